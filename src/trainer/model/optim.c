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

/* Clip by the global norm (shard.c: the same bits on every rank), AdamW on
 * every part this rank holds (the matrices decayed), then, sharded, the
 * updated bf16 weights all-gathered. */
mst_status mst_optim_step(mst_model* m, const mst_optim_config* o) {
    MST_TRY(mst_optim_grad_sumsq(m));
    MST_TRY(mst_stage_norm_sum(m)); /* P stages: the sum of theirs */
    const size_t es = mst_optim_state_elem(m, 1);
    for (int32_t i = 0; i < m->n_opt_parts; i++) {
        const mst_optim_part* p = &m->opt_part[i];
        mst_adamw_args a = {.n = p->n, .beta1 = o->beta1, .beta2 = o->beta2, .eps = o->eps,
                            .weight_decay = p->decay ? o->weight_decay : 0.0f, .clip = o->clip,
                            .hyper = m->hyper, .master = m->master + p->at, .grad = m->grad + p->lo,
                            .m = (char*)m->adam_m + es * (size_t)p->at, .v = (char*)m->adam_v + es * (size_t)p->at,
                            .moments_bf16 = m->mem_cfg.moments_bf16, .w = m->w + p->lo,
                            .grad_sumsq = m->gsumsq, .flag = m->ctx->err_flag};
        MST_TRY(MST_MODEL_OP(m, adamw, &a));
    }
    return mst_optim_gather_weights(m);
}
