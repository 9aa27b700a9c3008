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
 * power of two). GB/s per GPU = N k H 2 bytes (this rank's token copies) /
 * time, for dispatch, combine, one captured CUDA graph of both (per op), and
 * the NCCL all-to-all of the same rows. Rank 0's figures; ratio to NCCL.
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
    double dispatch_ms, combine_ms;   /* eager, per call                   */
    double graph_ms;                  /* replay of dispatch + combine      */
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
    mst_ep_config cfg = {.n_experts = c->experts, .top_k = c->top_k, .hidden = H, .max_tokens = N,
                         .max_rows = w->max_rows, .pair_rows = w->pair_cap, .path = w->path};
    TRY(mst_ep_create_nccl(st->ctx, &cfg, st->comm, &st->ep));
    TRY(mst_ep_handle_create(st->ep, &st->h));
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

static mst_status dispatch(rank_state* st) {
    const ep_case* c = st->w->c;
    mst_tensor x = mst_tensor_make(st->x, MST_DTYPE_BF16, c->tokens, c->hidden);
    mst_tensor idx = mst_tensor_make(st->idx, MST_DTYPE_INT32, c->tokens, c->top_k);
    mst_tensor rows = mst_tensor_make(st->rows, MST_DTYPE_BF16, st->w->max_rows, c->hidden);
    mst_tensor counts = mst_tensor_make(st->counts, MST_DTYPE_INT32, c->experts / st->w->world, 1);
    return mst_ep_dispatch(st->ep, st->h, &x, &idx, NULL, &rows, NULL, &counts);
}

static mst_status combine(rank_state* st) {
    const ep_case* c = st->w->c;
    mst_tensor rows = mst_tensor_make(st->rows, MST_DTYPE_BF16, st->w->max_rows, c->hidden);
    mst_tensor y = mst_tensor_make(st->y, MST_DTYPE_BF16, c->tokens, c->hidden);
    return mst_ep_combine(st->ep, st->h, &rows, NULL, &y);
}

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

static mst_status validate(rank_state* st) {
    const ep_case* c = st->w->c;
    const int64_t n = c->tokens * c->hidden;
    TRY(dispatch(st));
    TRY(combine(st));
    TRY(mst_ctx_check(st->ctx));
    uint16_t* y = malloc((size_t)n * 2);
    TRY(mst_copy_b2h(st->ctx, y, st->y, (size_t)n * 2));
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (y[i] != mst_fp32_to_bf16((float)c->top_k * mst_bf16_to_fp32(st->hx[i]))) bad = i;
    free(y);
    if (bad >= 0) FAIL(MST_ERR_STATE, "validation: combine of the dispatched rows differs at element %lld", (long long)bad);
    return MST_OK;
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

static mst_status capture(rank_state* st, cudaGraphExec_t* exec) {
    cudaGraph_t g;
    if (cudaStreamBeginCapture(st->s, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        FAIL(MST_ERR_BACKEND, "cudaStreamBeginCapture failed");
    mst_status rc = dispatch(st);
    if (rc == MST_OK) rc = combine(st);
    const cudaError_t end = cudaStreamEndCapture(st->s, &g);
    TRY(rc);
    if (end != cudaSuccess) FAIL(MST_ERR_BACKEND, "cudaStreamEndCapture failed: %s", cudaGetErrorString(end));
    cudaError_t e = cudaGraphInstantiate(exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) FAIL(MST_ERR_BACKEND, "cudaGraphInstantiate failed: %s", cudaGetErrorString(e));
    return MST_OK;
}

static mst_status run_rank(rank_state* st, ep_result* r) {
    TRY(setup(st));
    pthread_barrier_wait(&st->w->bar); /* pair_rows complete */
    TRY(validate(st));
    TRY(time_phase(st, dispatch, NULL, &r->dispatch_ms));
    TRY(time_phase(st, combine, NULL, &r->combine_ms));
    cudaGraphExec_t exec;
    TRY(capture(st, &exec));
    mst_status rc = time_phase(st, NULL, exec, &r->graph_ms);
    cudaGraphExecDestroy(exec);
    TRY(rc);
    TRY(mst_ctx_check(st->ctx));
    TRY(validate(st)); /* still right after the replays */
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

static void print_result(const bench_world* w, const ep_result* r) {
    const double gb = r->bytes / 1e9;
    printf("%-4s %-3s N %5lld H %5lld E %3d k %d  dispatch %7.1f GB/s  combine %7.1f GB/s  graph (per op) %7.1f GB/s"
           "  nccl a2a %7.1f GB/s  dispatch/a2a %.2f  combine/a2a %.2f\n",
           r->c->name, strstr(r->path, "device") ? "lsa" : "p2p", (long long)r->c->tokens, (long long)r->c->hidden,
           r->c->experts, r->c->top_k,
           gb / (r->dispatch_ms / 1e3), gb / (r->combine_ms / 1e3), gb / (r->graph_ms / 2e3), gb / (r->a2a_ms / 1e3),
           r->a2a_ms / r->dispatch_ms, r->a2a_ms / r->combine_ms);
    (void)w;
}

static void write_json(FILE* f, const char* device, const bench_world* w, const ep_result* res, int n) {
    fprintf(f, "{\n  \"bench\": \"ep\",\n  \"device\": \"%s\",\n  \"world\": %d,\n"
               "  \"nccl\": \"%d.%d.%d\",\n  \"capacity\": %.3f,\n  \"iters\": %d,\n  \"cases\": [\n",
            device, w->world, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, w->capacity, w->iters);
    for (int i = 0; i < n; i++) {
        const ep_result* r = &res[i];
        const double gb = r->bytes / 1e9;
        fprintf(f, "    {\"case\": \"%s\", \"path\": \"%s\", \"tokens\": %lld, \"hidden\": %lld, \"experts\": %d, \"top_k\": %d, "
                   "\"ok\": %s, \"dispatch_ms\": %.4f, \"combine_ms\": %.4f, \"graph_ms\": %.4f, \"a2a_ms\": %.4f, "
                   "\"dispatch_gbs\": %.2f, \"combine_gbs\": %.2f, \"a2a_gbs\": %.2f, "
                   "\"dispatch_over_a2a\": %.3f, \"combine_over_a2a\": %.3f}%s\n",
                r->c->name, r->path, (long long)r->c->tokens, (long long)r->c->hidden, r->c->experts, r->c->top_k,
                r->ok ? "true" : "false", r->dispatch_ms, r->combine_ms, r->graph_ms, r->a2a_ms,
                gb / (r->dispatch_ms / 1e3), gb / (r->combine_ms / 1e3), gb / (r->a2a_ms / 1e3),
                r->a2a_ms / r->dispatch_ms, r->a2a_ms / r->combine_ms, i + 1 < n ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
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
    const char *json = NULL, *only = NULL, *path = NULL;
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
        } else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench ep [--gpus N] [--iters N] [--capacity F] [--case a|b] [--path p2p|lsa] "
                   "[--json FILE]\n");
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
    for (int p = MST_EP_PATH_P2P; p <= MST_EP_PATH_LSA; p++) {
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
    for (int i = 0; i < n; i++)
        if (res[i].ok) print_result(&w, &res[i]);
    if (json) {
        FILE* f = mst_out_open("moestash bench ep", json);
        if (!f) return 1;
        write_json(f, device, &w, res, n);
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
