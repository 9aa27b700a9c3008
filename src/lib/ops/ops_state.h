/*
 * ops_state.h — what the ops layer keeps per context: the queue of DEFERRED
 * wgrads (grouped_linear.c) and the grouped MLP's scratch (grouped_mlp.c).
 * It hangs off the context (ctx->ops), made on first use, freed with it.
 */
#ifndef MST_OPS_STATE_H
#define MST_OPS_STATE_H

#include "../core/context.h"

/* The grouped MLP backward's scratch: dz, dh, a recomputed z. */
enum { MST_MLP_WS_DZ = 0, MST_MLP_WS_DH, MST_MLP_WS_Z, MST_N_MLP_WS };

typedef struct mst_ops_state {
    mst_gl_args* deferred;        /* [n_deferred] wgrads waiting for the flush */
    int n_deferred, cap_deferred;
    mst_ws mlp[MST_N_MLP_WS];     /* backend memory, by MST_MLP_WS_*           */
} mst_ops_state;

/* ctx's ops state, made on first use. */
mst_status mst_ops_state_of(mst_ctx_t* ctx, mst_ops_state** out);

#endif
