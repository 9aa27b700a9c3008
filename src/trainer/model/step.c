/*
 * step.c — the whole optimizer step as one function: the passes of every
 * microbatch along the schedule (mst_model_step), clip + AdamW with its
 * device-side skip, and the record the host reads afterwards (the error
 * flag and the loss sums, summed on the backend). The same function runs
 * eagerly on every backend; on a backend that captures (CUDA) a sized step
 * is captured once into a graph and replayed. Between two steps the host
 * only uploads the static inputs and reads the record. On W ranks the
 * step also all-reduces the replicated gradients (--overlap on: a bucket
 * per layer during the backward, overlap.c), the flag word and the
 * record's loss sums (inside the graph: the sums capture).
 */
#include "model.h"
#include "ops.h"
#include "overlap.h"

/* W ranks: the step's flag word, the max over the ranks, so that every rank
 * skips AdamW and reruns alike (max, not or: NCCL has no or; with both bits
 * raised on different ranks every rank sees OVERFLOW and reruns measuring,
 * which finds the over-budget group again). */
static mst_status share_flag(mst_model* m) { return mst_model_allreduce_world(m, m->ctx->err_flag, 1, MST_EP_MAX_I32); }

int64_t mst_step_shared_grads(const mst_model* m) { return m->n_dense + m->n_params - m->n_decay; }

/* P stages: a table tied across stages summed over the grid after the
 * stage's replicated gradients (its copies on stage 0 and the last). */
mst_status mst_step_share_grads(mst_model* m) {
    MST_TRY(mst_optim_share_grads(m));
    return mst_stage_share_tied(m);
}

/* flag and loss sums into the record (backend memory); W ranks: the sums
 * over every rank's tokens */
static mst_status record(mst_model* m) {
    const int64_t N = m->cfg.batch * m->cfg.seq, M = m->n_micro;
    mst_step_record* r = (mst_step_record*)m->record;
    MST_TRY(mst_copy_b2b(m->ctx, &r->flag, m->ctx->err_flag, sizeof(int32_t)));
    mst_sum_args a = {.n = M * N, .x = m->loss_main, .out = &r->loss_main};
    MST_TRY(MST_MODEL_OP(m, sum, &a));
    a.x = m->loss_mtp;
    a.out = &r->loss_mtp;
    MST_TRY(MST_MODEL_OP(m, sum, &a));
    a = (mst_sum_args){.n = M * (m->cfg.layers + 1), .x = m->aux_sum, .out = &r->aux};
    MST_TRY(MST_MODEL_OP(m, sum, &a));
    /* loss_main, loss_mtp, aux: P stages: each sums its own (the others' are 0) */
    return mst_model_allreduce_world(m, &r->loss_main, 3, MST_EP_SUM_F64);
}

/* --overlap on (overlap.c): the passes start the layers' sums, finish
 * sums the rest and joins them before the optimizer. */
static mst_status whole_step(mst_model* m, const mst_optim_config* o, int measuring) {
    if (m->ov) m->ov->active = 1;
    mst_status st = mst_model_step(m, measuring);
    if (m->ov) m->ov->active = 0;
    MST_TRY(st);
    MST_TRY(mst_overlap_finish(m));
    MST_TRY(mst_stage_share_tied(m));
    MST_TRY(share_flag(m));
    MST_TRY(mst_optim_step(m, o));
    return record(m);
}

mst_status mst_step_eval(mst_model* m, int measuring) {
    if (measuring) mst_step_drop_graph(m);
    MST_TRY(mst_model_step(m, measuring));
    MST_TRY(share_flag(m));
    return record(m);
}

void mst_step_drop_graph(mst_model* m) {
    if (m->graph) m->ctx->be->graph_destroy(m->ctx, m->graph);
    m->graph = NULL;
    m->graph_warm = 0;
}

mst_status mst_step_run(mst_model* m, const mst_optim_config* o, int measuring) {
    if (measuring) mst_step_drop_graph(m); /* pools and buffers may be resized */
    MST_TRY(whole_step(m, o, measuring));
    m->graph_warm |= !measuring;
    return MST_OK;
}

/* Captures a sized step; the capture is ended even when the step fails. */
static mst_status capture(mst_model* m, const mst_optim_config* o) {
    mst_ctx_t* ctx = m->ctx;
    MST_TRY(ctx->be->capture_begin(ctx));
    mst_status st = whole_step(m, o, 0);
    char why[512] = "";
    if (st != MST_OK) snprintf(why, sizeof why, "%s", mst_last_error());
    void* g = NULL;
    mst_status end = ctx->be->capture_end(ctx, &g);
    if (st != MST_OK) {
        ctx->be->graph_destroy(ctx, g);
        return mst_set_error(st, "capture of the step: %s", why);
    }
    MST_TRY(end);
    m->graph = g;
    return MST_OK;
}

mst_status mst_step_replay(mst_model* m, const mst_optim_config* o, int* captured) {
    *captured = 0;
    if (!m->ctx->be->capture_begin || !m->graph_warm) return mst_step_run(m, o, 0);
    if (!m->graph) {
        MST_TRY(capture(m, o));
        *captured = 1;
    }
    return m->ctx->be->graph_launch(m->ctx, m->graph);
}

mst_status mst_step_read(mst_model* m, mst_step_record* r) {
    return mst_copy_b2h(m->ctx, r, m->record, sizeof *r);
}
