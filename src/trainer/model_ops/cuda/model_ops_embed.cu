/*
 * model_ops_embed.cu — the token embedding on CUDA (the CPU reference is in
 * model_ops.c): the gather of table rows, and its backward, the scatter-add
 * of the rows' gradients into the table, each vocabulary entry's sum in
 * token order (tokens ordered by (id, token) first: no floating-point
 * atomics, the same bits on every run).
 */
#include "model_ops.cuh"

/* x[t] = table[tokens[t]]: one block per (token, 256 x VEC columns). */
template <int VEC>
__global__ void embed_forward_kernel(mst_embed_args a) {
    const int64_t t = blockIdx.x, c = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (c >= a.cols) return;
    const uint16_t* src = a.table + (int64_t)a.tokens[t] * a.cols + c;
    uint16_t* dst = a.x + t * a.cols + c;
    if constexpr (VEC == 8) *(uint4*)dst = *(const uint4*)src;
    else *dst = *src;
}

/* Backward in three steps, none of them walking the vocabulary (Qwen3's is
 * 151 936 entries; a call touches only the ids of its N tokens):
 *   rank:  each token's place in the (id, token) order, the number of
 *          tokens u with tokens[u] < tokens[t], or equal and u < t: blocks
 *          of EMB_RANK_THREADS tokens x spans of EMB_RANK_SPAN tokens u,
 *          each adding its count (an exact int atomic: any order, the same
 *          sum); O(N^2) compares, 4 M at N = 2048;
 *   place: list[rank[t]] = t, ids[rank[t]] = tokens[t];
 *   sum:   one block per (place i, EMB_SUM_THREADS x VEC columns); the
 *          first place of each id's run sums dx over the run (token order)
 *          from 0 in fp32 and adds the sum to dtable[id]. VEC = 8: 16-byte
 *          loads of dx, EMB_UNROLL rows in flight before their adds.
 * Scratch order [3 N]: rank [N], list [N], ids [N]. */
enum { EMB_RANK_THREADS = 128, EMB_RANK_SPAN = 512, EMB_SUM_THREADS = 32, EMB_UNROLL = 16 };

__global__ void embed_rank_kernel(mst_embed_args a) {
    __shared__ int32_t span[EMB_RANK_SPAN];
    const int32_t N = (int32_t)a.n_tok, u0 = (int32_t)blockIdx.y * EMB_RANK_SPAN;
    const int32_t n = min((int32_t)EMB_RANK_SPAN, N - u0);
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) span[i] = a.tokens[u0 + i];
    __syncthreads();
    const int32_t t = (int32_t)(blockIdx.x * blockDim.x + threadIdx.x);
    if (t >= N) return;
    const int32_t v = a.tokens[t];
    int32_t before = 0;
    for (int32_t i = 0; i < n; i++) before += span[i] < v || (span[i] == v && u0 + i < t);
    if (before) atomicAdd(&a.order[t], before);
}

__global__ void embed_place_kernel(mst_embed_args a) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= a.n_tok) return;
    const int32_t r = a.order[t];
    a.order[a.n_tok + r] = (int32_t)t;
    a.order[2 * a.n_tok + r] = a.tokens[t];
}

template <int VEC>
__global__ void embed_sum_kernel(mst_embed_args a) {
    const int32_t N = (int32_t)a.n_tok, i = (int32_t)blockIdx.x;
    const int32_t *list = a.order + N, *ids = a.order + 2 * (int64_t)N;
    const int32_t v = ids[i];
    if (i > 0 && ids[i - 1] == v) return; /* not the first place of its id */
    const int64_t H = a.cols, c = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (c >= H) return;
    int32_t e = i + 1;
    while (e < N && ids[e] == v) e++;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) acc[k] = 0.0f;
    int32_t j = i;
    for (; j + EMB_UNROLL <= e; j += EMB_UNROLL) {
        bf_raw<VEC> r[EMB_UNROLL];
#pragma unroll
        for (int u = 0; u < EMB_UNROLL; u++) r[u] = bf_load<VEC>(a.dx + (int64_t)list[j + u] * H + c);
#pragma unroll
        for (int u = 0; u < EMB_UNROLL; u++) bf_add<VEC>(acc, r[u]);
    }
    for (; j < e; j++) bf_add<VEC>(acc, bf_load<VEC>(a.dx + (int64_t)list[j] * H + c));
    float* d = a.dtable + (int64_t)v * H + c;
#pragma unroll
    for (int k = 0; k < VEC; k++) d[k] += acc[k];
}

extern "C" mst_status mst_cuda_embed_forward(mst_ctx_t* ctx, const mst_embed_args* a) {
    if (a->n_tok == 0) return MST_OK;
    const int vec = a->cols % 8 == 0 && mst_aligned(a->table, 16) && mst_aligned(a->x, 16) ? 8 : 1;
    const dim3 grid((unsigned)a->n_tok, mst_blocks(a->cols, 256 * vec));
    if (vec == 8) embed_forward_kernel<8><<<grid, 256, 0, mst_cuda(ctx)->stream>>>(*a);
    else embed_forward_kernel<1><<<grid, 256, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_embed_backward(mst_ctx_t* ctx, const mst_embed_args* a) {
    const int64_t N = a->n_tok;
    if (N == 0) return MST_OK;
    if (N > INT32_MAX || (N + EMB_RANK_SPAN - 1) / EMB_RANK_SPAN > 65535)
        return mst_set_error(MST_ERR_INVALID, "embedding backward: %lld tokens, at most %d", (long long)N,
                             65535 * EMB_RANK_SPAN);
    const int vec = a->cols % 8 == 0 && mst_aligned(a->dx, 16) && mst_aligned(a->dtable, 16) ? 8 : 1;
    const int64_t col_blocks = (a->cols + EMB_SUM_THREADS * vec - 1) / (EMB_SUM_THREADS * vec);
    if (col_blocks > 65535)
        return mst_set_error(MST_ERR_INVALID, "embedding backward: %lld columns", (long long)a->cols);
    cudaStream_t s = mst_cuda(ctx)->stream;
    MST_CUDA_TRY(cudaMemsetAsync(a->order, 0, sizeof(int32_t) * (size_t)N, s));
    const dim3 rank_grid(mst_blocks(N, EMB_RANK_THREADS), mst_blocks(N, EMB_RANK_SPAN));
    embed_rank_kernel<<<rank_grid, EMB_RANK_THREADS, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    embed_place_kernel<<<mst_blocks(N, 256), 256, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    const dim3 sum_grid((unsigned)N, (unsigned)col_blocks);
    if (vec == 8) embed_sum_kernel<8><<<sum_grid, EMB_SUM_THREADS, 0, s>>>(*a);
    else embed_sum_kernel<1><<<sum_grid, EMB_SUM_THREADS, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

