/*
 * transport_nccl.h — the NCCL transport's state, shared by its files:
 * transport_nccl.cu (communicators, exchanges, NCCL's own collectives) and
 * transport_nccl_sum.cu (the float sums in a fixed order). CUDA sources
 * only (built with NCCL, MST_HAVE_NCCL).
 */
#ifndef MST_TRANSPORT_NCCL_H
#define MST_TRANSPORT_NCCL_H

#include <nccl.h>
#ifdef MST_HAVE_NCCL_DEVICE /* nccl_device.h beside nccl.h (NCCL >= 2.28) */
#include <nccl_device.h>
#endif

#include "ep.h"

/* lsa: CTAs of the exchange kernel (one LSA barrier each). 128: a CTA on
 * nearly every SM of an H100 (the old 32 CTAs left NVLink idle between
 * loads). */
enum { LSA_CTAS = 128, SUM_MAX_RETIRED = 48 };

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
    void* stage;        /* [W, c] the float sums' receive staging (transport_nccl_sum.cu),
                           grown outside captures, never shrunk                      */
    size_t stage_bytes; /* its size (0: none yet)                                    */
    void* retired[SUM_MAX_RETIRED]; /* stages it outgrew: a graph captured before may
                           still read them, so they live until destroy               */
    int n_retired;
} nccl_state;

static inline mst_status nccl_error(ncclResult_t r, const char* what, ncclComm_t comm) {
    return mst_set_error(MST_ERR_BACKEND, "%s failed: %s (%s)", what, ncclGetErrorString(r), ncclGetLastError(comm));
}

#define NCCL_TRY(call, comm)                                            \
    do {                                                                \
        ncclResult_t r_ = (call);                                       \
        if (r_ != ncclSuccess) return nccl_error(r_, #call, comm);      \
    } while (0)

/* ---- the float sums (transport_nccl_sum.cu): MST_EP_SUM_F32 / F64 by data
 * movement only (ncclSend / ncclRecv groups) and one kernel that adds the
 * ranks' values in sum_order.h's order; the contracts of mst_ep_allreduce
 * and mst_ep_reduce_scatter (ep.h), the CPU twin's bits. ---- */
mst_status mst_nccl_sum_allreduce(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind);
mst_status mst_nccl_sum_reduce_scatter(mst_ep_t* ep, void* data, int64_t q, int64_t lo, int64_t hi, mst_ep_reduce kind);
/* Frees the staging (destroy). */
void mst_nccl_sum_free(nccl_state* ns);

#endif /* MST_TRANSPORT_NCCL_H */
