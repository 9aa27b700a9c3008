/*
 * model.h — the language model that `moestash train` trains: the Qwen3-MoE
 * architecture (transformers' qwen3_moe; docs/DESIGN.md, "The trainer"):
 * token embedding, pre-norm layers of RMSNorm, grouped-query attention with
 * QK-norm and rotary positions, an MoE block in every layer (softmax
 * router, top-k renormalised, transformers' load-balancing loss, dropless
 * dispatch into the --ep groups' grouped rows, grouped SwiGLU MLP,
 * combine), final norm and an output head (tied to the embedding or its
 * own), plus one DeepSeek-V3-style multi-token-prediction (MTP) module
 * built from the same layer. bf16 weights and activations, fp32 master
 * weights, main_grad and AdamW state.
 *
 * The grouped MLP's saved activations go through the memory manager (policy
 * per name, layer recompute, schedules); the model keeps its own attention,
 * norm and router activations per (microbatch, layer).
 *
 * Shapes: V vocab, H hidden, F ffn (moe_intermediate_size), NH query heads,
 * KV key-value heads, D head dim, Wq = (NH + 2 KV) D the q|k|v row, B batch,
 * T seq, N = B T tokens
 * of one microbatch, M microbatches, L layers (+1: the MTP module's layer has
 * index L), E experts, k top-k, G = --ep groups of E / G experts, R = max_rows
 * of each group; the groups' rows are packed into one [G R] grouped-rows
 * buffer (group g after the groups before it), each group limited to R rows.
 */
#ifndef MST_MODEL_H
#define MST_MODEL_H

#include "lib/internal.h"
#include "trainer/model_ops/model_backend.h"
#include "trainer/model/data.h"

/* Attention: what forward saves for backward (model_backend.h) and which
 * implementation runs it. CUDNN: cuDNN's fused attention under the flash
 * contract (output and row logsumexp saved), where the library loads and
 * takes the dims; else an error naming --attention. FLASH: our kernels,
 * the same contract. AUTO: cuDNN where the backend has it and it takes the
 * dims, else our flash kernels, else the probabilities (each refusal in
 * mst_model.attn_note). */
typedef enum { MST_ATTN_AUTO = 0, MST_ATTN_FLASH, MST_ATTN_CUBLAS, MST_ATTN_CUDNN } mst_attn_kind;
const char* mst_attn_kind_str(int32_t kind);

typedef struct mst_model_config {
    int64_t vocab;          /* V (256: bytes)                                   */
    int64_t hidden, ffn;    /* H, F                                             */
    int64_t n_head;         /* NH query heads                                   */
    int64_t n_kv_head;      /* KV key-value heads (divides NH; NH: no grouping) */
    int64_t head_dim;       /* D, given (Qwen3: not H / NH)                     */
    float rope_theta;       /* rotary base (rope_theta)                         */
    int32_t norm_topk_prob; /* 1: the top-k router weights renormalised to 1    */
    int32_t tie_embeddings; /* 1: the output head is the embedding table        */
    int64_t seq, batch;     /* T, B                                             */
    int32_t layers;         /* L                                                */
    int32_t experts, top_k; /* E, k                                             */
    int32_t ep;             /* G (E % G == 0)                                   */
    float capacity_factor;  /* R = ceil(cf * N * k / G)                         */
    float mtp_weight;       /* weight of the MTP loss                           */
    float aux_coef;         /* load-balancing loss coefficient                  */
    float norm_eps;
    float init_std;
    uint64_t seed;
    int32_t attention;      /* mst_attn_kind (0: AUTO)                          */
} mst_model_config;

/* The model on W ranks (one context each): the experts sharded, rank r
 * holding experts [r E / W, (r + 1) E / W) and receiving their rows through
 * ep's dispatch and combine; embedding, attention, norms, router and MTP
 * replicated, their fp32 main_grad all-reduced. Each rank runs its own B
 * sequences of the global batch of W B: the run equals one rank with batch
 * W B and --ep W groups. The model's ep (G) is W.
 * With P pipeline stages (stage.c) the grid is P x W ranks: rank and world
 * are this rank's place among the W data-parallel ranks of its stage, ep
 * their communicator (the stage's experts sharded over it, its replicated
 * gradients summed over it), pipe the communicator of all P W ranks (rank
 * stage W + rank: activations between stages, the flag, losses, the
 * gradient norm). */
typedef struct mst_dist {
    int32_t rank, world;  /* this rank among its stage's data-parallel ranks, W */
    mst_ep_t* ep;         /* the stage's W ranks' communicator, made with
                             mst_model_ep_config; NULL: one rank a stage      */
    int32_t stage, stages;/* s, P (0 or 1: one stage)                         */
    mst_ep_t* pipe;       /* P > 1: every rank of the grid (a bare
                             communicator: mst_ep_p2p and all-reduces); NULL  */
} mst_dist;

/* The grid of `world` ranks in `pp` stages: pp divides --layers (interleaved,
 * virtual_stages V chunks a stage: P V divides --layers + 1, at least 2
 * layers a virtual stage) and world, the world / pp data-parallel ranks of a
 * stage divide --experts; each refusal names --pp and its value. */
mst_status mst_model_grid_check(const mst_model_config* c, int32_t pp, int32_t world, mst_schedule_kind schedule,
                                int32_t virtual_stages);
/* 1: the data-parallel ranks of each stage of that grid (D = world / pp;
 * pp 0 or 1: one stage) get a communicator of their own (dist.ep): D > 1,
 * or one stage (its ranks, even one); 0: one rank a stage of several, no
 * communicator, its --ep groups kept on the rank as one GPU keeps them. */
int mst_model_stage_comm(int32_t pp, int32_t world);

/* The policy of each saved grouped-MLP activation (layer, name) of the L+1
 * layers: per_layer's when set (the memory-budget planner's plan), else
 * name[n] on every layer. All zero: keep. --policy's spec is parsed once
 * (mst_policy_spec_parse) into name[]; mst_policy_spec_format prints it. */
typedef struct mst_policies {
    mst_policy name[MST_N_SAVED]; /* each name's on every layer (per_layer NULL) */
    const mst_policy* per_layer;  /* [L+1, MST_N_SAVED] or NULL                  */
} mst_policies;

/* The policy of (layer, n) under p. */
mst_policy mst_policies_at(const mst_policies* p, int32_t layer, mst_saved_name n);

/* How the grouped MLP's activations are saved (the memory manager). */
typedef struct mst_mem_config {
    mst_policies policy;            /* per (layer, name) (zero: keep)             */
    mst_recompute_config recompute; /* layer recompute (method NONE: off)        */
    int32_t recompute_full;         /* 1 (full): a recomputed layer keeps only its
                                       input; norms, attention, router and the
                                       grouped MLP are rerun. 0 (moe): only the
                                       grouped MLP's tensors are not kept         */
    int32_t recompute_mtp;          /* 1: the MTP layer is recomputed too (a
                                       chunk of its own when the plan has none),
                                       with its module's norms and projection
                                       (full): it keeps its two inputs           */
    mst_schedule_kind schedule;     /* order of forward/backward over microbatches */
    int32_t virtual_stages;         /* chunks of layers (interleaved: >= 2)      */
    double pool_factor;             /* stash pages over the measured peak (1.10) */
    int32_t optimizer_shard;        /* 1: ZeRO-1, the replicated parameters' fp32
                                       master weights and AdamW moments sharded
                                       over the data-parallel ranks (shard.c);
                                       one rank: nothing to shard               */
    int32_t moments_bf16;           /* 1: AdamW's moments stored bf16 (rounded to
                                       nearest even; --adam-moments bf16)       */
    int32_t overlap;                /* 1: --overlap on: each layer's replicated
                                       gradients summed during the backward
                                       (overlap.c); 0: after it (the default)    */
    int32_t own_needs;              /* W ranks: 1: each rank sizes its stash pools
                                       for its own rows (the planner's probe,
                                       whose steps route alike); 0: for the
                                       largest need of any rank (share_needs)   */
    /* the memory-budget planner's recompute plan, over recompute: */
    const int32_t* chunk_start;     /* [L+1] recompute plan over every layer (a stage
                                       gives its manager its layers' part:
                                       mst_stage_local_plan) or NULL              */
} mst_mem_config;

/* keep, plain schedule, no layer recompute (granularity full when one is
 * set), pool factor 1.10. */
mst_mem_config mst_mem_config_default(void);

/* The attention a model of config c runs on ctx's backend: *kind
 * MST_ATTN_FLASH or MST_ATTN_CUDNN (the flash contract) or MST_ATTN_CUBLAS
 * (the probabilities); under AUTO, why not cuDNN or flash in note ("" when
 * the first it tried runs);
 * MST_ATTN_FLASH or MST_ATTN_CUDNN where the backend cannot run it for
 * these dims is an error naming --attention and the reason (for cuDNN:
 * the library missing, its version, a shape no engine takes). CUDNN builds
 * its plans here. */
mst_status mst_model_attention(mst_ctx_t* ctx, const mst_model_config* c, int32_t* kind, char* note, size_t note_size);
/* 1 when attention kind k (resolved) saves the flash contract's out + lse. */
static inline int mst_attn_is_flash(int32_t k) { return k == MST_ATTN_FLASH || k == MST_ATTN_CUDNN; }

/* Checks sizes (each failure names the flag and its value). */
mst_status mst_model_config_check(const mst_model_config* c);
/* R: rows of one group, ceil(cf * tokens * k / G), the tokens of every
 * rank (world: 1, or W with c->batch per rank). */
int64_t mst_model_max_rows(const mst_model_config* c, int32_t world);
/* The communicator settings of a model of config c on `world` ranks, each
 * with c->batch sequences (c->ep must be world). */
mst_status mst_model_ep_config(const mst_model_config* c, int32_t world, mst_ep_config* out);
/* What a model of config c surely needs on a rank, before any
 * allocation: the parameters of the largest of pp stages (0 or 1: one),
 * its experts over dp ranks, with their gradients and AdamW state (18
 * bytes each, 14 with bf16 moments: moments_bf16; shard: the replicated
 * tensors' master and moments over the dp ranks, as ZeRO-1 keeps them), one
 * layer's saved attention (MST_ATTN_CUBLAS: the probabilities; else qkv, the
 * output and the row logsumexp: AUTO's smaller case) and the head's logits
 * with the two loss gradients ([N, V] bf16 each); *params_bytes is the
 * parameters' part. */
mst_status mst_model_bytes_at_least(const mst_model_config* c, int32_t moments_bf16, int32_t shard, int32_t pp,
                                    int32_t dp, double* total_bytes, double* params_bytes);

/* The model FLOPs of one token's training step (forward and backward), as
 * MFU counts them: 6 x the active parameters a token (per layer, the MTP
 * layer too: (NH + 2 KV) D H + H NH D + E H + 3 k F H; the MTP projection
 * 2 H^2; the heads 2 H V, tied or not) + 6 T NH D a layer (causal attention:
 * QK^T and PV of every query head over the causal half, grouping saves
 * none). Norms, rotary, softmax and SwiGLU's elementwise work not counted. */
double mst_model_flops_per_token(const mst_model_config* c);

/* Element offsets of one transformer layer's parameters in the flat buffers. */
typedef struct mst_layer_params {
    int64_t ln1;   /* [H] input_layernorm                                    */
    int64_t wqkv;  /* [(NH + 2 KV) D, H]: q_proj rows, then k_proj, v_proj    */
    int64_t q_norm;/* [D]                                                     */
    int64_t k_norm;/* [D]                                                     */
    int64_t wo;    /* [H, NH D] o_proj                                        */
    int64_t ln2;   /* [H]           */
    int64_t wr;    /* [E, H] router */
    int64_t w1;    /* [E*2F, H]: expert e's rows [2F e, 2F e + F) gate_proj,
                      then F rows up_proj                                     */
    int64_t w2;    /* [E*H, F]: expert e's [H, F] down_proj                   */
} mst_layer_params;

/* Saved activations and routing plan of one layer for one microbatch. */
typedef struct mst_layer_acts {
    const uint16_t* in;  /* [N, H] the layer's input (another buffer, not owned) */
    uint16_t* a;         /* [N, H] norm1 output                             */
    float* rstd1;        /* [N]                                             */
    uint16_t* qkv;       /* [N, Wq] q|k|v projection output (before QK-norm
                            and rotation: the backward reruns qk_forward)   */
    float* rstdqk;       /* [N, NH + KV] QK-norm's 1 / rms per head         */
    float* attp;         /* [B, NH, T, T] attention probabilities (NULL: flash) */
    float* lse;          /* [B, NH, T] attention row logsumexp (flash; else NULL) */
    uint16_t* att;       /* [N, NH D] attention output (before Wo)          */
    uint16_t* x1;        /* [N, H] residual after attention                 */
    uint16_t* b;         /* [N, H] norm2 output (router and MLP input)      */
    float* rstd2;        /* [N]                                             */
    float* rlogits;      /* [N, E] router logits                            */
    float* rprobs;       /* [N, E] router softmax                           */
    int32_t* topk_idx;   /* [N, k]                                          */
    float* topk_w;       /* [N, k]                                          */
    int32_t* pos;        /* [N, k] row in the [G*R] grouped rows, or -1     */
    int32_t* counts;     /* [E] rows per expert for the grouped MLP (W ranks:
                            the first El, this rank's, from dispatch)       */
    int32_t* load;       /* [E] token copies per expert (W ranks: summed over
                            the ranks): row l of mst_micro.loads             */
    const int32_t* loads;/* [n_loads, E] the loads the load-balancing loss of
                            this layer spans: the main layers' (rows [0, L) of
                            mst_micro.loads), or the MTP layer's own row L  */
    int32_t n_loads;     /* L, or 1 (the MTP layer)                         */
    float* aux;          /* [1] this layer's share of the load-balancing loss
                            (written by the backward)                       */
    uint16_t* out;       /* [N, H] the layer's output                       */
    mst_ep_handle_t* eph;/* W ranks: the routing of this (layer, microbatch)
                            from dispatch to the backward (NULL: one rank)   */
} mst_layer_acts;

/* One microbatch's activations. */
typedef struct mst_micro {
    int32_t* tok;            /* [3, N] inputs, next tokens, tokens after next
                                (in the step's static inputs)                 */
    uint16_t* x0;            /* [N, H] embedding of the inputs                */
    uint16_t* xf;            /* [N, H] final norm output                      */
    float* rstdf;            /* [N]                                           */
    uint16_t* e1;            /* [N, H] MTP: embedding of the next tokens      */
    uint16_t *ne, *nh;       /* [N, H] MTP: its norm / the last hidden's norm */
    float *rstd_e, *rstd_h;  /* [N]                                           */
    uint16_t* p;             /* [N, H] MTP projection output (layer L input)  */
    uint16_t* mf;            /* [N, H] MTP final norm output                  */
    float* rstd_mf;          /* [N]                                           */
    uint16_t *dl_main, *dl_mtp; /* [N, V] d(loss)/d(logits)                   */
    uint16_t* dh;            /* [N, H] gradient flowing down the main layers  */
    uint16_t* de1;           /* [N, H] P > 1: d(e1), from the last stage back to
                                stage 0 (stage.c)                             */
    int32_t* loads_bwd;      /* [L+1, E] P > 1: the router loads of a backward
                                message                                        */
    int32_t* loads;          /* [L+1, E] each layer's router loads (the main
                                layers' load-balancing loss spans rows [0, L)) */
    mst_layer_acts* acts;    /* [L+1]                                         */
} mst_micro;

/* Memory by category, bytes (backend memory the model allocated itself).
 * Saved activations by kind: a layer's attention (qkv, probabilities,
 * output), norms and residuals (norm outputs, rstd, x1, the layer output),
 * router (logits, probs, top-k, positions, counts); the main path's
 * embedding and head (tokens, x0, final norm, d logits); the MTP module
 * (its norms, projection, head and its transformer layer, whatever kind).
 * RECOMPUTE: the shared activations that recomputed layers run in. */
enum {
    MST_MEM_WEIGHTS = 0, MST_MEM_GRADS, MST_MEM_OPTIM, MST_MEM_SAVED_ATTN, MST_MEM_SAVED_NORM,
    MST_MEM_SAVED_ROUTER, MST_MEM_SAVED_HEAD, MST_MEM_SAVED_MTP, MST_MEM_RECOMPUTE, MST_MEM_COMPUTE, MST_N_MEM
};

/* A replicated run [lo, lo + n) of the flat parameters over the W
 * data-parallel ranks (shard.c): a body of W blocks of q elements (q a
 * multiple of 4, W q <= n), rank r's block [lo + r q, lo + (r + 1) q), and a
 * tail [lo + W q, lo + n) of fewer than 4 W elements. Sharded: the body's
 * gradients reduce-scattered and its bf16 weights all-gathered, the tail's
 * gradients all-reduced and its state on every rank. */
typedef struct mst_optim_run {
    int64_t lo, n, q;
} mst_optim_run;

/* Elements [lo, lo + n) of the flat buffers (w, grad) have their master
 * weights and moments at [at, at + n) of the state buffers (master, adam_m,
 * adam_v); decay: a matrix (weight decay). Unsharded: at == lo. */
typedef struct mst_optim_part {
    int64_t lo, n, at;
    int32_t decay;
} mst_optim_part;
enum { MST_OPTIM_MAX_PARTS = 6, MST_GNORM_COLS = 4 }; /* parts: a tied table (P stages), 2 per run, the experts */
enum { MST_MODEL_NEEDS = 64 }; /* the most needs a memory manager shares over the ranks */

typedef struct mst_model {
    mst_ctx_t* ctx;
    const mst_model_backend* ops; /* ctx's model ops (mst_model_backend_of)     */
    mst_model_config cfg;
    int32_t attn;            /* attention run (mst_model_attention): FLASH or
                                CUDNN (the flash contract: att, lse saved), or
                                CUBLAS (the probabilities: attp saved)        */
    char attn_note[256];     /* why AUTO took the probabilities ("" if not)   */
    mst_mem_config mem_cfg;
    /* (optional) called after each schedule entry of a step, eagerly (the
     * memory picture of --timeline); NULL in every other step */
    mst_status (*after_entry)(struct mst_model* m, int32_t entry, void* user);
    void* after_entry_user;
    mst_dist dist;           /* ranks (dist.ep NULL: one rank)                */
    /* the pipeline stage (stage.c): main layers [l_first, l_end) here, and
     * on the last stage the MTP layer L, the final norm and the head; the
     * embedding on stage 0. One stage: every layer. Layers not here have
     * every offset of lp[l] -1 and no activations. */
    int32_t stage, stages;   /* s, P                                          */
    int32_t l_first, l_end;  /* s L / P, (s + 1) L / P                        */
    int32_t n_here;          /* layers here: l_end - l_first, +1 (MTP) on the
                                last stage; the memory manager's layers       */
    int64_t n_tied;          /* P > 1, tied embeddings: V H on stage 0 and the
                                last (the table at [0, V H), its gradient
                                summed over the grid), else 0                 */
    float* tied_zero;        /* [V H] zeros: a middle stage's share of that sum */
    int32_t lpv;             /* interleaved (V > 1): layers a virtual stage,
                                (L + 1) / (P V); 0 otherwise                  */
    int32_t n_local;         /* El: experts held here (E, or E / W)           */
    int32_t row_groups;      /* groups whose rows are here (G, or 1 on W ranks) */
    int64_t max_rows;        /* R in use now (static, or exact on a rerun)     */
    int64_t static_rows;     /* R from the capacity factor                    */
    int32_t n_micro;         /* M                                             */
    /* parameters: one flat buffer per kind, matrices first (decayed) */
    int64_t n_params, n_decay;
    int64_t n_dense;         /* W ranks: [0, n_dense) replicated matrices, then
                                this rank's experts up to n_decay (one rank:
                                n_decay, the experts among the matrices)      */
    int64_t emb, lnf, ln_e, ln_h, proj, ln_mf; /* offsets: [V,H] [H] [H] [H] [H,2H] [H] */
    int64_t head;            /* [V,H] lm_head (== emb when tie_embeddings)     */
    mst_layer_params* lp;    /* [L+1]                                         */
    uint16_t* w;             /* [n_params] bf16 weights                       */
    float* grad;             /* [n_params] fp32 main_grad                     */
    /* optimizer state: the parts (shard.c) of the flat parameters this rank
     * updates, at their offsets `at` in the state buffers:
     * sum of parts' n <= n_state <= n_params */
    float* master;           /* [n_state] fp32 master weights                 */
    void* adam_m;            /* [n_state] fp32, or bf16 (mem_cfg.moments_bf16) */
    void* adam_v;            /* [n_state] likewise                            */
    int64_t n_state;
    mst_optim_part opt_part[MST_OPTIM_MAX_PARTS];
    int32_t n_opt_parts;
    int32_t opt_shard;       /* 1: the replicated runs sharded (W ranks)       */
    mst_optim_run rep[2];    /* W ranks: the replicated matrices [0, n_dense)
                                and norm weights [n_decay, n_params)          */
    struct mst_overlap* ov;  /* --overlap on: their sums' buckets (overlap.h) */
    float* gsumsq;           /* [1] sum of squared gradients                  */
    float* gpartial;         /* [MST_SUMSQ_PARTS] its chunk sums              */
    int32_t* peak;           /* [L+1, G] peak rows per group over the run     */
    int32_t* peak_local;     /* [1] W ranks: route_forward's peak (unused)    */
    double* needs;           /* [MST_MODEL_NEEDS] W ranks or P stages: host
                                values while summed over the ranks (the memory
                                manager's needs, mst_model_allreduce_host): kept,
                                so that nothing allocates between collectives */
    float* gnorm_rows;       /* [W, MST_GNORM_COLS] W ranks: each rank's shares
                                of the squared gradient norm (shard.c)         */
    /* the step's static inputs: what changes between two steps, copied in
     * before each (a captured step reads them at the same addresses) */
    void* inputs;            /* backend: tokens [M, 3, N] int32, then hyper   */
    float* hyper;            /* [MST_N_HYPER] in inputs: lr, bias corrections */
    void* staging[2];        /* host (pinned) copies of inputs, filled in turn */
    size_t inputs_bytes;
    /* the record the host reads after a step (mst_step_record) */
    void* record;            /* backend: [1] mst_step_record                  */
    void* graph;             /* the step captured (backend graph) or NULL     */
    int graph_warm;          /* a sized step ran eagerly since the last
                                measuring step or max_rows change             */
    /* activations */
    mst_micro* micro;        /* [M] each microbatch's view of its activation set */
    mst_micro* sets;         /* [n_sets] the activation sets: a microbatch holds
                                one from its first forward to its last backward,
                                so there are as many as the schedule has
                                microbatches in flight (1F1B on one stage: 1) */
    int32_t n_sets;
    float *loss_main, *loss_mtp; /* [M, N] per-token losses                   */
    float* aux_sum;          /* [M, L+1] load-balancing losses                */
    /* the memory manager of the grouped MLP's saved activations */
    mst_memmgr_t* mm;        /* active: mm_static, or one for exact shapes    */
    mst_memmgr_t* mm_static; /* sized for R = static_rows                     */
    mst_sched_entry* sched;  /* [n_sched]                                     */
    int32_t n_sched, layers_per_chunk;
    /* compute buffers shared by layers */
    uint16_t* logits;        /* [N, V]                                        */
    uint16_t *yrows, *drows, *dxrows; /* [G*R, H]                             */
    float* dprow;            /* [G*R] gradients of the rows' router probs     */
    float* dtopk;            /* [N, k]                                        */
    uint16_t* drl;           /* [N, E] d(router logits)                       */
    int32_t* emb_order;      /* [mst_embed_order_len(N)] embedding backward scratch */
    uint16_t* qkvr;          /* [N, Wq] q|k|v after QK-norm and rotation
                                (attention's input); backward: d(qkv)          */
    uint16_t* dqkv;          /* [N, Wq] d(qkvr)                                */
    uint16_t* datt;          /* [N, NH D] d(attention output)                  */
    float* att32;            /* [B, NH, T, T] attention scratch (probabilities
                                contract, ops->attn_scratch)                  */
    uint16_t* att16;         /* [B, NH, T, T] likewise                        */
    float* att_delta;        /* [B, NH, T] flash backward scratch             */
    uint16_t *dm, *t1, *t2, *t3; /* [N, H] gradient and scratch               */
    size_t mem[MST_N_MEM];   /* bytes allocated by category                   */
    size_t mem_keep[MST_N_MEM]; /* the same with every layer keeping its
                                   activations (no recompute): the reference   */
    int32_t* chunk_start;    /* [L+1] recompute chunk of each layer, -1: kept  */
    int32_t full;            /* layers in chunks recompute whole (full)       */
    mst_layer_acts* slots;   /* [n_slots] activations recomputed layers run in:
                                layer l in slot l - chunk_start[l]             */
    int32_t n_slots;
    mst_micro mtp_slot;      /* the MTP module's activations when recomputed  */
    void** owned;            /* [n_owned] backend buffers freed by destroy    */
    int n_owned, cap_owned;
} mst_model;

/* ---- pipeline stage (stage.c) ---- */
/* Sets m's stage fields for stage `stage` of `stages` (m->cfg set). */
void mst_model_set_stage(mst_model* m, int32_t stage, int32_t stages);
/* 1: layer l (0 .. L) is on this stage. */
int mst_model_here(const mst_model* m, int32_t l);
/* Layer l here -> its index among the stage's layers (the memory
 * manager's), and back. */
int32_t mst_model_local(const mst_model* m, int32_t l);
int32_t mst_model_global(const mst_model* m, int32_t i);
/* Chunk c's input when another stage sends it: the layer before the
 * chunk's first, whose output acts[l].out ([N, H] a set, saved norm bytes)
 * receives it; -1 when that layer is here or the chunk starts at layer 0. */
int32_t mst_stage_received(const mst_model* m, int32_t c);
/* A recompute plan over the L+1 layers (chunk_start [L+1], each -1 or the
 * first layer of l's chunk) as the stage's manager takes it: local [n_here]
 * of local indices. A chunk that starts on another stage is refused. */
mst_status mst_stage_local_plan(const mst_model* m, const int32_t* chunk_start, int32_t* local);
/* This rank in the grid (stage W + rank) and the grid's ranks (P W). */
int32_t mst_model_grid_rank(const mst_model* m);
int32_t mst_model_grid_size(const mst_model* m);
/* The stage that holds layer `layer` (0 .. L; -1: the embedding when
 * `first`, else the final norm or head). */
int32_t mst_model_stage_of(const mst_model* m, int32_t layer, int first);
/* Schedule entry i's transfers between stages: before it, the receive it
 * needs unless the entry before it received it; after it, its send, grouped
 * with the next entry's receive when that one goes the other way (Megatron's
 * pairing). One stage: nothing. */
mst_status mst_stage_before(mst_model* m, int32_t i);
mst_status mst_stage_after(mst_model* m, int32_t i);
/* P > 1, tied embeddings: the table's gradient summed over the grid (stage
 * 0's and the last stage's copies; the others add zeros). */
mst_status mst_stage_share_tied(mst_model* m);
/* Elements at the start of the flat buffers this stage leaves out of the
 * gradient norm (the last stage's copy of a tied table: stage 0 counts it). */
int64_t mst_stage_norm_skip(const mst_model* m);
/* P > 1: m->gsumsq, the stage's, becomes the sum over the stages. */
mst_status mst_stage_norm_sum(mst_model* m);

/* ---- parameters (params.c) ---- */
/* Offsets of every parameter (m->cfg, m->n_local, m->dist) into m: emb,
 * head, lp, n_dense, n_decay, n_params, ... */
void mst_model_layout(mst_model* m);
/* p [n_params] host fp32: the initial weights of seed cfg.seed. */
void mst_model_init_params(const mst_model* m, float* p);

/* mem: NULL for mst_mem_config_default(). */
mst_status mst_model_create(mst_ctx_t* ctx, const mst_model_config* cfg, int32_t n_micro,
                            const mst_mem_config* mem, mst_model** out);
/* The same as rank dist->rank of dist->world (dist NULL or dist->ep NULL:
 * one rank). Collective on W ranks. */
mst_status mst_model_create_dist(mst_ctx_t* ctx, const mst_model_config* cfg, int32_t n_micro,
                                 const mst_mem_config* mem, const mst_dist* dist, mst_model** out);
/* dist (NULL, or no communicator: one rank) checked against its
 * communicators, the grid (stage.c) and the model's groups, into *out
 * (stages 0 read as 1). dist.c, with the sums below. */
mst_status mst_model_dist_check(const mst_model_config* cfg, const mst_mem_config* mem, const mst_dist* dist,
                                mst_dist* out);
/* W ranks: all-reduces count elements of backend memory over the ranks (one
 * rank: nothing). */
mst_status mst_model_allreduce(mst_model* m, void* data, int64_t count, mst_ep_reduce kind);
/* The same over every rank of the grid (dist.pipe; one stage: dist.ep). */
mst_status mst_model_allreduce_world(mst_model* m, void* data, int64_t count, mst_ep_reduce kind);
/* The same on count elements of host memory, in pieces through m->needs
 * (elementwise: the bits of one call); world: over every rank of the grid
 * (mst_model_allreduce_world). No backend allocation: ranks as threads over
 * NCCL hang when one frees or allocates while another waits in a kernel. */
mst_status mst_model_allreduce_host(mst_model* m, void* host, int64_t count, mst_ep_reduce kind);
mst_status mst_model_allreduce_host_world(mst_model* m, void* host, int64_t count, mst_ep_reduce kind);
/* W ranks: v [n] host doubles -> each its max over the ranks (through the
 * backend; sizes and bytes below 2^53 stay exact); one rank: nothing. */
mst_status mst_model_max_over_ranks(mst_model* m, double* v, int64_t n);
void mst_model_destroy(mst_model* m);
/* Sizes every group to R rows (a memory manager of its own when R is not
 * the static R; its first step must be measuring). */
mst_status mst_model_set_max_rows(mst_model* m, int64_t max_rows);

/* Fills host staging slot `slot` (0 or 1) of the step's static inputs:
 * host_tok [M, B, T+2] (B windows of T+2 bytes per microbatch; each token
 * checked against the vocabulary) and the AdamW values of the step. */
mst_status mst_model_stage(mst_model* m, int slot, const int32_t* host_tok, const float hyper[MST_N_HYPER]);
/* Copies staging slot `slot` into the static inputs, not waited for (after
 * what the context's stream holds; the slot may be refilled once the next
 * step's record was read). */
mst_status mst_model_upload(mst_model* m, int slot);

/* One step's forward and backward passes over M microbatches along the
 * schedule, on the static inputs; gradients (zeroed first) accumulate into
 * main_grad. measuring: the memory manager's measuring step (the first, and
 * reruns). Allocates, syncs and reads nothing on the host unless measuring,
 * so a sized step can be captured. */
mst_status mst_model_step(mst_model* m, int measuring);

/* Peak rows per group over the run, [L+1, G] host (reads device stats). */
mst_status mst_model_peak_rows(mst_model* m, int32_t* peak);

/* ---- optimizer (optim.c) ---- */
typedef struct mst_optim_config {
    float lr, min_lr_frac, beta1, beta2, eps, weight_decay, clip;
    int64_t warmup, steps;
} mst_optim_config;
float mst_optim_lr(const mst_optim_config* o, int64_t step);
/* Zeroes main_grad (start of a step). */
mst_status mst_optim_zero(mst_model* m);
/* The AdamW values of step `step` (1-based): lr, 1 - beta1^step, 1 - beta2^step. */
void mst_optim_hyper(const mst_optim_config* o, int64_t step, float hyper[MST_N_HYPER]);
/* Clip by global norm and AdamW with the step's values from the static
 * inputs; skipped on the device when the step's error flag is set. */
mst_status mst_optim_step(mst_model* m, const mst_optim_config* o);

/* ---- the optimizer state over the data-parallel ranks (shard.c) ---- */
/* The model's data-parallel communicator, this rank in it and its size
 * (NULL, 0, 1: one rank). */
mst_ep_t* mst_model_dp(const mst_model* m, int32_t* rank, int32_t* world);
/* The replicated runs, the parts and n_state of m (after the layout;
 * m->mem_cfg.optimizer_shard and the ranks decide). */
void mst_optim_layout(mst_model* m);
/* Bytes of one element of state buffer k (0 master, 1 adam_m, 2 adam_v). */
size_t mst_optim_state_elem(const mst_model* m, int k);
/* Host [n] fp32 -> state buffer k at flat elements [off, off + n): the
 * parts of them this rank holds (bf16 moments: rounded to nearest even,
 * exact for values a bf16 state gave). */
mst_status mst_optim_state_put(mst_model* m, int k, int64_t off, int64_t n, const float* host);
/* Sharded: state k of the replicated runs all-gathered (collective, every
 * rank; through main_grad, which is zeroed after: call between steps) into
 * host [rep[0].n + rep[1].n] fp32 on the ranks that pass one (NULL: take
 * part only). Unsharded: nothing (every rank holds the runs). */
mst_status mst_optim_gather_runs(mst_model* m, int k, float* host);
/* State k at flat elements [off, off + n) into host [n] fp32 (bf16 moments
 * widened): from this rank's parts, and, sharded, elements of the
 * replicated runs from runs (mst_optim_gather_runs'; NULL: only the parts
 * here). MST_ERR_STATE for an element this rank cannot give. */
mst_status mst_optim_state_get(mst_model* m, int k, int64_t off, int64_t n, const float* runs, float* host);
/* W ranks: the replicated gradients summed over the ranks (sharded: the
 * bodies reduce-scattered, the tails all-reduced; else all-reduced). */
mst_status mst_optim_share_grads(mst_model* m);
/* The squared gradient norm into m->gsumsq, every rank the same bits (W
 * ranks: the same order sharded or not). */
mst_status mst_optim_grad_sumsq(mst_model* m);
/* W ranks, sharded: the bodies' bf16 weights all-gathered. */
mst_status mst_optim_gather_weights(mst_model* m);
/* Bytes of optimizer state this rank holds for the replicated parameters,
 * and what it would hold unsharded (0, 0 on one rank). */
void mst_optim_replicated_bytes(const mst_model* m, size_t* held, size_t* whole);

/* ---- the whole optimizer step (step.c) ---- */

/* What the host reads after a step: its error flag and its loss sums. */
typedef struct mst_step_record {
    int32_t flag;            /* MST_FLAG_* bits raised in the step            */
    int32_t unused;
    double loss_main;        /* sum of the [M, N] next-token losses           */
    double loss_mtp;         /* sum of the [M, N] MTP losses                  */
    double aux;              /* sum of the [M, L+1] load-balancing losses     */
} mst_step_record;

/* One optimizer step on the static inputs, run eagerly: mst_model_step,
 * clip + AdamW (mst_optim_step), then the record. A measuring step drops
 * the captured graph (it may resize what the graph points at). */
mst_status mst_step_run(mst_model* m, const mst_optim_config* o, int measuring);
/* One sized step replayed from its graph, captured first when there is
 * none. Until a sized step has run eagerly since the last measuring step
 * (ops size their workspaces on first use), and on a backend without
 * capture, the step runs eagerly instead. *captured: 1 when this call
 * captured the step. */
mst_status mst_step_replay(mst_model* m, const mst_optim_config* o, int* captured);
/* The record of the last step (waits for it). */
mst_status mst_step_read(mst_model* m, mst_step_record* r);
/* Forward and backward of the staged inputs without the optimizer (held-out
 * evaluation): the record's losses; the weights and optimizer state do not
 * change. Eager. measuring: a measuring step (drops the step graph). */
mst_status mst_step_eval(mst_model* m, int measuring);
/* Forgets the captured graph (buffers it points at change). */
void mst_step_drop_graph(mst_model* m);
/* W ranks: main_grad of the replicated parameters summed over the ranks, in
 * two buckets (the matrices [0, n_dense), then the norm weights), after the
 * whole backward (a step with --overlap on starts a bucket per layer during
 * the backward instead: overlap.c; the same bits); the experts' are this
 * rank's own. One rank: nothing. */
mst_status mst_step_share_grads(mst_model* m);
/* The fp32 elements mst_step_share_grads sums (both buckets). */
int64_t mst_step_shared_grads(const mst_model* m);

#endif
