/*
 * ep_ops.h — the local halves of expert-parallel dispatch and combine
 * (src/lib/ep/ runs them around the exchange): one argument struct both backends
 * read the same way, the table of ops per backend, and the slot <-> row math
 * they share (host/device inline).
 *
 * Layout of an exchange buffer ("blocks"): [W, C] rows, block d holding the
 * rows this rank sends to rank d (send side) or got from rank d (receive
 * side), in (local expert, token, slot) order of the sender; C = pair_rows.
 *   route:  topk_idx -> send_pos (the row d C + slot of each (t, s) in the
 *           blocks, d its destination; -1: skipped) and send_counts
 *           [W, El] (send_total [W] their sums); flag when a block passes
 *           C rows (its counts zeroed,
 *           its slots skipped) or an id is outside [0, E).
 *   pack:   tok[t] -> blk[send_pos[t][s]], tok_p[t][s] -> blk_p[...].
 *   gather: tok_out[t] = sum_s w[t][s] blk[pos] (w = tok_p or 1, fp32 in
 *           slot order); tok_p_out[t][s] = blk_p[pos] (0 when skipped).
 *   plan:   recv_counts [W, El] -> counts [El], row_base, block_off; flag
 *           when sum(counts) > R (counts and block totals zeroed: no row is
 *           mapped).
 *   unpack: rows[r] = blk[j][i] (times blk_p when scale), rows_p[r] =
 *           blk_p[j][i], dot_out[j][i] = blk[j][i] . dot_src[r] (fp32);
 *           r = the expert row of slot (j, i).
 *   repack: blk[j][i] = rows[r], blk_p[j][i] = rows_p[r].
 * Outputs not named (NULL) are not written; rows of a slot past its block's
 * total are not touched. Direct dispatch (no receive blocks, no unpack: the
 * sender stores each row at its expert row on the receiver) shares its
 * offset math below between the transports (mst_ep_direct_shift,
 * mst_ep_direct_row).
 */
#ifndef MST_EP_OPS_H
#define MST_EP_OPS_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mst_ep_args {
    int32_t world, rank;        /* W, this rank                                   */
    int32_t n_experts, top_k;   /* E (all ranks), k                               */
    int32_t n_local;            /* El = E / W                                     */
    int64_t n_tok;              /* N of this dispatch                             */
    int64_t cols;               /* H                                              */
    int64_t pair_rows;          /* C                                              */
    int64_t max_rows;           /* R                                              */
    const int32_t* topk_idx;    /* [N, k] global expert ids (route)               */
    int32_t* send_pos;          /* [N, k] row in [W C] (route; pack, gather read) */
    int32_t* send_counts;       /* [W, El] rows sent to (rank, local expert)      */
    int32_t* send_total;        /* [W] rows sent to each rank (route)             */
    const int32_t* recv_counts; /* [W, El] rows got from (rank, local expert)     */
    int32_t* counts;            /* [El] rows per local expert (plan)              */
    int32_t* row_base;          /* [W, El] first row of (source, expert) (plan)   */
    int32_t* block_off;         /* [W, El + 1] slot of each expert in a received
                                   block; [El] is the block's total (plan)        */
    int32_t* scratch;           /* route: [ceil(N k / MST_EP_CHUNK), E] (CUDA)    */
    int32_t* flag;              /* [1] the context's error flag                   */
    const uint16_t* tok;        /* [N, H] bf16 (pack)                             */
    const float* tok_p;         /* [N, k] fp32 (pack; gather weights), or NULL    */
    uint16_t* tok_out;          /* [N, H] bf16 (gather), or NULL                  */
    float* tok_p_out;           /* [N, k] fp32 (gather), or NULL                  */
    uint16_t* blk;              /* [W, C, H] bf16: written by pack and repack,
                                   read by gather and unpack                      */
    float* blk_p;               /* [W, C] fp32, likewise, or NULL                 */
    const uint16_t* rows_in;    /* [R, H] bf16 (repack)                           */
    const float* rows_p_in;     /* [R] fp32 (repack), or NULL                     */
    uint16_t* rows;             /* [R, H] bf16 (unpack), or NULL                  */
    float* rows_p;              /* [R] fp32 (unpack), or NULL                     */
    int scale;                  /* unpack: rows = bf16(blk_p * blk)               */
    const uint16_t* dot_src;    /* [R, H] bf16 (unpack), or NULL                  */
    float* dot_out;             /* [W, C] fp32 (unpack, with dot_src)             */
} mst_ep_args;

/* Entries per chunk of the CUDA route (its scratch is one row per chunk). */
#define MST_EP_CHUNK 256

typedef struct mst_ep_ops {
    mst_status (*route)(mst_ctx_t* ctx, const mst_ep_args* a);
    mst_status (*pack)(mst_ctx_t* ctx, const mst_ep_args* a);
    mst_status (*gather)(mst_ctx_t* ctx, const mst_ep_args* a);
    mst_status (*plan)(mst_ctx_t* ctx, const mst_ep_args* a);
    mst_status (*unpack)(mst_ctx_t* ctx, const mst_ep_args* a);
    mst_status (*repack)(mst_ctx_t* ctx, const mst_ep_args* a);
} mst_ep_ops;

extern const mst_ep_ops mst_ep_ops_cpu;
#ifdef MST_HAVE_CUDA
extern const mst_ep_ops mst_ep_ops_cuda;
#endif

/* Raises bits of the context's error flag (atomically on the device). */
MST_HD void mst_ep_flag(int32_t* flag, int32_t bits) {
#ifdef __CUDA_ARCH__
    atomicOr(flag, bits);
#else
    *flag |= bits;
#endif
}

/* plan, serially (a few thousand adds: one CUDA thread runs it too). */
MST_HD void mst_ep_plan_serial(const mst_ep_args* a) {
    const int32_t W = a->world, El = a->n_local;
    int64_t total = 0;
    for (int32_t i = 0; i < W * El; i++) total += a->recv_counts[i];
    const int over = total > a->max_rows;
    if (over) mst_ep_flag(a->flag, MST_FLAG_COUNTS);
    int32_t off = 0;
    for (int32_t e = 0; e < El; e++) {
        int32_t c = 0;
        for (int32_t j = 0; j < W; j++) {
            a->row_base[j * El + e] = off + c;
            c += over ? 0 : a->recv_counts[j * El + e];
        }
        a->counts[e] = c;
        off += c;
    }
    for (int32_t j = 0; j < W; j++) {
        int32_t* bo = a->block_off + (int64_t)j * (El + 1);
        bo[0] = 0;
        for (int32_t e = 0; e < El; e++) bo[e + 1] = bo[e] + (over ? 0 : a->recv_counts[j * El + e]);
    }
}

/* The expert row of received slot (j, i), or -1 past block j's total. */
MST_HD int64_t mst_ep_slot_row(const mst_ep_args* a, int32_t j, int64_t i) {
    const int32_t El = a->n_local;
    const int32_t* bo = a->block_off + (int64_t)j * (El + 1);
    if (i >= bo[El]) return -1;
    int32_t lo = 0, hi = El; /* the last e with bo[e] <= i (empty experts skipped) */
    while (hi - lo > 1) {
        const int32_t mid = (lo + hi) >> 1;
        if (bo[mid] <= i) lo = mid;
        else hi = mid;
    }
    return a->row_base[j * El + lo] + (i - bo[lo]);
}

/* Direct dispatch (the sender stores each row at its final expert row on
 * the receiver, no receive blocks): from every rank's send counts,
 * gathered [W, W, El] (gathered[(r W + d) El + e] = rows rank r sends to
 * local expert e of rank d), the shift of this sender's rows for
 * destination d: slot i of local expert e in its block d lands on row
 * shift[e] + i of d's rows. d's layout is plan's: for each expert, the rows
 * from rank 0, then rank 1, ..., so shift[e] = (rows of d's experts before
 * e, every rank) + (rows of e from ranks before this one) - (slot of e in
 * block d). Every shift is -1 when d receives more than max_rows rows: no
 * rank writes to it (its plan flags it and zeroes its counts). */
MST_HD void mst_ep_direct_shift(const mst_ep_args* a, const int32_t* gathered, int32_t d, int32_t* shift) {
    const int32_t W = a->world, El = a->n_local;
    int64_t off = 0, slot = 0; /* d's rows before expert e; e's slot in block d */
    for (int32_t e = 0; e < El; e++) {
        int64_t before = 0, all = 0; /* e's rows from ranks before this one; from every rank */
        for (int32_t r = 0; r < W; r++) {
            const int32_t n = gathered[((int64_t)r * W + d) * El + e];
            all += n;
            before += r < a->rank ? n : 0;
        }
        shift[e] = (int32_t)(off + before - slot);
        off += all;
        slot += gathered[((int64_t)a->rank * W + d) * El + e];
    }
    if (off > a->max_rows)
        for (int32_t e = 0; e < El; e++) shift[e] = -1;
}

/* The row on its destination *d of routing entry u (< N k) of the direct
 * dispatch, by shift [W, El] (mst_ep_direct_shift of each destination); -1
 * when the entry moves nothing (skipped by route, or its destination over
 * max_rows). */
MST_HD int64_t mst_ep_direct_row(const mst_ep_args* a, const int32_t* shift, int64_t u, int32_t* d) {
    const int32_t pos = a->send_pos[u];
    if (pos < 0) return -1;
    *d = (int32_t)(pos / a->pair_rows);
    const int32_t e = a->topk_idx[u] - *d * a->n_local, s = shift[*d * a->n_local + e];
    return s < 0 ? -1 : s + pos % a->pair_rows;
}

#ifdef __cplusplus
}
#endif
#endif /* MST_EP_OPS_H */
