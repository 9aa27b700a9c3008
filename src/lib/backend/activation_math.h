/*
 * activation_math.h — the per-element math of the grouped MLP activation,
 * shared by the CPU reference (C11) and the CUDA kernels (host/device inline),
 * so both backends compute the same formulas in fp32.
 *
 *   SwiGLU:          z0 = silu(a) * b
 *   clamped SwiGLU:  a' = min(a, L), b' = clamp(b, -L, L),
 *                    z0 = a' * sigmoid(alpha a') * (b' + 1)
 *   z = z0 * p; backward with g = dz * p: da, db below, dprob += dz * z0.
 *   Where a clamp is active (a > L, |b| > L) its gradient is zero.
 */
#ifndef MST_ACTIVATION_MATH_H
#define MST_ACTIVATION_MATH_H

#include <math.h>

#include "backend.h"

/* Activation constants, fixed per call. */
typedef struct mst_act_param {
    int clamped; /* 0 SwiGLU, 1 clamped SwiGLU   */
    float limit; /* L                            */
    float alpha; /* sigmoid slope (1 for SwiGLU) */
} mst_act_param;

MST_HD mst_act_param mst_act_param_make(mst_activation act, float limit, float alpha) {
    mst_act_param p;
    p.clamped = act == MST_ACT_CLAMPED_SWIGLU;
    p.limit = limit;
    p.alpha = p.clamped ? alpha : 1.0f;
    return p;
}

/* On the GPU with the fast exponential and division (a few ulp; the
 * forward kernel was compute-bound with the IEEE ones); the CPU reference
 * stays with expf. Forward, backward and the recompute of fc2_input all run
 * this, so a recomputed z has the same bits on each backend. */
MST_HD float mst_act_sigmoid(float v) {
#ifdef __CUDA_ARCH__
    return __fdividef(1.0f, 1.0f + __expf(-v));
#else
    return 1.0f / (1.0f + expf(-v));
#endif
}

/* z0 = act(a, b) before the prob scale. */
MST_HD float mst_act_value(mst_act_param q, float a, float b) {
    if (q.clamped) {
        a = fminf(a, q.limit);
        b = fminf(fmaxf(b, -q.limit), q.limit) + 1.0f;
    }
    return a * mst_act_sigmoid(q.alpha * a) * b;
}

/* Gradients of z0 = act(a, b) times g (= dz * p): *da, *db; returns z0. */
MST_HD float mst_act_grad(mst_act_param q, float a, float b, float g, float* da, float* db) {
    int a_live = 1, b_live = 1;
    if (q.clamped) {
        a_live = a <= q.limit;
        b_live = b >= -q.limit && b <= q.limit;
        a = fminf(a, q.limit);
        b = fminf(fmaxf(b, -q.limit), q.limit) + 1.0f;
    }
    float s = mst_act_sigmoid(q.alpha * a);
    float gate = a * s;                                 /* a sigmoid(alpha a)      */
    float dgate = s + q.alpha * a * s * (1.0f - s);     /* d gate / d a            */
    *da = a_live ? g * b * dgate : 0.0f;
    *db = b_live ? g * gate : 0.0f;
    return gate * b;
}

#endif
