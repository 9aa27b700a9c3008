/*
 * model_ops_qk.c (CPU) — Qwen3's QK-norm and rotary position embedding
 * (mst_qk_args), forward and backward side by side. Per token row and per
 * q or k head of width D:
 *   n = x rstd, rstd = 1 / sqrt(mean(x^2) + eps);  u = n w;  y = rope(u)
 *   rope: y[i] = u[i] c - u[i+D/2] s, y[i+D/2] = u[i+D/2] c + u[i] s,
 *         c, s = cos, sin of pos / theta^(2i/D)
 * backward (the rotation's transpose, then RMSNorm's):
 *   du[i] = dy[i] c + dy[i+D/2] s, du[i+D/2] = dy[i+D/2] c - dy[i] s
 *   dw += du n;  dn = du w;  dx = rstd dn - x rstd^3 / D sum(dn x)
 * v's columns are copied both ways. fp32 from the bf16 inputs, one bf16
 * rounding on store. The weight gradients: each row's sum over its heads
 * (head order), then the rows' sums in row order.
 */
#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "model_ops.h"

/* One head: x [D] -> y [D] (bf16), the row's 1 / rms into *rstd. */
static void head_forward(const uint16_t* x, const uint16_t* w, const float* cs, int64_t D, float eps, uint16_t* y,
                         float* rstd, float* u) {
    const int64_t D2 = D / 2;
    float ss = 0.0f;
    for (int64_t i = 0; i < D; i++) {
        const float v = mst_bf16_to_fp32(x[i]);
        ss += v * v;
    }
    const float rs = 1.0f / sqrtf(ss / (float)D + eps);
    *rstd = rs;
    for (int64_t i = 0; i < D; i++) u[i] = mst_bf16_to_fp32(x[i]) * rs * mst_bf16_to_fp32(w[i]);
    for (int64_t i = 0; i < D2; i++) {
        const float c = cs[i], s = cs[D2 + i];
        y[i] = mst_fp32_to_bf16(u[i] * c - u[i + D2] * s);
        y[i + D2] = mst_fp32_to_bf16(u[i + D2] * c + u[i] * s);
    }
}

/* One head's backward: dy [D] -> dx [D] (bf16); dw [D] += du n. */
static void head_backward(const uint16_t* x, const uint16_t* w, const uint16_t* dy, const float* cs, int64_t D,
                          float rs, uint16_t* dx, float* dw, float* du) {
    const int64_t D2 = D / 2;
    for (int64_t i = 0; i < D2; i++) {
        const float c = cs[i], s = cs[D2 + i], g0 = mst_bf16_to_fp32(dy[i]), g1 = mst_bf16_to_fp32(dy[i + D2]);
        du[i] = g0 * c + g1 * s;
        du[i + D2] = g1 * c - g0 * s;
    }
    float dot = 0.0f;
    for (int64_t i = 0; i < D; i++) {
        const float xv = mst_bf16_to_fp32(x[i]);
        dw[i] += du[i] * xv * rs;
        du[i] *= mst_bf16_to_fp32(w[i]); /* dn */
        dot += du[i] * xv;
    }
    const float k = dot * rs * rs * rs / (float)D;
    for (int64_t i = 0; i < D; i++) dx[i] = mst_fp32_to_bf16(rs * du[i] - mst_bf16_to_fp32(x[i]) * k);
}

static mst_status check(const mst_qk_args* a) {
    if (a->head_dim < 2 || a->head_dim % 2 || a->seq < 1 || a->n_head < 1 || a->n_kv_head < 1)
        return mst_set_error(MST_ERR_INVALID, "qk: head_dim %lld (even), seq %lld, heads %lld / %lld",
                             (long long)a->head_dim, (long long)a->seq, (long long)a->n_head, (long long)a->n_kv_head);
    return MST_OK;
}

mst_status mst_cpu_qk_forward(mst_ctx_t* ctx, const mst_qk_args* a) {
    (void)ctx;
    MST_TRY(check(a));
    const int64_t D = a->head_dim, NQK = a->n_head + a->n_kv_head, W = (NQK + a->n_kv_head) * D;
    float* buf = (float*)malloc(sizeof(float) * (size_t)(2 * D * a->rows)); /* per row: cs [D], u [D] */
    if (!buf) return mst_set_error(MST_ERR_OOM, "cpu qk scratch");
#pragma omp parallel for if (a->rows * W > 65536)
    for (int64_t r = 0; r < a->rows; r++) {
        float *cs = buf + 2 * D * r, *u = cs + D;
        mst_rope_angles(a->theta, a->head_dim, r % a->seq, cs);
        const uint16_t* x = a->x + r * W;
        uint16_t* y = a->y + r * W;
        for (int64_t h = 0; h < NQK; h++)
            head_forward(x + h * D, h < a->n_head ? a->wq : a->wk, cs, D, a->eps, y + h * D, a->rstd + r * NQK + h, u);
        memcpy(y + NQK * D, x + NQK * D, sizeof(uint16_t) * (size_t)(W - NQK * D));
    }
    free(buf);
    return MST_OK;
}

mst_status mst_cpu_qk_backward(mst_ctx_t* ctx, const mst_qk_args* a) {
    (void)ctx;
    MST_TRY(check(a));
    const int64_t D = a->head_dim, NQK = a->n_head + a->n_kv_head, W = (NQK + a->n_kv_head) * D, N = a->rows;
    /* per row: cs [D], du [D], its dwq [D] and dwk [D] */
    float* buf = (float*)calloc((size_t)(4 * D * N), sizeof(float));
    if (!buf) return mst_set_error(MST_ERR_OOM, "cpu qk scratch");
#pragma omp parallel for if (N * W > 65536)
    for (int64_t r = 0; r < N; r++) {
        float *cs = buf + 4 * D * r, *du = cs + D, *dwq = du + D, *dwk = dwq + D;
        mst_rope_angles(a->theta, a->head_dim, r % a->seq, cs);
        const int64_t o = r * W;
        for (int64_t h = 0; h < NQK; h++) {
            const int q = h < a->n_head;
            head_backward(a->x + o + h * D, q ? a->wq : a->wk, a->dy + o + h * D, cs, D, a->rstd[r * NQK + h],
                          a->dx + o + h * D, q ? dwq : dwk, du);
        }
        memcpy(a->dx + o + NQK * D, a->dy + o + NQK * D, sizeof(uint16_t) * (size_t)(W - NQK * D));
    }
    for (int64_t i = 0; i < D; i++) {
        float sq = 0.0f, sk = 0.0f;
        for (int64_t r = 0; r < N; r++) {
            sq += buf[4 * D * r + 2 * D + i];
            sk += buf[4 * D * r + 3 * D + i];
        }
        a->dwq[i] += sq;
        a->dwk[i] += sk;
    }
    free(buf);
    return MST_OK;
}
