/*
 * ops.c — the model's calls into the backend's model ops (see ops.h).
 */
#include "ops.h"

mst_status mst_op_linear(const mst_model* m, int64_t n, int64_t in, int64_t out, const uint16_t* x,
                         const uint16_t* w, uint16_t* y) {
    mst_mm_args a = {.trans_a = 0, .trans_b = 1, .m = n, .n = out, .k = in, .a = x, .lda = in,
                     .b = w, .ldb = in, .c16 = y, .ldc = out};
    return MST_MODEL_OP(m, mm, &a);
}

mst_status mst_op_linear_dgrad(const mst_model* m, int64_t n, int64_t in, int64_t out,
                               const uint16_t* dy, const uint16_t* w, int64_t ldw, uint16_t* dx) {
    mst_mm_args a = {.trans_a = 0, .trans_b = 0, .m = n, .n = in, .k = out, .a = dy, .lda = out,
                     .b = w, .ldb = ldw, .c16 = dx, .ldc = in};
    return MST_MODEL_OP(m, mm, &a);
}

mst_status mst_op_linear_wgrad(const mst_model* m, int64_t n, int64_t in, int64_t out,
                               const uint16_t* dy, const uint16_t* x, float* gw, int64_t ldg) {
    mst_mm_args a = {.trans_a = 1, .trans_b = 0, .m = out, .n = in, .k = n, .a = dy, .lda = out,
                     .b = x, .ldb = in, .c32 = gw, .ldc = ldg, .accumulate = 1};
    return MST_MODEL_OP(m, mm, &a);
}

mst_status mst_op_norm(const mst_model* m, int64_t n, int64_t h, float eps, const uint16_t* x,
                       const uint16_t* w, uint16_t* y, float* rstd) {
    mst_norm_args a = {.rows = n, .cols = h, .eps = eps, .x = x, .w = w, .y = y, .rstd = rstd};
    return MST_MODEL_OP(m, norm_forward, &a);
}

mst_status mst_op_norm_bwd(const mst_model* m, int64_t n, int64_t h, const uint16_t* x,
                           const uint16_t* w, const float* rstd, const uint16_t* dy, uint16_t* dx,
                           float* dw) {
    mst_norm_args a = {.rows = n, .cols = h, .x = x, .w = w, .rstd = (float*)rstd, .dy = dy,
                       .dx = dx, .dw = dw};
    return MST_MODEL_OP(m, norm_backward, &a);
}

mst_status mst_op_add(const mst_model* m, int64_t n, const uint16_t* a, const uint16_t* b, uint16_t* y) {
    mst_add_args args = {.n = n, .a = a, .b = b, .y = y};
    return MST_MODEL_OP(m, add, &args);
}
