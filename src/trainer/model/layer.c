/*
 * layer.c — one pre-norm transformer layer, forward and backward side by
 * side:  x1 = in + Wo attn(Wqkv norm1(in));  out = x1 + MoE(norm2(x1)).
 * The attention, norm and router activations stay in the layer's acts; the
 * grouped MLP's go through the saver.
 */
#include "moe.h"
#include "ops.h"

static mst_attn_args attn_args(const mst_model* m, const mst_layer_acts* a) {
    const mst_model_config* c = &m->cfg;
    mst_attn_args r = {.batch = c->batch, .seq = c->seq, .n_head = c->n_head,
                       .head_dim = c->hidden / c->n_head, .qkv = a->qkv, .probs = a->attp, .lse = a->lse,
                       .out = a->att, .delta = m->att_delta, .scratch32 = m->att32, .scratch16 = m->att16};
    return r;
}

/* The attention op of the model's contract (flash, or the probabilities). */
static mst_status attention(const mst_model* m, const mst_attn_args* a, int backward) {
    if (m->flash) return backward ? MST_MODEL_OP(m, attn_flash_backward, a) : MST_MODEL_OP(m, attn_flash_forward, a);
    return backward ? MST_MODEL_OP(m, attn_backward, a) : MST_MODEL_OP(m, attn_forward, a);
}

mst_status mst_layer_forward(mst_model* m, int32_t l, mst_layer_acts* a, const uint16_t* in,
                             const mst_saver* saver) {
    const mst_model_config* c = &m->cfg;
    const mst_layer_params* p = &m->lp[l];
    const int64_t N = c->batch * c->seq, H = c->hidden;
    a->in = in;
    MST_TRY(mst_op_norm(m, N, H, c->norm_eps, in, m->w + p->ln1, a->a, a->rstd1));
    MST_TRY(mst_op_linear(m, N, H, 3 * H, a->a, m->w + p->wqkv, a->qkv));
    mst_attn_args at = attn_args(m, a);
    MST_TRY(attention(m, &at, 0));
    MST_TRY(mst_op_linear(m, N, H, H, a->att, m->w + p->wo, a->x1));
    MST_TRY(mst_op_add(m, N * H, a->x1, in, a->x1));
    MST_TRY(mst_op_norm(m, N, H, c->norm_eps, a->x1, m->w + p->ln2, a->b, a->rstd2));
    MST_TRY(mst_moe_forward(m, l, a, saver, a->out));
    return mst_op_add(m, N * H, a->out, a->x1, a->out);
}

mst_status mst_layer_backward(mst_model* m, int32_t l, mst_layer_acts* a, const mst_saver* saver, uint16_t* d) {
    const mst_model_config* c = &m->cfg;
    const mst_layer_params* p = &m->lp[l];
    const int64_t N = c->batch * c->seq, H = c->hidden;
    /* MoE block: d(x1) = d + norm2'(MoE'(d)) */
    MST_TRY(mst_moe_backward(m, l, a, saver, d, m->t1));
    MST_TRY(mst_op_norm_bwd(m, N, H, a->x1, m->w + p->ln2, a->rstd2, m->t1, m->t2, m->grad + p->ln2));
    MST_TRY(mst_op_add(m, N * H, d, m->t2, d));
    /* attention block: d(in) = d(x1) + norm1'(Wqkv'(attn'(Wo'(d(x1))))) */
    MST_TRY(mst_op_linear_wgrad(m, N, H, H, d, a->att, m->grad + p->wo, H));
    MST_TRY(mst_op_linear_dgrad(m, N, H, H, d, m->w + p->wo, H, m->t1));
    mst_attn_args at = attn_args(m, a);
    at.dout = m->t1;
    at.dqkv = m->dqkv;
    MST_TRY(attention(m, &at, 1));
    MST_TRY(mst_op_linear_wgrad(m, N, H, 3 * H, m->dqkv, a->a, m->grad + p->wqkv, H));
    MST_TRY(mst_op_linear_dgrad(m, N, H, 3 * H, m->dqkv, m->w + p->wqkv, H, m->t1));
    MST_TRY(mst_op_norm_bwd(m, N, H, a->in, m->w + p->ln1, a->rstd1, m->t1, m->t2, m->grad + p->ln1));
    return mst_op_add(m, N * H, d, m->t2, d);
}
