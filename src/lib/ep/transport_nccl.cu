/*
 * transport_nccl.cu — the exchanges over NCCL, two paths on one communicator
 * (built only with NCCL, MST_HAVE_NCCL):
 *   lsa: NCCL's device API. The receive buffers live in one symmetric window
 *        (ncclMemAlloc + ncclCommWindowRegister); one kernel waits on an LSA
 *        barrier until every peer is done with its receive buffers, stores
 *        each row straight from where it lies (the token rows by the
 *        routing, the expert rows by their slots: no pack or repack before
 *        it) into its place in the peer's window over NVLink (counts read on
 *        the device: only the rows that exist move), and meets the peers at
 *        a second barrier. Direct dispatch (into the window rows of
 *        mst_ep_window_rows) is one more kernel of three barriers: every
 *        rank's send counts to every rank, then each CTA works out where its
 *        rows go on each peer (mst_ep_direct_shift) and stores them at their
 *        final expert rows in the peer's window rows: no receive blocks, no
 *        unpack.
 *   p2p: one group of ncclSend/ncclRecv per exchange, every block at its
 *        full, fixed size (C rows per rank pair): host sizes that never
 *        depend on the routing.
 * Both enqueue on the context's stream and capture in a CUDA graph. The lsa
 * path is built where nccl_device.h stands beside nccl.h.
 * MST_EP_PATH_AUTO takes lsa when every rank is load/store accessible to
 * every other (one NVLink domain) and NCCL can make the device communicator,
 * else p2p. The collectives: the float sums in a fixed order
 * (transport_nccl_sum.cu), the exact kinds and the all-gather NCCL's.
 */
#include <string.h>

#include "../backend/cuda/cuda_common.cuh"
#include "transport_nccl.h"

/* lsa: threads per CTA of the exchange kernel (LSA_CTAS of them:
 * transport_nccl.h). */
enum { LSA_THREADS = 512, LSA_MAX_PLANES = 4 };

static_assert(sizeof(ncclUniqueId) == sizeof(((mst_ep_id*)0)->bytes), "mst_ep_id holds an ncclUniqueId");

/* ---- p2p: send/recv of whole blocks ---- */

static mst_status p2p_exchange(mst_ep_t* ep, const mst_ep_plane* pl, int n) {
    nccl_state* ns = (nccl_state*)ep->comm;
    cudaStream_t s = mst_cuda(ep->ctx)->stream;
    NCCL_TRY(ncclGroupStart(), ns->comm);
    ncclResult_t first = ncclSuccess, r;
    for (int p = 0; p < n; p++)
        for (int j = 0; j < ep->world; j++) {
            const size_t bb = pl[p].block_bytes;
            r = ncclSend((const char*)pl[p].send + (size_t)j * bb, bb, ncclChar, j, ns->comm, s);
            if (first == ncclSuccess) first = r;
            r = ncclRecv((char*)pl[p].recv + (size_t)j * bb, bb, ncclChar, j, ns->comm, s);
            if (first == ncclSuccess) first = r;
        }
    r = ncclGroupEnd(); /* always closes the group, also after a failed call */
    if (first == ncclSuccess) first = r;
    if (first != ncclSuccess) {
        ns->failed = 1;
        return nccl_error(first, "ep exchange (ncclSend/ncclRecv group)", ns->comm);
    }
    return MST_OK;
}

/* ---- point-to-point transfers (mst_ep_p2p): one group ---- */

static mst_status nccl_sendrecv(mst_ep_t* ep, const mst_ep_p2p_op* ops, int n) {
    nccl_state* ns = (nccl_state*)ep->comm;
    cudaStream_t s = mst_cuda(ep->ctx)->stream;
    NCCL_TRY(ncclGroupStart(), ns->comm);
    ncclResult_t first = ncclSuccess, r;
    for (int i = 0; i < n; i++) {
        r = ops[i].recv ? ncclRecv(ops[i].data, ops[i].bytes, ncclChar, ops[i].peer, ns->comm, s)
                        : ncclSend(ops[i].data, ops[i].bytes, ncclChar, ops[i].peer, ns->comm, s);
        if (first == ncclSuccess) first = r;
    }
    r = ncclGroupEnd(); /* always closes the group, also after a failed call */
    if (first == ncclSuccess) first = r;
    if (first != ncclSuccess) {
        ns->failed = 1;
        return nccl_error(first, "mst_ep_p2p (ncclSend/ncclRecv group)", ns->comm);
    }
    return MST_OK;
}

/* ---- lsa: stores into the peers' windows ---- */
#ifdef MST_HAVE_NCCL_DEVICE

typedef struct lsa_plane {
    const char* send;      /* src BLOCKS: [W, block_bytes] this rank's send blocks;
                              else the rows they would be packed from         */
    size_t recv_off;       /* offset of the receive blocks in the window           */
    size_t block_bytes, row_bytes;
    const int32_t* valid;  /* rows of block d at valid[d * stride], or NULL: all   */
    int64_t valid_stride;
    int src;               /* mst_ep_src                                          */
    int64_t src_div;       /* MST_EP_SRC_TOKENS                                   */
} lsa_plane;

typedef struct lsa_args {
    lsa_plane pl[LSA_MAX_PLANES];
    int n_planes, world, rank;
    mst_ep_args map;       /* the routing of gathered planes                      */
    ncclWindow_t win;
    ncclDevComm dev;
} lsa_args;

/* bytes [0, n) of src -> dst by threads tid of n_threads: 16-byte words
 * (four in flight per thread) when both allow, else 4-byte words. */
__device__ __forceinline__ void copy_bytes(char* dst, const char* src, size_t n, size_t tid, size_t n_threads) {
    if ((((uintptr_t)dst | (uintptr_t)src | n) & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        const size_t nv = n / 16;
        size_t i = tid;
        for (; i + 3 * n_threads < nv; i += 4 * n_threads) {
            const uint4 a = s[i], b = s[i + n_threads], c = s[i + 2 * n_threads], e = s[i + 3 * n_threads];
            d[i] = a, d[i + n_threads] = b, d[i + 2 * n_threads] = c, d[i + 3 * n_threads] = e;
        }
        for (; i < nv; i += n_threads) d[i] = s[i];
    } else {
        for (size_t i = tid; i < n / 4; i += n_threads) ((uint32_t*)dst)[i] = ((const uint32_t*)src)[i];
    }
}

/* Row i of the block this rank sends to peer d, in d's window. */
__device__ __forceinline__ char* peer_row(const lsa_args& a, const lsa_plane& pl, int d, int64_t i) {
    return (char*)ncclGetPeerPointer(a.win, pl.recv_off + (size_t)a.rank * pl.block_bytes + (size_t)i * pl.row_bytes, d);
}

/* Send row u of a gathered plane: its source and its destination (peer d,
 * row i of the block); false when it moves nothing. u runs over the N k
 * entries (TOKENS) or the W C received slots, peers interleaved so that
 * neighbouring rows go to different peers (ROWS). */
__device__ __forceinline__ bool gathered_row(const lsa_args& a, const lsa_plane& pl, int64_t u, const char** src,
                                             int* d, int64_t* i) {
    const mst_ep_args& m = a.map;
    if (pl.src == MST_EP_SRC_TOKENS) {
        const int32_t pos = m.send_pos[u];
        if (pos < 0) return false;
        *d = (int)(pos / m.pair_rows), *i = pos % m.pair_rows;
        *src = pl.send + (size_t)(u / pl.src_div) * pl.row_bytes;
        return true;
    }
    *d = (int)((a.rank + u % a.world) % a.world), *i = u / a.world;
    const int64_t r = mst_ep_slot_row(&m, *d, *i);
    if (r < 0) return false;
    *src = pl.send + (size_t)r * pl.row_bytes;
    return true;
}

/* f(u, lane, width) for every u < n over the grid: a warp per u (width 32)
 * for rows of 512 bytes or more, else a thread per u (width 1). */
template <class F>
__device__ void each_row(int64_t n, size_t row_bytes, F f) {
    const bool by_warp = row_bytes >= 512;
    const int width = by_warp ? 32 : 1;
    const int64_t first = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / width;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x / width;
    const size_t lane = by_warp ? threadIdx.x % 32 : 0;
    for (int64_t u = first; u < n; u += stride) f(u, lane, width);
}

/* Every row of gathered plane pl. */
__device__ void copy_gathered(const lsa_args& a, const lsa_plane& pl) {
    const int64_t n = pl.src == MST_EP_SRC_TOKENS ? a.map.n_tok * a.map.top_k : (int64_t)a.world * a.map.pair_rows;
    each_row(n, pl.row_bytes, [&](int64_t u, size_t lane, int width) {
        const char* src;
        int d;
        int64_t i;
        if (gathered_row(a, pl, u, &src, &d, &i)) copy_bytes(peer_row(a, pl, d, i), src, pl.row_bytes, lane, width);
    });
}

/* The valid rows of every send block of pl to its peer, every thread of the
 * grid on one block at a time, peers staggered. */
__device__ void copy_blocks(const lsa_args& a, const lsa_plane& pl) {
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nt = (size_t)gridDim.x * blockDim.x;
    for (int k = 0; k < a.world; k++) {
        const int d = (a.rank + k) % a.world; /* staggered: not every rank at peer 0 first */
        size_t n = pl.block_bytes;
        if (pl.valid) {
            const int32_t v = pl.valid[d * pl.valid_stride];
            n = v <= 0 ? 0 : min(n, (size_t)v * pl.row_bytes);
        }
        copy_bytes(peer_row(a, pl, d, 0), pl.send + (size_t)d * pl.block_bytes, n, tid, nt);
    }
}

__global__ void __launch_bounds__(LSA_THREADS) lsa_exchange_kernel(lsa_args a) {
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), a.dev, ncclTeamTagLsa(), blockIdx.x};
    bar.sync(ncclCoopCta(), cuda::memory_order_acquire); /* every peer is done reading its window */
    for (int p = 0; p < a.n_planes; p++) {
        if (a.pl[p].src == MST_EP_SRC_BLOCKS) copy_blocks(a, a.pl[p]);
        else copy_gathered(a, a.pl[p]);
    }
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel); /* every peer's rows have landed */
}

/* Offset of p (in this rank's window) in the window: the same buffer's
 * offset in every peer's. */
static size_t win_off(const nccl_state* ns, const void* p) {
    MST_ASSERT((const char*)p >= (const char*)ns->win_base);
    return (size_t)((const char*)p - (const char*)ns->win_base);
}

static mst_status lsa_exchange(mst_ep_t* ep, const mst_ep_plane* pl, int n) {
    nccl_state* ns = (nccl_state*)ep->comm;
    MST_ASSERT(n <= LSA_MAX_PLANES);
    lsa_args a;
    memset(&a, 0, sizeof a);
    a.n_planes = n, a.world = ep->world, a.rank = ep->rank, a.win = ns->win, a.dev = ns->dev;
    for (int p = 0; p < n; p++) {
        a.pl[p] = lsa_plane{(const char*)pl[p].send, win_off(ns, pl[p].recv),
                            pl[p].block_bytes, pl[p].row_bytes, pl[p].valid, pl[p].valid_stride, (int)pl[p].src,
                            pl[p].src_div};
        if (pl[p].src != MST_EP_SRC_BLOCKS) a.map = *pl[p].map; /* every gathered plane of a call has one map */
    }
    lsa_exchange_kernel<<<LSA_CTAS, LSA_THREADS, 0, mst_cuda(ep->ctx)->stream>>>(a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* ---- lsa direct dispatch: rows straight to their expert rows ---- */

typedef struct lsa_direct_args {
    mst_ep_args map;          /* route's send_pos and send_counts; topk_idx, tok,
                                 tok_p (NULL: no probs)                         */
    const int32_t* gathered;  /* [W, W, El] this rank's gathered counts (window) */
    size_t gathered_off, counts_off, rows_off, p_off; /* in the window: gathered,
                                 recv_counts [W, El], win_rows [., H], win_p [.] */
    ncclWindow_t win;
    ncclDevComm dev;
} lsa_direct_args;

/* This rank's send counts [W, El] into every peer's window: all to its
 * gathered row `rank`, block d to peer d's recv_counts row `rank`. Every CTA
 * writes them all (the same values): the barrier after it pairs each CTA
 * with the same CTA of the peers only, so each must see every count from
 * its own partners. */
__device__ void put_counts(const lsa_direct_args& a) {
    const mst_ep_args& m = a.map;
    const size_t El4 = (size_t)m.n_local * 4, WEl4 = (size_t)m.world * El4;
    const char* counts = (const char*)m.send_counts;
    for (int d = 0; d < m.world; d++) { /* 16-byte stores where El allows */
        copy_bytes((char*)ncclGetPeerPointer(a.win, a.gathered_off + (size_t)m.rank * WEl4, d), counts, WEl4,
                   threadIdx.x, blockDim.x);
        copy_bytes((char*)ncclGetPeerPointer(a.win, a.counts_off + (size_t)m.rank * El4, d), counts + d * El4, El4,
                   threadIdx.x, blockDim.x);
    }
}

/* Row u / src_div of src (row_bytes each) for every routing entry u, to its
 * expert row of the destination's window buffer at `off`. */
__device__ void store_direct(const lsa_direct_args& a, const int32_t* shift, const char* src, size_t row_bytes,
                             int64_t src_div, size_t off) {
    each_row(a.map.n_tok * a.map.top_k, row_bytes, [&](int64_t u, size_t lane, int width) {
        int32_t d;
        const int64_t r = mst_ep_direct_row(&a.map, shift, u, &d);
        if (r >= 0)
            copy_bytes((char*)ncclGetPeerPointer(a.win, off + (size_t)r * row_bytes, d),
                       src + (size_t)(u / src_div) * row_bytes, row_bytes, lane, width);
    });
}

/* Three barriers: peers done with their window rows | counts landed | rows
 * landed. Between the second and the third each CTA turns the gathered
 * counts into its own shift table (shared memory) and stores its share of
 * the rows. */
__global__ void __launch_bounds__(LSA_THREADS) lsa_direct_kernel(lsa_direct_args a) {
    extern __shared__ int32_t sh[]; /* gathered [W, W, El], shift [W, El] */
    const mst_ep_args& m = a.map;
    const int64_t WEl = (int64_t)m.world * m.n_local;
    int32_t *gathered = sh, *shift = sh + m.world * WEl;
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), a.dev, ncclTeamTagLsa(), blockIdx.x};
    bar.sync(ncclCoopCta(), cuda::memory_order_acquire); /* every peer is done reading its window rows */
    put_counts(a);
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel); /* every peer's counts have landed */
    for (int64_t j = threadIdx.x; j < m.world * WEl; j += blockDim.x) gathered[j] = __ldcg(a.gathered + j);
    __syncthreads();
    for (int32_t d = threadIdx.x; d < m.world; d += blockDim.x) mst_ep_direct_shift(&m, gathered, d, shift + d * m.n_local);
    __syncthreads();
    store_direct(a, shift, (const char*)m.tok, (size_t)m.cols * 2, m.top_k, a.rows_off);
    if (m.tok_p) store_direct(a, shift, (const char*)m.tok_p, sizeof(float), 1, a.p_off);
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel); /* every peer's rows have landed */
}

static mst_status lsa_dispatch_direct(mst_ep_t* ep, const mst_ep_args* m) {
    nccl_state* ns = (nccl_state*)ep->comm;
    lsa_direct_args a;
    memset(&a, 0, sizeof a);
    a.map = *m, a.gathered = ep->gathered, a.win = ns->win, a.dev = ns->dev;
    a.gathered_off = win_off(ns, ep->gathered), a.counts_off = win_off(ns, ep->recv_counts);
    a.rows_off = win_off(ns, ep->win_rows), a.p_off = win_off(ns, ep->win_p);
    const size_t smem = (size_t)m->n_experts * (size_t)(m->world + 1) * sizeof(int32_t);
    if (smem > 48 * 1024 && cudaFuncSetAttribute(lsa_direct_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)smem) != cudaSuccess) {
        (void)cudaGetLastError();
        return mst_set_error(MST_ERR_UNSUPPORTED, "ep direct dispatch: the counts of %d experts on %d ranks "
                             "(%zu bytes) do not fit in shared memory", m->n_experts, m->world, smem);
    }
    lsa_direct_kernel<<<LSA_CTAS, LSA_THREADS, smem, mst_cuda(ep->ctx)->stream>>>(a);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

/* The receive block in the symmetric window (collective: every rank). */
static mst_status lsa_recv_alloc(mst_ep_t* ep, size_t n_bytes, void** out) {
    nccl_state* ns = (nccl_state*)ep->comm;
    const size_t rounded = (n_bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
                           NCCL_WIN_REQUIRED_ALIGNMENT;
    NCCL_TRY(ncclMemAlloc(&ns->win_base, rounded), ns->comm);
    NCCL_TRY(ncclCommWindowRegister(ns->comm, ns->win_base, rounded, &ns->win, NCCL_WIN_COLL_SYMMETRIC), ns->comm);
    *out = ns->win_base;
    return MST_OK;
}

#endif /* MST_HAVE_NCCL_DEVICE */

/* ---- all-reduce, reduce-scatter, all-gather (both paths), in place: the
 * float sums in sum_order.h's order (transport_nccl_sum.cu), the exact
 * kinds (int32 sums, maxima) and the all-gather NCCL's ---- */

static const ncclDataType_t nccl_type[] = {ncclFloat32, ncclFloat64, ncclInt32, ncclInt32, ncclFloat64};

static int float_sum(mst_ep_reduce kind) { return kind == MST_EP_SUM_F32 || kind == MST_EP_SUM_F64; }

static mst_status nccl_allreduce(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind) {
    if (float_sum(kind)) return mst_nccl_sum_allreduce(ep, data, count, kind);
    nccl_state* ns = (nccl_state*)ep->comm;
    const ncclRedOp_t op = kind == MST_EP_MAX_I32 || kind == MST_EP_MAX_F64 ? ncclMax : ncclSum;
    ncclResult_t r = ncclAllReduce(data, data, (size_t)count, nccl_type[kind], op, ns->comm, mst_cuda(ep->ctx)->stream);
    if (r != ncclSuccess) {
        ns->failed = 1;
        return nccl_error(r, "mst_ep_allreduce (ncclAllReduce)", ns->comm);
    }
    return MST_OK;
}

/* ncclReduceScatter in place (the exact kinds, the whole of data [W, q]:
 * collectives.c): rank r's block r. */
static mst_status nccl_reduce_scatter(mst_ep_t* ep, void* data, int64_t q, int64_t lo, int64_t hi, mst_ep_reduce kind) {
    if (float_sum(kind)) return mst_nccl_sum_reduce_scatter(ep, data, q, lo, hi, kind);
    const int64_t count = q;
    (void)lo, (void)hi;
    nccl_state* ns = (nccl_state*)ep->comm;
    const ncclRedOp_t op = kind == MST_EP_MAX_I32 || kind == MST_EP_MAX_F64 ? ncclMax : ncclSum;
    char* mine = (char*)data + (size_t)ep->rank * (size_t)count * mst_ep_reduce_size(kind);
    ncclResult_t r = ncclReduceScatter(data, mine, (size_t)count, nccl_type[kind], op, ns->comm, mst_cuda(ep->ctx)->stream);
    if (r != ncclSuccess) {
        ns->failed = 1;
        return nccl_error(r, "mst_ep_reduce_scatter (ncclReduceScatter)", ns->comm);
    }
    return MST_OK;
}

/* ncclAllGather in place: rank r sends its block r of data [W, block_bytes]. */
static mst_status nccl_allgather(mst_ep_t* ep, void* data, size_t block_bytes) {
    nccl_state* ns = (nccl_state*)ep->comm;
    const char* mine = (const char*)data + (size_t)ep->rank * block_bytes;
    ncclResult_t r = ncclAllGather(mine, data, block_bytes, ncclUint8, ns->comm, mst_cuda(ep->ctx)->stream);
    if (r != ncclSuccess) {
        ns->failed = 1;
        return nccl_error(r, "mst_ep_allgather (ncclAllGather)", ns->comm);
    }
    return MST_OK;
}

static void nccl_destroy(mst_ep_t* ep) {
    nccl_state* ns = (nccl_state*)ep->comm;
    if (!ns) return;
#ifdef MST_HAVE_NCCL_DEVICE
    if (ns->lsa) ncclDevCommDestroy(ns->comm, &ns->dev);
#endif
    if (ns->win) ncclCommWindowDeregister(ns->comm, ns->win);
    if (ns->win_base) ncclMemFree(ns->win_base);
    mst_nccl_sum_free(ns);
    if (ns->owned && ns->comm) {
        if (ns->failed) ncclCommAbort(ns->comm);
        else ncclCommDestroy(ns->comm);
    }
    free(ns);
    ep->comm = NULL;
}

const mst_ep_transport mst_ep_transport_nccl = {
    "nccl send/recv, fixed-capacity blocks", p2p_exchange, nccl_destroy, NULL, 0, nccl_allreduce,
    nccl_reduce_scatter, nccl_allgather, NULL, nccl_sendrecv,
};
#ifdef MST_HAVE_NCCL_DEVICE
const mst_ep_transport mst_ep_transport_lsa = {
    "nccl device API (symmetric window, NVLink stores of the valid rows)", lsa_exchange, nccl_destroy,
    lsa_recv_alloc, 1, nccl_allreduce, nccl_reduce_scatter, nccl_allgather, lsa_dispatch_direct, nccl_sendrecv,
};
#endif

/* ---- communicators ---- */

extern "C" mst_status mst_ep_id_create(mst_ep_id* out) {
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    NCCL_TRY(ncclGetUniqueId((ncclUniqueId*)out->bytes), NULL);
    return MST_OK;
}

static mst_status check_cuda_ctx(mst_ctx_t* ctx, mst_ep_t** out) {
    MST_TRY(mst_check_ctx(ctx));
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (ctx->kind != MST_BACKEND_CUDA)
        return mst_set_error(MST_ERR_UNSUPPORTED, "NCCL communicators need a CUDA context (got %s); "
                             "CPU contexts exchange through mst_ep_create_local", ctx->be->name);
    return MST_OK;
}

/* Before the buffers: the lsa transport (its receive block goes into a
 * window) when asked for or auto and every rank is load/store accessible;
 * every rank decides the same way from what they share. */
static mst_status pick_transport(mst_ep_t* ep, nccl_state* ns, mst_ep_path_kind want) {
#ifndef MST_HAVE_NCCL_DEVICE
    (void)ns;
    if (want == MST_EP_PATH_LSA)
        return mst_set_error(MST_ERR_UNSUPPORTED, "cfg.path = lsa: built without NCCL's device API "
                             "(no nccl_device.h beside nccl.h)");
    ep->tr = &mst_ep_transport_nccl;
    return MST_OK;
#else
    const int n_lsa = ncclTeamLsa(ns->comm).nRanks;
    if (want == MST_EP_PATH_LSA && n_lsa != ep->world)
        return mst_set_error(MST_ERR_UNSUPPORTED, "cfg.path = lsa: only %d of the %d ranks are load/store "
                             "accessible (NCCL's device API needs all)", n_lsa, ep->world);
    ep->tr = want != MST_EP_PATH_P2P && n_lsa == ep->world ? &mst_ep_transport_lsa : &mst_ep_transport_nccl;
    return MST_OK;
#endif
}

/* After the window is registered: the device communicator (collective). If
 * NCCL cannot make it, auto falls back to p2p over the same buffers. */
static mst_status make_dev_comm(mst_ep_t* ep, nccl_state* ns, mst_ep_path_kind want) {
#ifndef MST_HAVE_NCCL_DEVICE
    (void)ep, (void)ns, (void)want;
    return MST_OK;
#else
    if (ep->tr != &mst_ep_transport_lsa) return MST_OK;
    ncclDevCommRequirements reqs;
    memset(&reqs, 0, sizeof reqs);
    reqs.lsaBarrierCount = LSA_CTAS;
    ncclResult_t r = ncclDevCommCreate(ns->comm, &reqs, &ns->dev);
    ns->lsa = r == ncclSuccess;
    if (ns->lsa) return MST_OK;
    if (want == MST_EP_PATH_LSA) return nccl_error(r, "cfg.path = lsa: ncclDevCommCreate", ns->comm);
    ep->tr = &mst_ep_transport_nccl;
    return MST_OK;
#endif
}

/* ep over comm (made from `id` when given), path chosen, buffers set up
 * (cfg NULL: bare, on p2p); owned: comm is destroyed with ep. */
static mst_status finish(mst_ctx_t* ctx, const mst_ep_config* cfg, int rank, int world, ncclComm_t comm,
                         const mst_ep_id* id, int owned, mst_ep_t** out) {
    if (cfg) MST_TRY(mst_ep_check_config(cfg, world));
    mst_ep_t* ep;
    MST_TRY(mst_ep_alloc(&ep));
    nccl_state* ns = (nccl_state*)calloc(1, sizeof *ns);
    mst_status st = ns ? MST_OK : mst_set_error(MST_ERR_OOM, "nccl state");
    if (st == MST_OK) {
        ep->comm = ns;
        ep->tr = &mst_ep_transport_nccl; /* destroys ns on failure */
        ep->rank = rank, ep->world = world;
        ns->owned = owned || id != NULL;
        ns->comm = comm;
    }
    if (st == MST_OK && id) {
        ncclUniqueId uid;
        memcpy(&uid, id->bytes, sizeof uid);
        if (cudaSetDevice(ctx->device) != cudaSuccess)
            st = mst_set_error(MST_ERR_BACKEND, "cudaSetDevice(%d) failed", ctx->device);
        ncclResult_t r = st == MST_OK ? ncclCommInitRank(&ns->comm, world, uid, rank) : ncclSuccess;
        if (r != ncclSuccess) st = nccl_error(r, "ncclCommInitRank", NULL);
    }
    const mst_ep_path_kind path = cfg ? (mst_ep_path_kind)cfg->path : MST_EP_PATH_P2P;
    if (st == MST_OK) st = pick_transport(ep, ns, path);
    if (st == MST_OK) st = mst_ep_init(ep, ctx, cfg, rank, world);
    if (st == MST_OK) st = make_dev_comm(ep, ns, path);
    if (st != MST_OK) {
        mst_ep_destroy(ep);
        return st;
    }
    *out = ep;
    return MST_OK;
}

extern "C" mst_status mst_ep_create(mst_ctx_t* ctx, const mst_ep_config* cfg, const mst_ep_id* id, int rank,
                                    int world, mst_ep_t** out) {
    MST_TRY(check_cuda_ctx(ctx, out));
    if (!id) return mst_set_error(MST_ERR_INVALID, "id is NULL");
    if (world < 1) return mst_set_error(MST_ERR_INVALID, "world = %d: must be >= 1", world);
    if (rank < 0 || rank >= world)
        return mst_set_error(MST_ERR_INVALID, "rank = %d: must be in [0, %d)", rank, world);
    return finish(ctx, cfg, rank, world, NULL, id, 0, out);
}

extern "C" mst_status mst_ep_create_nccl(mst_ctx_t* ctx, const mst_ep_config* cfg, void* nccl_comm,
                                         mst_ep_t** out) {
    MST_TRY(check_cuda_ctx(ctx, out));
    if (!nccl_comm) return mst_set_error(MST_ERR_INVALID, "nccl_comm is NULL");
    ncclComm_t comm = (ncclComm_t)nccl_comm;
    int world = 0, rank = 0, dev = -1;
    NCCL_TRY(ncclCommCount(comm, &world), comm);
    NCCL_TRY(ncclCommUserRank(comm, &rank), comm);
    NCCL_TRY(ncclCommCuDevice(comm, &dev), comm);
    if (dev != ctx->device)
        return mst_set_error(MST_ERR_INVALID, "nccl_comm is on device %d, the context on device %d", dev,
                             ctx->device);
    return finish(ctx, cfg, rank, world, comm, NULL, 0, out);
}

extern "C" mst_status mst_ep_create_split(mst_ctx_t* ctx, const mst_ep_config* cfg, mst_ep_t* parent, int color,
                                          int key, mst_ep_t** out) {
    MST_TRY(check_cuda_ctx(ctx, out));
    if (!parent || (parent->tr != &mst_ep_transport_nccl
#ifdef MST_HAVE_NCCL_DEVICE
                    && parent->tr != &mst_ep_transport_lsa
#endif
                    ))
        return mst_set_error(MST_ERR_INVALID, "parent: not an NCCL communicator (%s)", parent ? mst_ep_path(parent) : "NULL");
    if (color < 0) return mst_set_error(MST_ERR_INVALID, "color = %d: must be >= 0", color);
    ncclComm_t pc = ((nccl_state*)parent->comm)->comm, sub = NULL;
    if (cudaSetDevice(ctx->device) != cudaSuccess)
        return mst_set_error(MST_ERR_BACKEND, "cudaSetDevice(%d) failed", ctx->device);
    NCCL_TRY(ncclCommSplit(pc, color, key, &sub, NULL), pc);
    int world = 0, rank = 0;
    ncclResult_t r = ncclCommCount(sub, &world);
    if (r == ncclSuccess) r = ncclCommUserRank(sub, &rank);
    if (r != ncclSuccess) {
        ncclCommDestroy(sub);
        return nccl_error(r, "ncclCommCount / ncclCommUserRank of a split communicator", pc);
    }
    return finish(ctx, cfg, rank, world, sub, NULL, 1, out);
}
