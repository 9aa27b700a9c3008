/*
 * ep.c — the local halves of expert-parallel dispatch and combine on the CPU
 * (the reference the CUDA kernels of cuda/ep.cu are checked against; the ops
 * are described in ../ep_ops.h). Plain loops in entry, token and slot order.
 */
#include <stdlib.h>
#include <string.h>

#include "../../core/context.h"
#include "../ep_ops.h"

/* Row r (= d C + slot) of a [W, C, H] block buffer. */
static uint16_t* blk_row(const mst_ep_args* a, uint16_t* blk, int64_t r) { return blk + r * a->cols; }

static int valid_id(const mst_ep_args* a, int32_t g) { return g >= 0 && g < a->n_experts; }

static mst_status cpu_ep_route(mst_ctx_t* ctx, const mst_ep_args* a) {
    (void)ctx;
    const int32_t E = a->n_experts, El = a->n_local;
    const int64_t NK = a->n_tok * a->top_k;
    int32_t* next = (int32_t*)calloc((size_t)E, sizeof *next); /* [E] next slot, -1: skipped */
    if (!next) return mst_set_error(MST_ERR_OOM, "ep route scratch");
    for (int64_t i = 0; i < NK; i++) {
        if (valid_id(a, a->topk_idx[i])) next[a->topk_idx[i]]++;
        else mst_ep_flag(a->flag, MST_FLAG_COUNTS);
    }
    for (int32_t d = 0; d < a->world; d++) {
        int64_t total = 0;
        for (int32_t e = 0; e < El; e++) total += next[d * El + e];
        const int over = total > a->pair_rows;
        if (over) mst_ep_flag(a->flag, MST_FLAG_COUNTS);
        a->send_total[d] = over ? 0 : (int32_t)total;
        int32_t base = 0;
        for (int32_t e = 0; e < El; e++) {
            const int32_t n = next[d * El + e];
            a->send_counts[d * El + e] = over ? 0 : n;
            next[d * El + e] = over ? -1 : (int32_t)(d * a->pair_rows) + base;
            base += over ? 0 : n;
        }
    }
    for (int64_t i = 0; i < NK; i++) {
        const int32_t g = a->topk_idx[i];
        a->send_pos[i] = !valid_id(a, g) || next[g] < 0 ? -1 : next[g]++;
    }
    free(next);
    return MST_OK;
}

static mst_status cpu_ep_pack(mst_ctx_t* ctx, const mst_ep_args* a) {
    (void)ctx;
    const int64_t H = a->cols;
    for (int64_t i = 0; i < a->n_tok * a->top_k; i++) {
        const int32_t pos = a->send_pos[i];
        if (pos < 0) continue;
        memcpy(blk_row(a, a->blk, pos), a->tok + (i / a->top_k) * H, (size_t)H * 2);
        if (a->blk_p) a->blk_p[pos] = a->tok_p[i];
    }
    return MST_OK;
}

static mst_status cpu_ep_gather(mst_ctx_t* ctx, const mst_ep_args* a) {
    (void)ctx;
    const int64_t H = a->cols;
    const int32_t K = a->top_k;
    float* acc = (float*)malloc((size_t)H * sizeof *acc); /* [H] one token's sum */
    if (!acc) return mst_set_error(MST_ERR_OOM, "ep gather scratch");
    for (int64_t t = 0; t < a->n_tok; t++) {
        for (int64_t c = 0; c < H; c++) acc[c] = 0.0f;
        for (int32_t s = 0; s < K; s++) {
            const int64_t i = t * K + s;
            const int32_t pos = a->send_pos[i];
            if (a->tok_p_out) a->tok_p_out[i] = pos < 0 ? 0.0f : a->blk_p[pos];
            if (pos < 0 || !a->tok_out) continue;
            const float w = a->tok_p ? a->tok_p[i] : 1.0f;
            const uint16_t* src = blk_row(a, a->blk, pos);
            for (int64_t c = 0; c < H; c++) acc[c] += w * mst_bf16_to_fp32(src[c]);
        }
        if (a->tok_out) mst_fp32_to_bf16_array(a->tok_out + t * H, acc, (size_t)H);
    }
    free(acc);
    return MST_OK;
}

static mst_status cpu_ep_plan(mst_ctx_t* ctx, const mst_ep_args* a) {
    (void)ctx;
    mst_ep_plan_serial(a);
    return MST_OK;
}

/* Calls fn(a, slot, r) for every received slot (j C + i) and its expert
 * row r, blocks in order. */
static void each_slot(const mst_ep_args* a, void (*fn)(const mst_ep_args* a, int64_t slot, int64_t r)) {
    for (int32_t j = 0; j < a->world; j++)
        for (int64_t i = 0; i < a->pair_rows; i++) {
            const int64_t r = mst_ep_slot_row(a, j, i);
            if (r < 0) break;
            fn(a, (int64_t)j * a->pair_rows + i, r);
        }
}

static void unpack_slot(const mst_ep_args* a, int64_t slot, int64_t r) {
    const int64_t H = a->cols;
    const uint16_t* src = blk_row(a, a->blk, slot);
    const float p = a->blk_p ? a->blk_p[slot] : 1.0f;
    if (a->rows && a->scale)
        for (int64_t c = 0; c < H; c++) a->rows[r * H + c] = mst_fp32_to_bf16(p * mst_bf16_to_fp32(src[c]));
    else if (a->rows)
        memcpy(a->rows + r * H, src, (size_t)H * 2);
    if (a->rows_p) a->rows_p[r] = p;
    if (!a->dot_src) return;
    float dot = 0.0f;
    for (int64_t c = 0; c < H; c++) dot += mst_bf16_to_fp32(src[c]) * mst_bf16_to_fp32(a->dot_src[r * H + c]);
    a->dot_out[slot] = dot;
}

static void repack_slot(const mst_ep_args* a, int64_t slot, int64_t r) {
    memcpy(blk_row(a, a->blk, slot), a->rows_in + r * a->cols, (size_t)a->cols * 2);
    if (a->blk_p) a->blk_p[slot] = a->rows_p_in[r];
}

static mst_status cpu_ep_unpack(mst_ctx_t* ctx, const mst_ep_args* a) {
    (void)ctx;
    each_slot(a, unpack_slot);
    return MST_OK;
}

static mst_status cpu_ep_repack(mst_ctx_t* ctx, const mst_ep_args* a) {
    (void)ctx;
    each_slot(a, repack_slot);
    return MST_OK;
}

const mst_ep_ops mst_ep_ops_cpu = {
    .route = cpu_ep_route,
    .pack = cpu_ep_pack,
    .gather = cpu_ep_gather,
    .plan = cpu_ep_plan,
    .unpack = cpu_ep_unpack,
    .repack = cpu_ep_repack,
};
