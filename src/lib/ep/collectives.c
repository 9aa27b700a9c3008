/*
 * collectives.c — the data-parallel collectives (ep.h): all-reduce,
 * reduce-scatter (of all of the blocks or a window of them) and all-gather
 * over the communicator's ranks, in place, argument checks before the
 * transport's.
 */
#include "ep.h"

size_t mst_ep_reduce_size(mst_ep_reduce k) {
    return k == MST_EP_SUM_F64 || k == MST_EP_MAX_F64 ? sizeof(double) : 4;
}

/* The arguments of a reduction (ep, kind, count, then data: count 0 takes
 * any data), checked in that order. */
static mst_status reduce_args(const mst_ep_t* ep, const void* data, int64_t count, mst_ep_reduce kind) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (kind < MST_EP_SUM_F32 || kind > MST_EP_MAX_F64)
        return mst_set_error(MST_ERR_INVALID, "kind = %d: must be a mst_ep_reduce", (int)kind);
    if (count < 0) return mst_set_error(MST_ERR_INVALID, "count = %lld: must be >= 0", (long long)count);
    if (count > 0 && !data) return mst_set_error(MST_ERR_INVALID, "data is NULL (count %lld)", (long long)count);
    return MST_OK;
}

mst_status mst_ep_allreduce(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind) {
    mst_status st = reduce_args(ep, data, count, kind);
    if (st != MST_OK || count == 0) return st;
    if (!ep->tr || !ep->tr->allreduce)
        return mst_set_error(MST_ERR_UNSUPPORTED, "mst_ep_allreduce: the %s transport has none", mst_ep_path(ep));
    return ep->tr->allreduce(ep, data, count, kind);
}

mst_status mst_ep_reduce_scatter_window(mst_ep_t* ep, void* data, int64_t q, int64_t lo, int64_t hi,
                                        mst_ep_reduce kind) {
    mst_status st = reduce_args(ep, data, q, kind);
    if (st != MST_OK || q == 0) return st;
    const int64_t n = (int64_t)ep->world * q;
    if (lo < 0 || lo > hi || hi > n)
        return mst_set_error(MST_ERR_INVALID, "window [%lld, %lld): must lie in [0, %lld] (W %d x q %lld), lo <= hi",
                             (long long)lo, (long long)hi, (long long)n, ep->world, (long long)q);
    if ((lo > 0 || hi < n) && kind != MST_EP_SUM_F32 && kind != MST_EP_SUM_F64)
        return mst_set_error(MST_ERR_UNSUPPORTED, "mst_ep_reduce_scatter_window: kind %d over a part [%lld, %lld) of "
                             "[0, %lld): float sums only", (int)kind, (long long)lo, (long long)hi, (long long)n);
    if (!ep->tr || !ep->tr->reduce_scatter)
        return mst_set_error(MST_ERR_UNSUPPORTED, "mst_ep_reduce_scatter: the %s transport has none", mst_ep_path(ep));
    return ep->tr->reduce_scatter(ep, data, q, lo, hi, kind);
}

mst_status mst_ep_reduce_scatter(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    return mst_ep_reduce_scatter_window(ep, data, count, 0, (int64_t)ep->world * count, kind);
}

mst_status mst_ep_allgather(mst_ep_t* ep, void* data, size_t block_bytes) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (block_bytes == 0) return MST_OK;
    if (!data) return mst_set_error(MST_ERR_INVALID, "data is NULL (block_bytes %zu)", block_bytes);
    if (!ep->tr || !ep->tr->allgather)
        return mst_set_error(MST_ERR_UNSUPPORTED, "mst_ep_allgather: the %s transport has none", mst_ep_path(ep));
    return ep->tr->allgather(ep, data, block_bytes);
}
