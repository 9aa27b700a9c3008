/*
 * cpu_ops.h — the CPU backend's ops, one declaration per backend slot.
 */
#ifndef MST_CPU_OPS_H
#define MST_CPU_OPS_H

#include "../backend.h"

mst_status mst_cpu_gl_forward(mst_ctx_t* ctx, const mst_gl_args* a);
mst_status mst_cpu_gl_dgrad(mst_ctx_t* ctx, const mst_gl_args* a);
mst_status mst_cpu_gl_wgrad(mst_ctx_t* ctx, const mst_gl_args* a);
int mst_cpu_gl_wgrad_pages(mst_ctx_t* ctx, int64_t page_rows, int64_t in, int64_t out);

/* grouped MLP activation (activation.c) */
mst_status mst_cpu_act_forward(mst_ctx_t* ctx, const mst_act_args* a);
mst_status mst_cpu_act_backward(mst_ctx_t* ctx, const mst_act_args* a);

/* paged stash (stash.c): reserve + copy, copy + page return, ring refill;
 * host blocks in ordinary host memory */
mst_status mst_cpu_stash_reset(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cpu_stash_save(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cpu_stash_restore(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cpu_host_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out);
void mst_cpu_host_free(mst_ctx_t* ctx, void* ptr);

/* Sets the context's error flag and returns MST_ERR_COUNTS when counts are
 * bad; fills off [E+1] otherwise. */
mst_status mst_cpu_offsets(mst_ctx_t* ctx, const mst_gl_args* a, int64_t* off);

#endif
