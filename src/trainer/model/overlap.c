/*
 * overlap.c — --overlap on: the replicated gradients' sums over the
 * data-parallel ranks started during the backward (overlap.h).
 *
 * Buckets by layer: layer l's matrices [wqkv, wr + E H) and its norm
 * weights [ln1, ln2 + H), each contiguous in the flat layout (params.c; the
 * layers' buckets tile [first wqkv, n_dense) and [n_decay, last ln2 + H),
 * checked at set-up), summed once the step's last backward of l has run
 * (the last backward entry of the chunk holding l: under --pp each stage's
 * own); at the end the rest of the two replicated runs (before the first
 * layer's matrices: embedding, head, MTP projection; after the last
 * layer's norms: the final norms) and the join. Sharded (ZeRO-1) a
 * bucket's part in a run's body is reduce-scattered as a window of the
 * body (mst_ep_reduce_scatter_window: this rank's block gets the sums), its
 * part in the run's tail all-reduced. Every float sum adds the ranks in
 * rank order, element by element (ep.h), so the bits do not depend on how
 * the runs are cut or when a bucket runs: --overlap on and off give the
 * same bits, sharded or not.
 *
 * CUDA: a bucket's sums are enqueued on the stream of a communication
 * context after an event of the compute stream (fork) and run under the
 * next layers' backward; the compute stream waits for the communication
 * stream's event before the optimizer (join). Fork and join are events, so
 * the step stays one captured graph. The sums have their own NCCL
 * communicator (split from dist.ep at set-up): dispatch and combine use
 * dist.ep on the compute stream meanwhile, and one communicator's calls
 * from two streams could meet in different orders on different ranks. The
 * CPU twin runs the same sums at the same points in program order.
 */
#include <stdlib.h>

#include "overlap.h"

/* [lo, hi) of main_grad (inside the replicated runs) summed over the ranks
 * (on the communication stream, CUDA): all-reduced; sharded (ZeRO-1), its
 * part in a run's body reduce-scattered as a window of the body (this
 * rank's block gets the sums there, as mst_optim_share_grads'
 * reduce-scatter gives them) and its part in the run's tail all-reduced. */
static mst_status sum_range(mst_model* m, int64_t lo, int64_t hi) {
    mst_ep_t* ep = m->ov->ep;
    if (hi <= lo) return MST_OK;
    if (!m->opt_shard) return mst_ep_allreduce(ep, m->grad + lo, hi - lo, MST_EP_SUM_F32);
    for (int u = 0; u < 2; u++) {
        const mst_optim_run* x = &m->rep[u];
        const int64_t body = x->lo + (int64_t)m->dist.world * x->q, end = x->lo + x->n;
        const int64_t a = lo > x->lo ? lo : x->lo, b = hi < body ? hi : body;
        if (b > a) MST_TRY(mst_ep_reduce_scatter_window(ep, m->grad + x->lo, x->q, a - x->lo, b - x->lo, MST_EP_SUM_F32));
        const int64_t c = lo > body ? lo : body, d = hi < end ? hi : end;
        if (d > c) MST_TRY(mst_ep_allreduce(ep, m->grad + c, d - c, MST_EP_SUM_F32));
    }
    return MST_OK;
}

/* The communication stream waits for the compute stream's work so far. */
static mst_status fork_comm(mst_model* m) {
    mst_overlap* ov = m->ov;
    if (!ov->ctx) return MST_OK;
    MST_TRY(m->ctx->be->event_record(m->ctx, ov->fork, NULL));
    MST_TRY(ov->ctx->be->stream_wait(ov->ctx, NULL, ov->fork));
    ov->forked = 1;
    return MST_OK;
}

/* The compute stream waits for every sum enqueued since the last join. */
static mst_status join_comm(mst_model* m) {
    mst_overlap* ov = m->ov;
    if (!ov->ctx || !ov->forked) return MST_OK;
    MST_TRY(ov->ctx->be->event_record(ov->ctx, ov->join, NULL));
    MST_TRY(m->ctx->be->stream_wait(m->ctx, NULL, ov->join));
    ov->forked = 0;
    return MST_OK;
}

static int64_t mats_end(const mst_model* m, int32_t l) { return m->lp[l].wr + (int64_t)m->cfg.experts * m->cfg.hidden; }
static int64_t norms_end(const mst_model* m, int32_t l) { return m->lp[l].ln2 + m->cfg.hidden; }

mst_status mst_overlap_layer_done(mst_model* m, int32_t entry, int32_t chunk, int32_t l) {
    mst_overlap* ov = m->ov;
    if (!ov || !ov->active || chunk < 0 || chunk >= ov->n_chunks || entry != ov->last_bwd[chunk]) return MST_OK;
    MST_TRY(fork_comm(m));
    MST_TRY(sum_range(m, m->lp[l].wqkv, mats_end(m, l)));
    return sum_range(m, m->lp[l].ln1, norms_end(m, l));
}

/* The layers here, first and last in the layout (layer order). */
static void layer_span(const mst_model* m, int32_t* first, int32_t* last) {
    *first = -1, *last = -1;
    for (int32_t l = 0; l <= m->cfg.layers; l++)
        if (mst_model_here(m, l)) {
            if (*first < 0) *first = l;
            *last = l;
        }
}

mst_status mst_overlap_finish(mst_model* m) {
    if (!m->ov) return mst_optim_share_grads(m);
    int32_t first, last;
    layer_span(m, &first, &last);
    MST_TRY(fork_comm(m));
    MST_TRY(sum_range(m, m->rep[0].lo, m->lp[first].wqkv));
    MST_TRY(sum_range(m, norms_end(m, last), m->rep[1].lo + m->rep[1].n));
    return join_comm(m);
}

/* The layers' buckets tile the runs between the rest's two pieces: each
 * layer's matrices end where the next layer's start (the last at
 * n_dense), its norms likewise (the first at n_decay). */
static mst_status check_tiling(const mst_model* m) {
    int32_t first, last;
    layer_span(m, &first, &last);
    if (first < 0 || m->lp[first].ln1 != m->n_decay || mats_end(m, last) != m->n_dense ||
        m->lp[first].wqkv < m->rep[0].lo)
        return mst_set_error(MST_ERR_STATE, "--overlap: the layers' parameters do not tile the replicated runs");
    for (int32_t l = first, next; l < last; l = next) {
        for (next = l + 1; !mst_model_here(m, next); next++) {}
        if (mats_end(m, l) != m->lp[next].wqkv || norms_end(m, l) != m->lp[next].ln1)
            return mst_set_error(MST_ERR_STATE, "--overlap: layer %d's parameters are not followed by layer %d's", l, next);
    }
    return MST_OK;
}

/* ov->last_bwd: the last backward entry of each chunk of the schedule. */
static mst_status last_backwards(mst_model* m) {
    mst_overlap* ov = m->ov;
    for (int32_t i = 0; i < m->n_sched; i++)
        if (m->sched[i].chunk + 1 > ov->n_chunks) ov->n_chunks = m->sched[i].chunk + 1;
    ov->last_bwd = (int32_t*)malloc(sizeof(int32_t) * (size_t)(ov->n_chunks + 1));
    if (!ov->last_bwd) return mst_set_error(MST_ERR_OOM, "--overlap: the schedule's last backwards");
    for (int32_t c = 0; c < ov->n_chunks; c++) ov->last_bwd[c] = -1;
    for (int32_t i = 0; i < m->n_sched; i++)
        if (m->sched[i].backward) ov->last_bwd[m->sched[i].chunk] = i;
    return MST_OK;
}

mst_status mst_overlap_create(mst_model* m) {
    int32_t r, W;
    mst_ep_t* dp = mst_model_dp(m, &r, &W);
    m->ov = NULL;
    if (!dp || W < 2 || !m->mem_cfg.overlap) return MST_OK;
    MST_TRY(check_tiling(m));
    m->ov = (mst_overlap*)calloc(1, sizeof *m->ov);
    if (!m->ov) return mst_set_error(MST_ERR_OOM, "--overlap state");
    mst_overlap* ov = m->ov;
    MST_TRY(last_backwards(m));
    if (m->ctx->kind != MST_BACKEND_CUDA) { /* the CPU twin: dist.ep, in program order */
        ov->ep = dp;
        return MST_OK;
    }
    MST_TRY(mst_ctx_create(MST_BACKEND_CUDA, m->ctx->device, &ov->ctx));
    MST_TRY(mst_ep_create_split(ov->ctx, NULL, dp, 0, r, &ov->ep));
    MST_TRY(m->ctx->be->event_create(m->ctx, &ov->fork));
    return m->ctx->be->event_create(m->ctx, &ov->join);
}

void mst_overlap_destroy(mst_model* m) {
    mst_overlap* ov = m->ov;
    if (!ov) return;
    if (ov->ctx) { /* CUDA: the split communicator, the events and the context are ours */
        mst_ep_destroy(ov->ep);
        if (ov->fork) m->ctx->be->event_destroy(m->ctx, ov->fork);
        if (ov->join) m->ctx->be->event_destroy(m->ctx, ov->join);
        mst_ctx_destroy(ov->ctx);
    }
    free(ov->last_bwd);
    free(ov);
    m->ov = NULL;
}
