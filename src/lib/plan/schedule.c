/*
 * schedule.c — pipeline schedules for one rank: the order of forward and
 * backward passes over (model chunk, microbatch).
 *
 *   plain        F(all) then B(all, last microbatch first)
 *   1F1B         w = min(S - r - 1, M) warm-up forwards, then pairs F, B,
 *                then w cool-down backwards
 *   interleaved  the same over M V virtual microbatches k, with
 *                w = min(2 (S - r - 1) + (V - 1) S, M V) and
 *                forward k -> chunk (k / S) % V, backward k -> chunk V-1 - (k / S) % V,
 *                both -> microbatch (k / (S V)) S + k % S
 */
#include <stdlib.h>
#include <string.h>

#include "../core/context.h"

const char* mst_schedule_kind_str(mst_schedule_kind k) {
    switch (k) {
    case MST_SCHEDULE_PLAIN: return "plain";
    case MST_SCHEDULE_1F1B: return "1f1b";
    case MST_SCHEDULE_INTERLEAVED: return "interleaved";
    }
    return "unknown";
}

mst_status mst_schedule_kind_parse(const char* s, mst_schedule_kind* out) {
    if (!s) return mst_set_error(MST_ERR_INVALID, "schedule is NULL");
    for (int k = MST_SCHEDULE_PLAIN; k <= MST_SCHEDULE_INTERLEAVED; k++)
        if (strcmp(s, mst_schedule_kind_str((mst_schedule_kind)k)) == 0) {
            *out = (mst_schedule_kind)k;
            return MST_OK;
        }
    return mst_set_error(MST_ERR_INVALID, "schedule '%s': expected plain, 1f1b or interleaved", s);
}

static mst_status check_config(const mst_schedule_config* c) {
    if (c->stages < 1) return mst_set_error(MST_ERR_INVALID, "stages = %d, must be >= 1", c->stages);
    if (c->rank < 0 || c->rank >= c->stages)
        return mst_set_error(MST_ERR_INVALID, "rank = %d, must be in [0, stages = %d)", c->rank,
                             c->stages);
    if (c->microbatches < 1)
        return mst_set_error(MST_ERR_INVALID, "microbatches = %d, must be >= 1", c->microbatches);
    if (c->virtual_stages < 1)
        return mst_set_error(MST_ERR_INVALID, "virtual_stages = %d, must be >= 1", c->virtual_stages);
    if (c->kind == MST_SCHEDULE_1F1B && c->virtual_stages != 1)
        return mst_set_error(MST_ERR_INVALID,
                             "virtual_stages = %d with schedule 1f1b: use interleaved", c->virtual_stages);
    if (c->kind == MST_SCHEDULE_INTERLEAVED) {
        if (c->virtual_stages < 2)
            return mst_set_error(MST_ERR_INVALID,
                                 "virtual_stages = %d with schedule interleaved: needs >= 2",
                                 c->virtual_stages);
        if (c->microbatches % c->stages != 0)
            return mst_set_error(MST_ERR_INVALID,
                                 "microbatches = %d with schedule interleaved: must be a multiple of "
                                 "stages = %d", c->microbatches, c->stages);
    }
    if (c->kind < MST_SCHEDULE_PLAIN || c->kind > MST_SCHEDULE_INTERLEAVED)
        return mst_set_error(MST_ERR_INVALID, "schedule kind = %d", (int)c->kind);
    return MST_OK;
}

/* The k-th forward (backward) virtual microbatch of a pipelined schedule. */
static mst_sched_entry virtual_entry(const mst_schedule_config* c, int32_t k, int32_t backward) {
    const int32_t S = c->stages, V = c->virtual_stages;
    int32_t chunk = (k / S) % V;
    mst_sched_entry e = {backward, backward ? V - 1 - chunk : chunk, (k / (S * V)) * S + k % S};
    return e;
}

static void make_plain(const mst_schedule_config* c, mst_sched_entry* out) {
    const int32_t M = c->microbatches, V = c->virtual_stages;
    int32_t n = 0;
    for (int32_t mb = 0; mb < M; mb++)
        for (int32_t ch = 0; ch < V; ch++) out[n++] = (mst_sched_entry){0, ch, mb};
    for (int32_t mb = M - 1; mb >= 0; mb--)
        for (int32_t ch = V - 1; ch >= 0; ch--) out[n++] = (mst_sched_entry){1, ch, mb};
}

static void make_pipelined(const mst_schedule_config* c, mst_sched_entry* out) {
    const int32_t S = c->stages, V = c->virtual_stages, total = c->microbatches * V;
    int32_t warm = V == 1 ? S - c->rank - 1 : 2 * (S - c->rank - 1) + (V - 1) * S;
    if (warm > total) warm = total;
    int32_t n = 0;
    for (int32_t k = 0; k < warm; k++) out[n++] = virtual_entry(c, k, 0);
    for (int32_t i = 0; i < total - warm; i++) {
        out[n++] = virtual_entry(c, warm + i, 0);
        out[n++] = virtual_entry(c, i, 1);
    }
    for (int32_t k = total - warm; k < total; k++) out[n++] = virtual_entry(c, k, 1);
}

mst_status mst_schedule_make(const mst_schedule_config* cfg, mst_sched_entry* out, int32_t n_out) {
    if (!cfg) return mst_set_error(MST_ERR_INVALID, "cfg is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    MST_TRY(MST_CHECK_STRUCT("cfg", cfg, mst_schedule_config));
    MST_TRY(check_config(cfg));
    int64_t n = 2 * (int64_t)cfg->microbatches * cfg->virtual_stages;
    if (n_out != n)
        return mst_set_error(MST_ERR_INVALID, "n_out = %d, the schedule has 2 M V = %lld entries",
                             n_out, (long long)n);
    if (cfg->kind == MST_SCHEDULE_PLAIN) make_plain(cfg, out);
    else make_pipelined(cfg, out);
    return MST_OK;
}

mst_status mst_schedule_sets(const mst_sched_entry* s, int32_t n, int32_t microbatches, int32_t* set_of,
                             int32_t* n_sets) {
    if (!s || !set_of || !n_sets) return mst_set_error(MST_ERR_INVALID, "s, set_of or n_sets is NULL");
    if (microbatches < 1) return mst_set_error(MST_ERR_INVALID, "microbatches = %d, must be >= 1", microbatches);
    int32_t* held = (int32_t*)calloc((size_t)microbatches * 2, sizeof(int32_t)); /* [M] set taken, [M] mb state */
    if (!held) return mst_set_error(MST_ERR_OOM, "schedule sets");
    int32_t* state = held + microbatches; /* 0 not started, 1 forward seen, 2 backward seen */
    mst_status st = MST_OK;
    *n_sets = 0;
    for (int32_t i = 0; i < n && st == MST_OK; i++) {
        const mst_sched_entry e = s[i];
        if (e.microbatch < 0 || e.microbatch >= microbatches)
            st = mst_set_error(MST_ERR_INVALID, "entry %d: microbatch %d not in [0, %d)", i, e.microbatch, microbatches);
        else if (e.chunk != 0)
            continue;
        else if (state[e.microbatch] != e.backward)
            st = mst_set_error(MST_ERR_INVALID, "entry %d: %s of chunk 0 of microbatch %d out of order", i,
                               e.backward ? "backward" : "forward", e.microbatch);
        else if (e.backward)
            held[set_of[e.microbatch]] = 0;
        else {
            int32_t k = 0;
            while (k < *n_sets && held[k]) k++;
            if (k == *n_sets) (*n_sets)++;
            held[k] = 1;
            set_of[e.microbatch] = k;
        }
        if (st == MST_OK && e.chunk == 0) state[e.microbatch]++;
    }
    for (int32_t mb = 0; mb < microbatches && st == MST_OK; mb++)
        if (state[mb] != 2) st = mst_set_error(MST_ERR_INVALID, "microbatch %d: no forward and backward of chunk 0", mb);
    free(held);
    return st;
}
