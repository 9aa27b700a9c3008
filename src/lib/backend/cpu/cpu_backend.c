/*
 * cpu_backend.c — the reference backend's memory functions and its function
 * table. Backend memory is host memory; ops run synchronously, so sync is a
 * no-op and counts are read straight from memory when an op executes.
 */
#define _DEFAULT_SOURCE /* sysconf(_SC_PHYS_PAGES) */
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "../../core/context.h"
#include "cpu_ops.h"

static mst_status cpu_init(mst_ctx_t* ctx, int device) {
    (void)device;
    ctx->impl = ctx; /* no state of its own */
    mst_cpu_blas_single_thread();
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    snprintf(ctx->desc, sizeof ctx->desc, "cpu (reference backend, %d OpenMP threads, single-threaded sgemm per block)",
             threads);
    return MST_OK;
}

static void cpu_shutdown(mst_ctx_t* ctx) { ctx->impl = NULL; }

static mst_status cpu_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out) {
    (void)ctx;
    size_t rounded = (n_bytes + 63) & ~(size_t)63;
    *out = aligned_alloc(64, rounded);
    if (!*out) return mst_set_error(MST_ERR_OOM, "cpu allocation of %zu bytes failed", n_bytes);
    return MST_OK;
}

static void cpu_free(mst_ctx_t* ctx, void* ptr) {
    (void)ctx;
    free(ptr);
}

static mst_status cpu_copy(mst_ctx_t* ctx, void* dst, const void* src, size_t n_bytes,
                           mst_copy_dir dir) {
    (void)ctx;
    (void)dir;
    memmove(dst, src, n_bytes);
    return MST_OK;
}

static mst_status cpu_fill(mst_ctx_t* ctx, void* dst, int byte, size_t n_bytes) {
    (void)ctx;
    memset(dst, byte, n_bytes);
    return MST_OK;
}

static mst_status cpu_sync(mst_ctx_t* ctx) {
    (void)ctx;
    return MST_OK;
}

static mst_status cpu_capacity(mst_ctx_t* ctx, size_t* total_bytes) {
    (void)ctx;
    const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || size <= 0) return mst_set_error(MST_ERR_BACKEND, "sysconf: physical memory unknown");
    *total_bytes = (size_t)pages * (size_t)size;
    return MST_OK;
}

const mst_backend mst_backend_cpu = {
    .name = "cpu",
    .init = cpu_init,
    .shutdown = cpu_shutdown,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy = cpu_copy,
    .fill = cpu_fill,
    .sync = cpu_sync,
    .capacity = cpu_capacity,
    .gl_forward = mst_cpu_gl_forward,
    .gl_dgrad = mst_cpu_gl_dgrad,
    .gl_wgrad = mst_cpu_gl_wgrad,
    .gl_wgrad_pages = mst_cpu_gl_wgrad_pages,
    /* grouped MLP activation */
    .act_forward = mst_cpu_act_forward,
    .act_backward = mst_cpu_act_backward,
    /* paged stash */
    .stash_reset = mst_cpu_stash_reset,
    .stash_save = mst_cpu_stash_save,
    .stash_restore = mst_cpu_stash_restore,
    .stash_batch = mst_cpu_stash_batch,
    .host_alloc = mst_cpu_host_alloc,
    .host_free = mst_cpu_host_free,
};
