/*
 * stash_host.cu — the host block of a stash pool on the CUDA backend:
 * pinned, mapped host memory that the copy kernels of stash.cu read and
 * write over PCIe at the same address as the host's.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

extern "C" mst_status mst_cuda_host_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out) {
    (void)ctx;
    *out = NULL;
    cudaError_t e = cudaHostAlloc(out, n_bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *out = NULL;
        return mst_set_error(MST_ERR_OOM, "cudaHostAlloc of %zu bytes (host block) failed: %s", n_bytes,
                             cudaGetErrorString(e));
    }
    void* dev = NULL;
    e = cudaHostGetDevicePointer(&dev, *out, 0);
    if (e == cudaSuccess && dev == *out) return MST_OK;
    cudaGetLastError();
    cudaFreeHost(*out);
    *out = NULL;
    return mst_set_error(MST_ERR_UNSUPPORTED,
                         "host block: mapped pinned memory has no device address equal to its host "
                         "address (%s)", cudaGetErrorString(e));
}

extern "C" void mst_cuda_host_free(mst_ctx_t* ctx, void* ptr) {
    (void)ctx;
    cudaFreeHost(ptr);
}
