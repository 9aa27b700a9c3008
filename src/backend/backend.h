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

/* Bits of the context's device error flag (int32 in backend memory). */
enum { MST_FLAG_COUNTS = 1 };

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
