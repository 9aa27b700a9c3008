/*
 * model_ops_rows.cu — token rows <-> grouped rows on CUDA (dispatch and
 * combine; the CPU reference is in model_ops_route.c): a warp per row,
 * 16-byte loads and stores when the rows allow (H % 8 == 0, aligned
 * buffers), else one value a lane.
 *   rows_gather: dst[pos[t][s]] = src[t] (a warp per entry (t, s));
 *   rows_sum: dst[t] = sum over s of src[pos[t][s]] in slot order, fp32,
 *     one rounding (a warp per token, the k rows loaded before the adds).
 */
#include "model_ops.cuh"

enum { ROWS_WARPS = 8, ROWS_SLOTS = 8 };

template <int VEC>
__global__ void rows_gather_kernel(mst_rows_args a) {
    const int64_t entry = (int64_t)blockIdx.x * ROWS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (entry >= a.n_tok * a.top_k) return;
    const int32_t r = a.pos[entry];
    if (r < 0) return;
    const int64_t H = a.cols;
    const uint16_t* src = a.src + (entry / a.top_k) * H; /* [H] token row  */
    uint16_t* dst = a.dst + (int64_t)r * H;                /* [H] grouped row */
#pragma unroll 4
    for (int64_t c = (int64_t)lane * VEC; c < H; c += 32 * VEC) {
        if constexpr (VEC == 8) *(uint4*)(dst + c) = *(const uint4*)(src + c);
        else dst[c] = src[c];
    }
    if (a.dst_p && lane == 0) a.dst_p[r] = a.src_p[entry];
}

template <int VEC>
__global__ void rows_sum_kernel(mst_rows_args a) {
    const int64_t t = (int64_t)blockIdx.x * ROWS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= a.n_tok) return;
    const int32_t K = a.top_k;
    const int64_t H = a.cols;
    const int32_t* pos = a.pos + t * K; /* [K] grouped rows of token t */
    for (int64_t c = (int64_t)lane * VEC; c < H; c += 32 * VEC) {
        float acc[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++) acc[k] = 0.0f;
        for (int32_t s0 = 0; s0 < K; s0 += ROWS_SLOTS) {
            bf_raw<VEC> raw[ROWS_SLOTS] = {};
            int32_t row[ROWS_SLOTS];
#pragma unroll
            for (int u = 0; u < ROWS_SLOTS; u++) {
                row[u] = s0 + u < K ? pos[s0 + u] : -1;
                if (row[u] >= 0) raw[u] = bf_load<VEC>(a.src + (int64_t)row[u] * H + c);
            }
#pragma unroll
            for (int u = 0; u < ROWS_SLOTS; u++)
                if (row[u] >= 0) bf_add<VEC>(acc, raw[u]); /* slot order; skipped slots add nothing */
        }
        bf_store<VEC>(a.dst + t * H + c, acc);
    }
    if (a.dst_p)
        for (int32_t s = lane; s < K; s += 32) a.dst_p[t * K + s] = pos[s] >= 0 ? a.src_p[pos[s]] : 0.0f;
}

/* 8 when both row buffers take 16-byte vectors of every row, else 1. */
static int rows_vec(const mst_rows_args* a) {
    return a->cols % 8 == 0 && mst_aligned(a->src, 16) && mst_aligned(a->dst, 16) ? 8 : 1;
}

extern "C" mst_status mst_cuda_rows_gather(mst_ctx_t* ctx, const mst_rows_args* a) {
    const int64_t NK = a->n_tok * a->top_k;
    if (NK == 0) return MST_OK;
    const unsigned grid = mst_blocks(NK, ROWS_WARPS);
    cudaStream_t s = mst_cuda(ctx)->stream;
    if (rows_vec(a) == 8) rows_gather_kernel<8><<<grid, ROWS_WARPS * 32, 0, s>>>(*a);
    else rows_gather_kernel<1><<<grid, ROWS_WARPS * 32, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_rows_sum(mst_ctx_t* ctx, const mst_rows_args* a) {
    if (a->n_tok == 0) return MST_OK;
    const unsigned grid = mst_blocks(a->n_tok, ROWS_WARPS);
    cudaStream_t s = mst_cuda(ctx)->stream;
    if (rows_vec(a) == 8) rows_sum_kernel<8><<<grid, ROWS_WARPS * 32, 0, s>>>(*a);
    else rows_sum_kernel<1><<<grid, ROWS_WARPS * 32, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}
