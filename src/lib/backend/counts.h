/*
 * counts.h — the contract of the per-group row counts, defined once for the
 * host and every kernel (C11 and CUDA): counts [E] int32 are valid when each
 * is >= 0 and their sum is <= max_rows; the rows of group g are then
 * [off[g], off[g] + counts[g]), off the exclusive prefix sum (off[E] = the
 * sum). The host check with a message is mst_counts_offsets (core); a CUDA
 * block runs it as mst_block_counts (cuda/counts.cuh).
 */
#ifndef MST_COUNTS_H
#define MST_COUNTS_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MST_COUNTS_BAD = -1 }; /* the verdict on invalid counts */

/* The sum of counts [lo, hi); off (NULL: not written) gets off[g] = base +
 * the sum of counts [lo, g) for g in [lo, hi); *neg is set when a count is
 * negative. */
MST_HD int64_t mst_counts_span(const int32_t* counts, int32_t lo, int32_t hi, int64_t base, int64_t* off,
                               int* neg) {
    int64_t run = base;
    for (int32_t g = lo; g < hi; g++) {
        const int32_t c = counts[g];
        if (off) off[g] = run;
        *neg |= c < 0;
        run += c;
    }
    return run - base;
}

/* The verdict on counts of sum `total` (neg: one was negative): the sum,
 * or MST_COUNTS_BAD. */
MST_HD int64_t mst_counts_verdict(int neg, int64_t total, int64_t max_rows) {
    return neg || total > max_rows ? (int64_t)MST_COUNTS_BAD : total;
}

/* counts [E] in one pass: the verdict; off [E+1] (NULL: not written) the
 * offsets. */
MST_HD int64_t mst_counts_total(const int32_t* counts, int32_t n_groups, int64_t max_rows, int64_t* off) {
    int neg = 0;
    const int64_t total = mst_counts_span(counts, 0, n_groups, 0, off, &neg);
    if (off) off[n_groups] = total;
    return mst_counts_verdict(neg, total, max_rows);
}

#ifdef __cplusplus
}
#endif
#endif /* MST_COUNTS_H */
