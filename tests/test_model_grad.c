/*
 * test_model_grad.c — the model's gradients (bf16 weights and activations,
 * fp32 main_grad) against central finite differences of the loss computed by
 * a float64 reference Qwen3-MoE model on the host (written from
 * transformers' definitions: RMSNorm, q/k/v projection, per-head QK-norm,
 * rotary embedding with rotate_half, grouped-query attention, softmax
 * router with renormalised top-k, SwiGLU experts, load_balancing_loss_func
 * over the main layers; plus the MTP module), for sampled elements of every
 * parameter kind: embedding (input, tied or untied head, MTP next-token
 * input), norms (QK-norm included), attention (Wqkv, Wo), router, experts
 * (W1, W2), the MTP projection, of the main layers and of the MTP layer.
 *
 * Tolerance 5e-2 (relative norm error over 24 sampled elements per tensor):
 * the model stores every activation and activation gradient in bf16 (each
 * store rounds by up to 2^-9 relative) and a gradient passes some 20 such
 * stores between the loss and a weight, while the reference is float64
 * throughout; measured errors are 0.2e-2 .. 4.2e-2. A wrong term is far
 * outside: dropping the load-balancing gradient (aux_coef 0.1 here so that it
 * matters) gives 0.1 .. 1.0 on most tensors.
 *
 * Routing: the reference takes the backend's top-k choices (topk_idx of
 * every layer, read back after the step) and computes everything else in
 * float64, so the finite differences are of a smooth function along the
 * routing the model's gradient is of. Top-k is discontinuous: a token
 * whose k-th and (k+1)-th router logits are closer than the bf16 noise of
 * the logits (1e-2 .. 3e-2 here) may choose differently on a backend (CUDA's
 * GEMMs round otherwise than the CPU's) than in float64, and one such token
 * moves the loss by far more than any gradient error (renormalised top-k:
 * rel errs 0.2 .. 0.7 on CUDA before this; the first case has an MTP-layer
 * token of margin 5.7e-3). Every router logit must be within LOGIT_TOL of
 * float64, and a flip is allowed only where the reference's margin
 * (log p_k - log p_k+1, a logit gap) is under MARGIN: a routing bug flips
 * tokens of any margin and fails. Flips per layer are printed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/model/model.h"

/* ---- float64 reference model (same layout as the model's flat buffer) ---- */

/* Router logits: the backend's within LOGIT_TOL of float64's (measured on
 * the CPU: 1.0e-2 .. 3.0e-2 absolute, from the bf16 activations below).
 * Then a token whose two logits at the k-th place differ by more than
 * MARGIN = 2 LOGIT_TOL in float64 cannot be routed otherwise. */
#define LOGIT_TOL 5e-2
#define MARGIN (2 * LOGIT_TOL)

/* Per layer: how the backend's routing compares with the reference's own. */
typedef struct ref_route {
    int flips;           /* tokens whose chosen set differs                */
    double flip_margin;  /* the largest reference margin among them        */
    double min_margin;   /* the smallest margin of any token               */
    double logit_err;    /* max |backend's router logit - float64's|       */
} ref_route;

typedef struct ref {
    const mst_model* m;     /* layout and config only */
    const double* w;        /* [n_params] */
    const int32_t* tok;     /* [B, T+2] */
    const int32_t* route;   /* [L+1, N k] the backend's top-k choices */
    const float* logits;    /* [L+1, N, E] the backend's router logits */
    ref_route* seen;        /* [L+1] filled by ref_loss when not NULL */
} ref;

static void ref_norm(const double* x, const double* w, int64_t n, int64_t h, double eps, double* y) {
    for (int64_t r = 0; r < n; r++) {
        double ss = 0;
        for (int64_t c = 0; c < h; c++) ss += x[r * h + c] * x[r * h + c];
        double rs = 1.0 / sqrt(ss / (double)h + eps);
        for (int64_t c = 0; c < h; c++) y[r * h + c] = x[r * h + c] * rs * w[c];
    }
}

/* y [n, o] (+)= x [n, i] W^T with W [o, i] of row stride ldw. */
static void ref_linear(const double* x, const double* w, int64_t n, int64_t in, int64_t out, int64_t ldw,
                       double* y, int acc) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t o = 0; o < out; o++) {
            double s = acc ? y[r * out + o] : 0;
            for (int64_t i = 0; i < in; i++) s += x[r * in + i] * w[o * ldw + i];
            y[r * out + o] = s;
        }
}

/* mean over rows of the cross-entropy of x head^T against targets */
static double ref_head(const ref* R, const double* x, int j) {
    const mst_model_config* c = &R->m->cfg;
    const int64_t T = c->seq, H = c->hidden, V = c->vocab;
    double* lg = (double*)malloc(sizeof(double) * (size_t)V);
    double total = 0;
    for (int64_t b = 0; b < c->batch; b++)
        for (int64_t t = 0; t < T; t++) {
            const double* xr = x + (b * T + t) * H;
            double mx = -INFINITY, s = 0;
            for (int64_t v = 0; v < V; v++) {
                double a = 0;
                for (int64_t i = 0; i < H; i++) a += xr[i] * R->w[R->m->head + v * H + i];
                lg[v] = a;
                mx = fmax(mx, a);
            }
            for (int64_t v = 0; v < V; v++) s += exp(lg[v] - mx);
            total += log(s) + mx - lg[R->tok[b * (T + 2) + t + j]];
        }
    free(lg);
    return total / (double)(c->batch * T);
}

/* Per-head RMSNorm (weight w [D]) then the rotation of rotate_half at
 * position pos, in place on one head's u [D]. */
static void ref_qk_head(double* u, const double* w, int64_t D, double eps, double theta, int64_t pos) {
    double ss = 0, y[512];
    for (int64_t i = 0; i < D; i++) ss += u[i] * u[i];
    const double rs = 1.0 / sqrt(ss / (double)D + eps);
    for (int64_t i = 0; i < D; i++) u[i] *= rs * w[i];
    for (int64_t i = 0; i < D; i++) {
        const double a = (double)pos / pow(theta, (double)(2 * (i % (D / 2))) / (double)D);
        y[i] = u[i] * cos(a) + (i < D / 2 ? -u[i + D / 2] : u[i - D / 2]) * sin(a);
    }
    memcpy(u, y, sizeof(double) * (size_t)D);
}

/* qkv [N, (NH + 2 KV) D] (q and k normed and rotated here) -> out [N, NH D]:
 * query head h reads key-value head h / (NH / KV). */
static void ref_attention(const ref* R, int32_t l, double* qkv, double* out) {
    const mst_model_config* c = &R->m->cfg;
    const int64_t T = c->seq, NH = c->n_head, KV = c->n_kv_head, D = c->head_dim, W = (NH + 2 * KV) * D, HO = NH * D;
    const mst_layer_params* P = &R->m->lp[l];
    for (int64_t r = 0; r < c->batch * T; r++)
        for (int64_t h = 0; h < NH + KV; h++)
            ref_qk_head(qkv + r * W + h * D, R->w + (h < NH ? P->q_norm : P->k_norm), D, c->norm_eps, c->rope_theta,
                        r % T);
    double* p = (double*)malloc(sizeof(double) * (size_t)T);
    for (int64_t b = 0; b < c->batch; b++)
        for (int64_t h = 0; h < NH; h++)
            for (int64_t i = 0; i < T; i++) {
                const int64_t g = h / (NH / KV);
                const double* q = qkv + (b * T + i) * W + h * D;
                double mx = -INFINITY, s = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double* k = qkv + (b * T + j) * W + (NH + g) * D;
                    double a = 0;
                    for (int64_t d = 0; d < D; d++) a += q[d] * k[d];
                    p[j] = a / sqrt((double)D);
                    mx = fmax(mx, p[j]);
                }
                for (int64_t j = 0; j <= i; j++) s += (p[j] = exp(p[j] - mx));
                for (int64_t d = 0; d < D; d++) {
                    double a = 0;
                    for (int64_t j = 0; j <= i; j++) a += p[j] / s * qkv[(b * T + j) * W + (NH + KV + g) * D + d];
                    out[(b * T + i) * HO + h * D + d] = a;
                }
            }
    free(p);
}

/* The load-balancing statistics of the layers one loss spans: top-k hits
 * and softmax sums per expert, and their rows. */
typedef struct ref_lb {
    double load[64], psum[64], rows;
} ref_lb;

/* transformers' load_balancing_loss_func: coef E sum_e (L_e / rows) (P_e / rows). */
static double ref_lb_loss(const ref* R, const ref_lb* s) {
    const mst_model_config* c = &R->m->cfg;
    double aux = 0;
    for (int32_t e = 0; e < c->experts; e++) aux += s->load[e] / s->rows * (s->psum[e] / s->rows);
    return c->aux_coef * (double)c->experts * aux;
}

/* The reference's own top-k of probabilities p [E] into own [k] (ties to
 * the lower index); returns the margin log p_k - log p_k+1. */
static double ref_topk(const double* p, int64_t E, int64_t K, int64_t* own) {
    double next = 0;
    for (int64_t k = 0; k <= K && k < E; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t u = 0; u < k; u++) taken |= own[u] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        if (k < K) own[k] = best;
        else next = p[best];
    }
    return K < E ? log(p[own[K - 1]]) - log(next) : INFINITY;
}

/* Records token t's routing: the backend's chosen set idx [k] against the
 * reference's own [k] of margin `margin`. */
static void ref_see(ref_route* s, const int32_t* idx, const int64_t* own, int64_t K, double margin) {
    int same = 1;
    for (int64_t k = 0; k < K; k++) {
        int found = 0;
        for (int64_t u = 0; u < K; u++) found |= idx[u] == own[k];
        same &= found;
    }
    if (!same) s->flips++, s->flip_margin = fmax(s->flip_margin, margin);
    s->min_margin = fmin(s->min_margin, margin);
}

/* The MoE block: softmax router, top-k (the backend's choices, R->route)
 * renormalised (norm_topk_prob), SwiGLU experts scaled by their weights,
 * summed; its statistics into *lb. x [N, H] -> y [N, H]. */
static void ref_moe(const ref* R, int32_t l, const double* x, double* y, ref_lb* lb) {
    const mst_model_config* c = &R->m->cfg;
    const mst_layer_params* P = &R->m->lp[l];
    const int64_t N = c->batch * c->seq, H = c->hidden, F = c->ffn, E = c->experts, K = c->top_k;
    double* pr = (double*)malloc(sizeof(double) * (size_t)(N * E));
    double* hh = (double*)malloc(sizeof(double) * (size_t)(2 * F));
    double* z = (double*)malloc(sizeof(double) * (size_t)F);
    ref_linear(x, R->w + P->wr, N, H, E, H, pr, 0);
    memset(y, 0, sizeof(double) * (size_t)(N * H));
    lb->rows += (double)N;
    for (int64_t t = 0; t < N; t++) {
        double* p = pr + t * E;
        double mx = -INFINITY, s = 0, chosen_sum = 0;
        for (int64_t e = 0; R->seen && e < E; e++)
            R->seen[l].logit_err = fmax(R->seen[l].logit_err, fabs(p[e] - R->logits[(l * N + t) * E + e]));
        for (int64_t e = 0; e < E; e++) mx = fmax(mx, p[e]);
        for (int64_t e = 0; e < E; e++) s += (p[e] = exp(p[e] - mx));
        for (int64_t e = 0; e < E; e++) lb->psum[e] += (p[e] /= s);
        int64_t own[64];
        const int32_t* idx = R->route + (l * N + t) * K;
        const double margin = ref_topk(p, E, K, own);
        if (R->seen) ref_see(&R->seen[l], idx, own, K, margin);
        for (int64_t k = 0; k < K; k++) {
            chosen_sum += p[idx[k]];
            lb->load[idx[k]] += 1;
        }
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = idx[k];
            const double wk = p[e] / (c->norm_topk_prob ? chosen_sum : 1.0);
            ref_linear(x + t * H, R->w + P->w1 + e * 2 * F * H, 1, H, 2 * F, H, hh, 0);
            for (int64_t f = 0; f < F; f++) z[f] = hh[f] / (1 + exp(-hh[f])) * hh[F + f] * wk;
            ref_linear(z, R->w + P->w2 + e * H * F, 1, F, H, F, y + t * H, 1);
        }
    }
    free(pr);
    free(hh);
    free(z);
}

/* x [N, H] -> x + attn, then + MoE; the router's statistics into *lb. */
static void ref_layer(const ref* R, int32_t l, double* x, ref_lb* lb) {
    const mst_model_config* c = &R->m->cfg;
    const mst_layer_params* P = &R->m->lp[l];
    const int64_t N = c->batch * c->seq, H = c->hidden, HO = c->n_head * c->head_dim;
    const int64_t W = (c->n_head + 2 * c->n_kv_head) * c->head_dim;
    double* a = (double*)malloc(sizeof(double) * (size_t)(N * H));
    double* qkv = (double*)malloc(sizeof(double) * (size_t)(N * W));
    double* att = (double*)malloc(sizeof(double) * (size_t)(N * (HO > H ? HO : H)));
    ref_norm(x, R->w + P->ln1, N, H, c->norm_eps, a);
    ref_linear(a, R->w + P->wqkv, N, H, W, H, qkv, 0);
    ref_attention(R, l, qkv, att);
    ref_linear(att, R->w + P->wo, N, HO, H, HO, x, 1);
    ref_norm(x, R->w + P->ln2, N, H, c->norm_eps, a);
    ref_moe(R, l, a, att, lb);
    for (int64_t i = 0; i < N * H; i++) x[i] += att[i];
    free(a);
    free(qkv);
    free(att);
}

static double ref_loss(const ref* R) {
    const mst_model* m = R->m;
    const mst_model_config* c = &m->cfg;
    const int64_t T = c->seq, N = c->batch * T, H = c->hidden;
    double* x = (double*)malloc(sizeof(double) * (size_t)(N * H));
    double* e = (double*)malloc(sizeof(double) * (size_t)(N * H));
    double* cat = (double*)malloc(sizeof(double) * (size_t)(N * 2 * H));
    double* p = (double*)malloc(sizeof(double) * (size_t)(N * H));
    for (int64_t b = 0; b < c->batch; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < H; i++) {
                x[(b * T + t) * H + i] = R->w[m->emb + R->tok[b * (T + 2) + t] * H + i];
                e[(b * T + t) * H + i] = R->w[m->emb + R->tok[b * (T + 2) + t + 1] * H + i];
            }
    ref_lb main_lb = {{0}, {0}, 0}, mtp_lb = {{0}, {0}, 0}; /* the main layers' loss spans them all */
    for (int32_t l = 0; l < c->layers; l++) ref_layer(R, l, x, &main_lb);
    ref_norm(x, R->w + m->lnf, N, H, c->norm_eps, p);
    double main_loss = ref_head(R, p, 1);
    /* MTP: [norm_e(e) | norm_h(x)] Wproj^T, one layer, own norm, shared head */
    double* ne = (double*)malloc(sizeof(double) * (size_t)(N * H));
    double* nh = (double*)malloc(sizeof(double) * (size_t)(N * H));
    ref_norm(e, R->w + m->ln_e, N, H, c->norm_eps, ne);
    ref_norm(x, R->w + m->ln_h, N, H, c->norm_eps, nh);
    for (int64_t r = 0; r < N; r++) {
        memcpy(cat + r * 2 * H, ne + r * H, sizeof(double) * (size_t)H);
        memcpy(cat + r * 2 * H + H, nh + r * H, sizeof(double) * (size_t)H);
    }
    ref_linear(cat, R->w + m->proj, N, 2 * H, H, 2 * H, p, 0);
    ref_layer(R, c->layers, p, &mtp_lb);
    ref_norm(p, R->w + m->ln_mf, N, H, c->norm_eps, x);
    double mtp_loss = ref_head(R, x, 2);
    free(x);
    free(e);
    free(cat);
    free(p);
    free(ne);
    free(nh);
    return main_loss + c->mtp_weight * mtp_loss + ref_lb_loss(R, &main_lb) + ref_lb_loss(R, &mtp_lb);
}

/* ---- the check -------------------------------------------------------- */

typedef struct pkind {
    const char* name;
    int64_t off, n;   /* elements [off, off + n) of the flat buffer */
} pkind;

/* Sampled elements of one parameter tensor: model gradient vs float64
 * central differences; returns the relative norm error. */
static double check_kind(ref* R, double* w, const float* grad, const pkind* k, mst_rng* rng,
                         const int* used_rows, int64_t H) {
    enum { SAMPLES = 24 };
    double num = 0, den = 0;
    for (int s = 0; s < SAMPLES; s++) {
        int64_t i = k->off + mst_rng_int(rng, 0, k->n - 1);
        if (used_rows) { /* embedding: a row of a token that occurs */
            int64_t row;
            do row = mst_rng_int(rng, 0, k->n / H - 1);
            while (!used_rows[row]);
            i = k->off + row * H + mst_rng_int(rng, 0, H - 1);
        }
        const double w0 = w[i], h = 1e-4 * fmax(1.0, fabs(w0));
        w[i] = w0 + h;
        double lp = ref_loss(R);
        w[i] = w0 - h;
        double lm = ref_loss(R);
        w[i] = w0;
        double fd = (lp - lm) / (2 * h), d = grad[i] - fd;
        num += d * d;
        den += fd * fd;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* route [L+1, N k], logits [L+1, N, E]: the top-k choices and router
 * logits of every layer of m's last step (microbatch 0). A layer that m
 * recomputes runs in a slot that later layers reuse, so such a model (mem
 * not NULL) is asked through a twin keeping every activation, run on the
 * same weights and tokens (the same forward), whose per-layer loads must
 * equal m's. */
static void read_routing(mst_ctx_t* ctx, mst_model* m, const mst_mem_config* mem, const int32_t* tok,
                         const float* hyper, int32_t* route, float* logits) {
    const mst_model_config* c = &m->cfg;
    const int64_t NK = c->batch * c->seq * c->top_k, NE = c->batch * c->seq * c->experts;
    const int64_t LE = (int64_t)(c->layers + 1) * c->experts;
    mst_model *src = m, *twin = NULL;
    if (mem) {
        CHECK_OK(mst_model_create(ctx, c, 1, NULL, &twin));
        if (!twin) return;
        src = twin;
        CHECK_OK(mst_copy_b2b(ctx, src->w, m->w, sizeof(uint16_t) * (size_t)m->n_params));
        CHECK_OK(mst_model_stage(src, 0, tok, hyper));
        CHECK_OK(mst_model_upload(src, 0));
        CHECK_OK(mst_model_step(src, 1));
        int32_t* loads = (int32_t*)malloc(sizeof(int32_t) * (size_t)(2 * LE));
        CHECK_OK(mst_copy_b2h(ctx, loads, m->micro[0].loads, sizeof(int32_t) * (size_t)LE));
        CHECK_OK(mst_copy_b2h(ctx, loads + LE, src->micro[0].loads, sizeof(int32_t) * (size_t)LE));
        CHECK(memcmp(loads, loads + LE, sizeof(int32_t) * (size_t)LE) == 0,
              "the loads of the model and of its twin keeping every activation differ");
        free(loads);
    }
    for (int32_t l = 0; l <= c->layers; l++) {
        CHECK_OK(mst_copy_b2h(ctx, route + l * NK, src->micro[0].acts[l].topk_idx, sizeof(int32_t) * (size_t)NK));
        CHECK_OK(mst_copy_b2h(ctx, logits + l * NE, src->micro[0].acts[l].rlogits, sizeof(float) * (size_t)NE));
    }
    for (int64_t i = 0; i < (c->layers + 1) * NK; i++)
        CHECK(route[i] >= 0 && route[i] < c->experts, "topk_idx[%lld] = %d: not an expert", (long long)i, route[i]);
    if (twin) mst_model_destroy(twin);
}

/* Prints each layer's tokens routed otherwise than in float64 and checks
 * they are near ties (margin under MARGIN) and the logits within LOGIT_TOL. */
static void check_routing(const mst_model_config* c, const ref_route* seen, const char* label) {
    printf("    routing flips vs float64 (of %lld tokens; margin: log p_k - log p_k+1):\n",
           (long long)(c->batch * c->seq));
    for (int32_t l = 0; l <= c->layers; l++) {
        char name[16];
        snprintf(name, sizeof name, l < c->layers ? "layer %d" : "mtp", l);
        printf("      %-8s %d flipped (largest margin %.2e), smallest margin %.2e, logits off by %.2e\n", name,
               seen[l].flips, seen[l].flip_margin, seen[l].min_margin, seen[l].logit_err);
        CHECK(seen[l].logit_err < LOGIT_TOL, "%s, %s: router logits off float64 by %.3e (bound %.0e)", label, name,
              seen[l].logit_err, LOGIT_TOL);
        CHECK(seen[l].flips == 0 || seen[l].flip_margin < MARGIN,
              "%s, %s: a token of margin %.3e routed otherwise than in float64 (bound %.0e)", label, name,
              seen[l].flip_margin, MARGIN);
    }
}

/* The gradients of one model under the memory configuration mem (NULL:
 * every activation kept) against float64 finite differences. */
/* The attention shape and the two switches of one case. */
typedef struct grad_case {
    int64_t n_head, n_kv_head, head_dim;
    int32_t tie, norm_topk;
} grad_case;

static void check_model(mst_ctx_t* ctx, const mst_mem_config* mem, grad_case g, const char* label) {
    printf("  %s (heads %lld / %lld of dim %lld, head %s, top-k %s)\n", label, (long long)g.n_head,
           (long long)g.n_kv_head, (long long)g.head_dim, g.tie ? "tied" : "untied",
           g.norm_topk ? "renormalised" : "not renormalised");
    /* rope theta 100: the rotation turns every pair of dims visibly over 5 positions */
    mst_model_config c = {.vocab = 256, .hidden = 16, .ffn = 8, .n_head = g.n_head, .n_kv_head = g.n_kv_head,
                          .head_dim = g.head_dim, .rope_theta = 100.0f, .norm_topk_prob = g.norm_topk,
                          .tie_embeddings = g.tie, .seq = 5, .batch = 2,
                          .layers = 2, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 4.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.1f, .norm_eps = 1e-5f,
                          .init_std = 0.3f, .seed = 7};
    mst_model* m = NULL;
    CHECK_OK(mst_model_create(ctx, &c, 1, mem, &m));
    if (!m) return;
    mst_rng rng = {20240611};
    const int64_t W = c.seq + 2, H = c.hidden;
    int32_t tok[2 * 7];
    int used[256] = {0};
    for (int64_t i = 0; i < c.batch * W; i++) used[tok[i] = (int32_t)mst_rng_int(&rng, 32, 40)] = 1;
    /* norm weights away from 1 so their gradients are not a special case */
    const int64_t nn = m->n_params - m->n_decay;
    uint16_t* nw = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)nn);
    mst_rng_bf16(&rng, nw, (size_t)nn, 0.2);
    for (int64_t i = 0; i < nn; i++) nw[i] = mst_fp32_to_bf16(1.0f + mst_bf16_to_fp32(nw[i]));
    CHECK_OK(mst_copy_h2b(ctx, m->w + m->n_decay, nw, sizeof(uint16_t) * (size_t)nn));
    free(nw);
    const float hyper[MST_N_HYPER] = {0.0f, 1.0f, 1.0f};
    CHECK_OK(mst_model_stage(m, 0, tok, hyper));
    CHECK_OK(mst_model_upload(m, 0));
    CHECK_OK(mst_model_step(m, 1));
    CHECK_OK(mst_ctx_check(ctx));
    float* grad = (float*)malloc(sizeof(float) * (size_t)m->n_params);
    uint16_t* w16 = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)m->n_params);
    double* w = (double*)malloc(sizeof(double) * (size_t)m->n_params);
    CHECK_OK(mst_copy_b2h(ctx, grad, m->grad, sizeof(float) * (size_t)m->n_params));
    CHECK_OK(mst_copy_b2h(ctx, w16, m->w, sizeof(uint16_t) * (size_t)m->n_params));
    for (int64_t i = 0; i < m->n_params; i++) w[i] = mst_bf16_to_fp32(w16[i]);
    const int64_t NK = c.batch * c.seq * c.top_k;
    int32_t* route = (int32_t*)malloc(sizeof(int32_t) * (size_t)((c.layers + 1) * NK));
    float* logits = (float*)malloc(sizeof(float) * (size_t)((c.layers + 1) * NK / c.top_k * c.experts));
    ref_route seen[8];
    for (int32_t l = 0; l <= c.layers; l++) seen[l] = (ref_route){0, 0, INFINITY, 0};
    read_routing(ctx, m, mem, tok, hyper, route, logits);
    /* the loss itself: model (fp32 sums of bf16 activations) vs float64 */
    ref R = {m, w, tok, route, logits, seen};
    float lm[10], lt[10], aux[3];
    CHECK_OK(mst_copy_b2h(ctx, lm, m->loss_main, sizeof lm));
    CHECK_OK(mst_copy_b2h(ctx, lt, m->loss_mtp, sizeof lt));
    CHECK_OK(mst_copy_b2h(ctx, aux, m->aux_sum, sizeof aux));
    double got = 0;
    for (int i = 0; i < 10; i++) got += (lm[i] + c.mtp_weight * lt[i]) / 10.0;
    got += (double)aux[0] + aux[1] + aux[2];
    double want = ref_loss(&R);
    R.seen = NULL;
    check_routing(&c, seen, label);
    CHECK(fabs(got - want) < 1e-2 * fabs(want), "loss %.6f vs float64 reference %.6f", got, want);
    const mst_layer_params* L0 = &m->lp[0];
    const mst_layer_params* L1 = &m->lp[1];
    const mst_layer_params* LM = &m->lp[c.layers];
    const int64_t E = c.experts, F = c.ffn, D = c.head_dim, Wq = (c.n_head + 2 * c.n_kv_head) * D, HO = c.n_head * D;
    pkind kinds[] = {
        {"embedding", m->emb, c.vocab * H},   {"mtp projection", m->proj, 2 * H * H},
        {"wqkv[0]", L0->wqkv, Wq * H},        {"wo[0]", L0->wo, H * HO},
        {"router[0]", L0->wr, E * H},         {"w1[0]", L0->w1, E * 2 * F * H},
        {"w2[0]", L0->w2, E * H * F},         {"ln1[0]", L0->ln1, H},
        {"q_norm[0]", L0->q_norm, D},         {"k_norm[0]", L0->k_norm, D},
        {"ln2[0]", L0->ln2, H},               {"wqkv[1]", L1->wqkv, Wq * H},
        {"router[1]", L1->wr, E * H},         {"w1[1]", L1->w1, E * 2 * F * H},
        {"wqkv[mtp]", LM->wqkv, Wq * H},      {"wo[mtp]", LM->wo, H * HO},
        {"router[mtp]", LM->wr, E * H},       {"w1[mtp]", LM->w1, E * 2 * F * H},
        {"w2[mtp]", LM->w2, E * H * F},       {"ln1[mtp]", LM->ln1, H},
        {"q_norm[mtp]", LM->q_norm, D},       {"k_norm[mtp]", LM->k_norm, D},
        {"ln2[mtp]", LM->ln2, H},             {"final norm", m->lnf, H},
        {"mtp norm (embedding)", m->ln_e, H}, {"mtp norm (hidden)", m->ln_h, H},
        {"mtp final norm", m->ln_mf, H},      {"lm_head (untied)", m->head, c.vocab * H},
    };
    const size_t n_kinds = sizeof kinds / sizeof *kinds - (c.tie_embeddings ? 1 : 0);
    for (size_t k = 0; k < n_kinds; k++) {
        double err = check_kind(&R, w, grad, &kinds[k], &rng, k == 0 ? used : NULL, H);
        printf("    %-22s rel err %.2e\n", kinds[k].name, err);
        CHECK(err < 5e-2, "%s, %s: gradient rel err %.3e vs float64 finite differences", label, kinds[k].name, err);
    }
    free(route);
    free(logits);
    free(grad);
    free(w16);
    free(w);
    mst_model_destroy(m);
}

static void run(mst_ctx_t* ctx) {
    check_model(ctx, NULL, (grad_case){2, 1, 8, 1, 1}, "every activation kept");
    check_model(ctx, NULL, (grad_case){4, 2, 6, 0, 0}, "every activation kept");
    mst_mem_config full = mst_mem_config_default();
    full.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_UNIFORM, 2};
    full.recompute_mtp = 1;
    check_model(ctx, &full, (grad_case){4, 1, 4, 0, 1}, "whole-layer recompute uniform:2 (MTP layer included)");
    mst_mem_config block = mst_mem_config_default();
    block.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_BLOCK, 1};
    block.recompute_mtp = 1;
    CHECK_OK(mst_policy_spec_parse("stash", block.policy.name));
    check_model(ctx, &block, (grad_case){2, 2, 8, 1, 1}, "whole-layer recompute block:1 + --recompute-mtp, stash");
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
