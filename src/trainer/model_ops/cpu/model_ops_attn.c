/*
 * model_ops_attn.c (CPU) — causal grouped-query self-attention (NH query
 * heads over KV key-value heads, query head h reading key-value head
 * h / (NH / KV)), forward and backward side by side, under both contracts
 * of model_backend.h:
 *   S = q k^T / sqrt(D) (j <= i), P = softmax_j(S), out = P v
 *   dP = dout v^T, dS = P (dP - Delta), dq = dS k / sqrt(D),
 *   dk = dS^T q / sqrt(D), dv = P^T dout
 * attn_*: forward saves P [B, NH, T, T] (zero above the diagonal), backward
 * reads it, Delta = rowsum(P dP). attn_flash_*: forward saves each row's
 * logsumexp; backward recomputes P = exp(S - lse) and takes
 * Delta = rowsum(dout out) from the stored output, as the CUDA flash kernels
 * do. Forward: one (batch, query head) per OpenMP task; backward: one
 * (batch, key-value head) per task, its dk and dv the sums of its query
 * heads' in head order. Sums run in index order.
 */
#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "model_ops.h"

/* fp32 copy of one head's [T, D] slice of a [B*T, ld] bf16 matrix. */
static void head_load(float* dst, const uint16_t* src, int64_t T, int64_t D, int64_t ld) {
    for (int64_t t = 0; t < T; t++) mst_bf16_to_fp32_array(dst + t * D, src + t * ld, (size_t)D);
}

static void head_store(uint16_t* dst, const float* src, int64_t T, int64_t D, int64_t ld) {
    for (int64_t t = 0; t < T; t++) mst_fp32_to_bf16_array(dst + t * ld, src + t * D, (size_t)D);
}

/* Row i of one head: p[0..i] = softmax_j(q_i k_j sc) (p[j > i] untouched),
 * o_i = sum_j p_j v_j; returns the row's logsumexp. */
static float attend_row(const float* q, const float* k, const float* v, int64_t i, int64_t D, float sc, float* p,
                        float* o) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j <= i; j++) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; d++) s += q[i * D + d] * k[j * D + d];
        p[j] = s * sc;
        mx = fmaxf(mx, p[j]);
    }
    for (int64_t j = 0; j <= i; j++) sum += (p[j] = expf(p[j] - mx));
    for (int64_t j = 0; j <= i; j++) p[j] /= sum;
    for (int64_t d = 0; d < D; d++) {
        float acc = 0.0f;
        for (int64_t j = 0; j <= i; j++) acc += p[j] * v[j * D + d];
        o[i * D + d] = acc;
    }
    return mx + logf(sum);
}

/* The layout of a qkv row: [q (NH D) | k (KV D) | v (KV D)]. */
typedef struct attn_layout {
    int64_t T, D, NH, KV, W; /* W = (NH + 2 KV) D, the qkv row */
} attn_layout;

static attn_layout layout_of(const mst_attn_args* a) {
    attn_layout z = {a->seq, a->head_dim, a->n_head, a->n_kv_head, (a->n_head + 2 * a->n_kv_head) * a->head_dim};
    return z;
}

/* The key-value head query head h reads. */
static int64_t kv_head(const attn_layout* z, int64_t h) { return h / (z->NH / z->KV); }

/* Columns of query head h, of key and value head g in a qkv row. */
static int64_t q_col(const attn_layout* z, int64_t h) { return h * z->D; }
static int64_t k_col(const attn_layout* z, int64_t g) { return (z->NH + g) * z->D; }
static int64_t v_col(const attn_layout* z, int64_t g) { return (z->NH + z->KV + g) * z->D; }

static mst_status check(const mst_attn_args* a) {
    if (a->n_head < 1 || a->n_kv_head < 1 || a->n_head % a->n_kv_head || a->head_dim < 1)
        return mst_set_error(MST_ERR_INVALID, "attention: n_kv_head %lld must divide n_head %lld (head_dim %lld)",
                             (long long)a->n_kv_head, (long long)a->n_head, (long long)a->head_dim);
    return MST_OK;
}

/* Forward of both contracts: the probabilities into a->probs (lse NULL), or
 * each row's logsumexp into a->lse (probs NULL). */
static mst_status forward(const mst_attn_args* a, float* probs, float* lse) {
    MST_TRY(check(a));
    const attn_layout z = layout_of(a);
    const int64_t T = z.T, D = z.D, NH = z.NH, HO = NH * D;
    const float sc = 1.0f / sqrtf((float)D);
    const int64_t per = 4 * T * D + (probs ? 0 : T); /* q k v o [T, D], a row of p */
    float* buf = (float*)malloc(sizeof(float) * (size_t)per * (size_t)(a->batch * NH));
    if (!buf) return mst_set_error(MST_ERR_OOM, "cpu attention scratch");
#pragma omp parallel for
    for (int64_t bh = 0; bh < a->batch * NH; bh++) {
        int64_t b = bh / NH, h = bh % NH, g = kv_head(&z, h);
        float *q = buf + bh * per, *k = q + T * D, *v = k + T * D, *o = v + T * D, *row = o + T * D;
        const uint16_t* base = a->qkv + b * T * z.W;
        head_load(q, base + q_col(&z, h), T, D, z.W);
        head_load(k, base + k_col(&z, g), T, D, z.W);
        head_load(v, base + v_col(&z, g), T, D, z.W);
        for (int64_t i = 0; i < T; i++) {
            float* p = probs ? probs + (bh * T + i) * T : row;
            float l = attend_row(q, k, v, i, D, sc, p, o);
            if (probs) memset(p + i + 1, 0, sizeof(float) * (size_t)(T - i - 1));
            else lse[bh * T + i] = l;
        }
        head_store(a->out + b * T * HO + h * D, o, T, D, HO);
    }
    free(buf);
    return MST_OK;
}

mst_status mst_cpu_attn_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx;
    return forward(a, a->probs, NULL);
}

mst_status mst_cpu_attn_flash_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx;
    return forward(a, NULL, a->lse);
}

/* Backward of one head from its probabilities P [T, T] (0 above the
 * diagonal) and, for the flash contract, delta [T] = rowsum(dout * out)
 * (NULL: rowsum(P dP), the probabilities contract); ds [T, T] scratch. */
static void head_backward(const float* q, const float* k, const float* v, const float* dout, const float* P,
                          const float* delta, float* ds, float* dq, float* dk, float* dv, int64_t T, int64_t D,
                          float sc) {
    for (int64_t i = 0; i < T; i++) {
        float rowdot = 0.0f;
        for (int64_t j = 0; j <= i; j++) {
            float dp = 0.0f;
            for (int64_t d = 0; d < D; d++) dp += dout[i * D + d] * v[j * D + d];
            ds[i * T + j] = dp;
            rowdot += P[i * T + j] * dp;
        }
        if (delta) rowdot = delta[i];
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
}

/* The flash contract's P [T, T] of one head, recomputed from lse [T], and
 * delta [T] from its output o [T, D] (the bf16 values forward stored). */
static void recompute_probs(const float* q, const float* k, const float* o, const float* dout, const float* lse,
                            int64_t T, int64_t D, float sc, float* P, float* delta) {
    for (int64_t i = 0; i < T; i++) {
        for (int64_t j = 0; j < T; j++) {
            float s = 0.0f;
            for (int64_t d = 0; j <= i && d < D; d++) s += q[i * D + d] * k[j * D + d];
            P[i * T + j] = j <= i ? expf(s * sc - lse[i]) : 0.0f;
        }
        float dot = 0.0f;
        for (int64_t d = 0; d < D; d++) dot += dout[i * D + d] * o[i * D + d];
        delta[i] = dot;
    }
}

/* Backward of both contracts: from a->probs (lse NULL) or recomputed from
 * a->lse and a->out (probs NULL). */
static mst_status backward(const mst_attn_args* a, const float* probs, const float* lse) {
    MST_TRY(check(a));
    const attn_layout z = layout_of(a);
    const int64_t T = z.T, D = z.D, NH = z.NH, KV = z.KV, HO = NH * D;
    const float sc = 1.0f / sqrtf((float)D);
    /* per (b, g): k v dk dv [T, D]; per query head: q do dq dkh dvh [T, D] and
     * dS [T, T]; flash: o [T, D], P [T, T], delta [T] */
    const int64_t per = 9 * T * D + T * T + (probs ? 0 : T * D + T * T + T);
    float* buf = (float*)malloc(sizeof(float) * (size_t)per * (size_t)(a->batch * KV));
    if (!buf) return mst_set_error(MST_ERR_OOM, "cpu attention scratch");
#pragma omp parallel for
    for (int64_t bg = 0; bg < a->batch * KV; bg++) {
        int64_t b = bg / KV, g = bg % KV;
        float *k = buf + bg * per, *v = k + T * D, *dk = v + T * D, *dv = dk + T * D, *q = dv + T * D;
        float *dout = q + T * D, *dq = dout + T * D, *dkh = dq + T * D, *dvh = dkh + T * D, *ds = dvh + T * D;
        const uint16_t* base = a->qkv + b * T * z.W;
        uint16_t* dbase = a->dqkv + b * T * z.W;
        head_load(k, base + k_col(&z, g), T, D, z.W);
        head_load(v, base + v_col(&z, g), T, D, z.W);
        memset(dk, 0, sizeof(float) * (size_t)(2 * T * D)); /* dk, dv */
        for (int64_t h = 0; h < NH; h++) {
            if (kv_head(&z, h) != g) continue;
            const int64_t bh = b * NH + h;
            head_load(q, base + q_col(&z, h), T, D, z.W);
            head_load(dout, a->dout + b * T * HO + h * D, T, D, HO);
            const float* P = probs ? probs + bh * T * T : NULL;
            float* delta = NULL;
            if (!probs) {
                float *o = ds + T * T, *Pr = o + T * D;
                delta = Pr + T * T;
                head_load(o, a->out + b * T * HO + h * D, T, D, HO);
                recompute_probs(q, k, o, dout, lse + bh * T, T, D, sc, Pr, delta);
                P = Pr;
            }
            head_backward(q, k, v, dout, P, delta, ds, dq, dkh, dvh, T, D, sc);
            for (int64_t i = 0; i < T * D; i++) dk[i] += dkh[i], dv[i] += dvh[i];
            head_store(dbase + q_col(&z, h), dq, T, D, z.W);
        }
        head_store(dbase + k_col(&z, g), dk, T, D, z.W);
        head_store(dbase + v_col(&z, g), dv, T, D, z.W);
    }
    free(buf);
    return MST_OK;
}

mst_status mst_cpu_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx;
    return backward(a, a->probs, NULL);
}

mst_status mst_cpu_attn_flash_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx;
    return backward(a, NULL, a->lse);
}
