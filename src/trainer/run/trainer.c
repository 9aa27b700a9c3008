/*
 * trainer.c — the training loop (see trainer.h). A step (step.c): M
 * microbatches of forward + backward along the schedule (main_grad zeroed
 * first), clip + AdamW (skipped on the backend when the step's flag is set),
 * the record of flag and loss sums; eagerly, or replayed from its captured
 * graph (--graph on, from step cfg->graph_from). The host uploads the step's staged inputs, launches
 * it, stages the next step's batch while it runs, then reads the record
 * once. A step flagged over budget (a group got more rows than max_rows) is
 * rerun with exact shapes: every group sized to the largest group seen,
 * with its own memory manager, and the static buffers come back for the
 * next step. A step whose stash pool overflowed is rerun as a measuring
 * step, which resizes the pools. Reruns run eagerly; the step is captured
 * again after one.
 */
#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "trainer/io/checkpoint.h"
#include "trainer/plan/planner.h"
#include "trainer/io/plot.h"
#include "trainer.h"

/* The largest group of any layer so far (host read: the rerun path only). */
static mst_status exact_rows(mst_model* m, int64_t* rows) {
    const int64_t n = (int64_t)(m->cfg.layers + 1) * m->cfg.ep;
    int32_t* peak = (int32_t*)malloc(sizeof(int32_t) * (size_t)n);
    if (!peak) return mst_set_error(MST_ERR_OOM, "peak rows");
    mst_status st = mst_model_peak_rows(m, peak);
    *rows = 1;
    for (int64_t i = 0; i < n; i++) *rows = peak[i] > *rows ? peak[i] : *rows;
    free(peak);
    return st;
}

/* Starts step `step` on the uploaded inputs: the first eagerly as the
 * measuring step, the others replayed from the captured graph (--graph on)
 * or eagerly. */
static mst_status launch_step(mst_model* m, const mst_train_config* cfg, int64_t step, mst_train_result* res) {
    int32_t inject = step == cfg->force_over_budget ? MST_FLAG_COUNTS : 0;
    inject |= step == cfg->force_overflow ? MST_FLAG_OVERFLOW : 0;
    if (inject) MST_TRY(mst_copy_h2b(m->ctx, m->ctx->err_flag, &inject, sizeof inject));
    const int first = step == res->first_step; /* the measuring step: this run's first */
    if (first || !cfg->graph_from || step < cfg->graph_from) return mst_step_run(m, &cfg->optim, first);
    int captured = 0;
    MST_TRY(mst_step_replay(m, &cfg->optim, &captured));
    res->captures += captured;
    res->replays += m->graph != NULL;
    return MST_OK;
}

/* After a flagged step, its reruns (eager, on the same inputs), then its
 * record again. A step flagged over budget is rerun with exact shapes:
 * every group sized to the largest group seen, with a manager of its own; a
 * layer after an over-budget one saw other inputs, so its group may still
 * not fit the first exact size: rerun again (each rerun fixes at least one
 * more layer); the last attempt sizes groups for every token copy (N k
 * rows). A step whose stash pool overflowed is rerun as a measuring step,
 * which resizes the pools. The static buffers come back afterwards. */
static mst_status rerun(mst_model* m, const mst_train_config* cfg, mst_train_result* res, mst_step_record* r,
                        int eval) {
    mst_status st = mst_memmgr_step_check(m->mm);
    const int64_t all = m->cfg.batch * m->cfg.seq * m->cfg.top_k;
    for (int32_t attempt = 0; (st == MST_ERR_COUNTS || st == MST_ERR_OVERFLOW) && attempt <= m->cfg.layers + 1;
         attempt++) {
        res->reruns++;
        if (st == MST_ERR_COUNTS) {
            res->over_budget++;
            int64_t exact = all;
            if (attempt < m->cfg.layers + 1) MST_TRY(exact_rows(m, &exact));
            /* exact <= R only when the flag was forced: still a fresh
             * manager of its own, one row larger */
            MST_TRY(mst_model_set_max_rows(m, exact > m->max_rows ? exact : m->max_rows + 1));
        }
        MST_TRY(eval ? mst_step_eval(m, 1) : mst_step_run(m, &cfg->optim, 1));
        st = mst_memmgr_step_check(m->mm);
    }
    if (st != MST_OK) return st;
    MST_TRY(mst_step_read(m, r));
    return mst_model_set_max_rows(m, m->static_rows);
}

void mst_train_draw(const mst_model* m, mst_data* d, const mst_train_config* cfg, int32_t* tok) {
    const int64_t win = cfg->model.seq + 2, per = cfg->model.batch * win, W = m->dist.world;
    for (int32_t mb = 0; mb < cfg->microbatches; mb++) {
        int32_t* t = tok + mb * per * W; /* [W B, T+2] of scratch past this step's windows */
        mst_data_batch(d, cfg->model.batch * W, cfg->model.seq, W > 1 ? t : tok + mb * per);
        if (W > 1) memmove(tok + mb * per, t + m->dist.rank * per, sizeof(int32_t) * (size_t)per);
    }
}

/* Draws the next step's microbatches and stages them with its AdamW values. */
static mst_status stage_next(mst_model* m, mst_data* d, const mst_train_config* cfg, int32_t* tok, int64_t step) {
    mst_train_draw(m, d, cfg, tok);
    float hyper[MST_N_HYPER];
    mst_optim_hyper(&cfg->optim, step, hyper);
    return mst_model_stage(m, (int)((step - 1) & 1), tok, hyper);
}

/* One step (1-based) on staged inputs: upload, launch, stage the next step
 * while this one runs, read the record (rerun when it is flagged), losses. */
static mst_status one_step(mst_model* m, mst_data* d, const mst_train_config* cfg, int32_t* tok, int64_t step,
                           mst_train_result* res) {
    MST_TRY(mst_model_upload(m, (int)((step - 1) & 1)));
    MST_TRY(launch_step(m, cfg, step, res));
    if (step < cfg->steps) MST_TRY(stage_next(m, d, cfg, tok, step + 1));
    mst_step_record r;
    MST_TRY(mst_step_read(m, &r));
    if (r.flag) MST_TRY(rerun(m, cfg, res, &r, 0));
    const double MN = (double)(m->n_micro * m->cfg.batch * m->cfg.seq) * m->dist.world;
    res->loss[step - 1] = r.loss_main / MN;
    res->mtp_loss[step - 1] = r.loss_mtp / MN;
    res->aux_loss[step - 1] = r.aux / (double)m->n_micro;
    return MST_OK;
}

/* Held-out loss after `step`: eval_batches batches of the eval text (the
 * same windows every time), each a step's microbatches through forward and
 * backward without the optimizer, staged in the slot `step` used (free: the
 * next step's inputs wait in the other). Mean main loss per token. */
static mst_status evaluate(mst_model* m, mst_data* e, const mst_train_config* cfg, int32_t* tok, int64_t step,
                           mst_train_result* res, double* out) {
    const int32_t nb = cfg->eval_batches > 0 ? cfg->eval_batches : 8;
    const uint64_t rng = e->rng;
    const int slot = (int)((step - 1) & 1);
    float hyper[MST_N_HYPER];
    mst_optim_hyper(&cfg->optim, step, hyper);
    double sum = 0;
    for (int32_t b = 0; b < nb; b++) {
        mst_train_draw(m, e, cfg, tok);
        MST_TRY(mst_model_stage(m, slot, tok, hyper));
        MST_TRY(mst_model_upload(m, slot));
        MST_TRY(mst_step_eval(m, 0));
        mst_step_record r;
        MST_TRY(mst_step_read(m, &r));
        if (r.flag) MST_TRY(rerun(m, cfg, res, &r, 1));
        sum += r.loss_main;
    }
    e->rng = rng;
    *out = sum / ((double)nb * (double)(m->n_micro * m->cfg.batch * m->cfg.seq) * m->dist.world);
    return MST_OK;
}

/* DIR/step-N (or DIR/final) of the run after `step`; rng: the sampler's
 * state before the next step's batches were drawn. */
static mst_status save(mst_model* m, const mst_train_config* cfg, int64_t step, uint64_t rng, int final) {
    char dir[4200], rank[16] = "";
    if (m->dist.ep) snprintf(rank, sizeof rank, "/rank-%d", m->dist.rank); /* W ranks: a directory each */
    if (final) snprintf(dir, sizeof dir, "%s/final%s", cfg->save_dir, rank);
    else snprintf(dir, sizeof dir, "%s/step-%lld%s", cfg->save_dir, (long long)step, rank);
    return mst_ckpt_save(m, cfg, step, rng, dir);
}

/* --plot: the train loss every step, the eval loss where evaluated. */
static mst_status plot(const mst_train_config* cfg, const mst_train_result* r) {
    const int64_t n = r->steps - r->first_step + 1;
    double* x = (double*)malloc(sizeof(double) * (size_t)n * 3);
    if (!x) return mst_set_error(MST_ERR_OOM, "--plot");
    double *ex = x + n, *ey = x + 2 * n;
    int64_t ne = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = r->first_step + i;
        x[i] = (double)s;
        if (isfinite(r->eval_loss[s - 1])) ex[ne] = (double)s, ey[ne++] = r->eval_loss[s - 1];
    }
    mst_plot_series ser[] = {{"train loss", x, r->loss + r->first_step - 1, n}, {"eval loss (held out)", ex, ey, ne}};
    const mst_plot p = {"moestash train: next-byte loss", "step", "loss (nats per byte)", ser, ne ? 2 : 1, NULL, 0};
    mst_status st = mst_plot_lines(cfg->plot_path, &p);
    free(x);
    return st;
}

/* ---- --timeline: the memory of one step over time ------------------------------ */

typedef struct pages_seen {
    double* dev;   /* [n_sched + 1] device pages in live handles after each entry, bytes */
    double* host;  /* [n_sched + 1] host pages                                             */
} pages_seen;

static mst_status see_pages(mst_model* m, int32_t entry, void* user) {
    pages_seen* p = (pages_seen*)user;
    mst_mem_report_t r;
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
static mst_status timeline(mst_model* m, const mst_train_config* cfg, const mst_train_result* res) {
    pages_seen p = {(double*)calloc((size_t)m->n_sched + 1, sizeof(double)),
                    (double*)calloc((size_t)m->n_sched + 1, sizeof(double))};
    mst_status st = p.dev && p.host ? MST_OK : mst_set_error(MST_ERR_OOM, "--timeline");
    if (st == MST_OK) st = mst_model_upload(m, (int)((cfg->steps - 1) & 1));
    m->after_entry = see_pages, m->after_entry_user = &p;
    if (st == MST_OK) st = mst_step_eval(m, 0);
    m->after_entry = NULL;
    mst_step_record r;
    if (st == MST_OK) st = mst_step_read(m, &r);
    char keep[4200];
    const char* dot = strrchr(cfg->timeline_path, '.');
    const int stem = dot && strcmp(dot, ".svg") == 0 ? (int)(dot - cfg->timeline_path) : (int)strlen(cfg->timeline_path);
    snprintf(keep, sizeof keep, "%.*s-keep.svg", stem, cfg->timeline_path);
    char title[160];
    snprintf(title, sizeof title, "backend memory over one step: this run (policy %s)", cfg->mem.policy ? cfg->mem.policy : "keep");
    const int draws = m->dist.rank == 0; /* W ranks: every rank runs the step, rank 0 draws its own memory */
    if (st == MST_OK && draws)
        st = draw_timeline(cfg->timeline_path, title, m, res->mem.run, &p, (double)res->mem.run[MST_ROW_MLP_DEV_PAGES]);
    if (st == MST_OK && draws) st = draw_timeline(keep, "backend memory over one step: KEEP (static max_rows buffers)", m, res->mem.keep, NULL, 0);
    free(p.dev), free(p.host);
    return st;
}

/* ---- memory report ------------------------------------------------------------ */

static const char* const row_names[MST_N_ROWS] = {
    "weights (bf16)", "gradients (fp32 main_grad)", "optimizer (master, m, v)", "saved: attention",
    "saved: norms, residuals", "saved: router", "saved: embedding, head", "saved: MTP module",
    "recompute: shared rerun buffers", "saved: grouped MLP, kept", "saved: grouped MLP, stash pages",
    "saved: grouped MLP, offload (host)", "compute buffers", "op workspaces, context"};
const char* mst_mem_row_str(int row) { return row >= 0 && row < MST_N_ROWS ? row_names[row] : "?"; }

/* Bytes of one routed row of the grouped MLP's saved tensors (x, h, z bf16;
 * prob fp32) and of the shared grouped-rows compute buffers (y, dy, dx
 * bf16; dprob fp32). */
static size_t saved_row_bytes(const mst_model_config* c) { return (size_t)(c->hidden + 3 * c->ffn) * 2 + 4; }
static size_t compute_row_bytes(const mst_model_config* c) { return (size_t)c->hidden * 6 + 4; }

/* Over 8-byte words: a hash of weights of billions of bytes in seconds. */
uint64_t mst_fnv1a(uint64_t h, const void* p, size_t n) {
    const unsigned char* b = (const unsigned char*)p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001B3ull;
    }
    for (; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}

/* The hash of parameters [lo, hi): fp32 master, then bf16 weights,
 * continuing from *x. */
static mst_status hash_params(mst_model* m, int64_t lo, int64_t hi, uint64_t* x) {
    const size_t n = (size_t)(hi - lo);
    void* h = malloc(n * sizeof(float) + 1);
    if (!h) return mst_set_error(MST_ERR_OOM, "weights readback");
    mst_status st = mst_copy_b2h(m->ctx, h, m->master + lo, n * sizeof(float));
    if (st == MST_OK) *x = mst_fnv1a(*x, h, n * sizeof(float));
    if (st == MST_OK) st = mst_copy_b2h(m->ctx, h, m->w + lo, n * sizeof(uint16_t));
    if (st == MST_OK) *x = mst_fnv1a(*x, h, n * sizeof(uint16_t));
    free(h);
    return st;
}

/* Every parameter's hash; and the replicated ones' (all but the experts on
 * W ranks: the same bits on every rank). */
static mst_status weights_hash(mst_model* m, uint64_t* out, uint64_t* replicated) {
    *out = *replicated = MST_FNV1A_SEED;
    MST_TRY(hash_params(m, 0, m->n_params, out));
    MST_TRY(hash_params(m, 0, m->n_dense, replicated));
    return hash_params(m, m->n_decay, m->n_params, replicated);
}

/* W ranks: every rank's x in rank order into all [W] (each rank puts its
 * x into its slot of a zeroed vector; the sum over the ranks, by int32
 * halves of disjoint slots, has no carry: the vector of every rank's). */
static mst_status ranks_gather(mst_model* m, uint64_t x, uint64_t* all) {
    memset(all, 0, sizeof *all * (size_t)m->dist.world);
    all[m->dist.rank] = x;
    return mst_model_allreduce_host(m, all, 2 * (int64_t)m->dist.world, MST_EP_SUM_I32);
}

/* W ranks: the ranks' weight hashes in rank order, hashed. */
static mst_status ranks_hash(mst_model* m, uint64_t* h) {
    const int32_t W = m->dist.world;
    uint64_t* all = (uint64_t*)malloc(sizeof *all * (size_t)W);
    if (!all) return mst_set_error(MST_ERR_OOM, "ranks' hashes");
    mst_status st = ranks_gather(m, *h, all);
    if (st == MST_OK) *h = mst_fnv1a(MST_FNV1A_SEED, all, sizeof *all * (size_t)W);
    free(all);
    return st;
}

/* W ranks: each entry of the memory table, its max over the ranks. */
static mst_status ranks_max(mst_model* m, const mst_mem_table* t, mst_mem_table* out) {
    enum { N = 3 * MST_N_ROWS + 3 };
    double v[N];
    for (int k = 0; k < MST_N_ROWS; k++) v[k] = (double)t->run[k], v[MST_N_ROWS + k] = (double)t->keep[k],
                                         v[2 * MST_N_ROWS + k] = (double)t->exact[k];
    v[N - 3] = (double)t->dev_pages_peak, v[N - 2] = (double)t->host_pages_peak, v[N - 1] = (double)t->peak;
    mst_status st = mst_model_max_over_ranks(m, v, N);
    *out = *t;
    for (int k = 0; k < MST_N_ROWS; k++) out->run[k] = (size_t)v[k], out->keep[k] = (size_t)v[MST_N_ROWS + k],
                                         out->exact[k] = (size_t)v[2 * MST_N_ROWS + k];
    out->dev_pages_peak = (size_t)v[N - 3], out->host_pages_peak = (size_t)v[N - 2], out->peak = (size_t)v[N - 1];
    return st;
}

/* This rank's table (its groups: all G on one rank, its own on W ranks). */
static mst_status memory_table(mst_model* m, mst_train_result* res) {
    const mst_model_config* c = &m->cfg;
    const int64_t G = c->ep, L1 = c->layers + 1, R = m->static_rows, M = m->n_micro;
    const int64_t Gh = m->row_groups, g0 = m->dist.ep ? m->dist.rank : 0;
    res->peak_rows = (int32_t*)malloc(sizeof(int32_t) * (size_t)(L1 * G));
    if (!res->peak_rows) return mst_set_error(MST_ERR_OOM, "peak rows");
    MST_TRY(mst_model_peak_rows(m, res->peak_rows));
    MST_TRY(mst_mem_report(m->mm, &res->mem.manager));
    size_t exact_saved = 0, exact_rows_max = 0;
    for (int64_t l = 0; l < L1; l++) {
        size_t layer_rows = 0;
        for (int64_t g = g0; g < g0 + Gh; g++) layer_rows += (size_t)res->peak_rows[l * G + g];
        exact_saved += layer_rows * (size_t)M * saved_row_bytes(c);
        if (layer_rows > exact_rows_max) exact_rows_max = layer_rows;
    }
    mst_mem_table* t = &res->mem;
    const mst_mem_report_t* r = &t->manager;
    const size_t rows_compute = (size_t)(Gh * R) * compute_row_bytes(c);
    /* the model's own buffers: this run's, and with every layer keeping its
     * activations (KEEP; exact shapes alike: they do not depend on routing) */
    static const int rows[][2] = {{MST_ROW_WEIGHTS, MST_MEM_WEIGHTS}, {MST_ROW_GRADS, MST_MEM_GRADS},
                                  {MST_ROW_OPTIM, MST_MEM_OPTIM}, {MST_ROW_SAVED_ATTN, MST_MEM_SAVED_ATTN},
                                  {MST_ROW_SAVED_NORM, MST_MEM_SAVED_NORM}, {MST_ROW_SAVED_ROUTER, MST_MEM_SAVED_ROUTER},
                                  {MST_ROW_SAVED_HEAD, MST_MEM_SAVED_HEAD}, {MST_ROW_SAVED_MTP, MST_MEM_SAVED_MTP},
                                  {MST_ROW_RECOMPUTE, MST_MEM_RECOMPUTE}};
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        t->run[rows[k][0]] = m->mem[rows[k][1]];
        t->keep[rows[k][0]] = t->exact[rows[k][0]] = k < 3 ? m->mem[rows[k][1]] : m->mem_keep[rows[k][1]];
    }
    t->run[MST_ROW_MLP_KEPT] = r->kept_bytes;
    t->keep[MST_ROW_MLP_KEPT] = (size_t)(L1 * M * Gh * R) * saved_row_bytes(c);
    t->exact[MST_ROW_MLP_KEPT] = exact_saved;
    t->run[MST_ROW_MLP_DEV_PAGES] = r->dev_pages_bytes;
    t->run[MST_ROW_MLP_HOST_PAGES] = r->host_pages_bytes;
    t->dev_pages_peak = r->dev_pages_peak_bytes;
    t->host_pages_peak = r->host_pages_peak_bytes;
    t->run[MST_ROW_COMPUTE] = m->mem[MST_MEM_COMPUTE] + r->compute_bytes;
    t->keep[MST_ROW_COMPUTE] = m->mem[MST_MEM_COMPUTE];
    t->exact[MST_ROW_COMPUTE] = m->mem[MST_MEM_COMPUTE] - rows_compute + exact_rows_max * compute_row_bytes(c);
    size_t in_use = 0, known = 0;
    mst_ctx_mem(m->ctx, &in_use, &t->peak);
    for (int k = 0; k < MST_ROW_OTHER; k++)
        if (k != MST_ROW_MLP_HOST_PAGES) known += t->run[k];
    t->run[MST_ROW_OTHER] = t->keep[MST_ROW_OTHER] = t->exact[MST_ROW_OTHER] = in_use > known ? in_use - known : 0;
    res->max_rows = R;
    res->n_layers = L1;
    res->n_groups = G;
    res->world = m->dist.world;
    res->mem_max = *t;
    MST_TRY(weights_hash(m, &res->weights_hash, &res->replicated_hash));
    if (!m->dist.ep) return MST_OK;
    MST_TRY(ranks_max(m, t, &res->mem_max));
    res->rank_peak = (uint64_t*)malloc(sizeof *res->rank_peak * (size_t)m->dist.world);
    if (!res->rank_peak) return mst_set_error(MST_ERR_OOM, "ranks' peaks");
    MST_TRY(ranks_gather(m, t->peak, res->rank_peak));
    return ranks_hash(m, &res->weights_hash);
}

/* ---- the loop ------------------------------------------------------------------ */

static mst_status load_data(const mst_train_config* cfg, mst_data* d) {
    if (!cfg->data_path) return mst_data_synthetic(d, cfg->model.seed, 1 << 20);
    return mst_data_file(d, cfg->data_path, cfg->model.seq + 2, cfg->model.seed);
}

static mst_status alloc_result(mst_train_result* res, int64_t steps) {
    memset(res, 0, sizeof *res);
    res->steps = steps;
    res->first_step = 1;
    res->eval_loss = (double*)malloc(sizeof(double) * (size_t)steps);
    for (int64_t i = 0; res->eval_loss && i < steps; i++) res->eval_loss[i] = NAN;
    res->loss = (double*)calloc((size_t)steps, sizeof(double));
    res->mtp_loss = (double*)calloc((size_t)steps, sizeof(double));
    res->aux_loss = (double*)calloc((size_t)steps, sizeof(double));
    res->tok_per_s = (double*)calloc((size_t)steps, sizeof(double));
    if (!res->loss || !res->mtp_loss || !res->aux_loss || !res->tok_per_s || !res->eval_loss)
        return mst_set_error(MST_ERR_OOM, "result arrays for %lld steps", (long long)steps);
    return MST_OK;
}

/* W ranks: the step's all-reduce of the replicated gradients timed apart,
 * eager, 5 times after the run (on the last step's gradients, which nothing
 * reads again: the checkpoint and the memory table are taken). */
static mst_status time_allreduce(mst_model* m, mst_train_result* res) {
    if (!m->dist.ep) return MST_OK;
    enum { TIMES = 5 };
    MST_TRY(mst_step_share_grads(m)); /* NCCL's first call of a size sets up */
    MST_TRY(mst_ctx_sync(m->ctx));
    const double t0 = mst_clock_s();
    for (int i = 0; i < TIMES; i++) MST_TRY(mst_step_share_grads(m));
    MST_TRY(mst_ctx_sync(m->ctx));
    res->allreduce_ms = (mst_clock_s() - t0) * 1e3 / TIMES;
    res->allreduce_bytes = sizeof(float) * (size_t)mst_step_shared_grads(m);
    return MST_OK;
}

static mst_status train_loop(mst_model* m, mst_data* d, mst_data* e, const mst_train_config* cfg, FILE* progress,
                             mst_train_result* res) {
    const int64_t per = cfg->model.batch * (cfg->model.seq + 2) * m->dist.world; /* the global batch's */
    const double tokens = (double)(cfg->model.batch * cfg->model.seq * cfg->microbatches) * m->dist.world;
    const int64_t every = cfg->log_every > 0 ? cfg->log_every : 1;
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)(per * cfg->microbatches));
    if (!tok) return mst_set_error(MST_ERR_OOM, "token batch");
    const double t0 = mst_clock_s();
    mst_status st = stage_next(m, d, cfg, tok, res->first_step);
    uint64_t rng = d->rng; /* the sampler before the next step's batches */
    for (int64_t i = res->first_step - 1; i < cfg->steps && st == MST_OK; i++) {
        double ts = mst_clock_s();
        rng = d->rng;
        st = one_step(m, d, cfg, tok, i + 1, res);
        if (st != MST_OK) break;
        res->tok_per_s[i] = tokens / (mst_clock_s() - ts);
        if (e && ((cfg->eval_every > 0 && (i + 1) % cfg->eval_every == 0) || i + 1 == cfg->steps))
            st = evaluate(m, e, cfg, tok, i + 1, res, &res->eval_loss[i]);
        if (st == MST_OK && cfg->save_dir && cfg->save_every > 0 && (i + 1) % cfg->save_every == 0)
            st = save(m, cfg, i + 1, rng, 0);
        size_t in_use = 0;
        mst_ctx_mem(m->ctx, &in_use, NULL);
        if (st == MST_OK && progress && ((i + 1) % every == 0 || i + 1 == cfg->steps || isfinite(res->eval_loss[i]))) {
            fprintf(progress, "step %5lld | loss %.4f | mtp %.4f | aux %.4f | lr %.2e | %8.0f tok/s | mem %.1f MiB | reruns %lld | graph %lld",
                    (long long)(i + 1), res->loss[i], res->mtp_loss[i], res->aux_loss[i],
                    (double)mst_optim_lr(&cfg->optim, i + 1), res->tok_per_s[i],
                    (double)in_use / (1 << 20), (long long)res->reruns, (long long)res->captures);
            if (isfinite(res->eval_loss[i]))
                fprintf(progress, " | eval %.4f (%.3f bits/byte)", res->eval_loss[i], res->eval_loss[i] / log(2.0));
            fprintf(progress, "\n");
            fflush(progress);
        }
    }
    res->seconds = mst_clock_s() - t0;
    free(tok);
    if (st == MST_OK && cfg->save_dir) st = save(m, cfg, cfg->steps, rng, 1);
    if (st == MST_OK && cfg->plot_path && m->dist.rank == 0) st = plot(cfg, res); /* W ranks: the same curves */
    if (st == MST_OK) st = mst_memmgr_check(m->mm);
    if (st == MST_OK) st = memory_table(m, res);
    if (st == MST_OK && cfg->timeline_path) st = timeline(m, cfg, res);
    if (st == MST_OK) st = time_allreduce(m, res);
    return st;
}

/* --resume: the checkpoint must be of this run's configuration; its
 * tensors go into m, its sampler state into d, and the run goes on after
 * its step. */
static mst_status resume(mst_model* m, const mst_train_config* cfg, mst_data* d, mst_train_result* res) {
    mst_ckpt_meta meta;
    const int32_t W = m->dist.ep ? m->dist.world : 1;
    char dir[4200];
    if (W > 1) snprintf(dir, sizeof dir, "%s/rank-%d", cfg->resume_dir, m->dist.rank);
    else snprintf(dir, sizeof dir, "%s", cfg->resume_dir);
    MST_TRY(mst_ckpt_read_meta(dir, &meta));
    MST_TRY(mst_ckpt_check_ranks(&meta, cfg->resume_dir, W));
    if (memcmp(&meta.cfg.model, &cfg->model, sizeof cfg->model) != 0 || meta.cfg.microbatches != cfg->microbatches ||
        meta.cfg.eval_fraction != cfg->eval_fraction)
        return mst_set_error(MST_ERR_INVALID, "--resume '%s': the checkpoint is of another configuration (model, "
                             "microbatches or held-out fraction)", cfg->resume_dir);
    if (meta.step >= cfg->steps)
        return mst_set_error(MST_ERR_INVALID, "--resume '%s': the checkpoint is at step %lld, --steps %lld leaves "
                             "nothing to do", cfg->resume_dir, (long long)meta.step, (long long)cfg->steps);
    MST_TRY(mst_ckpt_load(m, dir));
    d->rng = meta.data_rng;
    res->first_step = meta.step + 1;
    return MST_OK;
}

/* --memory-budget: the probe and the plan (res->plan); *cfg becomes
 * `planned`, a copy with the plan's memory configuration. */
static mst_status plan_budget(mst_ctx_t* ctx, const mst_train_config** cfg, mst_train_config* planned, mst_data* d,
                              mst_train_result* res) {
    res->plan = (mst_plan_report*)calloc(1, sizeof *res->plan);
    if (!res->plan) return mst_set_error(MST_ERR_OOM, "memory plan");
    MST_TRY(mst_plan_budget(ctx, *cfg, d, res->plan));
    *planned = **cfg;
    mst_plan_apply(res->plan, planned);
    *cfg = planned;
    return MST_OK;
}

mst_status mst_train_run(mst_ctx_t* ctx, const mst_train_config* cfg, FILE* progress,
                         mst_train_result* res) {
    if (cfg->steps < 1) return mst_set_error(MST_ERR_INVALID, "--steps %lld: expected >= 1", (long long)cfg->steps);
    MST_TRY(mst_model_config_check(&cfg->model));
    MST_TRY(alloc_result(res, cfg->steps));
    mst_data d, e = {0};
    MST_TRY(load_data(cfg, &d));
    mst_status st = MST_OK;
    if (cfg->eval_path) st = mst_data_file(&e, cfg->eval_path, cfg->model.seq + 2, cfg->model.seed ^ 0xE7A1ull);
    else if (cfg->eval_fraction > 0) st = mst_data_split(&d, cfg->eval_fraction, cfg->model.seq + 2, &e);
    mst_train_config planned;
    if (st == MST_OK && cfg->memory_budget) st = plan_budget(ctx, &cfg, &planned, &d, res);
    mst_ctx_mem_reset_peak(ctx); /* this run's peak */
    mst_model* m = NULL;
    if (st == MST_OK) st = mst_model_create_dist(ctx, &cfg->model, cfg->microbatches, &cfg->mem, &cfg->dist, &m);
    if (st == MST_OK && cfg->resume_dir) st = resume(m, cfg, &d, res);
    if (st == MST_OK) st = train_loop(m, &d, e.bytes ? &e : NULL, cfg, progress, res);
    mst_model_destroy(m);
    mst_data_free(&d);
    mst_data_free(&e);
    return st;
}

void mst_train_result_free(mst_train_result* res) {
    free(res->loss);
    free(res->mtp_loss);
    free(res->aux_loss);
    free(res->tok_per_s);
    free(res->eval_loss);
    free(res->peak_rows);
    free(res->rank_peak);
    mst_plan_report_free(res->plan);
    free(res->plan);
    memset(res, 0, sizeof *res);
}

/* ---- --check-policies ------------------------------------------------------------ */

static void json_array(FILE* f, const char* name, const double* v, int64_t first, int64_t n);

/* One run of --check-policies in the JSON document (label without padding). */
static void json_run(FILE* f, int i, const char* label, const mst_train_result* r, const char* verdict) {
    fprintf(f, "%s    {\"run\": \"", i ? ",\n" : "");
    for (const char* c = label; *c; c++) /* runs of spaces as one; none at the end */
        if (*c != ' ' || (c > label && c[-1] != ' ' && c[1] && c[strspn(c, " ")])) fputc(*c, f);
    fprintf(f, "\",\n");
    json_array(f, "loss", r->loss, r->first_step, r->steps);
    json_array(f, "mtp_loss", r->mtp_loss, r->first_step, r->steps);
    fprintf(f, "     \"weights_hash\": \"%016llx\", \"reruns\": %lld, \"verdict\": \"%s\"}", (unsigned long long)r->weights_hash,
            (long long)r->reruns, verdict);
}

mst_status mst_train_compare(mst_ctx_t* ctx, const mst_train_config* runs, const char* const* labels, int n,
                             FILE* out, FILE* json) {
    mst_train_result base = {0};
    int bad = 0;
    mst_status st = MST_OK;
    if (json) fprintf(json, "{\n  \"check_policies\": [\n");
    for (int i = 0; i < n && st == MST_OK; i++) {
        mst_train_result r = {0};
        st = mst_train_run(ctx, &runs[i], NULL, &r);
        if (st != MST_OK) {
            if (out) fprintf(out, "check-policies: %s FAILED: %s\n", labels[i], mst_last_error());
            mst_train_result_free(&r);
            break;
        }
        int same = i == 0 || (r.weights_hash == base.weights_hash &&
                              memcmp(r.loss, base.loss, sizeof(double) * (size_t)r.steps) == 0 &&
                              memcmp(r.mtp_loss, base.mtp_loss, sizeof(double) * (size_t)r.steps) == 0);
        bad |= !same;
        if (out)
            fprintf(out, "check-policies: %s loss %.6f, weights %016llx, reruns %lld: %s\n", labels[i],
                r.loss[r.steps - 1], (unsigned long long)r.weights_hash, (long long)r.reruns,
                i == 0 ? "reference" : same ? "bit-identical" : "DIFFERS");
        if (json) json_run(json, i, labels[i], &r, i == 0 ? "reference" : same ? "bit-identical" : "DIFFERS");
        if (i == 0) base = r;
        else mst_train_result_free(&r);
    }
    mst_train_result_free(&base);
    if (json) fprintf(json, "\n  ],\n  \"all_bit_identical\": %s\n}\n", st == MST_OK && !bad ? "true" : "false");
    if (st != MST_OK) return st;
    return bad ? mst_set_error(MST_ERR_STATE, "a run changed the losses or the final weights") : MST_OK;
}

mst_status mst_train_check_policies(mst_ctx_t* ctx, const mst_train_config* cfg, FILE* out, FILE* json) {
    static const struct { const char* policy; const char* recompute; } runs[] = {
        {"keep", "none"}, {"stash", "none"}, {"offload", "none"}, {"recompute", "none"},
        {"fc1_input=stash,act_input=offload,fc2_input=recompute,probs=keep", "none"},
        {"keep", "uniform:1"}, {"stash", "block:1"},
    };
    enum { N = sizeof runs / sizeof *runs };
    mst_train_config c[N];
    char label[N][96];
    const char* labels[N];
    for (int i = 0; i < N; i++) {
        c[i] = *cfg;
        c[i].mem.policy = runs[i].policy;
        MST_TRY(mst_recompute_parse(runs[i].recompute, &c[i].mem.recompute));
        snprintf(label[i], sizeof label[i], "%-66s --recompute %-9s", runs[i].policy, runs[i].recompute);
        labels[i] = label[i];
    }
    mst_status st = mst_train_compare(ctx, c, labels, N, out, json);
    return st == MST_ERR_STATE ? mst_set_error(st, "a policy changed the losses or the final weights") : st;
}

/* ---- output -------------------------------------------------------------------- */

static double mib(size_t b) { return (double)b / (1 << 20); }

/* One table: t's rows and totals. */
static void print_table(FILE* f, const char* title, const mst_mem_table* t) {
    size_t tot[3] = {0, 0, 0};
    fprintf(f, "\n%-37s this run   KEEP, static max_rows   exact shapes\n", title);
    for (int k = 0; k < MST_N_ROWS; k++) {
        fprintf(f, "  %-34s %10.2f   %21.2f   %12.2f", mst_mem_row_str(k), mib(t->run[k]), mib(t->keep[k]),
                mib(t->exact[k]));
        if (k == MST_ROW_MLP_DEV_PAGES && t->run[k]) fprintf(f, "   (peak in use %.2f)", mib(t->dev_pages_peak));
        if (k == MST_ROW_MLP_HOST_PAGES && t->run[k]) fprintf(f, "   (peak in use %.2f; not in total)", mib(t->host_pages_peak));
        fprintf(f, "\n");
        if (k == MST_ROW_MLP_HOST_PAGES) continue;
        tot[0] += t->run[k];
        tot[1] += t->keep[k];
        tot[2] += t->exact[k];
    }
    fprintf(f, "  %-34s %10.2f   %21.2f   %12.2f\n", "total", mib(tot[0]), mib(tot[1]), mib(tot[2]));
}

void mst_train_print_memory(FILE* f, const mst_train_result* r) {
    const mst_mem_table* t = &r->mem;
    char title[64];
    if (r->world > 1) snprintf(title, sizeof title, "memory (MiB), rank 0 of %d", (int)r->world);
    print_table(f, r->world > 1 ? title : "memory (MiB)", t);
    if (r->world > 1) print_table(f, "memory (MiB), max over the ranks", &r->mem_max);
    if (t->manager.recompute_bytes)
        fprintf(f, "  not saved (recomputed in backward): %.2f MiB of KEEP buffers\n", mib(t->manager.recompute_bytes));
    fprintf(f, "  max_rows %lld per group; peak rows per group over the run, by layer:", (long long)r->max_rows);
    const int64_t G = r->n_groups;
    for (int64_t i = 0; r->peak_rows && i < r->n_layers * G; i++)
        fprintf(f, "%s%d%s", i % G ? " " : " [", r->peak_rows[i], i % G == G - 1 ? "]" : "");
    fprintf(f, "\n  backend peak %.2f MiB; reruns %lld (over budget %lld, overflow %lld); step graph: %lld captures, "
               "%lld replays\n", mib(t->peak), (long long)r->reruns, (long long)r->over_budget,
            (long long)(r->reruns - r->over_budget), (long long)r->captures, (long long)r->replays);
    if (r->world > 1)
        fprintf(f, "  replicated gradients: %.2f MiB fp32 all-reduced a step after the backward, %.3f ms alone "
                   "(rank 0, timed after the run)\n", mib(r->allreduce_bytes), r->allreduce_ms);
}

/* Values of the steps this run made (from its first); null where not finite. */
static void json_array(FILE* f, const char* name, const double* v, int64_t first, int64_t n) {
    fprintf(f, "  \"%s\": [", name);
    for (int64_t i = first - 1; i < n; i++) {
        fprintf(f, i >= first ? ", " : "");
        if (isfinite(v[i])) fprintf(f, "%.9g", v[i]);
        else fprintf(f, "null");
    }
    fprintf(f, "],\n");
}

/* s as a JSON string: quotes, backslashes and control bytes escaped. */
static void json_string(FILE* f, const char* s) {
    fputc('"', f);
    for (const unsigned char* p = (const unsigned char*)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

static void json_mem(FILE* f, const char* name, const size_t* v) {
    fprintf(f, "    \"%s\": {", name);
    for (int k = 0; k < MST_N_ROWS; k++) fprintf(f, "%s\"%s\": %zu", k ? ", " : "", mst_mem_row_str(k), v[k]);
    fprintf(f, "},\n");
}

mst_status mst_train_write_json(const char* path, const mst_train_config* cfg,
                                const mst_train_result* r, const char* device) {
    FILE* f = fopen(path, "w");
    if (!f) return mst_set_error(MST_ERR_IO, "--json '%s': cannot open for writing", path);
    const mst_model_config* c = &cfg->model;
    static const char* const recompute[] = {"none", "uniform", "block"};
    char rec[32] = "none";
    if (cfg->mem.recompute.method != MST_RECOMPUTE_NONE)
        snprintf(rec, sizeof rec, "%s:%d", recompute[cfg->mem.recompute.method], cfg->mem.recompute.num_layers);
    fprintf(f, "{\n  \"device\": ");
    json_string(f, device);
    fprintf(f, ",\n  \"config\": {\"hidden\": %lld, \"ffn\": %lld, \"heads\": %lld, \"seq\": %lld, "
               "\"batch\": %lld, \"layers\": %d, \"experts\": %d, \"top_k\": %d, \"ep\": %d, "
               "\"capacity_factor\": %g, \"microbatches\": %d, \"schedule\": \"%s\", \"policy\": ",
            (long long)c->hidden, (long long)c->ffn, (long long)c->n_head, (long long)c->seq,
            (long long)c->batch, c->layers, c->experts, c->top_k, c->ep, (double)c->capacity_factor,
            cfg->microbatches, mst_schedule_kind_str(cfg->mem.schedule));
    json_string(f, cfg->memory_budget ? "planned" : cfg->mem.policy ? cfg->mem.policy : "keep");
    fprintf(f, ", \"recompute\": \"%s\", \"mtp_weight\": %g, \"steps\": %lld, \"lr\": %g, \"seed\": %llu, \"data\": ",
            rec, (double)c->mtp_weight, (long long)cfg->steps, (double)cfg->optim.lr, (unsigned long long)c->seed);
    if (cfg->data_path) json_string(f, cfg->data_path);
    else fprintf(f, "\"synthetic\"");
    fprintf(f, "},\n");
    fprintf(f, "  \"first_step\": %lld,\n  \"ranks\": %d,\n", (long long)r->first_step, r->world > 1 ? (int)r->world : 1);
    json_array(f, "loss", r->loss, r->first_step, r->steps);
    json_array(f, "mtp_loss", r->mtp_loss, r->first_step, r->steps);
    json_array(f, "aux_loss", r->aux_loss, r->first_step, r->steps);
    json_array(f, "tokens_per_s", r->tok_per_s, r->first_step, r->steps);
    json_array(f, "eval_loss", r->eval_loss, r->first_step, r->steps);
    const double last_eval = r->eval_loss[r->steps - 1];
    if (isfinite(last_eval))
        fprintf(f, "  \"eval\": {\"loss\": %.9g, \"bits_per_byte\": %.9g},\n", last_eval, last_eval / log(2.0));
    fprintf(f, "  \"graph_from_step\": %lld,\n  \"captures\": %lld,\n  \"replays\": %lld,\n", (long long)cfg->graph_from,
            (long long)r->captures, (long long)r->replays);
    fprintf(f, "  \"reruns\": %lld,\n  \"over_budget_reruns\": %lld,\n  \"seconds\": %.3f,\n  \"max_rows\": %lld,\n"
               "  \"weights_hash\": \"%016llx\",\n  \"peak_rows\": [",
            (long long)r->reruns, (long long)r->over_budget, r->seconds, (long long)r->max_rows,
            (unsigned long long)r->weights_hash);
    for (int64_t i = 0; i < (int64_t)(c->layers + 1) * c->ep; i++)
        fprintf(f, "%s%d", i ? ", " : "", r->peak_rows ? r->peak_rows[i] : 0);
    fprintf(f, "],\n");
    if (r->plan) mst_plan_json(f, r->plan, r, cfg);
    if (r->world > 1) /* the replicated gradients' all-reduce, timed alone */
        fprintf(f, "  \"allreduce\": {\"bytes\": %zu, \"ms\": %.4f},\n", r->allreduce_bytes, r->allreduce_ms);
    fprintf(f, "  \"memory_bytes\": {\n");
    json_mem(f, "run", r->mem.run);
    json_mem(f, "keep_static", r->mem.keep);
    json_mem(f, "exact_shapes", r->mem.exact);
    if (r->world > 1) { /* each entry's max over the ranks */
        json_mem(f, "run_max_over_ranks", r->mem_max.run);
        fprintf(f, "    \"backend_peak_max_over_ranks\": %zu,\n", r->mem_max.peak);
    }
    const mst_mem_report_t* q = &r->mem.manager;
    fprintf(f, "    \"dev_pages_peak\": %zu,\n    \"host_pages_peak\": %zu,\n    \"backend_peak\": %zu,\n",
            r->mem.dev_pages_peak, r->mem.host_pages_peak, r->mem.peak);
    fprintf(f, "    \"manager\": {\"kept\": %zu, \"compute\": %zu, \"dev_pages\": %zu, \"host_pages\": %zu, "
               "\"recompute_not_saved\": %zu, \"static_keep\": %zu, \"exact_measured\": %zu, \"overflows\": %d, "
               "\"reruns\": %d}\n  }\n}\n",
            q->kept_bytes, q->compute_bytes, q->dev_pages_bytes, q->host_pages_bytes, q->recompute_bytes,
            q->static_keep_bytes, q->exact_bytes, q->overflows, q->reruns);
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    return bad ? mst_set_error(MST_ERR_IO, "--json '%s': write failed", path) : MST_OK;
}
