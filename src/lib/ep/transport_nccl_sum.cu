/*
 * transport_nccl_sum.cu — the float sums of the NCCL transport
 * (mst_ep_allreduce and mst_ep_reduce_scatter of MST_EP_SUM_F32 / F64) with
 * NCCL moving bytes only. NCCL's own reductions add in an order that
 * depends on its algorithm, channels and chunking, so on the transport: the
 * NVLink and the network runs of one grid drift apart (DESIGN 12.1). Here:
 *   reduce-scatter of data [W, q] over a window [lo, hi) of its flat
 *     elements (all of them: mst_ep_reduce_scatter): in buckets of c
 *     columns, the window's part of block d goes to rank d (one group of
 *     ncclSend / ncclRecv), which takes the W - 1 others' into its staging
 *     [W, c] and adds the W values of each element in rank order
 *     (sum_order.h; its own from its block) into its block;
 *   all-reduce of data [count]: buckets of m <= W c elements, each cut into
 *     W slices of ceil(m / W) (the last ones shorter or empty) reduce-
 *     scattered as above, then every rank's summed slice goes to every peer
 *     (ncclAllGather in place when the W slices are equal, else a second
 *     group: copies, bit-exact on any transport).
 * Bytes per rank: (W - 1) / W of the data each way per phase (a ring's).
 * The staging [W, c] is cudaMalloc'd outside a capture, at the first float
 * sum of the communicator and again when a later sum outside a capture
 * wants more (up to ep->sum_stage_cap); the stages it outgrows live until
 * destroy (a graph captured before may read them). Under a capture a sum
 * works in the buckets the staging holds (the bits do not depend on the
 * buckets), so the sums capture once one ran eagerly.
 */
#include "../backend/cuda/cuda_common.cuh"
#include "sum_order.h"
#include "transport_nccl.h"

enum { SUM_THREADS = 256, SUM_MAX_CTAS = 2048 };

__device__ __forceinline__ float fold(float acc, float x, int j) { return mst_ep_sum_f32(acc, x, j); }
__device__ __forceinline__ double fold(double acc, double x, int j) { return mst_ep_sum_f64(acc, x, j); }

/* mine [n] = the W ranks' values summed in rank order; rank j's element i
 * is mine[i] (j == rank) or stage[j c + i]. */
template <class T>
__global__ void sum_ranks_kernel(T* mine, const T* stage, int64_t c, int64_t n, int W, int rank) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        T acc = 0;
        for (int j = 0; j < W; j++) acc = fold(acc, j == rank ? mine[i] : stage[(int64_t)j * c + i], j);
        mine[i] = acc;
    }
}

/* A bucket of a window: data [W, q] elements at base (block d at base +
 * d q), the flat elements [lo, hi), columns [c0, c0 + cols) of each block:
 * block d's part is [max(lo, d q + c0), min(hi, d q + min(c0 + cols, q)))
 * (part() gives offset and length; empty: length 0). The staging holds the
 * ranks' parts `rank` at row stride cols. */
typedef struct bucket {
    char* base;
    int64_t q, lo, hi, c0, cols;
} bucket;

static void part(const bucket& b, int d, int64_t* off, int64_t* len) {
    const int64_t at = (int64_t)d * b.q, a = at + b.c0, e = at + (b.c0 + b.cols < b.q ? b.c0 + b.cols : b.q);
    *off = a > b.lo ? a : b.lo;
    const int64_t end = e < b.hi ? e : b.hi;
    *len = end > *off ? end - *off : 0;
}

/* One group: with every peer d, a send of sn bytes from sp and a receive of
 * rn bytes into rp, as peer(d, &sp, &sn, &rp, &rn) gives them (0 bytes: no
 * call; both sides of a pair compute the same count). */
template <class F>
static mst_status group(mst_ep_t* ep, const char* what, F peer) {
    nccl_state* ns = (nccl_state*)ep->comm;
    cudaStream_t s = mst_cuda(ep->ctx)->stream;
    NCCL_TRY(ncclGroupStart(), ns->comm);
    ncclResult_t first = ncclSuccess, r;
    for (int k = 1; k < ep->world; k++) {
        const int d = (ep->rank + k) % ep->world; /* staggered: not every rank at peer 0 first */
        const void* sp;
        void* rp;
        size_t sn, rn;
        peer(d, &sp, &sn, &rp, &rn);
        if (sn && (r = ncclSend(sp, sn, ncclChar, d, ns->comm, s)) != ncclSuccess && first == ncclSuccess) first = r;
        if (rn && (r = ncclRecv(rp, rn, ncclChar, d, ns->comm, s)) != ncclSuccess && first == ncclSuccess) first = r;
    }
    r = ncclGroupEnd(); /* always closes the group, also after a failed call */
    if (first == ncclSuccess) first = r;
    if (first != ncclSuccess) {
        ns->failed = 1;
        return nccl_error(first, what, ns->comm);
    }
    return MST_OK;
}

/* This rank's part of b summed over the ranks in rank order, in place:
 * every peer's part `rank` into the staging, then the kernel. */
static mst_status scatter_sum(mst_ep_t* ep, const bucket& b, size_t es, mst_ep_reduce kind, const char* what) {
    nccl_state* ns = (nccl_state*)ep->comm;
    const int me = ep->rank;
    int64_t at, n;
    part(b, me, &at, &n);
    MST_TRY(group(ep, what, [&](int d, const void** sp, size_t* sn, void** rp, size_t* rn) {
        int64_t off, len;
        part(b, d, &off, &len);
        *sp = b.base + (size_t)off * es, *sn = (size_t)len * es;
        *rp = (char*)ns->stage + (size_t)d * (size_t)b.cols * es, *rn = (size_t)n * es;
    }));
    if (n == 0) return MST_OK;
    const int64_t ctas = (n + SUM_THREADS - 1) / SUM_THREADS;
    const unsigned grid = (unsigned)(ctas < (int64_t)SUM_MAX_CTAS ? ctas : (int64_t)SUM_MAX_CTAS);
    cudaStream_t s = mst_cuda(ep->ctx)->stream;
    char* mine = b.base + (size_t)at * es;
    if (kind == MST_EP_SUM_F32)
        sum_ranks_kernel<float><<<grid, SUM_THREADS, 0, s>>>((float*)mine, (const float*)ns->stage, b.cols, n, ep->world, me);
    else
        sum_ranks_kernel<double><<<grid, SUM_THREADS, 0, s>>>((double*)mine, (const double*)ns->stage, b.cols, n, ep->world, me);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* This rank's part of b to every peer, every peer's into its place: a
 * bucket of W whole blocks (the window all of [W, q], one column bucket)
 * by ncclAllGather in place, else one group. Copies either way. */
static mst_status gather(mst_ep_t* ep, const bucket& b, size_t es) {
    const int me = ep->rank;
    if (b.lo == 0 && b.hi == (int64_t)ep->world * b.q && b.c0 == 0 && b.cols == b.q) {
        nccl_state* ns = (nccl_state*)ep->comm;
        const size_t n = (size_t)b.q * es;
        ncclResult_t r = ncclAllGather(b.base + (size_t)me * n, b.base, n, ncclChar, ns->comm, mst_cuda(ep->ctx)->stream);
        if (r != ncclSuccess) {
            ns->failed = 1;
            return nccl_error(r, "mst_ep_allreduce (ncclAllGather)", ns->comm);
        }
        return MST_OK;
    }
    return group(ep, "mst_ep_allreduce (ncclSend/ncclRecv group: all-gather)",
                 [&](int d, const void** sp, size_t* sn, void** rp, size_t* rn) {
                     int64_t at, n, off, len;
                     part(b, me, &at, &n);
                     part(b, d, &off, &len);
                     *sp = b.base + (size_t)at * es, *sn = (size_t)n * es;
                     *rp = b.base + (size_t)off * es, *rn = (size_t)len * es;
                 });
}

/* Columns per block of a bucket: the staging [W, c] for a sum of blocks of
 * `want` columns, allocated or grown when not capturing; under a capture
 * what the staging holds (MST_ERR_STATE when it holds nothing). */
static mst_status stage_cols(mst_ep_t* ep, int64_t want, size_t es, const char* what, int64_t* cols) {
    nccl_state* ns = (nccl_state*)ep->comm;
    const size_t row = (size_t)ep->world * es, cap = ep->sum_stage_cap ? ep->sum_stage_cap : MST_EP_SUM_STAGE_BYTES;
    if (cap < row)
        return mst_set_error(MST_ERR_INVALID, "%s: sum_stage_cap = %zu bytes holds no column of %d ranks (%zu bytes)",
                             what, cap, ep->world, row);
    size_t bytes = (size_t)want <= cap / row ? (size_t)want * row : cap / row * row; /* what this sum could use */
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    MST_CUDA_TRY(cudaStreamIsCapturing(mst_cuda(ep->ctx)->stream, &cs));
    if (ns->stage_bytes < bytes && cs == cudaStreamCaptureStatusNone && ns->n_retired < SUM_MAX_RETIRED) {
        const size_t twice = 2 * ns->stage_bytes < cap ? 2 * ns->stage_bytes : cap;
        if (bytes < twice) bytes = twice / row * row; /* grow by doubling: few stages retired */
        void* p = NULL;
        MST_CUDA_TRY(cudaSetDevice(ep->ctx->device));
        if (cudaMalloc(&p, bytes) != cudaSuccess) {
            (void)cudaGetLastError();
            return mst_set_error(MST_ERR_OOM, "%s: the staging of the float sums (%zu bytes)", what, bytes);
        }
        if (ns->stage) ns->retired[ns->n_retired++] = ns->stage;
        ns->stage = p, ns->stage_bytes = bytes;
    }
    if (ns->stage_bytes < row)
        return mst_set_error(MST_ERR_STATE, "%s: the communicator's first float sum runs during a capture (its "
                             "staging is allocated outside one: run a step eagerly first)", what);
    *cols = (int64_t)(ns->stage_bytes / row);
    return MST_OK;
}

/* 1 when some rank's part of b is not empty (the same answer on every rank). */
static int any_part(const bucket& b, int W) {
    for (int d = 0; d < W; d++) {
        int64_t off, len;
        part(b, d, &off, &len);
        if (len > 0) return 1;
    }
    return 0;
}

mst_status mst_nccl_sum_reduce_scatter(mst_ep_t* ep, void* data, int64_t q, int64_t lo, int64_t hi, mst_ep_reduce kind) {
    if (ep->world == 1 || hi <= lo) return MST_OK; /* one rank: its block is the sum */
    const char* what = "mst_ep_reduce_scatter (ncclSend/ncclRecv group)";
    const size_t es = mst_ep_reduce_size(kind);
    int64_t cols;
    MST_TRY(stage_cols(ep, hi - lo < q ? hi - lo : q, es, what, &cols));
    for (int64_t c0 = 0; c0 < q; c0 += cols) {
        const bucket b = {(char*)data, q, lo, hi, c0, q - c0 < cols ? q - c0 : cols};
        if (any_part(b, ep->world)) MST_TRY(scatter_sum(ep, b, es, kind, what));
    }
    return MST_OK;
}

mst_status mst_nccl_sum_allreduce(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind) {
    if (ep->world == 1) return MST_OK;
    const char* what = "mst_ep_allreduce (ncclSend/ncclRecv group: reduce-scatter)";
    const size_t es = mst_ep_reduce_size(kind);
    const int64_t W = ep->world;
    int64_t cols;
    MST_TRY(stage_cols(ep, (count + W - 1) / W, es, what, &cols));
    for (int64_t o = 0; o < count; o += W * cols) { /* [o, o + m) as [W, c] slices, the last shorter or empty */
        const int64_t m = count - o < W * cols ? count - o : W * cols, c = (m + W - 1) / W;
        const bucket b = {(char*)data + (size_t)o * es, c, 0, m, 0, c};
        MST_TRY(scatter_sum(ep, b, es, kind, what));
        MST_TRY(gather(ep, b, es));
    }
    return MST_OK;
}

void mst_nccl_sum_free(nccl_state* ns) {
    for (int i = 0; i < ns->n_retired; i++) cudaFree(ns->retired[i]);
    if (ns->stage) cudaFree(ns->stage);
    ns->stage = NULL, ns->stage_bytes = 0, ns->n_retired = 0;
}
