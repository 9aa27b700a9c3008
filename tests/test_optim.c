/*
 * test_optim.c — the trainer's optimizer (src/trainer/model/optim.c) on the backend
 * named by --backend: the learning-rate schedule against values worked out
 * by hand (linear warmup whose first step is lr / warmup, cosine decay to
 * min_lr_frac), and one clipped AdamW step of a small model against a
 * float64 host reference: the clipping norm over every parameter (norm
 * weights included), weight decay on the matrices only, the bf16 weights
 * the nearest-even rounding of the new master weights; the same step with
 * bf16 moments (--adam-moments bf16) against the float64 reference of the
 * same rounding (moments read from bf16, updated, stored rounded to nearest
 * even: each stored moment the reference's rounding, or one bf16 ulp off
 * only where the float64 value lies within 2^-20 of the midpoint between
 * the two, a few fp32 roundings, which near-ties of 0.95 times a bf16
 * value make common: about 1 in 1000), and its moments' bytes half the
 * fp32 moments'.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/model/model.h"

static mst_optim_config optim(void) {
    mst_optim_config o = {.lr = 1e-2f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 4, .steps = 24};
    return o;
}

static void test_schedule(void) {
    const mst_optim_config o = optim();
    /* step: expected lr (warmup 4, then 20 steps of cosine from 1e-2 to 1e-3) */
    static const struct { int64_t step; double lr; } want[] = {
        {1, 2.5e-3}, {2, 5e-3}, {3, 7.5e-3}, {4, 1e-2},
        {14, 5.5e-3},  /* half way: (1e-2 + 1e-3) / 2 */
        {9, 1e-3 + 9e-3 * (1 + 0.70710678118654752) / 2}, /* a quarter: cos(pi / 4) */
        {24, 1e-3}, {30, 1e-3}, /* the end, and past it */
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        double got = mst_optim_lr(&o, want[i].step);
        CHECK(fabs(got - want[i].lr) <= 1e-6 * want[i].lr, "lr at step %lld: %.9g, expected %.9g",
              (long long)want[i].step, got, want[i].lr);
    }
}

static mst_model_config tiny(void) {
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 32, .n_head = 2,
                          .n_kv_head = 1, .head_dim = 16, .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 16, .batch = 2,
                          .layers = 1, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f,
                          .seed = 5};
    return m;
}

static float* host_f32(size_t n) { return (float*)malloc(sizeof(float) * n); }

/* Relative norm error of the update (after - before) against want, over [lo, hi). */
static double update_err(const float* after, const float* before, const double* want, int64_t lo, int64_t hi) {
    double num = 0, den = 0;
    for (int64_t i = lo; i < hi; i++) {
        double d = ((double)after[i] - before[i]) - want[i];
        num += d * d;
        den += want[i] * want[i];
    }
    return isnan(num) ? INFINITY : sqrt(num / den);
}

/* Gradients: small on the matrices, large on the norm weights, so the norm
 * weights decide the clipping; moments from an earlier step. */
/* host [n] fp32 -> backend moments of elem bytes (bf16: values already bf16). */
static void put_moments(mst_ctx_t* ctx, void* dst, const float* host, int64_t n, int bf16) {
    if (!bf16) {
        CHECK_OK(mst_copy_h2b(ctx, dst, host, sizeof(float) * (size_t)n));
        return;
    }
    uint16_t* h = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) h[i] = mst_ref_bf16(host[i]);
    CHECK_OK(mst_copy_h2b(ctx, dst, h, sizeof(uint16_t) * (size_t)n));
    free(h);
}

/* Stored moments against want [n] (float64): fp32 within 1e-5 relative
 * (norm); bf16: the nearest-even rounding of want, but for at most 1 in
 * 1000 one bf16 ulp away. */
static void check_moments(mst_ctx_t* ctx, const void* got_dev, const double* want, int64_t n, int bf16, const char* what) {
    if (!bf16) {
        float* got = host_f32((size_t)n);
        CHECK_OK(mst_copy_b2h(ctx, got, got_dev, sizeof(float) * (size_t)n));
        const double e = mst_rel_err_fp32(got, want, (size_t)n);
        CHECK(e < 1e-5, "%s (fp32): rel err %.3e", what, e);
        free(got);
        return;
    }
    uint16_t* got = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)n);
    CHECK_OK(mst_copy_b2h(ctx, got, got_dev, sizeof(uint16_t) * (size_t)n));
    int64_t off = 0, far = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t r = mst_ref_bf16(want[i]);
        if (got[i] == r) continue;
        off++;
        /* the other side of a rounding midpoint: only within a few fp32 roundings of it */
        const double mid = (mst_ref_bf16_value(got[i]) + mst_ref_bf16_value(r)) / 2;
        far += abs((int)got[i] - (int)r) > 1 || fabs(want[i] - mid) > 0x1p-20 * fabs(want[i]);
    }
    CHECK(far == 0, "%s (bf16): %lld of %lld not the nearest-even rounding of the float64 reference, %lld of them "
          "not within 2^-20 of the midpoint they fell on the other side of", what, (long long)off, (long long)n, (long long)far);
    printf("  %s, bf16: %lld of %lld one ulp from the float64 reference's rounding, each within 2^-20 of a midpoint\n", what,
           (long long)off, (long long)n);
    free(got);
}

static void test_step(mst_ctx_t* ctx, int bf16) {
    const mst_model_config cfg = tiny();
    mst_model* m = NULL;
    mst_mem_config mem = mst_mem_config_default();
    mem.moments_bf16 = bf16;
    CHECK_OK(mst_model_create(ctx, &cfg, 1, &mem, &m));
    if (!m) return;
    const int64_t n = m->n_params, nd = m->n_decay;
    CHECK(nd > 0 && nd < n, "the model has %lld parameters, %lld decayed: expected both kinds", (long long)n,
          (long long)nd);
    float *g = host_f32((size_t)n), *mo = host_f32((size_t)n), *vo = host_f32((size_t)n);
    float *w0 = host_f32((size_t)n), *w1 = host_f32((size_t)n);
    uint16_t* w16 = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)n);
    double* dw = (double*)malloc(sizeof(double) * (size_t)n);
    mst_rng r = {17};
    mst_rng_fp32(&r, g, (size_t)nd, -1e-3, 1e-3);
    mst_rng_fp32(&r, g + nd, (size_t)(n - nd), -1, 1);
    mst_rng_fp32(&r, mo, (size_t)n, -1e-2, 1e-2);
    mst_rng_fp32(&r, vo, (size_t)n, 1e-6, 1e-4);
    for (int64_t i = 0; bf16 && i < n; i++) /* the moments a bf16 state holds */
        mo[i] = (float)mst_ref_bf16_value(mst_ref_bf16(mo[i])), vo[i] = (float)mst_ref_bf16_value(mst_ref_bf16(vo[i]));
    CHECK_OK(mst_copy_h2b(ctx, m->grad, g, sizeof(float) * (size_t)n));
    put_moments(ctx, m->adam_m, mo, n, bf16);
    put_moments(ctx, m->adam_v, vo, n, bf16);
    CHECK_OK(mst_copy_b2h(ctx, w0, m->master, sizeof(float) * (size_t)n));
    const mst_optim_config o = optim();
    const int64_t step = 3; /* in the warmup: lr 7.5e-3 */
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)g[i] * g[i];
    const double lr = 7.5e-3, gs = sqrt(ss) > o.clip ? o.clip / sqrt(ss) : 1.0;
    const double c1 = 1 - pow(o.beta1, step), c2 = 1 - pow(o.beta2, step);
    double* m1 = (double*)malloc(sizeof(double) * (size_t)n); /* [n] the moments after the step */
    double* v1 = (double*)malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        double gg = g[i] * gs, mm = o.beta1 * mo[i] + (1 - o.beta1) * gg, vv = o.beta2 * vo[i] + (1 - o.beta2) * gg * gg;
        double decay = i < nd ? lr * o.weight_decay * w0[i] : 0.0;
        dw[i] = -decay - lr * (mm / c1) / (sqrt(vv / c2) + o.eps);
    }
    float hyper[MST_N_HYPER];
    mst_optim_hyper(&o, step, hyper);
    int32_t* tok = (int32_t*)calloc((size_t)(cfg.batch * (cfg.seq + 2)), sizeof(int32_t));
    CHECK_OK(mst_model_stage(m, 0, tok, hyper));
    CHECK_OK(mst_model_upload(m, 0));
    CHECK_OK(mst_optim_step(m, &o));
    free(tok);
    CHECK_OK(mst_ctx_check(ctx));
    CHECK_OK(mst_copy_b2h(ctx, w1, m->master, sizeof(float) * (size_t)n));
    CHECK_OK(mst_copy_b2h(ctx, w16, m->w, sizeof(uint16_t) * (size_t)n));
    double em = update_err(w1, w0, dw, 0, nd), en = update_err(w1, w0, dw, nd, n);
    CHECK(em < 1e-4, "AdamW update of the matrices: rel err %.3e (clipping over all %lld gradients, decay %g)", em,
          (long long)n, (double)o.weight_decay);
    CHECK(en < 1e-4, "AdamW update of the norm weights: rel err %.3e (no weight decay on them)", en);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += w16[i] != mst_ref_bf16(w1[i]);
    CHECK(bad == 0, "%lld of %lld bf16 weights are not the nearest-even rounding of the master weights",
          (long long)bad, (long long)n);
    /* the moments against the float64 step of the kernel's own clip scale
     * (its fp32 norm): what is left is the per-element arithmetic */
    float ssk = 0;
    CHECK_OK(mst_copy_b2h(ctx, &ssk, m->gsumsq, sizeof(float)));
    const float nk = sqrtf(ssk), gk = nk > o.clip ? o.clip / nk : 1.0f;
    for (int64_t i = 0; i < n; i++) {
        const double gg = (double)(g[i] * gk);
        m1[i] = o.beta1 * (double)mo[i] + (1 - (double)o.beta1) * gg;
        v1[i] = o.beta2 * (double)vo[i] + (1 - (double)o.beta2) * gg * gg;
    }
    check_moments(ctx, m->adam_m, m1, n, bf16, "first moment");
    check_moments(ctx, m->adam_v, v1, n, bf16, "second moment");
    /* the optimizer's bytes: master 4 + moments 2 x (4 or 2) a parameter */
    const size_t want = (size_t)m->n_state * (bf16 ? 8 : 12);
    CHECK(m->mem[MST_MEM_OPTIM] == want, "optimizer bytes %zu, want %zu (%s moments)", m->mem[MST_MEM_OPTIM], want,
          bf16 ? "bf16" : "fp32");
    printf("  AdamW step, %s moments: matrices' update rel err %.2e, norm weights' %.2e; optimizer %zu bytes "
           "(%lld parameters)\n", bf16 ? "bf16" : "fp32", em, en, m->mem[MST_MEM_OPTIM], (long long)n);
    mst_model_destroy(m);
    free(g), free(mo), free(vo), free(w0), free(w1), free(w16), free(dw), free(m1), free(v1);
}

static void run(mst_ctx_t* ctx) {
    test_schedule();
    test_step(ctx, 0);
    test_step(ctx, 1);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
