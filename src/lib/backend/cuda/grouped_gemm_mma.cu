/*
 * grouped_gemm_mma.cu — the general tensor-core grouped GEMM (mma.sync
 * m16n8k16 bf16 -> fp32) for every layout of the three ops: a persistent grid
 * takes (group, tile) work from the device schedule; operand tiles come in
 * through a cp.async pipeline of GG_STAGES stages (zero-filled past the
 * group's rows and the widths), ldmatrix (.trans for M/N-major operands)
 * feeds the tensor cores, and the epilogue writes y / dx (with bias * scale)
 * or adds into main_grad. Serves every shape; the Hopper path
 * (grouped_gemm_wgmma.cu) takes over the large ones. Built, like the whole
 * CUDA backend, for MST_CUDA_ARCH only (sm_90a): its instructions exist from
 * sm_80 on, but the stash kernels and the Hopper path beside it do not.
 */
#include "grouped_gemm.cuh"
#include "ptx.cuh"

namespace {

constexpr int BM = 128, BN = 128, BK = 32;   /* CTA tile                       */
constexpr int WARPS_M = 2, WARPS_N = 4;      /* warp grid                      */
constexpr int WM = BM / WARPS_M;             /* 64: warp tile rows             */
constexpr int WN = BN / WARPS_N;             /* 32: warp tile cols             */
constexpr int MT = WM / 16, NT = WN / 8;     /* mma tiles per warp: 4 x 4      */
constexpr int THREADS = 32 * WARPS_M * WARPS_N;
constexpr int GG_STAGES = 4;
constexpr int PAD = 8;                       /* bf16 per smem row: no ldmatrix bank conflicts */

/* Shared-memory tile of ROWS x COLS bf16, rows padded. */
template <int ROWS, int COLS>
struct smem_tile {
    static constexpr int LD = COLS + PAD;
    static constexpr int ELEMS = ROWS * LD;
};
/* A K-major operand tile is [rows of M or N][BK]; an M/N-major one [BK][BM or BN]. */
template <bool KMAJOR, int MN>
using op_tile = smem_tile<KMAJOR ? MN : BK, KMAJOR ? BK : MN>;

/* Loads rows [r0, r0 + ROWS) x cols [c0, c0 + COLS) of a row-major bf16
 * matrix (pitch ld) into a padded smem tile; elements with row >= r_lim or
 * col >= c_lim become zero and are not read. vec: rows and base are 16-byte
 * aligned, so each 8-column chunk is all in or all out. */
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile(uint16_t* dst, const uint16_t* src, int64_t ld, int r0,
                                          int c0, int r_lim, int c_lim, int vec) {
    constexpr int CHUNKS = ROWS * COLS / 8;
    constexpr int LD = smem_tile<ROWS, COLS>::LD;
    static_assert(CHUNKS % THREADS == 0, "whole chunks per thread");
#pragma unroll
    for (int it = 0; it < CHUNKS / THREADS; it++) {
        int i = threadIdx.x + it * THREADS;
        int r = i / (COLS / 8), c = (i % (COLS / 8)) * 8;
        int gr = r0 + r, gc = c0 + c;
        uint16_t* d = dst + r * LD + c;
        bool row_in = gr < r_lim;
        const uint16_t* s = src + (int64_t)(row_in ? gr : 0) * ld + gc;
        if (vec) {
            bool in = row_in && gc < c_lim;
            mst_cp_async16(d, in ? s : src, in ? 16 : 0);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) d[j] = row_in && gc + j < c_lim ? s[j] : (uint16_t)0;
        }
    }
}

/* A fragment (16 x 16 at m, k) from a K-major [m][k] or M-major [k][m] tile. */
template <bool KMAJOR>
__device__ __forceinline__ void frag_a(uint32_t (&r)[4], const uint16_t* t, int m, int k, int lane) {
    constexpr int LD = op_tile<KMAJOR, BM>::LD;
    int i = lane >> 3, j = lane & 7;
    if (KMAJOR) mst_ldmatrix_x4(r, t + (m + j + (i & 1) * 8) * LD + k + (i >> 1) * 8);
    else mst_ldmatrix_x4_t(r, t + (k + j + (i >> 1) * 8) * LD + m + (i & 1) * 8);
}

/* B fragments of two n8 tiles (16 x 16 at n, k): r[0..1] tile n, r[2..3] tile n + 8. */
template <bool KMAJOR>
__device__ __forceinline__ void frag_b(uint32_t (&r)[4], const uint16_t* t, int n, int k, int lane) {
    constexpr int LD = op_tile<KMAJOR, BN>::LD;
    int i = lane >> 3, j = lane & 7;
    if (KMAJOR) mst_ldmatrix_x4(r, t + (n + j + (i >> 1) * 8) * LD + k + (i & 1) * 8);
    else mst_ldmatrix_x4_t(r, t + (k + j + (i & 1) * 8) * LD + n + (i >> 1) * 8);
}

template <int OP>
struct layout {
    static constexpr bool A_K = OP != GG_WGRAD; /* A K-major */
    static constexpr bool B_K = OP == GG_FWD;   /* B K-major */
};

/* Where the tile's operands start: group row offset or weight slice. */
template <int OP>
__device__ __forceinline__ void operand_bases(const gg_problem& p, const gg_tile& t,
                                              const uint16_t*& a, const uint16_t*& b) {
    a = p.a + (int64_t)t.row0 * p.lda;
    b = OP == GG_WGRAD ? p.b + (int64_t)t.row0 * p.ldb : p.b + (int64_t)t.g * p.b_group;
}

template <int OP>
__device__ __forceinline__ void load_stage(const gg_problem& p, const gg_tile& t, const uint16_t* a,
                                           const uint16_t* b, uint16_t* sa, uint16_t* sb, int k0) {
    using L = layout<OP>;
    if (L::A_K) load_tile<BM, BK>(sa, a, p.lda, t.m0, k0, t.m_lim, t.k_len, p.vec);
    else load_tile<BK, BM>(sa, a, p.lda, k0, t.m0, t.k_len, t.m_lim, p.vec);
    if (L::B_K) load_tile<BN, BK>(sb, b, p.ldb, t.n0, k0, t.n_lim, t.k_len, p.vec);
    else load_tile<BK, BN>(sb, b, p.ldb, k0, t.n0, t.k_len, t.n_lim, p.vec);
}

template <int OP>
__global__ void __launch_bounds__(THREADS) mma_kernel(const gg_problem p, const gg_sched s) {
    using L = layout<OP>;
    constexpr int A_ELEMS = op_tile<L::A_K, BM>::ELEMS, B_ELEMS = op_tile<L::B_K, BN>::ELEMS;
    extern __shared__ __align__(128) uint16_t smem[];
    __shared__ int32_t next;
    uint16_t* sa = smem;                          /* [STAGES][A_ELEMS] */
    uint16_t* sb = smem + GG_STAGES * A_ELEMS;    /* [STAGES][B_ELEMS] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
    const int32_t n_tiles = s.hdr[GG_H_TILES];

    for (;;) {
        __syncthreads(); /* the previous tile is done with `next` and the stages */
        if (threadIdx.x == 0) next = gg_next_tile(s, n_tiles, 0);
        __syncthreads();
        const int32_t ti = next;
        if (ti < 0) break;
        const gg_tile t = gg_decode(p, s, ti, BM, BN);
        const uint16_t *a, *b;
        operand_bases<OP>(p, t, a, b);
        const int nk = gg_cdiv(t.k_len, BK);

        float acc[MT][NT][4];
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;

#pragma unroll
        for (int st = 0; st < GG_STAGES - 1; st++) {
            if (st < nk) load_stage<OP>(p, t, a, b, sa + st * A_ELEMS, sb + st * B_ELEMS, st * BK);
            mst_cp_async_commit();
        }
        for (int kt = 0; kt < nk; kt++) {
            mst_cp_async_wait<GG_STAGES - 2>();
            __syncthreads(); /* stage kt landed; stage kt-1 is free */
            int ld = kt + GG_STAGES - 1;
            if (ld < nk)
                load_stage<OP>(p, t, a, b, sa + (ld % GG_STAGES) * A_ELEMS,
                               sb + (ld % GG_STAGES) * B_ELEMS, ld * BK);
            mst_cp_async_commit();
            const uint16_t* ta = sa + (kt % GG_STAGES) * A_ELEMS;
            const uint16_t* tb = sb + (kt % GG_STAGES) * B_ELEMS;
#pragma unroll
            for (int kk = 0; kk < BK; kk += 16) {
                uint32_t fa[MT][4], fb[NT / 2][4];
#pragma unroll
                for (int i = 0; i < MT; i++) frag_a<L::A_K>(fa[i], ta, wm + i * 16, kk, lane);
#pragma unroll
                for (int j = 0; j < NT / 2; j++) frag_b<L::B_K>(fb[j], tb, wn + j * 16, kk, lane);
#pragma unroll
                for (int i = 0; i < MT; i++)
#pragma unroll
                    for (int j = 0; j < NT; j++)
                        mst_mma_bf16(acc[i][j], fa[i], fb[j / 2][(j & 1) * 2], fb[j / 2][(j & 1) * 2 + 1]);
            }
        }
        mst_cp_async_wait<0>();

        const int m = t.m0 + wm + (lane >> 2), n = t.n0 + wn + (lane & 3) * 2;
        if (OP == GG_WGRAD && p.accumulate) { /* all old main_grad values first */
#pragma unroll
            for (int x = 0; x < MT * NT; x++) {
                const int i = x / NT, j = x % NT;
                gg_add_old_pair(p, t, m + i * 16, n + j * 8, acc[i][j][0], acc[i][j][1]);
                gg_add_old_pair(p, t, m + i * 16 + 8, n + j * 8, acc[i][j][2], acc[i][j][3]);
            }
        }
#pragma unroll
        for (int x = 0; x < MT * NT; x++) {
            const int i = x / NT, j = x % NT;
            gg_store_pair<OP>(p, t, m + i * 16, n + j * 8, acc[i][j][0], acc[i][j][1]);
            gg_store_pair<OP>(p, t, m + i * 16 + 8, n + j * 8, acc[i][j][2], acc[i][j][3]);
        }
    }
}

template <int OP>
constexpr size_t smem_bytes() {
    using L = layout<OP>;
    return sizeof(uint16_t) * GG_STAGES * (op_tile<L::A_K, BM>::ELEMS + op_tile<L::B_K, BN>::ELEMS);
}

/* The shared-memory attribute and the resident blocks per SM (at least 1). */
template <int OP>
mst_status setup(int* per_sm) {
    MST_CUDA_TRY(cudaFuncSetAttribute(mma_kernel<OP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)smem_bytes<OP>()));
    MST_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, mma_kernel<OP>, THREADS, smem_bytes<OP>()));
    if (*per_sm < 1) *per_sm = 1;
    return MST_OK;
}

template <int OP>
mst_status launch(const gg_problem* p, const gg_sched* s, const mst_cuda_impl* c) {
    mma_kernel<OP><<<c->n_sm * c->mma_per_sm[OP], THREADS, smem_bytes<OP>(), c->stream>>>(*p, *s);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

} // namespace

extern "C" mst_status gg_mma_setup(int per_sm[3]) {
    MST_TRY(setup<GG_FWD>(&per_sm[GG_FWD]));
    MST_TRY(setup<GG_DGRAD>(&per_sm[GG_DGRAD]));
    return setup<GG_WGRAD>(&per_sm[GG_WGRAD]);
}

extern "C" mst_status gg_launch_mma(const gg_problem* p, const gg_sched* s, const mst_cuda_impl* c) {
    switch (p->op) {
    case GG_FWD: return launch<GG_FWD>(p, s, c);
    case GG_DGRAD: return launch<GG_DGRAD>(p, s, c);
    default: return launch<GG_WGRAD>(p, s, c);
    }
}

extern "C" void gg_mma_tile(int* bm, int* bn) {
    *bm = BM;
    *bn = BN;
}
