/*
 * roof.h — the roofs every GEMM / MLP benchmark line is measured against,
 * taken on the same card in the same run:
 *   dense  cuBLAS bf16 GEMM TFLOP/s (fp32 accumulate)
 *   copy   device-to-device copy GB/s, counting bytes read + bytes written
 * and the roofline time of an op: max(FLOPs / dense, bytes / copy), where
 * bytes are the op's minimum traffic (inputs read once, outputs written
 * once, an accumulated fp32 main_grad read and written once).
 */
#ifndef MST_BENCH_ROOF_H
#define MST_BENCH_ROOF_H

#include "moestash.h"

typedef struct mst_bench_roofs {
    double dense_tflops; /* cuBLAS bf16 GEMM 8192^3, TFLOP/s             */
    double copy_gbps;    /* cudaMemcpyAsync D2D of 1 GiB, (read+write) GB/s */
} mst_bench_roofs;

/* Measures both roofs on the context's device, on `stream` (cudaStream_t). */
mst_status mst_bench_roofs_measure(mst_ctx_t* ctx, void* stream, mst_bench_roofs* out);

/* Roofline time in ms of an op of `flops` FLOPs moving `bytes` bytes. */
double mst_bench_roofline_ms(const mst_bench_roofs* r, double flops, double bytes);

#endif
