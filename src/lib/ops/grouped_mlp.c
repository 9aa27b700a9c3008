/*
 * grouped_mlp.c — the grouped MLP (docs/DESIGN.md), forward and
 * backward side by side, on top of the grouped linear ops and the backend's
 * activation slots:
 *
 *   forward:  h = x W1[g]^T + b1[g]            (fc1, saved as act_input)
 *             z = act(h) * p                    (saved as fc2_input or recomputed)
 *             y = z W2[g]^T + b2[g] * p         (fc2)
 *   backward: dz = dy W2[g]                     (fc2 dgrad)
 *             dh, dprobs = d act(h, p) . dz     (+ dy . b2[g] in dprobs)
 *             dx = dh W1[g]                     (fc1 dgrad)
 *             dW2, db2 from (dy, z, p); dW1, db1 from (dh, x), through the mode
 *
 * Saved tensors go through the caller's mst_saver by name, each under its own
 * policy; act_input and fc2_input may be claimed (saver.claim): the
 * activation then writes them into their pages itself. Scratch (dz, dh, a
 * recomputed z) lives in the MLP workspaces of the context's ops state
 * (ops_state.h), sized by max_rows, so after the first call nothing is
 * allocated and the whole forward + backward can be captured in a graph.
 *
 * Shapes: E groups, R rows (max_rows), H hidden, F ffn.
 */
#include <math.h>
#include <string.h>

#include "ops_state.h"

mst_mlp_config mst_mlp_config_default(int32_t n_groups, int64_t hidden, int64_t ffn) {
    mst_mlp_config c = MST_MLP_CONFIG_INIT;
    c.n_groups = n_groups;
    c.hidden = hidden;
    c.ffn = ffn;
    c.act = MST_ACT_SWIGLU;
    c.clamp_limit = 7.0f;
    c.clamp_alpha = 1.702f;
    return c;
}

static int present(const mst_tensor* t) { return t->data != NULL; }

static mst_status check_config(const mst_mlp_config* cfg) {
    if (!cfg) return mst_set_error(MST_ERR_INVALID, "cfg is NULL");
    MST_TRY(MST_CHECK_STRUCT("cfg", cfg, mst_mlp_config));
    if (cfg->n_groups <= 0 || cfg->hidden <= 0 || cfg->ffn <= 0)
        return mst_set_error(MST_ERR_INVALID,
                             "cfg: n_groups = %d, hidden = %lld, ffn = %lld: all must be > 0",
                             cfg->n_groups, (long long)cfg->hidden, (long long)cfg->ffn);
    if (cfg->act != MST_ACT_SWIGLU && cfg->act != MST_ACT_CLAMPED_SWIGLU)
        return mst_set_error(MST_ERR_INVALID, "cfg->act = %d is not a mst_activation", (int)cfg->act);
    if (cfg->act == MST_ACT_CLAMPED_SWIGLU &&
        !(isfinite(cfg->clamp_limit) && cfg->clamp_limit > 0 && isfinite(cfg->clamp_alpha) &&
          cfg->clamp_alpha > 0))
        return mst_set_error(MST_ERR_INVALID,
                             "cfg: clamp_limit = %g, clamp_alpha = %g: both must be finite and > 0",
                             (double)cfg->clamp_limit, (double)cfg->clamp_alpha);
    return MST_OK;
}

static mst_status check_like(const mst_tensor* t, const char* name, mst_dtype dt, int64_t rows,
                             int64_t cols) {
    MST_TRY(mst_check_tensor(t, name, dt));
    return mst_check_shape(t, name, rows, cols);
}

/* An optional tensor (data NULL = absent) and its gradient: both or neither. */
static mst_status check_optional_pair(const mst_tensor* b, const char* bname,
                                      const mst_tensor* g, const char* gname, int64_t rows,
                                      int64_t cols, int with_grad) {
    if (present(b)) MST_TRY(check_like(b, bname, MST_DTYPE_BF16, rows, cols));
    if (!with_grad) return MST_OK;
    if (present(b) != present(g))
        return mst_set_error(MST_ERR_INVALID, "%s and %s go together: %s %s, %s %s", bname, gname,
                             bname, present(b) ? "given" : "absent", gname,
                             present(g) ? "given" : "absent");
    if (present(g)) MST_TRY(check_like(g, gname, MST_DTYPE_FP32, rows, cols));
    return MST_OK;
}

/* ctx, cfg, weights (and their grads when with_grad), counts, saver. */
static mst_status check_common(mst_ctx_t* ctx, const mst_mlp_config* cfg,
                               const mst_mlp_weights* w, const mst_tensor* counts,
                               const mst_saver* saver, int with_grad) {
    MST_TRY(mst_check_ctx(ctx));
    MST_TRY(check_config(cfg));
    if (saver) MST_TRY(MST_CHECK_STRUCT("saver", saver, mst_saver));
    if (!w) return mst_set_error(MST_ERR_INVALID, "w is NULL");
    const int64_t E = cfg->n_groups, H = cfg->hidden, F = cfg->ffn;
    MST_TRY(check_like(counts, "counts", MST_DTYPE_INT32, E, 1));
    MST_TRY(check_like(&w->w1, "w->w1", MST_DTYPE_BF16, E * 2 * F, H));
    MST_TRY(check_like(&w->w2, "w->w2", MST_DTYPE_BF16, E * H, F));
    MST_TRY(check_optional_pair(&w->b1, "w->b1", &w->g_b1, "w->g_b1", E, 2 * F, with_grad));
    MST_TRY(check_optional_pair(&w->b2, "w->b2", &w->g_b2, "w->g_b2", E, H, with_grad));
    if (with_grad) {
        MST_TRY(check_like(&w->g_w1, "w->g_w1", MST_DTYPE_FP32, E * 2 * F, H));
        MST_TRY(check_like(&w->g_w2, "w->g_w2", MST_DTYPE_FP32, E * H, F));
    }
    if (!saver || !saver->produce || !saver->commit || !saver->fetch || !saver->release)
        return mst_set_error(MST_ERR_INVALID, "saver is NULL or misses a function");
    return MST_OK;
}

/* ---- activation ----------------------------------------------------------- */

static mst_act_args act_args(const mst_mlp_config* cfg, const mst_tensor* counts,
                             const mst_tensor* h, const mst_tensor* probs) {
    mst_act_args a = {0};
    a.n_groups = cfg->n_groups;
    a.max_rows = h->rows;
    a.ffn = cfg->ffn;
    a.hidden = cfg->hidden;
    a.counts = (const int32_t*)counts->data;
    a.h = (const uint16_t*)h->data;
    if (h->pages) a.h_pages = *h->pages; /* a stashed act_input read in place */
    a.probs = (const float*)probs->data;
    a.act = cfg->act;
    a.limit = cfg->clamp_limit;
    a.alpha = cfg->clamp_alpha;
    return a;
}

/* z = act(h) * p: the forward (h and z also into the pages of h_out / z_out
 * when claimed), and the recompute of fc2_input in backward (no pages). */
static mst_status act_forward(mst_ctx_t* ctx, const mst_mlp_config* cfg, const mst_tensor* h,
                              const mst_tensor* probs, const mst_tensor* counts, const mst_pages* h_out,
                              const mst_pages* z_out, mst_tensor* z) {
    mst_act_args a = act_args(cfg, counts, h, probs);
    a.z = (uint16_t*)z->data;
    a.h_out = *h_out;
    a.z_out = *z_out;
    return MST_SLOT(ctx, ctx->be, act_forward, &a);
}

/* ---- saved tensors -------------------------------------------------------- */

static mst_status produce(const mst_saver* s, const mst_mlp_config* cfg, mst_saved_name n,
                          int64_t R, mst_tensor* out) {
    int64_t cols;
    mst_dtype dt;
    MST_TRY(mst_saved_shape(n, cfg->hidden, cfg->ffn, &cols, &dt));
    MST_TRY(s->produce(s->self, n, R, cols, dt, out));
    return check_like(out, mst_saved_name_str(n), dt, R, cols);
}

/* Fetches `n`; data NULL is allowed only where RECOMPUTE is (fc2_input),
 * pages where the readers take them: a wgrad's x (fc1_input, fc2_input)
 * and the activation (act_input). */
static mst_status fetch(const mst_saver* s, const mst_mlp_config* cfg, mst_saved_name n, int64_t R,
                        mst_tensor* out) {
    int64_t cols;
    mst_dtype dt;
    MST_TRY(mst_saved_shape(n, cfg->hidden, cfg->ffn, &cols, &dt));
    MST_TRY(s->fetch(s->self, n, out));
    if (n == MST_SAVED_FC2_INPUT && !out->data) return MST_OK;
    if (n == MST_SAVED_ACT_INPUT && out->pages) MST_TRY(mst_check_pages(out->pages, "act_input.pages"));
    mst_tensor v = *out;
    if (n != MST_SAVED_PROBS) v.pages = NULL; /* read by a wgrad (its check) or the activation (as pages) */
    return check_like(&v, mst_saved_name_str(n), dt, R, cols);
}

/* The pages the saver claims for `n` (table NULL: none), checked. */
static mst_status claim(const mst_saver* s, mst_saved_name n, const mst_tensor* counts, mst_pages* out) {
    memset(out, 0, sizeof *out);
    if (!s->claim) return MST_OK;
    MST_TRY(s->claim(s->self, n, counts, out));
    return out->table ? mst_check_pages(out, mst_saved_name_str(n)) : MST_OK;
}

/* ---- forward -------------------------------------------------------------- */

mst_status mst_grouped_mlp_forward(mst_ctx_t* ctx, const mst_mlp_config* cfg,
                                   const mst_mlp_weights* w, const mst_tensor* x,
                                   const mst_tensor* probs, const mst_tensor* counts,
                                   const mst_saver* saver, mst_tensor* y) {
    MST_TRY(check_common(ctx, cfg, w, counts, saver, 0));
    MST_TRY(mst_check_tensor(x, "x", MST_DTYPE_BF16));
    const int64_t R = x->rows;
    MST_TRY(check_like(x, "x", MST_DTYPE_BF16, R, cfg->hidden));
    MST_TRY(check_like(probs, "probs", MST_DTYPE_FP32, R, 1));
    MST_TRY(check_like(y, "y", MST_DTYPE_BF16, R, cfg->hidden));

    mst_tensor h, z;
    mst_pages h_out, z_out; /* the activation writes h and z into these too */
    MST_TRY(produce(saver, cfg, MST_SAVED_ACT_INPUT, R, &h));
    MST_TRY(produce(saver, cfg, MST_SAVED_FC2_INPUT, R, &z));
    /* the inputs first: a saver may take them and the claims in one go */
    MST_TRY(saver->commit(saver->self, MST_SAVED_FC1_INPUT, x, counts));
    MST_TRY(saver->commit(saver->self, MST_SAVED_PROBS, probs, counts));
    MST_TRY(claim(saver, MST_SAVED_ACT_INPUT, counts, &h_out));
    MST_TRY(claim(saver, MST_SAVED_FC2_INPUT, counts, &z_out));
    MST_TRY(mst_grouped_linear_forward(ctx, x, &w->w1, &w->b1, NULL, counts, &h));
    MST_TRY(saver->commit(saver->self, MST_SAVED_ACT_INPUT, &h, counts));
    MST_TRY(act_forward(ctx, cfg, &h, probs, counts, &h_out, &z_out, &z));
    MST_TRY(saver->commit(saver->self, MST_SAVED_FC2_INPUT, &z, counts));
    return mst_grouped_linear_forward(ctx, &z, &w->w2, &w->b2, probs, counts, y);
}

/* ---- backward ------------------------------------------------------------- */

/* A bf16 [R, cols] tensor in MLP workspace `slot` (MST_MLP_WS_*). */
static mst_status scratch(mst_ctx_t* ctx, int slot, int64_t R, int64_t cols, mst_tensor* out) {
    mst_ops_state* s;
    void* p;
    MST_TRY(mst_ops_state_of(ctx, &s));
    MST_TRY(mst_workspace(ctx, &s->mlp[slot], (size_t)R * (size_t)cols * 2, &p));
    *out = mst_tensor_make(p, MST_DTYPE_BF16, R, cols);
    return MST_OK;
}

static int in_mlp_workspace(const mst_ops_state* s, const void* p) {
    for (int i = 0; i < MST_N_MLP_WS; i++) {
        const char* b = (const char*)s->mlp[i].ptr;
        if (b && (const char*)p >= b && (const char*)p < b + s->mlp[i].n_bytes) return 1;
    }
    return 0;
}

/* A DEFERRED wgrad of an earlier backward may still read dh or a recomputed
 * z from the MLP workspace: it must be flushed before the workspace is reused. */
static mst_status check_workspace_free(const mst_ctx_t* ctx) {
    const mst_ops_state* s = ctx->ops;
    for (int i = 0; s && i < s->n_deferred; i++)
        if (in_mlp_workspace(s, s->deferred[i].x) || in_mlp_workspace(s, s->deferred[i].dy))
            return mst_set_error(MST_ERR_STATE,
                                 "deferred wgrad %d of an earlier grouped MLP backward still reads "
                                 "its scratch: call mst_wgrad_flush() first", i);
    return MST_OK;
}

static mst_status check_backward_io(const mst_mlp_config* cfg, const mst_tensor* dy,
                                    const mst_tensor* dx, const mst_tensor* dprobs,
                                    mst_wgrad_mode mode) {
    if (mode != MST_WGRAD_OVERWRITE && mode != MST_WGRAD_ACCUMULATE && mode != MST_WGRAD_DEFERRED)
        return mst_set_error(MST_ERR_INVALID, "mode = %d is not a mst_wgrad_mode", (int)mode);
    MST_TRY(mst_check_tensor(dy, "dy", MST_DTYPE_BF16));
    MST_TRY(check_like(dy, "dy", MST_DTYPE_BF16, dy->rows, cfg->hidden));
    MST_TRY(check_like(dx, "dx", MST_DTYPE_BF16, dy->rows, cfg->hidden));
    return check_like(dprobs, "dprobs", MST_DTYPE_FP32, dy->rows, 1);
}

/* The saved tensors of one backward: x, h, z (recomputed when data NULL), p. */
typedef struct mlp_saved {
    mst_tensor x; /* [R, H]  bf16 */
    mst_tensor h; /* [R, 2F] bf16 */
    mst_tensor z; /* [R, F]  bf16 */
    mst_tensor p; /* [R, 1]  fp32 */
} mlp_saved;

static mst_status fetch_all(mst_ctx_t* ctx, const mst_mlp_config* cfg, const mst_tensor* counts,
                            const mst_saver* s, int64_t R, mlp_saved* v) {
    MST_TRY(fetch(s, cfg, MST_SAVED_FC1_INPUT, R, &v->x));
    MST_TRY(fetch(s, cfg, MST_SAVED_ACT_INPUT, R, &v->h));
    MST_TRY(fetch(s, cfg, MST_SAVED_FC2_INPUT, R, &v->z));
    MST_TRY(fetch(s, cfg, MST_SAVED_PROBS, R, &v->p));
    if (v->z.data) return MST_OK;
    MST_TRY(scratch(ctx, MST_MLP_WS_Z, R, cfg->ffn, &v->z));
    const mst_pages none = {0};
    return act_forward(ctx, cfg, &v->h, &v->p, counts, &none, &none, &v->z); /* same kernel, same bits */
}

mst_status mst_grouped_mlp_backward(mst_ctx_t* ctx, const mst_mlp_config* cfg,
                                    const mst_mlp_weights* w, const mst_tensor* dy,
                                    const mst_tensor* counts, const mst_saver* saver,
                                    mst_tensor* dx, mst_tensor* dprobs, mst_wgrad_mode mode) {
    MST_TRY(check_common(ctx, cfg, w, counts, saver, 1));
    MST_TRY(check_backward_io(cfg, dy, dx, dprobs, mode));
    MST_TRY(check_workspace_free(ctx));
    const int64_t R = dy->rows, F = cfg->ffn;
    mlp_saved v;
    mst_tensor dz, dh;
    MST_TRY(fetch_all(ctx, cfg, counts, saver, R, &v));
    MST_TRY(scratch(ctx, MST_MLP_WS_DZ, R, F, &dz));
    MST_TRY(scratch(ctx, MST_MLP_WS_DH, R, 2 * F, &dh));

    /* dx first, so a caller can start its communication early; wgrads last. */
    MST_TRY(mst_grouped_linear_dgrad(ctx, dy, &w->w2, counts, &dz));
    mst_act_args a = act_args(cfg, counts, &v.h, &v.p);
    a.dz = (const uint16_t*)dz.data;
    a.dh = (uint16_t*)dh.data;
    a.dprobs = (float*)dprobs->data;
    if (present(&w->b2)) {
        a.dy = (const uint16_t*)dy->data;
        a.b2 = (const uint16_t*)w->b2.data;
    }
    MST_TRY(MST_SLOT(ctx, ctx->be, act_backward, &a));
    MST_TRY(mst_grouped_linear_dgrad(ctx, &dh, &w->w1, counts, dx));
    mst_tensor g_w1 = w->g_w1, g_b1 = w->g_b1, g_w2 = w->g_w2, g_b2 = w->g_b2; /* views */
    MST_TRY(mst_grouped_linear_wgrad(ctx, dy, &v.z, &v.p, NULL, counts, &g_w2, &g_b2, NULL, mode));
    MST_TRY(mst_grouped_linear_wgrad(ctx, &dh, &v.x, NULL, NULL, counts, &g_w1, &g_b1, NULL, mode));
    for (int n = 0; n < MST_N_SAVED; n++) MST_TRY(saver->release(saver->self, (mst_saved_name)n));
    return MST_OK;
}
