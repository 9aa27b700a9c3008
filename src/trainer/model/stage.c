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
 * MTP module (layer L). The memory manager of a stage sees its layers only,
 * as local layers 0 .. n_here-1.
 *
 * Forward, stage s to s+1, per microbatch: the last layer's output [N, H],
 * the MTP module's next-token embedding e1 [N, H] (made on stage 0, which
 * holds the table) and the router loads [L+1, E] so far (the load-balancing
 * loss couples every main layer). Backward, s+1 to s: d(input) [N, H],
 * d(e1) [N, H] (stage 0 adds it into the table's gradient, in the order one
 * stage would) and the loads of every layer, through a buffer of their own
 * (m->loads_bwd: the group that sends them may receive the next
 * microbatch's forward into the same activation set). Pairing as Megatron's 1F1B: an
 * entry's send goes in one group with the next entry's receive when that
 * receive comes from the same neighbour (send forward + receive backward,
 * send backward + receive forward); other transfers go alone.
 */
#include <string.h>

#include "ops.h"

#define BAD(...) mst_set_error(MST_ERR_INVALID, __VA_ARGS__)

mst_status mst_model_grid_check(const mst_model_config* c, int32_t pp, int32_t world, mst_schedule_kind schedule) {
    if (pp < 1 || pp > 256) return BAD("--pp %d: expected 1 .. 256 pipeline stages", pp);
    if (pp == 1) return MST_OK;
    if (c->layers % pp) return BAD("--pp %d: must divide --layers %d (each stage holds L / P layers)", pp, c->layers);
    if (world < pp || world % pp)
        return BAD("--pp %d: must divide --gpus %d (world = P x data-parallel ranks)", pp, world);
    const int32_t D = world / pp;
    if (c->experts % D)
        return BAD("--pp %d: the %d data-parallel ranks of a stage (--gpus %d / --pp %d) share its %d experts "
                   "(--experts): must divide them", pp, D, world, pp, c->experts);
    if (schedule == MST_SCHEDULE_INTERLEAVED)
        return BAD("--pp %d: --schedule interleaved across stages is not built yet (1f1b or plain)", pp);
    return MST_OK;
}

void mst_model_set_stage(mst_model* m, int32_t stage, int32_t stages) {
    const int32_t L = m->cfg.layers, P = stages > 1 ? stages : 1, s = stages > 1 ? stage : 0;
    m->stage = s, m->stages = P;
    m->l_first = s * (L / P);
    m->l_end = m->l_first + L / P;
    m->n_here = m->l_end - m->l_first + (s == P - 1);
}

int mst_model_here(const mst_model* m, int32_t l) {
    return (l >= m->l_first && l < m->l_end) || (l == m->cfg.layers && m->stage == m->stages - 1);
}

int32_t mst_model_local(const mst_model* m, int32_t l) {
    return l == m->cfg.layers ? m->l_end - m->l_first : l - m->l_first;
}

int32_t mst_model_global(const mst_model* m, int32_t i) {
    return i == m->l_end - m->l_first ? m->cfg.layers : m->l_first + i;
}

int32_t mst_model_grid_rank(const mst_model* m) { return m->stage * m->dist.world + m->dist.rank; }
int32_t mst_model_grid_size(const mst_model* m) { return m->stages * m->dist.world; }

int32_t mst_model_stage_of(const mst_model* m, int32_t layer, int first) {
    if (layer < 0) return first ? 0 : m->stages - 1;
    return layer >= m->cfg.layers ? m->stages - 1 : layer / (m->cfg.layers / m->stages);
}

/* ---- what crosses stages ---------------------------------------------------- */

static size_t loads_bytes(const mst_model* m) {
    return sizeof(int32_t) * (size_t)((m->cfg.layers + 1) * m->cfg.experts);
}

/* The pipe rank of data-parallel rank d of stage s. */
static int32_t pipe_rank(const mst_model* m, int32_t s) { return s * m->dist.world + m->dist.rank; }

/* The transfers of entry e's message, appended to ops: as the receiver
 * (recv: entry e needs it) or the sender (entry e made it). 0 when e
 * neither needs nor makes one on this stage. */
static int message(mst_model* m, mst_sched_entry e, int recv, mst_ep_p2p_op* ops) {
    const int32_t s = m->stage, last = m->stages - 1;
    /* forward: received from s-1, sent to s+1; backward: the other way */
    const int from_below = e.backward ? !recv : recv;
    if (from_below ? s == 0 : s == last) return 0;
    const int32_t peer = pipe_rank(m, from_below ? s - 1 : s + 1);
    mst_micro* u = &m->micro[e.microbatch];
    const mst_model_config* c = &m->cfg;
    const size_t NH = sizeof(uint16_t) * (size_t)(c->batch * c->seq * c->hidden);
    void* act = e.backward ? (void*)u->dh : recv ? (void*)u->acts[m->l_first - 1].out : (void*)u->acts[m->l_end - 1].out;
    void* de1 = e.backward ? (void*)m->de1 : (void*)u->e1;
    void* loads = e.backward ? (void*)m->loads_bwd : (void*)u->loads;
    ops[0] = (mst_ep_p2p_op){peer, recv, act, NH};
    ops[1] = (mst_ep_p2p_op){peer, recv, de1, NH};
    ops[2] = (mst_ep_p2p_op){peer, recv, loads, loads_bytes(m)};
    return 3;
}

/* Backward entry e's loads between m->loads_bwd and its activation set:
 * in (received: every layer's, into the set) or out (to be sent). */
static mst_status loads_bwd(mst_model* m, mst_sched_entry e, int in) {
    int32_t* u = m->micro[e.microbatch].loads;
    return in ? mst_copy_b2b(m->ctx, u, m->loads_bwd, loads_bytes(m)) : mst_copy_b2b(m->ctx, m->loads_bwd, u, loads_bytes(m));
}

mst_status mst_stage_before(mst_model* m, int32_t i) {
    if (m->stages == 1) return MST_OK;
    const mst_sched_entry e = m->sched[i];
    mst_ep_p2p_op ops[3];
    /* after an entry of the other direction, its group received this one's */
    const int alone = i == 0 || m->sched[i - 1].backward == e.backward;
    const int n = alone ? message(m, e, 1, ops) : 0;
    MST_TRY(mst_ep_p2p(m->dist.pipe, ops, n));
    return e.backward && m->stage < m->stages - 1 ? loads_bwd(m, e, 1) : MST_OK;
}

mst_status mst_stage_after(mst_model* m, int32_t i) {
    if (m->stages == 1) return MST_OK;
    const mst_sched_entry e = m->sched[i];
    mst_ep_p2p_op ops[6];
    if (!e.backward && m->stage == 0) { /* e1 for the MTP module, from the table here */
        mst_embed_args a = {.n_tok = m->cfg.batch * m->cfg.seq, .vocab = m->cfg.vocab, .cols = m->cfg.hidden,
                            .tokens = m->micro[e.microbatch].tok + m->cfg.batch * m->cfg.seq,
                            .table = m->w + m->emb, .x = m->micro[e.microbatch].e1};
        MST_TRY(MST_MODEL_OP(m, embed_forward, &a));
    }
    if (e.backward && m->stage > 0) MST_TRY(loads_bwd(m, e, 0));
    int n = message(m, e, 0, ops);
    if (i + 1 < m->n_sched && m->sched[i + 1].backward != e.backward) n += message(m, m->sched[i + 1], 1, ops + n);
    return mst_ep_p2p(m->dist.pipe, ops, n);
}

/* ---- sums over the grid ------------------------------------------------------ */

mst_status mst_model_allreduce_world(mst_model* m, void* data, int64_t count, mst_ep_reduce kind) {
    return m->dist.pipe ? mst_ep_allreduce(m->dist.pipe, data, count, kind) : mst_model_allreduce(m, data, count, kind);
}

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
