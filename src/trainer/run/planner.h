/*
 * planner.h — `moestash train --memory-budget SIZE`: measures what the
 * planner (src/trainer/plan/budget.h) needs on this machine and this model, and
 * turns its plan into the run's memory configuration.
 *
 * The probe: the same model with every saved tensor stashed (pages only for
 * the microbatches in flight) but fc2_input, recomputed (the workspace for
 * it is the context's: made by the probe, it stays), no layer recompute, runs the run's first
 * batches once as a measuring step (the rows each (layer, microbatch) saves
 * are the first step's: the weights are the run's initial ones, and AdamW
 * runs with learning rate 0, so they stay) and twice
 * more sized and timed (the faster counts: the step, and its forward entries:
 * a layer's rerun cost). The sizes are the memory table's rows: the
 * model's categories give a layer's activations per set and the MTP
 * module's; the rest of what is in use ("fixed": weights, gradients,
 * optimizer, head, compute buffers, workspaces) is what the planner's own
 * prediction of the probe's plan does not explain; the KEEP step's time is
 * the probe's less its plan's predicted cost. The device copy and host spill
 * bandwidths are timed beforehand on buffers of the widest saved tensor's
 * size (at most 256 MiB). The probe model is then freed and the run starts
 * with its own peak.
 *
 * W ranks (cfg->dist): every rank probes (collective: the probe's steps
 * exchange rows), each its own expert shard and the rows routed to it; the
 * planner gets the max over the ranks of every size, row count and time
 * and the min of each bandwidth, the same on every rank, so every rank
 * makes the same plan (or the same refusal). The probe sizes each rank's
 * stash pools for its own rows (mst_mem_config.own_needs), so each rank's
 * fixed part is its own exactly.
 *
 * P pipeline stages (cfg->dist.stages): each stage probes and plans its own
 * layers along its own schedule (its memory manager's: stage 0 holds the
 * most microbatches in flight), the max taken over its own ranks (dist.ep),
 * the budget applying to each rank. The stages then share their plans and
 * verdicts over the grid (dist.pipe), so every rank holds the whole
 * model's plan (each layer planned by the stage that holds it) and every
 * rank refuses alike when a stage finds no plan.
 */
#ifndef MST_PLANNER_H
#define MST_PLANNER_H

#include <stdio.h>

#include "trainer/plan/budget.h"
#include "trainer.h"

/* One stage's plan as every rank of the grid sees it. */
typedef struct mst_plan_stage {
    int32_t failed;            /* 0; 1: no plan fits the budget; 2: its probe failed */
    int32_t full;              /* its recomputed layers' granularity (1 full, 0 moe) */
    int32_t sets;              /* its activation sets: microbatches in flight       */
    size_t peak, peak_measuring, peak_sized; /* its plan's predictions, bytes        */
    size_t keep_peak;          /* KEEP's predicted peak                              */
    size_t smallest;           /* the smallest peak its planner reaches              */
    double step_s, keep_step_s; /* predicted step time: its plan's, KEEP's           */
} mst_plan_stage;

typedef struct mst_plan_report {
    size_t budget;             /* bytes asked for (each rank's)                      */
    mst_budget_model bm;       /* what the planner was given (rows, sched owned): on
                                  W ranks the max over the ranks, the same on each;
                                  P stages: this rank's stage's layers (local)       */
    mst_budget_model own;      /* this rank's probe alone (rows owned, sched bm's)   */
    mst_budget_plan plan;      /* its plan, with predictions                         */
    mst_budget_plan keep;      /* KEEP, with predictions                             */
    size_t smallest;           /* the smallest peak the planner reaches              */
    size_t probe_peak;         /* the probe's measured peak (KEEP)                    */
    /* the grid's (one stage: the same as above, over the L+1 layers) */
    int32_t stage, stages;     /* this rank's stage s of P                           */
    int32_t n_all;             /* L+1: the model's layers, the MTP layer last        */
    mst_policy* policy_all;    /* [L+1, MST_N_SAVED] each layer's by its stage's plan */
    int32_t* chunk_all;        /* [L+1] l: layer l recomputed; -1                     */
    int32_t* stage_of;         /* [L+1] the stage that holds (and planned) layer l    */
    mst_plan_stage* by_stage;  /* [P] each stage's plan and predictions              */
} mst_plan_report;

/* The probe and the plan for cfg->memory_budget on the batches d gives next
 * (d's sampler is left as it was). MST_ERR_INVALID naming --memory-budget
 * and the smallest peak that would fit when nothing does (P stages: on
 * every rank, naming the first stage that fits no plan and the largest of
 * the stages' smallest peaks). */
mst_status mst_plan_budget(mst_ctx_t* ctx, const mst_train_config* cfg, mst_data* d, mst_plan_report* out);
/* cfg's memory configuration set to the plan (its arrays stay r's): every
 * layer's policies and recompute (the model takes its stage's), this
 * stage's granularity. */
void mst_plan_apply(const mst_plan_report* r, mst_train_config* cfg);
void mst_plan_report_free(mst_plan_report* r);
/* The plan as a table (tensor kind x layers -> choice), predicted and
 * measured peak and step time of run res (P stages: the stage of each
 * layer, and a line a stage: its granularity, predicted peak against the
 * max over its ranks of the measured one, KEEP's and the smallest). */
void mst_plan_print(FILE* f, const mst_plan_report* r, const mst_train_result* res, const mst_train_config* cfg);
/* The same as a JSON member "plan": {...}, (with the trailing comma): the
 * choices of every layer; the predictions and measurements of this rank's
 * stage (P stages: rank 0's is stage 0; each stage's in mst_plan_stage_json). */
void mst_plan_json(FILE* f, const mst_plan_report* r, const mst_train_result* res, const mst_train_config* cfg);
/* P stages: stage s's choices as one line ("stash 6, recompute 2; 1 layer
 * (full)": tensors of (layer, name) by choice, layers recomputed whole). */
void mst_plan_stage_summary(const mst_plan_report* r, int32_t s, char* out, size_t cap);
/* P stages: `, "plan": {...}` of stage s (its layers, choices, predictions)
 * inside its entry of the JSON "stages" array. */
void mst_plan_stage_json(FILE* f, const mst_plan_report* r, int32_t s);
/* Median step time of run res of cfg (the steps after its first), seconds. */
double mst_plan_step_s(const mst_train_result* res, const mst_train_config* cfg);

#endif
