/*
 * grouped_gemm.cuh — what the grouped GEMM files share: the device schedule
 * (row offsets and the (group, tile) work list derived on the device from the
 * counts), the per-op problem description every kernel reads, and tile
 * decoding.
 *
 * Every op is C[m][n] = sum_k A(m, k) B(n, k) per group g:
 *   forward (TN): M = count[g], N = O, K = I   A = x rows (K-major), B = W[g] (K-major)
 *   dgrad   (NN): M = count[g], N = I, K = O   A = dy rows (K-major), B = W[g] (N-major)
 *   wgrad   (NT): M = O, N = I, K = count[g]   A = dy rows (M-major), B = x rows (N-major)
 * Rows of group g are [off[g], off[g] + count[g]); no kernel reads or writes a
 * row past off[E] = sum(counts) as data.
 */
#ifndef MST_GROUPED_GEMM_CUH
#define MST_GROUPED_GEMM_CUH

#include "cuda_common.cuh"

enum gg_op { GG_FWD = 0, GG_DGRAD = 1, GG_WGRAD = 2 };

/* Schedule header words (int32, backend memory). */
enum { GG_H_TILES = 0, GG_H_OK = 1, GG_H_NEXT = 2, GG_H_WORDS = 4 };

/* The device schedule of one op, inside the ws_sched workspace:
 *   hdr[GG_H_TILES] = tile_off[E] when counts are valid, else 0 (no work)
 *   hdr[GG_H_OK]    = 1 when counts are valid
 *   hdr[GG_H_NEXT], hdr[GG_H_NEXT + 1] = tiles handed out from the front and
 *                     from the back of the schedule (one 64-bit word)
 * Invariants (valid counts): off[0] = 0, off[g+1] = off[g] + counts[g] <= R;
 * tile_off[0] = 0, tile_off[s+1] - tile_off[s] = tiles of group order[s];
 * order is a permutation of [0, E) by decreasing rows (largest first). */
typedef struct gg_sched {
    int32_t* hdr;      /* [GG_H_WORDS]                           */
    int32_t* off;      /* [E+1] row offsets, group order         */
    int32_t* tile_off; /* [E+1] tile offsets, schedule-slot order */
    int32_t* order;    /* [E]   group of each schedule slot       */
} gg_sched;

/* One op's operands, shapes and epilogue inputs (pointers are bases of the
 * whole buffers; kernels add the group's offsets). */
typedef struct gg_problem {
    int op;                /* gg_op                                         */
    int32_t n_groups;      /* E                                             */
    int32_t M, N, K;       /* fixed extents (count-bound ones are ignored)  */
    const uint16_t* a;     /* A operand base (bf16)                         */
    const uint16_t* b;     /* B operand base (bf16)                         */
    int64_t lda, ldb;      /* row pitch in elements of A's and B's buffers  */
    int64_t b_group;       /* elements between groups of a weight B (O*I)   */
    void* c;               /* output base: y / dx bf16, main_grad_w fp32    */
    int64_t ldc;           /* row pitch of C in elements                    */
    const uint16_t* bias;  /* [E, O] bf16 (forward, optional)               */
    const float* scale;    /* [R] fp32 (forward, optional)                  */
    int accumulate;        /* wgrad: C += dW instead of C = dW              */
    int vec;               /* 1: rows 16-byte aligned, 16-byte copies       */
    int staged_out;        /* wgmma forward / dgrad: full row blocks stored
                              through shared memory and TMA (else registers) */
} gg_problem; /* kept small: kernels take it by value, and at 144 bytes
                 the compiler stopped splitting it into registers (measured:
                 forward at short K 20 % slower, the mma dgrad 25 %) */

/* wgrad's x read from pages by the Hopper kernel (table NULL: x in memory). */
typedef struct gg_paged {
    const uint32_t* table; /* [table_pages] page ids (bit 31: host block) */
    int32_t page_shift;    /* log2 of the page rows, a power of 2 >= GG_K_ALIGN */
    int32_t table_pages;   /* entries of the table                         */
    int32_t n_pages[2];    /* pages of the device and the host block       */
    int32_t map_pages[2];  /* pages of the map each block reads through (a block without pages has the other's) */
} gg_paged;

/* One output tile of the schedule, decoded. */
typedef struct gg_tile {
    int32_t g;             /* group                                         */
    int32_t m0, n0;        /* tile origin in the group's C                  */
    int32_t m_lim, n_lim;  /* valid extents of the group's C                */
    int32_t k_len;         /* K of this group                               */
    int32_t row0;          /* off[g]: first grouped row of the group        */
} gg_tile;

/* Tiles of one group along M (count-bound for forward/dgrad). */
__host__ __device__ __forceinline__ int32_t gg_cdiv(int64_t a, int32_t b) {
    return (int32_t)((a + b - 1) / b);
}

/* Band height of the tile raster: BAND m-tiles sweep all n-tiles together so
 * the B tiles they share stay in L2. */
#define GG_BAND 8

/* Decodes schedule tile t for a kernel of tile BM x BN. */
__device__ __forceinline__ gg_tile gg_decode(const gg_problem& p, const gg_sched& s, int32_t t,
                                             int BM, int BN) {
    int lo = 0, hi = p.n_groups; /* last slot with tile_off[slot] <= t */
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (__ldg(s.tile_off + mid) <= t) lo = mid;
        else hi = mid;
    }
    gg_tile tl;
    tl.g = __ldg(s.order + lo);
    tl.row0 = __ldg(s.off + tl.g);
    int32_t count = __ldg(s.off + tl.g + 1) - tl.row0;
    int32_t local = t - __ldg(s.tile_off + lo);
    tl.m_lim = p.op == GG_WGRAD ? p.M : count;
    tl.n_lim = p.N;
    tl.k_len = p.op == GG_WGRAD ? count : p.K;
    int32_t nm = gg_cdiv(tl.m_lim, BM), nn = gg_cdiv(tl.n_lim, BN);
    int32_t band = local / (GG_BAND * nn), first = band * GG_BAND;
    int32_t h = min(nm - first, GG_BAND);
    int32_t in_band = local - band * GG_BAND * nn;
    tl.m0 = (first + in_band % h) * BM;
    tl.n0 = (in_band / h) * BN;
    return tl;
}

/* The Hopper wgrad starts a tile's k-blocks at the multiple of GG_K_ALIGN
 * rows (its k-block) at or before the group's first row, so that a k-block
 * of x read from pages of a multiple of GG_K_ALIGN rows lies in one page
 * (one box per column block, as from memory), and so that x in memory and
 * x in pages are summed in the same k16 steps (the same bits). Returns the
 * rows added in front (they are dropped: dy's are zeroed) and moves t.row0
 * / t.k_len to match. */
#define GG_K_ALIGN 64
__device__ __forceinline__ int32_t gg_align_k(gg_tile& t) {
    const int32_t head = t.row0 & (GG_K_ALIGN - 1);
    t.row0 -= head;
    t.k_len += head;
    return head;
}

/* Hands out the next of the schedule's n tiles to a persistent CTA, or -1
 * when all are out: from the front (largest groups first) or from the
 * back. Both ends count in one 64-bit word, so the two never hand out the
 * same tile (integer atomics only). */
__device__ __forceinline__ int32_t gg_next_tile(const gg_sched& s, int32_t n, int back) {
    const unsigned long long old =
        atomicAdd((unsigned long long*)(s.hdr + GG_H_NEXT), back ? 1ull << 32 : 1ull);
    const int32_t front_out = (int32_t)(uint32_t)old, back_out = (int32_t)(old >> 32);
    if (front_out + back_out >= n) return -1;
    return back ? n - 1 - back_out : front_out;
}

/* Where main_grad_w element (m, n) of the tile's group lives (wgrad). */
__device__ __forceinline__ float* gg_grad_at(const gg_problem& p, const gg_tile& t, int m, int n) {
    return (float*)p.c + ((int64_t)t.g * p.M + m) * p.ldc + n;
}

/* wgrad ACCUMULATE, before the stores: adds main_grad's old values into one
 * accumulator pair (row m, cols n, n + 1); kernels call it for all their
 * pairs first so the loads are in flight together. */
__device__ __forceinline__ void gg_add_old_pair(const gg_problem& p, const gg_tile& t, int m, int n,
                                                float& v0, float& v1) {
    if (m >= t.m_lim || n >= t.n_lim) return;
    const float* c = gg_grad_at(p, t, m, n);
    if (n + 1 < t.n_lim && p.vec) {
        float2 o = *(const float2*)c;
        v0 += o.x, v1 += o.y;
    } else {
        v0 += c[0];
        if (n + 1 < t.n_lim) v1 += c[1];
    }
}

/* Epilogue of every kernel: writes one accumulator pair (row m, cols n,
 * n+1 of the group's C): y / dx in bf16, or main_grad_w in fp32 (old values
 * already added for ACCUMULATE). Masked to the group's extents. */
template <int OP>
__device__ __forceinline__ void gg_put_pair(const gg_problem& p, const gg_tile& t, int m, int n, float v0,
                                            float v1) {
    if (m >= t.m_lim || n >= t.n_lim) return;
    bool two = n + 1 < t.n_lim;
    if (OP == GG_WGRAD) {
        float* c = gg_grad_at(p, t, m, n);
        if (two && p.vec) *(float2*)c = make_float2(v0, v1);
        else {
            c[0] = v0;
            if (two) c[1] = v1;
        }
        return;
    }
    __nv_bfloat16* c = (__nv_bfloat16*)p.c + ((int64_t)t.row0 + m) * p.ldc + n;
    if (two && p.vec) *(__nv_bfloat162*)c = __floats2bfloat162_rn(v0, v1);
    else {
        c[0] = __float2bfloat16_rn(v0);
        if (two) c[1] = __float2bfloat16_rn(v1);
    }
}

/* The same, the forward first adding bias[g] * s[r]. */
template <int OP>
__device__ __forceinline__ void gg_store_pair(const gg_problem& p, const gg_tile& t, int m, int n,
                                              float v0, float v1) {
    if (OP == GG_FWD && p.bias && m < t.m_lim && n < t.n_lim) {
        float s = p.scale ? p.scale[(int64_t)t.row0 + m] : 1.0f;
        const __nv_bfloat16* bg = (const __nv_bfloat16*)p.bias + (int64_t)t.g * p.N + n;
        v0 += __bfloat162float(bg[0]) * s;
        if (n + 1 < t.n_lim) v1 += __bfloat162float(bg[1]) * s;
    }
    gg_put_pair<OP>(p, t, m, n, v0, v1);
}

#ifdef __cplusplus
extern "C" {
#endif
/* Launchers (grouped_gemm_*.cu): enqueue the GEMM of `p` on c's stream,
 * a persistent grid on c's SMs. */
mst_status gg_launch_mma(const gg_problem* p, const gg_sched* s, const mst_cuda_impl* c);
void gg_mma_tile(int* bm, int* bn); /* the mma kernel's CTA tile */
/* Hopper path: operands through TMA (needs rows 16-byte aligned: p->vec). */
mst_status gg_launch_wgmma(const gg_problem* p, const gg_sched* s, int64_t max_rows, const mst_cuda_impl* c,
                           const mst_pages* x_pages);
void gg_wgmma_tile(int* bm, int* bn); /* the wgmma kernel's CTA tile */
/* Set-up on the current device (context creation): the mma kernel's
 * shared-memory attribute and its resident blocks per SM by op into
 * per_sm [3]; the wgmma kernel's attribute. */
mst_status gg_mma_setup(int per_sm[3]);
mst_status gg_wgmma_setup(void);
#ifdef __cplusplus
}
#endif

#endif
