/*
 * test_grouped_linear.c — grouped linear forward, dgrad and wgrad (all modes)
 * against a float64 reference, on the backend named by --backend; padding
 * rows poisoned and checked untouched, guard bytes around every output, and
 * every bad-input case of the grouped linear's contract (docs/DESIGN.md).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "lib/internal.h"

typedef struct gl_case {
    int E;           /* groups                    */
    int64_t I, O;    /* in, out widths            */
    int64_t total;   /* sum(counts)               */
    int64_t R;       /* max_rows >= total         */
    double skew;     /* 0 balanced .. 1 Zipf-like */
    int bias, scale; /* optional inputs present   */
    const int32_t* fixed; /* [E] counts summing to total, or NULL: random */
} gl_case;

/* Host copies of one case's inputs and its float64 references. */
typedef struct gl_host {
    int32_t* counts; /* [E]      */
    int64_t* off;    /* [E+1]    */
    uint16_t *x, *w, *b, *dy; /* [R,I] [E*O,I] [E,O] [R,O] */
    float* s;        /* [R]      */
    double *y, *dx, *dw, *db, *ds; /* references */
} gl_host;

static double* to_double(const uint16_t* src, size_t n) {
    double* d = (double*)malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) d[i] = mst_bf16_to_fp32(src[i]);
    return d;
}

/* float64 references, loops ordered so the inner one runs along contiguous
 * rows (the GPU cases reach tens of billions of multiply-adds). */
static void reference(const gl_case* c, gl_host* h) {
    const int64_t I = c->I, O = c->O, n = h->off[c->E];
    double *x = to_double(h->x, (size_t)(n * I)), *dy = to_double(h->dy, (size_t)(n * O)),
           *w = to_double(h->w, (size_t)(c->E * O * I)), *b = to_double(h->b, (size_t)(c->E * O));
    for (int g = 0; g < c->E; g++) {
        const double* wg = w + (int64_t)g * O * I;
        const double* bg = b + (int64_t)g * O;
        #pragma omp parallel for schedule(dynamic, 8)
        for (int64_t r = h->off[g]; r < h->off[g + 1]; r++) {
            double s = c->scale ? h->s[r] : 1.0, ds = 0;
            for (int64_t o = 0; o < O; o++) {
                double acc = c->bias ? bg[o] * s : 0.0, d = dy[r * O + o];
                for (int64_t i = 0; i < I; i++) acc += x[r * I + i] * wg[o * I + i];
                h->y[r * O + o] = acc;
                ds += d * bg[o];
                for (int64_t i = 0; i < I; i++) h->dx[r * I + i] += d * wg[o * I + i];
            }
            h->ds[r] = c->bias ? ds : 0;
        }
        #pragma omp parallel for schedule(dynamic, 8)
        for (int64_t o = 0; o < O; o++) {
            double db = 0, *dw = h->dw + ((int64_t)g * O + o) * I;
            for (int64_t r = h->off[g]; r < h->off[g + 1]; r++) {
                double d = dy[r * O + o];
                db += d * (c->scale ? h->s[r] : 1.0);
                for (int64_t i = 0; i < I; i++) dw[i] += d * x[r * I + i];
            }
            h->db[g * O + o] = db;
        }
    }
    free(x), free(dy), free(w), free(b);
}

/* Every byte of rows [n, R) of a [R, width] buffer still holds the poison. */
static int padding_poisoned(const void* host, int64_t n, int64_t R, int64_t row_bytes) {
    const unsigned char* p = (const unsigned char*)host;
    for (int64_t i = n * row_bytes; i < R * row_bytes; i++)
        if (p[i] != MST_POISON) return 0;
    return 1;
}

/* Downloads a guarded bf16 output, checks guards, padding and error. */
static void expect_bf16(mst_ctx_t* ctx, const mst_guarded* g, const double* ref, int64_t n,
                        int64_t R, int64_t width, const char* what, const gl_case* c) {
    uint16_t* got = (uint16_t*)malloc(g->n_bytes);
    mst_guarded_get(ctx, g, got);
    double err = mst_rel_err_bf16(got, ref, (size_t)(n * width));
    CHECK(err < MST_TOL_BF16, "%s E=%d I=%lld O=%lld n=%lld: rel err %.3g", what, c->E,
          (long long)c->I, (long long)c->O, (long long)n, err);
    CHECK(padding_poisoned(got, n, R, width * 2), "%s: padding rows written", what);
    CHECK(mst_guarded_intact(ctx, g), "%s: guard bytes overwritten", what);
    free(got);
}

/* Downloads a guarded fp32 output and checks it against ref + base (base
 * NULL: 0). */
static void expect_fp32(mst_ctx_t* ctx, const mst_guarded* g, const double* ref, size_t n,
                        const float* base, const char* what, const gl_case* c) {
    float* got = (float*)malloc(g->n_bytes);
    double* want = (double*)malloc(sizeof(double) * (n ? n : 1));
    mst_guarded_get(ctx, g, got);
    for (size_t i = 0; i < n; i++) want[i] = ref[i] + (base ? base[i] : 0.0);
    double err = mst_rel_err_fp32(got, want, n);
    CHECK(err < MST_TOL_FP32, "%s E=%d I=%lld O=%lld: rel err %.3g", what, c->E, (long long)c->I,
          (long long)c->O, err);
    CHECK(mst_guarded_intact(ctx, g), "%s: guard bytes overwritten", what);
    free(got);
    free(want);
}

/* wgrad ACCUMULATE with x read from the pages of a stash (random page
 * rows; device pages only, or about half spilled to the host block; page
 * rows that the Hopper kernel cannot read go through a gather) gives the bits of
 * the same call on x in memory (acc, acc_b); a paged x is refused where it
 * cannot be read (DEFERRED, any other argument). */
/* A page id past its block (device or host bit) reads as a page of zeros:
 * wgrad over the paged x with table entry j made bad equals wgrad over x in
 * memory with the rows of page j zeroed, bit for bit. The entry is put back. */
static void bad_page_id(mst_ctx_t* ctx, mst_rng* rng, const gl_case* c, const mst_tensor* x, const mst_tensor* xp,
                        const mst_tensor* dy, const mst_tensor* ps, const mst_tensor* counts, mst_guarded* gmw,
                        const float* g0) {
    const mst_pages* pg = xp->pages;
    const int64_t used = (c->total + pg->page_rows - 1) / pg->page_rows, R = c->R, I = c->I;
    if (used == 0) return;
    const int64_t j = (int64_t)(mst_rng_next(rng) % (uint64_t)used);
    const uint32_t host = (uint32_t)(mst_rng_next(rng) % 2);
    const uint32_t bad = host << 31 | (uint32_t)(pg->n_pages[host] + mst_rng_next(rng) % 3);
    uint16_t* hx = (uint16_t*)malloc((size_t)(2 * R * I));
    CHECK_OK(mst_copy_b2h(ctx, hx, x->data, (size_t)(2 * R * I)));
    const int64_t r1 = (j + 1) * pg->page_rows < R ? (j + 1) * pg->page_rows : R;
    memset(hx + j * pg->page_rows * I, 0, (size_t)(2 * (r1 - j * pg->page_rows) * I));
    mst_guarded gxz = mst_guarded_alloc(ctx, (size_t)(2 * R * I));
    mst_guarded_put(ctx, &gxz, hx);
    mst_tensor xz = mst_tensor_make(gxz.data, MST_DTYPE_BF16, R, I);
    mst_tensor mw = mst_tensor_make(gmw->data, MST_DTYPE_FP32, c->E * c->O, I);
    float* want = (float*)malloc(gmw->n_bytes);
    float* got = (float*)malloc(gmw->n_bytes);
    mst_guarded_put(ctx, gmw, g0);
    CHECK_OK(mst_grouped_linear_wgrad(ctx, dy, &xz, ps, NULL, counts, &mw, NULL, NULL, MST_WGRAD_ACCUMULATE));
    mst_guarded_get(ctx, gmw, want);
    uint32_t good;
    CHECK_OK(mst_copy_b2h(ctx, &good, pg->table + j, 4));
    CHECK_OK(mst_copy_h2b(ctx, (uint32_t*)pg->table + j, &bad, 4));
    mst_guarded_put(ctx, gmw, g0);
    CHECK_OK(mst_grouped_linear_wgrad(ctx, dy, xp, ps, NULL, counts, &mw, NULL, NULL, MST_WGRAD_ACCUMULATE));
    CHECK_OK(mst_ctx_check(ctx));
    mst_guarded_get(ctx, gmw, got);
    CHECK(mst_first_diff(got, want, gmw->n_bytes) < 0, "page id 0x%08x (page %lld of the table) past its block: "
          "wgrad differs from x with those rows zeroed", bad, (long long)j);
    CHECK(mst_guarded_intact(ctx, gmw), "bad page id: guard bytes overwritten");
    CHECK_OK(mst_copy_h2b(ctx, (uint32_t*)pg->table + j, &good, 4));
    mst_guarded_free(ctx, &gxz);
    free(hx), free(want), free(got);
}

/* gl_wgrad_pages and the op decide alike: on a fresh context (workspaces
 * unsized) the paged wgrad allocates nothing past what the same wgrad of x
 * in memory did exactly when gl_wgrad_pages says it reads the pages in place
 * (else it gathers x into a workspace of its own). */
static void pages_promise(mst_ctx_t* ctx, const gl_case* c, int64_t page_rows, const mst_tensor* dy,
                          const mst_tensor* x, const mst_tensor* xp, const mst_tensor* ps, const mst_tensor* counts,
                          mst_tensor* mw, mst_tensor* pmb) {
    mst_ctx_t* fresh = NULL;
    CHECK_OK(mst_ctx_sync(ctx));
    CHECK_OK(mst_ctx_create(mst_ctx_backend(ctx), 0, &fresh));
    if (!fresh) return;
    size_t in_memory = 0, paged = 0;
    CHECK_OK(mst_grouped_linear_wgrad(fresh, dy, x, ps, NULL, counts, mw, pmb, NULL, MST_WGRAD_ACCUMULATE));
    mst_ctx_mem(fresh, &in_memory, NULL);
    CHECK_OK(mst_grouped_linear_wgrad(fresh, dy, xp, ps, NULL, counts, mw, pmb, NULL, MST_WGRAD_ACCUMULATE));
    CHECK_OK(mst_ctx_sync(fresh));
    mst_ctx_mem(fresh, &paged, NULL);
    const mst_backend* be = fresh->be;
    const int in_place = be->gl_wgrad_pages && be->gl_wgrad_pages(fresh, page_rows, c->I, c->O);
    CHECK(in_place == (paged == in_memory),
          "gl_wgrad_pages says %s for pages of %lld rows (I = %lld, O = %lld), but the paged wgrad allocated %zu bytes",
          in_place ? "in place" : "gathered", (long long)page_rows, (long long)c->I, (long long)c->O,
          paged - in_memory);
    mst_ctx_destroy(fresh);
}

static void paged_x_wgrad(mst_ctx_t* ctx, mst_rng* rng, const gl_case* c, const mst_tensor* x,
                          const mst_tensor* dy, const mst_tensor* ps, const mst_tensor* counts,
                          mst_guarded* gmw, mst_guarded* gmb, mst_tensor* pmb, const float* g0,
                          const float* g0_b, const float* acc, const float* acc_b) {
    static const int64_t page_rows[] = {8, 16, 64, 128};
    mst_pool_config pc = mst_pool_config_default(1);
    pc.page_rows = page_rows[mst_rng_next(rng) % 4];
    const int64_t need = (c->total + pc.page_rows - 1) / pc.page_rows;
    const int spill = (int)(mst_rng_next(rng) % 2); /* else device pages only */
    pc.n_dev_pages = spill ? need / 2 : need + 1;
    pc.n_host_pages = spill ? need - need / 2 + 1 : 0;
    printf("  paged x: %lld rows per page, %lld device + %lld host pages\n", (long long)pc.page_rows,
           (long long)pc.n_dev_pages, (long long)pc.n_host_pages);
    mst_pool_t* pool = NULL;
    mst_stash_handle_t* h = NULL;
    CHECK_OK(mst_pool_create(ctx, MST_DTYPE_BF16, c->I, &pc, &pool));
    CHECK_OK(mst_stash_handle_create(pool, c->R, &h));
    CHECK_OK(mst_stash_save(pool, h, x, counts));
    mst_pages pages;
    CHECK_OK(mst_stash_handle_pages(h, &pages));
    mst_tensor xp = *x;
    xp.pages = &pages;
    mst_tensor mw = mst_tensor_make(gmw->data, MST_DTYPE_FP32, c->E * c->O, c->I);
    mst_guarded_put(ctx, gmw, g0);
    mst_guarded_put(ctx, gmb, g0_b);
    CHECK_OK(mst_grouped_linear_wgrad(ctx, dy, &xp, ps, NULL, counts, &mw, pmb, NULL, MST_WGRAD_ACCUMULATE));
    CHECK_OK(mst_ctx_check(ctx));
    float* got = (float*)malloc(gmw->n_bytes);
    float* got_b = (float*)malloc(gmb->n_bytes);
    mst_guarded_get(ctx, gmw, got);
    mst_guarded_get(ctx, gmb, got_b);
    int64_t bad = mst_first_diff(got, acc, gmw->n_bytes);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < gmw->n_bytes / 4; i++) {
        worst = fmax(worst, fabs((double)got[i] - acc[i]));
        scale = fmax(scale, fabs((double)acc[i]));
    }
    CHECK(bad < 0, "paged-x wgrad differs from x in memory at byte %lld (max diff %.3g of max %.3g)", (long long)bad,
          worst, scale);
    CHECK(!pmb || mst_first_diff(got_b, acc_b, gmb->n_bytes) < 0, "paged-x wgrad dbias differs");
    CHECK(mst_guarded_intact(ctx, gmw), "paged-x wgrad: guard bytes overwritten");
    CHECK_STATUS(mst_grouped_linear_wgrad(ctx, dy, &xp, ps, NULL, counts, &mw, pmb, NULL, MST_WGRAD_DEFERRED),
                 MST_ERR_UNSUPPORTED);
    CHECK_STATUS(mst_grouped_linear_wgrad(ctx, &xp, x, ps, NULL, counts, &mw, pmb, NULL, MST_WGRAD_ACCUMULATE),
                 MST_ERR_INVALID); /* a paged dy */
    CHECK(strstr(mst_last_error(), "paged") != NULL, "message says paged: %s", mst_last_error());
    bad_page_id(ctx, rng, c, x, &xp, dy, ps, counts, gmw, g0);
    pages_promise(ctx, c, pc.page_rows, dy, x, &xp, ps, counts, &mw, pmb);
    CHECK_OK(mst_stash_restore_return(pool, h));
    CHECK_OK(mst_pool_check(pool));
    mst_stash_handle_destroy(h);
    mst_pool_destroy(pool);
    free(got), free(got_b);
}

static void run_case(mst_ctx_t* ctx, mst_rng* rng, const gl_case* c) {
    const int E = c->E;
    printf("case E=%d I=%lld O=%lld rows=%lld max_rows=%lld\n", E, (long long)c->I, (long long)c->O,
           (long long)c->total, (long long)c->R);
    fflush(stdout);
    const int64_t I = c->I, O = c->O, R = c->R;
    gl_host h = {0};
    h.counts = (int32_t*)malloc(sizeof(int32_t) * E);
    h.off = (int64_t*)malloc(sizeof(int64_t) * (E + 1));
    if (c->fixed) memcpy(h.counts, c->fixed, sizeof(int32_t) * E);
    else mst_rng_counts(rng, h.counts, E, c->total, c->skew);
    h.off[0] = 0;
    for (int g = 0; g < E; g++) h.off[g + 1] = h.off[g] + h.counts[g];
    const int64_t n = h.off[E];
    CHECK(n == c->total, "case counts sum to %lld, expected %lld", (long long)n, (long long)c->total);
    h.x = (uint16_t*)malloc(2 * R * I);
    h.w = (uint16_t*)malloc(2 * E * O * I);
    h.b = (uint16_t*)malloc(2 * E * O);
    h.dy = (uint16_t*)malloc(2 * R * O);
    h.s = (float*)malloc(4 * R);
    mst_rng_bf16(rng, h.x, (size_t)(R * I), 1.0);
    mst_rng_bf16(rng, h.w, (size_t)(E * O * I), 1.0 / sqrt((double)I));
    mst_rng_bf16(rng, h.b, (size_t)(E * O), 0.5);
    mst_rng_bf16(rng, h.dy, (size_t)(R * O), 1.0);
    mst_rng_fp32(rng, h.s, (size_t)R, 0.05, 1.0);
    h.y = (double*)calloc((size_t)(R * O), 8);
    h.dx = (double*)calloc((size_t)(R * I), 8);
    h.dw = (double*)calloc((size_t)(E * O * I), 8);
    h.db = (double*)calloc((size_t)(E * O), 8);
    h.ds = (double*)calloc((size_t)R, 8);
    reference(c, &h);

    mst_guarded gc = mst_guarded_alloc(ctx, 4 * E), gx = mst_guarded_alloc(ctx, 2 * R * I),
                gw = mst_guarded_alloc(ctx, 2 * E * O * I), gb = mst_guarded_alloc(ctx, 2 * E * O),
                gdy = mst_guarded_alloc(ctx, 2 * R * O), gs = mst_guarded_alloc(ctx, 4 * R),
                gy = mst_guarded_alloc(ctx, 2 * R * O), gdx = mst_guarded_alloc(ctx, 2 * R * I),
                gmw = mst_guarded_alloc(ctx, 4 * E * O * I), gmb = mst_guarded_alloc(ctx, 4 * E * O),
                gds = mst_guarded_alloc(ctx, 4 * R);
    mst_guarded_put(ctx, &gc, h.counts);
    mst_guarded_put(ctx, &gx, h.x);
    mst_guarded_put(ctx, &gw, h.w);
    mst_guarded_put(ctx, &gb, h.b);
    mst_guarded_put(ctx, &gdy, h.dy);
    mst_guarded_put(ctx, &gs, h.s);
    mst_tensor counts = mst_tensor_make(gc.data, MST_DTYPE_INT32, E, 1),
               x = mst_tensor_make(gx.data, MST_DTYPE_BF16, R, I),
               w = mst_tensor_make(gw.data, MST_DTYPE_BF16, E * O, I),
               b = mst_tensor_make(gb.data, MST_DTYPE_BF16, E, O),
               dy = mst_tensor_make(gdy.data, MST_DTYPE_BF16, R, O),
               s = mst_tensor_make(gs.data, MST_DTYPE_FP32, R, 1),
               y = mst_tensor_make(gy.data, MST_DTYPE_BF16, R, O),
               dx = mst_tensor_make(gdx.data, MST_DTYPE_BF16, R, I),
               mw = mst_tensor_make(gmw.data, MST_DTYPE_FP32, E * O, I),
               mb = mst_tensor_make(gmb.data, MST_DTYPE_FP32, E, O),
               ds = mst_tensor_make(gds.data, MST_DTYPE_FP32, R, 1);
    const mst_tensor* pb = c->bias ? &b : NULL;
    const mst_tensor* ps = c->scale ? &s : NULL;

    CHECK_OK(mst_grouped_linear_forward(ctx, &x, &w, pb, ps, &counts, &y));
    CHECK_OK(mst_ctx_check(ctx));
    expect_bf16(ctx, &gy, h.y, n, R, O, "forward y", c);

    CHECK_OK(mst_grouped_linear_dgrad(ctx, &dy, &w, &counts, &dx));
    CHECK_OK(mst_ctx_check(ctx));
    expect_bf16(ctx, &gdx, h.dx, n, R, I, "dgrad dx", c);

    /* OVERWRITE from poison, then ACCUMULATE from 0.5, then DEFERRED from 0.5. */
    mst_tensor* pmb = c->bias || c->scale ? &mb : NULL;
    CHECK_OK(mst_grouped_linear_wgrad(ctx, &dy, &x, ps, pb, &counts, &mw, pmb, c->bias ? &ds : NULL,
                                      MST_WGRAD_OVERWRITE));
    CHECK_OK(mst_ctx_check(ctx));
    expect_fp32(ctx, &gmw, h.dw, (size_t)(E * O * I), NULL, "wgrad overwrite dW", c);
    if (pmb) expect_fp32(ctx, &gmb, h.db, (size_t)(E * O), NULL, "wgrad overwrite dbias", c);
    float* ovw = (float*)malloc(gmw.n_bytes);
    mst_guarded_get(ctx, &gmw, ovw);
    if (c->bias) {
        float* got = (float*)malloc(gds.n_bytes);
        mst_guarded_get(ctx, &gds, got);
        CHECK(mst_rel_err_fp32(got, h.ds, (size_t)n) < MST_TOL_FP32, "dscale rel err %.3g",
              mst_rel_err_fp32(got, h.ds, (size_t)n));
        CHECK(padding_poisoned(got, n, R, 4), "dscale: padding rows written");
        CHECK(mst_guarded_intact(ctx, &gds), "dscale: guard bytes overwritten");
        free(got);
    }

    /* ACCUMULATE onto random old main_grad values g0: g0 + dW within the
     * tolerance; on CUDA (K is never split) exactly g0 + the OVERWRITE
     * result, rounded once. */
    float* g0 = (float*)malloc(gmw.n_bytes);
    float* g0_b = (float*)malloc(gmb.n_bytes);
    mst_rng_fp32(rng, g0, (size_t)(E * O * I), -1.0, 1.0);
    mst_rng_fp32(rng, g0_b, (size_t)(E * O), -1.0, 1.0);
    mst_guarded_put(ctx, &gmw, g0);
    mst_guarded_put(ctx, &gmb, g0_b);
    CHECK_OK(mst_grouped_linear_wgrad(ctx, &dy, &x, ps, NULL, &counts, &mw, pmb, NULL,
                                      MST_WGRAD_ACCUMULATE));
    expect_fp32(ctx, &gmw, h.dw, (size_t)(E * O * I), g0, "wgrad accumulate dW", c);
    if (pmb) expect_fp32(ctx, &gmb, h.db, (size_t)(E * O), g0_b, "wgrad accumulate dbias", c);
    float* acc = (float*)malloc(gmw.n_bytes);
    float* acc_b = (float*)malloc(gmb.n_bytes);
    mst_guarded_get(ctx, &gmw, acc);
    mst_guarded_get(ctx, &gmb, acc_b);
    if (mst_ctx_backend(ctx) == MST_BACKEND_CUDA) {
        int64_t bad = -1;
        for (int64_t i = 0; i < E * O * I && bad < 0; i++)
            if (acc[i] != g0[i] + ovw[i]) bad = i;
        CHECK(bad < 0, "wgrad accumulate dW[%lld] = %.9g, expected old %.9g + dW %.9g exactly", (long long)bad,
              bad < 0 ? 0.0 : acc[bad], bad < 0 ? 0.0 : g0[bad], bad < 0 ? 0.0 : ovw[bad]);
    }

    paged_x_wgrad(ctx, rng, c, &x, &dy, ps, &counts, &gmw, &gmb, pmb, g0, g0_b, acc, acc_b);

    mst_guarded_put(ctx, &gmw, g0);
    mst_guarded_put(ctx, &gmb, g0_b);
    CHECK_OK(mst_grouped_linear_wgrad(ctx, &dy, &x, ps, NULL, &counts, &mw, pmb, NULL,
                                      MST_WGRAD_DEFERRED));
    CHECK(mst_wgrad_pending(ctx) == 1, "deferred wgrad: %d pending, expected 1", mst_wgrad_pending(ctx));
    float* before = (float*)malloc(gmw.n_bytes);
    mst_guarded_get(ctx, &gmw, before);
    CHECK(mst_first_diff(before, g0, gmw.n_bytes) < 0, "deferred wgrad ran before the flush");
    CHECK_OK(mst_wgrad_flush(ctx));
    CHECK(mst_wgrad_pending(ctx) == 0, "flush left %d pending", mst_wgrad_pending(ctx));
    float* def = (float*)malloc(gmw.n_bytes);
    float* def_b = (float*)malloc(gmb.n_bytes);
    mst_guarded_get(ctx, &gmw, def);
    mst_guarded_get(ctx, &gmb, def_b);
    CHECK(mst_first_diff(acc, def, gmw.n_bytes) < 0, "DEFERRED dW differs from ACCUMULATE");
    CHECK(!pmb || mst_first_diff(acc_b, def_b, gmb.n_bytes) < 0, "DEFERRED dbias differs from ACCUMULATE");
    free(ovw), free(g0), free(g0_b), free(acc), free(acc_b), free(before), free(def), free(def_b);

    mst_guarded* all[] = {&gc, &gx, &gw, &gb, &gdy, &gs, &gy, &gdx, &gmw, &gmb, &gds};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mst_guarded_free(ctx, all[i]);
    free(h.counts), free(h.off), free(h.x), free(h.w), free(h.b), free(h.dy), free(h.s);
    free(h.y), free(h.dx), free(h.dw), free(h.db), free(h.ds);
}

/* Bad counts: the context's error flag is set and the next check returns
 * MST_ERR_COUNTS; the CPU op also returns it at once. Nothing lands past R. */
static void bad_counts(mst_ctx_t* ctx, mst_rng* rng, const int32_t* bad, int E, const char* what) {
    const int64_t R = 40, I = 16, O = 24;
    mst_guarded gc = mst_guarded_alloc(ctx, 4 * E), gx = mst_guarded_alloc(ctx, 2 * R * I),
                gw = mst_guarded_alloc(ctx, 2 * E * O * I), gy = mst_guarded_alloc(ctx, 2 * R * O),
                gdx = mst_guarded_alloc(ctx, 2 * R * I), gmw = mst_guarded_alloc(ctx, 4 * E * O * I);
    uint16_t* hx = (uint16_t*)malloc(2 * R * I);
    uint16_t* hw = (uint16_t*)malloc(2 * E * O * I);
    mst_rng_bf16(rng, hx, (size_t)(R * I), 1.0);
    mst_rng_bf16(rng, hw, (size_t)(E * O * I), 0.3);
    mst_guarded_put(ctx, &gc, bad);
    mst_guarded_put(ctx, &gx, hx);
    mst_guarded_put(ctx, &gw, hw);
    mst_tensor counts = mst_tensor_make(gc.data, MST_DTYPE_INT32, E, 1),
               x = mst_tensor_make(gx.data, MST_DTYPE_BF16, R, I),
               w = mst_tensor_make(gw.data, MST_DTYPE_BF16, E * O, I),
               y = mst_tensor_make(gy.data, MST_DTYPE_BF16, R, O),
               dx = mst_tensor_make(gdx.data, MST_DTYPE_BF16, R, I),
               mw = mst_tensor_make(gmw.data, MST_DTYPE_FP32, E * O, I);
    int cpu = mst_ctx_backend(ctx) == MST_BACKEND_CPU;
    mst_status want_now = cpu ? MST_ERR_COUNTS : MST_OK;
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &w, NULL, NULL, &counts, &y), want_now);
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS); /* the flag is set on every backend */
    CHECK(strstr(mst_last_error(), "an op saw counts that are negative or sum past max_rows") != NULL,
          "%s: the check's message: %s", what, mst_last_error());
    CHECK_STATUS(mst_grouped_linear_dgrad(ctx, &x /* as dy: [R, I] */, &w, &counts, &y), MST_ERR_INVALID);
    mst_tensor dy = mst_tensor_make(gy.data, MST_DTYPE_BF16, R, O);
    CHECK_STATUS(mst_grouped_linear_dgrad(ctx, &dy, &w, &counts, &dx), want_now);
    CHECK_STATUS(mst_grouped_linear_wgrad(ctx, &dy, &x, NULL, NULL, &counts, &mw, NULL, NULL,
                                          MST_WGRAD_OVERWRITE), want_now);
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS); /* the flag is set on every backend */
    /* Outputs: nothing past R, and the guards intact. What the op may have
     * written inside [0, R) is not data, but nothing lands outside. */
    CHECK(mst_guarded_intact(ctx, &gy), "%s: y guards overwritten", what);
    CHECK(mst_guarded_intact(ctx, &gdx), "%s: dx guards overwritten", what);
    CHECK(mst_guarded_intact(ctx, &gmw), "%s: main_grad guards overwritten", what);
    CHECK_OK(mst_ctx_check(ctx)); /* the flag was cleared */
    mst_guarded* all[] = {&gc, &gx, &gw, &gy, &gdx, &gmw};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mst_guarded_free(ctx, all[i]);
    free(hx), free(hw);
}

/* A flush whose first DEFERRED wgrad fails (bad counts) still runs the next
 * one and empties the queue: the second main_grad equals the same wgrad run
 * as ACCUMULATE, bit for bit; the first failure is returned (the CPU op
 * fails at once, CUDA raises the flag) and named. */
static void flush_after_failure(mst_ctx_t* ctx, mst_rng* rng) {
    const int E = 3;
    const int64_t R = 40, I = 16, O = 24;
    const int32_t bad[3] = {5, -1, 4}, good[3] = {11, 0, 17};
    mst_guarded gbad = mst_guarded_alloc(ctx, 4 * E), ggood = mst_guarded_alloc(ctx, 4 * E),
                gx = mst_guarded_alloc(ctx, 2 * R * I), gdy = mst_guarded_alloc(ctx, 2 * R * O),
                gm0 = mst_guarded_alloc(ctx, 4 * E * O * I), gm1 = mst_guarded_alloc(ctx, 4 * E * O * I);
    uint16_t* hx = (uint16_t*)malloc(2 * R * I);
    uint16_t* hdy = (uint16_t*)malloc(2 * R * O);
    float* g0 = (float*)malloc(4 * E * O * I);
    float* ref = (float*)malloc(4 * E * O * I);
    float* got = (float*)malloc(4 * E * O * I);
    mst_rng_bf16(rng, hx, (size_t)(R * I), 1.0);
    mst_rng_bf16(rng, hdy, (size_t)(R * O), 1.0);
    mst_rng_fp32(rng, g0, (size_t)(E * O * I), -1.0, 1.0);
    mst_guarded_put(ctx, &gbad, bad);
    mst_guarded_put(ctx, &ggood, good);
    mst_guarded_put(ctx, &gx, hx);
    mst_guarded_put(ctx, &gdy, hdy);
    mst_tensor cb = mst_tensor_make(gbad.data, MST_DTYPE_INT32, E, 1),
               cg = mst_tensor_make(ggood.data, MST_DTYPE_INT32, E, 1),
               x = mst_tensor_make(gx.data, MST_DTYPE_BF16, R, I),
               dy = mst_tensor_make(gdy.data, MST_DTYPE_BF16, R, O),
               m0 = mst_tensor_make(gm0.data, MST_DTYPE_FP32, E * O, I),
               m1 = mst_tensor_make(gm1.data, MST_DTYPE_FP32, E * O, I);
    mst_guarded_put(ctx, &gm1, g0); /* the reference: ACCUMULATE now */
    CHECK_OK(mst_grouped_linear_wgrad(ctx, &dy, &x, NULL, NULL, &cg, &m1, NULL, NULL, MST_WGRAD_ACCUMULATE));
    mst_guarded_get(ctx, &gm1, ref);
    mst_guarded_put(ctx, &gm1, g0);
    CHECK_OK(mst_grouped_linear_wgrad(ctx, &dy, &x, NULL, NULL, &cb, &m0, NULL, NULL, MST_WGRAD_DEFERRED));
    CHECK_OK(mst_grouped_linear_wgrad(ctx, &dy, &x, NULL, NULL, &cg, &m1, NULL, NULL, MST_WGRAD_DEFERRED));
    const int cpu = mst_ctx_backend(ctx) == MST_BACKEND_CPU;
    CHECK_STATUS(mst_wgrad_flush(ctx), cpu ? MST_ERR_COUNTS : MST_OK);
    if (cpu)
        CHECK(strstr(mst_last_error(), "deferred wgrad 0 of 2") && strstr(mst_last_error(), "counts[1] = -1"),
              "flush failure message names neither the wgrad nor the count: %s", mst_last_error());
    CHECK(mst_wgrad_pending(ctx) == 0, "flush after a failure left %d pending", mst_wgrad_pending(ctx));
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS);
    mst_guarded_get(ctx, &gm1, got);
    const int64_t diff = mst_first_diff(ref, got, gm1.n_bytes);
    CHECK(diff < 0, "the wgrad queued after a failing one: main_grad byte %lld differs from ACCUMULATE",
          (long long)diff);
    CHECK(mst_guarded_intact(ctx, &gm0) && mst_guarded_intact(ctx, &gm1), "flush: main_grad guards overwritten");
    mst_guarded* all[] = {&gbad, &ggood, &gx, &gdy, &gm0, &gm1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) mst_guarded_free(ctx, all[i]);
    free(hx), free(hdy), free(g0), free(ref), free(got);
}

/* A kind that is not a mst_backend_kind is bad input, not an unbuilt backend. */
static void bad_backend_kind(void) {
    const int kinds[] = {-1, 2, 7};
    for (int i = 0; i < 3; i++) {
        mst_ctx_t* c = (mst_ctx_t*)&c; /* must be set to NULL */
        char want[32];
        snprintf(want, sizeof want, "kind = %d", kinds[i]);
        CHECK_STATUS(mst_ctx_create((mst_backend_kind)kinds[i], 0, &c), MST_ERR_INVALID);
        CHECK(strstr(mst_last_error(), want) != NULL, "message does not name %s: %s", want, mst_last_error());
        CHECK(c == NULL, "kind %d: *out not cleared", kinds[i]);
    }
}

static void bad_arguments(mst_ctx_t* ctx) {
    const int E = 4;
    const int64_t R = 32, I = 8, O = 12;
    void *pc, *px, *pw, *py, *pm, *pb;
    mst_alloc(ctx, 4 * E, &pc);
    mst_alloc(ctx, 2 * R * I, &px);
    mst_alloc(ctx, 2 * E * O * I, &pw);
    mst_alloc(ctx, 2 * R * O, &py);
    mst_alloc(ctx, 4 * E * O * I, &pm);
    mst_alloc(ctx, 4 * E * O, &pb);
    int32_t hc[4] = {3, 0, 5, 2};
    mst_copy_h2b(ctx, pc, hc, sizeof hc);
    mst_tensor counts = mst_tensor_make(pc, MST_DTYPE_INT32, E, 1),
               x = mst_tensor_make(px, MST_DTYPE_BF16, R, I),
               w = mst_tensor_make(pw, MST_DTYPE_BF16, E * O, I),
               y = mst_tensor_make(py, MST_DTYPE_BF16, R, O),
               mw = mst_tensor_make(pm, MST_DTYPE_FP32, E * O, I);
    mst_tensor t;
    CHECK_STATUS(mst_grouped_linear_forward(NULL, &x, &w, NULL, NULL, &counts, &y), MST_ERR_INVALID);
    CHECK_STATUS(mst_grouped_linear_forward(ctx, NULL, &w, NULL, NULL, &counts, &y), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "x is NULL") != NULL, "message does not name x: %s", mst_last_error());
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &w, NULL, NULL, &counts, NULL), MST_ERR_INVALID);
    t = x, t.data = NULL;
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &t, &w, NULL, NULL, &counts, &y), MST_ERR_INVALID);
    t = x, t.dtype = MST_DTYPE_FP32;
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &t, &w, NULL, NULL, &counts, &y), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "fp32") != NULL, "message does not name the dtype: %s", mst_last_error());
    t = counts, t.rows = 0; /* E = 0 */
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &w, NULL, NULL, &t, &y), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "counts") != NULL, "message does not name counts: %s", mst_last_error());
    t = counts, t.dtype = MST_DTYPE_FP32;
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &w, NULL, NULL, &t, &y), MST_ERR_INVALID);
    t = x, t.cols = 0; /* width 0 */
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &t, &w, NULL, NULL, &counts, &y), MST_ERR_INVALID);
    t = w, t.rows = E * O + 1; /* not a multiple of E */
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &t, NULL, NULL, &counts, &y), MST_ERR_INVALID);
    t = w, t.cols = I + 1;
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &t, NULL, NULL, &counts, &y), MST_ERR_INVALID);
    t = y, t.rows = R - 1;
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &w, NULL, NULL, &counts, &t), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "y has shape [31, 12], expected [32, 12]") != NULL,
          "message does not name y and its shape: %s", mst_last_error());
    t = mst_tensor_make(pb, MST_DTYPE_BF16, E, O + 1); /* bias of the wrong width */
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &w, &t, NULL, &counts, &y), MST_ERR_INVALID);
    t = mst_tensor_make(pb, MST_DTYPE_FP32, R - 2, 1); /* scale of the wrong length */
    CHECK_STATUS(mst_grouped_linear_forward(ctx, &x, &w, NULL, &t, &counts, &y), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "scale") != NULL, "message does not name scale: %s", mst_last_error());
    CHECK_STATUS(mst_grouped_linear_wgrad(ctx, &y, &x, NULL, NULL, &counts, &mw, NULL, NULL,
                                          (mst_wgrad_mode)7), MST_ERR_INVALID);
    t = mw, t.dtype = MST_DTYPE_BF16;
    CHECK_STATUS(mst_grouped_linear_wgrad(ctx, &y, &x, NULL, NULL, &counts, &t, NULL, NULL,
                                          MST_WGRAD_ACCUMULATE), MST_ERR_INVALID);
    t = mst_tensor_make(pb, MST_DTYPE_BF16, E, O); /* bias without dscale */
    CHECK_STATUS(mst_grouped_linear_wgrad(ctx, &y, &x, NULL, &t, &counts, &mw, NULL, NULL,
                                          MST_WGRAD_ACCUMULATE), MST_ERR_INVALID);
    CHECK(mst_wgrad_pending(ctx) == 0, "a rejected DEFERRED call was queued");
    void* ps[] = {pc, px, pw, py, pm, pb};
    for (int i = 0; i < 6; i++) mst_free(ctx, ps[i]);
}

static void run(mst_ctx_t* ctx) {
    mst_rng rng = {0x5eed1234};
    int gpu = mst_ctx_backend(ctx) == MST_BACKEND_CUDA;
    const gl_case cases[] = {
        {1, 32, 48, 100, 128, 0.0, 1, 1, NULL},    /* one group                      */
        {4, 64, 40, 3, 64, 0.0, 1, 0, NULL},       /* mostly zero-size groups        */
        {8, 72, 96, 517, 700, 1.0, 0, 1, NULL},    /* ragged, skewed                 */
        {8, 48, 56, 300, 300, 0.3, 1, 1, NULL},    /* max_rows == sum(counts)        */
        {128, 40, 24, 900, 1400, 1.0, 1, 1, NULL}, /* many groups, many of them empty */
        {64, 128, 128, 2000, 3000, 0.5, 0, 0, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(ctx, &rng, &cases[i]);
    if (gpu) { /* tile-edge shapes only the GPU runs quickly */
        /* counts at the Hopper kernel's 128-row tile edges: a last tile of
         * at most 64 rows (1, 63, 64, 129, 191, 192, 257: its second
         * warpgroup idles) or of more (65, 127, 193), whole tiles (128),
         * an empty group; groups start off the 64-row k-block grid (wgrad's
         * K tails and heads) */
        static const int32_t edges[12] = {1, 63, 64, 65, 0, 127, 128, 129, 191, 192, 193, 257};
        /* one group holds every row, fifteen are empty: most CTAs draw no tile */
        static const int32_t one[16] = {0, 0, 0, 0, 0, 1500, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
        const gl_case big[] = {
            {12, 320, 384, 1410, 1500, 0.0, 1, 1, edges},
            {16, 512, 264, 1500, 1600, 0.0, 1, 0, one},
            {4, 1024, 2048, 3001, 4500, 0.7, 1, 1, NULL},
            {8, 7168, 256, 1337, 2000, 0.0, 0, 1, NULL},
            {1, 2048, 7168, 777, 1000, 0.0, 1, 0, NULL},
            {128, 256, 384, 9000, 13000, 1.0, 0, 0, NULL},
            {8, 1001, 203, 2500, 3000, 0.5, 1, 1, NULL}, /* rows not 16-byte aligned: the mma.sync path */
            {6144, 16, 8, 5000, 6000, 0.0, 1, 1, NULL},  /* the most groups the schedule kernel takes */
        };
        for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) run_case(ctx, &rng, &big[i]);
    }
    const int32_t neg[3] = {5, -1, 4};
    const int32_t over[3] = {20, 15, 6}; /* 41 > R = 40 */
    bad_counts(ctx, &rng, neg, 3, "negative count");
    bad_counts(ctx, &rng, over, 3, "sum past max_rows");
    bad_arguments(ctx);
    flush_after_failure(ctx, &rng);
    bad_backend_kind();
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
