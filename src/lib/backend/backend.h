/*
 * backend.h — the private interface between the library's backend-independent
 * code and the backends: a struct of function pointers for memory, streams
 * and events, the grouped linear, the grouped MLP activation and the paged
 * stash. (The trainer's model ops have a table of their own:
 * model_backend.h.) Members marked (optional) may be NULL; MST_SLOT then
 * returns MST_ERR_UNSUPPORTED.
 *
 * Every op takes one argument struct that both backends read the same way, so
 * the CPU backend is the reference the CUDA backend is checked against.
 * Arguments reaching a backend are already validated (shapes, dtypes, null
 * pointers); only what lives in backend memory (counts) is checked there.
 */
#ifndef MST_BACKEND_H
#define MST_BACKEND_H

#include "moestash.h"
#include "host_device.h" /* MST_HD */
#include "page_table.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bits of the context's device error flag (int32 in backend memory). */
enum {
    MST_FLAG_COUNTS = 1,   /* an op saw negative counts or counts past max_rows */
    MST_FLAG_OVERFLOW = 2, /* a stash pool ran out of pages                     */
    MST_FLAG_NONFINITE = 4, /* a save into fp8 pages met inf or NaN (not stored) */
};

/* Row r of a paged tensor (rows of row_bytes): its address, or NULL when it
 * is past the table or its page id past its block (the row reads as zeros). */
MST_HD const char* mst_paged_row(const mst_pages* pg, int64_t r, int64_t row_bytes) {
    if (r >= pg->table_rows) return 0;
    int b;
    const int64_t i = mst_page_decode(pg->table[r / pg->page_rows], &b);
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

/* The streams of the memory manager: main (the context's current stream,
 * where ops run) and the side streams of the stash traffic. A selector is
 * always one of these names, never a bare number. */
typedef enum mst_stream_sel {
    MST_STREAM_MAIN = 0, /* the context's current stream                        */
    MST_STREAM_RING,     /* saves and page returns: every ring update, in order */
    MST_STREAM_COPY,     /* the copies of split restores                        */
    MST_N_STREAMS,
} mst_stream_sel;

/* Calls slot `slot` of function table `table` with (ctx, args), or returns
 * MST_ERR_UNSUPPORTED naming the slot and the backend when it is NULL. */
#define MST_SLOT(ctx, table, slot, args) \
    ((table)->slot ? (table)->slot((ctx), (args)) : mst_slot_missing((ctx), #slot))
mst_status mst_slot_missing(const mst_ctx_t* ctx, const char* slot);

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
    /* total bytes of backend memory (device memory; host RAM for the CPU) */
    mst_status (*capacity)(mst_ctx_t* ctx, size_t* total_bytes);
    void* (*get_stream)(mst_ctx_t* ctx);                 /* (optional) */
    mst_status (*set_stream)(mst_ctx_t* ctx, void* s);  /* (optional) */

    mst_status (*gl_forward)(mst_ctx_t* ctx, const mst_gl_args* a);
    mst_status (*gl_dgrad)(mst_ctx_t* ctx, const mst_gl_args* a);
    mst_status (*gl_wgrad)(mst_ctx_t* ctx, const mst_gl_args* a);
    /* (optional) 1 when gl_wgrad reads an x of width `in` (dy of width `out`)
     * from pages of page_rows rows as it is, with no memory of its own (a
     * graph-captured step cannot allocate); absent: never. */
    int (*gl_wgrad_pages)(mst_ctx_t* ctx, int64_t page_rows, int64_t in, int64_t out);

    /* grouped MLP activation */
    mst_status (*act_forward)(mst_ctx_t* ctx, const mst_act_args* a);
    mst_status (*act_backward)(mst_ctx_t* ctx, const mst_act_args* a);

    /* streams and events (memory manager); (optional): a backend without
     * them runs everything in program order. stream NULL = the context's
     * current stream; side_stream(ctx, sel) is the stream `sel` names (the
     * current stream for MST_STREAM_MAIN). stream_spin (tests: slows a
     * stream down) enqueues a kernel that spins for `cycles` clock cycles. */
    void* (*side_stream)(mst_ctx_t* ctx, mst_stream_sel sel);        /* (optional) */
    mst_status (*event_create)(mst_ctx_t* ctx, void** ev);           /* (optional) */
    void (*event_destroy)(mst_ctx_t* ctx, void* ev);                 /* (optional) */
    mst_status (*event_record)(mst_ctx_t* ctx, void* ev, void* stream); /* (optional) */
    mst_status (*stream_wait)(mst_ctx_t* ctx, void* stream, void* ev);  /* (optional) */
    mst_status (*stream_spin)(mst_ctx_t* ctx, void* stream, int64_t cycles); /* (optional) */

    /* paged stash (page_table.h): reserve + copy, copy + page return,
     * ring refill, a batch of those; host_alloc gives pinned host memory that the backend's
     * kernels can address (the host block of a pool). */
    mst_status (*stash_reset)(mst_ctx_t* ctx, const struct mst_stash_args* a);
    mst_status (*stash_save)(mst_ctx_t* ctx, const struct mst_stash_args* a);
    mst_status (*stash_restore)(mst_ctx_t* ctx, const struct mst_stash_args* a);
    /* the slots of b (page_table.h), each as the slot above would run it;
     * the first error of a slot is returned, the others still run */
    mst_status (*stash_batch)(mst_ctx_t* ctx, const struct mst_stash_batch* b);
    mst_status (*host_alloc)(mst_ctx_t* ctx, size_t n_bytes, void** out);
    void (*host_free)(mst_ctx_t* ctx, void* ptr);

    /* (optional) whole-step capture: copy_async enqueues a copy between
     * backend memory and host memory from host_alloc without waiting;
     * capture_begin / capture_end record what the context's stream is given
     * in between as one graph (an allocation, a host sync or a blocking copy
     * inside fails the capture); graph_launch replays it on that stream. */
    mst_status (*copy_async)(mst_ctx_t* ctx, void* dst, const void* src, size_t n_bytes, mst_copy_dir dir);
    mst_status (*capture_begin)(mst_ctx_t* ctx);
    mst_status (*capture_end)(mst_ctx_t* ctx, void** graph);
    mst_status (*graph_launch)(mst_ctx_t* ctx, void* graph);
    void (*graph_destroy)(mst_ctx_t* ctx, void* graph);
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
