/*
 * model_ops_attn.cu — causal multi-head self-attention on CUDA, forward and
 * backward side by side (the CPU reference is model_ops_attn.c), through
 * batched cuBLAS GEMMs (one call over every (batch, head) pair, from pointer
 * arrays made on the device: head h of q, k, v at column h D of its batch's
 * rows) and two row kernels:
 *   S = q k^T / sqrt(D) (fp32, into probs), P = masked row softmax of S
 *   (saved fp32; a bf16 copy in scratch16), out = P v;
 *   backward: dv = P^T dout, dP = dout v^T (fp32, scratch32),
 *   dS = P (dP - rowsum(P dP)) / sqrt(D) (bf16, scratch16), dq = dS k,
 *   dk = dS^T q.
 * The bf16 P and dS feed the tensor-core GEMMs (fp32 accumulation), as in
 * flash attention. Deterministic: cuBLAS GEMMs and fixed-order row sums.
 * Replaced per-row kernels (one block per query row, scores in shared
 * memory): 2.1x slower steps on the GPU default (docs/history/perf-notes.md).
 */
#include "model_ops.cuh"

enum { ATTN_THREADS = 128 };

struct attn_dims {
    int64_t T, D, NH, H;
    float sc;
};

static attn_dims dims_of(const mst_attn_args* a) {
    attn_dims d = {a->seq, a->head_dim, a->n_head, a->n_head * a->head_dim, 1.0f / sqrtf((float)a->head_dim)};
    return d;
}

/* Where the operand of (batch b, head h) starts: base + b sb + h sh bytes. */
struct bh_operand {
    const char* base;
    int64_t sb, sh;
};

static bh_operand bh(const void* base, int64_t elt, int64_t sb, int64_t sh) {
    bh_operand o = {(const char*)base, sb * elt, sh * elt};
    return o;
}

/* Pointer arrays of the batched GEMM: pair i = b NH + h; p [3 n]: A, B, C. */
__global__ void attn_ptrs_kernel(const void** p, bh_operand a, bh_operand b, bh_operand c, int64_t NH, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t bi = i / NH, h = i % NH;
    p[i] = a.base + bi * a.sb + h * a.sh;
    p[n + i] = b.base + bi * b.sb + h * b.sh;
    p[2 * n + i] = c.base + bi * c.sb + h * c.sh;
}

/* Row-major C [m, n] = alpha op(A) op(B) for every (batch, head) pair in one
 * batched cuBLAS call (see mst_cuda_mm for the column-major swap); the
 * pointer arrays are made on the device in the ws_attn workspace (sized by
 * the first call, outside capture). */
static mst_status gemm_heads(mst_ctx_t* ctx, const mst_attn_args* at, int ta, int tb, int64_t m, int64_t n,
                             int64_t k, float alpha, bh_operand A, int64_t lda, bh_operand B, int64_t ldb,
                             bh_operand C, cudaDataType ct, int64_t ldc) {
    mst_cuda_impl* c = mst_cuda(ctx);
    const int64_t pairs = at->batch * at->n_head;
    const void** p = NULL;
    MST_TRY(mst_workspace(ctx, &c->ws_attn, 3 * (size_t)pairs * sizeof(void*), (void**)&p));
    attn_ptrs_kernel<<<mst_blocks(pairs, 128), 128, 0, c->stream>>>(p, A, B, C, at->n_head, pairs);
    MST_CUDA_LAUNCHED();
    const float beta = 0.0f;
    MST_CUBLAS_TRY(cublasGemmBatchedEx(c->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                       (int)n, (int)m, (int)k, &alpha, p + pairs, CUDA_R_16BF, (int)ldb, p,
                                       CUDA_R_16BF, (int)lda, &beta, (void* const*)(p + 2 * pairs), ct, (int)ldc,
                                       (int)pairs, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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
    if (a->batch * a->n_head * a->seq > INT32_MAX || a->n_head > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "attention: batch %lld x heads %lld x seq %lld: too large",
                             (long long)a->batch, (long long)a->n_head, (long long)a->seq);
    return MST_OK;
}

extern "C" mst_status mst_cuda_attn_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_dims(a));
    const attn_dims d = dims_of(a);
    const int64_t TT = d.T * d.T, NHTT = d.NH * TT, row = d.T * 3 * d.H;
    cudaStream_t s = mst_cuda(ctx)->stream;
    /* S = q k^T sc (fp32, into probs) */
    MST_TRY(gemm_heads(ctx, a, 0, 1, d.T, d.T, d.D, d.sc, bh(a->qkv, 2, row, d.D), 3 * d.H,
                       bh(a->qkv + d.H, 2, row, d.D), 3 * d.H, bh(a->probs, 4, NHTT, TT), CUDA_R_32F, d.T));
    attn_softmax_kernel<<<(unsigned)(a->batch * NHTT / d.T), ATTN_THREADS, 0, s>>>(a->probs, a->scratch16, d.T);
    MST_CUDA_LAUNCHED();
    /* out = P v */
    return gemm_heads(ctx, a, 0, 0, d.T, d.D, d.T, 1.0f, bh(a->scratch16, 2, NHTT, TT), d.T,
                      bh(a->qkv + 2 * d.H, 2, row, d.D), 3 * d.H, bh(a->out, 2, d.T * d.H, d.D), CUDA_R_16BF, d.H);
}

extern "C" mst_status mst_cuda_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_dims(a));
    const attn_dims d = dims_of(a);
    const int64_t TT = d.T * d.T, NHTT = d.NH * TT, n = a->batch * NHTT, row = d.T * 3 * d.H;
    cudaStream_t s = mst_cuda(ctx)->stream;
    attn_to_bf16_kernel<<<mst_blocks(n, 256), 256, 0, s>>>(a->probs, a->scratch16, n);
    MST_CUDA_LAUNCHED();
    const bh_operand P16 = bh(a->scratch16, 2, NHTT, TT), g = bh(a->dout, 2, d.T * d.H, d.D);
    /* dv = P^T dout; dP = dout v^T (fp32, scratch32) */
    MST_TRY(gemm_heads(ctx, a, 1, 0, d.T, d.D, d.T, 1.0f, P16, d.T, g, d.H, bh(a->dqkv + 2 * d.H, 2, row, d.D),
                       CUDA_R_16BF, 3 * d.H));
    MST_TRY(gemm_heads(ctx, a, 0, 1, d.T, d.T, d.D, 1.0f, g, d.H, bh(a->qkv + 2 * d.H, 2, row, d.D), 3 * d.H,
                       bh(a->scratch32, 4, NHTT, TT), CUDA_R_32F, d.T));
    attn_dsoftmax_kernel<<<(unsigned)(n / d.T), ATTN_THREADS, 0, s>>>(a->probs, a->scratch32, a->scratch16, d.T, d.sc);
    MST_CUDA_LAUNCHED();
    /* dq = dS k; dk = dS^T q (dS bf16 in scratch16) */
    MST_TRY(gemm_heads(ctx, a, 0, 0, d.T, d.D, d.T, 1.0f, P16, d.T, bh(a->qkv + d.H, 2, row, d.D), 3 * d.H,
                       bh(a->dqkv, 2, row, d.D), CUDA_R_16BF, 3 * d.H));
    return gemm_heads(ctx, a, 1, 0, d.T, d.D, d.T, 1.0f, P16, d.T, bh(a->qkv, 2, row, d.D), 3 * d.H,
                      bh(a->dqkv + d.H, 2, row, d.D), CUDA_R_16BF, 3 * d.H);
}
