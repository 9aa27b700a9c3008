/*
 * stash.h — the host side of the paged stash: pools and handles. Their state
 * in backend memory, the page ids and the page bookkeeping the backends run
 * are the page-table format, src/lib/backend/page_table.h.
 */
#ifndef MST_STASH_H
#define MST_STASH_H

#include "../core/context.h" /* backend.h, with the page-table format */

#ifdef __cplusplus
extern "C" {
#endif

/* Host side of a pool and a handle. */
struct mst_pool {
    mst_ctx_t* ctx;
    mst_dtype dtype;              /* of the rows saved (bf16 for fp8 pages)       */
    int64_t width;                /* W elements per row                           */
    int64_t page_bytes;           /* page_rows * row_bytes                        */
    mst_stash_args a;             /* the pool part of every backend call          */
    mst_stash_handle_t** handles; /* [n_handles] live handles, for mst_pool_check */
    int n_handles, cap_handles;
    int32_t next_id;              /* id of the next handle                        */
};

struct mst_stash_handle {
    mst_pool_t* pool;
    int32_t id;                   /* unique within the pool                       */
    int64_t max_rows;             /* capacity in rows                             */
    int64_t max_pages;            /* ceil(max_rows / page_rows)                   */
    mst_handle_state* hs;         /* [1] + table [max_pages], backend memory      */
};

/* Batches (mst_stash_batch, page_table.h): the operations of
 * mst_stash_save / _claim / _restore (part MST_RESTORE_*) / mst_pool_reset,
 * checked as those are and added as slot b->n (an error when b is full or
 * holds the pool already), then run by one backend call on the context's
 * current stream, which empties b. */
int mst_stash_batch_has(const mst_stash_batch* b, const mst_pool_t* pool);
mst_status mst_stash_batch_save(mst_stash_batch* b, mst_pool_t* pool, mst_stash_handle_t* h, const mst_tensor* src,
                                const mst_tensor* counts);
mst_status mst_stash_batch_claim(mst_stash_batch* b, mst_pool_t* pool, mst_stash_handle_t* h, int64_t rows,
                                 const mst_tensor* counts);
mst_status mst_stash_batch_restore(mst_stash_batch* b, mst_pool_t* pool, mst_stash_handle_t* h,
                                   const mst_tensor* dst, int32_t part);
mst_status mst_stash_batch_reset(mst_stash_batch* b, mst_pool_t* pool);
mst_status mst_stash_batch_run(mst_ctx_t* ctx, mst_stash_batch* b);

#ifdef __cplusplus
}
#endif
#endif /* MST_STASH_H */
