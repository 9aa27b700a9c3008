/*
 * eval.c — a model's mean next-token loss on a token file through the
 * trainer's forward (eval.h).
 */
#include "eval.h"

#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "trainer/io/hf.h"
#include "trainer/run/checkpoint.h"

/* The model of dir with T, B of the evaluation: one group holding every
 * expert and R = N k rows (no routing goes over it: nothing is rerun or
 * dropped), the MTP module at its initialisation unless dir has one (its
 * loss is not reported); dir's files checked against it (before any work). */
static mst_status model_config(const mst_eval_config* c, mst_model_config* m) {
    *m = (mst_model_config){.seq = c->seq, .batch = c->batch, .ep = 1, .capacity_factor = 1.0f, .mtp_weight = 0.3f,
                            .init_std = 0.02f, .seed = 1};
    MST_TRY(mst_hf_read_config(c->model_dir, m));
    MST_TRY(mst_model_config_check(m));
    return mst_ckpt_check_hf(c->model_dir, m);
}

/* Stages windows [first, first + B) of T+1 tokens as the step's [B, T+2]
 * (the token after each window: its last, for the MTP loss nobody reads);
 * windows past `last` repeat window `first` (their losses are not summed). */
static void stage_windows(const mst_data* d, int64_t T, int64_t B, int64_t first, int64_t last, int32_t* tok) {
    for (int64_t b = 0; b < B; b++) {
        const int64_t w = first + b < last ? first + b : first;
        memcpy(tok + b * (T + 2), d->tok + w * (T + 1), sizeof(int32_t) * (size_t)(T + 1));
        tok[b * (T + 2) + T + 1] = tok[b * (T + 2) + T];
    }
}

/* Every window through the forward: each real window's summed per-token
 * losses into wsum [n_win]. */
static mst_status run_windows(mst_model* m, const mst_data* d, int64_t n_win, double* wsum) {
    const int64_t T = m->cfg.seq, B = m->cfg.batch;
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)(B * (T + 2)));
    float* loss = (float*)malloc(sizeof(float) * (size_t)(B * T)); /* [B, T] */
    mst_status st = tok && loss ? MST_OK : mst_set_error(MST_ERR_OOM, "eval: a batch of %lld windows", (long long)B);
    const float hyper[MST_N_HYPER] = {0.0f, 1.0f, 1.0f};
    for (int64_t first = 0; first < n_win && st == MST_OK; first += B) {
        stage_windows(d, T, B, first, n_win, tok);
        st = mst_model_stage(m, 0, tok, hyper);
        if (st == MST_OK) st = mst_model_upload(m, 0);
        if (st == MST_OK) st = mst_step_eval(m, first == 0); /* the memory manager measures its first step */
        mst_step_record r;
        if (st == MST_OK) st = mst_step_read(m, &r);
        if (st == MST_OK && r.flag)
            st = mst_set_error(MST_ERR_STATE, "eval: the step raised flag %d (R = N k rows cannot overflow)", r.flag);
        if (st == MST_OK) st = mst_copy_b2h(m->ctx, loss, m->loss_main, sizeof(float) * (size_t)(B * T));
        for (int64_t b = 0; st == MST_OK && b < B && first + b < n_win; b++) {
            double s = 0;
            for (int64_t t = 0; t < T; t++) s += loss[b * T + t];
            wsum[first + b] = s;
        }
    }
    free(tok), free(loss);
    return st;
}

mst_status mst_eval_run(mst_ctx_t* ctx, const mst_eval_config* c, mst_eval_result* out) {
    memset(out, 0, sizeof *out);
    mst_model_config mc;
    MST_TRY(model_config(c, &mc));
    mst_data d;
    MST_TRY(mst_data_file(&d, "--data", c->data_path, mc.vocab, c->seq + 1, 0));
    const int64_t fit = d.n / (c->seq + 1);
    if (c->n_windows > fit) {
        mst_data_free(&d);
        return mst_set_error(MST_ERR_INVALID, "--windows %lld: '%s' holds %lld windows of --seq + 1 = %lld tokens",
                             (long long)c->n_windows, c->data_path, (long long)fit, (long long)(c->seq + 1));
    }
    const int64_t n_win = c->n_windows > 0 ? c->n_windows : fit;
    out->window_loss = (double*)calloc((size_t)n_win, sizeof(double));
    mst_model* m = NULL;
    mst_status st = out->window_loss ? mst_model_create(ctx, &mc, 1, NULL, &m)
                                     : mst_set_error(MST_ERR_OOM, "eval: %lld windows", (long long)n_win);
    if (st == MST_OK) st = mst_ckpt_init_from(m, c->model_dir);
    if (st == MST_OK) st = run_windows(m, &d, n_win, out->window_loss);
    mst_model_destroy(m);
    mst_data_free(&d);
    if (st != MST_OK) {
        mst_eval_result_free(out);
        return st;
    }
    double sum = 0; /* the windows in order: the same bits whatever B */
    for (int64_t w = 0; w < n_win; w++) sum += out->window_loss[w];
    for (int64_t w = 0; w < n_win; w++) out->window_loss[w] /= (double)c->seq;
    out->windows = n_win;
    out->tokens = n_win * c->seq;
    out->loss = sum / (double)out->tokens;
    return MST_OK;
}

void mst_eval_result_free(mst_eval_result* r) {
    free(r->window_loss);
    memset(r, 0, sizeof *r);
}
