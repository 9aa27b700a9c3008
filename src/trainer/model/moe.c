/*
 * moe.c — the MoE block of a layer, forward and backward side by side:
 * router logits (matmul), route (softmax, top-k renormalised, dropless plan
 * with counts on the backend, over-budget flag), the token copies
 * to the experts' grouped rows (written straight into the buffers the
 * memory manager hands out for fc1_input and probs), one grouped MLP over
 * the experts held here, and back (the MLP already scales each row by its
 * router prob, so combine is a sum over the k slots). On one rank the
 * copies go into the --ep groups' packed rows (rows gather / sum); on W
 * ranks through the communicator's dispatch and combine, with the router's
 * loads summed over the ranks first (the load-balancing loss and its
 * gradient are those of the global batch). The loss spans the main layers
 * of one microbatch (transformers' load_balancing_loss_func), so the
 * backward computes it, from the loads every main layer's forward left in
 * the activation set; the MTP layer's spans itself.
 */
#include "moe.h"

#include "ops.h"

static mst_mlp_config mlp_config(const mst_model* m) {
    return mst_mlp_config_default(m->n_local, m->cfg.hidden, m->cfg.ffn);
}

static mst_mlp_weights mlp_weights(const mst_model* m, int32_t l) {
    const mst_model_config* c = &m->cfg;
    const int64_t H = c->hidden, F = c->ffn, El = m->n_local;
    const mst_layer_params* p = &m->lp[l];
    mst_mlp_weights w = {0};
    w.w1 = mst_tensor_make(m->w + p->w1, MST_DTYPE_BF16, El * 2 * F, H);
    w.w2 = mst_tensor_make(m->w + p->w2, MST_DTYPE_BF16, El * H, F);
    w.g_w1 = mst_tensor_make(m->grad + p->w1, MST_DTYPE_FP32, El * 2 * F, H);
    w.g_w2 = mst_tensor_make(m->grad + p->w2, MST_DTYPE_FP32, El * H, F);
    w.b1.dtype = w.b2.dtype = MST_DTYPE_BF16; /* no biases */
    w.g_b1.dtype = w.g_b2.dtype = MST_DTYPE_FP32;
    return w;
}

/* One rank: the plan into the G groups' packed rows. W ranks: route's plan
 * is one group that never overflows (dispatch checks the budget where the
 * rows arrive), its peak unused; the loads are summed over the ranks before
 * route_peak (peak rows per rank) and the backward (the loss). */
static mst_route_args route_args(mst_model* m, int32_t l, mst_layer_acts* a) {
    const mst_model_config* c = &m->cfg;
    const int64_t N = c->batch * c->seq;
    const int dist = m->dist.ep != NULL;
    mst_route_args r = {.n_tok = N, .n_experts = c->experts, .top_k = c->top_k,
                        .n_groups = dist ? 1 : c->ep, .norm_topk = c->norm_topk_prob,
                        .max_rows = dist ? N * c->top_k : m->max_rows, .aux_coef = c->aux_coef,
                        .grad_scale = 1.0f / (float)m->n_micro, /* the loss is the mean over microbatches */
                        .n_layers = a->n_loads, .loads = a->loads, .logits = a->rlogits, .probs = a->rprobs,
                        .topk_idx = a->topk_idx, .topk_w = a->topk_w, .pos = a->pos, .counts = a->counts,
                        .load = a->load, .peak_rows = dist ? m->peak_local : m->peak + (int64_t)l * c->ep,
                        .aux_loss = a->aux, .world = m->dist.world, .flag = m->ctx->err_flag};
    return r;
}

static mst_status route(mst_model* m, int32_t l, mst_layer_acts* a) {
    mst_route_args r = route_args(m, l, a);
    MST_TRY(MST_MODEL_OP(m, route_forward, &r));
    if (!m->dist.ep) return MST_OK;
    MST_TRY(mst_ep_allreduce(m->dist.ep, a->load, m->cfg.experts, MST_EP_SUM_I32));
    r.n_groups = m->cfg.ep;
    r.peak_rows = m->peak + (int64_t)l * m->cfg.ep;
    return MST_MODEL_OP(m, route_peak, &r);
}

mst_status mst_moe_forward(mst_model* m, int32_t l, mst_layer_acts* a, const mst_saver* saver, uint16_t* y) {
    const mst_model_config* c = &m->cfg;
    mst_ctx_t* ctx = m->ctx;
    const int64_t N = c->batch * c->seq, H = c->hidden, GR = m->max_rows * m->row_groups, K = c->top_k;
    mst_mm_args lg = {.trans_b = 1, .m = N, .n = c->experts, .k = H, .a = a->b, .lda = H,
                      .b = m->w + m->lp[l].wr, .ldb = H, .c32 = a->rlogits, .ldc = c->experts};
    MST_TRY(MST_MODEL_OP(m, mm, &lg));
    MST_TRY(route(m, l, a));
    mst_tensor x, p;
    MST_TRY(saver->produce(saver->self, MST_SAVED_FC1_INPUT, GR, H, MST_DTYPE_BF16, &x));
    MST_TRY(saver->produce(saver->self, MST_SAVED_PROBS, GR, 1, MST_DTYPE_FP32, &p));
    mst_tensor counts = mst_tensor_make(a->counts, MST_DTYPE_INT32, m->n_local, 1);
    mst_tensor tok = mst_tensor_make(a->b, MST_DTYPE_BF16, N, H), yt = mst_tensor_make(y, MST_DTYPE_BF16, N, H);
    mst_tensor idx = mst_tensor_make(a->topk_idx, MST_DTYPE_INT32, N, K), tw = mst_tensor_make(a->topk_w, MST_DTYPE_FP32, N, K);
    if (m->dist.ep) {
        MST_TRY(mst_ep_dispatch(m->dist.ep, a->eph, &tok, &idx, &tw, &x, &p, &counts));
    } else {
        mst_rows_args d = {.n_tok = N, .top_k = K, .cols = H, .pos = a->pos, .src = a->b,
                           .dst = (uint16_t*)x.data, .src_p = a->topk_w, .dst_p = (float*)p.data};
        MST_TRY(MST_MODEL_OP(m, rows_gather, &d));
    }
    mst_mlp_config mc = mlp_config(m);
    mst_mlp_weights w = mlp_weights(m, l);
    mst_tensor yr = mst_tensor_make(m->yrows, MST_DTYPE_BF16, GR, H);
    MST_TRY(mst_grouped_mlp_forward(ctx, &mc, &w, &x, &p, &counts, saver, &yr));
    if (m->dist.ep) return mst_ep_combine(m->dist.ep, a->eph, &yr, NULL, &yt);
    mst_rows_args s = {.n_tok = N, .top_k = K, .cols = H, .pos = a->pos, .src = m->yrows, .dst = y};
    return MST_MODEL_OP(m, rows_sum, &s);
}

mst_status mst_moe_backward(mst_model* m, int32_t l, mst_layer_acts* a, const mst_saver* saver,
                            const uint16_t* dy, uint16_t* dx) {
    const mst_model_config* c = &m->cfg;
    mst_ctx_t* ctx = m->ctx;
    const int64_t N = c->batch * c->seq, H = c->hidden, E = c->experts, GR = m->max_rows * m->row_groups, K = c->top_k;
    mst_tensor dyr = mst_tensor_make(m->drows, MST_DTYPE_BF16, GR, H);
    mst_tensor dyt = mst_tensor_make((void*)dy, MST_DTYPE_BF16, N, H), dxt = mst_tensor_make(dx, MST_DTYPE_BF16, N, H);
    if (m->dist.ep) {
        MST_TRY(mst_ep_combine_backward(m->dist.ep, a->eph, &dyt, NULL, NULL, &dyr, NULL));
    } else {
        mst_rows_args d = {.n_tok = N, .top_k = K, .cols = H, .pos = a->pos, .src = dy, .dst = m->drows};
        MST_TRY(MST_MODEL_OP(m, rows_gather, &d));
    }
    mst_mlp_config mc = mlp_config(m);
    mst_mlp_weights w = mlp_weights(m, l);
    mst_tensor counts = mst_tensor_make(a->counts, MST_DTYPE_INT32, m->n_local, 1);
    mst_tensor dxr = mst_tensor_make(m->dxrows, MST_DTYPE_BF16, GR, H);
    mst_tensor dp = mst_tensor_make(m->dprow, MST_DTYPE_FP32, GR, 1);
    MST_TRY(mst_grouped_mlp_backward(ctx, &mc, &w, &dyr, &counts, saver, &dxr, &dp, MST_WGRAD_ACCUMULATE));
    if (m->dist.ep) {
        mst_tensor dtk = mst_tensor_make(m->dtopk, MST_DTYPE_FP32, N, K);
        MST_TRY(mst_ep_dispatch_backward(m->dist.ep, a->eph, &dxr, &dp, &dxt, &dtk));
    } else {
        mst_rows_args s = {.n_tok = N, .top_k = K, .cols = H, .pos = a->pos, .src = m->dxrows,
                           .dst = dx, .src_p = m->dprow, .dst_p = m->dtopk};
        MST_TRY(MST_MODEL_OP(m, rows_sum, &s));
    }
    mst_route_args r = route_args(m, l, a);
    r.dtopk_w = m->dtopk;
    r.dlogits = m->drl;
    MST_TRY(MST_MODEL_OP(m, route_backward, &r));
    /* dx += drl Wr; gWr += drl^T b */
    mst_mm_args dg = {.m = N, .n = H, .k = E, .a = m->drl, .lda = E, .b = m->w + m->lp[l].wr,
                      .ldb = H, .c16 = dx, .ldc = H, .accumulate = 1};
    MST_TRY(MST_MODEL_OP(m, mm, &dg));
    return mst_op_linear_wgrad(m, N, H, E, m->drl, a->b, m->grad + m->lp[l].wr, H);
}
