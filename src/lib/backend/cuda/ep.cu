/*
 * ep.cu — the local halves of expert-parallel dispatch and combine on CUDA
 * (ops described in ../ep_ops.h; the CPU reference is cpu/ep.c). Counts and
 * offsets stay on the device; nothing here syncs, so all of it captures in
 * a CUDA graph.
 *   route:  three kernels over chunks of MST_EP_CHUNK entries: per-chunk
 *           expert counts (integer atomics in shared memory: the counts do
 *           not depend on their order), one block that turns them into each
 *           chunk's first slot per expert (and flags blocks past C), then
 *           each entry's slot = its chunk's first + the entries of the same
 *           expert before it in the chunk. Slots in (expert, token, slot)
 *           order, as the CPU's.
 *   row ops (pack, gather, unpack, repack): one warp per row, 16-byte
 *           vectors; gather sums the slots in order with separately rounded
 *           multiply and add (the CPU's arithmetic: same bits); unpack's dot
 *           is a fixed xor-shuffle tree.
 */
#include "../ep_ops.h"
#include "cuda_common.cuh"

enum { ROW_WARPS = 8 }; /* rows per 256-thread block */

static unsigned grid_of(int64_t n, int64_t per) { return (unsigned)((n + per - 1) / per); }

/* 8 bf16 of a 16-byte vector <-> fp32. */
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    uint32_t w[4];
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)mst_to_bf(f[2 * i]) | ((uint32_t)mst_to_bf(f[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ bool valid_id(const mst_ep_args& a, int32_t g) { return g >= 0 && g < a.n_experts; }

/* ---- route ---- */

__global__ void ep_count_kernel(mst_ep_args a) {
    extern __shared__ int32_t cnt[]; /* [E] */
    const int64_t NK = a.n_tok * a.top_k, i = (int64_t)blockIdx.x * MST_EP_CHUNK + threadIdx.x;
    for (int32_t e = threadIdx.x; e < a.n_experts; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    if (i < NK) {
        const int32_t g = a.topk_idx[i];
        if (valid_id(a, g)) atomicAdd(&cnt[g], 1);
        else mst_dev_flag(a.flag, MST_FLAG_COUNTS);
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < a.n_experts; e += blockDim.x)
        a.scratch[(int64_t)blockIdx.x * a.n_experts + e] = cnt[e];
}

/* One block: scratch [chunks, E] counts -> each chunk's first slot per
 * expert (-1: the expert's block is over C); send_counts. */
__global__ void ep_scan_kernel(mst_ep_args a, int32_t n_chunks) {
    extern __shared__ int32_t sh[]; /* tot [E], start [E] */
    const int32_t E = a.n_experts, El = a.n_local;
    int32_t *tot = sh, *start = sh + E;
    for (int32_t g = threadIdx.x; g < E; g += blockDim.x) {
        int32_t s = 0;
        for (int32_t b = 0; b < n_chunks; b++) {
            const int32_t c = a.scratch[(int64_t)b * E + g];
            a.scratch[(int64_t)b * E + g] = s;
            s += c;
        }
        tot[g] = s;
    }
    __syncthreads();
    for (int32_t d = threadIdx.x; d < a.world; d += blockDim.x) {
        int64_t total = 0;
        for (int32_t e = 0; e < El; e++) total += tot[d * El + e];
        const bool over = total > a.pair_rows;
        if (over) mst_dev_flag(a.flag, MST_FLAG_COUNTS);
        a.send_total[d] = over ? 0 : (int32_t)total;
        int32_t base = (int32_t)(d * a.pair_rows);
        for (int32_t e = 0; e < El; e++) {
            const int32_t g = d * El + e;
            a.send_counts[g] = over ? 0 : tot[g];
            start[g] = over ? -1 : base;
            base += over ? 0 : tot[g];
        }
    }
    __syncthreads();
    for (int32_t g = threadIdx.x; g < E; g += blockDim.x)
        for (int32_t b = 0; b < n_chunks; b++) {
            int32_t* s = &a.scratch[(int64_t)b * E + g];
            *s = start[g] < 0 ? -1 : start[g] + *s;
        }
}

__global__ void ep_assign_kernel(mst_ep_args a) {
    __shared__ int32_t ids[MST_EP_CHUNK];
    const int64_t NK = a.n_tok * a.top_k, i = (int64_t)blockIdx.x * MST_EP_CHUNK + threadIdx.x;
    const int32_t g = i < NK ? a.topk_idx[i] : -1;
    ids[threadIdx.x] = g;
    __syncthreads();
    if (i >= NK) return;
    if (!valid_id(a, g)) {
        a.send_pos[i] = -1;
        return;
    }
    int32_t before = 0;
    for (int u = 0; u < (int)threadIdx.x; u++) before += ids[u] == g;
    const int32_t first = a.scratch[(int64_t)blockIdx.x * a.n_experts + g];
    a.send_pos[i] = first < 0 ? -1 : first + before;
}

static mst_status cuda_ep_route(mst_ctx_t* ctx, const mst_ep_args* a) {
    cudaStream_t s = mst_cuda(ctx)->stream;
    const int64_t NK = a->n_tok * a->top_k;
    const int32_t n_chunks = (int32_t)grid_of(NK, MST_EP_CHUNK);
    const size_t E4 = (size_t)a->n_experts * sizeof(int32_t);
    if (2 * E4 > 48 * 1024)
        return mst_set_error(MST_ERR_INVALID, "ep: %d experts, at most %d", a->n_experts, (int)(24 * 1024 / 4));
    ep_count_kernel<<<n_chunks, MST_EP_CHUNK, E4, s>>>(*a);
    MST_CUDA_LAUNCHED();
    ep_scan_kernel<<<1, 1024, 2 * E4, s>>>(*a, n_chunks);
    MST_CUDA_LAUNCHED();
    ep_assign_kernel<<<n_chunks, MST_EP_CHUNK, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* ---- row ops: one warp per row ---- */

__device__ __forceinline__ int64_t warp_row() { return (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5); }
__device__ __forceinline__ int lane() { return threadIdx.x & 31; }

__device__ __forceinline__ void copy_row(uint4* dst, const uint4* src, int64_t n_vec) {
    for (int64_t v = lane(); v < n_vec; v += 32) dst[v] = src[v];
}

__global__ void ep_pack_kernel(mst_ep_args a) {
    const int64_t i = warp_row(), nv = a.cols / 8;
    if (i >= a.n_tok * a.top_k) return;
    const int32_t pos = a.send_pos[i];
    if (pos < 0) return;
    copy_row((uint4*)(a.blk + (int64_t)pos * a.cols), (const uint4*)(a.tok + (i / a.top_k) * a.cols), nv);
    if (a.blk_p && lane() == 0) a.blk_p[pos] = a.tok_p[i];
}

__global__ void ep_gather_kernel(mst_ep_args a) {
    const int64_t t = warp_row(), nv = a.cols / 8;
    if (t >= a.n_tok) return;
    const int32_t K = a.top_k;
    if (a.tok_p_out && lane() == 0)
        for (int32_t s = 0; s < K; s++) {
            const int32_t pos = a.send_pos[t * K + s];
            a.tok_p_out[t * K + s] = pos < 0 ? 0.0f : a.blk_p[pos];
        }
    if (!a.tok_out) return;
    for (int64_t v = lane(); v < nv; v += 32) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, x[8];
        for (int32_t s = 0; s < K; s++) {
            const int32_t pos = a.send_pos[t * K + s];
            if (pos < 0) continue;
            const float w = a.tok_p ? a.tok_p[t * K + s] : 1.0f;
            unpack8(((const uint4*)(a.blk + (int64_t)pos * a.cols))[v], x);
            for (int c = 0; c < 8; c++) acc[c] = __fadd_rn(acc[c], __fmul_rn(w, x[c]));
        }
        ((uint4*)(a.tok_out + t * a.cols))[v] = pack8(acc);
    }
}

__global__ void ep_plan_kernel(mst_ep_args a) { mst_ep_plan_serial(&a); }

__global__ void ep_unpack_kernel(mst_ep_args a) {
    const int64_t slot = warp_row(), nv = a.cols / 8;
    if (slot >= a.world * a.pair_rows) return;
    const int64_t r = mst_ep_slot_row(&a, (int32_t)(slot / a.pair_rows), slot % a.pair_rows);
    if (r < 0) return;
    const uint4* src = (const uint4*)(a.blk + slot * a.cols);
    const float p = a.blk_p ? a.blk_p[slot] : 1.0f;
    if (a.rows_p && lane() == 0) a.rows_p[r] = p;
    if (a.rows && !a.scale) copy_row((uint4*)(a.rows + r * a.cols), src, nv);
    if (!(a.rows && a.scale) && !a.dot_src) return;
    float dot = 0.0f, x[8], y[8];
    for (int64_t v = lane(); v < nv; v += 32) {
        const uint4 xv = src[v];
        unpack8(xv, x);
        if (a.rows && a.scale) {
            for (int c = 0; c < 8; c++) y[c] = __fmul_rn(p, x[c]);
            ((uint4*)(a.rows + r * a.cols))[v] = pack8(y);
        }
        if (!a.dot_src) continue;
        unpack8(((const uint4*)(a.dot_src + r * a.cols))[v], y);
        for (int c = 0; c < 8; c++) dot = fmaf(x[c], y[c], dot);
    }
    if (!a.dot_src) return;
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane() == 0) a.dot_out[slot] = dot;
}

__global__ void ep_repack_kernel(mst_ep_args a) {
    const int64_t slot = warp_row(), nv = a.cols / 8;
    if (slot >= a.world * a.pair_rows) return;
    const int64_t r = mst_ep_slot_row(&a, (int32_t)(slot / a.pair_rows), slot % a.pair_rows);
    if (r < 0) return;
    copy_row((uint4*)(a.blk + slot * a.cols), (const uint4*)(a.rows_in + r * a.cols), nv);
    if (a.blk_p && lane() == 0) a.blk_p[slot] = a.rows_p_in[r];
}

#define ROW_OP(name, kernel, n_rows)                                                          \
    static mst_status name(mst_ctx_t* ctx, const mst_ep_args* a) {                            \
        const int64_t n_ = (n_rows);                                                          \
        if (n_ == 0) return MST_OK;                                                           \
        kernel<<<grid_of(n_, ROW_WARPS), 32 * ROW_WARPS, 0, mst_cuda(ctx)->stream>>>(*a);     \
        MST_CUDA_LAUNCHED();                                                                  \
        return MST_OK;                                                                        \
    }
ROW_OP(cuda_ep_pack, ep_pack_kernel, a->n_tok * a->top_k)
ROW_OP(cuda_ep_gather, ep_gather_kernel, a->n_tok)
ROW_OP(cuda_ep_unpack, ep_unpack_kernel, a->world * a->pair_rows)
ROW_OP(cuda_ep_repack, ep_repack_kernel, a->world * a->pair_rows)

static mst_status cuda_ep_plan(mst_ctx_t* ctx, const mst_ep_args* a) {
    ep_plan_kernel<<<1, 1, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" const mst_ep_ops mst_ep_ops_cuda = {
    cuda_ep_route, cuda_ep_pack, cuda_ep_gather, cuda_ep_plan, cuda_ep_unpack, cuda_ep_repack,
};
