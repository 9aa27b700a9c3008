/*
 * transport_nccl.c — the exchange over NCCL point-to-point: one group of
 * ncclSend/ncclRecv per exchange, every block of every plane at its full,
 * fixed size (C rows per rank pair), so the sizes the host passes never
 * depend on the routing and the exchange captures in a CUDA graph. Enqueued
 * on the context's stream. Built only with NCCL (MST_HAVE_NCCL).
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <string.h>

#include "ep.h"

typedef struct nccl_state {
    ncclComm_t comm;
    int owned;  /* 1: made by mst_ep_create, destroyed with the communicator */
    int failed; /* an NCCL call failed: abort instead of destroy             */
} nccl_state;

_Static_assert(sizeof(ncclUniqueId) == sizeof(((mst_ep_id*)0)->bytes), "mst_ep_id holds an ncclUniqueId");

static mst_status nccl_error(ncclResult_t r, const char* what, ncclComm_t comm) {
    return mst_set_error(MST_ERR_BACKEND, "%s failed: %s (%s)", what, ncclGetErrorString(r),
                         comm ? ncclGetLastError(comm) : ncclGetLastError(NULL));
}

static mst_status nccl_exchange(mst_ep_t* ep, const mst_ep_plane* pl, int n) {
    nccl_state* ns = (nccl_state*)ep->comm;
    cudaStream_t s = (cudaStream_t)mst_ctx_stream(ep->ctx);
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return nccl_error(r, "ncclGroupStart", ns->comm);
    ncclResult_t first = ncclSuccess;
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

static void nccl_destroy(mst_ep_t* ep) {
    nccl_state* ns = (nccl_state*)ep->comm;
    if (!ns) return;
    if (ns->owned && ns->comm) {
        if (ns->failed) ncclCommAbort(ns->comm);
        else ncclCommDestroy(ns->comm);
    }
    free(ns);
    ep->comm = NULL;
}

const mst_ep_transport mst_ep_transport_nccl = {
    .name = "nccl send/recv, fixed-capacity blocks",
    .exchange = nccl_exchange,
    .destroy = nccl_destroy,
};

mst_status mst_ep_id_create(mst_ep_id* out) {
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    ncclResult_t r = ncclGetUniqueId((ncclUniqueId*)out->bytes);
    return r == ncclSuccess ? MST_OK : nccl_error(r, "ncclGetUniqueId", NULL);
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

/* ep set up for (rank, world), then its NCCL state: the comm made by make()
 * or the caller's. */
static mst_status finish(mst_ctx_t* ctx, const mst_ep_config* cfg, int rank, int world, ncclComm_t comm,
                         int owned, const mst_ep_id* id, mst_ep_t** out) {
    mst_ep_t* ep;
    MST_TRY(mst_ep_alloc(&ep));
    nccl_state* ns = (nccl_state*)calloc(1, sizeof *ns);
    mst_status st = ns ? mst_ep_init(ep, ctx, cfg, rank, world) : mst_set_error(MST_ERR_OOM, "nccl state");
    if (st == MST_OK) {
        ep->comm = ns;
        ep->tr = &mst_ep_transport_nccl;
        ns->owned = owned;
        ns->comm = comm;
    } else {
        free(ns);
    }
    if (st == MST_OK && owned) {
        ncclUniqueId uid;
        memcpy(&uid, id->bytes, sizeof uid);
        if (cudaSetDevice(ctx->device) != cudaSuccess)
            st = mst_set_error(MST_ERR_BACKEND, "cudaSetDevice(%d) failed", ctx->device);
        ncclResult_t r = st == MST_OK ? ncclCommInitRank(&ns->comm, world, uid, rank) : ncclSuccess;
        if (r != ncclSuccess) st = nccl_error(r, "ncclCommInitRank", NULL);
    }
    if (st != MST_OK) {
        mst_ep_destroy(ep);
        return st;
    }
    *out = ep;
    return MST_OK;
}

mst_status mst_ep_create(mst_ctx_t* ctx, const mst_ep_config* cfg, const mst_ep_id* id, int rank,
                         int world, mst_ep_t** out) {
    MST_TRY(check_cuda_ctx(ctx, out));
    if (!id) return mst_set_error(MST_ERR_INVALID, "id is NULL");
    if (world < 1) return mst_set_error(MST_ERR_INVALID, "world = %d: must be >= 1", world);
    if (rank < 0 || rank >= world)
        return mst_set_error(MST_ERR_INVALID, "rank = %d: must be in [0, %d)", rank, world);
    return finish(ctx, cfg, rank, world, NULL, 1, id, out);
}

mst_status mst_ep_create_nccl(mst_ctx_t* ctx, const mst_ep_config* cfg, void* nccl_comm, mst_ep_t** out) {
    MST_TRY(check_cuda_ctx(ctx, out));
    if (!nccl_comm) return mst_set_error(MST_ERR_INVALID, "nccl_comm is NULL");
    ncclComm_t comm = (ncclComm_t)nccl_comm;
    int world = 0, rank = 0, dev = -1;
    ncclResult_t r = ncclCommCount(comm, &world);
    if (r == ncclSuccess) r = ncclCommUserRank(comm, &rank);
    if (r == ncclSuccess) r = ncclCommCuDevice(comm, &dev);
    if (r != ncclSuccess) return nccl_error(r, "reading nccl_comm (ncclCommCount/UserRank/CuDevice)", comm);
    if (dev != ctx->device)
        return mst_set_error(MST_ERR_INVALID, "nccl_comm is on device %d, the context on device %d", dev,
                             ctx->device);
    return finish(ctx, cfg, rank, world, comm, 0, NULL, out);
}
