/*
 * trainer.h — the training loop of `moestash train`: steps of M microbatches
 * along a schedule (gradient accumulation), AdamW, reruns of steps that went
 * over budget (exact shapes) or overflowed a stash pool (measuring step that
 * resizes the pools), a progress line per step, the memory report by
 * category, and --check-policies.
 */
#ifndef MST_TRAINER_H
#define MST_TRAINER_H

#include <stdio.h>

#include "trainer/model/model.h"

typedef struct mst_train_config {
    mst_model_config model;
    mst_optim_config optim;
    mst_mem_config mem;
    int32_t microbatches;      /* M                                               */
    int64_t steps;
    const char* data_path;     /* NULL: the synthetic corpus                      */
    int64_t force_over_budget; /* step (1-based) flagged over budget once; 0: never */
    int64_t force_overflow;    /* step flagged as a stash-pool overflow once      */
    int64_t graph_from;        /* first step that may be replayed from the
                                  captured step graph (backends that capture;
                                  others run eagerly); 0: never                 */
    int64_t log_every;         /* a progress line every N steps (0: every step)  */
    const char* save_dir;      /* checkpoints (checkpoint.h): DIR/step-N every
                                  save_every steps and DIR/final; NULL: none     */
    int64_t save_every;        /* 0: DIR/final only                              */
    size_t save_shard_bytes;   /* shards of a checkpoint's file sets at most this
                                  (0: MST_CKPT_SHARD_BYTES, 5 GB)               */
    const char* init_from;     /* a Hugging Face Qwen3-MoE directory whose weights
                                  start the run (model's config from its
                                  config.json; fresh optimizer); NULL: random  */
    const char* dump_grads;    /* after step 1's backward, before its optimizer:
                                  every main_grad, the step's tokens and losses
                                  into this safetensors file (one rank); NULL  */
    const char* resume_dir;    /* a checkpoint of this configuration: its weights,
                                  optimizer state, sampler; the run continues
                                  after its step (NULL: from the start)         */
    const char* eval_path;     /* held-out text (NULL: eval_fraction of the
                                  training text, or no evaluation)             */
    double eval_fraction;      /* the tail of the training text held out       */
    int64_t eval_every;        /* evaluate every N steps (0: at the end only)  */
    int32_t eval_batches;      /* batches of B windows per evaluation (0: 8)   */
    const char* plot_path;     /* SVG of the train and eval losses (NULL: none) */
    const char* timeline_path; /* SVG of the backend memory over one step by
                                  category (this run; FILE-keep.svg: KEEP)     */
    size_t memory_budget;      /* bytes: the memory plan that fits it replaces
                                  mem's policy and recompute (planner.h); 0: none */
    int32_t pp;                /* pipeline stages P (0 or 1: one stage): the
                                  ranks of mst_train_ranks form P stages of
                                  world / P data-parallel ranks (stage.c)    */
    mst_dist dist;             /* the ranks of the run (model.h): each rank
                                  calls mst_train_run with its own context,
                                  rank and communicator (mst_model_ep_config of
                                  model, world); model.batch is per rank, the
                                  global batch W B; dist.ep NULL: one rank.
                                  Rank 0 draws the timeline                    */
} mst_train_config;

/* Memory of the run by row of the table, with the same routing's needs under
 * KEEP (static max_rows buffers) and exact shapes (rows really routed: each
 * group at its peak over the run). Bytes. */
enum {
    MST_ROW_WEIGHTS = 0, MST_ROW_GRADS, MST_ROW_OPTIM, MST_ROW_SAVED_ATTN, MST_ROW_SAVED_NORM,
    MST_ROW_SAVED_ROUTER, MST_ROW_SAVED_HEAD, MST_ROW_SAVED_MTP, MST_ROW_RECOMPUTE, MST_ROW_MLP_KEPT,
    MST_ROW_MLP_DEV_PAGES, MST_ROW_MLP_HOST_PAGES, MST_ROW_COMPUTE, MST_ROW_OTHER, MST_N_ROWS
};
typedef struct mst_mem_table {
    size_t run[MST_N_ROWS];
    size_t keep[MST_N_ROWS];
    size_t exact[MST_N_ROWS];
    size_t dev_pages_peak, host_pages_peak; /* pages in use at peak            */
    size_t peak;               /* backend memory peak of the context            */
    mst_mem_report_t manager;  /* the memory manager's own report               */
} mst_mem_table;
const char* mst_mem_row_str(int row);

typedef struct mst_train_result {
    double* loss;             /* [steps] main next-token loss (mean)           */
    double* mtp_loss;         /* [steps] MTP loss (unweighted mean)            */
    double* aux_loss;         /* [steps] load-balancing loss (sum over layers) */
    double* tok_per_s;        /* [steps]                                       */
    double* eval_loss;        /* [steps] held-out main loss after the step (NaN:
                                 not evaluated); bits per byte = loss / ln 2    */
    int64_t steps;
    int64_t first_step;       /* 1, or the step after the resumed checkpoint's */
    int64_t reruns;           /* step reruns: over budget or overflow          */
    int64_t over_budget;      /* of which over budget                          */
    int64_t captures;         /* graph captures of the step (again after reruns) */
    int64_t replays;          /* steps replayed from a captured graph          */
    int64_t max_rows;         /* static R per group                            */
    int32_t* peak_rows;       /* [L+1, G] peak rows per group                  */
    int64_t n_layers, n_groups; /* L+1, G                                      */
    uint64_t weights_hash;    /* FNV-1a of the final fp32 master and bf16 weights
                                 (W ranks: of the ranks' hashes in rank order,
                                 P stages: of the grid's; the same on every
                                 rank)                                         */
    uint64_t replicated_hash; /* the same of the parameters every rank holds
                                 (all but the experts on W ranks): this rank's */
    mst_mem_table mem;        /* this rank's                                   */
    mst_mem_table mem_max;    /* W ranks: each entry's max over the ranks      */
    int32_t world;            /* W (1: one rank)                               */
    int32_t stages;           /* P pipeline stages (1: one)                    */
    mst_mem_table* stage_mem; /* [P] P > 1: each stage's table (its data-parallel
                                 rank 0's), on every rank; NULL otherwise      */
    int32_t* stage_sets;      /* [P] each stage's activation sets: microbatches
                                 in flight at once                            */
    uint64_t* grid_peak;      /* [P W] P > 1: each grid rank's backend peak
                                 (rank s W + d), bytes, on every rank          */
    uint64_t* rank_peak;      /* [W] W ranks: each rank's backend peak, bytes (NULL: one rank) */
    int32_t optim_shard;      /* 1: the optimizer state sharded (ZeRO-1)       */
    int32_t grad_overlap;     /* 1: the replicated gradients' sums started
                                 during the backward (--overlap on took)      */
    size_t optim_rep_bytes;   /* W ranks: this rank's optimizer state of the
                                 replicated parameters (master, m, v), bytes    */
    size_t optim_rep_whole_bytes; /* the same unsharded                        */
    size_t allreduce_bytes;   /* W ranks: the replicated gradients a step sums  */
    double allreduce_ms;      /* W ranks: that all-reduce alone, eager, after the
                                 run (what overlapping it could save at most)   */
    double seconds;
    struct mst_plan_report* plan; /* --memory-budget: the plan and its predictions */
} mst_train_result;


/* One step's microbatches of windows of model m's rank into tok [M, W B,
 * T+2] (this rank's [M, B, T+2] first, the rest scratch): each microbatch
 * draws the global batch of W B windows (every rank the same draws) and
 * this rank keeps its B, windows r B .. r B + B - 1. */
void mst_train_draw(const mst_model* m, mst_data* d, const mst_train_config* cfg, int32_t* tok);
/* Runs the training; progress lines go to `progress` (NULL: none). */
mst_status mst_train_run(mst_ctx_t* ctx, const mst_train_config* cfg, FILE* progress,
                         mst_train_result* res);
/* Runs cfg (dist empty) on `world` ranks as threads of this process
 * (train_ranks.c): CPU contexts over the CPU twin, or CUDA contexts on GPUs
 * 0 .. world-1 over NCCL; res [world] gets each rank's result (losses and
 * hash the same on every rank); rank 0's progress lines go to `out`.
 * check_policies: mst_train_check_policies on every rank instead (rank 0
 * writes `out` and `json`; res may be NULL). A failure names its rank. */
mst_status mst_train_ranks(mst_backend_kind kind, const mst_train_config* cfg, int32_t world, int check_policies,
                           FILE* out, FILE* json, mst_train_result* res);
void mst_train_result_free(mst_train_result* res);
void mst_train_print_memory(FILE* f, const mst_train_result* res);
/* P > 1: one line a stage of res->stage_mem (nothing otherwise). */
void mst_train_print_stages(FILE* f, const mst_train_result* res);
mst_status mst_train_write_json(const char* path, const mst_train_config* cfg,
                                const mst_train_result* res, const char* device);
/* The same steps under every policy, a mixed per-name spec and layer
 * recompute; one line each to `out`; MST_ERR_STATE when any run's losses or
 * final weights differ in a bit from the keep run's. */
mst_status mst_train_check_policies(mst_ctx_t* ctx, const mst_train_config* cfg, FILE* out, FILE* json);
/* The runs of --check-policies: trains runs[0 .. n), one line each to `out`
 * (NULL: none)
 * (labels[i], last loss, weights hash, verdict against runs[0]) and, when
 * json is not NULL, one JSON document of every run's losses, hash, reruns
 * and verdict;
 * MST_ERR_STATE when any run's losses, MTP losses or final weights differ
 * in a bit from runs[0]'s. */
mst_status mst_train_compare(mst_ctx_t* ctx, const mst_train_config* runs, const char* const* labels, int n,
                             FILE* out, FILE* json);

#endif
