/*
 * mlp_stack.h — a stack of grouped-MLP layers driven through the memory
 * manager along a pipeline schedule (not library API: a helper of the
 * memory-manager tests and `moestash bench step`, built from support/).
 * Layer l of microbatch mb maps x [R, H] -> y [R, H] with its own routing
 * (counts, probs); chunk c's input is chunk c-1's output, as on a pipeline
 * rank that holds several chunks.
 */
#ifndef MST_MLP_STACK_H
#define MST_MLP_STACK_H

#include "moestash.h"

typedef struct mst_stack {
    mst_ctx_t* ctx;
    mst_mlp_config mlp;       /* E, H, F, activation                         */
    int32_t n_layers;         /* L                                            */
    int32_t n_micro;          /* M                                            */
    int32_t virtual_stages;   /* V                                            */
    int64_t max_rows;         /* R                                            */
    mst_mlp_weights* w;       /* [L] views into wbuf / gbuf                   */
    void* wbuf;               /* all bf16 weights                             */
    void* gbuf;               /* all fp32 main_grads                          */
    size_t gbuf_bytes;
    mst_tensor* counts;       /* [L, M] [E, 1] int32                          */
    mst_tensor* probs;        /* [L, M] [R, 1] fp32                           */
    mst_tensor* io;           /* [V+1, M] [R, H]: chunk inputs (c) / outputs (c+1) */
    mst_tensor* grad;         /* [V+1, M] [R, H]: dy of chunk outputs / dx of inputs */
    mst_tensor* dprobs;       /* [L, M] [R, 1] fp32                           */
    mst_tensor act[2];        /* [R, H] ping-pong activations inside a chunk  */
    mst_tensor dact[2];       /* [R, H] ping-pong gradients inside a chunk    */
    void* arena;              /* the buffers above, one allocation            */
    mst_memmgr_t* mm;
} mst_stack;

/* Random weights (seeded), no biases. Buffers for L layers and M microbatches. */
mst_status mst_stack_create(mst_ctx_t* ctx, const mst_mlp_config* mlp, int32_t n_layers,
                            int32_t n_micro, int32_t virtual_stages, int64_t max_rows,
                            uint64_t seed, mst_stack* out);
void mst_stack_destroy(mst_stack* s);
/* New routing: counts [L, M, E] (host), totals per microbatch equal across
 * layers; fresh probs, inputs and output gradients drawn from seed. */
mst_status mst_stack_route(mst_stack* s, const int32_t* host_counts, uint64_t seed);
/* One step along `schedule` through s->mm (created by the caller with the same
 * shape): main_grads zeroed, forward and backward of every entry. */
mst_status mst_stack_step(mst_stack* s, const mst_sched_entry* schedule, int32_t n_schedule,
                          int measuring);

#endif
