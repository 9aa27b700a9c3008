/*
 * model_ops.h (CPU) — the CPU backend's model ops, one declaration per
 * slot of the model-op table (model_backend.h).
 */
#ifndef MST_CPU_MODEL_OPS_H
#define MST_CPU_MODEL_OPS_H

#include "trainer/model_ops/model_backend.h"

/* model_ops.c */
mst_status mst_cpu_mm(mst_ctx_t* ctx, const mst_mm_args* a);
mst_status mst_cpu_norm_forward(mst_ctx_t* ctx, const mst_norm_args* a);
mst_status mst_cpu_norm_backward(mst_ctx_t* ctx, const mst_norm_args* a);
mst_status mst_cpu_add(mst_ctx_t* ctx, const mst_add_args* a);
mst_status mst_cpu_embed_forward(mst_ctx_t* ctx, const mst_embed_args* a);
mst_status mst_cpu_embed_backward(mst_ctx_t* ctx, const mst_embed_args* a);
mst_status mst_cpu_xent(mst_ctx_t* ctx, const mst_xent_args* a);
mst_status mst_cpu_sumsq(mst_ctx_t* ctx, const mst_sumsq_args* a);
mst_status mst_cpu_adamw(mst_ctx_t* ctx, const mst_adamw_args* a);
mst_status mst_cpu_sum(mst_ctx_t* ctx, const mst_sum_args* a);
/* model_ops_attn.c */
mst_status mst_cpu_attn_forward(mst_ctx_t* ctx, const mst_attn_args* a);
mst_status mst_cpu_attn_backward(mst_ctx_t* ctx, const mst_attn_args* a);
mst_status mst_cpu_attn_flash_forward(mst_ctx_t* ctx, const mst_attn_args* a);
mst_status mst_cpu_attn_flash_backward(mst_ctx_t* ctx, const mst_attn_args* a);
/* model_ops_qk.c */
mst_status mst_cpu_qk_forward(mst_ctx_t* ctx, const mst_qk_args* a);
mst_status mst_cpu_qk_backward(mst_ctx_t* ctx, const mst_qk_args* a);
/* model_ops_route.c */
mst_status mst_cpu_route_forward(mst_ctx_t* ctx, const mst_route_args* a);
mst_status mst_cpu_route_backward(mst_ctx_t* ctx, const mst_route_args* a);
mst_status mst_cpu_route_peak(mst_ctx_t* ctx, const mst_route_args* a);
mst_status mst_cpu_rows_gather(mst_ctx_t* ctx, const mst_rows_args* a);
mst_status mst_cpu_rows_sum(mst_ctx_t* ctx, const mst_rows_args* a);

#endif
