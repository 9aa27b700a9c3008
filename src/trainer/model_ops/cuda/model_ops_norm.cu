/*
 * model_ops_norm.cu — RMSNorm forward / backward and the residual add on
 * CUDA (the CPU references are in model_ops.c). A warp per row; lane l
 * takes the 8-column pieces l, l + 32, ... of its row (model_ops.cuh:
 * 16-byte loads and stores when H % 8 == 0 and the buffers are aligned,
 * else one value a load, the same sums either way), its sums in that
 * order, then a fixed xor tree over the lanes.
 * The weight gradient: DW_PARTS chunks of consecutive rows, each chunk's
 * column sums in row order into the ws_norm workspace, then the chunks
 * added in chunk order and once into dw (no atomics: the same bits on
 * every run).
 */
#include "model_ops.cuh"

enum { NORM_WARPS = 8, DW_PARTS = 128, DW_THREADS = 128 };

__device__ __forceinline__ float warp_sum_xor(float v) {
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

template <int VEC>
__global__ void norm_forward_kernel(mst_norm_args a) {
    const int64_t r = (int64_t)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= a.rows) return;
    const int64_t H = a.cols;
    const uint16_t* x = a.x + r * H; /* [H] */
    float ss = 0.0f;
#pragma unroll 4
    for (int64_t c = (int64_t)lane * MST_PIECE; c < H; c += 32 * MST_PIECE) {
        float f[MST_PIECE];
        const int m = piece_load<VEC>(x, c, H, f);
#pragma unroll
        for (int k = 0; k < MST_PIECE; k++)
            if (k < m) ss += f[k] * f[k];
    }
    ss = warp_sum_xor(ss);
    const float rs = rsqrtf(ss / (float)H + a.eps);
    if (lane == 0) a.rstd[r] = rs;
#pragma unroll 4
    for (int64_t c = (int64_t)lane * MST_PIECE; c < H; c += 32 * MST_PIECE) {
        float f[MST_PIECE], w[MST_PIECE];
        piece_load<VEC>(x, c, H, f);
        piece_load<VEC>(a.w, c, H, w);
#pragma unroll
        for (int k = 0; k < MST_PIECE; k++) f[k] = f[k] * rs * w[k];
        piece_store<VEC>(a.y + r * H, c, H, f);
    }
}

/* dx = rstd (dy w) - x rstd^3 / H * sum(dy w x). */
template <int VEC>
__global__ void norm_dx_kernel(mst_norm_args a) {
    const int64_t r = (int64_t)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= a.rows) return;
    const int64_t H = a.cols;
    const uint16_t *x = a.x + r * H, *dy = a.dy + r * H; /* [H], [H] */
    const float rs = a.rstd[r];
    float dot = 0.0f;
#pragma unroll 4
    for (int64_t c = (int64_t)lane * MST_PIECE; c < H; c += 32 * MST_PIECE) {
        float fx[MST_PIECE], fd[MST_PIECE], w[MST_PIECE];
        const int m = piece_load<VEC>(x, c, H, fx);
        piece_load<VEC>(dy, c, H, fd);
        piece_load<VEC>(a.w, c, H, w);
#pragma unroll
        for (int k = 0; k < MST_PIECE; k++)
            if (k < m) dot += fd[k] * w[k] * fx[k];
    }
    dot = warp_sum_xor(dot);
    const float k3 = dot * rs * rs * rs / (float)H;
#pragma unroll 4
    for (int64_t c = (int64_t)lane * MST_PIECE; c < H; c += 32 * MST_PIECE) {
        float fx[MST_PIECE], fd[MST_PIECE], w[MST_PIECE];
        piece_load<VEC>(x, c, H, fx);
        piece_load<VEC>(dy, c, H, fd);
        piece_load<VEC>(a.w, c, H, w);
#pragma unroll
        for (int k = 0; k < MST_PIECE; k++) fx[k] = rs * fd[k] * w[k] - fx[k] * k3;
        piece_store<VEC>(a.dx + r * H, c, H, fx);
    }
}

/* partial [parts, H]: row p = the column sums of dy x rstd over the rows
 * [p chunk, (p + 1) chunk), in row order. Block (y: chunk, x: DW_THREADS
 * threads of VEC columns). */
template <int VEC>
__global__ void norm_dw_part_kernel(mst_norm_args a, int64_t chunk, float* partial) {
    const int64_t H = a.cols, c = ((int64_t)blockIdx.x * DW_THREADS + threadIdx.x) * VEC;
    if (c >= H) return;
    const int64_t r0 = (int64_t)blockIdx.y * chunk, r1 = min(r0 + chunk, a.rows);
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) acc[k] = 0.0f;
#pragma unroll 8
    for (int64_t r = r0; r < r1; r++) {
        float fx[VEC], fd[VEC];
        bf_unpack<VEC>(bf_load<VEC>(a.x + r * H + c), fx);
        bf_unpack<VEC>(bf_load<VEC>(a.dy + r * H + c), fd);
        const float rs = a.rstd[r];
#pragma unroll
        for (int k = 0; k < VEC; k++) acc[k] += fd[k] * fx[k] * rs;
    }
    float* out = partial + (int64_t)blockIdx.y * H + c;
#pragma unroll
    for (int k = 0; k < VEC; k++) out[k] = acc[k];
}

/* dw [H] += the parts' sums, in part order (SUM_AHEAD loads in flight
 * before their adds). */
enum { SUM_AHEAD = 8 };

__global__ void norm_dw_sum_kernel(mst_norm_args a, int64_t parts, const float* partial) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= a.cols) return;
    float s = 0.0f;
    int64_t p = 0;
    for (; p + SUM_AHEAD <= parts; p += SUM_AHEAD) {
        float v[SUM_AHEAD];
#pragma unroll
        for (int u = 0; u < SUM_AHEAD; u++) v[u] = partial[(p + u) * a.cols + c];
#pragma unroll
        for (int u = 0; u < SUM_AHEAD; u++) s += v[u];
    }
    for (; p < parts; p++) s += partial[p * a.cols + c];
    a.dw[c] += s;
}

/* 8 when every row of x, dy, dx / y and w take 16-byte vectors, else 1. */
static int norm_vec(const mst_norm_args* a, int backward) {
    const void* out = backward ? (const void*)a->dx : (const void*)a->y;
    const int ok = a->cols % 8 == 0 && mst_aligned(a->x, 16) && mst_aligned(a->w, 16) && mst_aligned(out, 16);
    return ok && (!backward || mst_aligned(a->dy, 16)) ? 8 : 1;
}

extern "C" mst_status mst_cuda_norm_forward(mst_ctx_t* ctx, const mst_norm_args* a) {
    if (a->rows == 0) return MST_OK;
    const unsigned grid = mst_blocks(a->rows, NORM_WARPS);
    cudaStream_t s = mst_cuda(ctx)->stream;
    if (norm_vec(a, 0) == 8) norm_forward_kernel<8><<<grid, NORM_WARPS * 32, 0, s>>>(*a);
    else norm_forward_kernel<1><<<grid, NORM_WARPS * 32, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_norm_backward(mst_ctx_t* ctx, const mst_norm_args* a) {
    if (a->rows == 0) return MST_OK;
    mst_cuda_impl* c = mst_cuda(ctx);
    const int vec = norm_vec(a, 1);
    const unsigned grid = mst_blocks(a->rows, NORM_WARPS);
    if (vec == 8) norm_dx_kernel<8><<<grid, NORM_WARPS * 32, 0, c->stream>>>(*a);
    else norm_dx_kernel<1><<<grid, NORM_WARPS * 32, 0, c->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    const int64_t parts = a->rows < (int64_t)DW_PARTS ? a->rows : (int64_t)DW_PARTS, chunk = (a->rows + parts - 1) / parts;
    const int64_t n_parts = (a->rows + chunk - 1) / chunk; /* the chunks that hold rows */
    float* partial = NULL;
    MST_TRY(mst_workspace(ctx, &c->ws_norm, (size_t)(DW_PARTS * a->cols) * sizeof(float), (void**)&partial));
    const dim3 part_grid(mst_blocks(a->cols, DW_THREADS * vec), (unsigned)n_parts);
    if (vec == 8) norm_dw_part_kernel<8><<<part_grid, DW_THREADS, 0, c->stream>>>(*a, chunk, partial);
    else norm_dw_part_kernel<1><<<part_grid, DW_THREADS, 0, c->stream>>>(*a, chunk, partial);
    MST_CUDA_LAUNCHED();
    norm_dw_sum_kernel<<<mst_blocks(a->cols, 64), 64, 0, c->stream>>>(*a, n_parts, partial);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* ---- elementwise: VEC values a thread ------------------------------------- */

template <int VEC>
__global__ void add_kernel(mst_add_args a) {
    const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= a.n) return;
    float fa[VEC], fb[VEC];
    bf_unpack<VEC>(bf_load<VEC>(a.a + i), fa);
    bf_unpack<VEC>(bf_load<VEC>(a.b + i), fb);
#pragma unroll
    for (int k = 0; k < VEC; k++) fa[k] += fb[k];
    bf_store<VEC>(a.y + i, fa);
}

extern "C" mst_status mst_cuda_add(mst_ctx_t* ctx, const mst_add_args* a) {
    if (a->n == 0) return MST_OK;
    cudaStream_t s = mst_cuda(ctx)->stream;
    if (a->n % 8 == 0 && mst_aligned(a->a, 16) && mst_aligned(a->b, 16) && mst_aligned(a->y, 16))
        add_kernel<8><<<mst_blocks(a->n / 8, 256), 256, 0, s>>>(*a);
    else
        add_kernel<1><<<mst_blocks(a->n, 256), 256, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}
