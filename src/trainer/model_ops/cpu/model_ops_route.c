/*
 * model_ops_route.c (CPU) — the MoE router and the token <-> grouped-rows
 * moves, reference versions:
 *   route forward: softmax over experts, top-k (renormalised), the dropless
 *     plan (counts, positions, over-budget detection, peak rows); route
 *     backward: the load-balancing loss of the layers' summed loads and
 *     d(router logits) from d(top-k weights) plus its term, through the
 *     renormalisation and the softmax.
 *   rows gather / sum: dispatch and combine (and their transposes).
 * Counts are computed here, in backend memory, never on the host.
 */
#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "trainer/model_ops/route_math.h"
#include "model_ops.h"

/* Counts, positions and over-budget flags from topk_idx, in entry order.
 * Groups are packed: group g's rows follow those of the groups before it. */
static mst_status route_plan(const mst_route_args* a) {
    const int32_t E = a->n_experts, G = a->n_groups, EG = E / G;
    const int64_t NK = a->n_tok * a->top_k, R = a->max_rows;
    int32_t* next = (int32_t*)malloc(sizeof(int32_t) * (size_t)E); /* next row of expert e */
    if (!next) return mst_set_error(MST_ERR_OOM, "cpu router plan scratch");
    memset(a->load, 0, sizeof(int32_t) * (size_t)E);
    for (int64_t i = 0; i < NK; i++) a->load[a->topk_idx[i]]++;
    int64_t base = 0;
    for (int32_t g = 0; g < G; g++) {
        int64_t total = 0;
        for (int32_t e = g * EG; e < (g + 1) * EG; e++) total += a->load[e];
        const int over = total > R;
        if (over) *a->flag |= MST_FLAG_COUNTS;
        if (a->peak_rows && total > a->peak_rows[g]) a->peak_rows[g] = (int32_t)total;
        for (int32_t e = g * EG; e < (g + 1) * EG; e++) {
            a->counts[e] = over ? 0 : a->load[e];
            next[e] = over ? -1 : (int32_t)base;
            base += a->counts[e];
        }
    }
    for (int64_t i = 0; i < NK; i++) {
        int32_t e = a->topk_idx[i];
        a->pos[i] = next[e] < 0 ? -1 : next[e]++;
    }
    free(next);
    return MST_OK;
}

/* Rows the load-balancing statistics span: layers x tokens x ranks. */
static float stat_rows(const mst_route_args* a) {
    return (float)a->n_layers * (float)a->n_tok * (float)(a->world > 1 ? a->world : 1);
}

mst_status mst_cpu_route_forward(mst_ctx_t* ctx, const mst_route_args* a) {
    (void)ctx;
    for (int64_t t = 0; t < a->n_tok; t++) mst_route_token(a, t);
    return route_plan(a);
}

/* Peak rows per group from the (summed) loads. */
mst_status mst_cpu_route_peak(mst_ctx_t* ctx, const mst_route_args* a) {
    (void)ctx;
    const int32_t EG = a->n_experts / a->n_groups;
    for (int32_t g = 0; a->peak_rows && g < a->n_groups; g++) {
        int64_t total = 0;
        for (int32_t e = g * EG; e < (g + 1) * EG; e++) total += a->load[e];
        if (total > a->peak_rows[g]) a->peak_rows[g] = (int32_t)total;
    }
    return MST_OK;
}

/* lb[e] = coef E L_e / rows^2 (L_e: the loads summed over the layers, in
 * layer order); aux_loss = sum_e lb[e] (sum_t probs[t][e]) (tokens in
 * order): this layer's share of the loss. */
static mst_status balance_term(const mst_route_args* a, float* lb) {
    const int32_t E = a->n_experts;
    const float rows = stat_rows(a);
    if (a->n_layers < 1 || !a->loads)
        return mst_set_error(MST_ERR_INVALID, "route backward: n_layers %d, loads %p", a->n_layers, (const void*)a->loads);
    float aux = 0.0f;
    for (int32_t e = 0; e < E; e++) {
        int64_t L = 0;
        for (int32_t l = 0; l < a->n_layers; l++) L += a->loads[(int64_t)l * E + e];
        lb[e] = a->aux_coef * (float)E * ((float)L / rows) / rows;
        float pe = 0.0f;
        for (int64_t t = 0; t < a->n_tok; t++) pe += a->probs[t * E + e];
        aux += lb[e] * pe;
    }
    *a->aux_loss = aux;
    return MST_OK;
}

/* dp[e] = grad_scale lb[e] + d(topk_w)/d(p) applied to dtopk_w (slots
 * choosing e; through the renormalisation w_s = p_s / S when norm_topk:
 * dp_s = (dw_s - sum_u dw_u w_u) / S); dlogits = p (dp - sum_j p_j dp_j). */
mst_status mst_cpu_route_backward(mst_ctx_t* ctx, const mst_route_args* a) {
    (void)ctx;
    const int32_t E = a->n_experts, K = a->top_k;
    float* dp = (float*)malloc(sizeof(float) * (size_t)(2 * E));
    if (!dp) return mst_set_error(MST_ERR_OOM, "cpu router scratch");
    float* lb = dp + E;
    mst_status st = balance_term(a, lb);
    for (int64_t t = 0; st == MST_OK && t < a->n_tok; t++) {
        const float* p = a->probs + t * E;
        const int32_t* idx = a->topk_idx + t * K;
        const float *w = a->topk_w + t * K, *dw = a->dtopk_w + t * K;
        for (int32_t e = 0; e < E; e++) dp[e] = a->grad_scale * lb[e];
        float chosen = 0.0f, dot_w = 0.0f;
        for (int32_t s = 0; s < K; s++) chosen += p[idx[s]], dot_w += dw[s] * w[s];
        for (int32_t s = 0; s < K; s++) dp[idx[s]] += a->norm_topk ? (dw[s] - dot_w) / chosen : dw[s];
        float dot = 0.0f;
        for (int32_t e = 0; e < E; e++) dot += p[e] * dp[e];
        for (int32_t e = 0; e < E; e++) a->dlogits[t * E + e] = mst_fp32_to_bf16(p[e] * (dp[e] - dot));
    }
    free(dp);
    return st;
}

mst_status mst_cpu_rows_gather(mst_ctx_t* ctx, const mst_rows_args* a) {
    (void)ctx;
    for (int64_t i = 0; i < a->n_tok * a->top_k; i++) {
        int32_t r = a->pos[i];
        if (r < 0) continue;
        memcpy(a->dst + (int64_t)r * a->cols, a->src + (i / a->top_k) * a->cols, sizeof(uint16_t) * (size_t)a->cols);
        if (a->dst_p) a->dst_p[r] = a->src_p[i];
    }
    return MST_OK;
}

mst_status mst_cpu_rows_sum(mst_ctx_t* ctx, const mst_rows_args* a) {
    (void)ctx;
    const int32_t K = a->top_k;
    const int64_t H = a->cols;
#pragma omp parallel for if (a->n_tok * H > 65536)
    for (int64_t t = 0; t < a->n_tok; t++) {
        for (int64_t c = 0; c < H; c++) {
            float acc = 0.0f;
            for (int32_t s = 0; s < K; s++) {
                int32_t r = a->pos[t * K + s];
                if (r >= 0) acc += mst_bf16_to_fp32(a->src[(int64_t)r * H + c]);
            }
            a->dst[t * H + c] = mst_fp32_to_bf16(acc);
        }
        if (a->dst_p)
            for (int32_t s = 0; s < K; s++) {
                int32_t r = a->pos[t * K + s];
                a->dst_p[t * K + s] = r >= 0 ? a->src_p[r] : 0.0f;
            }
    }
    return MST_OK;
}
