/*
 * model_ops_route.cu — the MoE router and the token <-> grouped-rows moves on
 * CUDA (the CPU reference is model_ops_route.c). Counts stay on the device:
 *   route_token_kernel: softmax over experts, top-k and its renormalisation
 *     (route_math.h, shared with the CPU), one thread per token;
 *   route_plan_kernel (one block): per-expert loads counted in entry order
 *     from shared-memory tiles of the top-k ids (a warp per expert, 32
 *     entries a ballot), per-group totals, the over-budget flag and peak
 *     rows, each entry's row (groups packed in order; expert, then token,
 *     then slot order within). Deterministic: each expert's warp walks the
 *     entries in order; no atomics but the flag's atomicOr.
 *   route_peak_kernel (one thread): peak rows from loads summed over the
 *     ranks (the trainer on W ranks);
 *   route_balance_kernel (one block): this layer's share of the
 *     load-balancing loss; route_backward_kernel: d(router logits), one
 *     thread per token. Both take the loss's per-expert factor
 *     lb[e] = coef E L_e / rows^2 from balance_lb (the layers' loads summed
 *     in layer order, the same fp32 operations as the CPU's: the same bits).
 *   rows gather / sum: dispatch and combine, one thread per element.
 */
#include "trainer/model_ops/route_math.h"
#include "model_ops.cuh"

enum { PLAN_THREADS = 1024, PLAN_TILE = 4096, MAX_EXPERTS = 1024 };

__global__ void route_token_kernel(mst_route_args a) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < a.n_tok) mst_route_token(&a, t);
}

/* Walks the N k entries in tiles; warp w takes experts w, w + warps, ...
 * and visits each one's entries in entry order, 32 at a time: a ballot of
 * the lanes whose entry chose the expert, each such entry's place among
 * them by popc (the places one thread walking the entries would give).
 * assign = 0: count; 1: write rows (none, -1, for an over-budget group). */
__device__ void plan_walk(const mst_route_args& a, int32_t* tile, int32_t* next, int32_t* load, int assign) {
    const int64_t NK = a.n_tok * a.top_k;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int64_t base = 0; base < NK; base += PLAN_TILE) {
        const int64_t n = min((int64_t)PLAN_TILE, NK - base);
        __syncthreads();
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) tile[i] = a.topk_idx[base + i];
        __syncthreads();
        for (int32_t e = warp; e < a.n_experts; e += n_warps) {
            int32_t c = assign ? next[e] : load[e];
            for (int64_t i0 = 0; i0 < n; i0 += 32) {
                const int64_t i = i0 + lane;
                const int hit = i < n && tile[i] == e;
                const unsigned mask = __ballot_sync(0xffffffffu, hit);
                if (assign && hit) a.pos[base + i] = c < 0 ? -1 : c + __popc(mask & ((1u << lane) - 1u));
                if (!assign || c >= 0) c += __popc(mask);
            }
            __syncwarp();
            if (lane == 0) {
                if (assign) next[e] = c;
                else load[e] = c;
            }
        }
    }
}

__global__ void route_plan_kernel(mst_route_args a) {
    __shared__ int32_t tile[PLAN_TILE];
    __shared__ int32_t load[MAX_EXPERTS], next[MAX_EXPERTS];
    const int32_t E = a.n_experts, G = a.n_groups, EG = E / G;
    const int64_t R = a.max_rows;
    for (int32_t e = threadIdx.x; e < E; e += blockDim.x) load[e] = 0;
    plan_walk(a, tile, next, load, 0);
    __syncthreads();
    if (threadIdx.x == 0) { /* groups packed in order: a few hundred adds at most */
        int64_t base = 0;
        for (int32_t g = 0; g < G; g++) {
            int64_t total = 0;
            for (int32_t e = g * EG; e < (g + 1) * EG; e++) total += load[e];
            const int over = total > R;
            if (over) mst_dev_flag(a.flag, MST_FLAG_COUNTS);
            if (a.peak_rows && total > a.peak_rows[g]) a.peak_rows[g] = (int32_t)total;
            for (int32_t e = g * EG; e < (g + 1) * EG; e++) {
                a.counts[e] = over ? 0 : load[e];
                a.load[e] = load[e];
                next[e] = over ? -1 : (int32_t)base;
                base += over ? 0 : load[e];
            }
        }
    }
    plan_walk(a, tile, next, load, 1);
}

/* Peak rows per group from the (summed) loads: one thread. */
__global__ void route_peak_kernel(mst_route_args a) {
    const int32_t EG = a.n_experts / a.n_groups;
    for (int32_t g = 0; g < a.n_groups; g++) {
        int64_t total = 0;
        for (int32_t e = g * EG; e < (g + 1) * EG; e++) total += a.load[e];
        if (total > a.peak_rows[g]) a.peak_rows[g] = (int32_t)total;
    }
}

extern "C" mst_status mst_cuda_route_peak(mst_ctx_t* ctx, const mst_route_args* a) {
    if (!a->peak_rows) return MST_OK;
    route_peak_kernel<<<1, 1, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_route_forward(mst_ctx_t* ctx, const mst_route_args* a) {
    if (a->n_experts > MAX_EXPERTS)
        return mst_set_error(MST_ERR_INVALID, "router: %d experts, at most %d", a->n_experts, (int)MAX_EXPERTS);
    cudaStream_t s = mst_cuda(ctx)->stream;
    route_token_kernel<<<mst_blocks(a->n_tok, 128), 128, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    route_plan_kernel<<<1, PLAN_THREADS, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* lb [E] (shared) = coef E (L_e / rows) / rows, L_e the loads of expert e
 * summed over the n_layers layers in layer order, rows = n_layers N W (the
 * CPU's expression, operation for operation). By the whole block. */
__device__ void balance_lb(const mst_route_args& a, float* lb) {
    const int32_t E = a.n_experts;
    const float rows = (float)a.n_layers * (float)a.n_tok * (float)(a.world > 1 ? a.world : 1);
    for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
        int64_t L = 0;
        for (int32_t l = 0; l < a.n_layers; l++) L += a.loads[(int64_t)l * E + e];
        lb[e] = a.aux_coef * (float)E * ((float)L / rows) / rows;
    }
    __syncthreads();
}

/* aux_loss = sum_e lb[e] P_e, P_e = sum_t probs[t][e]: over tokens in
 * S = blockDim / E interleaved slices (each in token order), the slices in
 * order, then the experts in order. One block. */
__global__ void route_balance_kernel(mst_route_args a) {
    __shared__ float part[PLAN_THREADS], lb[MAX_EXPERTS];
    const int32_t E = a.n_experts, S = max(1, (int32_t)blockDim.x / E);
    balance_lb(a, lb);
    if ((int32_t)threadIdx.x < S * E) {
        const int32_t e = threadIdx.x % E, sl = threadIdx.x / E;
        float s = 0.0f;
        for (int64_t t = sl; t < a.n_tok; t += S) s += a.probs[t * E + e];
        part[threadIdx.x] = s;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    float aux = 0.0f;
    for (int32_t e = 0; e < E; e++) {
        float pe = 0.0f;
        for (int32_t sl = 0; sl < S; sl++) pe += part[sl * E + e];
        aux += lb[e] * pe;
    }
    *a.aux_loss = aux;
}

/* Token t: dp[e] = grad_scale lb[e] + the top-k term of e when a slot s
 * chose it: dw_s, or through the renormalisation w_s = p_s / S
 * (S = sum of the chosen probs), (dw_s - sum_u dw_u w_u) / S; then
 * dlogits = p (dp - sum_j p_j dp_j). Slots choose distinct experts: one
 * addition per expert, in the CPU's order. */
__global__ void route_backward_kernel(mst_route_args a) {
    __shared__ float lb[MAX_EXPERTS];
    balance_lb(a, lb);
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= a.n_tok) return;
    const int32_t E = a.n_experts, K = a.top_k;
    const float* p = a.probs + t * E;
    const int32_t* idx = a.topk_idx + t * K;
    const float *w = a.topk_w + t * K, *dw = a.dtopk_w + t * K;
    float chosen = 0.0f, dot_w = 0.0f;
    for (int32_t s = 0; s < K; s++) chosen += p[idx[s]], dot_w += dw[s] * w[s];
    float dot = 0.0f;
    for (int pass = 0; pass < 2; pass++)
        for (int32_t e = 0; e < E; e++) {
            float dp = a.grad_scale * lb[e];
            for (int32_t s = 0; s < K; s++)
                if (idx[s] == e) dp += a.norm_topk ? (dw[s] - dot_w) / chosen : dw[s];
            if (pass == 0) dot += p[e] * dp;
            else a.dlogits[t * E + e] = mst_to_bf(p[e] * (dp - dot));
        }
}

extern "C" mst_status mst_cuda_route_backward(mst_ctx_t* ctx, const mst_route_args* a) {
    if (a->n_experts > MAX_EXPERTS)
        return mst_set_error(MST_ERR_INVALID, "router: %d experts, at most %d", a->n_experts, (int)MAX_EXPERTS);
    if (a->n_layers < 1 || !a->loads)
        return mst_set_error(MST_ERR_INVALID, "route backward: n_layers %d, loads %p", a->n_layers,
                             (const void*)a->loads);
    cudaStream_t s = mst_cuda(ctx)->stream;
    route_balance_kernel<<<1, PLAN_THREADS, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    route_backward_kernel<<<mst_blocks(a->n_tok, 128), 128, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

__global__ void rows_gather_kernel(mst_rows_args a) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n_tok * a.top_k * a.cols) return;
    const int64_t entry = i / a.cols, c = i % a.cols;
    const int32_t r = a.pos[entry];
    if (r < 0) return;
    a.dst[(int64_t)r * a.cols + c] = a.src[(entry / a.top_k) * a.cols + c];
    if (a.dst_p && c == 0) a.dst_p[r] = a.src_p[entry];
}

__global__ void rows_sum_kernel(mst_rows_args a) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n_tok * a.cols) return;
    const int64_t t = i / a.cols, c = i % a.cols;
    float acc = 0.0f;
    for (int32_t s = 0; s < a.top_k; s++) {
        const int32_t r = a.pos[t * a.top_k + s];
        if (r >= 0) acc += mst_bf(a.src[(int64_t)r * a.cols + c]);
        if (a.dst_p && c == 0) a.dst_p[t * a.top_k + s] = r >= 0 ? a.src_p[r] : 0.0f;
    }
    a.dst[i] = mst_to_bf(acc);
}

extern "C" mst_status mst_cuda_rows_gather(mst_ctx_t* ctx, const mst_rows_args* a) {
    rows_gather_kernel<<<mst_blocks(a->n_tok * a->top_k * a->cols, 256), 256, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_rows_sum(mst_ctx_t* ctx, const mst_rows_args* a) {
    rows_sum_kernel<<<mst_blocks(a->n_tok * a->cols, 256), 256, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}
