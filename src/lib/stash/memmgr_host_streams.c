/*
 * memmgr_host_streams.c — the memory manager's streams on a backend without
 * them (the CPU): main runs at once; each side stream is a queue of batches
 * of pool operations and waits, and events are host objects (the stream and
 * queue position of their last record).
 *
 * In program order (the default) a batch runs when it is launched
 * (mst_mm_flush), after its waits. Deferred (mst_memmgr_debug_slow on a side stream, tests)
 * it runs only when an event wait needs it: main waiting for an event
 * recorded after it, a side stream reaching a wait for such an event, or the
 * join at step end. That is the slowest a side stream may legally be, so an
 * event edge missing from the table in memmgr_streams.c (side -> main, side
 * -> side) changes the results on the CPU as well. The main -> side edge
 * (ev_main) cannot be tested here: main never lags.
 */
#include <string.h>

#include "memmgr_impl.h"

typedef struct host_ev {
    mst_stream_sel on; /* stream of the last record                          */
    uint64_t seq;      /* items of that stream issued before it (side streams) */
} host_ev;

mst_status mst_mm_host_ev_new(void** ev) {
    *ev = calloc(1, sizeof(host_ev));
    return *ev ? MST_OK : mst_set_error(MST_ERR_OOM, "host event");
}

void mst_mm_host_ev_free(void* ev) { free(ev); }

void mst_mm_host_ev_record(mst_memmgr_t* m, void* ev, mst_stream_sel on) {
    host_ev* e = (host_ev*)ev;
    e->on = on;
    e->seq = m->host[on].pushed;
}

/* Runs stream s's items until `seq` have run (waits run the streams they
 * wait for first). */
static mst_status run_until(mst_memmgr_t* m, mst_stream_sel s, uint64_t seq) {
    host_stream* q = &m->host[s];
    while (q->done < seq) {
        host_item it = q->items[q->done - q->base];
        q->done++;
        if (it.is_wait) MST_TRY(run_until(m, it.on, it.seq));
        else MST_TRY(mst_stash_batch_run(m->ctx, &it.batch));
    }
    return MST_OK;
}

static mst_status push(mst_memmgr_t* m, mst_stream_sel s, const host_item* it) {
    host_stream* q = &m->host[s];
    const int64_t n = (int64_t)(q->pushed - q->base);
    if (n == q->cap) {
        const int64_t cap = q->cap ? 2 * q->cap : 64;
        host_item* items = (host_item*)realloc(q->items, (size_t)cap * sizeof *items);
        if (!items) return mst_set_error(MST_ERR_OOM, "host stream queue of %lld items", (long long)cap);
        q->items = items;
        q->cap = cap;
    }
    q->items[n] = *it;
    q->pushed++;
    return q->deferred ? MST_OK : run_until(m, s, q->pushed);
}

mst_status mst_mm_host_ev_wait(mst_memmgr_t* m, void* ev, mst_stream_sel on) {
    const host_ev* e = (const host_ev*)ev;
    if (e->on == MST_STREAM_MAIN || e->on == on) return MST_OK; /* main runs at once; a stream is in order */
    if (on == MST_STREAM_MAIN) return run_until(m, e->on, e->seq);
    host_item it = {.is_wait = 1, .on = e->on, .seq = e->seq};
    return push(m, on, &it);
}

mst_status mst_mm_host_on_side(mst_memmgr_t* m, mst_stream_sel side, const mst_stash_batch* b) {
    host_item it = {.batch = *b};
    return push(m, side, &it);
}

mst_status mst_mm_host_join(mst_memmgr_t* m) {
    mst_status st = MST_OK;
    for (mst_stream_sel s = MST_STREAM_RING; s < MST_N_STREAMS; s++) {
        if (st == MST_OK) st = run_until(m, s, m->host[s].pushed);
        m->host[s].base = m->host[s].done = m->host[s].pushed; /* after an error: dropped */
    }
    return st;
}

void mst_mm_host_free(mst_memmgr_t* m) {
    for (int s = 0; s < MST_N_STREAMS; s++) free(m->host[s].items);
}
