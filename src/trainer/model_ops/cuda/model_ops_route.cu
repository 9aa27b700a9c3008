/*
 * model_ops_route.cu — the MoE router on CUDA (the CPU reference is
 * model_ops_route.c). Counts stay on the device:
 *   route_token_kernel: softmax over experts, top-k and its renormalisation,
 *     a warp per token, the fp32 operations of route_math.h (the CPU's);
 *   route_plan_kernel: per-expert loads, per-group totals, the over-budget
 *     flag and peak rows, each entry's row (groups packed in order; expert,
 *     then token, then slot order within): chunks of the entries over up to
 *     PLAN_MAX_BLOCKS blocks, integer counts only (deterministic: the rows
 *     a thread walking the entries in order would give; no atomics but
 *     integer ones and the flag's atomicOr);
 *   route_peak_kernel (one thread): peak rows from loads summed over the
 *     ranks (the trainer on W ranks);
 *   route_balance_kernel (one block): this layer's share of the
 *     load-balancing loss; route_backward_kernel: d(router logits), a warp
 *     per token. Both take the loss's per-expert factor
 *     lb[e] = coef E L_e / rows^2 from balance_lb (the layers' loads summed
 *     in layer order, the same fp32 operations as the CPU's: the same bits).
 */
#include "model_ops.cuh"

enum { PLAN_THREADS = 1024, PLAN_MAX_BLOCKS = 64, MAX_EXPERTS = 1024, TOK_WARPS = 4 };

/* Max and argmax over the warp, every lane gets lane 0's result. */
__device__ __forceinline__ float warp_max(float v) {
    for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
    return __shfl_sync(0xffffffffu, v, 0);
}

/* The best (value, expert) of the warp: the larger value, of equal values
 * the lower expert; e < 0: none. */
__device__ __forceinline__ void warp_best(float& v, int32_t& e) {
    for (int d = 16; d > 0; d >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, d);
        const int32_t oe = __shfl_xor_sync(0xffffffffu, e, d);
        if (oe >= 0 && (e < 0 || ov > v || (ov == v && oe < e))) v = ov, e = oe;
    }
    v = __shfl_sync(0xffffffffu, v, 0);
    e = __shfl_sync(0xffffffffu, e, 0);
}

/* mst_route_token (route_math.h) with a warp per token, the same fp32
 * operations: lane l takes experts l, l + 32, ...; the max (any order
 * gives its bits), expf per expert, their sum in expert order (lane 0, from
 * shared memory), the probabilities; slot s: each lane's best not-taken
 * expert, then the warp's (larger probability, ties to the lower id: the
 * sequential scan's choice); the chosen sum in slot order (lane 0). */
__global__ void route_token_kernel(mst_route_args a) {
    __shared__ float prob[TOK_WARPS][MAX_EXPERTS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * TOK_WARPS + w;
    if (t >= a.n_tok) return; /* the whole warp */
    const int32_t E = a.n_experts, K = a.top_k;
    const float* l = a.logits + t * E;
    float* p = prob[w];
    float mx = -INFINITY;
    for (int32_t e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    for (int32_t e = lane; e < E; e += 32) p[e] = expf(l[e] - mx);
    __syncwarp();
    float sum = 0.0f;
    if (lane == 0)
        for (int32_t e = 0; e < E; e++) sum += p[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int32_t e = lane; e < E; e += 32) a.probs[t * E + e] = p[e] = p[e] / sum;
    __syncwarp();
    uint32_t taken = 0; /* bit j: expert lane + 32 j */
    float chosen = 0.0f;
    for (int32_t s = 0; s < K; s++) {
        float bv = 0.0f;
        int32_t be = -1;
        for (int32_t e = lane, j = 0; e < E; e += 32, j++)
            if (!(taken >> j & 1u) && (be < 0 || p[e] > bv)) bv = p[e], be = e;
        warp_best(bv, be);
        if (be >= 0 && (be & 31) == lane) taken |= 1u << (be >> 5);
        if (lane == 0) {
            a.topk_idx[t * K + s] = be;
            a.topk_w[t * K + s] = bv;
            chosen += bv;
        }
    }
    if (!a.norm_topk) return;
    chosen = __shfl_sync(0xffffffffu, chosen, 0);
    __syncwarp(); /* lane 0's weights are visible to the warp */
    for (int32_t s = lane; s < K; s += 32) a.topk_w[t * K + s] /= chosen;
}

/* Exclusive prefix sum over the block of one value a thread, in thread
 * order (integers: exact); *total gets the sum. shm: [32]. */
__device__ int32_t block_scan(int32_t v, int32_t* shm, int32_t* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    int32_t x = v;
    for (int d = 1; d < 32; d <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    __syncthreads();
    if (lane == 31) shm[warp] = x;
    __syncthreads();
    int32_t before = 0, all = 0;
    for (int i = 0; i < n_warps; i++) {
        before += i < warp ? shm[i] : 0;
        all += shm[i];
    }
    *total = all;
    return before + x - v;
}

/* Block b places the entries [b chunk, (b + 1) chunk) of the N k. Every
 * block counts the loads of all entries (integer counts in shared memory,
 * warp-aggregated), those before its chunk apart; a row is then the base
 * of its expert (groups packed in order, an over-budget group's -1) + the
 * expert's entries before the chunk + its place in the chunk: the chunk's
 * warps in turn, 32 entries a step, the place among the equal experts of
 * a step by match_any and popc (the place one thread walking the entries
 * in order gives). Block 0 writes counts, load, peak rows and the flag. */
__global__ void route_plan_kernel(mst_route_args a, int64_t chunk) {
    __shared__ int32_t total[MAX_EXPERTS], next[MAX_EXPERTS], shm[32];
    const int32_t E = a.n_experts, EG = E / a.n_groups;
    const int64_t NK = a.n_tok * a.top_k, c0 = (int64_t)blockIdx.x * chunk, c1 = min(c0 + chunk, NK);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int32_t e = threadIdx.x; e < E; e += blockDim.x) total[e] = next[e] = 0;
    __syncthreads();
    for (int64_t i0 = 0; i0 < NK; i0 += blockDim.x) {
        const int64_t i = i0 + threadIdx.x;
        const int32_t e = i < NK ? a.topk_idx[i] : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e), pre = __ballot_sync(0xffffffffu, i < c0);
        if (e < 0 || e >= E) continue;
        if (lane == __ffs(peers) - 1) atomicAdd(&total[e], __popc(peers));
        if ((peers & pre) && lane == __ffs(peers & pre) - 1) atomicAdd(&next[e], __popc(peers & pre));
    }
    __syncthreads();
    /* group totals from the prefix of the loads, then the prefix of the kept */
    const int32_t me = threadIdx.x, load = me < E ? total[me] : 0;
    int32_t all;
    const int32_t incl = block_scan(load, shm, &all) + load;
    __shared__ int32_t incl_of[MAX_EXPERTS];
    if (me < E) incl_of[me] = incl;
    __syncthreads();
    int32_t group_rows = 0, over = 0;
    if (me < E) {
        const int32_t g0 = me / EG * EG;
        group_rows = incl_of[g0 + EG - 1] - (g0 > 0 ? incl_of[g0 - 1] : 0);
        over = group_rows > a.max_rows;
    }
    const int32_t base = block_scan(over ? 0 : load, shm, &all);
    if (me < E) {
        next[me] = over ? -1 : base + next[me];
        if (blockIdx.x == 0) {
            a.counts[me] = over ? 0 : load;
            a.load[me] = load;
            if (me % EG == 0) {
                const int32_t g = me / EG;
                if (over) mst_dev_flag(a.flag, MST_FLAG_COUNTS);
                if (a.peak_rows && group_rows > a.peak_rows[g]) a.peak_rows[g] = group_rows;
            }
        }
    }
    for (int64_t i0 = c0; i0 < c1; i0 += blockDim.x)
        for (int turn = 0; turn < (int)(blockDim.x >> 5); turn++) {
            __syncthreads();
            if (warp != turn) continue;
            const int64_t i = i0 + threadIdx.x;
            const int32_t e = i < c1 ? a.topk_idx[i] : -1;
            const unsigned peers = __match_any_sync(0xffffffffu, e);
            if (e < 0 || e >= E) continue;
            const int32_t row = next[e];
            a.pos[i] = row < 0 ? -1 : row + __popc(peers & ((1u << lane) - 1u));
            __syncwarp(peers);
            if (row >= 0 && lane == __ffs(peers) - 1) next[e] = row + __popc(peers);
        }
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
    if (a->n_tok > 0) {
        route_token_kernel<<<mst_blocks(a->n_tok, TOK_WARPS), TOK_WARPS * 32, 0, s>>>(*a);
        MST_CUDA_LAUNCHED();
    }
    /* chunks of whole blocks of entries, at most PLAN_MAX_BLOCKS of them */
    const int64_t NK = a->n_tok * a->top_k, per = PLAN_THREADS * (int64_t)PLAN_MAX_BLOCKS;
    const int64_t chunk = PLAN_THREADS * ((NK + per - 1) / per > 0 ? (NK + per - 1) / per : 1);
    const int64_t blocks = NK > 0 ? (NK + chunk - 1) / chunk : 1;
    route_plan_kernel<<<(unsigned)blocks, PLAN_THREADS, 0, s>>>(*a, chunk);
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
 * S = blockDim / E interleaved slices (each in token order, BAL_AHEAD
 * loads in flight before their adds), the slices in order (thread e), then
 * the experts in order (thread 0). One block. */
enum { BAL_AHEAD = 16 };

__global__ void route_balance_kernel(mst_route_args a) {
    __shared__ float part[PLAN_THREADS], lb[MAX_EXPERTS], pe[MAX_EXPERTS];
    const int32_t E = a.n_experts, S = max(1, (int32_t)blockDim.x / E);
    balance_lb(a, lb);
    if ((int32_t)threadIdx.x < S * E) {
        const int32_t e = threadIdx.x % E, sl = threadIdx.x / E;
        float s = 0.0f;
        int64_t t = sl;
        for (; t + (BAL_AHEAD - 1) * S < a.n_tok; t += BAL_AHEAD * S) {
            float v[BAL_AHEAD];
#pragma unroll
            for (int u = 0; u < BAL_AHEAD; u++) v[u] = a.probs[(t + u * S) * E + e];
#pragma unroll
            for (int u = 0; u < BAL_AHEAD; u++) s += v[u];
        }
        for (; t < a.n_tok; t += S) s += a.probs[t * E + e];
        part[threadIdx.x] = s;
    }
    __syncthreads();
    if ((int32_t)threadIdx.x < E) {
        float p = 0.0f;
        for (int32_t sl = 0; sl < S; sl++) p += part[sl * E + threadIdx.x];
        pe[threadIdx.x] = p;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    float aux = 0.0f;
    for (int32_t e = 0; e < E; e++) aux += lb[e] * pe[e];
    *a.aux_loss = aux;
}

/* Token t (a warp per token): dp[e] = grad_scale lb[e] + the top-k term
 * of e when a slot s chose it: dw_s, or through the renormalisation
 * w_s = p_s / S (S = sum of the chosen probs), (dw_s - sum_u dw_u w_u) / S;
 * then dlogits = p (dp - sum_j p_j dp_j), that sum in expert order (lane
 * 0, from shared memory). Slots choose distinct experts: one addition per
 * expert. The same fp32 operations as the CPU's. */
__global__ void route_backward_kernel(mst_route_args a) {
    __shared__ float lb[MAX_EXPERTS], prob[TOK_WARPS][MAX_EXPERTS], dprob[TOK_WARPS][MAX_EXPERTS];
    balance_lb(a, lb);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * TOK_WARPS + w;
    if (t >= a.n_tok) return; /* the whole warp */
    const int32_t E = a.n_experts, K = a.top_k;
    const float* p = a.probs + t * E;
    const int32_t* idx = a.topk_idx + t * K;
    const float *wt = a.topk_w + t * K, *dw = a.dtopk_w + t * K;
    float *pw = prob[w], *dp = dprob[w];
    for (int32_t e = lane; e < E; e += 32) pw[e] = p[e], dp[e] = a.grad_scale * lb[e];
    float chosen = 0.0f, dot_w = 0.0f;
    for (int32_t s = 0; s < K; s++) chosen += p[idx[s]], dot_w += dw[s] * wt[s];
    __syncwarp();
    for (int32_t s = lane; s < K; s += 32)
        if (idx[s] >= 0 && idx[s] < E) dp[idx[s]] += a.norm_topk ? (dw[s] - dot_w) / chosen : dw[s];
    __syncwarp();
    float dot = 0.0f;
    if (lane == 0)
        for (int32_t e = 0; e < E; e++) dot += pw[e] * dp[e];
    dot = __shfl_sync(0xffffffffu, dot, 0);
    for (int32_t e = lane; e < E; e += 32) a.dlogits[t * E + e] = mst_to_bf(pw[e] * (dp[e] - dot));
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
    if (a->n_tok == 0) return MST_OK;
    route_backward_kernel<<<mst_blocks(a->n_tok, TOK_WARPS), TOK_WARPS * 32, 0, s>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

