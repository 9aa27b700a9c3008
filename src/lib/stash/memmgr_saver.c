/*
 * memmgr_saver.c — the saver the memory manager hands out for each layer
 * call: produce, claim and commit in the forward, fetch and release in the
 * backward, and the restores that bring paged tensors back (prefetched by
 * the step protocol). Which stream runs what: memmgr_streams.c.
 */
#include <string.h>

#include "../backend/fp8_page.h"
#include "memmgr_impl.h"

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
    if (rows != m->cfg.max_rows || cols != cols_of(m, n) || dt != dtype_of(m, n))
        return mst_set_error(MST_ERR_INVALID, "produce %s: [%lld, %lld] %s, the manager holds [%lld, %lld] %s",
                             mst_saved_name_str(n), (long long)rows, (long long)cols, mst_dtype_name(dt),
                             (long long)m->cfg.max_rows, (long long)cols_of(m, n), mst_dtype_name(dtype_of(m, n)));
    if (r->mode == MODE_RECOMP) {
        MST_TRY(mst_mm_alloc_tensor(m, n, mst_mm_rerun_buf(m, r->layer, n), &m->rep.kept_bytes));
        *out = *mst_mm_rerun_buf(m, r->layer, n);
        return MST_OK;
    }
    if (r->mode == MODE_FWD && policy_of(m, r->layer, n) == MST_POLICY_KEEP) {
        mst_tensor* k = keep_of(m, r->layer, r->mb, n);
        MST_TRY(mst_mm_alloc_tensor(m, n, k, &m->rep.kept_bytes));
        *out = *k;
        return MST_OK;
    }
    if (r->mode == MODE_BWD) return mst_set_error(MST_ERR_STATE, "produce of %s in a backward", mst_saved_name_str(n));
    MST_TRY(mst_mm_ensure_compute(m, n));
    shared_bufs* b = &m->bufs[n];
    if (b->compute_pending) { /* its last stash must have read it */
        MST_TRY(mst_mm_ev_wait(m, b->compute_free, MST_STREAM_MAIN));
        b->compute_pending = 0;
    }
    if (r->mode == MODE_FWD) slot_of(m, r->layer, r->mb, n)->produced = 1; /* a claim may take it */
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

/* fp8 pages in a measuring step: the exact copy holds what the pages would
 * give back. The rows go through the host, quantized and restored there by
 * the CPU backend's functions (fp8_page.h: the bytes of either backend's
 * pages); a block of inf or NaN raises MST_FLAG_NONFINITE, as a save does. */
static mst_status fp8_round_trip(mst_memmgr_t* m, slot* s, mst_saved_name n, const mst_tensor* src, uint16_t* rows) {
    const int64_t w = cols_of(m, n);
    MST_TRY(mst_copy_b2h(m->ctx, rows, src->data, (size_t)(s->n_rows * w) * sizeof(uint16_t)));
    int bad = 0;
    uint8_t q[MST_FP8_BLOCK];
    float scale;
    for (int64_t i = 0; i < s->n_rows; i++)
        for (int64_t j = 0; j < w; j += MST_FP8_BLOCK) {
            uint16_t* x = rows + i * w + j;
            const int64_t len = w - j < MST_FP8_BLOCK ? w - j : MST_FP8_BLOCK;
            bad |= mst_fp8_block_save(x, len, q, &scale);
            mst_fp8_block_restore(q, scale, len, x);
        }
    int32_t flag = 0;
    if (!bad) return MST_OK;
    MST_TRY(mst_copy_b2h(m->ctx, &flag, m->ctx->err_flag, sizeof flag));
    flag |= MST_FLAG_NONFINITE;
    return mst_copy_h2b(m->ctx, m->ctx->err_flag, &flag, sizeof flag);
}

/* The exact copy of a measuring step: device memory for STASH, pinned host
 * memory for OFFLOAD (host pages do not count against the device); for fp8
 * pages, the rows they would give back. */
static mst_status commit_measuring(mst_memmgr_t* m, slot* s, mst_saved_name n, mst_policy p, const mst_tensor* src) {
    size_t bytes = (size_t)s->n_rows * row_bytes(m, n); /* s->n_rows was read at commit */
    if (!bytes) return MST_OK;
    mst_ctx_t* ctx = m->ctx;
    const int host = offloaded(p) && ctx->be->host_alloc;
    MST_TRY(host ? ctx->be->host_alloc(ctx, bytes, &s->exact) : mst_alloc(ctx, bytes, &s->exact));
    if (!(kind_of(p) & MM_KIND_FP8))
        return host ? mst_copy_b2h(ctx, s->exact, src->data, bytes) : mst_copy_b2b(ctx, s->exact, src->data, bytes);
    uint16_t* rows = (uint16_t*)malloc(bytes);
    mst_status st = rows ? fp8_round_trip(m, s, n, src, rows) : mst_set_error(MST_ERR_OOM, "fp8 rows: %zu bytes", bytes);
    if (st == MST_OK && host) memcpy(s->exact, rows, bytes);
    else if (st == MST_OK) st = mst_copy_h2b(ctx, s->exact, rows, bytes);
    free(rows);
    return st;
}

void mst_mm_free_exact(mst_memmgr_t* m, slot* s, mst_policy p) {
    if (s->exact && offloaded(p) && m->ctx->be->host_alloc) m->ctx->be->host_free(m->ctx, s->exact);
    else mst_free(m->ctx, s->exact);
    s->exact = NULL;
}

static mst_status sv_commit(void* self, mst_saved_name n, const mst_tensor* src, const mst_tensor* counts) {
    saver_ref* r = (saver_ref*)self;
    mst_memmgr_t* m = r->m;
    if ((int)n < 0 || n >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)n);
    MST_TRY(mst_check_tensor(src, "src", dtype_of(m, n)));
    MST_TRY(mst_check_shape(src, "src", m->cfg.max_rows, cols_of(m, n)));
    if (r->mode == MODE_DISCARD) return MST_OK;
    if (r->mode == MODE_RECOMP) {
        mst_tensor* t = mst_mm_rerun_buf(m, r->layer, n);
        MST_TRY(mst_mm_alloc_tensor(m, n, t, &m->rep.kept_bytes));
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
    s->produced = 0;
    s->in_compute = 0;
    s->restore_idx = -1;
    if (p == MST_POLICY_RECOMPUTE) return MST_OK;
    if (p == MST_POLICY_KEEP) {
        mst_tensor* k = keep_of(m, r->layer, r->mb, n);
        MST_TRY(mst_mm_alloc_tensor(m, n, k, &m->rep.kept_bytes));
        return k->data == src->data ? MST_OK : mst_copy_b2b(m->ctx, k->data, src->data, buf_bytes(m, n));
    }
    if (s->claimed) { /* its producer writes the pages (sv_claim): nothing to copy */
        const int given = s->claimed == CLAIM_GIVEN;
        s->claimed = CLAIM_NONE;
        if (given) return MST_OK;
        return mst_set_error(MST_ERR_STATE, "%s of (layer %d, mb %d): its pages were taken with the layer's first "
                             "claim and never handed out (claim every produced name read in place, or none)",
                             mst_saved_name_str(n), r->layer, r->mb);
    }
    int from_compute = src->data == m->bufs[n].compute.data;
    if (from_compute && backward_follows(m, r->layer, r->mb)) { /* no stash: used right away */
        s->in_compute = 1;
        return MST_OK;
    }
    if (m->measuring) {
        MST_TRY(commit_measuring(m, s, n, p, src));
        int64_t* live = &m->live_pages[n][kind_of(p)];
        *live += pages_for(m, s->n_rows);
        if (*live > m->peak_pages[n][kind_of(p)]) m->peak_pages[n][kind_of(p)] = *live;
        if (s->n_rows > m->max_saved_rows) m->max_saved_rows = s->n_rows;
        return MST_OK;
    }
    mst_tensor t = *src;
    /* an op output: what was queued before its producer ran is launched
       first, so it does not wait for the producer as this save must */
    if (from_compute) MST_TRY(mst_mm_flush(m, MST_STREAM_RING));
    MST_TRY(mst_mm_on_side(m, MST_STREAM_RING, NULL, MM_SAVE, m->pool[n][kind_of(p)], s->handle, &t, counts));
    MST_TRY(mst_mm_ev_record(m, s->saved_ev, MST_STREAM_RING));
    if (from_compute) {
        MST_TRY(mst_mm_ev_record(m, m->bufs[n].compute_free, MST_STREAM_RING));
        m->bufs[n].compute_pending = 1;
    } else {
        MST_TRY(mst_mm_ev_record(m, m->inputs_read, MST_STREAM_RING));
        m->inputs_pending = 1;
    }
    return MST_OK;
}

/* In a sized step a stashed fc1_input, fc2_input or act_input is read from
 * its device pages in place (no restore copy) where read_from_pages: the
 * backward waits for its save and the pages go back at its release.
 * Offloaded ones are restored (in place the wgrad would read them over PCIe
 * once per row block of its output), and so are fp8 pages (STASH_FP8: the
 * restore dequantizes; no reader takes e4m3 rows). */
static int in_place(const mst_memmgr_t* m, int32_t l, mst_saved_name n) {
    return !m->measuring && policy_of(m, l, n) == MST_POLICY_STASH && read_from_pages(m, n);
}

/* Starts copying the paged tensors of (l, mb) back into restore buffers k
 * (copy stream); their pages are returned at the backward's release. */
mst_status mst_mm_issue_restore(mst_memmgr_t* m, int32_t l, int32_t mb, int k) {
    if (m->measuring || m->chunk_start[l] >= 0) return MST_OK;
    for (int n = 0; n < MST_N_SAVED; n++) {
        slot* s = slot_of(m, l, mb, (mst_saved_name)n);
        if (!paged(policy_of(m, l, (mst_saved_name)n)) || !s->saved || s->in_compute || s->restore_idx >= 0 ||
            in_place(m, l, (mst_saved_name)n))
            continue;
        shared_bufs* b = &m->bufs[n];
        if (b->restore_free_rec[k]) MST_TRY(mst_mm_ev_wait(m, b->restore_free[k], MST_STREAM_COPY));
        mst_pool_t* pool = m->pool[n][kind_of(policy_of(m, l, (mst_saved_name)n))];
        mst_tensor dst = mst_mm_restore_dst(m, &b->restore[k]);
        MST_TRY(mst_mm_on_side(m, MST_STREAM_COPY, s->saved_ev, MM_RESTORE_COPY, pool, s->handle, &dst, NULL));
        MST_TRY(mst_mm_ev_record(m, b->restore_done[k], MST_STREAM_COPY));
        s->restore_idx = k;
    }
    return mst_mm_flush(m, MST_STREAM_COPY); /* the restores of (l, mb): one batch */
}

static mst_status sv_fetch(void* self, mst_saved_name n, mst_tensor* out) {
    saver_ref* r = (saver_ref*)self;
    mst_memmgr_t* m = r->m;
    if ((int)n < 0 || n >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)n);
    if (r->mode != MODE_BWD) return mst_set_error(MST_ERR_STATE, "fetch of %s outside a backward", mst_saved_name_str(n));
    if (m->chunk_start[r->layer] >= 0) {
        *out = *mst_mm_rerun_buf(m, r->layer, n);
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
        *out = mst_tensor_make(NULL, dtype_of(m, n), m->cfg.max_rows, cols_of(m, n));
        return MST_OK;
    }
    if (p == MST_POLICY_KEEP) {
        *out = *keep_of(m, r->layer, r->mb, n);
        return MST_OK;
    }
    shared_bufs* b = &m->bufs[n];
    if (s->in_compute) {
        *out = b->compute;
        return MST_OK;
    }
    if (in_place(m, r->layer, n)) {
        MST_TRY(mst_mm_ev_wait(m, s->saved_ev, MST_STREAM_MAIN)); /* its pages are written */
        MST_TRY(mst_stash_handle_pages(s->handle, &s->pages));
        *out = mst_tensor_make((void*)s->pages.table, dtype_of(m, n), m->cfg.max_rows, cols_of(m, n));
        out->pages = &s->pages;
        return MST_OK;
    }
    int k = m->bwd_seq & 1;
    if (m->measuring) {
        size_t bytes = (size_t)s->n_rows * row_bytes(m, n);
        if (bytes && offloaded(p) && m->ctx->be->host_alloc)
            MST_TRY(mst_copy_h2b(m->ctx, b->restore[k].data, s->exact, bytes));
        else if (bytes) MST_TRY(mst_copy_b2b(m->ctx, b->restore[k].data, s->exact, bytes));
        s->restore_idx = k;
    } else {
        MST_TRY(mst_mm_issue_restore(m, r->layer, r->mb, k)); /* when not prefetched */
        MST_TRY(mst_mm_ev_wait(m, b->restore_done[s->restore_idx], MST_STREAM_MAIN));
    }
    *out = b->restore[s->restore_idx];
    return MST_OK;
}

/* Queues the claim of name n of (l, mb) on the ring stream (a save without
 * the copy): its pages are taken in order with the pool's other ring
 * updates, after main's work so far (the counts may come from it: the
 * router). */
static mst_status queue_claim(mst_memmgr_t* m, int32_t l, int32_t mb, mst_saved_name n, const mst_tensor* counts) {
    slot* s = slot_of(m, l, mb, n);
    MST_TRY(mst_mm_ensure_compute(m, n));
    mst_tensor t = m->bufs[n].compute; /* [R, cols]: counts past R are bad counts, as in a save */
    MST_TRY(mst_mm_on_side(m, MST_STREAM_RING, NULL, MM_CLAIM, m->pool[n][kind_of(MST_POLICY_STASH)], s->handle, &t, counts));
    MST_TRY(mst_mm_ev_record(m, s->saved_ev, MST_STREAM_RING));
    s->claimed = CLAIM_TAKEN;
    return MST_OK;
}

/* A stashed tensor read in place, claimed before its producer runs, and
 * the producer writes the rows into the pages besides its output; the
 * commit then copies nothing. The layer call's first claim takes the pages
 * of every name it produced that is read in place (they share the call's
 * counts), in one ring batch with the saves queued so far; main waits for
 * that batch, and a later claim of such a name hands its pages out. */
static mst_status sv_claim(void* self, mst_saved_name n, const mst_tensor* counts, mst_pages* out) {
    saver_ref* r = (saver_ref*)self;
    mst_memmgr_t* m = r->m;
    memset(out, 0, sizeof *out);
    if ((int)n < 0 || n >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)n);
    if (r->mode != MODE_FWD || !in_place(m, r->layer, n) || backward_follows(m, r->layer, r->mb)) return MST_OK;
    slot* s = slot_of(m, r->layer, r->mb, n);
    if (s->saved || s->claimed == CLAIM_GIVEN)
        return mst_set_error(MST_ERR_STATE, "%s of (layer %d, mb %d) claimed after its commit or twice",
                             mst_saved_name_str(n), r->layer, r->mb);
    if (s->claimed == CLAIM_NONE) {
        MST_TRY(queue_claim(m, r->layer, r->mb, n, counts));
        for (int k = 0; k < MST_N_SAVED; k++) {
            slot* o = slot_of(m, r->layer, r->mb, (mst_saved_name)k);
            if (o->produced && !o->saved && o->claimed == CLAIM_NONE && in_place(m, r->layer, (mst_saved_name)k))
                MST_TRY(queue_claim(m, r->layer, r->mb, (mst_saved_name)k, counts));
        }
    }
    MST_TRY(mst_mm_ev_wait(m, s->saved_ev, MST_STREAM_MAIN));
    MST_TRY(mst_stash_handle_pages(s->handle, out));
    s->claimed = CLAIM_GIVEN;
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
        MST_TRY(mst_mm_ev_record(m, b->restore_free[s->restore_idx], MST_STREAM_MAIN));
        b->restore_free_rec[s->restore_idx] = 1;
        if (!m->measuring) /* the pages go back now, where the measuring step counted them free */
            MST_TRY(mst_mm_on_side(m, MST_STREAM_RING, b->restore_done[s->restore_idx], MM_RETURN,
                            m->pool[n][kind_of(p)], s->handle, NULL, NULL));
    } else if (in_place(m, r->layer, n) && !s->in_compute) /* after the backward's reads (main, so far) */
        MST_TRY(mst_mm_on_side(m, MST_STREAM_RING, NULL, MM_RETURN, m->pool[n][kind_of(p)], s->handle, NULL, NULL));
    if (m->measuring) {
        m->live_exact -= (size_t)s->n_rows * row_bytes(m, n);
        if (paged(p) && !s->in_compute) m->live_pages[n][kind_of(p)] -= pages_for(m, s->n_rows);
        mst_mm_free_exact(m, s, p);
    }
    s->saved = 0;
    s->restore_idx = -1;
    s->in_compute = 0;
    return MST_OK;
}


const mst_saver* mst_mm_saver_for(mst_memmgr_t* m, int32_t l, int32_t mb, int mode) {
    saver_ref* r = &m->refs[((int64_t)l * m->cfg.n_microbatches + mb) * N_MODES + mode];
    r->m = m;
    r->layer = l;
    r->mb = mb;
    r->mode = mode;
    r->saver = (mst_saver){sizeof(mst_saver), r, sv_produce, sv_commit, sv_fetch, sv_release, sv_claim};
    return &r->saver;
}

