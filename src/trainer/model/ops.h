/*
 * ops.h — the model's calls into its backend's model ops (model_backend.h),
 * reached through m->ops (the door, mst_model_backend_of, opened once by
 * mst_model_create): MST_MODEL_OP calls a slot or fails with
 * MST_ERR_UNSUPPORTED naming it; the mst_op_* build the argument struct of
 * the common calls.
 */
#ifndef MST_MODEL_OPS_H
#define MST_MODEL_OPS_H

#include "model.h"

#define MST_MODEL_OP(m, slot, args) MST_SLOT((m)->ctx, (m)->ops, slot, args)

/* y [N, O] = x [N, I] W [O, I]^T (bf16 out). */
mst_status mst_op_linear(const mst_model* m, int64_t n, int64_t in, int64_t out, const uint16_t* x,
                         const uint16_t* w, uint16_t* y);
/* dx [N, I] = dy [N, O] W [O, I], W with row stride ldw. */
mst_status mst_op_linear_dgrad(const mst_model* m, int64_t n, int64_t in, int64_t out,
                               const uint16_t* dy, const uint16_t* w, int64_t ldw, uint16_t* dx);
/* gW [O, I] (row stride ldg) += dy [N, O]^T x [N, I]. */
mst_status mst_op_linear_wgrad(const mst_model* m, int64_t n, int64_t in, int64_t out,
                               const uint16_t* dy, const uint16_t* x, float* gw, int64_t ldg);
mst_status mst_op_norm(const mst_model* m, int64_t n, int64_t h, float eps, const uint16_t* x,
                       const uint16_t* w, uint16_t* y, float* rstd);
mst_status mst_op_norm_bwd(const mst_model* m, int64_t n, int64_t h, const uint16_t* x,
                           const uint16_t* w, const float* rstd, const uint16_t* dy, uint16_t* dx,
                           float* dw);
mst_status mst_op_add(const mst_model* m, int64_t n, const uint16_t* a, const uint16_t* b, uint16_t* y);

#endif
