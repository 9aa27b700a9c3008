/*
 * cuda_ops.h — the CUDA backend's ops, one declaration per backend slot.
 */
#ifndef MST_CUDA_OPS_H
#define MST_CUDA_OPS_H

#include "../backend.h"

#ifdef __cplusplus
extern "C" {
#endif

mst_status mst_cuda_gl_forward(mst_ctx_t* ctx, const mst_gl_args* a);
mst_status mst_cuda_gl_dgrad(mst_ctx_t* ctx, const mst_gl_args* a);
mst_status mst_cuda_gl_wgrad(mst_ctx_t* ctx, const mst_gl_args* a);
/* fc1 forward + activation in one Hopper GEMM (grouped_gemm.cu) */
mst_status mst_cuda_fc1_act_forward(mst_ctx_t* ctx, const mst_gl_args* fc1, const mst_act_args* act, int* done);

/* grouped MLP activation (activation.cu) */
mst_status mst_cuda_act_forward(mst_ctx_t* ctx, const mst_act_args* a);
mst_status mst_cuda_act_backward(mst_ctx_t* ctx, const mst_act_args* a);

#ifdef __cplusplus
}
#endif
#endif
