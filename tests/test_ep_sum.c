/*
 * test_ep_sum.c — the float sums of the data-parallel collectives
 * (mst_ep_allreduce, mst_ep_reduce_scatter and its window of
 * MST_EP_SUM_F32 / F64) give
 * exactly the bits of a sum in rank order in the element type (rank 0's
 * value + rank 1's + ..., written here apart from the library), on every
 * transport: `--backend cpu` the CPU twin (ranks as threads), `--backend
 * cuda` NCCL, one GPU per rank (2 ranks, and 3 and 4 where there are as
 * many GPUs: with 2 ranks every order gives the same bits, so the order is
 * seen from 3 on; exits MST_TEST_SKIP below 2 GPUs). CTest runs the CUDA
 * case a second time with NCCL on its network transport (NCCL_P2P_DISABLE,
 * NCCL_SHM_DISABLE: test_ep_sum_net_cuda): the same bits.
 *
 * Inputs are fresh random values over 24 binades (orders of addition give
 * other bits), buffers guarded. Each rank runs, in order: sums of a few
 * sizes (1 element, fewer than W, tails of every kind) and reduce-scatter
 * windows (parts of two or three blocks, one element, all, none) with a
 * staging cap of 2 KiB (many buckets; a bucket whose last slices are
 * empty), and windows refused (out of range, an int32 sum's part); then
 * (CUDA: captured in one graph, staging still 2 KiB though the cap is
 * lifted: the capture works in the buckets it has) a large all-reduce,
 * reduce-scatter and window, replayed on fresh inputs twice; then large sums eagerly
 * (the staging grows); then the graph once more (it still reads the stage
 * it was captured with). On the CPU the graph's calls run eagerly.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lib/internal.h"
#include "harness.h"

enum { AR = 0, RS, WINDOW };
typedef struct sum_case {
    int op;              /* AR: all-reduce of [count]; RS: reduce-scatter of
                            [W, count]; WINDOW: its window [lo, hi) (hi past
                            W count: W count)                                */
    mst_ep_reduce kind;  /* MST_EP_SUM_F32 or MST_EP_SUM_F64 */
    int64_t count;
    size_t cap;          /* ep->sum_stage_cap (0: the default)               */
    int64_t lo, hi;      /* WINDOW                                           */
} sum_case;

enum { SMALL_CAP = 2048, MAX_W = 4 };

/* Phase A: small sums, many buckets. */
static const sum_case SMALL[] = {
    {AR, MST_EP_SUM_F32, 1, SMALL_CAP, 0, 0},    {AR, MST_EP_SUM_F32, 3, SMALL_CAP, 0, 0},    {AR, MST_EP_SUM_F32, 1000, SMALL_CAP, 0, 0},
    {AR, MST_EP_SUM_F32, 4099, SMALL_CAP, 0, 0}, {AR, MST_EP_SUM_F64, 777, SMALL_CAP, 0, 0},  {RS, MST_EP_SUM_F32, 1, SMALL_CAP, 0, 0},
    {RS, MST_EP_SUM_F32, 65, SMALL_CAP, 0, 0},   {RS, MST_EP_SUM_F32, 1000, SMALL_CAP, 0, 0}, {RS, MST_EP_SUM_F64, 333, SMALL_CAP, 0, 0},
    /* windows: two blocks' ends, one element, all (f64), three blocks, none */
    {WINDOW, MST_EP_SUM_F32, 1000, SMALL_CAP, 123, 1877}, {WINDOW, MST_EP_SUM_F32, 1000, SMALL_CAP, 1500, 1501},
    {WINDOW, MST_EP_SUM_F64, 333, SMALL_CAP, 0, 1 << 20},  {WINDOW, MST_EP_SUM_F32, 1000, SMALL_CAP, 700, 2900},
    {WINDOW, MST_EP_SUM_F32, 100, SMALL_CAP, 50, 50},
};
/* Phase B and D: the graph's calls (cap lifted: the staging stays). */
static const sum_case GRAPH[] = {{AR, MST_EP_SUM_F32, 50001, 0, 0, 0}, {RS, MST_EP_SUM_F64, 20003, 0, 0, 0},
                                 {WINDOW, MST_EP_SUM_F32, 20003, 0, 5001, 37003}};
enum { N_GRAPH = sizeof GRAPH / sizeof GRAPH[0] };
/* Phase C: large sums eagerly (the staging grows). */
static const sum_case LARGE[] = {{AR, MST_EP_SUM_F32, 100003, 0, 0, 0}, {RS, MST_EP_SUM_F32, 30001, 0, 0, 0}};

typedef struct sum_rank {
    mst_backend_kind kind;
    int rank, W;
    mst_ep_group_t* group;
    mst_ep_id* id;
    mst_ctx_t* ctx;
    mst_ep_t* ep;
    int n_bad;           /* cases whose bits or guards were wrong */
    char bad[256];       /* the first                             */
    mst_status st;       /* the first failing call                */
    char err[256];
} sum_rank;

static size_t es_of(const sum_case* c) { return c->kind == MST_EP_SUM_F64 ? 8 : 4; }
static int64_t elems(const sum_case* c, int W) { return c->op != AR ? (int64_t)W * c->count : c->count; }
static int64_t win_hi(const sum_case* c, int W) { return c->hi < (int64_t)W * c->count ? c->hi : (int64_t)W * c->count; }

/* The elements rank r must hold after the call: [*at, *at + *n). */
static void owned(const sum_case* c, int W, int r, int64_t* at, int64_t* n) {
    int64_t a = 0, e = c->count;
    if (c->op != AR) a = (int64_t)r * c->count, e = a + c->count;
    if (c->op == WINDOW) {
        a = a > c->lo ? a : c->lo;
        e = e < win_hi(c, W) ? e : win_hi(c, W);
    }
    *at = a, *n = e > a ? e - a : 0;
}

/* Rank r's inputs of a case in a round: normal values times 2^[-12, 12]. */
static void inputs(const sum_case* c, int W, int r, uint64_t tag, void* out) {
    mst_rng rng = {0x5EEDull ^ (tag * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)(r + 1) << 40)};
    const int64_t n = elems(c, W);
    for (int64_t i = 0; i < n; i++) {
        const double v = ldexp(mst_rng_normal(&rng), (int)mst_rng_int(&rng, -12, 12));
        if (es_of(c) == 8) ((double*)out)[i] = v;
        else ((float*)out)[i] = (float)v;
    }
}

/* The sums in rank order, element by element, in the element type: want
 * [elems] from every rank's inputs. */
static void reference(const sum_case* c, int W, uint64_t tag, void* want) {
    const int64_t n = elems(c, W);
    void* x = malloc((size_t)n * es_of(c) + 1);
    for (int r = 0; r < W; r++) {
        inputs(c, W, r, tag, r == 0 ? want : x);
        for (int64_t i = 0; r > 0 && i < n; i++) {
            if (es_of(c) == 8) ((double*)want)[i] = ((double*)want)[i] + ((const double*)x)[i];
            else ((float*)want)[i] = ((float*)want)[i] + ((const float*)x)[i];
        }
    }
    free(x);
}

/* The bits this rank must hold after the call: the whole array (all-reduce)
 * or its block (reduce-scatter). */
static void verify(sum_rank* a, const sum_case* c, uint64_t tag, const void* got, int guards_ok) {
    const size_t es = es_of(c), n = (size_t)elems(c, a->W) * es;
    char* want = (char*)malloc(n + 1);
    reference(c, a->W, tag, want);
    int64_t first, count;
    owned(c, a->W, a->rank, &first, &count);
    const size_t at = (size_t)first * es, len = (size_t)count * es;
    const int64_t d = mst_first_diff((const char*)got + at, want + at, len);
    if ((d >= 0 || !guards_ok) && a->n_bad++ == 0)
        snprintf(a->bad, sizeof a->bad, "%s %s count %lld (tag %llu): %s at element %lld",
                 c->op == WINDOW ? "reduce_scatter_window" : c->op == RS ? "reduce_scatter" : "allreduce",
                 es == 8 ? "f64" : "f32", (long long)c->count,
                 (unsigned long long)tag, d >= 0 ? "bits differ" : "a guard was overwritten", (long long)(d / (int64_t)es));
    free(want);
}

static mst_status call(sum_rank* a, const sum_case* c, void* data) {
    a->ep->sum_stage_cap = c->cap;
    if (c->op == WINDOW) return mst_ep_reduce_scatter_window(a->ep, data, c->count, c->lo, win_hi(c, a->W), c->kind);
    return c->op == RS ? mst_ep_reduce_scatter(a->ep, data, c->count, c->kind) : mst_ep_allreduce(a->ep, data, c->count, c->kind);
}

/* Uploads case c's inputs of round `tag` into g (host: a scratch of its size). */
static void put(sum_rank* a, const sum_case* c, uint64_t tag, mst_guarded* g, void* host) {
    inputs(c, a->W, a->rank, tag, host);
    mst_guarded_put(a->ctx, g, host);
}

static void run_eager(sum_rank* a, const sum_case* cs, int n, uint64_t tag) {
    for (int i = 0; i < n && a->st == MST_OK; i++) {
        const sum_case* c = &cs[i];
        const size_t bytes = (size_t)elems(c, a->W) * es_of(c);
        void* host = malloc(bytes);
        mst_guarded g = mst_guarded_alloc(a->ctx, bytes);
        put(a, c, tag + (uint64_t)i, &g, host);
        a->st = call(a, c, g.data);
        if (a->st == MST_OK) {
            mst_guarded_get(a->ctx, &g, host);
            verify(a, c, tag + (uint64_t)i, host, mst_guarded_intact(a->ctx, &g));
        }
        mst_guarded_free(a->ctx, &g);
        free(host);
    }
}

/* GRAPH's calls on buffers g [N_GRAPH]: captured once (CUDA) into *graph, or eagerly. */
static mst_status graph_calls(sum_rank* a, mst_guarded* g, void** graph) {
    const mst_backend* be = a->ctx->be;
    if (!be->capture_begin) {
        for (int i = 0; i < N_GRAPH; i++) MST_TRY(call(a, &GRAPH[i], g[i].data));
        return MST_OK;
    }
    if (!*graph) {
        MST_TRY(be->capture_begin(a->ctx));
        mst_status st = MST_OK;
        for (int i = 0; i < N_GRAPH && st == MST_OK; i++) st = call(a, &GRAPH[i], g[i].data);
        mst_status end = be->capture_end(a->ctx, graph);
        MST_TRY(st);
        MST_TRY(end);
    }
    return be->graph_launch(a->ctx, *graph);
}

/* One round of the graph: fresh inputs, the calls, the bits. */
static void graph_round(sum_rank* a, mst_guarded* g, void** host, void** graph, uint64_t tag) {
    for (int i = 0; i < N_GRAPH; i++) put(a, &GRAPH[i], tag + (uint64_t)i, &g[i], host[i]);
    if (a->st == MST_OK) a->st = graph_calls(a, g, graph);
    for (int i = 0; i < N_GRAPH && a->st == MST_OK; i++) {
        mst_guarded_get(a->ctx, &g[i], host[i]);
        verify(a, &GRAPH[i], tag + (uint64_t)i, host[i], mst_guarded_intact(a->ctx, &g[i]));
    }
}

/* Windows refused before any transfer (every rank alike, no collective):
 * outside [0, W q], lo past hi, a part of an int32 sum. */
static void bad_windows(sum_rank* a) {
    static const struct { int64_t lo, hi; mst_ep_reduce kind; mst_status want; } bad[] = {
        {-1, 4, MST_EP_SUM_F32, MST_ERR_INVALID}, {5, 4, MST_EP_SUM_F32, MST_ERR_INVALID},
        {0, 1 << 20, MST_EP_SUM_F32, MST_ERR_INVALID}, {1, 4, MST_EP_SUM_I32, MST_ERR_UNSUPPORTED}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const mst_status st = mst_ep_reduce_scatter_window(a->ep, a, 8, bad[i].lo, bad[i].hi, bad[i].kind);
        if (st != bad[i].want && a->n_bad++ == 0)
            snprintf(a->bad, sizeof a->bad, "window [%lld, %lld) kind %d: %s, want %s", (long long)bad[i].lo,
                     (long long)bad[i].hi, (int)bad[i].kind, mst_status_str(st), mst_status_str(bad[i].want));
    }
}

static void* rank_main(void* p) {
    sum_rank* a = (sum_rank*)p;
    a->st = mst_ctx_create(a->kind, a->kind == MST_BACKEND_CPU ? 0 : a->rank, &a->ctx);
    if (a->st == MST_OK)
        a->st = a->kind == MST_BACKEND_CPU ? mst_ep_create_local(a->ctx, NULL, a->group, a->rank, &a->ep)
                                           : mst_ep_create(a->ctx, NULL, a->id, a->rank, a->W, &a->ep);
    if (a->st == MST_OK) run_eager(a, SMALL, (int)(sizeof SMALL / sizeof SMALL[0]), 100);
    if (a->st == MST_OK) bad_windows(a);
    mst_guarded g[N_GRAPH] = {{0}};
    void* host[N_GRAPH] = {NULL};
    void* graph = NULL;
    for (int i = 0; i < N_GRAPH && a->st == MST_OK; i++) {
        const size_t bytes = (size_t)elems(&GRAPH[i], a->W) * es_of(&GRAPH[i]);
        g[i] = mst_guarded_alloc(a->ctx, bytes);
        host[i] = malloc(bytes);
    }
    if (a->st == MST_OK) graph_round(a, g, host, &graph, 200);
    if (a->st == MST_OK) graph_round(a, g, host, &graph, 300);
    if (a->st == MST_OK) run_eager(a, LARGE, (int)(sizeof LARGE / sizeof LARGE[0]), 400);
    if (a->st == MST_OK) graph_round(a, g, host, &graph, 500);
    if (a->st != MST_OK) snprintf(a->err, sizeof a->err, "%s", mst_last_error());
    if (graph) a->ctx->be->graph_destroy(a->ctx, graph);
    for (int i = 0; i < N_GRAPH; i++) {
        if (g[i].base) mst_guarded_free(a->ctx, &g[i]);
        free(host[i]);
    }
    mst_ep_destroy(a->ep);
    mst_ctx_destroy(a->ctx);
    return NULL;
}

static void run_world(mst_backend_kind kind, int W) {
    sum_rank a[MAX_W];
    mst_ep_group_t* group = NULL;
    mst_ep_id id;
    if (kind == MST_BACKEND_CPU) CHECK_OK(mst_ep_group_create(W, &group));
    else CHECK_OK(mst_ep_id_create(&id));
    pthread_t th[MAX_W];
    for (int r = 0; r < W; r++) {
        a[r] = (sum_rank){.kind = kind, .rank = r, .W = W, .group = group, .id = &id};
        pthread_create(&th[r], NULL, rank_main, &a[r]);
    }
    for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < W; r++) {
        CHECK(a[r].st == MST_OK, "W %d rank %d: %s", W, r, a[r].err);
        CHECK(a[r].n_bad == 0, "W %d rank %d: %d cases wrong, the first %s", W, r, a[r].n_bad, a[r].bad);
    }
    printf("  %-28s W %d: %d sums per rank, bits of the rank order\n", "float sums", W,
           (int)(sizeof SMALL / sizeof SMALL[0] + sizeof LARGE / sizeof LARGE[0]) + 3 * N_GRAPH);
    mst_ep_group_destroy(group);
}

/* The reference itself: the rank-order sum lies within (W - 1) u sum |x| of
 * the exact one (fp64 here holds 4 floats' sum closely enough). */
static void check_reference(void) {
    const sum_case c = {AR, MST_EP_SUM_F32, 2000, 0, 0, 0};
    static float want[2000], x[4][2000];
    reference(&c, 4, 7, want);
    for (int r = 0; r < 4; r++) inputs(&c, 4, r, 7, x[r]);
    double worst = 0;
    for (int64_t i = 0; i < c.count; i++) {
        double exact = 0, sabs = 0;
        for (int r = 0; r < 4; r++) exact += x[r][i], sabs += fabs(x[r][i]);
        const double rel = fabs(want[i] - exact) / sabs;
        worst = rel > worst ? rel : worst;
    }
    CHECK(worst <= 3 * 0x1p-24 * 1.01, "the test's reference: error %g of sum |x|", worst);
}

int main(int argc, char** argv) {
    const mst_backend_kind kind = mst_test_backend_arg(argc, argv);
    const int n_dev = mst_test_devices(kind, MAX_W);
    if (kind == MST_BACKEND_CUDA && n_dev < 2) return mst_test_skip_devices(argv[0], n_dev, "the sums need 2");
    check_reference();
    for (int W = 2; W <= MAX_W && W <= n_dev; W++) run_world(kind, W);
    printf("%s: %d passed, %d failed\n", argv[0], mst_test_checks - mst_test_failures, mst_test_failures);
    return mst_test_failures ? 1 : 0;
}
