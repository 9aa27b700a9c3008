/*
 * ops_state.c — the ops layer's per-context state (see ops_state.h).
 */
#include "ops_state.h"

/* Host memory only: the workspaces are backend memory that the context
 * frees itself. */
static void ops_state_free(struct mst_ops_state* s) {
    free(s->deferred);
    free(s);
}

mst_status mst_ops_state_of(mst_ctx_t* ctx, mst_ops_state** out) {
    if (!ctx->ops) {
        ctx->ops = (mst_ops_state*)calloc(1, sizeof *ctx->ops);
        if (!ctx->ops) return mst_set_error(MST_ERR_OOM, "ops state of the context");
        ctx->ops_free = ops_state_free;
    }
    *out = ctx->ops;
    return MST_OK;
}
