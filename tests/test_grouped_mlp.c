/*
 * test_grouped_mlp.c — the grouped MLP (docs/DESIGN.md) on the backend
 * named by --backend, against float64 references:
 *   - the activation alone through the backend slots: z, dh, dprobs (with the
 *     fc2 bias term), the clamp masks exactly zero, padding rows untouched;
 *   - forward y and backward dx, dprobs, dW1, db1, dW2, db2 for both
 *     activations, with and without biases;
 *   - RECOMPUTE of fc2_input bit-identical to KEEP; every saved name
 *     produced/committed/fetched/released once and only under its own policy;
 *   - ACCUMULATE and DEFERRED through the MLP (DEFERRED bit-identical);
 *   - bad input: probs of the wrong length or dtype, counts, config, saver;
 *   - CUDA: forward + backward captured in one graph, replayed with new counts.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/internal.h"
#include "harness.h"
#ifdef MST_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static double bf(uint16_t v) { return (double)mst_bf16_to_fp32(v); }

/* ---- float64 activation (written independently of the library) ---------- */

typedef struct ref_act {
    int clamped;
    double limit, alpha;
} ref_act;

static double sigm(double v) { return 1.0 / (1.0 + exp(-v)); }

/* z0 of (a, b); with g != NULL also *da, *db for upstream g. */
static double ref_act_eval(const ref_act* q, double a, double b, double g, double* da, double* db) {
    double alpha = q->clamped ? q->alpha : 1.0;
    int a_live = !q->clamped || a <= q->limit;
    int b_live = !q->clamped || (b >= -q->limit && b <= q->limit);
    if (q->clamped) {
        a = a < q->limit ? a : q->limit;
        b = (b < -q->limit ? -q->limit : b > q->limit ? q->limit : b) + 1.0;
    }
    double s = sigm(alpha * a);
    if (da) *da = a_live ? g * b * (s + alpha * a * s * (1.0 - s)) : 0.0;
    if (db) *db = b_live ? g * a * s : 0.0;
    return a * s * b;
}

static ref_act ref_act_of(const mst_mlp_config* cfg) {
    ref_act q = {cfg->act == MST_ACT_CLAMPED_SWIGLU, cfg->clamp_limit, cfg->clamp_alpha};
    return q;
}

/* Rows [n, R) of a [R, row_bytes] host buffer still hold the poison. */
static int padding_poisoned(const void* host, int64_t n, int64_t R, int64_t row_bytes) {
    const unsigned char* p = (const unsigned char*)host;
    for (int64_t i = n * row_bytes; i < R * row_bytes; i++)
        if (p[i] != MST_POISON) return 0;
    return 1;
}

static void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) abort();
    return p;
}

static int64_t* offsets_of(const int32_t* counts, int E) {
    int64_t* off = (int64_t*)xmalloc(sizeof(int64_t) * (size_t)(E + 1));
    off[0] = 0;
    for (int g = 0; g < E; g++) off[g + 1] = off[g] + counts[g];
    return off;
}

/* ======================================================================== *
 * 1. the activation alone, through the backend slots
 * ======================================================================== */

typedef struct act_case {
    int E;
    int64_t F, H, total, R;
    mst_activation act;
    int bias; /* the fc2 bias term in dprobs */
} act_case;

/* The same activation with h read from the pages of a stash (random page
 * rows, device pages only or half of them spilled to the host block) gives
 * the bits of h in memory: z, dh, dprobs. */
static void act_paged_h(mst_ctx_t* ctx, mst_rng* rng, const mst_act_args* a, const mst_guarded* gc,
                        const uint16_t* z, const uint16_t* dh, const float* dp, mst_guarded* gz, mst_guarded* gdh,
                        mst_guarded* gdp) {
    static const int64_t page_rows[] = {8, 16, 64};
    mst_pool_config pc = mst_pool_config_default(1);
    pc.page_rows = page_rows[mst_rng_next(rng) % 3];
    const int64_t need = (a->max_rows + pc.page_rows - 1) / pc.page_rows;
    const int spill = (int)(mst_rng_next(rng) % 2);
    pc.n_dev_pages = spill ? need / 2 : need;
    pc.n_host_pages = spill ? need - need / 2 : 0;
    mst_pool_t* pool = NULL;
    mst_stash_handle_t* h = NULL;
    CHECK_OK(mst_pool_create(ctx, MST_DTYPE_BF16, 2 * a->ffn, &pc, &pool));
    CHECK_OK(mst_stash_handle_create(pool, a->max_rows, &h));
    mst_tensor ht = mst_tensor_make((void*)a->h, MST_DTYPE_BF16, a->max_rows, 2 * a->ffn);
    mst_tensor counts = mst_tensor_make(gc->data, MST_DTYPE_INT32, a->n_groups, 1);
    CHECK_OK(mst_stash_save(pool, h, &ht, &counts));
    mst_act_args b = *a;
    CHECK_OK(mst_stash_handle_pages(h, &b.h_pages));
    b.h = NULL;
    mst_guarded* outs[] = {gz, gdh, gdp};
    for (int i = 0; i < 3; i++) mst_guarded_put(ctx, outs[i], NULL); /* poisoned again */
    CHECK_OK(ctx->be->act_forward(ctx, &b));
    CHECK_OK(ctx->be->act_backward(ctx, &b));
    CHECK_OK(mst_ctx_check(ctx));
    void* got[3] = {malloc(gz->n_bytes), malloc(gdh->n_bytes), malloc(gdp->n_bytes)};
    const void* want[3] = {z, dh, dp};
    const char* names[3] = {"z", "dh", "dprobs"};
    for (int i = 0; i < 3; i++) {
        mst_guarded_get(ctx, outs[i], got[i]);
        int64_t bad = mst_first_diff(got[i], want[i], outs[i]->n_bytes);
        CHECK(bad < 0, "paged h (%lld rows per page, spill %d): %s differs at byte %lld", (long long)pc.page_rows,
              spill, names[i], (long long)bad);
        free(got[i]);
    }
    CHECK_OK(mst_stash_restore_return(pool, h));
    mst_stash_handle_destroy(h);
    mst_pool_destroy(pool);
}

static void act_run(mst_ctx_t* ctx, mst_rng* rng, const act_case* c) {
    const int E = c->E;
    const int64_t F = c->F, H = c->H, R = c->R;
    mst_mlp_config cfg = mst_mlp_config_default(E, H, F);
    cfg.act = c->act;
    const ref_act q = ref_act_of(&cfg);
    int32_t* counts = (int32_t*)xmalloc(4 * (size_t)E);
    mst_rng_counts(rng, counts, E, c->total, 0.6);
    int64_t* off = offsets_of(counts, E);
    const int64_t n = off[E];
    uint16_t* h = (uint16_t*)xmalloc(2 * (size_t)(R * 2 * F));
    uint16_t* dz = (uint16_t*)xmalloc(2 * (size_t)(R * F));
    uint16_t* dy = (uint16_t*)xmalloc(2 * (size_t)(R * H));
    uint16_t* b2 = (uint16_t*)xmalloc(2 * (size_t)(E * H));
    float* p = (float*)xmalloc(4 * (size_t)R);
    mst_rng_bf16(rng, h, (size_t)(R * 2 * F), 4.0); /* |h| > 7 on some elements */
    mst_rng_bf16(rng, dz, (size_t)(R * F), 1.0);
    mst_rng_bf16(rng, dy, (size_t)(R * H), 1.0);
    mst_rng_bf16(rng, b2, (size_t)(E * H), 0.5);
    mst_rng_fp32(rng, p, (size_t)R, 0.05, 1.0);

    double* rz = (double*)calloc((size_t)(R * F), 8);
    double* rdh = (double*)calloc((size_t)(R * 2 * F), 8);
    double* rdp = (double*)calloc((size_t)R, 8);
    int64_t n_masked = 0;
    for (int g = 0; g < E; g++)
        for (int64_t r = off[g]; r < off[g + 1]; r++) {
            double dp = 0;
            for (int64_t k = 0; k < F; k++) {
                double a = bf(h[r * 2 * F + k]), b = bf(h[r * 2 * F + F + k]), d = bf(dz[r * F + k]);
                double z0 = ref_act_eval(&q, a, b, d * p[r], &rdh[r * 2 * F + k], &rdh[r * 2 * F + F + k]);
                rz[r * F + k] = z0 * p[r];
                dp += d * z0;
                n_masked += q.clamped && (a > q.limit || fabs(b) > q.limit);
            }
            if (c->bias)
                for (int64_t o = 0; o < H; o++) dp += bf(dy[r * H + o]) * bf(b2[(int64_t)g * H + o]);
            rdp[r] = dp;
        }

    mst_guarded gc = mst_guarded_alloc(ctx, 4 * (size_t)E), gh = mst_guarded_alloc(ctx, 2 * (size_t)(R * 2 * F)),
                gp = mst_guarded_alloc(ctx, 4 * (size_t)R), gz = mst_guarded_alloc(ctx, 2 * (size_t)(R * F)),
                gdz = mst_guarded_alloc(ctx, 2 * (size_t)(R * F)), gdy = mst_guarded_alloc(ctx, 2 * (size_t)(R * H)),
                gb2 = mst_guarded_alloc(ctx, 2 * (size_t)(E * H)), gdh = mst_guarded_alloc(ctx, 2 * (size_t)(R * 2 * F)),
                gdp = mst_guarded_alloc(ctx, 4 * (size_t)R);
    mst_guarded_put(ctx, &gc, counts);
    mst_guarded_put(ctx, &gh, h);
    mst_guarded_put(ctx, &gp, p);
    mst_guarded_put(ctx, &gdz, dz);
    mst_guarded_put(ctx, &gdy, dy);
    mst_guarded_put(ctx, &gb2, b2);
    mst_act_args a = {0};
    a.n_groups = E, a.max_rows = R, a.ffn = F, a.hidden = H;
    a.counts = (const int32_t*)gc.data, a.h = (const uint16_t*)gh.data, a.probs = (const float*)gp.data;
    a.z = (uint16_t*)gz.data, a.dz = (const uint16_t*)gdz.data, a.dh = (uint16_t*)gdh.data;
    a.dprobs = (float*)gdp.data;
    a.dy = c->bias ? (const uint16_t*)gdy.data : NULL, a.b2 = c->bias ? (const uint16_t*)gb2.data : NULL;
    a.act = cfg.act, a.limit = cfg.clamp_limit, a.alpha = cfg.clamp_alpha;
    CHECK(ctx->be->act_forward && ctx->be->act_backward, "backend %s has no activation slots", ctx->be->name);
    if (!ctx->be->act_forward || !ctx->be->act_backward) goto done;
    CHECK_OK(ctx->be->act_forward(ctx, &a));
    CHECK_OK(ctx->be->act_backward(ctx, &a));
    CHECK_OK(mst_ctx_check(ctx));

    uint16_t* z = (uint16_t*)xmalloc(gz.n_bytes);
    uint16_t* dh = (uint16_t*)xmalloc(gdh.n_bytes);
    float* dp = (float*)xmalloc(gdp.n_bytes);
    mst_guarded_get(ctx, &gz, z);
    mst_guarded_get(ctx, &gdh, dh);
    mst_guarded_get(ctx, &gdp, dp);
    double ez = mst_rel_err_bf16(z, rz, (size_t)(n * F)), edh = mst_rel_err_bf16(dh, rdh, (size_t)(n * 2 * F)),
           edp = mst_rel_err_fp32(dp, rdp, (size_t)n);
    CHECK(ez < MST_TOL_BF16, "act %d F=%lld n=%lld: z rel err %.3g", c->act, (long long)F, (long long)n, ez);
    CHECK(edh < MST_TOL_BF16, "act %d F=%lld n=%lld: dh rel err %.3g", c->act, (long long)F, (long long)n, edh);
    CHECK(edp < MST_TOL_FP32, "act %d F=%lld n=%lld bias %d: dprobs rel err %.3g", c->act, (long long)F,
          (long long)n, c->bias, edp);
    /* The clamp masks: an active clamp gives a gradient of exactly zero. */
    int64_t mask_bad = 0;
    for (int64_t r = 0; r < n && q.clamped; r++)
        for (int64_t k = 0; k < F; k++) {
            double av = bf(h[r * 2 * F + k]), bv = bf(h[r * 2 * F + F + k]);
            mask_bad += av > q.limit && dh[r * 2 * F + k] != 0;
            mask_bad += fabs(bv) > q.limit && dh[r * 2 * F + F + k] != 0;
        }
    CHECK(!q.clamped || n == 0 || n_masked > 0, "no clamp was active: the mask check is vacuous");
    CHECK(mask_bad == 0, "%lld clamped elements got a nonzero gradient", (long long)mask_bad);
    CHECK(padding_poisoned(z, n, R, 2 * F), "z: padding rows written");
    CHECK(padding_poisoned(dh, n, R, 4 * F), "dh: padding rows written");
    CHECK(padding_poisoned(dp, n, R, 4), "dprobs: padding rows written");
    CHECK(mst_guarded_intact(ctx, &gz) && mst_guarded_intact(ctx, &gdh) && mst_guarded_intact(ctx, &gdp),
          "activation: guard bytes overwritten");
    act_paged_h(ctx, rng, &a, &gc, z, dh, dp, &gz, &gdh, &gdp);
    free(z), free(dh), free(dp);
done:;
    mst_guarded* all[] = {&gc, &gh, &gp, &gz, &gdz, &gdy, &gb2, &gdh, &gdp};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mst_guarded_free(ctx, all[i]);
    free(counts), free(off), free(h), free(dz), free(dy), free(b2), free(p), free(rz), free(rdh), free(rdp);
}

/* Bad counts reach the activation: flag set, nothing written outside. */
static void act_bad_counts(mst_ctx_t* ctx, mst_rng* rng, const int32_t* bad, int E) {
    const int64_t R = 24, F = 16;
    mst_guarded gc = mst_guarded_alloc(ctx, 4 * (size_t)E), gh = mst_guarded_alloc(ctx, 2 * (size_t)(R * 2 * F)),
                gp = mst_guarded_alloc(ctx, 4 * (size_t)R), gz = mst_guarded_alloc(ctx, 2 * (size_t)(R * F)),
                gdh = mst_guarded_alloc(ctx, 2 * (size_t)(R * 2 * F)), gdp = mst_guarded_alloc(ctx, 4 * (size_t)R);
    uint16_t* h = (uint16_t*)xmalloc(gh.n_bytes);
    float* p = (float*)xmalloc(gp.n_bytes);
    mst_rng_bf16(rng, h, (size_t)(R * 2 * F), 1.0);
    mst_rng_fp32(rng, p, (size_t)R, 0.1, 1.0);
    mst_guarded_put(ctx, &gc, bad);
    mst_guarded_put(ctx, &gh, h);
    mst_guarded_put(ctx, &gp, p);
    mst_act_args a = {0};
    a.n_groups = E, a.max_rows = R, a.ffn = F, a.hidden = 1;
    a.counts = (const int32_t*)gc.data, a.h = (const uint16_t*)gh.data, a.probs = (const float*)gp.data;
    a.z = (uint16_t*)gz.data, a.dz = (const uint16_t*)gh.data, a.dh = (uint16_t*)gdh.data,
    a.dprobs = (float*)gdp.data, a.act = MST_ACT_SWIGLU;
    mst_status want_now = mst_ctx_backend(ctx) == MST_BACKEND_CPU ? MST_ERR_COUNTS : MST_OK;
    CHECK_STATUS(ctx->be->act_forward(ctx, &a), want_now);
    CHECK_STATUS(ctx->be->act_backward(ctx, &a), want_now);
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS);
    CHECK(mst_guarded_intact(ctx, &gz) && mst_guarded_intact(ctx, &gdh) && mst_guarded_intact(ctx, &gdp),
          "activation with bad counts: guard bytes overwritten");
    mst_guarded* all[] = {&gc, &gh, &gp, &gz, &gdh, &gdp};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mst_guarded_free(ctx, all[i]);
    free(h), free(p);
}

/* ======================================================================== *
 * 2. the MLP end to end
 * ======================================================================== */

typedef struct mlp_case {
    int E;
    int64_t H, F, total, R;
    double skew;
    int bias;
    mst_activation act;
} mlp_case;

/* Host inputs and float64 references of one case. */
typedef struct mlp_host {
    int32_t* counts;                      /* [E]                               */
    uint16_t *x, *w1, *b1, *w2, *b2, *dy; /* [R,H] [E*2F,H] [E,2F] [E*H,F] [E,H] [R,H] */
    float* p;                             /* [R]                               */
    double *y, *dx, *dp;                  /* [R,H] [R,H] [R]                   */
    double *gw1, *gb1, *gw2, *gb2;        /* [E*2F,H] [E,2F] [E*H,F] [E,H]     */
} mlp_host;

/* One row r of group g: the float64 forward and backward, summed into h->g*. */
static void ref_row(const mlp_case* c, const mst_mlp_config* cfg, mlp_host* m, int g, int64_t r,
                    double* hh, double* z0, double* dz, double* dh) {
    const int64_t H = c->H, F = c->F;
    const ref_act q = ref_act_of(cfg);
    const uint16_t *w1 = m->w1 + (int64_t)g * 2 * F * H, *w2 = m->w2 + (int64_t)g * H * F;
    const uint16_t *x = m->x + r * H, *dy = m->dy + r * H;
    const double p = m->p[r];
    for (int64_t k = 0; k < 2 * F; k++) {
        double acc = c->bias ? bf(m->b1[(int64_t)g * 2 * F + k]) : 0.0;
        for (int64_t i = 0; i < H; i++) acc += bf(x[i]) * bf(w1[k * H + i]);
        hh[k] = bf(mst_fp32_to_bf16((float)acc)); /* act_input is bf16: the clamp masks see these bits */
    }
    for (int64_t k = 0; k < F; k++) z0[k] = ref_act_eval(&q, hh[k], hh[F + k], 0, NULL, NULL);
    double dp = 0;
    for (int64_t o = 0; o < H; o++) {
        double acc = c->bias ? bf(m->b2[(int64_t)g * H + o]) * p : 0.0;
        for (int64_t k = 0; k < F; k++) acc += z0[k] * p * bf(w2[o * F + k]);
        m->y[r * H + o] = acc;
        if (c->bias) {
            dp += bf(dy[o]) * bf(m->b2[(int64_t)g * H + o]);
            m->gb2[(int64_t)g * H + o] += bf(dy[o]) * p;
        }
        for (int64_t k = 0; k < F; k++) m->gw2[((int64_t)g * H + o) * F + k] += bf(dy[o]) * z0[k] * p;
    }
    for (int64_t k = 0; k < F; k++) {
        double acc = 0;
        for (int64_t o = 0; o < H; o++) acc += bf(dy[o]) * bf(w2[o * F + k]);
        dz[k] = acc;
        dp += acc * z0[k];
        ref_act_eval(&q, hh[k], hh[F + k], acc * p, &dh[k], &dh[F + k]);
    }
    m->dp[r] = dp;
    for (int64_t i = 0; i < H; i++) {
        double acc = 0;
        for (int64_t k = 0; k < 2 * F; k++) acc += dh[k] * bf(w1[k * H + i]);
        m->dx[r * H + i] = acc;
    }
    for (int64_t k = 0; k < 2 * F; k++) {
        if (c->bias) m->gb1[(int64_t)g * 2 * F + k] += dh[k];
        for (int64_t i = 0; i < H; i++) m->gw1[((int64_t)g * 2 * F + k) * H + i] += dh[k] * bf(x[i]);
    }
}

static void reference(const mlp_case* c, const mst_mlp_config* cfg, mlp_host* m) {
    const int64_t H = c->H, F = c->F, E = c->E;
    memset(m->gw1, 0, 8 * (size_t)(E * 2 * F * H));
    memset(m->gb1, 0, 8 * (size_t)(E * 2 * F));
    memset(m->gw2, 0, 8 * (size_t)(E * H * F));
    memset(m->gb2, 0, 8 * (size_t)(E * H));
    double* hh = (double*)xmalloc(8 * (size_t)(2 * F));
    double* z0 = (double*)xmalloc(8 * (size_t)F);
    double* dz = (double*)xmalloc(8 * (size_t)F);
    double* dh = (double*)xmalloc(8 * (size_t)(2 * F));
    int64_t* off = offsets_of(m->counts, c->E);
    for (int g = 0; g < c->E; g++)
        for (int64_t r = off[g]; r < off[g + 1]; r++) ref_row(c, cfg, m, g, r, hh, z0, dz, dh);
    free(hh), free(z0), free(dz), free(dh), free(off);
}

static void host_make(mst_rng* rng, const mlp_case* c, mlp_host* m) {
    const int64_t H = c->H, F = c->F, E = c->E, R = c->R;
    m->counts = (int32_t*)xmalloc(4 * (size_t)E);
    mst_rng_counts(rng, m->counts, c->E, c->total, c->skew);
    m->x = (uint16_t*)xmalloc(2 * (size_t)(R * H));
    m->w1 = (uint16_t*)xmalloc(2 * (size_t)(E * 2 * F * H));
    m->b1 = (uint16_t*)xmalloc(2 * (size_t)(E * 2 * F));
    m->w2 = (uint16_t*)xmalloc(2 * (size_t)(E * H * F));
    m->b2 = (uint16_t*)xmalloc(2 * (size_t)(E * H));
    m->dy = (uint16_t*)xmalloc(2 * (size_t)(R * H));
    m->p = (float*)xmalloc(4 * (size_t)R);
    mst_rng_bf16(rng, m->x, (size_t)(R * H), 1.0);
    mst_rng_bf16(rng, m->w1, (size_t)(E * 2 * F * H), 4.0 / sqrt((double)H)); /* h ~ 4: clamps active */
    mst_rng_bf16(rng, m->b1, (size_t)(E * 2 * F), 1.0);
    mst_rng_bf16(rng, m->w2, (size_t)(E * H * F), 1.0 / sqrt((double)F));
    mst_rng_bf16(rng, m->b2, (size_t)(E * H), 1.0);
    mst_rng_bf16(rng, m->dy, (size_t)(R * H), 1.0);
    mst_rng_fp32(rng, m->p, (size_t)R, 0.05, 1.0);
    m->y = (double*)calloc((size_t)(R * H), 8);
    m->dx = (double*)calloc((size_t)(R * H), 8);
    m->dp = (double*)calloc((size_t)R, 8);
    m->gw1 = (double*)xmalloc(8 * (size_t)(E * 2 * F * H));
    m->gb1 = (double*)xmalloc(8 * (size_t)(E * 2 * F));
    m->gw2 = (double*)xmalloc(8 * (size_t)(E * H * F));
    m->gb2 = (double*)xmalloc(8 * (size_t)(E * H));
}

static void host_free(mlp_host* m) {
    free(m->counts), free(m->x), free(m->w1), free(m->b1), free(m->w2), free(m->b2), free(m->dy);
    free(m->p), free(m->y), free(m->dx), free(m->dp), free(m->gw1), free(m->gb1), free(m->gw2), free(m->gb2);
}

/* Backend buffers of one case (guarded) and the tensors over them. */
enum { B_COUNTS, B_X, B_P, B_Y, B_DY, B_DX, B_DP, B_W1, B_B1, B_W2, B_B2, B_GW1, B_GB1, B_GW2, B_GB2, N_B };
typedef struct mlp_dev {
    mst_guarded b[N_B];
    mst_tensor counts, x, p, y, dy, dx, dp; /* [E,1] [R,H] [R,1] [R,H] [R,H] [R,H] [R,1] */
    mst_mlp_weights w;
    mst_mlp_config cfg;
} mlp_dev;

static void dev_make(mst_ctx_t* ctx, const mlp_case* c, const mlp_host* m, mlp_dev* d) {
    const int64_t H = c->H, F = c->F, E = c->E, R = c->R;
    const size_t sizes[N_B] = {4 * (size_t)E, 2 * (size_t)(R * H), 4 * (size_t)R, 2 * (size_t)(R * H),
                               2 * (size_t)(R * H), 2 * (size_t)(R * H), 4 * (size_t)R,
                               2 * (size_t)(E * 2 * F * H), 2 * (size_t)(E * 2 * F), 2 * (size_t)(E * H * F),
                               2 * (size_t)(E * H), 4 * (size_t)(E * 2 * F * H), 4 * (size_t)(E * 2 * F),
                               4 * (size_t)(E * H * F), 4 * (size_t)(E * H)};
    const void* host[N_B] = {m->counts, m->x, m->p, NULL, m->dy, NULL, NULL, m->w1, m->b1, m->w2, m->b2};
    for (int i = 0; i < N_B; i++) {
        d->b[i] = mst_guarded_alloc(ctx, sizes[i]);
        mst_guarded_put(ctx, &d->b[i], host[i]);
    }
    d->counts = mst_tensor_make(d->b[B_COUNTS].data, MST_DTYPE_INT32, E, 1);
    d->x = mst_tensor_make(d->b[B_X].data, MST_DTYPE_BF16, R, H);
    d->p = mst_tensor_make(d->b[B_P].data, MST_DTYPE_FP32, R, 1);
    d->y = mst_tensor_make(d->b[B_Y].data, MST_DTYPE_BF16, R, H);
    d->dy = mst_tensor_make(d->b[B_DY].data, MST_DTYPE_BF16, R, H);
    d->dx = mst_tensor_make(d->b[B_DX].data, MST_DTYPE_BF16, R, H);
    d->dp = mst_tensor_make(d->b[B_DP].data, MST_DTYPE_FP32, R, 1);
    memset(&d->w, 0, sizeof d->w);
    d->w.w1 = mst_tensor_make(d->b[B_W1].data, MST_DTYPE_BF16, E * 2 * F, H);
    d->w.w2 = mst_tensor_make(d->b[B_W2].data, MST_DTYPE_BF16, E * H, F);
    d->w.g_w1 = mst_tensor_make(d->b[B_GW1].data, MST_DTYPE_FP32, E * 2 * F, H);
    d->w.g_w2 = mst_tensor_make(d->b[B_GW2].data, MST_DTYPE_FP32, E * H, F);
    if (c->bias) {
        d->w.b1 = mst_tensor_make(d->b[B_B1].data, MST_DTYPE_BF16, E, 2 * F);
        d->w.b2 = mst_tensor_make(d->b[B_B2].data, MST_DTYPE_BF16, E, H);
        d->w.g_b1 = mst_tensor_make(d->b[B_GB1].data, MST_DTYPE_FP32, E, 2 * F);
        d->w.g_b2 = mst_tensor_make(d->b[B_GB2].data, MST_DTYPE_FP32, E, H);
    }
    d->cfg = mst_mlp_config_default(c->E, H, F);
    d->cfg.act = c->act;
}

static void dev_free(mst_ctx_t* ctx, mlp_dev* d) {
    for (int i = 0; i < N_B; i++) mst_guarded_free(ctx, &d->b[i]);
}

/* A saver that forwards to another and records every call by name, so the
 * test sees which tensor each policy touched. */
typedef struct rec_saver {
    const mst_saver* inner;
    int produced[MST_N_SAVED], committed[MST_N_SAVED], fetched[MST_N_SAVED], released[MST_N_SAVED];
    void* fetched_data[MST_N_SAVED];
    mst_saver saver;
} rec_saver;

static mst_status rec_produce(void* self, mst_saved_name n, int64_t rows, int64_t cols, mst_dtype dt,
                              mst_tensor* out) {
    rec_saver* r = (rec_saver*)self;
    r->produced[n]++;
    return r->inner->produce(r->inner->self, n, rows, cols, dt, out);
}
static mst_status rec_commit(void* self, mst_saved_name n, const mst_tensor* src, const mst_tensor* counts) {
    rec_saver* r = (rec_saver*)self;
    r->committed[n]++;
    return r->inner->commit(r->inner->self, n, src, counts);
}
static mst_status rec_fetch(void* self, mst_saved_name n, mst_tensor* out) {
    rec_saver* r = (rec_saver*)self;
    r->fetched[n]++;
    mst_status st = r->inner->fetch(r->inner->self, n, out);
    r->fetched_data[n] = out->data;
    return st;
}
static mst_status rec_release(void* self, mst_saved_name n) {
    rec_saver* r = (rec_saver*)self;
    r->released[n]++;
    return r->inner->release(r->inner->self, n);
}

static void rec_init(rec_saver* r, const mst_saver* inner) {
    memset(r, 0, sizeof *r);
    r->inner = inner;
    r->saver = (mst_saver){sizeof(mst_saver), r, rec_produce, rec_commit, rec_fetch, rec_release, NULL};
}

/* Outputs of one forward + backward, downloaded. */
typedef struct mlp_out {
    uint16_t *y, *dx;              /* [R,H] */
    float* dp;                     /* [R]   */
    float *gw1, *gb1, *gw2, *gb2;  /* grads */
} mlp_out;

static void out_free(mlp_out* o) {
    free(o->y), free(o->dx), free(o->dp), free(o->gw1), free(o->gb1), free(o->gw2), free(o->gb2);
    memset(o, 0, sizeof *o);
}

static void* download(mst_ctx_t* ctx, const mst_guarded* g) {
    void* h = xmalloc(g->n_bytes);
    mst_guarded_get(ctx, g, h);
    return h;
}

static void out_get(mst_ctx_t* ctx, const mlp_dev* d, mlp_out* o) {
    o->y = (uint16_t*)download(ctx, &d->b[B_Y]);
    o->dx = (uint16_t*)download(ctx, &d->b[B_DX]);
    o->dp = (float*)download(ctx, &d->b[B_DP]);
    o->gw1 = (float*)download(ctx, &d->b[B_GW1]);
    o->gb1 = (float*)download(ctx, &d->b[B_GB1]);
    o->gw2 = (float*)download(ctx, &d->b[B_GW2]);
    o->gb2 = (float*)download(ctx, &d->b[B_GB2]);
    for (int i = 0; i < N_B; i++)
        CHECK(mst_guarded_intact(ctx, &d->b[i]), "buffer %d: guard bytes overwritten", i);
}

/* Poisons the outputs, sets the grads (poison when grad0 is NaN). */
static void outputs_reset(mst_ctx_t* ctx, mlp_dev* d, float grad0) {
    mst_guarded_put(ctx, &d->b[B_Y], NULL);
    mst_guarded_put(ctx, &d->b[B_DX], NULL);
    mst_guarded_put(ctx, &d->b[B_DP], NULL);
    for (int i = B_GW1; i <= B_GB2; i++) {
        if (isnan(grad0)) mst_guarded_put(ctx, &d->b[i], NULL);
        else mst_guarded_fill_fp32(ctx, &d->b[i], grad0);
    }
}

/* Forward + backward with one policy for fc2_input and one wgrad mode. */
static void mlp_run(mst_ctx_t* ctx, mlp_dev* d, int64_t R, mst_policy fc2_policy, mst_wgrad_mode mode,
                    float grad0, mlp_out* o) {
    mst_policy pol[MST_N_SAVED] = {MST_POLICY_KEEP, MST_POLICY_KEEP, fc2_policy, MST_POLICY_KEEP};
    mst_saver_basic_t* basic = NULL;
    CHECK_OK(mst_saver_basic_create(ctx, R, &d->cfg, pol, &basic));
    if (!basic) return;
    rec_saver rec;
    rec_init(&rec, mst_saver_basic_get(basic));
    outputs_reset(ctx, d, grad0);
    CHECK_OK(mst_grouped_mlp_forward(ctx, &d->cfg, &d->w, &d->x, &d->p, &d->counts, &rec.saver, &d->y));
    CHECK_OK(mst_grouped_mlp_backward(ctx, &d->cfg, &d->w, &d->dy, &d->counts, &rec.saver, &d->dx, &d->dp, mode));
    if (mode == MST_WGRAD_DEFERRED) {
        CHECK(mst_wgrad_pending(ctx) == 2, "DEFERRED: %d wgrads pending, expected 2", mst_wgrad_pending(ctx));
        float first = 0;
        mst_copy_b2h(ctx, &first, d->b[B_GW1].data, 4);
        CHECK(first == grad0, "DEFERRED: main_grad changed before the flush");
        /* The scratch the queued wgrads read may not be reused before the flush. */
        CHECK_STATUS(mst_grouped_mlp_backward(ctx, &d->cfg, &d->w, &d->dy, &d->counts, &rec.saver,
                                              &d->dx, &d->dp, mode), MST_ERR_STATE);
        CHECK(strstr(mst_last_error(), "flush") != NULL, "message does not say flush: %s", mst_last_error());
        CHECK_OK(mst_wgrad_flush(ctx));
    }
    CHECK_OK(mst_ctx_check(ctx));
    out_get(ctx, d, o);
    /* Each name went through the saver once, under its own policy only. */
    for (int n = 0; n < MST_N_SAVED; n++) {
        int is_out = n == MST_SAVED_ACT_INPUT || n == MST_SAVED_FC2_INPUT;
        CHECK(rec.produced[n] == is_out && rec.committed[n] == 1 && rec.fetched[n] == 1 && rec.released[n] == 1,
              "%s: produce %d commit %d fetch %d release %d", mst_saved_name_str((mst_saved_name)n),
              rec.produced[n], rec.committed[n], rec.fetched[n], rec.released[n]);
        int recomputed = n == MST_SAVED_FC2_INPUT && fc2_policy == MST_POLICY_RECOMPUTE;
        CHECK((rec.fetched_data[n] == NULL) == recomputed, "%s (%s) fetched data %p",
              mst_saved_name_str((mst_saved_name)n), mst_policy_str(pol[n]), rec.fetched_data[n]);
    }
    mst_saver_basic_destroy(basic);
}

static void expect_bf16(const uint16_t* got, const double* ref, int64_t n, int64_t R, int64_t w,
                        const char* what, const mlp_case* c) {
    double e = mst_rel_err_bf16(got, ref, (size_t)(n * w));
    CHECK(e < MST_TOL_BF16, "%s E=%d H=%lld F=%lld act=%d bias=%d: rel err %.3g", what, c->E,
          (long long)c->H, (long long)c->F, c->act, c->bias, e);
    CHECK(padding_poisoned(got, n, R, 2 * w), "%s: padding rows written", what);
}

/* Gradients and dprobs come from bf16 intermediates (dz, dh, z): bf16 tolerance. */
static void expect_grad(const float* got, const double* ref, size_t n, const char* what, const mlp_case* c) {
    double e = mst_rel_err_fp32(got, ref, n);
    CHECK(e < MST_TOL_BF16, "%s E=%d H=%lld F=%lld act=%d bias=%d: rel err %.3g", what, c->E,
          (long long)c->H, (long long)c->F, c->act, c->bias, e);
}

static void expect_same(const void* a, const void* b, size_t n_bytes, const char* what) {
    int64_t i = mst_first_diff(a, b, n_bytes);
    CHECK(i < 0, "%s: not bit-identical (byte %lld)", what, (long long)i);
}

static void expect_same_out(const mlp_out* a, const mlp_out* b, const mlp_case* c, const char* what) {
    const int64_t H = c->H, F = c->F, E = c->E, R = c->R;
    char buf[128];
    const struct { const void *x, *y; size_t n; const char* name; } t[] = {
        {a->y, b->y, 2 * (size_t)(R * H), "y"},
        {a->dx, b->dx, 2 * (size_t)(R * H), "dx"},
        {a->dp, b->dp, 4 * (size_t)R, "dprobs"},
        {a->gw1, b->gw1, 4 * (size_t)(E * 2 * F * H), "dW1"},
        {a->gw2, b->gw2, 4 * (size_t)(E * H * F), "dW2"},
        {a->gb1, b->gb1, c->bias ? 4 * (size_t)(E * 2 * F) : 0, "db1"},
        {a->gb2, b->gb2, c->bias ? 4 * (size_t)(E * H) : 0, "db2"},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        snprintf(buf, sizeof buf, "%s %s", what, t[i].name);
        expect_same(t[i].x, t[i].y, t[i].n, buf);
    }
}

/* ACCUMULATE from 0.5 against OVERWRITE + 0.5. */
static void expect_accumulated(const float* acc, const float* ovr, size_t n, const char* what) {
    double* want = (double*)xmalloc(8 * n);
    for (size_t i = 0; i < n; i++) want[i] = (double)ovr[i] + 0.5;
    double e = mst_rel_err_fp32(acc, want, n);
    CHECK(e < MST_TOL_FP32, "ACCUMULATE %s: rel err %.3g against OVERWRITE + 0.5", what, e);
    free(want);
}

static void mlp_case_run(mst_ctx_t* ctx, mst_rng* rng, const mlp_case* c) {
    const int64_t H = c->H, F = c->F, E = c->E, R = c->R;
    mlp_host m;
    host_make(rng, c, &m);
    mlp_dev d;
    dev_make(ctx, c, &m, &d);
    reference(c, &d.cfg, &m);
    int64_t n = 0;
    for (int g = 0; g < c->E; g++) n += m.counts[g];

    mlp_out keep = {0}, rec = {0}, acc = {0}, def = {0};
    mlp_run(ctx, &d, R, MST_POLICY_KEEP, MST_WGRAD_OVERWRITE, NAN, &keep);
    if (!keep.y) goto done;
    expect_bf16(keep.y, m.y, n, R, H, "y", c);
    expect_bf16(keep.dx, m.dx, n, R, H, "dx", c);
    expect_grad(keep.dp, m.dp, (size_t)n, "dprobs", c);
    CHECK(padding_poisoned(keep.dp, n, R, 4), "dprobs: padding rows written");
    expect_grad(keep.gw1, m.gw1, (size_t)(E * 2 * F * H), "dW1", c);
    expect_grad(keep.gw2, m.gw2, (size_t)(E * H * F), "dW2", c);
    if (c->bias) {
        expect_grad(keep.gb1, m.gb1, (size_t)(E * 2 * F), "db1", c);
        expect_grad(keep.gb2, m.gb2, (size_t)(E * H), "db2", c);
    }

    mlp_run(ctx, &d, R, MST_POLICY_RECOMPUTE, MST_WGRAD_OVERWRITE, NAN, &rec);
    if (rec.y) expect_same_out(&keep, &rec, c, "RECOMPUTE vs KEEP");

    mlp_run(ctx, &d, R, MST_POLICY_RECOMPUTE, MST_WGRAD_ACCUMULATE, 0.5f, &acc);
    mlp_run(ctx, &d, R, MST_POLICY_RECOMPUTE, MST_WGRAD_DEFERRED, 0.5f, &def);
    if (acc.y && def.y) {
        expect_accumulated(acc.gw1, keep.gw1, (size_t)(E * 2 * F * H), "dW1");
        expect_accumulated(acc.gw2, keep.gw2, (size_t)(E * H * F), "dW2");
        if (c->bias) {
            expect_accumulated(acc.gb1, keep.gb1, (size_t)(E * 2 * F), "db1");
            expect_accumulated(acc.gb2, keep.gb2, (size_t)(E * H), "db2");
        }
        expect_same(acc.dx, keep.dx, 2 * (size_t)(R * H), "ACCUMULATE dx");
        expect_same(acc.dp, keep.dp, 4 * (size_t)R, "ACCUMULATE dprobs");
        expect_same_out(&acc, &def, c, "DEFERRED vs ACCUMULATE");
    }
done:
    out_free(&keep), out_free(&rec), out_free(&acc), out_free(&def);
    dev_free(ctx, &d);
    host_free(&m);
}

/* ======================================================================== *
 * 3. bad input
 * ======================================================================== */

static void expect_named(mst_status got, mst_status want, const char* name, const char* what) {
    CHECK(got == want, "%s: %s, expected %s (%s)", what, mst_status_str(got), mst_status_str(want),
          mst_last_error());
    CHECK(strstr(mst_last_error(), name) != NULL, "%s: message does not name %s: %s", what, name,
          mst_last_error());
}

/* A claim of pages that name no page rows: a saver's bad pages. */
static mst_status bad_claim(void* self, mst_saved_name n, const mst_tensor* counts, mst_pages* out) {
    (void)self, (void)n;
    memset(out, 0, sizeof *out);
    out->table = (const uint32_t*)counts->data; /* any non-NULL table */
    return MST_OK;
}

static void mlp_bad_input(mst_ctx_t* ctx, mst_rng* rng) {
    const mlp_case c = {3, 16, 8, 20, 32, 0.0, 1, MST_ACT_SWIGLU};
    mlp_host m;
    host_make(rng, &c, &m);
    mlp_dev d;
    dev_make(ctx, &c, &m, &d);
    mst_policy keep[MST_N_SAVED] = {0};
    mst_saver_basic_t* basic = NULL;
    CHECK_OK(mst_saver_basic_create(ctx, c.R, &d.cfg, keep, &basic));
    const mst_saver* sv = mst_saver_basic_get(basic);
    mst_mlp_config cfg;
    mst_mlp_weights w;
    mst_tensor t;
#define FWD(cfg_, w_, x_, p_, counts_, sv_, y_) mst_grouped_mlp_forward(ctx, cfg_, w_, x_, p_, counts_, sv_, y_)
    t = d.p, t.rows = c.R - 1; /* a prob tensor of the wrong length */
    expect_named(FWD(&d.cfg, &d.w, &d.x, &t, &d.counts, sv, &d.y), MST_ERR_INVALID, "probs", "probs [R-1, 1]");
    t = d.p, t.dtype = MST_DTYPE_BF16;
    expect_named(FWD(&d.cfg, &d.w, &d.x, &t, &d.counts, sv, &d.y), MST_ERR_INVALID, "probs", "probs bf16");
    t = d.x, t.dtype = MST_DTYPE_FP32;
    expect_named(FWD(&d.cfg, &d.w, &t, &d.p, &d.counts, sv, &d.y), MST_ERR_INVALID, "fp32", "x fp32");
    t = d.y, t.cols = c.H + 1;
    expect_named(FWD(&d.cfg, &d.w, &d.x, &d.p, &d.counts, sv, &t), MST_ERR_INVALID, "y", "y [R, H+1]");
    t = d.counts, t.rows = c.E + 1;
    expect_named(FWD(&d.cfg, &d.w, &d.x, &d.p, &t, sv, &d.y), MST_ERR_INVALID, "counts", "counts [E+1, 1]");
    w = d.w, w.w2.dtype = MST_DTYPE_FP32;
    expect_named(FWD(&d.cfg, &w, &d.x, &d.p, &d.counts, sv, &d.y), MST_ERR_INVALID, "w2", "w2 fp32");
    w = d.w, w.b1.cols = 2 * c.F + 1;
    expect_named(FWD(&d.cfg, &w, &d.x, &d.p, &d.counts, sv, &d.y), MST_ERR_INVALID, "b1", "b1 [E, 2F+1]");
    cfg = d.cfg, cfg.ffn = 0;
    expect_named(FWD(&cfg, &d.w, &d.x, &d.p, &d.counts, sv, &d.y), MST_ERR_INVALID, "ffn", "ffn 0");
    cfg = d.cfg, cfg.act = (mst_activation)9;
    expect_named(FWD(&cfg, &d.w, &d.x, &d.p, &d.counts, sv, &d.y), MST_ERR_INVALID, "act", "act 9");
    cfg = d.cfg, cfg.act = MST_ACT_CLAMPED_SWIGLU, cfg.clamp_limit = -1.0f;
    expect_named(FWD(&cfg, &d.w, &d.x, &d.p, &d.counts, sv, &d.y), MST_ERR_INVALID, "clamp_limit", "limit -1");
    expect_named(FWD(&d.cfg, &d.w, &d.x, &d.p, &d.counts, NULL, &d.y), MST_ERR_INVALID, "saver", "saver NULL");
    rec_saver claims;
    rec_init(&claims, sv);
    claims.saver.claim = bad_claim;
    expect_named(FWD(&d.cfg, &d.w, &d.x, &d.p, &d.counts, &claims.saver, &d.y), MST_ERR_INVALID, "act_input",
                 "claimed pages with page_rows 0");
    expect_named(FWD(NULL, &d.w, &d.x, &d.p, &d.counts, sv, &d.y), MST_ERR_INVALID, "cfg", "cfg NULL");
    /* backward before any forward: the saver has nothing to give */
    CHECK_STATUS(mst_grouped_mlp_backward(ctx, &d.cfg, &d.w, &d.dy, &d.counts, sv, &d.dx, &d.dp,
                                          MST_WGRAD_OVERWRITE), MST_ERR_STATE);
    CHECK_OK(FWD(&d.cfg, &d.w, &d.x, &d.p, &d.counts, sv, &d.y));
    t = d.dp, t.rows = c.R + 1;
    expect_named(mst_grouped_mlp_backward(ctx, &d.cfg, &d.w, &d.dy, &d.counts, sv, &d.dx, &t,
                                          MST_WGRAD_OVERWRITE), MST_ERR_INVALID, "dprobs", "dprobs [R+1, 1]");
    w = d.w, w.g_b1.data = NULL;
    expect_named(mst_grouped_mlp_backward(ctx, &d.cfg, &w, &d.dy, &d.counts, sv, &d.dx, &d.dp,
                                          MST_WGRAD_OVERWRITE), MST_ERR_INVALID, "g_b1", "b1 without g_b1");
    expect_named(mst_grouped_mlp_backward(ctx, &d.cfg, &d.w, &d.dy, &d.counts, sv, &d.dx, &d.dp,
                                          (mst_wgrad_mode)7), MST_ERR_INVALID, "mode", "mode 7");
    CHECK(mst_wgrad_pending(ctx) == 0, "a rejected backward queued wgrads");
    CHECK_OK(mst_ctx_check(ctx));

    /* Bad counts: the CPU says so at once, CUDA at the next check; nothing
     * lands outside the outputs. */
    const int32_t neg[3] = {5, -2, 4}, over[3] = {20, 9, 4}; /* 33 > R = 32 */
    const int32_t* bad[2] = {neg, over};
    const mst_status now = mst_ctx_backend(ctx) == MST_BACKEND_CPU ? MST_ERR_COUNTS : MST_OK;
    for (int i = 0; i < 2; i++) {
        mst_copy_h2b(ctx, d.counts.data, bad[i], sizeof neg);
        CHECK_STATUS(FWD(&d.cfg, &d.w, &d.x, &d.p, &d.counts, sv, &d.y), now);
        CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS);
        CHECK(strstr(mst_last_error(), "counts") != NULL, "bad counts: message %s", mst_last_error());
        for (int b = 0; b < N_B; b++)
            CHECK(mst_guarded_intact(ctx, &d.b[b]), "bad counts %d: buffer %d guards overwritten", i, b);
    }
#undef FWD
    mst_saver_basic_destroy(basic);
    dev_free(ctx, &d);
    host_free(&m);
}

static void saver_api(mst_ctx_t* ctx) {
    for (int n = 0; n < MST_N_SAVED; n++) {
        mst_saved_name back;
        CHECK_OK(mst_saved_name_parse(mst_saved_name_str((mst_saved_name)n), &back));
        CHECK(back == (mst_saved_name)n, "saved name %d does not round-trip", n);
    }
    for (int p = 0; p < MST_N_POLICIES; p++) {
        mst_policy back;
        CHECK_OK(mst_policy_parse(mst_policy_str((mst_policy)p), &back));
        CHECK(back == (mst_policy)p, "policy %d does not round-trip", p);
    }
    mst_policy pol;
    mst_saved_name nm;
    expect_named(mst_policy_parse("stashh", &pol), MST_ERR_INVALID, "stashh", "policy parse");
    expect_named(mst_saved_name_parse("fc3_input", &nm), MST_ERR_INVALID, "fc3_input", "name parse");
    CHECK(strcmp(mst_saved_name_str(MST_SAVED_ACT_INPUT), "act_input") == 0, "act_input name");

    mst_mlp_config cfg = mst_mlp_config_default(2, 16, 8);
    mst_saver_basic_t* s = NULL;
    mst_policy p[MST_N_SAVED] = {MST_POLICY_KEEP, MST_POLICY_STASH, MST_POLICY_KEEP, MST_POLICY_KEEP};
    expect_named(mst_saver_basic_create(ctx, 32, &cfg, p, &s), MST_ERR_UNSUPPORTED, "act_input", "stash");
    p[1] = MST_POLICY_KEEP, p[3] = MST_POLICY_OFFLOAD;
    expect_named(mst_saver_basic_create(ctx, 32, &cfg, p, &s), MST_ERR_UNSUPPORTED, "probs", "offload");
    p[3] = MST_POLICY_KEEP, p[0] = MST_POLICY_RECOMPUTE;
    expect_named(mst_saver_basic_create(ctx, 32, &cfg, p, &s), MST_ERR_UNSUPPORTED, "fc1_input", "recompute x");
    CHECK(s == NULL, "a rejected saver was returned");
    p[0] = MST_POLICY_KEEP;
    CHECK_OK(mst_saver_basic_create(ctx, 32, &cfg, p, &s));
    const mst_saver* sv = mst_saver_basic_get(s);
    mst_tensor t;
    expect_named(sv->produce(sv->self, MST_SAVED_ACT_INPUT, 32, 8, MST_DTYPE_BF16, &t), MST_ERR_INVALID,
                 "act_input", "produce of the wrong width");
    expect_named(sv->fetch(sv->self, MST_SAVED_PROBS, &t), MST_ERR_STATE, "probs", "fetch before commit");
    /* KEEP of a tensor held elsewhere: a bit-exact copy that survives the source. */
    void* src = NULL;
    CHECK_OK(mst_alloc(ctx, 32 * 16 * 2, &src));
    uint16_t host[32 * 16], back[32 * 16];
    mst_rng rng = {77};
    mst_rng_bf16(&rng, host, 32 * 16, 1.0);
    mst_copy_h2b(ctx, src, host, sizeof host);
    mst_tensor x = mst_tensor_make(src, MST_DTYPE_BF16, 32, 16);
    CHECK_OK(sv->commit(sv->self, MST_SAVED_FC1_INPUT, &x, NULL));
    mst_fill(ctx, src, MST_POISON, sizeof host);
    CHECK_OK(sv->fetch(sv->self, MST_SAVED_FC1_INPUT, &t));
    if (t.data) mst_copy_b2h(ctx, back, t.data, sizeof back);
    expect_same(host, back, sizeof host, "KEEP fc1_input");
    CHECK_OK(sv->release(sv->self, MST_SAVED_FC1_INPUT));
    CHECK_STATUS(sv->fetch(sv->self, MST_SAVED_FC1_INPUT, &t), MST_ERR_STATE);
    mst_free(ctx, src);
    mst_saver_basic_destroy(s);
}

/* ======================================================================== *
 * 4. CUDA: one graph of forward + backward, replayed with new counts
 * ======================================================================== */

#ifdef MST_HAVE_CUDA
#define CUDA_OK(call)                                                                         \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                    \
    } while (0)

static void graph_replay(mst_ctx_t* ctx, mst_rng* rng) {
    const mlp_case c = {8, 256, 128, 1500, 2048, 0.8, 1, MST_ACT_CLAMPED_SWIGLU};
    mlp_host m;
    host_make(rng, &c, &m);
    mlp_dev d;
    dev_make(ctx, &c, &m, &d);
    mst_policy pol[MST_N_SAVED] = {MST_POLICY_KEEP, MST_POLICY_KEEP, MST_POLICY_RECOMPUTE, MST_POLICY_KEEP};
    mst_saver_basic_t* basic = NULL;
    CHECK_OK(mst_saver_basic_create(ctx, c.R, &d.cfg, pol, &basic));
    const mst_saver* sv = mst_saver_basic_get(basic);
    cudaStream_t s = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    mlp_out eager = {0}, replay = {0};

    /* Eager once: grows the workspace, so the capture allocates nothing. */
    outputs_reset(ctx, &d, NAN);
    CHECK_OK(mst_grouped_mlp_forward(ctx, &d.cfg, &d.w, &d.x, &d.p, &d.counts, sv, &d.y));
    CHECK_OK(mst_grouped_mlp_backward(ctx, &d.cfg, &d.w, &d.dy, &d.counts, sv, &d.dx, &d.dp, MST_WGRAD_OVERWRITE));
    CHECK_OK(mst_ctx_check(ctx));
    if (mst_test_failures) goto done;

    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK_OK(mst_ctx_set_stream(ctx, s));
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    mst_status fst = mst_grouped_mlp_forward(ctx, &d.cfg, &d.w, &d.x, &d.p, &d.counts, sv, &d.y);
    mst_status bst = mst_grouped_mlp_backward(ctx, &d.cfg, &d.w, &d.dy, &d.counts, sv, &d.dx, &d.dp,
                                              MST_WGRAD_OVERWRITE);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    CHECK_OK(mst_ctx_set_stream(ctx, NULL));
    CHECK_OK(fst);
    CHECK_OK(bst);
    if (mst_test_failures) goto done;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    /* Each replay with new counts: bit-identical to an eager run with them,
     * and that eager run against the float64 reference. */
    const int64_t totals[2] = {1900, 700};
    for (int i = 0; i < 2 && !mst_test_failures; i++) {
        mst_rng_counts(rng, m.counts, c.E, totals[i], i ? 0.0 : 1.0);
        mst_copy_h2b(ctx, d.counts.data, m.counts, 4 * (size_t)c.E);
        reference(&c, &d.cfg, &m);
        outputs_reset(ctx, &d, NAN);
        CHECK_OK(mst_grouped_mlp_forward(ctx, &d.cfg, &d.w, &d.x, &d.p, &d.counts, sv, &d.y));
        CHECK_OK(mst_grouped_mlp_backward(ctx, &d.cfg, &d.w, &d.dy, &d.counts, sv, &d.dx, &d.dp,
                                          MST_WGRAD_OVERWRITE));
        CHECK_OK(mst_ctx_check(ctx));
        out_get(ctx, &d, &eager);
        expect_bf16(eager.y, m.y, totals[i], c.R, c.H, "eager y", &c);
        expect_bf16(eager.dx, m.dx, totals[i], c.R, c.H, "eager dx", &c);
        expect_grad(eager.dp, m.dp, (size_t)totals[i], "eager dprobs", &c);
        expect_grad(eager.gw1, m.gw1, (size_t)(c.E * 2 * c.F * c.H), "eager dW1", &c);

        outputs_reset(ctx, &d, NAN);
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        CHECK_OK(mst_ctx_check(ctx));
        out_get(ctx, &d, &replay);
        expect_same_out(&eager, &replay, &c, "graph replay vs eager");
        CHECK(padding_poisoned(replay.y, totals[i], c.R, 2 * c.H), "replay: y padding rows written");
        CHECK(padding_poisoned(replay.dp, totals[i], c.R, 4), "replay: dprobs padding rows written");
        out_free(&eager), out_free(&replay);
    }
done:
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (s) {
        mst_ctx_set_stream(ctx, NULL);
        cudaStreamDestroy(s);
    }
    out_free(&eager), out_free(&replay);
    mst_saver_basic_destroy(basic);
    dev_free(ctx, &d);
    host_free(&m);
}
#endif

static void run(mst_ctx_t* ctx) {
    mst_rng rng = {0x31337};
    int gpu = mst_ctx_backend(ctx) == MST_BACKEND_CUDA;
    const act_case acts[] = {
        {4, 48, 40, 150, 200, MST_ACT_SWIGLU, 1},
        {4, 48, 40, 150, 200, MST_ACT_CLAMPED_SWIGLU, 1},
        {6, 45, 33, 97, 97, MST_ACT_CLAMPED_SWIGLU, 0}, /* odd widths, R == sum(counts) */
        {64, 128, 64, 500, 800, MST_ACT_SWIGLU, 0},     /* many groups, some empty */
        {3, 1024, 512, 2000, 2600, MST_ACT_CLAMPED_SWIGLU, 1},
    };
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) act_run(ctx, &rng, &acts[i]);
    const int32_t neg[3] = {5, -1, 4}, over[3] = {10, 10, 5}; /* 25 > R = 24 */
    act_bad_counts(ctx, &rng, neg, 3);
    act_bad_counts(ctx, &rng, over, 3);
    saver_api(ctx);

    const mlp_case cases[] = {
        {4, 64, 48, 170, 200, 0.3, 1, MST_ACT_SWIGLU},
        {4, 64, 48, 170, 200, 0.3, 1, MST_ACT_CLAMPED_SWIGLU},
        {8, 40, 24, 120, 120, 1.0, 0, MST_ACT_CLAMPED_SWIGLU}, /* no biases, some groups empty */
        {1, 32, 16, 50, 64, 0.0, 1, MST_ACT_SWIGLU},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) mlp_case_run(ctx, &rng, &cases[i]);
    if (gpu) {
        /* sizes of the Hopper kernel's tiles; the second at Zipf counts
         * (many row blocks that reach past a group's count), no biases */
        const mlp_case big = {8, 512, 256, 3000, 4096, 0.7, 1, MST_ACT_CLAMPED_SWIGLU};
        const mlp_case zipf = {16, 256, 384, 2000, 3000, 1.0, 0, MST_ACT_SWIGLU};
        mlp_case_run(ctx, &rng, &big);
        mlp_case_run(ctx, &rng, &zipf);
    }
    mlp_bad_input(ctx, &rng);
#ifdef MST_HAVE_CUDA
    if (gpu) graph_replay(ctx, &rng);
#endif
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
