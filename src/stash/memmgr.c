/*
 * memmgr.c — the memory manager: owns the saved activations of every
 * (layer, microbatch, name), applies each (layer, name) policy, orders the
 * stash / restore traffic on the side stream, and sizes the page pools.
 *
 *   KEEP       the tensor lives in its own [R, cols] buffer (produced there,
 *              or copied there when it is an op input)
 *   STASH      produced into a shared compute buffer (one per name, reused
 *              by the next layer once its stash has read it), packed into
 *              device pages on the side stream. In the backward, the names
 *              whose readers take pages (read_from_pages: fc1_input and
 *              fc2_input, a wgrad's x; act_input, the activation) are read
 *              from the pages in place; the others are restored into one of
 *              two restore buffers (the next backward layer's restore is
 *              started while the current one runs, and a backward entry's
 *              first two while the forward before it runs: prefetch).
 *              A name read in place whose producer can write pages
 *              (act_input, fc2_input: the activation) is claimed instead
 *              (sv_claim): its pages are taken before the producer runs,
 *              which writes them besides the compute buffer; no copy
 *   OFFLOAD    as STASH, into pinned host pages
 *   RECOMPUTE  fc2_input only: not saved; the grouped MLP recomputes it
 *   layer recompute (uniform / block): a recomputed layer saves nothing in
 *              its forward; the caller keeps the chunk input and reruns the
 *              chunk with the recompute saver before its backward
 *
 * Streams (CUDA; the CPU runs everything in program order): main; ring =
 * every save and page return of every pool, in host order (the rings are
 * updated without atomics), so pages are used in the order the measuring
 * step counted them; copy = the copies of restores (mst_stash_restore_copy),
 * which run beside the saves (on PCIe: D2H and H2D at once).
 *   main --ev_main--> ring / copy: a save or restore starts after main's work so far;
 *   ring --compute_free--> main: the compute buffer is written again only
 *   after its stash read it; ring --inputs_read--> main: a layer's input
 *   buffers (fc1_input, probs) are reused only after their stash read them;
 *   ring --saved_ev--> copy: a restore copies a tensor after its save;
 *   ring --saved_ev--> main: a claimed tensor's producer runs after its claim;
 *   main --restore_free[k]--> copy: a restore overwrites restore buffer k
 *   only after the backward that used it; copy --restore_done[k]--> main
 *   (the backward) and --> ring (the page return, at the backward's release).
 *
 * Restore buffers are views into one arena: [restore_rows, cols] each, laid
 * out widest first so that every view has max_rows addressable rows inside
 * the arena (ops may read up to max_rows rows of a saved tensor; they use
 * only the first sum(counts)). Handles hold restore_rows rows: a save of
 * more rows overflows on the device and the step is rerun.
 *
 * A measuring step (eager, host-known counts) keeps stashed tensors as
 * exact-size copies, counts the pages each pool would need along the
 * schedule and the largest rows saved, and then sizes the pools (ceil(peak *
 * factor) pages) and the restore buffers (largest rows * (dev_factor +
 * host_factor), a page multiple, at most max_rows).
 */
#include <math.h>
#include <string.h>

#include "../core/context.h"

enum { MODE_FWD = 0, MODE_BWD, MODE_DISCARD, MODE_RECOMP, N_MODES };

typedef struct slot {            /* one saved tensor of (layer, mb, name)        */
    mst_tensor keep;              /* KEEP: own [R, cols] buffer                    */
    mst_stash_handle_t* handle;   /* STASH / OFFLOAD: its page table              */
    void* exact;                  /* measuring step: [n, cols] exact copy          */
    void* saved_ev;               /* STASH / OFFLOAD: event, its save finished     */
    int64_t n_rows;               /* rows saved (host-known in a measuring step)  */
    int in_compute;               /* stash skipped: still in the compute buffer   */
    int claimed;                  /* claimed, its producer writes the pages; until commit */
    mst_pages pages;              /* read in place: the view fetch handed out     */
    int restore_idx;              /* restore buffer holding it, or -1             */
    int saved;                    /* 1 between commit and release                 */
} slot;

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
    void** chunk_in;              /* [L, M] [R, H] chunk inputs (chunk starts)      */
    mst_pool_t* pool[MST_N_SAVED][2]; /* [name][0 STASH device, 1 OFFLOAD host]     */
    void* arena;                  /* restore buffers of the paged names, device    */
    size_t arena_bytes;           /* its size                                      */
    int64_t restore_rows;         /* rows of each restore buffer and handle; 0: none */
    int arena_sized;              /* the arena holds views of restored names only */
    int pages_read[MST_N_SAVED];  /* the backward reads name n from its pages as they are */
    int64_t max_saved_rows;       /* measuring: largest rows of a paged tensor     */
    void* ev_main;                /* event: main stream reached a commit           */
    void* ev_side;                /* event: side stream work so far                */
    void* inputs_read;            /* event: stashes of op inputs have read them    */
    int inputs_pending;
    /* step state */
    int measuring, sized, in_step;
    int started;                  /* a layer call of the current entry is open     */
    int side_used;                /* bit i: this step put work on side stream i    */
    int32_t pos, cursor;          /* schedule entry, layer within its chunk        */
    int32_t bwd_seq;              /* backward layers so far this step (restore parity) */
    /* accounting */
    int64_t live_pages[MST_N_SAVED][2], peak_pages[MST_N_SAVED][2]; /* measuring */
    size_t live_exact, peak_exact;
    mst_mem_report_t rep;
};

/* ---- small helpers ------------------------------------------------------- */

static int64_t cols_of(const mst_memmgr_t* m, mst_saved_name n) {
    switch (n) {
    case MST_SAVED_FC1_INPUT: return m->cfg.hidden;
    case MST_SAVED_ACT_INPUT: return 2 * m->cfg.ffn;
    case MST_SAVED_FC2_INPUT: return m->cfg.ffn;
    default: return 1;
    }
}
static mst_dtype dtype_of(mst_saved_name n) {
    return n == MST_SAVED_PROBS ? MST_DTYPE_FP32 : MST_DTYPE_BF16;
}
static size_t row_bytes(const mst_memmgr_t* m, mst_saved_name n) {
    return (size_t)cols_of(m, n) * mst_dtype_size(dtype_of(n));
}
static size_t buf_bytes(const mst_memmgr_t* m, mst_saved_name n) {
    return (size_t)m->cfg.max_rows * row_bytes(m, n);
}
static mst_policy policy_of(const mst_memmgr_t* m, int32_t l, mst_saved_name n) {
    return m->policy[l * MST_N_SAVED + n];
}
static slot* slot_of(mst_memmgr_t* m, int32_t l, int32_t mb, mst_saved_name n) {
    return &m->slots[((int64_t)l * m->cfg.n_microbatches + mb) * MST_N_SAVED + n];
}
static int paged(mst_policy p) { return p == MST_POLICY_STASH || p == MST_POLICY_OFFLOAD; }
static int kind_of(mst_policy p) { return p == MST_POLICY_OFFLOAD; } /* pool index */
/* Names that the grouped MLP's backward reads from pages as they are on
 * this backend and these shapes (fc1_input, fc2_input: a wgrad's x;
 * act_input: the activation, any backend). */
static int read_from_pages(const mst_memmgr_t* m, mst_saved_name n) { return m->pages_read[n]; }
static int32_t chunk_of(const mst_memmgr_t* m, int32_t l) { return l / m->layers_per_chunk; }
/* Layer l and microbatch mb in range, else an error naming the one that is not. */
static mst_status check_layer_mb(const mst_memmgr_t* m, int32_t l, int32_t mb) {
    if (l < 0 || l >= m->cfg.n_layers)
        return mst_set_error(MST_ERR_INVALID, "layer = %d, must be in [0, %d)", l, m->cfg.n_layers);
    if (mb < 0 || mb >= m->cfg.n_microbatches)
        return mst_set_error(MST_ERR_INVALID, "mb = %d, must be in [0, %d)", mb, m->cfg.n_microbatches);
    return MST_OK;
}

/* Events and side-stream switches: no-ops where the backend has no streams.
 * `where` is ON_MAIN or a side stream (MST_SIDE_*). */
enum { ON_MAIN = -1 };

static void* stream_of(mst_memmgr_t* m, int where) {
    return where == ON_MAIN ? NULL : m->ctx->be->side_stream(m->ctx, where);
}
static mst_status ev_record(mst_memmgr_t* m, void* ev, int where) {
    const mst_backend* be = m->ctx->be;
    if (!be->event_record) return MST_OK;
    return be->event_record(m->ctx, ev, stream_of(m, where));
}
static mst_status ev_wait(mst_memmgr_t* m, void* ev, int where) {
    const mst_backend* be = m->ctx->be;
    if (!be->stream_wait) return MST_OK;
    return be->stream_wait(m->ctx, stream_of(m, where), ev);
}
static mst_status ev_new(mst_memmgr_t* m, void** ev) {
    *ev = NULL;
    return m->ctx->be->event_create ? m->ctx->be->event_create(m->ctx, ev) : MST_OK;
}
static void ev_free(mst_memmgr_t* m, void* ev) {
    if (ev && m->ctx->be->event_destroy) m->ctx->be->event_destroy(m->ctx, ev);
}

/* Runs a pool operation on side stream `side` (MST_SIDE_*), after main's
 * work so far and after event `after` (NULL: none). */
typedef mst_status (*side_op)(mst_pool_t* p, mst_stash_handle_t* h, mst_tensor* t,
                              const mst_tensor* counts);
static mst_status op_stash(mst_pool_t* p, mst_stash_handle_t* h, mst_tensor* t, const mst_tensor* c) {
    return mst_stash_save(p, h, t, c);
}
static mst_status op_claim(mst_pool_t* p, mst_stash_handle_t* h, mst_tensor* t, const mst_tensor* c) {
    return mst_stash_claim(p, h, t->rows, c);
}
static mst_status op_restore_copy(mst_pool_t* p, mst_stash_handle_t* h, mst_tensor* t, const mst_tensor* c) {
    (void)c;
    return mst_stash_restore_copy(p, h, t);
}
static mst_status op_restore_return(mst_pool_t* p, mst_stash_handle_t* h, mst_tensor* t, const mst_tensor* c) {
    (void)t, (void)c;
    return mst_stash_restore_return(p, h);
}
static mst_status on_side(mst_memmgr_t* m, int side, void* after, side_op op, mst_pool_t* p,
                          mst_stash_handle_t* h, mst_tensor* t, const mst_tensor* counts) {
    const mst_backend* be = m->ctx->be;
    if (!be->side_stream) return op(p, h, t, counts);
    void* main_stream = mst_ctx_stream(m->ctx);
    MST_TRY(ev_record(m, m->ev_main, ON_MAIN));
    MST_TRY(ev_wait(m, m->ev_main, side));
    if (after) MST_TRY(ev_wait(m, after, side));
    MST_TRY(mst_ctx_set_stream(m->ctx, be->side_stream(m->ctx, side)));
    m->side_used |= 1 << side;
    mst_status st = op(p, h, t, counts);
    mst_status st2 = mst_ctx_set_stream(m->ctx, main_stream);
    return st != MST_OK ? st : st2;
}

/* ---- creation ------------------------------------------------------------- */

static mst_status check_config(const mst_memmgr_config* c) {
    if (c->n_layers < 1) return mst_set_error(MST_ERR_INVALID, "n_layers = %d, must be >= 1", c->n_layers);
    if (c->n_microbatches < 1)
        return mst_set_error(MST_ERR_INVALID, "n_microbatches = %d, must be >= 1", c->n_microbatches);
    if (c->virtual_stages < 1 || c->n_layers % c->virtual_stages != 0)
        return mst_set_error(MST_ERR_INVALID, "virtual_stages = %d does not divide n_layers = %d",
                             c->virtual_stages, c->n_layers);
    if (c->max_rows < 1 || c->hidden < 1 || c->ffn < 1)
        return mst_set_error(MST_ERR_INVALID, "max_rows = %lld, hidden = %lld, ffn = %lld: all must be >= 1",
                             (long long)c->max_rows, (long long)c->hidden, (long long)c->ffn);
    if (c->page_rows < 0 || c->dev_factor < 0 || c->host_factor < 0)
        return mst_set_error(MST_ERR_INVALID, "page_rows = %d, dev_factor = %g, host_factor = %g: none may be negative",
                             c->page_rows, c->dev_factor, c->host_factor);
    int64_t want = 2 * (int64_t)c->n_microbatches * c->virtual_stages;
    if (!c->schedule || c->n_schedule != want)
        return mst_set_error(MST_ERR_INVALID, "schedule has %d entries, expected 2 M V = %lld",
                             c->schedule ? c->n_schedule : 0, (long long)want);
    /* each (chunk, mb) forward and backward once, forward first */
    int32_t V = c->virtual_stages, M = c->n_microbatches;
    int* seen = (int*)calloc((size_t)(V * M), sizeof(int));
    if (!seen) return mst_set_error(MST_ERR_OOM, "schedule check");
    mst_status st = MST_OK;
    for (int32_t i = 0; i < c->n_schedule && st == MST_OK; i++) {
        mst_sched_entry e = c->schedule[i];
        if (e.chunk < 0 || e.chunk >= V || e.microbatch < 0 || e.microbatch >= M) {
            st = mst_set_error(MST_ERR_INVALID, "schedule[%d] = (chunk %d, mb %d) out of range", i, e.chunk, e.microbatch);
            break;
        }
        int* s = &seen[e.microbatch * V + e.chunk];
        if (*s != (e.backward ? 1 : 0))
            st = mst_set_error(MST_ERR_INVALID, "schedule[%d]: %s of (chunk %d, mb %d) out of order", i,
                               e.backward ? "backward" : "forward", e.chunk, e.microbatch);
        (*s)++;
    }
    free(seen);
    return st;
}

mst_status mst_memmgr_create(mst_ctx_t* ctx, const mst_memmgr_config* cfg, mst_memmgr_t** out) {
    MST_TRY(mst_check_ctx(ctx));
    if (!cfg) return mst_set_error(MST_ERR_INVALID, "cfg is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    MST_TRY(check_config(cfg));
    mst_memmgr_t* m = (mst_memmgr_t*)calloc(1, sizeof *m);
    if (!m) return mst_set_error(MST_ERR_OOM, "memory manager");
    m->ctx = ctx;
    m->cfg = *cfg;
    if (m->cfg.page_rows == 0) m->cfg.page_rows = 64;
    if (m->cfg.dev_factor == 0) m->cfg.dev_factor = 1.10;
    const int32_t L = cfg->n_layers, M = cfg->n_microbatches;
    m->layers_per_chunk = L / cfg->virtual_stages;
    m->schedule = (mst_sched_entry*)malloc(sizeof *m->schedule * (size_t)cfg->n_schedule);
    m->policy = (mst_policy*)calloc((size_t)L * MST_N_SAVED, sizeof *m->policy);
    m->chunk_start = (int32_t*)malloc(sizeof(int32_t) * (size_t)L);
    m->slots = (slot*)calloc((size_t)L * M * MST_N_SAVED, sizeof(slot));
    m->refs = (saver_ref*)calloc((size_t)L * M * N_MODES, sizeof(saver_ref));
    m->recomp = (mst_tensor*)calloc((size_t)L * MST_N_SAVED, sizeof(mst_tensor));
    m->chunk_in = (void**)calloc((size_t)L * M, sizeof(void*));
    if (!m->schedule || !m->policy || !m->chunk_start || !m->slots || !m->refs || !m->recomp || !m->chunk_in) {
        mst_memmgr_destroy(m);
        return mst_set_error(MST_ERR_OOM, "memory manager tables");
    }
    memcpy(m->schedule, cfg->schedule, sizeof *m->schedule * (size_t)cfg->n_schedule);
    m->cfg.schedule = m->schedule;
    for (int32_t l = 0; l < L; l++) m->chunk_start[l] = -1;
    for (int64_t i = 0; i < (int64_t)L * M * MST_N_SAVED; i++) {
        m->slots[i].restore_idx = -1;
    }
    mst_status st = ev_new(m, &m->ev_main);
    if (st == MST_OK) st = ev_new(m, &m->ev_side);
    if (st == MST_OK) st = ev_new(m, &m->inputs_read);
    if (st != MST_OK) {
        mst_memmgr_destroy(m);
        return st;
    }
    for (int n = 0; n < MST_N_SAVED; n++)
        m->rep.static_keep_bytes += (size_t)L * M * buf_bytes(m, (mst_saved_name)n);
    const mst_backend* be = ctx->be; /* fc1_input: x of fc1's wgrad (dy 2F wide); fc2_input: of fc2's (dy H) */
    const int64_t pr = m->cfg.page_rows;
    m->pages_read[MST_SAVED_FC1_INPUT] = be->gl_wgrad_pages && be->gl_wgrad_pages(ctx, pr, cfg->hidden, 2 * cfg->ffn);
    m->pages_read[MST_SAVED_FC2_INPUT] = be->gl_wgrad_pages && be->gl_wgrad_pages(ctx, pr, cfg->ffn, cfg->hidden);
    m->pages_read[MST_SAVED_ACT_INPUT] = 1;
    *out = m;
    return MST_OK;
}

/* Destroys the handles of the slots of `name` whose policy uses pool kind k
 * (k < 0: every handle of `name`). */
static void free_handles(mst_memmgr_t* m, mst_saved_name n, int k) {
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int32_t mb = 0; mb < m->cfg.n_microbatches; mb++) {
            slot* s = slot_of(m, l, mb, n);
            if (!s->handle || (k >= 0 && kind_of(policy_of(m, l, n)) != k)) continue;
            mst_stash_handle_destroy(s->handle);
            s->handle = NULL;
        }
}

void mst_memmgr_destroy(mst_memmgr_t* m) {
    if (!m) return;
    mst_ctx_t* ctx = m->ctx;
    mst_ctx_sync(ctx);
    const int64_t n_slots = (int64_t)m->cfg.n_layers * m->cfg.n_microbatches * MST_N_SAVED;
    for (int n = 0; n < MST_N_SAVED; n++) {
        if (m->slots && m->policy) free_handles(m, (mst_saved_name)n, -1);
        mst_pool_destroy(m->pool[n][0]);
        mst_pool_destroy(m->pool[n][1]);
        shared_bufs* b = &m->bufs[n];
        mst_free(ctx, b->compute.data);
        ev_free(m, b->compute_free);
        for (int k = 0; k < 2; k++) {
            ev_free(m, b->restore_done[k]);
            ev_free(m, b->restore_free[k]);
        }
    }
    mst_free(ctx, m->arena);
    for (int64_t i = 0; m->slots && i < n_slots; i++) {
        mst_free(ctx, m->slots[i].keep.data);
        mst_free(ctx, m->slots[i].exact);
        ev_free(m, m->slots[i].saved_ev);
    }
    for (int64_t i = 0; m->recomp && i < (int64_t)m->cfg.n_layers * MST_N_SAVED; i++)
        mst_free(ctx, m->recomp[i].data);
    for (int64_t i = 0; m->chunk_in && i < (int64_t)m->cfg.n_layers * m->cfg.n_microbatches; i++)
        mst_free(ctx, m->chunk_in[i]);
    ev_free(m, m->ev_main);
    ev_free(m, m->ev_side);
    ev_free(m, m->inputs_read);
    free(m->schedule), free(m->policy), free(m->chunk_start), free(m->slots), free(m->refs);
    free(m->recomp), free(m->chunk_in);
    free(m);
}

/* ---- policies ------------------------------------------------------------- */

mst_status mst_memmgr_set_policy(mst_memmgr_t* m, int32_t layer, mst_saved_name name, mst_policy p) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if (m->sized || m->in_step) return mst_set_error(MST_ERR_STATE, "policies are set before the first step");
    if (layer < -1 || layer >= m->cfg.n_layers)
        return mst_set_error(MST_ERR_INVALID, "layer = %d, must be -1 or in [0, %d)", layer, m->cfg.n_layers);
    if ((int)name < 0 || name >= MST_N_SAVED)
        return mst_set_error(MST_ERR_INVALID, "name = %d is not a saved tensor", (int)name);
    if ((int)p < 0 || p >= MST_N_POLICIES) return mst_set_error(MST_ERR_INVALID, "policy = %d", (int)p);
    if (p == MST_POLICY_RECOMPUTE && name != MST_SAVED_FC2_INPUT)
        return mst_set_error(MST_ERR_INVALID,
                             "policy recompute for %s: only fc2_input is recomputed by the grouped MLP "
                             "(use layer recompute for the rest)", mst_saved_name_str(name));
    for (int32_t l = layer < 0 ? 0 : layer; l < (layer < 0 ? m->cfg.n_layers : layer + 1); l++)
        m->policy[l * MST_N_SAVED + name] = p;
    return MST_OK;
}

/* One "name=policy" item, or a bare policy for every name ("recompute" then
 * means: fc2_input recomputed, the rest kept). */
static mst_status apply_item(mst_memmgr_t* m, const char* item) {
    const char* eq = strchr(item, '=');
    mst_policy p;
    if (!eq) {
        MST_TRY(mst_policy_parse(item, &p));
        for (int n = 0; n < MST_N_SAVED; n++) {
            mst_policy q = p == MST_POLICY_RECOMPUTE && n != MST_SAVED_FC2_INPUT ? MST_POLICY_KEEP : p;
            MST_TRY(mst_memmgr_set_policy(m, -1, (mst_saved_name)n, q));
        }
        return MST_OK;
    }
    char name[64];
    size_t len = (size_t)(eq - item);
    if (len >= sizeof name) return mst_set_error(MST_ERR_INVALID, "policy spec item '%s' is too long", item);
    memcpy(name, item, len);
    name[len] = '\0';
    mst_saved_name n;
    MST_TRY(mst_saved_name_parse(name, &n));
    MST_TRY(mst_policy_parse(eq + 1, &p));
    return mst_memmgr_set_policy(m, -1, n, p);
}

mst_status mst_memmgr_set_policy_spec(mst_memmgr_t* m, const char* spec) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if (!spec || !*spec) return mst_set_error(MST_ERR_INVALID, "policy spec is empty");
    char buf[512];
    if (strlen(spec) >= sizeof buf) return mst_set_error(MST_ERR_INVALID, "policy spec is too long");
    strcpy(buf, spec);
    for (char* item = strtok(buf, ","); item; item = strtok(NULL, ",")) MST_TRY(apply_item(m, item));
    return MST_OK;
}

mst_status mst_memmgr_set_recompute(mst_memmgr_t* m, const mst_recompute_config* rc) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if (m->sized || m->in_step) return mst_set_error(MST_ERR_STATE, "layer recompute is set before the first step");
    MST_TRY(mst_recompute_plan(rc, m->cfg.n_layers, m->chunk_start));
    for (int32_t l = 0; l < m->cfg.n_layers; l++) { /* chunks stay inside a model chunk */
        int32_t first = chunk_of(m, l) * m->layers_per_chunk;
        if (m->chunk_start[l] >= 0 && m->chunk_start[l] < first) m->chunk_start[l] = first;
    }
    return MST_OK;
}

int32_t mst_memmgr_recompute_chunk(const mst_memmgr_t* m, int32_t layer) {
    return m && layer >= 0 && layer < m->cfg.n_layers ? m->chunk_start[layer] : -1;
}

/* ---- buffers -------------------------------------------------------------- */

static mst_status alloc_tensor(mst_memmgr_t* m, mst_saved_name n, mst_tensor* t, size_t* account) {
    if (t->data) return MST_OK;
    MST_TRY(mst_alloc(m->ctx, buf_bytes(m, n), &t->data));
    *t = mst_tensor_make(t->data, dtype_of(n), m->cfg.max_rows, cols_of(m, n));
    *account += buf_bytes(m, n);
    return MST_OK;
}

/* The compute buffer of a name, for its produced tensors; allocated on first use. */
static mst_status ensure_compute(mst_memmgr_t* m, mst_saved_name n) {
    shared_bufs* b = &m->bufs[n];
    if (b->compute.data) return MST_OK;
    MST_TRY(alloc_tensor(m, n, &b->compute, &m->rep.compute_bytes));
    return ev_new(m, &b->compute_free);
}

/* Is `n` stashed or offloaded on some layer (outside recompute chunks)? */
static int name_paged(const mst_memmgr_t* m, mst_saved_name n) {
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        if (paged(policy_of(m, l, n)) && m->chunk_start[l] < 0) return 1;
    return 0;
}

/* Does name n need restore buffers? In a measuring step every paged name
 * does; in a sized step those that some layer offloads or that the backward
 * does not read from pages (the others are read in place). */
static int name_restored(const mst_memmgr_t* m, mst_saved_name n, int sized) {
    if (!name_paged(m, n)) return 0;
    if (!sized || !read_from_pages(m, n)) return 1;
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        if (policy_of(m, l, n) == MST_POLICY_OFFLOAD && m->chunk_start[l] < 0) return 1;
    return 0;
}

/* The arena layout for restore buffers of `rows` rows: the views of the
 * restored names (name_restored), widest first, both parities of a name
 * side by side, each 256-byte aligned; returns the bytes so that every view
 * has max_rows rows inside the arena. off[n][k] = byte offset of restore[k]
 * of name n. */
static size_t arena_layout(const mst_memmgr_t* m, int64_t rows, int sized, size_t off[MST_N_SAVED][2]) {
    int order[MST_N_SAVED], n_order = 0;
    for (int n = 0; n < MST_N_SAVED; n++) {
        if (!name_restored(m, (mst_saved_name)n, sized)) continue;
        int i = n_order++;
        for (; i > 0 && row_bytes(m, (mst_saved_name)order[i - 1]) < row_bytes(m, (mst_saved_name)n); i--)
            order[i] = order[i - 1];
        order[i] = n;
    }
    size_t at = 0, need = 0;
    for (int i = 0; i < n_order; i++)
        for (int k = 0; k < 2; k++) {
            const mst_saved_name n = (mst_saved_name)order[i];
            off[n][k] = at;
            at += ((size_t)rows * row_bytes(m, n) + 255) & ~(size_t)255;
            if (off[n][k] + buf_bytes(m, n) > need) need = off[n][k] + buf_bytes(m, n);
        }
    return at > need ? at : need;
}

/* Restore buffers (and handles) of `rows` rows for a measuring or a sized
 * step: re-lays the arena when either changes; the events of every paged
 * name exist afterwards. */
static mst_status ensure_arena(mst_memmgr_t* m, int64_t rows, int sized) {
    for (int n = 0; n < MST_N_SAVED; n++) {
        shared_bufs* b = &m->bufs[n];
        for (int k = 0; k < 2 && name_paged(m, (mst_saved_name)n); k++) {
            if (!b->restore_done[k]) MST_TRY(ev_new(m, &b->restore_done[k]));
            if (!b->restore_free[k]) MST_TRY(ev_new(m, &b->restore_free[k]));
        }
    }
    if (rows == m->restore_rows && sized == m->arena_sized) return MST_OK;
    for (int n = 0; n < MST_N_SAVED; n++) free_handles(m, (mst_saved_name)n, -1); /* sized for the old rows */
    mst_free(m->ctx, m->arena);
    m->arena = NULL;
    m->rep.compute_bytes -= m->arena_bytes;
    m->arena_bytes = 0;
    m->restore_rows = 0;
    size_t off[MST_N_SAVED][2];
    const size_t bytes = arena_layout(m, rows, sized, off);
    if (bytes) MST_TRY(mst_alloc(m->ctx, bytes, &m->arena));
    m->arena_bytes = bytes;
    m->rep.compute_bytes += bytes;
    m->restore_rows = rows;
    m->arena_sized = sized;
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < 2; k++)
            m->bufs[n].restore[k] = name_restored(m, (mst_saved_name)n, sized)
                                        ? mst_tensor_make((char*)m->arena + off[n][k], dtype_of((mst_saved_name)n),
                                                          m->cfg.max_rows, cols_of(m, (mst_saved_name)n))
                                        : mst_tensor_make(NULL, dtype_of((mst_saved_name)n), 0, 0);
    return MST_OK;
}

/* A restore buffer as the destination of a restore: its restore_rows rows. */
static mst_tensor restore_dst(const mst_memmgr_t* m, const mst_tensor* view) {
    return mst_tensor_make(view->data, view->dtype, m->restore_rows, view->cols);
}

/* A recomputed layer's rerun buffers are shared by every chunk: a chunk is
 * rerun and consumed by its backward before the next chunk is rerun. */
static mst_tensor* rerun_buf(mst_memmgr_t* m, int32_t l, mst_saved_name n) {
    return &m->recomp[(l - m->chunk_start[l]) * MST_N_SAVED + n];
}

mst_status mst_memmgr_chunk_input(mst_memmgr_t* m, int32_t layer, int32_t mb, mst_tensor* out) {
    if (!m || !out) return mst_set_error(MST_ERR_INVALID, "m or out is NULL");
    if (layer < 0 || layer >= m->cfg.n_layers || m->chunk_start[layer] != layer)
        return mst_set_error(MST_ERR_INVALID, "layer = %d does not start a recompute chunk", layer);
    if (mb < 0 || mb >= m->cfg.n_microbatches)
        return mst_set_error(MST_ERR_INVALID, "mb = %d, must be in [0, %d)", mb, m->cfg.n_microbatches);
    void** p = &m->chunk_in[(int64_t)layer * m->cfg.n_microbatches + mb];
    size_t bytes = buf_bytes(m, MST_SAVED_FC1_INPUT);
    if (!*p) {
        MST_TRY(mst_alloc(m->ctx, bytes, p));
        m->rep.kept_bytes += bytes;
    }
    *out = mst_tensor_make(*p, MST_DTYPE_BF16, m->cfg.max_rows, m->cfg.hidden);
    return MST_OK;
}

mst_status mst_memmgr_keep_buffer(mst_memmgr_t* m, int32_t layer, int32_t mb, mst_saved_name name,
                                  mst_tensor* out) {
    if (!m || !out) return mst_set_error(MST_ERR_INVALID, "m or out is NULL");
    MST_TRY(check_layer_mb(m, layer, mb));
    if ((int)name < 0 || name >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)name);
    memset(out, 0, sizeof *out);
    if (policy_of(m, layer, name) != MST_POLICY_KEEP || m->chunk_start[layer] >= 0) return MST_OK;
    slot* s = slot_of(m, layer, mb, name);
    MST_TRY(alloc_tensor(m, name, &s->keep, &m->rep.kept_bytes));
    *out = s->keep;
    return MST_OK;
}

/* ---- the saver ------------------------------------------------------------- */

static int64_t pages_for(const mst_memmgr_t* m, int64_t rows) {
    return (rows + m->cfg.page_rows - 1) / m->cfg.page_rows;
}

/* Host-known rows of a measuring step: sum of counts (syncs), checked
 * (negative counts, sum past max_rows) by mst_counts_offsets. */
static mst_status host_rows(mst_memmgr_t* m, const mst_tensor* counts, int64_t* n) {
    int32_t E = (int32_t)counts->rows;
    int32_t* h = (int32_t*)malloc(sizeof(int32_t) * (size_t)E);
    int64_t* off = (int64_t*)malloc(sizeof(int64_t) * ((size_t)E + 1));
    mst_status st = h && off ? mst_copy_b2h(m->ctx, h, counts->data, sizeof(int32_t) * (size_t)E)
                             : mst_set_error(MST_ERR_OOM, "counts copy of %d groups", E);
    if (st == MST_OK) st = mst_counts_offsets(h, E, m->cfg.max_rows, off);
    if (st == MST_OK) *n = off[E];
    free(h);
    free(off);
    return st;
}

static mst_status sv_produce(void* self, mst_saved_name n, int64_t rows, int64_t cols, mst_dtype dt,
                             mst_tensor* out) {
    saver_ref* r = (saver_ref*)self;
    mst_memmgr_t* m = r->m;
    if ((int)n < 0 || n >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)n);
    if (rows != m->cfg.max_rows || cols != cols_of(m, n) || dt != dtype_of(n))
        return mst_set_error(MST_ERR_INVALID, "produce %s: [%lld, %lld] %s, the manager holds [%lld, %lld] %s",
                             mst_saved_name_str(n), (long long)rows, (long long)cols, mst_dtype_name(dt),
                             (long long)m->cfg.max_rows, (long long)cols_of(m, n), mst_dtype_name(dtype_of(n)));
    if (r->mode == MODE_RECOMP) {
        MST_TRY(alloc_tensor(m, n, rerun_buf(m, r->layer, n), &m->rep.kept_bytes));
        *out = *rerun_buf(m, r->layer, n);
        return MST_OK;
    }
    if (r->mode == MODE_FWD && policy_of(m, r->layer, n) == MST_POLICY_KEEP) {
        slot* s = slot_of(m, r->layer, r->mb, n);
        MST_TRY(alloc_tensor(m, n, &s->keep, &m->rep.kept_bytes));
        *out = s->keep;
        return MST_OK;
    }
    if (r->mode == MODE_BWD) return mst_set_error(MST_ERR_STATE, "produce of %s in a backward", mst_saved_name_str(n));
    MST_TRY(ensure_compute(m, n));
    shared_bufs* b = &m->bufs[n];
    if (b->compute_pending) { /* its last stash must have read it */
        MST_TRY(ev_wait(m, b->compute_free, ON_MAIN));
        b->compute_pending = 0;
    }
    *out = b->compute;
    return MST_OK;
}

/* Is (layer, mb)'s backward the very next thing after its forward? Only the
 * last layer of a chunk can be, when the next schedule entry is its backward. */
static int backward_follows(const mst_memmgr_t* m, int32_t l, int32_t mb) {
    int32_t c = chunk_of(m, l);
    if (l != (c + 1) * m->layers_per_chunk - 1 || m->pos + 1 >= m->cfg.n_schedule) return 0;
    mst_sched_entry e = m->schedule[m->pos + 1];
    return e.backward && e.chunk == c && e.microbatch == mb;
}

static mst_status commit_measuring(mst_memmgr_t* m, slot* s, mst_saved_name n, const mst_tensor* src,
                                   const mst_tensor* counts) {
    (void)counts; /* s->n_rows was read at commit */
    size_t bytes = (size_t)s->n_rows * row_bytes(m, n);
    if (bytes) {
        MST_TRY(mst_alloc(m->ctx, bytes, &s->exact));
        MST_TRY(mst_copy_b2b(m->ctx, s->exact, src->data, bytes));
    }
    return MST_OK;
}

static mst_status sv_commit(void* self, mst_saved_name n, const mst_tensor* src, const mst_tensor* counts) {
    saver_ref* r = (saver_ref*)self;
    mst_memmgr_t* m = r->m;
    if ((int)n < 0 || n >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)n);
    MST_TRY(mst_check_tensor(src, "src", dtype_of(n)));
    MST_TRY(mst_check_shape(src, "src", m->cfg.max_rows, cols_of(m, n)));
    if (r->mode == MODE_DISCARD) return MST_OK;
    if (r->mode == MODE_RECOMP) {
        mst_tensor* t = rerun_buf(m, r->layer, n);
        MST_TRY(alloc_tensor(m, n, t, &m->rep.kept_bytes));
        return t->data == src->data ? MST_OK : mst_copy_b2b(m->ctx, t->data, src->data, buf_bytes(m, n));
    }
    if (r->mode != MODE_FWD) return mst_set_error(MST_ERR_STATE, "commit of %s in a backward", mst_saved_name_str(n));
    slot* s = slot_of(m, r->layer, r->mb, n);
    if (s->saved)
        return mst_set_error(MST_ERR_STATE, "%s of (layer %d, mb %d) committed twice", mst_saved_name_str(n),
                             r->layer, r->mb);
    mst_policy p = policy_of(m, r->layer, n);
    if (m->measuring) { /* exact shapes: what this tensor needs kept at its true size */
        MST_TRY(host_rows(m, counts, &s->n_rows));
        m->live_exact += (size_t)s->n_rows * row_bytes(m, n);
        if (m->live_exact > m->peak_exact) m->peak_exact = m->live_exact;
    }
    s->saved = 1;
    s->in_compute = 0;
    s->restore_idx = -1;
    if (p == MST_POLICY_RECOMPUTE) return MST_OK;
    if (p == MST_POLICY_KEEP) {
        MST_TRY(alloc_tensor(m, n, &s->keep, &m->rep.kept_bytes));
        return s->keep.data == src->data ? MST_OK : mst_copy_b2b(m->ctx, s->keep.data, src->data, buf_bytes(m, n));
    }
    if (s->claimed) { /* its producer writes the pages (sv_claim): nothing to copy */
        s->claimed = 0;
        return MST_OK;
    }
    int from_compute = src->data == m->bufs[n].compute.data;
    if (from_compute && backward_follows(m, r->layer, r->mb)) { /* no stash: used right away */
        s->in_compute = 1;
        return MST_OK;
    }
    if (m->measuring) {
        MST_TRY(commit_measuring(m, s, n, src, counts));
        int64_t* live = &m->live_pages[n][kind_of(p)];
        *live += pages_for(m, s->n_rows);
        if (*live > m->peak_pages[n][kind_of(p)]) m->peak_pages[n][kind_of(p)] = *live;
        if (s->n_rows > m->max_saved_rows) m->max_saved_rows = s->n_rows;
        return MST_OK;
    }
    mst_tensor t = *src;
    MST_TRY(on_side(m, MST_SIDE_RING, NULL, op_stash, m->pool[n][kind_of(p)], s->handle, &t, counts));
    MST_TRY(ev_record(m, s->saved_ev, MST_SIDE_RING));
    if (from_compute) {
        MST_TRY(ev_record(m, m->bufs[n].compute_free, MST_SIDE_RING));
        m->bufs[n].compute_pending = 1;
    } else {
        MST_TRY(ev_record(m, m->inputs_read, MST_SIDE_RING));
        m->inputs_pending = 1;
    }
    return MST_OK;
}

/* In a sized step a stashed fc1_input, fc2_input or act_input is read from
 * its device pages in place (no restore copy) where read_from_pages: the
 * backward waits for its save and the pages go back at its release.
 * Offloaded ones are restored (in place the wgrad would read them over PCIe
 * once per row block of its output). */
static int in_place(const mst_memmgr_t* m, int32_t l, mst_saved_name n) {
    return !m->measuring && policy_of(m, l, n) == MST_POLICY_STASH && read_from_pages(m, n);
}

/* Starts copying the paged tensors of (l, mb) back into restore buffers k
 * (copy stream); their pages are returned at the backward's release. */
static mst_status issue_restore(mst_memmgr_t* m, int32_t l, int32_t mb, int k) {
    if (m->measuring || m->chunk_start[l] >= 0) return MST_OK;
    for (int n = 0; n < MST_N_SAVED; n++) {
        slot* s = slot_of(m, l, mb, (mst_saved_name)n);
        if (!paged(policy_of(m, l, (mst_saved_name)n)) || !s->saved || s->in_compute || s->restore_idx >= 0 ||
            in_place(m, l, (mst_saved_name)n))
            continue;
        shared_bufs* b = &m->bufs[n];
        if (b->restore_free_rec[k]) MST_TRY(ev_wait(m, b->restore_free[k], MST_SIDE_COPY));
        mst_pool_t* pool = m->pool[n][kind_of(policy_of(m, l, (mst_saved_name)n))];
        mst_tensor dst = restore_dst(m, &b->restore[k]);
        MST_TRY(on_side(m, MST_SIDE_COPY, s->saved_ev, op_restore_copy, pool, s->handle, &dst, NULL));
        MST_TRY(ev_record(m, b->restore_done[k], MST_SIDE_COPY));
        s->restore_idx = k;
    }
    return MST_OK;
}

static mst_status sv_fetch(void* self, mst_saved_name n, mst_tensor* out) {
    saver_ref* r = (saver_ref*)self;
    mst_memmgr_t* m = r->m;
    if ((int)n < 0 || n >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)n);
    if (r->mode != MODE_BWD) return mst_set_error(MST_ERR_STATE, "fetch of %s outside a backward", mst_saved_name_str(n));
    if (m->chunk_start[r->layer] >= 0) {
        *out = *rerun_buf(m, r->layer, n);
        if (!out->data)
            return mst_set_error(MST_ERR_STATE, "%s of recomputed layer %d was not rerun before its backward",
                                 mst_saved_name_str(n), r->layer);
        return MST_OK;
    }
    slot* s = slot_of(m, r->layer, r->mb, n);
    if (!s->saved)
        return mst_set_error(MST_ERR_STATE, "%s of (layer %d, mb %d) was never saved", mst_saved_name_str(n),
                             r->layer, r->mb);
    mst_policy p = policy_of(m, r->layer, n);
    if (p == MST_POLICY_RECOMPUTE) {
        *out = mst_tensor_make(NULL, dtype_of(n), m->cfg.max_rows, cols_of(m, n));
        return MST_OK;
    }
    if (p == MST_POLICY_KEEP) {
        *out = s->keep;
        return MST_OK;
    }
    shared_bufs* b = &m->bufs[n];
    if (s->in_compute) {
        *out = b->compute;
        return MST_OK;
    }
    if (in_place(m, r->layer, n)) {
        MST_TRY(ev_wait(m, s->saved_ev, ON_MAIN)); /* its pages are written */
        MST_TRY(mst_stash_handle_pages(s->handle, &s->pages));
        *out = mst_tensor_make((void*)s->pages.table, dtype_of(n), m->cfg.max_rows, cols_of(m, n));
        out->pages = &s->pages;
        return MST_OK;
    }
    int k = m->bwd_seq & 1;
    if (m->measuring) {
        size_t bytes = (size_t)s->n_rows * row_bytes(m, n);
        if (bytes) MST_TRY(mst_copy_b2b(m->ctx, b->restore[k].data, s->exact, bytes));
        s->restore_idx = k;
    } else {
        MST_TRY(issue_restore(m, r->layer, r->mb, k)); /* when not prefetched */
        MST_TRY(ev_wait(m, b->restore_done[s->restore_idx], ON_MAIN));
    }
    *out = b->restore[s->restore_idx];
    return MST_OK;
}

/* A stashed tensor read in place, claimed before its producer runs: the
 * claim (a save without the copy) takes its pages on the ring stream, in
 * order with the pool's other ring updates, main waits for it, and the
 * producer writes the rows into the pages besides its output; the commit
 * then copies nothing. */
static mst_status sv_claim(void* self, mst_saved_name n, const mst_tensor* counts, mst_pages* out) {
    saver_ref* r = (saver_ref*)self;
    mst_memmgr_t* m = r->m;
    memset(out, 0, sizeof *out);
    if ((int)n < 0 || n >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)n);
    if (r->mode != MODE_FWD || !in_place(m, r->layer, n) || backward_follows(m, r->layer, r->mb)) return MST_OK;
    slot* s = slot_of(m, r->layer, r->mb, n);
    if (s->saved || s->claimed)
        return mst_set_error(MST_ERR_STATE, "%s of (layer %d, mb %d) claimed after its commit or twice",
                             mst_saved_name_str(n), r->layer, r->mb);
    MST_TRY(ensure_compute(m, n));
    mst_tensor t = m->bufs[n].compute; /* [R, cols]: counts past R are bad counts, as in a save */
    /* after main's work so far: the counts may come from it (the router) */
    MST_TRY(on_side(m, MST_SIDE_RING, NULL, op_claim, m->pool[n][kind_of(MST_POLICY_STASH)], s->handle, &t, counts));
    MST_TRY(ev_record(m, s->saved_ev, MST_SIDE_RING));
    MST_TRY(ev_wait(m, s->saved_ev, ON_MAIN));
    MST_TRY(mst_stash_handle_pages(s->handle, out));
    s->claimed = 1;
    return MST_OK;
}

static mst_status sv_release(void* self, mst_saved_name n) {
    saver_ref* r = (saver_ref*)self;
    mst_memmgr_t* m = r->m;
    if ((int)n < 0 || n >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)n);
    if (r->mode != MODE_BWD || m->chunk_start[r->layer] >= 0) return MST_OK;
    slot* s = slot_of(m, r->layer, r->mb, n);
    if (!s->saved) return MST_OK;
    mst_policy p = policy_of(m, r->layer, n);
    if (s->restore_idx >= 0) {
        shared_bufs* b = &m->bufs[n];
        MST_TRY(ev_record(m, b->restore_free[s->restore_idx], ON_MAIN));
        b->restore_free_rec[s->restore_idx] = 1;
        if (!m->measuring) /* the pages go back now, where the measuring step counted them free */
            MST_TRY(on_side(m, MST_SIDE_RING, b->restore_done[s->restore_idx], op_restore_return,
                            m->pool[n][kind_of(p)], s->handle, NULL, NULL));
    } else if (in_place(m, r->layer, n) && !s->in_compute) /* after the backward's reads (main, so far) */
        MST_TRY(on_side(m, MST_SIDE_RING, NULL, op_restore_return, m->pool[n][kind_of(p)], s->handle, NULL, NULL));
    if (m->measuring) {
        m->live_exact -= (size_t)s->n_rows * row_bytes(m, n);
        if (paged(p) && !s->in_compute) m->live_pages[n][kind_of(p)] -= pages_for(m, s->n_rows);
        mst_free(m->ctx, s->exact);
        s->exact = NULL;
    }
    s->saved = 0;
    s->restore_idx = -1;
    s->in_compute = 0;
    return MST_OK;
}

/* ---- step protocol --------------------------------------------------------- */

static const mst_saver* saver_for(mst_memmgr_t* m, int32_t l, int32_t mb, int mode) {
    saver_ref* r = &m->refs[((int64_t)l * m->cfg.n_microbatches + mb) * N_MODES + mode];
    r->m = m;
    r->layer = l;
    r->mb = mb;
    r->mode = mode;
    r->saver = (mst_saver){r, sv_produce, sv_commit, sv_fetch, sv_release, sv_claim};
    return &r->saver;
}

static mst_status check_call(const mst_memmgr_t* m, int32_t l, int32_t mb, const mst_saver** out) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    if (!m->in_step) return mst_set_error(MST_ERR_STATE, "call outside mst_memmgr_step_begin / step_end");
    return check_layer_mb(m, l, mb);
}

/* The previous layer call is over: move the cursor past it. */
static void advance(mst_memmgr_t* m) {
    if (!m->started) return;
    m->started = 0;
    if (++m->cursor == m->layers_per_chunk) {
        m->cursor = 0;
        m->pos++;
    }
}

/* The call must be the next layer of the schedule. */
static mst_status expect(mst_memmgr_t* m, int backward, int32_t l, int32_t mb) {
    advance(m);
    const char* what[2] = {"forward", "backward"};
    if (m->pos >= m->cfg.n_schedule)
        return mst_set_error(MST_ERR_STATE, "%s of (layer %d, mb %d) after the schedule's last entry",
                             what[backward], l, mb);
    mst_sched_entry e = m->schedule[m->pos];
    int32_t first = e.chunk * m->layers_per_chunk;
    int32_t want = e.backward ? first + m->layers_per_chunk - 1 - m->cursor : first + m->cursor;
    if (e.backward != backward || e.microbatch != mb || l != want)
        return mst_set_error(MST_ERR_STATE,
                             "schedule mismatch at entry %d: %s of (layer %d, mb %d), expected %s of "
                             "(layer %d, mb %d)", m->pos, what[backward], l, mb, what[e.backward], want,
                             e.microbatch);
    m->started = 1;
    return MST_OK;
}

/* Before the caller writes again into buffers an earlier layer committed as
 * inputs: their stashes must have read them. */
static mst_status inputs_free(mst_memmgr_t* m) {
    if (!m->inputs_pending) return MST_OK;
    m->inputs_pending = 0;
    return ev_wait(m, m->inputs_read, 0);
}

/* At the start of a forward entry that a backward entry follows: the
 * restores of that backward's first two layers start now, into the restore
 * buffers it will use, beside this forward's saves (on PCIe: H2D beside
 * D2H). Restores already issued, and tensors not saved yet, are skipped. */
static mst_status prefetch_next_entry(mst_memmgr_t* m) {
    if (m->cursor != 0 || m->pos + 1 >= m->cfg.n_schedule || !m->schedule[m->pos + 1].backward) return MST_OK;
    const mst_sched_entry e = m->schedule[m->pos + 1];
    const int32_t top = (e.chunk + 1) * m->layers_per_chunk - 1;
    for (int32_t i = 0; i < 2 && i < m->layers_per_chunk; i++)
        MST_TRY(issue_restore(m, top - i, e.microbatch, (m->bwd_seq + 1 + i) & 1));
    return MST_OK;
}

mst_status mst_memmgr_forward(mst_memmgr_t* m, int32_t layer, int32_t mb, const mst_saver** out) {
    MST_TRY(check_call(m, layer, mb, out));
    MST_TRY(expect(m, 0, layer, mb));
    MST_TRY(inputs_free(m));
    MST_TRY(prefetch_next_entry(m));
    *out = saver_for(m, layer, mb, m->chunk_start[layer] >= 0 ? MODE_DISCARD : MODE_FWD);
    return MST_OK;
}

/* The layer whose backward comes after the current one, or -1. */
static int32_t next_backward(const mst_memmgr_t* m, int32_t l, int32_t* mb) {
    if (m->cursor + 1 < m->layers_per_chunk) return l - 1;
    for (int32_t i = m->pos + 1; i < m->cfg.n_schedule; i++)
        if (m->schedule[i].backward) {
            *mb = m->schedule[i].microbatch;
            return (m->schedule[i].chunk + 1) * m->layers_per_chunk - 1;
        }
    return -1;
}

mst_status mst_memmgr_backward(mst_memmgr_t* m, int32_t layer, int32_t mb, const mst_saver** out) {
    MST_TRY(check_call(m, layer, mb, out));
    MST_TRY(expect(m, 1, layer, mb));
    MST_TRY(inputs_free(m));
    m->bwd_seq++;
    MST_TRY(issue_restore(m, layer, mb, m->bwd_seq & 1));
    int32_t next_mb = mb, next = next_backward(m, layer, &next_mb);
    if (next >= 0) MST_TRY(issue_restore(m, next, next_mb, (m->bwd_seq + 1) & 1)); /* prefetch */
    *out = saver_for(m, layer, mb, MODE_BWD);
    return MST_OK;
}

mst_status mst_memmgr_recompute(mst_memmgr_t* m, int32_t layer, int32_t mb, const mst_saver** out) {
    MST_TRY(check_call(m, layer, mb, out));
    if (m->chunk_start[layer] < 0)
        return mst_set_error(MST_ERR_INVALID, "layer = %d is not in a recompute chunk", layer);
    MST_TRY(inputs_free(m));
    *out = saver_for(m, layer, mb, MODE_RECOMP);
    return MST_OK;
}

mst_status mst_memmgr_step_begin(mst_memmgr_t* m, int measuring) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if (m->in_step) return mst_set_error(MST_ERR_STATE, "step_begin inside a step");
    if (!measuring && !m->sized)
        return mst_set_error(MST_ERR_STATE, "the first step must be a measuring step (measuring = 1)");
    if (measuring) { /* restore buffers for any rows up to max_rows */
        MST_TRY(ensure_arena(m, m->cfg.max_rows, 0));
        memset(m->live_pages, 0, sizeof m->live_pages);
        memset(m->peak_pages, 0, sizeof m->peak_pages);
        m->live_exact = m->peak_exact = 0;
        m->max_saved_rows = 0;
    } else {
        for (int n = 0; n < MST_N_SAVED; n++)
            for (int k = 0; k < 2; k++)
                if (m->pool[n][k]) MST_TRY(mst_pool_reset(m->pool[n][k]));
    }
    for (int n = 0; n < MST_N_SAVED; n++) {
        m->bufs[n].compute_pending = 0;
        memset(m->bufs[n].restore_free_rec, 0, sizeof m->bufs[n].restore_free_rec);
    }
    m->inputs_pending = m->side_used = 0;
    m->measuring = measuring != 0;
    m->pos = m->cursor = m->bwd_seq = m->started = 0;
    m->in_step = 1;
    return MST_OK;
}

/* Rows of the restore buffers and handles after a measuring step: the
 * largest rows saved with the pools' headroom, a page multiple, at most
 * max_rows. */
static int64_t sized_restore_rows(const mst_memmgr_t* m) {
    const int64_t pr = m->cfg.page_rows;
    int64_t rows = (int64_t)ceil((double)m->max_saved_rows * (m->cfg.dev_factor + m->cfg.host_factor));
    rows = (rows + pr - 1) / pr * pr;
    if (rows < pr) rows = pr;
    return rows < m->cfg.max_rows ? rows : m->cfg.max_rows;
}

/* The pool of (name n, kind k) with at least the pages of config pc. */
static mst_status ensure_pool(mst_memmgr_t* m, mst_saved_name n, int k, const mst_pool_config* pc) {
    mst_pool_t** pool = &m->pool[n][k];
    if (*pool) {
        mst_pool_stats have;
        MST_TRY(mst_pool_stats_get(*pool, &have));
        if (have.n_dev_pages >= pc->n_dev_pages && have.n_host_pages >= pc->n_host_pages) return MST_OK;
        free_handles(m, n, k);
        mst_pool_destroy(*pool);
        *pool = NULL;
    }
    return mst_pool_create(m->ctx, dtype_of(n), cols_of(m, n), pc, pool);
}

/* SMs of one side-stream copy of a pool (mst_pool_config.copy_sms).
 * The copies run beside the GEMMs, which hold every SM they get: on 20 SMs a
 * copy moves about as fast (more bytes in flight per SM) and leaves the rest
 * to the GEMM. bench step, H100, STASH vs KEEP: 1.075-1.079 on all 132 SMs,
 * 1.065-1.071 on 40, 1.047-1.055 on 20, 1.051-1.058 on 16, 1.068 on 8. */
enum { SIDE_COPY_SMS = 20 };

/* After a measuring step: restore buffers and handles of sized_restore_rows,
 * pools of ceil(peak * factor) pages, and a handle and a save event for every
 * slot that stashes or offloads. */
static mst_status size_pools(mst_memmgr_t* m) {
    MST_TRY(ensure_arena(m, sized_restore_rows(m), 1));
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < 2; k++) {
            int used = 0;
            for (int32_t l = 0; l < m->cfg.n_layers; l++) {
                mst_policy p = policy_of(m, l, (mst_saved_name)n);
                used |= paged(p) && kind_of(p) == k && m->chunk_start[l] < 0;
            }
            if (!used) continue;
            mst_pool_stats measured = {0};
            measured.total_peak = m->peak_pages[n][k];
            mst_pool_config pc;
            MST_TRY(mst_pool_config_from_peak(&measured, k ? 0.0 : m->cfg.dev_factor,
                                              k ? m->cfg.dev_factor : m->cfg.host_factor, &pc));
            pc.page_rows = m->cfg.page_rows;
            pc.copy_sms = SIDE_COPY_SMS;
            MST_TRY(ensure_pool(m, (mst_saved_name)n, k, &pc));
            for (int32_t l = 0; l < m->cfg.n_layers; l++) {
                mst_policy p = policy_of(m, l, (mst_saved_name)n);
                if (!paged(p) || kind_of(p) != k || m->chunk_start[l] >= 0) continue;
                for (int32_t mb = 0; mb < m->cfg.n_microbatches; mb++) {
                    slot* s = slot_of(m, l, mb, (mst_saved_name)n);
                    if (!s->handle) MST_TRY(mst_stash_handle_create(m->pool[n][k], m->restore_rows, &s->handle));
                    if (!s->saved_ev) MST_TRY(ev_new(m, &s->saved_ev));
                }
            }
        }
    return MST_OK;
}

mst_status mst_memmgr_step_end(mst_memmgr_t* m) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if (!m->in_step) return mst_set_error(MST_ERR_STATE, "step_end outside a step");
    advance(m);
    m->in_step = 0;
    if (m->pos != m->cfg.n_schedule)
        return mst_set_error(MST_ERR_STATE, "step ended at schedule entry %d of %d", m->pos, m->cfg.n_schedule);
    for (int64_t i = 0; i < (int64_t)m->cfg.n_layers * m->cfg.n_microbatches * MST_N_SAVED; i++)
        if (m->slots[i].saved)
            return mst_set_error(MST_ERR_STATE, "%s of (layer %lld, mb %lld) was saved and never released",
                                 mst_saved_name_str((mst_saved_name)(i % MST_N_SAVED)),
                                 (long long)(i / MST_N_SAVED / m->cfg.n_microbatches),
                                 (long long)(i / MST_N_SAVED % m->cfg.n_microbatches));
    for (int i = 0; i < MST_N_SIDE; i++) { /* join the side streams this step forked */
        if (!(m->side_used & 1 << i)) continue;
        MST_TRY(ev_record(m, m->ev_side, i));
        MST_TRY(ev_wait(m, m->ev_side, ON_MAIN));
    }
    if (!m->measuring) return MST_OK;
    if (m->sized) m->rep.reruns++;
    if (m->peak_exact > m->rep.exact_bytes) m->rep.exact_bytes = m->peak_exact;
    MST_TRY(size_pools(m));
    m->sized = 1;
    return MST_OK;
}

mst_status mst_memmgr_step_check(mst_memmgr_t* m) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    mst_status st = mst_ctx_check(m->ctx);
    if (st == MST_ERR_OVERFLOW) m->rep.overflows++;
    return st;
}

const int32_t* mst_memmgr_overflow_flag(const mst_memmgr_t* m) { return m ? m->ctx->err_flag : NULL; }

mst_status mst_mem_report(const mst_memmgr_t* m, mst_mem_report_t* out) {
    if (!m || !out) return mst_set_error(MST_ERR_INVALID, "m or out is NULL");
    *out = m->rep;
    out->recompute_bytes = 0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int n = 0; n < MST_N_SAVED; n++)
            if (m->chunk_start[l] >= 0 || policy_of(m, l, (mst_saved_name)n) == MST_POLICY_RECOMPUTE)
                out->recompute_bytes += (size_t)m->cfg.n_microbatches * buf_bytes(m, (mst_saved_name)n);
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < 2; k++) {
            if (!m->pool[n][k]) continue;
            mst_pool_stats st;
            MST_TRY(mst_pool_stats_get(m->pool[n][k], &st));
            out->dev_pages_bytes += (size_t)(st.n_dev_pages * st.page_bytes);
            out->dev_pages_peak_bytes += (size_t)(st.dev_peak * st.page_bytes);
            out->host_pages_bytes += (size_t)(st.n_host_pages * st.page_bytes);
            out->host_pages_peak_bytes += (size_t)(st.host_peak * st.page_bytes);
        }
    return MST_OK;
}

mst_status mst_memmgr_check(mst_memmgr_t* m) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < 2; k++) {
            if (!m->pool[n][k]) continue;
            MST_TRY(mst_pool_check(m->pool[n][k]));
            mst_pool_stats st;
            MST_TRY(mst_pool_stats_get(m->pool[n][k], &st));
            if (!m->in_step && st.dev_used + st.host_used != 0)
                return mst_set_error(MST_ERR_STATE, "pool of %s (%s) holds %lld pages between steps",
                                     mst_saved_name_str((mst_saved_name)n), k ? "offload" : "stash",
                                     (long long)(st.dev_used + st.host_used));
        }
    return MST_OK;
}
