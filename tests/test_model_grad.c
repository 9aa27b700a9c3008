/*
 * test_model_grad.c — the model's gradients (bf16 weights and activations,
 * fp32 main_grad) against central finite differences of the loss computed by
 * a float64 reference model on the host, for sampled elements of every
 * parameter kind: embedding (input, tied head, MTP next-token input), norms,
 * attention (Wqkv, Wo), router, experts (W1, W2), the MTP projection, of the
 * main layer and of the MTP layer.
 *
 * Tolerance 5e-2 (relative norm error over 24 sampled elements per tensor):
 * the model stores every activation and activation gradient in bf16 (each
 * store rounds by up to 2^-9 relative) and a gradient passes some 20 such
 * stores between the loss and a weight, while the reference is float64
 * throughout; measured errors are 0.4e-2 .. 3e-2. A wrong term is far
 * outside: dropping the load-balancing gradient (aux_coef 0.1 here so that it
 * matters) gives 0.1 .. 1.0 on most tensors.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/model/model.h"

/* ---- float64 reference model (same layout as the model's flat buffer) ---- */

typedef struct ref {
    const mst_model* m;     /* layout and config only */
    const double* w;        /* [n_params] */
    const int32_t* tok;     /* [B, T+2] */
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

/* mean over rows of the cross-entropy of x emb^T against targets */
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
                for (int64_t i = 0; i < H; i++) a += xr[i] * R->w[R->m->emb + v * H + i];
                lg[v] = a;
                mx = fmax(mx, a);
            }
            for (int64_t v = 0; v < V; v++) s += exp(lg[v] - mx);
            total += log(s) + mx - lg[R->tok[b * (T + 2) + t + j]];
        }
    free(lg);
    return total / (double)(c->batch * T);
}

static void ref_attention(const ref* R, const double* qkv, double* out) {
    const mst_model_config* c = &R->m->cfg;
    const int64_t T = c->seq, H = c->hidden, NH = c->n_head, D = H / NH;
    double* p = (double*)malloc(sizeof(double) * (size_t)T);
    for (int64_t b = 0; b < c->batch; b++)
        for (int64_t h = 0; h < NH; h++)
            for (int64_t i = 0; i < T; i++) {
                const double* q = qkv + (b * T + i) * 3 * H + h * D;
                double mx = -INFINITY, s = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double* k = qkv + (b * T + j) * 3 * H + H + h * D;
                    double a = 0;
                    for (int64_t d = 0; d < D; d++) a += q[d] * k[d];
                    p[j] = a / sqrt((double)D);
                    mx = fmax(mx, p[j]);
                }
                for (int64_t j = 0; j <= i; j++) s += (p[j] = exp(p[j] - mx));
                for (int64_t d = 0; d < D; d++) {
                    double a = 0;
                    for (int64_t j = 0; j <= i; j++) a += p[j] / s * qkv[(b * T + j) * 3 * H + 2 * H + h * D + d];
                    out[(b * T + i) * H + h * D + d] = a;
                }
            }
    free(p);
}

/* The MoE block: softmax router, top-k, SwiGLU experts scaled by the prob,
 * summed; returns the load-balancing loss. x [N, H] -> y [N, H]. */
static double ref_moe(const ref* R, int32_t l, const double* x, double* y) {
    const mst_model_config* c = &R->m->cfg;
    const mst_layer_params* P = &R->m->lp[l];
    const int64_t N = c->batch * c->seq, H = c->hidden, F = c->ffn, E = c->experts, K = c->top_k;
    double* pr = (double*)malloc(sizeof(double) * (size_t)(N * E));
    double* hh = (double*)malloc(sizeof(double) * (size_t)(2 * F));
    double* z = (double*)malloc(sizeof(double) * (size_t)F);
    int64_t* load = (int64_t*)calloc((size_t)E, sizeof(int64_t));
    ref_linear(x, R->w + P->wr, N, H, E, H, pr, 0);
    memset(y, 0, sizeof(double) * (size_t)(N * H));
    for (int64_t t = 0; t < N; t++) {
        double* p = pr + t * E;
        double mx = -INFINITY, s = 0;
        for (int64_t e = 0; e < E; e++) mx = fmax(mx, p[e]);
        for (int64_t e = 0; e < E; e++) s += (p[e] = exp(p[e] - mx));
        for (int64_t e = 0; e < E; e++) p[e] /= s;
        int64_t chosen[64];
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t u = 0; u < k; u++) taken |= chosen[u] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            chosen[k] = best;
            load[best]++;
            ref_linear(x + t * H, R->w + P->w1 + best * 2 * F * H, 1, H, 2 * F, H, hh, 0);
            for (int64_t f = 0; f < F; f++) z[f] = hh[f] / (1 + exp(-hh[f])) * hh[F + f] * p[best];
            ref_linear(z, R->w + P->w2 + best * H * F, 1, F, H, F, y + t * H, 1);
        }
    }
    double aux = 0;
    for (int64_t e = 0; e < E; e++) {
        double pe = 0;
        for (int64_t t = 0; t < N; t++) pe += pr[t * E + e];
        aux += (double)load[e] / (double)(N * K) * pe / (double)N;
    }
    free(pr);
    free(hh);
    free(z);
    free(load);
    return c->aux_coef * (double)E * aux;
}

/* x [N, H] -> x + attn, then + MoE; returns the layer's aux loss. */
static double ref_layer(const ref* R, int32_t l, double* x) {
    const mst_model_config* c = &R->m->cfg;
    const mst_layer_params* P = &R->m->lp[l];
    const int64_t N = c->batch * c->seq, H = c->hidden;
    double* a = (double*)malloc(sizeof(double) * (size_t)(N * H));
    double* qkv = (double*)malloc(sizeof(double) * (size_t)(N * 3 * H));
    double* att = (double*)malloc(sizeof(double) * (size_t)(N * H));
    ref_norm(x, R->w + P->ln1, N, H, c->norm_eps, a);
    ref_linear(a, R->w + P->wqkv, N, H, 3 * H, H, qkv, 0);
    ref_attention(R, qkv, att);
    ref_linear(att, R->w + P->wo, N, H, H, H, x, 1);
    ref_norm(x, R->w + P->ln2, N, H, c->norm_eps, a);
    double aux = ref_moe(R, l, a, att);
    for (int64_t i = 0; i < N * H; i++) x[i] += att[i];
    free(a);
    free(qkv);
    free(att);
    return aux;
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
    double aux = 0;
    for (int32_t l = 0; l < c->layers; l++) aux += ref_layer(R, l, x);
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
    aux += ref_layer(R, c->layers, p);
    ref_norm(p, R->w + m->ln_mf, N, H, c->norm_eps, x);
    double mtp_loss = ref_head(R, x, 2);
    free(x);
    free(e);
    free(cat);
    free(p);
    free(ne);
    free(nh);
    return main_loss + c->mtp_weight * mtp_loss + aux;
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

/* The gradients of one model under the memory configuration mem (NULL:
 * every activation kept) against float64 finite differences. */
static void check_model(mst_ctx_t* ctx, const mst_mem_config* mem, const char* label) {
    printf("  %s\n", label);
    mst_model_config c = {.vocab = 256, .hidden = 16, .ffn = 8, .n_head = 2, .seq = 5, .batch = 2,
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
    /* the loss itself: model (fp32 sums of bf16 activations) vs float64 */
    ref R = {m, w, tok};
    float lm[10], lt[10], aux[3];
    CHECK_OK(mst_copy_b2h(ctx, lm, m->loss_main, sizeof lm));
    CHECK_OK(mst_copy_b2h(ctx, lt, m->loss_mtp, sizeof lt));
    CHECK_OK(mst_copy_b2h(ctx, aux, m->aux_sum, sizeof aux));
    double got = 0;
    for (int i = 0; i < 10; i++) got += (lm[i] + c.mtp_weight * lt[i]) / 10.0;
    got += (double)aux[0] + aux[1] + aux[2];
    double want = ref_loss(&R);
    CHECK(fabs(got - want) < 1e-2 * fabs(want), "loss %.6f vs float64 reference %.6f", got, want);
    const mst_layer_params* L0 = &m->lp[0];
    const mst_layer_params* L1 = &m->lp[1];
    const mst_layer_params* LM = &m->lp[c.layers];
    const int64_t E = c.experts, F = c.ffn;
    pkind kinds[] = {
        {"embedding", m->emb, c.vocab * H},   {"mtp projection", m->proj, 2 * H * H},
        {"wqkv[0]", L0->wqkv, 3 * H * H},     {"wo[0]", L0->wo, H * H},
        {"router[0]", L0->wr, E * H},         {"w1[0]", L0->w1, E * 2 * F * H},
        {"w2[0]", L0->w2, E * H * F},         {"ln1[0]", L0->ln1, H},
        {"ln2[0]", L0->ln2, H},               {"wqkv[1]", L1->wqkv, 3 * H * H},
        {"router[1]", L1->wr, E * H},         {"w1[1]", L1->w1, E * 2 * F * H},
        {"wqkv[mtp]", LM->wqkv, 3 * H * H},   {"wo[mtp]", LM->wo, H * H},
        {"router[mtp]", LM->wr, E * H},       {"w1[mtp]", LM->w1, E * 2 * F * H},
        {"w2[mtp]", LM->w2, E * H * F},       {"ln1[mtp]", LM->ln1, H},
        {"ln2[mtp]", LM->ln2, H},             {"final norm", m->lnf, H},
        {"mtp norm (embedding)", m->ln_e, H}, {"mtp norm (hidden)", m->ln_h, H},
        {"mtp final norm", m->ln_mf, H},
    };
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        double err = check_kind(&R, w, grad, &kinds[k], &rng, k == 0 ? used : NULL, H);
        printf("    %-22s rel err %.2e\n", kinds[k].name, err);
        CHECK(err < 5e-2, "%s, %s: gradient rel err %.3e vs float64 finite differences", label, kinds[k].name, err);
    }
    free(grad);
    free(w16);
    free(w);
    mst_model_destroy(m);
}

static void run(mst_ctx_t* ctx) {
    check_model(ctx, NULL, "every activation kept");
    mst_mem_config full = mst_mem_config_default();
    full.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_UNIFORM, 2};
    full.recompute_mtp = 1;
    check_model(ctx, &full, "whole-layer recompute uniform:2 (MTP layer included)");
    mst_mem_config block = mst_mem_config_default();
    block.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_BLOCK, 1};
    block.recompute_mtp = 1;
    block.policy = "stash";
    check_model(ctx, &block, "whole-layer recompute block:1 + --recompute-mtp, stash");
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
