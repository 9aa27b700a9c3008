/*
 * bench_ep.c — `moestash bench ep [--gpus N] [--iters N] [--capacity F]
 * [--case a|b] [--path p2p|lsa] [--json FILE]`: expert-parallel dispatch
 * and combine over NCCL on each path (send/recv of fixed blocks; device
 * API), one thread and one GPU per rank, beside NCCL's own all-to-all
 * (grouped ncclSend/ncclRecv with the per-pair sizes known on the host, as
 * torch's all_to_all_single gets them) moving the same token rows, in the
 * same run on the same communicator (wrapped with mst_ep_create_nccl).
 *
 *   a: 4096 tokens per rank, hidden 7168, top-8 of 256 experts
 *   b: 16384 tokens per rank, hidden 4096, top-4 of 64 experts
 * Routing: uniform random top-k (distinct experts) per token, seeded per
 * rank. Budgets: pair_rows = ceil(F N k / W), max_rows = ceil(F N k), F =
 * --capacity (1.2); the flag is checked after every phase.
 *
 * Validated first: dispatch, then combine of the rows as they came (identity
 * experts, no probs) gives bf16(k x) for every token, bit for bit (k is a
 * power of two), for dispatch into the caller's rows and into the
 * communicator's window rows (mst_ep_window_rows: direct on lsa, no
 * unpack). GB/s per GPU = N k H 2 bytes (this rank's token copies) / time,
 * for dispatch both ways, combine, one captured CUDA graph of dispatch and
 * combine (per op), and the NCCL all-to-all of the same rows. Rank 0's
 * figures; ratio to NCCL.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "moestash.h"

#if defined(MST_HAVE_CUDA) && defined(MST_HAVE_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>

typedef struct ep_case {
    const char* name;
    int64_t tokens, hidden;
    int32_t experts, top_k;
} ep_case;

static const ep_case CASES[] = {
    {"a", 4096, 7168, 256, 8},
    {"b", 16384, 4096, 64, 4},
};

typedef struct ep_result {
    const ep_case* c;
    char path[80];                    /* mst_ep_path of rank 0             */
    double bytes;                     /* N k H 2 per rank                  */
    double dispatch_ms, combine_ms;   /* eager, per call (dispatch into the
                                         caller's rows: exchange + unpack)  */
    double window_ms;                 /* dispatch into the window rows     */
    double graph_ms, graph_w_ms;      /* replay of dispatch + combine (into
                                         the caller's rows; the window's)  */
    double a2a_ms;                    /* NCCL all-to-all, host sizes       */
    int ok;
    char err[256];
} ep_result;

typedef struct bench_world {
    int world, iters;
    double capacity;
    mst_ep_path_kind path;
    const ep_case* c;
    int64_t max_rows, pair_cap; /* R = ceil(F N k), C = ceil(F N k / W)    */
    ncclUniqueId id;
    pthread_barrier_t bar;
    int64_t* pair_rows;  /* [W, W] rows rank i sends to rank j (host sizes) */
    ep_result* res;      /* [W] */
} bench_world;

typedef struct rank_state {
    bench_world* w;
    int rank;
    mst_ctx_t* ctx;
    cudaStream_t s;
    ncclComm_t comm;
    mst_ep_t* ep;
    mst_ep_handle_t* h;
    void *x, *idx, *rows, *counts, *y, *a2a_send, *a2a_recv; /* backend memory */
    mst_tensor win;                                          /* the window rows [R, H] */
    uint16_t* hx;  /* [N, H] host copy of x */
    int32_t* hidx; /* [N, k] */
} rank_state;

#define TRY(expr)                                                               \
    do {                                                                        \
        mst_status s_ = (expr);                                                 \
        if (s_ != MST_OK) return s_;                                            \
    } while (0)

/* Records a failure of the bench itself (not of a library call) on the rank. */
#define FAIL(st_, ...)                                                          \
    do {                                                                        \
        snprintf(st->w->res[st->rank].err, sizeof st->w->res[st->rank].err, __VA_ARGS__); \
        return st_;                                                             \
    } while (0)

static uint64_t mix(uint64_t* s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void make_inputs(rank_state* st) {
    const ep_case* c = st->w->c;
    uint64_t seed = 77 + (uint64_t)st->rank;
    st->hx = malloc((size_t)(c->tokens * c->hidden) * 2);
    st->hidx = malloc((size_t)(c->tokens * c->top_k) * 4);
    for (int64_t i = 0; i < c->tokens * c->hidden; i++)
        st->hx[i] = mst_fp32_to_bf16((float)((double)(mix(&seed) >> 11) * 0x1.0p-53 - 0.5));
    for (int64_t t = 0; t < c->tokens; t++)
        for (int j = 0; j < c->top_k; j++) {
            int32_t g, dup;
            do {
                g = (int32_t)(mix(&seed) % (uint64_t)c->experts);
                dup = 0;
                for (int u = 0; u < j; u++) dup |= st->hidx[t * c->top_k + u] == g;
            } while (dup);
            st->hidx[t * c->top_k + j] = g;
        }
}

static mst_status setup(rank_state* st) {
    bench_world* w = st->w;
    const ep_case* c = w->c;
    const int64_t N = c->tokens, H = c->hidden, K = c->top_k, NK = N * K;
    TRY(mst_ctx_create(MST_BACKEND_CUDA, st->rank, &st->ctx));
    st->s = (cudaStream_t)mst_ctx_stream(st->ctx);
    if (ncclCommInitRank(&st->comm, w->world, w->id, st->rank) != ncclSuccess)
        FAIL(MST_ERR_BACKEND, "ncclCommInitRank failed");
    mst_ep_config cfg = {.struct_size = sizeof(mst_ep_config), .n_experts = c->experts, .top_k = c->top_k, .hidden = H, .max_tokens = N,
                         .max_rows = w->max_rows, .pair_rows = w->pair_cap, .path = w->path,
                         .window_rows = w->max_rows};
    TRY(mst_ep_create_nccl(st->ctx, &cfg, st->comm, &st->ep));
    TRY(mst_ep_handle_create(st->ep, &st->h));
    TRY(mst_ep_window_rows(st->ep, &st->win, NULL));
    make_inputs(st);
    TRY(mst_alloc(st->ctx, (size_t)(N * H) * 2, &st->x));
    TRY(mst_alloc(st->ctx, (size_t)NK * 4, &st->idx));
    TRY(mst_alloc(st->ctx, (size_t)(cfg.max_rows * H) * 2, &st->rows));
    TRY(mst_alloc(st->ctx, (size_t)(c->experts / w->world) * 4, &st->counts));
    TRY(mst_alloc(st->ctx, (size_t)(N * H) * 2, &st->y));
    TRY(mst_alloc(st->ctx, (size_t)(NK * H) * 2, &st->a2a_send));
    TRY(mst_alloc(st->ctx, (size_t)(cfg.max_rows * H) * 2, &st->a2a_recv));
    TRY(mst_copy_h2b(st->ctx, st->x, st->hx, (size_t)(N * H) * 2));
    TRY(mst_copy_h2b(st->ctx, st->idx, st->hidx, (size_t)NK * 4));
    /* host sizes for the NCCL baseline: rows to each rank */
    const int El = c->experts / w->world;
    for (int64_t i = 0; i < NK; i++) w->pair_rows[st->rank * w->world + st->hidx[i] / El]++;
    return MST_OK;
}

/* The rows dispatch writes and combine reads: the window's or the caller's. */
static mst_tensor rows_of(rank_state* st, int window) {
    if (window) return st->win;
    return mst_tensor_make(st->rows, MST_DTYPE_BF16, st->w->max_rows, st->w->c->hidden);
}

static mst_status dispatch_into(rank_state* st, int window) {
    const ep_case* c = st->w->c;
    mst_tensor x = mst_tensor_make(st->x, MST_DTYPE_BF16, c->tokens, c->hidden);
    mst_tensor idx = mst_tensor_make(st->idx, MST_DTYPE_INT32, c->tokens, c->top_k);
    mst_tensor rows = rows_of(st, window);
    mst_tensor counts = mst_tensor_make(st->counts, MST_DTYPE_INT32, c->experts / st->w->world, 1);
    return mst_ep_dispatch(st->ep, st->h, &x, &idx, NULL, &rows, NULL, &counts);
}

static mst_status dispatch(rank_state* st) { return dispatch_into(st, 0); }
static mst_status dispatch_window(rank_state* st) { return dispatch_into(st, 1); }

static mst_status combine_from(rank_state* st, int window) {
    const ep_case* c = st->w->c;
    mst_tensor rows = rows_of(st, window);
    mst_tensor y = mst_tensor_make(st->y, MST_DTYPE_BF16, c->tokens, c->hidden);
    return mst_ep_combine(st->ep, st->h, &rows, NULL, &y);
}

static mst_status combine(rank_state* st) { return combine_from(st, 0); }

/* NCCL all-to-all of the same token rows, sizes known on the host. */
static mst_status a2a(rank_state* st) {
    bench_world* w = st->w;
    const size_t row = (size_t)w->c->hidden * 2;
    size_t soff = 0, roff = 0;
    ncclGroupStart();
    for (int j = 0; j < w->world; j++) {
        const size_t sb = (size_t)w->pair_rows[st->rank * w->world + j] * row;
        const size_t rb = (size_t)w->pair_rows[j * w->world + st->rank] * row;
        ncclSend((char*)st->a2a_send + soff, sb, ncclChar, j, st->comm, st->s);
        ncclRecv((char*)st->a2a_recv + roff, rb, ncclChar, j, st->comm, st->s);
        soff += sb, roff += rb;
    }
    if (ncclGroupEnd() != ncclSuccess) FAIL(MST_ERR_BACKEND, "nccl all-to-all failed");
    return MST_OK;
}

static mst_status poison_y(rank_state* st) {
    return mst_fill(st->ctx, st->y, 0xFF, (size_t)(st->w->c->tokens * st->w->c->hidden) * 2);
}

/* y (poisoned before `what` ran) is bf16(k x), and no flag was raised. */
static mst_status check_y(rank_state* st, const char* what) {
    const ep_case* c = st->w->c;
    const int64_t n = c->tokens * c->hidden;
    TRY(mst_ctx_check(st->ctx));
    uint16_t* y = malloc((size_t)n * 2);
    TRY(mst_copy_b2h(st->ctx, y, st->y, (size_t)n * 2));
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (y[i] != mst_fp32_to_bf16((float)c->top_k * mst_bf16_to_fp32(st->hx[i]))) bad = i;
    free(y);
    if (bad >= 0) FAIL(MST_ERR_STATE, "validation: %s: y differs from bf16(k x) at element %lld", what, (long long)bad);
    return MST_OK;
}

static const char* way(int window) { return window ? "into the window rows" : "into the caller's rows"; }

/* Dispatch (into the window rows or the caller's) and combine of what
 * came give bf16(k x). */
static mst_status validate(rank_state* st, int window) {
    TRY(poison_y(st));
    TRY(dispatch_into(st, window));
    TRY(combine_from(st, window));
    return check_y(st, way(window));
}

typedef mst_status (*phase_fn)(rank_state*);

/* ms per call of fn, iters calls between two events, every rank together. */
static mst_status time_phase(rank_state* st, phase_fn fn, cudaGraphExec_t graph, double* ms) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    mst_status rc = MST_OK;
    for (int warm = 0; warm < 2 && rc == MST_OK; warm++) rc = graph ? (cudaGraphLaunch(graph, st->s) ? MST_ERR_BACKEND : MST_OK) : fn(st);
    if (rc == MST_OK) rc = mst_ctx_sync(st->ctx);
    pthread_barrier_wait(&st->w->bar);
    cudaEventRecord(e0, st->s);
    for (int i = 0; i < st->w->iters && rc == MST_OK; i++)
        rc = graph ? (cudaGraphLaunch(graph, st->s) ? MST_ERR_BACKEND : MST_OK) : fn(st);
    cudaEventRecord(e1, st->s);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    *ms = t / st->w->iters;
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    pthread_barrier_wait(&st->w->bar);
    return rc;
}

static mst_status capture(rank_state* st, int window, cudaGraphExec_t* exec) {
    cudaGraph_t g;
    if (cudaStreamBeginCapture(st->s, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        FAIL(MST_ERR_BACKEND, "cudaStreamBeginCapture failed");
    mst_status rc = dispatch_into(st, window);
    if (rc == MST_OK) rc = combine_from(st, window);
    const cudaError_t end = cudaStreamEndCapture(st->s, &g);
    TRY(rc);
    if (end != cudaSuccess) FAIL(MST_ERR_BACKEND, "cudaStreamEndCapture failed: %s", cudaGetErrorString(end));
    cudaError_t e = cudaGraphInstantiate(exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) FAIL(MST_ERR_BACKEND, "cudaGraphInstantiate failed: %s", cudaGetErrorString(e));
    return MST_OK;
}

/* ms per replay of a captured dispatch + combine (into the window rows or
 * the caller's); then one more replay gives bf16(k x). */
static mst_status time_graph(rank_state* st, int window, double* ms) {
    cudaGraphExec_t exec;
    TRY(capture(st, window, &exec));
    mst_status rc = time_phase(st, NULL, exec, ms);
    if (rc == MST_OK) rc = poison_y(st);
    if (rc == MST_OK && cudaGraphLaunch(exec, st->s) != cudaSuccess) rc = MST_ERR_BACKEND;
    if (rc == MST_OK) rc = check_y(st, window ? "graph replay, into the window rows" : "graph replay");
    cudaGraphExecDestroy(exec);
    return rc;
}

static mst_status run_rank(rank_state* st, ep_result* r) {
    TRY(setup(st));
    pthread_barrier_wait(&st->w->bar); /* pair_rows complete */
    TRY(validate(st, 0));
    TRY(validate(st, 1));
    TRY(time_phase(st, dispatch, NULL, &r->dispatch_ms));
    TRY(time_phase(st, dispatch_window, NULL, &r->window_ms));
    TRY(time_phase(st, combine, NULL, &r->combine_ms));
    TRY(time_graph(st, 0, &r->graph_ms));
    TRY(time_graph(st, 1, &r->graph_w_ms));
    TRY(validate(st, 0)); /* still right eagerly after the replays */
    TRY(validate(st, 1));
    return time_phase(st, a2a, NULL, &r->a2a_ms);
}

static void* rank_main(void* p) {
    rank_state* st = (rank_state*)p;
    ep_result* r = &st->w->res[st->rank];
    mst_status rc = run_rank(st, r);
    r->ok = rc == MST_OK;
    if (!r->ok && !r->err[0]) snprintf(r->err, sizeof r->err, "%.250s", mst_last_error());
    if (st->ep) snprintf(r->path, sizeof r->path, "%.70s", mst_ep_path(st->ep));
    mst_ep_handle_destroy(st->h);
    mst_ep_destroy(st->ep);
    if (st->comm) ncclCommDestroy(st->comm);
    mst_ctx_destroy(st->ctx);
    free(st->hx), free(st->hidx);
    return NULL;
}

/* ---- the MoE layer step: weak scaling ------------------------------------ *
 * dispatch -> grouped MLP -> combine, forward and backward, one rank per GPU
 * at W = 1, 2, 4, ... with the same tokens per rank and the same global
 * experts (E / W per rank): the work per rank is the same at every W, so
 * t(1) / t(W) is the weak-scaling efficiency. Eager, each phase between two
 * events of the rank's stream, summed over iters; rank 0's figures. */

typedef struct layer_case {
    int64_t tokens, hidden, ffn;
    int32_t experts, top_k;
} layer_case;

/* DeepSeek-V3's expert shape (H 7168, F 2048, top-8), 32 experts in all so
 * that one GPU holds every expert's weights and fp32 main_grad at W = 1. */
static const layer_case LAYER = {4096, 7168, 2048, 32, 8};

enum { PH_DISPATCH, PH_MLP_FWD, PH_COMBINE, PH_COMBINE_BWD, PH_MLP_BWD, PH_DISPATCH_BWD, N_PH };

typedef struct layer_result {
    int world, ok;
    double ms[N_PH]; /* per step                                                 */
    char path[80], err[256];
} layer_result;

typedef struct layer_world {
    int world, iters;
    double capacity;
    ncclUniqueId id;
    pthread_barrier_t bar;
    layer_result* res; /* [W] */
} layer_world;

typedef struct layer_rank {
    layer_world* w;
    int rank;
    mst_ctx_t* ctx;
    ncclComm_t comm;
    mst_ep_t* ep;
    mst_ep_handle_t* h;
    mst_mlp_config mlp;
    mst_mlp_weights wt;
    mst_saver_basic_t* saver;
    mst_tensor x, idx, probs, rows, row_p, counts, out, y, dy, d_out, d_rows, d_row_p, dx, dprobs;
    void* mem[32];
    int n_mem;
} layer_rank;

/* A tensor of backend memory filled with a random pattern (bf16 or fp32
 * in (0.05, 1), int32 expert ids of distinct top-k per token). */
static mst_status layer_tensor(layer_rank* r, mst_tensor* t, mst_dtype dt, int64_t rows, int64_t cols, double scale,
                               uint64_t seed) {
    void* p;
    const size_t n = (size_t)(rows * cols), bytes = n * mst_dtype_size(dt);
    TRY(mst_alloc(r->ctx, bytes, &p));
    r->mem[r->n_mem++] = p;
    *t = mst_tensor_make(p, dt, rows, cols);
    enum { CHUNK = 1 << 22 }; /* elements of the pattern, repeated */
    const size_t m = n < CHUNK ? n : CHUNK;
    void* hbuf = malloc(m * mst_dtype_size(dt));
    for (size_t i = 0; i < m; i++) {
        const double u = (double)(mix(&seed) >> 11) * 0x1.0p-53;
        if (dt == MST_DTYPE_BF16) ((uint16_t*)hbuf)[i] = mst_fp32_to_bf16((float)((u - 0.5) * scale));
        else if (dt == MST_DTYPE_FP32) ((float*)hbuf)[i] = (float)(0.05 + 0.95 * u);
        else ((int32_t*)hbuf)[i] = 0;
    }
    if (dt == MST_DTYPE_INT32) /* top-k distinct experts per row */
        for (size_t i = 0; i < m; i += (size_t)cols)
            for (int64_t j = 0; j < cols; j++) {
                int32_t g, dup;
                do {
                    g = (int32_t)(mix(&seed) % (uint64_t)LAYER.experts);
                    dup = 0;
                    for (int64_t u = 0; u < j; u++) dup |= ((int32_t*)hbuf)[i + u] == g;
                } while (dup);
                ((int32_t*)hbuf)[i + j] = g;
            }
    mst_status st = MST_OK;
    for (size_t off = 0; off < n && st == MST_OK; off += m) {
        const size_t k = n - off < m ? n - off : m;
        st = mst_copy_h2b(r->ctx, (char*)p + off * mst_dtype_size(dt), hbuf, k * mst_dtype_size(dt));
    }
    free(hbuf);
    return st;
}

static mst_status layer_setup(layer_rank* r) {
    layer_world* w = r->w;
    const layer_case* c = &LAYER;
    const int64_t N = c->tokens, H = c->hidden, F = c->ffn, K = c->top_k, El = c->experts / w->world;
    const int64_t R = (int64_t)ceil(w->capacity * (double)(N * K));
    TRY(mst_ctx_create(MST_BACKEND_CUDA, r->rank, &r->ctx));
    if (ncclCommInitRank(&r->comm, w->world, w->id, r->rank) != ncclSuccess) {
        snprintf(w->res[r->rank].err, sizeof w->res[r->rank].err, "ncclCommInitRank failed");
        return MST_ERR_BACKEND;
    }
    mst_ep_config cfg = {.struct_size = sizeof(mst_ep_config), .n_experts = c->experts, .top_k = c->top_k, .hidden = H, .max_tokens = N, .max_rows = R,
                         .pair_rows = (int64_t)ceil(w->capacity * (double)(N * K) / w->world)};
    TRY(mst_ep_create_nccl(r->ctx, &cfg, r->comm, &r->ep));
    TRY(mst_ep_handle_create(r->ep, &r->h));
    r->mlp = mst_mlp_config_default((int32_t)El, H, F);
    const mst_policy keep[MST_N_SAVED] = {MST_POLICY_KEEP, MST_POLICY_KEEP, MST_POLICY_KEEP, MST_POLICY_KEEP};
    TRY(mst_saver_basic_create(r->ctx, R, &r->mlp, keep, &r->saver));
    const mst_saver* sv = mst_saver_basic_get(r->saver);
    /* dispatch writes straight into the saver's KEEP buffers of x and p */
    TRY(sv->produce(sv->self, MST_SAVED_FC1_INPUT, R, H, MST_DTYPE_BF16, &r->rows));
    TRY(sv->produce(sv->self, MST_SAVED_PROBS, R, 1, MST_DTYPE_FP32, &r->row_p));
    const uint64_t s = 1000 * (uint64_t)(r->rank + 1);
    TRY(layer_tensor(r, &r->x, MST_DTYPE_BF16, N, H, 2.0, s + 1));
    TRY(layer_tensor(r, &r->idx, MST_DTYPE_INT32, N, K, 0, s + 2));
    TRY(layer_tensor(r, &r->probs, MST_DTYPE_FP32, N, K, 0, s + 3));
    TRY(layer_tensor(r, &r->dy, MST_DTYPE_BF16, N, H, 2.0, s + 4));
    TRY(layer_tensor(r, &r->wt.w1, MST_DTYPE_BF16, El * 2 * F, H, 2.0 / sqrt((double)H), s + 5));
    TRY(layer_tensor(r, &r->wt.w2, MST_DTYPE_BF16, El * H, F, 2.0 / sqrt((double)F), s + 6));
    TRY(layer_tensor(r, &r->wt.g_w1, MST_DTYPE_FP32, El * 2 * F, H, 0, s + 7));
    TRY(layer_tensor(r, &r->wt.g_w2, MST_DTYPE_FP32, El * H, F, 0, s + 8));
    TRY(layer_tensor(r, &r->counts, MST_DTYPE_INT32, El, 1, 0, s + 9));
    TRY(layer_tensor(r, &r->out, MST_DTYPE_BF16, R, H, 2.0, s + 10));
    TRY(layer_tensor(r, &r->y, MST_DTYPE_BF16, N, H, 2.0, s + 11));
    TRY(layer_tensor(r, &r->d_out, MST_DTYPE_BF16, R, H, 2.0, s + 12));
    TRY(layer_tensor(r, &r->d_rows, MST_DTYPE_BF16, R, H, 2.0, s + 13));
    TRY(layer_tensor(r, &r->d_row_p, MST_DTYPE_FP32, R, 1, 0, s + 14));
    TRY(layer_tensor(r, &r->dx, MST_DTYPE_BF16, N, H, 2.0, s + 15));
    return layer_tensor(r, &r->dprobs, MST_DTYPE_FP32, N, K, 0, s + 16);
}

/* One phase of the step. */
static mst_status layer_phase(layer_rank* r, int ph) {
    const mst_saver* sv = mst_saver_basic_get(r->saver);
    switch (ph) {
    case PH_DISPATCH: return mst_ep_dispatch(r->ep, r->h, &r->x, &r->idx, &r->probs, &r->rows, &r->row_p, &r->counts);
    case PH_MLP_FWD:
        return mst_grouped_mlp_forward(r->ctx, &r->mlp, &r->wt, &r->rows, &r->row_p, &r->counts, sv, &r->out);
    case PH_COMBINE: return mst_ep_combine(r->ep, r->h, &r->out, NULL, &r->y);
    case PH_COMBINE_BWD: return mst_ep_combine_backward(r->ep, r->h, &r->dy, NULL, NULL, &r->d_out, NULL);
    case PH_MLP_BWD:
        return mst_grouped_mlp_backward(r->ctx, &r->mlp, &r->wt, &r->d_out, &r->counts, sv, &r->d_rows, &r->d_row_p,
                                        MST_WGRAD_ACCUMULATE);
    default: return mst_ep_dispatch_backward(r->ep, r->h, &r->d_rows, &r->d_row_p, &r->dx, &r->dprobs);
    }
}

static mst_status layer_run(layer_rank* r, layer_result* res) {
    TRY(layer_setup(r));
    cudaStream_t s = (cudaStream_t)mst_ctx_stream(r->ctx);
    for (int warm = 0; warm < 2; warm++)
        for (int ph = 0; ph < N_PH; ph++) TRY(layer_phase(r, ph));
    TRY(mst_ctx_check(r->ctx));
    cudaEvent_t ev[N_PH + 1];
    for (int i = 0; i <= N_PH; i++) cudaEventCreate(&ev[i]);
    pthread_barrier_wait(&r->w->bar);
    mst_status st = MST_OK;
    for (int it = 0; it < r->w->iters && st == MST_OK; it++) {
        cudaEventRecord(ev[0], s);
        for (int ph = 0; ph < N_PH && st == MST_OK; ph++) {
            st = layer_phase(r, ph);
            cudaEventRecord(ev[ph + 1], s);
        }
        cudaEventSynchronize(ev[N_PH]);
        for (int ph = 0; ph < N_PH; ph++) {
            float t = 0;
            cudaEventElapsedTime(&t, ev[ph], ev[ph + 1]);
            res->ms[ph] += t / r->w->iters;
        }
    }
    for (int i = 0; i <= N_PH; i++) cudaEventDestroy(ev[i]);
    pthread_barrier_wait(&r->w->bar);
    TRY(st);
    return mst_ctx_check(r->ctx); /* no rank went over budget */
}

static void* layer_main(void* p) {
    layer_rank* r = (layer_rank*)p;
    layer_result* res = &r->w->res[r->rank];
    const mst_status st = layer_run(r, res);
    res->ok = st == MST_OK;
    if (!res->ok && !res->err[0]) snprintf(res->err, sizeof res->err, "%.250s", mst_last_error());
    if (r->ep) snprintf(res->path, sizeof res->path, "%.70s", mst_ep_path(r->ep));
    for (int i = 0; i < r->n_mem; i++) mst_free(r->ctx, r->mem[i]);
    mst_saver_basic_destroy(r->saver);
    mst_ep_handle_destroy(r->h);
    mst_ep_destroy(r->ep);
    if (r->comm) ncclCommDestroy(r->comm);
    mst_ctx_destroy(r->ctx);
    return NULL;
}

/* The layer step on W ranks; rank 0's result into *out. */
static int layer_case_run(int world, int iters, double capacity, layer_result* out) {
    layer_world w = {.world = world, .iters = iters, .capacity = capacity};
    w.res = calloc((size_t)world, sizeof *w.res);
    layer_rank* rk = calloc((size_t)world, sizeof *rk);
    pthread_t* th = calloc((size_t)world, sizeof *th);
    int ok = ncclGetUniqueId(&w.id) == ncclSuccess;
    if (ok) {
        pthread_barrier_init(&w.bar, NULL, (unsigned)world);
        for (int r = 0; r < world; r++) {
            rk[r] = (layer_rank){.w = &w, .rank = r};
            pthread_create(&th[r], NULL, layer_main, &rk[r]);
        }
        for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
        pthread_barrier_destroy(&w.bar);
        for (int r = 0; r < world; r++)
            if (!w.res[r].ok) {
                fprintf(stderr, "moestash bench ep: layer W=%d rank %d: %s\n", world, r, w.res[r].err);
                ok = 0;
            }
    }
    *out = w.res[0];
    out->world = world;
    out->ok = ok;
    free(w.res), free(rk), free(th);
    return ok;
}

static double layer_step_ms(const layer_result* r) {
    double t = 0;
    for (int ph = 0; ph < N_PH; ph++) t += r->ms[ph];
    return t;
}

static void print_layer(const layer_result* r, const layer_result* one) {
    const double step = layer_step_ms(r);
    printf("layer W=%d  dispatch %6.3f + %6.3f ms  grouped MLP %6.3f + %6.3f ms  combine %6.3f + %6.3f ms  "
           "(fwd + bwd)  step %7.3f ms  weak-scaling efficiency %.3f\n",
           r->world, r->ms[PH_DISPATCH], r->ms[PH_DISPATCH_BWD], r->ms[PH_MLP_FWD], r->ms[PH_MLP_BWD],
           r->ms[PH_COMBINE], r->ms[PH_COMBINE_BWD], step, one ? layer_step_ms(one) / step : 1.0);
}

static void write_layer_json(FILE* f, const layer_result* res, int n) {
    static const char* const names[N_PH] = {"dispatch", "mlp_fwd", "combine", "combine_bwd", "mlp_bwd", "dispatch_bwd"};
    fprintf(f, "  \"layer\": {\"tokens\": %lld, \"hidden\": %lld, \"ffn\": %lld, \"experts\": %d, \"top_k\": %d, "
               "\"rows\": [\n", (long long)LAYER.tokens, (long long)LAYER.hidden, (long long)LAYER.ffn, LAYER.experts,
            LAYER.top_k);
    for (int i = 0; i < n; i++) {
        fprintf(f, "    {\"world\": %d, \"ok\": %s, \"path\": \"%s\"", res[i].world, res[i].ok ? "true" : "false",
                res[i].path);
        for (int ph = 0; ph < N_PH; ph++) fprintf(f, ", \"%s_ms\": %.4f", names[ph], res[i].ms[ph]);
        fprintf(f, ", \"step_ms\": %.4f, \"efficiency\": %.4f}%s\n", layer_step_ms(&res[i]),
                res[0].ok && res[i].ok ? layer_step_ms(&res[0]) / layer_step_ms(&res[i]) : 0.0, i + 1 < n ? "," : "");
    }
    fprintf(f, "  ]}\n");
}

static void print_result(const bench_world* w, const ep_result* r) {
    const double gb = r->bytes / 1e9;
    printf("%-4s %-3s N %5lld H %5lld E %3d k %d  dispatch %7.1f GB/s (window rows %7.1f)  combine %7.1f GB/s  "
           "graph (per op) %7.1f GB/s (window rows %7.1f)  nccl a2a %7.1f GB/s  dispatch/a2a %.2f (window rows %.2f)  "
           "combine/a2a %.2f\n",
           r->c->name, strstr(r->path, "device") ? "lsa" : "p2p", (long long)r->c->tokens, (long long)r->c->hidden,
           r->c->experts, r->c->top_k, gb / (r->dispatch_ms / 1e3), gb / (r->window_ms / 1e3),
           gb / (r->combine_ms / 1e3), gb / (r->graph_ms / 2e3), gb / (r->graph_w_ms / 2e3), gb / (r->a2a_ms / 1e3),
           r->a2a_ms / r->dispatch_ms, r->a2a_ms / r->window_ms, r->a2a_ms / r->combine_ms);
    (void)w;
}

static void write_json(FILE* f, const char* device, const bench_world* w, const ep_result* res, int n,
                       const layer_result* layer, int n_layer) {
    fprintf(f, "{\n  \"bench\": \"ep\",\n  \"device\": \"%s\",\n  \"world\": %d,\n"
               "  \"nccl\": \"%d.%d.%d\",\n  \"capacity\": %.3f,\n  \"iters\": %d,\n  \"cases\": [\n",
            device, w->world, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, w->capacity, w->iters);
    for (int i = 0; i < n; i++) {
        const ep_result* r = &res[i];
        const double gb = r->bytes / 1e9;
        fprintf(f, "    {\"case\": \"%s\", \"path\": \"%s\", \"tokens\": %lld, \"hidden\": %lld, \"experts\": %d, \"top_k\": %d, "
                   "\"ok\": %s, \"dispatch_ms\": %.4f, \"dispatch_window_ms\": %.4f, \"combine_ms\": %.4f, "
                   "\"graph_ms\": %.4f, \"graph_window_ms\": %.4f, \"a2a_ms\": %.4f, "
                   "\"dispatch_gbs\": %.2f, \"dispatch_window_gbs\": %.2f, \"combine_gbs\": %.2f, \"a2a_gbs\": %.2f, "
                   "\"dispatch_over_a2a\": %.3f, \"dispatch_window_over_a2a\": %.3f, \"combine_over_a2a\": %.3f}%s\n",
                r->c->name, r->path, (long long)r->c->tokens, (long long)r->c->hidden, r->c->experts, r->c->top_k,
                r->ok ? "true" : "false", r->dispatch_ms, r->window_ms, r->combine_ms, r->graph_ms, r->graph_w_ms,
                r->a2a_ms,
                gb / (r->dispatch_ms / 1e3), gb / (r->window_ms / 1e3), gb / (r->combine_ms / 1e3),
                gb / (r->a2a_ms / 1e3), r->a2a_ms / r->dispatch_ms, r->a2a_ms / r->window_ms,
                r->a2a_ms / r->combine_ms, i + 1 < n ? "," : "");
    }
    fprintf(f, "  ]%s\n", n_layer ? "," : "");
    if (n_layer) write_layer_json(f, layer, n_layer);
    fprintf(f, "}\n");
}

/* Runs case c on W ranks; rank 0's result into *out. */
static int run_case(bench_world* w, const ep_case* c, ep_result* out) {
    w->c = c;
    const int64_t NK = c->tokens * c->top_k;
    w->max_rows = (int64_t)ceil(w->capacity * (double)NK);
    w->pair_cap = (int64_t)ceil(w->capacity * (double)NK / w->world);
    w->pair_rows = calloc((size_t)(w->world * w->world), sizeof(int64_t));
    w->res = calloc((size_t)w->world, sizeof(ep_result));
    rank_state* st = calloc((size_t)w->world, sizeof(rank_state));
    pthread_t* th = calloc((size_t)w->world, sizeof(pthread_t));
    if (ncclGetUniqueId(&w->id) != ncclSuccess) {
        fprintf(stderr, "moestash bench ep: ncclGetUniqueId failed\n");
        return 0;
    }
    pthread_barrier_init(&w->bar, NULL, (unsigned)w->world);
    for (int r = 0; r < w->world; r++) {
        st[r] = (rank_state){.w = w, .rank = r};
        pthread_create(&th[r], NULL, rank_main, &st[r]);
    }
    for (int r = 0; r < w->world; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&w->bar);
    int ok = 1;
    for (int r = 0; r < w->world; r++)
        if (!w->res[r].ok) {
            fprintf(stderr, "moestash bench ep: case %s rank %d: %s\n", c->name, r, w->res[r].err);
            ok = 0;
        }
    *out = w->res[0];
    out->c = c;
    if (!ok) snprintf(out->path, sizeof out->path, "%s", w->path == MST_EP_PATH_LSA ? "nccl device API" : "nccl send/recv");
    out->bytes = (double)NK * (double)c->hidden * 2;
    out->ok = ok;
    free(w->pair_rows), free(w->res), free(st), free(th);
    return ok;
}

int mst_bench_ep(int argc, char** argv) {
    bench_world w = {.world = 0, .iters = 20, .capacity = 1.2};
    static const char* const case_names[] = {"a", "b", NULL};
    static const char* const path_names[] = {"p2p", "lsa", NULL};
    static const char* const part_names[] = {"all", "ep", "layer", NULL};
    const char *json = NULL, *only = NULL, *path = NULL;
    int part = 0;
    mst_args a;
    mst_args_init(&a, "moestash bench ep", argc, argv);
    while (mst_args_next(&a)) {
        int rc, k = 0;
        float cap = 0;
        if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--gpus")) rc = mst_args_int32(&a, 0, 1024, &w.world); /* 0: every device */
        else if (mst_args_is(&a, "--iters")) rc = mst_args_int32(&a, 1, 1000000, &w.iters);
        else if (mst_args_is(&a, "--capacity")) {
            rc = mst_args_float(&a, 1.0, 1024, &cap);
            w.capacity = cap;
        } else if (mst_args_is(&a, "--case")) {
            rc = mst_args_choice(&a, case_names, &k);
            only = case_names[k];
        } else if (mst_args_is(&a, "--path")) {
            rc = mst_args_choice(&a, path_names, &k);
            path = path_names[k];
        } else if (mst_args_is(&a, "--part")) {
            rc = mst_args_choice(&a, part_names, &part);
        } else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench ep [--gpus N] [--iters N] [--capacity F] [--case a|b] [--path p2p|lsa] "
                   "[--part all|ep|layer] [--json FILE]\n"
                   "  ep: dispatch/combine GB/s per GPU beside NCCL all-to-all of the same rows;\n"
                   "  layer: the MoE layer step (dispatch, grouped MLP, combine, fwd + bwd) at 1, 2, 4, ... GPUs\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess) n_dev = 0;
    if (w.world == 0) w.world = n_dev;
    if (w.world < 1 || w.world > n_dev) {
        fprintf(stderr, "moestash bench ep: --gpus %d: %d CUDA devices present\n", w.world, n_dev);
        return 2;
    }
    ep_result res[4];
    int n = 0, ok = 1;
    for (int p = MST_EP_PATH_P2P; p <= MST_EP_PATH_LSA && part != 2; p++) {
        if (path && strcmp(path, p == MST_EP_PATH_P2P ? "p2p" : "lsa")) continue;
        w.path = (mst_ep_path_kind)p;
        for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
            if (only && strcmp(only, CASES[i].name)) continue;
            if (CASES[i].experts % w.world) continue;
            ok &= run_case(&w, &CASES[i], &res[n]);
            n++;
        }
    }
    char device[128];
    struct cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    snprintf(device, sizeof device, "%d x %.100s", w.world, p.name);
    printf("== bench ep: %s, NCCL %d.%d.%d, pair_rows = %.2f N k / W, iters %d\n", device, NCCL_MAJOR,
           NCCL_MINOR, NCCL_PATCH, w.capacity, w.iters);
    printf("p2p: ncclSend/ncclRecv of the whole C-row blocks; lsa: NCCL device API, the valid rows stored into peers\n");
    printf("GB/s per GPU = N k H 2 bytes of this rank's token copies / time (rank 0); a2a: NCCL send/recv with host sizes\n");
    printf("dispatch: into the caller's rows (exchange + unpack); window rows: into mst_ep_window_rows (lsa: direct, "
           "no unpack; p2p: unpacked there)\n");
    for (int i = 0; i < n; i++)
        if (res[i].ok) print_result(&w, &res[i]);
    layer_result layer[8];
    int n_layer = 0;
    for (int world = 1; world <= w.world && part != 1 && n_layer < 8; world *= 2) {
        if (LAYER.experts % world) break;
        ok &= layer_case_run(world, w.iters, w.capacity, &layer[n_layer]);
        n_layer++;
    }
    if (n_layer)
        printf("layer: %lld tokens per rank, H %lld, F %lld, top-%d of %d experts (E / W per rank), bf16, eager; "
               "efficiency = step(W=1) / step(W)\n", (long long)LAYER.tokens, (long long)LAYER.hidden,
               (long long)LAYER.ffn, LAYER.top_k, LAYER.experts);
    for (int i = 0; i < n_layer; i++)
        if (layer[i].ok) print_layer(&layer[i], layer[0].ok ? &layer[0] : NULL);
    if (json) {
        FILE* f = mst_out_open("moestash bench ep", json);
        if (!f) return 1;
        write_json(f, device, &w, res, n, layer, n_layer);
        if (mst_out_close("moestash bench ep", json, f)) return 1;
    }
    return ok ? 0 : 1;
}

#else /* no CUDA or no NCCL */

int mst_bench_ep(int argc, char** argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moestash bench ep: needs the CUDA backend and NCCL (built without them)\n");
    return 2;
}

#endif
