/*
 * memmgr_buffers.c — the memory manager's buffers: KEEP buffers, the compute
 * buffer of each name, the restore arena and its views, rerun buffers and
 * chunk inputs of recomputed layers; and the sizing of the pools, restore
 * buffers and handles after a measuring step.
 */
#include <math.h>
#include <string.h>

#include "memmgr_impl.h"

mst_status mst_mm_alloc_tensor(mst_memmgr_t* m, mst_saved_name n, mst_tensor* t, size_t* account) {
    if (t->data) return MST_OK;
    MST_TRY(mst_alloc(m->ctx, buf_bytes(m, n), &t->data));
    *t = mst_tensor_make(t->data, dtype_of(m, n), m->cfg.max_rows, cols_of(m, n));
    *account += buf_bytes(m, n);
    return MST_OK;
}

mst_status mst_mm_ensure_compute(mst_memmgr_t* m, mst_saved_name n) {
    shared_bufs* b = &m->bufs[n];
    if (b->compute.data) return MST_OK;
    MST_TRY(mst_mm_alloc_tensor(m, n, &b->compute, &m->rep.compute_bytes));
    return mst_mm_ev_new(m, &b->compute_free);
}

void mst_mm_free_handles(mst_memmgr_t* m, mst_saved_name n, int k) {
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int32_t mb = 0; mb < m->cfg.n_microbatches; mb++) {
            slot* s = slot_of(m, l, mb, n);
            if (!s->handle || (k >= 0 && kind_of(policy_of(m, l, n)) != k)) continue;
            mst_stash_handle_destroy(s->handle);
            s->handle = NULL;
        }
}

/* ---- restore buffers -------------------------------------------------------- */

/* Is `n` stashed or offloaded on some layer (outside recompute chunks)? */
static int name_paged(const mst_memmgr_t* m, mst_saved_name n) {
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        if (paged(policy_of(m, l, n)) && m->chunk_start[l] < 0) return 1;
    return 0;
}

/* Does name n need restore buffers? In a measuring step every paged name
 * does; in a sized step those that some layer offloads or stashes as fp8, or
 * that the backward does not read from pages (the others are read in place). */
static int name_restored(const mst_memmgr_t* m, mst_saved_name n, int sized) {
    if (!name_paged(m, n)) return 0;
    if (!sized || !read_from_pages(m, n)) return 1;
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        if (paged(policy_of(m, l, n)) && kind_of(policy_of(m, l, n)) != MM_KIND_STASH && m->chunk_start[l] < 0)
            return 1;
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

/* Re-lays the arena when rows or sized changes. */
mst_status mst_mm_ensure_arena(mst_memmgr_t* m, int64_t rows, int sized) {
    for (int n = 0; n < MST_N_SAVED; n++) {
        shared_bufs* b = &m->bufs[n];
        for (int k = 0; k < 2 && name_paged(m, (mst_saved_name)n); k++) {
            if (!b->restore_done[k]) MST_TRY(mst_mm_ev_new(m, &b->restore_done[k]));
            if (!b->restore_free[k]) MST_TRY(mst_mm_ev_new(m, &b->restore_free[k]));
        }
    }
    if (rows == m->restore_rows && sized == m->arena_sized) return MST_OK;
    for (int n = 0; n < MST_N_SAVED; n++) mst_mm_free_handles(m, (mst_saved_name)n, -1); /* sized for the old rows */
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
        for (int k = 0; k < 2; k++) {
            const mst_saved_name nm = (mst_saved_name)n;
            m->bufs[n].restore[k] = name_restored(m, nm, sized)
                                        ? mst_tensor_make((char*)m->arena + off[n][k], dtype_of(m, nm),
                                                          m->cfg.max_rows, cols_of(m, nm))
                                        : mst_tensor_make(NULL, dtype_of(m, nm), 0, 0);
        }
    return MST_OK;
}

mst_tensor mst_mm_restore_dst(const mst_memmgr_t* m, const mst_tensor* view) {
    return mst_tensor_make(view->data, view->dtype, m->restore_rows, view->cols);
}

/* ---- recomputed layers and KEEP buffers -------------------------------------- */

/* A recomputed layer's rerun buffers are shared by every chunk: a chunk is
 * rerun and consumed by its backward before the next chunk is rerun. */
mst_tensor* mst_mm_rerun_buf(mst_memmgr_t* m, int32_t l, mst_saved_name n) {
    return &m->recomp[(l - m->chunk_start[l]) * MST_N_SAVED + n];
}

mst_status mst_memmgr_chunk_input(mst_memmgr_t* m, int32_t layer, int32_t mb, mst_tensor* out) {
    if (!m || !out) return mst_set_error(MST_ERR_INVALID, "m or out is NULL");
    if (layer < 0 || layer >= m->cfg.n_layers || m->chunk_start[layer] != layer)
        return mst_set_error(MST_ERR_INVALID, "layer = %d does not start a recompute chunk", layer);
    if (mb < 0 || mb >= m->cfg.n_microbatches)
        return mst_set_error(MST_ERR_INVALID, "mb = %d, must be in [0, %d)", mb, m->cfg.n_microbatches);
    void** p = &m->chunk_in[(int64_t)layer * m->n_sets + m->set_of[mb]];
    size_t bytes = buf_bytes(m, MST_SAVED_FC1_INPUT);
    if (!*p) {
        MST_TRY(mst_alloc(m->ctx, bytes, p));
        m->rep.kept_bytes += bytes;
    }
    *out = mst_tensor_make(*p, dtype_of(m, MST_SAVED_FC1_INPUT), m->cfg.max_rows, cols_of(m, MST_SAVED_FC1_INPUT));
    return MST_OK;
}

mst_status mst_memmgr_keep_buffer(mst_memmgr_t* m, int32_t layer, int32_t mb, mst_saved_name name,
                                  mst_tensor* out) {
    if (!m || !out) return mst_set_error(MST_ERR_INVALID, "m or out is NULL");
    MST_TRY(mst_mm_check_layer_mb(m, layer, mb));
    if ((int)name < 0 || name >= MST_N_SAVED) return mst_set_error(MST_ERR_INVALID, "name = %d", (int)name);
    memset(out, 0, sizeof *out);
    if (policy_of(m, layer, name) != MST_POLICY_KEEP || m->chunk_start[layer] >= 0) return MST_OK;
    mst_tensor* k = keep_of(m, layer, mb, name);
    MST_TRY(mst_mm_alloc_tensor(m, name, k, &m->rep.kept_bytes));
    *out = *k;
    return MST_OK;
}

/* ---- pool sizing --------------------------------------------------------------- */

/* A size after a measuring step, from the measured need (with its
 * headroom) and the size before (0: none): never smaller, and when the need
 * passes it, at least half as much again. A load that drifts up from step
 * to step (a rank's rows on N ranks while the router learns; on one GPU the
 * rows of a layer are N k every step) then costs a few overflow reruns, not
 * one every step or two. */
static int64_t grown(int64_t need, int64_t have) {
    if (need <= have) return have;
    if (have <= 0) return need;
    const int64_t half_again = have + (have + 1) / 2;
    return need > half_again ? need : half_again;
}

/* Rows of the restore buffers and handles after a measuring step: the
 * largest rows saved with the pools' headroom (grown() over the last
 * sizing's), a page multiple, at most max_rows. */
static int64_t sized_restore_rows(const mst_memmgr_t* m) {
    const int64_t pr = m->cfg.page_rows;
    int64_t rows = (int64_t)ceil((double)m->max_saved_rows * (m->cfg.dev_factor + m->cfg.host_factor));
    rows = grown(rows, m->sized_rows);
    rows = (rows + pr - 1) / pr * pr;
    if (rows < pr) rows = pr;
    return rows < m->cfg.max_rows ? rows : m->cfg.max_rows;
}

void mst_mm_release_pools(mst_memmgr_t* m) {
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < MM_N_KINDS; k++) {
            mst_pool_stats st = MST_POOL_STATS_INIT;
            if (!m->pool[n][k] || mst_pool_stats_get(m->pool[n][k], &st) != MST_OK) continue;
            m->had_pages[n][k][0] = st.n_dev_pages, m->had_pages[n][k][1] = st.n_host_pages;
            mst_mm_free_handles(m, (mst_saved_name)n, k);
            mst_pool_destroy(m->pool[n][k]);
            m->pool[n][k] = NULL;
        }
}

/* The pool of (name n, kind k): the pages of config pc, grown() over the
 * pool it had before this measuring step. */
static mst_status create_pool(mst_memmgr_t* m, mst_saved_name n, int k, const mst_pool_config* pc) {
    MST_ASSERT(!m->pool[n][k]); /* released when the measuring step began */
    mst_pool_config g = *pc;
    g.n_dev_pages = grown(pc->n_dev_pages, m->had_pages[n][k][0]);
    g.n_host_pages = grown(pc->n_host_pages, m->had_pages[n][k][1]);
    return mst_pool_create(m->ctx, k & MM_KIND_FP8 ? MST_DTYPE_FP8 : dtype_of(m, n), cols_of(m, n), &g, &m->pool[n][k]);
}

/* SMs of one side-stream copy of a pool (mst_pool_config.copy_sms).
 * The copies run beside the GEMMs, which hold every SM they get: on 20 SMs a
 * copy moves about as fast (more bytes in flight per SM) and leaves the rest
 * to the GEMM. bench step, H100, STASH vs KEEP: 1.075-1.079 on all 132 SMs,
 * 1.065-1.071 on 40, 1.047-1.055 on 20, 1.051-1.058 on 16, 1.068 on 8. */
enum { SIDE_COPY_SMS = 20 };

/* Does some layer outside recompute chunks put name n into pool kind k? */
static int pool_used(const mst_memmgr_t* m, mst_saved_name n, int k) {
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        mst_policy p = policy_of(m, l, n);
        if (paged(p) && kind_of(p) == k && m->chunk_start[l] < 0) return 1;
    }
    return 0;
}

/* A handle and a save event for every slot of name n in pool kind k. */
static mst_status ensure_handles(mst_memmgr_t* m, mst_saved_name n, int k) {
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        mst_policy p = policy_of(m, l, n);
        if (!paged(p) || kind_of(p) != k || m->chunk_start[l] >= 0) continue;
        for (int32_t mb = 0; mb < m->cfg.n_microbatches; mb++) {
            slot* s = slot_of(m, l, mb, n);
            if (!s->handle) MST_TRY(mst_stash_handle_create(m->pool[n][k], m->restore_rows, &s->handle));
            if (!s->saved_ev) MST_TRY(mst_mm_ev_new(m, &s->saved_ev));
        }
    }
    return MST_OK;
}

/* The measured needs through cfg.share_needs (when set): the largest rows
 * saved, then the peak pages of every (name, kind). */
static mst_status share_needs(mst_memmgr_t* m) {
    if (!m->cfg.share_needs) return MST_OK;
    enum { N = 1 + MM_N_KINDS * MST_N_SAVED };
    int64_t v[N];
    v[0] = m->max_saved_rows;
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < MM_N_KINDS; k++) v[1 + MM_N_KINDS * n + k] = m->peak_pages[n][k];
    MST_TRY(m->cfg.share_needs(m->cfg.share_user, v, N));
    m->max_saved_rows = v[0];
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < MM_N_KINDS; k++) m->peak_pages[n][k] = v[1 + MM_N_KINDS * n + k];
    return MST_OK;
}

/* Restore buffers and handles of sized_restore_rows, pools of ceil(peak *
 * factor) pages of the peak the measuring step counted (the needs shared
 * first). */
mst_status mst_mm_size_pools(mst_memmgr_t* m) {
    MST_TRY(share_needs(m));
    m->sized_rows = sized_restore_rows(m);
    MST_TRY(mst_mm_ensure_arena(m, m->sized_rows, 1));
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < MM_N_KINDS; k++) {
            const mst_saved_name nm = (mst_saved_name)n;
            const int host = k & MM_KIND_OFFLOAD;
            if (!pool_used(m, nm, k)) continue;
            mst_pool_stats measured = MST_POOL_STATS_INIT;
            measured.total_peak = m->peak_pages[n][k];
            mst_pool_config pc = MST_POOL_CONFIG_INIT;
            MST_TRY(mst_pool_config_from_peak(&measured, host ? 0.0 : m->cfg.dev_factor,
                                              host ? m->cfg.dev_factor : m->cfg.host_factor, &pc));
            pc.page_rows = m->cfg.page_rows;
            pc.copy_sms = SIDE_COPY_SMS;
            MST_TRY(create_pool(m, nm, k, &pc));
            MST_TRY(ensure_handles(m, nm, k));
        }
    return MST_OK;
}
