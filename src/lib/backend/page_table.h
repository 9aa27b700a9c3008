/*
 * page_table.h — the page-table format of the paged stash, as backends see
 * it: page ids, the pool and handle state in backend memory, the argument
 * struct of the stash slots, and the page bookkeeping (reserve, return, ring
 * moves) that the CPU backend runs on the host and the CUDA kernels run on
 * the device (one source, MST_HD functions). The host side of pools and
 * handles is src/lib/stash/stash.h.
 *
 * A page id names a page of one of a pool's two blocks (device, pinned
 * host): mst_page_encode / mst_page_decode are the only code that knows how
 * (bit 31 = the host block, bits 0-30 = the index in its block). A handle's
 * table lists its device pages, then its host pages: table[i] holds rows
 * [i * page_rows, (i + 1) * page_rows).
 */
#ifndef MST_PAGE_TABLE_H
#define MST_PAGE_TABLE_H

#include <stdint.h>

#include "host_device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The blocks of a pool. */
enum { MST_BLK_DEV = 0, MST_BLK_HOST = 1, MST_N_BLK = 2 };

/* Pages per block are fewer than this (an index takes 31 bits). */
#define MST_PAGE_INDEX_LIMIT ((int64_t)1 << 31)
/* An id past every block: a table entry that holds no page (reads as zeros). */
#define MST_PAGE_NONE 0xffffffffu

/* The id of page `index` (< MST_PAGE_INDEX_LIMIT) of block `blk` (MST_BLK_*). */
MST_HD uint32_t mst_page_encode(int blk, int64_t index) {
    return (uint32_t)index | (blk == MST_BLK_HOST ? 0x80000000u : 0u);
}

/* The index of page `id` in its block; *blk = the block (MST_BLK_*). */
MST_HD int64_t mst_page_decode(uint32_t id, int* blk) {
    *blk = (int)(id >> 31);
    return (int64_t)(id & 0x7fffffffu);
}


/* Handle states (mst_handle_state.state). */
enum {
    MST_HANDLE_EMPTY = 0, /* holds nothing; restore is a bad-state error          */
    MST_HANDLE_STASHED,   /* holds n_rows rows in its pages (if epoch is current) */
    MST_HANDLE_VOID,      /* its save took nothing (overflow, bad counts): restore
                             writes nothing and is not an error                   */
};

/* Bits of mst_pool_state.bad_state. */
enum {
    MST_BAD_RESTORE = 1, /* restore of a handle that holds nothing        */
    MST_BAD_SAVE = 2,    /* save into a handle that still holds its pages */
};

/* Pool state in backend memory. Ring invariant per block b:
 *   0 <= tail[b] - head[b] <= cap[b]
 *   free ids = ring[b][(head[b] + i) % cap[b]], i < tail[b] - head[b]
 *   used[b] = cap[b] - (tail[b] - head[b]) pages live in handle tables */
typedef struct mst_pool_state {
    uint64_t head[MST_N_BLK]; /* ids taken from ring b so far (monotonic)       */
    uint64_t tail[MST_N_BLK]; /* ids given back to ring b so far (monotonic)    */
    int64_t peak[MST_N_BLK];  /* max used pages of block b since creation       */
    int64_t peak_total;       /* max used pages of both blocks together         */
    int64_t spilled;          /* host pages taken since the last reset          */
    int32_t overflow;         /* 1 once a save found too few pages; until reset */
    int32_t bad_state;        /* MST_BAD_* bits since the last poll             */
    int32_t bad_handle;       /* id of the last handle that set bad_state       */
    uint32_t epoch;           /* bumped by each reset                           */
} mst_pool_state;

/* Handle state in backend memory, followed by its table [max_pages] uint32. */
typedef struct mst_handle_state {
    int64_t n_rows;             /* rows held (state STASHED)                     */
    int32_t n_pages[MST_N_BLK]; /* pages held from each block                    */
    int32_t state;              /* MST_HANDLE_*                                  */
    uint32_t epoch;             /* pool epoch at the save                        */
    uint32_t done_blocks;       /* CUDA save / restore: blocks that have read
                                   the state; the last one commits (0 between
                                   operations)                                   */
} mst_handle_state;

/* One save, restore or reset, as the backend slots receive it. */
typedef struct mst_stash_args {
    mst_pool_state* st;          /* [1] backend memory                            */
    uint32_t* ring[MST_N_BLK];   /* [cap[b]] backend memory (NULL when cap 0)     */
    char* block[MST_N_BLK];      /* [cap[b], page_bytes] device / pinned host     */
    int64_t cap[MST_N_BLK];      /* pages of each block                           */
    int64_t page_rows;           /* rows per page                                 */
    int64_t row_bytes;           /* bytes of a row in a page: W * dtype size, or
                                    mst_fp8_row_bytes(W) for fp8 pages            */
    int32_t elt_bytes;           /* dtype size of the rows (bf16 for fp8 pages)   */
    int32_t fp8;                 /* 1: fp8 pages (fp8_page.h): a save quantizes
                                    the bf16 rows, a restore dequantizes          */
    int64_t width;               /* W elements per row                            */
    int32_t handle_id;           /* for bad-state messages                        */
    int32_t copy_sms;            /* SMs a copy may use (0: as many as help)       */
    mst_handle_state* hs;        /* [1] backend memory (save, restore)            */
    uint32_t* table;             /* [max_pages] backend memory (save, restore)    */
    int64_t max_rows;            /* rows the handle holds (save, restore)         */
    int64_t max_pages;           /* table capacity: ceil(max_rows / page_rows)    */
    int32_t restore_part;        /* MST_RESTORE_* (restore)                       */
    const int32_t* counts;       /* [E] backend memory (save)                     */
    int32_t n_groups;            /* E (save)                                      */
    int64_t src_rows;            /* R of src (save)                               */
    const char* src;             /* [R, W] of elt_bytes (save); NULL: a claim, the
                                    pages are taken and tabled but nothing is
                                    copied (the producer writes them)          */
    char* dst;                   /* [R, W] of elt_bytes (restore)                 */
    int32_t* err_flag;           /* [1] the context's MST_FLAG_* bits             */
} mst_stash_args;

/* What a restore does (mst_stash_args.restore_part). */
enum {
    MST_RESTORE_ALL = 0, /* copy the rows back, then return the pages          */
    MST_RESTORE_COPY,    /* copy the rows back only; the handle keeps its pages */
    MST_RESTORE_RETURN,  /* return the pages only (after a MST_RESTORE_COPY)    */
};

/* What a slot of a batch does (mst_stash_batch.op). */
enum {
    MST_STASH_OP_SAVE = 0, /* a save (src set) or a claim (src NULL)            */
    MST_STASH_OP_RESTORE,  /* a restore, or the part restore_part names          */
    MST_STASH_OP_RESET,    /* a pool reset                                       */
};

/* Slots of one batch: the saves of a layer's four names from both pool
 * kinds (STASH, OFFLOAD) fit. */
#define MST_STASH_BATCH_MAX 8

/* Stash operations on distinct pools, run by one backend call (one launch
 * on CUDA where every copy is small). No slot touches another's pool state,
 * rings, handle or pages, so the slots may run in any order or at once: the
 * result is each slot's operation run alone. */
typedef struct mst_stash_batch {
    int32_t n;                                /* slots used, <= MST_STASH_BATCH_MAX */
    int32_t op[MST_STASH_BATCH_MAX];          /* [n] MST_STASH_OP_* of each slot     */
    mst_stash_args slot[MST_STASH_BATCH_MAX]; /* [n] each slot's call, st distinct  */
} mst_stash_batch;

MST_HD uint32_t* mst_handle_table(mst_handle_state* hs) { return (uint32_t*)(hs + 1); }

/* ---- page bookkeeping, shared by the CPU backend and the CUDA kernels ---- */

MST_HD char* mst_page_ptr(char* const block[MST_N_BLK], uint32_t id, int64_t page_bytes) {
    int b;
    const int64_t i = mst_page_decode(id, &b);
    return (b == MST_BLK_HOST ? block[MST_BLK_HOST] : block[MST_BLK_DEV]) + i * page_bytes;
}

MST_HD int64_t mst_block_used(const mst_pool_state* st, const int64_t cap[MST_N_BLK], int b) {
    return cap[b] - (int64_t)(st->tail[b] - st->head[b]);
}

/* A handle holds pages: saved in the current epoch. */
MST_HD int mst_handle_live(const mst_pool_state* st, const mst_handle_state* hs) {
    return hs->state == MST_HANDLE_STASHED && hs->epoch == st->epoch;
}

/* Outcome of a save's plan. */
enum { MST_RESERVE_TAKEN = 0, MST_RESERVE_SKIPPED, MST_RESERVE_OVERFLOW, MST_RESERVE_COUNTS,
       MST_RESERVE_STATE };

/* What a save does, decided before it changes anything: every CUDA block of
 * the save kernel computes the same plan from the same state. */
typedef struct mst_plan {
    int64_t n;                 /* rows to pack (TAKEN), else 0                  */
    int64_t take[MST_N_BLK];   /* pages taken from each block                   */
    uint64_t pos[MST_N_BLK];   /* ring position of the first id taken           */
    int64_t first[MST_N_BLK];  /* pos[b] % cap[b]: ring index of that id        */
    int32_t outcome;           /* MST_RESERVE_*                                 */
} mst_plan;

/* The plan of a save of n = sum(counts) rows (n = -1: bad counts): ceil(n /
 * page_rows) pages, device first, then host; more rows than the handle holds
 * (max_rows) is an overflow like too few free pages; anything but TAKEN
 * takes none. */
MST_HD void mst_reserve_plan(const mst_pool_state* st, const mst_handle_state* hs,
                             const int64_t cap[MST_N_BLK], int64_t page_rows, int64_t max_rows, int64_t n,
                             mst_plan* p) {
    p->n = 0;
    for (int b = 0; b < MST_N_BLK; b++) {
        p->take[b] = 0;
        p->pos[b] = st->head[b];
        p->first[b] = cap[b] ? (int64_t)(st->head[b] % (uint64_t)cap[b]) : 0;
    }
    if (mst_handle_live(st, hs)) { p->outcome = MST_RESERVE_STATE; return; } /* would leak its pages */
    if (st->overflow) { p->outcome = MST_RESERVE_SKIPPED; return; }
    if (n < 0) { p->outcome = MST_RESERVE_COUNTS; return; }
    const int64_t need = (n + page_rows - 1) / page_rows;
    const int64_t free_dev = (int64_t)(st->tail[MST_BLK_DEV] - st->head[MST_BLK_DEV]);
    const int64_t free_host = (int64_t)(st->tail[MST_BLK_HOST] - st->head[MST_BLK_HOST]);
    const int64_t dev = need < free_dev ? need : free_dev;
    if (n > max_rows || need - dev > free_host) { p->outcome = MST_RESERVE_OVERFLOW; return; }
    p->take[MST_BLK_DEV] = dev;
    p->take[MST_BLK_HOST] = need - dev;
    p->n = n;
    p->outcome = MST_RESERVE_TAKEN;
}

/* Page id i of a TAKEN plan, read from the rings (valid until the commit).
 * Selects rather than indexes by block, so CUDA keeps it in registers. */
MST_HD uint32_t mst_plan_page(uint32_t* const ring[MST_N_BLK], const int64_t cap[MST_N_BLK],
                              const mst_plan* p, int64_t i) {
    const int host = i >= p->take[MST_BLK_DEV];
    const int64_t c = host ? cap[MST_BLK_HOST] : cap[MST_BLK_DEV];
    int64_t k = (host ? p->first[MST_BLK_HOST] - p->take[MST_BLK_DEV] : p->first[MST_BLK_DEV]) + i;
    if (k >= c) k -= c;
    return (host ? ring[MST_BLK_HOST] : ring[MST_BLK_DEV])[k];
}

/* The single-threaded commit of a plan (once, after the plan's ids were
 * read): moves the ring heads, the counters and the handle's state. */
MST_HD void mst_reserve_commit(mst_pool_state* st, mst_handle_state* hs, const int64_t cap[MST_N_BLK],
                               const mst_plan* p, int32_t handle_id) {
    if (p->outcome == MST_RESERVE_STATE) { /* keep the handle's pages, flag */
        st->bad_state |= MST_BAD_SAVE;
        st->bad_handle = handle_id;
        return;
    }
    hs->state = p->outcome == MST_RESERVE_TAKEN ? MST_HANDLE_STASHED : MST_HANDLE_VOID;
    hs->epoch = st->epoch;
    hs->n_rows = p->n;
    if (p->outcome == MST_RESERVE_OVERFLOW) st->overflow = 1;
    int64_t total = 0;
    for (int b = 0; b < MST_N_BLK; b++) {
        st->head[b] += (uint64_t)p->take[b];
        hs->n_pages[b] = (int32_t)p->take[b];
        const int64_t used = mst_block_used(st, cap, b);
        if (used > st->peak[b]) st->peak[b] = used;
        total += used;
    }
    if (total > st->peak_total) st->peak_total = total;
    st->spilled += p->take[MST_BLK_HOST];
}

/* Outcome of mst_return_begin. */
enum { MST_RETURN_PAGES = 0, MST_RETURN_NONE, MST_RETURN_BAD };

/* The single-threaded start of a page return (after the restore's copy):
 * MST_RETURN_PAGES with pos[b] = ring positions to write and take[b] = counts
 * when the handle holds pages; MST_RETURN_NONE for a VOID handle (its save
 * took nothing); MST_RETURN_BAD, flagged, for a handle that holds nothing.
 * The last two leave the handle EMPTY. */
MST_HD int mst_return_begin(mst_pool_state* st, mst_handle_state* hs, int32_t handle_id,
                            uint64_t pos[MST_N_BLK], int64_t take[MST_N_BLK]) {
    if (!mst_handle_live(st, hs)) {
        const int bad = hs->state != MST_HANDLE_VOID;
        if (bad) {
            st->bad_state |= MST_BAD_RESTORE;
            st->bad_handle = handle_id;
        }
        hs->state = MST_HANDLE_EMPTY;
        return bad ? MST_RETURN_BAD : MST_RETURN_NONE;
    }
    for (int b = 0; b < MST_N_BLK; b++) {
        pos[b] = st->tail[b];
        take[b] = hs->n_pages[b];
    }
    return MST_RETURN_PAGES;
}

/* The single-threaded end of a page return, after the ids were written. */
MST_HD void mst_return_end(mst_pool_state* st, mst_handle_state* hs, const int64_t take[MST_N_BLK]) {
    for (int b = 0; b < MST_N_BLK; b++) st->tail[b] += (uint64_t)take[b];
    hs->state = MST_HANDLE_EMPTY;
    hs->n_rows = 0;
}

/* Moves page ids between the rings and a handle's table, for i = start,
 * start + stride, ... : to_ring 0 (save) table[off_b + i] = ring[b][(pos[b] + i)
 * % cap[b]]; to_ring 1 (restore) the other way. off_b = 0 for the device
 * block, take[dev] for the host block. */
MST_HD void mst_ring_move(uint32_t* const ring[MST_N_BLK], const int64_t cap[MST_N_BLK],
                          const uint64_t pos[MST_N_BLK], const int64_t take[MST_N_BLK],
                          uint32_t* table, int to_ring, int64_t start, int64_t stride) {
    for (int b = 0; b < MST_N_BLK; b++) {
        uint32_t* t = table + (b == MST_BLK_HOST ? take[MST_BLK_DEV] : 0);
        for (int64_t i = start; i < take[b]; i += stride) {
            uint32_t* slot = ring[b] + (pos[b] + (uint64_t)i) % (uint64_t)cap[b];
            if (to_ring) *slot = t[i];
            else t[i] = *slot;
        }
    }
}

/* A save that took no pages and leaves the handle VOID (skipped, overflow,
 * bad counts): table entries i = start, start + stride, ... < max_pages made
 * invalid, so that a claimed producer's writes go nowhere and in-place reads
 * see zeros. */
MST_HD void mst_table_void(const mst_plan* p, uint32_t* table, int64_t max_pages, int64_t start, int64_t stride) {
    if (p->outcome == MST_RESERVE_TAKEN || p->outcome == MST_RESERVE_STATE) return;
    for (int64_t i = start; i < max_pages; i += stride) table[i] = MST_PAGE_NONE;
}

/* Reset of block b, entries i = start, start + stride, ...: ring[b][i] = id i. */
MST_HD void mst_ring_fill(uint32_t* const ring[MST_N_BLK], const int64_t cap[MST_N_BLK], int b,
                          int64_t start, int64_t stride) {
    for (int64_t i = start; i < cap[b]; i += stride) ring[b][i] = mst_page_encode(b, i);
}

/* Reset of the counters (single-threaded, after the rings are full). */
MST_HD void mst_state_reset(mst_pool_state* st, const int64_t cap[MST_N_BLK]) {
    for (int b = 0; b < MST_N_BLK; b++) {
        st->head[b] = 0;
        st->tail[b] = (uint64_t)cap[b];
    }
    st->spilled = 0;
    st->overflow = 0;
    st->bad_state = 0;
    st->bad_handle = -1;
    st->epoch++;
}


#ifdef __cplusplus
}
#endif
#endif /* MST_PAGE_TABLE_H */
