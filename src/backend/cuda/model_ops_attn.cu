/*
 * model_ops_attn.cu — causal multi-head self-attention on CUDA, forward and
 * backward side by side (the CPU reference is model_ops_attn.c):
 *   S = q k^T / sqrt(D) (j <= i), P = softmax_j(S), out = P v
 *   dv = P^T dout; dP = dout v^T, dS = P (dP - rowsum(P dP)), dq = dS k / sqrt(D),
 *   dk = dS^T q / sqrt(D)
 * One block per (query or key row, batch * head). Scores of a row live in
 * shared memory; every sum runs in index order (no atomics). Backward runs
 * dv first, then dq (which overwrites P with dS), then dk.
 */
#include <stdlib.h>

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

/* Head h's q, k or v row t of batch b (part 0, 1, 2) in a [B*T, 3H] buffer. */
__device__ __forceinline__ const uint16_t* qkv_row(const uint16_t* qkv, const attn_dims& d, int64_t b,
                                                   int64_t h, int64_t t, int part) {
    return qkv + (b * d.T + t) * 3 * d.H + part * d.H + h * d.D;
}

__global__ void attn_forward_kernel(mst_attn_args a, attn_dims d) {
    extern __shared__ float sh[]; /* q [D], p [T] */
    __shared__ float red[32];
    float *q = sh, *p = sh + d.D;
    const int64_t i = blockIdx.x, bh = blockIdx.y, b = bh / d.NH, h = bh % d.NH;
    const uint16_t* qi = qkv_row(a.qkv, d, b, h, i, 0);
    for (int64_t c = threadIdx.x; c < d.D; c += blockDim.x) q[c] = mst_bf(qi[c]);
    __syncthreads();
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
        const uint16_t* kj = qkv_row(a.qkv, d, b, h, j, 1);
        float s = 0.0f;
        for (int64_t c = 0; c < d.D; c++) s += q[c] * mst_bf(kj[c]);
        p[j] = s * d.sc;
        mx = fmaxf(mx, p[j]);
    }
    mx = mst_block_max(mx, red);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) sum += (p[j] = expf(p[j] - mx));
    sum = mst_block_sum(sum, red);
    float* P = a.probs + (bh * d.T + i) * d.T;
    for (int64_t j = threadIdx.x; j < d.T; j += blockDim.x) {
        float v = j <= i ? p[j] / sum : 0.0f;
        if (j <= i) p[j] = v;
        P[j] = v;
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < d.D; c += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j <= i; j++) acc += p[j] * mst_bf(qkv_row(a.qkv, d, b, h, j, 2)[c]);
        a.out[(b * d.T + i) * d.H + h * d.D + c] = mst_to_bf(acc);
    }
}

/* dv[j] = sum_{i >= j} P[i][j] dout[i]; with dk = 1: dk[j] = sc sum dS[i][j] q[i]
 * (P then holds dS). One block per key row j. */
__global__ void attn_dkv_kernel(mst_attn_args a, attn_dims d, int dk) {
    const int64_t j = blockIdx.x, bh = blockIdx.y, b = bh / d.NH, h = bh % d.NH;
    const float* P = a.probs + bh * d.T * d.T;
    for (int64_t c = threadIdx.x; c < d.D; c += blockDim.x) {
        float acc = 0.0f;
        for (int64_t i = j; i < d.T; i++) {
            float x = dk ? mst_bf(qkv_row(a.qkv, d, b, h, i, 0)[c]) : mst_bf(a.dout[(b * d.T + i) * d.H + h * d.D + c]);
            acc += P[i * d.T + j] * x;
        }
        a.dqkv[(b * d.T + j) * 3 * d.H + (dk ? 1 : 2) * d.H + h * d.D + c] = mst_to_bf(dk ? acc * d.sc : acc);
    }
}

/* One block per query row i: dP, dS (written over P), dq. */
__global__ void attn_dq_kernel(mst_attn_args a, attn_dims d) {
    extern __shared__ float sh[]; /* dout_i [D], ds [T] */
    __shared__ float red[32];
    float *g = sh, *ds = sh + d.D;
    const int64_t i = blockIdx.x, bh = blockIdx.y, b = bh / d.NH, h = bh % d.NH;
    const uint16_t* gi = a.dout + (b * d.T + i) * d.H + h * d.D;
    for (int64_t c = threadIdx.x; c < d.D; c += blockDim.x) g[c] = mst_bf(gi[c]);
    __syncthreads();
    float* P = a.probs + (bh * d.T + i) * d.T;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
        const uint16_t* vj = qkv_row(a.qkv, d, b, h, j, 2);
        float dp = 0.0f;
        for (int64_t c = 0; c < d.D; c++) dp += g[c] * mst_bf(vj[c]);
        ds[j] = dp;
        dot += P[j] * dp;
    }
    dot = mst_block_sum(dot, red);
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
        ds[j] = P[j] * (ds[j] - dot);
        P[j] = ds[j];
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < d.D; c += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j <= i; j++) acc += ds[j] * mst_bf(qkv_row(a.qkv, d, b, h, j, 1)[c]);
        a.dqkv[(b * d.T + i) * 3 * d.H + h * d.D + c] = mst_to_bf(acc * d.sc);
    }
}

/* ---- the cuBLAS variant ------------------------------------------------------
 * Per batch b, strided-batched GEMMs over the NH heads (head h of q, k, v at
 * column h D, batch stride D): S = q k^T sc (fp32, into probs), a masked
 * row softmax (P fp32 saved, P bf16 into scratch16), out = P v; backward
 * dv = P^T dout, dP = dout v^T (fp32, scratch32), dS = P (dP - rowsum(P dP)) sc
 * (bf16, scratch16), dq = dS k, dk = dS^T q. */

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

static mst_status attn_forward_blas(mst_ctx_t* ctx, const mst_attn_args* a) {
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

static mst_status attn_backward_blas(mst_ctx_t* ctx, const mst_attn_args* a) {
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

/* Which variant runs: the naive kernels, or cuBLAS (MST_ATTN=blas) — for
 * the comparison in docs/perf-notes.md. */
static int use_blas(const mst_attn_args* a) {
    const char* e = getenv("MST_ATTN");
    return e && e[0] == 'b' && a->scratch16 && a->scratch32;
}

static mst_status check_dims(const mst_attn_args* a, size_t* shm) {
    *shm = sizeof(float) * (size_t)(a->head_dim + a->seq);
    if (*shm > 48 * 1024 || a->batch * a->n_head > 65535)
        return mst_set_error(MST_ERR_INVALID, "attention: seq %lld, head dim %lld, %lld heads x batch: too large",
                             (long long)a->seq, (long long)a->head_dim, (long long)(a->batch * a->n_head));
    return MST_OK;
}

extern "C" mst_status mst_cuda_attn_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    size_t shm;
    MST_TRY(check_dims(a, &shm));
    if (use_blas(a)) return attn_forward_blas(ctx, a);
    dim3 grid((unsigned)a->seq, (unsigned)(a->batch * a->n_head));
    attn_forward_kernel<<<grid, ATTN_THREADS, shm, mst_cuda(ctx)->stream>>>(*a, dims_of(a));
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    size_t shm;
    MST_TRY(check_dims(a, &shm));
    if (use_blas(a)) return attn_backward_blas(ctx, a);
    cudaStream_t s = mst_cuda(ctx)->stream;
    dim3 grid((unsigned)a->seq, (unsigned)(a->batch * a->n_head));
    const unsigned dthreads = a->head_dim >= 64 ? 64 : 32;
    attn_dkv_kernel<<<grid, dthreads, 0, s>>>(*a, dims_of(a), 0);
    MST_CUDA_LAUNCHED();
    attn_dq_kernel<<<grid, ATTN_THREADS, shm, s>>>(*a, dims_of(a));
    MST_CUDA_LAUNCHED();
    attn_dkv_kernel<<<grid, dthreads, 0, s>>>(*a, dims_of(a), 1);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}
