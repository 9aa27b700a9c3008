/*
 * sample.c — one-token-at-a-time inference with a KV cache (sample.h).
 */
#include "sample.h"

#include <math.h>
#include <string.h>

#include "lib/internal.h"

typedef struct layer_w {
    float *ln1, *wqkv, *wo, *ln2, *wr, *w1, *w2; /* [H] [3H,H] [H,H] [H] [E,H] [E,2F,H] [E,H,F] */
    float *k, *v;                                /* [max_tokens, H] cache                      */
} layer_w;

struct mst_sampler {
    mst_model_config cfg;
    int64_t max_tokens, pos;  /* cache length; tokens fed so far             */
    float *emb, *lnf;         /* [V, H] [H]                                  */
    layer_w* lw;              /* [L]                                         */
    float *x, *a, *qkv, *att, *t, *y, *h, *z, *logits, *gate, *score; /* scratch */
};

/* ---- loading ------------------------------------------------------------------ */

static mst_status load(const char* dir, const char* name, int64_t n, float** out) {
    *out = (float*)malloc(sizeof(float) * (size_t)n);
    if (!*out) return mst_set_error(MST_ERR_OOM, "sample: %s (%lld values)", name, (long long)n);
    return mst_ckpt_read_bf16(dir, name, n, *out);
}

static mst_status load_layer(mst_sampler* s, const char* dir, int32_t l) {
    const int64_t H = s->cfg.hidden, F = s->cfg.ffn, E = s->cfg.experts;
    layer_w* w = &s->lw[l];
    char n[64];
#define LOAD(field, what, count)                                   \
    snprintf(n, sizeof n, "layers.%d.%s", l, what);                \
    MST_TRY(load(dir, n, count, &w->field))
    LOAD(ln1, "attn_norm.weight", H);
    LOAD(wqkv, "attn.wqkv", 3 * H * H);
    LOAD(wo, "attn.wo", H * H);
    LOAD(ln2, "mlp_norm.weight", H);
    LOAD(wr, "router.weight", E * H);
    LOAD(w1, "experts.w1", E * 2 * F * H);
    LOAD(w2, "experts.w2", E * H * F);
#undef LOAD
    w->k = (float*)calloc((size_t)(s->max_tokens * H), sizeof(float));
    w->v = (float*)calloc((size_t)(s->max_tokens * H), sizeof(float));
    return w->k && w->v ? MST_OK : mst_set_error(MST_ERR_OOM, "sample: KV cache of %lld tokens", (long long)s->max_tokens);
}

static float* scratch(int64_t n, int* bad) {
    float* p = (float*)calloc((size_t)n, sizeof(float));
    *bad |= !p;
    return p;
}

mst_status mst_sampler_create(const char* dir, int64_t max_tokens, mst_sampler** out) {
    *out = NULL;
    if (max_tokens < 1 || max_tokens > (1 << 24))
        return mst_set_error(MST_ERR_INVALID, "sample: %lld tokens: expected 1 .. %d", (long long)max_tokens, 1 << 24);
    mst_ckpt_meta meta;
    MST_TRY(mst_ckpt_read_meta(dir, &meta));
    if (meta.ranks > 1)
        return mst_set_error(MST_ERR_UNSUPPORTED, "checkpoint '%s': saved by %d ranks (each holds a shard of the "
                             "experts); sampling reads a one-rank checkpoint", dir, meta.ranks);
    mst_sampler* s = (mst_sampler*)calloc(1, sizeof *s);
    if (!s) return mst_set_error(MST_ERR_OOM, "sampler");
    s->cfg = meta.cfg.model;
    s->max_tokens = max_tokens;
    const mst_model_config* c = &s->cfg;
    const int64_t H = c->hidden, F = c->ffn, E = c->experts, V = c->vocab;
    s->lw = (layer_w*)calloc((size_t)c->layers, sizeof *s->lw);
    mst_status st = s->lw ? MST_OK : mst_set_error(MST_ERR_OOM, "sampler layers");
    if (st == MST_OK) st = load(dir, "embed.weight", V * H, &s->emb);
    if (st == MST_OK) st = load(dir, "final_norm.weight", H, &s->lnf);
    for (int32_t l = 0; l < c->layers && st == MST_OK; l++) st = load_layer(s, dir, l);
    int bad = 0;
    s->x = scratch(H, &bad), s->a = scratch(H, &bad), s->qkv = scratch(3 * H, &bad), s->att = scratch(H, &bad);
    s->t = scratch(H, &bad), s->y = scratch(H, &bad), s->h = scratch(2 * F, &bad), s->z = scratch(F, &bad);
    s->logits = scratch(V > E ? V : E, &bad), s->gate = scratch(E, &bad), s->score = scratch(max_tokens, &bad);
    if (st == MST_OK && bad) st = mst_set_error(MST_ERR_OOM, "sampler scratch");
    if (st != MST_OK) {
        mst_sampler_destroy(s);
        return st;
    }
    *out = s;
    return MST_OK;
}

void mst_sampler_destroy(mst_sampler* s) {
    if (!s) return;
    for (int32_t l = 0; s->lw && l < s->cfg.layers; l++) {
        layer_w* w = &s->lw[l];
        free(w->ln1), free(w->wqkv), free(w->wo), free(w->ln2), free(w->wr), free(w->w1), free(w->w2);
        free(w->k), free(w->v);
    }
    free(s->lw), free(s->emb), free(s->lnf);
    free(s->x), free(s->a), free(s->qkv), free(s->att), free(s->t), free(s->y), free(s->h), free(s->z);
    free(s->logits), free(s->gate), free(s->score);
    free(s);
}

const mst_model_config* mst_sampler_config(const mst_sampler* s) { return &s->cfg; }

/* ---- the forward of one token -------------------------------------------------- */

/* y [n] = W [n, k] x [k] (+= when acc). */
static void matvec(const float* w, const float* x, int64_t n, int64_t k, float* y, int acc) {
    for (int64_t i = 0; i < n; i++) {
        double s = 0;
        for (int64_t j = 0; j < k; j++) s += (double)w[i * k + j] * x[j];
        y[i] = (float)(acc ? y[i] + s : s);
    }
}

static void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* softmax over n values in place. */
static void softmax(float* v, int64_t n) {
    float mx = v[0];
    for (int64_t i = 1; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += v[i] = expf(v[i] - mx);
    for (int64_t i = 0; i < n; i++) v[i] = (float)(v[i] / sum);
}

/* Causal attention of the newest position over the cache, every head. */
static void attention(mst_sampler* s, const layer_w* w) {
    const int64_t H = s->cfg.hidden, NH = s->cfg.n_head, D = H / NH, T = s->pos + 1;
    const float sc = 1.0f / sqrtf((float)D);
    for (int64_t hd = 0; hd < NH; hd++) {
        const float* q = s->qkv + hd * D;
        for (int64_t j = 0; j < T; j++) {
            double d = 0;
            for (int64_t i = 0; i < D; i++) d += (double)q[i] * w->k[j * H + hd * D + i];
            s->score[j] = (float)d * sc;
        }
        softmax(s->score, T);
        for (int64_t i = 0; i < D; i++) {
            double o = 0;
            for (int64_t j = 0; j < T; j++) o += (double)s->score[j] * w->v[j * H + hd * D + i];
            s->att[hd * D + i] = (float)o;
        }
    }
}

/* The MoE block on s->a (norm2 output) into s->y: softmax router, top-k
 * (ties to the lower index), each chosen expert's SwiGLU MLP scaled by its
 * router probability, summed. */
static void moe(mst_sampler* s, const layer_w* w) {
    const int64_t H = s->cfg.hidden, F = s->cfg.ffn, E = s->cfg.experts;
    matvec(w->wr, s->a, E, H, s->gate, 0);
    softmax(s->gate, E);
    memset(s->y, 0, sizeof(float) * (size_t)H);
    unsigned char* used = (unsigned char*)calloc((size_t)E, 1);
    for (int32_t slot = 0; slot < s->cfg.top_k && used; slot++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!used[e] && (best < 0 || s->gate[e] > s->gate[best])) best = e;
        used[best] = 1;
        matvec(w->w1 + best * 2 * F * H, s->a, 2 * F, H, s->h, 0);
        for (int64_t i = 0; i < F; i++) {
            const float g = s->h[i];
            s->z[i] = g / (1.0f + expf(-g)) * s->h[F + i] * s->gate[best];
        }
        matvec(w->w2 + best * H * F, s->z, H, F, s->y, 1);
    }
    free(used);
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
    for (int32_t l = 0; l < c->layers; l++) {
        layer_w* w = &s->lw[l];
        rmsnorm(s->x, w->ln1, H, c->norm_eps, s->a);
        matvec(w->wqkv, s->a, 3 * H, H, s->qkv, 0);
        memcpy(w->k + s->pos * H, s->qkv + H, sizeof(float) * (size_t)H);
        memcpy(w->v + s->pos * H, s->qkv + 2 * H, sizeof(float) * (size_t)H);
        attention(s, w);
        matvec(w->wo, s->att, H, H, s->t, 0);
        for (int64_t i = 0; i < H; i++) s->x[i] += s->t[i];
        rmsnorm(s->x, w->ln2, H, c->norm_eps, s->a);
        moe(s, w);
        for (int64_t i = 0; i < H; i++) s->x[i] += s->y[i];
    }
    s->pos++;
    if (!logits) return MST_OK;
    rmsnorm(s->x, s->lnf, H, c->norm_eps, s->a);
    matvec(s->emb, s->a, c->vocab, H, logits, 0);
    return MST_OK;
}

/* ---- picking ----------------------------------------------------------------- */

int32_t mst_sampler_pick(const float* logits, int64_t vocab, float temperature, int32_t top_k, uint64_t* rng) {
    int32_t best = 0;
    for (int64_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = (int32_t)i;
    if (temperature <= 0) return best;
    /* the k-th largest logit is the cut (ties at the cut all stay) */
    float cut = -INFINITY;
    if (top_k > 0 && top_k < vocab) {
        float* v = (float*)malloc(sizeof(float) * (size_t)vocab);
        if (!v) return best;
        memcpy(v, logits, sizeof(float) * (size_t)vocab);
        for (int32_t k = 0; k < top_k; k++) { /* partial selection: k passes */
            int64_t m = k;
            for (int64_t i = k + 1; i < vocab; i++)
                if (v[i] > v[m]) m = i;
            float t = v[k];
            v[k] = v[m], v[m] = t;
        }
        cut = v[top_k - 1];
        free(v);
    }
    double sum = 0;
    for (int64_t i = 0; i < vocab; i++)
        if (logits[i] >= cut) sum += exp((double)(logits[i] - logits[best]) / temperature);
    double u = mst_splitmix_unit(rng) * sum;
    for (int64_t i = 0; i < vocab; i++) {
        if (logits[i] < cut) continue;
        u -= exp((double)(logits[i] - logits[best]) / temperature);
        if (u < 0) return (int32_t)i;
    }
    return best;
}
