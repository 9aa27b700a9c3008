/*
 * cuda_backend.cu — the CUDA backend's context state, memory functions and
 * function table. Ops enqueue on the context's stream without host syncs;
 * only copies to or from host memory wait.
 */
#include <stdio.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

/* CUDA devices present; 0 when the runtime cannot tell, with *why (when
 * given) its error text (no driver, driver too old, no device). */
static int device_count(const char** why) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no device" error */
        if (why) *why = cudaGetErrorString(e);
        return 0;
    }
    return n;
}

extern "C" int mst_cuda_device_count(void) { return device_count(NULL); }

/* cuBLAS's workspace: 32 MiB, what NVIDIA advises for Hopper. */
enum { BLAS_WORKSPACE = 32 << 20 };

/* cuBLAS on the context's stream with our workspace (cublasSetStream
 * drops a workspace set before it, so both go together). */
static mst_status bind_blas(mst_cuda_impl* c) {
    MST_CUBLAS_TRY(cublasSetStream(c->blas, c->stream));
    MST_CUBLAS_TRY(cublasSetWorkspace(c->blas, c->blas_ws, BLAS_WORKSPACE));
    return MST_OK;
}

static mst_status cuda_init(mst_ctx_t* ctx, int device) {
    const char* why = NULL;
    int n = device_count(&why);
    if (device < 0 || device >= n)
        return mst_set_error(MST_ERR_INVALID, "device = %d, but %d CUDA devices are present%s%s",
                             device, n, why ? ": cudaGetDeviceCount: " : "", why ? why : "");
    mst_cuda_impl* c = (mst_cuda_impl*)calloc(1, sizeof *c);
    if (!c) return mst_set_error(MST_ERR_OOM, "cuda context state");
    ctx->impl = c;
    c->device = device;
    MST_CUDA_TRY(cudaSetDevice(device));
    cudaDeviceProp p;
    MST_CUDA_TRY(cudaGetDeviceProperties(&p, device));
    c->n_sm = p.multiProcessorCount;
    c->cc_major = p.major;
    MST_TRY(mst_cuda_gg_setup(c));
    MST_TRY(mst_cuda_stash_setup(c));
    MST_CUDA_TRY(cudaStreamCreateWithFlags(&c->own_stream, cudaStreamNonBlocking));
    for (int i = MST_STREAM_RING; i < MST_N_STREAMS; i++) MST_CUDA_TRY(cudaStreamCreateWithFlags(&c->side[i], cudaStreamNonBlocking));
    c->stream = c->own_stream;
    MST_CUBLAS_TRY(cublasCreate(&c->blas));
    /* cuBLAS's workspace up front (accounted as context memory): it never
     * allocates inside a step, so the step can be captured */
    MST_TRY(mst_alloc(ctx, BLAS_WORKSPACE, &c->blas_ws));
    MST_TRY(bind_blas(c));
    snprintf(ctx->desc, sizeof ctx->desc, "cuda:%d %.120s (sm_%d%d, %d SMs, %.1f GiB)", device, p.name,
             p.major, p.minor, p.multiProcessorCount, (double)p.totalGlobalMem / (1 << 30));
    return MST_OK;
}

static void cuda_shutdown(mst_ctx_t* ctx) {
    mst_cuda_impl* c = mst_cuda(ctx);
    if (c->cudnn_free) c->cudnn_free(c->cudnn);
    if (c->blas) cublasDestroy(c->blas);
    for (int i = MST_STREAM_RING; i < MST_N_STREAMS; i++)
        if (c->side[i]) cudaStreamDestroy(c->side[i]);
    if (c->own_stream) cudaStreamDestroy(c->own_stream);
    free(c);
    ctx->impl = NULL;
}

static mst_status cuda_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out) {
    (void)ctx;
    cudaError_t e = cudaMalloc(out, n_bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *out = NULL;
        return mst_set_error(MST_ERR_OOM, "cudaMalloc of %zu bytes failed: %s", n_bytes,
                             cudaGetErrorString(e));
    }
    return MST_OK;
}

static void cuda_free(mst_ctx_t* ctx, void* ptr) {
    (void)ctx;
    cudaFree(ptr);
}

/* Enqueues a copy on the context's stream, not waited for (host memory:
 * pinned, from host_alloc). */
static mst_status cuda_copy_async(mst_ctx_t* ctx, void* dst, const void* src, size_t n_bytes,
                                  mst_copy_dir dir) {
    cudaMemcpyKind kind = dir == MST_COPY_H2B   ? cudaMemcpyHostToDevice
                          : dir == MST_COPY_B2H ? cudaMemcpyDeviceToHost
                                                : cudaMemcpyDeviceToDevice;
    MST_CUDA_TRY(cudaMemcpyAsync(dst, src, n_bytes, kind, mst_cuda(ctx)->stream));
    return MST_OK;
}

/* The same, waited for when host memory is involved. */
static mst_status cuda_copy(mst_ctx_t* ctx, void* dst, const void* src, size_t n_bytes, mst_copy_dir dir) {
    MST_TRY(cuda_copy_async(ctx, dst, src, n_bytes, dir));
    if (dir != MST_COPY_B2B) MST_CUDA_TRY(cudaStreamSynchronize(mst_cuda(ctx)->stream));
    return MST_OK;
}

static mst_status cuda_fill(mst_ctx_t* ctx, void* dst, int byte, size_t n_bytes) {
    MST_CUDA_TRY(cudaMemsetAsync(dst, byte, n_bytes, mst_cuda(ctx)->stream));
    return MST_OK;
}

static mst_status cuda_capacity(mst_ctx_t* ctx, size_t* total_bytes) {
    (void)ctx;
    size_t free_bytes = 0;
    MST_CUDA_TRY(cudaMemGetInfo(&free_bytes, total_bytes));
    return MST_OK;
}

static mst_status cuda_sync(mst_ctx_t* ctx) {
    mst_cuda_impl* c = mst_cuda(ctx);
    for (int i = MST_STREAM_RING; i < MST_N_STREAMS; i++) MST_CUDA_TRY(cudaStreamSynchronize(c->side[i]));
    MST_CUDA_TRY(cudaStreamSynchronize(c->stream));
    return MST_OK;
}

/* Global capture mode: an allocation, a host sync or a blocking copy by
 * this thread while it captures is an error, never a silent slowdown. */
/* Thread-local mode: an allocation, a host sync or a blocking copy on this
 * thread inside the capture fails it, and other threads of the process
 * (ranks as threads, each capturing its own step) go on undisturbed. */
static mst_status cuda_capture_begin(mst_ctx_t* ctx) {
    MST_CUDA_TRY(cudaStreamBeginCapture(mst_cuda(ctx)->stream, cudaStreamCaptureModeThreadLocal));
    return MST_OK;
}

/* Ends the capture (also after a failed step, so the stream is usable);
 * *graph: the instantiated graph (a cudaGraphExec_t). */
static mst_status cuda_capture_end(mst_ctx_t* ctx, void** graph) {
    cudaGraph_t g = NULL;
    cudaGraphExec_t exec = NULL;
    *graph = NULL;
    cudaError_t e = cudaStreamEndCapture(mst_cuda(ctx)->stream, &g);
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, g, 0);
    if (g) cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return mst_set_error(MST_ERR_BACKEND, "capture of a step: %s", cudaGetErrorString(e));
    }
    *graph = (void*)exec;
    return MST_OK;
}

static mst_status cuda_graph_launch(mst_ctx_t* ctx, void* graph) {
    MST_CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)graph, mst_cuda(ctx)->stream));
    return MST_OK;
}

static void cuda_graph_destroy(mst_ctx_t* ctx, void* graph) {
    (void)ctx;
    if (graph) cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

static void* cuda_get_stream(mst_ctx_t* ctx) { return (void*)mst_cuda(ctx)->stream; }

static mst_status cuda_set_stream(mst_ctx_t* ctx, void* s) {
    mst_cuda_impl* c = mst_cuda(ctx);
    c->stream = s ? (cudaStream_t)s : c->own_stream;
    return bind_blas(c);
}

static void* cuda_side_stream(mst_ctx_t* ctx, mst_stream_sel sel) {
    mst_cuda_impl* c = mst_cuda(ctx);
    return (void*)(sel == MST_STREAM_MAIN ? c->stream : c->side[sel]);
}

static mst_status cuda_event_create(mst_ctx_t* ctx, void** ev) {
    (void)ctx;
    MST_CUDA_TRY(cudaEventCreateWithFlags((cudaEvent_t*)ev, cudaEventDisableTiming));
    return MST_OK;
}

static void cuda_event_destroy(mst_ctx_t* ctx, void* ev) {
    (void)ctx;
    cudaEventDestroy((cudaEvent_t)ev);
}

static mst_status cuda_event_record(mst_ctx_t* ctx, void* ev, void* stream) {
    cudaStream_t s = stream ? (cudaStream_t)stream : mst_cuda(ctx)->stream;
    MST_CUDA_TRY(cudaEventRecord((cudaEvent_t)ev, s));
    return MST_OK;
}

static mst_status cuda_stream_wait(mst_ctx_t* ctx, void* stream, void* ev) {
    cudaStream_t s = stream ? (cudaStream_t)stream : mst_cuda(ctx)->stream;
    MST_CUDA_TRY(cudaStreamWaitEvent(s, (cudaEvent_t)ev, 0));
    return MST_OK;
}

extern "C" const mst_backend mst_backend_cuda = {
    .name = "cuda",
    .init = cuda_init,
    .shutdown = cuda_shutdown,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .copy = cuda_copy,
    .fill = cuda_fill,
    .sync = cuda_sync,
    .capacity = cuda_capacity,
    .get_stream = cuda_get_stream,
    .set_stream = cuda_set_stream,
    .gl_forward = mst_cuda_gl_forward,
    .gl_dgrad = mst_cuda_gl_dgrad,
    .gl_wgrad = mst_cuda_gl_wgrad,
    .gl_wgrad_pages = mst_cuda_gl_wgrad_pages,
    /* grouped MLP activation */
    .act_forward = mst_cuda_act_forward,
    .act_backward = mst_cuda_act_backward,
    /* (C++ designated initializers must follow the order of backend.h:
     * add new slots above this block, in their declaration order) */
    .side_stream = cuda_side_stream,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .stream_wait = cuda_stream_wait,
    .stream_spin = mst_cuda_stream_spin,
    /* paged stash */
    .stash_reset = mst_cuda_stash_reset,
    .stash_save = mst_cuda_stash_save,
    .stash_restore = mst_cuda_stash_restore,
    .stash_batch = mst_cuda_stash_batch,
    .host_alloc = mst_cuda_host_alloc,
    .host_free = mst_cuda_host_free,
    .copy_async = cuda_copy_async,
    .capture_begin = cuda_capture_begin,
    .capture_end = cuda_capture_end,
    .graph_launch = cuda_graph_launch,
    .graph_destroy = cuda_graph_destroy,
};
