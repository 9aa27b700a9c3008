/*
 * cuda_common.cuh — what every CUDA backend file shares: the backend state
 * behind ctx->impl, checked CUDA calls, and the device error flag.
 */
#ifndef MST_CUDA_COMMON_CUH
#define MST_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "../../core/context.h"

/* Which grouped GEMM kernel runs (MST_GG_KERNEL: "mma", "wgmma_regs"). */
typedef enum mst_gg_kernel { MST_GG_AUTO = 0, MST_GG_MMA, MST_GG_WGMMA_REGS } mst_gg_kernel;

/* A context's CUDA state: what the device is and what its kernels need,
 * read or set up once at context creation (never per op, never process-wide:
 * two contexts on two devices each have their own). */
typedef struct mst_cuda_impl {
    int device;               /* CUDA device index                              */
    int n_sm;                 /* multiprocessors, for persistent grids          */
    int cc_major;             /* compute capability (9: the Hopper kernels)     */
    mst_gg_kernel gg_kernel;  /* MST_GG_KERNEL at creation (mst_cuda_gg_kernel) */
    int mma_per_sm[3];        /* resident blocks per SM of the mma GEMM, by op  */
    int copy_per_sm[2][3];    /* of the stash's vector copy: [restore][16-, 4-,
                                 2-byte vectors]                                */
    int batch_per_sm;         /* of the stash's batch of 16-byte vector copies  */
    cudaStream_t stream;      /* where ops are enqueued (own_stream or caller's) */
    cudaStream_t own_stream;  /* created by the context                          */
    cudaStream_t side[MST_N_STREAMS]; /* side streams of the memory manager, by
                                         mst_stream_sel from MST_STREAM_RING   */
    cublasHandle_t blas;      /* bound to `stream`                              */
    mst_ws ws_sched;          /* the grouped GEMM's schedule (grouped_gemm.cu)  */
    mst_ws ws_gather;         /* a paged wgrad's x gathered (grouped_gemm.cu)   */
    mst_ws ws_attn;           /* the attention's GEMM pointer arrays            */
    mst_ws ws_qk;             /* QK-norm backward's dw partials (model_ops_qk.cu) */
    mst_ws ws_norm;           /* RMSNorm backward's dw partials (model_ops_norm.cu) */
    void* blas_ws;            /* cuBLAS's workspace (context memory)            */
    void* cudnn;              /* (optional) the trainer's cuDNN attention state,
                                 made on first use, freed by cudnn_free at
                                 shutdown (after the context's memory)      */
    void (*cudnn_free)(void* cudnn);
} mst_cuda_impl;

static inline mst_cuda_impl* mst_cuda(mst_ctx_t* ctx) { return (mst_cuda_impl*)ctx->impl; }

/* Set-up at context creation, on c's device (current): kernel attributes
 * and occupancies of the grouped GEMM (grouped_gemm.cu) and of the stash
 * (stash.cu). */
mst_status mst_cuda_gg_setup(mst_cuda_impl* c);
mst_status mst_cuda_stash_setup(mst_cuda_impl* c);

/* Checked CUDA runtime call: returns MST_ERR_BACKEND naming call, file, line. */
#define MST_CUDA_TRY(call)                                                                 \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess)                                                             \
            return mst_set_error(MST_ERR_BACKEND, "%s failed: %s at %s:%d", #call,         \
                                 cudaGetErrorString(e_), __FILE__, __LINE__);              \
    } while (0)

/* After a kernel launch: the launch error, if any. */
#define MST_CUDA_LAUNCHED() MST_CUDA_TRY(cudaGetLastError())

#define MST_CUBLAS_TRY(call)                                                               \
    do {                                                                                   \
        cublasStatus_t s_ = (call);                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                   \
            return mst_set_error(MST_ERR_BACKEND, "%s failed: cublas status %d at %s:%d",   \
                                 #call, (int)s_, __FILE__, __LINE__);                      \
    } while (0)

/* bf16 bits <-> fp32 (round to nearest even), on the device. */
__device__ __forceinline__ float mst_bf(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ __forceinline__ uint16_t mst_to_bf(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

/* Group of grouped row r < off[E]: the last g with off[g] <= r (so empty
 * groups are skipped); off [E+1] exclusive prefix of the counts. */
template <class T>
__device__ __forceinline__ int mst_group_of(const T* off, int n_groups, T r) {
    int lo = 0, hi = n_groups;
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (off[mid] <= r) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* Device side: raise bits of the context's error flag. */
__device__ __forceinline__ void mst_dev_flag(int32_t* flag, int32_t bits) { atomicOr(flag, bits); }

#endif
