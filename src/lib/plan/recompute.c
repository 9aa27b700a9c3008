/*
 * recompute.c — whole-layer recompute plans (docs/DESIGN.md): which layers of a
 * stage are recomputed in backward, grouped into chunks whose input is saved.
 *
 *   uniform:N  chunk_start[l] = l - l % N                 (every layer)
 *   block:N    chunk_start[l] = l for l < N, -1 after     (first N layers)
 */
#include <stdlib.h>
#include <string.h>

#include "../core/context.h"

mst_status mst_recompute_parse(const char* spec, mst_recompute_config* out) {
    if (!spec) return mst_set_error(MST_ERR_INVALID, "recompute spec is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    MST_TRY(MST_CHECK_STRUCT("out", out, mst_recompute_config));
    if (strcmp(spec, "none") == 0) {
        *out = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_NONE, 0};
        return MST_OK;
    }
    const char* colon = strchr(spec, ':');
    size_t len = colon ? (size_t)(colon - spec) : strlen(spec);
    mst_recompute_method m;
    if (len == 7 && strncmp(spec, "uniform", 7) == 0) m = MST_RECOMPUTE_UNIFORM;
    else if (len == 5 && strncmp(spec, "block", 5) == 0) m = MST_RECOMPUTE_BLOCK;
    else
        return mst_set_error(MST_ERR_INVALID,
                             "recompute '%s': unknown method, expected none, uniform:N or block:N", spec);
    char* end = NULL;
    long n = colon ? strtol(colon + 1, &end, 10) : 0;
    if (!colon || end == colon + 1 || *end != '\0' || n < 1 || n > 1 << 20)
        return mst_set_error(MST_ERR_INVALID, "recompute '%s': N must be an integer >= 1", spec);
    *out = (mst_recompute_config){sizeof(mst_recompute_config), m, (int32_t)n};
    return MST_OK;
}

mst_status mst_recompute_plan(const mst_recompute_config* cfg, int32_t n_layers,
                              int32_t* chunk_start) {
    if (!cfg) return mst_set_error(MST_ERR_INVALID, "cfg is NULL");
    MST_TRY(MST_CHECK_STRUCT("cfg", cfg, mst_recompute_config));
    if (!chunk_start) return mst_set_error(MST_ERR_INVALID, "chunk_start is NULL");
    if (n_layers < 1) return mst_set_error(MST_ERR_INVALID, "n_layers = %d, must be >= 1", n_layers);
    if (cfg->method != MST_RECOMPUTE_NONE && (cfg->num_layers < 1 || cfg->num_layers > n_layers))
        return mst_set_error(MST_ERR_INVALID,
                             "recompute num_layers = %d, must be in [1, n_layers = %d]",
                             cfg->num_layers, n_layers);
    for (int32_t l = 0; l < n_layers; l++) {
        switch (cfg->method) {
        case MST_RECOMPUTE_NONE: chunk_start[l] = -1; break;
        case MST_RECOMPUTE_UNIFORM: chunk_start[l] = l - l % cfg->num_layers; break;
        case MST_RECOMPUTE_BLOCK: chunk_start[l] = l < cfg->num_layers ? l : -1; break;
        default: return mst_set_error(MST_ERR_INVALID, "recompute method = %d", (int)cfg->method);
        }
    }
    return MST_OK;
}
