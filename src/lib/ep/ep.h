/*
 * ep.h — the private layout of an expert-parallel communicator: its exchange
 * buffers, the transport that moves them between ranks, and the routing
 * handle (ep.c runs dispatch and combine; transports in transport_*.c).
 */
#ifndef MST_EP_H
#define MST_EP_H

#include "../backend/ep_ops.h"
#include "../core/context.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where the rows of a plane's send blocks come from. */
typedef enum mst_ep_src {
    MST_EP_SRC_BLOCKS = 0, /* `send` holds the blocks (packed)                          */
    MST_EP_SRC_TOKENS,     /* entry q < N k of the routing goes to row send_pos[q] of the
                              blocks; its row is row q / src_div of `send` (k: a token
                              row, 1: a prob per entry)                                */
    MST_EP_SRC_ROWS,       /* received slot (j, i) goes back to block j, row i; its row
                              is expert row mst_ep_slot_row(j, i) of `send`              */
} mst_ep_src;

/* One buffer to exchange: send block d (block_bytes at send + d *
 * block_bytes) goes to rank d, which receives it as its block `rank`. Only
 * its first valid[d * valid_stride] rows of row_bytes matter (device
 * counts; valid NULL: the whole block): a transport may move just those.
 * A transport with `gathers` also takes planes whose blocks were never
 * packed (src != BLOCKS): it stores each row straight from `send` to its
 * place in the peer's block, by the routing in `map`. */
typedef struct mst_ep_plane {
    const void* send;      /* [W, block_bytes] backend memory (src BLOCKS), else
                              the rows the blocks would be packed from         */
    void* recv;            /* [W, block_bytes] backend memory (ep's receive block) */
    size_t block_bytes;
    size_t row_bytes;
    const int32_t* valid;  /* backend memory, or NULL                         */
    int64_t valid_stride;
    mst_ep_src src;
    int64_t src_div;       /* MST_EP_SRC_TOKENS                               */
    const mst_ep_args* map; /* the routing (src != BLOCKS): send_pos, n_tok,
                              top_k, pair_rows, block_off, row_base        */
} mst_ep_plane;

/* One transfer of a group: a send of data to peer, or a receive of data
 * from it; both sides name the same byte count. */
typedef struct mst_ep_p2p_op {
    int32_t peer;  /* the other rank of the communicator                 */
    int32_t recv;  /* 1: receive into data, 0: send data                  */
    void* data;    /* [bytes] backend memory                              */
    size_t bytes;
} mst_ep_p2p_op;

/* How the ranks' buffers move. Every rank calls exchange with the same
 * planes (sizes), in the same order; the exchange is ordered after the work
 * already enqueued on the context and before the work enqueued after it. */
typedef struct mst_ep_transport {
    const char* name; /* mst_ep_path() */
    mst_status (*exchange)(mst_ep_t* ep, const mst_ep_plane* planes, int n_planes);
    void (*destroy)(mst_ep_t* ep); /* frees ep->comm (and a receive block it made) */
    /* (optional) the receive block, where the transport needs it (a
     * symmetric window); NULL: mst_alloc. Collective. */
    mst_status (*recv_alloc)(mst_ep_t* ep, size_t n_bytes, void** out);
    int gathers; /* 1: takes planes with src != BLOCKS (no pack before it) */
    /* in place over count elements (mst_ep_allreduce); ordered like exchange */
    mst_status (*allreduce)(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind);
    /* in place over the window [lo, hi) of [W, q] elements
     * (mst_ep_reduce_scatter_window; a kind other than a float sum: the
     * whole of them); ordered like exchange */
    mst_status (*reduce_scatter)(mst_ep_t* ep, void* data, int64_t q, int64_t lo, int64_t hi, mst_ep_reduce kind);
    /* in place over [W, block_bytes] (mst_ep_allgather); ordered like exchange */
    mst_status (*allgather)(mst_ep_t* ep, void* data, size_t block_bytes);
    /* (optional) dispatch's exchange on the direct path, ordered like
     * exchange: once every peer is in it (done reading its window rows),
     * this rank's send_counts [W, El] go to every peer's `gathered` (row
     * `rank`) and block d of them to peer d's recv_counts (as the counts
     * plane); once every peer's have landed, each row of a->tok (prob of
     * a->tok_p, when given) goes straight to its row of the destination's
     * win_rows (win_p) by mst_ep_direct_shift / mst_ep_direct_row; then it
     * waits for every peer's rows. NULL: no direct path (dispatch unpacks). */
    mst_status (*dispatch_direct)(mst_ep_t* ep, const mst_ep_args* a);
    /* (optional) every point-to-point transfer of ops [n] at once
     * (mst_ep_p2p, checked), ordered like exchange. NULL: none. */
    mst_status (*sendrecv)(mst_ep_t* ep, const mst_ep_p2p_op* ops, int n);
} mst_ep_transport;

/* ---- point-to-point transfers (p2p.c): the pipeline's activations and
 * their gradients between neighbouring stages ---- */

/* Every transfer of ops [n] at once (one NCCL group), ordered after the work
 * already enqueued on ep's context and before the work after it: the sends
 * and receives between two ranks match in the order each rank issues them,
 * and the call completes (on the stream) once all of its transfers have.
 * Two ranks that wait on each other must list their pair in one call each
 * (send forward with receive backward, as Megatron pairs them) or in the
 * same order. Capturable over NCCL. The CPU twin waits for its partners
 * (the receiver copies from the sender's buffer) and fails after
 * MST_EP_P2P_TIMEOUT_S seconds without one (the environment's
 * MOESTASH_P2P_TIMEOUT_S when set: the tests' 60), naming both ranks. */
mst_status mst_ep_p2p(mst_ep_t* ep, const mst_ep_p2p_op* ops, int n);
enum { MST_EP_P2P_TIMEOUT_S = 600 };

/* Bytes of one element of kind k. */
size_t mst_ep_reduce_size(mst_ep_reduce k);

/* The data-parallel collectives of a sharded optimizer (collectives.c),
 * enqueued on the context's stream like mst_ep_allreduce (capturable over
 * NCCL), collective in the same order on every rank.
 * Reduce-scatter, in place: data [W, count] elements of kind's type; rank r
 * ends with block r the reduction over the ranks of their blocks r, the
 * other blocks undefined.
 * The bits of the float sums (MST_EP_SUM_F32 / F64, both collectives): each
 * element is rank 0's value + rank 1's + ... + rank W-1's, added in that
 * order in the element type (sum_order.h), on every transport: the CPU twin
 * and NCCL (which moves the bytes and adds nothing: transport_nccl_sum.cu)
 * over NVLink or a network give the same bits, and block r of a
 * reduce-scatter holds the bits mst_ep_allreduce gives for those elements.
 * The int32 sums and the maxima are exact (NCCL's own there). */
mst_status mst_ep_reduce_scatter(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind);
/* Reduce-scatter of a window, in place: data [W, q] elements (block d at
 * data + d q), of which only the flat elements [lo, hi) (0 <= lo <= hi <=
 * W q) take part: rank r ends with the window's part of its block r,
 * [max(lo, r q), min(hi, (r + 1) q)), summed over the ranks with the bits
 * mst_ep_allreduce gives for those elements; the rest of data undefined.
 * A float sum only (MST_ERR_UNSUPPORTED for the other kinds unless the
 * window is all of data). mst_ep_reduce_scatter is the window [0, W q).
 * The trainer's ZeRO-1 sums a layer's part of a replicated run this way
 * (--overlap on). */
mst_status mst_ep_reduce_scatter_window(mst_ep_t* ep, void* data, int64_t q, int64_t lo, int64_t hi,
                                        mst_ep_reduce kind);
/* All-gather, in place: data [W, block_bytes]; every rank ends with block j
 * the bytes rank j had in its block j. */
mst_status mst_ep_allgather(mst_ep_t* ep, void* data, size_t block_bytes);

struct mst_ep {
    mst_ctx_t* ctx;
    const mst_ep_ops* ops;       /* the context's backend's local halves          */
    const mst_ep_transport* tr;
    void* comm;                  /* the transport's state                         */
    mst_ep_config cfg;           /* pair_rows resolved (never 0)                  */
    int32_t rank, world;         /* this rank, W                                  */
    int32_t n_local;             /* El = E / W                                    */
    uint16_t* send;              /* [W, C, H] bf16 exchange buffers               */
    float* send_p;               /* [W, C] fp32                                   */
    void* recv_block;            /* the receive buffers and the window rows, one
                                    allocation                                    */
    int recv_by_tr;              /* 1: recv_block came from tr->recv_alloc (the
                                    transport frees it), 0: from mst_alloc        */
    uint16_t* recv;              /* [W, C, H] bf16, in recv_block                 */
    float* recv_p;               /* [W, C] fp32, in recv_block                    */
    int32_t* recv_counts;        /* [W, El] rows got from (rank, local expert)    */
    int32_t* gathered;           /* [W, W, El] every rank's send_counts (direct
                                    dispatch), in recv_block                      */
    uint16_t* win_rows;          /* [window_rows, H] bf16 dispatch outputs held
                                    for the caller (mst_ep_window_rows), in
                                    recv_block; NULL when cfg.window_rows is 0    */
    float* win_p;                /* [window_rows] fp32, likewise                  */
    int32_t* scratch;            /* [ceil(N k / MST_EP_CHUNK), E] route scratch    */
    size_t sum_stage_cap;        /* bytes the NCCL float sums may stage ([W, c]
                                    columns, in buckets); 0: MST_EP_SUM_STAGE_BYTES.
                                    Tests lower it (before the first sum) to make
                                    many buckets                                  */
};

/* The NCCL float sums' staging: at most this many bytes per communicator
 * (transport_nccl_sum.cu). */
#define MST_EP_SUM_STAGE_BYTES ((size_t)64 << 20)

struct mst_ep_handle {
    mst_ep_t* ep;
    int64_t n_tok;          /* N of the last dispatch (0: none yet)         */
    int32_t* send_pos;      /* [N, k] backend memory: row in the [W, C] blocks */
    int32_t* send_counts;   /* [W, El]                                      */
    int32_t* send_total;    /* [W]                                          */
    int32_t* row_base;      /* [W, El]                                      */
    int32_t* block_off;     /* [W, El + 1]                                  */
};

/* cfg NULL (mst_ep_create, mst_ep_create_local): a bare communicator, for
 * mst_ep_allreduce and mst_ep_p2p only (no dispatch buffers). */
/* MST_ERR_INVALID naming the first bad field of cfg for `world` ranks. */
mst_status mst_ep_check_config(const mst_ep_config* cfg, int world);
/* Sets up ep (cfg checked, buffers allocated; the receive block through
 * ep->tr->recv_alloc when there is one); on failure the caller destroys ep. */
mst_status mst_ep_init(mst_ep_t* ep, mst_ctx_t* ctx, const mst_ep_config* cfg, int rank, int world);
/* A loopback TCP port nobody listens on now (bound to port 0, released),
 * for a rendezvous of ranks on this host (the launcher, tests); -1 when no
 * socket could be bound. */
int mst_ep_free_port(void);
/* Allocates an ep struct (zeroed). */
mst_status mst_ep_alloc(mst_ep_t** out);

#ifdef MST_HAVE_NCCL
extern const mst_ep_transport mst_ep_transport_nccl, mst_ep_transport_lsa;
#endif
extern const mst_ep_transport mst_ep_transport_local;

/* NCCL (MST_ERR_UNSUPPORTED without it): the communicator of the ranks of
 * parent (a CUDA one) that pass the same color, ranked by key
 * (ncclCommSplit; collective over parent), with cfg's buffers (cfg NULL:
 * bare). The pipeline's stage groups. */
mst_status mst_ep_create_split(mst_ctx_t* ctx, const mst_ep_config* cfg, mst_ep_t* parent, int color, int key,
                               mst_ep_t** out);

#ifdef __cplusplus
}
#endif
#endif /* MST_EP_H */
