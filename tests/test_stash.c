/*
 * test_stash.c — the paged stash (docs/DESIGN.md) on the backend named
 * by --backend: random interleavings of save / restore over many handles
 * (pipeline-like orders included), restores (whole or split into copy and
 * page return) bit-exact with rows past n still poisoned and guard bytes intact, mst_pool_check and the counters compared
 * with a host model after every operation, no page leaked at the end; spill,
 * overflow (nothing taken or written, later saves no-ops, reset recovers),
 * a save past the handle's rows from a larger src (an overflow),
 * sizing from a measured peak, every bad-input case, and on CUDA a captured
 * graph of a save / restore sequence replayed with different counts (the
 * CPU backend runs the same sequence eagerly); batches of saves, claims,
 * restores and resets on distinct pools against the same calls one by one.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "lib/internal.h"

#ifdef MST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

/* ---- a host model of the pool's counters ---- */

typedef struct model {
    int64_t page_rows;
    int64_t cap[2];      /* device, host pages                         */
    int64_t used[2];     /* pages in live handles                      */
    int64_t peak_total;  /* max of used[0] + used[1]                   */
    int64_t spilled;     /* host pages taken since the last reset      */
    int overflow;
} model;

/* One handle of a test: its expected content and pages. */
typedef struct slot {
    mst_stash_handle_t* h;
    int64_t R;           /* max_rows of the handle and its buffers */
    int live;            /* holds pages                            */
    int64_t n;           /* rows saved                             */
    int64_t pages[2];    /* pages held: device, host               */
    unsigned char* want; /* [R, row_bytes] what the save packed    */
} slot;

static void model_save(model* m, slot* s, int64_t n) {
    s->live = 0;
    s->n = 0;
    if (m->overflow) return;
    const int64_t need = (n + m->page_rows - 1) / m->page_rows;
    const int64_t dev = need < m->cap[0] - m->used[0] ? need : m->cap[0] - m->used[0];
    if (n > s->R || need - dev > m->cap[1] - m->used[1]) { /* past the handle, or too few pages */
        m->overflow = 1;
        return;
    }
    s->live = 1;
    s->n = n;
    s->pages[0] = dev;
    s->pages[1] = need - dev;
    m->used[0] += dev;
    m->used[1] += need - dev;
    m->spilled += need - dev;
    if (m->used[0] + m->used[1] > m->peak_total) m->peak_total = m->used[0] + m->used[1];
}

static void model_restore(model* m, slot* s) {
    if (s->live) {
        m->used[0] -= s->pages[0];
        m->used[1] -= s->pages[1];
    }
    s->live = 0;
}

/* ---- one pool under test ---- */

typedef struct env {
    mst_ctx_t* ctx;
    mst_rng* rng;
    mst_dtype dtype;
    int64_t width, row_bytes;
    mst_pool_t* pool;
    model m;
    int n_slots;
    slot* slots;
    mst_guarded src, dst, counts; /* [R_max, W] each, counts [E_MAX] */
    int64_t R_max;
    unsigned char* host;          /* [R_max, row_bytes] scratch */
} env;

enum { E_MAX = 16 };

static void fill_random(env* e, void* buf, int64_t rows) {
    const size_t n = (size_t)(rows * e->width);
    if (e->dtype == MST_DTYPE_BF16) mst_rng_bf16(e->rng, (uint16_t*)buf, n, 1.0);
    else mst_rng_fp32(e->rng, (float*)buf, n, -2.0, 2.0);
}

static int env_open(env* e, mst_ctx_t* ctx, mst_rng* rng, mst_dtype dt, int64_t width,
                    const mst_pool_config* cfg, int n_slots, int64_t R_max) {
    memset(e, 0, sizeof *e);
    e->ctx = ctx;
    e->rng = rng;
    e->dtype = dt;
    e->width = width;
    e->row_bytes = width * (int64_t)mst_dtype_size(dt);
    e->R_max = R_max;
    mst_status st = mst_pool_create(ctx, dt, width, cfg, &e->pool);
    CHECK(st == MST_OK, "pool create %s W=%lld: %s", mst_dtype_name(dt), (long long)width, mst_last_error());
    if (st != MST_OK) return 0;
    e->m.page_rows = cfg->page_rows;
    e->m.cap[0] = cfg->n_dev_pages;
    e->m.cap[1] = cfg->n_host_pages;
    e->n_slots = n_slots;
    e->slots = (slot*)calloc((size_t)n_slots, sizeof(slot));
    for (int i = 0; i < n_slots; i++) {
        e->slots[i].R = R_max - mst_rng_int(rng, 0, R_max / 3);
        e->slots[i].want = (unsigned char*)malloc((size_t)(R_max * e->row_bytes));
        CHECK_OK(mst_stash_handle_create(e->pool, e->slots[i].R, &e->slots[i].h));
    }
    e->src = mst_guarded_alloc(ctx, (size_t)(R_max * e->row_bytes));
    e->dst = mst_guarded_alloc(ctx, (size_t)(R_max * e->row_bytes));
    e->counts = mst_guarded_alloc(ctx, sizeof(int32_t) * E_MAX);
    e->host = (unsigned char*)malloc((size_t)(R_max * e->row_bytes));
    return 1;
}

static void env_close(env* e) {
    for (int i = 0; i < e->n_slots; i++) {
        mst_stash_handle_destroy(e->slots[i].h);
        free(e->slots[i].want);
    }
    mst_pool_destroy(e->pool);
    mst_guarded_free(e->ctx, &e->src);
    mst_guarded_free(e->ctx, &e->dst);
    mst_guarded_free(e->ctx, &e->counts);
    free(e->slots);
    free(e->host);
}

/* The pool's counters and invariants against the model. */
static void expect_pool(env* e, const char* what) {
    CHECK_STATUS(mst_pool_check(e->pool), MST_OK);
    mst_pool_stats s = MST_POOL_STATS_INIT;
    CHECK_OK(mst_pool_stats_get(e->pool, &s));
    CHECK(s.dev_used == e->m.used[0] && s.host_used == e->m.used[1],
          "%s: %lld + %lld pages used, model %lld + %lld", what, (long long)s.dev_used,
          (long long)s.host_used, (long long)e->m.used[0], (long long)e->m.used[1]);
    CHECK(s.spilled_pages == e->m.spilled, "%s: %lld pages spilled, model %lld", what,
          (long long)s.spilled_pages, (long long)e->m.spilled);
    CHECK(s.overflowed == e->m.overflow, "%s: overflowed %d, model %d", what, s.overflowed, e->m.overflow);
}

/* Saves n rows (random counts over E groups) of fresh random data from a
 * src of src_rows rows into slot i, overwriting the source right after so a
 * restore must read the pages. */
static void save_from(env* e, int i, int64_t n, int64_t src_rows) {
    slot* s = &e->slots[i];
    int32_t counts[E_MAX];
    const int E = (int)mst_rng_int(e->rng, 1, E_MAX);
    mst_rng_counts(e->rng, counts, E, n, mst_rng_uniform(e->rng));
    fill_random(e, e->host, src_rows);
    mst_guarded_put(e->ctx, &e->src, e->host);
    mst_guarded_put(e->ctx, &e->counts, counts);
    mst_tensor src = mst_tensor_make(e->src.data, e->dtype, src_rows, e->width);
    mst_tensor tc = mst_tensor_make(e->counts.data, MST_DTYPE_INT32, E, 1);
    CHECK_OK(mst_stash_save(e->pool, s->h, &src, &tc));
    model_save(&e->m, s, n);
    if (s->live) memcpy(s->want, e->host, (size_t)(n * e->row_bytes));
    fill_random(e, e->host, src_rows);
    mst_guarded_put(e->ctx, &e->src, e->host); /* the pages must not alias src */
}

/* save_from a src of the handle's rows. */
static void do_save(env* e, int i, int64_t n) { save_from(e, i, n, e->slots[i].R); }

/* Restores slot i into poisoned dst: rows [0, n) bit-exact, the rest (all of
 * it when the slot holds nothing) still poisoned, guards intact. Half of the
 * restores at random are split (copy, pages still held, then the return). */
static void do_restore(env* e, int i, const char* what) {
    slot* s = &e->slots[i];
    mst_guarded_put(e->ctx, &e->dst, NULL);
    mst_tensor dst = mst_tensor_make(e->dst.data, e->dtype, s->R, e->width);
    if (mst_rng_int(e->rng, 0, 1)) {
        CHECK_OK(mst_stash_restore_copy(e->pool, s->h, &dst));
        expect_pool(e, what); /* the model still counts the pages as held */
        CHECK_OK(mst_stash_restore_return(e->pool, s->h));
    } else {
        CHECK_OK(mst_stash_restore(e->pool, s->h, &dst));
    }
    const int64_t n = s->live ? s->n : 0;
    mst_guarded_get(e->ctx, &e->dst, e->host);
    const int64_t bytes = n * e->row_bytes;
    int64_t d = mst_first_diff(e->host, s->want, (size_t)bytes);
    CHECK(d < 0, "%s: %s W=%lld slot %d n=%lld: restored byte %lld differs", what,
          mst_dtype_name(e->dtype), (long long)e->width, i, (long long)n, (long long)d);
    int64_t bad = -1;
    for (int64_t b = bytes; b < s->R * e->row_bytes && bad < 0; b++)
        if (e->host[b] != MST_POISON) bad = b;
    CHECK(bad < 0, "%s: slot %d n=%lld: byte %lld past the valid rows was written", what, i,
          (long long)n, (long long)bad);
    CHECK(mst_guarded_intact(e->ctx, &e->dst), "%s: dst guard bytes overwritten", what);
    model_restore(&e->m, s);
}

static int64_t rand_rows(env* e, int i) {
    const int64_t R = e->slots[i].R;
    switch (mst_rng_int(e->rng, 0, 5)) {
    case 0: return 0;
    case 1: return R;
    case 2: return e->m.page_rows * mst_rng_int(e->rng, 0, R / e->m.page_rows);
    default: return mst_rng_int(e->rng, 1, R);
    }
}

/* Random interleaving: each step saves into a free slot or restores a live
 * one, in any order; every step checked. Ends with every page returned. */
static void random_interleave(mst_ctx_t* ctx, mst_rng* rng, mst_dtype dt, int64_t width,
                              int64_t page_rows, int n_slots, int n_ops, double dev_share) {
    const int64_t R_max = 3 * page_rows + mst_rng_int(rng, 1, 2 * page_rows);
    const int64_t worst = n_slots * ((R_max + page_rows - 1) / page_rows);
    /* copy_sms 0 (all) or 1-3: a persistent grid far smaller than the copy */
    mst_pool_config cfg = {sizeof(mst_pool_config), page_rows, (int64_t)(worst * dev_share), 0, (int32_t)mst_rng_int(rng, 0, 3)};
    cfg.n_host_pages = worst - cfg.n_dev_pages; /* spills, never overflows */
    env e;
    if (!env_open(&e, ctx, rng, dt, width, &cfg, n_slots, R_max)) return;
    char what[96];
    snprintf(what, sizeof what, "interleave %s W=%lld pr=%lld dev %lld host %lld", mst_dtype_name(dt),
             (long long)width, (long long)page_rows, (long long)cfg.n_dev_pages, (long long)cfg.n_host_pages);
    for (int op = 0; op < n_ops; op++) {
        const int i = (int)mst_rng_int(rng, 0, n_slots - 1);
        if (e.slots[i].live) do_restore(&e, i, what);
        else do_save(&e, i, rand_rows(&e, i));
        expect_pool(&e, what);
    }
    for (int i = 0; i < n_slots; i++)
        if (e.slots[i].live) do_restore(&e, i, what);
    expect_pool(&e, what);
    CHECK(e.m.used[0] + e.m.used[1] == 0, "%s: model still holds pages", what);
    env_close(&e);
}

/* Pipeline-like: W warm-up saves, then one save and one restore each step
 * with restores first-in-first-out (not the reverse of the saves), then the
 * cool-down restores in reverse. */
static void pipeline_order(mst_ctx_t* ctx, mst_rng* rng) {
    enum { M = 12, W = 4 };
    const int64_t pr = 16, R = 150;
    mst_pool_config cfg = {sizeof(mst_pool_config), pr, (W + 1) * ((R + pr - 1) / pr) / 2, (W + 1) * ((R + pr - 1) / pr), 0};
    env e;
    if (!env_open(&e, ctx, rng, MST_DTYPE_BF16, 40, &cfg, M, R)) return;
    int order[M];
    for (int i = 0; i < M; i++) order[i] = i;
    int next_restore = 0;
    for (int mb = 0; mb < M; mb++) {
        do_save(&e, mb, mst_rng_int(rng, R / 2, e.slots[mb].R));
        expect_pool(&e, "pipeline save");
        if (mb >= W - 1 && mb < M - 1) {
            do_restore(&e, order[next_restore++], "pipeline 1F1B restore");
            expect_pool(&e, "pipeline restore");
        }
    }
    for (int k = M - 1; k >= next_restore; k--) {
        do_restore(&e, order[k], "pipeline cool-down restore");
        expect_pool(&e, "pipeline cool-down");
    }
    env_close(&e);
}

/* Spill: device block of 3 pages, the rest page by page to the host block. */
static void spill(mst_ctx_t* ctx, mst_rng* rng) {
    const int64_t pr = 8;
    mst_pool_config cfg = {sizeof(mst_pool_config), pr, 3, 40, 0};
    env e;
    if (!env_open(&e, ctx, rng, MST_DTYPE_BF16, 72, &cfg, 3, 100)) return;
    do_save(&e, 0, 8 * pr + 3); /* 9 pages: 3 device, 6 host */
    expect_pool(&e, "spill save");
    CHECK(e.m.used[0] == 3 && e.m.used[1] == 6, "spill model: %lld + %lld", (long long)e.m.used[0],
          (long long)e.m.used[1]);
    do_save(&e, 1, 2 * pr); /* all host */
    expect_pool(&e, "spill save 2");
    do_restore(&e, 0, "spill restore");
    expect_pool(&e, "spill restore");
    do_save(&e, 2, 5 * pr - 1); /* 3 device + 2 host again */
    expect_pool(&e, "spill save 3");
    do_restore(&e, 2, "spill restore 3");
    do_restore(&e, 1, "spill restore 2");
    expect_pool(&e, "spill end");
    env_close(&e);
}

static int32_t read_flag(mst_ctx_t* ctx, const int32_t* dev_flag) {
    int32_t v = -1;
    CHECK_OK(mst_copy_b2h(ctx, &v, dev_flag, sizeof v));
    return v;
}

/* Overflow: both blocks short. Nothing taken, nothing written, later saves
 * are no-ops, earlier handles restore intact, reset recovers. */
static void overflow(mst_ctx_t* ctx, mst_rng* rng) {
    const int64_t pr = 8;
    mst_pool_config cfg = {sizeof(mst_pool_config), pr, 3, 2, 0};
    env e;
    if (!env_open(&e, ctx, rng, MST_DTYPE_BF16, 24, &cfg, 4, 80)) return;
    CHECK_OK(mst_ctx_check(ctx));
    do_save(&e, 0, 3 * pr + 1); /* 4 pages: 3 device + 1 host */
    expect_pool(&e, "overflow: first save");
    CHECK_OK(mst_pool_poll(e.pool));
    do_save(&e, 1, 2 * pr); /* needs 2, 1 free: overflow */
    CHECK(e.m.overflow && !e.slots[1].live, "overflow: the model did not overflow");
    expect_pool(&e, "overflow: the save that overflowed");
    CHECK_STATUS(mst_pool_poll(e.pool), MST_ERR_OVERFLOW);
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_OVERFLOW);
    CHECK(read_flag(ctx, mst_pool_overflow_flag(e.pool)) != 0, "overflow flag not set on the device");
    do_save(&e, 2, pr / 2); /* one page would be free: still a no-op */
    CHECK(!e.slots[2].live, "overflow: the model took pages after the overflow");
    expect_pool(&e, "overflow: save after overflow");
    do_restore(&e, 1, "overflow: restore of the overflowed save"); /* writes nothing */
    do_restore(&e, 2, "overflow: restore of a skipped save");
    CHECK_OK(mst_ctx_check(ctx)); /* no state error: those handles hold nothing by design */
    do_restore(&e, 0, "overflow: restore of the save before it");
    expect_pool(&e, "overflow: after restores");
    CHECK_STATUS(mst_pool_poll(e.pool), MST_ERR_OVERFLOW); /* until reset */

    /* reset with a live handle: the handle holds nothing afterwards */
    do_save(&e, 3, pr); /* still a no-op */
    CHECK_OK(mst_pool_reset(e.pool));
    e.m.overflow = 0;
    e.m.spilled = 0;
    CHECK_OK(mst_pool_poll(e.pool));
    CHECK(read_flag(ctx, mst_pool_overflow_flag(e.pool)) == 0, "overflow flag still set after reset");
    expect_pool(&e, "overflow: after reset");
    do_save(&e, 0, 3 * pr + 2); /* 3 device + 1 host */
    do_save(&e, 1, 1);          /* the last host page */
    expect_pool(&e, "overflow: saves after reset");
    CHECK_OK(mst_pool_reset(e.pool)); /* slots 0 and 1 are stale now */
    e.m.used[0] = e.m.used[1] = e.m.spilled = 0;
    e.slots[0].live = e.slots[1].live = 0;
    expect_pool(&e, "overflow: reset with live handles");
    mst_guarded_put(ctx, &e.dst, NULL);
    mst_tensor dst = mst_tensor_make(e.dst.data, MST_DTYPE_BF16, e.slots[0].R, 24);
    int cpu = mst_ctx_backend(ctx) == MST_BACKEND_CPU;
    CHECK_STATUS(mst_stash_restore(e.pool, e.slots[0].h, &dst), cpu ? MST_ERR_STATE : MST_OK);
    CHECK_STATUS(mst_pool_poll(e.pool), MST_ERR_STATE);
    do_save(&e, 1, 3 * pr); /* a stale handle saves again */
    do_restore(&e, 1, "overflow: save into a stale handle");
    expect_pool(&e, "overflow: end");
    env_close(&e);
}

/* A src with more rows than the handle: a save of more rows than the handle
 * holds overflows (nothing taken or written); after a reset a save of the
 * handle's rows from the same src restores bit-exact. */
static void handle_capacity(mst_ctx_t* ctx, mst_rng* rng) {
    const int64_t pr = 8, R_max = 80;
    mst_pool_config cfg = {sizeof(mst_pool_config), pr, 20, 4, 0};
    env e;
    if (!env_open(&e, ctx, rng, MST_DTYPE_BF16, 24, &cfg, 2, R_max)) return;
    slot* s = &e.slots[0];
    mst_stash_handle_destroy(s->h);
    s->R = 5 * pr - 3; /* 5 pages of the 12 free */
    CHECK_OK(mst_stash_handle_create(e.pool, s->R, &s->h));
    save_from(&e, 0, s->R + 1, R_max); /* 6 pages: past the handle */
    CHECK(e.m.overflow && !s->live, "capacity: the model did not overflow");
    expect_pool(&e, "capacity: save past the handle");
    CHECK_STATUS(mst_pool_poll(e.pool), MST_ERR_OVERFLOW);
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_OVERFLOW);
    do_restore(&e, 0, "capacity: restore of the overflowed save"); /* writes nothing */
    CHECK_OK(mst_pool_reset(e.pool));
    e.m.overflow = 0;
    save_from(&e, 0, s->R, R_max);
    expect_pool(&e, "capacity: save of the handle's rows");
    do_restore(&e, 0, "capacity: restore");
    expect_pool(&e, "capacity: end");
    env_close(&e);
}

/* Sizing: a measuring pool big enough for everything records the peak; a
 * pool from that peak x 1.10 runs the same sequence without overflow; one
 * from 0.5 device + 0.6 host spills and does not overflow either. */
static void sizing(mst_ctx_t* ctx, mst_rng* rng) {
    const int64_t pr = 16, R = 120;
    enum { N = 6 };
    int64_t rows[N];
    for (int i = 0; i < N; i++) rows[i] = mst_rng_int(rng, 1, R - R / 3);
    mst_pool_config measure = {sizeof(mst_pool_config), pr, N * ((R + pr - 1) / pr), 0, 0};
    mst_pool_stats peak = MST_POOL_STATS_INIT;
    const double factors[3][2] = {{0, 0}, {MST_POOL_DEV_FACTOR, MST_POOL_HOST_FACTOR}, {0.5, 0.6}};
    for (int run = 0; run < 3; run++) {
        mst_pool_config cfg = measure;
        if (run > 0) CHECK_OK(mst_pool_config_from_peak(&peak, factors[run][0], factors[run][1], &cfg));
        env e;
        if (!env_open(&e, ctx, rng, MST_DTYPE_FP32, 1, &cfg, N, R)) return;
        /* saves 0..3, restore 1, saves 4, 5, restore the rest out of order */
        for (int i = 0; i < 4; i++) do_save(&e, i, rows[i]);
        do_restore(&e, 1, "sizing");
        do_save(&e, 4, rows[4]);
        do_save(&e, 5, rows[5]);
        const int rest[] = {3, 0, 5, 2, 4};
        for (int k = 0; k < 5; k++) do_restore(&e, rest[k], "sizing");
        expect_pool(&e, "sizing");
        mst_pool_stats s = MST_POOL_STATS_INIT;
        CHECK_OK(mst_pool_stats_get(e.pool, &s));
        CHECK(s.total_peak == e.m.peak_total, "sizing run %d: peak %lld pages, model %lld", run,
              (long long)s.total_peak, (long long)e.m.peak_total);
        CHECK(!s.overflowed, "sizing run %d overflowed", run);
        if (run == 0) peak = s;
        if (run == 1)
            CHECK(cfg.n_dev_pages == (int64_t)ceil(peak.total_peak * 1.10) && cfg.n_host_pages == 0,
                  "from_peak: %lld device / %lld host pages for peak %lld", (long long)cfg.n_dev_pages,
                  (long long)cfg.n_host_pages, (long long)peak.total_peak);
        if (run == 2) CHECK(s.spilled_pages > 0, "sizing at 0.5 device did not spill");
        env_close(&e);
    }
}

/* Bad input: clear statuses naming the argument; device-side cases flagged. */
static void bad_input(mst_ctx_t* ctx, mst_rng* rng) {
    const int cpu = mst_ctx_backend(ctx) == MST_BACKEND_CPU;
    const int64_t pr = 8, W = 16;
    mst_pool_config cfg = {sizeof(mst_pool_config), pr, 20, 0, 0};
    mst_pool_t* p = NULL;
    CHECK_STATUS(mst_pool_create(NULL, MST_DTYPE_BF16, W, &cfg, &p), MST_ERR_INVALID);
    CHECK_STATUS(mst_pool_create(ctx, MST_DTYPE_INT32, W, &cfg, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "dtype") != NULL, "message does not name dtype: %s", mst_last_error());
    CHECK_STATUS(mst_pool_create(ctx, MST_DTYPE_BF16, 0, &cfg, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "width") != NULL, "message does not name width: %s", mst_last_error());
    CHECK_STATUS(mst_pool_create(ctx, MST_DTYPE_BF16, W, NULL, &p), MST_ERR_INVALID);
    mst_pool_config bad = {sizeof(mst_pool_config), 12, 20, 0, 0};
    CHECK_STATUS(mst_pool_create(ctx, MST_DTYPE_BF16, W, &bad, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "page_rows = 12") != NULL, "message: %s", mst_last_error());
    bad = (mst_pool_config){sizeof(mst_pool_config), 8, 0, 0, 0};
    CHECK_STATUS(mst_pool_create(ctx, MST_DTYPE_BF16, W, &bad, &p), MST_ERR_INVALID);
    bad = (mst_pool_config){sizeof(mst_pool_config), 8, -1, 5, 0};
    CHECK_STATUS(mst_pool_create(ctx, MST_DTYPE_BF16, W, &bad, &p), MST_ERR_INVALID);
    bad = (mst_pool_config){sizeof(mst_pool_config), 8, 20, 0, -1};
    CHECK_STATUS(mst_pool_create(ctx, MST_DTYPE_BF16, W, &bad, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "copy_sms = -1") != NULL, "message: %s", mst_last_error());
    CHECK(p == NULL, "a failed create left a pool");
    mst_pool_config out = MST_POOL_CONFIG_INIT;
    mst_pool_stats st0 = {.struct_size = sizeof(mst_pool_stats), .page_rows = 64, .total_peak = 10};
    CHECK_STATUS(mst_pool_config_from_peak(&st0, -1, 0, &out), MST_ERR_INVALID);
    CHECK_STATUS(mst_pool_config_from_peak(&st0, 0, 0, &out), MST_ERR_INVALID);
    CHECK_OK(mst_pool_config_from_peak(&st0, 1.10, 0.25, &out));
    CHECK(out.n_dev_pages == 11 && out.n_host_pages == 3 && out.page_rows == 64, "from_peak: %lld / %lld",
          (long long)out.n_dev_pages, (long long)out.n_host_pages);

    env e;
    if (!env_open(&e, ctx, rng, MST_DTYPE_BF16, W, &cfg, 3, 40)) return;
    mst_stash_handle_t* h = NULL;
    CHECK_STATUS(mst_stash_handle_create(e.pool, 0, &h), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "max_rows") != NULL, "message: %s", mst_last_error());
    CHECK_STATUS(mst_stash_handle_create(NULL, 10, &h), MST_ERR_INVALID);
    slot* s0 = &e.slots[0];
    mst_tensor src = mst_tensor_make(e.src.data, MST_DTYPE_BF16, s0->R, W);
    mst_tensor dst = mst_tensor_make(e.dst.data, MST_DTYPE_BF16, s0->R, W);
    mst_tensor tc = mst_tensor_make(e.counts.data, MST_DTYPE_INT32, 2, 1);
    mst_tensor t;
    CHECK_STATUS(mst_stash_save(NULL, s0->h, &src, &tc), MST_ERR_INVALID);
    CHECK_STATUS(mst_stash_save(e.pool, NULL, &src, &tc), MST_ERR_INVALID);
    CHECK_STATUS(mst_stash_save(e.pool, s0->h, NULL, &tc), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "src is NULL") != NULL, "message does not name src: %s", mst_last_error());
    CHECK_STATUS(mst_stash_save(e.pool, s0->h, &src, NULL), MST_ERR_INVALID);
    t = src, t.dtype = MST_DTYPE_FP32;
    CHECK_STATUS(mst_stash_save(e.pool, s0->h, &t, &tc), MST_ERR_INVALID);
    t = src, t.cols = W + 1;
    CHECK_STATUS(mst_stash_save(e.pool, s0->h, &t, &tc), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "width") != NULL, "message: %s", mst_last_error());
    t = tc, t.cols = 2;
    CHECK_STATUS(mst_stash_save(e.pool, s0->h, &src, &t), MST_ERR_INVALID);
    t = dst, t.rows = s0->R - 1;
    CHECK_STATUS(mst_stash_restore(e.pool, s0->h, &t), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "dst has ") != NULL, "message does not name dst: %s", mst_last_error());
    CHECK_STATUS(mst_stash_restore(e.pool, s0->h, NULL), MST_ERR_INVALID);
    CHECK_STATUS(mst_stash_restore_copy(e.pool, s0->h, &t), MST_ERR_INVALID);
    CHECK_STATUS(mst_stash_restore_return(e.pool, NULL), MST_ERR_INVALID);
    expect_pool(&e, "bad arguments");

    /* counts summing past src rows, and a negative count: nothing taken */
    const int32_t past[E_MAX] = {(int32_t)s0->R, 1}, neg[E_MAX] = {5, -1};
    const int32_t* cases[2] = {past, neg};
    for (int c = 0; c < 2; c++) {
        mst_guarded_put(ctx, &e.counts, cases[c]);
        mst_guarded_put(ctx, &e.src, NULL);
        CHECK_STATUS(mst_stash_save(e.pool, s0->h, &src, &tc), cpu ? MST_ERR_COUNTS : MST_OK);
        CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS);
        CHECK_OK(mst_pool_poll(e.pool));
        expect_pool(&e, "bad counts");
        do_restore(&e, 0, "restore after bad counts"); /* writes nothing, no error */
        CHECK_OK(mst_pool_poll(e.pool));
    }

    /* restore of a never-saved handle, and twice */
    dst.rows = e.R_max;
    CHECK_STATUS(mst_stash_restore(e.pool, e.slots[1].h, &dst), cpu ? MST_ERR_STATE : MST_OK);
    CHECK_STATUS(mst_pool_poll(e.pool), MST_ERR_STATE);
    CHECK(strstr(mst_last_error(), "holds nothing") != NULL, "message: %s", mst_last_error());
    CHECK_OK(mst_pool_poll(e.pool)); /* cleared by the poll */
    do_save(&e, 1, 17);
    do_restore(&e, 1, "restore once");
    CHECK_OK(mst_pool_poll(e.pool));
    mst_guarded_put(ctx, &e.dst, NULL);
    CHECK_STATUS(mst_stash_restore(e.pool, e.slots[1].h, &dst), cpu ? MST_ERR_STATE : MST_OK);
    CHECK_STATUS(mst_pool_poll(e.pool), MST_ERR_STATE);
    mst_guarded_get(ctx, &e.dst, e.host);
    int written = 0;
    for (int64_t b = 0; b < e.R_max * e.row_bytes; b++) written |= e.host[b] != MST_POISON;
    CHECK(!written, "a restore of a handle that holds nothing wrote into dst");
    expect_pool(&e, "restore twice");

    /* save into a handle that still holds pages: kept, flagged */
    do_save(&e, 2, e.slots[2].R - 3);
    mst_tensor src2 = mst_tensor_make(e.src.data, MST_DTYPE_BF16, e.slots[2].R, W);
    CHECK_STATUS(mst_stash_save(e.pool, e.slots[2].h, &src2, &tc), cpu ? MST_ERR_STATE : MST_OK);
    CHECK_STATUS(mst_pool_poll(e.pool), MST_ERR_STATE);
    CHECK(strstr(mst_last_error(), "still holds") != NULL, "message: %s", mst_last_error());
    expect_pool(&e, "save into a live handle");
    do_restore(&e, 2, "restore after a rejected save"); /* the first save's rows */
    expect_pool(&e, "bad input end");
    CHECK_OK(mst_ctx_check(ctx));
    env_close(&e);
}

/* Unaligned rows (a view one element in): the element-wise copy path. */
static void unaligned(mst_ctx_t* ctx, mst_rng* rng) {
    const int64_t pr = 8, W = 5, R = 61;
    mst_pool_config cfg = {sizeof(mst_pool_config), pr, 4, 8, 0};
    env e;
    if (!env_open(&e, ctx, rng, MST_DTYPE_BF16, W, &cfg, 0, R + 1)) return;
    const int64_t n = 53;
    int32_t counts[E_MAX] = {20, 0, 33};
    fill_random(&e, e.host, R + 1);
    mst_guarded_put(ctx, &e.src, e.host);
    mst_guarded_put(ctx, &e.counts, counts);
    mst_tensor src = mst_tensor_make((char*)e.src.data + 2, MST_DTYPE_BF16, R, W);
    mst_tensor tc = mst_tensor_make(e.counts.data, MST_DTYPE_INT32, 3, 1);
    mst_stash_handle_t* h = NULL;
    CHECK_OK(mst_stash_handle_create(e.pool, R, &h));
    CHECK_OK(mst_stash_save(e.pool, h, &src, &tc));
    mst_guarded_put(ctx, &e.dst, NULL);
    mst_tensor dst = mst_tensor_make((char*)e.dst.data + 2, MST_DTYPE_BF16, R, W);
    CHECK_OK(mst_stash_restore(e.pool, h, &dst));
    unsigned char* got = (unsigned char*)malloc(e.dst.n_bytes);
    mst_guarded_get(ctx, &e.dst, got);
    CHECK(got[0] == MST_POISON && got[1] == MST_POISON, "unaligned: byte before dst written");
    CHECK(mst_first_diff(got + 2, e.host + 2, (size_t)(n * W * 2)) < 0, "unaligned: restore differs");
    int clean = 1;
    for (int64_t b = 2 + n * W * 2; b < (int64_t)e.dst.n_bytes; b++) clean &= got[b] == MST_POISON;
    CHECK(clean, "unaligned: rows past n written");
    CHECK_OK(mst_pool_check(e.pool));
    mst_stash_handle_destroy(h);
    free(got);
    env_close(&e);
}

/* ---- a save / restore sequence, captured on CUDA, eager on the CPU ---- */

enum { G_SLOTS = 3 };

typedef struct graph_seq {
    env* e;
    mst_guarded src[G_SLOTS], dst[G_SLOTS], counts[G_SLOTS];
} graph_seq;

/* save 0, save 1, restore 0, save 2, restore 2, restore 1 */
static mst_status seq_enqueue(graph_seq* g) {
    env* e = g->e;
    mst_tensor src[G_SLOTS], dst[G_SLOTS], tc[G_SLOTS];
    for (int i = 0; i < G_SLOTS; i++) {
        src[i] = mst_tensor_make(g->src[i].data, e->dtype, e->slots[i].R, e->width);
        dst[i] = mst_tensor_make(g->dst[i].data, e->dtype, e->slots[i].R, e->width);
        tc[i] = mst_tensor_make(g->counts[i].data, MST_DTYPE_INT32, 4, 1);
    }
    mst_status st = mst_stash_save(e->pool, e->slots[0].h, &src[0], &tc[0]);
    if (st == MST_OK) st = mst_stash_save(e->pool, e->slots[1].h, &src[1], &tc[1]);
    if (st == MST_OK) st = mst_stash_restore(e->pool, e->slots[0].h, &dst[0]);
    if (st == MST_OK) st = mst_stash_save(e->pool, e->slots[2].h, &src[2], &tc[2]);
    if (st == MST_OK) st = mst_stash_restore(e->pool, e->slots[2].h, &dst[2]);
    if (st == MST_OK) st = mst_stash_restore(e->pool, e->slots[1].h, &dst[1]);
    return st;
}

static void graph_replay(mst_ctx_t* ctx, mst_rng* rng, int64_t W) {
    const int64_t pr = 16, R = 200;
    mst_pool_config cfg = {sizeof(mst_pool_config), pr, 14, 13, 0}; /* two live saves of <= 13 pages: spills */
    env e;
    if (!env_open(&e, ctx, rng, MST_DTYPE_BF16, W, &cfg, G_SLOTS, R)) return;
    graph_seq g = {&e, {{0}}, {{0}}, {{0}}};
    for (int i = 0; i < G_SLOTS; i++) {
        g.src[i] = mst_guarded_alloc(ctx, (size_t)(R * e.row_bytes));
        g.dst[i] = mst_guarded_alloc(ctx, (size_t)(R * e.row_bytes));
        g.counts[i] = mst_guarded_alloc(ctx, 4 * sizeof(int32_t));
        int32_t c[4] = {1, 1, 1, 1};
        mst_guarded_put(ctx, &g.counts[i], c);
    }
    int captured = 0;
#ifdef MST_HAVE_CUDA
    cudaGraphExec_t exec = NULL;
    cudaStream_t stream = NULL;
    if (mst_ctx_backend(ctx) == MST_BACKEND_CUDA) {
        CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
        CHECK_OK(mst_ctx_set_stream(ctx, stream));
        cudaGraph_t graph = NULL;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "begin capture");
        mst_status st = seq_enqueue(&g);
        cudaError_t ce = cudaStreamEndCapture(stream, &graph);
        CHECK(st == MST_OK && ce == cudaSuccess, "capture: %s / %s", mst_last_error(), cudaGetErrorString(ce));
        if (ce == cudaSuccess) {
            ce = cudaGraphInstantiate(&exec, graph, 0);
            CHECK(ce == cudaSuccess, "instantiate: %s", cudaGetErrorString(ce));
            cudaGraphDestroy(graph);
        }
        captured = exec != NULL;
        CHECK_OK(mst_ctx_set_stream(ctx, NULL));
        if (!captured) return;
    }
#endif
    for (int rep = 0; rep < 4; rep++) {
        int64_t n[G_SLOTS];
        for (int i = 0; i < G_SLOTS; i++) {
            slot* s = &e.slots[i];
            n[i] = rep == 3 && i == 1 ? 0 : mst_rng_int(rng, 1, s->R);
            int32_t c[4];
            mst_rng_counts(rng, c, 4, n[i], 0.5);
            fill_random(&e, s->want, s->R);
            mst_guarded_put(ctx, &g.src[i], s->want);
            mst_guarded_put(ctx, &g.counts[i], c);
            mst_guarded_put(ctx, &g.dst[i], NULL);
        }
#ifdef MST_HAVE_CUDA
        if (captured) {
            CHECK(cudaGraphLaunch(exec, stream) == cudaSuccess, "graph launch");
            CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "graph sync");
        }
#endif
        if (!captured) CHECK_OK(seq_enqueue(&g));
        for (int i = 0; i < G_SLOTS; i++) {
            mst_guarded_get(ctx, &g.dst[i], e.host);
            const int64_t bytes = n[i] * e.row_bytes;
            CHECK(mst_first_diff(e.host, e.slots[i].want, (size_t)bytes) < 0,
                  "graph replay %d: slot %d (n = %lld) differs", rep, i, (long long)n[i]);
            int clean = 1;
            for (int64_t b = bytes; b < e.slots[i].R * e.row_bytes; b++) clean &= e.host[b] == MST_POISON;
            CHECK(clean, "graph replay %d: slot %d rows past n written", rep, i);
            CHECK(mst_guarded_intact(ctx, &g.dst[i]), "graph replay %d: guards", rep);
        }
        CHECK_OK(mst_pool_check(e.pool));
        mst_pool_stats s = MST_POOL_STATS_INIT;
        CHECK_OK(mst_pool_stats_get(e.pool, &s));
        CHECK(s.dev_used == 0 && s.host_used == 0 && !s.overflowed, "graph replay %d: %lld + %lld pages left",
              rep, (long long)s.dev_used, (long long)s.host_used);
        CHECK_OK(mst_pool_poll(e.pool));
    }
#ifdef MST_HAVE_CUDA
    if (exec) cudaGraphExecDestroy(exec);
    if (stream) cudaStreamDestroy(stream);
#endif
    for (int i = 0; i < G_SLOTS; i++) {
        mst_guarded_free(ctx, &g.src[i]);
        mst_guarded_free(ctx, &g.dst[i]);
        mst_guarded_free(ctx, &g.counts[i]);
    }
    env_close(&e);
}

/* A claim takes and tables the pages without copying: rows written into
 * them by hand (as a producer would) come back bit for bit through a
 * restore, rows past n untouched, no page leaked; a claim that overflows
 * leaves a table of invalid ids (a producer's writes go nowhere). */
static void claim(mst_ctx_t* ctx, mst_rng* rng) {
    const int64_t W = 96, R = 700, pr = 16 << (mst_rng_next(rng) % 3), max_pages = (R + pr - 1) / pr;
    const int64_t n = R - (int64_t)(mst_rng_next(rng) % 100), used = (n + pr - 1) / pr, rb = 2 * W;
    int32_t counts[4];
    mst_rng_counts(rng, counts, 4, n, 0.5);
    mst_guarded gc = mst_guarded_alloc(ctx, sizeof counts), gd = mst_guarded_alloc(ctx, (size_t)(R * rb));
    mst_guarded_put(ctx, &gc, counts);
    const mst_tensor tc = mst_tensor_make(gc.data, MST_DTYPE_INT32, 4, 1);
    mst_tensor dst = mst_tensor_make(gd.data, MST_DTYPE_BF16, R, W);
    uint16_t* rows = (uint16_t*)malloc((size_t)(R * rb));
    uint16_t* back = (uint16_t*)malloc((size_t)(R * rb));
    uint16_t* poison = (uint16_t*)malloc((size_t)(R * rb));
    uint32_t* table = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)max_pages);
    mst_rng_bf16(rng, rows, (size_t)(R * W), 1.0);
    mst_rng_bf16(rng, poison, (size_t)(R * W), 1.0);
    for (int big = 1; big >= 0; big--) { /* enough pages, then one page only */
        mst_pool_config cfg = {sizeof(mst_pool_config), pr, big ? max_pages + 2 : 1, 0, 0};
        mst_pool_t* pool = NULL;
        mst_stash_handle_t* h = NULL;
        CHECK_OK(mst_pool_create(ctx, MST_DTYPE_BF16, W, &cfg, &pool));
        CHECK_OK(mst_stash_handle_create(pool, R, &h));
        CHECK_STATUS(mst_stash_claim(pool, h, -1, &tc), MST_ERR_INVALID);
        CHECK(strstr(mst_last_error(), "rows = -1") != NULL, "message names rows: %s", mst_last_error());
        CHECK_OK(mst_stash_claim(pool, h, R, &tc));
        mst_pages pg;
        CHECK_OK(mst_stash_handle_pages(h, &pg));
        CHECK_OK(mst_copy_b2h(ctx, table, pg.table, sizeof(uint32_t) * (size_t)max_pages));
        if (!big) {
            CHECK_STATUS(mst_pool_poll(pool), MST_ERR_OVERFLOW);
            int64_t valid = 0;
            for (int64_t i = 0; i < max_pages; i++) valid += table[i] != 0xffffffffu;
            CHECK(valid == 0, "overflowed claim: %lld table entries still name pages", (long long)valid);
        } else {
            CHECK_OK(mst_pool_poll(pool));
            for (int64_t i = 0; i < used; i++) { /* the producer's writes */
                CHECK(table[i] < (uint32_t)pg.n_pages[0], "claim: table[%lld] = %u", (long long)i, table[i]);
                for (int64_t j = 0; j < i && table[i] < (uint32_t)pg.n_pages[0]; j++)
                    CHECK(table[j] != table[i], "claim: page %u tabled twice", table[i]);
                const int64_t r0 = i * pr, nr = n - r0 < pr ? n - r0 : pr;
                if (table[i] < (uint32_t)pg.n_pages[0])
                    CHECK_OK(mst_copy_h2b(ctx, (char*)pg.block[0] + (size_t)table[i] * (size_t)(pr * rb),
                                          rows + r0 * W, (size_t)(nr * rb)));
            }
        }
        mst_guarded_put(ctx, &gd, poison);
        CHECK_OK(mst_stash_restore(pool, h, &dst));
        if (big) CHECK_OK(mst_ctx_check(ctx));
        else CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_OVERFLOW); /* reported, then cleared */
        mst_guarded_get(ctx, &gd, back);
        const int64_t got = big ? n : 0; /* rows restored: a VOID handle writes nothing */
        CHECK(mst_first_diff(back, rows, (size_t)(got * rb)) < 0, "claimed rows differ after the restore");
        CHECK(mst_first_diff(back + got * W, poison + got * W, (size_t)((R - got) * rb)) < 0,
              "rows past %lld written by the restore", (long long)got);
        CHECK(mst_guarded_intact(ctx, &gd), "claim restore: guard bytes overwritten");
        CHECK_OK(mst_pool_check(pool));
        mst_stash_handle_destroy(h);
        mst_pool_destroy(pool);
    }
    mst_guarded_free(ctx, &gc), mst_guarded_free(ctx, &gd);
    free(rows), free(back), free(poison), free(table);
}

/* The pool state in backend memory, read or written by the test. */
static void state_io(mst_pool_t* pool, mst_pool_state* st, int write) {
    if (write) CHECK_OK(mst_copy_h2b(pool->ctx, pool->a.st, st, sizeof *st));
    else CHECK_OK(mst_copy_b2h(pool->ctx, st, pool->a.st, sizeof *st));
}

/* mst_pool_check sees a corrupted pool: a page both free in the ring and
 * held by a live handle, and a page in no ring and no handle (leaked); the
 * state put back, it passes again. */
static void check_sees_corruption(mst_ctx_t* ctx, mst_rng* rng) {
    env e;
    mst_pool_config cfg = {sizeof(mst_pool_config), 16, 8, 4, 0};
    if (!env_open(&e, ctx, rng, MST_DTYPE_BF16, 24, &cfg, 2, 64)) return;
    do_save(&e, 0, 40); /* 3 device pages */
    expect_pool(&e, "before the corruption");
    mst_pool_state good, bad;
    state_io(e.pool, &good, 0);
    mst_pages pg;
    CHECK_OK(mst_stash_handle_pages(e.slots[0].h, &pg));
    uint32_t last;
    CHECK_OK(mst_copy_b2h(ctx, &last, pg.table + 2, sizeof last)); /* the handle's third page */
    char want[96];
    bad = good; /* the handle's last page back in the free ring: owned twice */
    bad.head[MST_BLK_DEV]--;
    state_io(e.pool, &bad, 1);
    CHECK_STATUS(mst_pool_check(e.pool), MST_ERR_STATE);
    snprintf(want, sizeof want, "page id 0x%x is in two places (again in handle #", last);
    CHECK(strstr(mst_last_error(), want) != NULL, "owned twice: '%s' lacks '%s'", mst_last_error(), want);
    bad = good; /* the first free page taken from the ring by no handle: leaked */
    bad.head[MST_BLK_DEV]++;
    state_io(e.pool, &bad, 1);
    CHECK_STATUS(mst_pool_check(e.pool), MST_ERR_STATE);
    CHECK(strstr(mst_last_error(), "device page 3 is in no ring and no live handle") != NULL, "leaked: '%s'",
          mst_last_error());
    state_io(e.pool, &good, 1);
    expect_pool(&e, "after the state was put back");
    do_restore(&e, 0, "after the corruption");
    env_close(&e);
}

/* ---- batches against the same operations one by one ---- */

enum { B_POOLS = 6, B_R = 200, B_E = 5 };

/* One pool kind of the batch test, twice: [0] driven by batches, [1] by the
 * single calls. */
typedef struct twin {
    mst_pool_t* pool[2];
    mst_stash_handle_t* h[2];
    mst_guarded src, counts, dst[2];
    int64_t rb;        /* row bytes                           */
    int64_t n;         /* rows of the save                    */
    unsigned char* in; /* [B_R, rb] the saved rows            */
} twin;

/* The pool, handle and table of twin t, [0] and [1], byte for byte. */
static void expect_twins(mst_ctx_t* ctx, twin* t, int i, const char* what) {
    mst_pool_state st[2];
    mst_handle_state hs[2];
    uint32_t table[2][B_R];
    for (int k = 0; k < 2; k++) {
        state_io(t->pool[k], &st[k], 0);
        CHECK_OK(mst_copy_b2h(ctx, &hs[k], t->h[k]->hs, sizeof hs[k]));
        CHECK_OK(mst_copy_b2h(ctx, table[k], mst_handle_table(t->h[k]->hs), sizeof(uint32_t) * (size_t)t->h[k]->max_pages));
        CHECK_OK(mst_pool_check(t->pool[k]));
    }
    CHECK(memcmp(&st[0], &st[1], sizeof st[0]) == 0, "%s: pool %d: the batch left another pool state", what, i);
    CHECK(memcmp(&hs[0], &hs[1], sizeof hs[0]) == 0, "%s: pool %d: the batch left another handle state", what, i);
    CHECK(memcmp(table[0], table[1], sizeof(uint32_t) * (size_t)t->h[0]->max_pages) == 0,
          "%s: pool %d: the batch tabled other pages", what, i);
}

/* dst [k] of twin t after a restore of `rows` rows: t->in's rows, the rest
 * poisoned, guards intact. */
static void expect_restored(mst_ctx_t* ctx, twin* t, int i, int k, int64_t rows, const char* what) {
    unsigned char* got = (unsigned char*)malloc(t->dst[k].n_bytes);
    mst_guarded_get(ctx, &t->dst[k], got);
    CHECK(mst_first_diff(got, t->in, (size_t)(rows * t->rb)) < 0, "%s: pool %d (%s): restored rows differ", what, i,
          k ? "single" : "batch");
    int clean = 1;
    for (int64_t b = rows * t->rb; b < (int64_t)t->dst[k].n_bytes; b++) clean &= got[b] == MST_POISON;
    CHECK(clean, "%s: pool %d (%s): rows past %lld written", what, i, k ? "single" : "batch", (long long)rows);
    CHECK(mst_guarded_intact(ctx, &t->dst[k]), "%s: pool %d (%s): guard bytes overwritten", what, i,
          k ? "single" : "batch");
    free(got);
}

/* Saves (a claim, an overflow, a spill among them), restores (whole, copy
 * then page return) and resets of six pools of different dtypes and widths
 * in batches leave the pools, handles and tables of the same calls made one
 * by one, and restore the same bytes: rows past n still poisoned, guards
 * intact, the overflow flagged on its pool alone. Then the batch's own
 * errors. */
static void batch_twins(mst_ctx_t* ctx, mst_rng* rng) {
    const struct { mst_dtype dt; int64_t W, pr, dev, host; int claim, overflow; } spec[B_POOLS] = {
        {MST_DTYPE_BF16, 64, 16, 20, 0, 0, 0},  /* fc1_input-like                   */
        {MST_DTYPE_BF16, 40, 8, 6, 30, 0, 0},   /* spills into host pages            */
        {MST_DTYPE_FP32, 1, 64, 8, 0, 0, 0},    /* probs                             */
        {MST_DTYPE_BF16, 512, 16, 20, 0, 1, 0}, /* 16 KiB pages, claimed             */
        {MST_DTYPE_BF16, 24, 8, 2, 1, 0, 1},    /* too few pages: overflows          */
        {MST_DTYPE_BF16, 8, 8, 30, 0, 0, 0},    /* 16-byte rows, restored unaligned  */
    };
    twin tw[B_POOLS];
    memset(tw, 0, sizeof tw);
    mst_stash_batch b = {0};
    for (int i = 0; i < B_POOLS; i++) {
        twin* t = &tw[i];
        const mst_pool_config cfg = {sizeof(mst_pool_config), spec[i].pr, spec[i].dev, spec[i].host, 0};
        t->rb = spec[i].W * (int64_t)mst_dtype_size(spec[i].dt);
        for (int k = 0; k < 2; k++) {
            CHECK_OK(mst_pool_create(ctx, spec[i].dt, spec[i].W, &cfg, &t->pool[k]));
            CHECK_OK(mst_stash_handle_create(t->pool[k], B_R, &t->h[k]));
            t->dst[k] = mst_guarded_alloc(ctx, (size_t)(B_R * t->rb) + 2); /* + 2: room to misalign */
        }
        t->n = spec[i].overflow ? 4 * spec[i].pr : mst_rng_int(rng, 1, B_R); /* 4 pages of 3 */
        t->in = (unsigned char*)malloc((size_t)(B_R * t->rb));
        if (spec[i].dt == MST_DTYPE_BF16) mst_rng_bf16(rng, (uint16_t*)t->in, (size_t)(B_R * spec[i].W), 1.0);
        else mst_rng_fp32(rng, (float*)t->in, (size_t)(B_R * spec[i].W), -2.0, 2.0);
        int32_t c[B_E];
        mst_rng_counts(rng, c, B_E, t->n, mst_rng_uniform(rng));
        t->src = mst_guarded_alloc(ctx, (size_t)(B_R * t->rb));
        t->counts = mst_guarded_alloc(ctx, sizeof c);
        mst_guarded_put(ctx, &t->src, t->in);
        mst_guarded_put(ctx, &t->counts, c);
        const mst_tensor src = mst_tensor_make(t->src.data, spec[i].dt, B_R, spec[i].W);
        const mst_tensor tc = mst_tensor_make(t->counts.data, MST_DTYPE_INT32, B_E, 1);
        if (spec[i].claim) {
            CHECK_OK(mst_stash_batch_claim(&b, t->pool[0], t->h[0], B_R, &tc));
            CHECK_OK(mst_stash_claim(t->pool[1], t->h[1], B_R, &tc));
        } else {
            CHECK_OK(mst_stash_batch_save(&b, t->pool[0], t->h[0], &src, &tc));
            CHECK_OK(mst_stash_save(t->pool[1], t->h[1], &src, &tc));
        }
    }
    CHECK_OK(mst_stash_batch_run(ctx, &b));
    CHECK(b.n == 0, "a batch run leaves %d slots", b.n);
    for (int i = 0; i < B_POOLS; i++) {
        mst_guarded_put(ctx, &tw[i].src, NULL); /* the restores must read the pages */
        expect_twins(ctx, &tw[i], i, "batched saves");
        CHECK_STATUS(mst_pool_poll(tw[i].pool[0]), spec[i].overflow ? MST_ERR_OVERFLOW : MST_OK);
    }
    CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_OVERFLOW);
    /* restores: pool 1 split (copy now, pages back in a second batch), the
       claim's pages (never written) only given back, the last pool's dst
       2 bytes past 16-byte alignment */
    for (int i = 0; i < B_POOLS; i++) {
        twin* t = &tw[i];
        const int part = i == 1 ? MST_RESTORE_COPY : spec[i].claim ? MST_RESTORE_RETURN : MST_RESTORE_ALL;
        for (int k = 0; k < 2; k++) {
            mst_guarded_put(ctx, &t->dst[k], NULL);
            mst_tensor dst = mst_tensor_make((char*)t->dst[k].data + (i == B_POOLS - 1 ? 2 : 0), spec[i].dt, B_R,
                                             spec[i].W);
            if (k == 0) CHECK_OK(mst_stash_batch_restore(&b, t->pool[0], t->h[0], &dst, part));
            else if (part == MST_RESTORE_COPY) CHECK_OK(mst_stash_restore_copy(t->pool[1], t->h[1], &dst));
            else if (part == MST_RESTORE_RETURN) CHECK_OK(mst_stash_restore_return(t->pool[1], t->h[1]));
            else CHECK_OK(mst_stash_restore(t->pool[1], t->h[1], &dst));
        }
    }
    CHECK_OK(mst_stash_batch_run(ctx, &b));
    CHECK_OK(mst_stash_batch_restore(&b, tw[1].pool[0], tw[1].h[0], NULL, MST_RESTORE_RETURN));
    CHECK_OK(mst_stash_batch_run(ctx, &b));
    CHECK_OK(mst_stash_restore_return(tw[1].pool[1], tw[1].h[1]));
    for (int i = 0; i < B_POOLS; i++) {
        twin* t = &tw[i];
        expect_twins(ctx, t, i, "batched restores");
        mst_pool_stats st = MST_POOL_STATS_INIT;
        CHECK_OK(mst_pool_stats_get(t->pool[0], &st));
        CHECK(st.dev_used + st.host_used == 0, "pool %d: %lld pages still held", i, (long long)(st.dev_used + st.host_used));
        if (spec[i].claim) continue;
        for (int k = 0; k < 2; k++) {
            if (i == B_POOLS - 1) { /* 2 bytes in: shift back before the comparison */
                unsigned char* raw = (unsigned char*)malloc(t->dst[k].n_bytes);
                mst_guarded_get(ctx, &t->dst[k], raw);
                CHECK(raw[0] == MST_POISON && raw[1] == MST_POISON, "pool %d: bytes before the unaligned dst written", i);
                CHECK(mst_first_diff(raw + 2, t->in, (size_t)(t->n * t->rb)) < 0, "pool %d (%s): unaligned restore differs",
                      i, k ? "single" : "batch");
                int clean = 1;
                for (size_t c = 2 + (size_t)(t->n * t->rb); c < t->dst[k].n_bytes; c++) clean &= raw[c] == MST_POISON;
                CHECK(clean && mst_guarded_intact(ctx, &t->dst[k]), "pool %d: rows past n or guards written", i);
                free(raw);
                continue;
            }
            expect_restored(ctx, t, i, k, spec[i].overflow ? 0 : t->n, "batched restores");
        }
    }
    for (int i = 0; i < B_POOLS; i++) { /* resets */
        CHECK_OK(mst_stash_batch_reset(&b, tw[i].pool[0]));
        CHECK_OK(mst_pool_reset(tw[i].pool[1]));
    }
    CHECK_OK(mst_stash_batch_run(ctx, &b));
    for (int i = 0; i < B_POOLS; i++) {
        expect_twins(ctx, &tw[i], i, "batched resets");
        CHECK_OK(mst_pool_poll(tw[i].pool[0]));
    }
    /* bad counts in one slot: that save takes nothing and raises the flag
       (CPU: MST_ERR_COUNTS returned), the slot after it still saves */
    {
        const int32_t bad[B_E] = {3, -1, 4, 0, 2};
        mst_guarded_put(ctx, &tw[0].counts, bad);
        mst_guarded_put(ctx, &tw[2].src, tw[2].in);
        const mst_tensor tc0 = mst_tensor_make(tw[0].counts.data, MST_DTYPE_INT32, B_E, 1);
        const mst_tensor tc2 = mst_tensor_make(tw[2].counts.data, MST_DTYPE_INT32, B_E, 1);
        const mst_tensor src0 = mst_tensor_make(tw[0].src.data, spec[0].dt, B_R, spec[0].W);
        const mst_tensor src2 = mst_tensor_make(tw[2].src.data, spec[2].dt, B_R, spec[2].W);
        CHECK_OK(mst_stash_batch_save(&b, tw[0].pool[0], tw[0].h[0], &src0, &tc0));
        CHECK_OK(mst_stash_batch_save(&b, tw[2].pool[0], tw[2].h[0], &src2, &tc2));
        CHECK_STATUS(mst_stash_batch_run(ctx, &b), mst_ctx_backend(ctx) == MST_BACKEND_CPU ? MST_ERR_COUNTS : MST_OK);
        CHECK_STATUS(mst_ctx_check(ctx), MST_ERR_COUNTS);
        for (int i = 0; i <= 2; i += 2) {
            mst_guarded_put(ctx, &tw[i].dst[0], NULL);
            mst_tensor dst = mst_tensor_make(tw[i].dst[0].data, spec[i].dt, B_R, spec[i].W);
            CHECK_OK(mst_stash_batch_restore(&b, tw[i].pool[0], tw[i].h[0], &dst, MST_RESTORE_ALL));
        }
        CHECK_OK(mst_stash_batch_run(ctx, &b));
        expect_restored(ctx, &tw[0], 0, 0, 0, "bad counts in a batch");
        expect_restored(ctx, &tw[2], 2, 0, tw[2].n, "the slot after bad counts");
        CHECK_OK(mst_ctx_check(ctx));
    }
    /* the batch's own errors: a pool twice, more than MST_STASH_BATCH_MAX slots */
    CHECK_OK(mst_stash_batch_reset(&b, tw[0].pool[0]));
    CHECK_STATUS(mst_stash_batch_reset(&b, tw[0].pool[0]), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "in it already") != NULL, "a pool twice: '%s'", mst_last_error());
    for (int i = 1; i < 2 * B_POOLS; i++) {
        const mst_status st = mst_stash_batch_reset(&b, tw[i / 2].pool[i % 2]);
        CHECK_STATUS(st, i < MST_STASH_BATCH_MAX ? MST_OK : MST_ERR_INVALID);
    }
    CHECK(strstr(mst_last_error(), "full") != NULL, "a full batch: '%s'", mst_last_error());
    CHECK(b.n == MST_STASH_BATCH_MAX, "a full batch holds %d slots", b.n);
    CHECK_OK(mst_stash_batch_run(ctx, &b));
    for (int i = 0; i < B_POOLS; i++) {
        twin* t = &tw[i];
        for (int k = 0; k < 2; k++) {
            mst_stash_handle_destroy(t->h[k]);
            mst_pool_destroy(t->pool[k]);
            mst_guarded_free(ctx, &t->dst[k]);
        }
        mst_guarded_free(ctx, &t->src);
        mst_guarded_free(ctx, &t->counts);
        free(t->in);
    }
}

static void run(mst_ctx_t* ctx) {
    mst_rng rng = {0x5157a5};
    bad_input(ctx, &rng);
    check_sees_corruption(ctx, &rng);
    spill(ctx, &rng);
    overflow(ctx, &rng);
    claim(ctx, &rng);
    batch_twins(ctx, &rng);
    handle_capacity(ctx, &rng);
    sizing(ctx, &rng);
    unaligned(ctx, &rng);
    pipeline_order(ctx, &rng);
    graph_replay(ctx, &rng, 136);
    graph_replay(ctx, &rng, 512); /* 16 KiB pages: CUDA's bulk copy */
    /* widths: fp32 probs, bf16 of several widths (odd ones too), page sizes */
    random_interleave(ctx, &rng, MST_DTYPE_FP32, 1, 64, 8, 120, 0.5);
    random_interleave(ctx, &rng, MST_DTYPE_BF16, 8, 8, 10, 150, 0.3);
    random_interleave(ctx, &rng, MST_DTYPE_BF16, 100, 16, 8, 120, 0.6);
    random_interleave(ctx, &rng, MST_DTYPE_BF16, 264, 64, 6, 80, 1.0);
    random_interleave(ctx, &rng, MST_DTYPE_BF16, 7, 24, 8, 100, 0.0);
    random_interleave(ctx, &rng, MST_DTYPE_FP32, 33, 8, 8, 100, 0.7);
    /* pages of whole 16 KiB chunks (CUDA's bulk copy), with host pages, and
       with rows of 2 bytes (a tail under 16 bytes) */
    random_interleave(ctx, &rng, MST_DTYPE_BF16, 512, 16, 8, 120, 0.6);
    random_interleave(ctx, &rng, MST_DTYPE_BF16, 2048, 64, 4, 60, 1.0);
    random_interleave(ctx, &rng, MST_DTYPE_BF16, 1, 8192, 4, 60, 0.5);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
