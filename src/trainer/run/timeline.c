/*
 * timeline.c — `train --timeline`: the backend memory of one step drawn
 * over its schedule entries (this run, and KEEP with static buffers), the
 * stash pages in use read after every entry.
 */
#include <string.h>

#include "lib/internal.h"
#include "trainer/io/plot.h"
#include "report.h"

/* ---- --timeline: the memory of one step over time ------------------------------ */

typedef struct pages_seen {
    double* dev;   /* [n_sched + 1] device pages in live handles after each entry, bytes */
    double* host;  /* [n_sched + 1] host pages                                             */
} pages_seen;

static mst_status see_pages(mst_model* m, int32_t entry, void* user) {
    pages_seen* p = (pages_seen*)user;
    mst_mem_report_t r = MST_MEM_REPORT_INIT;
    MST_TRY(mst_ctx_sync(m->ctx));
    MST_TRY(mst_mem_report(m->mm, &r));
    p->dev[entry + 1] = (double)r.dev_pages_used_bytes;
    p->host[entry + 1] = (double)r.host_pages_used_bytes;
    return MST_OK;
}

enum { TL_FLAT = 12, TL_SERIES = TL_FLAT + 3 };

/* One picture: the flat rows of column col (MiB), then the pages. */
static mst_status draw_timeline(const char* path, const char* title, const mst_model* m, const size_t* col,
                                const pages_seen* p, double reserved) {
    const int32_t n = m->n_sched + 1;
    static const int rows[TL_FLAT] = {MST_ROW_WEIGHTS, MST_ROW_GRADS, MST_ROW_OPTIM, MST_ROW_COMPUTE, MST_ROW_OTHER,
                                      MST_ROW_SAVED_HEAD, MST_ROW_SAVED_ATTN, MST_ROW_SAVED_NORM, MST_ROW_SAVED_ROUTER,
                                      MST_ROW_SAVED_MTP, MST_ROW_RECOMPUTE, MST_ROW_MLP_KEPT};
    double* v = (double*)calloc((size_t)n * (TL_SERIES + 1), sizeof(double));
    mst_plot_mark* mk = (mst_plot_mark*)calloc((size_t)n, sizeof *mk);
    char(*lab)[24] = (char(*)[24])calloc((size_t)n, 24);
    if (!v || !mk || !lab) {
        free(v), free(mk), free(lab);
        return mst_set_error(MST_ERR_OOM, "--timeline");
    }
    double* x = v + (size_t)n * TL_SERIES;
    mst_plot_series s[TL_SERIES];
    const double MiB = 1 << 20;
    for (int k = 0; k < TL_SERIES; k++) s[k] = (mst_plot_series){NULL, x, v + (size_t)k * n, n};
    for (int k = 0; k < TL_FLAT; k++) s[k].name = mst_mem_row_str(rows[k]);
    s[TL_FLAT].name = "saved: grouped MLP, pages in use";
    s[TL_FLAT + 1].name = "grouped MLP pages reserved, free";
    s[TL_FLAT + 2].name = "pinned host pages in use (not device)";
    for (int32_t i = 0; i < n; i++) {
        x[i] = i;
        for (int k = 0; k < TL_FLAT; k++) v[(size_t)k * n + i] = (double)col[rows[k]] / MiB;
        const double dev = p ? p->dev[i] : 0;
        v[(size_t)TL_FLAT * n + i] = dev / MiB;
        v[(size_t)(TL_FLAT + 1) * n + i] = (reserved > dev ? reserved - dev : 0) / MiB;
        v[(size_t)(TL_FLAT + 2) * n + i] = p ? p->host[i] / MiB : 0;
        if (i == 0) continue;
        const mst_sched_entry e = m->sched[i - 1];
        snprintf(lab[i], 24, m->mem_cfg.virtual_stages > 1 ? "%c%d.%d" : "%c%d", e.backward ? 'B' : 'F', e.microbatch, e.chunk);
        mk[i - 1] = (mst_plot_mark){i - 0.5, lab[i]};
    }
    const mst_plot pl = {title, "schedule entries of one step (F: forward, B: backward of microbatch)", "MiB", s,
                         TL_SERIES, mk, n - 1};
    mst_status st = mst_plot_stacked(path, &pl);
    free(v), free(mk), free(lab);
    return st;
}

/* One more step's passes (no optimizer) with the pages in use read after
 * every schedule entry; this run's picture and KEEP's (static buffers). */
mst_status mst_train_timeline(mst_model* m, const mst_train_config* cfg, const mst_train_result* res) {
    pages_seen p = {(double*)calloc((size_t)m->n_sched + 1, sizeof(double)),
                    (double*)calloc((size_t)m->n_sched + 1, sizeof(double))};
    mst_status st = p.dev && p.host ? MST_OK : mst_set_error(MST_ERR_OOM, "--timeline");
    if (st == MST_OK) st = mst_model_upload(m, (int)((cfg->steps - 1) & 1));
    m->after_entry = see_pages, m->after_entry_user = &p;
    if (st == MST_OK) st = mst_step_eval(m, 0);
    m->after_entry = NULL;
    mst_step_record r;
    if (st == MST_OK) st = mst_step_read(m, &r);
    /* P stages: stage s > 0 draws FILE-stageS.svg (and FILE-stageS-keep.svg) */
    char path[4200], keep[4200], stage[32] = "", of[48] = "";
    const char* dot = strrchr(cfg->timeline_path, '.');
    const int stem = dot && strcmp(dot, ".svg") == 0 ? (int)(dot - cfg->timeline_path) : (int)strlen(cfg->timeline_path);
    if (m->stages > 1) snprintf(of, sizeof of, ", stage %d of %d", m->stage, m->stages);
    if (m->stage > 0) snprintf(stage, sizeof stage, "-stage%d", m->stage);
    if (m->stage == 0) snprintf(path, sizeof path, "%s", cfg->timeline_path);
    else snprintf(path, sizeof path, "%.*s%s.svg", stem, cfg->timeline_path, stage);
    snprintf(keep, sizeof keep, "%.*s%s-keep.svg", stem, cfg->timeline_path, stage);
    char title[200], keep_title[200], policy[MST_POLICY_SPEC_MAX] = "?";
    mst_policy_spec_format(cfg->mem.policy.name, policy, sizeof policy);
    snprintf(title, sizeof title, "backend memory over one step: this run (policy %s%s)",
             cfg->mem.policy.per_layer ? "planned" : policy, of);
    snprintf(keep_title, sizeof keep_title, "backend memory over one step: KEEP (static max_rows buffers%s)", of);
    /* W ranks: every rank runs the step, data-parallel rank 0 of each stage draws its own memory */
    const int draws = m->dist.rank == 0;
    if (st == MST_OK && draws) st = draw_timeline(path, title, m, res->mem.run, &p, (double)res->mem.run[MST_ROW_MLP_DEV_PAGES]);
    if (st == MST_OK && draws) st = draw_timeline(keep, keep_title, m, res->mem.keep, NULL, 0);
    free(p.dev), free(p.host);
    return st;
}

