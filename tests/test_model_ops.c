/*
 * test_model_ops.c — every model op of the backend named by --backend
 * against a float64 reference on the host: matmul (each transpose, strides,
 * bf16 and fp32 outputs, accumulate), RMSNorm forward/backward, add,
 * embedding gather / scatter-add, cross-entropy, attention forward/backward
 * (both contracts; flash also against the probabilities contract, run to
 * run and on graph replays bit for bit, tail blocks of T, head dims 64, 128),
 * router (softmax, top-k with ties to the lower expert id, dropless plan,
 * over budget, load-balancing loss) and its backward, rows gather / sum, sum
 * of squares, AdamW (and its skip on a raised flag). Fresh random inputs,
 * outputs poisoned, guard bytes around every output; bf16 rel err < 1e-2,
 * fp32 < 1e-5, integers exact; add and rows sum (one rounding of an fp32
 * sum) bit for bit against the harness's own bf16 rounding.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/model_ops/model_backend.h"
#include "lib/internal.h"

static mst_rng rng = {977};

/* The model ops of ctx's backend, through the trainer's door. */
static const mst_model_backend* ops(mst_ctx_t* ctx) {
    const mst_model_backend* mo = NULL;
    if (mst_model_backend_of(ctx, &mo) != MST_OK) {
        fprintf(stderr, "no model ops: %s\n", mst_last_error());
        abort();
    }
    return mo;
}

/* A guarded backend copy of host data (poisoned when host is NULL). */
static mst_guarded up(mst_ctx_t* ctx, const void* host, size_t n_bytes) {
    mst_guarded g = mst_guarded_alloc(ctx, n_bytes);
    mst_guarded_put(ctx, &g, host);
    return g;
}

static void* down(mst_ctx_t* ctx, const mst_guarded* g, const char* what) {
    void* h = malloc(g->n_bytes);
    mst_guarded_get(ctx, g, h);
    CHECK(mst_guarded_intact(ctx, g), "%s: guard bytes overwritten", what);
    return h;
}

static uint16_t* rand_bf16(size_t n, double scale) {
    uint16_t* p = (uint16_t*)malloc(sizeof(uint16_t) * n);
    mst_rng_bf16(&rng, p, n, scale);
    return p;
}

static double bf(uint16_t h) { return mst_bf16_to_fp32(h); }

static void expect_bf16(mst_ctx_t* ctx, const mst_guarded* g, const double* ref, size_t n, const char* what) {
    uint16_t* got = (uint16_t*)down(ctx, g, what);
    double err = mst_rel_err_bf16(got, ref, n);
    CHECK(err < MST_TOL_BF16, "%s: bf16 rel err %.3e", what, err);
    free(got);
}

/* An op that adds in fp32 and rounds once (add, rows sum): its bf16 output
 * bit for bit against the reference rounding of the fp32 sums `sum` (added
 * in the op's order), and enough ties among them that rounding them the
 * wrong way would show. */
static void expect_rounded_once(mst_ctx_t* ctx, const mst_guarded* g, const float* sum, size_t n, const char* what) {
    uint16_t* got = (uint16_t*)down(ctx, g, what);
    size_t bad = 0, first = 0, ties = 0;
    for (size_t i = 0; i < n; i++) {
        float f = sum[i];
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        ties += (u & 0xFFFFu) == 0x8000u;
        if (got[i] != mst_ref_bf16(f) && bad++ == 0) first = i;
    }
    CHECK(bad == 0, "%s: %zu of %zu bf16 outputs are not the nearest-even rounding of the fp32 sum (first [%zu]: "
          "0x%04x, expected 0x%04x for %.9g)", what, bad, n, first, bad ? got[first] : 0,
          mst_ref_bf16(sum[first]), (double)sum[first]);
    CHECK(ties > n / 50, "%s: only %zu ties among %zu sums: the inputs do not test the tie rule", what, ties, n);
    free(got);
}

static void expect_fp32(mst_ctx_t* ctx, const mst_guarded* g, const double* ref, size_t n, double tol,
                        const char* what) {
    float* got = (float*)down(ctx, g, what);
    double err = mst_rel_err_fp32(got, ref, n);
    CHECK(err < tol, "%s: fp32 rel err %.3e", what, err);
    free(got);
}

/* Row reductions (RMSNorm, cross-entropy) take 16-byte loads where the
 * rows allow and one value a load elsewhere, with the same sums: their
 * outputs again from buffers 2 bytes off that alignment must have the same
 * bits. A backend copy of host (poisoned when NULL) at base + 2. */
typedef struct shifted {
    void* base;
    char* data; /* base + 2 */
    size_t n_bytes;
} shifted;

static shifted shifted_up(mst_ctx_t* ctx, const void* host, size_t n_bytes) {
    shifted b = {NULL, NULL, n_bytes};
    CHECK_OK(mst_alloc(ctx, n_bytes + 16, &b.base));
    b.data = (char*)b.base + 2;
    if (host) CHECK_OK(mst_copy_h2b(ctx, b.data, host, n_bytes));
    else CHECK_OK(mst_fill(ctx, b.data, 0xFF, n_bytes));
    return b;
}

/* The bits of the shifted buffer against those of g; frees the buffer. */
static void expect_same_bits(mst_ctx_t* ctx, shifted* b, const mst_guarded* g, const char* what) {
    void *want = down(ctx, g, what), *got = malloc(b->n_bytes);
    CHECK_OK(mst_copy_b2h(ctx, got, b->data, b->n_bytes));
    CHECK(memcmp(want, got, b->n_bytes) == 0, "%s: other bits from buffers off 16-byte alignment", what);
    free(want), free(got);
    mst_free(ctx, b->base);
}

/* ---- matmul -------------------------------------------------------------- */

static void mm_case(mst_ctx_t* ctx, int ta, int tb, int64_t M, int64_t N, int64_t K, int out32, int acc) {
    const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + (out32 ? 2 : 1);
    const int64_t ar = ta ? K : M, br = tb ? N : K;
    uint16_t *A = rand_bf16((size_t)(ar * lda), 1), *B = rand_bf16((size_t)(br * ldb), 1);
    uint16_t* C16 = rand_bf16((size_t)(M * ldc), 1);
    float* C32 = (float*)malloc(sizeof(float) * (size_t)(M * ldc));
    mst_rng_fp32(&rng, C32, (size_t)(M * ldc), -1, 1);
    double* ref = (double*)malloc(sizeof(double) * (size_t)(M * ldc));
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < ldc; j++) {
            double s = acc || j >= N ? (out32 ? C32[i * ldc + j] : bf(C16[i * ldc + j])) : 0;
            for (int64_t k = 0; j < N && k < K; k++)
                s += bf(ta ? A[k * lda + i] : A[i * lda + k]) * bf(tb ? B[j * ldb + k] : B[k * ldb + j]);
            ref[i * ldc + j] = s;
        }
    mst_guarded ga = up(ctx, A, sizeof(uint16_t) * (size_t)(ar * lda));
    mst_guarded gb = up(ctx, B, sizeof(uint16_t) * (size_t)(br * ldb));
    mst_guarded gc = out32 ? up(ctx, C32, sizeof(float) * (size_t)(M * ldc)) : up(ctx, C16, sizeof(uint16_t) * (size_t)(M * ldc));
    mst_mm_args a = {.trans_a = ta, .trans_b = tb, .m = M, .n = N, .k = K, .a = (uint16_t*)ga.data, .lda = lda,
                     .b = (uint16_t*)gb.data, .ldb = ldb, .ldc = ldc, .accumulate = acc};
    if (out32) a.c32 = (float*)gc.data;
    else a.c16 = (uint16_t*)gc.data;
    CHECK_OK(ops(ctx)->mm(ctx, &a));
    char what[96];
    snprintf(what, sizeof what, "mm ta=%d tb=%d [%lld,%lld,%lld] %s acc=%d", ta, tb, (long long)M, (long long)N,
             (long long)K, out32 ? "fp32" : "bf16", acc);
    if (out32) expect_fp32(ctx, &gc, ref, (size_t)(M * ldc), MST_TOL_FP32, what);
    else expect_bf16(ctx, &gc, ref, (size_t)(M * ldc), what);
    mst_guarded_free(ctx, &ga);
    mst_guarded_free(ctx, &gb);
    mst_guarded_free(ctx, &gc);
    free(A), free(B), free(C16), free(C32), free(ref);
}

static void test_mm(mst_ctx_t* ctx) {
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            mm_case(ctx, ta, tb, 37, 29, 45, 0, 0);
            mm_case(ctx, ta, tb, 37, 29, 45, 1, 1);
        }
    mm_case(ctx, 0, 1, 64, 48, 33, 0, 1);
    mm_case(ctx, 1, 0, 20, 16, 70, 1, 0);
}

/* ---- RMSNorm ------------------------------------------------------------- */

static void test_norm(mst_ctx_t* ctx, int64_t N, int64_t H) {
    char what[4][64];
    const char* part[4] = {"y", "rstd", "dx", "dw (accumulated)"};
    for (int i = 0; i < 4; i++)
        snprintf(what[i], sizeof what[i], "norm [%lld, %lld] %s", (long long)N, (long long)H, part[i]);
    const double eps = 1e-5;
    uint16_t *x = rand_bf16((size_t)(N * H), 1.5), *w = rand_bf16((size_t)H, 1), *dy = rand_bf16((size_t)(N * H), 1);
    float* dw0 = (float*)malloc(sizeof(float) * (size_t)H);
    mst_rng_fp32(&rng, dw0, (size_t)H, -1, 1);
    double *y = (double*)malloc(sizeof(double) * (size_t)(N * H)), *dx = (double*)malloc(sizeof(double) * (size_t)(N * H));
    double *rs = (double*)malloc(sizeof(double) * (size_t)N), *dw = (double*)malloc(sizeof(double) * (size_t)H);
    for (int64_t c = 0; c < H; c++) dw[c] = dw0[c];
    for (int64_t r = 0; r < N; r++) {
        double ss = 0, dot = 0;
        for (int64_t c = 0; c < H; c++) ss += bf(x[r * H + c]) * bf(x[r * H + c]);
        rs[r] = 1 / sqrt(ss / H + eps);
        for (int64_t c = 0; c < H; c++) {
            y[r * H + c] = bf(x[r * H + c]) * rs[r] * bf(w[c]);
            dot += bf(dy[r * H + c]) * bf(w[c]) * bf(x[r * H + c]);
            dw[c] += bf(dy[r * H + c]) * bf(x[r * H + c]) * rs[r];
        }
        for (int64_t c = 0; c < H; c++)
            dx[r * H + c] = rs[r] * bf(dy[r * H + c]) * bf(w[c]) - bf(x[r * H + c]) * dot * rs[r] * rs[r] * rs[r] / H;
    }
    mst_guarded gx = up(ctx, x, sizeof(uint16_t) * (size_t)(N * H)), gw = up(ctx, w, sizeof(uint16_t) * (size_t)H);
    mst_guarded gy = up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * H)), grs = up(ctx, NULL, sizeof(float) * (size_t)N);
    mst_guarded gdy = up(ctx, dy, sizeof(uint16_t) * (size_t)(N * H)), gdx = up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * H));
    mst_guarded gdw = up(ctx, dw0, sizeof(float) * (size_t)H);
    mst_norm_args a = {.rows = N, .cols = H, .eps = (float)eps, .x = (uint16_t*)gx.data, .w = (uint16_t*)gw.data,
                       .y = (uint16_t*)gy.data, .rstd = (float*)grs.data, .dy = (uint16_t*)gdy.data,
                       .dx = (uint16_t*)gdx.data, .dw = (float*)gdw.data};
    CHECK_OK(ops(ctx)->norm_forward(ctx, &a));
    expect_bf16(ctx, &gy, y, (size_t)(N * H), what[0]);
    expect_fp32(ctx, &grs, rs, (size_t)N, MST_TOL_FP32, what[1]);
    CHECK_OK(ops(ctx)->norm_backward(ctx, &a));
    expect_bf16(ctx, &gdx, dx, (size_t)(N * H), what[2]);
    expect_fp32(ctx, &gdw, dw, (size_t)H, MST_TOL_FP32, what[3]);
    shifted sx = shifted_up(ctx, x, sizeof(uint16_t) * (size_t)(N * H)), sw = shifted_up(ctx, w, sizeof(uint16_t) * (size_t)H);
    shifted sdy = shifted_up(ctx, dy, sizeof(uint16_t) * (size_t)(N * H));
    shifted sy = shifted_up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * H)), sdx = shifted_up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * H));
    mst_guarded grs2 = up(ctx, NULL, sizeof(float) * (size_t)N), gdw2 = up(ctx, dw0, sizeof(float) * (size_t)H);
    mst_norm_args b = a;
    b.x = (uint16_t*)sx.data, b.w = (uint16_t*)sw.data, b.y = (uint16_t*)sy.data, b.dy = (uint16_t*)sdy.data;
    b.dx = (uint16_t*)sdx.data, b.rstd = (float*)grs2.data, b.dw = (float*)gdw2.data;
    CHECK_OK(ops(ctx)->norm_forward(ctx, &b));
    CHECK_OK(ops(ctx)->norm_backward(ctx, &b));
    expect_same_bits(ctx, &sy, &gy, what[0]);
    expect_same_bits(ctx, &sdx, &gdx, what[2]);
    float *r1 = (float*)down(ctx, &grs, what[1]), *r2 = (float*)down(ctx, &grs2, what[1]);
    float *w1 = (float*)down(ctx, &gdw, what[3]), *w2 = (float*)down(ctx, &gdw2, what[3]);
    CHECK(memcmp(r1, r2, sizeof(float) * (size_t)N) == 0, "%s: other bits from buffers off alignment", what[1]);
    CHECK(memcmp(w1, w2, sizeof(float) * (size_t)H) == 0, "%s: other bits from buffers off alignment", what[3]);
    free(r1), free(r2), free(w1), free(w2);
    mst_free(ctx, sx.base), mst_free(ctx, sw.base), mst_free(ctx, sdy.base);
    mst_guarded_free(ctx, &grs2), mst_guarded_free(ctx, &gdw2);
    mst_guarded* all[] = {&gx, &gw, &gy, &grs, &gdy, &gdx, &gdw};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) mst_guarded_free(ctx, all[i]);
    free(x), free(w), free(dy), free(dw0), free(y), free(dx), free(rs), free(dw);
}

/* ---- add, embedding, cross-entropy ------------------------------------------- */

/* N tokens of ids stride x [0, n_ids) (repeats) over a vocabulary of V. */
static void test_add_embed(mst_ctx_t* ctx, int64_t N, int64_t V, int64_t H, int64_t n_ids, int64_t stride) {
    char what[128];
    snprintf(what, sizeof what, "embed backward N=%lld V=%lld H=%lld ids=%lld", (long long)N, (long long)V,
             (long long)H, (long long)n_ids);
    uint16_t *a = rand_bf16((size_t)(N * H), 1), *b = rand_bf16((size_t)(N * H), 1), *tab = rand_bf16((size_t)(V * H), 1);
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)N);
    for (int64_t t = 0; t < N; t++) tok[t] = (int32_t)(mst_rng_int(&rng, 0, n_ids - 1) * stride); /* repeats */
    float* dt0 = (float*)malloc(sizeof(float) * (size_t)(V * H));
    mst_rng_fp32(&rng, dt0, (size_t)(V * H), -1, 1);
    double *sum = (double*)malloc(sizeof(double) * (size_t)(N * H)), *emb = (double*)malloc(sizeof(double) * (size_t)(N * H));
    double* dt = (double*)malloc(sizeof(double) * (size_t)(V * H));
    float* sum32 = (float*)malloc(sizeof(float) * (size_t)(N * H));
    for (int64_t i = 0; i < V * H; i++) dt[i] = dt0[i];
    for (int64_t t = 0; t < N; t++)
        for (int64_t c = 0; c < H; c++) {
            sum[t * H + c] = bf(a[t * H + c]) + bf(b[t * H + c]);
            sum32[t * H + c] = (float)bf(a[t * H + c]) + (float)bf(b[t * H + c]);
            emb[t * H + c] = bf(tab[tok[t] * H + c]);
            dt[tok[t] * H + c] += bf(a[t * H + c]);
        }
    mst_guarded ga = up(ctx, a, sizeof(uint16_t) * (size_t)(N * H)), gb = up(ctx, b, sizeof(uint16_t) * (size_t)(N * H));
    mst_guarded gy = up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * H)), gtab = up(ctx, tab, sizeof(uint16_t) * (size_t)(V * H));
    mst_guarded gtok = up(ctx, tok, sizeof(int32_t) * (size_t)N), gdt = up(ctx, dt0, sizeof(float) * (size_t)(V * H));
    mst_guarded gord = up(ctx, NULL, sizeof(int32_t) * (size_t)mst_embed_order_len(N));
    mst_add_args ad = {.n = N * H, .a = (uint16_t*)ga.data, .b = (uint16_t*)gb.data, .y = (uint16_t*)gy.data};
    CHECK_OK(ops(ctx)->add(ctx, &ad));
    expect_bf16(ctx, &gy, sum, (size_t)(N * H), "add");
    expect_rounded_once(ctx, &gy, sum32, (size_t)(N * H), "add");
    mst_embed_args e = {.n_tok = N, .vocab = V, .cols = H, .tokens = (int32_t*)gtok.data, .table = (uint16_t*)gtab.data,
                        .x = (uint16_t*)gy.data, .dx = (uint16_t*)ga.data, .dtable = (float*)gdt.data,
                        .order = (int32_t*)gord.data};
    mst_guarded_put(ctx, &gy, NULL);
    CHECK_OK(ops(ctx)->embed_forward(ctx, &e));
    uint16_t* got = (uint16_t*)down(ctx, &gy, "embed forward");
    int exact = 1;
    for (int64_t t = 0; t < N; t++) exact &= memcmp(got + t * H, tab + tok[t] * H, sizeof(uint16_t) * (size_t)H) == 0;
    CHECK(exact, "embed forward: rows are not exact copies of the table");
    free(got);
    CHECK_OK(ops(ctx)->embed_backward(ctx, &e));
    expect_fp32(ctx, &gdt, dt, (size_t)(V * H), MST_TOL_FP32, what);
    /* the same bits again, from the same table and a poisoned scratch */
    float* first = (float*)down(ctx, &gdt, what);
    mst_guarded_put(ctx, &gdt, dt0);
    mst_guarded_put(ctx, &gord, NULL);
    CHECK_OK(ops(ctx)->embed_backward(ctx, &e));
    float* again = (float*)down(ctx, &gdt, what);
    CHECK(memcmp(first, again, sizeof(float) * (size_t)(V * H)) == 0, "%s: a second run gave other bits", what);
    free(first), free(again);
    mst_guarded* all[] = {&ga, &gb, &gy, &gtab, &gtok, &gdt, &gord};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) mst_guarded_free(ctx, all[i]);
    free(a), free(b), free(tab), free(tok), free(dt0), free(sum), free(sum32), free(emb), free(dt);
}

static void test_xent(mst_ctx_t* ctx, int64_t N, int64_t V) {
    char what[2][64];
    snprintf(what[0], sizeof what[0], "xent [%lld, %lld] loss", (long long)N, (long long)V);
    snprintf(what[1], sizeof what[1], "xent [%lld, %lld] dlogits", (long long)N, (long long)V);
    const float scale = 0.37f;
    uint16_t* l = rand_bf16((size_t)(N * V), 3);
    int32_t* tg = (int32_t*)malloc(sizeof(int32_t) * (size_t)N);
    double *loss = (double*)malloc(sizeof(double) * (size_t)N), *dl = (double*)malloc(sizeof(double) * (size_t)(N * V));
    for (int64_t r = 0; r < N; r++) {
        tg[r] = (int32_t)mst_rng_int(&rng, 0, V - 1);
        double mx = -INFINITY, s = 0;
        for (int64_t v = 0; v < V; v++) mx = fmax(mx, bf(l[r * V + v]));
        for (int64_t v = 0; v < V; v++) s += exp(bf(l[r * V + v]) - mx);
        loss[r] = log(s) + mx - bf(l[r * V + tg[r]]);
        for (int64_t v = 0; v < V; v++) dl[r * V + v] = (exp(bf(l[r * V + v]) - mx) / s - (v == tg[r])) * scale;
    }
    mst_guarded gl = up(ctx, l, sizeof(uint16_t) * (size_t)(N * V)), gt = up(ctx, tg, sizeof(int32_t) * (size_t)N);
    mst_guarded gloss = up(ctx, NULL, sizeof(float) * (size_t)N), gdl = up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * V));
    mst_xent_args a = {.rows = N, .vocab = V, .scale = scale, .logits = (uint16_t*)gl.data, .targets = (int32_t*)gt.data,
                       .loss = (float*)gloss.data, .dlogits = (uint16_t*)gdl.data};
    CHECK_OK(ops(ctx)->xent(ctx, &a));
    /* the CPU's fp32 sum of V exp terms in order drifts with V (1.3e-5 at
     * 151 936): 5x the fp32 tolerance there */
    expect_fp32(ctx, &gloss, loss, (size_t)N, V > 65536 ? 5 * MST_TOL_FP32 : MST_TOL_FP32, what[0]);
    expect_bf16(ctx, &gdl, dl, (size_t)(N * V), what[1]);
    shifted sl = shifted_up(ctx, l, sizeof(uint16_t) * (size_t)(N * V)), sdl = shifted_up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * V));
    mst_guarded gloss2 = up(ctx, NULL, sizeof(float) * (size_t)N);
    mst_xent_args b = a;
    b.logits = (uint16_t*)sl.data, b.dlogits = (uint16_t*)sdl.data, b.loss = (float*)gloss2.data;
    CHECK_OK(ops(ctx)->xent(ctx, &b));
    expect_same_bits(ctx, &sdl, &gdl, what[1]);
    float *l1 = (float*)down(ctx, &gloss, what[0]), *l2 = (float*)down(ctx, &gloss2, what[0]);
    CHECK(memcmp(l1, l2, sizeof(float) * (size_t)N) == 0, "%s: other bits from buffers off alignment", what[0]);
    free(l1), free(l2);
    mst_free(ctx, sl.base);
    mst_guarded_free(ctx, &gloss2);
    mst_guarded* all[] = {&gl, &gt, &gloss, &gdl};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) mst_guarded_free(ctx, all[i]);
    free(l), free(tg), free(loss), free(dl);
}

/* ---- attention --------------------------------------------------------------- */

/* NH query heads over KV key-value heads (KV 0: NH, no grouping). */
typedef struct attn_dims {
    int64_t B, T, NH, D, KV;
} attn_dims;

static int64_t kv_of(attn_dims z) { return z.KV ? z.KV : z.NH; }
/* The qkv row (NH + 2 KV) D and the output row NH D. */
static int64_t qkv_w(attn_dims z) { return (z.NH + 2 * kv_of(z)) * z.D; }

/* float64 causal grouped-query attention of qkv [B*T, (NH + 2 KV) D] and
 * dout [B*T, NH D], written from the definition with the query heads of
 * one key-value head repeated (transformers' repeat_kv: query head h reads
 * key-value head h / (NH / KV)): out [B*T, NH D], P [B, NH, T, T] (0 above
 * the diagonal), lse [B, NH, T], dqkv [B*T, (NH + 2 KV) D] (all zeroed by
 * the caller). */
static void attn_ref(attn_dims z, const uint16_t* qkv, const uint16_t* dout, double* out, double* P, double* lse,
                     double* dqkv) {
    const int64_t B = z.B, T = z.T, NH = z.NH, D = z.D, KV = kv_of(z), H = NH * D, W = qkv_w(z), rep = NH / KV;
    const double sc = 1 / sqrt((double)D);
    double* dp = (double*)malloc(sizeof(double) * (size_t)T);
#define Q(b, t, h, d) bf(qkv[((b) * T + (t)) * W + (h) * D + (d)])
#define K_(b, t, h, d) bf(qkv[((b) * T + (t)) * W + H + ((h) / rep) * D + (d)])
#define V_(b, t, h, d) bf(qkv[((b) * T + (t)) * W + H + KV * D + ((h) / rep) * D + (d)])
#define G(b, t, h, d) bf(dout[((b) * T + (t)) * H + (h) * D + (d)])
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < NH; h++) {
            double* p = P + (b * NH + h) * T * T;
            for (int64_t i = 0; i < T; i++) {
                double mx = -INFINITY, s = 0, dot = 0;
                for (int64_t j = 0; j <= i; j++) {
                    double a = 0;
                    for (int64_t d = 0; d < D; d++) a += Q(b, i, h, d) * K_(b, j, h, d);
                    p[i * T + j] = a * sc;
                    mx = fmax(mx, a * sc);
                }
                for (int64_t j = 0; j <= i; j++) s += (p[i * T + j] = exp(p[i * T + j] - mx));
                lse[(b * NH + h) * T + i] = mx + log(s);
                for (int64_t j = 0; j <= i; j++) p[i * T + j] /= s;
                for (int64_t d = 0; d < D; d++)
                    for (int64_t j = 0; j <= i; j++) out[(b * T + i) * H + h * D + d] += p[i * T + j] * V_(b, j, h, d);
                for (int64_t j = 0; j <= i; j++) {
                    dp[j] = 0;
                    for (int64_t d = 0; d < D; d++) dp[j] += G(b, i, h, d) * V_(b, j, h, d);
                    dot += p[i * T + j] * dp[j];
                }
                for (int64_t j = 0; j <= i; j++) {
                    double ds = p[i * T + j] * (dp[j] - dot);
                    for (int64_t d = 0; d < D; d++) {
                        dqkv[(b * T + i) * W + h * D + d] += ds * K_(b, j, h, d) * sc;
                        dqkv[(b * T + j) * W + H + (h / rep) * D + d] += ds * Q(b, i, h, d) * sc;
                        dqkv[(b * T + j) * W + H + (KV + h / rep) * D + d] += p[i * T + j] * G(b, i, h, d);
                    }
                }
            }
        }
    free(dp);
#undef Q
#undef K_
#undef V_
#undef G
}

/* Host inputs and float64 references of one attention case. */
typedef struct attn_case {
    attn_dims z;
    int64_t N, H;
    uint16_t *qkv, *dout;
    double *out, *P, *lse, *dqkv;
} attn_case;

static attn_case attn_case_make(attn_dims z) {
    attn_case c = {.z = z, .N = z.B * z.T, .H = z.NH * z.D};
    const size_t rows = (size_t)(z.B * z.NH * z.T);
    c.qkv = rand_bf16((size_t)(c.N * qkv_w(z)), 2);
    c.dout = rand_bf16((size_t)(c.N * c.H), 1);
    c.out = (double*)calloc((size_t)(c.N * c.H), sizeof(double));
    c.P = (double*)calloc(rows * (size_t)z.T, sizeof(double));
    c.lse = (double*)calloc(rows, sizeof(double));
    c.dqkv = (double*)calloc((size_t)(c.N * qkv_w(z)), sizeof(double));
    attn_ref(z, c.qkv, c.dout, c.out, c.P, c.lse, c.dqkv);
    return c;
}

static void attn_case_free(attn_case* c) {
    free(c->qkv), free(c->dout), free(c->out), free(c->P), free(c->lse), free(c->dqkv);
}

/* Backend buffers of one call of either contract (outputs poisoned). */
typedef struct attn_bufs {
    mst_guarded qkv, dout, out, dqkv, probs, lse, delta, s32, s16;
    mst_attn_args a;
} attn_bufs;

static attn_bufs attn_bufs_make(mst_ctx_t* ctx, const attn_case* c, int flash) {
    const attn_dims z = c->z;
    const size_t rows = (size_t)(z.B * z.NH * z.T), tt = flash ? 1 : rows * (size_t)z.T;
    attn_bufs g;
    g.qkv = up(ctx, c->qkv, sizeof(uint16_t) * (size_t)(c->N * qkv_w(z)));
    g.dout = up(ctx, c->dout, sizeof(uint16_t) * (size_t)(c->N * c->H));
    g.out = up(ctx, NULL, sizeof(uint16_t) * (size_t)(c->N * c->H));
    g.dqkv = up(ctx, NULL, sizeof(uint16_t) * (size_t)(c->N * qkv_w(z)));
    g.probs = up(ctx, NULL, sizeof(float) * tt);
    g.lse = up(ctx, NULL, sizeof(float) * rows);
    g.delta = up(ctx, NULL, sizeof(float) * rows);
    g.s32 = up(ctx, NULL, sizeof(float) * tt);
    g.s16 = up(ctx, NULL, sizeof(uint16_t) * tt);
    mst_attn_args a = {.batch = z.B, .seq = z.T, .n_head = z.NH, .head_dim = z.D, .n_kv_head = kv_of(z),
                       .qkv = (uint16_t*)g.qkv.data,
                       .probs = flash ? NULL : (float*)g.probs.data, .lse = flash ? (float*)g.lse.data : NULL,
                       .out = (uint16_t*)g.out.data, .dout = (uint16_t*)g.dout.data, .dqkv = (uint16_t*)g.dqkv.data,
                       .delta = flash ? (float*)g.delta.data : NULL, .scratch32 = flash ? NULL : (float*)g.s32.data,
                       .scratch16 = flash ? NULL : (uint16_t*)g.s16.data};
    g.a = a;
    return g;
}

static void attn_bufs_free(mst_ctx_t* ctx, attn_bufs* g) {
    mst_guarded* all[] = {&g->qkv, &g->dout, &g->out, &g->dqkv, &g->probs, &g->lse, &g->delta, &g->s32, &g->s16};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) mst_guarded_free(ctx, all[i]);
}

/* Forward then backward of either contract. */
static mst_status attn_run(mst_ctx_t* ctx, const mst_attn_args* a, int flash) {
    const mst_model_backend* o = ops(ctx);
    MST_TRY(flash ? o->attn_flash_forward(ctx, a) : o->attn_forward(ctx, a));
    return flash ? o->attn_flash_backward(ctx, a) : o->attn_backward(ctx, a);
}

/* The probabilities contract of one case against the float64 reference. */
static void attn_case_probs(mst_ctx_t* ctx, attn_dims z) {
    char what[160];
    snprintf(what, sizeof what, "attention B %lld T %lld heads %lld / %lld D %lld", (long long)z.B, (long long)z.T,
             (long long)z.NH, (long long)kv_of(z), (long long)z.D);
    attn_case c = attn_case_make(z);
    attn_bufs g = attn_bufs_make(ctx, &c, 0);
    char w[224];
    CHECK_OK(ops(ctx)->attn_forward(ctx, &g.a));
    snprintf(w, sizeof w, "%s: forward out", what);
    expect_bf16(ctx, &g.out, c.out, (size_t)(c.N * c.H), w);
    snprintf(w, sizeof w, "%s: forward probs (0 above the diagonal)", what);
    expect_fp32(ctx, &g.probs, c.P, (size_t)(c.z.B * c.z.NH * c.z.T * c.z.T), MST_TOL_FP32, w);
    CHECK_OK(ops(ctx)->attn_backward(ctx, &g.a));
    snprintf(w, sizeof w, "%s: backward dqkv", what);
    expect_bf16(ctx, &g.dqkv, c.dqkv, (size_t)(c.N * qkv_w(z)), w);
    attn_bufs_free(ctx, &g);
    attn_case_free(&c);
}

/* Multi-head (KV = NH) and grouped-query: 2 and 4 query heads per
 * key-value head, one key-value head for all (multi-query). */
static void test_attn(mst_ctx_t* ctx) {
    const attn_dims cases[] = {{2, 13, 3, 8, 0}, {2, 11, 4, 8, 2}, {1, 9, 4, 6, 1}, {2, 7, 6, 4, 3}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) attn_case_probs(ctx, cases[i]);
}

/* The bits of out, lse and dqkv after a run (the outputs poisoned before). */
typedef struct attn_bits {
    void *out, *lse, *dqkv;
} attn_bits;

static attn_bits attn_take(mst_ctx_t* ctx, attn_bufs* g, const char* what) {
    attn_bits b = {down(ctx, &g->out, what), down(ctx, &g->lse, what), down(ctx, &g->dqkv, what)};
    return b;
}

static void attn_poison(mst_ctx_t* ctx, attn_bufs* g) {
    mst_guarded* outs[] = {&g->out, &g->lse, &g->dqkv, &g->delta};
    for (size_t i = 0; i < sizeof outs / sizeof *outs; i++) mst_guarded_put(ctx, outs[i], NULL);
}

static void attn_same_bits(const attn_bufs* g, const attn_bits* x, const attn_bits* y, const char* what) {
    CHECK(memcmp(x->out, y->out, g->out.n_bytes) == 0, "%s: out not bit-identical", what);
    CHECK(memcmp(x->lse, y->lse, g->lse.n_bytes) == 0, "%s: lse not bit-identical", what);
    CHECK(memcmp(x->dqkv, y->dqkv, g->dqkv.n_bytes) == 0, "%s: dqkv not bit-identical", what);
}

static void attn_bits_free(attn_bits* b) { free(b->out), free(b->lse), free(b->dqkv); }

/* Flash contract of one case: against the float64 reference, against the
 * probabilities contract of the same backend, bit-identical on a second run
 * and (backends that capture) on a graph replay. A head dim the backend does
 * not take must be refused as unsupported, naming it. */
static void attn_flash_case(mst_ctx_t* ctx, attn_dims z) {
    const mst_model_backend* o = ops(ctx);
    char what[128];
    snprintf(what, sizeof what, "flash attention B %lld T %lld heads %lld / %lld D %lld", (long long)z.B,
             (long long)z.T, (long long)z.NH, (long long)kv_of(z), (long long)z.D);
    const mst_attn_args probe = {.batch = z.B, .seq = z.T, .n_head = z.NH, .head_dim = z.D, .n_kv_head = kv_of(z)};
    if (o->attn_flash_check && o->attn_flash_check(ctx, &probe) != MST_OK) {
        CHECK(strstr(mst_last_error(), "head_dim") != NULL, "%s: refused without naming head_dim: %s", what,
              mst_last_error());
        CHECK(z.D != 64 && z.D != 128, "%s: refused: %s", what, mst_last_error());
        return;
    }
    attn_case c = attn_case_make(z);
    const size_t rows = (size_t)(z.B * z.NH * z.T);
    attn_bufs g = attn_bufs_make(ctx, &c, 1);
    CHECK_OK(o->attn_flash_forward(ctx, &g.a));
    char w[192];
    snprintf(w, sizeof w, "%s: forward out", what);
    expect_bf16(ctx, &g.out, c.out, (size_t)(c.N * c.H), w);
    snprintf(w, sizeof w, "%s: forward lse", what);
    expect_fp32(ctx, &g.lse, c.lse, rows, MST_TOL_FP32, w);
    CHECK_OK(o->attn_flash_backward(ctx, &g.a));
    snprintf(w, sizeof w, "%s: backward dqkv", what);
    expect_bf16(ctx, &g.dqkv, c.dqkv, (size_t)(c.N * qkv_w(z)), w);
    attn_bits first = attn_take(ctx, &g, what);
    /* the probabilities contract of the same backend, as the reference */
    attn_bufs r = attn_bufs_make(ctx, &c, 0);
    CHECK_OK(attn_run(ctx, &r.a, 0));
    uint16_t *ro = (uint16_t*)down(ctx, &r.out, what), *rd = (uint16_t*)down(ctx, &r.dqkv, what);
    double *ref_o = (double*)malloc(sizeof(double) * (size_t)(c.N * c.H)),
           *ref_d = (double*)malloc(sizeof(double) * (size_t)(c.N * qkv_w(z)));
    for (int64_t i = 0; i < c.N * c.H; i++) ref_o[i] = bf(ro[i]);
    for (int64_t i = 0; i < c.N * qkv_w(z); i++) ref_d[i] = bf(rd[i]);
    snprintf(w, sizeof w, "%s: out against the probabilities contract", what);
    expect_bf16(ctx, &g.out, ref_o, (size_t)(c.N * c.H), w);
    snprintf(w, sizeof w, "%s: dqkv against the probabilities contract", what);
    expect_bf16(ctx, &g.dqkv, ref_d, (size_t)(c.N * qkv_w(z)), w);
    free(ro), free(rd), free(ref_o), free(ref_d);
    attn_bufs_free(ctx, &r);
    /* run to run */
    attn_poison(ctx, &g);
    CHECK_OK(attn_run(ctx, &g.a, 1));
    attn_bits again = attn_take(ctx, &g, what);
    snprintf(w, sizeof w, "%s: second run", what);
    attn_same_bits(&g, &first, &again, w);
    attn_bits_free(&again);
    /* captured once, replayed twice */
    const mst_backend* be = ctx->be;
    if (be->capture_begin) {
        void* graph = NULL;
        CHECK_OK(be->capture_begin(ctx));
        mst_status st = attn_run(ctx, &g.a, 1);
        CHECK_OK(be->capture_end(ctx, &graph));
        CHECK_OK(st);
        for (int k = 0; graph && k < 2; k++) {
            attn_poison(ctx, &g);
            CHECK_OK(be->graph_launch(ctx, graph));
            CHECK_OK(mst_ctx_sync(ctx));
            attn_bits rep = attn_take(ctx, &g, what);
            snprintf(w, sizeof w, "%s: graph replay %d", what, k + 1);
            attn_same_bits(&g, &first, &rep, w);
            attn_bits_free(&rep);
        }
        if (graph) be->graph_destroy(ctx, graph);
    }
    attn_bits_free(&first);
    attn_bufs_free(ctx, &g);
    attn_case_free(&c);
}

static void test_attn_flash(mst_ctx_t* ctx) {
    /* T past whole blocks of 64 (77, 200, 333), a whole number of them (128),
     * the head dims of the configs (64, 128) and one the CUDA kernels refuse */
    const attn_dims cases[] = {{2, 13, 3, 8, 0},   {2, 77, 3, 64, 0},   {1, 333, 2, 64, 0}, {2, 128, 1, 128, 0},
                               {1, 200, 2, 128, 0}, {2, 13, 4, 8, 2},   {2, 77, 4, 64, 1},  {1, 130, 8, 128, 2}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) attn_flash_case(ctx, cases[i]);
}

/* ---- QK-norm and rotary embedding ------------------------------------------ */

/* float64 reference of mst_qk_args from the definition (transformers'
 * Qwen3MoeRMSNorm per head, then apply_rotary_pos_emb with rotate_half):
 * y, rstd [N, NH + KV], and from dy: dx, dwq, dwk (added to their inputs). */
typedef struct qk_case {
    int64_t N, T, NH, KV, D;
    double theta, eps;
} qk_case;

static void qk_ref(const qk_case* q, const uint16_t* x, const uint16_t* wq, const uint16_t* wk, const uint16_t* dy,
                   double* y, double* rstd, double* dx, double* dwq, double* dwk) {
    const int64_t D = q->D, D2 = D / 2, NQK = q->NH + q->KV, W = (NQK + q->KV) * D;
    double *u = (double*)malloc(sizeof(double) * (size_t)D), *du = (double*)malloc(sizeof(double) * (size_t)D);
    for (int64_t r = 0; r < q->N; r++) {
        const double pos = (double)(r % q->T);
        for (int64_t h = 0; h < NQK; h++) {
            const uint16_t *xh = x + r * W + h * D, *gh = dy + r * W + h * D, *w = h < q->NH ? wq : wk;
            double* dw = h < q->NH ? dwq : dwk;
            double ss = 0, dot = 0;
            for (int64_t i = 0; i < D; i++) ss += bf(xh[i]) * bf(xh[i]);
            const double rs = 1 / sqrt(ss / (double)D + q->eps);
            rstd[r * NQK + h] = rs;
            for (int64_t i = 0; i < D; i++) u[i] = bf(xh[i]) * rs * bf(w[i]);
            for (int64_t i = 0; i < D; i++) { /* rotate_half: [-u2, u1] */
                const double a = pos / pow(q->theta, (double)(2 * (i % D2)) / (double)D);
                const double rot = i < D2 ? -u[i + D2] : u[i - D2];
                y[r * W + h * D + i] = u[i] * cos(a) + rot * sin(a);
            }
            for (int64_t i = 0; i < D; i++) { /* the transpose: du = cos dy + rotate_half^T (sin dy) */
                const double a = pos / pow(q->theta, (double)(2 * (i % D2)) / (double)D);
                du[i] = bf(gh[i]) * cos(a) + (i < D2 ? bf(gh[i + D2]) : -bf(gh[i - D2])) * sin(a);
            }
            for (int64_t i = 0; i < D; i++) {
                dw[i] += du[i] * bf(xh[i]) * rs;
                dot += du[i] * bf(w[i]) * bf(xh[i]);
            }
            for (int64_t i = 0; i < D; i++)
                dx[r * W + h * D + i] = rs * du[i] * bf(w[i]) - bf(xh[i]) * dot * rs * rs * rs / (double)D;
        }
        for (int64_t i = NQK * D; i < W; i++) y[r * W + i] = bf(x[r * W + i]), dx[r * W + i] = bf(dy[r * W + i]);
    }
    free(u), free(du);
}

static void qk_one(mst_ctx_t* ctx, qk_case q) {
    const int64_t NQK = q.NH + q.KV, W = (NQK + q.KV) * q.D, n = q.N * W;
    char what[128];
    snprintf(what, sizeof what, "qk N %lld T %lld heads %lld / %lld D %lld theta %g", (long long)q.N, (long long)q.T,
             (long long)q.NH, (long long)q.KV, (long long)q.D, q.theta);
    uint16_t *x = rand_bf16((size_t)n, 2), *dy = rand_bf16((size_t)n, 1);
    uint16_t *wq = rand_bf16((size_t)q.D, 0.5), *wk = rand_bf16((size_t)q.D, 0.5);
    for (int64_t i = 0; i < q.D; i++) /* norm weights around 1, each its own */
        wq[i] = mst_fp32_to_bf16(1.0f + (float)bf(wq[i])), wk[i] = mst_fp32_to_bf16(1.0f + (float)bf(wk[i]));
    float *dwq0 = (float*)malloc(sizeof(float) * (size_t)q.D), *dwk0 = (float*)malloc(sizeof(float) * (size_t)q.D);
    mst_rng_fp32(&rng, dwq0, (size_t)q.D, -1, 1);
    mst_rng_fp32(&rng, dwk0, (size_t)q.D, -1, 1);
    double *y = (double*)malloc(sizeof(double) * (size_t)n), *dx = (double*)malloc(sizeof(double) * (size_t)n);
    double* rs = (double*)malloc(sizeof(double) * (size_t)(q.N * NQK));
    double *dwq = (double*)malloc(sizeof(double) * (size_t)q.D), *dwk = (double*)malloc(sizeof(double) * (size_t)q.D);
    for (int64_t i = 0; i < q.D; i++) dwq[i] = dwq0[i], dwk[i] = dwk0[i];
    qk_ref(&q, x, wq, wk, dy, y, rs, dx, dwq, dwk);
    mst_guarded gx = up(ctx, x, sizeof(uint16_t) * (size_t)n), gdy = up(ctx, dy, sizeof(uint16_t) * (size_t)n);
    mst_guarded gwq = up(ctx, wq, sizeof(uint16_t) * (size_t)q.D), gwk = up(ctx, wk, sizeof(uint16_t) * (size_t)q.D);
    mst_guarded gy = up(ctx, NULL, sizeof(uint16_t) * (size_t)n), gdx = up(ctx, NULL, sizeof(uint16_t) * (size_t)n);
    mst_guarded grs = up(ctx, NULL, sizeof(float) * (size_t)(q.N * NQK));
    mst_guarded gdwq = up(ctx, dwq0, sizeof(float) * (size_t)q.D), gdwk = up(ctx, dwk0, sizeof(float) * (size_t)q.D);
    mst_qk_args a = {.rows = q.N, .seq = q.T, .n_head = q.NH, .n_kv_head = q.KV, .head_dim = q.D, .eps = (float)q.eps,
                     .theta = (float)q.theta, .x = (uint16_t*)gx.data, .wq = (uint16_t*)gwq.data,
                     .wk = (uint16_t*)gwk.data, .y = (uint16_t*)gy.data, .rstd = (float*)grs.data,
                     .dy = (uint16_t*)gdy.data, .dx = (uint16_t*)gdx.data, .dwq = (float*)gdwq.data,
                     .dwk = (float*)gdwk.data};
    char w[192];
    CHECK_OK(ops(ctx)->qk_forward(ctx, &a));
    snprintf(w, sizeof w, "%s: forward y", what);
    expect_bf16(ctx, &gy, y, (size_t)n, w);
    snprintf(w, sizeof w, "%s: forward rstd", what);
    expect_fp32(ctx, &grs, rs, (size_t)(q.N * NQK), MST_TOL_FP32, w);
    uint16_t* gyv = (uint16_t*)down(ctx, &gy, what);
    int same = 1;
    for (int64_t r = 0; r < q.N; r++) same &= memcmp(gyv + r * W + NQK * q.D, x + r * W + NQK * q.D, sizeof(uint16_t) * (size_t)(q.KV * q.D)) == 0;
    CHECK(same, "%s: v is not copied bit for bit", what);
    free(gyv);
    CHECK_OK(ops(ctx)->qk_backward(ctx, &a));
    snprintf(w, sizeof w, "%s: backward dx", what);
    expect_bf16(ctx, &gdx, dx, (size_t)n, w);
    snprintf(w, sizeof w, "%s: backward dwq (accumulated)", what);
    expect_fp32(ctx, &gdwq, dwq, (size_t)q.D, MST_TOL_FP32, w);
    snprintf(w, sizeof w, "%s: backward dwk (accumulated)", what);
    expect_fp32(ctx, &gdwk, dwk, (size_t)q.D, MST_TOL_FP32, w);
    mst_guarded* all[] = {&gx, &gdy, &gwq, &gwk, &gy, &gdx, &grs, &gdwq, &gdwk};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) mst_guarded_free(ctx, all[i]);
    free(x), free(dy), free(wq), free(wk), free(dwq0), free(dwk0), free(y), free(dx), free(rs), free(dwq), free(dwk);
}

/* Positions past one sequence (row % T), GQA 4/2 and 8/1, head dims 16
 * and 128, rope theta 1e4 and 1e6 (Qwen3-30B-A3B). A backend without the
 * op yet is named and skipped. */
static void test_qk(mst_ctx_t* ctx) {
    if (!ops(ctx)->qk_forward || !ops(ctx)->qk_backward) {
        printf("  SKIP qk: backend %s has no qk_forward / qk_backward yet\n", ops(ctx)->name);
        return;
    }
    qk_one(ctx, (qk_case){.N = 2 * 37, .T = 37, .NH = 4, .KV = 2, .D = 16, .theta = 1e4, .eps = 1e-6});
    qk_one(ctx, (qk_case){.N = 3 * 50, .T = 50, .NH = 8, .KV = 1, .D = 128, .theta = 1e6, .eps = 1e-6});
    qk_one(ctx, (qk_case){.N = 300, .T = 300, .NH = 2, .KV = 2, .D = 64, .theta = 1e4, .eps = 1e-5});
}

/* ---- router ------------------------------------------------------------------ */

typedef struct route_bufs {
    mst_guarded logits, probs, idx, w, pos, counts, load, peak, aux, dw, dl, loads;
} route_bufs;

/* One router case: N tokens, E experts, top-k, G groups of R rows; ties:
 * logits rounded to whole numbers; norm: norm_topk; world W ranks whose
 * tokens the load-balancing statistics span, over 3 layers (this one the
 * middle: the others' loads made up). */
typedef struct route_cfg {
    int64_t N;
    int E, K, G;
    int64_t R;
    int ties, norm, world;
} route_cfg;

/* The plan on the host from top-k ids: groups packed in order, rows in
 * expert, token, slot order. */
static void ref_plan(const int32_t* idx, int64_t NK, int E, int G, int64_t R, int32_t* load, int32_t* counts,
                     int32_t* pos, int* over_any) {
    const int EG = E / G;
    memset(load, 0, sizeof(int32_t) * (size_t)E);
    for (int64_t i = 0; i < NK; i++) load[idx[i]]++;
    *over_any = 0;
    for (int64_t i = 0; i < NK; i++) pos[i] = -1;
    int64_t row = 0;
    for (int g = 0; g < G; g++) {
        int64_t total = 0;
        for (int e = g * EG; e < (g + 1) * EG; e++) total += load[e];
        int over = total > R;
        *over_any |= over;
        for (int e = g * EG; e < (g + 1) * EG; e++) {
            counts[e] = over ? 0 : load[e];
            for (int64_t i = 0; i < NK && !over; i++)
                if (idx[i] == e) pos[i] = (int32_t)row++;
        }
    }
}

/* ties: logits rounded to whole numbers, so tokens have equal top
 * probabilities and the tie rule (the lower expert id first) decides.
 * The reference of the load-balancing loss is transformers'
 * load_balancing_loss_func over the layers' rows: coef E sum_e (L_e / rows)
 * (P_e / rows); this layer's share of it and its gradient through the
 * renormalised top-k and the softmax, from the definition. */
static void route_case(mst_ctx_t* ctx, route_cfg rc) {
    const int64_t N = rc.N, R = rc.R;
    const int E = rc.E, K = rc.K, G = rc.G, ties = rc.ties, NL = 3, W = rc.world;
    const int64_t NK = N * K;
    const float coef = 0.05f, gscale = 0.7f;
    float* logits = (float*)malloc(sizeof(float) * (size_t)(N * E));
    mst_rng_fp32(&rng, logits, (size_t)(N * E), -3, 3);
    for (int64_t i = 0; ties && i < N * E; i++) logits[i] = roundf(logits[i]);
    for (int64_t t = 0; t < N; t++) logits[t * E] += 1.5f; /* skew toward expert 0 (group 0) */
    float* dw = (float*)malloc(sizeof(float) * (size_t)NK);
    mst_rng_fp32(&rng, dw, (size_t)NK, -1, 1);
    double* probs = (double*)malloc(sizeof(double) * (size_t)(N * E));
    int32_t* idx = (int32_t*)malloc(sizeof(int32_t) * (size_t)NK);
    int64_t decided_by_tie = 0;
    for (int64_t t = 0; t < N; t++) {
        double mx = -INFINITY, s = 0;
        for (int e = 0; e < E; e++) mx = fmax(mx, logits[t * E + e]);
        for (int e = 0; e < E; e++) s += (probs[t * E + e] = exp(logits[t * E + e] - mx));
        for (int e = 0; e < E; e++) probs[t * E + e] /= s;
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int u = 0; u < k; u++) taken |= idx[t * K + u] == e;
                if (!taken && (best < 0 || probs[t * E + e] > probs[t * E + best])) best = e;
            }
            idx[t * K + k] = best;
            for (int e = best + 1; e < E; e++) /* a later expert as good as the one chosen */
                decided_by_tie += probs[t * E + e] == probs[t * E + best];
        }
    }
    CHECK(!ties || decided_by_tie > N / 10, "route: only %lld choices met a tie: the case does not test the tie rule",
          (long long)decided_by_tie);
    int32_t *load = (int32_t*)malloc(sizeof(int32_t) * (size_t)E), *counts = (int32_t*)malloc(sizeof(int32_t) * (size_t)E);
    int32_t* pos = (int32_t*)malloc(sizeof(int32_t) * (size_t)NK);
    int over = 0;
    ref_plan(idx, NK, E, G, R, load, counts, pos, &over);
    /* the layers' loads: this layer's in row 1, the others' made up (W ranks:
     * the sums over the ranks, this rank's share among them) */
    int32_t* loads = (int32_t*)malloc(sizeof(int32_t) * (size_t)(NL * E));
    int64_t* Ltot = (int64_t*)calloc((size_t)E, sizeof(int64_t));
    for (int l = 0; l < NL; l++)
        for (int e = 0; e < E; e++) {
            loads[l * E + e] = l == 1 ? load[e] * W : (int32_t)mst_rng_int(&rng, 0, 3 * N * K / E * W);
            Ltot[e] += loads[l * E + e];
        }
    const double rows = (double)NL * (double)N * (double)W;
    double aux = 0, *dl = (double*)malloc(sizeof(double) * (size_t)(N * E)), *tw = (double*)malloc(sizeof(double) * (size_t)NK);
    double* dp = (double*)malloc(sizeof(double) * (size_t)E);
    for (int e = 0; e < E; e++) {
        double pe = 0;
        for (int64_t t = 0; t < N; t++) pe += probs[t * E + e];
        aux += (double)Ltot[e] / rows * pe / rows;
    }
    aux *= coef * E;
    for (int64_t t = 0; t < N; t++) {
        double dot = 0, chosen = 0, wdot = 0;
        for (int k = 0; k < K; k++) chosen += probs[t * E + idx[t * K + k]];
        for (int k = 0; k < K; k++) tw[t * K + k] = probs[t * E + idx[t * K + k]] / (rc.norm ? chosen : 1.0);
        for (int k = 0; k < K; k++) wdot += dw[t * K + k] * tw[t * K + k];
        for (int e = 0; e < E; e++) dp[e] = gscale * coef * E * (double)Ltot[e] / (rows * rows);
        /* w_k = p_k / S: d w_k / d p_j = (delta_kj - w_k) / S */
        for (int k = 0; k < K; k++) dp[idx[t * K + k]] += rc.norm ? (dw[t * K + k] - wdot) / chosen : dw[t * K + k];
        for (int e = 0; e < E; e++) dot += probs[t * E + e] * dp[e];
        for (int e = 0; e < E; e++) dl[t * E + e] = probs[t * E + e] * (dp[e] - dot);
    }
    int32_t peak0[8] = {3, 100000, 0, 0, 0, 0, 0, 0}; /* a high peak must stay */
    route_bufs b = {up(ctx, logits, sizeof(float) * (size_t)(N * E)), up(ctx, NULL, sizeof(float) * (size_t)(N * E)),
                    up(ctx, NULL, sizeof(int32_t) * (size_t)NK), up(ctx, NULL, sizeof(float) * (size_t)NK),
                    up(ctx, NULL, sizeof(int32_t) * (size_t)NK), up(ctx, NULL, sizeof(int32_t) * (size_t)E),
                    up(ctx, NULL, sizeof(int32_t) * (size_t)E), up(ctx, peak0, sizeof(int32_t) * (size_t)G),
                    up(ctx, NULL, sizeof(float)), up(ctx, dw, sizeof(float) * (size_t)NK),
                    up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * E)), up(ctx, loads, sizeof(int32_t) * (size_t)(NL * E))};
    mst_route_args a = {.n_tok = N, .n_experts = E, .top_k = K, .n_groups = G, .max_rows = R, .aux_coef = coef,
                        .norm_topk = rc.norm, .grad_scale = gscale, .n_layers = NL, .loads = (int32_t*)b.loads.data,
                        .world = W,
                        .logits = (float*)b.logits.data, .probs = (float*)b.probs.data, .topk_idx = (int32_t*)b.idx.data,
                        .topk_w = (float*)b.w.data, .pos = (int32_t*)b.pos.data, .counts = (int32_t*)b.counts.data,
                        .load = (int32_t*)b.load.data, .peak_rows = (int32_t*)b.peak.data, .aux_loss = (float*)b.aux.data,
                        .flag = ctx->err_flag, .dtopk_w = (float*)b.dw.data, .dlogits = (uint16_t*)b.dl.data};
    CHECK_OK(ops(ctx)->route_forward(ctx, &a));
    char what[128];
    snprintf(what, sizeof what, "route N=%lld E=%d k=%d G=%d R=%lld norm=%d W=%d", (long long)N, E, K, G, (long long)R,
             rc.norm, W);
    CHECK_STATUS(mst_ctx_check(ctx), over ? MST_ERR_COUNTS : MST_OK);
    CHECK(over == (R < NK), "%s: test case expected %s", what, R < NK ? "over budget" : "no overflow");
    expect_fp32(ctx, &b.probs, probs, (size_t)(N * E), MST_TOL_FP32, what);
    expect_fp32(ctx, &b.w, tw, (size_t)NK, MST_TOL_FP32, what);
    int32_t *gi = (int32_t*)down(ctx, &b.idx, what), *gp = (int32_t*)down(ctx, &b.pos, what);
    int32_t *gc = (int32_t*)down(ctx, &b.counts, what), *gl = (int32_t*)down(ctx, &b.load, what);
    int32_t* gk = (int32_t*)down(ctx, &b.peak, what);
    CHECK(memcmp(gi, idx, sizeof(int32_t) * (size_t)NK) == 0, "%s: top-k ids differ", what);
    CHECK(memcmp(gp, pos, sizeof(int32_t) * (size_t)NK) == 0, "%s: rows differ", what);
    CHECK(memcmp(gc, counts, sizeof(int32_t) * (size_t)E) == 0, "%s: counts differ", what);
    CHECK(memcmp(gl, load, sizeof(int32_t) * (size_t)E) == 0, "%s: loads differ", what);
    for (int g = 0; g < G; g++) {
        int64_t total = 0;
        for (int e = g * (E / G); e < (g + 1) * (E / G); e++) total += load[e];
        int64_t want = total > peak0[g] ? total : peak0[g];
        CHECK(gk[g] == want, "%s: peak rows of group %d: %d, expected %lld", what, g, gk[g], (long long)want);
    }
    CHECK_OK(ops(ctx)->route_backward(ctx, &a));
    expect_bf16(ctx, &b.dl, dl, (size_t)(N * E), what);
    double aux_ref[1] = {aux};
    expect_fp32(ctx, &b.aux, aux_ref, 1, MST_TOL_FP32, what);
    free(gi), free(gp), free(gc), free(gl), free(gk);
    mst_guarded* all = &b.logits;
    for (size_t i = 0; i < sizeof b / sizeof b.logits; i++) mst_guarded_free(ctx, &all[i]);
    free(logits), free(dw), free(probs), free(idx), free(load), free(counts), free(pos), free(dl), free(tw), free(loads), free(Ltot), free(dp);
}

static void test_route(mst_ctx_t* ctx) {
    route_case(ctx, (route_cfg){300, 8, 2, 2, 600, 0, 1, 1});  /* R = N k: never over budget */
    route_case(ctx, (route_cfg){300, 8, 2, 2, 200, 0, 1, 1});  /* group 0 over budget (skewed) */
    route_case(ctx, (route_cfg){5000, 16, 3, 4, 15000, 0, 1, 2}); /* more entries than one plan tile; 2 ranks */
    route_case(ctx, (route_cfg){77, 6, 1, 3, 77, 0, 0, 1});    /* top-1 not renormalised */
    route_case(ctx, (route_cfg){77, 6, 1, 3, 77, 0, 1, 1});    /* top-1 renormalised: weight 1 */
    route_case(ctx, (route_cfg){400, 8, 3, 2, 1200, 1, 1, 1}); /* ties */
    route_case(ctx, (route_cfg){300, 8, 2, 2, 600, 0, 0, 3});  /* not renormalised, 3 ranks */
    route_case(ctx, (route_cfg){2048, 128, 8, 1, 16384, 0, 1, 1}); /* Qwen3-30B-A3B: 128 experts, top-8, T 2048 */
    route_case(ctx, (route_cfg){4096, 64, 4, 4, 16384, 0, 1, 1});  /* the h100 preset's router, 4 groups */
    route_case(ctx, (route_cfg){2048, 128, 8, 8, 1500, 0, 1, 2});  /* 8 groups, some over budget */
    route_case(ctx, (route_cfg){1000, 128, 8, 2, 8000, 1, 1, 1});  /* ties across the lanes of a warp */
    route_case(ctx, (route_cfg){300, 1024, 8, 4, 2400, 0, 1, 1});  /* the most experts a plan takes */
}

/* ---- rows gather / sum ----------------------------------------------------- */

/* N tokens of k slots (every seventh skipped), H columns, GR grouped rows
 * (GR >= N k, 37 not dividing it: distinct rows). */
static void test_rows(mst_ctx_t* ctx, int64_t N, int64_t K, int64_t H, int64_t GR) {
    char what_sum[96];
    snprintf(what_sum, sizeof what_sum, "rows sum N=%lld k=%lld H=%lld", (long long)N, (long long)K, (long long)H);
    uint16_t *x = rand_bf16((size_t)(N * H), 1), *rows = rand_bf16((size_t)(GR * H), 1);
    float *p = (float*)malloc(sizeof(float) * (size_t)(N * K)), *prow = (float*)malloc(sizeof(float) * (size_t)GR);
    mst_rng_fp32(&rng, p, (size_t)(N * K), 0, 1);
    mst_rng_fp32(&rng, prow, (size_t)GR, -1, 1);
    int32_t* pos = (int32_t*)malloc(sizeof(int32_t) * (size_t)(N * K));
    for (int64_t i = 0; i < N * K; i++) pos[i] = i % 7 == 3 ? -1 : (int32_t)((i * 37) % GR); /* distinct rows */
    double *sum = (double*)malloc(sizeof(double) * (size_t)(N * H)), *dp = (double*)malloc(sizeof(double) * (size_t)(N * K));
    float* sum32 = (float*)malloc(sizeof(float) * (size_t)(N * H));
    for (int64_t t = 0; t < N; t++) {
        for (int64_t c = 0; c < H; c++) {
            double s = 0;
            float s32 = 0.0f; /* fp32, in slot order: the op's contract */
            for (int64_t k = 0; k < K; k++)
                if (pos[t * K + k] >= 0) s += bf(rows[pos[t * K + k] * H + c]), s32 += (float)bf(rows[pos[t * K + k] * H + c]);
            sum[t * H + c] = s;
            sum32[t * H + c] = s32;
        }
        for (int64_t k = 0; k < K; k++) dp[t * K + k] = pos[t * K + k] >= 0 ? prow[pos[t * K + k]] : 0;
    }
    mst_guarded gx = up(ctx, x, sizeof(uint16_t) * (size_t)(N * H)), gp = up(ctx, p, sizeof(float) * (size_t)(N * K));
    mst_guarded gpos = up(ctx, pos, sizeof(int32_t) * (size_t)(N * K));
    mst_guarded grows = up(ctx, NULL, sizeof(uint16_t) * (size_t)(GR * H)), gprow = up(ctx, NULL, sizeof(float) * (size_t)GR);
    mst_rows_args a = {.n_tok = N, .top_k = (int32_t)K, .cols = H, .pos = (int32_t*)gpos.data, .src = (uint16_t*)gx.data,
                       .dst = (uint16_t*)grows.data, .src_p = (float*)gp.data, .dst_p = (float*)gprow.data};
    CHECK_OK(ops(ctx)->rows_gather(ctx, &a));
    uint16_t* gr = (uint16_t*)down(ctx, &grows, "rows gather");
    float* gq = (float*)down(ctx, &gprow, "rows gather probs");
    int ok = 1, untouched = 1;
    unsigned char* written = (unsigned char*)calloc((size_t)GR, 1);
    for (int64_t i = 0; i < N * K; i++) {
        if (pos[i] < 0) continue;
        written[pos[i]] = 1;
        ok &= memcmp(gr + pos[i] * H, x + (i / K) * H, sizeof(uint16_t) * (size_t)H) == 0 &&
              memcmp(&gq[pos[i]], &p[i], sizeof(float)) == 0;
    }
    for (int64_t r = 0; r < GR; r++)
        for (int64_t c = 0; !written[r] && c < H; c++) untouched &= gr[r * H + c] == 0xFFFF;
    CHECK(ok, "rows gather N=%lld k=%lld H=%lld: rows or probs are not exact copies", (long long)N, (long long)K,
          (long long)H);
    CHECK(untouched, "rows gather N=%lld k=%lld H=%lld wrote a row that no entry maps to", (long long)N, (long long)K,
          (long long)H);
    free(gr), free(gq), free(written);
    mst_guarded gsrc = up(ctx, rows, sizeof(uint16_t) * (size_t)(GR * H)), gsp = up(ctx, prow, sizeof(float) * (size_t)GR);
    mst_guarded gsum = up(ctx, NULL, sizeof(uint16_t) * (size_t)(N * H)), gdp = up(ctx, NULL, sizeof(float) * (size_t)(N * K));
    mst_rows_args s = {.n_tok = N, .top_k = (int32_t)K, .cols = H, .pos = (int32_t*)gpos.data, .src = (uint16_t*)gsrc.data,
                       .dst = (uint16_t*)gsum.data, .src_p = (float*)gsp.data, .dst_p = (float*)gdp.data};
    CHECK_OK(ops(ctx)->rows_sum(ctx, &s));
    expect_bf16(ctx, &gsum, sum, (size_t)(N * H), what_sum);
    expect_rounded_once(ctx, &gsum, sum32, (size_t)(N * H), what_sum);
    expect_fp32(ctx, &gdp, dp, (size_t)(N * K), MST_TOL_FP32, "rows sum probs");
    mst_guarded* all[] = {&gx, &gp, &gpos, &grows, &gprow, &gsrc, &gsp, &gsum, &gdp};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) mst_guarded_free(ctx, all[i]);
    free(x), free(rows), free(p), free(prow), free(pos), free(sum), free(sum32), free(dp);
}

/* ---- sum of squares, AdamW, float64 sum ----------------------------------------------- */

static void test_optim(mst_ctx_t* ctx) {
    const int64_t n = 5003;
    float *g = (float*)malloc(sizeof(float) * (size_t)n), *w = (float*)malloc(sizeof(float) * (size_t)n);
    float *m = (float*)malloc(sizeof(float) * (size_t)n), *v = (float*)malloc(sizeof(float) * (size_t)n);
    mst_rng_fp32(&rng, g, (size_t)n, -0.5, 0.5);
    mst_rng_fp32(&rng, w, (size_t)n, -1, 1);
    mst_rng_fp32(&rng, m, (size_t)n, -0.1, 0.1);
    mst_rng_fp32(&rng, v, (size_t)n, 0, 0.01);
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)g[i] * g[i];
    const float lr = 0.01f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, clip = 1.0f;
    const int64_t step = 7;
    const double gs = sqrt(ss) > clip ? clip / sqrt(ss) : 1.0, c1 = 1 - pow(b1, step), c2 = 1 - pow(b2, step);
    double *rw = (double*)malloc(sizeof(double) * (size_t)n), *rm = (double*)malloc(sizeof(double) * (size_t)n);
    double *rv = (double*)malloc(sizeof(double) * (size_t)n), *rw16 = (double*)malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        double gg = g[i] * gs;
        rm[i] = b1 * m[i] + (1 - b1) * gg;
        rv[i] = b2 * v[i] + (1 - b2) * gg * gg;
        rw[i] = w[i] * (1 - lr * wd) - lr * (rm[i] / c1) / (sqrt(rv[i] / c2) + eps);
        rw16[i] = rw[i];
    }
    mst_guarded gg = up(ctx, g, sizeof(float) * (size_t)n), gw = up(ctx, w, sizeof(float) * (size_t)n);
    mst_guarded gm = up(ctx, m, sizeof(float) * (size_t)n), gv = up(ctx, v, sizeof(float) * (size_t)n);
    mst_guarded g16 = up(ctx, NULL, sizeof(uint16_t) * (size_t)n), gss = up(ctx, NULL, sizeof(float));
    mst_guarded gpart = up(ctx, NULL, sizeof(float) * MST_SUMSQ_PARTS);
    mst_sumsq_args sa = {.n = n, .x = (float*)gg.data, .partial = (float*)gpart.data, .out = (float*)gss.data};
    CHECK_OK(ops(ctx)->sumsq(ctx, &sa));
    expect_fp32(ctx, &gss, &ss, 1, MST_TOL_FP32, "sum of squares");
    const float hyper[MST_N_HYPER] = {lr, (float)c1, (float)c2};
    mst_guarded gh = up(ctx, hyper, sizeof hyper);
    mst_adamw_args a = {.n = n, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd, .clip = clip,
                        .hyper = (float*)gh.data, .master = (float*)gw.data, .grad = (float*)gg.data, .m = (float*)gm.data,
                        .v = (float*)gv.data, .w = (uint16_t*)g16.data, .grad_sumsq = (float*)gss.data,
                        .flag = ctx->err_flag};
    /* a raised flag: nothing moves */
    const int32_t bits = 1;
    CHECK_OK(mst_copy_h2b(ctx, ctx->err_flag, &bits, sizeof bits));
    CHECK_OK(ops(ctx)->adamw(ctx, &a));
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS);
    float* same = (float*)down(ctx, &gw, "adamw skipped");
    CHECK(memcmp(same, w, sizeof(float) * (size_t)n) == 0, "adamw updated the weights although the flag was set");
    free(same);
    CHECK_OK(ops(ctx)->adamw(ctx, &a));
    expect_fp32(ctx, &gw, rw, (size_t)n, MST_TOL_FP32, "adamw master");
    expect_fp32(ctx, &gm, rm, (size_t)n, MST_TOL_FP32, "adamw m");
    expect_fp32(ctx, &gv, rv, (size_t)n, MST_TOL_FP32, "adamw v");
    expect_bf16(ctx, &g16, rw16, (size_t)n, "adamw bf16 weights");
    mst_guarded* all[] = {&gg, &gw, &gm, &gv, &g16, &gss, &gpart, &gh};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) mst_guarded_free(ctx, all[i]);
    free(g), free(w), free(m), free(v), free(rw), free(rm), free(rv), free(rw16);
}

/* The float64 sum of the step record: the documented lane order, bit for
 * bit (values of mixed signs and scales, so another order gives other
 * bits), for sizes below, at and past the lane count. */
static void test_sum(mst_ctx_t* ctx) {
    const int64_t sizes[] = {1, 37, MST_SUM_LANES, 100003};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        const int64_t n = sizes[k];
        float* x = (float*)malloc(sizeof(float) * (size_t)n);
        mst_rng_fp32(&rng, x, (size_t)n, -3, 3);
        for (int64_t i = 0; i < n; i += 7) x[i] *= 1e5f;
        double want = 0;
        for (int l = 0; l < MST_SUM_LANES; l++) {
            double lane = 0;
            for (int64_t i = l; i < n; i += MST_SUM_LANES) lane += x[i];
            want += lane;
        }
        const double poison = 12345.678;
        mst_guarded gx = up(ctx, x, sizeof(float) * (size_t)n), go = up(ctx, &poison, sizeof(double));
        mst_sum_args a = {.n = n, .x = (float*)gx.data, .out = (double*)go.data};
        CHECK_OK(ops(ctx)->sum(ctx, &a));
        double* got = (double*)down(ctx, &go, "sum");
        CHECK(got && memcmp(got, &want, sizeof want) == 0, "sum of %lld values: %.17g, expected %.17g bit for bit",
              (long long)n, got ? *got : 0.0, want);
        free(got);
        mst_guarded_free(ctx, &gx);
        mst_guarded_free(ctx, &go);
        free(x);
    }
}

static void run(mst_ctx_t* ctx) {
    test_mm(ctx);
    test_norm(ctx, 37, 72);
    test_norm(ctx, 50, 77);    /* odd columns: one value a lane */
    test_norm(ctx, 1000, 2048); /* H 2048; the weight gradient in 125 row chunks */
    test_add_embed(ctx, 4500, 50, 40, 13, 1);     /* more tokens than one rank span, long runs */
    test_add_embed(ctx, 300, 70001, 8, 13, 5833); /* ids past 65535 */
    test_add_embed(ctx, 777, 300, 13, 40, 7);     /* odd columns: the one-value path */
    test_add_embed(ctx, 1029, 5, 24, 1, 1);       /* one id: a single run of every token */
    test_add_embed(ctx, 2048, 151936, 16, 1500, 101); /* Qwen3's vocabulary, T 2048 */
    test_add_embed(ctx, 1024, 200, 2048, 150, 1); /* H 2048: several column blocks */
    test_xent(ctx, 33, 300);   /* one value a thread */
    test_xent(ctx, 40, 256);   /* byte tokens: a warp a row */
    test_xent(ctx, 5, 151936); /* Qwen3's vocabulary: 1024 threads a row */
    test_qk(ctx);
    test_attn(ctx);
    test_attn_flash(ctx);
    test_route(ctx);
    test_rows(ctx, 50, 3, 24, 200);
    test_rows(ctx, 61, 3, 13, 200);         /* odd columns: one value a lane */
    test_rows(ctx, 64, 10, 40, 700);        /* more slots than one load batch */
    test_rows(ctx, 512, 8, 2048, 4100);     /* Qwen3-30B-A3B: top-8, H 2048 */
    test_optim(ctx);
    test_sum(ctx);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
