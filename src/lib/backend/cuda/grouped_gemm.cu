/*
 * grouped_gemm.cu — the CUDA grouped linear ops (forward TN, dgrad NN, wgrad
 * NT) with the per-group row counts read on the device: a one-block schedule
 * kernel checks the counts (negative or summing past max_rows: raises
 * MST_FLAG_COUNTS and leaves zero tiles, so nothing is written), builds the
 * row offsets and the (group, tile) work list, then a persistent GEMM kernel
 * works through it. wgrad adds the bias gradients: dbias[g] (+)= sum_r dy[r]
 * s[r] and ds[r] = dy[r] . bias[g], summed in a fixed order.
 *
 * No host sync and no allocation once the workspace has its size (the first
 * eager call sizes it from E alone), so every op can be captured in a CUDA
 * graph and replayed with other counts. Deterministic: no floating-point
 * atomics anywhere.
 */
#include <stdlib.h>
#include <string.h>

#include "counts.cuh"
#include "cuda_ops.h"
#include "grouped_gemm.cuh"

#define GG_FULL 0xffffffffu

/* ---- schedule ------------------------------------------------------------ */

/* Exclusive prefix of v(i), i in [0, n), by one warp: out[i] (int32,
 * clamped) and out[n] = the total, which is returned in int64. */
template <class F>
__device__ int64_t warp_prefix(int n, F v, int32_t* out) {
    const int lane = threadIdx.x & 31;
    int64_t carry = 0;
    for (int base = 0; base < n; base += 32) {
        int i = base + lane;
        int64_t x = i < n ? v(i) : 0, inc = x;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            int64_t y = __shfl_up_sync(GG_FULL, inc, d);
            if (lane >= d) inc += y;
        }
        if (i < n) out[i] = (int32_t)min(carry + inc - x, (int64_t)INT32_MAX);
        carry += __shfl_sync(GG_FULL, inc, 31);
    }
    if (lane == 0) out[n] = (int32_t)min(carry, (int64_t)INT32_MAX);
    return carry;
}

/* Tiles of a group with `count` rows: rows_tile > 0 tiles the rows (forward,
 * dgrad); rows_tile = 0 gives fixed tiles (wgrad), also for an empty group
 * when include_empty (OVERWRITE writes its zeros). */
__device__ __forceinline__ int32_t group_tiles(int32_t count, int32_t rows_tile, int32_t tiles_fixed,
                                               int include_empty) {
    if (count < 0) return 0;
    if (rows_tile) return gg_cdiv(count, rows_tile) * tiles_fixed;
    return count > 0 || include_empty ? tiles_fixed : 0;
}

/* One block: validate counts (mst_block_counts), offsets, order groups by
 * rows (largest first, ties by index: deterministic), tile offsets, reset
 * the tile counter. */
__global__ void schedule_kernel(const int32_t* counts, int32_t n_groups, int64_t max_rows,
                                int32_t rows_tile, int32_t tiles_fixed, int include_empty,
                                gg_sched s, int32_t* err_flag) {
    extern __shared__ int32_t sh[]; /* cnt [E], work [E] */
    int32_t* cnt = sh;
    int32_t* work = sh + n_groups;
    for (int g = threadIdx.x; g < n_groups; g += blockDim.x) {
        int32_t c = counts[g];
        cnt[g] = c;
        work[g] = group_tiles(c, rows_tile, tiles_fixed, include_empty);
    }
    const int ok = mst_block_counts(counts, n_groups, max_rows, NULL) != MST_COUNTS_BAD; /* syncs the block */
    for (int g = threadIdx.x; g < n_groups; g += blockDim.x) {
        int rank = 0;
        for (int h = 0; h < n_groups; h++) /* by rows: the tile count or the K length */
            rank += cnt[h] > cnt[g] || (cnt[h] == cnt[g] && h < g);
        s.order[rank] = g;
    }
    __syncthreads(); /* order visible to warp 0 (global writes of this block) */
    if (threadIdx.x < 32) {
        warp_prefix(n_groups, [&](int g) { return (int64_t)cnt[g]; }, s.off);
        int32_t tiles = (int32_t)warp_prefix(
            n_groups, [&](int i) { return (int64_t)work[s.order[i]]; }, s.tile_off);
        if (threadIdx.x == 0) {
            if (!ok) mst_dev_flag(err_flag, MST_FLAG_COUNTS);
            s.hdr[GG_H_TILES] = ok ? tiles : 0;
            s.hdr[GG_H_NEXT] = s.hdr[GG_H_NEXT + 1] = 0;
            s.hdr[GG_H_OK] = ok;
        }
    }
}

/* The schedule kernel's dynamic shared memory for E groups: cnt [E], work
 * [E], + 16 bytes (the rank loop's loads may be widened past the last
 * element: compute-sanitizer saw a 12-byte read at E = 1). Its attribute is
 * set for GG_SCHED_MAX_E at context creation, so its static shared memory
 * (mst_block_counts) fits beside it. */
enum { GG_SCHED_MAX_E = 48 * 1024 / (2 * sizeof(int32_t)) };
static size_t sched_shared(int32_t n_groups) { return 2 * sizeof(int32_t) * (size_t)n_groups + 16; }

/* Carves the schedule out of the ws_sched workspace (size from E only). */
static mst_status sched_make(mst_ctx_t* ctx, int32_t n_groups, gg_sched* s) {
    size_t words = GG_H_WORDS + 3 * (size_t)n_groups + 2;
    int32_t* ws = NULL;
    MST_TRY(mst_workspace(ctx, &mst_cuda(ctx)->ws_sched, words * sizeof(int32_t), (void**)&ws));
    s->hdr = ws;
    s->off = ws + GG_H_WORDS;
    s->tile_off = s->off + n_groups + 1;
    s->order = s->tile_off + n_groups + 1;
    return MST_OK;
}

/* ---- bias gradients ------------------------------------------------------- */

/* ds[r] = dy[r] . bias[g], one warp per row: lanes stride the columns in
 * order, then a fixed xor tree. */
__global__ void dscale_kernel(const uint16_t* dy, const uint16_t* bias, int32_t O, int32_t n_groups,
                              int64_t max_rows, gg_sched s, float* ds) {
    int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (r >= max_rows || !s.hdr[GG_H_OK] || r >= s.off[n_groups]) return;
    int32_t g = mst_group_of(s.off, n_groups, (int32_t)r);
    const uint16_t* d = dy + r * O;
    const uint16_t* b = bias + (int64_t)g * O;
    float acc = 0.0f;
    for (int32_t o = lane; o < O; o += 32) acc += mst_bf(d[o]) * mst_bf(b[o]);
#pragma unroll
    for (int m = 16; m; m >>= 1) acc += __shfl_xor_sync(GG_FULL, acc, m);
    if (lane == 0) ds[r] = acc;
}

/* dbias[g][o] (+)= sum_r dy[r][o] s[r]: block (DB_COLS threads of V
 * columns each, DB_SLICES row slices) per (column block, group); slice j
 * sums rows j, j + DB_SLICES, ... in order, then the slices are added in
 * order (the same sums for every V). V = 4 reads 8-byte vectors (rows
 * 8-byte aligned). */
enum { DB_COLS = 32, DB_SLICES = 8 };
template <int V>
__global__ void dbias_kernel(const uint16_t* dy, const float* scale, int32_t O, gg_sched s,
                             float* db, int accumulate) {
    __shared__ float part[DB_SLICES][DB_COLS * V];
    const int32_t g = blockIdx.y, o = (blockIdx.x * DB_COLS + threadIdx.x) * V;
    if (!s.hdr[GG_H_OK]) return;
    const int32_t r0 = s.off[g], r1 = s.off[g + 1];
    if (accumulate && r0 == r1) return; /* ACCUMULATE: an empty group adds nothing */
    float acc[V] = {};
    if (o < O) {
#pragma unroll 4
        for (int32_t r = r0 + threadIdx.y; r < r1; r += DB_SLICES) {
            const uint16_t* d = dy + (int64_t)r * O + o; /* [V] */
            uint16_t v[V];
            if (V == 4) *(uint2*)v = *(const uint2*)d;
            else v[0] = d[0];
            const float sc = scale ? scale[r] : 1.0f;
#pragma unroll
            for (int k = 0; k < V; k++) acc[k] += mst_bf(v[k]) * sc;
        }
    }
#pragma unroll
    for (int k = 0; k < V; k++) part[threadIdx.y][threadIdx.x * V + k] = acc[k];
    __syncthreads();
    if (threadIdx.y) return;
#pragma unroll
    for (int k = 0; k < V; k++) {
        if (o + k >= O) return;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < DB_SLICES; j++) sum += part[j][threadIdx.x * V + k];
        float* out = db + (int64_t)g * O + o + k;
        *out = accumulate ? *out + sum : sum;
    }
}

static mst_status bias_grads(mst_ctx_t* ctx, const mst_gl_args* a, const gg_sched* s) {
    cudaStream_t st = mst_cuda(ctx)->stream;
    const int32_t O = (int32_t)a->out;
    if (a->main_grad_b) {
        const dim3 block(DB_COLS, DB_SLICES);
        if (O % 4 == 0 && ((uintptr_t)a->dy & 7) == 0)
            dbias_kernel<4><<<dim3(gg_cdiv(O, 4 * DB_COLS), a->n_groups), block, 0, st>>>(
                a->dy, a->scale, O, *s, a->main_grad_b, a->accumulate);
        else
            dbias_kernel<1><<<dim3(gg_cdiv(O, DB_COLS), a->n_groups), block, 0, st>>>(
                a->dy, a->scale, O, *s, a->main_grad_b, a->accumulate);
        MST_CUDA_LAUNCHED();
    }
    if (a->dscale) {
        const int rows_per_block = 8;
        dscale_kernel<<<gg_cdiv(a->max_rows, rows_per_block), 32 * rows_per_block, 0, st>>>(
            a->dy, a->bias, O, a->n_groups, a->max_rows, *s, a->dscale);
        MST_CUDA_LAUNCHED();
    }
    return MST_OK;
}

/* ---- ops ------------------------------------------------------------------- */

static int aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

/* The op as C = A B^T over groups (see grouped_gemm.cuh). */
static gg_problem make_problem(const mst_cuda_impl* c, const mst_gl_args* a, int op) {
    gg_problem p;
    memset(&p, 0, sizeof p);
    const int32_t I = (int32_t)a->in, O = (int32_t)a->out;
    p.op = op;
    p.n_groups = a->n_groups;
    p.b_group = (int64_t)O * I;
    if (op == GG_FWD) {
        p.N = O, p.K = I;
        p.a = a->x, p.lda = I, p.b = a->w, p.ldb = I;
        p.c = a->y, p.ldc = O;
        p.bias = a->bias, p.scale = a->scale;
    } else if (op == GG_DGRAD) {
        p.N = I, p.K = O;
        p.a = a->dy, p.lda = O, p.b = a->w, p.ldb = I;
        p.c = a->dx, p.ldc = I;
    } else {
        p.M = O, p.N = I;
        p.a = a->dy, p.lda = O, p.b = a->x_pages ? NULL : a->x, p.ldb = I; /* NULL: paged (gg_op) */
        p.c = a->main_grad_w, p.ldc = I;
        p.accumulate = a->accumulate;
    }
    p.vec = I % 8 == 0 && O % 8 == 0 && aligned16(p.a) && (!p.b || aligned16(p.b)) && aligned16(p.c);
    p.staged_out = c->gg_kernel != MST_GG_WGMMA_REGS;
    return p;
}

/* The Hopper kernel (TMA + wgmma) needs sm_90 and 16-byte rows; the
 * mma.sync kernel takes everything else. MST_GG_KERNEL=mma forces the
 * mma.sync kernel, MST_GG_KERNEL=wgmma_regs the Hopper kernel with forward
 * and dgrad stored from registers (read at context creation; benchmarks
 * switch with mst_cuda_gg_kernel). */
static int hopper(const mst_cuda_impl* c) { return c->cc_major == 9 && c->gg_kernel != MST_GG_MMA; }

static mst_gg_kernel gg_kernel_of(const char* name) {
    if (name && strcmp(name, "mma") == 0) return MST_GG_MMA;
    if (name && strcmp(name, "wgmma_regs") == 0) return MST_GG_WGMMA_REGS;
    return MST_GG_AUTO;
}

extern "C" mst_status mst_cuda_gg_kernel(mst_ctx_t* ctx, const char* kernel) {
    MST_TRY(mst_check_ctx(ctx));
    if (mst_ctx_backend(ctx) != MST_BACKEND_CUDA)
        return mst_set_error(MST_ERR_UNSUPPORTED, "the grouped GEMM kernel is chosen on backend cuda only, not %s",
                             ctx->be->name);
    mst_cuda(ctx)->gg_kernel = gg_kernel_of(kernel);
    return MST_OK;
}

mst_status mst_cuda_gg_setup(mst_cuda_impl* c) {
    c->gg_kernel = gg_kernel_of(getenv("MST_GG_KERNEL"));
    MST_CUDA_TRY(cudaFuncSetAttribute(schedule_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)sched_shared(GG_SCHED_MAX_E)));
    MST_TRY(gg_mma_setup(c->mma_per_sm));
    return c->cc_major == 9 ? gg_wgmma_setup() : MST_OK;
}

static mst_status check_extents(const mst_gl_args* a) {
    if (a->max_rows > INT32_MAX || a->in > INT32_MAX || a->out > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID,
                             "max_rows = %lld, in = %lld, out = %lld: the CUDA grouped GEMM takes "
                             "at most 2^31 - 1 of each",
                             (long long)a->max_rows, (long long)a->in, (long long)a->out);
    return MST_OK;
}

/* x [R, I] of a paged wgrad gathered into rows of memory; rows past the
 * table or in pages past their block become zeros. */
__global__ void gather_kernel(mst_pages pg, int64_t R, int64_t I, uint16_t* out) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < R * I; i += (int64_t)gridDim.x * blockDim.x) {
        const uint16_t* row = (const uint16_t*)mst_paged_row(&pg, i / I, I * 2);
        out[i] = row ? row[i % I] : 0;
    }
}

/* The one predicate of a paged wgrad's x read in place, with no memory of
 * its own (what gl_wgrad_pages answers): the Hopper kernel, rows of x and
 * dy of 16-byte multiples, pages of 2^k >= GG_K_ALIGN rows (a box then
 * stays in one page). Otherwise x is gathered into the ws_gather workspace;
 * also where the call breaks what the predicate cannot see (dy or main_grad
 * not 16-byte aligned, tables or blocks past 2^31 - 1 rows or pages). */
static int reads_pages(const mst_cuda_impl* c, int64_t page_rows, int64_t in, int64_t out) {
    return hopper(c) && in % 8 == 0 && out % 8 == 0 && page_rows >= GG_K_ALIGN && page_rows <= (1 << 30) &&
           (page_rows & (page_rows - 1)) == 0;
}

static mst_status paged_x(mst_ctx_t* ctx, const mst_gl_args* a, int wgmma, gg_problem* p, const mst_pages** direct) {
    const mst_pages* pg = a->x_pages;
    *direct = NULL;
    if (wgmma && reads_pages(mst_cuda(ctx), pg->page_rows, a->in, a->out) && pg->table_rows <= INT32_MAX &&
        pg->n_pages[0] <= INT32_MAX && pg->n_pages[1] <= INT32_MAX) {
        *direct = a->x_pages;
        return MST_OK;
    }
    void* ws = NULL;
    MST_TRY(mst_workspace(ctx, &mst_cuda(ctx)->ws_gather, (size_t)(a->max_rows * a->in * 2), &ws));
    gather_kernel<<<4 * mst_cuda(ctx)->n_sm, 256, 0, mst_cuda(ctx)->stream>>>(*a->x_pages, a->max_rows, a->in,
                                                                             (uint16_t*)ws);
    MST_CUDA_LAUNCHED();
    p->b = (const uint16_t*)ws;
    return MST_OK;
}

/* Enqueues op `op` of a: schedule, GEMM, bias gradients. */
static mst_status gg_op(mst_ctx_t* ctx, const mst_gl_args* a, int op) {
    MST_TRY(check_extents(a));
    mst_cuda_impl* c = mst_cuda(ctx);
    gg_problem p = make_problem(c, a, op);
    const int wgmma = p.vec && hopper(c);
    const mst_pages* x_pages = NULL;
    if (op == GG_WGRAD && a->x_pages) MST_TRY(paged_x(ctx, a, wgmma, &p, &x_pages));
    int bm, bn;
    if (wgmma) gg_wgmma_tile(&bm, &bn);
    else gg_mma_tile(&bm, &bn);
    gg_sched s;
    MST_TRY(sched_make(ctx, a->n_groups, &s));
    const int32_t rows_tile = op == GG_WGRAD ? 0 : bm;
    const int32_t tiles_fixed =
        op == GG_WGRAD ? gg_cdiv(p.M, bm) * gg_cdiv(p.N, bn) : gg_cdiv(p.N, bn);
    if (a->n_groups > GG_SCHED_MAX_E)
        return mst_set_error(MST_ERR_INVALID, "n_groups = %d: the CUDA grouped GEMM takes at most %d",
                             a->n_groups, (int)GG_SCHED_MAX_E);
    schedule_kernel<<<1, 1024, sched_shared(a->n_groups), c->stream>>>(a->counts, a->n_groups, a->max_rows, rows_tile,
                                                      tiles_fixed, op == GG_WGRAD && !a->accumulate,
                                                      s, ctx->err_flag);
    MST_CUDA_LAUNCHED();
    if (wgmma) MST_TRY(gg_launch_wgmma(&p, &s, a->max_rows, c, x_pages));
    else MST_TRY(gg_launch_mma(&p, &s, c));
    if (op == GG_WGRAD) MST_TRY(bias_grads(ctx, a, &s));
    return MST_OK;
}

extern "C" mst_status mst_cuda_gl_forward(mst_ctx_t* ctx, const mst_gl_args* a) {
    return gg_op(ctx, a, GG_FWD);
}
extern "C" mst_status mst_cuda_gl_dgrad(mst_ctx_t* ctx, const mst_gl_args* a) {
    return gg_op(ctx, a, GG_DGRAD);
}
extern "C" mst_status mst_cuda_gl_wgrad(mst_ctx_t* ctx, const mst_gl_args* a) {
    return gg_op(ctx, a, GG_WGRAD);
}
extern "C" int mst_cuda_gl_wgrad_pages(mst_ctx_t* ctx, int64_t page_rows, int64_t in, int64_t out) {
    return reads_pages(mst_cuda(ctx), page_rows, in, out);
}
