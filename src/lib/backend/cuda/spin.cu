/*
 * spin.cu — a one-thread kernel that busy-waits a number of clock cycles on
 * a given stream: the tests slow one stream of the memory manager down with
 * it, so that a missing event edge shows up as a wrong result. Capturable.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

namespace {

__global__ void spin_kernel(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

}  // namespace

extern "C" mst_status mst_cuda_stream_spin(mst_ctx_t* ctx, void* stream, int64_t cycles) {
    cudaStream_t s = stream ? (cudaStream_t)stream : mst_cuda(ctx)->stream;
    spin_kernel<<<1, 1, 0, s>>>((long long)cycles);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}
