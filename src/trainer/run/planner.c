/*
 * planner.c — the probe, the costs and the plan of `--memory-budget` (see
 * planner.h), and their report.
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
 * give a layer's activations per set and the MTP module's; the rest of what
 * is in use (fixed) is what the probe's own plan (probe_policy) does not
 * explain, and the KEEP step's time is the probe's less what its plan
 * costs. */
static mst_status probe_sizes(mst_model* m, mst_budget_model* bm, int64_t* rows, double t_probe) {
    const mst_model_config* c = &m->cfg;
    const int32_t L1 = bm->n_layers, M = bm->n_micro;
    const size_t NH2 = (size_t)(c->batch * c->seq * c->hidden) * sizeof(uint16_t);
    for (int32_t l = 0; l < L1; l++)
        for (int32_t mb = 0; mb < M; mb++) MST_TRY(mst_memmgr_saved_rows(m->mm, l, mb, &rows[l * M + mb]));
    for (int n = 0; n < MST_N_SAVED; n++) bm->reads_pages[n] = mst_memmgr_reads_pages(m->mm, (mst_saved_name)n);
    const size_t layers = m->mem[MST_MEM_SAVED_ATTN] + m->mem[MST_MEM_SAVED_NORM] + m->mem[MST_MEM_SAVED_ROUTER];
    const size_t S = (size_t)m->n_sets;
    bm->n_sets = m->n_sets;
    bm->layer_acts = layers / ((size_t)c->layers * S);
    bm->layer_out = NH2;
    bm->mtp_input = NH2;
    const size_t mtp = m->mem[MST_MEM_SAVED_MTP] / S;
    if (layers % ((size_t)c->layers * S) || mtp < bm->layer_acts + NH2)
        return mst_set_error(MST_ERR_STATE, "probe: activations of %zu bytes over %d layers and %zu activation sets, "
                             "MTP module %zu", layers, c->layers, S, mtp);
    bm->mtp_module = mtp - bm->layer_acts - NH2;
    mst_budget_plan pp; /* the probe's plan */
    MST_TRY(mst_budget_plan_alloc(L1, &pp));
    for (int32_t i = 0; i < L1 * MST_N_SAVED; i++)
        pp.policy[i] = i % MST_N_SAVED == MST_SAVED_FC2_INPUT ? MST_POLICY_RECOMPUTE : MST_POLICY_STASH;
    bm->fixed = 0, bm->t_step = 0;
    mst_status st = mst_budget_eval(bm, &pp);
    size_t in_use = 0;
    mst_ctx_mem(m->ctx, &in_use, NULL);
    if (st == MST_OK && in_use < pp.peak_sized)
        st = mst_set_error(MST_ERR_STATE, "probe: %zu bytes in use, its plan alone %zu", in_use, pp.peak_sized);
    bm->fixed = in_use - pp.peak_sized;
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
 * each bandwidth its min (the max of seconds per byte). A rank whose probe
 * failed says so in the same reduction: every rank fails, none waits for
 * it. One rank: bm is own. */
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

static mst_status probe(mst_ctx_t* ctx, const mst_train_config* cfg, mst_data* d, mst_plan_report* out) {
    mst_mem_config mem = cfg->mem;
    mem.policy = probe_policy;
    mem.recompute = (mst_recompute_config)MST_RECOMPUTE_CONFIG_INIT; /* none */
    mem.recompute_mtp = 0;
    mem.chunk_start = NULL;
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
    mst_model* m = NULL;
    mst_ctx_mem_reset_peak(ctx);
    MST_TRY(mst_model_create_dist(ctx, &cfg->model, cfg->microbatches, &mem, &cfg->dist, &m));
    bm->n_layers = cfg->model.layers + 1;
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
    if (st == MST_OK) st = probe_steps(m, cfg, d, bm, &t_probe);
    if (st == MST_OK) st = probe_sizes(m, bm, rows, t_probe);
    mst_ctx_mem(ctx, NULL, &out->probe_peak);
    st = over_ranks(m, out, st);
    mst_model_destroy(m);
    return st;
}

/* ---- the plan -------------------------------------------------------------------- */

mst_status mst_plan_budget(mst_ctx_t* ctx, const mst_train_config* cfg, mst_data* d, mst_plan_report* out) {
    memset(out, 0, sizeof *out);
    out->budget = cfg->memory_budget;
    const int32_t L1 = cfg->model.layers + 1;
    mst_status st = mst_budget_plan_alloc(L1, &out->plan);
    if (st == MST_OK) st = mst_budget_plan_alloc(L1, &out->keep);
    if (st == MST_OK) st = probe(ctx, cfg, d, out);
    if (st == MST_OK) st = mst_budget_eval(&out->bm, &out->keep);
    if (st != MST_OK) return st;
    st = mst_budget_solve(&out->bm, cfg->memory_budget, &out->plan, &out->smallest);
    if (st == MST_ERR_INVALID)
        return mst_set_error(st, "--memory-budget %zu (%.2f MiB): no plan fits; the smallest peak that would is %zu bytes "
                             "(%.2f MiB)", cfg->memory_budget, mib(cfg->memory_budget), out->smallest, mib(out->smallest));
    return st;
}

void mst_plan_apply(const mst_plan_report* r, mst_train_config* cfg) {
    cfg->mem.recompute = (mst_recompute_config)MST_RECOMPUTE_CONFIG_INIT; /* none */
    cfg->mem.recompute_mtp = 0;
    cfg->mem.recompute_full = r->plan.full;
    cfg->mem.policy = (mst_policies){.per_layer = r->plan.policy}; /* name[]: keep, per_layer decides */
    cfg->mem.chunk_start = r->plan.chunk_start;
    cfg->memory_budget = 0;
}

void mst_plan_report_free(mst_plan_report* r) {
    if (!r) return;
    mst_budget_plan_free(&r->plan);
    mst_budget_plan_free(&r->keep);
    free((void*)r->bm.sched);
    free((void*)r->bm.rows);
    free((void*)r->own.rows);
    memset(r, 0, sizeof *r);
}

/* ---- report ----------------------------------------------------------------------- */

static int cmp_double(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

double mst_plan_step_s(const mst_train_result* res, const mst_train_config* cfg) {
    const double tokens = (double)(cfg->model.batch * cfg->model.seq * cfg->microbatches);
    const int64_t first = res->first_step, n = res->steps - first; /* steps after the measuring one */
    if (n < 1) return tokens / res->tok_per_s[res->steps - 1];
    double* t = (double*)malloc(sizeof(double) * (size_t)n);
    if (!t) return NAN;
    for (int64_t i = 0; i < n; i++) t[i] = tokens / res->tok_per_s[first + i];
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    const double med = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
    free(t);
    return med;
}

static char letter(const mst_budget_plan* p, int32_t l, int n) {
    if (p->chunk_start[l] >= 0) return '-';
    return "KSOR"[p->policy[l * MST_N_SAVED + n]];
}

void mst_plan_print(FILE* f, const mst_plan_report* r, const mst_train_result* res, const mst_train_config* cfg) {
    const mst_budget_plan* p = &r->plan;
    const int32_t L1 = r->bm.n_layers;
    fprintf(f, "\nmemory plan for --memory-budget %.2f MiB (recomputed layers: %s)\n  %-18s", mib(r->budget),
            p->full ? "whole, --recompute-granularity full" : "grouped MLP only, --recompute-granularity moe", "layer");
    for (int32_t l = 0; l < L1; l++) fprintf(f, l + 1 < L1 ? " %3d" : " mtp", l);
    fprintf(f, "\n  %-18s", "layer recompute");
    for (int32_t l = 0; l < L1; l++) fprintf(f, "   %c", p->chunk_start[l] >= 0 ? 'R' : '.');
    for (int n = 0; n < MST_N_SAVED; n++) {
        fprintf(f, "\n  %-18s", mst_saved_name_str((mst_saved_name)n));
        for (int32_t l = 0; l < L1; l++) fprintf(f, "   %c", letter(p, l, n));
    }
    const size_t peak = res->mem_max.peak; /* W ranks: the max over the ranks, which the plan predicts */
    const double step = mst_plan_step_s(res, cfg);
    char over[48] = "";
    if (res->world > 1) snprintf(over, sizeof over, " (max over %d ranks)", (int)res->world);
    fprintf(f, "\n  K keep, S stash (device pages), O offload (pinned host pages), R recompute, - layer recomputed\n");
    fprintf(f, "  peak%s: predicted %.2f MiB (measuring step %.2f, sized steps %.2f), measured %.2f MiB (%+.1f %%); "
               "KEEP %.2f MiB; smallest reachable %.2f MiB\n", over, mib(p->peak), mib(p->peak_measuring),
            mib(p->peak_sized), mib(peak), 100.0 * ((double)p->peak - (double)peak) / (double)(peak ? peak : 1),
            mib(r->keep.peak), mib(r->smallest));
    fprintf(f, "  step: predicted %.2f ms, measured %.2f ms (median); KEEP %.2f ms (predicted)\n", 1e3 * p->step_s,
            1e3 * step, 1e3 * r->keep.step_s);
    fprintf(f, "  costs measured: device copy %.1f GB/s, host spill %.1f GB/s, one layer's forward %.3f ms\n",
            r->bm.dev_bw / 1e9, r->bm.host_bw / 1e9, 1e3 * r->bm.t_layer);
}

void mst_plan_json(FILE* f, const mst_plan_report* r, const mst_train_result* res, const mst_train_config* cfg) {
    const mst_budget_plan* p = &r->plan;
    const int32_t L1 = r->bm.n_layers;
    fprintf(f, "  \"plan\": {\"budget\": %zu, \"granularity\": \"%s\", \"recompute_layers\": [", r->budget,
            p->full ? "full" : "moe");
    for (int32_t l = 0, k = 0; l < L1; l++)
        if (p->chunk_start[l] >= 0) fprintf(f, "%s%d", k++ ? ", " : "", l);
    fprintf(f, "],\n    \"policy\": {");
    for (int n = 0; n < MST_N_SAVED; n++) {
        fprintf(f, "%s\"%s\": [", n ? ", " : "", mst_saved_name_str((mst_saved_name)n));
        for (int32_t l = 0; l < L1; l++)
            fprintf(f, "%s\"%s\"", l ? ", " : "",
                    p->chunk_start[l] >= 0 ? "recomputed layer" : mst_policy_str(p->policy[l * MST_N_SAVED + n]));
        fprintf(f, "]");
    }
    fprintf(f, "},\n    \"predicted_peak\": %zu, \"predicted_peak_measuring\": %zu, \"predicted_peak_sized\": %zu, "
               "\"measured_peak\": %zu,\n    \"predicted_step_s\": %.6g, \"measured_step_s\": %.6g, \"keep_peak\": %zu, "
               "\"keep_activations\": %zu, \"keep_step_s\": %.6g, \"smallest_peak\": %zu,\n    \"device_copy_bytes_per_s\": %.6g, "
               "\"host_spill_bytes_per_s\": %.6g, \"layer_forward_s\": %.6g",
            p->peak, p->peak_measuring, p->peak_sized, res->mem_max.peak, p->step_s, mst_plan_step_s(res, cfg),
            r->keep.peak, r->keep.acts, r->keep.step_s, r->smallest, r->bm.dev_bw, r->bm.host_bw, r->bm.t_layer);
    if (res->rank_peak) { /* W ranks: the peaks and times above are the max over the ranks */
        fprintf(f, ",\n    \"measured_peak_per_rank\": [");
        for (int32_t k = 0; k < res->world; k++) fprintf(f, "%s%llu", k ? ", " : "", (unsigned long long)res->rank_peak[k]);
        fprintf(f, "]");
    }
    fprintf(f, "},\n");
}
