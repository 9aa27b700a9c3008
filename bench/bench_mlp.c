/*
 * bench_mlp.c — `moestash bench mlp [--json FILE] [--iters N] [--shape I]`:
 * the grouped MLP (fc1 -> SwiGLU * prob -> fc2) forward and backward on CUDA,
 * each captured in one CUDA graph and replayed.
 *
 * Order of work: validate CUDA against the CPU reference on a ragged case;
 * measure the roofs (bench/roof.h: cuBLAS dense bf16 GEMM 8192^3 and the
 * device copy) on the same card; then per shape the forward (6 rows H F
 * FLOPs) and backward (12 rows H F FLOPs, wgrad ACCUMULATE into main_grad)
 * graph replays, each beside its roofline max(FLOPs / dense, bytes / copy)
 * (bytes: pass_bytes below), and the activation kernels alone
 * (their share of each pass; fusing them into the GEMM epilogues was
 * measured slower, see docs/history/perf-notes.md), all interleaved round by
 * round. The counts of every shape go into the JSON, so bench/torch/mlp.py
 * runs the PyTorch baseline on the same counts and prints the ratio. A
 * short table is printed last.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"
#include "roof.h"

#ifdef MST_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

typedef struct mlp_shape {
    int64_t rows, hidden, ffn;
    int32_t E;
    int skewed;       /* counts: 0 uniform random routing, 1 Zipf-like */
    const char* what;
} mlp_shape;

/* Coarse shapes first (as in earlier runs), then the fine-grained ones:
 * DeepSeek-V3 experts (H 7168, F 2048, top-8 of 256) on an EP rank of 32
 * experts receiving 4096 tokens x 8, and Qwen3-30B-A3B (H 2048, F 768,
 * top-8 of 128) at 8192 and 32768 tokens, balanced and skewed. */
static const mlp_shape shapes[] = {
    {131072, 4096, 1024, 64, 0, "32768 tokens top-4"},
    {32768, 7168, 2048, 4, 0, "DeepSeek-V3 EP rank, E=4"},
    {32768, 7168, 2048, 8, 0, "DeepSeek-V3 EP rank, E=8"},
    {65536, 2048, 768, 128, 0, "Qwen3-30B-A3B 8192 tokens"},
    {32768, 7168, 2048, 32, 0, "DeepSeek-V3 EP rank of 32 experts"},
    {32768, 7168, 2048, 32, 1, "DeepSeek-V3 EP rank of 32 experts, skewed"},
    {65536, 2048, 768, 128, 1, "Qwen3-30B-A3B 8192 tokens, skewed"},
    {262144, 2048, 768, 128, 0, "Qwen3-30B-A3B 32768 tokens"},
    {262144, 2048, 768, 128, 1, "Qwen3-30B-A3B 32768 tokens, skewed"},
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

typedef struct mlp_result {
    double fwd_ms, bwd_ms, act_fwd_ms, act_bwd_ms;
    double fwd_tflops, bwd_tflops;
    double fwd_bytes, bwd_bytes;         /* minimum traffic of each pass     */
    double fwd_line_ms, bwd_line_ms;     /* roofline time of each pass       */
    double act_bytes_fwd, act_bytes_bwd; /* bytes the activation kernels move */
} mlp_result;

/* ---- small helpers ------------------------------------------------------- */

static double unit_normal(uint64_t* s) {
    double u = 1.0 - mst_splitmix_unit(s), v = mst_splitmix_unit(s); /* u in (0, 1] */
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* Counts of `rows` (token, expert) pairs routed at random (top-k routing of
 * rows/k tokens): uniformly (near balanced with the usual spread), or, when
 * skewed, to expert e with weight 1/(e+1)^1.2 (the hottest expert takes
 * ~32 % of the rows at E=32, ~27 % at E=128). */
static void make_counts(int32_t* counts, int E, int64_t rows, int skewed, uint64_t seed) {
    double* cdf = (double*)malloc(sizeof(double) * (size_t)E);
    double sum = 0;
    for (int e = 0; e < E; e++) cdf[e] = sum += skewed ? 1.0 / pow(e + 1.0, 1.2) : 1.0;
    memset(counts, 0, sizeof(int32_t) * (size_t)E);
    for (int64_t i = 0; i < rows; i++) {
        if (!skewed) {
            counts[mst_splitmix64(&seed) % (uint64_t)E]++;
            continue;
        }
        const double u = mst_splitmix_unit(&seed) * sum;
        int e = 0;
        while (e + 1 < E && cdf[e] <= u) e++;
        counts[e]++;
    }
    free(cdf);
}

/* Fills n bytes of backend memory with bf16 N(0, scale^2) (a 16 MiB host
 * pattern repeated) — or fp32 U(lo, 1) when fp32 is set. */
static mst_status fill_random(mst_ctx_t* ctx, void* dst, size_t n_bytes, double scale, int fp32,
                              uint64_t seed) {
    enum { CHUNK = 1 << 24 };
    unsigned char* h = (unsigned char*)malloc(CHUNK);
    if (!h) return mst_set_error(MST_ERR_OOM, "bench host pattern");
    for (size_t i = 0; i < CHUNK / 4; i++) {
        if (fp32) ((float*)h)[i] = (float)(0.05 + 0.95 * mst_splitmix_unit(&seed));
        else {
            ((uint16_t*)h)[2 * i] = mst_fp32_to_bf16((float)(unit_normal(&seed) * scale));
            ((uint16_t*)h)[2 * i + 1] = mst_fp32_to_bf16((float)(unit_normal(&seed) * scale));
        }
    }
    mst_status st = MST_OK;
    for (size_t off = 0; off < n_bytes && st == MST_OK; off += CHUNK)
        st = mst_copy_h2b(ctx, (char*)dst + off, h, n_bytes - off < CHUNK ? n_bytes - off : CHUNK);
    free(h);
    return st;
}

/* ---- one MLP problem in backend memory ------------------------------------ */

typedef struct mlp_bufs {
    mst_mlp_config cfg;
    mst_mlp_weights w;
    mst_tensor x, p, counts, y, dy, dx, dp; /* x and p live in the saver's KEEP buffers */
    mst_saver_basic_t* saver;
    void* mem[16];                          /* allocations to free */
    int n_mem;
} mlp_bufs;

static mst_status alloc_t(mst_ctx_t* ctx, mlp_bufs* b, mst_tensor* t, mst_dtype dt, int64_t rows,
                          int64_t cols) {
    void* p = NULL;
    MST_TRY(mst_alloc(ctx, (size_t)rows * (size_t)cols * mst_dtype_size(dt), &p));
    b->mem[b->n_mem++] = p;
    *t = mst_tensor_make(p, dt, rows, cols);
    return MST_OK;
}

static void bufs_free(mst_ctx_t* ctx, mlp_bufs* b) {
    for (int i = 0; i < b->n_mem; i++) mst_free(ctx, b->mem[i]);
    mst_saver_basic_destroy(b->saver);
    memset(b, 0, sizeof *b);
}

/* Tensor n of R rows, in its saved shape, from the saver. */
static mst_status produce_saved(const mst_saver* sv, const mst_mlp_config* cfg, mst_saved_name n, int64_t R,
                                mst_tensor* out) {
    int64_t cols;
    mst_dtype dt;
    MST_TRY(mst_saved_shape(n, cfg->hidden, cfg->ffn, &cols, &dt));
    return sv->produce(sv->self, n, R, cols, dt, out);
}

/* Weights with biases, inputs produced straight into the saver's buffers. */
static mst_status bufs_make(mst_ctx_t* ctx, const mlp_shape* s, const int32_t* counts, uint64_t seed,
                            mlp_bufs* b) {
    memset(b, 0, sizeof *b);
    const int64_t R = s->rows, H = s->hidden, F = s->ffn, E = s->E;
    b->cfg = mst_mlp_config_default(s->E, H, F);
    mst_policy keep[MST_N_SAVED] = {MST_POLICY_KEEP, MST_POLICY_KEEP, MST_POLICY_KEEP, MST_POLICY_KEEP};
    MST_TRY(mst_saver_basic_create(ctx, R, &b->cfg, keep, &b->saver));
    const mst_saver* sv = mst_saver_basic_get(b->saver);
    MST_TRY(produce_saved(sv, &b->cfg, MST_SAVED_FC1_INPUT, R, &b->x));
    MST_TRY(produce_saved(sv, &b->cfg, MST_SAVED_PROBS, R, &b->p));
    MST_TRY(alloc_t(ctx, b, &b->counts, MST_DTYPE_INT32, E, 1));
    MST_TRY(alloc_t(ctx, b, &b->y, MST_DTYPE_BF16, R, H));
    MST_TRY(alloc_t(ctx, b, &b->dy, MST_DTYPE_BF16, R, H));
    MST_TRY(alloc_t(ctx, b, &b->dx, MST_DTYPE_BF16, R, H));
    MST_TRY(alloc_t(ctx, b, &b->dp, MST_DTYPE_FP32, R, 1));
    MST_TRY(alloc_t(ctx, b, &b->w.w1, MST_DTYPE_BF16, E * 2 * F, H));
    MST_TRY(alloc_t(ctx, b, &b->w.b1, MST_DTYPE_BF16, E, 2 * F));
    MST_TRY(alloc_t(ctx, b, &b->w.w2, MST_DTYPE_BF16, E * H, F));
    MST_TRY(alloc_t(ctx, b, &b->w.b2, MST_DTYPE_BF16, E, H));
    MST_TRY(alloc_t(ctx, b, &b->w.g_w1, MST_DTYPE_FP32, E * 2 * F, H));
    MST_TRY(alloc_t(ctx, b, &b->w.g_b1, MST_DTYPE_FP32, E, 2 * F));
    MST_TRY(alloc_t(ctx, b, &b->w.g_w2, MST_DTYPE_FP32, E * H, F));
    MST_TRY(alloc_t(ctx, b, &b->w.g_b2, MST_DTYPE_FP32, E, H));
    MST_TRY(mst_copy_h2b(ctx, b->counts.data, counts, sizeof(int32_t) * (size_t)E));
    MST_TRY(fill_random(ctx, b->x.data, mst_tensor_bytes(&b->x), 1.0, 0, seed + 1));
    MST_TRY(fill_random(ctx, b->p.data, mst_tensor_bytes(&b->p), 0, 1, seed + 2));
    MST_TRY(fill_random(ctx, b->dy.data, mst_tensor_bytes(&b->dy), 1.0, 0, seed + 3));
    MST_TRY(fill_random(ctx, b->w.w1.data, mst_tensor_bytes(&b->w.w1), 1.0 / sqrt((double)H), 0, seed + 4));
    MST_TRY(fill_random(ctx, b->w.b1.data, mst_tensor_bytes(&b->w.b1), 0.1, 0, seed + 5));
    MST_TRY(fill_random(ctx, b->w.w2.data, mst_tensor_bytes(&b->w.w2), 1.0 / sqrt((double)F), 0, seed + 6));
    MST_TRY(fill_random(ctx, b->w.b2.data, mst_tensor_bytes(&b->w.b2), 0.1, 0, seed + 7));
    MST_TRY(mst_fill(ctx, b->w.g_w1.data, 0, mst_tensor_bytes(&b->w.g_w1)));
    MST_TRY(mst_fill(ctx, b->w.g_b1.data, 0, mst_tensor_bytes(&b->w.g_b1)));
    MST_TRY(mst_fill(ctx, b->w.g_w2.data, 0, mst_tensor_bytes(&b->w.g_w2)));
    return mst_fill(ctx, b->w.g_b2.data, 0, mst_tensor_bytes(&b->w.g_b2));
}

static mst_status forward(mst_ctx_t* ctx, mlp_bufs* b) {
    return mst_grouped_mlp_forward(ctx, &b->cfg, &b->w, &b->x, &b->p, &b->counts,
                                   mst_saver_basic_get(b->saver), &b->y);
}

static mst_status backward(mst_ctx_t* ctx, mlp_bufs* b, mst_wgrad_mode mode) {
    return mst_grouped_mlp_backward(ctx, &b->cfg, &b->w, &b->dy, &b->counts,
                                    mst_saver_basic_get(b->saver), &b->dx, &b->dp, mode);
}

/* ---- 1. validation: CUDA against the CPU reference ------------------------ */

static double rel_err(const float* got, const float* ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return isnan(num) ? INFINITY : sqrt(num / (den > 0 ? den : 1));
}

/* Downloads t's first n rows as fp32. */
static float* fetch_rows(mst_ctx_t* ctx, const mst_tensor* t, int64_t n) {
    size_t count = (size_t)(n * t->cols);
    float* f = (float*)malloc(sizeof(float) * count);
    void* raw = malloc(count * mst_dtype_size(t->dtype));
    if (!f || !raw || mst_copy_b2h(ctx, raw, t->data, count * mst_dtype_size(t->dtype)) != MST_OK) {
        free(f), free(raw);
        return NULL;
    }
    if (t->dtype == MST_DTYPE_BF16) mst_bf16_to_fp32_array(f, (const uint16_t*)raw, count);
    else memcpy(f, raw, count * sizeof(float));
    free(raw);
    return f;
}

/* Runs a ragged problem on both backends; the bf16 tolerance of the tests. */
static int validate(mst_ctx_t* gpu) {
    const mlp_shape s = {3000, 512, 256, 8, 0, "validation"};
    int32_t counts[8] = {900, 0, 13, 400, 777, 1, 300, 309}; /* 2700 of 3000 rows */
    mst_ctx_t* cpu = NULL;
    mlp_bufs bg, bc;
    int ok = mst_ctx_create(MST_BACKEND_CPU, 0, &cpu) == MST_OK;
    ok = ok && bufs_make(gpu, &s, counts, 42, &bg) == MST_OK && bufs_make(cpu, &s, counts, 42, &bc) == MST_OK;
    bg.cfg.act = bc.cfg.act = MST_ACT_CLAMPED_SWIGLU;
    mst_wgrad_mode m = MST_WGRAD_OVERWRITE;
    ok = ok && forward(gpu, &bg) == MST_OK && backward(gpu, &bg, m) == MST_OK && mst_ctx_check(gpu) == MST_OK;
    ok = ok && forward(cpu, &bc) == MST_OK && backward(cpu, &bc, m) == MST_OK;
    if (!ok) {
        fprintf(stderr, "bench mlp: validation run failed: %s\n", mst_last_error());
        if (cpu) mst_ctx_destroy(cpu);
        return 0;
    }
    const int64_t n = 2700;
    const struct { mst_tensor *g, *c; int64_t rows; const char* name; } outs[] = {
        {&bg.y, &bc.y, n, "y"}, {&bg.dx, &bc.dx, n, "dx"}, {&bg.dp, &bc.dp, n, "dprobs"},
        {&bg.w.g_w1, &bc.w.g_w1, bg.w.g_w1.rows, "dW1"}, {&bg.w.g_w2, &bc.w.g_w2, bg.w.g_w2.rows, "dW2"},
        {&bg.w.g_b2, &bc.w.g_b2, bg.w.g_b2.rows, "db2"},
    };
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++) {
        float* g = fetch_rows(gpu, outs[i].g, outs[i].rows);
        float* c = fetch_rows(cpu, outs[i].c, outs[i].rows);
        double e = g && c ? rel_err(g, c, (size_t)(outs[i].rows * outs[i].g->cols)) : INFINITY;
        printf("validate %-7s cuda vs cpu: rel err %.2e %s\n", outs[i].name, e, e < 1e-2 ? "ok" : "FAILED");
        ok = ok && e < 1e-2;
        free(g), free(c);
    }
    bufs_free(gpu, &bg);
    bufs_free(cpu, &bc);
    mst_ctx_destroy(cpu);
    return ok;
}

/* ---- 2. timing -------------------------------------------------------------- */

#define CUDA_BENCH(call)                                                                      \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess)                                                                \
            return mst_set_error(MST_ERR_BACKEND, "%s: %s", #call, cudaGetErrorString(e_));   \
    } while (0)

typedef enum { OP_FORWARD, OP_BACKWARD, OP_ACT_FORWARD, OP_ACT_BACKWARD } bench_op;

/* The activation alone, through the backend slot, on b's saved h. */
static mst_status act_alone(mst_ctx_t* ctx, mlp_bufs* b, int backward_pass) {
    const mst_saver* sv = mst_saver_basic_get(b->saver);
    mst_tensor h, z, dz, dh;
    MST_TRY(produce_saved(sv, &b->cfg, MST_SAVED_ACT_INPUT, b->x.rows, &h));
    MST_TRY(produce_saved(sv, &b->cfg, MST_SAVED_FC2_INPUT, b->x.rows, &z));
    dz = z;     /* any [R, F] bf16 input will do for timing */
    dh = b->dx; /* [R, H] >= [R, 2F] bytes for every shape here */
    mst_act_args a = {0};
    a.n_groups = b->cfg.n_groups, a.max_rows = b->x.rows, a.ffn = b->cfg.ffn, a.hidden = b->cfg.hidden;
    a.counts = (const int32_t*)b->counts.data, a.h = (const uint16_t*)h.data, a.probs = (const float*)b->p.data;
    a.act = b->cfg.act, a.limit = b->cfg.clamp_limit, a.alpha = b->cfg.clamp_alpha;
    if (!backward_pass) {
        a.z = (uint16_t*)z.data;
        return ctx->be->act_forward(ctx, &a);
    }
    a.dz = (const uint16_t*)dz.data, a.dh = (uint16_t*)dh.data, a.dprobs = (float*)b->dp.data;
    a.dy = (const uint16_t*)b->dy.data, a.b2 = (const uint16_t*)b->w.b2.data;
    return ctx->be->act_backward(ctx, &a);
}

static mst_status enqueue(mst_ctx_t* ctx, mlp_bufs* b, bench_op op) {
    switch (op) {
    case OP_FORWARD: return forward(ctx, b);
    case OP_BACKWARD: return backward(ctx, b, MST_WGRAD_ACCUMULATE);
    case OP_ACT_FORWARD: return act_alone(ctx, b, 0);
    case OP_ACT_BACKWARD: return act_alone(ctx, b, 1);
    }
    return MST_ERR_INVALID;
}

/* Captures ops[k] in a graph on `s`, then replays them interleaved, one of
 * each per round, so clock and temperature drift reach all alike: ms[k] is
 * the mean of `iters` rounds after 3 warm-up rounds. */
static mst_status time_graphs(mst_ctx_t* ctx, mlp_bufs* b, const bench_op* ops, int n, cudaStream_t s, int iters,
                              double* ms) {
    cudaGraph_t g[8] = {0};
    cudaGraphExec_t ge[8] = {0};
    cudaEvent_t e0, e1;
    if (n > 8) return mst_set_error(MST_ERR_INVALID, "n = %d graphs: at most 8", n);
    for (int k = 0; k < n; k++) {
        MST_TRY(mst_ctx_set_stream(ctx, s));
        CUDA_BENCH(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        const mst_status st = enqueue(ctx, b, ops[k]);
        cudaError_t ce = cudaStreamEndCapture(s, &g[k]);
        MST_TRY(mst_ctx_set_stream(ctx, NULL));
        MST_TRY(st);
        CUDA_BENCH(ce);
        CUDA_BENCH(cudaGraphInstantiate(&ge[k], g[k], 0));
        ms[k] = 0;
    }
    CUDA_BENCH(cudaEventCreate(&e0));
    CUDA_BENCH(cudaEventCreate(&e1));
    for (int i = 0; i < iters + 3; i++)
        for (int k = 0; k < n; k++) {
            CUDA_BENCH(cudaEventRecord(e0, s));
            CUDA_BENCH(cudaGraphLaunch(ge[k], s));
            CUDA_BENCH(cudaEventRecord(e1, s));
            CUDA_BENCH(cudaEventSynchronize(e1));
            float t = 0;
            CUDA_BENCH(cudaEventElapsedTime(&t, e0, e1));
            if (i >= 3) ms[k] += t / iters;
        }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    for (int k = 0; k < n; k++) cudaGraphExecDestroy(ge[k]), cudaGraphDestroy(g[k]);
    return mst_ctx_check(ctx);
}

/* Minimum bytes of each pass (bf16 tensors 2 bytes, fp32 4): every input read
 * once, every output written once, main_grad read and written once.
 * forward  reads x, p, w1, b1, w2, b2; writes the saved h [R, 2F] and
 *          z [R, F] and y;
 * backward reads dy, x, h, z, p, w1, w2, b2; writes dx, dprobs; reads and
 *          writes the fp32 main_grads of w1, b1, w2, b2. */
static void pass_bytes(const mlp_shape* s, double* fwd, double* bwd) {
    const double R = (double)s->rows, H = (double)s->hidden, F = (double)s->ffn, E = s->E;
    const double weights = E * (2 * F * H + H * F), biases = E * (2 * F + H);
    const double saved = R * (2 * F + F) * 2;
    *fwd = R * H * 2 + R * 4 + (weights + biases) * 2 + saved + R * H * 2;
    *bwd = R * H * 2 * 2 + saved + R * 4 + (weights + E * H) * 2 + R * H * 2 + R * 4 + (weights + biases) * 4 * 2;
}

static mst_status run_shape(mst_ctx_t* ctx, const mlp_shape* s, const int32_t* counts, cudaStream_t st,
                            int iters, const mst_bench_roofs* roofs, mlp_result* r) {
    mlp_bufs b;
    mst_status e = bufs_make(ctx, s, counts, 1234, &b);
    /* eager once: sizes the workspaces, so the captures allocate nothing */
    if (e == MST_OK) e = forward(ctx, &b);
    if (e == MST_OK) e = backward(ctx, &b, MST_WGRAD_ACCUMULATE);
    if (e == MST_OK) e = mst_ctx_check(ctx);
    const bench_op ops[] = {OP_FORWARD, OP_BACKWARD, OP_ACT_FORWARD, OP_ACT_BACKWARD};
    double ms[4];
    if (e == MST_OK) e = time_graphs(ctx, &b, ops, 4, st, iters, ms);
    r->fwd_ms = ms[0], r->bwd_ms = ms[1], r->act_fwd_ms = ms[2], r->act_bwd_ms = ms[3];
    bufs_free(ctx, &b);
    const double flop = (double)s->rows * s->hidden * s->ffn;
    r->fwd_tflops = 6 * flop / (r->fwd_ms * 1e-3) / 1e12;
    r->bwd_tflops = 12 * flop / (r->bwd_ms * 1e-3) / 1e12;
    pass_bytes(s, &r->fwd_bytes, &r->bwd_bytes);
    r->fwd_line_ms = mst_bench_roofline_ms(roofs, 6 * flop, r->fwd_bytes);
    r->bwd_line_ms = mst_bench_roofline_ms(roofs, 12 * flop, r->bwd_bytes);
    /* act forward: read h, p; write z. backward: read h, dz, p, dy, b2; write dh, dprobs */
    r->act_bytes_fwd = (double)s->rows * (4 * s->ffn + 2 * s->ffn + 4);
    r->act_bytes_bwd = (double)s->rows * (4 * s->ffn + 2 * s->ffn + 4 * s->ffn + 2 * s->hidden + 8);
    return e;
}

static void write_json(FILE* f, const char* device, const mst_bench_roofs* roofs, const int* which, int n_which,
                       int32_t* const* counts, const mlp_result* res) {
    fprintf(f, "{\n  \"bench\": \"mlp\",\n  \"device\": \"%s\",\n  \"roof_cublas_tflops\": %.1f,\n"
               "  \"copy_gbps\": %.1f,\n  \"shapes\": [\n",
            device, roofs->dense_tflops, roofs->copy_gbps);
    for (int k = 0; k < n_which; k++) {
        const mlp_shape* s = &shapes[which[k]];
        const mlp_result* r = &res[k];
        fprintf(f, "    {\"index\": %d, \"what\": \"%s\", \"skewed\": %d, \"fwd_bytes\": %.0f, \"bwd_bytes\": %.0f, "
                   "\"fwd_roofline_ms\": %.4f, \"bwd_roofline_ms\": %.4f, ",
                which[k], s->what, s->skewed, r->fwd_bytes, r->bwd_bytes, r->fwd_line_ms, r->bwd_line_ms);
        fprintf(f, "\"rows\": %lld, \"hidden\": %lld, \"ffn\": %lld, \"E\": %d, \"act\": \"swiglu\", "
                   "\"fwd_ms\": %.4f, \"bwd_ms\": %.4f, \"fwd_tflops\": %.1f, \"bwd_tflops\": %.1f, "
                   "\"act_fwd_ms\": %.4f, \"act_bwd_ms\": %.4f, \"act_fwd_bytes\": %.0f, \"act_bwd_bytes\": %.0f, "
                   "\"counts\": [",
                (long long)s->rows, (long long)s->hidden, (long long)s->ffn, s->E, r->fwd_ms, r->bwd_ms,
                r->fwd_tflops, r->bwd_tflops, r->act_fwd_ms, r->act_bwd_ms, r->act_bytes_fwd, r->act_bytes_bwd);
        for (int g = 0; g < s->E; g++) fprintf(f, "%s%d", g ? ", " : "", counts[k][g]);
        fprintf(f, "]}%s\n", k + 1 < n_which ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
}

int mst_bench_mlp(int argc, char** argv) {
    const char* json = NULL;
    int32_t iters = 20, only = -1;
    mst_args a;
    mst_args_init(&a, "moestash bench mlp", argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--iters")) rc = mst_args_int32(&a, 1, 1000000, &iters);
        else if (mst_args_is(&a, "--shape")) rc = mst_args_int32(&a, 0, N_SHAPES - 1, &only);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench mlp [--json FILE] [--iters N (20)] [--shape 0..%d]\n", N_SHAPES - 1);
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (!mst_backend_available(MST_BACKEND_CUDA)) {
        fprintf(stderr, "bench mlp: needs the cuda backend (no device or not built in)\n");
        return 2;
    }
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(MST_BACKEND_CUDA, 0, &ctx) != MST_OK) {
        fprintf(stderr, "bench mlp: %s\n", mst_last_error());
        return 1;
    }
    printf("bench mlp on %s\n", mst_ctx_describe(ctx));
    int rc = 1, which[N_SHAPES], n_which = 0;
    int32_t* counts[N_SHAPES] = {0};
    mlp_result res[N_SHAPES];
    memset(res, 0, sizeof res);
    mst_bench_roofs roofs = {0, 0};
    cudaStream_t st = NULL;
    if (!validate(ctx)) goto out;
    if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) goto out;
    if (mst_bench_roofs_measure(ctx, st, &roofs) != MST_OK) {
        fprintf(stderr, "bench mlp: roofs: %s\n", mst_last_error());
        goto out;
    }
    for (int i = 0; i < N_SHAPES; i++)
        if (only < 0 || only == i) which[n_which++] = i;
    for (int k = 0; k < n_which; k++) {
        const mlp_shape* s = &shapes[which[k]];
        counts[k] = (int32_t*)malloc(sizeof(int32_t) * (size_t)s->E);
        make_counts(counts[k], s->E, s->rows, s->skewed, 1000 + (uint64_t)which[k]);
        if (run_shape(ctx, s, counts[k], st, iters, &roofs, &res[k]) != MST_OK) {
            fprintf(stderr, "bench mlp: shape %d: %s\n", which[k], mst_last_error());
            goto out;
        }
        printf("shape %d (%s) done\n", which[k], s->what);
    }
    printf("\nroofs (same card, same run): cuBLAS bf16 GEMM 8192^3 = %.0f TFLOP/s, device copy = %.0f GB/s "
           "(read + write)\n", roofs.dense_tflops, roofs.copy_gbps);
    printf("roofline = max(FLOPs / dense, minimum bytes / copy); /line = roofline time / ours, /dense = ours "
           "TFLOP/s / dense\n");
    printf("%-2s %-7s %-5s %-5s %-4s %-4s | %-8s %-7s %-6s %-5s | %-8s %-7s %-6s %-5s | %-9s %-9s\n", "#", "rows", "H",
           "F", "E", "skew", "fwd ms", "TFLOP/s", "/dense", "/line", "bwd ms", "TFLOP/s", "/dense", "/line",
           "act f GB/s", "act b GB/s");
    for (int k = 0; k < n_which; k++) {
        const mlp_shape* s = &shapes[which[k]];
        const mlp_result* r = &res[k];
        printf("%-2d %-7lld %-5lld %-5lld %-4d %-4s | %-8.3f %-7.0f %-6.2f %-5.2f | %-8.3f %-7.0f %-6.2f %-5.2f | "
               "%-10.0f %-9.0f\n",
               which[k], (long long)s->rows, (long long)s->hidden, (long long)s->ffn, s->E, s->skewed ? "yes" : "no",
               r->fwd_ms, r->fwd_tflops, r->fwd_tflops / roofs.dense_tflops, r->fwd_line_ms / r->fwd_ms, r->bwd_ms,
               r->bwd_tflops, r->bwd_tflops / roofs.dense_tflops, r->bwd_line_ms / r->bwd_ms,
               r->act_bytes_fwd / (r->act_fwd_ms * 1e6), r->act_bytes_bwd / (r->act_bwd_ms * 1e6));
    }
    printf("(act: the activation kernels alone, as run inside each pass; PyTorch ratio: bench/torch/mlp.py)\n");
    if (json) {
        FILE* f = mst_out_open("moestash bench mlp", json);
        if (!f) goto out;
        write_json(f, mst_ctx_describe(ctx), &roofs, which, n_which, counts, res);
        if (mst_out_close("moestash bench mlp", json, f)) goto out;
    }
    rc = 0;
out:
    for (int k = 0; k < N_SHAPES; k++) free(counts[k]);
    if (st) cudaStreamDestroy(st);
    mst_ctx_destroy(ctx);
    return rc;
}

#else /* no CUDA */

int mst_bench_mlp(int argc, char** argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "bench mlp: needs the cuda backend (built without CUDA)\n");
    return 2;
}

#endif
