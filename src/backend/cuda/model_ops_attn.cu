/*
 * model_ops_attn.cu — causal multi-head self-attention on CUDA, forward and
 * backward side by side (the CPU reference is model_ops_attn.c), through
 * cuBLAS strided-batched GEMMs (per batch b, batched over the NH heads: head
 * h of q, k, v at column h D, batch stride D) and two row kernels:
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

/* Row-major C [m, n] = op(A) op(B) for each of `batch` heads (see mst_cuda_mm
 * for the column-major swap). */
static mst_status gemm_heads(mst_ctx_t* ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                             const void* A, int64_t lda, int64_t sa, const void* B, int64_t ldb, int64_t sb,
                             void* C, cudaDataType ct, int64_t ldc, int64_t sc, int64_t batch) {
    const float beta = 0.0f;
    MST_CUBLAS_TRY(cublasGemmStridedBatchedEx(mst_cuda(ctx)->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                              ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)m, (int)k, &alpha,
                                              B, CUDA_R_16BF, (int)ldb, sb, A, CUDA_R_16BF, (int)lda, sa, &beta,
                                              C, ct, (int)ldc, sc, (int)batch, CUBLAS_COMPUTE_32F,
                                              CUBLAS_GEMM_DEFAULT));
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
    const int64_t TT = d.T * d.T, NHTT = d.NH * TT;
    cudaStream_t s = mst_cuda(ctx)->stream;
    for (int64_t b = 0; b < a->batch; b++) {
        const uint16_t* q = a->qkv + b * d.T * 3 * d.H;
        MST_TRY(gemm_heads(ctx, 0, 1, d.T, d.T, d.D, d.sc, q, 3 * d.H, d.D, q + d.H, 3 * d.H, d.D,
                           a->probs + b * NHTT, CUDA_R_32F, d.T, TT, d.NH));
    }
    attn_softmax_kernel<<<(unsigned)(a->batch * NHTT / d.T), ATTN_THREADS, 0, s>>>(a->probs, a->scratch16, d.T);
    MST_CUDA_LAUNCHED();
    for (int64_t b = 0; b < a->batch; b++) {
        const uint16_t* v = a->qkv + b * d.T * 3 * d.H + 2 * d.H;
        MST_TRY(gemm_heads(ctx, 0, 0, d.T, d.D, d.T, 1.0f, a->scratch16 + b * NHTT, d.T, TT, v, 3 * d.H, d.D,
                           a->out + b * d.T * d.H, CUDA_R_16BF, d.H, d.D, d.NH));
    }
    return MST_OK;
}

extern "C" mst_status mst_cuda_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_dims(a));
    const attn_dims d = dims_of(a);
    const int64_t TT = d.T * d.T, NHTT = d.NH * TT, n = a->batch * NHTT;
    cudaStream_t s = mst_cuda(ctx)->stream;
    attn_to_bf16_kernel<<<mst_blocks(n, 256), 256, 0, s>>>(a->probs, a->scratch16, n);
    MST_CUDA_LAUNCHED();
    for (int64_t b = 0; b < a->batch; b++) { /* dv = P^T dout; dP = dout v^T */
        const uint16_t *qkv = a->qkv + b * d.T * 3 * d.H, *g = a->dout + b * d.T * d.H;
        MST_TRY(gemm_heads(ctx, 1, 0, d.T, d.D, d.T, 1.0f, a->scratch16 + b * NHTT, d.T, TT, g, d.H, d.D,
                           a->dqkv + b * d.T * 3 * d.H + 2 * d.H, CUDA_R_16BF, 3 * d.H, d.D, d.NH));
        MST_TRY(gemm_heads(ctx, 0, 1, d.T, d.T, d.D, 1.0f, g, d.H, d.D, qkv + 2 * d.H, 3 * d.H, d.D,
                           a->scratch32 + b * NHTT, CUDA_R_32F, d.T, TT, d.NH));
    }
    attn_dsoftmax_kernel<<<(unsigned)(n / d.T), ATTN_THREADS, 0, s>>>(a->probs, a->scratch32, a->scratch16, d.T, d.sc);
    MST_CUDA_LAUNCHED();
    for (int64_t b = 0; b < a->batch; b++) { /* dq = dS k; dk = dS^T q */
        const uint16_t* qkv = a->qkv + b * d.T * 3 * d.H;
        uint16_t* dq = a->dqkv + b * d.T * 3 * d.H;
        MST_TRY(gemm_heads(ctx, 0, 0, d.T, d.D, d.T, 1.0f, a->scratch16 + b * NHTT, d.T, TT, qkv + d.H, 3 * d.H,
                           d.D, dq, CUDA_R_16BF, 3 * d.H, d.D, d.NH));
        MST_TRY(gemm_heads(ctx, 1, 0, d.T, d.D, d.T, 1.0f, a->scratch16 + b * NHTT, d.T, TT, qkv, 3 * d.H, d.D,
                           dq + d.H, CUDA_R_16BF, 3 * d.H, d.D, d.NH));
    }
    return MST_OK;
}
