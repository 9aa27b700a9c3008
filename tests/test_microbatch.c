/*
 * test_microbatch.c — a step is the mean over its microbatches.
 * One step of a model over M = 2 microbatches that are two copies of the
 * same tokens against M = 1 over one copy: per-token losses and
 * load-balancing losses of each microbatch bit for bit, and main_grad of
 * every parameter within fp32 tolerance (the loss gradient and the
 * load-balancing term divided by M; the router weights, where the
 * load-balancing term lands, checked on their own).
 * M = 3 different microbatches under plain, 1F1B and interleaved: the
 * activation sets (a microbatch holds one from its first forward to its
 * last backward) number M, 1 and at most M, the per-token losses are bit for
 * bit plain's and main_grad within fp32 tolerance (summed in another order).
 * The trainer's first step on a corpus of exactly seq + 2 bytes (one
 * window, so every microbatch is the same): with M = 2 the reported loss,
 * MTP loss and load-balancing loss are those of M = 1 (means over
 * microbatches, summed in another order: within 1e-12).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/run/trainer.h"

static mst_train_config tiny(const char* data) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 32, .n_head = 2,
                          .n_kv_head = 1, .head_dim = 16, .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 16, .batch = 3,
                          .layers = 1, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.05f, .norm_eps = 1e-5f, .init_std = 0.02f,
                          .seed = 11};
    mst_optim_config o = {.lr = 1e-2f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 2, .steps = 1};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.microbatches = 1;
    t.steps = 1;
    t.data_path = data;
    return t;
}

static int close_to(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b); }

static void compare(const mst_train_result* one, const mst_train_result* r, int M) {
    for (int64_t i = 0; i < one->steps; i++) {
        CHECK(close_to(r->loss[i], one->loss[i]) && close_to(r->mtp_loss[i], one->mtp_loss[i]),
              "M = %d, step %lld: loss %.12g, mtp %.12g; M = 1: %.12g, %.12g", M, (long long)i + 1, r->loss[i],
              r->mtp_loss[i], one->loss[i], one->mtp_loss[i]);
        CHECK(close_to(r->aux_loss[i], one->aux_loss[i]), "M = %d, step %lld: load-balancing loss %.12g; M = 1: %.12g",
              M, (long long)i + 1, r->aux_loss[i], one->aux_loss[i]);
    }
}

/* Relative norm error of got against want over n elements. */
static double rel_err(const float* got, const float* want, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)got[i] - want[i];
        num += d * d;
        den += (double)want[i] * want[i];
    }
    return isnan(num) ? INFINITY : sqrt(num / den);
}

/* One model of M microbatches (tokens all [M, B, T + 2]) stepped once under
 * the memory config mem (NULL: default); its main_grad, per-token losses
 * [M, N] and load-balancing losses [M, L+1] to host. */
static mst_model* step_tokens(mst_ctx_t* ctx, const mst_model_config* c, const mst_mem_config* mem, int32_t M,
                              const int32_t* all, float** grad, float** loss, float** aux) {
    mst_model* m = NULL;
    CHECK_OK(mst_model_create(ctx, c, M, mem, &m));
    if (!m) return NULL;
    const int64_t N = c->batch * c->seq, L1 = c->layers + 1;
    float hyper[MST_N_HYPER] = {0};
    CHECK_OK(mst_model_stage(m, 0, all, hyper));
    CHECK_OK(mst_model_upload(m, 0));
    CHECK_OK(mst_model_step(m, 1));
    CHECK_OK(mst_ctx_check(ctx));
    *grad = (float*)malloc(sizeof(float) * (size_t)m->n_params);
    *loss = (float*)malloc(sizeof(float) * (size_t)(M * N));
    *aux = (float*)malloc(sizeof(float) * (size_t)(M * L1));
    CHECK_OK(mst_copy_b2h(ctx, *grad, m->grad, sizeof(float) * (size_t)m->n_params));
    CHECK_OK(mst_copy_b2h(ctx, *loss, m->loss_main, sizeof(float) * (size_t)(M * N)));
    CHECK_OK(mst_copy_b2h(ctx, *aux, m->aux_sum, sizeof(float) * (size_t)(M * L1)));
    return m;
}

/* The same over M copies of tok [B, T + 2]. */
static mst_model* step_copies(mst_ctx_t* ctx, const mst_model_config* c, int32_t M, const int32_t* tok, float** grad,
                              float** loss, float** aux) {
    const int64_t per = c->batch * (c->seq + 2);
    int32_t* all = (int32_t*)malloc(sizeof(int32_t) * (size_t)(per * M));
    for (int32_t mb = 0; mb < M; mb++) memcpy(all + mb * per, tok, sizeof(int32_t) * (size_t)per);
    mst_model* m = step_tokens(ctx, c, NULL, M, all, grad, loss, aux);
    free(all);
    return m;
}

/* M = 3 different microbatches under each schedule against plain's. */
static void schedules_share_sets(mst_ctx_t* ctx) {
    const mst_model_config c = tiny(NULL).model;
    const int32_t M = 3;
    const int64_t n = M * c.batch * (c.seq + 2), N = c.batch * c.seq;
    int32_t* all = (int32_t*)malloc(sizeof(int32_t) * (size_t)n);
    mst_rng r = {31};
    for (int64_t i = 0; i < n; i++) all[i] = (int32_t)mst_rng_int(&r, 0, c.vocab - 1);
    const mst_schedule_kind kinds[] = {MST_SCHEDULE_PLAIN, MST_SCHEDULE_1F1B, MST_SCHEDULE_INTERLEAVED};
    float *g0 = NULL, *l0 = NULL, *a0 = NULL;
    for (int k = 0; k < 3; k++) {
        mst_mem_config mem = mst_mem_config_default();
        mem.schedule = kinds[k];
        mem.virtual_stages = kinds[k] == MST_SCHEDULE_INTERLEAVED ? 2 : 1; /* layers + 1 = 2 */
        float *g = NULL, *l = NULL, *a = NULL;
        mst_model* m = step_tokens(ctx, &c, &mem, M, all, &g, &l, &a);
        const char* name = mst_schedule_kind_str(kinds[k]);
        if (m) {
            const int32_t want = kinds[k] == MST_SCHEDULE_PLAIN ? M : 1;
            CHECK(kinds[k] == MST_SCHEDULE_INTERLEAVED ? m->n_sets >= 1 && m->n_sets <= M : m->n_sets == want,
                  "%s: %d activation sets for %d microbatches", name, m->n_sets, M);
            if (k == 0) {
                g0 = g, l0 = l, a0 = a;
                g = l = a = NULL;
            } else if (g0) {
                CHECK(mst_first_diff(l, l0, sizeof(float) * (size_t)(M * N)) < 0, "%s: per-token losses differ "
                      "from plain's", name);
                const double e = rel_err(g, g0, m->n_params);
                CHECK(e < 1e-5, "%s: main_grad rel err %.3e against plain's", name, e);
            }
        }
        mst_model_destroy(m);
        free(g), free(l), free(a);
    }
    free(all), free(g0), free(l0), free(a0);
}

static void model_step(mst_ctx_t* ctx) {
    const mst_model_config c = tiny(NULL).model;
    const int64_t per = c.batch * (c.seq + 2), N = c.batch * c.seq, L1 = c.layers + 1;
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)per);
    mst_rng r = {29};
    for (int64_t i = 0; i < per; i++) tok[i] = (int32_t)mst_rng_int(&r, 0, c.vocab - 1);
    float *g1 = NULL, *l1 = NULL, *a1 = NULL, *g2 = NULL, *l2 = NULL, *a2 = NULL;
    mst_model* one = step_copies(ctx, &c, 1, tok, &g1, &l1, &a1);
    mst_model* two = step_copies(ctx, &c, 2, tok, &g2, &l2, &a2);
    if (one && two) {
        for (int mb = 0; mb < 2; mb++) {
            CHECK(mst_first_diff(l2 + mb * N, l1, sizeof(float) * (size_t)N) < 0,
                  "M = 2, microbatch %d: per-token losses differ from M = 1's", mb);
            CHECK(mst_first_diff(a2 + mb * L1, a1, sizeof(float) * (size_t)L1) < 0,
                  "M = 2, microbatch %d: load-balancing losses differ from M = 1's", mb);
        }
        CHECK(a1[0] > 1e-3, "load-balancing loss %.3g: expected well above 0", (double)a1[0]);
        double e = rel_err(g2, g1, one->n_params);
        CHECK(e < 1e-5, "M = 2 over two copies: main_grad rel err %.3e against M = 1", e);
        for (int32_t l = 0; l < L1; l++) {
            const int64_t o = one->lp[l].wr, n = (int64_t)c.experts * c.hidden;
            e = rel_err(g2 + o, g1 + o, n);
            CHECK(e < 1e-5, "M = 2 over two copies: router weights of layer %d: main_grad rel err %.3e", l, e);
        }
    }
    mst_model_destroy(one);
    mst_model_destroy(two);
    free(tok), free(g1), free(l1), free(a1), free(g2), free(l2), free(a2);
}

static void run(mst_ctx_t* ctx) {
    model_step(ctx);
    schedules_share_sets(ctx);
    const char* path = "test_microbatch_window.txt";
    mst_train_config cfg = tiny(path);
    FILE* f = fopen(path, "w");
    if (!f) {
        CHECK(0, "cannot write %s", path);
        return;
    }
    mst_rng r = {23};
    for (int64_t b = 0; b < cfg.model.seq + 2; b++) fputc((int)mst_rng_int(&r, 32, 126), f);
    fclose(f);
    mst_train_result one = {0};
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &one));
    if (one.loss) {
        CHECK(one.aux_loss[0] > 1e-3 && one.loss[0] > 1, "M = 1: loss %.4g, load-balancing loss %.4g: expected both "
              "well above 0 so that their scale shows", one.loss[0], one.aux_loss[0]);
        for (int k = 0; k < 2; k++) { /* M = 2 under two schedules */
            mst_train_result res = {0};
            cfg.microbatches = 2;
            cfg.mem.schedule = k == 0 ? MST_SCHEDULE_PLAIN : MST_SCHEDULE_1F1B;
            CHECK_OK(mst_train_run(ctx, &cfg, NULL, &res));
            if (res.loss) compare(&one, &res, 2);
            mst_train_result_free(&res);
        }
    }
    mst_train_result_free(&one);
    remove(path);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
