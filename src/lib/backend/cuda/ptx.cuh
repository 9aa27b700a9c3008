/*
 * ptx.cuh — the inline PTX the CUDA kernels share: shared-memory addresses,
 * cp.async, ldmatrix and mma.sync (sm_80), mbarriers, TMA tensor copies
 * and plain bulk copies (sm_90), and the proxy fences between them. The
 * grouped GEMM kernels, the flash attention and the stash's bulk copy use
 * these and no asm of their own for them.
 */
#ifndef MST_CUDA_PTX_CUH
#define MST_CUDA_PTX_CUH

#include <cuda.h>
#include <stdint.h>

/* The shared-state-space address of a generic pointer into shared memory. */
__device__ __forceinline__ uint32_t mst_smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* ---- cp.async (16 bytes, zero-filled past src_bytes) ---- */
__device__ __forceinline__ void mst_cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(mst_smem_u32(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void mst_cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
/* Waits until at most N of this thread's cp.async groups are pending. */
template <int N>
__device__ __forceinline__ void mst_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* ---- tensor cores: ldmatrix and mma.sync m16n8k16 (bf16 in, fp32 accumulate) ---- */
/* Four 8 x 8 b16 matrices from shared memory: lanes 8i .. 8i+7 give the row
 * addresses of matrix i; r[i] holds row lane / 4, elements 2 (lane % 4), +1
 * (.trans: column lane / 4, rows 2 (lane % 4), +1). */
__device__ __forceinline__ void mst_ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(mst_smem_u32(p)));
}
__device__ __forceinline__ void mst_ldmatrix_x4_t(uint32_t (&r)[4], const uint16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(mst_smem_u32(p)));
}
/* d [16 x 8] += a [16 x 16] b [16 x 8] (a row-major fragment, b column-major). */
__device__ __forceinline__ void mst_mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ---- mbarriers (shared::cta) ---- */
__device__ __forceinline__ void mst_mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(mst_smem_u32(bar)), "r"(count));
}
/* After the inits, before other threads or the async proxy use the barriers. */
__device__ __forceinline__ void mst_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* Arrives and expects `bytes` more of asynchronous copies on this phase. */
__device__ __forceinline__ void mst_mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mst_smem_u32(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mst_mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(mst_smem_u32(bar)) : "memory");
}
/* Until the phase of parity `parity` has completed. */
__device__ __forceinline__ void mst_mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(mst_smem_u32(bar)),
        "r"(parity)
        : "memory");
}

/* Generic-proxy writes of shared memory made visible to the async proxy
 * (TMA / bulk copies that read it next). */
__device__ __forceinline__ void mst_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* ---- TMA tensor copies (global -> shared complete on an mbarrier) ---- */
__device__ __forceinline__ void mst_tma_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            mst_smem_u32(dst)),
        "l"(map), "r"(c0), "r"(c1), "r"(mst_smem_u32(bar))
        : "memory");
}
__device__ __forceinline__ void mst_tma_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
            mst_smem_u32(dst)),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(mst_smem_u32(bar))
        : "memory");
}
/* Shared -> the box of a rank-3 map at (c0, c1, c2): store, or reduce-add;
 * one bulk group of this thread (committed). */
__device__ __forceinline__ void mst_tma_out_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int add) {
    if (add)
        asm volatile(
            "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(map),
            "r"(c0), "r"(c1), "r"(c2), "r"(mst_smem_u32(src))
            : "memory");
    else
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(map),
                     "r"(c0), "r"(c1), "r"(c2), "r"(mst_smem_u32(src))
                     : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

/* ---- plain bulk copies (bytes a multiple of 16, 16-byte aligned) ---- */
/* Global -> shared, completing on `bar` (whose phase expects the bytes). */
__device__ __forceinline__ void mst_bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     mst_smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(mst_smem_u32(bar))
                 : "memory");
}
/* Shared -> global, as one bulk group of this thread (committed). */
__device__ __forceinline__ void mst_bulk_s2g(void* dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(mst_smem_u32(src)),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
/* Until at most N of this thread's bulk groups still read shared memory. */
template <int N>
__device__ __forceinline__ void mst_bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
/* Until all of this thread's bulk groups are complete (writes done). */
__device__ __forceinline__ void mst_bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

#endif
