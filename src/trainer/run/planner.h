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
 * makes the same plan (or the same refusal).
 */
#ifndef MST_PLANNER_H
#define MST_PLANNER_H

#include <stdio.h>

#include "trainer/plan/budget.h"
#include "trainer.h"

typedef struct mst_plan_report {
    size_t budget;             /* bytes asked for                                    */
    mst_budget_model bm;       /* what the planner was given (rows, sched owned): on
                                  W ranks the max over the ranks, the same on each   */
    mst_budget_model own;      /* this rank's probe alone (rows owned, sched bm's)   */
    mst_budget_plan plan;      /* its plan, with predictions                         */
    mst_budget_plan keep;      /* KEEP, with predictions                             */
    size_t smallest;           /* the smallest peak the planner reaches              */
    size_t probe_peak;         /* the probe's measured peak (KEEP)                    */
} mst_plan_report;

/* The probe and the plan for cfg->memory_budget on the batches d gives next
 * (d's sampler is left as it was). MST_ERR_INVALID naming --memory-budget
 * and the smallest peak that would fit when nothing does. */
mst_status mst_plan_budget(mst_ctx_t* ctx, const mst_train_config* cfg, mst_data* d, mst_plan_report* out);
/* cfg's memory configuration set to the plan (its arrays stay r's). */
void mst_plan_apply(const mst_plan_report* r, mst_train_config* cfg);
void mst_plan_report_free(mst_plan_report* r);
/* The plan as a table (tensor kind x layers -> choice), predicted and
 * measured peak and step time of run res. */
void mst_plan_print(FILE* f, const mst_plan_report* r, const mst_train_result* res, const mst_train_config* cfg);
/* The same as a JSON member "plan": {...}, (with the trailing comma). */
void mst_plan_json(FILE* f, const mst_plan_report* r, const mst_train_result* res, const mst_train_config* cfg);
/* Median step time of run res of cfg (the steps after its first), seconds. */
double mst_plan_step_s(const mst_train_result* res, const mst_train_config* cfg);

#endif
