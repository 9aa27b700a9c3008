/*
 * sgemm.c (CPU) — every fp32 GEMM of the CPU backend, and its one threading
 * layer. OpenMP splits C into blocks of MST_CPU_GEMM_ROWS rows, a partition
 * fixed by the shape alone, and each block is one single-threaded BLAS call
 * (the context turns BLAS's own threads off: mst_cpu_blas_single_thread).
 * Every element of C is summed by the same call in the same order whatever
 * the number of threads, so results are bit-identical for any
 * OMP_NUM_THREADS, and BLAS threads never compete with OpenMP's for cores.
 */
#include <cblas.h>
#undef I /* complex.h, pulled in by cblas.h */

#include "cpu_ops.h"

#define MST_CPU_GEMM_ROWS 32

void mst_cpu_blas_single_thread(void) {
#ifdef MST_OPENBLAS
    openblas_set_num_threads(1);
#endif
}

void mst_cpu_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
                   const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    const int64_t blocks = (m + MST_CPU_GEMM_ROWS - 1) / MST_CPU_GEMM_ROWS;
#pragma omp parallel for schedule(static) if (blocks > 1 && m * n * k >= (1 << 22))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r0 = b * MST_CPU_GEMM_ROWS, rows = m - r0 < MST_CPU_GEMM_ROWS ? m - r0 : MST_CPU_GEMM_ROWS;
        cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                    (int)rows, (int)n, (int)k, 1.0f, A + (trans_a ? r0 : r0 * lda), (int)lda, B, (int)ldb, beta,
                    C + r0 * ldc, (int)ldc);
    }
}
