/*
 * sum_order.h — the one order in which the float sums of the data-parallel
 * collectives (mst_ep_allreduce, mst_ep_reduce_scatter: ep.h) add the
 * ranks' values, element by element: rank 0's value alone, then + rank 1's,
 * ..., + rank W-1's, each add rounded in the element type (fp32 for
 * MST_EP_SUM_F32, fp64 for MST_EP_SUM_F64; no fused or reassociated adds).
 * The CPU twin (transport_local.c) and the NCCL transport's sum kernel
 * (transport_nccl_sum.cu) both fold with these, ranks j = 0, 1, ..., W-1:
 * a sum's bits depend on the inputs and W alone, never on the transport,
 * its channels or chunks, or the buckets it is cut into.
 */
#ifndef MST_EP_SUM_ORDER_H
#define MST_EP_SUM_ORDER_H

#include "../backend/host_device.h"

/* The running sum after rank j's value x (acc: the sum of ranks 0..j-1). */
MST_HD float mst_ep_sum_f32(float acc, float x, int j) { return j == 0 ? x : acc + x; }
MST_HD double mst_ep_sum_f64(double acc, double x, int j) { return j == 0 ? x : acc + x; }

#endif /* MST_EP_SUM_ORDER_H */
