/*
 * memmgr.c — the memory manager's step protocol: creation, policies, the
 * layer calls along the schedule (expect / advance, prefetch), step begin /
 * end / check, the report and the invariant check. The state and the rooms
 * it is split into: memmgr_impl.h.
 */
#include <string.h>

#include "memmgr_impl.h"

mst_status mst_mm_check_layer_mb(const mst_memmgr_t* m, int32_t l, int32_t mb) {
    if (l < 0 || l >= m->cfg.n_layers)
        return mst_set_error(MST_ERR_INVALID, "layer = %d, must be in [0, %d)", l, m->cfg.n_layers);
    if (mb < 0 || mb >= m->cfg.n_microbatches)
        return mst_set_error(MST_ERR_INVALID, "mb = %d, must be in [0, %d)", mb, m->cfg.n_microbatches);
    return MST_OK;
}

/* ---- creation ------------------------------------------------------------- */

/* Entry i of a schedule: in range, and the next step of its microbatch,
 * whose steps are forward of chunk 0 .. V-1, then backward of V-1 .. 0
 * (done[mb] of them taken so far). */
static mst_status check_entry(mst_sched_entry e, int32_t i, int32_t V, int32_t M, int32_t* done) {
    if (e.chunk < 0 || e.chunk >= V || e.microbatch < 0 || e.microbatch >= M)
        return mst_set_error(MST_ERR_INVALID, "schedule[%d] = (chunk %d, mb %d) out of range", i, e.chunk, e.microbatch);
    const char* what = e.backward ? "backward" : "forward";
    const int32_t k = done[e.microbatch]++, step = e.backward ? 2 * V - 1 - e.chunk : e.chunk;
    if (e.backward && k < V) /* the microbatch's forward is not through */
        return mst_set_error(MST_ERR_INVALID, "schedule[%d]: backward of (chunk %d, mb %d) before the forward of "
                             "(chunk %d, mb %d)", i, e.chunk, e.microbatch, k, e.microbatch);
    if (step != k)
        return mst_set_error(MST_ERR_INVALID,
                             "schedule[%d]: %s of (chunk %d, mb %d) out of order: mb %d runs forward of chunks "
                             "0 .. %d, then backward of %d .. 0; its next is the %s of chunk %d",
                             i, what, e.chunk, e.microbatch, e.microbatch, V - 1, V - 1,
                             k < V ? "forward" : k < 2 * V ? "backward" : "end (none)",
                             k < V ? k : 2 * V - 1 - k);
    return MST_OK;
}

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
    /* each microbatch in its order: forward chunk 0 .. V-1, then backward V-1 .. 0 */
    int32_t V = c->virtual_stages, M = c->n_microbatches;
    int32_t* done = (int32_t*)calloc((size_t)M, sizeof(int32_t)); /* [M] steps of mb taken */
    if (!done) return mst_set_error(MST_ERR_OOM, "schedule check");
    mst_status st = MST_OK;
    for (int32_t i = 0; i < c->n_schedule && st == MST_OK; i++)
        st = check_entry(c->schedule[i], i, V, M, done);
    free(done);
    return st;
}

mst_status mst_memmgr_create(mst_ctx_t* ctx, const mst_memmgr_config* cfg, mst_memmgr_t** out) {
    MST_TRY(mst_check_ctx(ctx));
    if (!cfg) return mst_set_error(MST_ERR_INVALID, "cfg is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    MST_TRY(MST_CHECK_STRUCT("cfg", cfg, mst_memmgr_config));
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
    m->set_of = (int32_t*)calloc((size_t)M, sizeof(int32_t));
    if (!m->schedule || !m->policy || !m->chunk_start || !m->slots || !m->refs || !m->recomp || !m->set_of) {
        mst_memmgr_destroy(m);
        return mst_set_error(MST_ERR_OOM, "memory manager tables");
    }
    memcpy(m->schedule, cfg->schedule, sizeof *m->schedule * (size_t)cfg->n_schedule);
    mst_status sets = mst_schedule_sets(m->schedule, cfg->n_schedule, M, m->set_of, &m->n_sets);
    m->keep = sets == MST_OK ? (mst_tensor*)calloc((size_t)L * m->n_sets * MST_N_SAVED, sizeof(mst_tensor)) : NULL;
    m->chunk_in = sets == MST_OK ? (void**)calloc((size_t)L * m->n_sets, sizeof(void*)) : NULL;
    if (sets != MST_OK || !m->keep || !m->chunk_in) {
        mst_memmgr_destroy(m);
        return sets != MST_OK ? sets : mst_set_error(MST_ERR_OOM, "memory manager tables");
    }
    m->cfg.schedule = m->schedule;
    for (int32_t l = 0; l < L; l++) m->chunk_start[l] = -1;
    for (int64_t i = 0; i < (int64_t)L * M * MST_N_SAVED; i++) {
        m->slots[i].restore_idx = -1;
    }
    mst_status st = mst_mm_ev_new(m, &m->ev_main);
    if (st == MST_OK) st = mst_mm_ev_new(m, &m->ev_side);
    if (st == MST_OK) st = mst_mm_ev_new(m, &m->inputs_read);
    if (st != MST_OK) {
        mst_memmgr_destroy(m);
        return st;
    }
    for (int n = 0; n < MST_N_SAVED; n++)
        m->rep.static_keep_bytes += (size_t)L * m->n_sets * buf_bytes(m, (mst_saved_name)n);
    const mst_backend* be = ctx->be; /* fc1_input: x of fc1's wgrad (dy 2F wide); fc2_input: of fc2's (dy H) */
    const int64_t pr = m->cfg.page_rows;
    m->pages_read[MST_SAVED_FC1_INPUT] = be->gl_wgrad_pages && be->gl_wgrad_pages(ctx, pr, cfg->hidden, 2 * cfg->ffn);
    m->pages_read[MST_SAVED_FC2_INPUT] = be->gl_wgrad_pages && be->gl_wgrad_pages(ctx, pr, cfg->ffn, cfg->hidden);
    m->pages_read[MST_SAVED_ACT_INPUT] = 1;
    *out = m;
    return MST_OK;
}

void mst_memmgr_destroy(mst_memmgr_t* m) {
    if (!m) return;
    mst_ctx_t* ctx = m->ctx;
    mst_ctx_sync(ctx);
    const int64_t n_slots = (int64_t)m->cfg.n_layers * m->cfg.n_microbatches * MST_N_SAVED;
    for (int n = 0; n < MST_N_SAVED; n++) {
        if (m->slots && m->policy) mst_mm_free_handles(m, (mst_saved_name)n, -1);
        for (int k = 0; k < MM_N_KINDS; k++) mst_pool_destroy(m->pool[n][k]);
        shared_bufs* b = &m->bufs[n];
        mst_free(ctx, b->compute.data);
        mst_mm_ev_free(m, b->compute_free);
        for (int k = 0; k < 2; k++) {
            mst_mm_ev_free(m, b->restore_done[k]);
            mst_mm_ev_free(m, b->restore_free[k]);
        }
    }
    mst_free(ctx, m->arena);
    for (int64_t i = 0; m->slots && i < n_slots; i++) {
        if (m->slots[i].exact) /* a measuring step that failed midway */
            mst_mm_free_exact(m, &m->slots[i], policy_of(m, (int32_t)(i / ((int64_t)m->cfg.n_microbatches * MST_N_SAVED)),
                                                          (mst_saved_name)(i % MST_N_SAVED)));
        mst_mm_ev_free(m, m->slots[i].saved_ev);
    }
    for (int64_t i = 0; m->recomp && i < (int64_t)m->cfg.n_layers * MST_N_SAVED; i++)
        mst_free(ctx, m->recomp[i].data);
    for (int64_t i = 0; m->chunk_in && i < (int64_t)m->cfg.n_layers * m->n_sets; i++)
        mst_free(ctx, m->chunk_in[i]);
    for (int64_t i = 0; m->keep && i < (int64_t)m->cfg.n_layers * m->n_sets * MST_N_SAVED; i++)
        mst_free(ctx, m->keep[i].data);
    mst_mm_ev_free(m, m->ev_main);
    mst_mm_ev_free(m, m->ev_side);
    mst_mm_ev_free(m, m->inputs_read);
    mst_mm_host_free(m);
    free(m->schedule), free(m->policy), free(m->chunk_start), free(m->slots), free(m->refs);
    free(m->recomp), free(m->chunk_in), free(m->keep), free(m->set_of);
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
    if (!mst_policy_valid(p)) return mst_set_error(MST_ERR_INVALID, "policy = %d", (int)p);
    if (((int)p & MST_POLICY_FP8) && name == MST_SAVED_PROBS)
        return mst_set_error(MST_ERR_INVALID, "policy %s for probs: probs is fp32, fp8 pages hold bf16 tensors",
                             mst_policy_str(p));
    if (p == MST_POLICY_RECOMPUTE && name != MST_SAVED_FC2_INPUT)
        return mst_set_error(MST_ERR_INVALID,
                             "policy recompute for %s: only fc2_input is recomputed by the grouped MLP "
                             "(use layer recompute for the rest)", mst_saved_name_str(name));
    for (int32_t l = layer < 0 ? 0 : layer; l < (layer < 0 ? m->cfg.n_layers : layer + 1); l++)
        m->policy[l * MST_N_SAVED + name] = p;
    return MST_OK;
}

mst_status mst_memmgr_set_policy_spec(mst_memmgr_t* m, const char* spec) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    mst_policy p[MST_N_SAVED];
    MST_TRY(mst_policy_spec_parse(spec, p));
    for (int n = 0; n < MST_N_SAVED; n++) MST_TRY(mst_memmgr_set_policy(m, -1, (mst_saved_name)n, p[n]));
    return MST_OK;
}

mst_status mst_memmgr_set_recompute_plan(mst_memmgr_t* m, const int32_t* chunk_start) {
    if (!m || !chunk_start) return mst_set_error(MST_ERR_INVALID, "m or chunk_start is NULL");
    if (m->sized || m->in_step) return mst_set_error(MST_ERR_STATE, "layer recompute is set before the first step");
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        const int32_t c = chunk_start[l];
        if (c < -1 || c > l || (c >= 0 && c != l && (l == 0 || chunk_start[l - 1] != c)))
            return mst_set_error(MST_ERR_INVALID, "recompute plan: layer %d starts its chunk at %d", l, c);
    }
    for (int32_t l = 0; l < m->cfg.n_layers; l++) { /* chunks stay inside a model chunk */
        const int32_t first = chunk_of(m, l) * m->layers_per_chunk;
        m->chunk_start[l] = chunk_start[l] >= 0 && chunk_start[l] < first ? first : chunk_start[l];
    }
    return MST_OK;
}

mst_status mst_memmgr_set_recompute(mst_memmgr_t* m, const mst_recompute_config* rc) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    int32_t* plan = (int32_t*)malloc(sizeof(int32_t) * (size_t)m->cfg.n_layers);
    if (!plan) return mst_set_error(MST_ERR_OOM, "recompute plan");
    mst_status st = mst_recompute_plan(rc, m->cfg.n_layers, plan);
    if (st == MST_OK) st = mst_memmgr_set_recompute_plan(m, plan);
    free(plan);
    return st;
}

int32_t mst_memmgr_recompute_chunk(const mst_memmgr_t* m, int32_t layer) {
    return m && layer >= 0 && layer < m->cfg.n_layers ? m->chunk_start[layer] : -1;
}

static mst_status check_call(const mst_memmgr_t* m, int32_t l, int32_t mb, const mst_saver** out) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    if (!m->in_step) return mst_set_error(MST_ERR_STATE, "call outside mst_memmgr_step_begin / step_end");
    return mst_mm_check_layer_mb(m, l, mb);
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

/* At each layer call: the side operations of the previous call are
 * launched (one batch per side stream and layer call); before the caller
 * writes again into buffers an earlier layer committed as inputs, their
 * stashes must have read them (edge inputs_read, memmgr_streams.c). */
static mst_status layer_call_begins(mst_memmgr_t* m) {
    MST_TRY(mst_mm_flush_all(m));
    MST_TRY(mst_mm_slow_main(m));
    if (!m->inputs_pending) return MST_OK;
    m->inputs_pending = 0;
    return mst_mm_ev_wait(m, m->inputs_read, MST_STREAM_MAIN);
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
        MST_TRY(mst_mm_issue_restore(m, top - i, e.microbatch, (m->bwd_seq + 1 + i) & 1));
    return MST_OK;
}

mst_status mst_memmgr_forward(mst_memmgr_t* m, int32_t layer, int32_t mb, const mst_saver** out) {
    MST_TRY(check_call(m, layer, mb, out));
    MST_TRY(expect(m, 0, layer, mb));
    MST_TRY(layer_call_begins(m));
    MST_TRY(prefetch_next_entry(m));
    *out = mst_mm_saver_for(m, layer, mb, m->chunk_start[layer] >= 0 ? MODE_DISCARD : MODE_FWD);
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
    MST_TRY(layer_call_begins(m));
    m->bwd_seq++;
    MST_TRY(mst_mm_issue_restore(m, layer, mb, m->bwd_seq & 1));
    int32_t next_mb = mb, next = next_backward(m, layer, &next_mb);
    if (next >= 0) MST_TRY(mst_mm_issue_restore(m, next, next_mb, (m->bwd_seq + 1) & 1)); /* prefetch */
    *out = mst_mm_saver_for(m, layer, mb, MODE_BWD);
    return MST_OK;
}

mst_status mst_memmgr_recompute(mst_memmgr_t* m, int32_t layer, int32_t mb, const mst_saver** out) {
    MST_TRY(check_call(m, layer, mb, out));
    if (m->chunk_start[layer] < 0)
        return mst_set_error(MST_ERR_INVALID, "layer = %d is not in a recompute chunk", layer);
    MST_TRY(layer_call_begins(m));
    *out = mst_mm_saver_for(m, layer, mb, MODE_RECOMP);
    return MST_OK;
}

mst_status mst_memmgr_saved_rows(const mst_memmgr_t* m, int32_t layer, int32_t mb, int64_t* rows) {
    if (!m || !rows) return mst_set_error(MST_ERR_INVALID, "m or rows is NULL");
    MST_TRY(mst_mm_check_layer_mb(m, layer, mb));
    *rows = 0;
    for (int n = 0; n < MST_N_SAVED; n++) {
        const int64_t r = slot_of(m, layer, mb, (mst_saved_name)n)->n_rows;
        *rows = r > *rows ? r : *rows;
    }
    return MST_OK;
}

int mst_memmgr_reads_pages(const mst_memmgr_t* m, mst_saved_name name) {
    return m && (int)name >= 0 && name < MST_N_SAVED && read_from_pages(m, name);
}

mst_status mst_memmgr_step_begin(mst_memmgr_t* m, int measuring) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    if (m->in_step) return mst_set_error(MST_ERR_STATE, "step_begin inside a step");
    if (!measuring && !m->sized)
        return mst_set_error(MST_ERR_STATE, "the first step must be a measuring step (measuring = 1)");
    if (measuring) { /* no pools; restore buffers for any rows up to max_rows */
        mst_mm_release_pools(m);
        MST_TRY(mst_mm_ensure_arena(m, m->cfg.max_rows, 0));
        memset(m->live_pages, 0, sizeof m->live_pages);
        memset(m->peak_pages, 0, sizeof m->peak_pages);
        m->live_exact = m->peak_exact = 0;
        m->max_saved_rows = 0;
    } else { /* every pool's reset in one batch, on main */
        mst_stash_batch resets = {0};
        for (int n = 0; n < MST_N_SAVED; n++)
            for (int k = 0; k < MM_N_KINDS; k++) {
                if (resets.n == MST_STASH_BATCH_MAX) MST_TRY(mst_stash_batch_run(m->ctx, &resets));
                if (m->pool[n][k]) MST_TRY(mst_stash_batch_reset(&resets, m->pool[n][k]));
            }
        MST_TRY(mst_stash_batch_run(m->ctx, &resets));
    }
    for (int n = 0; n < MST_N_SAVED; n++) {
        m->bufs[n].compute_pending = 0;
        memset(m->bufs[n].restore_free_rec, 0, sizeof m->bufs[n].restore_free_rec);
    }
    for (int s = MST_STREAM_RING; s < MST_N_STREAMS; s++) /* left by a step that failed */
        m->batch[s].b.n = m->batch[s].n_rec = 0;
    for (int64_t i = 0; i < (int64_t)m->cfg.n_layers * m->cfg.n_microbatches * MST_N_SAVED; i++)
        m->slots[i].produced = m->slots[i].claimed = 0;
    m->inputs_pending = m->side_used = 0;
    m->measuring = measuring != 0;
    m->pos = m->cursor = m->bwd_seq = m->started = 0;
    m->in_step = 1;
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
    MST_TRY(mst_mm_join_side(m));
    if (!m->measuring) return MST_OK;
    if (m->sized) m->rep.reruns++;
    if (m->peak_exact > m->rep.exact_bytes) m->rep.exact_bytes = m->peak_exact;
    MST_TRY(mst_mm_size_pools(m));
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
    MST_TRY(MST_CHECK_STRUCT("out", out, mst_mem_report_t));
    *out = m->rep;
    out->struct_size = sizeof *out;
    out->recompute_bytes = 0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int n = 0; n < MST_N_SAVED; n++)
            if (m->chunk_start[l] >= 0 || policy_of(m, l, (mst_saved_name)n) == MST_POLICY_RECOMPUTE)
                out->recompute_bytes += (size_t)m->cfg.n_microbatches * buf_bytes(m, (mst_saved_name)n);
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < MM_N_KINDS; k++) {
            if (!m->pool[n][k]) continue;
            mst_pool_stats st = MST_POOL_STATS_INIT;
            MST_TRY(mst_pool_stats_get(m->pool[n][k], &st));
            out->dev_pages_bytes += (size_t)(st.n_dev_pages * st.page_bytes);
            out->dev_pages_peak_bytes += (size_t)(st.dev_peak * st.page_bytes);
            out->host_pages_bytes += (size_t)(st.n_host_pages * st.page_bytes);
            out->host_pages_peak_bytes += (size_t)(st.host_peak * st.page_bytes);
            out->dev_pages_used_bytes += (size_t)(st.dev_used * st.page_bytes);
            out->host_pages_used_bytes += (size_t)(st.host_used * st.page_bytes);
        }
    return MST_OK;
}

mst_status mst_memmgr_check(mst_memmgr_t* m) {
    if (!m) return mst_set_error(MST_ERR_INVALID, "m is NULL");
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < MM_N_KINDS; k++) {
            if (!m->pool[n][k]) continue;
            MST_TRY(mst_pool_check(m->pool[n][k]));
            mst_pool_stats st = MST_POOL_STATS_INIT;
            MST_TRY(mst_pool_stats_get(m->pool[n][k], &st));
            if (!m->in_step && st.dev_used + st.host_used != 0)
                return mst_set_error(MST_ERR_STATE, "pool of %s (%s) holds %lld pages between steps",
                                     mst_saved_name_str((mst_saved_name)n), k & MM_KIND_OFFLOAD ? "offload" : "stash",
                                     (long long)(st.dev_used + st.host_used));
        }
    return MST_OK;
}
