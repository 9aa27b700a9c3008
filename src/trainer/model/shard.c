/*
 * shard.c — the optimizer state over the data-parallel ranks (ZeRO-1, as
 * Megatron's distributed optimizer): which parts of the flat parameters
 * this rank updates and where their fp32 master weights and AdamW moments
 * lie, the replicated gradients' reduction, the squared gradient norm and
 * the all-gather of the updated bf16 weights.
 *
 * On W ranks the replicated parameters are two runs of the flat buffers:
 * the matrices [0, n_dense) and the norm weights [n_decay, n_params); this
 * rank's experts [n_dense, n_decay) lie between them. Each run is a body of
 * W blocks of q elements and a tail (mst_optim_run). Unsharded, every rank
 * all-reduces the runs' gradients and updates all of them; sharded, rank r
 * reduce-scatters the bodies, all-reduces the tails, updates block r of
 * each body, the tails and its experts, and all-gathers the bodies' bf16
 * weights: its state is q + tail per run instead of n.
 *
 * What is promised: the squared gradient norm sums the same pieces in the
 * same order either way (each rank's body blocks, its experts, rank 0 the
 * tails; the [W, 4] table of pieces summed over the ranks with zeros
 * elsewhere, which is exact, then added in row order), and AdamW is
 * elementwise; and the reduce-scatter's block holds the all-reduce's bits
 * (both sum in rank order on every transport: ep.h); so sharded and
 * unsharded runs are bit-identical, on the CPU twin and over NCCL.
 */
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "ops.h"

mst_ep_t* mst_model_dp(const mst_model* m, int32_t* rank, int32_t* world) {
    *rank = m->dist.ep ? m->dist.rank : 0;
    *world = m->dist.ep ? m->dist.world : 1;
    return m->dist.ep;
}

/* ---- layout ------------------------------------------------------------------ */

static mst_optim_run make_run(int64_t lo, int64_t n, int32_t W) {
    const int64_t q = n / (4 * (int64_t)W) * 4;
    return (mst_optim_run){lo, n, q};
}

static int64_t up4(int64_t x) { return (x + 3) / 4 * 4; }

/* Appends part [lo, lo + n) at the next 16-byte aligned state offset. */
static void add_part(mst_model* m, int64_t lo, int64_t n, int32_t decay) {
    if (n <= 0) return;
    MST_ASSERT(m->n_opt_parts < MST_OPTIM_MAX_PARTS);
    m->opt_part[m->n_opt_parts++] = (mst_optim_part){lo, n, m->n_state, decay};
    m->n_state = up4(m->n_state + n);
}

/* A replicated run's parts here: block r of its body and its tail, or all. */
static void add_run(mst_model* m, const mst_optim_run* u, int32_t r, int32_t W, int32_t decay) {
    if (!m->opt_shard) {
        add_part(m, u->lo, u->n, decay);
        return;
    }
    add_part(m, u->lo + r * u->q, u->q, decay);
    add_part(m, u->lo + W * u->q, u->n - W * u->q, decay);
}

void mst_optim_layout(mst_model* m) {
    int32_t r, W;
    const mst_ep_t* dp = mst_model_dp(m, &r, &W);
    m->n_opt_parts = 0;
    m->n_state = 0;
    m->opt_shard = dp && W > 1 && m->mem_cfg.optimizer_shard;
    if (!dp) { /* one rank: the matrices, then the norm weights, at == lo */
        add_part(m, 0, m->n_decay, 1);
        add_part(m, m->n_decay, m->n_params - m->n_decay, 0);
        m->n_state = m->n_params;
        return;
    }
    /* P stages: a table tied across them is a part of its own, whole on its
     * two stages (its gradient summed over the grid: stage.c) */
    add_part(m, 0, m->n_tied, 1);
    m->rep[0] = make_run(m->n_tied, m->n_dense - m->n_tied, W);
    m->rep[1] = make_run(m->n_decay, m->n_params - m->n_decay, W);
    add_run(m, &m->rep[0], r, W, 1);
    add_part(m, m->n_dense, m->n_decay - m->n_dense, 1); /* this rank's experts */
    add_run(m, &m->rep[1], r, W, 0);
    if (m->n_state < 1) m->n_state = 1;
}

/* ---- state in and out -------------------------------------------------------- */

size_t mst_optim_state_elem(const mst_model* m, int k) { return k > 0 && m->mem_cfg.moments_bf16 ? 2 : 4; }

static char* state_buf(mst_model* m, int k) {
    return (char*)(k == 0 ? (void*)m->master : k == 1 ? m->adam_m : m->adam_v);
}

mst_status mst_optim_state_put(mst_model* m, int k, int64_t off, int64_t n, const float* host) {
    char* s = state_buf(m, k);
    const size_t es = mst_optim_state_elem(m, k);
    uint16_t* half = es == 2 ? (uint16_t*)malloc(sizeof(uint16_t) * (size_t)n + 1) : NULL; /* [n] bf16 */
    if (es == 2 && !half) return mst_set_error(MST_ERR_OOM, "optimizer state staging (%lld)", (long long)n);
    if (half) mst_fp32_to_bf16_array(half, host, (size_t)n);
    const char* src = half ? (const char*)half : (const char*)host;
    mst_status st = MST_OK;
    for (int32_t i = 0; i < m->n_opt_parts && st == MST_OK; i++) {
        const mst_optim_part* p = &m->opt_part[i];
        const int64_t lo = off > p->lo ? off : p->lo, hi = off + n < p->lo + p->n ? off + n : p->lo + p->n;
        if (hi > lo) st = mst_copy_h2b(m->ctx, s + es * (size_t)(p->at + lo - p->lo), src + es * (size_t)(lo - off), es * (size_t)(hi - lo));
    }
    free(half);
    return st;
}

/* host [n] fp32 = src [n] of es bytes (bf16 widened). */
static void widen(float* host, const void* src, int64_t n, size_t es) {
    if (es == 4) memcpy(host, src, sizeof(float) * (size_t)n);
    else for (int64_t i = 0; i < n; i++) host[i] = mst_bf16_to_fp32(((const uint16_t*)src)[i]);
}

/* The part holding flat element x, or NULL. */
static const mst_optim_part* part_of(const mst_model* m, int64_t x) {
    for (int32_t i = 0; i < m->n_opt_parts; i++)
        if (x >= m->opt_part[i].lo && x < m->opt_part[i].lo + m->opt_part[i].n) return &m->opt_part[i];
    return NULL;
}

mst_status mst_optim_state_get(mst_model* m, int k, int64_t off, int64_t n, const float* runs, float* host) {
    const char* s = state_buf(m, k);
    const size_t es = mst_optim_state_elem(m, k);
    void* stage = malloc(es * (size_t)n + 1); /* [n] of es bytes */
    if (!stage) return mst_set_error(MST_ERR_OOM, "optimizer state readback (%lld)", (long long)n);
    mst_status st = MST_OK;
    for (int64_t x = off; x < off + n && st == MST_OK;) {
        int64_t end = off + n;
        const mst_optim_run* u = NULL;
        for (int v = 0; runs && m->opt_shard && v < 2; v++)
            if (x >= m->rep[v].lo && x < m->rep[v].lo + m->rep[v].n) u = &m->rep[v];
        const mst_optim_part* p = u ? NULL : part_of(m, x);
        if (u) { /* a replicated run, from the gathered runs [rep0 | rep1] */
            end = end < u->lo + u->n ? end : u->lo + u->n;
            const float* from = runs + (u == &m->rep[1] ? m->rep[0].n : 0) + (x - u->lo);
            memcpy(host + (x - off), from, sizeof(float) * (size_t)(end - x));
        } else if (p) {
            end = end < p->lo + p->n ? end : p->lo + p->n;
            st = mst_copy_b2h(m->ctx, stage, s + es * (size_t)(p->at + x - p->lo), es * (size_t)(end - x));
            if (st == MST_OK) widen(host + (x - off), stage, end - x, es);
        } else {
            st = mst_set_error(MST_ERR_STATE, "optimizer state of parameter element %lld: not on rank %d (sharded)",
                               (long long)x, m->dist.rank);
        }
        x = end;
    }
    free(stage);
    return st;
}

mst_status mst_optim_gather_runs(mst_model* m, int k, float* host) {
    if (!m->opt_shard) return MST_OK;
    const char* s = state_buf(m, k);
    const size_t es = mst_optim_state_elem(m, k);
    char* stage = (char*)m->grad; /* [n_params] fp32: the runs' flat layout of state k for a moment */
    mst_status st = MST_OK;
    void* tmp = host ? malloc(es * (size_t)(m->rep[0].n > m->rep[1].n ? m->rep[0].n : m->rep[1].n) + 1) : NULL;
    if (host && !tmp) st = mst_set_error(MST_ERR_OOM, "optimizer state gather");
    for (int32_t i = 0; i < m->n_opt_parts && st == MST_OK; i++) { /* every part here: the blocks, tails, experts */
        const mst_optim_part* p = &m->opt_part[i];
        st = mst_copy_b2b(m->ctx, stage + es * (size_t)p->lo, s + es * (size_t)p->at, es * (size_t)p->n);
    }
    for (int u = 0; u < 2 && st == MST_OK; u++) {
        const mst_optim_run* x = &m->rep[u];
        st = mst_ep_allgather(m->dist.ep, stage + es * (size_t)x->lo, es * (size_t)x->q);
        if (st == MST_OK && host) st = mst_copy_b2h(m->ctx, tmp, stage + es * (size_t)x->lo, es * (size_t)x->n);
        if (st == MST_OK && host) widen(host + (u ? m->rep[0].n : 0), tmp, x->n, es);
    }
    free(tmp);
    if (st != MST_OK) return st;
    return mst_optim_zero(m);
}

void mst_optim_replicated_bytes(const mst_model* m, size_t* held, size_t* whole) {
    *held = *whole = 0;
    if (!m->dist.ep) return;
    const size_t per = 4 + 2 * mst_optim_state_elem(m, 1); /* master, m, v */
    for (int32_t i = 0; i < m->n_opt_parts; i++) {
        const mst_optim_part* p = &m->opt_part[i];
        if (p->lo < m->n_dense || p->lo >= m->n_decay) *held += (size_t)p->n * per;
    }
    *whole = (size_t)(m->rep[0].n + m->rep[1].n + m->n_tied) * per; /* P stages: a tied table's copy, a part of its own */
}

/* ---- the step's collectives ---------------------------------------------------- */

mst_status mst_optim_share_grads(mst_model* m) {
    int32_t r, W;
    mst_ep_t* dp = mst_model_dp(m, &r, &W);
    if (!dp) return MST_OK;
    for (int u = 0; u < 2; u++) {
        const mst_optim_run* x = &m->rep[u];
        if (!m->opt_shard) {
            MST_TRY(mst_ep_allreduce(dp, m->grad + x->lo, x->n, MST_EP_SUM_F32));
            continue;
        }
        MST_TRY(mst_ep_reduce_scatter(dp, m->grad + x->lo, x->q, MST_EP_SUM_F32));
        MST_TRY(mst_ep_allreduce(dp, m->grad + x->lo + W * x->q, x->n - W * x->q, MST_EP_SUM_F32));
    }
    return MST_OK;
}

mst_status mst_optim_gather_weights(mst_model* m) {
    if (!m->opt_shard) return MST_OK;
    for (int u = 0; u < 2; u++)
        MST_TRY(mst_ep_allgather(m->dist.ep, m->w + m->rep[u].lo, sizeof(uint16_t) * (size_t)m->rep[u].q));
    return MST_OK;
}

/* out [1] = base (when given) + the sum of squares of grad [lo, lo + n). */
static mst_status sumsq(mst_model* m, int64_t lo, int64_t n, const float* base, float* out) {
    mst_sumsq_args a = {.n = n, .x = m->grad + lo, .partial = m->gpartial, .base = base, .out = out};
    return MST_MODEL_OP(m, sumsq, &a);
}

/* W ranks: row r of the [W, 4] table this rank's pieces (block r of each
 * run's body, its experts; rank 0 the tails), the other rows zero; summed
 * over the ranks (one value and zeros per entry: exact), then every entry
 * added in row order. Every gradient element is in exactly one piece, and
 * the pieces are the same sharded or not. */
mst_status mst_optim_grad_sumsq(mst_model* m) {
    int32_t r, W;
    mst_ep_t* dp = mst_model_dp(m, &r, &W);
    const int64_t skip = mst_stage_norm_skip(m); /* P stages: the last stage's copy of a tied table */
    if (!dp) return sumsq(m, skip, m->n_params - skip, NULL, m->gsumsq);
    float* row = m->gnorm_rows + (int64_t)r * MST_GNORM_COLS; /* [4] */
    const mst_optim_run *a = &m->rep[0], *b = &m->rep[1];
    MST_TRY(mst_fill(m->ctx, m->gnorm_rows, 0, sizeof(float) * (size_t)(W * MST_GNORM_COLS)));
    MST_TRY(sumsq(m, a->lo + r * a->q, a->q, NULL, row + 0));
    MST_TRY(sumsq(m, m->n_dense, m->n_decay - m->n_dense, NULL, row + 1));
    MST_TRY(sumsq(m, b->lo + r * b->q, b->q, NULL, row + 2));
    if (r == 0) {
        MST_TRY(sumsq(m, a->lo + W * a->q, a->n - W * a->q, NULL, row + 3));
        MST_TRY(sumsq(m, b->lo + W * b->q, b->n - W * b->q, row + 3, row + 3));
        if (m->n_tied && !skip) MST_TRY(sumsq(m, 0, m->n_tied, row + 3, row + 3));
    }
    MST_TRY(mst_ep_allreduce(dp, m->gnorm_rows, (int64_t)W * MST_GNORM_COLS, MST_EP_SUM_F32));
    mst_sumsq_args t = {.n = (int64_t)W * MST_GNORM_COLS, .x = m->gnorm_rows, .partial = m->gpartial, .out = m->gsumsq,
                        .plain = 1};
    return MST_MODEL_OP(m, sumsq, &t);
}
