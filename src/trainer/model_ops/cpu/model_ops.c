/*
 * model_ops.c (CPU) — the reference versions of the trainer's row ops:
 * matmul (mst_cpu_sgemm on fp32 copies of the bf16 operands), RMSNorm
 * forward/backward, residual add, token embedding gather / scatter-add,
 * softmax cross-entropy, sum of squares, AdamW and the float64 loss sum.
 * fp32 accumulation (float64 in the loss sum), bf16
 * rounding (nearest even) on store; every reduction runs in a fixed order.
 */
#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "model_ops.h"

/* fp32 copy of a [rows, cols] bf16 matrix with row stride ld. */
static float* widen(const uint16_t* src, int64_t rows, int64_t cols, int64_t ld) {
    float* dst = (float*)malloc(sizeof(float) * (size_t)(rows * cols) + 1);
    if (!dst) return NULL;
    for (int64_t r = 0; r < rows; r++) mst_bf16_to_fp32_array(dst + r * cols, src + r * ld, (size_t)cols);
    return dst;
}

mst_status mst_cpu_mm(mst_ctx_t* ctx, const mst_mm_args* a) {
    (void)ctx;
    int64_t ar = a->trans_a ? a->k : a->m, ac = a->trans_a ? a->m : a->k;
    int64_t br = a->trans_b ? a->n : a->k, bc = a->trans_b ? a->k : a->n;
    float* A = widen(a->a, ar, ac, a->lda);
    float* B = widen(a->b, br, bc, a->ldb);
    float* C = a->c16 ? (float*)malloc(sizeof(float) * (size_t)(a->m * a->n) + 1) : NULL;
    mst_status st = MST_OK;
    if (!A || !B || (a->c16 && !C)) {
        st = mst_set_error(MST_ERR_OOM, "cpu matmul scratch for [%lld, %lld, %lld]", (long long)a->m,
                           (long long)a->n, (long long)a->k);
        goto done;
    }
    if (a->c16) {
        for (int64_t r = 0; r < a->m; r++) {
            if (a->accumulate) mst_bf16_to_fp32_array(C + r * a->n, a->c16 + r * a->ldc, (size_t)a->n);
            else memset(C + r * a->n, 0, sizeof(float) * (size_t)a->n);
        }
    }
    mst_cpu_sgemm(a->trans_a, a->trans_b, a->m, a->n, a->k, A, ac, B, bc, a->accumulate ? 1.0f : 0.0f,
                  a->c16 ? C : a->c32, a->c16 ? a->n : a->ldc);
    if (a->c16)
        for (int64_t r = 0; r < a->m; r++) mst_fp32_to_bf16_array(a->c16 + r * a->ldc, C + r * a->n, (size_t)a->n);
done:
    free(A);
    free(B);
    free(C);
    return st;
}

mst_status mst_cpu_norm_forward(mst_ctx_t* ctx, const mst_norm_args* a) {
    (void)ctx;
    const int64_t H = a->cols;
#pragma omp parallel for if (a->rows * H > 65536)
    for (int64_t r = 0; r < a->rows; r++) {
        const uint16_t* x = a->x + r * H;
        float ss = 0.0f;
        for (int64_t c = 0; c < H; c++) {
            float v = mst_bf16_to_fp32(x[c]);
            ss += v * v;
        }
        float rs = 1.0f / sqrtf(ss / (float)H + a->eps);
        a->rstd[r] = rs;
        for (int64_t c = 0; c < H; c++)
            a->y[r * H + c] = mst_fp32_to_bf16(mst_bf16_to_fp32(x[c]) * rs * mst_bf16_to_fp32(a->w[c]));
    }
    return MST_OK;
}

/* dx = rstd (dy w) - x rstd^3 / H * sum(dy w x); dw += sum_r dy x rstd. */
mst_status mst_cpu_norm_backward(mst_ctx_t* ctx, const mst_norm_args* a) {
    (void)ctx;
    const int64_t H = a->cols;
#pragma omp parallel for if (a->rows * H > 65536)
    for (int64_t r = 0; r < a->rows; r++) {
        const uint16_t *x = a->x + r * H, *dy = a->dy + r * H;
        float rs = a->rstd[r], dot = 0.0f;
        for (int64_t c = 0; c < H; c++)
            dot += mst_bf16_to_fp32(dy[c]) * mst_bf16_to_fp32(a->w[c]) * mst_bf16_to_fp32(x[c]);
        float k = dot * rs * rs * rs / (float)H;
        for (int64_t c = 0; c < H; c++) {
            float g = mst_bf16_to_fp32(dy[c]) * mst_bf16_to_fp32(a->w[c]);
            a->dx[r * H + c] = mst_fp32_to_bf16(rs * g - mst_bf16_to_fp32(x[c]) * k);
        }
    }
    for (int64_t c = 0; c < H; c++) {
        float acc = 0.0f;
        for (int64_t r = 0; r < a->rows; r++)
            acc += mst_bf16_to_fp32(a->dy[r * H + c]) * mst_bf16_to_fp32(a->x[r * H + c]) * a->rstd[r];
        a->dw[c] += acc;
    }
    return MST_OK;
}

mst_status mst_cpu_add(mst_ctx_t* ctx, const mst_add_args* a) {
    (void)ctx;
    for (int64_t i = 0; i < a->n; i++)
        a->y[i] = mst_fp32_to_bf16(mst_bf16_to_fp32(a->a[i]) + mst_bf16_to_fp32(a->b[i]));
    return MST_OK;
}

/* Tokens outside [0, V) are a caller bug the model layer already rejects. */
mst_status mst_cpu_embed_forward(mst_ctx_t* ctx, const mst_embed_args* a) {
    (void)ctx;
    for (int64_t t = 0; t < a->n_tok; t++)
        memcpy(a->x + t * a->cols, a->table + (int64_t)a->tokens[t] * a->cols, sizeof(uint16_t) * (size_t)a->cols);
    return MST_OK;
}

mst_status mst_cpu_embed_backward(mst_ctx_t* ctx, const mst_embed_args* a) {
    (void)ctx;
    for (int64_t t = 0; t < a->n_tok; t++) {
        float* d = a->dtable + (int64_t)a->tokens[t] * a->cols;
        for (int64_t c = 0; c < a->cols; c++) d[c] += mst_bf16_to_fp32(a->dx[t * a->cols + c]);
    }
    return MST_OK;
}

mst_status mst_cpu_xent(mst_ctx_t* ctx, const mst_xent_args* a) {
    (void)ctx;
    const int64_t V = a->vocab;
#pragma omp parallel for if (a->rows * V > 65536)
    for (int64_t r = 0; r < a->rows; r++) {
        const uint16_t* l = a->logits + r * V;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t v = 0; v < V; v++) mx = fmaxf(mx, mst_bf16_to_fp32(l[v]));
        for (int64_t v = 0; v < V; v++) sum += expf(mst_bf16_to_fp32(l[v]) - mx);
        int32_t tg = a->targets[r];
        a->loss[r] = logf(sum) + mx - mst_bf16_to_fp32(l[tg]);
        for (int64_t v = 0; v < V; v++) {
            float p = expf(mst_bf16_to_fp32(l[v]) - mx) / sum;
            a->dlogits[r * V + v] = mst_fp32_to_bf16((p - (v == tg ? 1.0f : 0.0f)) * a->scale);
        }
    }
    return MST_OK;
}

/* Chunk sums in fp32, then the chunk sums in chunk order (as CUDA does). */
mst_status mst_cpu_sumsq(mst_ctx_t* ctx, const mst_sumsq_args* a) {
    (void)ctx;
    const int64_t chunk = (a->n + MST_SUMSQ_PARTS - 1) / MST_SUMSQ_PARTS;
#pragma omp parallel for if (a->n > 1 << 20)
    for (int64_t p = 0; p < MST_SUMSQ_PARTS; p++) {
        float part = 0.0f;
        int64_t b = p * chunk, e = b + chunk < a->n ? b + chunk : a->n;
        for (int64_t i = b; i < e; i++) part += a->plain ? a->x[i] : a->x[i] * a->x[i];
        a->partial[p] = part;
    }
    float total = a->base ? *a->base : 0.0f;
    for (int64_t p = 0; p < MST_SUMSQ_PARTS; p++) total += a->partial[p];
    *a->out = total;
    return MST_OK;
}

mst_status mst_cpu_adamw(mst_ctx_t* ctx, const mst_adamw_args* a) {
    (void)ctx;
    if (*a->flag != 0) return MST_OK; /* invalid step: no update */
    float norm = sqrtf(*a->grad_sumsq);
    float gs = norm > a->clip ? a->clip / norm : 1.0f;
    const float lr = a->hyper[MST_HYPER_LR], bc1 = a->hyper[MST_HYPER_BC1], bc2 = a->hyper[MST_HYPER_BC2];
    float* m32 = (float*)a->m, *v32 = (float*)a->v;        /* [n] fp32 moments */
    uint16_t* m16 = (uint16_t*)a->m, *v16 = (uint16_t*)a->v; /* [n] bf16 moments */
    const int bf = a->moments_bf16;
    for (int64_t i = 0; i < a->n; i++) {
        float g = a->grad[i] * gs;
        float m = a->beta1 * (bf ? mst_bf16_to_fp32(m16[i]) : m32[i]) + (1.0f - a->beta1) * g;
        float v = a->beta2 * (bf ? mst_bf16_to_fp32(v16[i]) : v32[i]) + (1.0f - a->beta2) * g * g;
        if (bf) m16[i] = mst_fp32_to_bf16(m), v16[i] = mst_fp32_to_bf16(v);
        else m32[i] = m, v32[i] = v;
        float p = a->master[i] * (1.0f - lr * a->weight_decay);
        p -= lr * (m / bc1) / (sqrtf(v / bc2) + a->eps);
        a->master[i] = p;
        a->w[i] = mst_fp32_to_bf16(p);
    }
    return MST_OK;
}

mst_status mst_cpu_sum(mst_ctx_t* ctx, const mst_sum_args* a) {
    (void)ctx;
    double lane[MST_SUM_LANES] = {0};
    for (int64_t i = 0; i < a->n; i++) lane[i % MST_SUM_LANES] += (double)a->x[i];
    double s = 0.0;
    for (int i = 0; i < MST_SUM_LANES; i++) s += lane[i];
    *a->out = s;
    return MST_OK;
}

const mst_model_backend mst_model_backend_cpu = {
    .name = "cpu",
    .attn_scratch = 0, /* scratch of its own, per call */
    .mm = mst_cpu_mm,
    .norm_forward = mst_cpu_norm_forward,
    .norm_backward = mst_cpu_norm_backward,
    .add = mst_cpu_add,
    .embed_forward = mst_cpu_embed_forward,
    .embed_backward = mst_cpu_embed_backward,
    .xent = mst_cpu_xent,
    .qk_forward = mst_cpu_qk_forward,
    .qk_backward = mst_cpu_qk_backward,
    .attn_forward = mst_cpu_attn_forward,
    .attn_backward = mst_cpu_attn_backward,
    .attn_flash_check = NULL, /* every head dim */
    .attn_flash_forward = mst_cpu_attn_flash_forward,
    .attn_flash_backward = mst_cpu_attn_flash_backward,
    .route_forward = mst_cpu_route_forward,
    .route_backward = mst_cpu_route_backward,
    .route_peak = mst_cpu_route_peak,
    .rows_gather = mst_cpu_rows_gather,
    .rows_sum = mst_cpu_rows_sum,
    .sumsq = mst_cpu_sumsq,
    .adamw = mst_cpu_adamw,
    .sum = mst_cpu_sum,
};
