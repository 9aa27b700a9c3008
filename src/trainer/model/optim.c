/*
 * optim.c — AdamW with linear warmup and cosine decay, clipping by the
 * global gradient norm (computed on the backend in a fixed order). The
 * update reads the step's error flag on the backend and skips itself when it
 * is set (over budget: the step is rerun with exact shapes); it reads the
 * step's learning rate and bias corrections from the static inputs, which
 * the host fills before each step (mst_optim_hyper).
 */
#include <math.h>

#include "model.h"
#include "ops.h"

float mst_optim_lr(const mst_optim_config* o, int64_t step) {
    if (step <= o->warmup) return o->lr * (float)step / (float)(o->warmup > 0 ? o->warmup : 1);
    double t = (double)(step - o->warmup) / (double)(o->steps > o->warmup ? o->steps - o->warmup : 1);
    if (t > 1) t = 1;
    double f = o->min_lr_frac + (1 - o->min_lr_frac) * 0.5 * (1 + cos(3.141592653589793 * t));
    return (float)(o->lr * f);
}

mst_status mst_optim_zero(mst_model* m) {
    return mst_fill(m->ctx, m->grad, 0, sizeof(float) * (size_t)m->n_params);
}

void mst_optim_hyper(const mst_optim_config* o, int64_t step, float hyper[MST_N_HYPER]) {
    hyper[MST_HYPER_LR] = mst_optim_lr(o, step);
    hyper[MST_HYPER_BC1] = 1.0f - powf(o->beta1, (float)step);
    hyper[MST_HYPER_BC2] = 1.0f - powf(o->beta2, (float)step);
}

/* The squared global norm of the gradients. W ranks: the experts' share
 * summed over the ranks, then this rank's norm weights and replicated
 * matrices (the same on every rank) added to it: every rank the same bits. */
static mst_status grad_sumsq(mst_model* m) {
    mst_sumsq_args ss = {.n = m->n_params, .x = m->grad, .partial = m->gpartial, .out = m->gsumsq};
    if (!m->dist.ep) return MST_MODEL_OP(m, sumsq, &ss);
    mst_sumsq_args e = {.n = m->n_decay - m->n_dense, .x = m->grad + m->n_dense, .partial = m->gpartial,
                        .out = m->gsum_experts};
    MST_TRY(MST_MODEL_OP(m, sumsq, &e));
    MST_TRY(mst_model_allreduce(m, m->gsum_experts, 1, MST_EP_SUM_F32));
    e = (mst_sumsq_args){.n = m->n_params - m->n_decay, .x = m->grad + m->n_decay, .partial = m->gpartial,
                         .base = m->gsum_experts, .out = m->gsum_experts};
    MST_TRY(MST_MODEL_OP(m, sumsq, &e));
    ss.n = m->n_dense;
    ss.base = m->gsum_experts;
    return MST_MODEL_OP(m, sumsq, &ss);
}

mst_status mst_optim_step(mst_model* m, const mst_optim_config* o) {
    MST_TRY(grad_sumsq(m));
    /* [0, n_decay): matrices with weight decay; the rest: norm weights */
    const int64_t lo[2] = {0, m->n_decay}, hi[2] = {m->n_decay, m->n_params};
    for (int i = 0; i < 2; i++) {
        mst_adamw_args a = {.n = hi[i] - lo[i], .beta1 = o->beta1, .beta2 = o->beta2, .eps = o->eps,
                            .weight_decay = i == 0 ? o->weight_decay : 0.0f, .clip = o->clip,
                            .hyper = m->hyper, .master = m->master + lo[i], .grad = m->grad + lo[i],
                            .m = m->adam_m + lo[i], .v = m->adam_v + lo[i], .w = m->w + lo[i],
                            .grad_sumsq = m->gsumsq, .flag = m->ctx->err_flag};
        MST_TRY(MST_MODEL_OP(m, adamw, &a));
    }
    return MST_OK;
}
