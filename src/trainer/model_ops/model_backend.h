/*
 * model_backend.h — the trainer's model ops (src/trainer/): a function table
 * of its own beside the library's (backend.h), with the argument structs
 * both backends read the same way. The model reaches it through one door,
 * mst_model_backend_of(); the library never calls it.
 */
#ifndef MST_MODEL_BACKEND_H
#define MST_MODEL_BACKEND_H

#include <math.h>

#include "lib/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Row-major everywhere; bf16 storage, fp32 accumulation, bf16 rounding on
 * store. Every reduction runs in a fixed order (no floating-point atomics). */

/* C [m, n] (+)= op(A) [m, k] . op(B) [k, n]; op(X) = X^T when trans_x. */
typedef struct mst_mm_args {
    int trans_a, trans_b;  /* 0 or 1                                         */
    int64_t m, n, k;
    const uint16_t* a;     /* bf16, [m, k] (or [k, m] when trans_a), row stride lda */
    int64_t lda;
    const uint16_t* b;     /* bf16, [k, n] (or [n, k] when trans_b), row stride ldb */
    int64_t ldb;
    uint16_t* c16;         /* [m, n] bf16 out (row stride ldc), or NULL      */
    float* c32;            /* [m, n] fp32 out when c16 is NULL               */
    int64_t ldc;
    int accumulate;        /* 1: C += op(A) op(B) (fp32 sum, one rounding)   */
} mst_mm_args;

/* RMSNorm y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps). */
typedef struct mst_norm_args {
    int64_t rows, cols;    /* N, H                                           */
    float eps;
    const uint16_t* x;     /* [N, H] bf16                                    */
    const uint16_t* w;     /* [H] bf16                                       */
    uint16_t* y;           /* [N, H] bf16 (forward)                          */
    float* rstd;           /* [N] fp32 (written forward, read backward)      */
    const uint16_t* dy;    /* [N, H] bf16 (backward)                         */
    uint16_t* dx;          /* [N, H] bf16 (backward)                         */
    float* dw;             /* [H] fp32 main_grad, += sum over rows (backward) */
} mst_norm_args;

/* y = a + b, elementwise over n bf16 values (y may alias a or b). */
typedef struct mst_add_args {
    int64_t n;
    const uint16_t* a;     /* [n] bf16 */
    const uint16_t* b;     /* [n] bf16 */
    uint16_t* y;           /* [n] bf16 */
} mst_add_args;

/* Token embedding: x[t] = table[tokens[t]]; backward dtable[v] += sum of
 * dx[t] over t with tokens[t] = v, in token order. */
static inline int64_t mst_embed_order_len(int64_t n_tok) { return 3 * n_tok; }
typedef struct mst_embed_args {
    int64_t n_tok, vocab, cols; /* N, V, H                                   */
    const int32_t* tokens; /* [N] int32 in [0, V)                            */
    const uint16_t* table; /* [V, H] bf16 (forward)                          */
    uint16_t* x;           /* [N, H] bf16 (forward)                          */
    const uint16_t* dx;    /* [N, H] bf16 (backward)                         */
    float* dtable;         /* [V, H] fp32 main_grad (backward, +=)           */
    int32_t* order;        /* [mst_embed_order_len(N)] int32 scratch
                              (backward; CUDA: the tokens in (id, token) order) */
} mst_embed_args;

/* Softmax cross-entropy per row, forward and backward in one pass:
 * loss[r] = logsumexp(logits[r]) - logits[r][target[r]];
 * dlogits[r] = (softmax(logits[r]) - onehot(target[r])) * scale. */
typedef struct mst_xent_args {
    int64_t rows, vocab;   /* N, V                                           */
    float scale;           /* d(total loss) / d(loss[r])                     */
    const uint16_t* logits;/* [N, V] bf16                                    */
    const int32_t* targets;/* [N] int32 in [0, V)                            */
    float* loss;           /* [N] fp32                                       */
    uint16_t* dlogits;     /* [N, V] bf16                                    */
} mst_xent_args;

/* Causal grouped-query attention (Qwen3-MoE / Llama): NH query heads and
 * KV key-value heads (KV divides NH), each of width D (given, not H / NH);
 * query head h reads key-value head h / (NH / KV). A row t of qkv is
 * [q (NH D) | k (KV D) | v (KV D)], head h of each part at columns
 * [h D, (h+1) D) of that part; q and k arrive normed and rotated (qk_forward).
 * The backward's dk and dv of one key-value head sum the NH / KV query heads
 * that read it in head order (fixed order: no atomics).
 * Two contracts for what forward saves for backward:
 *   attn_forward / attn_backward: the probabilities (probs);
 *   attn_flash_*: nothing T x T: the output (out) and each row's logsumexp
 *   (lse); backward recomputes the probabilities from them. */
typedef struct mst_attn_args {
    int64_t batch, seq, n_head, head_dim; /* B, T, NH, D                     */
    int64_t n_kv_head;     /* KV (divides NH)                                */
    const uint16_t* qkv;   /* [B*T, (NH + 2 KV) D] bf16                      */
    float* probs;          /* [B, NH, T, T] fp32 softmax (attn_*: saved by
                              forward, read by backward)                     */
    float* lse;            /* [B, NH, T] fp32 log sum_j exp(q_i k_j / sqrt(D))
                              over j <= i (attn_flash_*: saved by forward,
                              read by backward)                              */
    uint16_t* out;         /* [B*T, NH D] bf16 (written by forward; attn_flash_
                              backward reads it)                             */
    const uint16_t* dout;  /* [B*T, NH D] bf16 (backward)                    */
    uint16_t* dqkv;        /* [B*T, (NH + 2 KV) D] bf16 (backward)           */
    float* delta;          /* [B, NH, T] fp32 scratch of attn_flash_backward:
                              rowsum(dout * out) per head                    */
    float* scratch32;      /* [B, NH, T, T] fp32 scratch, or NULL where the
                              table's attn_scratch is 0 (CUDA: dP)           */
    uint16_t* scratch16;   /* [B, NH, T, T] bf16 scratch, likewise (CUDA: P, dS) */
    int32_t nondeterministic; /* attn_cudnn_*: 1 lets the backward use an
                              engine that adds atomically (bench attn prices
                              determinism with it); 0: bit-identical runs  */
} mst_attn_args;

/* Qwen3's QK-norm and rotary position embedding, between the q/k/v
 * projection and attention. Forward, per token t at position t % T:
 *   q head h: y = rope(rmsnorm(x_h) * wq), k head g: y = rope(rmsnorm(x_g) * wk),
 *   v copied; rmsnorm over the head's D values (eps), its 1 / rms kept in rstd;
 *   rope (transformers' rotate-half pairing): for i < D/2,
 *   a = (float)pos * (1.0f / powf(theta, (float)(2 i) / (float)D)) in fp32 as
 *   transformers computes it, cos and sin in fp32 (precise, not fast-math),
 *   y[i] = u[i] cos a - u[i + D/2] sin a, y[i + D/2] = u[i + D/2] cos a + u[i] sin a.
 * All in fp32 from the bf16 input, one bf16 rounding on store.
 * Backward: dx from dy (v's part copied), dwq / dwk += sums over tokens and
 * heads in a fixed order (fp32). Rows as in mst_attn_args. */
typedef struct mst_qk_args {
    int64_t rows, seq;     /* N = B T tokens, T (position = row % T)         */
    int64_t n_head, n_kv_head, head_dim; /* NH, KV, D (D even)               */
    float eps;
    float theta;           /* rope_theta                                     */
    const uint16_t* x;     /* [N, (NH + 2 KV) D] bf16 projection output       */
    const uint16_t* wq;    /* [D] bf16 q_norm weight                         */
    const uint16_t* wk;    /* [D] bf16 k_norm weight                         */
    uint16_t* y;           /* [N, (NH + 2 KV) D] bf16 (forward)              */
    float* rstd;           /* [N, NH + KV] fp32 (written forward, read backward) */
    const uint16_t* dy;    /* [N, (NH + 2 KV) D] bf16 (backward)             */
    uint16_t* dx;          /* [N, (NH + 2 KV) D] bf16 (backward)             */
    float* dwq;            /* [D] fp32 main_grad, += (backward)              */
    float* dwk;            /* [D] fp32 main_grad, += (backward)              */
} mst_qk_args;

/* The rotary angles of the contract above on the host: cs [D] = the cos of
 * the D/2 angles of position pos, then their sin (the CPU op and the
 * sampler; the CUDA kernel rounds the same expressions once from double). */
static inline void mst_rope_angles(float theta, int64_t D, int64_t pos, float* cs) {
    for (int64_t i = 0; i < D / 2; i++) {
        const float ang = (float)pos * (1.0f / powf(theta, (float)(2 * i) / (float)D));
        cs[i] = cosf(ang);
        cs[D / 2 + i] = sinf(ang);
    }
}

/* Router (Qwen3-MoE): softmax over E experts, top-k (ties to the lower
 * index), the chosen probabilities divided by their sum when norm_topk
 * (topk_w: the weights that scale the experts' outputs), and the dropless
 * plan into G groups of E/G experts (groups packed in order into one [G*R]
 * grouped-rows buffer, each group limited to R rows; rows ordered by
 * expert, then token, then slot). A group with more than R rows is over
 * budget: its counts are zeroed, its positions set to -1, and
 * MST_FLAG_COUNTS raised in `flag`; nothing is written past the buffers.
 *
 * The load-balancing loss is transformers' load_balancing_loss_func over
 * the n_layers layers of one forward (attention mask None):
 *   aux = coef E sum_e (L_e / rows) (P_e / rows),  rows = n_layers N W,
 *   L_e = top-k hits of expert e, P_e = sum of the softmax probs of e, both
 *   over those layers' tokens on all W ranks.
 * It couples the layers (d aux / d probs[t][e] = coef E L_e / rows^2 for
 * every layer), so route_backward computes it, from the loads of every
 * layer it spans (`loads`, each summed over the ranks) and this layer's
 * probs: aux_loss = this layer's and rank's share, coef E sum_e
 * (L_e / rows) (sum_t probs[t][e] / rows) (the shares over the layers and
 * ranks add up to aux), and dlogits its gradient times grad_scale.
 *   route_forward: probs, topk_idx, topk_w, pos, counts, load (this call's
 *     N tokens), peak_rows;
 *   route_peak: peak_rows from `load` as given (on W ranks the caller sums
 *     the loads over the ranks between the two);
 *   route_backward: dlogits from dtopk_w (through the renormalisation) and
 *     the load-balancing term, through the softmax; aux_loss. */
typedef struct mst_route_args {
    int64_t n_tok;         /* N                                              */
    int32_t n_experts, top_k, n_groups; /* E, k, G (E % G == 0)             */
    int32_t norm_topk;     /* 1: topk_w renormalised to sum 1 (norm_topk_prob) */
    int64_t max_rows;      /* R: rows of each group's grouped-rows buffer    */
    float aux_coef;        /* coef (router_aux_loss_coef)                    */
    float grad_scale;      /* backward: d(total loss) / d(aux) (1 / M over M
                              microbatches)                                  */
    int32_t n_layers;      /* backward: layers the loss spans (>= 1)         */
    const int32_t* loads;  /* backward: [n_layers, E] int32 each layer's loads
                              (summed over the W ranks); this layer's among them */
    const float* logits;   /* [N, E] fp32                                    */
    float* probs;          /* [N, E] fp32 softmax                            */
    int32_t* topk_idx;     /* [N, k] int32 expert ids                        */
    float* topk_w;         /* [N, k] fp32 router weights of the chosen experts */
    int32_t* pos;          /* [N, k] int32 row in [0, sum(counts)), or -1    */
    int32_t* counts;       /* [E] int32 rows per expert for the grouped MLP  */
    int32_t* load;         /* [E] int32 token copies routed to each expert   */
    int32_t* peak_rows;    /* [G] int32 max over calls of each group's rows  */
    float* aux_loss;       /* [1] fp32 (backward: this layer's share)        */
    int32_t world;         /* W ranks whose tokens the loss spans (0 or 1:
                              this call's N)                                 */
    int32_t* flag;         /* [1] the context's error flag                   */
    const float* dtopk_w;  /* [N, k] fp32 (backward)                         */
    uint16_t* dlogits;     /* [N, E] bf16 (backward; aux-loss term included) */
} mst_route_args;

/* Token rows <-> grouped rows through pos [N, k] (entries < 0 skipped):
 * gather: dst[pos[t][s]] = src[t], dst_p[pos[t][s]] = src_p[t k + s];
 * sum:    dst[t] = sum over s of src[pos[t][s]] (slot order, fp32),
 *         dst_p[t k + s] = src_p[pos[t][s]] (0 when skipped). */
typedef struct mst_rows_args {
    int64_t n_tok;         /* N                                              */
    int32_t top_k;         /* k                                              */
    int64_t cols;          /* H                                              */
    const int32_t* pos;    /* [N, k] int32                                   */
    const uint16_t* src;   /* gather: [N, H]; sum: [G*R, H] bf16            */
    uint16_t* dst;         /* gather: [G*R, H]; sum: [N, H] bf16            */
    const float* src_p;    /* (optional) gather: [N, k]; sum: [G*R] fp32     */
    float* dst_p;          /* (optional) gather: [G*R]; sum: [N, k] fp32     */
} mst_rows_args;

/* Sum of squares of n fp32 values into out [1], in a fixed order: base
 * (when given), then the sums of MST_SUMSQ_PARTS contiguous chunks of
 * ceil(n / parts) values, added in chunk order (n <= parts: base + x[0] +
 * x[1] + ... in turn). plain: the values themselves, not their squares. */
enum { MST_SUMSQ_PARTS = 1024 };
typedef struct mst_sumsq_args {
    int64_t n;
    const float* x;        /* [n] fp32                                       */
    float* partial;        /* [MST_SUMSQ_PARTS] fp32 scratch                 */
    const float* base;     /* (optional) [1] fp32 added first; may be out    */
    float* out;            /* [1] fp32                                       */
    int32_t plain;         /* 1: sum x, not x^2                              */
} mst_sumsq_args;

/* Sum of n fp32 values into out [1] as float64 (the losses of a step,
 * summed on the backend so the host reads one small record), in the same
 * order on every backend: lane i < MST_SUM_LANES sums x[i], x[i + lanes],
 * ... in turn, then the lanes are added in lane order. */
enum { MST_SUM_LANES = 256 };
typedef struct mst_sum_args {
    int64_t n;
    const float* x;        /* [n] fp32                                       */
    double* out;           /* [1] float64                                    */
} mst_sum_args;

/* AdamW on fp32 master weights with the gradient scaled by
 * min(1, clip / sqrt(*grad_sumsq)); skipped entirely when *flag != 0 (the
 * step's results are invalid). Writes the bf16 copy of the new weights.
 * The moments are fp32, or bf16 (moments_bf16, as DeepSeek-V3 trains):
 * read as bf16, updated in fp32, the step's update taken from the fp32
 * values, stored rounded to nearest even.
 * The step's learning rate and bias corrections are read from backend
 * memory, so that a captured step replays with each step's values. */
enum { MST_HYPER_LR = 0, MST_HYPER_BC1, MST_HYPER_BC2, MST_N_HYPER };
typedef struct mst_adamw_args {
    int64_t n;
    float beta1, beta2, eps, weight_decay, clip;
    const float* hyper;    /* [MST_N_HYPER] fp32: lr, 1 - beta1^step,
                              1 - beta2^step (step 1-based)                 */
    float* master;         /* [n] fp32                                       */
    const float* grad;     /* [n] fp32 main_grad                             */
    void* m;               /* [n] fp32 (bf16: moments_bf16) first moment     */
    void* v;               /* [n] fp32 (bf16: moments_bf16) second moment    */
    int32_t moments_bf16;  /* 1: m and v are bf16                            */
    uint16_t* w;           /* [n] bf16 weights used by forward and backward  */
    const float* grad_sumsq; /* [1] fp32 from sumsq over every gradient      */
    const int32_t* flag;   /* [1] the context's error flag                   */
} mst_adamw_args;

typedef struct mst_model_backend {
    const char* name;
    /* capability: 1 when attn_forward / attn_backward use scratch32 and
     * scratch16 (the caller provides them); 0: they may be NULL */
    int attn_scratch;
    mst_status (*mm)(mst_ctx_t* ctx, const mst_mm_args* a);
    mst_status (*norm_forward)(mst_ctx_t* ctx, const mst_norm_args* a);
    mst_status (*norm_backward)(mst_ctx_t* ctx, const mst_norm_args* a);
    mst_status (*add)(mst_ctx_t* ctx, const mst_add_args* a);
    mst_status (*embed_forward)(mst_ctx_t* ctx, const mst_embed_args* a);
    mst_status (*embed_backward)(mst_ctx_t* ctx, const mst_embed_args* a);
    mst_status (*xent)(mst_ctx_t* ctx, const mst_xent_args* a);
    mst_status (*qk_forward)(mst_ctx_t* ctx, const mst_qk_args* a);
    mst_status (*qk_backward)(mst_ctx_t* ctx, const mst_qk_args* a);
    mst_status (*attn_forward)(mst_ctx_t* ctx, const mst_attn_args* a);
    mst_status (*attn_backward)(mst_ctx_t* ctx, const mst_attn_args* a);
    /* (optional) flash attention: whether it takes a's dims (MST_OK, or
     * MST_ERR_UNSUPPORTED with the reason), forward, backward */
    mst_status (*attn_flash_check)(mst_ctx_t* ctx, const mst_attn_args* a);
    mst_status (*attn_flash_forward)(mst_ctx_t* ctx, const mst_attn_args* a);
    mst_status (*attn_flash_backward)(mst_ctx_t* ctx, const mst_attn_args* a);
    /* (optional) cuDNN's fused attention under the flash contract (out and
     * lse saved; delta: its rowsum(dO O)): whether the library loads and
     * takes a's dims (MST_OK with its plans built and workspace sized, or
     * MST_ERR_UNSUPPORTED with the reason), forward, backward */
    mst_status (*attn_cudnn_check)(mst_ctx_t* ctx, const mst_attn_args* a);
    mst_status (*attn_cudnn_forward)(mst_ctx_t* ctx, const mst_attn_args* a);
    mst_status (*attn_cudnn_backward)(mst_ctx_t* ctx, const mst_attn_args* a);
    mst_status (*route_forward)(mst_ctx_t* ctx, const mst_route_args* a);
    mst_status (*route_backward)(mst_ctx_t* ctx, const mst_route_args* a);
    /* peak rows per group from `load` as given (route_forward computes
     * them itself; on W ranks the caller sums the loads over the ranks
     * between the two) */
    mst_status (*route_peak)(mst_ctx_t* ctx, const mst_route_args* a);
    mst_status (*rows_gather)(mst_ctx_t* ctx, const mst_rows_args* a);
    mst_status (*rows_sum)(mst_ctx_t* ctx, const mst_rows_args* a);
    mst_status (*sumsq)(mst_ctx_t* ctx, const mst_sumsq_args* a);
    mst_status (*adamw)(mst_ctx_t* ctx, const mst_adamw_args* a);
    mst_status (*sum)(mst_ctx_t* ctx, const mst_sum_args* a);

} mst_model_backend;

/* The door: the model ops of ctx's backend in *out, or MST_ERR_UNSUPPORTED
 * (message naming the backend) when it has none. */
mst_status mst_model_backend_of(const mst_ctx_t* ctx, const mst_model_backend** out);

extern const mst_model_backend mst_model_backend_cpu;
#ifdef MST_HAVE_CUDA
extern const mst_model_backend mst_model_backend_cuda;
/* Opens the cuDNN library `name` (NULL: $MST_CUDNN_LIB, else libcudnn.so.9),
 * checks it has the backend API of the major version built for and closes
 * it: MST_OK with its version (91900: 9.19.0), or MST_ERR_UNSUPPORTED naming
 * the library and why (dlopen's error, a missing symbol, another version,
 * a build without cuDNN's headers). */
mst_status mst_cudnn_probe(const char* name, size_t* version);
/* The cuDNN attention graph of a's dims (backward, a->nondeterministic)
 * built and finalized as an operation graph, which needs no GPU (cuDNN
 * checks every operation's shapes and types): MST_OK or why not. */
mst_status mst_cudnn_graph_check(const mst_attn_args* a, int backward);
#endif

#ifdef __cplusplus
}
#endif
#endif /* MST_MODEL_BACKEND_H */
