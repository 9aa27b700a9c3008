/*
 * model_ops_attn.c (CPU) — causal multi-head self-attention, forward and
 * backward side by side. The softmax probabilities P [B, NH, T, T] are saved
 * by forward (zero above the diagonal) and read by backward:
 *   S = q k^T / sqrt(D) (j <= i), P = softmax_j(S), out = P v
 *   dP = dout v^T, dS = P (dP - rowsum(P dP)), dq = dS k / sqrt(D),
 *   dk = dS^T q / sqrt(D), dv = P^T dout
 * One (batch, head) per OpenMP task; sums run in index order.
 */
#include <math.h>
#include <string.h>

#include "../../core/context.h"
#include "model_ops.h"

/* fp32 copy of one head's [T, D] slice of a [B*T, ld] bf16 matrix. */
static void head_load(float* dst, const uint16_t* src, int64_t T, int64_t D, int64_t ld) {
    for (int64_t t = 0; t < T; t++) mst_bf16_to_fp32_array(dst + t * D, src + t * ld, (size_t)D);
}

static void head_store(uint16_t* dst, const float* src, int64_t T, int64_t D, int64_t ld) {
    for (int64_t t = 0; t < T; t++) mst_fp32_to_bf16_array(dst + t * ld, src + t * D, (size_t)D);
}

mst_status mst_cpu_attn_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx;
    const int64_t T = a->seq, D = a->head_dim, NH = a->n_head, H = NH * D;
    const float sc = 1.0f / sqrtf((float)D);
    float* buf = (float*)malloc(sizeof(float) * (size_t)(4 * T * D) * (size_t)(a->batch * NH));
    if (!buf) return mst_set_error(MST_ERR_OOM, "cpu attention scratch");
#pragma omp parallel for
    for (int64_t bh = 0; bh < a->batch * NH; bh++) {
        int64_t b = bh / NH, h = bh % NH;
        float *q = buf + bh * 4 * T * D, *k = q + T * D, *v = k + T * D, *o = v + T * D;
        const uint16_t* base = a->qkv + b * T * 3 * H + h * D;
        head_load(q, base, T, D, 3 * H);
        head_load(k, base + H, T, D, 3 * H);
        head_load(v, base + 2 * H, T, D, 3 * H);
        for (int64_t i = 0; i < T; i++) {
            float* p = a->probs + (bh * T + i) * T;
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j <= i; j++) {
                float s = 0.0f;
                for (int64_t d = 0; d < D; d++) s += q[i * D + d] * k[j * D + d];
                p[j] = s * sc;
                mx = fmaxf(mx, p[j]);
            }
            for (int64_t j = 0; j <= i; j++) sum += (p[j] = expf(p[j] - mx));
            for (int64_t j = 0; j <= i; j++) p[j] /= sum;
            for (int64_t j = i + 1; j < T; j++) p[j] = 0.0f;
            for (int64_t d = 0; d < D; d++) {
                float acc = 0.0f;
                for (int64_t j = 0; j <= i; j++) acc += p[j] * v[j * D + d];
                o[i * D + d] = acc;
            }
        }
        head_store(a->out + b * T * H + h * D, o, T, D, H);
    }
    free(buf);
    return MST_OK;
}

mst_status mst_cpu_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx;
    const int64_t T = a->seq, D = a->head_dim, NH = a->n_head, H = NH * D;
    const float sc = 1.0f / sqrtf((float)D);
    /* per (b, h): q k v do dq dk dv [T, D] and dS [T, T] */
    const int64_t per = 7 * T * D + T * T;
    float* buf = (float*)malloc(sizeof(float) * (size_t)per * (size_t)(a->batch * NH));
    if (!buf) return mst_set_error(MST_ERR_OOM, "cpu attention scratch");
#pragma omp parallel for
    for (int64_t bh = 0; bh < a->batch * NH; bh++) {
        int64_t b = bh / NH, h = bh % NH;
        float *q = buf + bh * per, *k = q + T * D, *v = k + T * D, *dout = v + T * D;
        float *dq = dout + T * D, *dk = dq + T * D, *dv = dk + T * D, *ds = dv + T * D;
        const uint16_t* base = a->qkv + b * T * 3 * H + h * D;
        head_load(q, base, T, D, 3 * H);
        head_load(k, base + H, T, D, 3 * H);
        head_load(v, base + 2 * H, T, D, 3 * H);
        head_load(dout, a->dout + b * T * H + h * D, T, D, H);
        const float* P = a->probs + bh * T * T;
        for (int64_t i = 0; i < T; i++) {
            float rowdot = 0.0f;
            for (int64_t j = 0; j <= i; j++) {
                float dp = 0.0f;
                for (int64_t d = 0; d < D; d++) dp += dout[i * D + d] * v[j * D + d];
                ds[i * T + j] = dp;
                rowdot += P[i * T + j] * dp;
            }
            for (int64_t j = 0; j <= i; j++) ds[i * T + j] = P[i * T + j] * (ds[i * T + j] - rowdot);
            for (int64_t d = 0; d < D; d++) {
                float acc = 0.0f;
                for (int64_t j = 0; j <= i; j++) acc += ds[i * T + j] * k[j * D + d];
                dq[i * D + d] = acc * sc;
            }
        }
        for (int64_t j = 0; j < T; j++)
            for (int64_t d = 0; d < D; d++) {
                float ak = 0.0f, av = 0.0f;
                for (int64_t i = j; i < T; i++) {
                    ak += ds[i * T + j] * q[i * D + d];
                    av += P[i * T + j] * dout[i * D + d];
                }
                dk[j * D + d] = ak * sc;
                dv[j * D + d] = av;
            }
        uint16_t* dbase = a->dqkv + b * T * 3 * H + h * D;
        head_store(dbase, dq, T, D, 3 * H);
        head_store(dbase + H, dk, T, D, 3 * H);
        head_store(dbase + 2 * H, dv, T, D, 3 * H);
    }
    free(buf);
    return MST_OK;
}
