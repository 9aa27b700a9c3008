/*
 * grouped_linear.c (CPU) — reference grouped linear: forward (TN), dgrad
 * (NN) and wgrad (NT) per group through sgemm on fp32 copies of the
 * bf16 operands (mst_cpu_sgemm); fp32 accumulation, bf16 rounding (nearest
 * even) on store.
 * Rows past sum(counts) are neither read nor written.
 */
#include <string.h>

#include "../../core/context.h"
#include "cpu_ops.h"

mst_status mst_cpu_offsets(mst_ctx_t* ctx, const int32_t* counts, int32_t n_groups, int64_t max_rows,
                           int64_t** off) {
    *off = (int64_t*)malloc(sizeof(int64_t) * ((size_t)n_groups + 1));
    if (!*off) return mst_set_error(MST_ERR_OOM, "cpu scratch (offsets)");
    mst_status st = mst_counts_offsets(counts, n_groups, max_rows, *off);
    if (st == MST_ERR_COUNTS) *ctx->err_flag |= MST_FLAG_COUNTS;
    if (st != MST_OK) {
        free(*off);
        *off = NULL;
    }
    return st;
}

/* Host scratch for one call: off [E+1] and three fp32 staging buffers. */
typedef struct gl_scratch {
    int64_t* off;   /* [E+1] */
    float* rows_a;  /* [n, max(I, O)] */
    float* rows_b;  /* [n, max(I, O)] */
    float* weight;  /* [O, I] */
} gl_scratch;

static void scratch_free(gl_scratch* s) {
    free(s->off);
    free(s->rows_a);
    free(s->rows_b);
    free(s->weight);
}

static mst_status scratch_make(mst_ctx_t* ctx, const mst_gl_args* a, gl_scratch* s) {
    memset(s, 0, sizeof *s);
    MST_TRY(mst_cpu_offsets(ctx, a->counts, a->n_groups, a->max_rows, &s->off));
    int64_t n = s->off[a->n_groups] > 0 ? s->off[a->n_groups] : 1;
    size_t width = (size_t)(a->in > a->out ? a->in : a->out);
    s->rows_a = (float*)malloc(sizeof(float) * (size_t)n * width);
    s->rows_b = (float*)malloc(sizeof(float) * (size_t)n * width);
    s->weight = (float*)malloc(sizeof(float) * (size_t)a->out * (size_t)a->in);
    if (!s->rows_a || !s->rows_b || !s->weight) {
        scratch_free(s);
        return mst_set_error(MST_ERR_OOM, "cpu scratch for %lld rows", (long long)n);
    }
    return MST_OK;
}

/* rows_b [n, n_out] = rows [n, k] . op(W[g]) in fp32: op = W^T for the
 * forward (k = I, n_out = O), W for the dgrad (k = O, n_out = I). */
static void rows_times_weight(gl_scratch* s, const mst_gl_args* a, int32_t g, const uint16_t* rows,
                              int64_t n, int forward) {
    const int64_t I = a->in, O = a->out, k = forward ? I : O, n_out = forward ? O : I;
    mst_bf16_to_fp32_array(s->rows_a, rows, (size_t)(n * k));
    mst_bf16_to_fp32_array(s->weight, a->w + (int64_t)g * O * I, (size_t)(O * I));
    mst_cpu_sgemm(0, forward, n, n_out, k, s->rows_a, k, s->weight, I, 0.0f, s->rows_b, n_out);
}

/* The forward (y = x W^T + bias[g] s) or the dgrad (dx = dy W), group by group. */
static mst_status rows_op(mst_ctx_t* ctx, const mst_gl_args* a, int forward) {
    gl_scratch s;
    MST_TRY(scratch_make(ctx, a, &s));
    const int64_t I = a->in, O = a->out, k = forward ? I : O, n_out = forward ? O : I;
    const uint16_t* in = forward ? a->x : a->dy; /* [R, k]     */
    uint16_t* out = forward ? a->y : a->dx;      /* [R, n_out] */
    for (int32_t g = 0; g < a->n_groups; g++) {
        int64_t r0 = s.off[g], n = s.off[g + 1] - r0;
        if (n == 0) continue;
        rows_times_weight(&s, a, g, in + r0 * k, n, forward);
        for (int64_t r = 0; r < n && forward && a->bias; r++) {
            float sc = a->scale ? a->scale[r0 + r] : 1.0f;
            for (int64_t o = 0; o < O; o++)
                s.rows_b[r * O + o] += mst_bf16_to_fp32(a->bias[(int64_t)g * O + o]) * sc;
        }
        mst_fp32_to_bf16_array(out + r0 * n_out, s.rows_b, (size_t)(n * n_out));
    }
    scratch_free(&s);
    return MST_OK;
}

mst_status mst_cpu_gl_forward(mst_ctx_t* ctx, const mst_gl_args* a) { return rows_op(ctx, a, 1); }
mst_status mst_cpu_gl_dgrad(mst_ctx_t* ctx, const mst_gl_args* a) { return rows_op(ctx, a, 0); }

/* dbias[g] (+)= sum_r dy[r] s[r], summed in row order; ds[r] = dy[r] . bias[g]. */
static void bias_grads(const mst_gl_args* a, int32_t g, int64_t r0, int64_t n, const float* dy) {
    const int64_t O = a->out;
    if (a->main_grad_b) {
        float* db = a->main_grad_b + (int64_t)g * O;
        for (int64_t o = 0; o < O; o++) {
            float acc = 0.0f;
            for (int64_t r = 0; r < n; r++) acc += dy[r * O + o] * (a->scale ? a->scale[r0 + r] : 1.0f);
            db[o] = a->accumulate ? db[o] + acc : acc;
        }
    }
    if (a->dscale) {
        for (int64_t r = 0; r < n; r++) {
            float acc = 0.0f;
            for (int64_t o = 0; o < O; o++)
                acc += dy[r * O + o] * mst_bf16_to_fp32(a->bias[(int64_t)g * O + o]);
            a->dscale[r0 + r] = acc;
        }
    }
}

/* Rows [r0, r0 + n) of wgrad's x as fp32 [n, I], from memory or pages. */
static void x_rows(const mst_gl_args* a, int64_t r0, int64_t n, float* out) {
    const int64_t I = a->in;
    if (!a->x_pages) {
        mst_bf16_to_fp32_array(out, a->x + r0 * I, (size_t)(n * I));
        return;
    }
    for (int64_t r = 0; r < n; r++) {
        const uint16_t* row = (const uint16_t*)mst_paged_row(a->x_pages, r0 + r, I * 2);
        if (row) mst_bf16_to_fp32_array(out + r * I, row, (size_t)I);
        else memset(out + r * I, 0, sizeof(float) * (size_t)I);
    }
}

/* Every page size: x's rows are converted row by row into the call's scratch. */
int mst_cpu_gl_wgrad_pages(mst_ctx_t* ctx, int64_t page_rows, int64_t in, int64_t out) {
    (void)ctx, (void)page_rows, (void)in, (void)out;
    return 1;
}

mst_status mst_cpu_gl_wgrad(mst_ctx_t* ctx, const mst_gl_args* a) {
    gl_scratch s;
    MST_TRY(scratch_make(ctx, a, &s));
    const int64_t I = a->in, O = a->out;
    for (int32_t g = 0; g < a->n_groups; g++) {
        int64_t r0 = s.off[g], n = s.off[g + 1] - r0;
        float* mg = a->main_grad_w + (int64_t)g * O * I;
        if (n == 0) { /* dW[g] = 0 */
            if (!a->accumulate) memset(mg, 0, sizeof(float) * (size_t)(O * I));
            if (!a->accumulate && a->main_grad_b) memset(a->main_grad_b + g * O, 0, sizeof(float) * (size_t)O);
            continue;
        }
        mst_bf16_to_fp32_array(s.rows_a, a->dy + r0 * O, (size_t)(n * O));
        x_rows(a, r0, n, s.rows_b);
        mst_cpu_sgemm(1, 0, O, I, n, s.rows_a, O, s.rows_b, I, a->accumulate ? 1.0f : 0.0f, mg, I);
        bias_grads(a, g, r0, n, s.rows_a);
    }
    scratch_free(&s);
    return MST_OK;
}
