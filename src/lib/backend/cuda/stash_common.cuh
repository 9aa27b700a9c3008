/*
 * stash_common.cuh — what the CUDA stash kernels share (stash.cu: the copy,
 * bulk, reset and batch kernels; stash_fp8.cu: fp8 pages): the part of a
 * grid an operation runs on, a save's plan, the reader tickets whose last
 * holder commits, a restore's page return, the table share of each block
 * and the end of a kernel. The bookkeeping itself is page_table.h's.
 */
#ifndef MST_STASH_COMMON_CUH
#define MST_STASH_COMMON_CUH

#include "counts.cuh"
#include "cuda_common.cuh"

namespace {

constexpr int kThreads = 256; /* block size of the vector copy, the fp8
                                 kernel and the reset                      */
constexpr int kWarpThreads = 32; /* the page-return kernel: one warp of at
                                    most 32 registers fits beside a
                                    persistent GEMM block, which leaves
                                    1024 free; and the bulk copy's block  */

/* This block's place among the blocks of its operation: the whole grid of
 * a single launch, or its slot's range of a batch. */
typedef struct part {
    uint32_t bid; /* block index within the operation */
    uint32_t nb;  /* blocks of the operation          */
} part;

__device__ inline part whole_grid() { return {blockIdx.x, gridDim.x}; }

/* Every thread of a save's block: the plan, computed by thread 0 on copies
 * of the state loaded while the block sums the counts. */
__device__ inline void block_plan(const mst_stash_args& a, mst_plan* s_plan) {
    mst_pool_state st;
    mst_handle_state hs;
    if (threadIdx.x == 0) st = *a.st, hs = *a.hs;
    const int64_t sum = mst_block_counts(a.counts, a.n_groups, a.src_rows, NULL); /* MST_COUNTS_BAD: -1 */
    if (threadIdx.x == 0) mst_reserve_plan(&st, &hs, a.cap, a.page_rows, a.max_rows, sum, s_plan);
    __syncthreads();
}

/* Thread 0, once its block's reads of the pool and handle state are done:
 * the block's ticket as a reader (the last block gets pt.nb - 1). The
 * caller uses it only after its copy, so the atomic's latency is hidden. */
__device__ inline uint32_t count_reader(uint32_t* done) {
    __threadfence(); /* the state reads come before the count */
    return atomicAdd(done, 1u);
}

/* Every lane of warp 0 after its copy: true when thread 0's ticket was the
 * last of the operation's pt.nb blocks; then every block has read the
 * state, and the counter is reset for the handle's next operation. */
__device__ inline bool last_reader(uint32_t* done, uint32_t ticket, part pt) {
    const bool last = __shfl_sync(0xffffffffu, ticket, 0) == pt.nb - 1;
    if (last && threadIdx.x == 0) *done = 0;
    if (last) __threadfence(); /* the state changes come after every read */
    return last;
}

/* Save, last reader, thread 0: the commit and the context flags (every block
 * writes its share of the page table itself). */
__device__ inline void finish_save(const mst_stash_args& a, const mst_plan* p) {
    if (threadIdx.x != 0) return;
    mst_reserve_commit(a.st, a.hs, a.cap, p, a.handle_id);
    if (p->outcome == MST_RESERVE_OVERFLOW) mst_dev_flag(a.err_flag, MST_FLAG_OVERFLOW);
    if (p->outcome == MST_RESERVE_COUNTS) mst_dev_flag(a.err_flag, MST_FLAG_COUNTS);
}

/* Restore, last reader, thread 0: the ring tails move past the pages that
 * every block wrote back, and the handle is emptied (a handle that holds
 * none: flagged or not, as mst_return_begin says). */
__device__ inline void finish_return(const mst_stash_args& a) {
    if (threadIdx.x != 0) return;
    uint64_t pos[MST_N_BLK];
    int64_t take[MST_N_BLK];
    if (mst_return_begin(a.st, a.hs, a.handle_id, pos, take) == MST_RETURN_PAGES) mst_return_end(a.st, a.hs, take);
}

/* The end of a copy kernel: block 0 copies bytes [tail, total) (fewer than
 * a vector) byte by byte; then the last reader commits the save or the
 * restore's page return (not for MST_RESTORE_COPY, which counts no
 * readers). */
template <bool RESTORE>
__device__ inline void copy_end(const mst_stash_args& a, const mst_plan* plan, char* rows, uint32_t tail, uint32_t total,
                         uint32_t ticket, part pt) {
    if (pt.bid == 0 && threadIdx.x < total - tail) {
        const uint32_t page_bytes = (uint32_t)(a.page_rows * a.row_bytes);
        const uint32_t b = tail + threadIdx.x, p = b / page_bytes;
        const uint32_t id = RESTORE ? a.table[p] : mst_plan_page(a.ring, a.cap, plan, p);
        char* pg = mst_page_ptr(a.block, id, page_bytes) + (b - p * page_bytes);
        if (RESTORE) rows[b] = *pg;
        else *pg = rows[b];
    }
    if ((RESTORE && a.restore_part == MST_RESTORE_COPY) || threadIdx.x >= kWarpThreads) return;
    if (!last_reader(&a.hs->done_blocks, ticket, pt)) return;
    if (RESTORE) finish_return(a);
    else finish_save(a, plan);
}

/* Where a restore's pages go back: ring positions and counts (0 for
 * MST_RESTORE_COPY or a handle that holds none). Every block writes its
 * share of the ring entries; the last reader moves the tails. */
typedef struct page_return {
    uint64_t pos[MST_N_BLK];  /* st->tail[b] before the return */
    int64_t take[MST_N_BLK];  /* pages going back to ring b     */
} page_return;

/* Restore, every thread: rows to copy back (those the handle holds; 0 when
 * it holds none or for MST_RESTORE_RETURN) and *r, read by thread 0, which
 * then takes its reader ticket (not for MST_RESTORE_COPY) while the others
 * start copying. */
__device__ inline int64_t restore_rows(const mst_stash_args& a, page_return* r, uint32_t* ticket) {
    __shared__ int64_t s_n;
    if (threadIdx.x == 0) {
        const int live = mst_handle_live(a.st, a.hs);
        s_n = live && a.restore_part != MST_RESTORE_RETURN ? a.hs->n_rows : 0;
        for (int b = 0; b < MST_N_BLK; b++) {
            r->pos[b] = a.st->tail[b];
            r->take[b] = live && a.restore_part != MST_RESTORE_COPY ? a.hs->n_pages[b] : 0;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && a.restore_part != MST_RESTORE_COPY) *ticket = count_reader(&a.hs->done_blocks);
    return s_n;
}

/* This block's share of the page table (a save; invalid ids when it took
 * none) or of the page return (a restore). */
template <bool RESTORE>
__device__ inline void table_share(const mst_stash_args& a, const mst_plan* plan, const page_return* ret, part pt) {
    const int64_t i = (int64_t)pt.bid * blockDim.x + threadIdx.x, stride = (int64_t)pt.nb * blockDim.x;
    mst_ring_move(a.ring, a.cap, RESTORE ? ret->pos : plan->pos, RESTORE ? ret->take : plan->take, a.table, RESTORE,
                  i, stride);
    if (!RESTORE) mst_table_void(plan, a.table, a.max_pages, i, stride);
}

/* SMs a copy of pool state a may use: the pool's copy_sms, or all. */
inline int copy_sms(mst_ctx_t* ctx, const mst_stash_args* a) {
    const int n = mst_cuda(ctx)->n_sm;
    return a->copy_sms > 0 && a->copy_sms < n ? a->copy_sms : n;
}

} // namespace

#endif /* MST_STASH_COMMON_CUH */
