/*
 * layer.c — one Qwen3-MoE decoder layer, forward and backward side by side:
 *   qkv = norm1(in) Wqkv^T;  y = rope(qknorm(qkv));  x1 = in + attn(y) Wo^T;
 *   out = x1 + MoE(norm2(x1)).
 * The attention, norm and router activations stay in the layer's acts (qkv
 * before QK-norm and rotation: the backward reruns qk_forward into the
 * shared m->qkvr, a cheap elementwise pass, instead of keeping both); the
 * grouped MLP's go through the saver.
 */
#include "moe.h"
#include "ops.h"

static mst_attn_args attn_args(const mst_model* m, const mst_layer_acts* a) {
    const mst_model_config* c = &m->cfg;
    mst_attn_args r = {.batch = c->batch, .seq = c->seq, .n_head = c->n_head, .head_dim = c->head_dim,
                       .n_kv_head = c->n_kv_head, .qkv = m->qkvr, .probs = a->attp, .lse = a->lse,
                       .out = a->att, .delta = m->att_delta, .scratch32 = m->att32, .scratch16 = m->att16};
    return r;
}

/* QK-norm and rotation of layer l: a->qkv -> m->qkvr. */
static mst_qk_args qk_args(const mst_model* m, int32_t l, const mst_layer_acts* a) {
    const mst_model_config* c = &m->cfg;
    const mst_layer_params* p = &m->lp[l];
    mst_qk_args r = {.rows = c->batch * c->seq, .seq = c->seq, .n_head = c->n_head, .n_kv_head = c->n_kv_head,
                     .head_dim = c->head_dim, .eps = c->norm_eps, .theta = c->rope_theta, .x = a->qkv,
                     .wq = m->w + p->q_norm, .wk = m->w + p->k_norm, .y = m->qkvr, .rstd = a->rstdqk,
                     .dwq = m->grad + p->q_norm, .dwk = m->grad + p->k_norm};
    return r;
}

/* The attention op the model runs (cuDNN's or our flash kernels under the
 * flash contract, or the probabilities). */
static mst_status attention(const mst_model* m, const mst_attn_args* a, int backward) {
    if (m->attn == MST_ATTN_CUDNN)
        return backward ? MST_MODEL_OP(m, attn_cudnn_backward, a) : MST_MODEL_OP(m, attn_cudnn_forward, a);
    if (m->attn == MST_ATTN_FLASH)
        return backward ? MST_MODEL_OP(m, attn_flash_backward, a) : MST_MODEL_OP(m, attn_flash_forward, a);
    return backward ? MST_MODEL_OP(m, attn_backward, a) : MST_MODEL_OP(m, attn_forward, a);
}

static int64_t qkv_cols(const mst_model_config* c) { return (c->n_head + 2 * c->n_kv_head) * c->head_dim; }

mst_status mst_layer_forward(mst_model* m, int32_t l, mst_layer_acts* a, const uint16_t* in,
                             const mst_saver* saver) {
    const mst_model_config* c = &m->cfg;
    const mst_layer_params* p = &m->lp[l];
    const int64_t N = c->batch * c->seq, H = c->hidden, HO = c->n_head * c->head_dim;
    a->in = in;
    MST_TRY(mst_op_norm(m, N, H, c->norm_eps, in, m->w + p->ln1, a->a, a->rstd1));
    MST_TRY(mst_op_linear(m, N, H, qkv_cols(c), a->a, m->w + p->wqkv, a->qkv));
    mst_qk_args qk = qk_args(m, l, a);
    MST_TRY(MST_MODEL_OP(m, qk_forward, &qk));
    mst_attn_args at = attn_args(m, a);
    MST_TRY(attention(m, &at, 0));
    MST_TRY(mst_op_linear(m, N, HO, H, a->att, m->w + p->wo, a->x1));
    MST_TRY(mst_op_add(m, N * H, a->x1, in, a->x1));
    MST_TRY(mst_op_norm(m, N, H, c->norm_eps, a->x1, m->w + p->ln2, a->b, a->rstd2));
    MST_TRY(mst_moe_forward(m, l, a, saver, a->out));
    return mst_op_add(m, N * H, a->out, a->x1, a->out);
}

mst_status mst_layer_backward(mst_model* m, int32_t l, mst_layer_acts* a, const mst_saver* saver, uint16_t* d) {
    const mst_model_config* c = &m->cfg;
    const mst_layer_params* p = &m->lp[l];
    const int64_t N = c->batch * c->seq, H = c->hidden, HO = c->n_head * c->head_dim, Wq = qkv_cols(c);
    /* MoE block: d(x1) = d + norm2'(MoE'(d)) */
    MST_TRY(mst_moe_backward(m, l, a, saver, d, m->t1));
    MST_TRY(mst_op_norm_bwd(m, N, H, a->x1, m->w + p->ln2, a->rstd2, m->t1, m->t2, m->grad + p->ln2));
    MST_TRY(mst_op_add(m, N * H, d, m->t2, d));
    /* attention block: d(in) = d(x1) + norm1'(Wqkv'(qk'(attn'(Wo'(d(x1)))))) */
    MST_TRY(mst_op_linear_wgrad(m, N, HO, H, d, a->att, m->grad + p->wo, HO));
    MST_TRY(mst_op_linear_dgrad(m, N, HO, H, d, m->w + p->wo, HO, m->datt));
    mst_qk_args qk = qk_args(m, l, a);
    MST_TRY(MST_MODEL_OP(m, qk_forward, &qk)); /* attention's input again, bit for bit */
    mst_attn_args at = attn_args(m, a);
    at.dout = m->datt;
    at.dqkv = m->dqkv;
    MST_TRY(attention(m, &at, 1));
    qk.dy = m->dqkv;
    qk.dx = m->qkvr;
    MST_TRY(MST_MODEL_OP(m, qk_backward, &qk));
    MST_TRY(mst_op_linear_wgrad(m, N, H, Wq, m->qkvr, a->a, m->grad + p->wqkv, H));
    MST_TRY(mst_op_linear_dgrad(m, N, H, Wq, m->qkvr, m->w + p->wqkv, H, m->t1));
    MST_TRY(mst_op_norm_bwd(m, N, H, a->in, m->w + p->ln1, a->rstd1, m->t1, m->t2, m->grad + p->ln1));
    return mst_op_add(m, N * H, d, m->t2, d);
}
