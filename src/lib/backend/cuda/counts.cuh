/*
 * counts.cuh — the counts contract (counts.h) run by a whole CUDA block.
 */
#ifndef MST_CUDA_COUNTS_CUH
#define MST_CUDA_COUNTS_CUH

#include "../counts.h"

/* Every thread of the block (blockDim.x a multiple of 32, at most 1024):
 * mst_counts_verdict of counts [E] against max_rows; off (NULL: not
 * written), visible to the whole block on return, gets the offsets [E+1].
 * Each thread takes a run of consecutive groups (mst_counts_span); a warp
 * scan and the warp sums in order join the runs. */
__device__ __forceinline__ int64_t mst_block_counts(const int32_t* __restrict__ counts, int32_t E, int64_t max_rows,
                                                    int64_t* off) {
    __shared__ int64_t s_part[32];
    __shared__ int s_neg;
    const int t = threadIdx.x, lane = t & 31, w = t >> 5, n = blockDim.x;
    if (t == 0) s_neg = 0;
    const int per = (E + n - 1) / n;
    const int g0 = min(t * per, E), g1 = min(g0 + per, E);
    int neg = 0;
    const int64_t local = mst_counts_span(counts, g0, g1, 0, NULL, &neg);
    int64_t incl = local; /* inclusive scan over the warp */
    for (int o = 1; o < 32; o <<= 1) {
        const int64_t v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) s_part[w] = incl;
    __syncthreads();
    if (neg) s_neg = 1;
    int64_t base = 0, total = 0;
    for (int i = 0; i < (n >> 5); i++) {
        base += i < w ? s_part[i] : 0;
        total += s_part[i];
    }
    if (off) {
        mst_counts_span(counts, g0, g1, base + incl - local, off, &neg);
        if (t == 0) off[E] = total;
    }
    __syncthreads();
    return mst_counts_verdict(s_neg, total, max_rows);
}

#endif
