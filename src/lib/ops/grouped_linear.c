/*
 * grouped_linear.c — the backend-independent grouped linear: argument checks
 * (each failure names the argument and its value), dispatch to the backend,
 * and the DEFERRED wgrad queue flushed by mst_wgrad_flush().
 *
 * Shapes: E groups (counts.rows), R rows (max_rows), I in, O out.
 */
#include <string.h>

#include "ops_state.h"

/* counts [E, 1] int32; fills a->n_groups. */
static mst_status check_counts(const mst_tensor* counts, mst_gl_args* a) {
    MST_TRY(mst_check_tensor(counts, "counts", MST_DTYPE_INT32));
    if (counts->cols != 1)
        return mst_set_error(MST_ERR_INVALID, "counts has %lld columns, expected 1",
                             (long long)counts->cols);
    if (counts->rows > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "counts has %lld groups", (long long)counts->rows);
    a->n_groups = (int32_t)counts->rows;
    a->counts = (const int32_t*)counts->data;
    return MST_OK;
}

/* w [E*O, I] bf16; fills a->out and checks a->in. */
static mst_status check_weight(const mst_tensor* w, mst_gl_args* a) {
    MST_TRY(mst_check_tensor(w, "w", MST_DTYPE_BF16));
    if (w->rows % a->n_groups != 0)
        return mst_set_error(MST_ERR_INVALID, "w has %lld rows, not a multiple of E = %d",
                             (long long)w->rows, a->n_groups);
    a->out = w->rows / a->n_groups;
    if (w->cols != a->in)
        return mst_set_error(MST_ERR_INVALID, "w has %lld columns, expected in = %lld",
                             (long long)w->cols, (long long)a->in);
    a->w = (const uint16_t*)w->data;
    return MST_OK;
}

/* An optional tensor: NULL (or NULL data) means absent. */
static int present(const mst_tensor* t) { return t && t->data; }

static mst_status check_optional(const mst_tensor* t, const char* name, mst_dtype dt,
                                 int64_t rows, int64_t cols) {
    MST_TRY(mst_check_tensor(t, name, dt));
    return mst_check_shape(t, name, rows, cols);
}

mst_status mst_grouped_linear_forward(mst_ctx_t* ctx, const mst_tensor* x, const mst_tensor* w,
                                      const mst_tensor* bias, const mst_tensor* scale,
                                      const mst_tensor* counts, mst_tensor* y) {
    mst_gl_args a = {0};
    MST_TRY(mst_check_ctx(ctx));
    MST_TRY(check_counts(counts, &a));
    MST_TRY(mst_check_tensor(x, "x", MST_DTYPE_BF16));
    a.max_rows = x->rows;
    a.in = x->cols;
    MST_TRY(check_weight(w, &a));
    MST_TRY(mst_check_tensor(y, "y", MST_DTYPE_BF16));
    MST_TRY(mst_check_shape(y, "y", a.max_rows, a.out));
    if (present(bias)) {
        MST_TRY(check_optional(bias, "bias", MST_DTYPE_BF16, a.n_groups, a.out));
        a.bias = (const uint16_t*)bias->data;
    }
    if (present(scale)) {
        MST_TRY(check_optional(scale, "scale", MST_DTYPE_FP32, a.max_rows, 1));
        a.scale = (const float*)scale->data;
    }
    a.x = (const uint16_t*)x->data;
    a.y = (uint16_t*)y->data;
    return MST_SLOT(ctx, ctx->be, gl_forward, &a);
}

mst_status mst_grouped_linear_dgrad(mst_ctx_t* ctx, const mst_tensor* dy, const mst_tensor* w,
                                    const mst_tensor* counts, mst_tensor* dx) {
    mst_gl_args a = {0};
    MST_TRY(mst_check_ctx(ctx));
    MST_TRY(check_counts(counts, &a));
    MST_TRY(mst_check_tensor(dx, "dx", MST_DTYPE_BF16));
    a.max_rows = dx->rows;
    a.in = dx->cols;
    MST_TRY(check_weight(w, &a));
    MST_TRY(mst_check_tensor(dy, "dy", MST_DTYPE_BF16));
    MST_TRY(mst_check_shape(dy, "dy", a.max_rows, a.out));
    a.dy = (const uint16_t*)dy->data;
    a.dx = (uint16_t*)dx->data;
    return MST_SLOT(ctx, ctx->be, gl_dgrad, &a);
}

static mst_status defer(mst_ctx_t* ctx, const mst_gl_args* a) {
    mst_ops_state* s;
    MST_TRY(mst_ops_state_of(ctx, &s));
    if (s->n_deferred == s->cap_deferred) {
        int cap = s->cap_deferred ? 2 * s->cap_deferred : 16;
        mst_gl_args* d = (mst_gl_args*)realloc(s->deferred, (size_t)cap * sizeof *d);
        if (!d) return mst_set_error(MST_ERR_OOM, "deferred wgrad queue growth failed");
        s->deferred = d;
        s->cap_deferred = cap;
    }
    s->deferred[s->n_deferred++] = *a;
    return MST_OK;
}

/* wgrad's x [R, I] bf16, in memory or in pages; fills a->x or a->x_pages.
 * A paged x is read when the op runs: DEFERRED would read it after its owner
 * may have given the pages back. */
static mst_status check_x(const mst_tensor* x, mst_wgrad_mode mode, mst_gl_args* a) {
    if (!x || !x->pages) {
        MST_TRY(mst_check_tensor(x, "x", MST_DTYPE_BF16));
        a->x = (const uint16_t*)x->data;
        return MST_OK;
    }
    const mst_pages* pg = x->pages;
    MST_TRY(mst_check_pages(pg, "x.pages"));
    mst_tensor t = *x; /* dtype and shape as for x in memory (data is unused) */
    t.pages = NULL;
    t.data = (void*)pg->table;
    MST_TRY(mst_check_tensor(&t, "x", MST_DTYPE_BF16));
    if (mode == MST_WGRAD_DEFERRED)
        return mst_set_error(MST_ERR_UNSUPPORTED, "x is paged: DEFERRED wgrad would read it after the pages "
                                                  "may be given back; use ACCUMULATE or OVERWRITE");
    a->x_pages = pg;
    return MST_OK;
}

mst_status mst_grouped_linear_wgrad(mst_ctx_t* ctx, const mst_tensor* dy, const mst_tensor* x,
                                    const mst_tensor* scale, const mst_tensor* bias,
                                    const mst_tensor* counts, mst_tensor* main_grad_w,
                                    mst_tensor* main_grad_b, mst_tensor* dscale,
                                    mst_wgrad_mode mode) {
    mst_gl_args a = {0};
    MST_TRY(mst_check_ctx(ctx));
    if (mode != MST_WGRAD_OVERWRITE && mode != MST_WGRAD_ACCUMULATE && mode != MST_WGRAD_DEFERRED)
        return mst_set_error(MST_ERR_INVALID, "mode = %d is not a mst_wgrad_mode", (int)mode);
    MST_TRY(check_counts(counts, &a));
    MST_TRY(check_x(x, mode, &a));
    MST_TRY(mst_check_tensor(dy, "dy", MST_DTYPE_BF16));
    a.max_rows = x->rows;
    a.in = x->cols;
    a.out = dy->cols;
    MST_TRY(mst_check_shape(dy, "dy", a.max_rows, a.out));
    MST_TRY(mst_check_tensor(main_grad_w, "main_grad_w", MST_DTYPE_FP32));
    MST_TRY(mst_check_shape(main_grad_w, "main_grad_w", (int64_t)a.n_groups * a.out, a.in));
    if (present(main_grad_b)) {
        MST_TRY(check_optional(main_grad_b, "main_grad_b", MST_DTYPE_FP32, a.n_groups, a.out));
        a.main_grad_b = (float*)main_grad_b->data;
    }
    if (present(scale)) {
        MST_TRY(check_optional(scale, "scale", MST_DTYPE_FP32, a.max_rows, 1));
        a.scale = (const float*)scale->data;
    }
    if (present(bias) != present(dscale))
        return mst_set_error(MST_ERR_INVALID, "bias and dscale go together: bias %s, dscale %s",
                             present(bias) ? "given" : "NULL", present(dscale) ? "given" : "NULL");
    if (present(bias)) {
        MST_TRY(check_optional(bias, "bias", MST_DTYPE_BF16, a.n_groups, a.out));
        MST_TRY(check_optional(dscale, "dscale", MST_DTYPE_FP32, a.max_rows, 1));
        a.bias = (const uint16_t*)bias->data;
        a.dscale = (float*)dscale->data;
    }
    a.dy = (const uint16_t*)dy->data;
    a.main_grad_w = (float*)main_grad_w->data;
    a.accumulate = mode != MST_WGRAD_OVERWRITE;
    if (mode == MST_WGRAD_DEFERRED) return defer(ctx, &a);
    return MST_SLOT(ctx, ctx->be, gl_wgrad, &a);
}

/* Every queued wgrad runs, in order, even after one fails (a later one does
 * not depend on an earlier one); the queue is empty afterwards and the first
 * failure is returned (its message is the last one set when a later wgrad
 * fails too, so it is formatted again). */
mst_status mst_wgrad_flush(mst_ctx_t* ctx) {
    MST_TRY(mst_check_ctx(ctx));
    mst_ops_state* s = ctx->ops;
    const int n = s ? s->n_deferred : 0;
    mst_status first = MST_OK;
    int first_i = -1;
    char why[256] = "";
    for (int i = 0; i < n; i++) {
        const mst_status st = MST_SLOT(ctx, ctx->be, gl_wgrad, &s->deferred[i]);
        if (st == MST_OK || first != MST_OK) continue;
        first = st;
        first_i = i;
        snprintf(why, sizeof why, "%s", mst_last_error());
    }
    if (s) s->n_deferred = 0;
    if (first == MST_OK) return MST_OK;
    return mst_set_error(first, "deferred wgrad %d of %d: %s", first_i, n, why);
}

int mst_wgrad_pending(const mst_ctx_t* ctx) { return ctx && ctx->ops ? ctx->ops->n_deferred : 0; }
