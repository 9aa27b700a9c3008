/*
 * model_ops_flash.cu — fused causal attention (flash attention, written for
 * this project from the published algorithm), forward and backward side by
 * side; the CPU reference of the same contract is model_ops_attn.c. Nothing
 * T x T is stored: forward keeps the output O (bf16) and each row's
 * logsumexp lse (fp32, natural log of the scaled scores), backward
 * recomputes the probabilities block by block from them:
 *   forward (one block per 64 query rows of one (batch, head)): for each key
 *     block in order, S = q k^T sc, online softmax (running max and sum,
 *     fp32), O += P v (P in bf16 on the tensor cores, fp32 accumulation);
 *   backward: Delta_i = rowsum(dO_i O_i) (fp32); dk, dv per 64 keys of one
 *     key-value head looping over the query heads that read it (the group,
 *     in head order), each over its query blocks in order (P = exp(S - lse),
 *     dP = dO v^T, dS = P (dP - Delta), dv += P^T dO, dk += dS^T q sc): the
 *     group's sum in registers, no atomics; dq per 64 queries looping over
 *     the key blocks in order (dq += dS k sc).
 * Grouped-query attention: query head h reads key-value head h / G
 * (G = NH / KV), a row of qkv being [q (NH D) | k (KV D) | v (KV D)].
 * Deterministic: every sum runs in a fixed order and no value is added
 * atomically; graph-safe: kernels only, no workspace. Tensor cores through
 * mma.sync m16n8k16 (bf16 -> fp32), operand tiles staged in padded shared
 * memory by cp.async (rows past T zero-filled, double-buffered), fragments
 * by ldmatrix. Head dims 64 and 128; any T.
 */
#include <cuda_bf16.h>

#include "model_ops.cuh"
#include "lib/internal.h"

namespace {

constexpr int WARPS = 4, THREADS = 32 * WARPS;
constexpr int BR = 64;        /* rows of a block: 16 per warp (queries: fwd, dq; keys: dk/dv) */
constexpr int BC = 64;        /* keys per step of fwd and dq                                  */
constexpr int PAD = 8;        /* bf16 per smem row: ldmatrix rows on distinct banks           */
constexpr float LOG2E = 1.4426950408889634f;

/* The call's buffers: q, k, v rows of the [B*T, W] qkv (stride W =
 * (NH + 2 KV) D), out / dout rows of [B*T, HO] (stride HO = NH D), lse /
 * delta rows of [B, NH, T]. */
struct fa_args {
    const uint16_t* qkv;  /* [B*T, W] */
    const uint16_t* out;  /* [B*T, HO] */
    uint16_t* out_w;      /* [B*T, HO] (forward)  */
    const uint16_t* dout; /* [B*T, HO] (backward) */
    uint16_t* dqkv;       /* [B*T, W] (backward) */
    float* lse;           /* [B, NH, T] */
    float* delta;         /* [B, NH, T] (backward) */
    int T, NH, KV, W, HO; /* seq, query heads, key-value heads, row widths */
    float sc;             /* 1 / sqrt(D) */
};

/* Offsets (elements) of row 0 of batch b's head in [B*T, W] qkv (or dqkv):
 * query head h, key head g, value head g; and in [B*T, HO] out. */
__device__ __forceinline__ int64_t q_off(const fa_args& p, int D, int b, int h) {
    return (int64_t)b * p.T * p.W + (int64_t)h * D;
}
__device__ __forceinline__ int64_t k_off(const fa_args& p, int D, int b, int g) {
    return (int64_t)b * p.T * p.W + p.HO + (int64_t)g * D;
}
__device__ __forceinline__ int64_t v_off(const fa_args& p, int D, int b, int g) {
    return k_off(p, D, b, g) + (int64_t)p.KV * D;
}
__device__ __forceinline__ int64_t o_off(const fa_args& p, int D, int b, int h) {
    return (int64_t)b * p.T * p.HO + (int64_t)h * D;
}

/* Rows [r0, r0 + ROWS) of a head operand (row stride ld, D wide) into a
 * padded smem tile [ROWS][D + PAD]; rows >= T become zero. */
template <int ROWS, int D>
__device__ __forceinline__ void load_rows(uint16_t* dst, const uint16_t* src, int64_t ld, int r0, int T) {
    constexpr int CH = D / 8, LD = D + PAD;
    static_assert(ROWS * CH % THREADS == 0, "whole chunks per thread");
#pragma unroll
    for (int it = 0; it < ROWS * CH / THREADS; it++) {
        const int i = threadIdx.x + it * THREADS, r = i / CH, c = (i % CH) * 8;
        const bool in = r0 + r < T;
        mst_cp_async16(dst + r * LD + c, src + (in ? (int64_t)(r0 + r) * ld + c : 0), in ? 16 : 0);
    }
}

/* N fp32 of a row vector from v + r0 into smem; past T zero (plain loads:
 * the rows of [B, NH, T] need not be 16-byte aligned). */
template <int N>
__device__ __forceinline__ void load_vec(float* dst, const float* v, int r0, int T) {
    for (int i = threadIdx.x; i < N; i += THREADS) dst[i] = r0 + i < T ? v[r0 + i] : 0.0f;
}

/* 2^x (ex2.approx: 2 ulp, -inf -> 0). */
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* One step of a double-buffered loop: the copy of the next step's tiles
 * started (has_next: load_next issues it), this step's awaited, the block
 * synced. */
template <typename F>
__device__ __forceinline__ void pipe_step(bool has_next, F load_next) {
    if (has_next) {
        load_next();
        mst_cp_async_commit();
        mst_cp_async_wait<1>();
    } else {
        mst_cp_async_wait<0>();
    }
    __syncthreads();
}

/* A fragment of rows [m, m + 16) x cols [k, k + 16) of a row-major tile. */
template <int LD>
__device__ __forceinline__ void frag_a(uint32_t (&r)[4], const uint16_t* t, int m, int k, int lane) {
    mst_ldmatrix_x4(r, t + (m + (lane & 15)) * LD + k + (lane >> 4) * 8);
}
/* B fragments of n8 tiles n and n + 8 (r[0..1], r[2..3]), k16 at k, from a
 * tile stored [n][k] (B = tile^T). */
template <int LD>
__device__ __forceinline__ void frag_bt(uint32_t (&r)[4], const uint16_t* t, int n, int k, int lane) {
    mst_ldmatrix_x4(r, t + (n + (lane >> 4) * 8 + (lane & 7)) * LD + k + ((lane >> 3) & 1) * 8);
}
/* The same from a tile stored [k][n] (B = tile). */
template <int LD>
__device__ __forceinline__ void frag_b(uint32_t (&r)[4], const uint16_t* t, int n, int k, int lane) {
    mst_ldmatrix_x4_t(r, t + (k + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + n + (lane >> 4) * 8);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
/* The A fragment of k16 step kk from accumulators c [n8 tiles][4] (rows
 * of this warp's 16, columns the k dimension). */
template <int NT>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[NT][4], int kk) {
    a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

/* c [16 x 8 NT] = rows [m, m+16) of A (tile [..][K], row-major) times B^T
 * for B the rows [0, 8 NT) of tile b ([..][K], row-major). */
template <int NT, int K, int LD>
__device__ __forceinline__ void mma_abt(float (&c)[NT][4], const uint16_t* a, int m, const uint16_t* b, int lane) {
#pragma unroll
    for (int i = 0; i < NT; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t fa[4];
        frag_a<LD>(fa, a, m, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t fb[4];
            frag_bt<LD>(fb, b, np * 16, kk * 16, lane);
            mst_mma_bf16(c[2 * np], fa, fb[0], fb[1]);
            mst_mma_bf16(c[2 * np + 1], fa, fb[2], fb[3]);
        }
    }
}

/* acc [16 x D] += P [16 x K] (accumulators p, bf16) times tile b [K][D]. */
template <int NT, int DT, int LD>
__device__ __forceinline__ void mma_pb(float (&acc)[DT][4], const float (&p)[NT][4], const uint16_t* b, int lane) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        uint32_t fa[4];
        acc_to_a<NT>(fa, p, kk);
#pragma unroll
        for (int dp = 0; dp < DT / 2; dp++) {
            uint32_t fb[4];
            frag_b<LD>(fb, b, dp * 16, kk * 16, lane);
            mst_mma_bf16(acc[2 * dp], fa, fb[0], fb[1]);
            mst_mma_bf16(acc[2 * dp + 1], fa, fb[2], fb[3]);
        }
    }
}

/* Rows r0 + g and r0 + g + 8 (g = lane / 4) of acc [16 x 8 DT] times s into a
 * row-major bf16 matrix (stride ld), rows >= T skipped. */
template <int DT>
__device__ __forceinline__ void store_rows(uint16_t* dst, int64_t ld, const float (&acc)[DT][4], int r0, int T,
                                           float s0, float s1, int lane) {
    const int g = lane >> 2, c = 2 * (lane & 3);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = r0 + g + 8 * half;
        if (r >= T) continue;
        const float s = half ? s1 : s0;
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
            *reinterpret_cast<uint32_t*>(dst + (int64_t)r * ld + dt * 8 + c) =
                pack_bf16(acc[dt][2 * half] * s, acc[dt][2 * half + 1] * s);
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <int D>
constexpr int fwd_smem() { return (BR + 4 * BC) * (D + PAD) * 2; }

/* Forward: block (b NH + h, y) takes query block nqb - 1 - y of query head
 * h (the longest rows first), reading key-value head h / G. */
template <int D>
__global__ void __launch_bounds__(THREADS, 2) flash_fwd_kernel(fa_args p) {
    constexpr int LD = D + PAD, NT = BC / 8, DT = D / 8;
    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t *sQ = smem, *sK = sQ + BR * LD, *sV = sK + 2 * BC * LD; /* [BR][LD] [2][BC][LD] [2][BC][LD] */
    const int nqb = (p.T + BR - 1) / BR, qb = nqb - 1 - blockIdx.y, q0 = qb * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c2 = 2 * (lane & 3);
    const int b = blockIdx.x / p.NH, h = blockIdx.x % p.NH, kvh = h / (p.NH / p.KV);
    const int64_t ld = p.W;
    const uint16_t *q = p.qkv + q_off(p, D, b, h), *k = p.qkv + k_off(p, D, b, kvh), *v = p.qkv + v_off(p, D, b, kvh);
    const int nkb = (q0 + BR - 1) / BC + 1; /* key blocks up to the last row's diagonal */
    const int row0 = q0 + warp * 16 + g;    /* this thread's rows: row0, row0 + 8 */
    const float scl = p.sc * LOG2E;         /* scores in log2 units */
    load_rows<BR, D>(sQ, q, ld, q0, p.T);
    load_rows<BC, D>(sK, k, ld, 0, p.T);
    load_rows<BC, D>(sV, v, ld, 0, p.T);
    mst_cp_async_commit();
    float o[DT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    uint32_t qf[D / 16][4];
    for (int j = 0; j < nkb; j++) {
        const int cur = j & 1;
        pipe_step(j + 1 < nkb, [&] {
            load_rows<BC, D>(sK + (cur ^ 1) * BC * LD, k, ld, (j + 1) * BC, p.T);
            load_rows<BC, D>(sV + (cur ^ 1) * BC * LD, v, ld, (j + 1) * BC, p.T);
        });
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) frag_a<LD>(qf[kk], sQ, warp * 16, kk * 16, lane);
        }
        const uint16_t *K = sK + cur * BC * LD, *V = sV + cur * BC * LD;
        float s[NT][4];
#pragma unroll
        for (int i = 0; i < NT; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t fb[4];
                frag_bt<LD>(fb, K, np * 16, kk * 16, lane);
                mst_mma_bf16(s[2 * np], qf[kk], fb[0], fb[1]);
                mst_mma_bf16(s[2 * np + 1], qf[kk], fb[2], fb[3]);
            }
        /* scale; keys past the row masked (keys >= T come only with rows >= T) */
        const bool diag = j * BC + BC - 1 > q0 + warp * 16;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int i = 0; i < NT; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = j * BC + i * 8 + c2 + (e & 1), row = row0 + 8 * (e >> 1);
                s[i][e] = diag && key > row ? -INFINITY : s[i][e] * scl;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[i][e]);
            }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = quad_max(mx[r]);
            base[r] = mx[r] == -INFINITY ? 0.0f : mx[r];
            const float corr = fast_exp2(m[r] - base[r]);
            m[r] = mx[r];
            l[r] *= corr;
#pragma unroll
            for (int i = 0; i < DT; i++) o[i][2 * r] *= corr, o[i][2 * r + 1] *= corr;
        }
#pragma unroll
        for (int i = 0; i < NT; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[i][e] = fast_exp2(s[i][e] - base[e >> 1]);
                l[e >> 1] += s[i][e];
            }
        mma_pb<NT, DT, LD>(o, s, V, lane);
        __syncthreads(); /* buffer cur is refilled by the next step */
    }
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] = quad_sum(l[r]);
        inv[r] = 1.0f / l[r];
        const int row = row0 + 8 * r;
        if ((lane & 3) == 0 && row < p.T) p.lse[(int64_t)blockIdx.x * p.T + row] = (m[r] + log2f(l[r])) / LOG2E;
    }
    store_rows<DT>(p.out_w + o_off(p, D, b, h), p.HO, o, q0 + warp * 16, p.T, inv[0], inv[1], lane);
}

/* delta [B, NH, T] = rowsum(dout * out) per (row, head), fp32, one warp each
 * (lane sums in element order, then a fixed xor tree). */
__global__ void flash_delta_kernel(fa_args p, int D, int64_t rows) {
    const int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= rows) return;
    const int64_t bt = w / p.NH, h = w % p.NH, b = bt / p.T, t = bt % p.T;
    const uint16_t *o = p.out + bt * p.HO + h * D, *g = p.dout + bt * p.HO + h * D;
    float s = 0.0f;
    for (int d = 2 * lane; d < D; d += 64) {
        const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(o + d);
        const __nv_bfloat162 y = *reinterpret_cast<const __nv_bfloat162*>(g + d);
        s += __bfloat162float(x.x) * __bfloat162float(y.x) + __bfloat162float(x.y) * __bfloat162float(y.y);
    }
    for (int k = 16; k > 0; k >>= 1) s += __shfl_xor_sync(0xffffffffu, s, k);
    if (lane == 0) p.delta[(b * p.NH + h) * p.T + t] = s;
}

/* Queries per step of the dk/dv kernel: fewer at D 128 (registers). */
template <int D>
constexpr int dkv_bq() { return D == 128 ? 32 : 64; }
template <int D>
constexpr int dkv_smem() { return (2 * BR + 4 * dkv_bq<D>()) * (D + PAD) * 2 + 4 * dkv_bq<D>() * 4; }

/* dk, dv of key block y (the longest first) of key-value head g of batch b
 * (block x = b KV + g): the sum over the query heads that read it,
 * h = g G + r for r = 0, 1, ... in order, of each one's query blocks from the
 * diagonal on, in order: one double-buffered loop of G (nqb - first) steps
 * (step st: head r = st / per, query block first + st % per), the sums in
 * registers. Each warp owns 16 keys; its tiles are transposed:
 * S^T = k q^T, dP^T = v dO^T. */
template <int D>
__global__ void __launch_bounds__(THREADS, 2) flash_dkv_kernel(fa_args p) {
    constexpr int BQ = dkv_bq<D>(), LD = D + PAD, NT = BQ / 8, DT = D / 8;
    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t *sK = smem, *sV = sK + BR * LD, *sQ = sV + BR * LD, *sG = sQ + 2 * BQ * LD; /* [BR][LD] x2, [2][BQ][LD] x2 */
    float *sL = reinterpret_cast<float*>(sG + 2 * BQ * LD), *sD = sL + 2 * BQ;          /* [2][BQ] x2 */
    const int b = blockIdx.x / p.KV, kvh = blockIdx.x % p.KV, grp = p.NH / p.KV;
    const int k0 = blockIdx.y * BR, nqb = (p.T + BQ - 1) / BQ, first = k0 / BQ;
    const int per = nqb - first, steps = grp * per; /* per >= 1: k0 < T */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c2 = 2 * (lane & 3);
    const int64_t ld = p.W;
    const float scl = p.sc * LOG2E;
    const int key0 = k0 + warp * 16 + g; /* this thread's keys: key0, key0 + 8 */
    load_rows<BR, D>(sK, p.qkv + k_off(p, D, b, kvh), ld, k0, p.T);
    load_rows<BR, D>(sV, p.qkv + v_off(p, D, b, kvh), ld, k0, p.T);
    auto load_q = [&](int st, int buf) {
        const int h = kvh * grp + st / per, i = first + st % per;
        const int64_t lrow = ((int64_t)b * p.NH + h) * p.T; /* [B, NH, T] row of (b, h) */
        load_rows<BQ, D>(sQ + buf * BQ * LD, p.qkv + q_off(p, D, b, h), ld, i * BQ, p.T);
        load_rows<BQ, D>(sG + buf * BQ * LD, p.dout + o_off(p, D, b, h), p.HO, i * BQ, p.T);
        load_vec<BQ>(sL + buf * BQ, p.lse + lrow, i * BQ, p.T);
        load_vec<BQ>(sD + buf * BQ, p.delta + lrow, i * BQ, p.T);
    };
    load_q(0, 0);
    mst_cp_async_commit();
    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[i][e] = dv[i][e] = 0.0f;
    for (int st = 0; st < steps; st++) {
        const int cur = st & 1, i = first + st % per;
        pipe_step(st + 1 < steps, [&] { load_q(st + 1, cur ^ 1); });
        const uint16_t *Q = sQ + cur * BQ * LD, *G = sG + cur * BQ * LD;
        const float *L = sL + cur * BQ, *Dl = sD + cur * BQ;
        float s[NT][4], dp[NT][4];
        mma_abt<NT, D, LD>(s, sK, warp * 16, Q, lane);
        mma_abt<NT, D, LD>(dp, sV, warp * 16, G, lane);
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qi = n * 8 + c2 + (e & 1), row = i * BQ + qi, key = key0 + 8 * (e >> 1);
                const float pr = row >= key && row < p.T ? fast_exp2(s[n][e] * scl - L[qi] * LOG2E) : 0.0f;
                s[n][e] = pr;                       /* P^T */
                dp[n][e] = pr * (dp[n][e] - Dl[qi]); /* dS^T */
            }
        mma_pb<NT, DT, LD>(dv, s, G, lane);
        mma_pb<NT, DT, LD>(dk, dp, Q, lane);
        __syncthreads();
    }
    store_rows<DT>(p.dqkv + k_off(p, D, b, kvh), ld, dk, k0 + warp * 16, p.T, p.sc, p.sc, lane);
    store_rows<DT>(p.dqkv + v_off(p, D, b, kvh), ld, dv, k0 + warp * 16, p.T, 1.0f, 1.0f, lane);
}

template <int D>
constexpr int dq_smem() { return (2 * BR + 4 * BC) * (D + PAD) * 2; }

/* dq of query block nqb - 1 - y of query head h of batch b (block x =
 * b NH + h), over the key blocks of key-value head h / G in order. */
template <int D>
__global__ void __launch_bounds__(THREADS, 2) flash_dq_kernel(fa_args p) {
    constexpr int LD = D + PAD, NT = BC / 8, DT = D / 8;
    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t *sQ = smem, *sG = sQ + BR * LD, *sK = sG + BR * LD, *sV = sK + 2 * BC * LD; /* [BR][LD] x2, [2][BC][LD] x2 */
    const int nqb = (p.T + BR - 1) / BR, q0 = (nqb - 1 - blockIdx.y) * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c2 = 2 * (lane & 3);
    const int b = blockIdx.x / p.NH, h = blockIdx.x % p.NH, kvh = h / (p.NH / p.KV);
    const int64_t ld = p.W;
    const uint16_t *q = p.qkv + q_off(p, D, b, h), *k = p.qkv + k_off(p, D, b, kvh), *v = p.qkv + v_off(p, D, b, kvh);
    const int nkb = (q0 + BR - 1) / BC + 1, row0 = q0 + warp * 16 + g;
    const float scl = p.sc * LOG2E;
    float lse2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        lse2[r] = row < p.T ? p.lse[(int64_t)blockIdx.x * p.T + row] * LOG2E : 0.0f;
        dl[r] = row < p.T ? p.delta[(int64_t)blockIdx.x * p.T + row] : 0.0f;
    }
    load_rows<BR, D>(sQ, q, ld, q0, p.T);
    load_rows<BR, D>(sG, p.dout + o_off(p, D, b, h), p.HO, q0, p.T);
    load_rows<BC, D>(sK, k, ld, 0, p.T);
    load_rows<BC, D>(sV, v, ld, 0, p.T);
    mst_cp_async_commit();
    float dq[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
    for (int j = 0; j < nkb; j++) {
        const int cur = j & 1;
        pipe_step(j + 1 < nkb, [&] {
            load_rows<BC, D>(sK + (cur ^ 1) * BC * LD, k, ld, (j + 1) * BC, p.T);
            load_rows<BC, D>(sV + (cur ^ 1) * BC * LD, v, ld, (j + 1) * BC, p.T);
        });
        const uint16_t *K = sK + cur * BC * LD, *V = sV + cur * BC * LD;
        float s[NT][4], dp[NT][4];
        mma_abt<NT, D, LD>(s, sQ, warp * 16, K, lane);
        mma_abt<NT, D, LD>(dp, sG, warp * 16, V, lane);
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = j * BC + n * 8 + c2 + (e & 1), r = e >> 1;
                const float pr = key <= row0 + 8 * r ? fast_exp2(s[n][e] * scl - lse2[r]) : 0.0f;
                dp[n][e] = pr * (dp[n][e] - dl[r]); /* dS */
            }
        mma_pb<NT, DT, LD>(dq, dp, K, lane);
        __syncthreads();
    }
    store_rows<DT>(p.dqkv + q_off(p, D, b, h), ld, dq, q0 + warp * 16, p.T, p.sc, p.sc, lane);
}

fa_args args_of(const mst_attn_args* a) {
    const int64_t NH = a->n_head, KV = a->n_kv_head, D = a->head_dim;
    fa_args p = {a->qkv, a->out, a->out, a->dout, a->dqkv, a->lse, a->delta, (int)a->seq, (int)NH, (int)KV,
                 (int)((NH + 2 * KV) * D), (int)(NH * D), 1.0f / sqrtf((float)D)};
    return p;
}

template <typename K>
mst_status launch(K kernel, dim3 grid, int smem, cudaStream_t s, const fa_args& p) {
    MST_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<grid, THREADS, smem, s>>>(p);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

template <int D>
mst_status forward(const mst_attn_args* a, cudaStream_t s) {
    const unsigned bh = (unsigned)(a->batch * a->n_head), nqb = (unsigned)((a->seq + BR - 1) / BR);
    return launch(flash_fwd_kernel<D>, dim3(bh, nqb), fwd_smem<D>(), s, args_of(a));
}

/* delta; dk, dv per (batch, key-value head, key block); dq per (batch,
 * query head, query block). */
template <int D>
mst_status backward(const mst_attn_args* a, cudaStream_t s) {
    const fa_args p = args_of(a);
    const int64_t rows = a->batch * a->seq * a->n_head;
    flash_delta_kernel<<<mst_blocks(rows * 32, 256), 256, 0, s>>>(p, D, rows);
    MST_CUDA_LAUNCHED();
    const unsigned bkv = (unsigned)(a->batch * a->n_kv_head), bh = (unsigned)(a->batch * a->n_head);
    const unsigned nb = (unsigned)((a->seq + BR - 1) / BR);
    MST_TRY(launch(flash_dkv_kernel<D>, dim3(bkv, nb), dkv_smem<D>(), s, p));
    return launch(flash_dq_kernel<D>, dim3(bh, nb), dq_smem<D>(), s, p);
}

bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

} // namespace

/* The dims the kernels take: D 64 or 128 (the tile shapes), KV dividing
 * NH (any group size), and the sizes their int indices and grids hold. */
extern "C" mst_status mst_cuda_attn_flash_check(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx;
    if (a->head_dim != 64 && a->head_dim != 128)
        return mst_set_error(MST_ERR_UNSUPPORTED, "flash attention on cuda: head_dim %lld: expected 64 or 128",
                             (long long)a->head_dim);
    if (a->n_head < 1 || a->n_kv_head < 1 || a->n_head % a->n_kv_head != 0)
        return mst_set_error(MST_ERR_INVALID, "flash attention: n_kv_head %lld must divide n_head %lld",
                             (long long)a->n_kv_head, (long long)a->n_head);
    if (a->batch < 1 || a->seq < 1)
        return mst_set_error(MST_ERR_INVALID, "flash attention: batch %lld, seq %lld: expected >= 1",
                             (long long)a->batch, (long long)a->seq);
    if (a->batch * a->n_head > INT32_MAX || a->seq > INT32_MAX / 2 ||
        a->batch * a->seq * a->n_head > INT32_MAX || (a->n_head + 2 * a->n_kv_head) * a->head_dim > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "flash attention: batch %lld x heads %lld x seq %lld: too large",
                             (long long)a->batch, (long long)a->n_head, (long long)a->seq);
    return MST_OK;
}

/* The buffers' alignment (16 bytes: the cp.async copies and pair stores). */
static mst_status check_ptrs(const mst_attn_args* a, int backward) {
    MST_TRY(mst_cuda_attn_flash_check(NULL, a));
    const void* q = a->qkv;
    const void* need[] = {q, a->out, a->lse, backward ? (const void*)a->dout : q, backward ? (const void*)a->dqkv : q,
                          backward ? (const void*)a->delta : q};
    for (size_t i = 0; i < sizeof need / sizeof *need; i++)
        if (!need[i] || !aligned16(need[i]))
            return mst_set_error(MST_ERR_INVALID, "flash attention: buffer %zu of (qkv, out, lse, dout, dqkv, delta) "
                                 "is NULL or not 16-byte aligned (%p)", i, need[i]);
    return MST_OK;
}

extern "C" mst_status mst_cuda_attn_flash_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_ptrs(a, 0));
    cudaStream_t s = mst_cuda(ctx)->stream;
    return a->head_dim == 64 ? forward<64>(a, s) : forward<128>(a, s);
}

extern "C" mst_status mst_cuda_attn_flash_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_ptrs(a, 1));
    cudaStream_t s = mst_cuda(ctx)->stream;
    return a->head_dim == 64 ? backward<64>(a, s) : backward<128>(a, s);
}
