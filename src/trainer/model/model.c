/*
 * model.c — the model's backend buffers: parameters (laid out and drawn by
 * params.c), activations by memory category
 * (weights, gradients, optimizer, saved activations, compute), and its
 * memory manager (grouped-MLP activations) with the schedule it follows.
 */
#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "model.h"
#include "overlap.h"

#define BAD(...) mst_set_error(MST_ERR_INVALID, __VA_ARGS__)

const char* mst_attn_kind_str(int32_t kind) {
    static const char* const names[] = {"auto", "flash", "cublas", "cudnn"};
    return kind >= 0 && kind <= MST_ATTN_CUDNN ? names[kind] : "?";
}

mst_mem_config mst_mem_config_default(void) {
    mst_mem_config c = {.schedule = MST_SCHEDULE_PLAIN, .virtual_stages = 1, .pool_factor = 1.10,
                        .recompute = MST_RECOMPUTE_CONFIG_INIT, .recompute_full = 1};
    return c;
}

mst_policy mst_policies_at(const mst_policies* p, int32_t layer, mst_saved_name n) {
    return p->per_layer ? p->per_layer[layer * MST_N_SAVED + n] : p->name[n];
}

int64_t mst_model_max_rows(const mst_model_config* c, int32_t world) {
    double r = ceil((double)c->capacity_factor * (double)(c->batch * world * c->seq * c->top_k) / c->ep);
    return r < 1 ? 1 : (int64_t)r;
}

mst_status mst_model_ep_config(const mst_model_config* c, int32_t world, mst_ep_config* out) {
    MST_TRY(mst_model_config_check(c));
    if (world < 1 || c->ep != world)
        return BAD("--ep %d: on %d ranks the expert groups are the ranks (--ep %d)", c->ep, world, world);
    mst_ep_config e = {.struct_size = sizeof(mst_ep_config), .n_experts = c->experts, .top_k = c->top_k, .hidden = c->hidden,
                       .max_tokens = c->batch * c->seq, .max_rows = mst_model_max_rows(c, world)};
    *out = e; /* pair_rows 0: N k, which no routing passes; path auto */
    return MST_OK;
}

/* ---- buffers ------------------------------------------------------------- */

/* A backend buffer of category cat, owned by the model (freed by destroy). */
static mst_status buf(mst_model* m, int cat, size_t n_bytes, void* out) {
    if (m->n_owned == m->cap_owned) {
        int cap = m->cap_owned ? 2 * m->cap_owned : 64;
        void** o = (void**)realloc(m->owned, sizeof *o * (size_t)cap);
        if (!o) return mst_set_error(MST_ERR_OOM, "model buffer table");
        m->owned = o;
        m->cap_owned = cap;
    }
    MST_TRY(mst_alloc(m->ctx, n_bytes, (void**)out));
    m->owned[m->n_owned++] = *(void**)out;
    m->mem[cat] += n_bytes;
    return MST_OK;
}

static void unbuf(mst_model* m, int cat, void* ptr, size_t n_bytes) {
    for (int i = 0; i < m->n_owned; i++)
        if (m->owned[i] == ptr) {
            m->owned[i] = m->owned[--m->n_owned];
            mst_free(m->ctx, ptr);
            m->mem[cat] -= n_bytes;
            return;
        }
}

#define BUF(cat, ptr, count) MST_TRY(buf(m, cat, sizeof(*(ptr)) * (size_t)(count), &(ptr)))

static mst_status alloc_params(mst_model* m) {
    const int64_t n = m->n_params, ns = m->n_state;
    BUF(MST_MEM_WEIGHTS, m->w, n);
    BUF(MST_MEM_GRADS, m->grad, n);
    BUF(MST_MEM_OPTIM, m->master, ns);
    const size_t mom = mst_optim_state_elem(m, 1) * (size_t)ns;
    MST_TRY(buf(m, MST_MEM_OPTIM, mom, &m->adam_m));
    MST_TRY(buf(m, MST_MEM_OPTIM, mom, &m->adam_v));
    BUF(MST_MEM_COMPUTE, m->gsumsq, 1);
    BUF(MST_MEM_COMPUTE, m->gpartial, MST_SUMSQ_PARTS);
    if (m->stages > 1 && m->cfg.tie_embeddings && !m->n_tied) BUF(MST_MEM_GRADS, m->tied_zero, m->cfg.vocab * m->cfg.hidden);
    float* host = (float*)malloc(sizeof(float) * (size_t)n);
    uint16_t* host16 = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)n);
    mst_status st = host && host16 ? MST_OK : mst_set_error(MST_ERR_OOM, "host parameter init (%lld)", (long long)n);
    if (st == MST_OK) {
        mst_model_init_params(m, host);
        mst_fp32_to_bf16_array(host16, host, (size_t)n);
        for (int64_t i = 0; i < n; i++) host[i] = mst_bf16_to_fp32(host16[i]); /* master = weights */
        st = mst_fill(m->ctx, m->master, 0, sizeof(float) * (size_t)ns);
        if (st == MST_OK) st = mst_optim_state_put(m, 0, 0, n, host);
    }
    if (st == MST_OK) st = mst_copy_h2b(m->ctx, m->w, host16, sizeof(uint16_t) * (size_t)n);
    if (st == MST_OK) st = mst_fill(m->ctx, m->adam_m, 0, mom);
    if (st == MST_OK) st = mst_fill(m->ctx, m->adam_v, 0, mom);
    free(host);
    free(host16);
    return st;
}

/* One activation buffer: counted into the KEEP reference (as kept) when
 * `ref`; allocated in category cat when `own`, else taken from `from`. */
#define ACT(cat, dst, from, field, count, own, ref)                                \
    do {                                                                           \
        const size_t nb_ = sizeof(*(dst)->field) * (size_t)(count);                \
        if (ref) m->mem_keep[cat] += nb_;                                          \
        if (own) MST_TRY(buf(m, cat, nb_, &(dst)->field));                         \
        else (dst)->field = (from)->field;                                         \
    } while (0)

/* q|k|v row of the attention projection: (NH + 2 KV) D. */
static int64_t qkv_cols(const mst_model_config* c) { return (c->n_head + 2 * c->n_kv_head) * c->head_dim; }

/* A layer's activations: its own buffers (slot NULL), or the recompute
 * slot's, but for the output when keep_out (the input of the next chunk).
 * cats: attention, norms, router categories. ref: count as kept. loads:
 * the router loads [L+1, E] of the activation set (row l this layer's: the
 * main layers' loss spans rows [0, L), the MTP layer's its own row L), or
 * NULL (a recompute slot). */
static mst_status alloc_layer(mst_model* m, mst_layer_acts* a, const mst_layer_acts* slot, int keep_out,
                              const int cats[3], int ref, int32_t* loads, int32_t l) {
    const mst_model_config* c = &m->cfg;
    const int64_t N = c->batch * c->seq, H = c->hidden, E = c->experts, K = c->top_k;
    const int64_t rows = c->batch * c->n_head * c->seq, HO = c->n_head * c->head_dim;
    const int own = slot == NULL, A = cats[0], R = cats[2], Nm = cats[1];
    ACT(Nm, a, slot, a, N * H, own, ref);
    ACT(Nm, a, slot, rstd1, N, own, ref);
    ACT(A, a, slot, qkv, N * qkv_cols(c), own, ref);
    ACT(A, a, slot, rstdqk, N * (c->n_head + c->n_kv_head), own, ref);
    if (mst_attn_is_flash(m->attn)) ACT(A, a, slot, lse, rows, own, ref);
    else ACT(A, a, slot, attp, rows * c->seq, own, ref);
    ACT(A, a, slot, att, N * HO, own, ref);
    ACT(Nm, a, slot, x1, N * H, own, ref);
    ACT(Nm, a, slot, b, N * H, own, ref);
    ACT(Nm, a, slot, rstd2, N, own, ref);
    ACT(R, a, slot, rlogits, N * E, own, ref);
    ACT(R, a, slot, rprobs, N * E, own, ref);
    ACT(R, a, slot, topk_idx, N * K, own, ref);
    ACT(R, a, slot, topk_w, N * K, own, ref);
    ACT(R, a, slot, pos, N * K, own, ref);
    ACT(R, a, slot, counts, E, own, ref);
    if (loads) {
        a->load = loads + (int64_t)l * E;
        a->loads = l < c->layers ? loads : a->load;
        a->n_loads = l < c->layers ? c->layers : 1;
    } else { /* a recompute slot: the loads stay in the activation set */
        a->load = NULL;
        a->loads = NULL;
        a->n_loads = 0;
    }
    ACT(R, a, slot, aux, 1, own, ref);
    ACT(Nm, a, slot, out, N * H, own || keep_out, ref);
    return MST_OK;
}

/* The MTP module's activations besides its layer: e1 (the next tokens'
 * embedding, one of its two inputs) its own; the rest its own, or the
 * shared slot's when the module is recomputed. is_slot: u is that slot
 * (no e1; category RECOMPUTE, not in the KEEP reference). */
static mst_status alloc_mtp(mst_model* m, mst_micro* u, const mst_micro* slot, int is_slot) {
    const mst_model_config* c = &m->cfg;
    const int64_t N = c->batch * c->seq, H = c->hidden, V = c->vocab;
    const int P = is_slot ? MST_MEM_RECOMPUTE : MST_MEM_SAVED_MTP, own = slot == NULL, ref = !is_slot;
    if (!is_slot) ACT(MST_MEM_SAVED_MTP, u, u, e1, N * H, 1, 1);
    ACT(P, u, slot, ne, N * H, own, ref);
    ACT(P, u, slot, nh, N * H, own, ref);
    ACT(P, u, slot, rstd_e, N, own, ref);
    ACT(P, u, slot, rstd_h, N, own, ref);
    ACT(P, u, slot, p, N * H, own, ref);
    ACT(P, u, slot, mf, N * H, own, ref);
    ACT(P, u, slot, rstd_mf, N, own, ref);
    ACT(P, u, slot, dl_mtp, N * V, own, ref);
    return MST_OK;
}
#undef ACT

static int recomputed(const mst_model* m, int32_t l) { return mst_model_here(m, l) && m->full && m->chunk_start[l] >= 0; }

/* Layer l's output is kept when it is the input of a later chunk or of the
 * MTP module and heads (layer L-1); a recomputed MTP layer's output is rerun. */
static int keeps_out(const mst_model* m, int32_t l) {
    const int32_t L = m->cfg.layers;
    return l < L && (l == L - 1 || m->chunk_start[l + 1] != m->chunk_start[l]);
}

static mst_status alloc_micro(mst_model* m, mst_micro* u) {
    const mst_model_config* c = &m->cfg;
    const int64_t N = c->batch * c->seq, H = c->hidden, V = c->vocab;
    const int32_t L = c->layers;
    u->acts = (mst_layer_acts*)calloc((size_t)L + 1, sizeof *u->acts);
    if (!u->acts) return mst_set_error(MST_ERR_OOM, "layer table");
    /* the loads: a few bytes a layer that every layer keeps, recomputed or
     * not (compute, as u->dh) */
    BUF(MST_MEM_COMPUTE, u->loads, (L + 1) * c->experts);
    for (int32_t l = 0; l <= L; l++) {
        const int kinds[3] = {MST_MEM_SAVED_ATTN, MST_MEM_SAVED_NORM, MST_MEM_SAVED_ROUTER};
        const int mtp[3] = {MST_MEM_SAVED_MTP, MST_MEM_SAVED_MTP, MST_MEM_SAVED_MTP};
        if (!mst_model_here(m, l)) continue;
        const mst_layer_acts* slot = recomputed(m, l) ? &m->slots[l - m->chunk_start[l]] : NULL;
        MST_TRY(alloc_layer(m, &u->acts[l], slot, slot && keeps_out(m, l), l == L ? mtp : kinds, 1, u->loads, l));
        if (m->dist.ep) MST_TRY(mst_ep_handle_create(m->dist.ep, &u->acts[l].eph));
    }
    const int S = MST_MEM_SAVED_HEAD, first = m->stage == 0, last = m->stage == m->stages - 1;
    for (int32_t c = 0; c < m->mem_cfg.virtual_stages; c++) { /* each chunk's input from another stage (received) */
        const int32_t r = mst_stage_received(m, c);
        if (r < 0) continue;
        BUF(MST_MEM_SAVED_NORM, u->acts[r].out, N * H);
        m->mem_keep[MST_MEM_SAVED_NORM] += sizeof(uint16_t) * (size_t)(N * H);
    }
    if (first) BUF(S, u->x0, N * H);
    if (last) {
        BUF(S, u->xf, N * H);
        BUF(S, u->rstdf, N);
        BUF(S, u->dl_main, N * V);
    }
    m->mem_keep[S] += sizeof(uint16_t) * ((first + last) * N * H + last * N * V) + sizeof(float) * last * N;
    if (last) MST_TRY(alloc_mtp(m, u, recomputed(m, L) ? &m->mtp_slot : NULL, 0));
    else { /* made on stage 0, passed on to the last */
        BUF(MST_MEM_SAVED_MTP, u->e1, N * H);
        m->mem_keep[MST_MEM_SAVED_MTP] += sizeof(uint16_t) * (size_t)(N * H);
    }
    BUF(MST_MEM_COMPUTE, u->dh, N * H);
    if (m->stages > 1) { /* the backward message's own buffers (stage.c) */
        BUF(MST_MEM_COMPUTE, u->de1, N * H);
        BUF(MST_MEM_COMPUTE, u->loads_bwd, (L + 1) * c->experts);
    }
    return MST_OK;
}

/* The static inputs (tokens of every microbatch, then the AdamW values),
 * their two host staging copies (pinned), and the record. */
static mst_status alloc_inputs(mst_model* m) {
    const int64_t N = m->cfg.batch * m->cfg.seq, tok = (int64_t)m->n_micro * 3 * N;
    m->inputs_bytes = sizeof(int32_t) * (size_t)tok + sizeof(float) * MST_N_HYPER;
    MST_TRY(buf(m, MST_MEM_COMPUTE, m->inputs_bytes, &m->inputs));
    m->hyper = (float*)((int32_t*)m->inputs + tok);
    for (int32_t mb = 0; mb < m->n_micro; mb++) m->micro[mb].tok = (int32_t*)m->inputs + mb * 3 * N;
    for (int k = 0; k < 2; k++) {
        if (!m->ctx->be->host_alloc)
            return mst_set_error(MST_ERR_UNSUPPORTED, "backend %s has no host_alloc", m->ctx->be->name);
        MST_TRY(m->ctx->be->host_alloc(m->ctx, m->inputs_bytes, &m->staging[k]));
    }
    return buf(m, MST_MEM_COMPUTE, sizeof(mst_step_record), &m->record);
}

/* The recompute plan of the L+1 layers (the memory manager's, which keeps
 * chunks inside schedule chunks) and the shared slots recomputed layers run
 * in: as many as the longest chunk, and one MTP module when layer L is
 * recomputed. */
static mst_status alloc_slots(mst_model* m) {
    const int32_t L1 = m->cfg.layers + 1;
    m->chunk_start = (int32_t*)malloc(sizeof(int32_t) * (size_t)L1);
    if (!m->chunk_start) return mst_set_error(MST_ERR_OOM, "recompute plan");
    m->full = m->mem_cfg.recompute_full;
    m->n_slots = 0;
    for (int32_t l = 0; l < L1; l++) { /* the manager's plan is over the stage's layers */
        const int32_t cs = mst_model_here(m, l) ? mst_memmgr_recompute_chunk(m->mm_static, mst_model_local(m, l)) : -1;
        m->chunk_start[l] = cs < 0 ? -1 : mst_model_global(m, cs);
        if (recomputed(m, l) && l - m->chunk_start[l] + 1 > m->n_slots) m->n_slots = l - m->chunk_start[l] + 1;
    }
    m->slots = (mst_layer_acts*)calloc((size_t)(m->n_slots > 0 ? m->n_slots : 1), sizeof *m->slots);
    if (!m->slots) return mst_set_error(MST_ERR_OOM, "recompute slots");
    const int rc[3] = {MST_MEM_RECOMPUTE, MST_MEM_RECOMPUTE, MST_MEM_RECOMPUTE};
    for (int32_t k = 0; k < m->n_slots; k++) MST_TRY(alloc_layer(m, &m->slots[k], NULL, 0, rc, 0, NULL, 0));
    if (recomputed(m, L1 - 1)) MST_TRY(alloc_mtp(m, &m->mtp_slot, NULL, 1));
    return MST_OK;
}

static mst_status alloc_acts(mst_model* m) {
    const mst_model_config* c = &m->cfg;
    const int64_t N = c->batch * c->seq, H = c->hidden, V = c->vocab, M = m->n_micro;
    MST_TRY(alloc_slots(m));
    m->micro = (mst_micro*)calloc((size_t)M, sizeof *m->micro);
    int32_t* set_of = (int32_t*)calloc((size_t)M, sizeof(int32_t));
    if (!m->micro || !set_of) {
        free(set_of);
        return mst_set_error(MST_ERR_OOM, "microbatch table");
    }
    mst_status st = mst_schedule_sets(m->sched, m->n_sched, m->n_micro, set_of, &m->n_sets);
    m->sets = st == MST_OK ? (mst_micro*)calloc((size_t)m->n_sets, sizeof *m->sets) : NULL;
    if (st == MST_OK && !m->sets) st = mst_set_error(MST_ERR_OOM, "activation sets");
    for (int32_t s = 0; s < m->n_sets && st == MST_OK; s++) st = alloc_micro(m, &m->sets[s]);
    for (int64_t mb = 0; mb < M && m->sets; mb++) m->micro[mb] = m->sets[set_of[mb]];
    free(set_of);
    MST_TRY(st);
    MST_TRY(alloc_inputs(m));
    const int C = MST_MEM_COMPUTE;
    BUF(C, m->peak, (c->layers + 1) * c->ep);
    MST_TRY(mst_fill(m->ctx, m->peak, 0, sizeof(int32_t) * (size_t)((c->layers + 1) * c->ep)));
    if (m->dist.ep || m->dist.pipe) BUF(C, m->needs, MST_MODEL_NEEDS);
    if (m->dist.ep) {
        BUF(C, m->peak_local, 1);
        BUF(C, m->gnorm_rows, m->dist.world * MST_GNORM_COLS);
    }
    if (m->stage == m->stages - 1) BUF(C, m->logits, N * V);
    BUF(C, m->loss_main, M * N);
    BUF(C, m->loss_mtp, M * N);
    BUF(C, m->aux_sum, M * (c->layers + 1));
    /* a stage writes its own losses only: the others' stay 0 in the sums */
    MST_TRY(mst_fill(m->ctx, m->loss_main, 0, sizeof(float) * (size_t)(M * N)));
    MST_TRY(mst_fill(m->ctx, m->loss_mtp, 0, sizeof(float) * (size_t)(M * N)));
    MST_TRY(mst_fill(m->ctx, m->aux_sum, 0, sizeof(float) * (size_t)(M * (c->layers + 1))));
    BUF(C, m->dtopk, N * c->top_k);
    BUF(C, m->drl, N * c->experts);
    if (m->stage == 0) BUF(C, m->emb_order, mst_embed_order_len(N));
    BUF(C, m->qkvr, N * qkv_cols(c));
    BUF(C, m->dqkv, N * qkv_cols(c));
    BUF(C, m->datt, N * c->n_head * c->head_dim);
    if (mst_attn_is_flash(m->attn)) BUF(C, m->att_delta, c->batch * c->n_head * c->seq);
    else if (m->ops->attn_scratch) {
        BUF(C, m->att32, c->batch * c->n_head * c->seq * c->seq);
        BUF(C, m->att16, c->batch * c->n_head * c->seq * c->seq);
    }
    BUF(C, m->dm, N * H);
    BUF(C, m->t1, N * H);
    BUF(C, m->t2, N * H);
    BUF(C, m->t3, N * H);
    return MST_OK;
}

/* Whether the backend runs the flash contract by implementation k (FLASH:
 * our kernels, CUDNN: cuDNN's, which builds its plans in the check): MST_OK,
 * or the reason. */
static mst_status attn_takes(mst_ctx_t* ctx, const mst_model_backend* ops, int32_t k, const mst_attn_args* a) {
    const int cudnn = k == MST_ATTN_CUDNN;
    if (cudnn ? !ops->attn_cudnn_forward || !ops->attn_cudnn_backward
              : !ops->attn_flash_forward || !ops->attn_flash_backward)
        return mst_set_error(MST_ERR_UNSUPPORTED, "backend %s has no %s attention", ops->name,
                             cudnn ? "cuDNN" : "flash");
    mst_status (*check)(mst_ctx_t*, const mst_attn_args*) = cudnn ? ops->attn_cudnn_check : ops->attn_flash_check;
    return check ? check(ctx, a) : MST_OK;
}

mst_status mst_model_attention(mst_ctx_t* ctx, const mst_model_config* c, int32_t* kind, char* note, size_t note_size) {
    const mst_model_backend* ops;
    MST_TRY(mst_model_backend_of(ctx, &ops));
    const mst_attn_args a = {.batch = c->batch, .seq = c->seq, .n_head = c->n_head, .head_dim = c->head_dim,
                             .n_kv_head = c->n_kv_head};
    *kind = MST_ATTN_CUBLAS;
    if (note_size) note[0] = 0;
    if (c->attention == MST_ATTN_CUBLAS) return MST_OK;
    /* AUTO: cuDNN where the backend has it and it takes the dims, else
     * flash, else the probabilities; each refusal in the note */
    char cudnn_why[400] = "", why[400];
    if (c->attention == MST_ATTN_AUTO && ops->attn_cudnn_forward) {
        if (attn_takes(ctx, ops, MST_ATTN_CUDNN, &a) == MST_OK) {
            *kind = MST_ATTN_CUDNN;
            return MST_OK;
        }
        snprintf(cudnn_why, sizeof cudnn_why, "%s", mst_last_error());
    }
    const int32_t want = c->attention == MST_ATTN_CUDNN ? MST_ATTN_CUDNN : MST_ATTN_FLASH;
    mst_status st = attn_takes(ctx, ops, want, &a);
    if (st == MST_OK) {
        *kind = want;
        if (cudnn_why[0] && note_size) snprintf(note, note_size, "attention: flash, not cuDNN (%s)", cudnn_why);
        return MST_OK;
    }
    snprintf(why, sizeof why, "%s", mst_last_error());
    if (c->attention != MST_ATTN_AUTO) return mst_set_error(st, "--attention %s: %s", mst_attn_kind_str(want), why);
    if (note_size)
        snprintf(note, note_size, "attention: the probabilities path (%s%s%s)", why, cudnn_why[0] ? "; cuDNN: " : "",
                 cudnn_why);
    return MST_OK;
}

/* ---- memory manager and schedule ------------------------------------------ */

static mst_status make_schedule(mst_model* m) {
    const mst_mem_config* mc = &m->mem_cfg;
    const int32_t L1 = m->n_here, V = mc->virtual_stages;
    if (V < 1 || (V > 1 && (m->cfg.layers + 1) % (V * m->stages)))
        return BAD("--schedule %s: %d chunks do not divide the %d layers (--layers + the MTP layer)",
                   mst_schedule_kind_str(mc->schedule), V * m->stages, m->cfg.layers + 1);
    mst_schedule_config sc = {.struct_size = sizeof sc, .kind = mc->schedule, .stages = m->stages, .rank = m->stage,
                              .microbatches = m->n_micro, .virtual_stages = V};
    m->n_sched = 2 * m->n_micro * V;
    m->layers_per_chunk = L1 / V;
    m->sched = (mst_sched_entry*)malloc(sizeof *m->sched * (size_t)m->n_sched);
    if (!m->sched) return mst_set_error(MST_ERR_OOM, "schedule");
    return mst_schedule_make(&sc, m->sched, m->n_sched);
}

/* The recompute plan of the L+1 layers: --recompute's over every layer (the
 * MTP layer L counts as the stage's last), and layer L a chunk of its own
 * under --recompute-mtp when the plan leaves it kept. */
static mst_status set_plan(mst_model* m, mst_memmgr_t* mm) {
    const int32_t L1 = m->n_here; /* the stage's layers: the MTP layer last on the last stage */
    int32_t* plan = (int32_t*)malloc(sizeof(int32_t) * (size_t)L1);
    if (!plan) return mst_set_error(MST_ERR_OOM, "recompute plan");
    mst_status st = mst_recompute_plan(&m->mem_cfg.recompute, L1, plan);
    if (st == MST_OK && m->mem_cfg.recompute_mtp && m->stage == m->stages - 1 && plan[L1 - 1] < 0) plan[L1 - 1] = L1 - 1;
    if (st == MST_OK) st = mst_memmgr_set_recompute_plan(mm, plan);
    free(plan);
    return st;
}

/* The memory-budget planner's recompute plan (over the L+1 layers): the
 * stage's part of it. */
static mst_status set_budget_plan(mst_model* m, mst_memmgr_t* mm) {
    int32_t* plan = (int32_t*)malloc(sizeof(int32_t) * (size_t)m->n_here);
    if (!plan) return mst_set_error(MST_ERR_OOM, "recompute plan");
    mst_status st = mst_stage_local_plan(m, m->mem_cfg.chunk_start, plan);
    if (st == MST_OK) st = mst_memmgr_set_recompute_plan(mm, plan);
    free(plan);
    return st;
}

/* The policy of every (layer, name), from the run's typed policies. */
static mst_status set_policies(mst_model* m, mst_memmgr_t* mm) {
    for (int32_t i = 0; i < m->n_here; i++)
        for (int n = 0; n < MST_N_SAVED; n++)
            MST_TRY(mst_memmgr_set_policy(mm, i, (mst_saved_name)n,
                                          mst_policies_at(&m->mem_cfg.policy, mst_model_global(m, i), (mst_saved_name)n)));
    return MST_OK;
}

/* mst_memmgr_config.share_needs on W ranks: every rank sizes its pools for
 * the largest need any rank measured (a rank's rows change from step to
 * step; its own peak alone left each rank to overflow in its turn). */
static mst_status share_needs(void* user, int64_t* needs, int32_t n) {
    mst_model* m = (mst_model*)user;
    double v[MST_MODEL_NEEDS];
    MST_ASSERT(n <= MST_MODEL_NEEDS && m->needs);
    for (int32_t i = 0; i < n; i++) v[i] = (double)needs[i];
    MST_TRY(mst_copy_h2b(m->ctx, m->needs, v, sizeof(double) * (size_t)n)); /* m->needs: no allocation mid-step */
    MST_TRY(mst_model_allreduce(m, m->needs, n, MST_EP_MAX_F64));
    MST_TRY(mst_copy_b2h(m->ctx, v, m->needs, sizeof(double) * (size_t)n));
    for (int32_t i = 0; i < n; i++) needs[i] = (int64_t)v[i];
    return MST_OK;
}

/* A manager for rows of R per group (G R in all), with the run's policies. */
static mst_status make_memmgr(mst_model* m, int64_t R, mst_memmgr_t** out) {
    const mst_model_config* c = &m->cfg;
    mst_memmgr_config mc = {.struct_size = sizeof mc, .n_layers = m->n_here, .n_microbatches = m->n_micro,
                            .virtual_stages = m->mem_cfg.virtual_stages, .max_rows = R * m->row_groups,
                            .hidden = c->hidden, .ffn = c->ffn, .schedule = m->sched,
                            .n_schedule = m->n_sched, .page_rows = 64,
                            .dev_factor = m->mem_cfg.pool_factor, .host_factor = 0.0,
                            .share_needs = m->dist.ep && !m->mem_cfg.own_needs ? share_needs : NULL,
                            .share_user = m};
    MST_TRY(mst_memmgr_create(m->ctx, &mc, out));
    const mst_recompute_config* rc = &m->mem_cfg.recompute;
    char where[64] = "policy"; /* what an error comes from */
    mst_status st = set_policies(m, *out);
    if (st == MST_OK && (rc->method != MST_RECOMPUTE_NONE || m->mem_cfg.recompute_mtp)) {
        if (rc->method == MST_RECOMPUTE_NONE) snprintf(where, sizeof where, "--recompute 'none'");
        else snprintf(where, sizeof where, "--recompute '%s:%d'", rc->method == MST_RECOMPUTE_UNIFORM ? "uniform" : "block",
                      rc->num_layers);
        st = set_plan(m, *out);
    }
    if (st == MST_OK && m->mem_cfg.chunk_start) {
        snprintf(where, sizeof where, "--memory-budget's recompute plan");
        st = set_budget_plan(m, *out);
    }
    if (st != MST_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", mst_last_error());
        mst_memmgr_destroy(*out);
        *out = NULL;
        return mst_set_error(st, "%s: %s", where, why);
    }
    return MST_OK;
}

/* ---- grouped rows: the part that depends on R ------------------------------ */

static void free_rows(mst_model* m) {
    const size_t hb = (size_t)(m->max_rows * m->row_groups * m->cfg.hidden) * sizeof(uint16_t);
    unbuf(m, MST_MEM_COMPUTE, m->yrows, hb);
    unbuf(m, MST_MEM_COMPUTE, m->drows, hb);
    unbuf(m, MST_MEM_COMPUTE, m->dxrows, hb);
    unbuf(m, MST_MEM_COMPUTE, m->dprow, (size_t)(m->max_rows * m->row_groups) * sizeof(float));
    m->yrows = m->drows = m->dxrows = NULL;
    m->dprow = NULL;
    if (m->mm != m->mm_static) mst_memmgr_destroy(m->mm);
    m->mm = NULL;
    m->max_rows = 0;
}

mst_status mst_model_set_max_rows(mst_model* m, int64_t R) {
    if (R == m->max_rows) return MST_OK;
    if (R < 1 || R > INT32_MAX / m->row_groups) return BAD("max_rows %lld per group", (long long)R);
    mst_step_drop_graph(m); /* it points at the rows and the manager */
    if (m->dist.ep) MST_TRY(mst_ep_set_max_rows(m->dist.ep, R));
    if (m->max_rows > 0) free_rows(m);
    const int64_t GR = R * m->row_groups, H = m->cfg.hidden;
    const int C = MST_MEM_COMPUTE;
    BUF(C, m->yrows, GR * H);
    BUF(C, m->drows, GR * H);
    BUF(C, m->dxrows, GR * H);
    BUF(C, m->dprow, GR);
    if (R == m->static_rows && !m->mm_static) MST_TRY(make_memmgr(m, R, &m->mm_static));
    if (R == m->static_rows) m->mm = m->mm_static;
    else MST_TRY(make_memmgr(m, R, &m->mm));
    m->max_rows = R;
    return MST_OK;
}

mst_status mst_model_create(mst_ctx_t* ctx, const mst_model_config* cfg, int32_t n_micro,
                            const mst_mem_config* mem, mst_model** out) {
    return mst_model_create_dist(ctx, cfg, n_micro, mem, NULL, out);
}

mst_status mst_model_create_dist(mst_ctx_t* ctx, const mst_model_config* cfg, int32_t n_micro,
                                 const mst_mem_config* mem, const mst_dist* dist, mst_model** out) {
    const mst_model_backend* ops;
    MST_TRY(mst_model_backend_of(ctx, &ops));
    MST_TRY(mst_model_config_check(cfg));
    if (n_micro < 1 || n_micro > 4096) return BAD("--microbatches %d: expected 1 .. 4096", n_micro);
    const mst_mem_config mc = mem ? *mem : mst_mem_config_default();
    mst_dist d;
    MST_TRY(mst_model_dist_check(cfg, &mc, dist, &d));
    mst_model* m = (mst_model*)calloc(1, sizeof *m);
    if (!m) return mst_set_error(MST_ERR_OOM, "model");
    m->ctx = ctx;
    m->ops = ops;
    m->cfg = *cfg;
    m->dist = d;
    m->mem_cfg = mc;
    mst_model_set_stage(m, d.stage, d.stages);
    m->n_local = cfg->experts / d.world;
    m->row_groups = d.ep ? 1 : cfg->ep;
    m->n_micro = n_micro;
    if (m->mem_cfg.recompute_mtp && !(cfg->mtp_weight > 0.0f)) {
        free(m);
        return BAD("--recompute-mtp: the model has no MTP module (--mtp-weight %g)", (double)cfg->mtp_weight);
    }
    m->static_rows = mst_model_max_rows(cfg, d.world);
    m->lp = (mst_layer_params*)calloc((size_t)cfg->layers + 1, sizeof *m->lp);
    mst_status st = m->lp ? MST_OK : mst_set_error(MST_ERR_OOM, "layer parameter table");
    if (st == MST_OK) st = mst_model_attention(ctx, cfg, &m->attn, m->attn_note, sizeof m->attn_note);
    if (st == MST_OK) st = make_schedule(m);
    if (st == MST_OK) {
        mst_model_layout(m);
        mst_optim_layout(m);
        st = alloc_params(m);
    }
    if (st == MST_OK) st = mst_model_set_max_rows(m, m->static_rows); /* the manager: the recompute plan */
    if (st == MST_OK) st = alloc_acts(m);
    if (st == MST_OK) st = mst_overlap_create(m);
    if (st != MST_OK) {
        mst_model_destroy(m);
        return st;
    }
    *out = m;
    return MST_OK;
}

void mst_model_destroy(mst_model* m) {
    if (!m) return;
    mst_step_drop_graph(m);
    mst_overlap_destroy(m);
    for (int k = 0; k < 2; k++)
        if (m->staging[k]) m->ctx->be->host_free(m->ctx, m->staging[k]);
    if (m->mm != m->mm_static) mst_memmgr_destroy(m->mm);
    mst_memmgr_destroy(m->mm_static);
    for (int32_t k = 0; m->sets && k < m->n_sets; k++) {
        for (int32_t l = 0; m->sets[k].acts && l <= m->cfg.layers; l++) mst_ep_handle_destroy(m->sets[k].acts[l].eph);
        free(m->sets[k].acts);
    }
    free(m->sets);
    for (int i = 0; i < m->n_owned; i++) mst_free(m->ctx, m->owned[i]);
    free(m->owned);
    free(m->micro);
    free(m->sched);
    free(m->lp);
    free(m->chunk_start);
    free(m->slots);
    free(m);
}

mst_status mst_model_peak_rows(mst_model* m, int32_t* peak) {
    return mst_copy_b2h(m->ctx, peak, m->peak, sizeof(int32_t) * (size_t)((m->cfg.layers + 1) * m->cfg.ep));
}
