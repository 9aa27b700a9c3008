/*
 * memmgr_streams.c — the memory manager's streams and events.
 *
 * Streams (mst_stream_sel; on CUDA; a backend without streams runs them as
 * host queues, memmgr_host_streams.c):
 *   main  the context's current stream: the ops, and every buffer the caller
 *         and the ops write
 *   ring  every save, claim and page return of every pool, in host order
 *         (the rings are updated without atomics), so that pages are used in
 *         the order the measuring step counted them
 *   copy  the copies of restores (mst_stash_restore_copy), which run beside
 *         the saves (on PCIe: D2H and H2D at once)
 *
 * Batches: a side operation is queued in its stream's batch (distinct
 * pools) and the batch launched as one backend call (mst_mm_flush) at the
 * next layer call, at the end of one (layer, mb)'s restores, at step end,
 * before a second operation on a pool it holds, when full, when a wait
 * needs it, or before the save of an op output (sv_commit: what was queued
 * before its producer ran does not wait for the producer). The waits of an operation are enqueued when it is queued (before
 * the launch); an event recorded after a queued operation is recorded after
 * the launch; a wait on an event whose record is queued launches that batch
 * first. So each edge below holds for the whole batch of its operation, and
 * each pool's ring updates stay in host order.
 *
 * Every event edge (record on one stream -> wait on another), and what it
 * guards. A side operation starts only after main's work so far (ev_main), so
 * the other edges order work that main enqueues AFTER a side operation.
 *
 *   event             recorded on / where        waited on / where          guards
 *   ----------------  -------------------------  -------------------------  ------------------------------
 *   ev_main           main, as each side op is   ring / copy, before that   the tensor a save reads is
 *                     queued (mst_mm_on_side)    op's batch                 written; the pages a return
 *                                                                           gives back and the restore
 *                                                                           buffer a copy overwrites are
 *                                                                           no longer read
 *   compute_free[n]   ring, after a save from    main, before the next      main overwrites compute buffer
 *                     compute buffer n           produce into it            n only after its stash read it
 *                     (sv_commit)                (sv_produce)
 *   inputs_read       ring, after a save of an   main, at the next layer    the caller writes its input
 *                     op input (fc1_input,       call: forward, backward,   buffers again only after
 *                     probs) (sv_commit)         recompute                  their stash read them
 *   saved_ev[slot]    ring, after the save or    copy, before its restore   a restore reads pages the
 *                     claim of the slot          copy (issue_restore)       save has written
 *                     (sv_commit, sv_claim)      main, after a claim        the producer writes pages the
 *                                                (sv_claim)                 claim has tabled
 *                                                main, before an in-place   the backward reads pages the
 *                                                read (sv_fetch)            save has written (*)
 *   restore_done[n][k] copy, after a restore     main, before the backward  the backward reads the rows
 *                     into restore[k]            reads it (sv_fetch)        the copy wrote
 *                     (issue_restore)            ring, before the page      the pages go back to the ring
 *                                                return (sv_release)        after the copy read them (*)
 *   restore_free[n][k] main, at the release of   copy, before the next      the copy overwrites a restore
 *                     a tensor restored into k   restore into k             buffer after its last reader
 *                     (sv_release)               (issue_restore)            (*)
 *   ev_side           ring and copy (those used) main (step end:            the next step (pool reset on
 *                     at step end                mst_mm_join_side)          main, host reads) after this
 *                                                                           step's side work; a captured
 *                                                                           graph rejoins its streams
 *
 * (*) implied today by other edges, kept for savers that call in other
 * orders: the in-place read of an op input by inputs_read (waited at every
 * layer call), of a produced tensor by its claim; the page return after a
 * fetched restore by restore_done -> main then ev_main; restore_free by
 * ev_main (a restore into k is issued after the release of k's last reader).
 * Removing one of these changes no result of the tests. Removing any other
 * edge does: on the CPU each side -> main and side -> side edge
 * (tests/mutants/stash.txt), on CUDA ev_main too (main slowed down).
 *
 * Tests slow a stream down (mst_memmgr_debug_slow): on CUDA a spin before
 * each operation of a side stream, or at each layer call on main; on the CPU
 * (no streams: memmgr_host_streams.c) a side stream deferred as long as the
 * events allow. A missing edge then changes the gradients.
 */
#include <string.h>

#include "memmgr_impl.h"

static void* stream_of(mst_memmgr_t* m, mst_stream_sel on) {
    return on == MST_STREAM_MAIN ? NULL : m->ctx->be->side_stream(m->ctx, on);
}

/* Every function below takes the host model of memmgr_host_streams.c where
 * the backend has no streams and events. */
static int host_streams(const mst_memmgr_t* m) {
    const mst_backend* be = m->ctx->be;
    return !be->side_stream || !be->event_create || !be->event_destroy || !be->event_record || !be->stream_wait;
}

/* The side stream whose queued batch an event waits to be recorded after
 * (MST_STREAM_MAIN: none). */
static mst_stream_sel pending_on(const mst_memmgr_t* m, const void* ev) {
    for (mst_stream_sel s = MST_STREAM_RING; s < MST_N_STREAMS; s++)
        for (int i = 0; i < m->batch[s].n_rec; i++)
            if (m->batch[s].rec[i] == ev) return s;
    return MST_STREAM_MAIN;
}

mst_status mst_mm_ev_record(mst_memmgr_t* m, void* ev, mst_stream_sel on) {
    const mst_backend* be = m->ctx->be;
    const mst_stream_sel pend = pending_on(m, ev);
    if (pend != MST_STREAM_MAIN && pend != on) MST_TRY(mst_mm_flush(m, pend)); /* records stay in order */
    side_batch* q = &m->batch[on];
    if (on != MST_STREAM_MAIN && q->b.n && q->n_rec < 2 * MST_STASH_BATCH_MAX) { /* after the batch */
        if (pend != on) q->rec[q->n_rec++] = ev;
        return MST_OK;
    }
    if (on != MST_STREAM_MAIN) MST_TRY(mst_mm_flush(m, on));
    if (host_streams(m)) {
        mst_mm_host_ev_record(m, ev, on);
        return MST_OK;
    }
    return be->event_record(m->ctx, ev, stream_of(m, on));
}

mst_status mst_mm_ev_wait(mst_memmgr_t* m, void* ev, mst_stream_sel on) {
    const mst_backend* be = m->ctx->be;
    const mst_stream_sel pend = pending_on(m, ev);
    if (pend != MST_STREAM_MAIN) MST_TRY(mst_mm_flush(m, pend)); /* the record it waits for, first */
    if (host_streams(m)) return mst_mm_host_ev_wait(m, ev, on);
    return be->stream_wait(m->ctx, stream_of(m, on), ev);
}

mst_status mst_mm_ev_new(mst_memmgr_t* m, void** ev) {
    *ev = NULL;
    if (host_streams(m)) return mst_mm_host_ev_new(ev);
    return m->ctx->be->event_create(m->ctx, ev);
}

void mst_mm_ev_free(mst_memmgr_t* m, void* ev) {
    if (!ev) return;
    if (host_streams(m)) mst_mm_host_ev_free(ev);
    else m->ctx->be->event_destroy(m->ctx, ev);
}

/* Side operation op as slot b->n of batch b. */
static mst_status batch_add(mst_stash_batch* b, mst_mm_side_op op, mst_pool_t* p, mst_stash_handle_t* h,
                            const mst_tensor* t, const mst_tensor* counts) {
    switch (op) {
    case MM_SAVE: return mst_stash_batch_save(b, p, h, t, counts);
    case MM_CLAIM: return mst_stash_batch_claim(b, p, h, t->rows, counts);
    case MM_RESTORE_COPY: return mst_stash_batch_restore(b, p, h, t, MST_RESTORE_COPY);
    case MM_RETURN: return mst_stash_batch_restore(b, p, h, NULL, MST_RESTORE_RETURN);
    }
    return mst_set_error(MST_ERR_INVALID, "side op = %d", (int)op);
}

/* A spin of m->slow[on] cycles on stream `on` (NULL stream: the current one). */
static mst_status slow_down(mst_memmgr_t* m, mst_stream_sel on) {
    if (!m->slow[on]) return MST_OK;
    return m->ctx->be->stream_spin(m->ctx, NULL, m->slow[on]);
}

mst_status mst_mm_on_side(mst_memmgr_t* m, mst_stream_sel side, void* after, mst_mm_side_op op,
                          mst_pool_t* p, mst_stash_handle_t* h, mst_tensor* t, const mst_tensor* counts) {
    side_batch* q = &m->batch[side];
    if (q->b.n == MST_STASH_BATCH_MAX || mst_stash_batch_has(&q->b, p)) MST_TRY(mst_mm_flush(m, side));
    if (!host_streams(m)) { /* main's work so far, then `after`: waits enqueued now, before the launch */
        m->side_used |= 1 << side; /* joined at step end from now on */
        MST_TRY(mst_mm_ev_record(m, m->ev_main, MST_STREAM_MAIN));
        MST_TRY(mst_mm_ev_wait(m, m->ev_main, side));
    }
    if (after) MST_TRY(mst_mm_ev_wait(m, after, side));
    return batch_add(&q->b, op, p, h, t, counts);
}

/* The batch of side stream `side`, launched on it. */
static mst_status launch(mst_memmgr_t* m, mst_stream_sel side, mst_stash_batch* b) {
    if (host_streams(m)) return mst_mm_host_on_side(m, side, b);
    void* main_stream = mst_ctx_stream(m->ctx);
    MST_TRY(mst_ctx_set_stream(m->ctx, m->ctx->be->side_stream(m->ctx, side)));
    mst_status st = slow_down(m, side);
    if (st == MST_OK) st = mst_stash_batch_run(m->ctx, b);
    mst_status st2 = mst_ctx_set_stream(m->ctx, main_stream);
    return st != MST_OK ? st : st2;
}

mst_status mst_mm_flush(mst_memmgr_t* m, mst_stream_sel side) {
    side_batch* q = &m->batch[side];
    if (!q->b.n) return MST_OK;
    mst_status st = launch(m, side, &q->b);
    void* rec[2 * MST_STASH_BATCH_MAX];
    const int n_rec = q->n_rec;
    memcpy(rec, q->rec, sizeof(void*) * (size_t)n_rec);
    q->b.n = q->n_rec = 0;
    for (int i = 0; i < n_rec && st == MST_OK; i++) st = mst_mm_ev_record(m, rec[i], side);
    return st;
}

mst_status mst_mm_flush_all(mst_memmgr_t* m) {
    for (mst_stream_sel s = MST_STREAM_RING; s < MST_N_STREAMS; s++) MST_TRY(mst_mm_flush(m, s));
    return MST_OK;
}

mst_status mst_mm_join_side(mst_memmgr_t* m) {
    MST_TRY(mst_mm_flush_all(m));
    if (host_streams(m)) return mst_mm_host_join(m);
    for (mst_stream_sel s = MST_STREAM_RING; s < MST_N_STREAMS; s++) {
        if (!(m->side_used & 1 << s)) continue;
        MST_TRY(mst_mm_ev_record(m, m->ev_side, s));
        MST_TRY(mst_mm_ev_wait(m, m->ev_side, MST_STREAM_MAIN));
    }
    return MST_OK;
}

mst_status mst_mm_slow_main(mst_memmgr_t* m) { return slow_down(m, MST_STREAM_MAIN); }

mst_status mst_memmgr_debug_slow(mst_memmgr_t* m, mst_stream_sel sel, int64_t cycles) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if ((int)sel < 0 || sel >= MST_N_STREAMS || cycles < 0)
        return mst_set_error(MST_ERR_INVALID, "sel = %d, cycles = %lld: a stream and cycles >= 0", (int)sel,
                             (long long)cycles);
    if (m->in_step) return mst_set_error(MST_ERR_STATE, "a stream is slowed down between steps");
    if (host_streams(m)) { /* a side stream deferred; main never lags */
        if (sel == MST_STREAM_MAIN && cycles)
            return mst_set_error(MST_ERR_UNSUPPORTED, "backend %s runs main at once: it cannot be slowed down",
                                 m->ctx->be->name);
        m->host[sel].deferred = cycles > 0;
        return MST_OK;
    }
    if (cycles && !m->ctx->be->stream_spin)
        return mst_set_error(MST_ERR_UNSUPPORTED, "backend %s cannot slow a stream down", m->ctx->be->name);
    m->slow[sel] = cycles;
    return MST_OK;
}
