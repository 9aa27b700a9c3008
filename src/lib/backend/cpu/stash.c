/*
 * stash.c — the paged stash on the CPU backend: the reference for the CUDA
 * kernels. Runs the shared page bookkeeping of page_table.h on the host,
 * one thread, and copies page by page with memcpy (fp8 pages: converts row
 * by row with the functions of fp8_page.h). Blocks and rings are host
 * memory, so the "pinned host block" is plain aligned memory. A batch runs
 * its slots one after the other (they touch disjoint pools).
 */
#include <stdlib.h>
#include <string.h>

#include "../../core/context.h"
#include "../counts.h"
#include "../fp8_page.h"
#include "cpu_ops.h"

mst_status mst_cpu_host_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out) {
    (void)ctx;
    *out = aligned_alloc(64, (n_bytes + 63) & ~(size_t)63);
    if (!*out) return mst_set_error(MST_ERR_OOM, "host block of %zu bytes: allocation failed", n_bytes);
    return MST_OK;
}

void mst_cpu_host_free(mst_ctx_t* ctx, void* ptr) {
    (void)ctx;
    free(ptr);
}

mst_status mst_cpu_stash_reset(mst_ctx_t* ctx, const mst_stash_args* a) {
    (void)ctx;
    for (int b = 0; b < MST_N_BLK; b++) mst_ring_fill(a->ring, a->cap, b, 0, 1);
    mst_state_reset(a->st, a->cap);
    return MST_OK;
}

/* Row r of page `page` in fp8 pages (fp8_page.h) and the bf16 row `row`
 * [W]: quantized block by block (a save), or dequantized (a restore); a
 * save of a block holding inf or NaN raises MST_FLAG_NONFINITE. */
static void fp8_row(const mst_stash_args* a, char* page, int64_t r, uint16_t* row, int to_pages) {
    uint8_t* q = mst_fp8_codes(page, r, a->width);
    float* sc = mst_fp8_scales(page, r, a->width, a->page_rows);
    for (int64_t j = 0, b = 0; j < a->width; j += MST_FP8_BLOCK, b++) {
        const int64_t len = a->width - j < MST_FP8_BLOCK ? a->width - j : MST_FP8_BLOCK;
        if (!to_pages) mst_fp8_block_restore(q + j, sc[b], len, row + j);
        else if (mst_fp8_block_save(row + j, len, q + j, &sc[b])) *a->err_flag |= MST_FLAG_NONFINITE;
    }
}

/* Rows [0, n) between the contiguous buffer `rows` and the handle's pages:
 * copies, or the fp8 conversion row by row. */
static void copy_pages(const mst_stash_args* a, char* rows, int64_t n, int to_pages) {
    const uint32_t* table = a->table;
    const int64_t page_bytes = a->page_rows * a->row_bytes, src_bytes = a->width * a->elt_bytes;
    for (int64_t p = 0; p * a->page_rows < n; p++) {
        const int64_t r = n - p * a->page_rows < a->page_rows ? n - p * a->page_rows : a->page_rows;
        char* page = mst_page_ptr(a->block, table[p], page_bytes);
        char* contig = rows + p * a->page_rows * src_bytes;
        if (a->fp8)
            for (int64_t i = 0; i < r; i++) fp8_row(a, page, i, (uint16_t*)(contig + i * src_bytes), to_pages);
        else if (to_pages) memcpy(page, contig, (size_t)(r * a->row_bytes));
        else memcpy(contig, page, (size_t)(r * a->row_bytes));
    }
}

static mst_status bad_state(const mst_stash_args* a, const char* what) {
    return mst_set_error(MST_ERR_STATE, "%s of stash handle #%d", what, a->handle_id);
}

mst_status mst_cpu_stash_save(mst_ctx_t* ctx, const mst_stash_args* a) {
    mst_plan p;
    mst_reserve_plan(a->st, a->hs, a->cap, a->page_rows, a->max_rows,
                     mst_counts_total(a->counts, a->n_groups, a->src_rows, NULL), &p);
    if (p.outcome == MST_RESERVE_TAKEN) mst_ring_move(a->ring, a->cap, p.pos, p.take, a->table, 0, 0, 1);
    mst_table_void(&p, a->table, a->max_pages, 0, 1);
    mst_reserve_commit(a->st, a->hs, a->cap, &p, a->handle_id);
    switch (p.outcome) {
    case MST_RESERVE_TAKEN:
        if (a->src) copy_pages(a, (char*)a->src, p.n, 1); /* else a claim */
        return MST_OK;
    case MST_RESERVE_SKIPPED: return MST_OK;
    case MST_RESERVE_OVERFLOW:
        *ctx->err_flag |= MST_FLAG_OVERFLOW;
        return MST_OK; /* a runtime condition, read by mst_pool_poll */
    case MST_RESERVE_COUNTS:
        *ctx->err_flag |= MST_FLAG_COUNTS;
        return mst_set_error(MST_ERR_COUNTS,
                             "stash save: counts are negative or sum past src rows = %lld",
                             (long long)a->src_rows);
    default: return bad_state(a, "save into a handle that still holds its pages");
    }
}

mst_status mst_cpu_stash_restore(mst_ctx_t* ctx, const mst_stash_args* a) {
    (void)ctx;
    uint64_t pos[MST_N_BLK];
    int64_t take[MST_N_BLK];
    if (a->restore_part != MST_RESTORE_RETURN && mst_handle_live(a->st, a->hs))
        copy_pages(a, a->dst, a->hs->n_rows, 0);
    if (a->restore_part == MST_RESTORE_COPY) return MST_OK;
    switch (mst_return_begin(a->st, a->hs, a->handle_id, pos, take)) {
    case MST_RETURN_PAGES:
        mst_ring_move(a->ring, a->cap, pos, take, a->table, 1, 0, 1);
        mst_return_end(a->st, a->hs, take);
        return MST_OK;
    case MST_RETURN_NONE: return MST_OK;
    default: return bad_state(a, "restore of a handle that holds nothing (never saved, restored twice, or saved before a reset)");
    }
}

mst_status mst_cpu_stash_batch(mst_ctx_t* ctx, const mst_stash_batch* b) {
    mst_status first = MST_OK;
    for (int32_t i = 0; i < b->n; i++) {
        const mst_stash_args* a = &b->slot[i];
        const mst_status st = b->op[i] == MST_STASH_OP_SAVE      ? mst_cpu_stash_save(ctx, a)
                              : b->op[i] == MST_STASH_OP_RESTORE ? mst_cpu_stash_restore(ctx, a)
                                                                 : mst_cpu_stash_reset(ctx, a);
        if (first == MST_OK) first = st; /* the rest still run, as on CUDA */
    }
    return first;
}
