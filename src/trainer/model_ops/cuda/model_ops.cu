/*
 * model_ops.cu — the CUDA versions of the trainer's row ops: matmul through
 * cublasGemmEx (bf16 operands, fp32 compute), softmax cross-entropy, sum of
 * squares, AdamW and the float64 loss sum (RMSNorm and add: model_ops_norm.cu).
 * Same arguments as the CPU reference (model_ops.c). Every reduction runs in
 * a fixed order: no floating-point atomics, the same bits on every run.
 */
#include "model_ops.cuh"

/* ---- matmul ----------------------------------------------------------------
 * Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the
 * row-major buffers read as column-major are the transposes, so the call
 * swaps A and B and keeps each operand's transpose flag. */
extern "C" mst_status mst_cuda_mm(mst_ctx_t* ctx, const mst_mm_args* a) {
    mst_cuda_impl* c = mst_cuda(ctx);
    const float alpha = 1.0f, beta = a->accumulate ? 1.0f : 0.0f;
    void* C = a->c16 ? (void*)a->c16 : (void*)a->c32;
    MST_CUBLAS_TRY(cublasGemmEx(c->blas, a->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                a->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)a->n, (int)a->m, (int)a->k,
                                &alpha, a->b, CUDA_R_16BF, (int)a->ldb, a->a, CUDA_R_16BF, (int)a->lda,
                                &beta, C, a->c16 ? CUDA_R_16BF : CUDA_R_32F, (int)a->ldc,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return MST_OK;
}

/* ---- cross-entropy: one block per row --------------------------------------
 * Two passes over the row: thread i takes the 8-value pieces i, i + threads,
 * ... (model_ops.cuh: 16-byte loads where the rows allow, the same sums
 * either way) and keeps a running max and the sum of exp
 * below it, rescaled when the max grows; the threads' (max, sum) pairs are
 * joined by a fixed xor tree in each warp, then the warps in order. The
 * second pass writes dlogits. Threads by V (a warp at V 256, 1024 at
 * Qwen3's 151 936): fixed by the shape, so are the bits. */

/* (m, s) += (m2, s2): the larger max, each sum rescaled to it. */
__device__ __forceinline__ void lse_join(float& m, float& s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return; /* both empty */
    s = (m == -INFINITY ? 0.0f : s * expf(m - M)) + (m2 == -INFINITY ? 0.0f : s2 * expf(m2 - M));
    m = M;
}

template <int VEC>
__global__ void xent_kernel(mst_xent_args a) {
    __shared__ float shm_m[32], shm_s[32];
    const int64_t r = blockIdx.x, V = a.vocab;
    const uint16_t* l = a.logits + r * V; /* [V] */
    float m = -INFINITY, s = 0.0f;
#pragma unroll 2
    for (int64_t v = (int64_t)threadIdx.x * MST_PIECE; v < V; v += (int64_t)blockDim.x * MST_PIECE) {
        float f[MST_PIECE];
        const int n = piece_load<VEC>(l, v, V, f);
#pragma unroll
        for (int k = 0; k < MST_PIECE; k++) {
            if (k >= n) break;
            if (f[k] > m) {
                s = s * expf(m - f[k]) + 1.0f;
                m = f[k];
            } else if (m != -INFINITY) {
                s += expf(f[k] - m);
            }
        }
    }
    for (int d = 16; d > 0; d >>= 1)
        lse_join(m, s, __shfl_xor_sync(0xffffffffu, m, d), __shfl_xor_sync(0xffffffffu, s, d));
    const int warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) shm_m[warp] = m, shm_s[warp] = s;
    __syncthreads();
    m = shm_m[0], s = shm_s[0];
    for (int w = 1; w < n_warps; w++) lse_join(m, s, shm_m[w], shm_s[w]);
    const int32_t tg = a.targets[r];
    if (threadIdx.x == 0) a.loss[r] = logf(s) + m - mst_bf(l[tg]);
#pragma unroll 2
    for (int64_t v = (int64_t)threadIdx.x * MST_PIECE; v < V; v += (int64_t)blockDim.x * MST_PIECE) {
        float f[MST_PIECE];
        piece_load<VEC>(l, v, V, f);
#pragma unroll
        for (int k = 0; k < MST_PIECE; k++) f[k] = (expf(f[k] - m) / s - (v + k == tg ? 1.0f : 0.0f)) * a.scale;
        piece_store<VEC>(a.dlogits + r * V, v, V, f);
    }
}

extern "C" mst_status mst_cuda_xent(mst_ctx_t* ctx, const mst_xent_args* a) {
    if (a->rows == 0) return MST_OK;
    const int vec = a->vocab % 8 == 0 && mst_aligned(a->logits, 16) && mst_aligned(a->dlogits, 16) ? 8 : 1;
    int64_t threads = (a->vocab / (8 * MST_PIECE) + 31) / 32 * 32; /* about 8 pieces a thread */
    threads = threads < 32 ? 32 : threads > 1024 ? 1024 : threads;
    cudaStream_t s = mst_cuda(ctx)->stream;
    if (vec == 8) xent_kernel<8><<<(unsigned)a->rows, (unsigned)threads, 0, s>>>(*a);
    else xent_kernel<1><<<(unsigned)a->rows, (unsigned)threads, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* ---- sum of squares: chunk sums, then the chunks in order ------------------ */

__global__ void sumsq_chunks_kernel(mst_sumsq_args a, int64_t chunk) {
    __shared__ float shm[32];
    const int64_t b = (int64_t)blockIdx.x * chunk, e = min(b + chunk, a.n);
    /* four running sums a thread (four loads in flight), added in order */
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t step = blockDim.x;
    int64_t i = b + threadIdx.x;
    for (; i + 3 * step < e; i += 4 * step)
#pragma unroll
        for (int k = 0; k < 4; k++) s[k] += a.plain ? a.x[i + k * step] : a.x[i + k * step] * a.x[i + k * step];
    for (int k = 0; i < e; i += step, k++) s[k] += a.plain ? a.x[i] : a.x[i] * a.x[i];
    const float t = mst_block_sum(((s[0] + s[1]) + s[2]) + s[3], shm);
    if (threadIdx.x == 0) a.partial[blockIdx.x] = t;
}

__global__ void sumsq_total_kernel(mst_sumsq_args a) {
    float s = a.base ? *a.base : 0.0f;
    for (int p = 0; p < MST_SUMSQ_PARTS; p++) s += a.partial[p];
    *a.out = s;
}

extern "C" mst_status mst_cuda_sumsq(mst_ctx_t* ctx, const mst_sumsq_args* a) {
    cudaStream_t s = mst_cuda(ctx)->stream;
    const int64_t chunk = (a->n + MST_SUMSQ_PARTS - 1) / MST_SUMSQ_PARTS;
    sumsq_chunks_kernel<<<MST_SUMSQ_PARTS, 256, 0, s>>>(*a, chunk);
    MST_CUDA_LAUNCHED();
    sumsq_total_kernel<<<1, 1, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* ---- AdamW -------------------------------------------------------------------- */

/* One parameter's update (the same arithmetic for every V below). */
__device__ __forceinline__ void adamw_one(const mst_adamw_args& a, float lr, float bc1, float bc2, float gs, float g,
                                          float& m, float& v, float& p) {
    g *= gs;
    m = a.beta1 * m + (1.0f - a.beta1) * g;
    v = a.beta2 * v + (1.0f - a.beta2) * g * g;
    p *= 1.0f - lr * a.weight_decay;
    p -= lr * (m / bc1) / (sqrtf(v / bc2) + a.eps);
}

/* Moments of type T (float, or uint16_t: bf16 rounded to nearest even). */
__device__ __forceinline__ float mom_load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float mom_load(const uint16_t* p, int64_t i) { return mst_bf(p[i]); }
__device__ __forceinline__ void mom_store(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void mom_store(uint16_t* p, int64_t i, float x) { p[i] = mst_to_bf(x); }

/* Four moments at once: 16-byte (fp32) or 8-byte (bf16) loads and stores. */
__device__ __forceinline__ float4 mom_load4(const float* p, int64_t i) { return *(const float4*)(p + i); }
__device__ __forceinline__ float4 mom_load4(const uint16_t* p, int64_t i) {
    const uint2 u = *(const uint2*)(p + i);
    return make_float4(mst_bf((uint16_t)u.x), mst_bf((uint16_t)(u.x >> 16)), mst_bf((uint16_t)u.y), mst_bf((uint16_t)(u.y >> 16)));
}
__device__ __forceinline__ uint2 pack_bf4(float4 x) {
    uint2 w;
    w.x = (uint32_t)mst_to_bf(x.x) | (uint32_t)mst_to_bf(x.y) << 16;
    w.y = (uint32_t)mst_to_bf(x.z) | (uint32_t)mst_to_bf(x.w) << 16;
    return w;
}
__device__ __forceinline__ void mom_store4(float* p, int64_t i, float4 x) { *(float4*)(p + i) = x; }
__device__ __forceinline__ void mom_store4(uint16_t* p, int64_t i, float4 x) { *(uint2*)(p + i) = pack_bf4(x); }

/* V parameters a thread: V = 4 with vector loads and stores (16 bytes for
 * fp32, 8 for the bf16 weights and moments) when the buffers allow, else
 * 1. T: the moments' type. */
template <int V, typename T>
__global__ void adamw_kernel(mst_adamw_args a) {
    if (*a.flag != 0) return; /* the step's results are invalid: no update */
    const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= a.n) return;
    const float lr = a.hyper[MST_HYPER_LR], bc1 = a.hyper[MST_HYPER_BC1], bc2 = a.hyper[MST_HYPER_BC2];
    const float norm = sqrtf(*a.grad_sumsq), gs = norm > a.clip ? a.clip / norm : 1.0f;
    T* am = (T*)a.m; /* [n] */
    T* av = (T*)a.v; /* [n] */
    if (V == 4 && i + 4 <= a.n) {
        const float4 g = *(const float4*)(a.grad + i);
        float4 m = mom_load4(am, i), v = mom_load4(av, i), p = *(const float4*)(a.master + i);
        adamw_one(a, lr, bc1, bc2, gs, g.x, m.x, v.x, p.x);
        adamw_one(a, lr, bc1, bc2, gs, g.y, m.y, v.y, p.y);
        adamw_one(a, lr, bc1, bc2, gs, g.z, m.z, v.z, p.z);
        adamw_one(a, lr, bc1, bc2, gs, g.w, m.w, v.w, p.w);
        mom_store4(am, i, m);
        mom_store4(av, i, v);
        *(float4*)(a.master + i) = p;
        *(uint2*)(a.w + i) = pack_bf4(p);
        return;
    }
    for (int64_t j = i; j < i + V && j < a.n; j++) {
        float m = mom_load(am, j), v = mom_load(av, j), p = a.master[j];
        adamw_one(a, lr, bc1, bc2, gs, a.grad[j], m, v, p);
        mom_store(am, j, m);
        mom_store(av, j, v);
        a.master[j] = p;
        a.w[j] = mst_to_bf(p);
    }
}

template <typename T>
static void adamw_launch(const mst_adamw_args* a, cudaStream_t s) {
    const uintptr_t mb = 4 * sizeof(T); /* four moments' bytes */
    if (mst_aligned(a->grad, 16) && mst_aligned(a->m, mb) && mst_aligned(a->v, mb) && mst_aligned(a->master, 16) && mst_aligned(a->w, 8))
        adamw_kernel<4, T><<<mst_blocks((a->n + 3) / 4, 256), 256, 0, s>>>(*a);
    else
        adamw_kernel<1, T><<<mst_blocks(a->n, 256), 256, 0, s>>>(*a);
}

extern "C" mst_status mst_cuda_adamw(mst_ctx_t* ctx, const mst_adamw_args* a) {
    cudaStream_t s = mst_cuda(ctx)->stream;
    if (a->moments_bf16) adamw_launch<uint16_t>(a, s);
    else adamw_launch<float>(a, s);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* ---- float64 sum: MST_SUM_LANES lanes, then the lanes in order ------------- */

__global__ void sum_kernel(mst_sum_args a) {
    __shared__ double lane[MST_SUM_LANES];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < a.n; i += MST_SUM_LANES) s += (double)a.x[i];
    lane[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x != 0) return;
    double t = 0.0;
    for (int i = 0; i < MST_SUM_LANES; i++) t += lane[i];
    *a.out = t;
}

extern "C" mst_status mst_cuda_sum(mst_ctx_t* ctx, const mst_sum_args* a) {
    sum_kernel<<<1, MST_SUM_LANES, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" const mst_model_backend mst_model_backend_cuda = {
    .name = "cuda",
    .attn_scratch = 1, /* the cuBLAS attention's P / dP / dS */
    .mm = mst_cuda_mm,
    .norm_forward = mst_cuda_norm_forward,
    .norm_backward = mst_cuda_norm_backward,
    .add = mst_cuda_add,
    .embed_forward = mst_cuda_embed_forward,
    .embed_backward = mst_cuda_embed_backward,
    .xent = mst_cuda_xent,
    .qk_forward = mst_cuda_qk_forward,
    .qk_backward = mst_cuda_qk_backward,
    .attn_forward = mst_cuda_attn_forward,
    .attn_backward = mst_cuda_attn_backward,
    .attn_flash_check = mst_cuda_attn_flash_check,
    .attn_flash_forward = mst_cuda_attn_flash_forward,
    .attn_flash_backward = mst_cuda_attn_flash_backward,
    .attn_cudnn_check = mst_cuda_attn_cudnn_check,
    .attn_cudnn_forward = mst_cuda_attn_cudnn_forward,
    .attn_cudnn_backward = mst_cuda_attn_cudnn_backward,
    .route_forward = mst_cuda_route_forward,
    .route_backward = mst_cuda_route_backward,
    .route_peak = mst_cuda_route_peak,
    .rows_gather = mst_cuda_rows_gather,
    .rows_sum = mst_cuda_rows_sum,
    .sumsq = mst_cuda_sumsq,
    .adamw = mst_cuda_adamw,
    .sum = mst_cuda_sum,
};
