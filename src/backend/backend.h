/*
 * backend.h — the private interface between backend-independent code and the
 * backends: a struct of function pointers. Members marked (optional) may be
 * NULL; the caller then returns MST_ERR_UNSUPPORTED.
 *
 * Every op takes one argument struct that both backends read the same way, so
 * the CPU backend is the reference the CUDA backend is checked against.
 * Arguments reaching a backend are already validated (shapes, dtypes, null
 * pointers); only what lives in backend memory (counts) is checked there.
 */
#ifndef MST_BACKEND_H
#define MST_BACKEND_H

#include "moestash.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Inline functions shared by the CPU reference (C11) and the CUDA kernels. */
#ifdef __CUDACC__
#define MST_HD static __host__ __device__ __forceinline__
#else
#define MST_HD static inline
#endif

/* Bits of the context's device error flag (int32 in backend memory). */
enum {
    MST_FLAG_COUNTS = 1,   /* an op saw negative counts or counts past max_rows */
    MST_FLAG_OVERFLOW = 2, /* a stash pool ran out of pages                     */
};

/* Row r of a paged tensor (rows of row_bytes): its address, or NULL when it
 * is past the table or its page id past its block (the row reads as zeros). */
MST_HD const char* mst_paged_row(const mst_pages* pg, int64_t r, int64_t row_bytes) {
    if (r >= pg->table_rows) return 0;
    const uint32_t id = pg->table[r / pg->page_rows];
    const int b = (int)(id >> 31);
    const int64_t i = (int64_t)(id & 0x7fffffffu);
    if (i >= pg->n_pages[b]) return 0;
    return (const char*)pg->block[b] + (i * pg->page_rows + r % pg->page_rows) * row_bytes;
}

typedef enum mst_copy_dir { MST_COPY_H2B, MST_COPY_B2H, MST_COPY_B2B } mst_copy_dir;

/* One grouped-linear call: forward, dgrad or wgrad (fields not used by an op
 * are NULL). Rows of group g are [off[g], off[g] + counts[g]). */
typedef struct mst_gl_args {
    int32_t n_groups;       /* E                                             */
    int64_t max_rows;       /* R: static row capacity of x, y, dy, dx         */
    int64_t in;             /* I                                             */
    int64_t out;            /* O                                             */
    const int32_t* counts;  /* [E] backend memory                            */
    const uint16_t* x;      /* [R, I] bf16 (forward, wgrad)                  */
    const mst_pages* x_pages; /* wgrad: x's rows in these pages (x unused), or NULL */
    const uint16_t* w;      /* [E, O, I] bf16 (forward, dgrad)               */
    const uint16_t* bias;   /* [E, O] bf16 (optional: forward, wgrad dscale) */
    const float* scale;     /* [R] fp32 (optional: forward, wgrad dbias)     */
    const uint16_t* dy;     /* [R, O] bf16 (dgrad, wgrad)                    */
    uint16_t* y;            /* [R, O] bf16 (forward)                         */
    uint16_t* dx;           /* [R, I] bf16 (dgrad)                           */
    float* main_grad_w;     /* [E, O, I] fp32 (wgrad)                        */
    float* main_grad_b;     /* [E, O] fp32 (optional: wgrad)                 */
    float* dscale;          /* [R] fp32 (optional: wgrad, needs bias)        */
    int accumulate;         /* wgrad: 0 = overwrite, 1 = add into main_grad  */
} mst_gl_args;

/* grouped MLP activation: z = act(h) * p forward; dh, dprobs backward.
 * Row-wise over rows [0, sum(counts)); rows past the sum are untouched. */
typedef struct mst_act_args {
    int32_t n_groups;       /* E                                              */
    int64_t max_rows;       /* R: static row capacity of h, z, dz, dh         */
    int64_t ffn;            /* F                                              */
    int64_t hidden;         /* H: width of dy and b2 (backward with b2)       */
    const int32_t* counts;  /* [E] backend memory                             */
    const uint16_t* h;      /* [R, 2F] bf16 fc1 output [a | b]                */
    mst_pages h_pages;      /* table NULL: h in memory; else h's rows in these
                               pages (a stashed act_input read in place)      */
    const float* probs;     /* [R] fp32 router prob p                         */
    uint16_t* z;            /* [R, F] bf16 out (forward)                      */
    mst_pages h_out, z_out; /* forward, table NULL: none; else h and z are also
                               written into these pages (claimed stashes)      */
    const uint16_t* dz;     /* [R, F] bf16 in (backward)                      */
    uint16_t* dh;           /* [R, 2F] bf16 out (backward)                    */
    float* dprobs;          /* [R] fp32 out (backward): dz . act(h) (+ dy . b2[g]) */
    const uint16_t* dy;     /* [R, H] bf16 (backward, optional: with b2)      */
    const uint16_t* b2;     /* [E, H] bf16 (backward, optional): fc2 bias term */
    mst_activation act;     /* SwiGLU or clamped SwiGLU                       */
    float limit;            /* L (clamped)                                    */
    float alpha;            /* sigmoid slope (clamped)                        */
} mst_act_args;

/* Row r of a paged tensor the op writes (mst_paged_row); NULL: not written. */
MST_HD uint16_t* mst_paged_out_row(const mst_pages* pg, int64_t r, int64_t row_bytes) {
    return pg->table ? (uint16_t*)mst_paged_row(pg, r, row_bytes) : 0;
}

/* Row r of h [2F]: in memory or in its page; NULL: a row that reads as zeros. */
MST_HD const uint16_t* mst_act_h_row(const mst_act_args* a, int64_t r) {
    if (!a->h_pages.table) return a->h + r * 2 * a->ffn;
    return (const uint16_t*)mst_paged_row(&a->h_pages, r, 4 * a->ffn);
}

/* ---- model ops: argument structs (the trainer's transformer, src/model/) ---- *
 * Row-major everywhere; bf16 storage, fp32 accumulation, bf16 rounding on
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
typedef struct mst_embed_args {
    int64_t n_tok, vocab, cols; /* N, V, H                                   */
    const int32_t* tokens; /* [N] int32 in [0, V)                            */
    const uint16_t* table; /* [V, H] bf16 (forward)                          */
    uint16_t* x;           /* [N, H] bf16 (forward)                          */
    const uint16_t* dx;    /* [N, H] bf16 (backward)                         */
    float* dtable;         /* [V, H] fp32 main_grad (backward, +=)           */
    int32_t* order;        /* [V + 1 + N] scratch (backward): token ids
                              bucketed by vocabulary entry, in token order   */
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

/* Causal multi-head attention, heads of width D = H / n_head;
 * qkv row t = [q | k | v], head h at columns [h D, (h+1) D) of each part. */
typedef struct mst_attn_args {
    int64_t batch, seq, n_head, head_dim; /* B, T, NH, D                     */
    const uint16_t* qkv;   /* [B*T, 3H] bf16                                 */
    float* probs;          /* [B, NH, T, T] fp32 softmax (saved by forward,
                              read by backward)                              */
    uint16_t* out;         /* [B*T, H] bf16 (forward)                        */
    const uint16_t* dout;  /* [B*T, H] bf16 (backward)                       */
    uint16_t* dqkv;        /* [B*T, 3H] bf16 (backward)                      */
    float* scratch32;      /* [B, NH, T, T] fp32 scratch (CUDA: dP)          */
    uint16_t* scratch16;   /* [B, NH, T, T] bf16 scratch (CUDA: P, dS)       */
} mst_attn_args;

/* Router: softmax over E experts, top-k (ties to the lower index), the
 * dropless plan into G groups of E/G experts (groups packed in order into
 * one [G*R] grouped-rows buffer, each group limited to R rows; rows ordered
 * by expert, then token, then slot), and the load-balancing loss
 * coef * E * sum_e f_e P_e
 * (f_e = load_e / (N k), P_e = mean_t probs[t][e]). A group with more than R
 * rows is over budget: its counts are zeroed, its positions set to -1, and
 * MST_FLAG_COUNTS raised in `flag`; nothing is written past the buffers. */
typedef struct mst_route_args {
    int64_t n_tok;         /* N                                              */
    int32_t n_experts, top_k, n_groups; /* E, k, G (E % G == 0)             */
    int64_t max_rows;      /* R: rows of each group's grouped-rows buffer    */
    float aux_coef;
    const float* logits;   /* [N, E] fp32                                    */
    float* probs;          /* [N, E] fp32 softmax                            */
    int32_t* topk_idx;     /* [N, k] int32 expert ids                        */
    float* topk_w;         /* [N, k] fp32 probs of the chosen experts        */
    int32_t* pos;          /* [N, k] int32 row in [0, sum(counts)), or -1    */
    int32_t* counts;       /* [E] int32 rows per expert for the grouped MLP  */
    int32_t* load;         /* [E] int32 token copies routed to each expert   */
    int32_t* peak_rows;    /* [G] int32 max over calls of each group's rows  */
    float* aux_loss;       /* [1] fp32                                       */
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

/* Sum of squares of n fp32 values into out [1], in a fixed order: the sums
 * of MST_SUMSQ_PARTS contiguous chunks of ceil(n / parts) values, added in
 * chunk order. */
enum { MST_SUMSQ_PARTS = 1024 };
typedef struct mst_sumsq_args {
    int64_t n;
    const float* x;        /* [n] fp32                                       */
    float* partial;        /* [MST_SUMSQ_PARTS] fp32 scratch                 */
    float* out;            /* [1] fp32                                       */
} mst_sumsq_args;

/* AdamW on fp32 master weights with the gradient scaled by
 * min(1, clip / sqrt(*grad_sumsq)); skipped entirely when *flag != 0 (the
 * step's results are invalid). Writes the bf16 copy of the new weights. */
typedef struct mst_adamw_args {
    int64_t n;
    float lr, beta1, beta2, eps, weight_decay, clip;
    int64_t step;          /* 1-based, for bias correction                   */
    float* master;         /* [n] fp32                                       */
    const float* grad;     /* [n] fp32 main_grad                             */
    float* m;              /* [n] fp32 first moment                          */
    float* v;              /* [n] fp32 second moment                         */
    uint16_t* w;           /* [n] bf16 weights used by forward and backward  */
    const float* grad_sumsq; /* [1] fp32 from sumsq over every gradient      */
    const int32_t* flag;   /* [1] the context's error flag                   */
} mst_adamw_args;

struct mst_stash_args; /* paged stash: src/stash/stash.h */

/* The side streams of the memory manager. */
enum {
    MST_SIDE_RING = 0, /* saves and page returns: every ring update, in order */
    MST_SIDE_COPY,     /* the copies of split restores                         */
    MST_N_SIDE,
};

typedef struct mst_backend {
    const char* name;
    /* Sets ctx->impl and ctx->desc; device is the CUDA device index. */
    mst_status (*init)(mst_ctx_t* ctx, int device);
    void (*shutdown)(mst_ctx_t* ctx);
    mst_status (*alloc)(mst_ctx_t* ctx, size_t n_bytes, void** out);
    void (*free)(mst_ctx_t* ctx, void* ptr);
    mst_status (*copy)(mst_ctx_t* ctx, void* dst, const void* src, size_t n_bytes, mst_copy_dir dir);
    mst_status (*fill)(mst_ctx_t* ctx, void* dst, int byte, size_t n_bytes);
    mst_status (*sync)(mst_ctx_t* ctx);
    void* (*get_stream)(mst_ctx_t* ctx);                 /* (optional) */
    mst_status (*set_stream)(mst_ctx_t* ctx, void* s);  /* (optional) */

    mst_status (*gl_forward)(mst_ctx_t* ctx, const mst_gl_args* a);
    mst_status (*gl_dgrad)(mst_ctx_t* ctx, const mst_gl_args* a);
    mst_status (*gl_wgrad)(mst_ctx_t* ctx, const mst_gl_args* a);
    /* (optional) 1 when gl_wgrad reads an x of width `in` (dy of width `out`)
     * from pages of page_rows rows as it is, with no memory of its own (a
     * graph-captured step cannot allocate); absent: never. */
    int (*gl_wgrad_pages)(mst_ctx_t* ctx, int64_t page_rows, int64_t in, int64_t out);

    /* model ops */
    mst_status (*mm)(mst_ctx_t* ctx, const mst_mm_args* a);
    mst_status (*norm_forward)(mst_ctx_t* ctx, const mst_norm_args* a);
    mst_status (*norm_backward)(mst_ctx_t* ctx, const mst_norm_args* a);
    mst_status (*add)(mst_ctx_t* ctx, const mst_add_args* a);
    mst_status (*embed_forward)(mst_ctx_t* ctx, const mst_embed_args* a);
    mst_status (*embed_backward)(mst_ctx_t* ctx, const mst_embed_args* a);
    mst_status (*xent)(mst_ctx_t* ctx, const mst_xent_args* a);
    mst_status (*attn_forward)(mst_ctx_t* ctx, const mst_attn_args* a);
    mst_status (*attn_backward)(mst_ctx_t* ctx, const mst_attn_args* a);
    mst_status (*route_forward)(mst_ctx_t* ctx, const mst_route_args* a);
    mst_status (*route_backward)(mst_ctx_t* ctx, const mst_route_args* a);
    mst_status (*rows_gather)(mst_ctx_t* ctx, const mst_rows_args* a);
    mst_status (*rows_sum)(mst_ctx_t* ctx, const mst_rows_args* a);
    mst_status (*sumsq)(mst_ctx_t* ctx, const mst_sumsq_args* a);
    mst_status (*adamw)(mst_ctx_t* ctx, const mst_adamw_args* a);

    /* grouped MLP activation */
    mst_status (*act_forward)(mst_ctx_t* ctx, const mst_act_args* a);
    mst_status (*act_backward)(mst_ctx_t* ctx, const mst_act_args* a);

    /* streams and events (memory manager); (optional): a backend without
     * them runs everything in program order. stream NULL = the context's
     * current stream; side_stream(ctx, MST_SIDE_*) is a stream of the
     * stash traffic. */
    void* (*side_stream)(mst_ctx_t* ctx, int which);                 /* (optional) */
    mst_status (*event_create)(mst_ctx_t* ctx, void** ev);           /* (optional) */
    void (*event_destroy)(mst_ctx_t* ctx, void* ev);                 /* (optional) */
    mst_status (*event_record)(mst_ctx_t* ctx, void* ev, void* stream); /* (optional) */
    mst_status (*stream_wait)(mst_ctx_t* ctx, void* stream, void* ev);  /* (optional) */

    /* paged stash (src/stash/stash.h): reserve + copy, copy + page return,
     * ring refill; host_alloc gives pinned host memory that the backend's
     * kernels can address (the host block of a pool). */
    mst_status (*stash_reset)(mst_ctx_t* ctx, const struct mst_stash_args* a);
    mst_status (*stash_save)(mst_ctx_t* ctx, const struct mst_stash_args* a);
    mst_status (*stash_restore)(mst_ctx_t* ctx, const struct mst_stash_args* a);
    mst_status (*host_alloc)(mst_ctx_t* ctx, size_t n_bytes, void** out);
    void (*host_free)(mst_ctx_t* ctx, void* ptr);
} mst_backend;

/* The backend of a kind, or NULL when it was not built in. */
const mst_backend* mst_backend_get(mst_backend_kind kind);
extern const mst_backend mst_backend_cpu;
#ifdef MST_HAVE_CUDA
extern const mst_backend mst_backend_cuda;
int mst_cuda_device_count(void);
#endif

#ifdef __cplusplus
}
#endif
#endif /* MST_BACKEND_H */
