/*
 * stash_fp8.cu — saves into and restores from fp8 pages (fp8_page.h) on the
 * CUDA backend: one kernel each, with the bookkeeping of the copy kernels
 * (stash_common.cuh: every block plans, counts itself as a reader, writes its
 * share of the table or the ring entries, and the last reader commits).
 *
 * The rows go by blocks of MST_FP8_BLOCK elements, one warp per block, each
 * lane 4 elements (8 bytes of bf16, 4 codes): a save loads them, reduces
 * the block's largest magnitude over the warp (integers: the bf16 bits),
 * takes the scale exponent and encodes with the functions of fp8_page.h
 * (the CPU backend's, so both store the same bytes); lane 0 writes the
 * scale, and raises MST_FLAG_NONFINITE for a block holding inf or NaN (its
 * codes zeros). A restore decodes. Each warp has kBlocks blocks in flight;
 * the grid is persistent (per_sm blocks of kThreads per SM of the copy, 64
 * for a pool of host pages only).
 */
#include "cuda_ops.h"
#include "stash_common.cuh"
#include "../fp8_page.h"

namespace {

constexpr int kBlocks = 4;      /* fp8 blocks in flight per warp            */
/* Resident blocks of kThreads per SM: 4 for a restore (56 registers); 3 for
 * a save (80 registers, 8 bytes spilled), whose kBlocks blocks in flight
 * need more than 64 (at 4 per SM ptxas spilled 52 bytes; kBlocks 2 at 4 per
 * SM spills nothing but keeps a third fewer bytes in flight). */
__host__ __device__ constexpr int per_sm(bool restore) { return restore ? 4 : 3; }
constexpr int kHostGrid = 64;   /* blocks for a pool of host pages only     */

/* Where block u (of row u / nb) of the rows sits: its bf16 elements in the
 * rows, its codes and scale in the page. */
typedef struct fp8_unit {
    uint16_t* x;  /* [len] bf16 in the rows          */
    uint8_t* q;   /* [len] e4m3 codes in the page     */
    float* scale; /* [1] its scale in the page        */
    int len;      /* elements: MST_FP8_BLOCK or fewer */
} fp8_unit;

template <bool RESTORE>
__device__ fp8_unit unit_at(const mst_stash_args& a, const mst_plan* plan, char* rows, int64_t u, int64_t nb) {
    const int64_t i = u / nb, b = u - i * nb, j = b * MST_FP8_BLOCK;
    const int64_t p = i / a.page_rows, r = i - p * a.page_rows;
    const uint32_t id = RESTORE ? a.table[p] : mst_plan_page(a.ring, a.cap, plan, p);
    char* page = mst_page_ptr(a.block, id, a.page_rows * a.row_bytes);
    fp8_unit o;
    o.x = (uint16_t*)(rows + i * a.width * 2) + j;
    o.q = mst_fp8_codes(page, r, a.width) + j;
    o.scale = mst_fp8_scales(page, r, a.width, a.page_rows) + b;
    o.len = (int)min((int64_t)MST_FP8_BLOCK, a.width - j);
    return o;
}

/* Lane `lane` of a warp: its 4 elements (e = lane * 4 < len; len is a
 * multiple of 8) into codes, the block's scale by lane 0. */
__device__ void save_block(const mst_stash_args& a, const fp8_unit& o, uint2 v, int lane) {
    const bool mine = lane * 4 < o.len;
    const uint16_t e[4] = {(uint16_t)(v.x & 0xffffu), (uint16_t)(v.x >> 16), (uint16_t)(v.y & 0xffffu),
                           (uint16_t)(v.y >> 16)};
    uint32_t amax = 0;
    for (int k = 0; k < 4; k++) amax = max(amax, (uint32_t)(e[k] & 0x7fffu));
    amax = __reduce_max_sync(0xffffffffu, mine ? amax : 0u);
    const bool bad = amax >= MST_BF16_NONFINITE;
    const int k = bad ? 0 : mst_fp8_scale_exp((uint16_t)amax);
    if (mine) {
        uint32_t w = 0;
        for (int t = 0; t < 4; t++) w |= (uint32_t)(bad ? 0 : mst_e4m3_encode(e[t], k)) << (8 * t);
        *(uint32_t*)(o.q + lane * 4) = w;
    }
    if (lane == 0) {
        *o.scale = mst_fp8_scale_value(k);
        if (bad) mst_dev_flag(a.err_flag, MST_FLAG_NONFINITE);
    }
}

/* Lane `lane`: its 4 codes back to bf16. */
__device__ void restore_block(const fp8_unit& o, uint32_t w, float scale, int lane) {
    if (lane * 4 >= o.len) return;
    const int k = mst_fp8_scale_k(scale);
    uint32_t h[4];
    for (int t = 0; t < 4; t++) h[t] = mst_e4m3_decode((uint8_t)(w >> (8 * t)), k);
    *(uint2*)(o.x + lane * 4) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

/* A save (RESTORE false) or a restore's copy of fp8 pages on the whole
 * grid: blocks u = warp, warp + n_warps, ... of the n rows, kBlocks at a
 * time, every load of a step before its stores. */
template <bool RESTORE>
__global__ void __launch_bounds__(kThreads, per_sm(RESTORE)) fp8_kernel(mst_stash_args a) {
    __shared__ mst_plan s_plan;    /* save only    */
    __shared__ page_return s_ret; /* restore only */
    const part pt = whole_grid();
    uint32_t ticket = 0;
    int64_t n;
    if (RESTORE) {
        n = restore_rows(a, &s_ret, &ticket);
    } else {
        block_plan(a, &s_plan);
        if (threadIdx.x == 0) ticket = count_reader(&a.hs->done_blocks);
        n = s_plan.n;
    }
    char* rows = RESTORE ? a.dst : (char*)a.src;
    const int lane = threadIdx.x % kWarpThreads;
    const int64_t nb = mst_fp8_blocks(a.width), units = n * nb;
    const int64_t n_warps = (int64_t)pt.nb * (blockDim.x / kWarpThreads);
    for (int64_t u0 = (int64_t)pt.bid * (blockDim.x / kWarpThreads) + threadIdx.x / kWarpThreads; u0 < units;
         u0 += kBlocks * n_warps) { /* warp-uniform: u0 is the warp's */
        fp8_unit o[kBlocks];
        uint2 v[kBlocks];
        uint32_t w[kBlocks];
        float s[kBlocks];
#pragma unroll
        for (int b = 0; b < kBlocks; b++) {
            const int64_t u = u0 + b * n_warps;
            if (u >= units) continue;
            o[b] = unit_at<RESTORE>(a, &s_plan, rows, u, nb);
            const bool mine = lane * 4 < o[b].len;
            if (RESTORE) w[b] = mine ? *(const uint32_t*)(o[b].q + lane * 4) : 0u, s[b] = *o[b].scale;
            else v[b] = mine ? *(const uint2*)(o[b].x + lane * 4) : make_uint2(0u, 0u);
        }
#pragma unroll
        for (int b = 0; b < kBlocks; b++) {
            if (u0 + b * n_warps >= units) continue;
            if (RESTORE) restore_block(o[b], w[b], s[b], lane);
            else save_block(a, o[b], v[b], lane);
        }
    }
    table_share<RESTORE>(a, &s_plan, &s_ret, pt);
    copy_end<RESTORE>(a, &s_plan, rows, 0, 0, ticket, pt);
}

/* The persistent grid for the handle's most blocks: per_sm blocks per SM
 * of the copy (kHostGrid for host pages only), fewer for small handles. */
unsigned fp8_grid(mst_ctx_t* ctx, const mst_stash_args* a, bool restore) {
    const int64_t units = a->max_pages * a->page_rows * mst_fp8_blocks(a->width);
    const int64_t warps = kThreads / kWarpThreads, want = (units + warps * kBlocks - 1) / (warps * kBlocks);
    int64_t cap = (int64_t)copy_sms(ctx, a) * per_sm(restore);
    if (a->cap[MST_BLK_DEV] == 0 && cap > kHostGrid) cap = kHostGrid;
    return (unsigned)(want < 1 ? 1 : want < cap ? want : cap);
}

} // namespace

extern "C" mst_status mst_cuda_stash_fp8(mst_ctx_t* ctx, const mst_stash_args* a, int restore) {
    const char* rows = restore ? a->dst : a->src;
    if ((uintptr_t)rows % 8 != 0)
        return mst_set_error(MST_ERR_INVALID, "fp8 pages: the rows at %p are not 8-byte aligned", (const void*)rows);
    if (restore) fp8_kernel<true><<<fp8_grid(ctx, a, true), kThreads, 0, mst_cuda(ctx)->stream>>>(*a);
    else fp8_kernel<false><<<fp8_grid(ctx, a, false), kThreads, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}
