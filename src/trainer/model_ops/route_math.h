/*
 * route_math.h — the router's per-token math, the CPU reference's: softmax
 * over the E logits of token t, then its top-k (ties to the lower index),
 * the chosen probabilities divided by their sum when norm_topk. The CUDA
 * router (model_ops_route.cu) runs the same fp32 operations in the same
 * order with a warp per token.
 */
#ifndef MST_ROUTE_MATH_H
#define MST_ROUTE_MATH_H

#include <math.h>

#include "model_backend.h"

MST_HD void mst_route_token(const mst_route_args* a, int64_t t) {
    const int32_t E = a->n_experts, K = a->top_k;
    const float* l = a->logits + t * E;
    float* p = a->probs + t * E;
    float mx = -INFINITY, sum = 0.0f;
    for (int32_t e = 0; e < E; e++) mx = fmaxf(mx, l[e]);
    for (int32_t e = 0; e < E; e++) sum += (p[e] = expf(l[e] - mx));
    for (int32_t e = 0; e < E; e++) p[e] /= sum;
    for (int32_t s = 0; s < K; s++) {
        int32_t best = -1;
        for (int32_t e = 0; e < E; e++) {
            int taken = 0;
            for (int32_t u = 0; u < s; u++) taken |= a->topk_idx[t * K + u] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        a->topk_idx[t * K + s] = best;
        a->topk_w[t * K + s] = p[best];
    }
    if (!a->norm_topk) return;
    float chosen = 0.0f;
    for (int32_t s = 0; s < K; s++) chosen += a->topk_w[t * K + s];
    for (int32_t s = 0; s < K; s++) a->topk_w[t * K + s] /= chosen;
}

#endif
