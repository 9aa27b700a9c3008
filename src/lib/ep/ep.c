/*
 * ep.c — expert-parallel dispatch and combine, forward and backward side by
 * side: argument checks, then the local halves of the context's backend
 * (ep_ops.h) around the transport's exchange of fixed-size blocks. Every
 * size that reaches the host is static (config and tensor shapes); counts
 * and offsets stay in backend memory.
 *   dispatch:          route, pack (rows, probs) | exchange counts, rows,
 *                      probs | plan, unpack
 * (a transport that gathers — lsa — stores the rows straight from the
 * tokens or the expert rows into the peers' blocks: no pack, no repack)
 *   direct dispatch:   route | counts to every rank, rows and probs
 *                      straight to their expert rows in the peers' window
 *                      rows | plan (into the window rows of
 *                      mst_ep_window_rows, on a transport with
 *                      dispatch_direct: no blocks, no unpack)
 *   combine:           repack | exchange rows | gather (weighted sum)
 *   combine backward:  pack (dy, probs) | exchange | unpack (dy p, dot with
 *                      the outputs) | exchange the dots | gather (dprobs)
 *   dispatch backward: repack (row grads, row-prob grads) | exchange |
 *                      gather (sum, dprobs)
 */
#include <string.h>

#include "ep.h"

/* ---- communicator -------------------------------------------------------- */

mst_status mst_ep_alloc(mst_ep_t** out) {
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = (mst_ep_t*)calloc(1, sizeof **out);
    return *out ? MST_OK : mst_set_error(MST_ERR_OOM, "ep communicator");
}

mst_status mst_ep_check_config(const mst_ep_config* c, int world) {
    if (!c) return mst_set_error(MST_ERR_INVALID, "cfg is NULL");
    MST_TRY(MST_CHECK_STRUCT("cfg", c, mst_ep_config));
    if (c->n_experts < 1 || c->n_experts % world != 0)
        return mst_set_error(MST_ERR_INVALID, "cfg.n_experts = %d: must be a positive multiple of the world size %d",
                             c->n_experts, world);
    if (c->top_k < 1 || c->top_k > c->n_experts)
        return mst_set_error(MST_ERR_INVALID, "cfg.top_k = %d: must be in [1, %d]", c->top_k, c->n_experts);
    if (c->hidden < 8 || c->hidden % 8 != 0)
        return mst_set_error(MST_ERR_INVALID, "cfg.hidden = %lld: must be a positive multiple of 8",
                             (long long)c->hidden);
    if (c->max_tokens < 1 || c->max_tokens > INT32_MAX / c->top_k)
        return mst_set_error(MST_ERR_INVALID, "cfg.max_tokens = %lld: must be in [1, %d]",
                             (long long)c->max_tokens, INT32_MAX / c->top_k);
    if (c->max_rows < 1 || c->max_rows > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "cfg.max_rows = %lld: must be in [1, %d]",
                             (long long)c->max_rows, INT32_MAX);
    const int64_t C = c->pair_rows ? c->pair_rows : c->max_tokens * c->top_k;
    if (C < 1 || C > INT32_MAX / world)
        return mst_set_error(MST_ERR_INVALID, "cfg.pair_rows = %lld: must be 0 or in [1, %d] (world %d)",
                             (long long)c->pair_rows, INT32_MAX / world, world);
    if (c->window_rows < 0 || c->window_rows > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "cfg.window_rows = %lld: must be in [0, %d]",
                             (long long)c->window_rows, INT32_MAX);
    if (c->path < MST_EP_PATH_AUTO || c->path > MST_EP_PATH_LSA)
        return mst_set_error(MST_ERR_INVALID, "cfg.path = %d: must be a mst_ep_path_kind (0 auto, 1 p2p, 2 lsa)",
                             c->path);
    return MST_OK;
}

static mst_status ops_of(mst_ctx_t* ctx, const mst_ep_ops** out) {
    if (ctx->kind == MST_BACKEND_CPU) *out = &mst_ep_ops_cpu;
#ifdef MST_HAVE_CUDA
    else if (ctx->kind == MST_BACKEND_CUDA) *out = &mst_ep_ops_cuda;
#endif
    else return mst_set_error(MST_ERR_UNSUPPORTED, "expert parallelism: backend %s has no ep ops", ctx->be->name);
    return MST_OK;
}

static mst_status alloc_zeroed(mst_ctx_t* ctx, size_t n_bytes, void** out) {
    MST_TRY(mst_alloc(ctx, n_bytes, out));
    return mst_fill(ctx, *out, 0, n_bytes);
}

static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/* Carves n_bytes (256-aligned) for *out at *off of the receive block. */
static void carve(mst_ep_t* ep, size_t* off, size_t n_bytes, void** out) {
    *out = (char*)ep->recv_block + *off;
    *off += align256(n_bytes);
}

/* The receive block: rows [W, C, H], probs [W, C], counts [W, El], the
 * gathered counts [W, W, El] and the window rows [window_rows, H] and probs
 * [window_rows] (none when cfg.window_rows is 0), zeroed (a slot read after
 * an over-budget step holds zeros or old rows). Every rank has the same
 * layout (the same config): a buffer's offset in the block is its offset
 * in every peer's. */
static mst_status alloc_recv(mst_ep_t* ep) {
    const size_t WC = (size_t)ep->world * (size_t)ep->cfg.pair_rows, WEl = (size_t)ep->world * (size_t)ep->n_local;
    const size_t Rw = (size_t)ep->cfg.window_rows, row = (size_t)ep->cfg.hidden * 2;
    const size_t sizes[] = {WC * row, WC * sizeof(float), WEl * sizeof(int32_t), (size_t)ep->world * WEl * sizeof(int32_t),
                            Rw * row, Rw * sizeof(float)};
    size_t n_bytes = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) n_bytes += align256(sizes[i]);
    ep->recv_by_tr = ep->tr && ep->tr->recv_alloc;
    if (ep->recv_by_tr) MST_TRY(ep->tr->recv_alloc(ep, n_bytes, &ep->recv_block));
    else MST_TRY(mst_alloc(ep->ctx, n_bytes, &ep->recv_block));
    void* at[6];
    size_t off = 0;
    for (int i = 0; i < 6; i++) carve(ep, &off, sizes[i], &at[i]);
    ep->recv = (uint16_t*)at[0];
    ep->recv_p = (float*)at[1];
    ep->recv_counts = (int32_t*)at[2];
    ep->gathered = (int32_t*)at[3];
    ep->win_rows = Rw ? (uint16_t*)at[4] : NULL;
    ep->win_p = Rw ? (float*)at[5] : NULL;
    return mst_fill(ep->ctx, ep->recv_block, 0, n_bytes);
}

mst_status mst_ep_init(mst_ep_t* ep, mst_ctx_t* ctx, const mst_ep_config* cfg, int rank, int world) {
    if (!cfg) { /* bare: all-reduce and point-to-point transfers only */
        MST_TRY(ops_of(ctx, &ep->ops));
        ep->ctx = ctx;
        ep->rank = rank;
        ep->world = world;
        return MST_OK;
    }
    MST_TRY(mst_ep_check_config(cfg, world));
    MST_TRY(ops_of(ctx, &ep->ops));
    ep->ctx = ctx;
    ep->cfg = *cfg;
    if (!ep->cfg.pair_rows) ep->cfg.pair_rows = cfg->max_tokens * cfg->top_k;
    ep->rank = rank;
    ep->world = world;
    ep->n_local = cfg->n_experts / world;
    const size_t WC = (size_t)world * (size_t)ep->cfg.pair_rows;
    const size_t n_chunks = (size_t)((cfg->max_tokens * cfg->top_k + MST_EP_CHUNK - 1) / MST_EP_CHUNK);
    MST_TRY(alloc_zeroed(ctx, WC * (size_t)cfg->hidden * 2, (void**)&ep->send));
    MST_TRY(alloc_zeroed(ctx, WC * sizeof(float), (void**)&ep->send_p));
    MST_TRY(alloc_recv(ep));
    return mst_alloc(ctx, n_chunks * (size_t)cfg->n_experts * sizeof(int32_t), (void**)&ep->scratch);
}

void mst_ep_destroy(mst_ep_t* ep) {
    if (!ep) return;
    if (ep->ctx) {
        mst_ctx_sync(ep->ctx);
        mst_free(ep->ctx, ep->send);
        mst_free(ep->ctx, ep->send_p);
        mst_free(ep->ctx, ep->scratch);
        if (!ep->recv_by_tr) mst_free(ep->ctx, ep->recv_block);
    }
    if (ep->tr) ep->tr->destroy(ep);
    free(ep);
}

int mst_ep_rank(const mst_ep_t* ep) { return ep->rank; }
int mst_ep_world(const mst_ep_t* ep) { return ep->world; }
const char* mst_ep_path(const mst_ep_t* ep) { return ep->tr ? ep->tr->name : "none"; }

#ifndef MST_HAVE_NCCL
static mst_status no_nccl(void) {
    return mst_set_error(MST_ERR_UNSUPPORTED,
                         "expert parallelism over GPUs needs NCCL: this library was built without it "
                         "(configure with MST_NCCL_ROOT=<dir with include/nccl.h and lib/libnccl.so*>)");
}
mst_status mst_ep_id_create(mst_ep_id* out) {
    (void)out;
    return no_nccl();
}
mst_status mst_ep_create(mst_ctx_t* ctx, const mst_ep_config* cfg, const mst_ep_id* id, int rank,
                         int world, mst_ep_t** out) {
    (void)ctx, (void)cfg, (void)id, (void)rank, (void)world;
    if (out) *out = NULL;
    return no_nccl();
}
mst_status mst_ep_create_nccl(mst_ctx_t* ctx, const mst_ep_config* cfg, void* nccl_comm, mst_ep_t** out) {
    (void)ctx, (void)cfg, (void)nccl_comm;
    if (out) *out = NULL;
    return no_nccl();
}
mst_status mst_ep_create_split(mst_ctx_t* ctx, const mst_ep_config* cfg, mst_ep_t* parent, int color, int key,
                               mst_ep_t** out) {
    (void)ctx, (void)cfg, (void)parent, (void)color, (void)key;
    if (out) *out = NULL;
    return no_nccl();
}
#endif

mst_status mst_ep_set_max_rows(mst_ep_t* ep, int64_t max_rows) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (max_rows < 1 || max_rows > INT32_MAX)
        return mst_set_error(MST_ERR_INVALID, "max_rows = %lld: must be in [1, %d]", (long long)max_rows, INT32_MAX);
    ep->cfg.max_rows = max_rows;
    return MST_OK;
}

mst_status mst_ep_window_rows(mst_ep_t* ep, mst_tensor* rows, mst_tensor* row_probs) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (!rows) return mst_set_error(MST_ERR_INVALID, "rows is NULL");
    if (!ep->win_rows)
        return mst_set_error(MST_ERR_INVALID, "cfg.window_rows = 0: the communicator holds no dispatch outputs");
    const int64_t R = ep->cfg.max_rows;
    if (R > ep->cfg.window_rows)
        return mst_set_error(MST_ERR_INVALID, "max_rows = %lld: more than cfg.window_rows = %lld", (long long)R,
                             (long long)ep->cfg.window_rows);
    *rows = mst_tensor_make(ep->win_rows, MST_DTYPE_BF16, R, ep->cfg.hidden);
    if (row_probs) *row_probs = mst_tensor_make(ep->win_p, MST_DTYPE_FP32, R, 1);
    return MST_OK;
}

/* ---- handles ------------------------------------------------------------- */

mst_status mst_ep_handle_create(mst_ep_t* ep, mst_ep_handle_t** out) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    mst_ep_handle_t* h = (mst_ep_handle_t*)calloc(1, sizeof *h);
    if (!h) return mst_set_error(MST_ERR_OOM, "ep handle");
    h->ep = ep;
    mst_ctx_t* ctx = ep->ctx;
    const size_t WE = (size_t)ep->world * (size_t)ep->n_local * sizeof(int32_t);
    mst_status st = mst_alloc(ctx, (size_t)(ep->cfg.max_tokens * ep->cfg.top_k) * sizeof(int32_t),
                              (void**)&h->send_pos);
    if (st == MST_OK) st = mst_alloc(ctx, WE, (void**)&h->send_counts);
    if (st == MST_OK) st = mst_alloc(ctx, (size_t)ep->world * sizeof(int32_t), (void**)&h->send_total);
    if (st == MST_OK) st = mst_alloc(ctx, WE, (void**)&h->row_base);
    if (st == MST_OK)
        st = mst_alloc(ctx, (size_t)ep->world * (size_t)(ep->n_local + 1) * sizeof(int32_t), (void**)&h->block_off);
    if (st != MST_OK) {
        mst_ep_handle_destroy(h);
        return st;
    }
    *out = h;
    return MST_OK;
}

void mst_ep_handle_destroy(mst_ep_handle_t* h) {
    if (!h) return;
    mst_ctx_t* ctx = h->ep->ctx;
    mst_ctx_sync(ctx);
    mst_free(ctx, h->send_pos);
    mst_free(ctx, h->send_counts);
    mst_free(ctx, h->send_total);
    mst_free(ctx, h->row_base);
    mst_free(ctx, h->block_off);
    free(h);
}

/* ---- argument checks ----------------------------------------------------- */

static int given(const mst_tensor* t) { return t && t->data; }

/* Rows are moved in 16-byte vectors: data 16-byte aligned. */
static mst_status check(const mst_tensor* t, const char* name, mst_dtype dt, int64_t rows, int64_t cols) {
    MST_TRY(mst_check_tensor(t, name, dt));
    MST_TRY(mst_check_shape(t, name, rows, cols));
    if ((uintptr_t)t->data % 16 != 0)
        return mst_set_error(MST_ERR_INVALID, "%s.data = %p: must be 16-byte aligned", name, t->data);
    return MST_OK;
}

/* Both given or both absent. */
static mst_status check_pair(const mst_tensor* a, const char* an, const mst_tensor* b, const char* bn) {
    if (given(a) != given(b))
        return mst_set_error(MST_ERR_INVALID, "%s is %s but %s is %s: give both or neither", an,
                             given(a) ? "given" : "NULL", bn, given(b) ? "given" : "NULL");
    return MST_OK;
}

static mst_status check_call(const mst_ep_t* ep, const mst_ep_handle_t* h, int after_dispatch) {
    if (!ep) return mst_set_error(MST_ERR_INVALID, "ep is NULL");
    if (!h) return mst_set_error(MST_ERR_INVALID, "h is NULL");
    if (h->ep != ep) return mst_set_error(MST_ERR_INVALID, "h belongs to another communicator");
    if (after_dispatch && h->n_tok == 0)
        return mst_set_error(MST_ERR_STATE, "h has no dispatch yet: dispatch before combine and backward");
    return MST_OK;
}

/* The arguments every op of handle h shares. */
static mst_ep_args args_of(const mst_ep_t* ep, const mst_ep_handle_t* h) {
    mst_ep_args a = {.world = ep->world, .rank = ep->rank, .n_experts = ep->cfg.n_experts,
                     .top_k = ep->cfg.top_k, .n_local = ep->n_local, .n_tok = h->n_tok,
                     .cols = ep->cfg.hidden, .pair_rows = ep->cfg.pair_rows,
                     .max_rows = ep->cfg.max_rows, .send_pos = h->send_pos,
                     .send_counts = h->send_counts, .send_total = h->send_total,
                     .recv_counts = ep->recv_counts,
                     .row_base = h->row_base, .block_off = h->block_off, .scratch = ep->scratch,
                     .flag = ep->ctx->err_flag};
    return a;
}

/* The planes of rows and probs: to_experts, from token ranks to the experts'
 * ranks (valid rows: what route sent); else back (valid rows: what plan
 * received from each rank). */
static mst_ep_plane rows_plane(const mst_ep_t* ep, const mst_ep_handle_t* h, int to_experts) {
    const size_t C = (size_t)ep->cfg.pair_rows, row = (size_t)ep->cfg.hidden * 2;
    if (to_experts) return (mst_ep_plane){ep->send, ep->recv, C * row, row, h->send_total, 1, MST_EP_SRC_BLOCKS, 0, NULL};
    return (mst_ep_plane){ep->send, ep->recv, C * row, row, h->block_off + ep->n_local, ep->n_local + 1,
                          MST_EP_SRC_BLOCKS, 0, NULL};
}

static mst_ep_plane probs_plane(const mst_ep_t* ep, const mst_ep_handle_t* h, int to_experts) {
    mst_ep_plane p = rows_plane(ep, h, to_experts);
    p.send = ep->send_p, p.recv = ep->recv_p;
    p.row_bytes = sizeof(float);
    p.block_bytes = (size_t)ep->cfg.pair_rows * sizeof(float);
    return p;
}

/* Exchanges the row plane (with_rows) and the prob plane (with_p). */
static mst_status exchange_rows(mst_ep_t* ep, const mst_ep_handle_t* h, int to_experts, int with_rows, int with_p) {
    mst_ep_plane pl[2];
    int n = 0;
    if (with_rows) pl[n++] = rows_plane(ep, h, to_experts);
    if (with_p) pl[n++] = probs_plane(ep, h, to_experts);
    return ep->tr->exchange(ep, pl, n);
}

/* Plane p with its rows taken straight from src by the routing in map
 * (transports that gather) instead of from packed send blocks. */
static mst_ep_plane gathered(mst_ep_plane p, const void* src, mst_ep_src kind, int64_t div, const mst_ep_args* map) {
    p.send = src;
    p.src = kind;
    p.src_div = div;
    p.map = map;
    return p;
}

typedef mst_status (*ep_op)(mst_ctx_t* ctx, const mst_ep_args* a);

/* Every move of rows but dispatch's: `fill` writes the send blocks, the
 * exchange moves them (and the probs when with_p), `read` reads the
 * received blocks. A transport that gathers takes the rows fill would read
 * (to_experts: token rows by send_pos, as pack; else expert rows by slot, as
 * repack) without the fill. */
static mst_status move_rows(mst_ep_t* ep, const mst_ep_handle_t* h, mst_ep_args* a, int to_experts, int with_p,
                            ep_op fill, ep_op read) {
    if (ep->tr->gathers) {
        const mst_ep_src src = to_experts ? MST_EP_SRC_TOKENS : MST_EP_SRC_ROWS;
        const mst_ep_plane pl[2] = {
            gathered(rows_plane(ep, h, to_experts), to_experts ? (const void*)a->tok : (const void*)a->rows_in, src,
                     to_experts ? a->top_k : 1, a),
            gathered(probs_plane(ep, h, to_experts), to_experts ? (const void*)a->tok_p : (const void*)a->rows_p_in,
                     src, 1, a),
        };
        MST_TRY(ep->tr->exchange(ep, pl, with_p ? 2 : 1));
    } else {
        a->blk = ep->send;
        a->blk_p = with_p ? ep->send_p : NULL;
        MST_TRY(fill(ep->ctx, a));
        MST_TRY(exchange_rows(ep, h, to_experts, 1, with_p));
    }
    a->blk = ep->recv;
    a->blk_p = with_p ? ep->recv_p : NULL;
    return read(ep->ctx, a);
}

/* ---- dispatch ------------------------------------------------------------ */

/* *direct = 1 when dispatch's outputs rows (and row_probs, or NULL) are the
 * window's (mst_ep_window_rows) and the transport stores into them
 * directly; MST_ERR_INVALID when one starts the window but has more rows
 * than it holds. */
static mst_status window_outputs(const mst_ep_t* ep, const mst_tensor* rows, const mst_tensor* row_probs,
                                 int* direct) {
    const int in_rows = ep->win_rows && rows->data == (void*)ep->win_rows;
    const int in_p = ep->win_p && row_probs && row_probs->data == (void*)ep->win_p;
    if ((in_rows || in_p) && ep->cfg.max_rows > ep->cfg.window_rows)
        return mst_set_error(MST_ERR_INVALID, "%s is the communicator's window, which holds cfg.window_rows = %lld "
                             "rows, fewer than max_rows = %lld", in_rows ? "rows" : "row_probs",
                             (long long)ep->cfg.window_rows, (long long)ep->cfg.max_rows);
    *direct = ep->tr->dispatch_direct && in_rows && (!row_probs || in_p);
    return MST_OK;
}

mst_status mst_ep_dispatch(mst_ep_t* ep, mst_ep_handle_t* h, const mst_tensor* x,
                           const mst_tensor* topk_idx, const mst_tensor* probs, mst_tensor* rows,
                           mst_tensor* row_probs, mst_tensor* counts) {
    MST_TRY(check_call(ep, h, 0));
    const mst_ep_config* c = &ep->cfg;
    MST_TRY(mst_check_tensor(x, "x", MST_DTYPE_BF16));
    const int64_t N = x->rows;
    if (N > c->max_tokens)
        return mst_set_error(MST_ERR_INVALID, "x has %lld rows, more than cfg.max_tokens = %lld",
                             (long long)N, (long long)c->max_tokens);
    MST_TRY(check(x, "x", MST_DTYPE_BF16, N, c->hidden));
    MST_TRY(check(topk_idx, "topk_idx", MST_DTYPE_INT32, N, c->top_k));
    MST_TRY(check(rows, "rows", MST_DTYPE_BF16, c->max_rows, c->hidden));
    MST_TRY(check_pair(probs, "probs", row_probs, "row_probs"));
    const int with_p = given(probs);
    if (with_p) {
        MST_TRY(check(probs, "probs", MST_DTYPE_FP32, N, c->top_k));
        MST_TRY(check(row_probs, "row_probs", MST_DTYPE_FP32, c->max_rows, 1));
    }
    MST_TRY(check(counts, "counts", MST_DTYPE_INT32, ep->n_local, 1));
    int direct = 0;
    MST_TRY(window_outputs(ep, rows, with_p ? row_probs : NULL, &direct));

    h->n_tok = N;
    mst_ep_args a = args_of(ep, h);
    a.topk_idx = (const int32_t*)topk_idx->data;
    a.tok = (const uint16_t*)x->data;
    a.tok_p = with_p ? (const float*)probs->data : NULL;
    a.blk = ep->send;
    a.blk_p = with_p ? ep->send_p : NULL;
    a.counts = (int32_t*)counts->data;
    MST_TRY(ep->ops->route(ep->ctx, &a));
    if (direct) { /* the rows land at their expert rows: the receiver only plans */
        MST_TRY(ep->tr->dispatch_direct(ep, &a));
        return ep->ops->plan(ep->ctx, &a);
    }
    const int gathers = ep->tr->gathers; /* no pack: the exchange reads x and probs itself */
    if (!gathers) MST_TRY(ep->ops->pack(ep->ctx, &a));
    const size_t El4 = (size_t)ep->n_local * sizeof(int32_t);
    mst_ep_plane pl[3] = {
        {.send = h->send_counts, .recv = ep->recv_counts, .block_bytes = El4, .row_bytes = El4},
        rows_plane(ep, h, 1),
        probs_plane(ep, h, 1),
    };
    if (gathers) {
        pl[1] = gathered(pl[1], x->data, MST_EP_SRC_TOKENS, c->top_k, &a);
        pl[2] = gathered(pl[2], a.tok_p, MST_EP_SRC_TOKENS, 1, &a);
    }
    MST_TRY(ep->tr->exchange(ep, pl, with_p ? 3 : 2));
    MST_TRY(ep->ops->plan(ep->ctx, &a));
    a.blk = ep->recv;
    a.blk_p = with_p ? ep->recv_p : NULL;
    a.rows = (uint16_t*)rows->data;
    a.rows_p = with_p ? (float*)row_probs->data : NULL;
    return ep->ops->unpack(ep->ctx, &a);
}

mst_status mst_ep_dispatch_backward(mst_ep_t* ep, mst_ep_handle_t* h, const mst_tensor* d_rows,
                                    const mst_tensor* d_row_probs, mst_tensor* dx,
                                    mst_tensor* dprobs) {
    MST_TRY(check_call(ep, h, 1));
    const mst_ep_config* c = &ep->cfg;
    MST_TRY(check(d_rows, "d_rows", MST_DTYPE_BF16, c->max_rows, c->hidden));
    MST_TRY(check_pair(d_row_probs, "d_row_probs", dprobs, "dprobs"));
    const int with_p = given(dprobs);
    if (with_p) {
        MST_TRY(check(d_row_probs, "d_row_probs", MST_DTYPE_FP32, c->max_rows, 1));
        MST_TRY(check(dprobs, "dprobs", MST_DTYPE_FP32, h->n_tok, c->top_k));
    }
    MST_TRY(check(dx, "dx", MST_DTYPE_BF16, h->n_tok, c->hidden));
    mst_ep_args a = args_of(ep, h);
    a.rows_in = (const uint16_t*)d_rows->data;
    a.rows_p_in = with_p ? (const float*)d_row_probs->data : NULL;
    a.tok_out = (uint16_t*)dx->data;
    a.tok_p_out = with_p ? (float*)dprobs->data : NULL;
    return move_rows(ep, h, &a, 0, with_p, ep->ops->repack, ep->ops->gather);
}

/* ---- combine ------------------------------------------------------------- */

mst_status mst_ep_combine(mst_ep_t* ep, mst_ep_handle_t* h, const mst_tensor* out_rows,
                          const mst_tensor* probs, mst_tensor* y) {
    MST_TRY(check_call(ep, h, 1));
    const mst_ep_config* c = &ep->cfg;
    MST_TRY(check(out_rows, "out_rows", MST_DTYPE_BF16, c->max_rows, c->hidden));
    if (given(probs)) MST_TRY(check(probs, "probs", MST_DTYPE_FP32, h->n_tok, c->top_k));
    MST_TRY(check(y, "y", MST_DTYPE_BF16, h->n_tok, c->hidden));
    mst_ep_args a = args_of(ep, h);
    a.rows_in = (const uint16_t*)out_rows->data;
    a.tok_p = given(probs) ? (const float*)probs->data : NULL;
    a.tok_out = (uint16_t*)y->data;
    return move_rows(ep, h, &a, 0, 0, ep->ops->repack, ep->ops->gather);
}

mst_status mst_ep_combine_backward(mst_ep_t* ep, mst_ep_handle_t* h, const mst_tensor* dy,
                                   const mst_tensor* probs, const mst_tensor* out_rows,
                                   mst_tensor* d_rows, mst_tensor* dprobs) {
    MST_TRY(check_call(ep, h, 1));
    const mst_ep_config* c = &ep->cfg;
    MST_TRY(check(dy, "dy", MST_DTYPE_BF16, h->n_tok, c->hidden));
    MST_TRY(check_pair(probs, "probs", out_rows, "out_rows"));
    MST_TRY(check_pair(probs, "probs", dprobs, "dprobs"));
    const int with_p = given(probs);
    if (with_p) {
        MST_TRY(check(probs, "probs", MST_DTYPE_FP32, h->n_tok, c->top_k));
        MST_TRY(check(out_rows, "out_rows", MST_DTYPE_BF16, c->max_rows, c->hidden));
        MST_TRY(check(dprobs, "dprobs", MST_DTYPE_FP32, h->n_tok, c->top_k));
    }
    MST_TRY(check(d_rows, "d_rows", MST_DTYPE_BF16, c->max_rows, c->hidden));
    mst_ep_args a = args_of(ep, h);
    a.tok = (const uint16_t*)dy->data;
    a.tok_p = with_p ? (const float*)probs->data : NULL;
    a.rows = (uint16_t*)d_rows->data;
    a.scale = with_p;
    a.dot_src = with_p ? (const uint16_t*)out_rows->data : NULL;
    a.dot_out = with_p ? ep->send_p : NULL; /* free once the rows moved */
    MST_TRY(move_rows(ep, h, &a, 1, with_p, ep->ops->pack, ep->ops->unpack));
    if (!with_p) return MST_OK;
    MST_TRY(exchange_rows(ep, h, 0, 0, 1));
    mst_ep_args g = args_of(ep, h);
    g.blk_p = ep->recv_p;
    g.tok_p_out = (float*)dprobs->data;
    return ep->ops->gather(ep->ctx, &g);
}
