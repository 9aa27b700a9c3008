/*
 * memmgr_impl.h — the memory manager's private state, shared by its rooms:
 *
 *   memmgr.c          the step protocol: create, policies, expect / advance,
 *                     prefetch, step begin / end / check, report
 *   memmgr_streams.c  stream and event plumbing (the table of event edges)
 *   memmgr_host_streams.c  the same modelled on the host, for a backend
 *                     without streams (the CPU)
 *   memmgr_buffers.c  KEEP, compute, restore and rerun buffers; pool sizing
 *   memmgr_saver.c    the saver: produce, claim, commit, fetch, release,
 *                     restore
 *
 * What the manager does with each policy:
 *
 *   KEEP       the tensor lives in its own [R, cols] buffer (produced there,
 *              or copied there when it is an op input)
 *   STASH      produced into a shared compute buffer (one per name, reused
 *              by the next layer once its stash has read it), packed into
 *              device pages on the ring stream. In the backward, the names
 *              whose readers take pages (read_from_pages: fc1_input and
 *              fc2_input, a wgrad's x; act_input, the activation) are read
 *              from the pages in place; the others are restored into one of
 *              two restore buffers (the next backward layer's restore is
 *              started while the current one runs, and a backward entry's
 *              first two while the forward before it runs: prefetch).
 *              A name read in place whose producer can write pages
 *              (act_input, fc2_input: the activation) is claimed instead
 *              (sv_claim): its pages are taken before the producer runs,
 *              which writes them besides the compute buffer; no copy. The
 *              first claim of a layer call takes every produced name read
 *              in place, in one ring batch with the saves queued before it
 *   OFFLOAD    as STASH, into pinned host pages
 *   STASH_FP8, OFFLOAD_FP8  as STASH, OFFLOAD into fp8 pages (their own
 *              pools, kind MM_KIND_FP8): never claimed nor read in place,
 *              restored (dequantized) into the restore buffers; a measuring
 *              step's exact copy holds the rows the pages would give back
 *   RECOMPUTE  fc2_input only: not saved; the grouped MLP recomputes it
 *   layer recompute (uniform / block): a recomputed layer saves nothing in
 *              its forward; the caller keeps the chunk input and reruns the
 *              chunk with the recompute saver before its backward
 *
 * Restore buffers are views into one arena: [restore_rows, cols] each, laid
 * out widest first so that every view has max_rows addressable rows inside
 * the arena (ops may read up to max_rows rows of a saved tensor; they use
 * only the first sum(counts)). Handles hold restore_rows rows: a save of
 * more rows overflows on the device and the step is rerun.
 *
 * A measuring step (eager, host-known counts) keeps stashed tensors as
 * exact-size copies (offloaded ones in pinned host memory, so the measuring
 * step holds no more device memory than the sized steps do), counts the pages each pool would need along the
 * schedule and the largest rows saved, and then sizes the pools (ceil(peak *
 * factor) pages) and the restore buffers (largest rows * (dev_factor +
 * host_factor), a page multiple, at most max_rows).
 */
#ifndef MST_MEMMGR_IMPL_H
#define MST_MEMMGR_IMPL_H

#include "../core/context.h"
#include "memmgr_debug.h"
#include "stash.h" /* batches */

/* The pools of a name, by kind_of(policy): bit 0 host pages (OFFLOAD),
 * bit 1 fp8 pages. */
enum { MM_KIND_STASH = 0, MM_KIND_OFFLOAD = 1, MM_KIND_FP8 = 2, MM_N_KINDS = 4 };

/* What a handed-out saver does: forward, backward, forward of a layer in a
 * recompute chunk (saves nothing), rerun of that layer before its backward. */
enum { MODE_FWD = 0, MODE_BWD, MODE_DISCARD, MODE_RECOMP, N_MODES };

typedef struct slot {            /* one saved tensor of (layer, mb, name)        */
    mst_stash_handle_t* handle;   /* STASH / OFFLOAD: its page table              */
    void* exact;                  /* measuring step: [n, cols] exact copy (OFFLOAD:
                                     pinned host memory, not the device's)        */
    void* saved_ev;               /* STASH / OFFLOAD: event, its save finished     */
    int64_t n_rows;               /* rows saved (host-known in a measuring step)  */
    int in_compute;               /* stash skipped: still in the compute buffer   */
    int produced;                 /* forward: produce handed out the compute buffer;
                                     until commit                                  */
    int claimed;                  /* CLAIM_*: its producer writes the pages; until commit */
    mst_pages pages;              /* read in place: the view fetch handed out     */
    int restore_idx;              /* restore buffer holding it, or -1             */
    int saved;                    /* 1 between commit and release                 */
} slot;

/* slot.claimed: taken with the layer call's first claim, then handed out. */
enum { CLAIM_NONE = 0, CLAIM_TAKEN, CLAIM_GIVEN };

typedef struct shared_bufs {      /* per name, for STASH / OFFLOAD / RECOMPUTE   */
    mst_tensor compute;           /* [R, cols] produced into                      */
    void* compute_free;           /* event: the stash of compute has read it      */
    int compute_pending;          /* compute_free recorded and not waited on      */
    mst_tensor restore[2];        /* [R, cols] views into the arena, restored
                                     into by backward parity                      */
    void* restore_done[2];        /* event: restore into restore[k] finished      */
    void* restore_free[2];        /* event: backward done reading restore[k]      */
    int restore_free_rec[2];      /* restore_free[k] recorded in this step        */
} shared_bufs;

typedef struct saver_ref {        /* what a handed-out mst_saver points at        */
    mst_memmgr_t* m;
    int32_t layer, mb, mode;
    mst_saver saver;
} saver_ref;

/* The side operations queued on one side stream and not launched yet: one
 * batch (distinct pools), launched at once when something must order after
 * it (memmgr_streams.c), and the events to record on the stream after it. */
typedef struct side_batch {
    mst_stash_batch b;            /* the operations                                */
    void* rec[2 * MST_STASH_BATCH_MAX]; /* [n_rec] events recorded after its launch */
    int n_rec;
} side_batch;

/* A backend without streams: the side streams modelled on the host
 * (memmgr_host_streams.c). An item is a batch of pool operations or a wait. */
typedef struct host_item {
    int is_wait;                  /* 1: wait until stream `on` ran `seq` items     */
    mst_stream_sel on;
    uint64_t seq;
    mst_stash_batch batch;        /* is_wait 0: the operations                     */
} host_item;

typedef struct host_stream {
    host_item* items;             /* [pushed - base] items since the last join     */
    int64_t cap;
    uint64_t base, pushed, done;  /* items counted since creation                  */
    int deferred;                 /* run each item as late as the events allow     */
} host_stream;

struct mst_memmgr {
    mst_ctx_t* ctx;
    mst_memmgr_config cfg;        /* cfg.schedule points at `schedule`             */
    mst_sched_entry* schedule;    /* [n_schedule]                                  */
    int32_t layers_per_chunk;     /* L / V                                         */
    mst_policy* policy;           /* [L, N_SAVED]                                  */
    int32_t* chunk_start;         /* [L] recompute chunk start, -1 = none          */
    slot* slots;                  /* [L, M, N_SAVED]                               */
    saver_ref* refs;              /* [L, M, N_MODES]                               */
    shared_bufs bufs[MST_N_SAVED];
    mst_tensor* recomp;           /* [L, N_SAVED] rerun buffers (recomputed layers) */
    int32_t* set_of;              /* [M] activation set of each microbatch
                                     (mst_schedule_sets): microbatches not in
                                     flight together share KEEP buffers       */
    int32_t n_sets;
    mst_tensor* keep;             /* [L, n_sets, N_SAVED] KEEP: [R, cols] buffers   */
    void** chunk_in;              /* [L, n_sets] [R, H] chunk inputs (chunk starts) */
    mst_pool_t* pool[MST_N_SAVED][MM_N_KINDS]; /* [name][kind_of(policy)]           */
    void* arena;                  /* restore buffers of the paged names, device    */
    size_t arena_bytes;           /* its size                                      */
    int64_t restore_rows;         /* rows of each restore buffer and handle; 0: none */
    int arena_sized;              /* the arena holds views of restored names only */
    int64_t sized_rows;           /* restore rows of the last sizing; 0: none yet  */
    int64_t had_pages[MST_N_SAVED][MM_N_KINDS][2]; /* [name][kind] device, host pages of the
                                     pool a measuring step released at its start */
    int pages_read[MST_N_SAVED];  /* the backward reads name n from its pages as they are */
    int64_t max_saved_rows;       /* measuring: largest rows of a paged tensor     */
    void* ev_main;                /* event: main stream reached a side operation   */
    void* ev_side;                /* event: a side stream's work so far (step end) */
    void* inputs_read;            /* event: stashes of op inputs have read them    */
    int inputs_pending;
    int64_t slow[MST_N_STREAMS];  /* tests: spin cycles per stream (mst_memmgr_debug_slow) */
    host_stream host[MST_N_STREAMS]; /* backend without streams: the side streams */
    side_batch batch[MST_N_STREAMS]; /* side streams: operations not launched yet */
    /* step state */
    int measuring, sized, in_step;
    int started;                  /* a layer call of the current entry is open     */
    int side_used;                /* bit s: this step put work on side stream s    */
    int32_t pos, cursor;          /* schedule entry, layer within its chunk        */
    int32_t bwd_seq;              /* backward layers so far this step (restore parity) */
    /* accounting */
    int64_t live_pages[MST_N_SAVED][MM_N_KINDS], peak_pages[MST_N_SAVED][MM_N_KINDS]; /* measuring */
    size_t live_exact, peak_exact;
    mst_mem_report_t rep;
};

/* ---- small helpers ------------------------------------------------------- */

static inline int64_t cols_of(const mst_memmgr_t* m, mst_saved_name n) {
    int64_t cols;
    mst_dtype dt;
    mst_saved_shape(n, m->cfg.hidden, m->cfg.ffn, &cols, &dt);
    return cols;
}
static inline mst_dtype dtype_of(const mst_memmgr_t* m, mst_saved_name n) {
    int64_t cols;
    mst_dtype dt;
    mst_saved_shape(n, m->cfg.hidden, m->cfg.ffn, &cols, &dt);
    return dt;
}
static inline size_t row_bytes(const mst_memmgr_t* m, mst_saved_name n) {
    return (size_t)cols_of(m, n) * mst_dtype_size(dtype_of(m, n));
}
static inline size_t buf_bytes(const mst_memmgr_t* m, mst_saved_name n) {
    return (size_t)m->cfg.max_rows * row_bytes(m, n);
}
static inline mst_policy policy_of(const mst_memmgr_t* m, int32_t l, mst_saved_name n) {
    return m->policy[l * MST_N_SAVED + n];
}
static inline slot* slot_of(const mst_memmgr_t* m, int32_t l, int32_t mb, mst_saved_name n) {
    return &m->slots[((int64_t)l * m->cfg.n_microbatches + mb) * MST_N_SAVED + n];
}
/* The KEEP buffer of (layer, mb, name): its activation set's. */
static inline mst_tensor* keep_of(mst_memmgr_t* m, int32_t l, int32_t mb, mst_saved_name n) {
    return &m->keep[((int64_t)l * m->n_sets + m->set_of[mb]) * MST_N_SAVED + n];
}
static inline int paged(mst_policy p) {
    return mst_policy_base(p) == MST_POLICY_STASH || mst_policy_base(p) == MST_POLICY_OFFLOAD;
}
static inline int kind_of(mst_policy p) { /* pool index of a paged policy: MM_KIND_* bits */
    return (mst_policy_base(p) == MST_POLICY_OFFLOAD ? MM_KIND_OFFLOAD : 0) | ((int)p & MST_POLICY_FP8 ? MM_KIND_FP8 : 0);
}
/* Host pages (OFFLOAD, OFFLOAD_FP8)? */
static inline int offloaded(mst_policy p) { return mst_policy_base(p) == MST_POLICY_OFFLOAD; }
/* Names that the grouped MLP's backward reads from pages as they are on
 * this backend and these shapes (fc1_input, fc2_input: a wgrad's x;
 * act_input: the activation, any backend). */
static inline int read_from_pages(const mst_memmgr_t* m, mst_saved_name n) { return m->pages_read[n]; }
static inline int32_t chunk_of(const mst_memmgr_t* m, int32_t l) { return l / m->layers_per_chunk; }
static inline int64_t pages_for(const mst_memmgr_t* m, int64_t rows) {
    return (rows + m->cfg.page_rows - 1) / m->cfg.page_rows;
}
/* Layer l and microbatch mb in range, else an error naming the one that is not. */
mst_status mst_mm_check_layer_mb(const mst_memmgr_t* m, int32_t l, int32_t mb);

/* ---- streams and events (memmgr_streams.c) ------------------------------- *
 * No-ops where the backend has no streams (everything runs in program order). */

mst_status mst_mm_ev_new(mst_memmgr_t* m, void** ev);
void mst_mm_ev_free(mst_memmgr_t* m, void* ev);
mst_status mst_mm_ev_record(mst_memmgr_t* m, void* ev, mst_stream_sel on);
/* Stream `on` waits for the last record of ev. */
mst_status mst_mm_ev_wait(mst_memmgr_t* m, void* ev, mst_stream_sel on);

/* The pool operations that run on a side stream. */
typedef enum mst_mm_side_op {
    MM_SAVE = 0,      /* mst_stash_save of t                         */
    MM_CLAIM,         /* mst_stash_claim of t->rows rows              */
    MM_RESTORE_COPY,  /* mst_stash_restore_copy into t                */
    MM_RETURN,        /* mst_stash_restore_return (t, counts unused)  */
} mst_mm_side_op;

/* Queues `op` on side stream `side`, to run after main's work so far and
 * after event `after` (NULL: none), in the stream's batch (launched first
 * when it holds p's pool already or is full). */
mst_status mst_mm_on_side(mst_memmgr_t* m, mst_stream_sel side, void* after, mst_mm_side_op op,
                          mst_pool_t* p, mst_stash_handle_t* h, mst_tensor* t, const mst_tensor* counts);
/* Launches the batch queued on side stream `side` (one backend call), then
 * records the events that wait for it; nothing queued: nothing. */
mst_status mst_mm_flush(mst_memmgr_t* m, mst_stream_sel side);
/* mst_mm_flush of every side stream. */
mst_status mst_mm_flush_all(mst_memmgr_t* m);
/* Main waits for the side streams this step used (step end; a graph
 * capture rejoins them here). */
mst_status mst_mm_join_side(mst_memmgr_t* m);
/* tests: main slowed at each layer call (mst_memmgr_debug_slow). */
mst_status mst_mm_slow_main(mst_memmgr_t* m);

/* The same on a backend without streams (memmgr_host_streams.c): events are
 * host objects, and each side stream runs its operations at once (program
 * order) or, deferred (tests), only when an event wait needs them. */
mst_status mst_mm_host_ev_new(void** ev);
void mst_mm_host_ev_free(void* ev);
void mst_mm_host_ev_record(mst_memmgr_t* m, void* ev, mst_stream_sel on);
mst_status mst_mm_host_ev_wait(mst_memmgr_t* m, void* ev, mst_stream_sel on);
/* Batch b (copied) as the next item of side stream `side`. */
mst_status mst_mm_host_on_side(mst_memmgr_t* m, mst_stream_sel side, const mst_stash_batch* b);
mst_status mst_mm_host_join(mst_memmgr_t* m);
void mst_mm_host_free(mst_memmgr_t* m);

/* ---- buffers and pool sizing (memmgr_buffers.c) --------------------------- */

/* t's [R, cols] buffer of name n, allocated on first use, its bytes added to *account. */
mst_status mst_mm_alloc_tensor(mst_memmgr_t* m, mst_saved_name n, mst_tensor* t, size_t* account);
/* The compute buffer of a name (and its event), allocated on first use. */
mst_status mst_mm_ensure_compute(mst_memmgr_t* m, mst_saved_name n);
/* Restore buffers (and handles) of `rows` rows for a measuring (sized 0)
 * or a sized step; the events of every paged name exist afterwards. */
mst_status mst_mm_ensure_arena(mst_memmgr_t* m, int64_t rows, int sized);
/* A restore buffer as the destination of a restore: its restore_rows rows. */
mst_tensor mst_mm_restore_dst(const mst_memmgr_t* m, const mst_tensor* view);
/* The rerun buffer of (layer l, name n) of a recomputed layer. */
mst_tensor* mst_mm_rerun_buf(mst_memmgr_t* m, int32_t l, mst_saved_name n);
/* After a measuring step: restore buffers, pools, handles and save events. */
mst_status mst_mm_size_pools(mst_memmgr_t* m);
/* Frees the measuring step's exact copy of slot s (of policy p). */
void mst_mm_free_exact(mst_memmgr_t* m, slot* s, mst_policy p);
/* Destroys the handles of name n whose policy uses pool kind k (MM_KIND_*; k < 0: all). */
void mst_mm_free_handles(mst_memmgr_t* m, mst_saved_name n, int k);
/* Frees every pool and its handles, keeping their sizes in had_pages: a
 * measuring step holds exact copies instead and sizes the pools again at
 * its end (a rerun that kept the pools it outgrew peaked above KEEP). */
void mst_mm_release_pools(mst_memmgr_t* m);

/* ---- the saver (memmgr_saver.c) ------------------------------------------- */

/* The saver of (layer l, mb) in mode MODE_*. */
const mst_saver* mst_mm_saver_for(mst_memmgr_t* m, int32_t l, int32_t mb, int mode);
/* Starts the restores of (l, mb)'s paged tensors into restore buffers k. */
mst_status mst_mm_issue_restore(mst_memmgr_t* m, int32_t l, int32_t mb, int k);

#endif /* MST_MEMMGR_IMPL_H */
