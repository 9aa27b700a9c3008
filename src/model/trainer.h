/*
 * trainer.h — the training loop of `moestash train`: steps of M microbatches
 * (gradient accumulation), AdamW, the over-budget rerun with exact shapes,
 * a progress line per step, and the memory report by category.
 */
#ifndef MST_TRAINER_H
#define MST_TRAINER_H

#include <stdio.h>

#include "model.h"

typedef struct mst_train_config {
    mst_model_config model;
    mst_optim_config optim;
    int32_t microbatches;     /* M                                               */
    int64_t steps;
    const char* data_path;    /* NULL: the synthetic corpus                      */
    int64_t force_over_budget;/* step (1-based) whose results are flagged over
                                 budget once, to exercise the rerun; 0: never    */
} mst_train_config;

/* Memory of the run by category, with the same routing's needs under KEEP
 * (static max_rows buffers) and exact shapes (rows really routed, peak over
 * the run per group). Bytes. */
typedef struct mst_mem_table {
    size_t run[MST_N_MEM];
    size_t keep[MST_N_MEM];
    size_t exact[MST_N_MEM];
    size_t other;             /* op workspaces and context memory (all columns) */
    size_t peak;              /* backend memory peak of the context            */
} mst_mem_table;

typedef struct mst_train_result {
    double* loss;             /* [steps] main next-token loss (mean)           */
    double* mtp_loss;         /* [steps] MTP loss (unweighted mean)            */
    double* aux_loss;         /* [steps] load-balancing loss (sum over layers) */
    double* tok_per_s;        /* [steps]                                       */
    int64_t steps;
    int64_t reruns;           /* steps rerun with exact shapes                 */
    int64_t max_rows;         /* static R per group                            */
    int32_t* peak_rows;       /* [L+1, G] peak rows per group                  */
    mst_mem_table mem;
    double seconds;
} mst_train_result;

/* Runs the training; progress lines go to `progress` (NULL: none). */
mst_status mst_train_run(mst_ctx_t* ctx, const mst_train_config* cfg, FILE* progress,
                         mst_train_result* res);
void mst_train_result_free(mst_train_result* res);
void mst_train_print_memory(FILE* f, const mst_train_result* res);
mst_status mst_train_write_json(const char* path, const mst_train_config* cfg,
                                const mst_train_result* res, const char* device);

#endif
