/*
 * sample.c — one-token-at-a-time inference of a Qwen3-MoE model directory
 * with a KV cache (sample.h).
 *
 * Shapes: V vocab, H hidden, F expert width, NH query heads, KV key-value
 * heads, D head dim, E experts, k top-k, P = max_tokens.
 */
#include "sample.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lib/internal.h"
#include "trainer/io/hf.h"

typedef struct layer_w {
    float *ln1, *ln2;      /* [H] input / post-attention RMSNorm            */
    float *wq, *wk, *wv;   /* [NH D, H] [KV D, H] [KV D, H]                 */
    float* wo;             /* [H, NH D]                                     */
    float *qn, *kn;        /* [D] QK-norm                                   */
    float* wr;             /* [E, H] router                                 */
    float** ex;            /* [E, 3]: expert e's gate [F, H], up [F, H],
                              down [H, F]                                   */
    float *k, *v;          /* [P, KV D] cache: k after QK-norm and RoPE     */
} layer_w;

struct mst_sampler {
    mst_model_config cfg;
    int64_t NH, KV, D;        /* heads, key-value heads, head dim            */
    int64_t max_tokens, pos;  /* cache length; tokens fed so far             */
    float* weights;           /* every tensor of the model set, fp32         */
    float *emb, *lnf, *head;  /* [V, H] [H] [V, H] (head == emb when tied)   */
    layer_w* lw;              /* [L]                                         */
    float* rope;              /* [D] the current position's cos, then sin    */
    /* scratch */
    float *x, *a;             /* [H] residual stream, norm output            */
    float *q, *kk, *vv, *att; /* [NH D] [KV D] [KV D] [NH D]                 */
    float *t, *y;             /* [H] attention output, MoE output            */
    float *g, *u;             /* [F] gate, up                                */
    float *gate, *score;      /* [E] router probabilities, [P] scores        */
    int64_t* chosen;          /* [k] the experts of the token                */
};

/* ---- loading ------------------------------------------------------------------ */

/* Where the tensor named name goes in s, or NULL for a name the model
 * does not have. */
static float** slot_of(mst_sampler* s, const char* name) {
    if (strcmp(name, "model.embed_tokens.weight") == 0) return &s->emb;
    if (strcmp(name, "model.norm.weight") == 0) return &s->lnf;
    if (strcmp(name, "lm_head.weight") == 0) return &s->head;
    int l = -1, e = -1, n = 0;
    if (sscanf(name, "model.layers.%d.%n", &l, &n) != 1 || l < 0 || l >= s->cfg.layers || n == 0) return NULL;
    layer_w* w = &s->lw[l];
    const char* rest = name + n;
    int m = 0;
    if (sscanf(rest, "mlp.experts.%d.%n", &e, &m) == 1 && m > 0 && e >= 0 && e < s->cfg.experts) {
        static const char* const part[3] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};
        for (int i = 0; i < 3; i++)
            if (strcmp(rest + m, part[i]) == 0) return &w->ex[3 * e + i];
        return NULL;
    }
    static const char* const names[] = {"input_layernorm.weight", "post_attention_layernorm.weight",
                                        "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight"};
    float** slots[] = {&w->ln1, &w->ln2, &w->wq, &w->wk, &w->wv, &w->wo, &w->qn, &w->kn, &w->wr};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(rest, names[i]) == 0) return slots[i];
    return NULL;
}

/* Every slot was filled (the table and slot_of agree). */
static mst_status check_slots(const mst_sampler* s, const char* dir) {
    int missing = !s->emb || !s->lnf || !s->head;
    for (int32_t l = 0; l < s->cfg.layers; l++) {
        const layer_w* w = &s->lw[l];
        missing |= !w->ln1 || !w->ln2 || !w->wq || !w->wk || !w->wv || !w->wo || !w->qn || !w->kn || !w->wr;
        for (int64_t e = 0; e < 3 * s->cfg.experts; e++) missing |= !w->ex[e];
    }
    return missing ? mst_set_error(MST_ERR_INVALID, "sample: '%s': the model set lacks a tensor of the model", dir) : MST_OK;
}

/* Reads every tensor of the model set (the table of hf.h, shapes checked by
 * the reader) into one fp32 buffer and points the slots at them. */
static mst_status load_weights(mst_sampler* s, const char* dir) {
    const int32_t n = mst_hf_n_params(&s->cfg);
    mst_hf_param* p = (mst_hf_param*)calloc((size_t)n, sizeof *p);
    if (!p) return mst_set_error(MST_ERR_OOM, "sample: parameter table");
    mst_hf_params(&s->cfg, NULL, p);
    int64_t total = 0;
    for (int32_t i = 0; i < n; i++) total += p[i].set == MST_HF_MODEL ? mst_hf_numel(&p[i]) : 0;
    mst_hf* h = NULL;
    mst_status st = mst_hf_open_set(dir, "model", 1, &h);
    if (st == MST_OK && !(s->weights = (float*)malloc(sizeof(float) * (size_t)total)))
        st = mst_set_error(MST_ERR_OOM, "sample: %lld weights", (long long)total);
    float* at = s->weights;
    for (int32_t i = 0; i < n && st == MST_OK; i++) {
        if (p[i].set != MST_HF_MODEL) continue;
        float** slot = slot_of(s, p[i].name);
        if (!slot) {
            st = mst_set_error(MST_ERR_INVALID, "sample: '%s': tensor %s has no place in the model", dir, p[i].name);
            break;
        }
        st = mst_hf_read_param(h, &p[i], MST_ST_F32, at);
        *slot = at;
        at += mst_hf_numel(&p[i]);
    }
    mst_hf_close(h);
    free(p);
    if (st == MST_OK && s->cfg.tie_embeddings) s->head = s->emb;
    if (st == MST_OK) st = check_slots(s, dir);
    return st;
}

static float* scratch(int64_t n, int* bad) {
    float* p = (float*)calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    *bad |= !p;
    return p;
}

/* The layers' expert tables and caches, the rotary frequencies, scratch. */
static mst_status alloc_state(mst_sampler* s) {
    const mst_model_config* c = &s->cfg;
    const int64_t H = c->hidden, F = c->ffn, E = c->experts, P = s->max_tokens;
    int bad = !(s->lw = (layer_w*)calloc((size_t)c->layers, sizeof *s->lw));
    for (int32_t l = 0; !bad && l < c->layers; l++) {
        layer_w* w = &s->lw[l];
        bad |= !(w->ex = (float**)calloc((size_t)(3 * E), sizeof(float*)));
        w->k = scratch(P * s->KV * s->D, &bad), w->v = scratch(P * s->KV * s->D, &bad);
    }
    s->rope = scratch(s->D, &bad);
    s->x = scratch(H, &bad), s->a = scratch(H, &bad), s->t = scratch(H, &bad), s->y = scratch(H, &bad);
    s->q = scratch(s->NH * s->D, &bad), s->att = scratch(s->NH * s->D, &bad);
    s->kk = scratch(s->KV * s->D, &bad), s->vv = scratch(s->KV * s->D, &bad);
    s->g = scratch(F, &bad), s->u = scratch(F, &bad), s->gate = scratch(E, &bad), s->score = scratch(P, &bad);
    bad |= !(s->chosen = (int64_t*)calloc((size_t)c->top_k, sizeof(int64_t)));
    if (bad) return mst_set_error(MST_ERR_OOM, "sample: KV cache of %lld tokens and scratch", (long long)P);
    return MST_OK;
}

mst_status mst_sampler_create(const char* dir, int64_t max_tokens, mst_sampler** out) {
    *out = NULL;
    if (max_tokens < 1 || max_tokens > (1 << 24))
        return mst_set_error(MST_ERR_INVALID, "sample: %lld tokens: expected 1 .. %d", (long long)max_tokens, 1 << 24);
    mst_sampler* s = (mst_sampler*)calloc(1, sizeof *s);
    if (!s) return mst_set_error(MST_ERR_OOM, "sampler");
    mst_status st = mst_hf_read_config(dir, &s->cfg);
    s->max_tokens = max_tokens;
    s->NH = s->cfg.n_head, s->KV = mst_hf_kv_heads(&s->cfg), s->D = mst_hf_head_dim(&s->cfg);
    if (st == MST_OK && (s->D % 2 || s->NH % s->KV))
        st = mst_set_error(MST_ERR_INVALID, "sample: '%s/config.json': head_dim %lld with %lld heads over %lld key-value "
                           "heads: RoPE pairs need an even head dim, GQA a head count the key-value heads divide",
                           dir, (long long)s->D, (long long)s->NH, (long long)s->KV);
    if (st == MST_OK) st = alloc_state(s);
    if (st == MST_OK) st = load_weights(s, dir);
    if (st != MST_OK) {
        mst_sampler_destroy(s);
        return st;
    }
    *out = s;
    return MST_OK;
}

void mst_sampler_destroy(mst_sampler* s) {
    if (!s) return;
    for (int32_t l = 0; s->lw && l < s->cfg.layers; l++) free(s->lw[l].ex), free(s->lw[l].k), free(s->lw[l].v);
    free(s->lw), free(s->weights), free(s->rope);
    free(s->x), free(s->a), free(s->t), free(s->y), free(s->q), free(s->att), free(s->kk), free(s->vv);
    free(s->g), free(s->u), free(s->gate), free(s->score), free(s->chosen);
    free(s);
}

const mst_model_config* mst_sampler_config(const mst_sampler* s) { return &s->cfg; }

/* ---- the forward of one token -------------------------------------------------- */

/* y [n] = W [n, k] x [k] (+= when acc), sums in double. */
static void matvec(const float* w, const float* x, int64_t n, int64_t k, float* y, int acc) {
    for (int64_t i = 0; i < n; i++) {
        double s = 0;
        for (int64_t j = 0; j < k; j++) s += (double)w[i * k + j] * x[j];
        y[i] = (float)(acc ? y[i] + s : s);
    }
}

/* y [n] = x / sqrt(mean(x^2) + eps) * w (y may be x). */
static void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* softmax over n values in place. */
static void softmax(float* v, int64_t n) {
    float mx = v[0];
    for (int64_t i = 1; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += v[i] = expf(v[i] - mx);
    for (int64_t i = 0; i < n; i++) v[i] = (float)(v[i] / sum);
}

/* QK-norm then RoPE (the angles of s->rope: mst_rope_angles), in place on
 * `heads` heads x [D]. */
static void qk_norm_rope(const mst_sampler* s, float* x, int64_t heads, const float* norm_w) {
    const int64_t D = s->D, half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float* v = x + h * D;
        rmsnorm(v, norm_w, D, s->cfg.norm_eps, v);
        for (int64_t i = 0; i < half; i++) {
            const float c = s->rope[i], sn = s->rope[half + i];
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c - x2 * sn;
            v[i + half] = x2 * c + x1 * sn;
        }
    }
}

/* Causal attention of the newest position over the cache: query head h
 * reads key-value head h / (NH / KV). */
static void attention(mst_sampler* s, const layer_w* w) {
    const int64_t D = s->D, KD = s->KV * D, T = s->pos + 1, group = s->NH / s->KV;
    const float sc = 1.0f / sqrtf((float)D);
    for (int64_t hd = 0; hd < s->NH; hd++) {
        const float* q = s->q + hd * D;
        const int64_t kv = hd / group;
        for (int64_t j = 0; j < T; j++) {
            double d = 0;
            for (int64_t i = 0; i < D; i++) d += (double)q[i] * w->k[j * KD + kv * D + i];
            s->score[j] = (float)d * sc;
        }
        softmax(s->score, T);
        for (int64_t i = 0; i < D; i++) {
            double o = 0;
            for (int64_t j = 0; j < T; j++) o += (double)s->score[j] * w->v[j * KD + kv * D + i];
            s->att[hd * D + i] = (float)o;
        }
    }
}

/* The MoE block on s->a (norm2 output) into s->y: softmax router, top-k
 * (ties to the lower index), weights renormalised over the k when
 * norm_topk_prob, each chosen expert's SwiGLU MLP scaled by its weight. */
static void moe(mst_sampler* s, const layer_w* w) {
    const int64_t H = s->cfg.hidden, F = s->cfg.ffn, E = s->cfg.experts;
    const int32_t K = s->cfg.top_k;
    matvec(w->wr, s->a, E, H, s->gate, 0);
    softmax(s->gate, E);
    int64_t* pick = s->chosen;
    double sum = 0;
    for (int32_t slot = 0; slot < K; slot++) { /* top-k by selection */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int32_t j = 0; j < slot; j++) taken |= pick[j] == e;
            if (!taken && (best < 0 || s->gate[e] > s->gate[best])) best = e;
        }
        pick[slot] = best;
        sum += s->gate[best];
    }
    memset(s->y, 0, sizeof(float) * (size_t)H);
    for (int32_t slot = 0; slot < K; slot++) {
        float* const* ex = w->ex + 3 * pick[slot];
        const float wt = s->cfg.norm_topk_prob ? (float)(s->gate[pick[slot]] / sum) : s->gate[pick[slot]];
        matvec(ex[0], s->a, F, H, s->g, 0);
        matvec(ex[1], s->a, F, H, s->u, 0);
        for (int64_t i = 0; i < F; i++) s->g[i] = s->g[i] / (1.0f + expf(-s->g[i])) * s->u[i] * wt;
        matvec(ex[2], s->g, H, F, s->y, 1);
    }
}

/* One layer on the residual stream s->x at position s->pos. */
static void layer(mst_sampler* s, layer_w* w) {
    const mst_model_config* c = &s->cfg;
    const int64_t H = c->hidden, KD = s->KV * s->D;
    rmsnorm(s->x, w->ln1, H, c->norm_eps, s->a);
    matvec(w->wq, s->a, s->NH * s->D, H, s->q, 0);
    matvec(w->wk, s->a, KD, H, w->k + s->pos * KD, 0);
    matvec(w->wv, s->a, KD, H, w->v + s->pos * KD, 0);
    qk_norm_rope(s, s->q, s->NH, w->qn);
    qk_norm_rope(s, w->k + s->pos * KD, s->KV, w->kn);
    attention(s, w);
    matvec(w->wo, s->att, H, s->NH * s->D, s->t, 0);
    for (int64_t i = 0; i < H; i++) s->x[i] += s->t[i];
    rmsnorm(s->x, w->ln2, H, c->norm_eps, s->a);
    moe(s, w);
    for (int64_t i = 0; i < H; i++) s->x[i] += s->y[i];
}

mst_status mst_sampler_feed(mst_sampler* s, int32_t token, float* logits) {
    const mst_model_config* c = &s->cfg;
    const int64_t H = c->hidden;
    if (s->pos >= s->max_tokens)
        return mst_set_error(MST_ERR_INVALID, "sample: position %lld past the %lld-token cache", (long long)s->pos,
                             (long long)s->max_tokens);
    if (token < 0 || token >= c->vocab)
        return mst_set_error(MST_ERR_INVALID, "sample: token %d outside [0, %lld)", token, (long long)c->vocab);
    memcpy(s->x, s->emb + (int64_t)token * H, sizeof(float) * (size_t)H);
    mst_rope_angles(c->rope_theta, s->D, s->pos, s->rope); /* once for every layer and head */
    for (int32_t l = 0; l < c->layers; l++) layer(s, &s->lw[l]);
    s->pos++;
    if (!logits) return MST_OK;
    rmsnorm(s->x, s->lnf, H, c->norm_eps, s->a);
    matvec(s->head, s->a, c->vocab, H, logits, 0);
    return MST_OK;
}

/* ---- picking ----------------------------------------------------------------- */

/* The k-th largest of logits [V] (k < V): the cut of top-k sampling. */
static float kth_largest(const float* logits, int64_t vocab, int32_t k) {
    float* v = (float*)malloc(sizeof(float) * (size_t)vocab);
    if (!v) return -INFINITY; /* no cut: sample from all */
    memcpy(v, logits, sizeof(float) * (size_t)vocab);
    for (int32_t i = 0; i < k; i++) { /* partial selection: k passes */
        int64_t m = i;
        for (int64_t j = i + 1; j < vocab; j++)
            if (v[j] > v[m]) m = j;
        const float t = v[i];
        v[i] = v[m], v[m] = t;
    }
    const float cut = v[k - 1];
    free(v);
    return cut;
}

/* The unnormalised probability of a logit at temperature t:
 * exp((logit - max) / t). */
static double weight(float logit, float max, float t) { return exp((double)(logit - max) / t); }

int32_t mst_sampler_pick(const float* logits, int64_t vocab, float temperature, int32_t top_k, uint64_t* rng) {
    int32_t best = 0;
    for (int64_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = (int32_t)i;
    if (temperature <= 0) return best;
    const float cut = top_k > 0 && top_k < vocab ? kth_largest(logits, vocab, top_k) : -INFINITY;
    double sum = 0;
    for (int64_t i = 0; i < vocab; i++)
        if (logits[i] >= cut) sum += weight(logits[i], logits[best], temperature);
    double u = mst_splitmix_unit(rng) * sum;
    for (int64_t i = 0; i < vocab; i++) {
        if (logits[i] < cut) continue;
        u -= weight(logits[i], logits[best], temperature);
        if (u < 0) return (int32_t)i;
    }
    return best;
}
