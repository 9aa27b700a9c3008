/*
 * model_backend.c — the one door from the trainer to its model ops: the
 * table of the context's backend.
 */
#include "lib/internal.h"
#include "model_backend.h"

mst_status mst_model_backend_of(const mst_ctx_t* ctx, const mst_model_backend** out) {
    *out = NULL;
    MST_TRY(mst_check_ctx(ctx));
    if (ctx->kind == MST_BACKEND_CPU) *out = &mst_model_backend_cpu;
#ifdef MST_HAVE_CUDA
    if (ctx->kind == MST_BACKEND_CUDA) *out = &mst_model_backend_cuda;
#endif
    if (*out) return MST_OK;
    return mst_set_error(MST_ERR_UNSUPPORTED, "backend %s has no model ops (the trainer's transformer)",
                         ctx->be->name);
}
