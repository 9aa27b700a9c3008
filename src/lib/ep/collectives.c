/*
 * collectives.c — the data-parallel collectives besides the all-reduce
 * (ep.h): reduce-scatter and all-gather over the communicator's ranks, in
 * place, argument checks before the transport's.
 */
#include "ep.h"

mst_status mst_ep_reduce_scatter(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (kind < MST_EP_SUM_F32 || kind > MST_EP_MAX_F64)
        return mst_set_error(MST_ERR_INVALID, "kind = %d: must be a mst_ep_reduce", (int)kind);
    if (count < 0) return mst_set_error(MST_ERR_INVALID, "count = %lld: must be >= 0", (long long)count);
    if (count == 0) return MST_OK;
    if (!data) return mst_set_error(MST_ERR_INVALID, "data is NULL (count %lld)", (long long)count);
    if (!ep->tr || !ep->tr->reduce_scatter)
        return mst_set_error(MST_ERR_UNSUPPORTED, "mst_ep_reduce_scatter: the %s transport has none", mst_ep_path(ep));
    return ep->tr->reduce_scatter(ep, data, count, kind);
}

mst_status mst_ep_allgather(mst_ep_t* ep, void* data, size_t block_bytes) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (block_bytes == 0) return MST_OK;
    if (!data) return mst_set_error(MST_ERR_INVALID, "data is NULL (block_bytes %zu)", block_bytes);
    if (!ep->tr || !ep->tr->allgather)
        return mst_set_error(MST_ERR_UNSUPPORTED, "mst_ep_allgather: the %s transport has none", mst_ep_path(ep));
    return ep->tr->allgather(ep, data, block_bytes);
}
