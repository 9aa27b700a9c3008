/*
 * model_ops_qk.cu — Qwen3's QK-norm and rotary embedding on CUDA, forward
 * and backward side by side (contract and formula: mst_qk_args in
 * model_backend.h; the CPU reference is the cpu/ folder's qk op).
 *
 * A row of x is [q (NH D) | k (KV D) | v (KV D)]; the NH + KV "normed heads"
 * j of a row are the q heads (j < NH, weight wq) then the k heads (weight
 * wk); v is copied. Per normed head, with u = x_j (fp32 from bf16):
 *   forward:  rs = 1 / sqrt(mean(u^2) + eps), n = u rs w,
 *             y[i] = n[i] c_i - n[i + D/2] s_i, y[i + D/2] = n[i + D/2] c_i + n[i] s_i
 *   backward: the rotation's transpose g = R^T dy:
 *             g[i] = dy[i] c_i + dy[i + D/2] s_i, g[i + D/2] = dy[i + D/2] c_i - dy[i] s_i,
 *             then RMSNorm's backward from g: dw += g u rs,
 *             dx = rs g w - u rs^3 sum(g w u) / D.
 * c_i, s_i: cos and sin of a_i = pos * inv_i, inv_i = 1 / theta^(2 i / D), all
 * fp32 values as the header states. powf, cosf and sinf are evaluated in
 * double and rounded once to fp32: the correctly rounded fp32 result,
 * which the CPU's libm gives too (to its < 1 ulp), rather than CUDA's
 * fp32 powf (up to a few ulp: at position 4096 a few ulp of inv_i are 1e-3
 * of an angle). No fast-math intrinsics.
 *
 * Forward: one block per token (the token's angle table in shared memory,
 * warps over its normed heads, the threads over its v). Backward: one
 * block per chunk of consecutive tokens (QK_PARTS chunks at most); warp w
 * keeps its own dw row in shared memory (its heads j = w, w + warps, ... of
 * each token, tokens in order), the block adds the warp rows in warp order
 * into its partial [2, D] of the ws_qk workspace, and a second kernel adds
 * the partials in chunk order into dwq / dwk. Fixed order everywhere, no
 * atomics, no allocation after the first call (the workspace is sized by
 * it, outside graph capture, like the other model ops' workspaces).
 */
#include "model_ops.cuh"

namespace {

constexpr int QK_THREADS = 256, QK_WARPS = QK_THREADS / 32;
constexpr int QK_PARTS = 1024;     /* backward chunks at most (partials [QK_PARTS, 2, D]) */
constexpr int64_t QK_MAX_D = 512;  /* shared memory: (2 QK_WARPS + 1) D fp32 */

struct qk_dims {
    int64_t W, NH, KV, D, half; /* row width (NH + 2 KV) D, heads, D, D / 2 */
};

qk_dims dims_of(const mst_qk_args* a) {
    qk_dims d = {(a->n_head + 2 * a->n_kv_head) * a->head_dim, a->n_head, a->n_kv_head, a->head_dim,
                 a->head_dim / 2};
    return d;
}

/* cs [D/2], sn [D/2] (shared) = cos, sin of the angles of position pos. The
 * exponent (2 i) / D and the angle pos * inv are fp32 operations as in the
 * header; the three transcendental functions are rounded once from double. */
__device__ void rope_table(float* cs, float* sn, int64_t pos, int64_t D, float theta) {
    for (int64_t i = threadIdx.x; i < D / 2; i += blockDim.x) {
        const float e = (float)(2 * i) / (float)D;
        const float inv = 1.0f / (float)pow((double)theta, (double)e);
        const float ang = (float)pos * inv;
        double s, c;
        sincos((double)ang, &s, &c);
        cs[i] = (float)c;
        sn[i] = (float)s;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
    return v;
}

/* One normed head of one token, by one warp: x, y [D] bf16, w [D] bf16,
 * *rstd fp32. Lane sums in element order, then a fixed xor tree. */
__device__ void head_forward(const uint16_t* x, const uint16_t* w, uint16_t* y, float* rstd, const float* cs,
                             const float* sn, int64_t D, float eps, int lane) {
    const int64_t half = D / 2;
    float ss = 0.0f;
    for (int64_t i = lane; i < D; i += 32) {
        const float u = mst_bf(x[i]);
        ss += u * u;
    }
    const float rs = 1.0f / sqrtf(warp_sum(ss) / (float)D + eps);
    if (lane == 0) *rstd = rs;
    for (int64_t i = lane; i < half; i += 32) {
        const float n0 = mst_bf(x[i]) * rs * mst_bf(w[i]), n1 = mst_bf(x[i + half]) * rs * mst_bf(w[i + half]);
        y[i] = mst_to_bf(n0 * cs[i] - n1 * sn[i]);
        y[i + half] = mst_to_bf(n1 * cs[i] + n0 * sn[i]);
    }
}

/* The same head backward: dx [D] bf16 from dy [D] bf16; acc [D] (this
 * warp's shared dw row) += g u rs. */
__device__ void head_backward(const uint16_t* x, const uint16_t* w, const uint16_t* dy, uint16_t* dx, float rs,
                              float* acc, const float* cs, const float* sn, int64_t D, int lane) {
    const int64_t half = D / 2;
    float dot = 0.0f;
    for (int64_t i = lane; i < half; i += 32) {
        const float d0 = mst_bf(dy[i]), d1 = mst_bf(dy[i + half]);
        const float g0 = d0 * cs[i] + d1 * sn[i], g1 = d1 * cs[i] - d0 * sn[i];
        const float u0 = mst_bf(x[i]), u1 = mst_bf(x[i + half]);
        dot += g0 * mst_bf(w[i]) * u0 + g1 * mst_bf(w[i + half]) * u1;
        acc[i] += g0 * u0 * rs;
        acc[i + half] += g1 * u1 * rs;
    }
    const float k = warp_sum(dot) * rs * rs * rs / (float)D;
    for (int64_t i = lane; i < half; i += 32) {
        const float d0 = mst_bf(dy[i]), d1 = mst_bf(dy[i + half]);
        const float g0 = d0 * cs[i] + d1 * sn[i], g1 = d1 * cs[i] - d0 * sn[i];
        dx[i] = mst_to_bf(rs * g0 * mst_bf(w[i]) - mst_bf(x[i]) * k);
        dx[i + half] = mst_to_bf(rs * g1 * mst_bf(w[i + half]) - mst_bf(x[i + half]) * k);
    }
}

/* v's KV D values of row t copied from src to dst (bf16 bits). */
__device__ void copy_v(uint16_t* dst, const uint16_t* src, const qk_dims& d, int64_t t) {
    const int64_t off = t * d.W + (d.NH + d.KV) * d.D;
    for (int64_t i = threadIdx.x; i < d.KV * d.D; i += blockDim.x) dst[off + i] = src[off + i];
}

/* Block t: token t. Shared: cs, sn [D/2] each. */
__global__ void __launch_bounds__(QK_THREADS) qk_forward_kernel(mst_qk_args a, qk_dims d) {
    extern __shared__ float qk_smem[];
    float *cs = qk_smem, *sn = cs + d.half;
    const int64_t t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    rope_table(cs, sn, t % a.seq, d.D, a.theta);
    __syncthreads();
    for (int64_t j = warp; j < d.NH + d.KV; j += QK_WARPS) {
        const int64_t off = t * d.W + j * d.D;
        head_forward(a.x + off, j < d.NH ? a.wq : a.wk, a.y + off, a.rstd + t * (d.NH + d.KV) + j, cs, sn, d.D,
                     a.eps, lane);
    }
    copy_v(a.y, a.x, d, t);
}

/* Block p: tokens [p chunk, (p + 1) chunk) in order; partial [QK_PARTS, 2, D]
 * fp32: row 2 p the chunk's dwq sum, row 2 p + 1 its dwk sum. Shared: cs, sn
 * [D/2] each, then acc [QK_WARPS][2][D]. */
__global__ void __launch_bounds__(QK_THREADS) qk_backward_kernel(mst_qk_args a, qk_dims d, int64_t chunk,
                                                                 float* partial) {
    extern __shared__ float qk_smem[];
    float *cs = qk_smem, *sn = cs + d.half, *acc = cs + d.D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int64_t i = threadIdx.x; i < QK_WARPS * 2 * d.D; i += blockDim.x) acc[i] = 0.0f;
    const int64_t t0 = blockIdx.x * chunk, t1 = min(t0 + chunk, a.rows);
    for (int64_t t = t0; t < t1; t++) {
        __syncthreads(); /* the previous token's table is read no more */
        rope_table(cs, sn, t % a.seq, d.D, a.theta);
        __syncthreads();
        for (int64_t j = warp; j < d.NH + d.KV; j += QK_WARPS) {
            const int64_t off = t * d.W + j * d.D;
            const int kind = j < d.NH ? 0 : 1; /* 0: q head, 1: k head */
            head_backward(a.x + off, kind ? a.wk : a.wq, a.dy + off, a.dx + off, a.rstd[t * (d.NH + d.KV) + j],
                          acc + (warp * 2 + kind) * d.D, cs, sn, d.D, lane);
        }
        copy_v(a.dx, a.dy, d, t);
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < 2 * d.D; i += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < QK_WARPS; w++) s += acc[w * 2 * d.D + i];
        partial[blockIdx.x * 2 * d.D + i] = s;
    }
}

/* dwq [D] += sum over the parts in order of partial rows 2 p; dwk of 2 p + 1. */
__global__ void qk_dw_kernel(mst_qk_args a, int64_t D, int64_t parts, const float* partial) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2 * D) return;
    float s = 0.0f;
    for (int64_t p = 0; p < parts; p++) s += partial[p * 2 * D + i];
    if (i < D) a.dwq[i] += s;
    else a.dwk[i - D] += s;
}

mst_status check(const mst_qk_args* a) {
    if (a->head_dim < 2 || a->head_dim % 2 != 0 || a->head_dim > QK_MAX_D)
        return mst_set_error(MST_ERR_INVALID, "qk norm + rope on cuda: head_dim %lld: expected even, 2..%lld",
                             (long long)a->head_dim, (long long)QK_MAX_D);
    if (a->n_head < 1 || a->n_kv_head < 1 || a->seq < 1 || a->rows < 0 || a->rows > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "qk norm + rope on cuda: heads %lld, kv heads %lld, seq %lld, rows %lld",
                             (long long)a->n_head, (long long)a->n_kv_head, (long long)a->seq, (long long)a->rows);
    return MST_OK;
}

} // namespace

extern "C" mst_status mst_cuda_qk_forward(mst_ctx_t* ctx, const mst_qk_args* a) {
    MST_TRY(check(a));
    if (a->rows == 0) return MST_OK;
    const qk_dims d = dims_of(a);
    qk_forward_kernel<<<(unsigned)a->rows, QK_THREADS, (size_t)d.D * 4, mst_cuda(ctx)->stream>>>(*a, d);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

extern "C" mst_status mst_cuda_qk_backward(mst_ctx_t* ctx, const mst_qk_args* a) {
    MST_TRY(check(a));
    if (a->rows == 0) return MST_OK;
    mst_cuda_impl* c = mst_cuda(ctx);
    const qk_dims d = dims_of(a);
    const int64_t parts = a->rows < QK_PARTS ? a->rows : QK_PARTS, chunk = (a->rows + parts - 1) / parts;
    const int64_t n_parts = (a->rows + chunk - 1) / chunk; /* the chunks that hold tokens */
    float* partial = NULL;
    MST_TRY(mst_workspace(ctx, &c->ws_qk, (size_t)(QK_PARTS * 2 * d.D) * sizeof(float), (void**)&partial));
    const size_t smem = (size_t)((1 + 2 * QK_WARPS) * d.D) * sizeof(float);
    qk_backward_kernel<<<(unsigned)n_parts, QK_THREADS, smem, c->stream>>>(*a, d, chunk, partial);
    MST_CUDA_LAUNCHED();
    qk_dw_kernel<<<mst_blocks(2 * d.D, 256), 256, 0, c->stream>>>(*a, d.D, n_parts, partial);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}
