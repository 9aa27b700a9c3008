/*
 * activation.c (CPU) — reference grouped MLP activation, forward and
 * backward: z = act(h) * p; dh = d act(h) * dz * p; dprobs = dz . act(h)
 * (+ dy . b2[g], the prob-scaled fc2 bias). fp32 math (activation_math.h),
 * bf16 rounding on store, sums in column order. Rows past sum(counts) are
 * neither read nor written.
 */
#include <stdlib.h>
#include <string.h>

#include "../../core/context.h"
#include "../activation_math.h"
#include "cpu_ops.h"

/* Element c of an h row (NULL: zeros). */
static float h_value(const uint16_t* h, int64_t c) { return h ? mst_bf16_to_fp32(h[c]) : 0.0f; }

mst_status mst_cpu_act_forward(mst_ctx_t* ctx, const mst_act_args* a) {
    int64_t* off;
    MST_TRY(mst_cpu_offsets(ctx, a->counts, a->n_groups, a->max_rows, &off));
    const int64_t F = a->ffn, n = off[a->n_groups];
    const mst_act_param q = mst_act_param_make(a->act, a->limit, a->alpha);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t* h = mst_act_h_row(a, r); /* [2F] */
        for (int64_t c = 0; c < F; c++) {
            float z0 = mst_act_value(q, h_value(h, c), h_value(h, F + c));
            a->z[r * F + c] = mst_fp32_to_bf16(z0 * a->probs[r]);
        }
        uint16_t* ho = mst_paged_out_row(&a->h_out, r, 4 * F); /* [2F] claimed pages */
        uint16_t* zo = mst_paged_out_row(&a->z_out, r, 2 * F); /* [F]              */
        if (ho && h) memcpy(ho, h, (size_t)(4 * F));
        else if (ho) memset(ho, 0, (size_t)(4 * F));
        if (zo) memcpy(zo, a->z + r * F, (size_t)(2 * F));
    }
    free(off);
    return MST_OK;
}

/* dy[r] . b2[g] in column order. */
static float bias_term(const mst_act_args* a, int64_t r, int32_t g) {
    float acc = 0.0f;
    for (int64_t c = 0; c < a->hidden; c++)
        acc += mst_bf16_to_fp32(a->dy[r * a->hidden + c]) *
               mst_bf16_to_fp32(a->b2[(int64_t)g * a->hidden + c]);
    return acc;
}

mst_status mst_cpu_act_backward(mst_ctx_t* ctx, const mst_act_args* a) {
    int64_t* off;
    MST_TRY(mst_cpu_offsets(ctx, a->counts, a->n_groups, a->max_rows, &off));
    const int64_t F = a->ffn;
    const mst_act_param q = mst_act_param_make(a->act, a->limit, a->alpha);
    for (int32_t g = 0; g < a->n_groups; g++) {
        for (int64_t r = off[g]; r < off[g + 1]; r++) {
            const uint16_t* h = mst_act_h_row(a, r); /* [2F] */
            uint16_t* dh = a->dh + r * 2 * F;        /* [2F] */
            float p = a->probs[r], dprob = 0.0f;
            for (int64_t c = 0; c < F; c++) {
                float dz = mst_bf16_to_fp32(a->dz[r * F + c]), da, db;
                float z0 = mst_act_grad(q, h_value(h, c), h_value(h, F + c), dz * p, &da, &db);
                dh[c] = mst_fp32_to_bf16(da);
                dh[F + c] = mst_fp32_to_bf16(db);
                dprob += dz * z0;
            }
            a->dprobs[r] = a->b2 ? dprob + bias_term(a, r, g) : dprob;
        }
    }
    free(off);
    return MST_OK;
}
