/*
 * budget.h — the memory-budget planner: from one step's sizes and costs (a
 * budget model) to a plan that says, per (layer, saved tensor), keep, stash,
 * offload or recompute, and which layers are recomputed whole (and at what
 * granularity), so that the predicted backend peak fits a budget with the
 * least predicted step time. Pure: it calls no backend, so a test can feed it
 * any model.
 *
 * The peak it predicts is the memory manager's and the trainer's own
 * accounting (docs/DESIGN.md, "The memory-budget planner"): every buffer the
 * trainer allocates is static, so the peak is a sum, the larger of the
 * measuring step's (exact copies of STASHed tensors, restore buffers of
 * max_rows rows) and a sized step's (pools of ceil(peak pages * factor)
 * pages, restore buffers of the largest rows saved, handles).
 *
 * Shapes: L1 layers of the manager (the trainer's L main layers and the MTP
 * layer last; a pipeline stage's: its own layers, the MTP layer last on the
 * last stage, none before it), M microbatches, R = max_rows of the grouped
 * rows (all groups).
 */
#ifndef MST_PLAN_BUDGET_H
#define MST_PLAN_BUDGET_H

#include "lib/internal.h"

/* What the planner knows about one step: sizes from the measuring step of a
 * probe run (bytes), costs measured on this machine (seconds, bytes/s). */
typedef struct mst_budget_model {
    int32_t n_layers;            /* L1                                                   */
    int32_t n_micro;             /* M                                                    */
    int32_t n_sets;              /* the model's activation sets (microbatches in flight) */
    const mst_sched_entry* sched; /* [n_sched] the step's schedule                       */
    int32_t n_sched, layers_per_chunk;
    const int64_t* rows;         /* [L1, M] rows saved by (layer, mb) (sum of counts)    */
    int64_t max_rows;            /* R                                                    */
    int64_t hidden, ffn;         /* H, F: the saved tensors' widths (mst_saved_shape)    */
    int32_t page_rows;           /* rows per stash page                                  */
    double pool_factor;          /* pool pages over the measured peak                    */
    int reads_pages[MST_N_SAVED]; /* a STASHed name is read from its pages in place      */
    /* bytes */
    size_t fixed;                /* what no choice changes: weights, gradients, optimizer
                                    state, embedding and head, compute buffers, the ops'
                                    workspaces (the context's, made once, kept) and the
                                    context                                             */
    size_t layer_acts;           /* one layer's own activations (attention, norms,
                                    router), one activation set                         */
    size_t layer_out;            /* of which its output [N, H]                           */
    size_t mtp_input;            /* the MTP module's kept input (next tokens' embedding) */
    size_t mtp_module;           /* the rest of the MTP module's activations             */
    int32_t no_mtp_layer;        /* 1: a pipeline stage before the last: every layer a
                                    main layer (recomputed whole, it keeps its output:
                                    the next stage's input), mtp_input the next-token
                                    embedding passed on, mtp_module 0. 0: layer L1-1
                                    is the MTP layer                                    */
    /* costs */
    double t_step;               /* the step with every tensor kept (KEEP), seconds      */
    double t_layer;              /* one layer's forward for one microbatch (a rerun)     */
    double t_mtp;                /* the MTP module's norms, projection and head           */
    double dev_bw, host_bw;      /* device copy, host spill (PCIe) bytes/s               */
} mst_budget_model;

/* A plan for the L1 layers. */
typedef struct mst_budget_plan {
    int32_t full;                /* recomputed layers: 1 whole layer, 0 grouped MLP only  */
    int32_t* chunk_start;        /* [L1] l: layer l recomputed (a chunk of its own); -1  */
    mst_policy* policy;          /* [L1, MST_N_SAVED] of the layers not recomputed       */
    /* predictions (mst_budget_eval) */
    size_t peak;                 /* max(peak_measuring, peak_sized)                      */
    size_t peak_measuring, peak_sized;
    size_t acts;                 /* of the peak: activations (layers' own, the MTP
                                    module's, recompute slots) and the manager's
                                    buffers, pools and handles                          */
    double step_s;               /* predicted step time                                  */
} mst_budget_plan;

/* Plan storage for L1 layers: every tensor kept, nothing recomputed. */
mst_status mst_budget_plan_alloc(int32_t n_layers, mst_budget_plan* p);
void mst_budget_plan_free(mst_budget_plan* p);
void mst_budget_plan_keep(int32_t n_layers, mst_budget_plan* p);
void mst_budget_plan_copy(int32_t n_layers, mst_budget_plan* dst, const mst_budget_plan* src);

/* Checks bm (every error names the field and its value). */
mst_status mst_budget_model_check(const mst_budget_model* bm);
/* Fills p's predictions. */
mst_status mst_budget_eval(const mst_budget_model* bm, mst_budget_plan* p);
/* The plan of least predicted step time whose predicted peak is <= budget.
 * When none is found: MST_ERR_INVALID, *smallest the smallest peak the
 * planner can reach (also set on success). */
mst_status mst_budget_solve(const mst_budget_model* bm, size_t budget, mst_budget_plan* out, size_t* smallest);

#endif
