/*
 * overlap.h — the replicated gradients' sums over the data-parallel ranks
 * started during the backward (--overlap on, overlap.c): a bucket per layer
 * as soon as the step's last backward of the layer has finished its
 * gradients, on a stream of its own, joined back before the optimizer.
 */
#ifndef MST_OVERLAP_H
#define MST_OVERLAP_H

#include "model.h"

/* The buckets' state of a model (NULL: off, or one data-parallel rank). */
typedef struct mst_overlap {
    mst_ep_t* ep;        /* the sums' communicator: CUDA, a split of dist.ep
                            (its own NCCL communicator: dispatch and combine
                            use dist.ep on the compute stream meanwhile);
                            the CPU twin, dist.ep (calls in program order)  */
    mst_ctx_t* ctx;      /* CUDA: the context whose stream runs the sums (the
                            communication stream); NULL: m->ctx, in order   */
    void *fork, *join;   /* events: compute -> communication, and back       */
    int32_t* last_bwd;   /* [n_chunks] the schedule entry of each chunk's last
                            backward (its layers' gradients final after it)  */
    int32_t n_chunks;
    int32_t active;      /* 1 during a training step's passes (not eval)     */
    int32_t forked;      /* sums enqueued on the communication stream since
                            the last join                                    */
} mst_overlap;

/* Sets m->ov for a model on W > 1 data-parallel ranks with
 * mem_cfg.overlap 1 (after the layout, the optimizer's and the
 * schedule); else leaves it NULL. CUDA: collective over dist.ep
 * (ncclCommSplit). */
mst_status mst_overlap_create(mst_model* m);
void mst_overlap_destroy(mst_model* m);

/* Layer l's backward (of schedule entry `entry`, chunk `chunk`) is done:
 * when the entry is the chunk's last backward of a training step, layer l's
 * bucket (its matrices, then its norm weights) is summed over the ranks. */
mst_status mst_overlap_layer_done(mst_model* m, int32_t entry, int32_t chunk, int32_t l);

/* The step's replicated gradients summed (mst_step_share_grads' first
 * half): --overlap on, the rest of the runs (embedding, head, projection,
 * final norms) and the join of the communication stream; off, or one
 * rank: mst_optim_share_grads. */
mst_status mst_overlap_finish(mst_model* m);

#endif
