/*
 * test_fp8.c — fp8 pages of the paged stash (src/lib/backend/fp8_page.h) on
 * the backend named by --backend:
 *   - the e4m3 rounding of every finite bf16 at several scale exponents,
 *     the decoding of every code and the scale exponent of every amax,
 *     against float64 references written here (a search of the e4m3 grid,
 *     ties to the even code; the harness's bf16 rounding);
 *   - save / restore through pools (device pages, spill to host pages, host
 *     pages only, split restore, a batch beside a bf16 pool) of random and
 *     adversarial rows (zeros, one huge outlier, subnormals, powers of two,
 *     widths that are not a multiple of 128): every code and scale in the
 *     pages equal to the reference's, every restored element within
 *     2^-4 |x| + 2^-10 s of x (and so within 2^-4 amax), rows past n still
 *     poisoned, guards intact;
 *   - a block holding inf or NaN: not stored (zeros), MST_FLAG_NONFINITE,
 *     mst_ctx_check returns MST_ERR_COUNTS; the other blocks as usual;
 *   - on CUDA, every page byte and every restored byte equal to the CPU
 *     backend's for the same rows (the CPU twin);
 *   - bad input: a width that is not a multiple of 8, claims and in-place
 *     reads of fp8 pages.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "lib/internal.h"

/* ---- float64 references ---- */

/* The value of e4m3 code c (not NaN), from its fields. */
static double ref_e4m3_value(int c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m, -9);
    return c & 0x80 ? -v : v;
}

/* The e4m3 code nearest to v (ties to the even code), +-448 past it. */
static int ref_e4m3(double v) {
    const int sign = v < 0 || (v == 0 && signbit(v)) ? 0x80 : 0;
    const double a = fabs(v);
    if (a >= 448) return sign | 0x7e;
    int best = 0;
    for (int c = 1; c <= 0x7e; c++) {
        const double d = fabs(ref_e4m3_value(c) - a), db = fabs(ref_e4m3_value(best) - a);
        if (d < db || (d == db && (c & 1) == 0)) best = c;
    }
    return sign | best;
}

/* The scale exponent of a block of largest magnitude amax: the least k with
 * amax / 2^k <= 448, at least MST_FP8_K_MIN; 0 for amax 0. */
static int ref_scale_exp(double amax) {
    if (amax == 0) return 0;
    int k = MST_FP8_K_MIN;
    while (ldexp(amax, -k) > 448) k++;
    return k;
}

static void rounding(void) {
    static const int ks[] = {MST_FP8_K_MIN, -70, -9, -1, 0, 3, 64, MST_FP8_K_MAX};
    int bad_enc = 0, bad_dec = 0, bad_k = 0;
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++)
        for (uint32_t x = 0; x < 0x10000; x++) {
            if ((x & 0x7fff) >= MST_BF16_NONFINITE) continue;
            const int want = ref_e4m3(ldexp(mst_ref_bf16_value((uint16_t)x), -ks[i]));
            const int got = mst_e4m3_encode((uint16_t)x, ks[i]);
            if (got != want && bad_enc++ < 5) CHECK(0, "encode(0x%04x, k %d) = 0x%02x, reference 0x%02x", x, ks[i], got, want);
        }
    for (int k = MST_FP8_K_MIN; k <= MST_FP8_K_MAX; k++)
        for (int c = 0; c < 256; c++) {
            if ((c & 0x7f) == 0x7f) continue; /* NaN: never stored */
            const double v = ldexp(ref_e4m3_value(c), k);
            const uint16_t want = fabs(v) > mst_ref_bf16_value(0x7f7f) ? (uint16_t)((c & 0x80 ? 0x8000 : 0) | 0x7f7f)
                                                                        : mst_ref_bf16(v);
            const uint16_t got = mst_e4m3_decode((uint8_t)c, k);
            if (got != want && bad_dec++ < 5) CHECK(0, "decode(0x%02x, k %d) = 0x%04x, reference 0x%04x", c, k, got, want);
        }
    for (uint32_t a = 0; a < MST_BF16_NONFINITE; a++) {
        const int want = ref_scale_exp(mst_ref_bf16_value((uint16_t)a)), got = mst_fp8_scale_exp((uint16_t)a);
        if (got != want && bad_k++ < 5) CHECK(0, "scale_exp(0x%04x) = %d, reference %d", a, got, want);
    }
    CHECK(bad_enc == 0 && bad_dec == 0 && bad_k == 0, "rounding: %d encode, %d decode, %d scale mismatches",
          bad_enc, bad_dec, bad_k);
}

/* ---- rows ---- */

enum { ROW_RANDOM = 0, ROW_ZEROS, ROW_OUTLIER, ROW_SUBNORMAL, ROW_POW2, ROW_WIDE, N_ROW_KINDS };

/* Row r of kind r % N_ROW_KINDS, [w] bf16. */
static void make_row(mst_rng* rng, int64_t r, int64_t w, uint16_t* x) {
    const int kind = (int)(r % N_ROW_KINDS);
    mst_rng_bf16(rng, x, (size_t)w, kind == ROW_WIDE ? 1e3 : 1.0);
    for (int64_t i = 0; i < w; i++) {
        if (kind == ROW_ZEROS) x[i] = i % 3 ? 0 : 0x8000; /* zeros, some negative */
        if (kind == ROW_SUBNORMAL) x[i] = (uint16_t)(mst_rng_int(rng, 0, 0x7f) | (i & 1 ? 0x8000 : 0));
        if (kind == ROW_POW2) x[i] = (uint16_t)((mst_rng_int(rng, 100, 140) << 7) | (i & 1 ? 0x8000 : 0));
        if (kind == ROW_WIDE && i % 5 == 0) x[i] = mst_ref_bf16(mst_rng_normal(rng) * 1e-6); /* a wide range */
    }
    if (kind == ROW_OUTLIER) x[mst_rng_int(rng, 0, w - 1)] = mst_ref_bf16(3e30);
}

/* Checks the pages of rows x [n, w] (codes and scales against the reference)
 * and the restored rows got [n, w] against x (the stated bound). */
static void check_block(const uint16_t* x, const uint16_t* got, int64_t len, const uint8_t* q, float scale,
                        const char* where, int64_t row, int* bad) {
    double amax = 0;
    for (int64_t i = 0; i < len; i++) amax = fmax(amax, fabs(mst_ref_bf16_value(x[i])));
    const int k = ref_scale_exp(amax);
    const double s = ldexp(1.0, k);
    if (q && (double)scale != s && (*bad)++ < 5) CHECK(0, "%s row %lld: scale %g, reference %g", where, (long long)row, scale, s);
    for (int64_t i = 0; i < len; i++) {
        const double v = mst_ref_bf16_value(x[i]), r = mst_ref_bf16_value(got[i]);
        if (q && q[i] != ref_e4m3(v / s) && (*bad)++ < 5)
            CHECK(0, "%s row %lld elt %lld: code 0x%02x, reference 0x%02x", where, (long long)row, (long long)i, q[i],
                  ref_e4m3(v / s));
        const double err = fabs(r - v), bound = ldexp(fabs(v), -4) + ldexp(s, -10);
        if ((!(err <= bound) || !(err <= ldexp(amax, -4))) && (*bad)++ < 5)
            CHECK(0, "%s row %lld elt %lld: %g restored as %g, error %g over the bound %g (amax %g)", where,
                  (long long)row, (long long)i, v, r, err, bound, amax);
    }
}

typedef struct fixture {
    int64_t w, rows, n, page_rows;
    int64_t dev_pages, host_pages;
    uint16_t* x;       /* [rows, w] source                      */
    uint16_t* back;    /* [rows, w] restored (poisoned past n)  */
    char* dev;         /* the device block after the save       */
    char* host;        /* the host block after the save         */
} fixture;

/* Saves x into a fresh fp8 pool, copies its blocks out, restores into a
 * poisoned guarded buffer (split: copy then return), and checks guards,
 * rows past n and the pool's invariant. */
static void run_pool(mst_ctx_t* ctx, fixture* f, int split) {
    mst_pool_config pc = mst_pool_config_default(f->dev_pages);
    pc.n_host_pages = f->host_pages;
    pc.page_rows = f->page_rows;
    mst_pool_t* pool = NULL;
    mst_stash_handle_t* h = NULL;
    CHECK_OK(mst_pool_create(ctx, MST_DTYPE_FP8, f->w, &pc, &pool));
    if (!pool) return;
    CHECK_OK(mst_stash_handle_create(pool, f->rows, &h));
    const size_t bytes = (size_t)(f->rows * f->w) * 2;
    mst_guarded src = mst_guarded_alloc(ctx, bytes), dst = mst_guarded_alloc(ctx, bytes);
    mst_guarded_put(ctx, &src, f->x);
    mst_guarded_put(ctx, &dst, NULL);
    int32_t counts_h[3] = {(int32_t)(f->n / 2), 0, (int32_t)(f->n - f->n / 2)};
    void* counts_d = NULL;
    CHECK_OK(mst_alloc(ctx, sizeof counts_h, &counts_d));
    CHECK_OK(mst_copy_h2b(ctx, counts_d, counts_h, sizeof counts_h));
    mst_tensor t_src = mst_tensor_make(src.data, MST_DTYPE_BF16, f->rows, f->w);
    mst_tensor t_dst = mst_tensor_make(dst.data, MST_DTYPE_BF16, f->rows, f->w);
    mst_tensor t_counts = mst_tensor_make(counts_d, MST_DTYPE_INT32, 3, 1);
    CHECK_OK(mst_stash_save(pool, h, &t_src, &t_counts));
    const int64_t page_bytes = pool->page_bytes;
    f->dev = (char*)calloc((size_t)(f->dev_pages * page_bytes) + 1, 1);
    f->host = (char*)calloc((size_t)(f->host_pages * page_bytes) + 1, 1);
    if (f->dev_pages) CHECK_OK(mst_copy_b2h(ctx, f->dev, pool->a.block[MST_BLK_DEV], (size_t)(f->dev_pages * page_bytes)));
    if (f->host_pages) CHECK_OK(mst_copy_b2h(ctx, f->host, pool->a.block[MST_BLK_HOST], (size_t)(f->host_pages * page_bytes)));
    if (split) {
        CHECK_OK(mst_stash_restore_copy(pool, h, &t_dst));
        CHECK_OK(mst_stash_restore_return(pool, h));
    } else {
        CHECK_OK(mst_stash_restore(pool, h, &t_dst));
    }
    CHECK_OK(mst_ctx_check(ctx));
    CHECK_OK(mst_pool_check(pool));
    mst_guarded_get(ctx, &dst, f->back);
    CHECK(mst_guarded_intact(ctx, &dst), "fp8 restore wrote past its buffer");
    for (int64_t i = f->n * f->w; i < f->rows * f->w; i++)
        if (f->back[i] != 0xffff) {
            CHECK(0, "restored element %lld past n = %lld was written", (long long)i, (long long)f->n);
            break;
        }
    mst_free(ctx, counts_d);
    mst_guarded_free(ctx, &src);
    mst_guarded_free(ctx, &dst);
    mst_pool_destroy(pool);
}

/* The codes and scales of row i in the fixture's copied blocks (its page
 * ids: the device block's in order, then the host block's: a fresh pool). */
static void row_in_pages(const fixture* f, int64_t i, uint8_t** q, float** sc) {
    const int64_t page_bytes = f->page_rows * mst_fp8_row_bytes(f->w), p = i / f->page_rows;
    char* page = p < f->dev_pages ? f->dev + p * page_bytes : f->host + (p - f->dev_pages) * page_bytes;
    *q = mst_fp8_codes(page, i % f->page_rows, f->w);
    *sc = mst_fp8_scales(page, i % f->page_rows, f->w, f->page_rows);
}

static void check_fixture(const fixture* f, const char* where) {
    int bad = 0;
    for (int64_t i = 0; i < f->n; i++) {
        uint8_t* q;
        float* sc;
        row_in_pages(f, i, &q, &sc);
        for (int64_t j = 0, b = 0; j < f->w; j += MST_FP8_BLOCK, b++)
            check_block(f->x + i * f->w + j, f->back + i * f->w + j, f->w - j < MST_FP8_BLOCK ? f->w - j : MST_FP8_BLOCK,
                        q + j, sc[b], where, i, &bad);
    }
    CHECK(bad == 0, "%s: %d elements off", where, bad);
}

static void fixture_free(fixture* f) {
    free(f->x), free(f->back), free(f->dev), free(f->host);
    f->x = f->back = NULL, f->dev = f->host = NULL;
}

static fixture fixture_make(mst_rng* rng, int64_t w, int64_t rows, int64_t n, int64_t dev_pages, int64_t host_pages) {
    fixture f = {w, rows, n, 16, dev_pages, host_pages, NULL, NULL, NULL, NULL};
    f.x = (uint16_t*)malloc((size_t)(rows * w) * 2);
    f.back = (uint16_t*)malloc((size_t)(rows * w) * 2);
    for (int64_t r = 0; r < rows; r++) make_row(rng, r, w, f.x + r * w);
    return f;
}

/* On CUDA: the same fixture on the CPU backend gives the same page and
 * restored bytes. */
static void against_cpu_twin(const fixture* f, const char* where) {
    mst_ctx_t* cpu = NULL;
    CHECK_OK(mst_ctx_create(MST_BACKEND_CPU, 0, &cpu));
    fixture g = *f;
    g.back = (uint16_t*)malloc((size_t)(f->rows * f->w) * 2);
    run_pool(cpu, &g, 0);
    /* the pages the save wrote: whole pages but the last one's rows past n */
    const int64_t used = (f->n + f->page_rows - 1) / f->page_rows;
    for (int64_t p = 0; p < used; p++) {
        const int64_t rows = f->n - p * f->page_rows < f->page_rows ? f->n - p * f->page_rows : f->page_rows;
        uint8_t *qa, *qb;
        float *sa, *sb;
        row_in_pages(f, p * f->page_rows, &qa, &sa);
        row_in_pages(&g, p * f->page_rows, &qb, &sb);
        const int64_t d1 = mst_first_diff(qa, qb, (size_t)(rows * f->w));
        const int64_t d2 = mst_first_diff(sa, sb, (size_t)(rows * mst_fp8_blocks(f->w)) * 4);
        CHECK(d1 < 0 && d2 < 0, "%s: page %lld differs from the CPU twin's (codes at byte %lld, scales at byte %lld)",
              where, (long long)p, (long long)d1, (long long)d2);
    }
    const int64_t d = mst_first_diff(f->back, g.back, (size_t)(f->rows * f->w) * 2);
    CHECK(d < 0, "%s: restored rows differ from the CPU twin's at byte %lld", where, (long long)d);
    free(g.back), free(g.dev), free(g.host);
    mst_ctx_destroy(cpu);
}

static void round_trips(mst_ctx_t* ctx, mst_rng* rng) {
    static const struct { int64_t w, rows, n, dev, host; int split; const char* what; } cases[] = {
        {256, 100, 93, 8, 0, 0, "device pages, w 256"},
        {200, 64, 64, 4, 0, 1, "w 200 (a short last block), split restore"},
        {1024, 80, 77, 2, 4, 0, "spill to host pages, w 1024"},
        {72, 40, 33, 0, 3, 1, "host pages only, w 72"},
        {8, 24, 17, 2, 0, 0, "w 8"},
    };
    const int twin = ctx->be != &mst_backend_cpu;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        fixture f = fixture_make(rng, cases[c].w, cases[c].rows, cases[c].n, cases[c].dev, cases[c].host);
        run_pool(ctx, &f, cases[c].split);
        check_fixture(&f, cases[c].what);
        if (twin) against_cpu_twin(&f, cases[c].what);
        fixture_free(&f);
    }
}

/* inf and NaN: the block is not stored, the flag is raised, the rest of the
 * row and the other rows are as usual. */
static void nonfinite(mst_ctx_t* ctx, mst_rng* rng) {
    const uint16_t bad[] = {0x7f80, 0xff80, 0x7fc0, 0xffc1};
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        fixture f = fixture_make(rng, 384, 16, 16, 1, 0);
        f.x[5 * 384 + 130 + b] = bad[b]; /* row 5, block 1 */
        mst_pool_config pc = mst_pool_config_default(1);
        pc.page_rows = 16;
        mst_pool_t* pool = NULL;
        mst_stash_handle_t* h = NULL;
        CHECK_OK(mst_pool_create(ctx, MST_DTYPE_FP8, 384, &pc, &pool));
        CHECK_OK(mst_stash_handle_create(pool, 16, &h));
        void *src = NULL, *dst = NULL, *cnt = NULL;
        const int32_t counts = 16;
        CHECK_OK(mst_alloc(ctx, 16 * 384 * 2, &src));
        CHECK_OK(mst_alloc(ctx, 16 * 384 * 2, &dst));
        CHECK_OK(mst_alloc(ctx, 4, &cnt));
        CHECK_OK(mst_copy_h2b(ctx, src, f.x, 16 * 384 * 2));
        CHECK_OK(mst_copy_h2b(ctx, cnt, &counts, 4));
        mst_tensor ts = mst_tensor_make(src, MST_DTYPE_BF16, 16, 384), td = mst_tensor_make(dst, MST_DTYPE_BF16, 16, 384);
        mst_tensor tc = mst_tensor_make(cnt, MST_DTYPE_INT32, 1, 1);
        CHECK_OK(mst_stash_save(pool, h, &ts, &tc));
        CHECK_OK(mst_stash_restore(pool, h, &td));
        CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS);
        CHECK_MESSAGE("inf or NaN");
        CHECK_OK(mst_ctx_check(ctx)); /* cleared */
        CHECK_OK(mst_copy_b2h(ctx, f.back, dst, 16 * 384 * 2));
        int zeros = 1;
        for (int i = 128; i < 256; i++) zeros &= f.back[5 * 384 + i] == 0;
        CHECK(zeros, "a block holding 0x%04x was stored", bad[b]);
        for (int i = 128; i < 256; i++) f.back[5 * 384 + i] = f.x[5 * 384 + i] = 0; /* the rest as usual */
        int off = 0;
        for (int64_t r = 0; r < 16; r++)
            for (int64_t j = 0; j < 384; j += 128) check_block(f.x + r * 384 + j, f.back + r * 384 + j, 128, NULL, 0, "nonfinite", r, &off);
        CHECK(off == 0, "nonfinite: %d elements off in the other blocks", off);
        mst_free(ctx, src), mst_free(ctx, dst), mst_free(ctx, cnt);
        mst_pool_destroy(pool);
        fixture_free(&f);
    }
}

/* A batch of an fp8 save beside a bf16 save gives each its single call's result. */
static void batched(mst_ctx_t* ctx, mst_rng* rng) {
    fixture f = fixture_make(rng, 128, 64, 50, 4, 0);
    run_pool(ctx, &f, 0);
    mst_pool_config pc = mst_pool_config_default(4);
    pc.page_rows = 16;
    mst_pool_t *p8 = NULL, *p16 = NULL;
    mst_stash_handle_t *h8 = NULL, *h16 = NULL;
    CHECK_OK(mst_pool_create(ctx, MST_DTYPE_FP8, 128, &pc, &p8));
    CHECK_OK(mst_pool_create(ctx, MST_DTYPE_BF16, 128, &pc, &p16));
    CHECK_OK(mst_stash_handle_create(p8, 64, &h8));
    CHECK_OK(mst_stash_handle_create(p16, 64, &h16));
    void *src = NULL, *d8 = NULL, *d16 = NULL, *cnt = NULL;
    const int32_t counts = 50;
    CHECK_OK(mst_alloc(ctx, 64 * 128 * 2, &src));
    CHECK_OK(mst_alloc(ctx, 64 * 128 * 2, &d8));
    CHECK_OK(mst_alloc(ctx, 64 * 128 * 2, &d16));
    CHECK_OK(mst_alloc(ctx, 4, &cnt));
    CHECK_OK(mst_copy_h2b(ctx, src, f.x, 64 * 128 * 2));
    CHECK_OK(mst_copy_h2b(ctx, cnt, &counts, 4));
    mst_tensor ts = mst_tensor_make(src, MST_DTYPE_BF16, 64, 128), tc = mst_tensor_make(cnt, MST_DTYPE_INT32, 1, 1);
    mst_tensor t8 = mst_tensor_make(d8, MST_DTYPE_BF16, 64, 128), t16 = mst_tensor_make(d16, MST_DTYPE_BF16, 64, 128);
    mst_stash_batch b = {0};
    CHECK_OK(mst_stash_batch_save(&b, p8, h8, &ts, &tc));
    CHECK_OK(mst_stash_batch_save(&b, p16, h16, &ts, &tc));
    CHECK_OK(mst_stash_batch_run(ctx, &b));
    CHECK_OK(mst_stash_batch_restore(&b, p8, h8, &t8, MST_RESTORE_ALL));
    CHECK_OK(mst_stash_batch_restore(&b, p16, h16, &t16, MST_RESTORE_ALL));
    CHECK_OK(mst_stash_batch_run(ctx, &b));
    CHECK_OK(mst_ctx_check(ctx));
    uint16_t* got = (uint16_t*)malloc(64 * 128 * 2);
    CHECK_OK(mst_copy_b2h(ctx, got, d8, 50 * 128 * 2));
    CHECK(mst_first_diff(got, f.back, 50 * 128 * 2) < 0, "a batched fp8 save / restore differs from the single calls");
    CHECK_OK(mst_copy_b2h(ctx, got, d16, 50 * 128 * 2));
    CHECK(mst_first_diff(got, f.x, 50 * 128 * 2) < 0, "the bf16 slot beside it is not a copy");
    free(got);
    mst_free(ctx, src), mst_free(ctx, d8), mst_free(ctx, d16), mst_free(ctx, cnt);
    mst_pool_destroy(p8);
    mst_pool_destroy(p16);
    fixture_free(&f);
}

static void bad_input(mst_ctx_t* ctx) {
    mst_pool_config pc = mst_pool_config_default(2);
    mst_pool_t* pool = NULL;
    CHECK_STATUS(mst_pool_create(ctx, MST_DTYPE_FP8, 12, &pc, &pool), MST_ERR_INVALID);
    CHECK_MESSAGE("width = 12");
    CHECK_OK(mst_pool_create(ctx, MST_DTYPE_FP8, 16, &pc, &pool));
    mst_pool_stats st = MST_POOL_STATS_INIT;
    CHECK_OK(mst_pool_stats_get(pool, &st));
    CHECK(st.page_bytes == 64 * (16 + 4), "fp8 page of 64 rows of 16: %lld bytes, expected %d", (long long)st.page_bytes,
          64 * 20);
    mst_stash_handle_t* h = NULL;
    CHECK_OK(mst_stash_handle_create(pool, 64, &h));
    void* cnt = NULL;
    CHECK_OK(mst_alloc(ctx, 4, &cnt));
    mst_tensor tc = mst_tensor_make(cnt, MST_DTYPE_INT32, 1, 1);
    CHECK_STATUS(mst_stash_claim(pool, h, 64, &tc), MST_ERR_INVALID);
    CHECK_MESSAGE("fp8");
    mst_pages pg;
    CHECK_STATUS(mst_stash_handle_pages(h, &pg), MST_ERR_INVALID);
    mst_tensor fp32 = mst_tensor_make(cnt, MST_DTYPE_FP32, 1, 16);
    CHECK_STATUS(mst_stash_save(pool, h, &fp32, &tc), MST_ERR_INVALID);
    mst_free(ctx, cnt);
    mst_pool_destroy(pool);
}

static void run(mst_ctx_t* ctx) {
    mst_rng rng = {31};
    rounding();
    round_trips(ctx, &rng);
    nonfinite(ctx, &rng);
    batched(ctx, &rng);
    bad_input(ctx);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
