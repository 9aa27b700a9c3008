/*
 * p2p.c — point-to-point transfers between the ranks of a communicator (a
 * pipeline's activations forward, their gradients backward): the argument
 * checks before the transport's sendrecv (one NCCL group of ncclSend and
 * ncclRecv; the CPU twin's rendezvous in transport_local.c).
 */
#include "ep.h"

mst_status mst_ep_p2p(mst_ep_t* ep, const mst_ep_p2p_op* ops, int n) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (n < 0 || (n > 0 && !ops)) return mst_set_error(MST_ERR_INVALID, "ops: %d transfers at %p", n, (const void*)ops);
    for (int i = 0; i < n; i++) {
        const mst_ep_p2p_op* o = &ops[i];
        if (o->peer < 0 || o->peer >= ep->world || o->peer == ep->rank)
            return mst_set_error(MST_ERR_INVALID, "ops[%d].peer = %d: must be another rank of [0, %d) (this is %d)", i,
                                 o->peer, ep->world, ep->rank);
        if (o->recv != 0 && o->recv != 1)
            return mst_set_error(MST_ERR_INVALID, "ops[%d].recv = %d: must be 0 (send) or 1 (receive)", i, o->recv);
        if (o->bytes > 0 && !o->data)
            return mst_set_error(MST_ERR_INVALID, "ops[%d].data is NULL (%zu bytes)", i, o->bytes);
    }
    if (n == 0) return MST_OK;
    if (!ep->tr || !ep->tr->sendrecv)
        return mst_set_error(MST_ERR_UNSUPPORTED, "mst_ep_p2p: the %s transport has no point-to-point transfers",
                             mst_ep_path(ep));
    return ep->tr->sendrecv(ep, ops, n);
}
