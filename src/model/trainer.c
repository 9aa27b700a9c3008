/*
 * trainer.c — the training loop (see trainer.h). A step: zero main_grad, M
 * microbatches of forward + backward, clip + AdamW (skipped on the backend
 * when the step's flag is set), then one host check of the flag. A step
 * flagged over budget (a group got more rows than max_rows) is rerun with
 * grouped-rows buffers of exact size — the largest group seen — and the
 * static buffers come back for the next step. Losses are read once per step.
 */
#include <math.h>
#include <string.h>
#include <time.h>

#include "trainer.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static mst_status run_step(mst_model* m, const mst_train_config* cfg, const int32_t* tok,
                           int64_t step, int force_flag) {
    const int64_t per = cfg->model.batch * (cfg->model.seq + 2);
    MST_TRY(mst_optim_zero(m));
    for (int32_t mb = 0; mb < cfg->microbatches; mb++)
        MST_TRY(mst_model_forward_backward(m, tok + mb * per, mb));
    if (force_flag) {
        const int32_t bits = MST_FLAG_COUNTS;
        MST_TRY(mst_copy_h2b(m->ctx, m->ctx->err_flag, &bits, sizeof bits));
    }
    return mst_optim_step(m, &cfg->optim, step);
}

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

/* Step with the reruns: returns MST_OK once the step's results are valid.
 * A rerun sizes every group to the largest group seen; a layer after an
 * over-budget one saw different inputs, so its group may still not fit:
 * rerun again (each rerun fixes at least one more layer), and at the last
 * attempt size the groups for every token copy (N k rows: cannot fail). */
static mst_status step_checked(mst_model* m, const mst_train_config* cfg, const int32_t* tok,
                               int64_t step, mst_train_result* res) {
    MST_TRY(run_step(m, cfg, tok, step, step == cfg->force_over_budget));
    mst_status st = mst_ctx_check(m->ctx);
    const int64_t R = m->max_rows, all = m->cfg.batch * m->cfg.seq * m->cfg.top_k;
    for (int32_t attempt = 0; st == MST_ERR_COUNTS && attempt <= m->cfg.layers + 1; attempt++) {
        res->reruns++;
        int64_t exact = all;
        if (attempt < m->cfg.layers + 1) MST_TRY(exact_rows(m, &exact));
        MST_TRY(mst_model_set_max_rows(m, exact));
        MST_TRY(run_step(m, cfg, tok, step, 0));
        st = mst_ctx_check(m->ctx);
    }
    if (st != MST_OK) return st;
    return mst_model_set_max_rows(m, R);
}

static mst_status read_losses(mst_model* m, int64_t i, mst_train_result* res) {
    const int64_t N = m->cfg.batch * m->cfg.seq, M = m->n_micro, NA = M * (m->cfg.layers + 1);
    float* h = (float*)malloc(sizeof(float) * (size_t)(2 * M * N + NA));
    if (!h) return mst_set_error(MST_ERR_OOM, "loss readback");
    mst_status st = mst_copy_b2h(m->ctx, h, m->loss_main, sizeof(float) * (size_t)(M * N));
    if (st == MST_OK) st = mst_copy_b2h(m->ctx, h + M * N, m->loss_mtp, sizeof(float) * (size_t)(M * N));
    if (st == MST_OK) st = mst_copy_b2h(m->ctx, h + 2 * M * N, m->aux_sum, sizeof(float) * (size_t)NA);
    double a = 0, b = 0, c = 0;
    for (int64_t j = 0; j < M * N; j++) {
        a += h[j];
        b += h[M * N + j];
    }
    for (int64_t j = 0; j < NA; j++) c += h[2 * M * N + j];
    res->loss[i] = a / (double)(M * N);
    res->mtp_loss[i] = b / (double)(M * N);
    res->aux_loss[i] = c / (double)M;
    free(h);
    return st;
}

/* Bytes of one routed row in the grouped MLP's saved activations (x, h, z
 * bf16; prob fp32) and in the shared grouped-rows compute buffers. */
static size_t saved_row_bytes(const mst_model_config* c) {
    return (size_t)(c->hidden + 3 * c->ffn) * 2 + 4;
}
static size_t compute_row_bytes(const mst_model_config* c) { return (size_t)c->hidden * 8 + 8; }

static mst_status memory_table(mst_model* m, mst_train_result* res) {
    const mst_model_config* c = &m->cfg;
    const int64_t G = c->ep, L1 = c->layers + 1, R = m->max_rows;
    res->peak_rows = (int32_t*)malloc(sizeof(int32_t) * (size_t)(L1 * G));
    if (!res->peak_rows) return mst_set_error(MST_ERR_OOM, "peak rows");
    MST_TRY(mst_model_peak_rows(m, res->peak_rows));
    size_t exact_saved = 0, exact_compute = 0;
    for (int64_t l = 0; l < L1; l++) {
        size_t layer_rows = 0;
        for (int64_t g = 0; g < G; g++) layer_rows += (size_t)res->peak_rows[l * G + g];
        exact_saved += layer_rows * saved_row_bytes(c);
        if (layer_rows * compute_row_bytes(c) > exact_compute) exact_compute = layer_rows * compute_row_bytes(c);
    }
    const size_t keep_saved = (size_t)(L1 * G * R) * saved_row_bytes(c);
    const size_t keep_compute = (size_t)(G * R) * compute_row_bytes(c);
    mst_mem_table* t = &res->mem;
    size_t in_use = 0, total = 0;
    mst_ctx_mem(m->ctx, &in_use, &t->peak);
    for (int k = 0; k < MST_N_MEM; k++) {
        t->run[k] = t->keep[k] = t->exact[k] = m->mem[k];
        total += m->mem[k];
    }
    t->other = in_use > total ? in_use - total : 0;
    /* the run holds KEEP buffers: the KEEP column is the run's */
    t->exact[MST_MEM_SAVED] = t->run[MST_MEM_SAVED] - keep_saved + exact_saved;
    t->exact[MST_MEM_COMPUTE] = t->run[MST_MEM_COMPUTE] - keep_compute + exact_compute;
    res->max_rows = R;
    return MST_OK;
}

static mst_status load_data(const mst_train_config* cfg, mst_data* d) {
    if (!cfg->data_path) return mst_data_synthetic(d, cfg->model.seed, 1 << 20);
    return mst_data_file(d, cfg->data_path, cfg->model.seq + 2, cfg->model.seed);
}

static mst_status alloc_result(mst_train_result* res, int64_t steps) {
    memset(res, 0, sizeof *res);
    res->steps = steps;
    res->loss = (double*)calloc((size_t)steps, sizeof(double));
    res->mtp_loss = (double*)calloc((size_t)steps, sizeof(double));
    res->aux_loss = (double*)calloc((size_t)steps, sizeof(double));
    res->tok_per_s = (double*)calloc((size_t)steps, sizeof(double));
    if (!res->loss || !res->mtp_loss || !res->aux_loss || !res->tok_per_s)
        return mst_set_error(MST_ERR_OOM, "result arrays for %lld steps", (long long)steps);
    return MST_OK;
}

static mst_status train_loop(mst_model* m, mst_data* d, const mst_train_config* cfg, FILE* progress,
                             mst_train_result* res) {
    const int64_t per = cfg->model.batch * (cfg->model.seq + 2);
    const double tokens = (double)(cfg->model.batch * cfg->model.seq * cfg->microbatches);
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)(per * cfg->microbatches));
    if (!tok) return mst_set_error(MST_ERR_OOM, "token batch");
    mst_status st = MST_OK;
    const double t0 = now_s();
    for (int64_t i = 0; i < cfg->steps && st == MST_OK; i++) {
        double ts = now_s();
        for (int32_t mb = 0; mb < cfg->microbatches; mb++)
            mst_data_batch(d, cfg->model.batch, cfg->model.seq, tok + mb * per);
        st = step_checked(m, cfg, tok, i + 1, res);
        if (st == MST_OK) st = read_losses(m, i, res);
        if (st != MST_OK) break;
        res->tok_per_s[i] = tokens / (now_s() - ts);
        size_t in_use = 0;
        mst_ctx_mem(m->ctx, &in_use, NULL);
        if (progress)
            fprintf(progress, "step %5lld | loss %.4f | mtp %.4f | aux %.4f | lr %.2e | %8.0f tok/s | mem %.1f MiB | reruns %lld\n",
                    (long long)(i + 1), res->loss[i], res->mtp_loss[i], res->aux_loss[i],
                    (double)mst_optim_lr(&cfg->optim, i + 1), res->tok_per_s[i],
                    (double)in_use / (1 << 20), (long long)res->reruns);
    }
    res->seconds = now_s() - t0;
    free(tok);
    return st == MST_OK ? memory_table(m, res) : st;
}

mst_status mst_train_run(mst_ctx_t* ctx, const mst_train_config* cfg, FILE* progress,
                         mst_train_result* res) {
    if (cfg->steps < 1) return mst_set_error(MST_ERR_INVALID, "--steps %lld: expected >= 1", (long long)cfg->steps);
    MST_TRY(mst_model_config_check(&cfg->model));
    MST_TRY(alloc_result(res, cfg->steps));
    mst_data d;
    MST_TRY(load_data(cfg, &d));
    mst_model* m = NULL;
    mst_status st = mst_model_create(ctx, &cfg->model, cfg->microbatches, &m);
    if (st == MST_OK) st = train_loop(m, &d, cfg, progress, res);
    mst_model_destroy(m);
    mst_data_free(&d);
    return st;
}

void mst_train_result_free(mst_train_result* res) {
    free(res->loss);
    free(res->mtp_loss);
    free(res->aux_loss);
    free(res->tok_per_s);
    free(res->peak_rows);
    memset(res, 0, sizeof *res);
}

static double mib(size_t b) { return (double)b / (1 << 20); }

void mst_train_print_memory(FILE* f, const mst_train_result* r) {
    const mst_mem_table* t = &r->mem;
    size_t tot[3] = {t->other, t->other, t->other};
    fprintf(f, "\nmemory by category (MiB)       this run   KEEP (static max_rows = %lld)   exact shapes\n",
            (long long)r->max_rows);
    for (int k = 0; k < MST_N_MEM; k++) {
        fprintf(f, "  %-26s %10.2f   %29.2f   %12.2f\n", mst_mem_category_str(k), mib(t->run[k]),
                mib(t->keep[k]), mib(t->exact[k]));
        tot[0] += t->run[k];
        tot[1] += t->keep[k];
        tot[2] += t->exact[k];
    }
    fprintf(f, "  %-26s %10.2f   %29.2f   %12.2f\n", "op workspaces, context", mib(t->other),
            mib(t->other), mib(t->other));
    fprintf(f, "  %-26s %10.2f   %29.2f   %12.2f\n", "total", mib(tot[0]), mib(tot[1]), mib(tot[2]));
    fprintf(f, "  backend peak %.2f MiB; steps rerun with exact shapes: %lld\n", mib(t->peak),
            (long long)r->reruns);
}

static void json_array(FILE* f, const char* name, const double* v, int64_t n, int last) {
    fprintf(f, "  \"%s\": [", name);
    for (int64_t i = 0; i < n; i++) fprintf(f, "%s%.9g", i ? ", " : "", v[i]);
    fprintf(f, "]%s\n", last ? "" : ",");
}

static void json_mem(FILE* f, const char* name, const size_t* v, size_t other) {
    fprintf(f, "    \"%s\": {", name);
    size_t tot = other;
    for (int k = 0; k < MST_N_MEM; k++) {
        fprintf(f, "\"%s\": %zu, ", mst_mem_category_str(k), v[k]);
        tot += v[k];
    }
    fprintf(f, "\"other\": %zu, \"total\": %zu}", other, tot);
}

mst_status mst_train_write_json(const char* path, const mst_train_config* cfg,
                                const mst_train_result* r, const char* device) {
    FILE* f = fopen(path, "w");
    if (!f) return mst_set_error(MST_ERR_IO, "--json '%s': cannot open for writing", path);
    const mst_model_config* c = &cfg->model;
    fprintf(f, "{\n  \"device\": \"%s\",\n", device);
    fprintf(f, "  \"config\": {\"hidden\": %lld, \"ffn\": %lld, \"heads\": %lld, \"seq\": %lld, "
               "\"batch\": %lld, \"layers\": %d, \"experts\": %d, \"top_k\": %d, \"ep\": %d, "
               "\"capacity_factor\": %g, \"microbatches\": %d, \"mtp_weight\": %g, \"steps\": %lld, "
               "\"lr\": %g, \"seed\": %llu, \"data\": \"%s\"},\n",
            (long long)c->hidden, (long long)c->ffn, (long long)c->n_head, (long long)c->seq,
            (long long)c->batch, c->layers, c->experts, c->top_k, c->ep, (double)c->capacity_factor,
            cfg->microbatches, (double)c->mtp_weight, (long long)cfg->steps, (double)cfg->optim.lr,
            (unsigned long long)c->seed, cfg->data_path ? "file" : "synthetic");
    json_array(f, "loss", r->loss, r->steps, 0);
    json_array(f, "mtp_loss", r->mtp_loss, r->steps, 0);
    json_array(f, "aux_loss", r->aux_loss, r->steps, 0);
    json_array(f, "tokens_per_s", r->tok_per_s, r->steps, 0);
    fprintf(f, "  \"reruns\": %lld,\n  \"seconds\": %.3f,\n  \"max_rows\": %lld,\n  \"peak_rows\": [",
            (long long)r->reruns, r->seconds, (long long)r->max_rows);
    for (int64_t i = 0; i < (int64_t)(c->layers + 1) * c->ep; i++)
        fprintf(f, "%s%d", i ? ", " : "", r->peak_rows ? r->peak_rows[i] : 0);
    fprintf(f, "],\n  \"memory_bytes\": {\n");
    json_mem(f, "run", r->mem.run, r->mem.other);
    fprintf(f, ",\n");
    json_mem(f, "keep_static", r->mem.keep, r->mem.other);
    fprintf(f, ",\n");
    json_mem(f, "exact_shapes", r->mem.exact, r->mem.other);
    fprintf(f, ",\n    \"backend_peak\": %zu\n  }\n}\n", r->mem.peak);
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    return bad ? mst_set_error(MST_ERR_IO, "--json '%s': write failed", path) : MST_OK;
}
