/*
 * forward.c — one microbatch through the whole model, forward then backward:
 * embedding, L layers, final norm and the tied output head (loss on the next
 * token), and the MTP module (seed 004): norms of the next token's embedding
 * and of the last hidden state, their concatenation projected 2H -> H, one
 * transformer layer, its own final norm, the shared head, loss on the token
 * after next weighted by --mtp-weight.
 */
#include <string.h>

#include "moe.h"
#include "ops.h"

static mst_status upload_tokens(mst_model* m, const int32_t* host_tok) {
    const mst_model_config* c = &m->cfg;
    const int64_t T = c->seq, N = c->batch * T, V = c->vocab;
    int32_t* t = (int32_t*)malloc(sizeof(int32_t) * 3 * (size_t)N);
    if (!t) return mst_set_error(MST_ERR_OOM, "token staging");
    for (int64_t b = 0; b < c->batch; b++)
        for (int64_t i = 0; i < T; i++)
            for (int j = 0; j < 3; j++) {
                int32_t v = host_tok[b * (T + 2) + i + j];
                if (v < 0 || v >= V) {
                    free(t);
                    return mst_set_error(MST_ERR_INVALID, "token %d at [%lld, %lld] is outside [0, %lld)",
                                         v, (long long)b, (long long)(i + j), (long long)V);
                }
                t[j * N + b * T + i] = v;
            }
    mst_status st = mst_copy_h2b(m->ctx, m->tok, t, sizeof(int32_t) * 3 * (size_t)N);
    free(t);
    return st;
}

/* logits = x emb^T, then cross-entropy forward and backward into dl. */
static mst_status head_forward(mst_model* m, const uint16_t* x, const int32_t* targets,
                               float scale, float* loss, uint16_t* dl) {
    const mst_model_config* c = &m->cfg;
    const int64_t N = c->batch * c->seq;
    MST_TRY(mst_op_linear(m->ctx, N, c->hidden, c->vocab, x, m->w + m->emb, m->logits, 0));
    mst_xent_args a = {.rows = N, .vocab = c->vocab, .scale = scale, .logits = m->logits,
                       .targets = targets, .loss = loss, .dlogits = dl};
    return MST_MODEL_OP(m->ctx, xent, &a);
}

/* d(x) [N, H] = dl emb; g(emb) += dl^T x. */
static mst_status head_backward(mst_model* m, const uint16_t* dl, const uint16_t* x, uint16_t* dx) {
    const mst_model_config* c = &m->cfg;
    const int64_t N = c->batch * c->seq;
    MST_TRY(mst_op_linear_wgrad(m->ctx, N, c->hidden, c->vocab, dl, x, m->grad + m->emb, c->hidden));
    return mst_op_linear_dgrad(m->ctx, N, c->hidden, c->vocab, dl, m->w + m->emb, c->hidden, dx);
}

static mst_status embed(mst_model* m, const int32_t* tok, uint16_t* x) {
    const mst_model_config* c = &m->cfg;
    mst_embed_args a = {.n_tok = c->batch * c->seq, .vocab = c->vocab, .cols = c->hidden,
                        .tokens = tok, .table = m->w + m->emb, .x = x};
    return MST_MODEL_OP(m->ctx, embed_forward, &a);
}

static mst_status embed_bwd(mst_model* m, const int32_t* tok, const uint16_t* dx) {
    const mst_model_config* c = &m->cfg;
    mst_embed_args a = {.n_tok = c->batch * c->seq, .vocab = c->vocab, .cols = c->hidden,
                        .tokens = tok, .dx = dx, .dtable = m->grad + m->emb};
    return MST_MODEL_OP(m->ctx, embed_backward, &a);
}

static mst_status forward(mst_model* m, int32_t micro) {
    const mst_model_config* c = &m->cfg;
    mst_ctx_t* ctx = m->ctx;
    const int64_t N = c->batch * c->seq, H = c->hidden, L = c->layers;
    const float inv = 1.0f / (float)(N * m->n_micro);
    MST_TRY(embed(m, m->tok, m->x0));
    const uint16_t* h = m->x0;
    for (int32_t l = 0; l < L; l++) {
        MST_TRY(mst_layer_forward(m, l, h));
        h = m->acts[l].out;
    }
    MST_TRY(mst_op_norm(ctx, N, H, c->norm_eps, h, m->w + m->lnf, m->xf, m->rstdf));
    MST_TRY(head_forward(m, m->xf, m->tok + N, inv, m->loss_main + micro * N, m->dl_main));
    /* MTP: p = [norm_e(emb(next)) | norm_h(h)] Wproj^T */
    MST_TRY(embed(m, m->tok + N, m->e1));
    MST_TRY(mst_op_norm(ctx, N, H, c->norm_eps, m->e1, m->w + m->ln_e, m->ne, m->rstd_e));
    MST_TRY(mst_op_norm(ctx, N, H, c->norm_eps, h, m->w + m->ln_h, m->nh, m->rstd_h));
    mst_mm_args pe = {.trans_b = 1, .m = N, .n = H, .k = H, .a = m->ne, .lda = H,
                      .b = m->w + m->proj, .ldb = 2 * H, .c16 = m->p, .ldc = H};
    MST_TRY(MST_MODEL_OP(ctx, mm, &pe));
    mst_mm_args ph = pe;
    ph.a = m->nh;
    ph.b = m->w + m->proj + H;
    ph.accumulate = 1;
    MST_TRY(MST_MODEL_OP(ctx, mm, &ph));
    MST_TRY(mst_layer_forward(m, (int32_t)L, m->p));
    MST_TRY(mst_op_norm(ctx, N, H, c->norm_eps, m->acts[L].out, m->w + m->ln_mf, m->mf, m->rstd_mf));
    MST_TRY(head_forward(m, m->mf, m->tok + 2 * N, c->mtp_weight * inv, m->loss_mtp + micro * N, m->dl_mtp));
    for (int32_t l = 0; l <= L; l++)
        MST_TRY(mst_copy_b2b(ctx, m->aux_sum + micro * (L + 1) + l, m->acts[l].aux, sizeof(float)));
    return MST_OK;
}

static mst_status backward(mst_model* m) {
    const mst_model_config* c = &m->cfg;
    mst_ctx_t* ctx = m->ctx;
    const int64_t N = c->batch * c->seq, H = c->hidden, L = c->layers;
    const uint16_t* h = m->acts[L - 1].out;
    /* MTP head and layer */
    MST_TRY(head_backward(m, m->dl_mtp, m->mf, m->t3));
    MST_TRY(mst_op_norm_bwd(ctx, N, H, m->acts[L].out, m->w + m->ln_mf, m->rstd_mf, m->t3, m->dm,
                            m->grad + m->ln_mf));
    MST_TRY(mst_layer_backward(m, (int32_t)L, m->dm));
    /* projection: d(ne), d(nh) and g(Wproj) halves */
    MST_TRY(mst_op_linear_wgrad(ctx, N, H, H, m->dm, m->ne, m->grad + m->proj, 2 * H));
    MST_TRY(mst_op_linear_wgrad(ctx, N, H, H, m->dm, m->nh, m->grad + m->proj + H, 2 * H));
    MST_TRY(mst_op_linear_dgrad(ctx, N, H, H, m->dm, m->w + m->proj, 2 * H, m->t3));
    MST_TRY(mst_op_norm_bwd(ctx, N, H, m->e1, m->w + m->ln_e, m->rstd_e, m->t3, m->t1, m->grad + m->ln_e));
    MST_TRY(embed_bwd(m, m->tok + N, m->t1));
    MST_TRY(mst_op_linear_dgrad(ctx, N, H, H, m->dm, m->w + m->proj + H, 2 * H, m->t3));
    MST_TRY(mst_op_norm_bwd(ctx, N, H, h, m->w + m->ln_h, m->rstd_h, m->t3, m->dh, m->grad + m->ln_h));
    /* main head */
    MST_TRY(head_backward(m, m->dl_main, m->xf, m->t3));
    MST_TRY(mst_op_norm_bwd(ctx, N, H, h, m->w + m->lnf, m->rstdf, m->t3, m->t1, m->grad + m->lnf));
    MST_TRY(mst_op_add(ctx, N * H, m->dh, m->t1, m->dh));
    for (int32_t l = (int32_t)L - 1; l >= 0; l--) MST_TRY(mst_layer_backward(m, l, m->dh));
    return embed_bwd(m, m->tok, m->dh);
}

mst_status mst_model_forward_backward(mst_model* m, const int32_t* host_tok, int32_t micro) {
    if (micro < 0 || micro >= m->n_micro)
        return mst_set_error(MST_ERR_INVALID, "microbatch %d: expected 0 .. %d", micro, m->n_micro - 1);
    MST_TRY(upload_tokens(m, host_tok));
    MST_TRY(forward(m, micro));
    return backward(m);
}
