/*
 * planner.c — the probe, the costs and the plan of `--memory-budget` (see
 * planner.h); their report is plan_report.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/internal.h"
#include "planner.h"

static double mib(size_t b) { return (double)b / (1 << 20); }

/* The probe: the run's model with every saved tensor stashed (pages for
 * the microbatches in flight only) but z, which is recomputed (so the
 * grouped MLP's workspace for it is made now: workspaces are the context's
 * and stay, a part of every later peak), no layer recompute. */
static const mst_policies probe_policy = {.name = {[MST_SAVED_FC1_INPUT] = MST_POLICY_STASH,
                                                   [MST_SAVED_ACT_INPUT] = MST_POLICY_STASH,
                                                   [MST_SAVED_FC2_INPUT] = MST_POLICY_RECOMPUTE,
                                                   [MST_SAVED_PROBS] = MST_POLICY_STASH}};

/* ---- the probe ------------------------------------------------------------------ */

/* Forward entries' time (after_entry: the backend synced after each entry). */
typedef struct entry_clock {
    double last, forward;
} entry_clock;

static mst_status tick(mst_model* m, int32_t entry, void* user) {
    entry_clock* c = (entry_clock*)user;
    MST_TRY(mst_ctx_sync(m->ctx));
    const double t = mst_clock_s();
    if (!m->sched[entry].backward) c->forward += t - c->last;
    c->last = t;
    return MST_OK;
}

/* The probe's step, timed: the run's first batches once measuring (the
 * rows), then sized: the whole step, and its forward entries per layer and
 * microbatch (the faster of two). *t_step: the sized step. */
static mst_status probe_steps(mst_model* m, const mst_train_config* cfg, mst_data* d, mst_budget_model* bm,
                              double* t_step) {
    const int64_t per = cfg->model.batch * (cfg->model.seq + 2) * m->dist.world; /* the global batch's */
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)(per * cfg->microbatches));
    if (!tok) return mst_set_error(MST_ERR_OOM, "probe batch");
    const uint64_t rng = d->rng;
    mst_train_draw(m, d, cfg, tok);
    d->rng = rng;
    float hyper[MST_N_HYPER];
    mst_optim_hyper(&cfg->optim, 1, hyper);
    hyper[MST_HYPER_LR] = 0; /* AdamW runs (its time counts) but keeps the weights: every probe step routes alike */
    mst_status st = mst_model_stage(m, 0, tok, hyper);
    free(tok);
    double forward = 0;
    *t_step = 0;
    for (int k = 0; k < 4 && st == MST_OK; k++) { /* measuring, a warm-up, the least of two timed */
        st = mst_model_upload(m, 0);
        if (st == MST_OK) st = mst_ctx_sync(m->ctx);
        entry_clock c = {mst_clock_s(), 0};
        m->after_entry = k >= 2 ? tick : NULL, m->after_entry_user = &c;
        const double t0 = mst_clock_s();
        if (st == MST_OK) st = mst_step_run(m, &cfg->optim, k == 0);
        if (st == MST_OK) st = mst_ctx_sync(m->ctx);
        const double t = mst_clock_s() - t0;
        m->after_entry = NULL;
        if (k >= 2 && (k == 2 || t < *t_step)) *t_step = t, forward = c.forward;
        if (st == MST_OK) st = mst_memmgr_step_check(m->mm);
    }
    bm->t_layer = forward / ((double)bm->n_layers * bm->n_micro);
    return st;
}

/* Bytes/s of copies of `bytes`: device to device, and to and from pinned
 * host memory (the mean of both directions). */
static mst_status bandwidths(mst_ctx_t* ctx, size_t bytes, double* dev_bw, double* host_bw) {
    void *a = NULL, *b = NULL, *h = NULL;
    mst_status st = mst_alloc(ctx, bytes, &a);
    if (st == MST_OK) st = mst_alloc(ctx, bytes, &b);
    if (st == MST_OK) st = ctx->be->host_alloc ? ctx->be->host_alloc(ctx, bytes, &h)
                                               : mst_set_error(MST_ERR_UNSUPPORTED, "backend has no host_alloc");
    if (st == MST_OK) st = mst_fill(ctx, a, 0x3c, bytes);
    double t[3] = {0, 0, 0};
    for (int rep = 0; rep < 3 && st == MST_OK; rep++) /* the first is a warm-up */
        for (int k = 0; k < 3 && st == MST_OK; k++) {
            st = mst_ctx_sync(ctx);
            const double t0 = mst_clock_s();
            if (st == MST_OK) st = k == 0 ? mst_copy_b2b(ctx, b, a, bytes) : k == 1 ? mst_copy_b2h(ctx, h, a, bytes)
                                                                                    : mst_copy_h2b(ctx, b, h, bytes);
            if (st == MST_OK) st = mst_ctx_sync(ctx);
            if (rep) t[k] += mst_clock_s() - t0;
        }
    *dev_bw = 2.0 * (double)bytes / (t[0] > 0 ? t[0] : 1e-9);
    *host_bw = 4.0 * (double)bytes / (t[1] + t[2] > 0 ? t[1] + t[2] : 1e-9);
    mst_free(ctx, a);
    mst_free(ctx, b);
    if (h) ctx->be->host_free(ctx, h);
    return st;
}

/* Sizes of the budget model from the probe's memory: the model's categories
 * give a layer's activations per set and the MTP module's. A pipeline
 * stage: its main layers (the inputs other stages send it, a set's [N, H]
 * each, are not a layer's: fixed); before the last stage no MTP layer, its
 * MTP bytes the next-token embedding it passes on. */
static mst_status probe_sizes(mst_model* m, mst_budget_model* bm, int64_t* rows) {
    const mst_model_config* c = &m->cfg;
    const int32_t L1 = bm->n_layers, M = bm->n_micro;
    const size_t NH2 = (size_t)(c->batch * c->seq * c->hidden) * sizeof(uint16_t);
    for (int32_t l = 0; l < L1; l++)
        for (int32_t mb = 0; mb < M; mb++) MST_TRY(mst_memmgr_saved_rows(m->mm, l, mb, &rows[l * M + mb]));
    for (int n = 0; n < MST_N_SAVED; n++) bm->reads_pages[n] = mst_memmgr_reads_pages(m->mm, (mst_saved_name)n);
    const size_t S = (size_t)m->n_sets;
    size_t received = 0;
    for (int32_t ch = 0; ch < m->mem_cfg.virtual_stages; ch++) received += mst_stage_received(m, ch) >= 0 ? NH2 * S : 0;
    const size_t layers = m->mem[MST_MEM_SAVED_ATTN] + m->mem[MST_MEM_SAVED_NORM] + m->mem[MST_MEM_SAVED_ROUTER] - received;
    const size_t n_main = (size_t)(L1 - !bm->no_mtp_layer); /* the main layers here */
    bm->n_sets = m->n_sets;
    bm->layer_acts = n_main ? layers / (n_main * S) : 0;
    bm->layer_out = NH2;
    const size_t mtp = m->mem[MST_MEM_SAVED_MTP] / S;
    bm->mtp_input = bm->no_mtp_layer ? mtp : NH2;
    if (!n_main || layers % (n_main * S) || (bm->no_mtp_layer ? mtp != NH2 : mtp < bm->layer_acts + NH2))
        return mst_set_error(MST_ERR_STATE, "probe: activations of %zu bytes over %zu main layers and %zu activation "
                             "sets, MTP %zu", layers, n_main, S, mtp);
    bm->mtp_module = bm->no_mtp_layer ? 0 : mtp - bm->layer_acts - NH2;
    return MST_OK;
}

/* The rest of what the probe had in use (in_use), "fixed", is what the
 * probe's own plan (probe_policy) predicted on bm does not explain, and the
 * KEEP step's time is the probe's (t_probe) less what that plan costs. */
static mst_status fixed_part(mst_budget_model* bm, size_t in_use, double t_probe) {
    mst_budget_plan pp; /* the probe's plan */
    MST_TRY(mst_budget_plan_alloc(bm->n_layers, &pp));
    for (int32_t i = 0; i < bm->n_layers * MST_N_SAVED; i++)
        pp.policy[i] = i % MST_N_SAVED == MST_SAVED_FC2_INPUT ? MST_POLICY_RECOMPUTE : MST_POLICY_STASH;
    bm->fixed = 0, bm->t_step = 0;
    mst_status st = mst_budget_eval(bm, &pp);
    if (st == MST_OK && in_use < pp.peak_sized)
        st = mst_set_error(MST_ERR_STATE, "probe: %zu bytes in use, its plan alone %zu", in_use, pp.peak_sized);
    if (st == MST_OK) bm->fixed = in_use - pp.peak_sized;
    bm->t_step = t_probe > pp.step_s ? t_probe - pp.step_s : 0;
    mst_budget_plan_free(&pp);
    return st;
}

/* Every rank probed its own expert shard and the rows routed to it, so
 * its sizes and times are its own (out->own keeps them). The plan must be
 * the same on every rank (the same graphs, recomputed layers and
 * exchanges), so every rank plans with the same model: each size, row count
 * and time its max over the ranks (the rank with the largest peak binds:
 * pages and copies only grow with rows; the slowest rank sets the step),
 * each bandwidth its min (the max of seconds per byte). Each rank's fixed
 * part is exact for it, as the probe sized each rank's pools for its own
 * needs (mst_mem_config.own_needs: pools sized for the largest need of any
 * rank would leave their surplus over a rank's own rows in its fixed part,
 * counted twice once the rows are the max). A rank whose probe failed says
 * so in the same reduction: every rank fails, none waits for it. One rank:
 * bm is own. */
enum { V_FAILED, V_FIXED, V_LAYER_ACTS, V_LAYER_OUT, V_MTP_INPUT, V_MTP_MODULE, V_T_STEP, V_T_LAYER, V_T_MTP,
       V_DEV_S, V_HOST_S, V_PROBE_PEAK, V_ROWS };

/* out->own: a copy of out->bm (its own rows). */
static mst_status keep_own(mst_plan_report* out, int64_t n) {
    int64_t* rows = (int64_t*)malloc(sizeof(int64_t) * (size_t)n);
    if (!rows) return mst_set_error(MST_ERR_OOM, "probe: this rank's rows");
    memcpy(rows, out->bm.rows, sizeof(int64_t) * (size_t)n);
    out->own = out->bm;
    out->own.rows = rows;
    return MST_OK;
}

static mst_status over_ranks(mst_model* m, mst_plan_report* out, mst_status st) {
    mst_budget_model* bm = &out->bm;
    const int64_t n = (int64_t)bm->n_layers * bm->n_micro;
    if (!bm->rows) return st; /* the probe's tables were not made */
    MST_TRY(keep_own(out, n));
    double* v = (double*)malloc(sizeof(double) * (size_t)(V_ROWS + n));
    if (!v) return mst_set_error(MST_ERR_OOM, "probe: the ranks' measurements");
    const double head[V_ROWS] = {st != MST_OK, (double)bm->fixed, (double)bm->layer_acts, (double)bm->layer_out,
                                 (double)bm->mtp_input, (double)bm->mtp_module, bm->t_step, bm->t_layer, bm->t_mtp,
                                 1.0 / bm->dev_bw, 1.0 / bm->host_bw, (double)out->probe_peak};
    memcpy(v, head, sizeof head);
    for (int64_t i = 0; i < n; i++) v[V_ROWS + i] = (double)bm->rows[i]; /* bytes and rows: exact in a double */
    mst_status rs = mst_model_max_over_ranks(m, v, V_ROWS + n);
    if (st == MST_OK) st = rs;
    if (st == MST_OK && v[V_FAILED] > 0) st = mst_set_error(MST_ERR_STATE, "probe: another rank's probe failed");
    if (st != MST_OK) {
        free(v);
        return st;
    }
    bm->fixed = (size_t)v[V_FIXED], bm->layer_acts = (size_t)v[V_LAYER_ACTS], bm->layer_out = (size_t)v[V_LAYER_OUT];
    bm->mtp_input = (size_t)v[V_MTP_INPUT], bm->mtp_module = (size_t)v[V_MTP_MODULE];
    bm->t_step = v[V_T_STEP], bm->t_layer = v[V_T_LAYER], bm->t_mtp = v[V_T_MTP];
    bm->dev_bw = 1.0 / v[V_DEV_S], bm->host_bw = 1.0 / v[V_HOST_S];
    out->probe_peak = (size_t)v[V_PROBE_PEAK];
    int64_t* rows = (int64_t*)bm->rows;
    for (int64_t i = 0; i < n; i++) rows[i] = (int64_t)v[V_ROWS + i];
    free(v);
    return MST_OK;
}

/* The probe: *pm the probe model (the caller frees it: the stages share
 * their plans over its communicators). */
static mst_status probe(mst_ctx_t* ctx, const mst_train_config* cfg, mst_data* d, mst_plan_report* out, mst_model** pm) {
    mst_mem_config mem = cfg->mem;
    mem.policy = probe_policy;
    mem.recompute = (mst_recompute_config)MST_RECOMPUTE_CONFIG_INIT; /* none */
    mem.recompute_mtp = 0;
    mem.chunk_start = NULL;
    mem.own_needs = 1; /* each rank's pools for its own rows: its fixed part exact (over_ranks) */
    mst_budget_model* bm = &out->bm;
    const int32_t W = cfg->dist.ep ? cfg->dist.world : 1;
    bm->max_rows = mst_model_max_rows(&cfg->model, W) * (cfg->model.ep / W); /* this rank's groups' (G, or 1 of W) */
    bm->hidden = cfg->model.hidden;
    bm->ffn = cfg->model.ffn;
    int64_t cols = 0;
    mst_dtype dt;
    mst_saved_shape(MST_SAVED_ACT_INPUT, bm->hidden, bm->ffn, &cols, &dt);
    const size_t bytes = (size_t)bm->max_rows * (size_t)cols * mst_dtype_size(dt); /* the widest saved tensor */
    MST_TRY(bandwidths(ctx, bytes < ((size_t)256 << 20) ? bytes : (size_t)256 << 20, &bm->dev_bw, &bm->host_bw));
    mst_ctx_mem_reset_peak(ctx);
    MST_TRY(mst_model_create_dist(ctx, &cfg->model, cfg->microbatches, &mem, &cfg->dist, pm));
    mst_model* m = *pm;
    bm->n_layers = m->n_here; /* the stage's layers (one stage: L + 1), its manager's indices */
    bm->no_mtp_layer = m->stage < m->stages - 1;
    bm->n_micro = cfg->microbatches;
    bm->n_sched = m->n_sched;
    bm->layers_per_chunk = m->layers_per_chunk;
    bm->page_rows = 64; /* the trainer's manager (model.c, make_memmgr) */
    bm->pool_factor = mem.pool_factor;
    mst_sched_entry* sched = (mst_sched_entry*)malloc(sizeof *sched * (size_t)m->n_sched);
    int64_t* rows = (int64_t*)calloc((size_t)bm->n_layers * (size_t)bm->n_micro, sizeof(int64_t));
    bm->sched = sched, bm->rows = rows;
    mst_status st = sched && rows ? MST_OK : mst_set_error(MST_ERR_OOM, "probe tables");
    if (st == MST_OK) memcpy(sched, m->sched, sizeof *sched * (size_t)m->n_sched);
    double t_probe = 0;
    size_t in_use = 0;
    if (st == MST_OK) st = probe_steps(m, cfg, d, bm, &t_probe);
    if (st == MST_OK) st = probe_sizes(m, bm, rows);
    mst_ctx_mem(ctx, &in_use, &out->probe_peak);
    if (st == MST_OK) st = fixed_part(bm, in_use, t_probe);
    return over_ranks(m, out, st);
}

/* ---- the plan, and the stages' plans over the grid ------------------------------ */

/* Each stage planned its own layers, the same plan on each of its ranks;
 * every rank of the grid learns every stage's in one max over the grid
 * (dist.pipe; one stage: over its ranks, who agree already): a row a stage
 * [P, G_ROW] that its ranks write (the same values) and the others leave
 * zero, then a code a (layer, recomputed or name) [L+1, 1 + MST_N_SAVED]
 * that the stage holding the layer writes. A stage that found no plan, or
 * whose probe failed, says so in its row: every rank refuses alike. */
enum { G_FAILED, G_FULL, G_SETS, G_PEAK, G_PEAK_MEASURING, G_PEAK_SIZED, G_KEEP_PEAK, G_SMALLEST, G_STEP, G_KEEP_STEP,
       G_ROW };
enum { G_CODES = 1 + MST_N_SAVED };

static mst_status grid_alloc(mst_plan_report* out, int32_t L1, int32_t P) {
    out->n_all = L1;
    out->policy_all = (mst_policy*)calloc((size_t)L1 * MST_N_SAVED, sizeof(mst_policy));
    out->chunk_all = (int32_t*)malloc(sizeof(int32_t) * (size_t)L1);
    out->stage_of = (int32_t*)malloc(sizeof(int32_t) * (size_t)L1);
    out->by_stage = (mst_plan_stage*)calloc((size_t)P, sizeof(mst_plan_stage));
    return out->policy_all && out->chunk_all && out->stage_of && out->by_stage
               ? MST_OK : mst_set_error(MST_ERR_OOM, "the plan of %d layers, %d stages", L1, P);
}

/* This stage's row and layer codes into v ([P, G_ROW] then [L+1, G_CODES]);
 * failed: mst_plan_stage's. */
static void grid_write(const mst_model* m, const mst_plan_report* out, int failed, double* v) {
    double* row = v + (size_t)m->stage * G_ROW;
    row[G_FAILED] = failed;
    if (failed == 2) return;
    const mst_budget_plan *p = &out->plan, *k = &out->keep;
    const double r[G_ROW] = {row[G_FAILED], p->full, out->bm.n_sets, (double)p->peak, (double)p->peak_measuring,
                             (double)p->peak_sized, (double)k->peak, (double)out->smallest, p->step_s, k->step_s};
    memcpy(row, r, sizeof r);
    if (failed) return;
    double* codes = v + (size_t)out->stages * G_ROW;
    for (int32_t i = 0; i < out->bm.n_layers; i++) {
        double* c = codes + (size_t)mst_model_global(m, i) * G_CODES;
        c[0] = p->chunk_start[i] >= 0;
        for (int n = 0; n < MST_N_SAVED; n++) c[1 + n] = p->policy[i * MST_N_SAVED + n];
    }
}

static void grid_read(const mst_model* m, mst_plan_report* out, const double* v) {
    for (int32_t s = 0; s < out->stages; s++) {
        const double* row = v + (size_t)s * G_ROW;
        out->by_stage[s] = (mst_plan_stage){(int32_t)row[G_FAILED], (int32_t)row[G_FULL], (int32_t)row[G_SETS],
                                            (size_t)row[G_PEAK], (size_t)row[G_PEAK_MEASURING], (size_t)row[G_PEAK_SIZED],
                                            (size_t)row[G_KEEP_PEAK], (size_t)row[G_SMALLEST], row[G_STEP], row[G_KEEP_STEP]};
    }
    const double* codes = v + (size_t)out->stages * G_ROW;
    for (int32_t l = 0; l < out->n_all; l++) {
        out->chunk_all[l] = codes[l * G_CODES] > 0 ? l : -1;
        for (int n = 0; n < MST_N_SAVED; n++) out->policy_all[l * MST_N_SAVED + n] = (mst_policy)codes[l * G_CODES + 1 + n];
        out->stage_of[l] = mst_model_stage_of(m, l, 0);
    }
}

/* The refusal every rank gives when a stage fits no plan: the first such
 * stage, and the largest of the stages' smallest peaks (a budget every
 * stage fits). */
static mst_status refuse(const mst_plan_report* out, size_t budget) {
    int32_t first = -1;
    size_t need = 0;
    for (int32_t s = 0; s < out->stages; s++) {
        if (out->by_stage[s].failed == 1 && first < 0) first = s;
        if (out->by_stage[s].smallest > need) need = out->by_stage[s].smallest;
    }
    if (out->stages == 1)
        return mst_set_error(MST_ERR_INVALID, "--memory-budget %zu (%.2f MiB): no plan fits; the smallest peak that would "
                             "is %zu bytes (%.2f MiB)", budget, mib(budget), need, mib(need));
    return mst_set_error(MST_ERR_INVALID, "--memory-budget %zu (%.2f MiB): no plan fits pipeline stage %d of %d; the "
                         "smallest peak that would is %zu bytes (%.2f MiB), the most a stage needs", budget, mib(budget),
                         first, out->stages, need, mib(need));
}

/* st: this stage's (nofit: its planner found no plan). */
static mst_status over_grid(mst_model* m, mst_plan_report* out, mst_status st, int nofit) {
    out->stage = m->stage, out->stages = m->stages;
    const int32_t L1 = m->cfg.layers + 1, P = m->stages;
    MST_TRY(grid_alloc(out, L1, P));
    const int64_t n = (int64_t)P * G_ROW + (int64_t)L1 * G_CODES;
    double* v = (double*)calloc((size_t)n, sizeof(double));
    if (!v) return mst_set_error(MST_ERR_OOM, "the stages' plans");
    grid_write(m, out, st == MST_OK ? 0 : nofit ? 1 : 2, v);
    const mst_status rs = mst_model_allreduce_host_world(m, v, n, MST_EP_MAX_F64);
    if (rs == MST_OK) grid_read(m, out, v);
    free(v);
    if (st != MST_OK && !nofit) return st;
    MST_TRY(rs);
    for (int32_t s = 0; s < P; s++)
        if (out->by_stage[s].failed == 2) return mst_set_error(MST_ERR_STATE, "probe: stage %d's probe failed", s);
    for (int32_t s = 0; s < P; s++)
        if (out->by_stage[s].failed == 1) return refuse(out, out->budget);
    return MST_OK;
}

mst_status mst_plan_budget(mst_ctx_t* ctx, const mst_train_config* cfg, mst_data* d, mst_plan_report* out) {
    memset(out, 0, sizeof *out);
    out->budget = cfg->memory_budget;
    mst_model* m = NULL;
    mst_status st = probe(ctx, cfg, d, out, &m);
    if (st == MST_OK) st = mst_budget_plan_alloc(out->bm.n_layers, &out->plan);
    if (st == MST_OK) st = mst_budget_plan_alloc(out->bm.n_layers, &out->keep);
    if (st == MST_OK) st = mst_budget_eval(&out->bm, &out->keep);
    int nofit = 0;
    if (st == MST_OK) {
        st = mst_budget_solve(&out->bm, cfg->memory_budget, &out->plan, &out->smallest);
        nofit = st == MST_ERR_INVALID;
    }
    if (m) st = over_grid(m, out, st, nofit);
    mst_model_destroy(m);
    return st;
}

void mst_plan_apply(const mst_plan_report* r, mst_train_config* cfg) {
    cfg->mem.recompute = (mst_recompute_config)MST_RECOMPUTE_CONFIG_INIT; /* none */
    cfg->mem.recompute_mtp = 0;
    cfg->mem.recompute_full = r->plan.full; /* this stage's */
    cfg->mem.policy = (mst_policies){.per_layer = r->policy_all}; /* name[]: keep, per_layer decides */
    cfg->mem.chunk_start = r->chunk_all;
    cfg->memory_budget = 0;
}

void mst_plan_report_free(mst_plan_report* r) {
    if (!r) return;
    mst_budget_plan_free(&r->plan);
    mst_budget_plan_free(&r->keep);
    free((void*)r->bm.sched);
    free((void*)r->bm.rows);
    free((void*)r->own.rows);
    free(r->policy_all);
    free(r->chunk_all);
    free(r->stage_of);
    free(r->by_stage);
    memset(r, 0, sizeof *r);
}
