/*
 * model_ops.cuh — the CUDA backend's model ops (one declaration per slot of
 * the model-op table, model_backend.h) and the device helpers their files
 * share: bf16 <-> fp32 and fixed-order block reductions.
 */
#ifndef MST_CUDA_MODEL_OPS_CUH
#define MST_CUDA_MODEL_OPS_CUH

#include "lib/internal.h"
#include "trainer/model_ops/model_backend.h"

extern "C" {
/* model_ops.cu */
mst_status mst_cuda_mm(mst_ctx_t* ctx, const mst_mm_args* a);
mst_status mst_cuda_xent(mst_ctx_t* ctx, const mst_xent_args* a);
mst_status mst_cuda_sumsq(mst_ctx_t* ctx, const mst_sumsq_args* a);
mst_status mst_cuda_adamw(mst_ctx_t* ctx, const mst_adamw_args* a);
mst_status mst_cuda_sum(mst_ctx_t* ctx, const mst_sum_args* a);
/* model_ops_norm.cu */
mst_status mst_cuda_norm_forward(mst_ctx_t* ctx, const mst_norm_args* a);
mst_status mst_cuda_norm_backward(mst_ctx_t* ctx, const mst_norm_args* a);
mst_status mst_cuda_add(mst_ctx_t* ctx, const mst_add_args* a);
/* model_ops_embed.cu */
mst_status mst_cuda_embed_forward(mst_ctx_t* ctx, const mst_embed_args* a);
mst_status mst_cuda_embed_backward(mst_ctx_t* ctx, const mst_embed_args* a);
/* model_ops_qk.cu */
mst_status mst_cuda_qk_forward(mst_ctx_t* ctx, const mst_qk_args* a);
mst_status mst_cuda_qk_backward(mst_ctx_t* ctx, const mst_qk_args* a);
/* model_ops_attn.cu */
mst_status mst_cuda_attn_forward(mst_ctx_t* ctx, const mst_attn_args* a);
mst_status mst_cuda_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a);
/* model_ops_flash.cu */
mst_status mst_cuda_attn_flash_check(mst_ctx_t* ctx, const mst_attn_args* a);
mst_status mst_cuda_attn_flash_forward(mst_ctx_t* ctx, const mst_attn_args* a);
mst_status mst_cuda_attn_flash_backward(mst_ctx_t* ctx, const mst_attn_args* a);
/* model_ops_cudnn.cu */
mst_status mst_cuda_attn_cudnn_check(mst_ctx_t* ctx, const mst_attn_args* a);
mst_status mst_cuda_attn_cudnn_forward(mst_ctx_t* ctx, const mst_attn_args* a);
mst_status mst_cuda_attn_cudnn_backward(mst_ctx_t* ctx, const mst_attn_args* a);
/* model_ops_route.cu */
mst_status mst_cuda_route_forward(mst_ctx_t* ctx, const mst_route_args* a);
mst_status mst_cuda_route_backward(mst_ctx_t* ctx, const mst_route_args* a);
mst_status mst_cuda_route_peak(mst_ctx_t* ctx, const mst_route_args* a);
/* model_ops_rows.cu */
mst_status mst_cuda_rows_gather(mst_ctx_t* ctx, const mst_rows_args* a);
mst_status mst_cuda_rows_sum(mst_ctx_t* ctx, const mst_rows_args* a);
}


/* Sum of v over the block in a fixed order (xor-shuffle within warps, then
 * warp sums in warp order); every thread gets the result. shm: [32]. */
__device__ __forceinline__ float mst_block_sum(float v, float* shm) {
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    const int warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    __syncthreads(); /* shm may still be read from a previous call */
    if ((threadIdx.x & 31) == 0) shm[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < n_warps; w++) s += shm[w];
    return s;
}

__device__ __forceinline__ float mst_block_max(float v, float* shm) {
    for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
    const int warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) shm[warp] = v;
    __syncthreads();
    float s = -INFINITY;
    for (int w = 0; w < n_warps; w++) s = fmaxf(s, shm[w]);
    return s;
}

static inline int mst_aligned(const void* p, uintptr_t n) { return ((uintptr_t)p & (n - 1)) == 0; }

/* VEC bf16 values: one 16-byte load (VEC 8) or one value. */
template <int VEC> struct bf_raw { uint16_t h; };
template <> struct bf_raw<8> { uint4 u; };

template <int VEC>
__device__ __forceinline__ bf_raw<VEC> bf_load(const uint16_t* p) {
    bf_raw<VEC> r;
    if constexpr (VEC == 8) r.u = *(const uint4*)p;
    else r.h = *p;
    return r;
}

template <int VEC>
__device__ __forceinline__ void bf_add(float* acc, const bf_raw<VEC>& r) {
    if constexpr (VEC == 8) {
        const uint32_t w[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            acc[2 * k] += __uint_as_float(w[k] << 16);
            acc[2 * k + 1] += __uint_as_float(w[k] & 0xFFFF0000u);
        }
    } else {
        acc[0] += mst_bf(r.h);
    }
}

/* VEC fp32 values stored as bf16 (nearest even): one 16-byte store (VEC 8)
 * or one value. */
template <int VEC>
__device__ __forceinline__ void bf_store(uint16_t* p, const float* f) {
    if constexpr (VEC == 8) {
        uint4 u;
        u.x = (uint32_t)mst_to_bf(f[0]) | (uint32_t)mst_to_bf(f[1]) << 16;
        u.y = (uint32_t)mst_to_bf(f[2]) | (uint32_t)mst_to_bf(f[3]) << 16;
        u.z = (uint32_t)mst_to_bf(f[4]) | (uint32_t)mst_to_bf(f[5]) << 16;
        u.w = (uint32_t)mst_to_bf(f[6]) | (uint32_t)mst_to_bf(f[7]) << 16;
        *(uint4*)p = u;
    } else {
        *p = mst_to_bf(f[0]);
    }
}

/* VEC fp32 values from VEC bf16 ones. */
template <int VEC>
__device__ __forceinline__ void bf_unpack(const bf_raw<VEC>& r, float* f) {
    if constexpr (VEC == 8) {
        const uint32_t w[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[2 * k] = __uint_as_float(w[k] << 16);
            f[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        }
    } else {
        f[0] = mst_bf(r.h);
    }
}

/* Pieces of 8 consecutive values of a row of n: the unit a thread takes in
 * the row reductions (RMSNorm, cross-entropy), so that which thread sums
 * which values, and in which order, does not depend on how they are loaded
 * (VEC 8: one 16-byte load, the row's length a multiple of 8 and the row
 * aligned; VEC 1: one value a load, the values past n left out). Returns
 * how many of the 8 are in the row. */
enum { MST_PIECE = 8 };

template <int VEC>
__device__ __forceinline__ int piece_load(const uint16_t* row, int64_t c, int64_t n, float* f) {
    if constexpr (VEC == 8) {
        bf_unpack<8>(bf_load<8>(row + c), f);
        return 8;
    } else {
        const int m = n - c < MST_PIECE ? (int)(n - c) : MST_PIECE;
#pragma unroll
        for (int k = 0; k < MST_PIECE; k++) f[k] = k < m ? mst_bf(row[c + k]) : 0.0f;
        return m;
    }
}

template <int VEC>
__device__ __forceinline__ void piece_store(uint16_t* row, int64_t c, int64_t n, const float* f) {
    if constexpr (VEC == 8) {
        bf_store<8>(row + c, f);
    } else {
        const int m = n - c < MST_PIECE ? (int)(n - c) : MST_PIECE;
        for (int k = 0; k < m; k++) row[c + k] = mst_to_bf(f[k]);
    }
}

/* Grid size for n items at `per` items per block, at most 65535 * 1024. */
static inline unsigned mst_blocks(int64_t n, int per) { return (unsigned)((n + per - 1) / per); }

#endif
