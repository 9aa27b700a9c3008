/*
 * moe.c — the MoE block of a layer, forward and backward side by side:
 * router logits (matmul), route (softmax, top-k, dropless plan with counts
 * on the backend, over-budget flag, load-balancing loss), dispatch of token
 * copies into the --ep groups' grouped-rows buffers, one grouped MLP call per
 * group, combine (the MLP already scales each row by its router prob).
 */
#include "moe.h"

#include "ops.h"

/* The grouped MLP's view of group g: its experts' weights, gradients, rows. */
typedef struct group_view {
    mst_mlp_config cfg;
    mst_mlp_weights w;
    mst_tensor counts;  /* [E/G, 1] int32 */
} group_view;

static group_view group(mst_model* m, int32_t l, int32_t g) {
    const mst_model_config* c = &m->cfg;
    const int64_t H = c->hidden, F = c->ffn, EG = c->experts / c->ep;
    const mst_layer_params* p = &m->lp[l];
    group_view v;
    v.cfg = mst_mlp_config_default((int32_t)EG, H, F);
    mst_mlp_weights w = {0};
    w.w1 = mst_tensor_make(m->w + p->w1 + g * EG * 2 * F * H, MST_DTYPE_BF16, EG * 2 * F, H);
    w.w2 = mst_tensor_make(m->w + p->w2 + g * EG * H * F, MST_DTYPE_BF16, EG * H, F);
    w.g_w1 = mst_tensor_make(m->grad + p->w1 + g * EG * 2 * F * H, MST_DTYPE_FP32, EG * 2 * F, H);
    w.g_w2 = mst_tensor_make(m->grad + p->w2 + g * EG * H * F, MST_DTYPE_FP32, EG * H, F);
    w.b1.dtype = w.b2.dtype = MST_DTYPE_BF16;
    w.g_b1.dtype = w.g_b2.dtype = MST_DTYPE_FP32;
    v.w = w;
    v.counts = mst_tensor_make(m->acts[l].counts + g * EG, MST_DTYPE_INT32, EG, 1);
    return v;
}

static mst_tensor rows_of(void* base, mst_dtype dt, int64_t R, int64_t g, int64_t cols) {
    return mst_tensor_make((char*)base + (size_t)(g * R * cols) * mst_dtype_size(dt), dt, R, cols);
}

static mst_route_args route_args(mst_model* m, mst_layer_acts* a) {
    const mst_model_config* c = &m->cfg;
    mst_route_args r = {.n_tok = c->batch * c->seq, .n_experts = c->experts, .top_k = c->top_k,
                        .n_groups = c->ep, .max_rows = m->max_rows, .aux_coef = c->aux_coef,
                        .logits = a->rlogits, .probs = a->rprobs, .topk_idx = a->topk_idx,
                        .topk_w = a->topk_w, .pos = a->pos, .counts = a->counts, .load = a->load,
                        .peak_rows = a->peak, .aux_loss = a->aux, .flag = m->ctx->err_flag};
    return r;
}

mst_status mst_moe_forward(mst_model* m, int32_t l, uint16_t* y) {
    const mst_model_config* c = &m->cfg;
    mst_ctx_t* ctx = m->ctx;
    mst_layer_acts* a = &m->acts[l];
    const int64_t N = c->batch * c->seq, H = c->hidden, R = m->max_rows;
    mst_mm_args lg = {.trans_b = 1, .m = N, .n = c->experts, .k = H, .a = a->b, .lda = H,
                      .b = m->w + m->lp[l].wr, .ldb = H, .c32 = a->rlogits, .ldc = c->experts};
    MST_TRY(MST_MODEL_OP(ctx, mm, &lg));
    mst_route_args r = route_args(m, a);
    MST_TRY(MST_MODEL_OP(ctx, route_forward, &r));
    mst_rows_args d = {.n_tok = N, .top_k = c->top_k, .cols = H, .pos = a->pos, .src = a->b,
                       .dst = m->rows, .src_p = a->topk_w, .dst_p = m->prow};
    MST_TRY(MST_MODEL_OP(ctx, rows_gather, &d));
    for (int32_t g = 0; g < c->ep; g++) {
        group_view v = group(m, l, g);
        mst_tensor x = rows_of(m->rows, MST_DTYPE_BF16, R, g, H);
        mst_tensor p = rows_of(m->prow, MST_DTYPE_FP32, R, g, 1);
        mst_tensor yr = rows_of(m->yrows, MST_DTYPE_BF16, R, g, H);
        MST_TRY(mst_grouped_mlp_forward(ctx, &v.cfg, &v.w, &x, &p, &v.counts,
                                        mst_saver_basic_get(a->savers[g]), &yr));
    }
    mst_rows_args s = {.n_tok = N, .top_k = c->top_k, .cols = H, .pos = a->pos, .src = m->yrows, .dst = y};
    return MST_MODEL_OP(ctx, rows_sum, &s);
}

mst_status mst_moe_backward(mst_model* m, int32_t l, const uint16_t* dy, uint16_t* dx) {
    const mst_model_config* c = &m->cfg;
    mst_ctx_t* ctx = m->ctx;
    mst_layer_acts* a = &m->acts[l];
    const int64_t N = c->batch * c->seq, H = c->hidden, R = m->max_rows, E = c->experts;
    mst_rows_args d = {.n_tok = N, .top_k = c->top_k, .cols = H, .pos = a->pos, .src = dy, .dst = m->drows};
    MST_TRY(MST_MODEL_OP(ctx, rows_gather, &d));
    for (int32_t g = 0; g < c->ep; g++) {
        group_view v = group(m, l, g);
        mst_tensor dyr = rows_of(m->drows, MST_DTYPE_BF16, R, g, H);
        mst_tensor dxr = rows_of(m->dxrows, MST_DTYPE_BF16, R, g, H);
        mst_tensor dp = rows_of(m->dprow, MST_DTYPE_FP32, R, g, 1);
        MST_TRY(mst_grouped_mlp_backward(ctx, &v.cfg, &v.w, &dyr, &v.counts,
                                         mst_saver_basic_get(a->savers[g]), &dxr, &dp,
                                         MST_WGRAD_ACCUMULATE));
    }
    mst_rows_args s = {.n_tok = N, .top_k = c->top_k, .cols = H, .pos = a->pos, .src = m->dxrows,
                       .dst = dx, .src_p = m->dprow, .dst_p = m->dtopk};
    MST_TRY(MST_MODEL_OP(ctx, rows_sum, &s));
    mst_route_args r = route_args(m, a);
    r.aux_coef = c->aux_coef / (float)m->n_micro; /* the loss is the mean over microbatches */
    r.dtopk_w = m->dtopk;
    r.dlogits = m->drl;
    MST_TRY(MST_MODEL_OP(ctx, route_backward, &r));
    /* dx += drl Wr; gWr += drl^T b */
    mst_mm_args dg = {.m = N, .n = H, .k = E, .a = m->drl, .lda = E, .b = m->w + m->lp[l].wr,
                      .ldb = H, .c16 = dx, .ldc = H, .accumulate = 1};
    MST_TRY(MST_MODEL_OP(ctx, mm, &dg));
    return mst_op_linear_wgrad(ctx, N, H, E, m->drl, a->b, m->grad + m->lp[l].wr, H);
}
