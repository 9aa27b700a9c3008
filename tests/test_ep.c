/*
 * test_ep.c — expert-parallel dispatch and combine, forward and backward,
 * against a single-process reference of the whole routing (float64 sums).
 * Ranks are threads, one context each: `--backend cpu` runs the CPU twin
 * (shared-memory exchange), `--backend cuda` one GPU per rank over NCCL,
 * every scenario on both paths: send/recv of fixed blocks and the device API
 * (needs >= 2 GPUs; exits MST_TEST_SKIP otherwise; scenarios of more ranks
 * than GPUs are skipped).
 *
 * Every scenario runs twice and must give the same bits. Outputs are
 * poisoned and guarded; rows past each rank's total must stay poisoned.
 * Scenarios: random routing, a rank that receives nothing, one expert that
 * receives everything, a receiver over max_rows (slot 0 of every token to
 * the last rank), senders over pair_rows and
 * an expert id out of range (both flagged, their rows skipped), and rows
 * wide enough for the lsa exchange's warp-per-row copies.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lib/internal.h"
#include "harness.h"

enum { ROUTE_RANDOM, ROUTE_SKIP_LAST_RANK, ROUTE_ONE_EXPERT, ROUTE_TO_LAST_RANK, ROUTE_BAD_ID };

typedef struct scen {
    const char* name;
    int W, E, k;
    int64_t H, N, R, C; /* C = 0: N k */
    int route;
    uint64_t seed;
} scen;

/* One rank's inputs and what the library returned (host copies). */
typedef struct rank_io {
    uint16_t* x;        /* [N, H] */
    int32_t* idx;       /* [N, k] */
    float* p;           /* [N, k] */
    uint16_t* out;      /* [R, H] expert outputs fed to combine */
    uint16_t* dy;       /* [N, H] */
    uint16_t* drows;    /* [R, H] row grads fed to dispatch backward */
    float* drp;         /* [R] row-prob grads */
    /* results */
    uint16_t* rows;     /* [R, H] dispatch */
    float* rowp;        /* [R] */
    int32_t* counts;    /* [El] */
    uint16_t* y;        /* [N, H] combine(out, p) */
    uint16_t* y_id;     /* [N, H] combine(rows, p): identity experts */
    uint16_t* y_sum;    /* [N, H] combine(out, NULL) */
    uint16_t* d_rows;   /* [R, H] combine backward */
    float* dprobs_c;    /* [N, k] */
    uint16_t* dx;       /* [N, H] dispatch backward */
    float* dprobs_d;    /* [N, k] */
    int guards_ok;
    int tail_ok;        /* window pass: the window's rows past R stay poisoned */
    int direct;         /* window pass: the transport stores into the window */
    int blocks_ok;      /* window pass, direct: the receive blocks stay poisoned */
    int rows_only_ok;   /* window pass: dispatch without probs gave the rows */
    mst_status st;      /* first failing call, or MST_OK */
    char err[256];
    mst_status check;   /* mst_ctx_check after the calls */
    char path[64];
} rank_io;

typedef struct world_run {
    const scen* s;
    mst_backend_kind kind;
    mst_ep_path_kind path;
    mst_ep_group_t* group; /* CPU twin */
    mst_ep_id id;          /* NCCL */
    rank_io* io;           /* [W] dispatch into the caller's rows */
    rank_io* io_w;         /* [W] the same calls again, dispatch into the
                              communicator's window rows (the inputs are io's) */
} world_run;

typedef struct rank_arg {
    world_run* w;
    int rank;
} rank_arg;

static int64_t pair_rows(const scen* s) { return s->C ? s->C : s->N * s->k; }

/* ---- inputs ---- */

static void route_token(const scen* s, mst_rng* r, int32_t* idx) {
    const int El = s->E / s->W;
    for (int j = 0; j < s->k; j++) {
        int32_t g;
        int dup;
        do {
            if (s->route == ROUTE_SKIP_LAST_RANK) g = (int32_t)mst_rng_int(r, 0, s->E - El - 1);
            else if (s->route == ROUTE_TO_LAST_RANK && j == 0) g = (int32_t)mst_rng_int(r, s->E - El, s->E - 1);
            else g = (int32_t)mst_rng_int(r, 0, s->E - 1);
            dup = 0;
            for (int u = 0; u < j; u++) dup |= idx[u] == g;
        } while (dup);
        idx[j] = g;
    }
    if (s->route == ROUTE_ONE_EXPERT) idx[0] = s->E - 1; /* k = 1: everything to one expert */
}

static void make_inputs(const scen* s, rank_io* io, int rank) {
    const int64_t N = s->N, H = s->H, R = s->R, k = s->k;
    mst_rng r = {s->seed * 1000 + (uint64_t)rank};
    io->x = malloc((size_t)(N * H) * 2);
    io->idx = malloc((size_t)(N * k) * 4);
    io->p = malloc((size_t)(N * k) * 4);
    io->out = malloc((size_t)(R * H) * 2);
    io->dy = malloc((size_t)(N * H) * 2);
    io->drows = malloc((size_t)(R * H) * 2);
    io->drp = malloc((size_t)R * 4);
    mst_rng_bf16(&r, io->x, (size_t)(N * H), 1.0);
    for (int64_t t = 0; t < N; t++) route_token(s, &r, io->idx + t * k);
    if (s->route == ROUTE_BAD_ID) io->idx[(N / 2) * k] = rank % 2 ? -1 : s->E;
    mst_rng_fp32(&r, io->p, (size_t)(N * k), 0.05, 1.0);
    mst_rng_bf16(&r, io->out, (size_t)(R * H), 1.0);
    mst_rng_bf16(&r, io->dy, (size_t)(N * H), 1.0);
    mst_rng_bf16(&r, io->drows, (size_t)(R * H), 1.0);
    mst_rng_fp32(&r, io->drp, (size_t)R, -1.0, 1.0);
}

static void free_inputs(rank_io* io) {
    void* p[] = {io->x, io->idx, io->p, io->out, io->dy, io->drows, io->drp};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

static void free_results(rank_io* io) {
    void* p[] = {io->rows, io->rowp, io->counts, io->y, io->y_id, io->y_sum, io->d_rows, io->dprobs_c, io->dx,
                 io->dprobs_d};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

/* ---- one rank's calls (a thread) ---- */

typedef struct rank_bufs {
    mst_guarded x, idx, p, out, dy, drows, drp, rows, rowp, counts, y, y_id, y_sum, d_rows, dpc, dx, dpd;
} rank_bufs;

#define T(g, dt, r, c) mst_tensor_make((g).data, dt, r, c)

static int all_poison(const void* p, size_t n_bytes) {
    const unsigned char* b = (const unsigned char*)p;
    for (size_t i = 0; i < n_bytes; i++)
        if (b[i] != MST_POISON) return 0;
    return 1;
}

/* Rows the window holds past R: they must stay poisoned. */
enum { WIN_TAIL = 5 };

/* The receive blocks of a transport with a direct path, right after a
 * dispatch into the window rows: still poisoned (nothing went through them). */
static mst_status check_blocks(mst_ctx_t* ctx, mst_ep_t* ep, const scen* s, rank_io* w) {
    w->direct = ep->tr->dispatch_direct != NULL;
    if (!w->direct) return MST_OK;
    const size_t WC = (size_t)s->W * (size_t)pair_rows(s), n_rows = WC * (size_t)s->H * 2;
    unsigned char* host = malloc(n_rows + WC * 4);
    mst_status st = mst_copy_b2h(ctx, host, ep->recv, n_rows);
    if (st == MST_OK) st = mst_copy_b2h(ctx, host + n_rows, ep->recv_p, WC * 4);
    w->blocks_ok = st == MST_OK && all_poison(host, n_rows + WC * 4);
    free(host);
    return st;
}

/* Every call of one pass, dispatch into rows / rowp; w: the window pass
 * (the receive blocks are checked right after its dispatch). */
static mst_status rank_calls(mst_ctx_t* ctx, mst_ep_t* ep, mst_ep_handle_t* h, const scen* s, rank_bufs* b,
                             mst_tensor* rows, mst_tensor* rowp, rank_io* w) {
    const int64_t N = s->N, H = s->H, R = s->R, k = s->k, El = s->E / s->W;
    mst_tensor x = T(b->x, MST_DTYPE_BF16, N, H), idx = T(b->idx, MST_DTYPE_INT32, N, k),
               p = T(b->p, MST_DTYPE_FP32, N, k), counts = T(b->counts, MST_DTYPE_INT32, El, 1),
               out = T(b->out, MST_DTYPE_BF16, R, H), y = T(b->y, MST_DTYPE_BF16, N, H),
               y_id = T(b->y_id, MST_DTYPE_BF16, N, H), y_sum = T(b->y_sum, MST_DTYPE_BF16, N, H),
               dy = T(b->dy, MST_DTYPE_BF16, N, H), d_rows = T(b->d_rows, MST_DTYPE_BF16, R, H),
               dpc = T(b->dpc, MST_DTYPE_FP32, N, k), drows = T(b->drows, MST_DTYPE_BF16, R, H),
               drp = T(b->drp, MST_DTYPE_FP32, R, 1), dx = T(b->dx, MST_DTYPE_BF16, N, H),
               dpd = T(b->dpd, MST_DTYPE_FP32, N, k);
    mst_status st = mst_ep_dispatch(ep, h, &x, &idx, &p, rows, rowp, &counts);
    if (st == MST_OK && w) st = check_blocks(ctx, ep, s, w);
    if (st == MST_OK) st = mst_ep_combine(ep, h, &out, &p, &y);
    if (st == MST_OK) st = mst_ep_combine(ep, h, rows, &p, &y_id);
    if (st == MST_OK) st = mst_ep_combine(ep, h, &out, NULL, &y_sum);
    if (st == MST_OK) st = mst_ep_combine_backward(ep, h, &dy, &p, &out, &d_rows, &dpc);
    if (st == MST_OK) st = mst_ep_dispatch_backward(ep, h, &drows, &drp, &dx, &dpd);
    return st;
}

static void* download(mst_ctx_t* ctx, const void* src, size_t n_bytes) {
    void* h = malloc(n_bytes);
    mst_copy_b2h(ctx, h, src, n_bytes);
    return h;
}

/* What a pass returned: its dispatch outputs rows [R, H] and rowp [R], and
 * the rest from the buffers. */
static void download_results(mst_ctx_t* ctx, const scen* s, const rank_bufs* b, const mst_tensor* rows,
                             const mst_tensor* rowp, rank_io* io) {
    io->rows = download(ctx, rows->data, (size_t)(s->R * s->H) * 2);
    io->rowp = download(ctx, rowp->data, (size_t)s->R * 4);
    io->counts = download(ctx, b->counts.data, b->counts.n_bytes);
    io->y = download(ctx, b->y.data, b->y.n_bytes);
    io->y_id = download(ctx, b->y_id.data, b->y_id.n_bytes);
    io->y_sum = download(ctx, b->y_sum.data, b->y_sum.n_bytes);
    io->d_rows = download(ctx, b->d_rows.data, b->d_rows.n_bytes);
    io->dprobs_c = download(ctx, b->dpc.data, b->dpc.n_bytes);
    io->dx = download(ctx, b->dx.data, b->dx.n_bytes);
    io->dprobs_d = download(ctx, b->dpd.data, b->dpd.n_bytes);
}

/* The calls again with dispatch into the window rows (poisoned, WIN_TAIL
 * rows past R included), the other outputs and the receive blocks poisoned
 * afresh. */
static void poison_window(mst_ctx_t* ctx, mst_ep_t* ep, const scen* s, const mst_tensor* rows,
                          const mst_tensor* rowp) {
    const size_t Rw = (size_t)(s->R + WIN_TAIL), row = (size_t)s->H * 2;
    const size_t WC = (size_t)s->W * (size_t)pair_rows(s);
    mst_fill(ctx, rows->data, MST_POISON, Rw * row);
    mst_fill(ctx, rowp->data, MST_POISON, Rw * 4);
    mst_fill(ctx, ep->recv, MST_POISON, WC * row);
    mst_fill(ctx, ep->recv_p, MST_POISON, WC * 4);
    /* the counts too: the direct path must write them afresh (the first
     * pass left the same counts there) */
    mst_fill(ctx, ep->recv_counts, MST_POISON, (size_t)(s->E * 4));
    mst_fill(ctx, ep->gathered, MST_POISON, (size_t)(s->W * s->E * 4));
}

/* Dispatch without probs into the (poisoned) window rows: the rows of the
 * caller's-rows pass, the same flag; the window's probs untouched. */
static mst_status window_rows_only(mst_ctx_t* ctx, mst_ep_t* ep, mst_ep_handle_t* h, const scen* s,
                                   rank_bufs* b, const mst_tensor* rows, const mst_tensor* rowp,
                                   const rank_io* io, rank_io* w) {
    const int64_t N = s->N, H = s->H, k = s->k, El = s->E / s->W;
    mst_tensor x = T(b->x, MST_DTYPE_BF16, N, H), idx = T(b->idx, MST_DTYPE_INT32, N, k),
               counts = T(b->counts, MST_DTYPE_INT32, El, 1);
    poison_window(ctx, ep, s, rows, rowp);
    MST_TRY(mst_ep_dispatch(ep, h, &x, &idx, NULL, (mst_tensor*)rows, NULL, &counts));
    uint16_t* got = download(ctx, rows->data, (size_t)(s->R * H) * 2);
    float* got_p = download(ctx, rowp->data, (size_t)s->R * 4);
    w->rows_only_ok = !memcmp(got, io->rows, (size_t)(s->R * H) * 2) && all_poison(got_p, (size_t)s->R * 4) &&
                      mst_ctx_check(ctx) == io->check;
    free(got), free(got_p);
    return MST_OK;
}

static void window_pass(mst_ctx_t* ctx, mst_ep_t* ep, mst_ep_handle_t* h, const scen* s, rank_bufs* b,
                        const rank_io* io, rank_io* w) {
    const size_t row = (size_t)s->H * 2;
    mst_tensor rows, rowp;
    w->st = mst_ep_window_rows(ep, &rows, &rowp);
    if (w->st == MST_OK) w->st = window_rows_only(ctx, ep, h, s, b, &rows, &rowp, io, w);
    if (w->st == MST_OK) {
        mst_guarded* out[] = {&b->counts, &b->y, &b->y_id, &b->y_sum, &b->d_rows, &b->dpc, &b->dx, &b->dpd};
        for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) mst_guarded_put(ctx, out[i], NULL);
        poison_window(ctx, ep, s, &rows, &rowp);
        w->st = rank_calls(ctx, ep, h, s, b, &rows, &rowp, w);
    }
    if (w->st != MST_OK) {
        snprintf(w->err, sizeof w->err, "%s", mst_last_error());
        return;
    }
    w->check = mst_ctx_check(ctx);
    download_results(ctx, s, b, &rows, &rowp, w);
    unsigned char* tail = download(ctx, (char*)rows.data + (size_t)s->R * row, WIN_TAIL * row);
    float* tail_p = download(ctx, (float*)rowp.data + s->R, WIN_TAIL * 4);
    w->tail_ok = all_poison(tail, WIN_TAIL * row) && all_poison(tail_p, WIN_TAIL * 4);
    free(tail), free(tail_p);
}

static mst_status make_ep(world_run* w, mst_ctx_t* ctx, const mst_ep_config* cfg, int rank, mst_ep_t** ep) {
    if (w->kind == MST_BACKEND_CPU) return mst_ep_create_local(ctx, cfg, w->group, rank, ep);
    return mst_ep_create(ctx, cfg, &w->id, rank, w->s->W, ep);
}

static void* rank_main(void* argp) {
    rank_arg* ra = (rank_arg*)argp;
    world_run* w = ra->w;
    const scen* s = w->s;
    rank_io *io = &w->io[ra->rank], *io_w = &w->io_w[ra->rank];
    const int64_t N = s->N, H = s->H, R = s->R, k = s->k, El = s->E / s->W;
    mst_ctx_t* ctx = NULL;
    io->st = io_w->st = mst_ctx_create(w->kind, w->kind == MST_BACKEND_CPU ? 0 : ra->rank, &ctx);
    if (io->st != MST_OK) {
        snprintf(io->err, sizeof io->err, "%s", mst_last_error());
        return NULL;
    }
    mst_ep_config cfg = {.struct_size = sizeof(mst_ep_config), .n_experts = s->E, .top_k = s->k, .hidden = H, .max_tokens = N, .max_rows = R,
                         .pair_rows = s->C, .path = w->path, .window_rows = R + WIN_TAIL};
    mst_ep_t* ep = NULL;
    mst_ep_handle_t* h = NULL;
    io->st = make_ep(w, ctx, &cfg, ra->rank, &ep);
    if (io->st == MST_OK) io->st = mst_ep_handle_create(ep, &h);
    if (io->st != MST_OK) {
        snprintf(io->err, sizeof io->err, "%s", mst_last_error());
        io_w->st = io->st;
        mst_ep_destroy(ep);
        mst_ctx_destroy(ctx);
        return NULL;
    }
    snprintf(io->path, sizeof io->path, "%s", mst_ep_path(ep));
    snprintf(io_w->path, sizeof io_w->path, "%s", mst_ep_path(ep));
    rank_bufs b;
    mst_guarded* all = (mst_guarded*)&b;
    const size_t n_bufs = sizeof b / sizeof b.x;
    size_t sizes[] = {N * H * 2, N * k * 4, N * k * 4, R * H * 2, N * H * 2, R * H * 2, R * 4, R * H * 2,
                      R * 4, El * 4, N * H * 2, N * H * 2, N * H * 2, R * H * 2, N * k * 4, N * H * 2, N * k * 4};
    for (size_t i = 0; i < n_bufs; i++) all[i] = mst_guarded_alloc(ctx, sizes[i]);
    mst_guarded_put(ctx, &b.x, io->x);
    mst_guarded_put(ctx, &b.idx, io->idx);
    mst_guarded_put(ctx, &b.p, io->p);
    mst_guarded_put(ctx, &b.out, io->out);
    mst_guarded_put(ctx, &b.dy, io->dy);
    mst_guarded_put(ctx, &b.drows, io->drows);
    mst_guarded_put(ctx, &b.drp, io->drp);
    mst_tensor rows = T(b.rows, MST_DTYPE_BF16, R, H), rowp = T(b.rowp, MST_DTYPE_FP32, R, 1);
    io->st = rank_calls(ctx, ep, h, s, &b, &rows, &rowp, NULL);
    if (io->st != MST_OK) snprintf(io->err, sizeof io->err, "%s", mst_last_error());
    io->check = mst_ctx_check(ctx);
    download_results(ctx, s, &b, &rows, &rowp, io);
    window_pass(ctx, ep, h, s, &b, io, io_w);
    io->guards_ok = 1;
    for (size_t i = 0; i < n_bufs; i++) io->guards_ok &= mst_guarded_intact(ctx, &all[i]);
    io_w->guards_ok = io->guards_ok;
    for (size_t i = 0; i < n_bufs; i++) mst_guarded_free(ctx, &all[i]);
    mst_ep_handle_destroy(h);
    mst_ep_destroy(ep);
    mst_ctx_destroy(ctx);
    return NULL;
}

/* Runs every rank of scenario s on its thread; io [W] holds the inputs,
 * io_w [W] gets the window pass's results. */
static int run_world(const scen* s, mst_backend_kind kind, mst_ep_path_kind path, rank_io* io, rank_io* io_w) {
    world_run w = {.s = s, .kind = kind, .path = path, .io = io, .io_w = io_w};
    if (kind == MST_BACKEND_CPU) {
        if (mst_ep_group_create(s->W, &w.group) != MST_OK) return 0;
    } else if (mst_ep_id_create(&w.id) != MST_OK) {
        printf("  %s: no NCCL id: %s\n", s->name, mst_last_error());
        return 0;
    }
    pthread_t th[16];
    rank_arg ra[16];
    for (int r = 0; r < s->W; r++) {
        ra[r] = (rank_arg){&w, r};
        pthread_create(&th[r], NULL, rank_main, &ra[r]);
    }
    for (int r = 0; r < s->W; r++) pthread_join(th[r], NULL);
    mst_ep_group_destroy(w.group);
    return 1;
}

/* ---- the single-process reference ---- */

typedef struct ref_t {
    int W, El;
    int* flag;        /* [W] expected flag per rank                         */
    int* recv_over;   /* [W]                                                */
    int64_t* total;   /* [W] rows received                                  */
    int32_t* counts;  /* [W, El]                                            */
    int32_t** row_of; /* [W][N k] row on the destination, -1: none          */
    int64_t** src;    /* [W][R] (j N + t) k + s of each received row        */
} ref_t;

static int dest_of(const scen* s, int32_t g) { return g >= 0 && g < s->E ? g / (s->E / s->W) : -1; }

static void ref_build(const scen* s, rank_io* io, ref_t* rf) {
    const int W = s->W, El = s->E / s->W, k = s->k;
    const int64_t N = s->N, NK = N * k, C = pair_rows(s);
    rf->W = W, rf->El = El;
    rf->flag = calloc(W, sizeof(int));
    rf->recv_over = calloc(W, sizeof(int));
    rf->total = calloc(W, sizeof(int64_t));
    rf->counts = calloc((size_t)W * El, sizeof(int32_t));
    rf->row_of = calloc(W, sizeof(int32_t*));
    rf->src = calloc(W, sizeof(int64_t*));
    int* send_over = calloc((size_t)W * W, sizeof(int)); /* [j, d] */
    for (int j = 0; j < W; j++) {
        rf->row_of[j] = malloc((size_t)NK * sizeof(int32_t));
        for (int64_t i = 0; i < NK; i++) rf->row_of[j][i] = -1;
        rf->src[j] = malloc((size_t)s->R * sizeof(int64_t));
        for (int d = 0; d < W; d++) {
            int64_t n = 0;
            for (int64_t i = 0; i < NK; i++) n += dest_of(s, io[j].idx[i]) == d;
            if (n > C) send_over[j * W + d] = rf->flag[j] = 1;
        }
        for (int64_t i = 0; i < NK; i++)
            if (dest_of(s, io[j].idx[i]) < 0) rf->flag[j] = 1;
    }
    for (int d = 0; d < W; d++) {
        int64_t n = 0;
        for (int e = 0; e < El; e++)
            for (int j = 0; j < W; j++)
                for (int64_t i = 0; i < NK; i++) {
                    if (io[j].idx[i] != d * El + e || send_over[j * W + d]) continue;
                    if (n < s->R) rf->src[d][n] = (int64_t)j * NK + i;
                    n++;
                    rf->counts[d * El + e]++;
                }
        if (n > s->R) {
            rf->recv_over[d] = rf->flag[d] = 1;
            for (int e = 0; e < El; e++) rf->counts[d * El + e] = 0;
            n = 0;
        }
        rf->total[d] = n;
        for (int64_t r = 0; r < n; r++) rf->row_of[rf->src[d][r] / NK][rf->src[d][r] % NK] = (int32_t)r;
    }
    free(send_over);
}

static void ref_free(ref_t* rf) {
    for (int j = 0; j < rf->W; j++) free(rf->row_of[j]), free(rf->src[j]);
    free(rf->flag), free(rf->recv_over), free(rf->total), free(rf->counts), free(rf->row_of), free(rf->src);
}

/* ---- checks ---- */

static void check_dispatch(const scen* s, rank_io* io, const ref_t* rf) {
    const int64_t H = s->H, NK = s->N * s->k;
    for (int d = 0; d < s->W; d++) {
        const int64_t n = rf->total[d];
        CHECK(memcmp(io[d].counts, rf->counts + d * rf->El, (size_t)rf->El * 4) == 0,
              "%s rank %d: counts differ from the reference (first %d vs %d)", s->name, d, io[d].counts[0],
              rf->counts[d * rf->El]);
        int64_t bad = -1;
        for (int64_t r = 0; r < n && bad < 0; r++) {
            const int64_t j = rf->src[d][r] / NK, i = rf->src[d][r] % NK;
            if (memcmp(io[d].rows + r * H, io[j].x + (i / s->k) * H, (size_t)H * 2) != 0 ||
                memcmp(&io[d].rowp[r], &io[j].p[i], 4) != 0)
                bad = r;
        }
        CHECK(bad < 0, "%s rank %d: dispatched row %lld is not its token's row / prob", s->name, d, (long long)bad);
        CHECK(all_poison(io[d].rows + n * H, (size_t)((s->R - n) * H) * 2) &&
                  all_poison(io[d].rowp + n, (size_t)(s->R - n) * 4),
              "%s rank %d: rows past the %lld received were written", s->name, d, (long long)n);
    }
}

/* y[t] = sum_s w_s v(slot), the reference of combine and dispatch backward. */
typedef double (*slot_val)(const scen* s, rank_io* io, const ref_t* rf, int j, int64_t i, int64_t c);

static double val_out(const scen* s, rank_io* io, const ref_t* rf, int j, int64_t i, int64_t c) {
    const int d = dest_of(s, io[j].idx[i]);
    return mst_bf16_to_fp32(io[d].out[rf->row_of[j][i] * s->H + c]);
}
static double val_x(const scen* s, rank_io* io, const ref_t* rf, int j, int64_t i, int64_t c) {
    (void)rf;
    return mst_bf16_to_fp32(io[j].x[(i / s->k) * s->H + c]);
}
static double val_drows(const scen* s, rank_io* io, const ref_t* rf, int j, int64_t i, int64_t c) {
    const int d = dest_of(s, io[j].idx[i]);
    return mst_bf16_to_fp32(io[d].drows[rf->row_of[j][i] * s->H + c]);
}

/* A token whose slots all went to ranks within budget (else its combine is
 * meaningless). */
static int token_defined(const scen* s, rank_io* io, const ref_t* rf, int j, int64_t t) {
    for (int u = 0; u < s->k; u++) {
        const int d = dest_of(s, io[j].idx[t * s->k + u]);
        if (d >= 0 && rf->recv_over[d]) return 0;
    }
    return 1;
}

static void check_token_sum(const scen* s, rank_io* io, const ref_t* rf, const char* what,
                            size_t got_off, slot_val v, int weighted) {
    const int64_t H = s->H;
    for (int j = 0; j < s->W; j++) {
        const uint16_t* got = *(uint16_t**)((char*)&io[j] + got_off);
        double* ref = calloc((size_t)(s->N * H), sizeof(double));
        uint16_t* g = malloc((size_t)(s->N * H) * 2);
        int64_t n = 0;
        for (int64_t t = 0; t < s->N; t++) {
            if (!token_defined(s, io, rf, j, t)) continue;
            for (int u = 0; u < s->k; u++) {
                const int64_t i = t * s->k + u;
                if (rf->row_of[j][i] < 0) continue;
                const double w = weighted ? io[j].p[i] : 1.0;
                for (int64_t c = 0; c < H; c++) ref[n * H + c] += w * v(s, io, rf, j, i, c);
            }
            memcpy(g + n * H, got + t * H, (size_t)H * 2);
            n++;
        }
        const double err = mst_rel_err_bf16(g, ref, (size_t)(n * H));
        CHECK(err < MST_TOL_BF16, "%s rank %d: %s rel err %.3g", s->name, j, what, err);
        free(ref), free(g);
    }
}

static void check_combine_backward(const scen* s, rank_io* io, const ref_t* rf) {
    const int64_t H = s->H, NK = s->N * s->k;
    for (int d = 0; d < s->W; d++) {
        const int64_t n = rf->total[d];
        double* ref = malloc((size_t)(n * H + 1) * sizeof(double));
        for (int64_t r = 0; r < n; r++) {
            const int64_t j = rf->src[d][r] / NK, i = rf->src[d][r] % NK;
            for (int64_t c = 0; c < H; c++)
                ref[r * H + c] = (double)io[j].p[i] * mst_bf16_to_fp32(io[j].dy[(i / s->k) * H + c]);
        }
        const double err = mst_rel_err_bf16(io[d].d_rows, ref, (size_t)(n * H));
        CHECK(err < MST_TOL_BF16, "%s rank %d: combine backward d_rows rel err %.3g", s->name, d, err);
        CHECK(all_poison(io[d].d_rows + n * H, (size_t)((s->R - n) * H) * 2),
              "%s rank %d: d_rows past the %lld received were written", s->name, d, (long long)n);
        free(ref);
    }
    for (int j = 0; j < s->W; j++) {
        double* ref = calloc((size_t)NK, sizeof(double));
        double* refd = calloc((size_t)NK, sizeof(double));
        float* gc = malloc((size_t)NK * 4);
        float* gd = malloc((size_t)NK * 4);
        int64_t n = 0;
        for (int64_t i = 0; i < NK; i++) {
            if (!token_defined(s, io, rf, j, i / s->k)) continue;
            const int32_t r = rf->row_of[j][i];
            const int d = dest_of(s, io[j].idx[i]);
            for (int64_t c = 0; c < H && r >= 0; c++)
                ref[n] += (double)mst_bf16_to_fp32(io[j].dy[(i / s->k) * H + c]) *
                          mst_bf16_to_fp32(io[d].out[(int64_t)r * H + c]);
            refd[n] = r >= 0 ? io[d].drp[r] : 0.0;
            gc[n] = io[j].dprobs_c[i];
            gd[n] = io[j].dprobs_d[i];
            n++;
        }
        const double err = mst_rel_err_fp32(gc, ref, (size_t)n);
        CHECK(err < MST_TOL_FP32, "%s rank %d: combine backward dprobs rel err %.3g", s->name, j, err);
        int exact = 1;
        for (int64_t i = 0; i < n; i++) exact &= gd[i] == (float)refd[i];
        CHECK(exact, "%s rank %d: dispatch backward dprobs are not the row-prob grads of their rows", s->name, j);
        free(ref), free(refd), free(gc), free(gd);
    }
}

/* Returns 1 when a receiver is over max_rows (the combines and backwards of
 * its tokens read whatever the receive blocks held: meaningless). */
static int check_outputs(const scen* s, rank_io* io, int verbose) {
    ref_t rf;
    ref_build(s, io, &rf);
    if (verbose) {
        printf("    rows received:");
        for (int r = 0; r < s->W; r++) printf(" %lld%s", (long long)rf.total[r], rf.flag[r] ? " (flag)" : "");
        printf("\n");
    }
    int recv_over = 0;
    for (int r = 0; r < s->W; r++) recv_over |= rf.recv_over[r];
    for (int r = 0; r < s->W; r++) {
        CHECK(io[r].st == MST_OK, "%s rank %d: %s (%s)", s->name, r, mst_status_str(io[r].st), io[r].err);
        const mst_status want = rf.flag[r] ? MST_ERR_COUNTS : MST_OK;
        CHECK(io[r].check == want, "%s rank %d: mst_ctx_check gave %s, expected %s", s->name, r,
              mst_status_str(io[r].check), mst_status_str(want));
        CHECK(io[r].guards_ok, "%s rank %d: a guard was overwritten", s->name, r);
    }
    check_dispatch(s, io, &rf);
    check_token_sum(s, io, &rf, "combine", offsetof(rank_io, y), val_out, 1);
    check_token_sum(s, io, &rf, "combine of identity experts", offsetof(rank_io, y_id), val_x, 1);
    check_token_sum(s, io, &rf, "unweighted combine", offsetof(rank_io, y_sum), val_out, 0);
    check_token_sum(s, io, &rf, "dispatch backward dx", offsetof(rank_io, dx), val_drows, 0);
    check_combine_backward(s, io, &rf);
    ref_free(&rf);
    return recv_over;
}

/* Same bits in every output of two runs of the same inputs (what: which
 * two), the poisoned rows past the counts included; dispatch's only
 * (dispatch_only) when the rest is meaningless and the runs' receive
 * blocks held different things. */
static void check_same_bits(const scen* s, rank_io* a, rank_io* b, const char* what, int dispatch_only) {
    const size_t NH = (size_t)(s->N * s->H) * 2, RH = (size_t)(s->R * s->H) * 2, Nk = (size_t)(s->N * s->k) * 4;
    for (int r = 0; r < s->W; r++) {
        const int same = !memcmp(a[r].rows, b[r].rows, RH) && !memcmp(a[r].rowp, b[r].rowp, (size_t)s->R * 4) &&
                         !memcmp(a[r].counts, b[r].counts, (size_t)(s->E / s->W) * 4) &&
                         (dispatch_only || (!memcmp(a[r].y, b[r].y, NH) &&
                         !memcmp(a[r].y_id, b[r].y_id, NH) && !memcmp(a[r].y_sum, b[r].y_sum, NH) &&
                         !memcmp(a[r].d_rows, b[r].d_rows, RH) && !memcmp(a[r].dprobs_c, b[r].dprobs_c, Nk) &&
                         !memcmp(a[r].dx, b[r].dx, NH) && !memcmp(a[r].dprobs_d, b[r].dprobs_d, Nk)));
        CHECK(same, "%s rank %d: %s differ", s->name, r, what);
    }
}

/* The window pass: the window's rows past R untouched; where the
 * transport stores into the window, the receive blocks too. */
static void check_window(const scen* s, rank_io* w) {
    for (int r = 0; r < s->W; r++) {
        CHECK(w[r].tail_ok, "%s rank %d: window rows past max_rows = %lld were written", s->name, r, (long long)s->R);
        CHECK(w[r].rows_only_ok, "%s rank %d: dispatch without probs into the window rows: not the rows (and flag) "
              "of the caller's rows, or it wrote the window's probs", s->name, r);
        CHECK(!w[r].direct || w[r].blocks_ok, "%s rank %d: dispatch into the window rows went through the receive "
              "blocks (direct path: nothing goes there)", s->name, r);
    }
}

/* Every rank returned its results (else the checks have nothing to read). */
static int have_results(const scen* s, rank_io* io, const char* what) {
    int ok = 1;
    for (int r = 0; r < s->W; r++) ok &= io[r].rows != NULL;
    CHECK(ok, "%s (%s): a rank returned nothing: %s", s->name, what, io[0].err);
    return ok;
}

/* Every scenario twice (same bits), each run two passes on the same
 * communicator: dispatch into the caller's rows, then into the window rows
 * (direct where the transport has it): both against the reference, and the
 * same bits. */
static void run_scen(const scen* s, mst_backend_kind kind, mst_ep_path_kind path) {
    rank_io io[2][16], io_w[2][16];
    memset(io, 0, sizeof io);
    memset(io_w, 0, sizeof io_w);
    int started = 1;
    for (int round = 0; round < 2 && started; round++) {
        for (int r = 0; r < s->W; r++) make_inputs(s, &io[round][r], r);
        started = run_world(s, kind, path, io[round], io_w[round]);
        for (int r = 0; r < s->W; r++) { /* the window pass ran on the same inputs */
            rank_io* w = &io_w[round][r];
            const rank_io* u = &io[round][r];
            w->x = u->x, w->idx = u->idx, w->p = u->p, w->out = u->out, w->dy = u->dy, w->drows = u->drows,
            w->drp = u->drp;
        }
    }
    CHECK(started, "%s: the world did not start", s->name);
    printf("  %-28s W %d, E %d, k %d, N %lld, R %lld, C %lld: path %s%s\n", s->name, s->W, s->E, s->k,
           (long long)s->N, (long long)s->R, (long long)pair_rows(s), io[0][0].path,
           io_w[0][0].direct ? " (window rows: direct)" : " (window rows: unpacked)");
    if (started && have_results(s, io[0], "caller's rows") && have_results(s, io_w[0], "window rows") &&
        have_results(s, io[1], "caller's rows, again") && have_results(s, io_w[1], "window rows, again")) {
        scen sw = *s;
        char name[96];
        snprintf(name, sizeof name, "%s, window rows", s->name);
        sw.name = name;
        const int recv_over = check_outputs(s, io[0], 1);
        check_outputs(&sw, io_w[0], 0);
        check_window(&sw, io_w[0]);
        check_same_bits(s, io[0], io[1], "two runs", 0);
        /* the window pass poisoned the receive blocks first */
        check_same_bits(s, io[0], io_w[0], "the caller's rows and the window rows", recv_over);
        check_same_bits(&sw, io_w[0], io_w[1], "two runs", 0);
    }
    for (int round = 0; round < 2; round++)
        for (int r = 0; r < s->W; r++) {
            free_inputs(&io[round][r]);
            free_results(&io[round][r]);
            free_results(&io_w[round][r]);
        }
}

/* ---- argument errors (one rank: nothing waits on a peer) ---- */

/* cfg.window_rows and the window rows of a communicator of one rank. */
static void check_bad_window(mst_ctx_t* ctx, const mst_ep_config* base) {
    mst_ep_config cfg = *base;
    mst_ep_group_t* g;
    mst_ep_t* ep = NULL;
    CHECK_OK(mst_ep_group_create(1, &g));
    cfg.window_rows = -3;
    CHECK_STATUS(mst_ep_create_local(ctx, &cfg, g, 0, &ep), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "cfg.window_rows = -3") != NULL, "message names window_rows: %s", mst_last_error());
    cfg.window_rows = cfg.max_rows + 8;
    CHECK_OK(mst_ep_create_local(ctx, &cfg, g, 0, &ep));
    mst_tensor rows, rowp;
    CHECK_STATUS(mst_ep_window_rows(ep, NULL, &rowp), MST_ERR_INVALID);
    CHECK_OK(mst_ep_window_rows(ep, &rows, &rowp));
    CHECK(rows.rows == cfg.max_rows && rows.cols == cfg.hidden && rowp.rows == cfg.max_rows && rowp.cols == 1,
          "window rows [%lld, %lld], probs [%lld, %lld]", (long long)rows.rows, (long long)rows.cols,
          (long long)rowp.rows, (long long)rowp.cols);
    CHECK_OK(mst_ep_set_max_rows(ep, cfg.window_rows + 1));
    CHECK_STATUS(mst_ep_window_rows(ep, &rows, &rowp), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "window_rows") != NULL, "message names window_rows: %s", mst_last_error());
    /* rows at the window's start, more rows than it holds */
    mst_ep_handle_t* h;
    CHECK_OK(mst_ep_handle_create(ep, &h));
    void* buf;
    CHECK_OK(mst_alloc(ctx, 1 << 16, &buf));
    const int64_t N = cfg.max_tokens, k = cfg.top_k, H = cfg.hidden;
    mst_tensor x = mst_tensor_make(buf, MST_DTYPE_BF16, N, H), idx = mst_tensor_make(buf, MST_DTYPE_INT32, N, k),
               cnt = mst_tensor_make(buf, MST_DTYPE_INT32, cfg.n_experts, 1),
               big = mst_tensor_make(rows.data, MST_DTYPE_BF16, cfg.window_rows + 1, H);
    CHECK_STATUS(mst_ep_dispatch(ep, h, &x, &idx, NULL, &big, NULL, &cnt), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "window_rows") != NULL, "message names window_rows: %s", mst_last_error());
    mst_free(ctx, buf);
    mst_ep_handle_destroy(h);
    mst_ep_destroy(ep);
    mst_ep_group_destroy(g);
}

static void check_bad_args(void) {
    mst_ctx_t* ctx;
    mst_ep_group_t* g;
    CHECK_OK(mst_ctx_create(MST_BACKEND_CPU, 0, &ctx));
    CHECK_OK(mst_ep_group_create(2, &g));
    mst_ep_t* ep = NULL;
    mst_ep_config cfg = {.struct_size = sizeof(mst_ep_config), .n_experts = 5, .top_k = 2, .hidden = 16, .max_tokens = 8, .max_rows = 32};
    CHECK_STATUS(mst_ep_create_local(ctx, &cfg, g, 0, &ep), MST_ERR_INVALID); /* 5 experts, 2 ranks */
    CHECK(strstr(mst_last_error(), "n_experts = 5") != NULL, "message names n_experts: %s", mst_last_error());
    mst_ep_group_destroy(g);
    CHECK_OK(mst_ep_group_create(1, &g));
    cfg.n_experts = 4;
    cfg.hidden = 12;
    CHECK_STATUS(mst_ep_create_local(ctx, &cfg, g, 0, &ep), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "hidden = 12") != NULL, "message names hidden: %s", mst_last_error());
    cfg.hidden = 16;
    cfg.path = 7;
    CHECK_STATUS(mst_ep_create_local(ctx, &cfg, g, 0, &ep), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "cfg.path = 7") != NULL, "message names path: %s", mst_last_error());
    cfg.path = MST_EP_PATH_AUTO;
    CHECK_STATUS(mst_ep_create_local(ctx, &cfg, g, 1, &ep), MST_ERR_INVALID);
    CHECK_OK(mst_ep_create_local(ctx, &cfg, g, 0, &ep));
    mst_ep_t* ep2 = NULL;
    CHECK_STATUS(mst_ep_create_local(ctx, &cfg, g, 0, &ep2), MST_ERR_INVALID); /* rank taken */
    CHECK(strcmp(mst_ep_path(ep), "local threads (CPU twin)") == 0, "path %s", mst_ep_path(ep));
    mst_ep_handle_t* h;
    CHECK_OK(mst_ep_handle_create(ep, &h));
    void* buf;
    CHECK_OK(mst_alloc(ctx, 1 << 16, &buf));
    mst_tensor x = mst_tensor_make(buf, MST_DTYPE_BF16, 8, 16), idx = mst_tensor_make(buf, MST_DTYPE_INT32, 8, 2),
               p = mst_tensor_make(buf, MST_DTYPE_FP32, 8, 2), rows = mst_tensor_make(buf, MST_DTYPE_BF16, 32, 16),
               cnt = mst_tensor_make(buf, MST_DTYPE_INT32, 4, 1), y = mst_tensor_make(buf, MST_DTYPE_BF16, 8, 16);
    CHECK_STATUS(mst_ep_combine(ep, h, &rows, NULL, &y), MST_ERR_STATE); /* before any dispatch */
    CHECK_STATUS(mst_ep_dispatch(ep, h, &x, &idx, &p, &rows, NULL, &cnt), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "row_probs") != NULL, "message names row_probs: %s", mst_last_error());
    mst_tensor big = mst_tensor_make(buf, MST_DTYPE_BF16, 9, 16);
    CHECK_STATUS(mst_ep_dispatch(ep, h, &big, &idx, NULL, &rows, NULL, &cnt), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "max_tokens") != NULL, "message names max_tokens: %s", mst_last_error());
    mst_tensor cnt_bad = mst_tensor_make(buf, MST_DTYPE_INT32, 3, 1);
    CHECK_STATUS(mst_ep_dispatch(ep, h, &x, &idx, NULL, &rows, NULL, &cnt_bad), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "counts") != NULL, "message names counts: %s", mst_last_error());
    mst_ep_id id;
    CHECK_STATUS(mst_ep_create(ctx, &cfg, &id, 0, 1, &ep2), MST_ERR_UNSUPPORTED); /* CPU context */
    mst_tensor wr;
    CHECK_STATUS(mst_ep_window_rows(ep, &wr, NULL), MST_ERR_INVALID); /* no window rows */
    CHECK(strstr(mst_last_error(), "window_rows = 0") != NULL, "message names window_rows: %s", mst_last_error());
    mst_free(ctx, buf);
    mst_ep_handle_destroy(h);
    mst_ep_destroy(ep);
    mst_ep_group_destroy(g);
    check_bad_window(ctx, &cfg);
    mst_ctx_destroy(ctx);
}

/* ---- all-reduce: every kind, W ranks, against the rank-order reference ---- */

enum { AR_N = 1000, AR_KINDS = 5 };

typedef struct ar_rank {
    mst_backend_kind kind;
    int rank, W;
    mst_ep_group_t* group;
    mst_ep_id* id;
    double in[AR_KINDS][AR_N];   /* the inputs as double (every kind holds them exactly) */
    double out[AR_KINDS][AR_N];  /* the results, read back as double                    */
    mst_status st;
    char err[256];
} ar_rank;

static size_t ar_size(int k) { return k == MST_EP_SUM_F64 || k == MST_EP_MAX_F64 ? 8 : 4; }

static void ar_put(int k, void* host, int64_t i, double v) {
    if (ar_size(k) == 8) ((double*)host)[i] = v;
    else if (k == MST_EP_SUM_F32) ((float*)host)[i] = (float)v;
    else ((int32_t*)host)[i] = (int32_t)v;
}

static double ar_get(int k, const void* host, int64_t i) {
    if (ar_size(k) == 8) return ((const double*)host)[i];
    return k == MST_EP_SUM_F32 ? (double)((const float*)host)[i] : (double)((const int32_t*)host)[i];
}

static void* ar_main(void* argp) {
    ar_rank* a = (ar_rank*)argp;
    mst_ctx_t* ctx = NULL;
    mst_ep_t* ep = NULL;
    mst_ep_config cfg = {.struct_size = sizeof(mst_ep_config), .n_experts = 2 * a->W, .top_k = 1, .hidden = 8, .max_tokens = 4, .max_rows = 8};
    a->st = mst_ctx_create(a->kind, a->kind == MST_BACKEND_CPU ? 0 : a->rank, &ctx);
    if (a->st == MST_OK)
        a->st = a->kind == MST_BACKEND_CPU ? mst_ep_create_local(ctx, &cfg, a->group, a->rank, &ep)
                                           : mst_ep_create(ctx, &cfg, a->id, a->rank, a->W, &ep);
    void* dev = NULL;
    unsigned char host[AR_N * 8];
    if (a->st == MST_OK) a->st = mst_alloc(ctx, sizeof host, &dev);
    for (int k = 0; k < AR_KINDS && a->st == MST_OK; k++) {
        for (int64_t i = 0; i < AR_N; i++) ar_put(k, host, i, a->in[k][i]);
        a->st = mst_copy_h2b(ctx, dev, host, AR_N * ar_size(k));
        if (a->st == MST_OK) a->st = mst_ep_allreduce(ep, dev, AR_N, (mst_ep_reduce)k);
        if (a->st == MST_OK) a->st = mst_copy_b2h(ctx, host, dev, AR_N * ar_size(k));
        for (int64_t i = 0; i < AR_N; i++) a->out[k][i] = ar_get(k, host, i);
    }
    if (a->st != MST_OK) snprintf(a->err, sizeof a->err, "%s", mst_last_error());
    if (dev) mst_free(ctx, dev);
    mst_ep_destroy(ep);
    mst_ctx_destroy(ctx);
    return NULL;
}

/* Sums in rank order in the element type, maxima and int32 sums: bit-exact
 * on every transport (ep.h; the float sums' buckets and tails:
 * test_ep_sum.c), every rank the same bits. */
static void check_allreduce(mst_backend_kind kind, int W) {
    ar_rank* a = (ar_rank*)calloc((size_t)W, sizeof *a);
    mst_ep_group_t* g = NULL;
    mst_ep_id id;
    if (kind == MST_BACKEND_CPU) CHECK_OK(mst_ep_group_create(W, &g));
    else CHECK_OK(mst_ep_id_create(&id));
    mst_rng rng = {0xA11ull + (uint64_t)W};
    for (int r = 0; r < W; r++) {
        a[r] = (ar_rank){.kind = kind, .rank = r, .W = W, .group = g, .id = &id};
        for (int k = 0; k < AR_KINDS; k++)
            for (int64_t i = 0; i < AR_N; i++) {
                const double v = mst_rng_normal(&rng) * 1000.0;
                a[r].in[k][i] = k == MST_EP_SUM_F32 ? (double)(float)v : ar_size(k) == 8 ? v : (double)(int32_t)v;
            }
    }
    pthread_t th[16];
    for (int r = 0; r < W; r++) pthread_create(&th[r], NULL, ar_main, &a[r]);
    for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
    int bad = 0;
    for (int r = 0; r < W; r++) {
        CHECK(a[r].st == MST_OK, "allreduce W %d rank %d: %s", W, r, a[r].err);
        if (a[r].st != MST_OK) bad = 1;
    }
    for (int k = 0; k < AR_KINDS && !bad; k++) {
        int exact = 1, same = 1;
        for (int64_t i = 0; i < AR_N; i++) {
            float f = 0.0f;
            double d = 0.0, mx = -INFINITY;
            int32_t n = 0;
            for (int r = 0; r < W; r++) {
                f += (float)a[r].in[k][i];
                d += a[r].in[k][i];
                n += (int32_t)a[r].in[k][i];
                mx = a[r].in[k][i] > mx ? a[r].in[k][i] : mx;
            }
            const double want = k == MST_EP_SUM_F32 ? (double)f : k == MST_EP_SUM_F64 ? d
                                : k == MST_EP_SUM_I32 ? (double)n : mx;
            const double got = a[0].out[k][i];
            exact &= got == want;
            for (int r = 1; r < W; r++) same &= memcmp(&a[r].out[k][i], &got, sizeof got) == 0;
        }
        CHECK(same, "allreduce W %d kind %d: the ranks got different bits", W, k);
        CHECK(exact, "allreduce W %d kind %d: not the rank-order result", W, k);
    }
    printf("  %-28s W %d: 5 kinds, %d values\n", "allreduce", W, AR_N);
    mst_ep_group_destroy(g);
    free(a);
}

static const scen SCENS[] = {
    {"random routing", 2, 8, 2, 64, 37, 200, 0, ROUTE_RANDOM, 1},
    {"random routing, 4 ranks", 4, 16, 3, 32, 29, 120, 0, ROUTE_RANDOM, 2},
    {"last rank receives nothing", 4, 12, 2, 24, 21, 64, 0, ROUTE_SKIP_LAST_RANK, 3},
    {"one expert takes everything", 3, 6, 1, 16, 40, 130, 0, ROUTE_ONE_EXPERT, 4},
    {"receiver over max_rows", 2, 4, 2, 16, 30, 70, 0, ROUTE_TO_LAST_RANK, 5},
    {"senders over pair_rows", 3, 6, 2, 16, 30, 100, 22, ROUTE_RANDOM, 6},
    {"expert id out of range", 2, 4, 2, 16, 20, 60, 0, ROUTE_BAD_ID, 7},
    /* rows of 2064 bytes: the lsa exchange copies them a warp per row, four
     * 16-byte words in flight per lane and a tail (rows under 512 bytes go a
     * thread per row) */
    {"wide rows, 4 ranks", 4, 8, 2, 1032, 33, 100, 0, ROUTE_RANDOM, 8},
    {"wide rows, senders over pair_rows", 2, 4, 2, 1032, 30, 70, 31, ROUTE_RANDOM, 9},
};

int main(int argc, char** argv) {
    const mst_backend_kind kind = mst_test_backend_arg(argc, argv);
    const int n_dev = mst_test_devices(kind, 16);
    if (kind == MST_BACKEND_CUDA && n_dev < 2) return mst_test_skip_devices(argv[0], n_dev, "expert parallelism needs 2");
    if (kind == MST_BACKEND_CPU) check_bad_args();
    for (size_t i = 0; i < sizeof SCENS / sizeof SCENS[0]; i++) {
        if (SCENS[i].W > n_dev) {
            printf("  %-28s skipped: %d ranks, %d devices\n", SCENS[i].name, SCENS[i].W, n_dev);
            continue;
        }
        if (kind == MST_BACKEND_CPU) run_scen(&SCENS[i], kind, MST_EP_PATH_AUTO);
        else for (int p = MST_EP_PATH_P2P; p <= MST_EP_PATH_LSA; p++) run_scen(&SCENS[i], kind, (mst_ep_path_kind)p);
    }
    for (int W = 2; W <= 4; W += 2)
        if (W <= n_dev) check_allreduce(kind, W);
    printf("%s: %d passed, %d failed\n", argv[0], mst_test_checks - mst_test_failures, mst_test_failures);
    return mst_test_failures ? 1 : 0;
}
