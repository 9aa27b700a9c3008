/*
 * bench_gemm.c — `moestash bench gemm [--json FILE] [--reps N] [--op NAME] [--shape I]`: the CUDA
 * grouped linear (forward TN, dgrad NN, wgrad NT with ACCUMULATE) with
 * device-side counts, graph-replayed, beside three cuBLAS baselines measured
 * in the same run on the same buffers:
 *   loop    per-expert cublasGemmEx with host-known counts
 *   grouped cublasGemmGroupedBatchedEx (one group per expert, host sizes)
 *   roof    one dense cublasGemmEx of the same total FLOPs
 * Every variant is captured in a CUDA graph and replayed (launch gaps out of
 * the figures), the variants of one op interleaved round by round; a
 * variant that cannot be captured is timed eagerly and says so. Shapes
 * (total rows x in -> out, E) with balanced and skewed (Zipf-like) counts,
 * buffers of max_rows = 1.5 x rows. Before timing, sampled outputs
 * of ours and of the loop are checked against float64 references.
 * Every line also gives ours against the op's roofline (bench/roof.h):
 * max(FLOPs / the dense roof of the line, minimum bytes / device copy GB/s
 * measured at the start of the run), bytes as op_bytes below.
 * A short table is printed last; --json writes every figure. --op runs one
 * op (forward, dgrad or wgrad) alone, --shape one shape (an index of shapes[]).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"
#include "moestash.h"
#include "roof.h"

#ifdef MST_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>


typedef struct gemm_shape {
    int64_t rows, in, out; /* T, I, O */
    int32_t E;
} gemm_shape;

static const gemm_shape shapes[] = {
    {32768, 4096, 4096, 8},
    {65536, 7168, 4096, 32},
    {16384, 2048, 2816, 64},
    {131072, 4096, 2048, 64},
    {131072, 1024, 4096, 64}, /* fc2 of bench mlp's first shape (no target) */
    /* fine-grained: DeepSeek-V3 EP rank (32 experts, 4096 tokens x 8) fc1 / fc2 */
    {32768, 7168, 4096, 32},
    {32768, 2048, 7168, 32},
    /* Qwen3-30B-A3B (128 experts top-8) fc1 / fc2 at 8192 and 32768 tokens */
    {65536, 2048, 1536, 128},
    {65536, 768, 2048, 128},
    {262144, 2048, 1536, 128},
    {262144, 768, 2048, 128},
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

enum { OP_FWD, OP_DGRAD, OP_WGRAD, N_OPS };
static const char* const op_names[N_OPS + 1] = {"forward", "dgrad", "wgrad", NULL};
/* ours: the default kernel (TMA + wgmma on Hopper); ours_mma: the mma.sync
 * kernel; ours_regs: the wgmma kernel with forward / dgrad stored from
 * registers (wgrad is the same as ours); forced through mst_cuda_gg_kernel, for
 * the perf notes; ours_paged: wgrad only, x read in place from the pages of
 * a stash (64 rows per page), as the memory manager's STASH backward does. */
enum { V_OURS, V_OURS_MMA, V_OURS_REGS, V_OURS_PAGED, V_LOOP, V_GROUPED, V_ROOF, N_VARIANTS };
static const char* variant_names[N_VARIANTS] = {"ours",        "ours_mma",       "ours_regs",  "ours_paged",
                                                "cublas_loop", "cublas_grouped", "dense_roof"};
static const char* variant_kernel[N_VARIANTS] = {NULL, "mma", "wgmma_regs", NULL, NULL, NULL, NULL};
static int is_ours(int v) { return v <= V_OURS_PAGED; }

#define BLK (1 << 22) /* elements of the random block every input repeats */

typedef struct gemm_bufs {
    int64_t R, I, O;
    int32_t E;
    int32_t* counts_h;        /* [E] host                        */
    int64_t* off_h;           /* [E+1] host                      */
    mst_tensor counts;        /* [E, 1] int32 device             */
    mst_tensor x, w, dy;      /* [R,I] [E*O,I] [R,O] bf16        */
    mst_tensor y, dx, mg;     /* [R,O] [R,I] bf16, [E*O,I] fp32  */
    uint16_t *hx, *hw, *hdy;  /* [BLK] host blocks the inputs repeat */
    void** ptrs_d;            /* [3 * E] device pointer arrays (grouped) */
    mst_pool_t* pool;         /* pages of x for ours_paged (64 rows each) */
    mst_stash_handle_t* h;    /* x's rows [0, sum(counts)) in the pool    */
    mst_pages pages;          /* h's view                                 */
    mst_tensor xp;            /* x read from `pages`                      */
} gemm_bufs;

typedef struct gemm_fig {
    double ms[N_VARIANTS];     /* median ms, -1 when the variant failed or is unsupported */
    int graphed[N_VARIANTS];
    double err[N_VARIANTS];    /* sampled relative error vs float64 (ours and the loop) */
} gemm_fig;

/* ---- inputs --------------------------------------------------------------- */

static uint16_t* random_block(uint64_t seed, double scale) {
    uint16_t* b = (uint16_t*)malloc(sizeof(uint16_t) * BLK);
    for (int i = 0; i < BLK; i++) b[i] = mst_fp32_to_bf16((float)((2 * mst_splitmix_unit(&seed) - 1) * scale));
    return b;
}

/* Fills a device bf16 buffer of n elements with the host block repeated:
 * element e = blk[e % BLK]. */
static int fill_repeat(mst_ctx_t* ctx, uint16_t* dst, const uint16_t* blk, int64_t n) {
    int64_t have = n < BLK ? n : BLK;
    if (mst_copy_h2b(ctx, dst, blk, (size_t)have * 2) != MST_OK) return 0;
    while (have < n) {
        int64_t c = have <= n - have ? have : n - have;
        if (mst_copy_b2b(ctx, dst + have, dst, (size_t)c * 2) != MST_OK) return 0;
        have += c;
    }
    return 1;
}

/* Balanced: T/E each with a +-5% jitter; skewed: Zipf-like weights
 * 1/(g+1)^1.2, shuffled. Sums to T exactly. */
static void make_counts(int32_t* c, int E, int64_t T, int skewed, uint64_t seed) {
    double* wt = (double*)malloc(sizeof(double) * E);
    double sum = 0;
    for (int g = 0; g < E; g++) {
        wt[g] = skewed ? 1.0 / pow(g + 1.0, 1.2) : 0.95 + 0.1 * mst_splitmix_unit(&seed);
        sum += wt[g];
    }
    int64_t given = 0;
    for (int g = 0; g < E; g++) given += c[g] = (int32_t)floor((double)T * wt[g] / sum);
    for (int g = 0; given < T; g = (g + 1) % E, given++) c[g]++;
    for (int g = E - 1; g > 0; g--) {
        int j = (int)(mst_splitmix64(&seed) % (uint64_t)(g + 1));
        int32_t t = c[g];
        c[g] = c[j], c[j] = t;
    }
    free(wt);
}

/* ---- the variants ---------------------------------------------------------- */

typedef struct bench_run {
    mst_ctx_t* ctx;
    cublasHandle_t blas;
    gemm_bufs* b;
    int op;
    int variant;
} bench_run;

static double bf(uint16_t v) { return (double)mst_bf16_to_fp32(v); }

static cublasStatus_t gemm_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                              int k, const void* a, int lda, const void* b, int ldb, void* c, int ldc,
                              int c_fp32, float beta) {
    const float alpha = 1.0f;
    return cublasGemmEx(h, ta, tb, m, n, k, &alpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &beta, c,
                        c_fp32 ? CUDA_R_32F : CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* One cuBLAS GEMM of `rows` grouped rows starting at row r0 with weight
 * slice g (column-major view of the row-major buffers). */
static cublasStatus_t gemm_rows(bench_run* br, int64_t r0, int rows, int g) {
    gemm_bufs* b = br->b;
    const int I = (int)b->I, O = (int)b->O;
    const uint16_t* x = (const uint16_t*)b->x.data + r0 * I;
    const uint16_t* dy = (const uint16_t*)b->dy.data + r0 * O;
    const uint16_t* w = (const uint16_t*)b->w.data + (int64_t)g * O * I;
    if (br->op == OP_FWD)
        return gemm_ex(br->blas, CUBLAS_OP_T, CUBLAS_OP_N, O, rows, I, w, I, x, I,
                       (uint16_t*)b->y.data + r0 * O, O, 0, 0.0f);
    if (br->op == OP_DGRAD)
        return gemm_ex(br->blas, CUBLAS_OP_N, CUBLAS_OP_N, I, rows, O, w, I, dy, O,
                       (uint16_t*)b->dx.data + r0 * I, I, 0, 0.0f);
    return gemm_ex(br->blas, CUBLAS_OP_N, CUBLAS_OP_T, I, O, rows, x, I, dy, O,
                   (float*)b->mg.data + (int64_t)g * O * I, I, 1, 1.0f);
}

/* Per group (nonempty only): m, n, k, lda, ldb, ldc, ops and pointers of
 * the same GEMMs as gemm_rows, for cublasGemmGroupedBatchedEx. */
static cublasStatus_t grouped(bench_run* br) {
    gemm_bufs* b = br->b;
    const int I = (int)b->I, O = (int)b->O, E = b->E;
    int m[E], n[E], k[E], lda[E], ldb[E], ldc[E], size[E];
    cublasOperation_t ta[E], tb[E];
    float alpha[E], beta[E];
    const void* hp[3 * E];
    int q = 0;
    for (int g = 0; g < E; g++) {
        int rows = b->counts_h[g];
        int64_t r0 = b->off_h[g];
        if (rows == 0) continue;
        const uint16_t* x = (const uint16_t*)b->x.data + r0 * I;
        const uint16_t* dy = (const uint16_t*)b->dy.data + r0 * O;
        const uint16_t* w = (const uint16_t*)b->w.data + (int64_t)g * O * I;
        size[q] = 1, alpha[q] = 1.0f, beta[q] = br->op == OP_WGRAD ? 1.0f : 0.0f;
        if (br->op == OP_FWD) {
            ta[q] = CUBLAS_OP_T, tb[q] = CUBLAS_OP_N, m[q] = O, n[q] = rows, k[q] = I;
            hp[q] = w, lda[q] = I, hp[E + q] = x, ldb[q] = I;
            hp[2 * E + q] = (uint16_t*)b->y.data + r0 * O, ldc[q] = O;
        } else if (br->op == OP_DGRAD) {
            ta[q] = CUBLAS_OP_N, tb[q] = CUBLAS_OP_N, m[q] = I, n[q] = rows, k[q] = O;
            hp[q] = w, lda[q] = I, hp[E + q] = dy, ldb[q] = O;
            hp[2 * E + q] = (uint16_t*)b->dx.data + r0 * I, ldc[q] = I;
        } else {
            ta[q] = CUBLAS_OP_N, tb[q] = CUBLAS_OP_T, m[q] = I, n[q] = O, k[q] = rows;
            hp[q] = x, lda[q] = I, hp[E + q] = dy, ldb[q] = O;
            hp[2 * E + q] = (float*)b->mg.data + (int64_t)g * O * I, ldc[q] = I;
        }
        q++;
    }
    /* pointer arrays live on the device: A at [0, q), B at [E, E+q), C at [2E, 2E+q);
     * uploaded by the eager warm-up, already in place when capturing */
    cudaStream_t s = (cudaStream_t)mst_ctx_stream(br->ctx);
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(s, &cs);
    if (cs == cudaStreamCaptureStatusNone &&
        (cudaMemcpyAsync(b->ptrs_d, hp, sizeof(void*) * 3 * E, cudaMemcpyHostToDevice, s) != cudaSuccess ||
         cudaStreamSynchronize(s) != cudaSuccess))
        return CUBLAS_STATUS_EXECUTION_FAILED;
    return cublasGemmGroupedBatchedEx(br->blas, ta, tb, m, n, k, alpha, (const void* const*)b->ptrs_d,
                                      CUDA_R_16BF, lda, (const void* const*)(b->ptrs_d + E), CUDA_R_16BF,
                                      ldb, beta, b->ptrs_d + 2 * E,
                                      br->op == OP_WGRAD ? CUDA_R_32F : CUDA_R_16BF, ldc, q, size,
                                      CUBLAS_COMPUTE_32F);
}

/* wgrad's x for the variant: in memory, or in the pages (ours_paged). */
static const mst_tensor* wgrad_x(const bench_run* br) {
    return br->variant == V_OURS_PAGED ? &br->b->xp : &br->b->x;
}

/* Enqueues one variant of one op on the context's stream; 0 on success. */
static int enqueue(bench_run* br) {
    gemm_bufs* b = br->b;
    if (is_ours(br->variant)) {
        mst_status st;
        if (br->variant == V_OURS_PAGED && br->op != OP_WGRAD) return 1; /* wgrad only */
        mst_cuda_gg_kernel(br->ctx, variant_kernel[br->variant]);
        if (br->op == OP_FWD) st = mst_grouped_linear_forward(br->ctx, &b->x, &b->w, NULL, NULL, &b->counts, &b->y);
        else if (br->op == OP_DGRAD) st = mst_grouped_linear_dgrad(br->ctx, &b->dy, &b->w, &b->counts, &b->dx);
        else
            st = mst_grouped_linear_wgrad(br->ctx, &b->dy, wgrad_x(br), NULL, NULL, &b->counts, &b->mg, NULL, NULL,
                                          MST_WGRAD_ACCUMULATE);
        mst_cuda_gg_kernel(br->ctx, NULL);
        if (st != MST_OK) fprintf(stderr, "bench gemm: ours %s: %s\n", op_names[br->op], mst_last_error());
        return st != MST_OK;
    }
    if (br->variant == V_GROUPED) return grouped(br) != CUBLAS_STATUS_SUCCESS;
    if (br->variant == V_ROOF) { /* all rows as one group, weight 0: same FLOPs */
        int64_t T = b->off_h[b->E];
        return gemm_rows(br, 0, (int)T, 0) != CUBLAS_STATUS_SUCCESS;
    }
    for (int g = 0; g < b->E; g++)
        if (b->counts_h[g] && gemm_rows(br, b->off_h[g], b->counts_h[g], g) != CUBLAS_STATUS_SUCCESS) return 1;
    return 0;
}

/* Warm-up (eager, sizes workspaces), then captures one run of the variant;
 * *exec stays NULL (timed eagerly) where capture fails. 0 on success. */
static int prepare(bench_run* br, cudaGraphExec_t* exec) {
    cudaStream_t s = (cudaStream_t)mst_ctx_stream(br->ctx);
    cudaGraph_t graph = NULL;
    *exec = NULL;
    if (enqueue(br) || cudaStreamSynchronize(s) != cudaSuccess) return 1;
    if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
        int bad = enqueue(br);
        cudaError_t e = cudaStreamEndCapture(s, &graph);
        if (bad || e != cudaSuccess || cudaGraphInstantiate(exec, graph, 0) != cudaSuccess) *exec = NULL;
        if (graph) cudaGraphDestroy(graph);
        cudaGetLastError();
    }
    return 0;
}

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

/* Times every variant of one op, interleaved (one run of each per round, so
 * clock and temperature drift reach all variants alike): the median of
 * `reps` rounds after two warm-up rounds, in ms; -1 where a variant fails. */
static void time_variants(bench_run* br, int reps, gemm_fig* f) {
    cudaStream_t s = (cudaStream_t)mst_ctx_stream(br->ctx);
    cudaGraphExec_t exec[N_VARIANTS];
    int ok[N_VARIANTS];
    double* t = (double*)malloc(sizeof(double) * N_VARIANTS * reps); /* [variant][rep] */
    cudaEvent_t ev[2];
    cudaEventCreate(&ev[0]);
    cudaEventCreate(&ev[1]);
    for (int v = 0; v < N_VARIANTS; v++) {
        br->variant = v;
        ok[v] = !prepare(br, &exec[v]);
        f->graphed[v] = exec[v] != NULL;
    }
    for (int i = 0; i < reps + 2; i++)
        for (int v = 0; v < N_VARIANTS; v++) {
            if (!ok[v]) continue;
            br->variant = v;
            cudaEventRecord(ev[0], s);
            ok[v] = exec[v] ? cudaGraphLaunch(exec[v], s) == cudaSuccess : !enqueue(br);
            cudaEventRecord(ev[1], s);
            ok[v] = ok[v] && cudaEventSynchronize(ev[1]) == cudaSuccess;
            float ms = 0;
            cudaEventElapsedTime(&ms, ev[0], ev[1]);
            if (i >= 2) t[v * reps + i - 2] = ms;
        }
    for (int v = 0; v < N_VARIANTS; v++) {
        qsort(t + v * reps, (size_t)reps, sizeof(double), cmp_double);
        f->ms[v] = ok[v] ? t[v * reps + reps / 2] : -1;
        if (exec[v]) cudaGraphExecDestroy(exec[v]);
    }
    free(t);
    cudaEventDestroy(ev[0]);
    cudaEventDestroy(ev[1]);
}

/* ---- correctness ------------------------------------------------------------ */

/* Input element values from the repeated host blocks. */
static double xv(const gemm_bufs* b, int64_t r, int64_t i) { return bf(b->hx[(r * b->I + i) % BLK]); }
static double wv(const gemm_bufs* b, int g, int64_t o, int64_t i) {
    return bf(b->hw[(((int64_t)g * b->O + o) * b->I + i) % BLK]);
}
static double dyv(const gemm_bufs* b, int64_t r, int64_t o) { return bf(b->hdy[(r * b->O + o) % BLK]); }

static int row_group(const gemm_bufs* b, int64_t r) {
    int g = 0;
    while (b->off_h[g + 1] <= r) g++;
    return g;
}

/* Runs `variant` of `op` once (wgrad as OVERWRITE from NaN for ours, and
 * from zeros + beta 1 for cuBLAS) and compares 256 sampled outputs with
 * float64; returns the relative norm error. */
static double check_variant(bench_run* br, uint64_t seed) {
    gemm_bufs* b = br->b;
    const int64_t T = b->off_h[b->E];
    if (br->op == OP_WGRAD) {
        mst_fill(br->ctx, b->mg.data, is_ours(br->variant) ? 0xFF : 0, mst_tensor_bytes(&b->mg));
        if (is_ours(br->variant)) {
            mst_cuda_gg_kernel(br->ctx, variant_kernel[br->variant]);
            mst_status st = mst_grouped_linear_wgrad(br->ctx, &b->dy, wgrad_x(br), NULL, NULL, &b->counts, &b->mg,
                                                     NULL, NULL, MST_WGRAD_OVERWRITE);
            mst_cuda_gg_kernel(br->ctx, NULL);
            if (st != MST_OK) return INFINITY;
        } else if (enqueue(br))
            return INFINITY;
    } else {
        mst_tensor* out = br->op == OP_FWD ? &b->y : &b->dx;
        mst_fill(br->ctx, out->data, 0xFF, mst_tensor_bytes(out));
        if (enqueue(br)) return INFINITY;
    }
    if (mst_ctx_check(br->ctx) != MST_OK) return INFINITY;
    double num = 0, den = 0;
    for (int q = 0; q < 256; q++) {
        double ref = 0, got;
        if (br->op == OP_WGRAD) {
            int g = (int)(mst_splitmix64(&seed) % (uint64_t)b->E);
            int64_t o = (int64_t)(mst_splitmix64(&seed) % (uint64_t)b->O), i = (int64_t)(mst_splitmix64(&seed) % (uint64_t)b->I);
            for (int64_t r = b->off_h[g]; r < b->off_h[g + 1]; r++) ref += dyv(b, r, o) * xv(b, r, i);
            float v;
            mst_copy_b2h(br->ctx, &v, (float*)b->mg.data + ((int64_t)g * b->O + o) * b->I + i, 4);
            got = v;
        } else {
            int64_t r = (int64_t)(mst_splitmix64(&seed) % (uint64_t)T);
            int g = row_group(b, r);
            int64_t n = br->op == OP_FWD ? b->O : b->I;
            int64_t c = (int64_t)(mst_splitmix64(&seed) % (uint64_t)n);
            if (br->op == OP_FWD)
                for (int64_t i = 0; i < b->I; i++) ref += xv(b, r, i) * wv(b, g, c, i);
            else
                for (int64_t o = 0; o < b->O; o++) ref += dyv(b, r, o) * wv(b, g, o, c);
            uint16_t v;
            const uint16_t* base = (const uint16_t*)(br->op == OP_FWD ? b->y.data : b->dx.data);
            mst_copy_b2h(br->ctx, &v, base + r * n + c, 2);
            got = bf(v);
        }
        num += (got - ref) * (got - ref);
        den += ref * ref;
    }
    return isnan(num) ? INFINITY : sqrt(num / (den > 0 ? den : 1));
}

/* ---- buffers ---------------------------------------------------------------- */

static int bufs_alloc(mst_ctx_t* ctx, gemm_bufs* b, const gemm_shape* s) {
    memset(b, 0, sizeof *b);
    b->R = s->rows * 3 / 2, b->I = s->in, b->O = s->out, b->E = s->E;
    void *c, *x, *w, *dy, *y, *dx, *mg;
    mst_status st = mst_alloc(ctx, 4 * (size_t)b->E, &c);
    if (st == MST_OK) st = mst_alloc(ctx, 2 * (size_t)(b->R * b->I), &x);
    if (st == MST_OK) st = mst_alloc(ctx, 2 * (size_t)(b->E * b->O * b->I), &w);
    if (st == MST_OK) st = mst_alloc(ctx, 2 * (size_t)(b->R * b->O), &dy);
    if (st == MST_OK) st = mst_alloc(ctx, 2 * (size_t)(b->R * b->O), &y);
    if (st == MST_OK) st = mst_alloc(ctx, 2 * (size_t)(b->R * b->I), &dx);
    if (st == MST_OK) st = mst_alloc(ctx, 4 * (size_t)(b->E * b->O * b->I), &mg);
    if (st == MST_OK) st = mst_alloc(ctx, sizeof(void*) * 3 * (size_t)b->E, (void**)&b->ptrs_d);
    mst_pool_config pc = mst_pool_config_default((b->R + 63) / 64);
    if (st == MST_OK) st = mst_pool_create(ctx, MST_DTYPE_BF16, b->I, &pc, &b->pool);
    if (st == MST_OK) st = mst_stash_handle_create(b->pool, b->R, &b->h);
    if (st != MST_OK) {
        fprintf(stderr, "bench gemm: %s\n", mst_last_error());
        return 0;
    }
    b->counts = mst_tensor_make(c, MST_DTYPE_INT32, b->E, 1);
    b->x = mst_tensor_make(x, MST_DTYPE_BF16, b->R, b->I);
    b->w = mst_tensor_make(w, MST_DTYPE_BF16, b->E * b->O, b->I);
    b->dy = mst_tensor_make(dy, MST_DTYPE_BF16, b->R, b->O);
    b->y = mst_tensor_make(y, MST_DTYPE_BF16, b->R, b->O);
    b->dx = mst_tensor_make(dx, MST_DTYPE_BF16, b->R, b->I);
    b->mg = mst_tensor_make(mg, MST_DTYPE_FP32, b->E * b->O, b->I);
    b->counts_h = (int32_t*)malloc(sizeof(int32_t) * b->E);
    b->off_h = (int64_t*)malloc(sizeof(int64_t) * (b->E + 1));
    b->hx = random_block(11 + (uint64_t)s->in, 1.0);
    b->hw = random_block(23 + (uint64_t)s->out, 1.0 / sqrt((double)s->in));
    b->hdy = random_block(37 + (uint64_t)s->E, 1.0);
    return fill_repeat(ctx, (uint16_t*)x, b->hx, b->R * b->I) && fill_repeat(ctx, (uint16_t*)w, b->hw, b->E * b->O * b->I) &&
           fill_repeat(ctx, (uint16_t*)dy, b->hdy, b->R * b->O) &&
           mst_fill(ctx, mg, 0, mst_tensor_bytes(&b->mg)) == MST_OK;
}

static void bufs_free(mst_ctx_t* ctx, gemm_bufs* b) {
    void* p[] = {b->counts.data, b->x.data, b->w.data, b->dy.data, b->y.data, b->dx.data, b->mg.data, b->ptrs_d};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) mst_free(ctx, p[i]);
    mst_stash_handle_destroy(b->h);
    mst_pool_destroy(b->pool);
    free(b->counts_h), free(b->off_h), free(b->hx), free(b->hw), free(b->hdy);
}

/* New counts, and x's rows under them stashed again for ours_paged. */
static int set_counts(mst_ctx_t* ctx, gemm_bufs* b, int64_t T, int skewed) {
    make_counts(b->counts_h, b->E, T, skewed, 1234 + (uint64_t)b->E);
    b->off_h[0] = 0;
    for (int g = 0; g < b->E; g++) b->off_h[g + 1] = b->off_h[g] + b->counts_h[g];
    if (mst_copy_h2b(ctx, b->counts.data, b->counts_h, sizeof(int32_t) * b->E) != MST_OK ||
        mst_pool_reset(b->pool) != MST_OK || mst_stash_save(b->pool, b->h, &b->x, &b->counts) != MST_OK ||
        mst_stash_handle_pages(b->h, &b->pages) != MST_OK || mst_pool_poll(b->pool) != MST_OK) {
        fprintf(stderr, "bench gemm: %s\n", mst_last_error());
        return 0;
    }
    b->xp = b->x;
    b->xp.pages = &b->pages;
    return 1;
}

/* ---- report ------------------------------------------------------------------ */

static double flops(const gemm_shape* s) { return 2.0 * (double)s->rows * (double)s->in * (double)s->out; }

static double tflops(const gemm_shape* s, double ms) { return ms > 0 ? flops(s) / (ms * 1e-3) / 1e12 : 0; }

/* Minimum bytes of an op: forward reads x [T, I] and w [E, O, I], writes
 * y [T, O]; dgrad reads dy [T, O] and w, writes dx [T, I]; wgrad reads x and
 * dy and reads + writes the fp32 main_grad [E, O, I] (bf16: 2 bytes). */
static double op_bytes(const gemm_shape* s, int op) {
    const double x = 2.0 * s->rows * s->in, y = 2.0 * s->rows * s->out, w = 2.0 * s->E * s->out * s->in;
    return op == OP_WGRAD ? x + y + 4 * w : x + y + w;
}

/* Roofline time / ours (1 = at the roofline), with the line's dense roof. */
static double over_line(const gemm_shape* s, int op, const gemm_fig* f, double copy_gbps) {
    if (f->ms[V_OURS] <= 0 || f->ms[V_ROOF] <= 0) return 0;
    const mst_bench_roofs r = {tflops(s, f->ms[V_ROOF]), copy_gbps};
    return mst_bench_roofline_ms(&r, flops(s), op_bytes(s, op)) / f->ms[V_OURS];
}

static void write_json(FILE* f, const char* device, double copy_gbps, const gemm_fig (*fig)[2][N_OPS]) {
    fprintf(f, "{\n  \"bench\": \"gemm\",\n  \"device\": \"%s\",\n  \"copy_gbps\": %.1f,\n  \"results\": [\n", device,
            copy_gbps);
    int first = 1;
    for (int si = 0; si < N_SHAPES; si++)
        for (int d = 0; d < 2; d++)
            for (int op = 0; op < N_OPS; op++) {
                const gemm_shape* s = &shapes[si];
                const gemm_fig* fg = &fig[si][d][op];
                if (fg->ms[V_ROOF] <= 0) continue; /* not run (--op) */
                fprintf(f, "%s    {\"rows\": %lld, \"in\": %lld, \"out\": %lld, \"E\": %d, \"counts\": \"%s\", \"op\": \"%s\"",
                        first ? "" : ",\n", (long long)s->rows, (long long)s->in, (long long)s->out, s->E,
                        d ? "skewed" : "balanced", op_names[op]);
                for (int v = 0; v < N_VARIANTS; v++) {
                    fprintf(f, ", \"%s_ms\": %.4f, \"%s_tflops\": %.1f, \"%s_graph\": %d", variant_names[v],
                            fg->ms[v], variant_names[v], tflops(s, fg->ms[v]), variant_names[v], fg->graphed[v]);
                    if (is_ours(v) || v == V_LOOP) fprintf(f, ", \"%s_err\": %.3g", variant_names[v], fg->err[v]);
                }
                fprintf(f, ", \"bytes\": %.0f, \"ours_over_roof\": %.3f, \"ours_over_roofline\": %.3f}", op_bytes(s, op),
                        fg->ms[V_OURS] > 0 ? fg->ms[V_ROOF] / fg->ms[V_OURS] : 0, over_line(s, op, fg, copy_gbps));
                first = 0;
            }
    fprintf(f, "\n  ]\n}\n");
}

/* "  123.4" TFLOP/s, or "    n/a" for a variant that did not run. */
static const char* tf_str(char* buf, const gemm_shape* s, double ms) {
    if (ms > 0) snprintf(buf, 16, "%7.1f", tflops(s, ms));
    else snprintf(buf, 16, "%7s", "n/a");
    return buf;
}

int mst_bench_gemm(int argc, char** argv) {
    const char* json = NULL;
    int32_t reps = 20, only_shape = -1;
    int only = -1;
    mst_args a;
    mst_args_init(&a, "moestash bench gemm", argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--reps")) rc = mst_args_int32(&a, 3, 1000000, &reps);
        else if (mst_args_is(&a, "--op")) rc = mst_args_choice(&a, op_names, &only);
        else if (mst_args_is(&a, "--shape")) rc = mst_args_int32(&a, 0, N_SHAPES - 1, &only_shape);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench gemm [--json FILE] [--reps N (>= 3, 20)] [--op forward|dgrad|wgrad] "
                   "[--shape 0..%d]\n", N_SHAPES - 1);
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (!mst_backend_available(MST_BACKEND_CUDA)) {
        fprintf(stderr, "bench gemm: needs the CUDA backend and a device\n");
        return 2;
    }
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(MST_BACKEND_CUDA, 0, &ctx) != MST_OK) {
        fprintf(stderr, "bench gemm: %s\n", mst_last_error());
        return 1;
    }
    printf("bench gemm on %s\n", mst_ctx_describe(ctx));
    cudaStream_t stream;
    cublasHandle_t blas;
    void* blas_ws = NULL;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    mst_ctx_set_stream(ctx, stream);
    cublasCreate(&blas);
    cublasSetStream(blas, stream);
    if (mst_alloc(ctx, 64u << 20, &blas_ws) == MST_OK) cublasSetWorkspace(blas, blas_ws, 64u << 20);
    mst_bench_roofs roofs;
    if (mst_bench_roofs_measure(ctx, stream, &roofs) != MST_OK) {
        fprintf(stderr, "bench gemm: roofs: %s\n", mst_last_error());
        return 1;
    }
    printf("device copy %.0f GB/s (read + write), cuBLAS 8192^3 %.0f TFLOP/s (same run); /line = roofline "
           "max(FLOPs / the line's roof, bytes / copy) over ours\n",
           roofs.copy_gbps, roofs.dense_tflops);

    static gemm_fig fig[N_SHAPES][2][N_OPS];
    int fails = 0;
    for (int si = 0; si < N_SHAPES; si++) {
        const gemm_shape* s = &shapes[si];
        gemm_bufs b;
        if (only_shape >= 0 && si != only_shape) continue;
        if (!bufs_alloc(ctx, &b, s)) return 1;
        for (int d = 0; d < 2; d++) {
            if (!set_counts(ctx, &b, s->rows, d)) return 1;
            for (int op = 0; op < N_OPS; op++) {
                if (only >= 0 && op != only) continue;
                gemm_fig* f = &fig[si][d][op];
                bench_run br = {ctx, blas, &b, op, V_OURS};
                for (int v = 0; v <= V_LOOP; v++) {
                    br.variant = v;
                    if (v == V_OURS_PAGED && op != OP_WGRAD) continue; /* wgrad only: err 0, n/a */
                    f->err[v] = check_variant(&br, 99 + (uint64_t)op);
                    fails += !(f->err[v] < 1e-2);
                }
                time_variants(&br, reps, f);
                double worst = 0;
                for (int v = 0; v <= V_LOOP; v++) worst = f->err[v] > worst ? f->err[v] : worst;
                char t[N_VARIANTS][16];
                printf("%6lld x %4lld -> %4lld E=%3d %-8s %-7s max err %.0e  TFLOP/s: ours %s mma %s regs %s  "
                       "paged %s  loop %s  grouped %s  roof %s  ours/roof %.2f  /line %.2f\n",
                       (long long)s->rows, (long long)s->in, (long long)s->out, s->E, d ? "skewed" : "balanced",
                       op_names[op], worst, tf_str(t[0], s, f->ms[V_OURS]),
                       tf_str(t[1], s, f->ms[V_OURS_MMA]), tf_str(t[2], s, f->ms[V_OURS_REGS]),
                       tf_str(t[3], s, f->ms[V_OURS_PAGED]), tf_str(t[4], s, f->ms[V_LOOP]),
                       tf_str(t[5], s, f->ms[V_GROUPED]), tf_str(t[6], s, f->ms[V_ROOF]),
                       f->ms[V_OURS] > 0 ? f->ms[V_ROOF] / f->ms[V_OURS] : 0, over_line(s, op, f, roofs.copy_gbps));
                fflush(stdout);
            }
        }
        bufs_free(ctx, &b);
    }
    if (json) {
        FILE* f = mst_out_open("moestash bench gemm", json);
        if (f) write_json(f, mst_ctx_describe(ctx), roofs.copy_gbps, fig);
        if (!f || mst_out_close("moestash bench gemm", json, f)) fails++;
    }
    printf("\n%-24s %-8s | %-30s | %-30s | %-30s\n", "shape (T x I -> O, E)", "counts", "forward /roof /line (TF)",
           "dgrad /roof /line (TF)", "wgrad acc /roof /line (TF)");
    for (int si = 0; si < N_SHAPES; si++)
        for (int d = 0; d < 2 && (only_shape < 0 || si == only_shape); d++) {
            const gemm_shape* s = &shapes[si];
            char name[40];
            snprintf(name, sizeof name, "%lldx%lld->%lld E%d", (long long)s->rows, (long long)s->in,
                     (long long)s->out, s->E);
            printf("%-24s %-8s", name, d ? "skewed" : "balanced");
            for (int op = 0; op < N_OPS; op++) {
                const gemm_fig* f = &fig[si][d][op];
                if (only >= 0 && op != only) {
                    printf(" | %-30s", "-");
                    continue;
                }
                printf(" | %4.2f %4.2f (%5.0f / %5.0f)     ", f->ms[V_OURS] > 0 ? f->ms[V_ROOF] / f->ms[V_OURS] : 0,
                       over_line(s, op, f, roofs.copy_gbps), tflops(s, f->ms[V_OURS]), tflops(s, f->ms[V_ROOF]));
            }
            printf("\n");
        }
    printf("correctness: %s\n", fails ? "FAILED (see err columns)" : "all sampled outputs within 1e-2 of float64");
    mst_ctx_set_stream(ctx, NULL);
    cublasDestroy(blas);
    mst_ctx_destroy(ctx);
    cudaStreamDestroy(stream);
    return fails ? 1 : 0;
}

#else

int mst_bench_gemm(int argc, char** argv) {
    (void)argc, (void)argv;
    fprintf(stderr, "bench gemm: built without the CUDA backend\n");
    return 2;
}

#endif
