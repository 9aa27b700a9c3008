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
    dim3 grid((unsigned)a->seq, (unsigned)(a->batch * a->n_head));
    attn_forward_kernel<<<grid, ATTN_THREADS, shm, mst_cuda(ctx)->stream>>>(*a, dims_of(a));
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    size_t shm;
    MST_TRY(check_dims(a, &shm));
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
