/*
 * stage.c — the model as one pipeline stage of P (docs/DESIGN.md, "The
 * pipeline grid"): the rank grid's checks, which layers a stage holds, and
 * what crosses stages inside a step.
 *
 * Grid: world = P D ranks, rank s D + d is data-parallel rank d of stage s;
 * the D ranks of a stage share its experts (expert parallelism inside data
 * parallelism) over dist.ep, and every rank talks to its neighbours over
 * dist.pipe (all P D ranks). Stage s holds main layers [s L / P, (s + 1) L /
 * P); stage 0 the embedding; the last stage the final norm, the head and the
 * MTP module (layer L). Interleaved (V chunks a stage): the L + 1 layers
 * (the MTP layer last) in P V virtual stages of lpv each, virtual stage
 * c P + s being chunk c of stage s; forward messages go round the ring
 * (stage P-1's chunk c to stage 0's chunk c + 1). The memory manager of a
 * stage sees its layers only, as local layers 0 .. n_here-1, chunk c's at
 * [c n_here / V, (c + 1) n_here / V).
 *
 * Forward, stage s to s+1, per microbatch: the last layer's output [N, H],
 * the MTP module's next-token embedding e1 [N, H] (made on stage 0, which
 * holds the table) and the router loads [L+1, E] so far (the load-balancing
 * loss couples every main layer). Backward, s+1 to s: d(input) [N, H],
 * d(e1) [N, H] (stage 0 adds it into the table's gradient, in the order one
 * stage would) and the loads of every layer, through a buffer of their own
 * (the set's loads_bwd: the group that sends them may receive the next
 * microbatch's forward into the same activation set). Pairing as Megatron's
 * 1F1B: an entry's send goes in one group with the next entry's receive
 * when that goes the other way (send forward + receive backward, send
 * backward + receive forward); other transfers go alone. Interleaved: every
 * send with the next entry's receive (the ring).
 */
#include <string.h>

#include "ops.h"

#define BAD(...) mst_set_error(MST_ERR_INVALID, __VA_ARGS__)

mst_status mst_model_grid_check(const mst_model_config* c, int32_t pp, int32_t world, mst_schedule_kind schedule,
                                int32_t virtual_stages) {
    if (pp < 1 || pp > 256) return BAD("--pp %d: expected 1 .. 256 pipeline stages", pp);
    if (pp == 1) return MST_OK;
    const int32_t V = schedule == MST_SCHEDULE_INTERLEAVED ? virtual_stages : 1;
    if (V > 1 && (c->layers + 1) % (pp * V))
        return BAD("--pp %d: with --schedule interleaved (%d chunks a stage) P x %d must divide --layers + 1 = %d (the "
                   "MTP layer last)", pp, V, V, c->layers + 1);
    if (V > 1 && (c->layers + 1) / (pp * V) < 2)
        return BAD("--pp %d: with --schedule interleaved each of the %d virtual stages needs 2 layers or more (the "
                   "head beside the MTP module): --layers %d", pp, pp * V, c->layers);
    if (V == 1 && c->layers % pp) return BAD("--pp %d: must divide --layers %d (each stage holds L / P layers)", pp, c->layers);
    if (world < pp || world % pp)
        return BAD("--pp %d: must divide --gpus %d (world = P x data-parallel ranks)", pp, world);
    const int32_t D = world / pp;
    if (c->experts % D)
        return BAD("--pp %d: the %d data-parallel ranks of a stage (--gpus %d / --pp %d) share its %d experts "
                   "(--experts): must divide them", pp, D, world, pp, c->experts);
    return MST_OK;
}

int mst_model_stage_comm(int32_t pp, int32_t world) {
    const int32_t P = pp > 1 ? pp : 1;
    return world / P > 1 || P == 1;
}

void mst_model_set_stage(mst_model* m, int32_t stage, int32_t stages) {
    const int32_t L = m->cfg.layers, P = stages > 1 ? stages : 1, s = stages > 1 ? stage : 0;
    const int32_t V = m->mem_cfg.virtual_stages > 1 ? m->mem_cfg.virtual_stages : 1;
    m->stage = s, m->stages = P;
    m->lpv = V > 1 ? (L + 1) / (P * V) : 0;
    m->l_first = V > 1 ? s * m->lpv : s * (L / P);
    m->l_end = V > 1 ? m->l_first + m->lpv : m->l_first + L / P;
    m->n_here = V > 1 ? V * m->lpv : m->l_end - m->l_first + (s == P - 1);
}

int mst_model_here(const mst_model* m, int32_t l) {
    if (m->lpv) return (l / m->lpv) % m->stages == m->stage;
    return (l >= m->l_first && l < m->l_end) || (l == m->cfg.layers && m->stage == m->stages - 1);
}

int32_t mst_model_local(const mst_model* m, int32_t l) {
    if (m->lpv) return l / m->lpv / m->stages * m->lpv + l % m->lpv;
    return l == m->cfg.layers ? m->l_end - m->l_first : l - m->l_first;
}

int32_t mst_model_global(const mst_model* m, int32_t i) {
    if (m->lpv) return ((i / m->lpv) * m->stages + m->stage) * m->lpv + i % m->lpv;
    return i == m->l_end - m->l_first ? m->cfg.layers : m->l_first + i;
}

int32_t mst_stage_received(const mst_model* m, int32_t c) {
    const int32_t f = mst_model_global(m, c * m->layers_per_chunk);
    return f == 0 || mst_model_here(m, f - 1) ? -1 : f - 1;
}

mst_status mst_stage_local_plan(const mst_model* m, const int32_t* chunk_start, int32_t* local) {
    for (int32_t i = 0; i < m->n_here; i++) {
        const int32_t l = mst_model_global(m, i), cs = chunk_start[l];
        if (cs >= 0 && (cs > l || !mst_model_here(m, cs)))
            return BAD("layer %d's recompute chunk starts at layer %d, not on stage %d before it", l, cs, m->stage);
        local[i] = cs < 0 ? -1 : mst_model_local(m, cs);
    }
    return MST_OK;
}

int32_t mst_model_grid_rank(const mst_model* m) { return m->stage * m->dist.world + m->dist.rank; }
int32_t mst_model_grid_size(const mst_model* m) { return m->stages * m->dist.world; }

int32_t mst_model_stage_of(const mst_model* m, int32_t layer, int first) {
    if (layer < 0) return first ? 0 : m->stages - 1;
    if (m->lpv) return (layer / m->lpv) % m->stages;
    return layer >= m->cfg.layers ? m->stages - 1 : layer / (m->cfg.layers / m->stages);
}

/* ---- what crosses stages ---------------------------------------------------- */

static size_t loads_bytes(const mst_model* m) {
    return sizeof(int32_t) * (size_t)((m->cfg.layers + 1) * m->cfg.experts);
}

/* The pipe rank of data-parallel rank d of stage s. */
static int32_t pipe_rank(const mst_model* m, int32_t s) { return s * m->dist.world + m->dist.rank; }

/* The virtual stage of chunk c here (one chunk a stage: the stage), and
 * the neighbour entry e's message comes from (recv) or goes to: forward
 * from v-1 to v+1, backward the other way; -1: none (the ends). */
static int32_t vstage(const mst_model* m, int32_t c) { return c * m->stages + m->stage; }

static int32_t neighbour(const mst_model* m, mst_sched_entry e, int recv) {
    const int32_t n = m->stages * (m->lpv ? m->mem_cfg.virtual_stages : 1);
    const int32_t w = vstage(m, e.chunk) + ((e.backward ? !recv : recv) ? -1 : 1);
    return w < 0 || w >= n ? -1 : w;
}

/* The transfers of entry e's message, appended to ops: as the receiver
 * (recv: entry e needs it) or the sender (entry e made it). 0 when e
 * neither needs nor makes one on this stage. */
static int message(mst_model* m, mst_sched_entry e, int recv, mst_ep_p2p_op* ops) {
    const int32_t w = neighbour(m, e, recv);
    if (w < 0) return 0;
    const int32_t peer = pipe_rank(m, w % m->stages), lpc = m->layers_per_chunk;
    const int32_t first = mst_model_global(m, e.chunk * lpc), last = mst_model_global(m, (e.chunk + 1) * lpc - 1);
    mst_micro* u = &m->micro[e.microbatch];
    const mst_model_config* c = &m->cfg;
    const size_t NH = sizeof(uint16_t) * (size_t)(c->batch * c->seq * c->hidden);
    void* act = e.backward ? (void*)u->dh : recv ? (void*)u->acts[first - 1].out : (void*)u->acts[last].out;
    void* de1 = e.backward ? (void*)u->de1 : (void*)u->e1;
    void* loads = e.backward ? (void*)u->loads_bwd : (void*)u->loads;
    ops[0] = (mst_ep_p2p_op){peer, recv, act, NH};
    ops[1] = (mst_ep_p2p_op){peer, recv, de1, NH};
    ops[2] = (mst_ep_p2p_op){peer, recv, loads, loads_bytes(m)};
    return 3;
}

/* Backward entry e's loads between its loads_bwd and its loads: in
 * (received: every layer's) or out (to be sent). */
static mst_status loads_bwd(mst_model* m, mst_sched_entry e, int in) {
    mst_micro* u = &m->micro[e.microbatch];
    return in ? mst_copy_b2b(m->ctx, u->loads, u->loads_bwd, loads_bytes(m))
              : mst_copy_b2b(m->ctx, u->loads_bwd, u->loads, loads_bytes(m));
}

/* 1F1B (one chunk a stage), Megatron's pairing: entry i + 1's receive goes
 * in one group with entry i's send when it goes the other way (send forward
 * + receive backward, send backward + receive forward); else alone. */
static int grouped(const mst_model* m, int32_t i) {
    return i + 1 < m->n_sched && m->sched[i + 1].backward != m->sched[i].backward;
}

/* Interleaved (the messages go round the ring, where a send alone could
 * wait on a ring of sends), Megatron's interleaved pairing: a forward
 * followed by a backward is a pair of the steady state, whose sends wait
 * for the pair's end and go in one group with the next entry's receive (and
 * the next pair's backward's); every other entry's send goes with the next
 * entry's receive (warm-up: forward with forward, cool-down: backward with
 * backward). A schedule that is all warm-up (M V forwards, then the
 * backwards) has no pair. */
static int pair_start(const mst_model* m, int32_t i) {
    int32_t warm = 0; /* the warm-up forwards; all of them (no steady state): no pair */
    while (warm < m->n_sched && !m->sched[warm].backward) warm++;
    return warm < m->n_sched / 2 && i >= 0 && i + 1 < m->n_sched && !m->sched[i].backward && m->sched[i + 1].backward;
}

/* The receives of entries i (and i + 1 when i starts a pair) into ops. */
static int receives(mst_model* m, int32_t i, mst_ep_p2p_op* ops) {
    if (i >= m->n_sched) return 0;
    const int n = message(m, m->sched[i], 1, ops);
    return pair_start(m, i) ? n + message(m, m->sched[i + 1], 1, ops + n) : n;
}

mst_status mst_stage_before(mst_model* m, int32_t i) {
    if (m->stages == 1) return MST_OK;
    const mst_sched_entry e = m->sched[i];
    mst_ep_p2p_op ops[6];
    int n = 0;
    if (m->lpv) n = i == 0 ? receives(m, 0, ops) : 0;
    else n = i == 0 || !grouped(m, i - 1) ? message(m, e, 1, ops) : 0; /* else the group before received it */
    MST_TRY(mst_ep_p2p(m->dist.pipe, ops, n));
    return e.backward && neighbour(m, e, 1) >= 0 ? loads_bwd(m, e, 1) : MST_OK;
}

mst_status mst_stage_after(mst_model* m, int32_t i) {
    if (m->stages == 1) return MST_OK;
    const mst_sched_entry e = m->sched[i];
    mst_ep_p2p_op ops[12];
    if (!e.backward && m->stage == 0 && e.chunk == 0) { /* e1 for the MTP module, from the table here */
        mst_embed_args a = {.n_tok = m->cfg.batch * m->cfg.seq, .vocab = m->cfg.vocab, .cols = m->cfg.hidden,
                            .tokens = m->micro[e.microbatch].tok + m->cfg.batch * m->cfg.seq,
                            .table = m->w + m->emb, .x = m->micro[e.microbatch].e1};
        MST_TRY(MST_MODEL_OP(m, embed_forward, &a));
    }
    if (e.backward && neighbour(m, e, 0) >= 0) MST_TRY(loads_bwd(m, e, 0));
    int n = 0;
    if (!m->lpv) {
        n = message(m, e, 0, ops);
        if (grouped(m, i)) n += message(m, m->sched[i + 1], 1, ops + n);
    } else if (!pair_start(m, i)) { /* a pair's forward sends at the pair's end */
        if (pair_start(m, i - 1)) n = message(m, m->sched[i - 1], 0, ops);
        n += message(m, e, 0, ops + n);
        n += receives(m, i + 1, ops + n);
    }
    return mst_ep_p2p(m->dist.pipe, ops, n);
}

/* ---- sums over the grid ------------------------------------------------------ */

mst_status mst_stage_share_tied(mst_model* m) {
    if (m->stages == 1 || !m->cfg.tie_embeddings) return MST_OK;
    const int64_t n = m->cfg.vocab * m->cfg.hidden;
    if (!m->n_tied) MST_TRY(mst_fill(m->ctx, m->tied_zero, 0, sizeof(float) * (size_t)n)); /* the sum lands here too */
    return mst_model_allreduce_world(m, m->n_tied ? m->grad : m->tied_zero, n, MST_EP_SUM_F32);
}

int64_t mst_stage_norm_skip(const mst_model* m) { return m->stage > 0 ? m->n_tied : 0; }

mst_status mst_stage_norm_sum(mst_model* m) {
    if (m->stages == 1) return MST_OK;
    if (m->dist.rank != 0) MST_TRY(mst_fill(m->ctx, m->gsumsq, 0, sizeof(float))); /* the stage's once */
    return mst_model_allreduce_world(m, m->gsumsq, 1, MST_EP_SUM_F32);
}
