/*
 * activation.cu — the grouped MLP activation on CUDA, forward and backward:
 * z = act(h) * p; dh = d act(h) * dz * p; dprobs = dz . act(h) (+ dy . b2[g]).
 * Same formulas as the CPU reference (activation_math.h), fp32 math, bf16
 * stored with round-to-nearest-even.
 *
 * Counts are read on the device: every block derives the row offsets into
 * shared memory, so the launch shape depends only on max_rows and the whole
 * op is graph-capturable with counts changing between replays. Rows past
 * sum(counts) are untouched; bad counts (negative, sum > R) raise
 * MST_FLAG_COUNTS and the kernel writes nothing.
 *
 * One warp per row (grid-stride over rows), 16-byte loads when the widths
 * and pointers allow; dprobs is a fixed-order warp reduction (deterministic).
 */
#include <stdint.h>

#include "../activation_math.h"
#include "counts.cuh"
#include "cuda_common.cuh"
#include "cuda_ops.h"

#define ACT_THREADS 256
#define ACT_WARPS (ACT_THREADS / 32)
#define ACT_MAX_E 2048 /* offsets in shared memory: 16 KiB */

/* off [E+1] of the counts into s_off (mst_block_counts); returns n = off[E],
 * or -1 (flag raised by block 0) when a count is negative or the sum passes R. */
__device__ int64_t act_block_offsets(const int32_t* __restrict__ counts, int E, int64_t R,
                                     int64_t* s_off, int32_t* flag) {
    const int64_t n = mst_block_counts(counts, E, R, s_off);
    if (n == MST_COUNTS_BAD) {
        if (blockIdx.x == 0 && threadIdx.x == 0) mst_dev_flag(flag, MST_FLAG_COUNTS);
        return -1;
    }
    return n;
}

/* V consecutive bf16 <-> fp32; V = 8 is one 16-byte access. */
template <int V>
__device__ __forceinline__ void load_bf16(const uint16_t* __restrict__ p, float* f) {
    if constexpr (V == 8) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) f[i] = mst_bf(p[i]);
    }
}

/* V values of an h row from column c (h NULL: zeros). */
template <int V>
__device__ __forceinline__ void load_h(const uint16_t* h, int64_t c, float* f) {
    if (h) load_bf16<V>(h + c, f);
    else
#pragma unroll
        for (int i = 0; i < V; i++) f[i] = 0.0f;
}

template <int V>
__device__ __forceinline__ void store_bf16(uint16_t* __restrict__ p, const float* f) {
    if constexpr (V == 8) {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = (uint32_t)mst_to_bf(f[2 * i]) | ((uint32_t)mst_to_bf(f[2 * i + 1]) << 16);
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) p[i] = (uint16_t)(uint32_t)mst_to_bf(f[i]);
    }
}

template <int V>
__global__ void __launch_bounds__(ACT_THREADS)
act_forward_kernel(const mst_act_args a, const mst_act_param q, int32_t* flag) {
    __shared__ int64_t s_off[ACT_MAX_E + 1];
    const int64_t n = act_block_offsets(a.counts, a.n_groups, a.max_rows, s_off, flag);
    const int lane = threadIdx.x & 31;
    const int64_t F = a.ffn;
    for (int64_t r = (int64_t)blockIdx.x * ACT_WARPS + (threadIdx.x >> 5); r < n;
         r += (int64_t)gridDim.x * ACT_WARPS) {
        const uint16_t* h = mst_act_h_row(&a, r);                /* [2F] */
        uint16_t* z = a.z + r * F;                               /* [F]  */
        uint16_t* ho = mst_paged_out_row(&a.h_out, r, 4 * F);    /* [2F] claimed pages, or NULL */
        uint16_t* zo = mst_paged_out_row(&a.z_out, r, 2 * F);    /* [F]  */
        const float p = a.probs[r];
        for (int64_t c = lane * V; c < F; c += 32 * V) {
            float av[V], bv[V], zv[V];
            load_h<V>(h, c, av);
            load_h<V>(h, F + c, bv);
#pragma unroll
            for (int i = 0; i < V; i++) zv[i] = mst_act_value(q, av[i], bv[i]) * p;
            store_bf16<V>(z + c, zv);
            if (ho) { /* bf16 -> fp32 -> bf16 gives the same bits */
                store_bf16<V>(ho + c, av);
                store_bf16<V>(ho + F + c, bv);
            }
            if (zo) store_bf16<V>(zo + c, zv);
        }
    }
}

/* Fixed-order butterfly: every lane ends with the same sum. */
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int V>
__global__ void __launch_bounds__(ACT_THREADS)
act_backward_kernel(const mst_act_args a, const mst_act_param q, int32_t* flag) {
    __shared__ int64_t s_off[ACT_MAX_E + 1];
    const int64_t n = act_block_offsets(a.counts, a.n_groups, a.max_rows, s_off, flag);
    const int lane = threadIdx.x & 31;
    const int64_t F = a.ffn, H = a.hidden;
    for (int64_t r = (int64_t)blockIdx.x * ACT_WARPS + (threadIdx.x >> 5); r < n;
         r += (int64_t)gridDim.x * ACT_WARPS) {
        const uint16_t* h = mst_act_h_row(&a, r); /* [2F] */
        const uint16_t* dz = a.dz + r * F;        /* [F]  */
        uint16_t* dh = a.dh + r * 2 * F;          /* [2F] */
        const float p = a.probs[r];
        float dprob = 0.0f;
        for (int64_t c = lane * V; c < F; c += 32 * V) {
            float av[V], bv[V], dzv[V], dav[V], dbv[V];
            load_h<V>(h, c, av);
            load_h<V>(h, F + c, bv);
            load_bf16<V>(dz + c, dzv);
#pragma unroll
            for (int i = 0; i < V; i++)
                dprob += dzv[i] * mst_act_grad(q, av[i], bv[i], dzv[i] * p, &dav[i], &dbv[i]);
            store_bf16<V>(dh + c, dav);
            store_bf16<V>(dh + F + c, dbv);
        }
        if (a.b2) { /* the prob-scaled fc2 bias: dp += dy[r] . b2[g] */
            const uint16_t* dy = a.dy + r * H;                               /* [H] */
            const uint16_t* b2 = a.b2 + (int64_t)mst_group_of(s_off, a.n_groups, r) * H; /* [H] */
            for (int64_t c = lane * V; c < H; c += 32 * V) {
                float dyv[V], bv[V];
                load_bf16<V>(dy + c, dyv);
                load_bf16<V>(b2 + c, bv);
#pragma unroll
                for (int i = 0; i < V; i++) dprob += dyv[i] * bv[i];
            }
        }
        dprob = warp_sum(dprob);
        if (lane == 0) a.dprobs[r] = dprob;
    }
}

static int aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

/* Pages with 16-byte aligned blocks, or none. */
static int pages16(const mst_pages* pg) {
    return !pg->table || (aligned16(pg->block[0]) && aligned16(pg->block[1]));
}

/* 8-wide (16-byte) access needs every row start and base 16-byte aligned. */
static int act_vec8(const mst_act_args* a) {
    const int h_ok = a->h_pages.table ? pages16(&a->h_pages) : aligned16(a->h);
    int ok = a->ffn % 8 == 0 && h_ok && pages16(&a->h_out) && pages16(&a->z_out) && aligned16(a->z) &&
             aligned16(a->dz) && aligned16(a->dh);
    if (a->b2) ok = ok && a->hidden % 8 == 0 && aligned16(a->dy) && aligned16(a->b2);
    return ok;
}

typedef void (*act_kernel)(const mst_act_args, const mst_act_param, int32_t*);

static mst_status act_launch(mst_ctx_t* ctx, const mst_act_args* a, act_kernel k8, act_kernel k1) {
    if (a->n_groups > ACT_MAX_E)
        return mst_set_error(MST_ERR_UNSUPPORTED,
                             "activation: n_groups = %d, the CUDA kernel takes at most %d",
                             a->n_groups, ACT_MAX_E);
    mst_cuda_impl* c = mst_cuda(ctx);
    const mst_act_param q = mst_act_param_make(a->act, a->limit, a->alpha);
    int64_t blocks = (a->max_rows + ACT_WARPS - 1) / ACT_WARPS;
    if (blocks > (int64_t)c->n_sm * 8) blocks = (int64_t)c->n_sm * 8;
    act_kernel k = act_vec8(a) ? k8 : k1;
    k<<<(unsigned)blocks, ACT_THREADS, 0, c->stream>>>(*a, q, ctx->err_flag);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_act_forward(mst_ctx_t* ctx, const mst_act_args* a) {
    return act_launch(ctx, a, act_forward_kernel<8>, act_forward_kernel<1>);
}

extern "C" mst_status mst_cuda_act_backward(mst_ctx_t* ctx, const mst_act_args* a) {
    return act_launch(ctx, a, act_backward_kernel<8>, act_backward_kernel<1>);
}
