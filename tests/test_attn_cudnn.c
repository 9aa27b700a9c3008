/*
 * test_attn_cudnn.c — cuDNN's fused attention (--attention cudnn, the
 * attn_cudnn_* slots, model_ops_cudnn.cu).
 *
 * Any backend (CI runs cpu): the choice and its fallbacks — --attention
 * cudnn where the backend has no cuDNN attention is an error naming the
 * flag and the reason; AUTO takes cuDNN where it loads and takes the dims,
 * else flash saying why not cuDNN (a backend without cuDNN: flash, no note); a cuDNN library
 * that cannot be opened (a name that does not exist, or $MST_CUDNN_LIB
 * naming one) is refused naming the library and dlopen's reason; where
 * the library loads (no GPU needed), every graph of the GPU cases passes
 * cuDNN's checks of its operations and of the operation graph.
 *
 * cuda (label gpu): for causal attention at T 256 and 2048, heads 16 / 4 and
 * 16 / 16, head dims 128 and 64 (and B 2, T 77: a sequence that is no whole
 * number of tiles): forward out and lse, backward dq, dk, dv (each part of
 * dqkv apart) and delta (= rowsum(dout out) of the stored out), each against
 * a float64 reference written here from the definition (every row at T <=
 * 256; at T 2048 out and lse on every 61st row) and against our flash
 * kernels on the same inputs; bit-identical on a second run and on two
 * replays of one captured graph; the nondeterministic backward (bench attn's
 * comparison) against the reference at T 256; a shape without a plan
 * refused inside a capture; a head dim cuDNN is not asked for refused
 * naming head_dim. Every failure names the case and the tensor. Outputs
 * poisoned, guard bytes around them; bf16 rel err < 1e-2, fp32 < 1e-5.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/model/model.h"
#include "lib/internal.h"

static mst_rng rng = {4242};

/* ---- choice and fallback (any backend) ------------------------------------- */

static mst_model_config config(int32_t attention) {
    mst_model_config c = {.n_head = 4, .n_kv_head = 2, .head_dim = 64, .seq = 64, .batch = 1,
                          .attention = attention};
    return c;
}

static void test_choice(mst_ctx_t* ctx) {
    const mst_model_backend* mo = NULL;
    CHECK_OK(mst_model_backend_of(ctx, &mo));
    int32_t kind = -1;
    char note[256];
    mst_model_config c = config(MST_ATTN_AUTO);
    CHECK_OK(mst_model_attention(ctx, &c, &kind, note, sizeof note));
    if (!mo->attn_cudnn_forward) /* no cuDNN on this backend: flash, nothing to say */
        CHECK(kind == MST_ATTN_FLASH && note[0] == 0, "auto on %s: kind %s (note '%s'), expected flash",
              mst_ctx_describe(ctx), mst_attn_kind_str(kind), note);
    else { /* cuDNN when it loads and takes the dims, else flash saying why not cuDNN */
        int32_t k2 = -1;
        char n2[256];
        c = config(MST_ATTN_CUDNN);
        const int takes = mst_model_attention(ctx, &c, &k2, n2, sizeof n2) == MST_OK;
        CHECK(takes ? kind == MST_ATTN_CUDNN && note[0] == 0
                    : kind == MST_ATTN_FLASH && strstr(note, "not cuDNN") != NULL,
              "auto on %s: kind %s (note '%s'), expected %s", mst_ctx_describe(ctx), mst_attn_kind_str(kind), note,
              takes ? "cudnn (--attention cudnn takes these dims)" : "flash with cuDNN's refusal in the note");
    }
    if (!mo->attn_cudnn_check) {
        c = config(MST_ATTN_CUDNN);
        CHECK_STATUS(mst_model_attention(ctx, &c, &kind, note, sizeof note), MST_ERR_UNSUPPORTED);
        CHECK_MESSAGE("--attention cudnn: backend cpu has no cuDNN attention");
    }
    CHECK(strcmp(mst_attn_kind_str(MST_ATTN_CUDNN), "cudnn") == 0, "kind name of MST_ATTN_CUDNN: %s",
          mst_attn_kind_str(MST_ATTN_CUDNN));
}

static void test_probe(void) {
#ifdef MST_HAVE_CUDA
    size_t v = 0;
    CHECK_STATUS(mst_cudnn_probe("libmst-no-such-cudnn.so.9", &v), MST_ERR_UNSUPPORTED);
    CHECK(strstr(mst_last_error(), "libmst-no-such-cudnn.so.9") != NULL &&
              (strstr(mst_last_error(), "dlopen") || strstr(mst_last_error(), "built without")),
          "a missing library refused without naming it or dlopen: %s", mst_last_error());
    const char* old = getenv("MST_CUDNN_LIB");
    char* keep = old ? strdup(old) : NULL;
    setenv("MST_CUDNN_LIB", "/nonexistent/libcudnn.so.9", 1);
    CHECK_STATUS(mst_cudnn_probe(NULL, &v), MST_ERR_UNSUPPORTED);
    CHECK(strstr(mst_last_error(), "/nonexistent/libcudnn.so.9") || strstr(mst_last_error(), "built without"),
          "$MST_CUDNN_LIB not the library tried: %s", mst_last_error());
    if (keep) setenv("MST_CUDNN_LIB", keep, 1);
    else unsetenv("MST_CUDNN_LIB");
    free(keep);
    /* the default: absent (say why) or cuDNN 9 */
    mst_status st = mst_cudnn_probe(NULL, &v);
    printf("cuDNN here: %s\n", st == MST_OK ? "loads" : mst_last_error());
    if (st == MST_OK) CHECK(v / 10000 == 9, "cuDNN version %zu accepted: expected 9.x", v);
#endif
}

/* Where the library loads (no GPU needed): every graph the GPU cases use,
 * forward, backward and nondeterministic backward, passes cuDNN's checks of
 * each operation and of the operation graph. */
static void test_graphs(void) {
#ifdef MST_HAVE_CUDA
    if (mst_cudnn_probe(NULL, NULL) != MST_OK) return; /* said by test_probe */
    const int64_t c[][5] = {{1, 256, 16, 4, 128}, {1, 256, 16, 16, 64}, {2, 77, 4, 2, 64}, {1, 8192, 16, 4, 128},
                            {1, 96, 2, 1, 64}, {1, 1, 1, 1, 8}};
    for (size_t i = 0; i < sizeof c / sizeof *c; i++)
        for (int k = 0; k < 3; k++) {
            const mst_attn_args a = {.batch = c[i][0], .seq = c[i][1], .n_head = c[i][2], .n_kv_head = c[i][3],
                                     .head_dim = c[i][4], .nondeterministic = k == 2};
            const mst_status st = mst_cudnn_graph_check(&a, k > 0);
            CHECK(st == MST_OK, "cuDNN %s graph B %lld T %lld heads %lld/%lld D %lld: %s",
                  k == 0 ? "forward" : k == 1 ? "backward" : "nondeterministic backward", (long long)c[i][0],
                  (long long)c[i][1], (long long)c[i][2], (long long)c[i][3], (long long)c[i][4], mst_last_error());
        }
#endif
}

/* ---- numerics (cuda) ----------------------------------------------------------- */

typedef struct dims {
    int64_t B, T, NH, KV, D;
} dims;

static int64_t width(const dims* z) { return (z->NH + 2 * z->KV) * z->D; }

/* float64 reference from the bf16 inputs: out [N, NH D], lse [B, NH, T] on
 * rows i with i % step == 0 (others 0); with step 1 also dqkv [N, W]. */
typedef struct ref {
    double *out, *lse, *dqkv;
} ref;

static double bf(uint16_t h) { return mst_ref_bf16_value(h); }

static ref reference(const dims* z, const uint16_t* qkv, const uint16_t* dout, int64_t step) {
    const int64_t T = z->T, D = z->D, W = width(z), HO = z->NH * D, G = z->NH / z->KV, N = z->B * T;
    const double sc = 1.0 / sqrt((double)D);
    ref r = {calloc((size_t)(N * HO), sizeof(double)), calloc((size_t)(z->B * z->NH * T), sizeof(double)),
             step == 1 ? calloc((size_t)(N * W), sizeof(double)) : NULL};
    double* p = malloc(sizeof(double) * (size_t)T);
    double* dp = malloc(sizeof(double) * (size_t)T);
    for (int64_t b = 0; b < z->B; b++)
        for (int64_t h = 0; h < z->NH; h++) {
            const int64_t qo = h * D, ko = HO + (h / G) * D, vo = HO + z->KV * D + (h / G) * D;
            for (int64_t i = 0; i < T; i += step) {
                const uint16_t* q = qkv + (b * T + i) * W + qo;
                double m = -INFINITY, s = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const uint16_t* k = qkv + (b * T + j) * W + ko;
                    double dot = 0;
                    for (int64_t d = 0; d < D; d++) dot += bf(q[d]) * bf(k[d]);
                    p[j] = dot * sc;
                    m = fmax(m, p[j]);
                }
                for (int64_t j = 0; j <= i; j++) s += exp(p[j] - m);
                const double lse = m + log(s);
                r.lse[(b * z->NH + h) * T + i] = lse;
                double* o = r.out + (b * T + i) * HO + qo;
                for (int64_t j = 0; j <= i; j++) {
                    p[j] = exp(p[j] - lse);
                    const uint16_t* v = qkv + (b * T + j) * W + vo;
                    for (int64_t d = 0; d < D; d++) o[d] += p[j] * bf(v[d]);
                }
                if (step != 1) continue;
                /* backward of row i: dP = dO v^T, dS = P (dP - delta) sc */
                const uint16_t* g = dout + (b * T + i) * HO + qo;
                double delta = 0;
                for (int64_t d = 0; d < D; d++) delta += bf(g[d]) * o[d];
                for (int64_t j = 0; j <= i; j++) {
                    const uint16_t* v = qkv + (b * T + j) * W + vo;
                    double dot = 0;
                    for (int64_t d = 0; d < D; d++) dot += bf(g[d]) * bf(v[d]);
                    dp[j] = p[j] * (dot - delta) * sc;
                }
                double* dq = r.dqkv + (b * T + i) * W + qo;
                for (int64_t j = 0; j <= i; j++) {
                    const uint16_t* k = qkv + (b * T + j) * W + ko;
                    double *dk = r.dqkv + (b * T + j) * W + ko, *dv = r.dqkv + (b * T + j) * W + vo;
                    for (int64_t d = 0; d < D; d++) {
                        dq[d] += dp[j] * bf(k[d]);
                        dk[d] += dp[j] * bf(q[d]);
                        dv[d] += p[j] * bf(g[d]);
                    }
                }
            }
        }
    free(p), free(dp);
    return r;
}

static void ref_free(ref* r) { free(r->out), free(r->lse), free(r->dqkv); }

/* The buffers of one implementation's call (outputs poisoned). */
typedef struct bufs {
    mst_guarded qkv, dout, out, lse, dqkv, delta;
    mst_attn_args a;
} bufs;

static bufs bufs_make(mst_ctx_t* ctx, const dims* z, const uint16_t* qkv, const uint16_t* dout, int nondet) {
    const size_t N = (size_t)(z->B * z->T), rows = (size_t)(z->B * z->NH * z->T), HO = (size_t)(z->NH * z->D);
    bufs g;
    g.qkv = mst_guarded_alloc(ctx, 2 * N * (size_t)width(z));
    g.dout = mst_guarded_alloc(ctx, 2 * N * HO);
    g.out = mst_guarded_alloc(ctx, 2 * N * HO);
    g.lse = mst_guarded_alloc(ctx, 4 * rows);
    g.dqkv = mst_guarded_alloc(ctx, 2 * N * (size_t)width(z));
    g.delta = mst_guarded_alloc(ctx, 4 * rows);
    mst_guarded_put(ctx, &g.qkv, qkv);
    mst_guarded_put(ctx, &g.dout, dout);
    mst_guarded* outs[] = {&g.out, &g.lse, &g.dqkv, &g.delta};
    for (size_t i = 0; i < 4; i++) mst_guarded_put(ctx, outs[i], NULL);
    mst_attn_args a = {.batch = z->B, .seq = z->T, .n_head = z->NH, .head_dim = z->D, .n_kv_head = z->KV,
                       .qkv = g.qkv.data, .lse = g.lse.data, .out = g.out.data, .dout = g.dout.data,
                       .dqkv = g.dqkv.data, .delta = g.delta.data, .nondeterministic = nondet};
    g.a = a;
    return g;
}

static void bufs_free(mst_ctx_t* ctx, bufs* g) {
    mst_guarded* all[] = {&g->qkv, &g->dout, &g->out, &g->lse, &g->dqkv, &g->delta};
    for (size_t i = 0; i < 6; i++) mst_guarded_free(ctx, all[i]);
}

/* Host copies of the outputs (guards checked). */
typedef struct outs {
    uint16_t *out, *dqkv;
    float *lse, *delta;
} outs;

static void* take(mst_ctx_t* ctx, const mst_guarded* g, const char* what, const char* name) {
    void* h = malloc(g->n_bytes);
    mst_guarded_get(ctx, g, h);
    CHECK(mst_guarded_intact(ctx, g), "%s: %s: guard bytes around it overwritten", what, name);
    return h;
}

static outs take_all(mst_ctx_t* ctx, const bufs* g, const char* what) {
    outs o = {take(ctx, &g->out, what, "out"), take(ctx, &g->dqkv, what, "dqkv"), take(ctx, &g->lse, what, "lse"),
              take(ctx, &g->delta, what, "delta")};
    return o;
}

static void outs_free(outs* o) { free(o->out), free(o->dqkv), free(o->lse), free(o->delta); }

/* Relative norm error over the rows (every `step`-th token) and columns
 * [c0, c0 + nc) of a [rows, ld] matrix; got bf16 (is16) or fp32. */
static double rel_err(const void* got, int is16, const double* want, int64_t rows, int64_t step, int64_t ld,
                      int64_t c0, int64_t nc, int64_t T) {
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; r++) {
        if ((r % T) % step) continue;
        for (int64_t c = c0; c < c0 + nc; c++) {
            const double g = is16 ? bf(((const uint16_t*)got)[r * ld + c]) : ((const float*)got)[r * ld + c];
            if (!isfinite(g)) return INFINITY;
            num += (g - want[r * ld + c]) * (g - want[r * ld + c]);
            den += want[r * ld + c] * want[r * ld + c];
        }
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Every part of o against want: out, lse (rows by step), and with a
 * backward dq, dk, dv apart and delta; `against` names the reference. */
static void compare(const dims* z, const outs* o, const ref* want, const double* delta, int64_t step, int backward,
                    const char* what, const char* against) {
    const int64_t N = z->B * z->T, HO = z->NH * z->D, W = width(z), KVD = z->KV * z->D, rows = z->B * z->NH * z->T;
    double e = rel_err(o->out, 1, want->out, N, step, HO, 0, HO, z->T);
    CHECK(e < MST_TOL_BF16, "%s: forward out against %s: bf16 rel err %.3e", what, against, e);
    e = rel_err(o->lse, 0, want->lse, rows, step, 1, 0, 1, z->T);
    CHECK(e < MST_TOL_FP32, "%s: forward lse against %s: fp32 rel err %.3e (log2 stats would be ~0.44)", what,
          against, e);
    if (!backward) return;
    const char* part[3] = {"dq", "dk", "dv"};
    const int64_t c0[3] = {0, HO, HO + KVD}, nc[3] = {HO, KVD, KVD};
    for (int k = 0; k < 3; k++) {
        e = rel_err(o->dqkv, 1, want->dqkv, N, 1, W, c0[k], nc[k], z->T);
        CHECK(e < MST_TOL_BF16, "%s: backward %s (columns %lld.. of dqkv) against %s: bf16 rel err %.3e", what,
              part[k], (long long)c0[k], against, e);
    }
    e = rel_err(o->delta, 0, delta, rows, 1, 1, 0, 1, z->T);
    CHECK(e < MST_TOL_FP32, "%s: backward delta (rowsum dout out) against %s: fp32 rel err %.3e", what, against, e);
}

/* delta [B, NH, T] = rowsum(dout out) of the out the call stored. */
static double* delta_of(const dims* z, const uint16_t* out, const uint16_t* dout) {
    const int64_t T = z->T, D = z->D, HO = z->NH * D;
    double* d = calloc((size_t)(z->B * z->NH * T), sizeof(double));
    for (int64_t b = 0; b < z->B; b++)
        for (int64_t h = 0; h < z->NH; h++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t c = 0; c < D; c++)
                    d[(b * z->NH + h) * T + t] += bf(out[(b * T + t) * HO + h * D + c]) * bf(dout[(b * T + t) * HO + h * D + c]);
    return d;
}

/* A run's outputs as the reference of another comparison. */
static ref as_ref(const dims* z, const outs* o) {
    const size_t N = (size_t)(z->B * z->T), rows = (size_t)(z->B * z->NH * z->T), HO = (size_t)(z->NH * z->D),
                 W = (size_t)width(z);
    ref r = {malloc(sizeof(double) * N * HO), malloc(sizeof(double) * rows), malloc(sizeof(double) * N * W)};
    for (size_t i = 0; i < N * HO; i++) r.out[i] = bf(o->out[i]);
    for (size_t i = 0; i < rows; i++) r.lse[i] = o->lse[i];
    for (size_t i = 0; i < N * W; i++) r.dqkv[i] = bf(o->dqkv[i]);
    return r;
}

static mst_status run_cudnn(mst_ctx_t* ctx, const mst_model_backend* mo, const mst_attn_args* a) {
    MST_TRY(mo->attn_cudnn_forward(ctx, a));
    return mo->attn_cudnn_backward(ctx, a);
}

static void same_bits(const dims* z, const outs* x, const outs* y, const char* what) {
    const size_t N = (size_t)(z->B * z->T), rows = (size_t)(z->B * z->NH * z->T);
    int64_t d;
    CHECK((d = mst_first_diff(x->out, y->out, 2 * N * (size_t)(z->NH * z->D))) < 0, "%s: out differs at byte %lld", what, (long long)d);
    CHECK((d = mst_first_diff(x->lse, y->lse, 4 * rows)) < 0, "%s: lse differs at byte %lld", what, (long long)d);
    CHECK((d = mst_first_diff(x->dqkv, y->dqkv, 2 * N * (size_t)width(z))) < 0, "%s: dqkv differs at byte %lld", what,
          (long long)d);
    CHECK((d = mst_first_diff(x->delta, y->delta, 4 * rows)) < 0, "%s: delta differs at byte %lld", what, (long long)d);
}

/* Captured once, replayed twice: the same bits as `first` each time. */
static void replays(mst_ctx_t* ctx, const mst_model_backend* mo, const dims* z, bufs* g, const outs* first,
                    const char* what) {
    const mst_backend* be = ctx->be;
    if (!be->capture_begin) return;
    void* graph = NULL;
    CHECK_OK(be->capture_begin(ctx));
    mst_status st = run_cudnn(ctx, mo, &g->a);
    CHECK_OK(be->capture_end(ctx, &graph));
    CHECK(st == MST_OK, "%s: inside a capture: %s", what, mst_last_error());
    for (int k = 0; graph && k < 2; k++) {
        mst_guarded* o[] = {&g->out, &g->lse, &g->dqkv, &g->delta};
        for (int i = 0; i < 4; i++) mst_guarded_put(ctx, o[i], NULL);
        CHECK_OK(be->graph_launch(ctx, graph));
        CHECK_OK(mst_ctx_sync(ctx));
        char w[200];
        snprintf(w, sizeof w, "%s: graph replay %d", what, k + 1);
        outs rep = take_all(ctx, g, w);
        same_bits(z, first, &rep, w);
        outs_free(&rep);
    }
    if (graph) be->graph_destroy(ctx, graph);
}

/* One case: cuDNN against the reference and our flash kernels, twice, and
 * (deterministic) on replays; the nondeterministic backward at small T. */
static void attn_case(mst_ctx_t* ctx, dims z) {
    const mst_model_backend* mo = NULL;
    CHECK_OK(mst_model_backend_of(ctx, &mo));
    char what[160];
    snprintf(what, sizeof what, "cudnn B %lld T %lld heads %lld/%lld D %lld", (long long)z.B, (long long)z.T,
             (long long)z.NH, (long long)z.KV, (long long)z.D);
    printf("%s\n", what);
    const int64_t N = z.B * z.T, HO = z.NH * z.D, step = z.T <= 256 ? 1 : 61;
    uint16_t* qkv = malloc(sizeof(uint16_t) * (size_t)(N * width(&z)));
    uint16_t* dout = malloc(sizeof(uint16_t) * (size_t)(N * HO));
    mst_rng_bf16(&rng, qkv, (size_t)(N * width(&z)), 1.0);
    mst_rng_bf16(&rng, dout, (size_t)(N * HO), 1.0);
    bufs g = bufs_make(ctx, &z, qkv, dout, 0);
    mst_status st = mo->attn_cudnn_check(ctx, &g.a);
    CHECK(st == MST_OK, "%s: attn_cudnn_check: %s", what, mst_last_error());
    if (st == MST_OK) st = run_cudnn(ctx, mo, &g.a);
    CHECK(st == MST_OK, "%s: forward + backward: %s", what, mst_last_error());
    if (st == MST_OK) {
        outs first = take_all(ctx, &g, what);
        ref want = reference(&z, qkv, dout, step);
        double* delta = delta_of(&z, first.out, dout);
        compare(&z, &first, &want, delta, step, step == 1, what, "the float64 reference");
        /* our flash kernels on the same inputs */
        bufs f = bufs_make(ctx, &z, qkv, dout, 0);
        CHECK_OK(mo->attn_flash_forward(ctx, &f.a));
        CHECK_OK(mo->attn_flash_backward(ctx, &f.a));
        outs fo = take_all(ctx, &f, "flash");
        ref fr = as_ref(&z, &fo);
        compare(&z, &first, &fr, delta, 1, 1, what, "our flash kernels");
        /* run to run, and on replays */
        mst_guarded* o[] = {&g.out, &g.lse, &g.dqkv, &g.delta};
        for (int i = 0; i < 4; i++) mst_guarded_put(ctx, o[i], NULL);
        CHECK_OK(run_cudnn(ctx, mo, &g.a));
        char w[200];
        snprintf(w, sizeof w, "%s: second run", what);
        outs again = take_all(ctx, &g, w);
        same_bits(&z, &first, &again, w);
        replays(ctx, mo, &z, &g, &first, what);
        /* the nondeterministic backward: right, not bit-identical */
        if (step == 1) {
            bufs nd = bufs_make(ctx, &z, qkv, dout, 1);
            snprintf(w, sizeof w, "%s nondeterministic", what);
            st = mo->attn_cudnn_check(ctx, &nd.a);
            if (st == MST_OK) st = run_cudnn(ctx, mo, &nd.a);
            CHECK(st == MST_OK, "%s: %s", w, mst_last_error());
            if (st == MST_OK) {
                outs ndo = take_all(ctx, &nd, w);
                compare(&z, &ndo, &want, delta, 1, 1, w, "the float64 reference");
                outs_free(&ndo);
            }
            bufs_free(ctx, &nd);
        }
        outs_free(&again), outs_free(&fo), outs_free(&first);
        ref_free(&fr), ref_free(&want);
        free(delta);
        bufs_free(ctx, &f);
    }
    bufs_free(ctx, &g);
    free(qkv), free(dout);
}

/* What cuDNN is not asked for, and a plan missing inside a capture. */
static void test_refusals(mst_ctx_t* ctx) {
    const mst_model_backend* mo = NULL;
    CHECK_OK(mst_model_backend_of(ctx, &mo));
    const mst_attn_args wide = {.batch = 1, .seq = 64, .n_head = 2, .head_dim = 200, .n_kv_head = 2};
    CHECK_STATUS(mo->attn_cudnn_check(ctx, &wide), MST_ERR_UNSUPPORTED);
    CHECK_MESSAGE("head_dim 200");
    const dims z = {1, 96, 2, 1, 64}; /* never checked: no plan */
    uint16_t* qkv = malloc(sizeof(uint16_t) * (size_t)(z.T * width(&z)));
    uint16_t* dout = malloc(sizeof(uint16_t) * (size_t)(z.T * z.NH * z.D));
    mst_rng_bf16(&rng, qkv, (size_t)(z.T * width(&z)), 1.0);
    mst_rng_bf16(&rng, dout, (size_t)(z.T * z.NH * z.D), 1.0);
    bufs g = bufs_make(ctx, &z, qkv, dout, 0);
    const mst_backend* be = ctx->be;
    if (be->capture_begin) {
        void* graph = NULL;
        CHECK_OK(be->capture_begin(ctx));
        const mst_status st = mo->attn_cudnn_forward(ctx, &g.a);
        char msg[512];
        snprintf(msg, sizeof msg, "%s", mst_last_error());
        (void)be->capture_end(ctx, &graph); /* nothing captured */
        CHECK(st == MST_ERR_INVALID && strstr(msg, "during capture"),
              "a plan missing inside a capture: %s (%s), expected invalid naming the capture", mst_status_str(st), msg);
        if (graph) be->graph_destroy(ctx, graph);
    }
    /* outside a capture the plan is built on first use */
    CHECK_OK(run_cudnn(ctx, mo, &g.a));
    bufs_free(ctx, &g);
    free(qkv), free(dout);
}

static void run(mst_ctx_t* ctx) {
    test_choice(ctx);
    test_probe();
    test_graphs();
    const mst_model_backend* mo = NULL;
    if (mst_model_backend_of(ctx, &mo) != MST_OK || !mo->attn_cudnn_check) return;
    setenv("MST_CUDNN_VERBOSE", "1", 0); /* each plan's engine and workspace on stderr */
    /* B, T, NH, KV, D */
    const dims cases[] = {{1, 256, 16, 4, 128}, {1, 256, 16, 16, 128}, {1, 256, 16, 4, 64},  {1, 256, 16, 16, 64},
                          {2, 77, 4, 2, 64},    {1, 2048, 16, 4, 128}, {1, 2048, 16, 16, 128}, {1, 2048, 16, 4, 64},
                          {1, 2048, 16, 16, 64}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) attn_case(ctx, cases[i]);
    test_refusals(ctx);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
