/*
 * test_gemm_graph.c — one grouped-linear step (forward with bias and scale,
 * dgrad, wgrad ACCUMULATE with dbias and dscale) captured once in a CUDA
 * graph and replayed with different counts written into the device counts
 * buffer; each replay is checked against a float64 reference, with outputs
 * poisoned, padding rows checked untouched and guard bytes around every
 * output. A replay with bad counts must raise MST_ERR_COUNTS and write
 * nothing. On the CPU backend the same step runs eagerly (no graph), which
 * checks the sequence and the reference themselves.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#ifdef MST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

enum { E = 8, I = 136, O = 200, R = 1200, N_REPLAYS = 5 };

/* Backend buffers of the step, all guarded. */
typedef struct step_bufs {
    mst_guarded counts, x, w, b, s, dy, y, dx, mw, mb, ds;
} step_bufs;

/* The captured (or eager) step: forward, dgrad, wgrad ACCUMULATE. */
static mst_status step(mst_ctx_t* ctx, step_bufs* B) {
    mst_tensor counts = mst_tensor_make(B->counts.data, MST_DTYPE_INT32, E, 1),
               x = mst_tensor_make(B->x.data, MST_DTYPE_BF16, R, I),
               w = mst_tensor_make(B->w.data, MST_DTYPE_BF16, E * O, I),
               b = mst_tensor_make(B->b.data, MST_DTYPE_BF16, E, O),
               s = mst_tensor_make(B->s.data, MST_DTYPE_FP32, R, 1),
               dy = mst_tensor_make(B->dy.data, MST_DTYPE_BF16, R, O),
               y = mst_tensor_make(B->y.data, MST_DTYPE_BF16, R, O),
               dx = mst_tensor_make(B->dx.data, MST_DTYPE_BF16, R, I),
               mw = mst_tensor_make(B->mw.data, MST_DTYPE_FP32, E * O, I),
               mb = mst_tensor_make(B->mb.data, MST_DTYPE_FP32, E, O),
               ds = mst_tensor_make(B->ds.data, MST_DTYPE_FP32, R, 1);
    mst_status st = mst_grouped_linear_forward(ctx, &x, &w, &b, &s, &counts, &y);
    if (st == MST_OK) st = mst_grouped_linear_dgrad(ctx, &dy, &w, &counts, &dx);
    if (st != MST_OK) return st;
    return mst_grouped_linear_wgrad(ctx, &dy, &x, &s, &b, &counts, &mw, &mb, &ds,
                                    MST_WGRAD_ACCUMULATE);
}

/* Host inputs: fixed for the whole test; counts change per replay. */
typedef struct step_host {
    uint16_t *x, *w, *b, *dy; /* [R,I] [E*O,I] [E,O] [R,O] */
    float* s;                 /* [R]                        */
    float *mw0, *mb0;         /* [E*O,I] [E,O] main_grad before the step */
} step_host;

static double bf(uint16_t v) { return (double)mst_bf16_to_fp32(v); }

/* Checks every output of one step against float64 references. */
static void check_step(mst_ctx_t* ctx, step_bufs* B, const step_host* h, const int32_t* counts,
                       int replay) {
    int64_t off[E + 1];
    off[0] = 0;
    for (int g = 0; g < E; g++) off[g + 1] = off[g] + counts[g];
    const int64_t n = off[E];
    double* ry = (double*)calloc((size_t)(R * O), 8);
    double* rdx = (double*)calloc((size_t)(R * I), 8);
    double* rmw = (double*)malloc(sizeof(double) * E * O * I);
    double* rmb = (double*)malloc(sizeof(double) * E * O);
    double* rds = (double*)calloc(R, 8);
    for (int g = 0; g < E; g++) {
        const uint16_t* wg = h->w + (int64_t)g * O * I;
        for (int64_t r = off[g]; r < off[g + 1]; r++) {
            for (int64_t o = 0; o < O; o++) {
                double acc = bf(h->b[g * O + o]) * h->s[r];
                for (int64_t i = 0; i < I; i++) acc += bf(h->x[r * I + i]) * bf(wg[o * I + i]);
                ry[r * O + o] = acc;
                rds[r] += bf(h->dy[r * O + o]) * bf(h->b[g * O + o]);
            }
            for (int64_t i = 0; i < I; i++) {
                double acc = 0;
                for (int64_t o = 0; o < O; o++) acc += bf(h->dy[r * O + o]) * bf(wg[o * I + i]);
                rdx[r * I + i] = acc;
            }
        }
        for (int64_t o = 0; o < O; o++) {
            double db = h->mb0[g * O + o];
            for (int64_t r = off[g]; r < off[g + 1]; r++) db += bf(h->dy[r * O + o]) * h->s[r];
            rmb[g * O + o] = db;
            for (int64_t i = 0; i < I; i++) {
                double acc = h->mw0[((int64_t)g * O + o) * I + i];
                for (int64_t r = off[g]; r < off[g + 1]; r++)
                    acc += bf(h->dy[r * O + o]) * bf(h->x[r * I + i]);
                rmw[((int64_t)g * O + o) * I + i] = acc;
            }
        }
    }
    uint16_t* gy = (uint16_t*)malloc(B->y.n_bytes);
    uint16_t* gdx = (uint16_t*)malloc(B->dx.n_bytes);
    float* gmw = (float*)malloc(B->mw.n_bytes);
    float* gmb = (float*)malloc(B->mb.n_bytes);
    float* gds = (float*)malloc(B->ds.n_bytes);
    mst_guarded_get(ctx, &B->y, gy);
    mst_guarded_get(ctx, &B->dx, gdx);
    mst_guarded_get(ctx, &B->mw, gmw);
    mst_guarded_get(ctx, &B->mb, gmb);
    mst_guarded_get(ctx, &B->ds, gds);
    double e;
    e = mst_rel_err_bf16(gy, ry, (size_t)(n * O));
    CHECK(e < MST_TOL_BF16, "replay %d (n=%lld): y rel err %.3g", replay, (long long)n, e);
    e = mst_rel_err_bf16(gdx, rdx, (size_t)(n * I));
    CHECK(e < MST_TOL_BF16, "replay %d: dx rel err %.3g", replay, e);
    e = mst_rel_err_fp32(gmw, rmw, (size_t)E * O * I);
    CHECK(e < MST_TOL_FP32, "replay %d: main_grad_w rel err %.3g", replay, e);
    e = mst_rel_err_fp32(gmb, rmb, (size_t)E * O);
    CHECK(e < MST_TOL_FP32, "replay %d: main_grad_b rel err %.3g", replay, e);
    e = mst_rel_err_fp32(gds, rds, (size_t)n);
    CHECK(e < MST_TOL_FP32, "replay %d: dscale rel err %.3g", replay, e);
    /* rows past n keep the poison */
    const unsigned char* py = (const unsigned char*)gy;
    const unsigned char* pdx = (const unsigned char*)gdx;
    const unsigned char* pds = (const unsigned char*)gds;
    int untouched = 1;
    for (size_t i = (size_t)n * O * 2; i < (size_t)R * O * 2; i++) untouched &= py[i] == MST_POISON;
    for (size_t i = (size_t)n * I * 2; i < (size_t)R * I * 2; i++) untouched &= pdx[i] == MST_POISON;
    for (size_t i = (size_t)n * 4; i < (size_t)R * 4; i++) untouched &= pds[i] == MST_POISON;
    CHECK(untouched, "replay %d: padding rows written", replay);
    mst_guarded* outs[] = {&B->y, &B->dx, &B->mw, &B->mb, &B->ds};
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++)
        CHECK(mst_guarded_intact(ctx, outs[i]), "replay %d: guard bytes of output %zu overwritten",
              replay, i);
    free(ry), free(rdx), free(rmw), free(rmb), free(rds);
    free(gy), free(gdx), free(gmw), free(gmb), free(gds);
}

/* Before each replay: new counts, poisoned outputs, main_grad reset. */
static void prepare(mst_ctx_t* ctx, step_bufs* B, const step_host* h, const int32_t* counts) {
    mst_guarded_put(ctx, &B->counts, counts);
    mst_guarded_put(ctx, &B->y, NULL);
    mst_guarded_put(ctx, &B->dx, NULL);
    mst_guarded_put(ctx, &B->ds, NULL);
    mst_guarded_put(ctx, &B->mw, h->mw0);
    mst_guarded_put(ctx, &B->mb, h->mb0);
}

/* Replays (graph) or reruns (eager) the step. */
typedef struct runner {
    mst_ctx_t* ctx;
    step_bufs* B;
#ifdef MST_HAVE_CUDA
    cudaGraphExec_t exec; /* NULL: eager */
    cudaStream_t stream;
#endif
} runner;

static mst_status run_step(runner* rn) {
#ifdef MST_HAVE_CUDA
    if (rn->exec) {
        cudaError_t e = cudaGraphLaunch(rn->exec, rn->stream);
        CHECK(e == cudaSuccess, "cudaGraphLaunch: %s", cudaGetErrorString(e));
        return e == cudaSuccess ? mst_ctx_sync(rn->ctx) : MST_ERR_BACKEND;
    }
#endif
    return step(rn->ctx, rn->B);
}

#ifdef MST_HAVE_CUDA
/* Captures the step on the context's stream (a stream of the test's own). */
static int capture(runner* rn) {
    cudaGraph_t graph = NULL;
    if (cudaStreamBeginCapture(rn->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return 0;
    mst_status st = step(rn->ctx, rn->B);
    cudaError_t e = cudaStreamEndCapture(rn->stream, &graph);
    CHECK(st == MST_OK, "step failed under capture: %s", mst_last_error());
    CHECK(e == cudaSuccess, "capture failed: %s", cudaGetErrorString(e));
    if (st != MST_OK || e != cudaSuccess) return 0;
    e = cudaGraphInstantiate(&rn->exec, graph, 0);
    cudaGraphDestroy(graph);
    CHECK(e == cudaSuccess, "graph instantiate failed: %s", cudaGetErrorString(e));
    return e == cudaSuccess;
}
#endif

static void run(mst_ctx_t* ctx) {
    mst_rng rng = {0x6a7a11};
    const int gpu = mst_ctx_backend(ctx) == MST_BACKEND_CUDA;
    step_host h;
    h.x = (uint16_t*)malloc(2 * (size_t)R * I);
    h.w = (uint16_t*)malloc(2 * (size_t)E * O * I);
    h.b = (uint16_t*)malloc(2 * (size_t)E * O);
    h.dy = (uint16_t*)malloc(2 * (size_t)R * O);
    h.s = (float*)malloc(4 * (size_t)R);
    h.mw0 = (float*)malloc(4 * (size_t)E * O * I);
    h.mb0 = (float*)malloc(4 * (size_t)E * O);
    mst_rng_bf16(&rng, h.x, (size_t)R * I, 1.0);
    mst_rng_bf16(&rng, h.w, (size_t)E * O * I, 1.0 / sqrt((double)I));
    mst_rng_bf16(&rng, h.b, (size_t)E * O, 0.5);
    mst_rng_bf16(&rng, h.dy, (size_t)R * O, 1.0);
    mst_rng_fp32(&rng, h.s, R, 0.05, 1.0);
    mst_rng_fp32(&rng, h.mw0, (size_t)E * O * I, -1.0, 1.0);
    mst_rng_fp32(&rng, h.mb0, (size_t)E * O, -1.0, 1.0);

    step_bufs B;
    B.counts = mst_guarded_alloc(ctx, 4 * E);
    B.x = mst_guarded_alloc(ctx, 2 * (size_t)R * I);
    B.w = mst_guarded_alloc(ctx, 2 * (size_t)E * O * I);
    B.b = mst_guarded_alloc(ctx, 2 * (size_t)E * O);
    B.s = mst_guarded_alloc(ctx, 4 * (size_t)R);
    B.dy = mst_guarded_alloc(ctx, 2 * (size_t)R * O);
    B.y = mst_guarded_alloc(ctx, 2 * (size_t)R * O);
    B.dx = mst_guarded_alloc(ctx, 2 * (size_t)R * I);
    B.mw = mst_guarded_alloc(ctx, 4 * (size_t)E * O * I);
    B.mb = mst_guarded_alloc(ctx, 4 * (size_t)E * O);
    B.ds = mst_guarded_alloc(ctx, 4 * (size_t)R);
    mst_guarded_put(ctx, &B.x, h.x);
    mst_guarded_put(ctx, &B.w, h.w);
    mst_guarded_put(ctx, &B.b, h.b);
    mst_guarded_put(ctx, &B.s, h.s);
    mst_guarded_put(ctx, &B.dy, h.dy);

    runner rn = {.ctx = ctx, .B = &B};
    int32_t counts[E];
    mst_rng_counts(&rng, counts, E, 700, 0.5);
    prepare(ctx, &B, &h, counts);
#ifdef MST_HAVE_CUDA
    if (gpu) { /* the ops run eagerly once (sizing the workspace), then are captured */
        CHECK(cudaStreamCreateWithFlags(&rn.stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
        CHECK_OK(mst_ctx_set_stream(ctx, rn.stream));
        CHECK_OK(step(ctx, &B));
        CHECK_OK(mst_ctx_check(ctx));
        check_step(ctx, &B, &h, counts, -1);
        prepare(ctx, &B, &h, counts);
        CHECK_OK(mst_ctx_sync(ctx));
        if (!capture(&rn)) goto done;
    }
#endif
    /* Replays with other totals, zero-size groups and skew; the last is the
     * capacity itself. */
    const int64_t totals[N_REPLAYS] = {1199, 17, 500, 800, R};
    const double skews[N_REPLAYS] = {0.0, 1.0, 1.0, 0.3, 0.6};
    for (int k = 0; k < N_REPLAYS; k++) {
        mst_rng_counts(&rng, counts, E, totals[k], skews[k]);
        if (k == 2) counts[3] += counts[5], counts[5] = 0; /* an empty group inside */
        prepare(ctx, &B, &h, counts);
        CHECK_OK(run_step(&rn));
        CHECK_OK(mst_ctx_check(ctx));
        check_step(ctx, &B, &h, counts, k);
    }
    /* Bad counts in a replay: flagged, and nothing is written. */
    int32_t bad[E] = {200, 150, 100, 250, 300, 80, 20, 101}; /* 1201 > R */
    prepare(ctx, &B, &h, bad);
    mst_status st = run_step(&rn);
    CHECK(st == (gpu ? MST_OK : MST_ERR_COUNTS), "bad counts: step returned %s", mst_status_str(st));
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS);
    {
        float* mw = (float*)malloc(B.mw.n_bytes);
        unsigned char* y = (unsigned char*)malloc(B.y.n_bytes);
        mst_guarded_get(ctx, &B.mw, mw);
        mst_guarded_get(ctx, &B.y, y);
        CHECK(mst_first_diff(mw, h.mw0, B.mw.n_bytes) < 0, "bad counts: main_grad_w was written");
        int poisoned = 1;
        for (size_t i = 0; i < B.y.n_bytes; i++) poisoned &= y[i] == MST_POISON;
        CHECK(poisoned, "bad counts: y was written");
        free(mw), free(y);
    }
    CHECK_OK(mst_ctx_check(ctx));
#ifdef MST_HAVE_CUDA
done:
    if (rn.exec) cudaGraphExecDestroy(rn.exec);
    if (gpu) {
        CHECK_OK(mst_ctx_set_stream(ctx, NULL));
        cudaStreamDestroy(rn.stream);
    }
#endif
    mst_guarded* all[] = {&B.counts, &B.x, &B.w, &B.b, &B.s, &B.dy, &B.y, &B.dx, &B.mw, &B.mb, &B.ds};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mst_guarded_free(ctx, all[i]);
    free(h.x), free(h.w), free(h.b), free(h.dy), free(h.s), free(h.mw0), free(h.mb0);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
