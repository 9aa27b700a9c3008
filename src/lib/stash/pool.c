/*
 * pool.c — the paged stash, backend independent: pools (blocks, rings, state),
 * stash handles, save / restore / reset dispatch with their argument checks,
 * the invariant check, statistics, the flag poll, and sizing from a measured
 * peak. Contracts: docs/DESIGN.md, "The paged stash"; the host side is in
 * stash.h, the format in src/lib/backend/page_table.h.
 */
#include <math.h>
#include <string.h>

#include "../backend/fp8_page.h"
#include "stash.h"

static mst_status need_slot(const mst_ctx_t* ctx, int present, const char* name) {
    if (present) return MST_OK;
    return mst_set_error(MST_ERR_UNSUPPORTED, "%s is not implemented on backend %s", name,
                         ctx->be->name);
}

/* ---- sizing -------------------------------------------------------------- */

mst_pool_config mst_pool_config_default(int64_t n_dev_pages) {
    mst_pool_config c = MST_POOL_CONFIG_INIT;
    c.page_rows = MST_POOL_PAGE_ROWS;
    c.n_dev_pages = n_dev_pages;
    return c;
}

mst_status mst_pool_config_from_peak(const mst_pool_stats* measured, double dev_factor,
                                     double host_factor, mst_pool_config* out) {
    if (!measured) return mst_set_error(MST_ERR_INVALID, "measured is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    MST_TRY(MST_CHECK_STRUCT("measured", measured, mst_pool_stats));
    MST_TRY(MST_CHECK_STRUCT("out", out, mst_pool_config));
    if (!(dev_factor >= 0) || !(host_factor >= 0) || dev_factor + host_factor <= 0)
        return mst_set_error(MST_ERR_INVALID,
                             "dev_factor = %g, host_factor = %g: both >= 0, not both 0",
                             dev_factor, host_factor);
    const double peak = (double)measured->total_peak;
    out->page_rows = measured->page_rows;
    out->n_dev_pages = (int64_t)ceil(peak * dev_factor);
    out->n_host_pages = (int64_t)ceil(peak * host_factor);
    out->copy_sms = 0;
    if (out->n_dev_pages + out->n_host_pages == 0) out->n_dev_pages = 1;
    return MST_OK;
}

/* ---- pools --------------------------------------------------------------- */

static mst_status check_config(const mst_pool_config* cfg, int64_t row_bytes) {
    if (!cfg) return mst_set_error(MST_ERR_INVALID, "cfg is NULL");
    MST_TRY(MST_CHECK_STRUCT("cfg", cfg, mst_pool_config));
    if (cfg->page_rows <= 0 || cfg->page_rows % 8 != 0)
        return mst_set_error(MST_ERR_INVALID, "cfg.page_rows = %lld: a positive multiple of 8",
                             (long long)cfg->page_rows);
    if (cfg->n_dev_pages < 0 || cfg->n_host_pages < 0 || cfg->n_dev_pages + cfg->n_host_pages == 0)
        return mst_set_error(MST_ERR_INVALID,
                             "cfg.n_dev_pages = %lld, cfg.n_host_pages = %lld: >= 0, not both 0",
                             (long long)cfg->n_dev_pages, (long long)cfg->n_host_pages);
    if (cfg->n_dev_pages >= MST_PAGE_INDEX_LIMIT || cfg->n_host_pages >= MST_PAGE_INDEX_LIMIT)
        return mst_set_error(MST_ERR_INVALID, "cfg: %lld device / %lld host pages, at most 2^31 - 1",
                             (long long)cfg->n_dev_pages, (long long)cfg->n_host_pages);
    if (cfg->copy_sms < 0)
        return mst_set_error(MST_ERR_INVALID, "copy_sms = %d: expected >= 0 (0: as many as help)", cfg->copy_sms);
    if (cfg->page_rows * row_bytes >= ((int64_t)1 << 32))
        return mst_set_error(MST_ERR_INVALID, "cfg.page_rows = %lld: a page of %lld bytes is >= 4 GiB",
                             (long long)cfg->page_rows, (long long)(cfg->page_rows * row_bytes));
    return MST_OK;
}

static mst_status pool_alloc(mst_pool_t* p, const mst_pool_config* cfg) {
    mst_ctx_t* ctx = p->ctx;
    mst_stash_args* a = &p->a;
    MST_TRY(mst_alloc(ctx, sizeof(mst_pool_state), (void**)&a->st));
    MST_TRY(mst_fill(ctx, a->st, 0, sizeof(mst_pool_state)));
    /* one allocation: the device ring, then the host ring */
    MST_TRY(mst_alloc(ctx, (size_t)(a->cap[0] + a->cap[1]) * sizeof(uint32_t), (void**)&a->ring[0]));
    a->ring[MST_BLK_HOST] = a->ring[MST_BLK_DEV] + a->cap[MST_BLK_DEV];
    if (a->cap[MST_BLK_DEV])
        MST_TRY(mst_alloc(ctx, (size_t)(a->cap[MST_BLK_DEV] * p->page_bytes), (void**)&a->block[MST_BLK_DEV]));
    if (a->cap[MST_BLK_HOST]) {
        MST_TRY(need_slot(ctx, ctx->be->host_alloc != NULL, "host_alloc"));
        MST_TRY(ctx->be->host_alloc(ctx, (size_t)(cfg->n_host_pages * p->page_bytes),
                                    (void**)&a->block[MST_BLK_HOST]));
    }
    return MST_OK;
}

/* The name of a pool's pages: its dtype, or fp8. */
static const char* page_dtype(const mst_pool_t* p) { return p->a.fp8 ? "fp8" : mst_dtype_name(p->dtype); }

mst_status mst_pool_create(mst_ctx_t* ctx, mst_dtype dtype, int64_t width,
                           const mst_pool_config* cfg, mst_pool_t** out) {
    MST_TRY(mst_check_ctx(ctx));
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (dtype != MST_DTYPE_BF16 && dtype != MST_DTYPE_FP32 && dtype != MST_DTYPE_FP8)
        return mst_set_error(MST_ERR_INVALID, "dtype is %s, expected bf16, fp32 or fp8", mst_dtype_name(dtype));
    if (width <= 0 || width > ((int64_t)1 << 31))
        return mst_set_error(MST_ERR_INVALID, "width = %lld: expected 1 .. 2^31", (long long)width);
    const int fp8 = dtype == MST_DTYPE_FP8;
    if (fp8 && width % 8 != 0)
        return mst_set_error(MST_ERR_INVALID, "width = %lld: fp8 pages hold rows of a multiple of 8 elements",
                             (long long)width);
    if (fp8) dtype = MST_DTYPE_BF16; /* the rows saved and restored */
    const int64_t row_bytes = fp8 ? mst_fp8_row_bytes(width) : width * (int64_t)mst_dtype_size(dtype);
    MST_TRY(check_config(cfg, row_bytes));
    MST_TRY(need_slot(ctx, ctx->be->stash_save != NULL, "stash_save"));
    mst_pool_t* p = (mst_pool_t*)calloc(1, sizeof *p);
    if (!p) return mst_set_error(MST_ERR_OOM, "pool allocation failed");
    p->ctx = ctx;
    p->dtype = dtype;
    p->width = width;
    p->page_bytes = cfg->page_rows * row_bytes;
    p->a.cap[MST_BLK_DEV] = cfg->n_dev_pages;
    p->a.cap[MST_BLK_HOST] = cfg->n_host_pages;
    p->a.copy_sms = cfg->copy_sms;
    p->a.page_rows = cfg->page_rows;
    p->a.row_bytes = row_bytes;
    p->a.elt_bytes = (int32_t)mst_dtype_size(dtype);
    p->a.fp8 = fp8;
    p->a.width = width;
    p->a.err_flag = ctx->err_flag;
    mst_status st = pool_alloc(p, cfg);
    if (st == MST_OK) st = mst_pool_reset(p);
    if (st != MST_OK) {
        mst_pool_destroy(p);
        return st;
    }
    *out = p;
    return MST_OK;
}

void mst_pool_destroy(mst_pool_t* pool) {
    if (!pool) return;
    mst_ctx_t* ctx = pool->ctx;
    while (pool->n_handles > 0) mst_stash_handle_destroy(pool->handles[0]);
    ctx->be->sync(ctx);
    if (pool->a.block[MST_BLK_HOST]) ctx->be->host_free(ctx, pool->a.block[MST_BLK_HOST]);
    mst_free(ctx, pool->a.block[MST_BLK_DEV]);
    mst_free(ctx, pool->a.ring[MST_BLK_DEV]);
    mst_free(ctx, pool->a.st);
    free(pool->handles);
    free(pool);
}

mst_status mst_pool_reset(mst_pool_t* pool) {
    if (!pool) return mst_set_error(MST_ERR_INVALID, "pool is NULL");
    return pool->ctx->be->stash_reset(pool->ctx, &pool->a);
}

const int32_t* mst_pool_overflow_flag(const mst_pool_t* pool) {
    return pool ? &pool->a.st->overflow : NULL;
}

static mst_status read_state(mst_pool_t* pool, mst_pool_state* st) {
    return mst_copy_b2h(pool->ctx, st, pool->a.st, sizeof *st); /* syncs */
}

mst_status mst_pool_stats_get(mst_pool_t* pool, mst_pool_stats* out) {
    if (!pool) return mst_set_error(MST_ERR_INVALID, "pool is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    MST_TRY(MST_CHECK_STRUCT("out", out, mst_pool_stats));
    mst_pool_state st;
    MST_TRY(read_state(pool, &st));
    const int64_t* cap = pool->a.cap;
    *out = (mst_pool_stats){
        .struct_size = sizeof(mst_pool_stats),
        .page_rows = pool->a.page_rows,
        .page_bytes = pool->page_bytes,
        .n_dev_pages = cap[MST_BLK_DEV],
        .n_host_pages = cap[MST_BLK_HOST],
        .dev_used = mst_block_used(&st, cap, MST_BLK_DEV),
        .host_used = mst_block_used(&st, cap, MST_BLK_HOST),
        .dev_peak = st.peak[MST_BLK_DEV],
        .host_peak = st.peak[MST_BLK_HOST],
        .total_peak = st.peak_total,
        .spilled_pages = st.spilled,
        .overflowed = st.overflow != 0,
    };
    return MST_OK;
}

mst_status mst_pool_poll(mst_pool_t* pool) {
    if (!pool) return mst_set_error(MST_ERR_INVALID, "pool is NULL");
    mst_pool_state st;
    MST_TRY(read_state(pool, &st));
    if (st.bad_state) {
        const int32_t zero = 0;
        MST_TRY(mst_copy_h2b(pool->ctx, &pool->a.st->bad_state, &zero, sizeof zero));
        return mst_set_error(MST_ERR_STATE, "stash pool: %s%s%s (last: handle #%d)",
                             st.bad_state & MST_BAD_RESTORE ? "restore of a handle that holds nothing" : "",
                             st.bad_state == (MST_BAD_RESTORE | MST_BAD_SAVE) ? "; " : "",
                             st.bad_state & MST_BAD_SAVE ? "save into a handle that still holds its pages" : "",
                             st.bad_handle);
    }
    if (st.overflow)
        return mst_set_error(MST_ERR_OVERFLOW,
                             "stash pool (%s, width %lld) ran out of pages: %lld device + %lld host pages",
                             page_dtype(pool), (long long)pool->width,
                             (long long)pool->a.cap[MST_BLK_DEV], (long long)pool->a.cap[MST_BLK_HOST]);
    return MST_OK;
}

/* ---- the invariant check -------------------------------------------------- */

/* Marks page id as seen in owner[]; an error when it is invalid or seen twice. */
static mst_status mark(const mst_pool_t* p, uint8_t* seen, uint32_t id, const char* where) {
    int host;
    const int64_t i = mst_page_decode(id, &host);
    if (i >= p->a.cap[host])
        return mst_set_error(MST_ERR_STATE, "stash pool check: %s holds page id 0x%x, past the %s block",
                             where, id, host ? "host" : "device");
    uint8_t* s = seen + (host ? p->a.cap[MST_BLK_DEV] : 0) + i;
    if (*s)
        return mst_set_error(MST_ERR_STATE, "stash pool check: page id 0x%x is in two places (again in %s)",
                             id, where);
    *s = 1;
    return MST_OK;
}

static mst_status check_rings(const mst_pool_t* p, const mst_pool_state* st, const uint32_t* rings,
                              uint8_t* seen) {
    for (int b = 0; b < MST_N_BLK; b++) {
        const int64_t cap = p->a.cap[b], n_free = (int64_t)(st->tail[b] - st->head[b]);
        if (n_free < 0 || n_free > cap)
            return mst_set_error(MST_ERR_STATE,
                                 "stash pool check: %s ring has tail - head = %lld, capacity %lld",
                                 b ? "host" : "device", (long long)n_free, (long long)cap);
        const uint32_t* ring = rings + (b ? p->a.cap[MST_BLK_DEV] : 0);
        for (int64_t i = 0; i < n_free; i++) {
            const uint32_t id = ring[(st->head[b] + (uint64_t)i) % (uint64_t)cap];
            int blk;
            mst_page_decode(id, &blk);
            if (blk != b)
                return mst_set_error(MST_ERR_STATE, "stash pool check: page id 0x%x in the %s ring",
                                     id, b ? "host" : "device");
            MST_TRY(mark(p, seen, id, b ? "the host ring" : "the device ring"));
        }
    }
    return MST_OK;
}

static mst_status check_handle(const mst_pool_t* p, const mst_pool_state* st,
                               const mst_stash_handle_t* h, uint8_t* seen, uint32_t* table) {
    mst_handle_state hs;
    MST_TRY(mst_copy_b2h(p->ctx, &hs, h->hs, sizeof hs));
    if (hs.state < MST_HANDLE_EMPTY || hs.state > MST_HANDLE_VOID)
        return mst_set_error(MST_ERR_STATE, "stash pool check: handle #%d has state %d", h->id, hs.state);
    if (!mst_handle_live(st, &hs)) return MST_OK;
    const int64_t n_pages = (int64_t)hs.n_pages[MST_BLK_DEV] + hs.n_pages[MST_BLK_HOST];
    if (hs.n_rows < 0 || hs.n_rows > h->max_rows || hs.n_pages[MST_BLK_DEV] < 0 ||
        hs.n_pages[MST_BLK_HOST] < 0 || n_pages != (hs.n_rows + p->a.page_rows - 1) / p->a.page_rows)
        return mst_set_error(MST_ERR_STATE, "stash pool check: handle #%d holds %lld rows in %d + %d pages",
                             h->id, (long long)hs.n_rows, hs.n_pages[0], hs.n_pages[1]);
    MST_TRY(mst_copy_b2h(p->ctx, table, h->hs + 1, (size_t)n_pages * sizeof(uint32_t)));
    char where[64];
    snprintf(where, sizeof where, "handle #%d", h->id);
    for (int64_t i = 0; i < n_pages; i++) {
        int blk;
        mst_page_decode(table[i], &blk);
        if (blk != (i >= hs.n_pages[MST_BLK_DEV] ? MST_BLK_HOST : MST_BLK_DEV))
            return mst_set_error(MST_ERR_STATE, "stash pool check: %s table[%lld] = 0x%x is out of order",
                                 where, (long long)i, table[i]);
        MST_TRY(mark(p, seen, table[i], where));
    }
    return MST_OK;
}

static mst_status check_all(mst_pool_t* p, uint8_t* seen, uint32_t* rings, uint32_t* table) {
    mst_pool_state st;
    MST_TRY(read_state(p, &st));
    const int64_t n_ids = p->a.cap[MST_BLK_DEV] + p->a.cap[MST_BLK_HOST];
    MST_TRY(mst_copy_b2h(p->ctx, rings, p->a.ring[MST_BLK_DEV], (size_t)n_ids * sizeof(uint32_t)));
    MST_TRY(check_rings(p, &st, rings, seen));
    for (int i = 0; i < p->n_handles; i++) MST_TRY(check_handle(p, &st, p->handles[i], seen, table));
    for (int64_t i = 0; i < n_ids; i++)
        if (!seen[i])
            return mst_set_error(MST_ERR_STATE,
                                 "stash pool check: %s page %lld is in no ring and no live handle (leaked)",
                                 i < p->a.cap[MST_BLK_DEV] ? "device" : "host",
                                 (long long)(i < p->a.cap[MST_BLK_DEV] ? i : i - p->a.cap[MST_BLK_DEV]));
    return MST_OK;
}

mst_status mst_pool_check(mst_pool_t* pool) {
    if (!pool) return mst_set_error(MST_ERR_INVALID, "pool is NULL");
    const int64_t n_ids = pool->a.cap[MST_BLK_DEV] + pool->a.cap[MST_BLK_HOST];
    int64_t max_pages = 1;
    for (int i = 0; i < pool->n_handles; i++)
        if (pool->handles[i]->max_pages > max_pages) max_pages = pool->handles[i]->max_pages;
    uint8_t* seen = (uint8_t*)calloc((size_t)n_ids, 1);
    uint32_t* rings = (uint32_t*)malloc((size_t)n_ids * sizeof(uint32_t));
    uint32_t* table = (uint32_t*)malloc((size_t)max_pages * sizeof(uint32_t));
    mst_status st = seen && rings && table ? check_all(pool, seen, rings, table)
                                           : mst_set_error(MST_ERR_OOM, "stash pool check: host buffers");
    free(seen);
    free(rings);
    free(table);
    return st;
}

/* ---- handles ------------------------------------------------------------- */

mst_status mst_stash_handle_pages(const mst_stash_handle_t* h, mst_pages* out) {
    if (!h || !out) return mst_set_error(MST_ERR_INVALID, "h or out is NULL");
    const mst_stash_args* a = &h->pool->a;
    memset(out, 0, sizeof *out);
    if (a->fp8)
        return mst_set_error(MST_ERR_INVALID, "stash handle #%d: fp8 pages are not rows to read in place "
                             "(restore them)", h->id);
    out->table = mst_handle_table(h->hs);
    for (int b = 0; b < MST_N_BLK; b++) {
        out->block[b] = a->block[b];
        out->n_pages[b] = a->cap[b];
    }
    out->page_rows = a->page_rows;
    out->table_rows = h->max_pages * a->page_rows;
    return MST_OK;
}

mst_status mst_stash_handle_create(mst_pool_t* pool, int64_t max_rows, mst_stash_handle_t** out) {
    if (!pool) return mst_set_error(MST_ERR_INVALID, "pool is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (max_rows <= 0 || max_rows * pool->a.row_bytes >= ((int64_t)1 << 32))
        return mst_set_error(MST_ERR_INVALID, "max_rows = %lld: expected > 0 and max_rows * %lld bytes < 4 GiB",
                             (long long)max_rows, (long long)pool->a.row_bytes);
    if (pool->n_handles == pool->cap_handles) {
        int cap = pool->cap_handles ? 2 * pool->cap_handles : 16;
        mst_stash_handle_t** hs = (mst_stash_handle_t**)realloc(pool->handles, (size_t)cap * sizeof *hs);
        if (!hs) return mst_set_error(MST_ERR_OOM, "stash handle list growth failed");
        pool->handles = hs;
        pool->cap_handles = cap;
    }
    mst_stash_handle_t* h = (mst_stash_handle_t*)calloc(1, sizeof *h);
    if (!h) return mst_set_error(MST_ERR_OOM, "stash handle allocation failed");
    h->pool = pool;
    h->id = pool->next_id++;
    h->max_rows = max_rows;
    h->max_pages = (max_rows + pool->a.page_rows - 1) / pool->a.page_rows;
    const size_t n_bytes = sizeof(mst_handle_state) + (size_t)h->max_pages * sizeof(uint32_t);
    mst_status st = mst_alloc(pool->ctx, n_bytes, (void**)&h->hs);
    if (st == MST_OK) st = mst_fill(pool->ctx, h->hs, 0, n_bytes); /* EMPTY, epoch 0 */
    if (st != MST_OK) {
        mst_free(pool->ctx, h->hs);
        free(h);
        return st;
    }
    pool->handles[pool->n_handles++] = h;
    *out = h;
    return MST_OK;
}

void mst_stash_handle_destroy(mst_stash_handle_t* h) {
    if (!h) return;
    mst_pool_t* p = h->pool;
    for (int i = 0; i < p->n_handles; i++)
        if (p->handles[i] == h) p->handles[i] = p->handles[--p->n_handles];
    p->ctx->be->sync(p->ctx);
    mst_free(p->ctx, h->hs);
    free(h);
}

/* ---- save and restore ----------------------------------------------------- */

/* pool and handle; with name, also tensor t (dtype, width). */
static mst_status check_rows(const mst_pool_t* pool, const mst_stash_handle_t* h, const mst_tensor* t,
                             const char* name) {
    if (!pool) return mst_set_error(MST_ERR_INVALID, "pool is NULL");
    if (!h) return mst_set_error(MST_ERR_INVALID, "handle is NULL");
    if (h->pool != pool)
        return mst_set_error(MST_ERR_INVALID, "handle #%d belongs to another pool", h->id);
    if (!name) return MST_OK; /* no tensor to check */
    MST_TRY(mst_check_tensor(t, name, pool->dtype));
    if (t->cols != pool->width)
        return mst_set_error(MST_ERR_INVALID, "%s has %lld columns, the pool's width is %lld", name,
                             (long long)t->cols, (long long)pool->width);
    return MST_OK;
}

static mst_stash_args handle_args(const mst_pool_t* pool, const mst_stash_handle_t* h) {
    mst_stash_args a = pool->a;
    a.hs = h->hs;
    a.table = mst_handle_table(h->hs);
    a.max_rows = h->max_rows;
    a.max_pages = h->max_pages;
    a.handle_id = h->id;
    return a;
}

/* The checked call of a save of rows [0, sum(counts)) of src (named
 * src_name), or of a claim (src_name NULL, src unused) of a producer's
 * output of `rows` rows. */
static mst_status save_call(const mst_pool_t* pool, const mst_stash_handle_t* h, const char* src_name,
                            const mst_tensor* src, int64_t rows, const mst_tensor* counts, mst_stash_args* a) {
    MST_TRY(check_rows(pool, h, src, src_name));
    if (!src_name) src = NULL;
    if (!src && rows < 0) return mst_set_error(MST_ERR_INVALID, "rows = %lld: expected >= 0", (long long)rows);
    if (!src && pool->a.fp8)
        return mst_set_error(MST_ERR_INVALID, "claim of a pool of fp8 pages: a producer writes bf16 rows (save them)");
    MST_TRY(mst_check_tensor(counts, "counts", MST_DTYPE_INT32));
    if (counts->cols != 1 || counts->rows > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "counts has shape [%lld, %lld], expected [E, 1]",
                             (long long)counts->rows, (long long)counts->cols);
    *a = handle_args(pool, h);
    a->counts = (const int32_t*)counts->data;
    a->n_groups = (int32_t)counts->rows;
    a->src_rows = src ? src->rows : rows;
    a->src = src ? (const char*)src->data : NULL;
    return MST_OK;
}

mst_status mst_stash_save(mst_pool_t* pool, mst_stash_handle_t* h, const mst_tensor* src,
                          const mst_tensor* counts) {
    mst_stash_args a;
    MST_TRY(save_call(pool, h, "src", src, 0, counts, &a));
    return pool->ctx->be->stash_save(pool->ctx, &a);
}

mst_status mst_stash_claim(mst_pool_t* pool, mst_stash_handle_t* h, int64_t rows, const mst_tensor* counts) {
    mst_stash_args a;
    MST_TRY(save_call(pool, h, NULL, NULL, rows, counts, &a));
    return pool->ctx->be->stash_save(pool->ctx, &a);
}

/* The checked call of restore part `part` (MST_RESTORE_*; dst unused for
 * MST_RESTORE_RETURN). */
static mst_status restore_call(const mst_pool_t* pool, const mst_stash_handle_t* h, const mst_tensor* dst,
                               int32_t part, mst_stash_args* a) {
    if (part < MST_RESTORE_ALL || part > MST_RESTORE_RETURN)
        return mst_set_error(MST_ERR_INVALID, "restore part = %d is not a MST_RESTORE_*", part);
    if (part != MST_RESTORE_RETURN) {
        MST_TRY(check_rows(pool, h, dst, "dst"));
        if (dst->rows < h->max_rows)
            return mst_set_error(MST_ERR_INVALID, "dst has %lld rows, fewer than handle #%d's max_rows = %lld",
                                 (long long)dst->rows, h->id, (long long)h->max_rows);
    } else {
        MST_TRY(check_rows(pool, h, NULL, NULL));
    }
    *a = handle_args(pool, h);
    a->dst = part != MST_RESTORE_RETURN ? (char*)dst->data : NULL;
    a->restore_part = part;
    return MST_OK;
}

/* One restore call: part MST_RESTORE_*. */
static mst_status restore_part(mst_pool_t* pool, mst_stash_handle_t* h, mst_tensor* dst, int32_t part) {
    mst_stash_args a;
    MST_TRY(restore_call(pool, h, dst, part, &a));
    return pool->ctx->be->stash_restore(pool->ctx, &a);
}

mst_status mst_stash_restore(mst_pool_t* pool, mst_stash_handle_t* h, mst_tensor* dst) {
    return restore_part(pool, h, dst, MST_RESTORE_ALL);
}

mst_status mst_stash_restore_copy(mst_pool_t* pool, mst_stash_handle_t* h, mst_tensor* dst) {
    return restore_part(pool, h, dst, MST_RESTORE_COPY);
}

mst_status mst_stash_restore_return(mst_pool_t* pool, mst_stash_handle_t* h) {
    return restore_part(pool, h, NULL, MST_RESTORE_RETURN);
}

/* ---- batches -------------------------------------------------------------- */

int mst_stash_batch_has(const mst_stash_batch* b, const mst_pool_t* pool) {
    for (int32_t i = 0; i < b->n; i++)
        if (b->slot[i].st == pool->a.st) return 1;
    return 0;
}

/* Slot b->n: operation op with the checked call a on `pool`. */
static mst_status batch_add(mst_stash_batch* b, const mst_pool_t* pool, int32_t op, const mst_stash_args* a) {
    if (b->n >= MST_STASH_BATCH_MAX)
        return mst_set_error(MST_ERR_INVALID, "stash batch is full (%d slots)", MST_STASH_BATCH_MAX);
    if (mst_stash_batch_has(b, pool))
        return mst_set_error(MST_ERR_INVALID, "stash batch: the pool (%s, width %lld) is in it already; the "
                             "slots of a batch touch distinct pools", page_dtype(pool),
                             (long long)pool->width);
    b->op[b->n] = op;
    b->slot[b->n++] = *a;
    return MST_OK;
}

mst_status mst_stash_batch_save(mst_stash_batch* b, mst_pool_t* pool, mst_stash_handle_t* h, const mst_tensor* src,
                                const mst_tensor* counts) {
    mst_stash_args a;
    if (!b) return mst_set_error(MST_ERR_INVALID, "b is NULL");
    MST_TRY(save_call(pool, h, "src", src, 0, counts, &a));
    return batch_add(b, pool, MST_STASH_OP_SAVE, &a);
}

mst_status mst_stash_batch_claim(mst_stash_batch* b, mst_pool_t* pool, mst_stash_handle_t* h, int64_t rows,
                                 const mst_tensor* counts) {
    mst_stash_args a;
    if (!b) return mst_set_error(MST_ERR_INVALID, "b is NULL");
    MST_TRY(save_call(pool, h, NULL, NULL, rows, counts, &a));
    return batch_add(b, pool, MST_STASH_OP_SAVE, &a);
}

mst_status mst_stash_batch_restore(mst_stash_batch* b, mst_pool_t* pool, mst_stash_handle_t* h,
                                   const mst_tensor* dst, int32_t part) {
    mst_stash_args a;
    if (!b) return mst_set_error(MST_ERR_INVALID, "b is NULL");
    MST_TRY(restore_call(pool, h, dst, part, &a));
    return batch_add(b, pool, MST_STASH_OP_RESTORE, &a);
}

mst_status mst_stash_batch_reset(mst_stash_batch* b, mst_pool_t* pool) {
    if (!b || !pool) return mst_set_error(MST_ERR_INVALID, "b or pool is NULL");
    return batch_add(b, pool, MST_STASH_OP_RESET, &pool->a);
}

mst_status mst_stash_batch_run(mst_ctx_t* ctx, mst_stash_batch* b) {
    MST_TRY(mst_check_ctx(ctx));
    if (!b) return mst_set_error(MST_ERR_INVALID, "b is NULL");
    for (int32_t i = 0; i < b->n; i++)
        if (b->slot[i].err_flag != ctx->err_flag)
            return mst_set_error(MST_ERR_INVALID, "stash batch slot %d: its pool belongs to another context", i);
    const mst_status st = b->n ? MST_SLOT(ctx, ctx->be, stash_batch, b) : MST_OK;
    b->n = 0;
    return st;
}
