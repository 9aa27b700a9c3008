/*
 * context.c — contexts, backend memory with accounting, copies, the device
 * error flag, and tensor views.
 */
#include <string.h>

#include "context.h"

const mst_backend* mst_backend_get(mst_backend_kind kind) {
    if (kind == MST_BACKEND_CPU) return &mst_backend_cpu;
#ifdef MST_HAVE_CUDA
    if (kind == MST_BACKEND_CUDA) return &mst_backend_cuda;
#endif
    return NULL;
}

int mst_backend_available(mst_backend_kind kind) {
    if (kind == MST_BACKEND_CPU) return 1;
#ifdef MST_HAVE_CUDA
    if (kind == MST_BACKEND_CUDA) return mst_cuda_device_count() > 0;
#endif
    return 0;
}

mst_status mst_ctx_create(mst_backend_kind kind, int device, mst_ctx_t** out) {
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (kind != MST_BACKEND_CPU && kind != MST_BACKEND_CUDA)
        return mst_set_error(MST_ERR_INVALID, "kind = %d is not a mst_backend_kind", (int)kind);
    const mst_backend* be = mst_backend_get(kind);
    if (!be) return mst_set_error(MST_ERR_UNSUPPORTED, "backend %d is not built in", (int)kind);
    mst_ctx_t* ctx = (mst_ctx_t*)calloc(1, sizeof *ctx);
    if (!ctx) return mst_set_error(MST_ERR_OOM, "context allocation failed");
    ctx->be = be;
    ctx->kind = kind;
    ctx->device = device;
    mst_status st = be->init(ctx, device);
    if (st != MST_OK) {
        if (ctx->impl) be->shutdown(ctx); /* what init made before it failed */
        free(ctx);
        return st;
    }
    st = mst_alloc(ctx, sizeof(int32_t), (void**)&ctx->err_flag);
    if (st == MST_OK) st = mst_fill(ctx, ctx->err_flag, 0, sizeof(int32_t));
    if (st != MST_OK) {
        mst_ctx_destroy(ctx);
        return st;
    }
    *out = ctx;
    return MST_OK;
}

void mst_ctx_destroy(mst_ctx_t* ctx) {
    if (!ctx) return;
    if (ctx->impl) ctx->be->sync(ctx);
    for (int i = 0; i < ctx->n_allocs; i++) ctx->be->free(ctx, ctx->allocs[i].ptr);
    if (ctx->impl) ctx->be->shutdown(ctx);
    free(ctx->allocs);
    if (ctx->ops) ctx->ops_free(ctx->ops);
    free(ctx);
}

mst_backend_kind mst_ctx_backend(const mst_ctx_t* ctx) { return ctx->kind; }
const char* mst_ctx_describe(const mst_ctx_t* ctx) { return ctx->desc; }

mst_status mst_ctx_sync(mst_ctx_t* ctx) {
    MST_TRY(mst_check_ctx(ctx));
    return ctx->be->sync(ctx);
}

mst_status mst_ctx_check(mst_ctx_t* ctx) {
    MST_TRY(mst_check_ctx(ctx));
    int32_t flag = 0;
    MST_TRY(mst_copy_b2h(ctx, &flag, ctx->err_flag, sizeof flag)); /* syncs */
    if (flag == 0) return MST_OK;
    MST_TRY(mst_fill(ctx, ctx->err_flag, 0, sizeof flag));
    if (flag & MST_FLAG_NONFINITE)
        return mst_set_error(MST_ERR_COUNTS, "a save into fp8 pages met inf or NaN: the block was not stored "
                             "(flag %d)", (int)flag);
    if (flag & MST_FLAG_COUNTS)
        return mst_set_error(MST_ERR_COUNTS,
                             "an op saw counts that are negative or sum past max_rows (flag %d)",
                             (int)flag);
    return mst_set_error(MST_ERR_OVERFLOW, "a stash pool ran out of pages (flag %d)", (int)flag);
}

void mst_ctx_mem(const mst_ctx_t* ctx, size_t* in_use_bytes, size_t* peak_bytes) {
    if (in_use_bytes) *in_use_bytes = ctx->in_use_bytes;
    if (peak_bytes) *peak_bytes = ctx->peak_bytes;
}

void mst_ctx_mem_reset_peak(mst_ctx_t* ctx) {
    if (ctx) ctx->peak_bytes = ctx->in_use_bytes;
}

mst_status mst_ctx_capacity(mst_ctx_t* ctx, size_t* total_bytes) {
    MST_TRY(mst_check_ctx(ctx));
    if (!total_bytes) return mst_set_error(MST_ERR_INVALID, "total_bytes is NULL");
    return ctx->be->capacity(ctx, total_bytes);
}

void* mst_ctx_stream(mst_ctx_t* ctx) {
    return ctx && ctx->be->get_stream ? ctx->be->get_stream(ctx) : NULL;
}

mst_status mst_ctx_set_stream(mst_ctx_t* ctx, void* stream) {
    MST_TRY(mst_check_ctx(ctx));
    if (!ctx->be->set_stream)
        return mst_set_error(MST_ERR_UNSUPPORTED, "backend %s has no streams", ctx->be->name);
    return ctx->be->set_stream(ctx, stream);
}

mst_status mst_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out) {
    MST_TRY(mst_check_ctx(ctx));
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (n_bytes == 0) return mst_set_error(MST_ERR_INVALID, "n_bytes = 0");
    if (ctx->n_allocs == ctx->cap_allocs) {
        int cap = ctx->cap_allocs ? 2 * ctx->cap_allocs : 64;
        mst_alloc_rec* a = (mst_alloc_rec*)realloc(ctx->allocs, (size_t)cap * sizeof *a);
        if (!a) return mst_set_error(MST_ERR_OOM, "allocation table growth failed");
        ctx->allocs = a;
        ctx->cap_allocs = cap;
    }
    MST_TRY(ctx->be->alloc(ctx, n_bytes, out));
    ctx->allocs[ctx->n_allocs++] = (mst_alloc_rec){*out, n_bytes};
    ctx->in_use_bytes += n_bytes;
    if (ctx->in_use_bytes > ctx->peak_bytes) ctx->peak_bytes = ctx->in_use_bytes;
    return MST_OK;
}

void mst_free(mst_ctx_t* ctx, void* ptr) {
    if (!ctx || !ptr) return;
    for (int i = ctx->n_allocs - 1; i >= 0; i--) {
        if (ctx->allocs[i].ptr != ptr) continue;
        ctx->be->free(ctx, ptr);
        ctx->in_use_bytes -= ctx->allocs[i].n_bytes;
        ctx->allocs[i] = ctx->allocs[--ctx->n_allocs];
        return;
    }
    MST_ASSERT(!"mst_free of a pointer not from mst_alloc on this context");
}

static mst_status copy_checked(mst_ctx_t* ctx, void* dst, const void* src, size_t n_bytes,
                               mst_copy_dir dir) {
    MST_TRY(mst_check_ctx(ctx));
    if (n_bytes == 0) return MST_OK;
    if (!dst) return mst_set_error(MST_ERR_INVALID, "dst is NULL");
    if (!src) return mst_set_error(MST_ERR_INVALID, "src is NULL");
    return ctx->be->copy(ctx, dst, src, n_bytes, dir);
}

mst_status mst_copy_h2b(mst_ctx_t* ctx, void* dst, const void* host_src, size_t n_bytes) {
    return copy_checked(ctx, dst, host_src, n_bytes, MST_COPY_H2B);
}
mst_status mst_copy_b2h(mst_ctx_t* ctx, void* host_dst, const void* src, size_t n_bytes) {
    return copy_checked(ctx, host_dst, src, n_bytes, MST_COPY_B2H);
}
mst_status mst_copy_b2b(mst_ctx_t* ctx, void* dst, const void* src, size_t n_bytes) {
    return copy_checked(ctx, dst, src, n_bytes, MST_COPY_B2B);
}

mst_status mst_fill(mst_ctx_t* ctx, void* dst, int byte, size_t n_bytes) {
    MST_TRY(mst_check_ctx(ctx));
    if (n_bytes == 0) return MST_OK;
    if (!dst) return mst_set_error(MST_ERR_INVALID, "dst is NULL");
    return ctx->be->fill(ctx, dst, byte, n_bytes);
}

mst_tensor mst_tensor_make(void* data, mst_dtype dtype, int64_t rows, int64_t cols) {
    mst_tensor t = {data, dtype, rows, cols, NULL};
    return t;
}

size_t mst_tensor_bytes(const mst_tensor* t) {
    return (size_t)t->rows * (size_t)t->cols * mst_dtype_size(t->dtype);
}

mst_status mst_workspace(mst_ctx_t* ctx, mst_ws* ws, size_t n_bytes, void** out) {
    if (ws->n_bytes < n_bytes) {
        mst_free(ctx, ws->ptr);
        ws->ptr = NULL;
        ws->n_bytes = 0;
        MST_TRY(mst_alloc(ctx, n_bytes, &ws->ptr));
        ws->n_bytes = n_bytes;
    }
    *out = ws->ptr;
    return MST_OK;
}

mst_status mst_slot_missing(const mst_ctx_t* ctx, const char* slot) {
    return mst_set_error(MST_ERR_UNSUPPORTED, "%s is not implemented on backend %s", slot, ctx->be->name);
}
