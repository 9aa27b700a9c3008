/*
 * model_ops_attn.cu — causal grouped-query self-attention on CUDA, forward
 * and backward side by side (the CPU reference is model_ops_attn.c),
 * through batched cuBLAS GEMMs (one call over (batch, head) pairs, from
 * pointer arrays made on the device: query head h at column h D of q, its
 * key-value head h / G (G = NH / KV) at column (h / G) D of k and of v) and
 * two row kernels:
 *   S = q k^T / sqrt(D) (fp32, into probs), P = masked row softmax of S
 *   (saved fp32; a bf16 copy in scratch16), out = P v;
 *   backward: dv = sum over the group of P^T dout, dP = dout v^T (fp32,
 *   scratch32), dS = P (dP - rowsum(P dP)) / sqrt(D) (bf16, scratch16),
 *   dk = sum over the group of dS^T q, dq = dS k.
 * The group sums (G > 1) run as G batched GEMMs over (batch, KV head) pairs,
 * query head g G + r in call r = 0, 1, ..., accumulated in fp32 (beta 1:
 * head order, no atomics) into an fp32 image of dk or dv, then rounded once
 * into dqkv. That image lives in the dq columns of dqkv, still unwritten:
 * a row's KV D fp32 take the bytes of 2 KV D <= NH D bf16 when G >= 2 (dq
 * is written last). G = 1 writes dk and dv directly.
 * The bf16 P and dS feed the tensor-core GEMMs (fp32 accumulation), as in
 * flash attention. Deterministic: cuBLAS GEMMs and fixed-order row sums.
 * Replaced per-row kernels (one block per query row, scores in shared
 * memory): 2.1x slower steps on the GPU default (docs/history/perf-notes.md).
 */
#include "model_ops.cuh"

enum { ATTN_THREADS = 128 };

struct attn_dims {
    int64_t T, D, NH, KV, G; /* seq, head dim, query heads, key-value heads, NH / KV */
    int64_t W, HO;           /* row widths: qkv (NH + 2 KV) D, out NH D              */
    float sc;                /* 1 / sqrt(D)                                          */
};

static attn_dims dims_of(const mst_attn_args* a) {
    const int64_t NH = a->n_head, KV = a->n_kv_head, D = a->head_dim;
    attn_dims d = {a->seq, D, NH, KV, NH / KV, (NH + 2 * KV) * D, NH * D, 1.0f / sqrtf((float)D)};
    return d;
}

/* Where the operand of (batch b, query head h) starts: base + b sb +
 * (h / div) sh bytes (div G: a key-value head's operand; else 1). */
struct bh_operand {
    const char* base;
    int64_t sb, sh, div;
};

static bh_operand bh(const void* base, int64_t elt, int64_t sb, int64_t sh, int64_t div = 1) {
    bh_operand o = {(const char*)base, sb * elt, sh * elt, div};
    return o;
}

/* The pairs of one batched call: pair i = b heads + j takes query head
 * h = j mul + off (all query heads: {NH, 1, 0}; member r of every group:
 * {KV, G, r}). */
struct bh_pairs {
    int64_t heads, mul, off;
};

__device__ __forceinline__ const char* bh_at(const bh_operand& o, int64_t b, int64_t h) {
    return o.base + b * o.sb + (h / o.div) * o.sh;
}

/* Pointer arrays of the batched GEMM; p [3 n]: A, B, C. */
__global__ void attn_ptrs_kernel(const void** p, bh_operand a, bh_operand b, bh_operand c, bh_pairs q, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t bi = i / q.heads, h = (i % q.heads) * q.mul + q.off;
    p[i] = bh_at(a, bi, h);
    p[n + i] = bh_at(b, bi, h);
    p[2 * n + i] = bh_at(c, bi, h);
}

/* Row-major C [m, n] = alpha op(A) op(B) + beta C for every pair of q in one
 * batched cuBLAS call (see mst_cuda_mm for the column-major swap); the
 * pointer arrays are made on the device in the ws_attn workspace (sized by
 * the first call, outside capture). */
static mst_status gemm_heads(mst_ctx_t* ctx, const mst_attn_args* at, bh_pairs q, int ta, int tb, int64_t m,
                             int64_t n, int64_t k, bh_operand A, int64_t lda, bh_operand B, int64_t ldb, bh_operand C,
                             cudaDataType ct, int64_t ldc, float alpha, float beta) {
    mst_cuda_impl* c = mst_cuda(ctx);
    const int64_t pairs = at->batch * q.heads;
    const void** p = NULL;
    MST_TRY(mst_workspace(ctx, &c->ws_attn, 3 * (size_t)(at->batch * at->n_head) * sizeof(void*), (void**)&p));
    attn_ptrs_kernel<<<mst_blocks(pairs, 128), 128, 0, c->stream>>>(p, A, B, C, q, pairs);
    MST_CUDA_LAUNCHED();
    MST_CUBLAS_TRY(cublasGemmBatchedEx(c->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                       (int)n, (int)m, (int)k, &alpha, p + pairs, CUDA_R_16BF, (int)ldb, p,
                                       CUDA_R_16BF, (int)lda, &beta, (void* const*)(p + 2 * pairs), ct, (int)ldc,
                                       (int)pairs, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return MST_OK;
}

/* dst [B*T, KV D] bf16 (row stride ld) = x [B*T, KV D] fp32 (row stride ldx). */
__global__ void attn_image_to_bf16_kernel(const float* x, int64_t ldx, uint16_t* dst, int64_t ld, int64_t rows,
                                          int64_t cols) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const int64_t r = i / cols, c = i % cols;
    dst[r * ld + c] = mst_to_bf(x[r * ldx + c]);
}

/* Per key-value head g: dst_g [T, D] = sum over r < G, in order, of
 * op(A_h) B_h [T, k] x [k, D] with h = g G + r (A, B: query-head operands);
 * dst: the k or v part of dqkv (bf16, row stride W). G = 1: straight into
 * dst. G > 1: accumulated in the fp32 image of dst in dq's columns (file
 * comment), then rounded into dst. */
static mst_status gemm_group_sum(mst_ctx_t* ctx, const mst_attn_args* a, const attn_dims& d, int ta, int64_t k,
                                 bh_operand A, int64_t lda, bh_operand B, int64_t ldb, uint16_t* dst) {
    if (d.G == 1)
        return gemm_heads(ctx, a, bh_pairs{d.NH, 1, 0}, ta, 0, d.T, d.D, k, A, lda, B, ldb, bh(dst, 2, d.T * d.W, d.D),
                          CUDA_R_16BF, d.W, 1.0f, 0.0f);
    const bh_operand img = bh(a->dqkv, 4, d.T * d.W / 2, d.D, d.G); /* [B*T, KV D] fp32, row stride W / 2 */
    for (int64_t r = 0; r < d.G; r++)
        MST_TRY(gemm_heads(ctx, a, bh_pairs{d.KV, d.G, r}, ta, 0, d.T, d.D, k, A, lda, B, ldb, img, CUDA_R_32F,
                           d.W / 2, 1.0f, r ? 1.0f : 0.0f));
    const int64_t rows = a->batch * d.T, cols = d.KV * d.D;
    attn_image_to_bf16_kernel<<<mst_blocks(rows * cols, 256), 256, 0, mst_cuda(ctx)->stream>>>(
        (const float*)a->dqkv, d.W / 2, dst, d.W, rows, cols);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* Row (bh, i) of S: masked softmax in place (0 above the diagonal), bf16 copy. */
__global__ void attn_softmax_kernel(float* P, uint16_t* P16, int64_t T) {
    __shared__ float red[32];
    const int64_t row = blockIdx.x, i = row % T;
    float* p = P + row * T;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, p[j]);
    mx = mst_block_max(mx, red);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) sum += expf(p[j] - mx);
    sum = mst_block_sum(sum, red);
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
        float v = j <= i ? expf(p[j] - mx) / sum : 0.0f;
        p[j] = v;
        P16[row * T + j] = mst_to_bf(v);
    }
}

__global__ void attn_to_bf16_kernel(const float* P, uint16_t* P16, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) P16[i] = mst_to_bf(P[i]);
}

/* Row (bh, i): dS = P (dP - sum_j P dP) sc, bf16. */
__global__ void attn_dsoftmax_kernel(const float* P, const float* dP, uint16_t* dS, int64_t T, float sc) {
    __shared__ float red[32];
    const int64_t row = blockIdx.x;
    const float *p = P + row * T, *dp = dP + row * T;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) dot += p[j] * dp[j];
    dot = mst_block_sum(dot, red);
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) dS[row * T + j] = mst_to_bf(p[j] * (dp[j] - dot) * sc);
}

static mst_status check_dims(const mst_attn_args* a) {
    if (!a->scratch16 || !a->scratch32)
        return mst_set_error(MST_ERR_INVALID, "attention: scratch16 and scratch32 are required on CUDA");
    if (a->n_head < 1 || a->n_kv_head < 1 || a->n_head % a->n_kv_head != 0 || a->head_dim < 1)
        return mst_set_error(MST_ERR_INVALID, "attention: n_kv_head %lld must divide n_head %lld (head_dim %lld)",
                             (long long)a->n_kv_head, (long long)a->n_head, (long long)a->head_dim);
    if (a->n_kv_head != a->n_head && a->head_dim % 2 != 0)
        return mst_set_error(MST_ERR_INVALID, "attention on cuda: grouped heads (n_kv_head %lld < n_head %lld) "
                             "need an even head_dim (%lld)", (long long)a->n_kv_head, (long long)a->n_head,
                             (long long)a->head_dim);
    if (a->batch * a->n_head * a->seq > INT32_MAX || (a->n_head + 2 * a->n_kv_head) * a->head_dim > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "attention: batch %lld x heads %lld x seq %lld: too large",
                             (long long)a->batch, (long long)a->n_head, (long long)a->seq);
    return MST_OK;
}

extern "C" mst_status mst_cuda_attn_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_dims(a));
    const attn_dims d = dims_of(a);
    const int64_t TT = d.T * d.T, NHTT = d.NH * TT, row = d.T * d.W;
    const bh_pairs all = {d.NH, 1, 0};
    cudaStream_t s = mst_cuda(ctx)->stream;
    /* S = q k^T sc (fp32, into probs) */
    MST_TRY(gemm_heads(ctx, a, all, 0, 1, d.T, d.T, d.D, bh(a->qkv, 2, row, d.D), d.W,
                       bh(a->qkv + d.HO, 2, row, d.D, d.G), d.W, bh(a->probs, 4, NHTT, TT), CUDA_R_32F, d.T, d.sc,
                       0.0f));
    attn_softmax_kernel<<<(unsigned)(a->batch * NHTT / d.T), ATTN_THREADS, 0, s>>>(a->probs, a->scratch16, d.T);
    MST_CUDA_LAUNCHED();
    /* out = P v */
    return gemm_heads(ctx, a, all, 0, 0, d.T, d.D, d.T, bh(a->scratch16, 2, NHTT, TT), d.T,
                      bh(a->qkv + d.HO + d.KV * d.D, 2, row, d.D, d.G), d.W, bh(a->out, 2, d.T * d.HO, d.D),
                      CUDA_R_16BF, d.HO, 1.0f, 0.0f);
}

extern "C" mst_status mst_cuda_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_dims(a));
    const attn_dims d = dims_of(a);
    const int64_t TT = d.T * d.T, NHTT = d.NH * TT, n = a->batch * NHTT, row = d.T * d.W;
    const int64_t ko = d.HO, vo = d.HO + d.KV * d.D; /* k's and v's columns in a row */
    const bh_pairs all = {d.NH, 1, 0};
    cudaStream_t s = mst_cuda(ctx)->stream;
    attn_to_bf16_kernel<<<mst_blocks(n, 256), 256, 0, s>>>(a->probs, a->scratch16, n);
    MST_CUDA_LAUNCHED();
    const bh_operand P16 = bh(a->scratch16, 2, NHTT, TT), g = bh(a->dout, 2, d.T * d.HO, d.D);
    const bh_operand q = bh(a->qkv, 2, row, d.D), k = bh(a->qkv + ko, 2, row, d.D, d.G);
    /* dv = sum over the group of P^T dout; dP = dout v^T (fp32, scratch32) */
    MST_TRY(gemm_group_sum(ctx, a, d, 1, d.T, P16, d.T, g, d.HO, a->dqkv + vo));
    MST_TRY(gemm_heads(ctx, a, all, 0, 1, d.T, d.T, d.D, g, d.HO, bh(a->qkv + vo, 2, row, d.D, d.G), d.W,
                       bh(a->scratch32, 4, NHTT, TT), CUDA_R_32F, d.T, 1.0f, 0.0f));
    attn_dsoftmax_kernel<<<(unsigned)(n / d.T), ATTN_THREADS, 0, s>>>(a->probs, a->scratch32, a->scratch16, d.T, d.sc);
    MST_CUDA_LAUNCHED();
    /* dk = sum over the group of dS^T q (before dq: its image is in dq's
     * columns); dq = dS k (dS bf16 in scratch16) */
    MST_TRY(gemm_group_sum(ctx, a, d, 1, d.T, P16, d.T, q, d.W, a->dqkv + ko));
    return gemm_heads(ctx, a, all, 0, 0, d.T, d.D, d.T, P16, d.T, k, d.W, bh(a->dqkv, 2, row, d.D), CUDA_R_16BF, d.W,
                      1.0f, 0.0f);
}
