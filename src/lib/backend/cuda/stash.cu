/*
 * stash.cu — the paged stash on the CUDA backend. Everything runs on the
 * context's stream, reads counts on the device, never syncs and allocates
 * nothing, so a save / restore / reset sequence can be captured in a graph.
 *
 *   save    = one kernel: every block sums the counts and computes the same
 *             plan (mst_reserve_plan) from the untouched pool state, copies
 *             its share of rows into the pages the plan names (read from the
 *             rings) and writes its share of the page table. The last block
 *             to have read the pool state commits the plan
 *             (mst_reserve_commit, one thread) once its copy is done
 *   restore = one kernel: copies from the pages and writes its share of
 *             the page ids back into the rings (past their tails); the last
 *             block to have read the handle's state moves the tails and
 *             empties the handle (mst_return_begin / end, one thread). A
 *             split restore is the copy kernel without the return, then a
 *             one-warp return kernel
 *   claim   = a save without the copy (one warp): the producer writes the
 *             pages itself
 *   reset   = one kernel refilling both rings and clearing the counters
 *   batch   = slots on distinct pools (mst_stash_batch) in one launch of
 *             batch_kernel: each slot a range of its blocks, running the
 *             vector copy (a save, claim or restore part) or the reset of
 *             the single kernels on that range; page returns alone, one
 *             warp each (returns_kernel). Slots whose copy may be large
 *             (kBatchBytes) or whose rows are not 16-byte aligned get their
 *             own single launch instead (bulk copies where they apply), and
 *             so do the copies of fp8 pages (stash_fp8.cu)
 *
 * No block waits for another: a block counts itself as a reader once its
 * reads of the pool and handle state are done (an atomic whose result is
 * used only after the copy), so the block that counts last may change that
 * state while the others still copy (they no longer read it; the ring
 * entries and the table they read do not change before the kernel ends).
 *
 * Device-page copies whose pages hold whole 16 KiB chunks go by bulk copies
 * (cp.async.bulk through shared memory, one warp per SM); the others, and
 * pools of host pages only, by 16-byte vectors.
 *
 * Vector copies run on a persistent grid (as many blocks as fit on the
 * device at once). The bookkeeping is the source the CPU backend runs too
 * (page_table.h). Host pages are pinned, mapped host memory (stash_host.cu)
 * that the copy kernels write and read over PCIe.
 */
#include "cuda_ops.h"
#include "ptx.cuh"
#include "stash_common.cuh"

namespace {

constexpr int kUnroll = 4;    /* independent vectors in flight per thread */
constexpr int kHostBlocks = 64; /* copy grid of a pool with only host pages:
                                   PCIe needs few blocks, and the rest of the
                                   SMs stay free for concurrent work        */
constexpr uint32_t kChunk = 16384; /* bytes of one bulk copy (divides the
                                      pages of rows of 256-byte multiples) */
constexpr int kStages = 12;        /* bulk copies in flight per block:
                                      192 KiB of shared memory, one block
                                      per SM                               */
constexpr int64_t kBatchBytes = (int64_t)16 << 20; /* a slot whose handle
                                      holds more goes alone: there the copy,
                                      not the launch, is the cost          */

/* The page return of a split restore, one warp: the pages go back to their
 * rings. */
__device__ void finish_restore(const mst_stash_args& a) {
    __shared__ int s_ret;
    __shared__ uint64_t s_pos[MST_N_BLK];
    __shared__ int64_t s_take[MST_N_BLK];
    if (threadIdx.x == 0) s_ret = mst_return_begin(a.st, a.hs, a.handle_id, s_pos, s_take);
    __syncwarp();
    if (s_ret != MST_RETURN_PAGES) return;
    mst_ring_move(a.ring, a.cap, s_pos, s_take, a.table, 1, threadIdx.x, kWarpThreads);
    __syncwarp();
    if (threadIdx.x == 0) mst_return_end(a.st, a.hs, s_take);
}

/* Rows [0, n) between the contiguous rows (src of a save, dst of a restore)
 * and the handle's pages, as vectors of V: flat vector u of the rows is
 * vector u % vpp of page u / vpp (a save looks its id up in the rings, a
 * restore in the table), on the blocks of part pt. Grid-stride, each thread
 * with kUnroll loads in flight before its stores. A save issues the loads
 * of its first step before its plan (any row < src_rows may be read), so
 * the plan's latency hides behind them. Byte offsets fit in 32 bits (a
 * handle holds < 4 GiB); the last < sizeof(V) bytes go byte by byte. A
 * claim (no src) and a page return (no dst) copy nothing. */
template <typename V, bool RESTORE>
__device__ __forceinline__ void copy_body(const mst_stash_args& a, part pt) {
    __shared__ mst_plan s_plan;    /* save only    */
    __shared__ page_return s_ret; /* restore only */
    const uint32_t page_bytes = (uint32_t)(a.page_rows * a.row_bytes);
    const uint32_t vpp = page_bytes / (uint32_t)sizeof(V);
    char* rows = RESTORE ? a.dst : (char*)a.src;
    const uint32_t stride = pt.nb * blockDim.x;
    uint32_t u0 = pt.bid * blockDim.x + threadIdx.x;
    V v[kUnroll];
    bool loaded = false; /* v holds the vectors of step u0 */
    int64_t n;
    uint32_t ticket = 0; /* thread 0: reader ticket */
    if (RESTORE) {
        n = restore_rows(a, &s_ret, &ticket);
    } else {
        const int64_t src_vec = rows ? a.src_rows * a.row_bytes / (int64_t)sizeof(V) : 0;
        const uint32_t last = (uint32_t)min(src_vec, (int64_t)UINT32_MAX) - 1;
        if (src_vec > 0) {
#pragma unroll
            for (int k = 0; k < kUnroll; k++) v[k] = ((const V*)rows)[min(u0 + k * stride, last)];
            loaded = true;
        }
        block_plan(a, &s_plan);
        if (threadIdx.x == 0) ticket = count_reader(&a.hs->done_blocks);
        n = s_plan.n;
    }
    const uint32_t total = rows ? (uint32_t)(n * a.row_bytes) : 0; /* bytes copied */
    const uint32_t n_vec = total / (uint32_t)sizeof(V);
    const uint32_t* __restrict__ table = a.table;
    auto page = [&](uint32_t p) -> char* {
        const uint32_t id = RESTORE ? table[p] : mst_plan_page(a.ring, a.cap, &s_plan, p);
        return mst_page_ptr(a.block, id, page_bytes);
    };
    for (; u0 < n_vec; u0 += kUnroll * stride, loaded = false) {
        V* to[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; k++) { /* clamped: every address valid, no branch */
            const uint32_t u = min(u0 + k * stride, n_vec - 1);
            const uint32_t p = u / vpp;
            V* pg = (V*)page(p) + (u - p * vpp);
            V* row = (V*)rows + u;
            if (!loaded) v[k] = RESTORE ? *pg : *row;
            to[k] = RESTORE ? row : pg;
        }
#pragma unroll
        for (int k = 0; k < kUnroll; k++)
            if (u0 + k * stride < n_vec) *to[k] = v[k];
    }
    table_share<RESTORE>(a, &s_plan, &s_ret, pt);
    copy_end<RESTORE>(a, &s_plan, rows, n_vec * (uint32_t)sizeof(V), total, ticket, pt);
}

/* One save or restore by vectors of V on the whole grid. */
template <typename V, bool RESTORE>
__global__ void __launch_bounds__(kThreads, 5) copy_kernel(mst_stash_args a) { copy_body<V, RESTORE>(a, whole_grid()); }

/* ---- bulk copy: the copy engine of each SM (cp.async.bulk) moves chunks of
 * kChunk bytes through kStages slots of shared memory; lane 0 drives it. */

typedef struct bulk_pipe {
    char* slot;    /* [kStages, kChunk] shared memory              */
    uint64_t* bar; /* [kStages] shared: slot i % kStages is loaded */
} bulk_pipe;

/* Lane 0: chunk i of this block (global bytes `from`, `bytes` a multiple of
 * 16) into slot i % kStages. */
__device__ void bulk_load(const bulk_pipe& q, uint32_t i, const char* from, uint32_t bytes) {
    uint64_t* bar = &q.bar[i % kStages];
    mst_mbar_expect_tx(bar, bytes);
    mst_bulk_g2s(q.slot + (size_t)(i % kStages) * kChunk, from, bytes, bar);
}

/* Lane 0: until chunk i's load has landed (the (i / kStages)-th use of its slot). */
__device__ void bulk_wait(const bulk_pipe& q, uint32_t i) { mst_mbar_wait(&q.bar[i % kStages], (i / kStages) & 1u); }

/* Lane 0: chunk i from its slot to global bytes `to`, as one bulk group. */
__device__ void bulk_store(const bulk_pipe& q, uint32_t i, char* to, uint32_t bytes) {
    mst_bulk_s2g(to, q.slot + (size_t)(i % kStages) * kChunk, bytes);
}

/* Chunk c (bytes [c * kChunk, ...) of the rows) inside its page: a save
 * looks the page up in the rings, a restore in the table. A chunk never
 * crosses a page (kChunk divides page_bytes). */
template <bool RESTORE>
__device__ char* chunk_in_page(const mst_stash_args& a, const mst_plan* plan, uint32_t c, uint32_t page_bytes) {
    const uint32_t b = c * kChunk, p = b / page_bytes;
    const uint32_t id = RESTORE ? a.table[p] : mst_plan_page(a.ring, a.cap, plan, p);
    return mst_page_ptr(a.block, id, page_bytes) + (b - p * page_bytes);
}

/* Chunks of this block among the chunks of `bytes`: c = blockIdx.x + i * gridDim.x. */
__device__ uint32_t my_chunks(uint32_t bytes) {
    const uint32_t n = (bytes + kChunk - 1) / kChunk;
    return n > blockIdx.x ? (n - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
}

/* Bytes of this block's chunk i among `bytes` (a multiple of 16). */
__device__ uint32_t chunk_bytes(uint32_t i, uint32_t bytes) {
    const uint32_t b = (blockIdx.x + i * gridDim.x) * kChunk;
    return min(kChunk, bytes - b);
}

/* Lane 0: this block's chunks i < my of `bytes` (a save's first `loaded`
 * loads already issued; a restore's first kStages pages looked up in
 * first[]), each slot refilled once the store before the last one has read
 * it; then waits for every load and store it issued. */
template <bool RESTORE>
__device__ void bulk_run(const mst_stash_args& a, const bulk_pipe& q, const mst_plan* plan, char* rows,
                         char* const* first, uint32_t page_bytes, uint32_t bytes, uint32_t my, uint32_t loaded) {
    auto row_of = [&](uint32_t i) { return rows + (size_t)(blockIdx.x + i * gridDim.x) * kChunk; };
    auto page_of = [&](uint32_t i) { return chunk_in_page<RESTORE>(a, plan, blockIdx.x + i * gridDim.x, page_bytes); };
    for (uint32_t i = loaded; i < my && i < (uint32_t)kStages; i++, loaded++)
        bulk_load(q, i, RESTORE ? first[i] : row_of(i), chunk_bytes(i, bytes));
    for (uint32_t i = 0; i < my; i++) {
        bulk_wait(q, i);
        bulk_store(q, i, RESTORE ? row_of(i) : page_of(i), chunk_bytes(i, bytes));
        const uint32_t next = i - 1 + kStages;
        if (i >= 1 && next < my) {
            mst_bulk_wait_read<1>();
            bulk_load(q, next, RESTORE ? page_of(next) : row_of(next), chunk_bytes(next, bytes));
        }
    }
    for (uint32_t i = my; i < loaded; i++) bulk_wait(q, i); /* a save's first loads past its rows */
    mst_bulk_wait_all();
}

/* The copy of copy_kernel by bulk copies, for 16-byte aligned rows whose
 * pages hold whole chunks: one warp per SM. A save issues the loads of its
 * first chunks of the source before its plan. A claim (no src) is this
 * kernel on one warp without the copy and without shared memory. */
template <bool RESTORE>
__global__ void __launch_bounds__(kWarpThreads, 1) bulk_kernel(mst_stash_args a) {
    extern __shared__ __align__(128) char slots[]; /* [kStages, kChunk] */
    __shared__ __align__(8) uint64_t bars[kStages];
    __shared__ mst_plan s_plan;        /* save only */
    __shared__ page_return s_ret;      /* restore only */
    __shared__ char* s_first[kStages]; /* restore: pages of the first chunks */
    const bulk_pipe q = {slots, bars};
    const uint32_t page_bytes = (uint32_t)(a.page_rows * a.row_bytes);
    char* rows = RESTORE ? a.dst : (char*)a.src;
    const bool lead = threadIdx.x == 0, claim = !RESTORE && !a.src; /* a claim copies nothing */
    if (lead) {
        for (int i = 0; i < kStages; i++) mst_mbar_init(&bars[i], 1);
        mst_fence_proxy_async();
    }
    uint32_t ticket = 0, loaded = 0;
    int64_t n;
    if (RESTORE) {
        n = restore_rows(a, &s_ret, &ticket);
    } else {
        const uint32_t src_bytes = (uint32_t)min(a.src_rows * a.row_bytes, (int64_t)UINT32_MAX) & ~15u;
        for (uint32_t i = 0; lead && !claim && i < my_chunks(src_bytes) && i < (uint32_t)kStages; i++, loaded++)
            bulk_load(q, i, rows + (size_t)(blockIdx.x + i * gridDim.x) * kChunk, chunk_bytes(i, src_bytes));
        block_plan(a, &s_plan);
        if (lead) ticket = count_reader(&a.hs->done_blocks);
        n = s_plan.n;
    }
    const uint32_t total = (uint32_t)(n * a.row_bytes), bytes = total & ~15u, my = my_chunks(bytes);
    if (RESTORE && threadIdx.x < min(my, (uint32_t)kStages)) /* the first lookups side by side */
        s_first[threadIdx.x] = chunk_in_page<RESTORE>(a, &s_plan, blockIdx.x + threadIdx.x * gridDim.x, page_bytes);
    __syncwarp();
    if (lead && !claim) bulk_run<RESTORE>(a, q, &s_plan, rows, s_first, page_bytes, bytes, my, loaded);
    __syncwarp();
    table_share<RESTORE>(a, &s_plan, &s_ret, whole_grid());
    copy_end<RESTORE>(a, &s_plan, rows, claim ? total : bytes, total, ticket, whole_grid());
}

/* The page return of a split restore (MST_RESTORE_RETURN): one warp. */
__global__ void __maxnreg__(32) return_kernel(mst_stash_args a) { finish_restore(a); }

/* A reset on the blocks of part pt: both rings refilled, then (thread 0 of
 * block 0) the counters; blocks read nothing they write. */
__device__ void reset_body(const mst_stash_args& a, part pt) {
    const int64_t start = (int64_t)pt.bid * blockDim.x + threadIdx.x, stride = (int64_t)pt.nb * blockDim.x;
    for (int b = 0; b < MST_N_BLK; b++) mst_ring_fill(a.ring, a.cap, b, start, stride);
    if (start == 0) mst_state_reset(a.st, a.cap);
}

__global__ void __launch_bounds__(kThreads) reset_kernel(mst_stash_args a) { reset_body(a, whole_grid()); }

/* A batch as one launch: slot i runs on blocks [first[i], first[i + 1]). */
typedef struct batch_launch {
    mst_stash_batch b;
    uint32_t first[MST_STASH_BATCH_MAX + 1];
} batch_launch;

/* Each block finds its slot (a few compares, the same for the whole block)
 * and runs that slot's operation on its range. */
template <typename V>
__global__ void __launch_bounds__(kThreads, 4) batch_kernel(const __grid_constant__ batch_launch L) {
    int s = 0;
    while (s + 1 < L.b.n && blockIdx.x >= L.first[s + 1]) s++;
    const part pt = {blockIdx.x - L.first[s], L.first[s + 1] - L.first[s]};
    if (L.b.op[s] == MST_STASH_OP_SAVE) copy_body<V, false>(L.b.slot[s], pt);
    else if (L.b.op[s] == MST_STASH_OP_RESTORE) copy_body<V, true>(L.b.slot[s], pt);
    else reset_body(L.b.slot[s], pt);
}

/* A batch of page returns only (a backward's): block i, one warp of at most
 * 32 registers as return_kernel (it fits beside a persistent GEMM), returns
 * slot i's pages. */
__global__ void __maxnreg__(32) returns_kernel(const __grid_constant__ batch_launch L) {
    finish_restore(L.b.slot[blockIdx.x]);
}

/* The slot of vector type V in mst_cuda_impl::copy_per_sm. */
template <typename V>
constexpr int vec_index() { return sizeof(V) == 16 ? 0 : sizeof(V) == 4 ? 1 : 2; }

/* Context creation: resident blocks per SM of copy_kernel<V, RESTORE>. */
template <typename V, bool RESTORE>
mst_status copy_setup(mst_cuda_impl* c) {
    MST_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c->copy_per_sm[RESTORE][vec_index<V>()],
                                                               copy_kernel<V, RESTORE>, kThreads, 0));
    return MST_OK;
}

/* Context creation: the bulk copy's shared memory attribute. */
template <bool RESTORE>
mst_status bulk_setup() {
    MST_CUDA_TRY(cudaFuncSetAttribute(bulk_kernel<RESTORE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kStages * (int)kChunk));
    return MST_OK;
}

/* Context creation: resident blocks per SM of batch_kernel. */
mst_status batch_setup(mst_cuda_impl* c) {
    MST_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c->batch_per_sm, batch_kernel<uint4>, kThreads, 0));
    return MST_OK;
}

/* Persistent grid for a handle's largest copy by vectors of vec_bytes, on
 * blocks of which per_sm fit on an SM (static: graph-safe): as many blocks
 * as fit on the copy's SMs at once (kHostBlocks for a pool of host pages
 * only), fewer for small handles. */
unsigned copy_grid(mst_ctx_t* ctx, const mst_stash_args* a, int64_t vec_bytes, int per_sm) {
    const int64_t max_vec = a->max_pages * a->page_rows * a->row_bytes / vec_bytes;
    const int64_t per_block = (int64_t)kThreads * kUnroll;
    const int64_t want = (max_vec + per_block - 1) / per_block;
    int64_t cap = (int64_t)copy_sms(ctx, a) * (per_sm > 0 ? per_sm : 1);
    if (a->cap[MST_BLK_DEV] == 0 && cap > kHostBlocks) cap = kHostBlocks;
    return (unsigned)(want < 1 ? 1 : want < cap ? want : cap);
}

template <typename V, bool RESTORE>
mst_status launch_copy(mst_ctx_t* ctx, const mst_stash_args* a) {
    const unsigned grid = copy_grid(ctx, a, sizeof(V), mst_cuda(ctx)->copy_per_sm[RESTORE][vec_index<V>()]);
    copy_kernel<V, RESTORE><<<grid, kThreads, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* Bulk copies, one block per SM of the copy (fewer for small handles). */
template <bool RESTORE>
mst_status launch_bulk(mst_ctx_t* ctx, const mst_stash_args* a) {
    constexpr int smem = kStages * (int)kChunk; /* the attribute: bulk_setup */
    const int64_t want = (a->max_pages * a->page_rows * a->row_bytes + kChunk - 1) / kChunk;
    const int cap = copy_sms(ctx, a);
    const unsigned grid = (unsigned)(want < cap ? (want < 1 ? 1 : want) : cap);
    bulk_kernel<RESTORE><<<grid, kWarpThreads, smem, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* Bulk copies for a pool with device pages whose pages hold whole chunks and
 * 16-byte aligned rows; else 16-byte vectors when the rows are 16-byte
 * aligned (pages always are: page_rows is a multiple of 8), else one element
 * at a time. A pool of host pages only keeps the vector copy on kHostBlocks
 * blocks (PCIe needs no more; the bulk copy was not faster there). */
template <bool RESTORE>
mst_status copy(mst_ctx_t* ctx, const mst_stash_args* a, const void* rows) {
    const bool aligned = (uintptr_t)rows % 16 == 0;
    if (aligned && a->cap[MST_BLK_DEV] > 0 && (a->page_rows * a->row_bytes) % kChunk == 0)
        return launch_bulk<RESTORE>(ctx, a);
    if (aligned) return launch_copy<uint4, RESTORE>(ctx, a);
    if (a->elt_bytes == 4) return launch_copy<uint32_t, RESTORE>(ctx, a);
    return launch_copy<uint16_t, RESTORE>(ctx, a);
}

/* Blocks of a reset: one ring entry per thread, at most a few waves. */
unsigned reset_grid(mst_ctx_t* ctx, const mst_stash_args* a) {
    const int64_t n = a->cap[MST_BLK_DEV] > a->cap[MST_BLK_HOST] ? a->cap[MST_BLK_DEV] : a->cap[MST_BLK_HOST];
    const int64_t want = (n + kThreads - 1) / kThreads, cap = (int64_t)mst_cuda(ctx)->n_sm * 4;
    return (unsigned)(want < 1 ? 1 : want < cap ? want : cap);
}

/* The rows a slot copies (NULL: none: a claim, a page return, a reset). */
const char* slot_rows(int32_t op, const mst_stash_args* a) {
    if (op == MST_STASH_OP_SAVE) return a->src;
    return op == MST_STASH_OP_RESTORE && a->restore_part != MST_RESTORE_RETURN ? a->dst : NULL;
}

/* A slot that runs alone, by the single kernels: a copy whose handle may
 * hold more than kBatchBytes (there the copy is the cost, and the bulk copy
 * applies), or whose rows are not 16-byte aligned, or of fp8 pages. */
bool alone(int32_t op, const mst_stash_args* a) {
    const char* rows = slot_rows(op, a);
    return rows && (a->max_pages * a->page_rows * a->row_bytes > kBatchBytes || (uintptr_t)rows % 16 != 0 || a->fp8);
}

/* Blocks of a slot in batch_kernel: a copy's persistent grid, a reset's, one
 * block for a claim or a page return. */
unsigned slot_blocks(mst_ctx_t* ctx, int32_t op, const mst_stash_args* a) {
    if (op == MST_STASH_OP_RESET) return reset_grid(ctx, a);
    return slot_rows(op, a) ? copy_grid(ctx, a, sizeof(uint4), mst_cuda(ctx)->batch_per_sm) : 1;
}

} // namespace

mst_status mst_cuda_stash_setup(mst_cuda_impl* c) {
    MST_TRY(bulk_setup<false>());
    MST_TRY(bulk_setup<true>());
    MST_TRY((copy_setup<uint4, false>(c)));
    MST_TRY((copy_setup<uint4, true>(c)));
    MST_TRY((copy_setup<uint32_t, false>(c)));
    MST_TRY((copy_setup<uint32_t, true>(c)));
    MST_TRY((copy_setup<uint16_t, false>(c)));
    MST_TRY((copy_setup<uint16_t, true>(c)));
    return batch_setup(c);
}

extern "C" mst_status mst_cuda_stash_reset(mst_ctx_t* ctx, const mst_stash_args* a) {
    reset_kernel<<<reset_grid(ctx, a), kThreads, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_stash_save(mst_ctx_t* ctx, const mst_stash_args* a) {
    if (a->fp8) return mst_cuda_stash_fp8(ctx, a, 0); /* never a claim (pool.c refuses them) */
    if (a->src) return copy<false>(ctx, a, a->src);
    bulk_kernel<false><<<1, kWarpThreads, 0, mst_cuda(ctx)->stream>>>(*a); /* a claim: plan, table, commit */
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_stash_restore(mst_ctx_t* ctx, const mst_stash_args* a) {
    if (a->restore_part != MST_RESTORE_RETURN) return a->fp8 ? mst_cuda_stash_fp8(ctx, a, 1) : copy<true>(ctx, a, a->dst);
    return_kernel<<<1, kWarpThreads, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* The slots that run alone first (single kernels), then the rest in one
 * launch: returns_kernel when all are page returns, else batch_kernel;
 * slots touch distinct pools, so the order is free. */
extern "C" mst_status mst_cuda_stash_batch(mst_ctx_t* ctx, const mst_stash_batch* b) {
    batch_launch L;
    memset(&L, 0, sizeof L);
    uint32_t blocks = 0;
    bool returns = true; /* every batched slot a page return */
    mst_status first = MST_OK;
    for (int32_t i = 0; i < b->n; i++) {
        const mst_stash_args* a = &b->slot[i];
        if (alone(b->op[i], a)) {
            const mst_status st = b->op[i] == MST_STASH_OP_SAVE ? mst_cuda_stash_save(ctx, a) : mst_cuda_stash_restore(ctx, a);
            if (first == MST_OK) first = st;
            continue;
        }
        returns &= b->op[i] == MST_STASH_OP_RESTORE && a->restore_part == MST_RESTORE_RETURN;
        L.first[L.b.n] = blocks;
        L.b.op[L.b.n] = b->op[i];
        L.b.slot[L.b.n++] = *a;
        blocks += slot_blocks(ctx, b->op[i], a);
    }
    if (!L.b.n) return first;
    L.first[L.b.n] = blocks;
    if (returns) returns_kernel<<<(unsigned)L.b.n, kWarpThreads, 0, mst_cuda(ctx)->stream>>>(L);
    else batch_kernel<uint4><<<blocks, kThreads, 0, mst_cuda(ctx)->stream>>>(L);
    MST_CUDA_LAUNCHED();
    return first;
}
