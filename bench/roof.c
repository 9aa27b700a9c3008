/*
 * roof.c — the dense-GEMM and copy roofs of the benchmarks (roof.h).
 */
#include "roof.h"

#include "lib/internal.h"

double mst_bench_roofline_ms(const mst_bench_roofs* r, double flops, double bytes) {
    const double compute_ms = flops / (r->dense_tflops * 1e9);
    const double memory_ms = bytes / (r->copy_gbps * 1e6);
    return compute_ms > memory_ms ? compute_ms : memory_ms;
}

#ifdef MST_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#define ROOF_CUDA(call)                                                                      \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess)                                                               \
            return mst_set_error(MST_ERR_BACKEND, "%s: %s", #call, cudaGetErrorString(e_));  \
    } while (0)

/* ms per call of `body` over `iters` calls after 3 warm-up calls, on s. */
#define ROOF_TIME(s, iters, ms_out, body)                                                    \
    do {                                                                                     \
        cudaEvent_t e0_, e1_;                                                                \
        ROOF_CUDA(cudaEventCreate(&e0_));                                                    \
        ROOF_CUDA(cudaEventCreate(&e1_));                                                    \
        for (int i_ = 0; i_ < (iters) + 3; i_++) {                                           \
            if (i_ == 3) ROOF_CUDA(cudaEventRecord(e0_, s));                                 \
            body;                                                                            \
        }                                                                                    \
        ROOF_CUDA(cudaEventRecord(e1_, s));                                                  \
        ROOF_CUDA(cudaEventSynchronize(e1_));                                                \
        float t_ = 0;                                                                        \
        ROOF_CUDA(cudaEventElapsedTime(&t_, e0_, e1_));                                      \
        cudaEventDestroy(e0_), cudaEventDestroy(e1_);                                        \
        *(ms_out) = t_ / (iters);                                                            \
    } while (0)

/* cuBLAS dense bf16 GEMM n^3 on uniform random inputs in (-1, 1). */
static mst_status dense_tflops(mst_ctx_t* ctx, cudaStream_t s, void* a, void* c, double* out) {
    const int n = 8192;
    const size_t count = (size_t)n * n;
    uint16_t* h = (uint16_t*)malloc(count * 2);
    if (!h) return mst_set_error(MST_ERR_OOM, "roof: host matrix of %zu bytes", count * 2);
    uint64_t q = 12345;
    for (size_t i = 0; i < count; i++) h[i] = mst_fp32_to_bf16((float)(2 * mst_splitmix_unit(&q) - 1));
    mst_status st = mst_copy_h2b(ctx, a, h, count * 2);
    free(h);
    MST_TRY(st);
    cublasHandle_t hb;
    if (cublasCreate(&hb) != CUBLAS_STATUS_SUCCESS) return mst_set_error(MST_ERR_BACKEND, "roof: cublasCreate");
    cublasSetStream(hb, s);
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t bs = CUBLAS_STATUS_SUCCESS;
    double ms = 0;
    ROOF_TIME(s, 20, &ms,
              bs = bs != CUBLAS_STATUS_SUCCESS ? bs
                                                : cublasGemmEx(hb, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n,
                                                               a, CUDA_R_16BF, n, &zero, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                                               CUBLAS_GEMM_DEFAULT));
    cublasDestroy(hb);
    if (bs != CUBLAS_STATUS_SUCCESS) return mst_set_error(MST_ERR_BACKEND, "roof: cublasGemmEx status %d", (int)bs);
    *out = 2.0 * n * (double)n * n / (ms * 1e-3) / 1e12;
    return MST_OK;
}

/* Device copy of n_bytes from a to c: GB/s of bytes read + written. */
static mst_status copy_gbps(cudaStream_t s, void* a, void* c, size_t n_bytes, double* out) {
    double ms = 0;
    ROOF_TIME(s, 20, &ms, ROOF_CUDA(cudaMemcpyAsync(c, a, n_bytes, cudaMemcpyDeviceToDevice, s)));
    *out = 2.0 * (double)n_bytes / (ms * 1e-3) / 1e9;
    return MST_OK;
}

mst_status mst_bench_roofs_measure(mst_ctx_t* ctx, void* stream, mst_bench_roofs* out) {
    const size_t n_bytes = (size_t)8192 * 8192 * 2; /* 128 MiB each, past the L2 */
    void *a = NULL, *c = NULL;
    MST_TRY(mst_alloc(ctx, n_bytes, &a));
    mst_status st = mst_alloc(ctx, n_bytes, &c);
    if (st == MST_OK) st = dense_tflops(ctx, (cudaStream_t)stream, a, c, &out->dense_tflops);
    if (st == MST_OK) st = copy_gbps((cudaStream_t)stream, a, c, n_bytes, &out->copy_gbps);
    mst_free(ctx, a);
    if (c) mst_free(ctx, c);
    return st;
}

#else

mst_status mst_bench_roofs_measure(mst_ctx_t* ctx, void* stream, mst_bench_roofs* out) {
    (void)ctx, (void)stream, (void)out;
    return mst_set_error(MST_ERR_UNSUPPORTED, "bench roofs: built without the CUDA backend");
}

#endif
