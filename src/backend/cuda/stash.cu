/*
 * stash.cu — the paged stash on the CUDA backend. Everything runs on the
 * context's stream, reads counts on the device, never syncs and allocates
 * nothing, so a save / restore / reset sequence can be captured in a graph.
 *
 *   save    = reserve kernel (one block: thread 0 sums counts and takes pages
 *             through mst_reserve; the block copies the ids into the table)
 *           + copy kernel (persistent grid, 16-byte vectors; launched with
 *             programmatic dependent launch so it is resident and waiting
 *             when the reserve ends)
 *   restore = copy kernel from the pages; its last block to finish returns
 *             the pages to their rings (mst_return_begin / end)
 *   reset   = one kernel refilling both rings and clearing the counters
 *
 * The bookkeeping (mst_reserve, mst_ring_move, ...) is the same source the
 * CPU backend runs, in src/stash/stash.h. Host pages are pinned, mapped host
 * memory written and read by the copy kernels over PCIe.
 */
#include "../../stash/stash.h"
#include "cuda_common.cuh"

namespace {

constexpr int kThreads = 256;     /* every stash kernel's block size                 */
constexpr int kUnroll = 4;        /* independent vectors in flight per thread         */
constexpr int kBlocksPerSm = 8;   /* persistent copy grid: 2048 threads per SM        */

/* Programmatic dependent launch (sm_90): the save's copy kernel starts while
 * the reserve runs and waits here for its completion and memory flush. */
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

/* Sum of counts [E]; *bad = a negative count was seen. Block-wide result. */
__device__ int64_t block_counts_sum(const int32_t* counts, int32_t n_groups, int* bad) {
    __shared__ unsigned long long s_sum;
    __shared__ int s_bad;
    if (threadIdx.x == 0) s_sum = 0, s_bad = 0;
    __syncthreads();
    long long part = 0;
    int neg = 0;
    for (int32_t g = threadIdx.x; g < n_groups; g += blockDim.x) {
        const int32_t c = counts[g];
        neg |= c < 0;
        part += c;
    }
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    neg = __any_sync(0xffffffffu, neg);
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(&s_sum, (unsigned long long)part);
        if (neg) s_bad = 1;
    }
    __syncthreads();
    *bad = s_bad;
    return (int64_t)s_sum;
}

__global__ void __launch_bounds__(kThreads) reserve_kernel(mst_stash_args a) {
    pdl_launch_dependents();
    __shared__ uint64_t s_pos[MST_N_BLK];
    __shared__ int64_t s_take[MST_N_BLK];
    int bad = 0;
    const int64_t sum = block_counts_sum(a.counts, a.n_groups, &bad);
    if (threadIdx.x == 0) {
        const int64_t n = bad || sum > a.src_rows ? -1 : sum;
        const int r = mst_reserve(a.st, a.hs, a.cap, a.page_rows, n, a.handle_id, s_pos, s_take);
        if (r == MST_RESERVE_OVERFLOW) mst_dev_flag(a.err_flag, MST_FLAG_OVERFLOW);
        if (r == MST_RESERVE_COUNTS) mst_dev_flag(a.err_flag, MST_FLAG_COUNTS);
    }
    __syncthreads();
    mst_ring_move(a.ring, a.cap, s_pos, s_take, a.table, 0, threadIdx.x, blockDim.x);
}

/* Restore, after the copy: the last block to finish returns the pages (all
 * blocks have read the handle's state by then). Resets the block counter. */
__device__ void return_pages_last_block(const mst_stash_args& a) {
    __shared__ int s_last, s_ret;
    __shared__ uint64_t s_pos[MST_N_BLK];
    __shared__ int64_t s_take[MST_N_BLK];
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(&a.hs->done_blocks, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (threadIdx.x == 0) {
        s_ret = mst_return_begin(a.st, a.hs, a.handle_id, s_pos, s_take);
        a.hs->done_blocks = 0;
    }
    __syncthreads();
    if (s_ret != MST_RETURN_PAGES) return;
    mst_ring_move(a.ring, a.cap, s_pos, s_take, a.table, 1, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) mst_return_end(a.st, a.hs, s_take);
}

/* Rows [0, n) between the contiguous rows (src of a save, dst of a restore)
 * and the handle's pages, as vectors of V: flat vector u of the rows is
 * vector u % vpp of page table[u / vpp]. Byte offsets fit in 32 bits (a
 * handle holds < 4 GiB); the last < sizeof(V) bytes go byte by byte. Each
 * thread has kUnroll loads in flight before its stores. */
template <typename V, bool RESTORE>
__global__ void __launch_bounds__(kThreads) copy_kernel(mst_stash_args a) {
    if (!RESTORE) pdl_wait();
    const int64_t n = RESTORE ? (mst_handle_live(a.st, a.hs) ? a.hs->n_rows : 0) : a.hs->xfer_rows;
    const uint32_t page_bytes = (uint32_t)(a.page_rows * a.row_bytes);
    const uint32_t total = (uint32_t)(n * a.row_bytes);
    const uint32_t vpp = page_bytes / (uint32_t)sizeof(V);
    const uint32_t n_vec = total / (uint32_t)sizeof(V);
    char* rows = RESTORE ? a.dst : (char*)a.src;
    const uint32_t* __restrict__ table = a.table;
    const uint32_t stride = gridDim.x * blockDim.x;
    for (uint32_t u0 = blockIdx.x * blockDim.x + threadIdx.x; u0 < n_vec; u0 += kUnroll * stride) {
        V v[kUnroll];
        V* to[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; k++) { /* clamped: every load valid, no branch */
            const uint32_t u = min(u0 + k * stride, n_vec - 1);
            const uint32_t p = u / vpp;
            V* page = (V*)mst_page_ptr(a.block, table[p], page_bytes) + (u - p * vpp);
            V* row = (V*)rows + u;
            v[k] = RESTORE ? *page : *row;
            to[k] = RESTORE ? row : page;
        }
#pragma unroll
        for (int k = 0; k < kUnroll; k++)
            if (u0 + k * stride < n_vec) *to[k] = v[k];
    }
    const uint32_t tail = n_vec * (uint32_t)sizeof(V);
    if (blockIdx.x == 0 && threadIdx.x < total - tail) {
        const uint32_t b = tail + threadIdx.x, p = b / page_bytes;
        char* page = mst_page_ptr(a.block, table[p], page_bytes) + (b - p * page_bytes);
        if (RESTORE) rows[b] = *page;
        else *page = rows[b];
    }
    if (RESTORE) return_pages_last_block(a);
}

__global__ void __launch_bounds__(kThreads) reset_kernel(mst_stash_args a) {
    const int64_t start = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    for (int b = 0; b < MST_N_BLK; b++) mst_ring_fill(a.ring, a.cap, b, start, stride);
    if (start == 0) mst_state_reset(a.st, a.cap);
}

int n_sm(mst_ctx_t* ctx) { return mst_cuda(ctx)->n_sm; }

/* Persistent grid for a handle's largest copy (static: graph-safe). */
template <typename V>
unsigned copy_grid(mst_ctx_t* ctx, const mst_stash_args* a) {
    const int64_t max_vec = a->max_pages * a->page_rows * a->row_bytes / (int64_t)sizeof(V);
    const int64_t per_block = (int64_t)kThreads * kUnroll;
    const int64_t want = (max_vec + per_block - 1) / per_block;
    const int64_t cap = (int64_t)n_sm(ctx) * kBlocksPerSm;
    return (unsigned)(want < 1 ? 1 : want < cap ? want : cap);
}

template <typename V, bool RESTORE>
mst_status launch_copy(mst_ctx_t* ctx, const mst_stash_args* a) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(copy_grid<V>(ctx, a));
    cfg.blockDim = dim3(kThreads);
    cfg.stream = mst_cuda(ctx)->stream;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = RESTORE ? 0 : 1; /* the save's copy follows its reserve */
    MST_CUDA_TRY(cudaLaunchKernelEx(&cfg, copy_kernel<V, RESTORE>, *a));
    return MST_OK;
}

/* 16-byte vectors when the rows are 16-byte aligned (pages always are:
 * page_rows is a multiple of 8), else one element at a time. */
template <bool RESTORE>
mst_status copy(mst_ctx_t* ctx, const mst_stash_args* a, const void* rows) {
    if ((uintptr_t)rows % 16 == 0) return launch_copy<uint4, RESTORE>(ctx, a);
    if (a->elt_bytes == 4) return launch_copy<uint32_t, RESTORE>(ctx, a);
    return launch_copy<uint16_t, RESTORE>(ctx, a);
}

} // namespace

extern "C" mst_status mst_cuda_stash_reset(mst_ctx_t* ctx, const mst_stash_args* a) {
    const int64_t n = a->cap[MST_BLK_DEV] > a->cap[MST_BLK_HOST] ? a->cap[MST_BLK_DEV] : a->cap[MST_BLK_HOST];
    const int64_t want = (n + kThreads - 1) / kThreads, cap = (int64_t)n_sm(ctx) * 4;
    const unsigned grid = (unsigned)(want < 1 ? 1 : want < cap ? want : cap);
    reset_kernel<<<grid, kThreads, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_stash_save(mst_ctx_t* ctx, const mst_stash_args* a) {
    reserve_kernel<<<1, kThreads, 0, mst_cuda(ctx)->stream>>>(*a);
    MST_CUDA_LAUNCHED();
    return copy<false>(ctx, a, a->src);
}

extern "C" mst_status mst_cuda_stash_restore(mst_ctx_t* ctx, const mst_stash_args* a) {
    return copy<true>(ctx, a, a->dst);
}

extern "C" mst_status mst_cuda_host_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out) {
    (void)ctx;
    *out = NULL;
    cudaError_t e = cudaHostAlloc(out, n_bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *out = NULL;
        return mst_set_error(MST_ERR_OOM, "cudaHostAlloc of %zu bytes (host block) failed: %s", n_bytes,
                             cudaGetErrorString(e));
    }
    void* dev = NULL;
    e = cudaHostGetDevicePointer(&dev, *out, 0);
    if (e == cudaSuccess && dev == *out) return MST_OK;
    cudaGetLastError();
    cudaFreeHost(*out);
    *out = NULL;
    return mst_set_error(MST_ERR_UNSUPPORTED,
                         "host block: mapped pinned memory has no device address equal to its host "
                         "address (%s)", cudaGetErrorString(e));
}

extern "C" void mst_cuda_host_free(mst_ctx_t* ctx, void* ptr) {
    (void)ctx;
    cudaFreeHost(ptr);
}
