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

/* paged stash (stash.c): reserve + copy, copy + page return, ring refill,
 * a batch of those; host blocks in ordinary host memory */
mst_status mst_cpu_stash_reset(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cpu_stash_save(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cpu_stash_restore(mst_ctx_t* ctx, const mst_stash_args* a);
mst_status mst_cpu_stash_batch(mst_ctx_t* ctx, const mst_stash_batch* b);
mst_status mst_cpu_host_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out);
void mst_cpu_host_free(mst_ctx_t* ctx, void* ptr);

/* fp32 GEMMs (sgemm.c): C [m, n] (row stride ldc) = op(A) op(B) + beta C,
 * row-major; op(A) [m, k] is A [m, k] (row stride lda), or A^T of A [k, m]
 * when trans_a; op(B) [k, n] likewise. Bit-identical for any number of
 * OpenMP threads (a partition of C's rows fixed by the shape). */
void mst_cpu_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
                   const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
/* BLAS runs on the calling thread only (OpenMP is the one threading layer). */
void mst_cpu_blas_single_thread(void);

/* The offsets [E+1] of counts [E] in *off (malloc'd: the caller frees it),
 * or, for bad counts, MST_ERR_COUNTS with the context's flag raised. */
mst_status mst_cpu_offsets(mst_ctx_t* ctx, const int32_t* counts, int32_t n_groups, int64_t max_rows,
                           int64_t** off);

#endif
