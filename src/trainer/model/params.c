/*
 * params.c — the model's configuration checks, its parameters' layout in
 * the flat buffers and their initialisation (as transformers initialises a
 * Qwen3-MoE model: every matrix normal(0, init_std), every norm weight 1),
 * and the lower bound of its memory.
 */
#include <math.h>

#include "lib/internal.h"
#include "model.h"

#define BAD(...) mst_set_error(MST_ERR_INVALID, __VA_ARGS__)

static mst_status check_attention(const mst_model_config* c) {
    if (c->n_head < 1 || c->n_head > 1024) return BAD("--heads %lld: expected 1 .. 1024", (long long)c->n_head);
    if (c->n_kv_head < 1 || c->n_head % c->n_kv_head)
        return BAD("--kv-heads %lld: must divide --heads %lld", (long long)c->n_kv_head, (long long)c->n_head);
    if (c->head_dim < 2 || c->head_dim > 1024 || c->head_dim % 2)
        return BAD("--head-dim %lld: expected an even number 2 .. 1024", (long long)c->head_dim);
    if (!(c->rope_theta >= 1.0f) || !isfinite(c->rope_theta))
        return BAD("--rope-theta %g: expected >= 1", (double)c->rope_theta);
    return MST_OK;
}

mst_status mst_model_config_check(const mst_model_config* c) {
    if (c->vocab < 2 || c->vocab > (1 << 24)) return BAD("--vocab %lld: expected 2 .. %d", (long long)c->vocab, 1 << 24);
    if (c->hidden < 8 || c->hidden > 65536) return BAD("--hidden %lld: expected 8 .. 65536", (long long)c->hidden);
    if (c->ffn < 1 || c->ffn > 262144) return BAD("--ffn %lld: expected 1 .. 262144", (long long)c->ffn);
    MST_TRY(check_attention(c));
    if (c->norm_topk_prob < 0 || c->norm_topk_prob > 1)
        return BAD("--norm-topk-prob %d: expected on or off", c->norm_topk_prob);
    if (c->tie_embeddings < 0 || c->tie_embeddings > 1)
        return BAD("--tie-embeddings %d: expected on or off", c->tie_embeddings);
    if (c->seq < 2 || c->seq > 8192) return BAD("--seq %lld: expected 2 .. 8192", (long long)c->seq);
    if (c->batch < 1 || c->batch > 65536) return BAD("--batch %lld: expected 1 .. 65536", (long long)c->batch);
    if (c->layers < 1 || c->layers > 256) return BAD("--layers %d: expected 1 .. 256", c->layers);
    if (c->experts < 1 || c->experts > 1024) return BAD("--experts %d: expected 1 .. 1024", c->experts);
    if (c->top_k < 1 || c->top_k > c->experts)
        return BAD("--top-k %d: expected 1 .. --experts (%d)", c->top_k, c->experts);
    if (c->ep < 1 || c->experts % c->ep)
        return BAD("--ep %d: must divide --experts %d", c->ep, c->experts);
    if (!(c->capacity_factor > 0.0f) || c->capacity_factor > 1024.0f)
        return BAD("--capacity-factor %g: expected > 0 and <= 1024", (double)c->capacity_factor);
    if (!(c->mtp_weight >= 0.0f) || c->mtp_weight > 100.0f)
        return BAD("--mtp-weight %g: expected 0 .. 100", (double)c->mtp_weight);
    if (c->attention < MST_ATTN_AUTO || c->attention > MST_ATTN_CUDNN)
        return BAD("--attention %d: expected auto, flash, cublas or cudnn", c->attention);
    if (c->batch * c->seq * c->top_k > INT32_MAX / 4)
        return BAD("--batch %lld x --seq %lld: too many tokens", (long long)c->batch, (long long)c->seq);
    return MST_OK;
}

/* ---- layout ---------------------------------------------------------------- */

static int64_t take(int64_t* n, int64_t size) {
    int64_t off = *n;
    *n += size;
    return off;
}

/* Matrices first (weight decay), then the norm weights. On W ranks the
 * matrices every rank holds come first and this rank's El experts after
 * them, so that the replicated gradients are two runs: [0, n_dense) and
 * the norm weights. An untied head follows the embedding. On a pipeline
 * stage only what the stage holds (stage.c): the embedding first (stage
 * 0; the last stage's copy of a tied table too), the head, the MTP module
 * and the final norms on the last stage, the stage's layers; every offset
 * of what is elsewhere is -1. */
void mst_model_layout(mst_model* m) {
    const mst_model_config* c = &m->cfg;
    const int64_t H = c->hidden, F = c->ffn, E = c->experts, El = m->n_local, D = c->head_dim;
    const int64_t Wq = (c->n_head + 2 * c->n_kv_head) * D, HO = c->n_head * D;
    const int apart = m->dist.ep != NULL, first = m->stage == 0, last = m->stage == m->stages - 1;
    int64_t n = 0;
    m->emb = first || (last && c->tie_embeddings) ? take(&n, c->vocab * H) : -1;
    m->n_tied = m->stages > 1 && c->tie_embeddings && m->emb >= 0 ? c->vocab * H : 0;
    m->head = c->tie_embeddings ? (last ? m->emb : -1) : last ? take(&n, c->vocab * H) : -1;
    m->proj = last ? take(&n, H * 2 * H) : -1;
    for (int32_t l = 0; l <= c->layers; l++) {
        mst_layer_params* p = &m->lp[l];
        if (!mst_model_here(m, l)) {
            *p = (mst_layer_params){-1, -1, -1, -1, -1, -1, -1, -1, -1};
            continue;
        }
        p->wqkv = take(&n, Wq * H);
        p->wo = take(&n, H * HO);
        p->wr = take(&n, E * H);
        if (apart) continue;
        p->w1 = take(&n, El * 2 * F * H);
        p->w2 = take(&n, El * H * F);
    }
    m->n_dense = n;
    for (int32_t l = 0; apart && l <= c->layers; l++) {
        if (!mst_model_here(m, l)) continue;
        m->lp[l].w1 = take(&n, El * 2 * F * H);
        m->lp[l].w2 = take(&n, El * H * F);
    }
    m->n_decay = n;
    for (int32_t l = 0; l <= c->layers; l++) {
        if (!mst_model_here(m, l)) continue;
        m->lp[l].ln1 = take(&n, H);
        m->lp[l].q_norm = take(&n, D);
        m->lp[l].k_norm = take(&n, D);
        m->lp[l].ln2 = take(&n, H);
    }
    m->lnf = last ? take(&n, H) : -1;
    m->ln_e = last ? take(&n, H) : -1;
    m->ln_h = last ? take(&n, H) : -1;
    m->ln_mf = last ? take(&n, H) : -1;
    m->n_params = n;
}

/* ---- initialisation ---------------------------------------------------------- */

/* Draw j of the splitmix64 stream from state s: the normal of counters
 * 2j + 1 and 2j + 2 (Box-Muller), so that draws can be made in any order
 * (in parallel) with the bits of a sequential stream. */
static double normal_at(uint64_t s, int64_t j) {
    uint64_t z[2];
    for (int i = 0; i < 2; i++) z[i] = mst_splitmix64_at(s, (uint64_t)(2 * j + 1 + i));
    double u = ((double)(z[0] >> 11) + 0.5) * 0x1.0p-53, v = (double)(z[1] >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* p[i] = draw lo + i of the next n draws (i < count) times std; the state
 * moves past all n. */
static void fill_normal_part(float* p, int64_t n, int64_t lo, int64_t count, double std, uint64_t* s) {
    const uint64_t s0 = *s;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) p[i] = (float)(normal_at(s0, lo + i) * std);
    *s = s0 + (uint64_t)(2 * n) * MST_SPLITMIX_GAMMA;
}

static void fill_normal(float* p, int64_t n, double std, uint64_t* s) { fill_normal_part(p, n, 0, n, std, s); }

/* Draws n normals into p + off (scaled by std), or only moves the state
 * past them when off < 0 (a tensor of another stage). */
static void draw(float* p, int64_t off, int64_t n, double std, uint64_t* s) {
    if (off >= 0) fill_normal(p + off, n, std, s);
    else fill_normal_part(p, n, 0, 0, std, s);
}

/* Every matrix normal(0, init_std) (transformers' _init_weights for
 * Qwen3-MoE: linear layers, embedding, router, experts alike), norm weights
 * 1. On W ranks each rank draws the whole stream's positions of its
 * experts, and a pipeline stage those of its tensors: the weights of one
 * rank's run. */
void mst_model_init_params(const mst_model* m, float* p) {
    const mst_model_config* c = &m->cfg;
    const int64_t H = c->hidden, F = c->ffn, E = c->experts, El = m->n_local, e0 = (int64_t)m->dist.rank * El;
    const int64_t Wq = (c->n_head + 2 * c->n_kv_head) * c->head_dim, HO = c->n_head * c->head_dim;
    const double std = c->init_std;
    uint64_t s = c->seed * 0x2545F4914F6CDD1Dull + 1;
    draw(p, m->emb, c->vocab * H, std, &s);
    if (!c->tie_embeddings) draw(p, m->head, c->vocab * H, std, &s);
    draw(p, m->proj, 2 * H * H, std, &s);
    for (int32_t l = 0; l <= c->layers; l++) {
        const mst_layer_params* q = &m->lp[l];
        const int here = mst_model_here(m, l);
        draw(p, q->wqkv, Wq * H, std, &s);
        draw(p, q->wo, H * HO, std, &s);
        draw(p, q->wr, E * H, std, &s);
        fill_normal_part(here ? p + q->w1 : p, E * 2 * F * H, e0 * 2 * F * H, here ? El * 2 * F * H : 0, std, &s);
        fill_normal_part(here ? p + q->w2 : p, E * H * F, e0 * H * F, here ? El * H * F : 0, std, &s);
    }
    for (int64_t i = m->n_decay; i < m->n_params; i++) p[i] = 1.0f;
}

/* ---- memory bound ------------------------------------------------------------ */

/* The parameters of stage s of P with El experts a layer, as the model lays
 * them out. */
static mst_status stage_params(const mst_model_config* c, int32_t s, int32_t P, int32_t El, int64_t* n) {
    mst_model m = {.cfg = *c, .n_local = El};
    mst_model_set_stage(&m, s, P);
    m.lp = (mst_layer_params*)calloc((size_t)c->layers + 1, sizeof *m.lp);
    if (!m.lp) return mst_set_error(MST_ERR_OOM, "layer parameter table");
    mst_model_layout(&m);
    free(m.lp);
    *n = m.n_params;
    return MST_OK;
}

mst_status mst_model_bytes_at_least(const mst_model_config* c, int32_t moments_bf16, int32_t shard, int32_t pp,
                                    int32_t dp, double* total_bytes, double* params_bytes) {
    const int32_t P = pp > 1 ? pp : 1, ranks = dp > 1 && c->experts % dp == 0 ? dp : 1;
    const double state = 4 + (moments_bf16 ? 2 * 2 : 2 * 4); /* master, m and v a parameter */
    double most = 0; /* the largest stage's bytes (its experts over its data-parallel ranks) */
    for (int32_t s = 0; s < P; s++) {
        int64_t n = 0, rep = 0; /* the stage's parameters, and those without its experts */
        MST_TRY(stage_params(c, s, P, c->experts / ranks, &n));
        MST_TRY(stage_params(c, s, P, 0, &rep));
        /* ZeRO-1 shards the replicated tensors' state over the dp ranks; an
         * expert's stays whole on the one rank of its group that holds it */
        const double b = (double)n * (2 + 4) + (double)(n - rep) * state + (double)rep * state / (shard && dp > 1 ? dp : 1);
        most = b > most ? b : most;
    }
    *params_bytes = most; /* w, grad, and master, m, v */
    const double N = (double)c->batch * (double)c->seq, rows = N * (double)c->n_head, D = (double)c->head_dim;
    const double Wq = ((double)c->n_head + 2.0 * (double)c->n_kv_head) * D;
    /* qkv (bf16), QK-norm's rstd (fp32) and the output (bf16) with the
     * probabilities (fp32) or the row logsumexp (fp32) */
    const double common = 2.0 * N * Wq + 4.0 * N * (double)(c->n_head + c->n_kv_head) + 2.0 * rows * D;
    const double attn = common + (c->attention == MST_ATTN_CUBLAS ? 4.0 * rows * (double)c->seq : 4.0 * rows);
    *total_bytes = *params_bytes + attn + 6.0 * N * (double)c->vocab;
    return MST_OK;
}

/* ---- model FLOPs --------------------------------------------------------------- */

double mst_model_flops_per_token(const mst_model_config* c) {
    const double H = (double)c->hidden, F = (double)c->ffn, E = c->experts, k = c->top_k, V = (double)c->vocab;
    const double NH = (double)c->n_head, KV = (double)c->n_kv_head, D = (double)c->head_dim;
    const double T = (double)c->seq, L1 = c->layers + 1;
    const double attn_proj = (NH + 2 * KV) * D * H + H * NH * D;
    const double active = L1 * (attn_proj + E * H + k * 3 * F * H) + 2 * H * H + 2 * H * V;
    return 6 * active + 6 * T * NH * D * L1; /* causal attention: 6 T^2 NH D a layer and sequence, over T tokens */
}
