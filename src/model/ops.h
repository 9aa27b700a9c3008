/*
 * ops.h — thin calls from the model into the backend's model ops (backend.h,
 * "model ops" block): each builds the argument struct and fails with
 * MST_ERR_UNSUPPORTED naming the slot when a backend lacks it.
 */
#ifndef MST_MODEL_OPS_H
#define MST_MODEL_OPS_H

#include "../core/context.h"

mst_status mst_op_missing(mst_ctx_t* ctx, const char* slot);
#define MST_MODEL_OP(ctx, slot, args) \
    ((ctx)->be->slot ? (ctx)->be->slot((ctx), (args)) : mst_op_missing((ctx), #slot))

/* y [N, O] = x [N, I] W [O, I]^T (bf16 out). */
mst_status mst_op_linear(mst_ctx_t* ctx, int64_t n, int64_t in, int64_t out, const uint16_t* x,
                         const uint16_t* w, uint16_t* y);
/* dx [N, I] = dy [N, O] W [O, I], W with row stride ldw. */
mst_status mst_op_linear_dgrad(mst_ctx_t* ctx, int64_t n, int64_t in, int64_t out,
                               const uint16_t* dy, const uint16_t* w, int64_t ldw, uint16_t* dx);
/* gW [O, I] (row stride ldg) += dy [N, O]^T x [N, I]. */
mst_status mst_op_linear_wgrad(mst_ctx_t* ctx, int64_t n, int64_t in, int64_t out,
                               const uint16_t* dy, const uint16_t* x, float* gw, int64_t ldg);
mst_status mst_op_norm(mst_ctx_t* ctx, int64_t n, int64_t h, float eps, const uint16_t* x,
                       const uint16_t* w, uint16_t* y, float* rstd);
mst_status mst_op_norm_bwd(mst_ctx_t* ctx, int64_t n, int64_t h, const uint16_t* x,
                           const uint16_t* w, const float* rstd, const uint16_t* dy, uint16_t* dx,
                           float* dw);
mst_status mst_op_add(mst_ctx_t* ctx, int64_t n, const uint16_t* a, const uint16_t* b, uint16_t* y);

#endif
