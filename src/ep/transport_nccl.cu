/*
 * transport_nccl.cu — the exchanges over NCCL, two paths on one communicator
 * (built only with NCCL, MST_HAVE_NCCL):
 *   lsa: NCCL's device API. The receive buffers live in one symmetric window
 *        (ncclMemAlloc + ncclCommWindowRegister); one kernel waits on an LSA
 *        barrier until every peer is done with its receive buffers, stores
 *        the valid rows of each send block straight into the peer's window
 *        over NVLink (counts read on the device: only the rows that exist
 *        move), and meets the peers at a second barrier.
 *   p2p: one group of ncclSend/ncclRecv per exchange, every block at its
 *        full, fixed size (C rows per rank pair): host sizes that never
 *        depend on the routing.
 * Both enqueue on the context's stream and capture in a CUDA graph. The lsa
 * path is built where nccl_device.h stands beside nccl.h.
 * MST_EP_PATH_AUTO takes lsa when every rank is load/store accessible to
 * every other (one NVLink domain) and NCCL can make the device communicator,
 * else p2p.
 */
#include <nccl.h>
#ifdef MST_HAVE_NCCL_DEVICE /* nccl_device.h beside nccl.h (NCCL >= 2.28) */
#include <nccl_device.h>
#endif
#include <string.h>

#include "../backend/cuda/cuda_common.cuh"
#include "ep.h"

enum { LSA_CTAS = 32, LSA_THREADS = 512, LSA_MAX_PLANES = 4 };

typedef struct nccl_state {
    ncclComm_t comm;
    int owned;          /* 1: made by mst_ep_create, destroyed with the communicator */
    int failed;         /* an NCCL call failed: abort instead of destroy             */
    int lsa;            /* the device-API path is set up                             */
    void* win_base;     /* ncclMemAlloc'd receive block (lsa)                        */
    ncclWindow_t win;   /* its symmetric window                                      */
#ifdef MST_HAVE_NCCL_DEVICE
    ncclDevComm dev;    /* device communicator with LSA_CTAS barriers                */
#endif
} nccl_state;

static_assert(sizeof(ncclUniqueId) == sizeof(((mst_ep_id*)0)->bytes), "mst_ep_id holds an ncclUniqueId");

static mst_status nccl_error(ncclResult_t r, const char* what, ncclComm_t comm) {
    return mst_set_error(MST_ERR_BACKEND, "%s failed: %s (%s)", what, ncclGetErrorString(r),
                         ncclGetLastError(comm));
}

#define NCCL_TRY(call, comm)                                            \
    do {                                                                \
        ncclResult_t r_ = (call);                                       \
        if (r_ != ncclSuccess) return nccl_error(r_, #call, comm);      \
    } while (0)

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

/* ---- lsa: stores into the peers' windows ---- */
#ifdef MST_HAVE_NCCL_DEVICE

typedef struct lsa_plane {
    const char* send;      /* [W, block_bytes] this rank's send blocks            */
    size_t recv_off;       /* offset of the receive blocks in the window           */
    size_t block_bytes, row_bytes;
    const int32_t* valid;  /* rows of block d at valid[d * stride], or NULL: all   */
    int64_t valid_stride;
} lsa_plane;

typedef struct lsa_args {
    lsa_plane pl[LSA_MAX_PLANES];
    int n_planes, world, rank;
    ncclWindow_t win;
    ncclDevComm dev;
} lsa_args;

/* bytes [0, n) of src -> dst, 16-byte words when both allow, else 4-byte */
__device__ void copy_bytes(char* dst, const char* src, size_t n, size_t tid, size_t n_threads) {
    if ((((uintptr_t)dst | (uintptr_t)src | n) & 15) == 0) {
        for (size_t i = tid; i < n / 16; i += n_threads) ((uint4*)dst)[i] = ((const uint4*)src)[i];
    } else {
        for (size_t i = tid; i < n / 4; i += n_threads) ((uint32_t*)dst)[i] = ((const uint32_t*)src)[i];
    }
}

__global__ void __launch_bounds__(LSA_THREADS) lsa_exchange_kernel(lsa_args a) {
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), a.dev, ncclTeamTagLsa(), blockIdx.x};
    bar.sync(ncclCoopCta(), cuda::memory_order_acquire); /* every peer is done reading its window */
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nt = (size_t)gridDim.x * blockDim.x;
    for (int p = 0; p < a.n_planes; p++) {
        const lsa_plane& pl = a.pl[p];
        for (int k = 0; k < a.world; k++) {
            const int d = (a.rank + k) % a.world; /* staggered: not every rank at peer 0 first */
            size_t n = pl.block_bytes;
            if (pl.valid) {
                const int32_t v = pl.valid[d * pl.valid_stride];
                n = v <= 0 ? 0 : min(n, (size_t)v * pl.row_bytes);
            }
            char* dst = (char*)ncclGetPeerPointer(a.win, pl.recv_off + (size_t)a.rank * pl.block_bytes, d);
            copy_bytes(dst, pl.send + (size_t)d * pl.block_bytes, n, tid, nt);
        }
    }
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel); /* every peer's rows have landed */
}

static mst_status lsa_exchange(mst_ep_t* ep, const mst_ep_plane* pl, int n) {
    nccl_state* ns = (nccl_state*)ep->comm;
    MST_ASSERT(n <= LSA_MAX_PLANES);
    lsa_args a;
    memset(&a, 0, sizeof a);
    a.n_planes = n, a.world = ep->world, a.rank = ep->rank, a.win = ns->win, a.dev = ns->dev;
    for (int p = 0; p < n; p++) {
        MST_ASSERT((const char*)pl[p].recv >= (const char*)ns->win_base);
        a.pl[p] = lsa_plane{(const char*)pl[p].send, (size_t)((const char*)pl[p].recv - (const char*)ns->win_base),
                            pl[p].block_bytes, pl[p].row_bytes, pl[p].valid, pl[p].valid_stride};
    }
    lsa_exchange_kernel<<<LSA_CTAS, LSA_THREADS, 0, mst_cuda(ep->ctx)->stream>>>(a);
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

static void nccl_destroy(mst_ep_t* ep) {
    nccl_state* ns = (nccl_state*)ep->comm;
    if (!ns) return;
#ifdef MST_HAVE_NCCL_DEVICE
    if (ns->lsa) ncclDevCommDestroy(ns->comm, &ns->dev);
#endif
    if (ns->win) ncclCommWindowDeregister(ns->comm, ns->win);
    if (ns->win_base) ncclMemFree(ns->win_base);
    if (ns->owned && ns->comm) {
        if (ns->failed) ncclCommAbort(ns->comm);
        else ncclCommDestroy(ns->comm);
    }
    free(ns);
    ep->comm = NULL;
}

const mst_ep_transport mst_ep_transport_nccl = {
    "nccl send/recv, fixed-capacity blocks", p2p_exchange, nccl_destroy, NULL,
};
#ifdef MST_HAVE_NCCL_DEVICE
const mst_ep_transport mst_ep_transport_lsa = {
    "nccl device API (symmetric window, NVLink stores of the valid rows)", lsa_exchange, nccl_destroy,
    lsa_recv_alloc,
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

/* ep over comm (made from `id` when owned), path chosen, buffers set up. */
static mst_status finish(mst_ctx_t* ctx, const mst_ep_config* cfg, int rank, int world, ncclComm_t comm,
                         const mst_ep_id* id, mst_ep_t** out) {
    MST_TRY(mst_ep_check_config(cfg, world));
    mst_ep_t* ep;
    MST_TRY(mst_ep_alloc(&ep));
    nccl_state* ns = (nccl_state*)calloc(1, sizeof *ns);
    mst_status st = ns ? MST_OK : mst_set_error(MST_ERR_OOM, "nccl state");
    if (st == MST_OK) {
        ep->comm = ns;
        ep->tr = &mst_ep_transport_nccl; /* destroys ns on failure */
        ep->rank = rank, ep->world = world;
        ns->owned = id != NULL;
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
    if (st == MST_OK) st = pick_transport(ep, ns, (mst_ep_path_kind)cfg->path);
    if (st == MST_OK) st = mst_ep_init(ep, ctx, cfg, rank, world);
    if (st == MST_OK) st = make_dev_comm(ep, ns, (mst_ep_path_kind)cfg->path);
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
    return finish(ctx, cfg, rank, world, NULL, id, out);
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
    return finish(ctx, cfg, rank, world, comm, NULL, out);
}
