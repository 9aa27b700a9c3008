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
/* 1 when the Hopper kernel reads wgrad's x from such pages itself (no gather workspace). */
int mst_cuda_gl_wgrad_pages(mst_ctx_t* ctx, int64_t page_rows, int64_t in, int64_t out);

/* The grouped GEMM kernel of ctx's later ops: "mma", "wgmma_regs", or NULL
 * for the default (MST_GG_KERNEL's values; the variable is read once, when
 * the context is created). Benchmarks compare the kernels this way. */
mst_status mst_cuda_gg_kernel(mst_ctx_t* ctx, const char* kernel);

/* grouped MLP activation (activation.cu) */
mst_status mst_cuda_act_forward(mst_ctx_t* ctx, const mst_act_args* a);
mst_status mst_cuda_act_backward(mst_ctx_t* ctx, const mst_act_args* a);

/* paged stash (stash.cu); host blocks are pinned, mapped host memory */
mst_status mst_cuda_stash_reset(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cuda_stash_save(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cuda_stash_restore(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cuda_stash_batch(mst_ctx_t* ctx, const mst_stash_batch* b);
/* a save (restore 0) or the copy of a restore (restore 1: part ALL or COPY)
 * of fp8 pages, one launch (stash_fp8.cu) */
mst_status mst_cuda_stash_fp8(mst_ctx_t* ctx, const mst_stash_args* a, int restore);
mst_status mst_cuda_host_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out);
void mst_cuda_host_free(mst_ctx_t* ctx, void* ptr);

/* tests: a kernel on `stream` (NULL: the context's) that spins `cycles` clock cycles (spin.cu) */
mst_status mst_cuda_stream_spin(mst_ctx_t* ctx, void* stream, int64_t cycles);

#ifdef __cplusplus
}
#endif
#endif
