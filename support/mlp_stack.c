/*
 * mlp_stack.c — a stack of grouped-MLP layers run along a pipeline schedule
 * through the memory manager (see mlp_stack.h). Forward of a chunk: its
 * layers in order, the chunk input kept for layer recompute where the plan
 * says so; backward: its layers in reverse, a recomputed chunk rerun from its
 * saved input just before the backward of its last layer.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/internal.h"
#include "mlp_stack.h"

/* n bf16 values ~ U(-a, a) uploaded to dst; past 2^22 values a random
 * block repeats (large benchmark buffers stay cheap to fill). */
static mst_status upload_bf16(mst_ctx_t* ctx, void* dst, size_t n, double a, uint64_t* seed) {
    size_t block = n < ((size_t)1 << 22) ? n : ((size_t)1 << 22);
    uint16_t* h = (uint16_t*)malloc(block * 2);
    if (!h) return mst_set_error(MST_ERR_OOM, "host staging of %zu values", block);
    for (size_t i = 0; i < block; i++) h[i] = mst_fp32_to_bf16((float)(a * (2 * mst_splitmix_unit(seed) - 1)));
    mst_status st = MST_OK;
    for (size_t off = 0; off < n && st == MST_OK; off += block) {
        size_t len = n - off < block ? n - off : block;
        st = mst_copy_h2b(ctx, (uint16_t*)dst + off, h, len * 2);
    }
    free(h);
    return st;
}

static int64_t idx(const mst_stack* s, int32_t a, int32_t mb) { return (int64_t)a * s->n_micro + mb; }

mst_status mst_stack_create(mst_ctx_t* ctx, const mst_mlp_config* mlp, int32_t n_layers,
                            int32_t n_micro, int32_t virtual_stages, int64_t max_rows,
                            uint64_t seed, mst_stack* out) {
    memset(out, 0, sizeof *out);
    if (n_layers < 1 || n_micro < 1 || virtual_stages < 1 || n_layers % virtual_stages || max_rows < 1)
        return mst_set_error(MST_ERR_INVALID, "stack of %d layers, %d microbatches, %d chunks, %lld rows",
                             n_layers, n_micro, virtual_stages, (long long)max_rows);
    out->ctx = ctx;
    out->mlp = *mlp;
    out->n_layers = n_layers;
    out->n_micro = n_micro;
    out->virtual_stages = virtual_stages;
    out->max_rows = max_rows;
    const int64_t E = mlp->n_groups, H = mlp->hidden, F = mlp->ffn, R = max_rows;
    const int64_t LM = (int64_t)n_layers * n_micro, VM = (int64_t)(virtual_stages + 1) * n_micro;
    size_t w_elems = (size_t)(E * 2 * F * H + E * H * F); /* per layer */
    out->w = (mst_mlp_weights*)calloc((size_t)n_layers, sizeof *out->w);
    out->counts = (mst_tensor*)calloc((size_t)LM, sizeof(mst_tensor));
    out->probs = (mst_tensor*)calloc((size_t)LM, sizeof(mst_tensor));
    out->dprobs = (mst_tensor*)calloc((size_t)LM, sizeof(mst_tensor));
    out->io = (mst_tensor*)calloc((size_t)VM, sizeof(mst_tensor));
    out->grad = (mst_tensor*)calloc((size_t)VM, sizeof(mst_tensor));
    if (!out->w || !out->counts || !out->probs || !out->dprobs || !out->io || !out->grad) {
        mst_stack_destroy(out);
        return mst_set_error(MST_ERR_OOM, "stack tables");
    }
    out->gbuf_bytes = w_elems * 4 * (size_t)n_layers;
    size_t row_bytes = (size_t)(R * H * 2);
    size_t arena = (size_t)LM * (size_t)(E * 4 + 2 * R * 4) + (size_t)(2 * VM + 4) * row_bytes;
    mst_status st = mst_alloc(ctx, w_elems * 2 * (size_t)n_layers, &out->wbuf);
    if (st == MST_OK) st = mst_alloc(ctx, out->gbuf_bytes, &out->gbuf);
    if (st == MST_OK) st = mst_alloc(ctx, arena, &out->arena);
    if (st != MST_OK) {
        mst_stack_destroy(out);
        return st;
    }
    uint16_t* wp = (uint16_t*)out->wbuf;
    float* gp = (float*)out->gbuf;
    for (int32_t l = 0; l < n_layers; l++) {
        mst_mlp_weights* w = &out->w[l];
        w->w1 = mst_tensor_make(wp, MST_DTYPE_BF16, E * 2 * F, H);
        w->w2 = mst_tensor_make(wp + E * 2 * F * H, MST_DTYPE_BF16, E * H, F);
        w->g_w1 = mst_tensor_make(gp, MST_DTYPE_FP32, E * 2 * F, H);
        w->g_w2 = mst_tensor_make(gp + E * 2 * F * H, MST_DTYPE_FP32, E * H, F);
        wp += w_elems;
        gp += w_elems;
    }
    st = upload_bf16(ctx, out->wbuf, w_elems * (size_t)n_layers, 1.7 / sqrt((double)H), &seed);
    char* a = (char*)out->arena;
    for (int64_t i = 0; i < LM; i++) {
        out->counts[i] = mst_tensor_make(a, MST_DTYPE_INT32, E, 1), a += E * 4;
        out->probs[i] = mst_tensor_make(a, MST_DTYPE_FP32, R, 1), a += R * 4;
        out->dprobs[i] = mst_tensor_make(a, MST_DTYPE_FP32, R, 1), a += R * 4;
    }
    for (int64_t i = 0; i < VM; i++) {
        out->io[i] = mst_tensor_make(a, MST_DTYPE_BF16, R, H), a += row_bytes;
        out->grad[i] = mst_tensor_make(a, MST_DTYPE_BF16, R, H), a += row_bytes;
    }
    for (int k = 0; k < 2; k++) {
        out->act[k] = mst_tensor_make(a, MST_DTYPE_BF16, R, H), a += row_bytes;
        out->dact[k] = mst_tensor_make(a, MST_DTYPE_BF16, R, H), a += row_bytes;
    }
    if (st == MST_OK) st = mst_fill(ctx, out->arena, 0, arena);
    if (st != MST_OK) mst_stack_destroy(out);
    return st;
}

void mst_stack_destroy(mst_stack* s) {
    if (!s->ctx) return;
    mst_free(s->ctx, s->wbuf);
    mst_free(s->ctx, s->gbuf);
    mst_free(s->ctx, s->arena);
    free(s->w), free(s->counts), free(s->probs), free(s->dprobs), free(s->io), free(s->grad);
    memset(s, 0, sizeof *s);
}

mst_status mst_stack_route(mst_stack* s, const int32_t* host_counts, uint64_t seed) {
    const int32_t E = s->mlp.n_groups, L = s->n_layers, M = s->n_micro, V = s->virtual_stages;
    const int64_t R = s->max_rows, H = s->mlp.hidden;
    float* p = (float*)malloc(sizeof(float) * (size_t)R);
    if (!p) return mst_set_error(MST_ERR_OOM, "probs staging");
    mst_status st = MST_OK;
    for (int32_t mb = 0; mb < M && st == MST_OK; mb++) {
        int64_t total0 = -1;
        for (int32_t l = 0; l < L && st == MST_OK; l++) {
            const int32_t* c = host_counts + idx(s, l, mb) * E;
            int64_t total = 0;
            for (int32_t g = 0; g < E; g++) total += c[g];
            if (total0 >= 0 && total != total0)
                st = mst_set_error(MST_ERR_INVALID, "counts of layer %d, mb %d sum to %lld, layer 0 to %lld",
                                   l, mb, (long long)total, (long long)total0);
            total0 = total;
            for (int64_t r = 0; r < R; r++) p[r] = (float)(0.05 + 0.95 * mst_splitmix_unit(&seed));
            if (st == MST_OK) st = mst_copy_h2b(s->ctx, s->counts[idx(s, l, mb)].data, c, sizeof(int32_t) * E);
            if (st == MST_OK) st = mst_copy_h2b(s->ctx, s->probs[idx(s, l, mb)].data, p, sizeof(float) * R);
        }
        if (st == MST_OK) st = upload_bf16(s->ctx, s->io[idx(s, 0, mb)].data, (size_t)(R * H), 1.0, &seed);
        if (st == MST_OK) st = upload_bf16(s->ctx, s->grad[idx(s, V, mb)].data, (size_t)(R * H), 0.1, &seed);
    }
    free(p);
    return st;
}

static int32_t per_chunk(const mst_stack* s) { return s->n_layers / s->virtual_stages; }

/* Forward of chunk c: layer outputs inside the chunk go straight into the
 * next layer's KEEP buffer of fc1_input where it has one (no copy at its
 * commit), else into the ping-pong buffers. */
static mst_status forward_chunk(mst_stack* s, int32_t c, int32_t mb) {
    const int32_t lpc = per_chunk(s), first = c * lpc;
    mst_tensor x = s->io[idx(s, c, mb)], y;
    for (int32_t i = 0; i < lpc; i++) {
        int32_t l = first + i;
        const mst_saver* sv;
        MST_TRY(mst_memmgr_forward(s->mm, l, mb, &sv));
        if (mst_memmgr_recompute_chunk(s->mm, l) == l) { /* keep the recompute chunk's input */
            mst_tensor in;
            MST_TRY(mst_memmgr_chunk_input(s->mm, l, mb, &in));
            MST_TRY(mst_copy_b2b(s->ctx, in.data, x.data, mst_tensor_bytes(&x)));
        }
        if (i == lpc - 1) y = s->io[idx(s, c + 1, mb)];
        else {
            MST_TRY(mst_memmgr_keep_buffer(s->mm, l + 1, mb, MST_SAVED_FC1_INPUT, &y));
            if (!y.data) y = s->act[i & 1];
        }
        MST_TRY(mst_grouped_mlp_forward(s->ctx, &s->mlp, &s->w[l], &x, &s->probs[idx(s, l, mb)],
                                        &s->counts[idx(s, l, mb)], sv, &y));
        x = y;
    }
    return MST_OK;
}

/* Reruns the forward of recompute chunk [cs, last] from its saved input. */
static mst_status rerun(mst_stack* s, int32_t cs, int32_t last, int32_t mb) {
    mst_tensor x;
    MST_TRY(mst_memmgr_chunk_input(s->mm, cs, mb, &x));
    for (int32_t l = cs; l <= last; l++) {
        const mst_saver* sv;
        MST_TRY(mst_memmgr_recompute(s->mm, l, mb, &sv));
        mst_tensor* y = &s->act[(l - cs) & 1];
        MST_TRY(mst_grouped_mlp_forward(s->ctx, &s->mlp, &s->w[l], &x, &s->probs[idx(s, l, mb)],
                                        &s->counts[idx(s, l, mb)], sv, y));
        x = *y;
    }
    return MST_OK;
}

static mst_status backward_chunk(mst_stack* s, int32_t c, int32_t mb) {
    const int32_t lpc = per_chunk(s), first = c * lpc;
    const mst_tensor* dy = &s->grad[idx(s, c + 1, mb)];
    for (int32_t i = lpc - 1; i >= 0; i--) {
        int32_t l = first + i, cs = mst_memmgr_recompute_chunk(s->mm, l);
        if (cs >= 0 && (i == lpc - 1 || mst_memmgr_recompute_chunk(s->mm, l + 1) != cs))
            MST_TRY(rerun(s, cs, l, mb));
        const mst_saver* sv;
        MST_TRY(mst_memmgr_backward(s->mm, l, mb, &sv));
        mst_tensor* dx = i == 0 ? &s->grad[idx(s, c, mb)] : &s->dact[i & 1];
        MST_TRY(mst_grouped_mlp_backward(s->ctx, &s->mlp, &s->w[l], dy, &s->counts[idx(s, l, mb)], sv,
                                         dx, &s->dprobs[idx(s, l, mb)], MST_WGRAD_ACCUMULATE));
        dy = dx;
    }
    return MST_OK;
}

mst_status mst_stack_step(mst_stack* s, const mst_sched_entry* schedule, int32_t n_schedule,
                          int measuring) {
    if (!s->mm) return mst_set_error(MST_ERR_STATE, "stack has no memory manager");
    MST_TRY(mst_fill(s->ctx, s->gbuf, 0, s->gbuf_bytes));
    MST_TRY(mst_memmgr_step_begin(s->mm, measuring));
    for (int32_t i = 0; i < n_schedule; i++) {
        mst_sched_entry e = schedule[i];
        MST_TRY(e.backward ? backward_chunk(s, e.chunk, e.microbatch) : forward_chunk(s, e.chunk, e.microbatch));
    }
    return mst_memmgr_step_end(s->mm);
}
