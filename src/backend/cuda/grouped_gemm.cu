/*
 * grouped_gemm.cu — placeholder until the CUDA grouped GEMM lands.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

static mst_status not_yet(const char* op) {
    return mst_set_error(MST_ERR_UNSUPPORTED, "%s is not implemented on cuda yet", op);
}
extern "C" mst_status mst_cuda_gl_forward(mst_ctx_t* ctx, const mst_gl_args* a) { (void)ctx; (void)a; return not_yet("gl_forward"); }
extern "C" mst_status mst_cuda_gl_dgrad(mst_ctx_t* ctx, const mst_gl_args* a) { (void)ctx; (void)a; return not_yet("gl_dgrad"); }
extern "C" mst_status mst_cuda_gl_wgrad(mst_ctx_t* ctx, const mst_gl_args* a) { (void)ctx; (void)a; return not_yet("gl_wgrad"); }
