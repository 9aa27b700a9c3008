/*
 * forward.c — one training step's passes along the schedule: for each entry
 * (forward or backward of a chunk of layers for a microbatch) the layers of
 * the chunk, with the memory manager's savers. Around the layers: the
 * embedding (before layer 0), the final norm and the output head (loss
 * on the next token, after the last main layer L-1), and the MTP module
 * (docs/DESIGN.md, "The trainer") around layer L: norms of the next token's embedding and of the
 * last hidden state, their concatenation projected 2H -> H, the layer, its
 * own final norm, the shared head, loss on the token after next weighted by
 * --mtp-weight. A layer in a recompute chunk is rerun from its kept input
 * just before the backward of the chunk's last layer. The host stages the
 * step's static inputs (tokens, AdamW values) and uploads them before the
 * step; the step itself reads them from backend memory only.
 */
#include <string.h>

#include "moe.h"
#include "ops.h"
#include "overlap.h"

mst_status mst_model_stage(mst_model* m, int slot, const int32_t* host_tok, const float hyper[MST_N_HYPER]) {
    const mst_model_config* c = &m->cfg;
    const int64_t T = c->seq, N = c->batch * T, V = c->vocab;
    if (slot < 0 || slot > 1) return mst_set_error(MST_ERR_INVALID, "slot = %d: expected 0 or 1", slot);
    int32_t* t = (int32_t*)m->staging[slot]; /* [M, 3, N] */
    for (int32_t mb = 0; mb < m->n_micro; mb++)
        for (int64_t b = 0; b < c->batch; b++)
            for (int64_t i = 0; i < T; i++)
                for (int j = 0; j < 3; j++) {
                    int32_t v = host_tok[(mb * c->batch + b) * (T + 2) + i + j];
                    if (v < 0 || v >= V)
                        return mst_set_error(MST_ERR_INVALID, "token %d of microbatch %d at [%lld, %lld] is outside [0, %lld)",
                                             v, mb, (long long)b, (long long)(i + j), (long long)V);
                    t[(mb * 3 + j) * N + b * T + i] = v;
                }
    memcpy(t + m->n_micro * 3 * N, hyper, sizeof(float) * MST_N_HYPER);
    return MST_OK;
}

mst_status mst_model_upload(mst_model* m, int slot) {
    mst_ctx_t* ctx = m->ctx;
    if (slot < 0 || slot > 1) return mst_set_error(MST_ERR_INVALID, "slot = %d: expected 0 or 1", slot);
    if (!ctx->be->copy_async) return mst_copy_h2b(ctx, m->inputs, m->staging[slot], m->inputs_bytes);
    return ctx->be->copy_async(ctx, m->inputs, m->staging[slot], m->inputs_bytes, MST_COPY_H2B);
}

static int64_t n_tok(const mst_model* m) { return m->cfg.batch * m->cfg.seq; }

/* logits = x head^T, then cross-entropy forward and backward into dl. */
static mst_status head_forward(mst_model* m, const uint16_t* x, const int32_t* targets, float scale,
                               float* loss, uint16_t* dl) {
    const mst_model_config* c = &m->cfg;
    MST_TRY(mst_op_linear(m, n_tok(m), c->hidden, c->vocab, x, m->w + m->head, m->logits));
    mst_xent_args a = {.rows = n_tok(m), .vocab = c->vocab, .scale = scale, .logits = m->logits,
                       .targets = targets, .loss = loss, .dlogits = dl};
    return MST_MODEL_OP(m, xent, &a);
}

/* dx [N, H] = dl head; g(head) += dl^T x (the embedding's when tied). */
static mst_status head_backward(mst_model* m, const uint16_t* dl, const uint16_t* x, uint16_t* dx) {
    const mst_model_config* c = &m->cfg;
    MST_TRY(mst_op_linear_wgrad(m, n_tok(m), c->hidden, c->vocab, dl, x, m->grad + m->head, c->hidden));
    return mst_op_linear_dgrad(m, n_tok(m), c->hidden, c->vocab, dl, m->w + m->head, c->hidden, dx);
}

static mst_status embed(mst_model* m, const int32_t* tok, uint16_t* x) {
    const mst_model_config* c = &m->cfg;
    mst_embed_args a = {.n_tok = n_tok(m), .vocab = c->vocab, .cols = c->hidden, .tokens = tok,
                        .table = m->w + m->emb, .x = x};
    return MST_MODEL_OP(m, embed_forward, &a);
}

static mst_status embed_bwd(mst_model* m, const int32_t* tok, const uint16_t* dx) {
    const mst_model_config* c = &m->cfg;
    mst_embed_args a = {.n_tok = n_tok(m), .vocab = c->vocab, .cols = c->hidden, .tokens = tok,
                        .dx = dx, .dtable = m->grad + m->emb, .order = m->emb_order};
    return MST_MODEL_OP(m, embed_backward, &a);
}

/* d(mean loss over the tokens of every rank) / d(one token's loss) */
static float loss_scale(const mst_model* m) { return 1.0f / (float)(n_tok(m) * m->n_micro * m->dist.world); }

/* After the last main layer: final norm, head, loss on the next tokens. */
static mst_status main_head(mst_model* m, int32_t mb) {
    mst_micro* u = &m->micro[mb];
    const uint16_t* h = u->acts[m->cfg.layers - 1].out;
    MST_TRY(mst_op_norm(m, n_tok(m), m->cfg.hidden, m->cfg.norm_eps, h, m->w + m->lnf, u->xf, u->rstdf));
    return head_forward(m, u->xf, u->tok + n_tok(m), loss_scale(m), m->loss_main + mb * n_tok(m), u->dl_main);
}

/* MTP input: p = [norm_e(emb(next)) | norm_h(h)] Wproj^T; the embedding of
 * the next tokens (e1) too when `embed_next` (not on a recompute: e1 and h,
 * the module's two inputs, are kept). */
static mst_status mtp_input(mst_model* m, int32_t mb, int embed_next) {
    mst_micro* u = &m->micro[mb];
    const int64_t N = n_tok(m), H = m->cfg.hidden;
    const float eps = m->cfg.norm_eps;
    if (embed_next) MST_TRY(embed(m, u->tok + N, u->e1));
    MST_TRY(mst_op_norm(m, N, H, eps, u->e1, m->w + m->ln_e, u->ne, u->rstd_e));
    MST_TRY(mst_op_norm(m, N, H, eps, u->acts[m->cfg.layers - 1].out, m->w + m->ln_h, u->nh, u->rstd_h));
    mst_mm_args pe = {.trans_b = 1, .m = N, .n = H, .k = H, .a = u->ne, .lda = H, .b = m->w + m->proj,
                      .ldb = 2 * H, .c16 = u->p, .ldc = H};
    MST_TRY(MST_MODEL_OP(m, mm, &pe));
    pe.a = u->nh;
    pe.b = m->w + m->proj + H;
    pe.accumulate = 1;
    return MST_MODEL_OP(m, mm, &pe);
}

static mst_status mtp_head(mst_model* m, int32_t mb) {
    mst_micro* u = &m->micro[mb];
    const int64_t N = n_tok(m);
    MST_TRY(mst_op_norm(m, N, m->cfg.hidden, m->cfg.norm_eps, u->acts[m->cfg.layers].out, m->w + m->ln_mf,
                        u->mf, u->rstd_mf));
    return head_forward(m, u->mf, u->tok + 2 * N, m->cfg.mtp_weight * loss_scale(m), m->loss_mtp + mb * N,
                        u->dl_mtp);
}

static const uint16_t* layer_input(const mst_model* m, const mst_micro* u, int32_t l) {
    return l == 0 ? u->x0 : l == m->cfg.layers ? u->p : u->acts[l - 1].out;
}

/* Local layers [first, first + layers_per_chunk) of the stage (the memory
 * manager's indices; model layer l = mst_model_global). */
static mst_status forward_chunk(mst_model* m, int32_t chunk, int32_t mb) {
    const int32_t L = m->cfg.layers, first = chunk * m->layers_per_chunk;
    mst_micro* u = &m->micro[mb];
    for (int32_t i = first; i < first + m->layers_per_chunk; i++) {
        const int32_t l = mst_model_global(m, i);
        const mst_saver* sv;
        MST_TRY(mst_memmgr_forward(m->mm, i, mb, &sv));
        if (l == 0) MST_TRY(embed(m, u->tok, u->x0));
        if (l == L) MST_TRY(mtp_input(m, mb, m->stages == 1)); /* P > 1: e1 came from stage 0 */
        MST_TRY(mst_layer_forward(m, l, &u->acts[l], layer_input(m, u, l), sv));
        if (l == L - 1) MST_TRY(main_head(m, mb));
        if (l == L) MST_TRY(mtp_head(m, mb));
    }
    return MST_OK;
}

/* MTP backward around layer L: head and norm, the layer, the projection;
 * d(h) starts here (u->dh), d(next-token embedding) goes to the table. */
static mst_status mtp_backward(mst_model* m, int32_t mb, const mst_saver* sv) {
    mst_micro* u = &m->micro[mb];
    const int32_t L = m->cfg.layers;
    const int64_t N = n_tok(m), H = m->cfg.hidden;
    MST_TRY(head_backward(m, u->dl_mtp, u->mf, m->t3));
    MST_TRY(mst_op_norm_bwd(m, N, H, u->acts[L].out, m->w + m->ln_mf, u->rstd_mf, m->t3, m->dm, m->grad + m->ln_mf));
    MST_TRY(mst_layer_backward(m, L, &u->acts[L], sv, m->dm));
    MST_TRY(mst_op_linear_wgrad(m, N, H, H, m->dm, u->ne, m->grad + m->proj, 2 * H));
    MST_TRY(mst_op_linear_wgrad(m, N, H, H, m->dm, u->nh, m->grad + m->proj + H, 2 * H));
    MST_TRY(mst_op_linear_dgrad(m, N, H, H, m->dm, m->w + m->proj, 2 * H, m->t3));
    /* P > 1: d(e1) goes back to stage 0, which adds it into the table's gradient */
    uint16_t* de1 = m->stages > 1 ? u->de1 : m->t1;
    MST_TRY(mst_op_norm_bwd(m, N, H, u->e1, m->w + m->ln_e, u->rstd_e, m->t3, de1, m->grad + m->ln_e));
    if (m->stages == 1) MST_TRY(embed_bwd(m, u->tok + N, de1));
    MST_TRY(mst_op_linear_dgrad(m, N, H, H, m->dm, m->w + m->proj + H, 2 * H, m->t3));
    return mst_op_norm_bwd(m, N, H, u->acts[L - 1].out, m->w + m->ln_h, u->rstd_h, m->t3, u->dh, m->grad + m->ln_h);
}

/* Main head backward: d(h) += norm_f'(head'(dl)). */
static mst_status main_head_backward(mst_model* m, int32_t mb) {
    mst_micro* u = &m->micro[mb];
    const int64_t N = n_tok(m), H = m->cfg.hidden;
    MST_TRY(head_backward(m, u->dl_main, u->xf, m->t3));
    MST_TRY(mst_op_norm_bwd(m, N, H, u->acts[m->cfg.layers - 1].out, m->w + m->lnf, u->rstdf, m->t3, m->t1,
                            m->grad + m->lnf));
    return mst_op_add(m, N * H, u->dh, m->t1, u->dh);
}

/* Reruns the forward of recompute chunk [cs, last] (local layers) from the kept inputs;
 * with whole-layer recompute, the MTP layer with its module (norms,
 * projection before it; final norm and head after it: the head's loss is
 * written again with the same bits). */
static mst_status rerun(mst_model* m, int32_t cs, int32_t last, int32_t mb) {
    mst_micro* u = &m->micro[mb];
    const int32_t L = m->cfg.layers;
    for (int32_t i = cs; i <= last; i++) {
        const int32_t l = mst_model_global(m, i);
        const mst_saver* sv;
        MST_TRY(mst_memmgr_recompute(m->mm, i, mb, &sv));
        if (l == L && m->full) MST_TRY(mtp_input(m, mb, 0));
        MST_TRY(mst_layer_forward(m, l, &u->acts[l], layer_input(m, u, l), sv));
        if (l == L && m->full) MST_TRY(mtp_head(m, mb));
    }
    return MST_OK;
}

/* entry: the schedule entry (the chunk's last backward starts its layers'
 * sums: overlap.c). */
static mst_status backward_chunk(mst_model* m, int32_t chunk, int32_t mb, int32_t entry) {
    const int32_t L = m->cfg.layers, first = chunk * m->layers_per_chunk, top = first + m->layers_per_chunk - 1;
    mst_micro* u = &m->micro[mb];
    /* stage 0 of P > 1: the MTP module's d(e1) first, where one stage adds it */
    if (m->stages > 1 && m->stage == 0 && first == 0) MST_TRY(embed_bwd(m, u->tok + n_tok(m), u->de1));
    for (int32_t i = top; i >= first; i--) {
        const int32_t l = mst_model_global(m, i);
        int32_t cs = mst_memmgr_recompute_chunk(m->mm, i);
        if (cs >= 0 && (i == top || mst_memmgr_recompute_chunk(m->mm, i + 1) != cs)) MST_TRY(rerun(m, cs, i, mb));
        const mst_saver* sv;
        MST_TRY(mst_memmgr_backward(m->mm, i, mb, &sv));
        if (l == L) {
            MST_TRY(mtp_backward(m, mb, sv));
        } else {
            if (l == L - 1) MST_TRY(main_head_backward(m, mb));
            MST_TRY(mst_layer_backward(m, l, &u->acts[l], sv, u->dh));
            if (l == 0) MST_TRY(embed_bwd(m, u->tok, u->dh));
        }
        MST_TRY(mst_overlap_layer_done(m, entry, chunk, l));
        /* the layer's share of the load-balancing loss, from its backward */
        MST_TRY(mst_copy_b2b(m->ctx, m->aux_sum + mb * (L + 1) + l, u->acts[l].aux, sizeof(float)));
    }
    return MST_OK;
}

mst_status mst_model_step(mst_model* m, int measuring) {
    MST_TRY(mst_optim_zero(m));
    MST_TRY(mst_memmgr_step_begin(m->mm, measuring));
    for (int32_t i = 0; i < m->n_sched; i++) {
        const mst_sched_entry e = m->sched[i];
        MST_TRY(mst_stage_before(m, i)); /* P > 1: what crosses stages (stage.c) */
        MST_TRY(e.backward ? backward_chunk(m, e.chunk, e.microbatch, i) : forward_chunk(m, e.chunk, e.microbatch));
        MST_TRY(mst_stage_after(m, i));
        if (m->after_entry) MST_TRY(m->after_entry(m, i, m->after_entry_user));
    }
    return mst_memmgr_step_end(m->mm);
}
