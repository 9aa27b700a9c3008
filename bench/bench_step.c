/*
 * bench_step.c — `moestash bench step [--json FILE] [--small] [--only LABEL]`: one training
 * step of a stack of grouped-MLP layers (8 layers, rows 32768, hidden 4096,
 * ffn 1024, E 16, max_rows = 1.5 x rows, skewed counts) over 4 microbatches
 * with the 1F1B schedule of a 4-stage pipeline's first rank, one CUDA graph
 * per step, under each memory policy. Beside it, in the same run: the same
 * work with exact shapes (host-known counts, exact-size saved tensors, no
 * graph: the manager's measuring step) and the pinned host copy roof.
 *
 * Order: every policy's step is checked bit-identical to KEEP's (a hash of
 * all main_grads and dprobs) before any figure is printed; the fp8-page
 * cases (stash:fp8, offload:fp8: not copies) instead give the same hash on
 * two replays and another than KEEP's (their error: tests/test_fp8.c,
 * docs/performance.md). Their targets: device pages <= 0.55x and step <=
 * 1.02x bf16 STASH's, OFFLOAD fp8 >= 1.8x faster than OFFLOAD. Activation memory
 * = saved activations + compute buffers (kept buffers, page blocks
 * allocated, shared compute / restore buffers); weights, gradients and the
 * stack's own input/output buffers are reported apart. A short table last.
 * Timing: KEEP's step stays captured; every other case is replayed in turn
 * with it (7 rounds on CUDA), and its ratio is taken to the KEEP replays
 * beside it, so that clocks and temperature drift out of the ratio.
 * --only LABEL runs KEEP and the case of that label only (e.g. "offload").
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"
#include "mlp_stack.h"

#ifdef MST_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

typedef struct step_shape {
    int32_t layers, micro, E, stages;
    int64_t rows, hidden, ffn;
} step_shape;

static const step_shape full = {8, 4, 16, 4, 32768, 4096, 1024};
static const step_shape small = {4, 4, 4, 4, 512, 64, 32};

/* One measured configuration: a policy spec and the pool sizing factors. */
typedef struct step_case {
    const char* label;     /* short name for the table                     */
    const char* policy;    /* mst_memmgr_set_policy_spec                   */
    double dev_factor;     /* device pages over the measured peak           */
    double host_factor;    /* pinned host pages (spill) over the peak       */
    int fp8;               /* fp8 pages: deterministic, not bit-identical   */
} step_case;

enum { CASE_KEEP = 0, CASE_STASH, CASE_STASH_SPILL, CASE_OFFLOAD, CASE_STASH_FP8 = 6, CASE_OFFLOAD_FP8, N_CASES };
static const step_case cases[N_CASES] = {
    {"keep", "keep", MST_POOL_DEV_FACTOR, 0, 0},
    {"stash", "stash", MST_POOL_DEV_FACTOR, 0, 0},
    {"stash 1.0+h", "stash", 1.0, 0.10, 0},
    {"offload", "offload", MST_POOL_DEV_FACTOR, 0, 0},
    {"recompute", "recompute", MST_POOL_DEV_FACTOR, 0, 0},
    {"mix", "fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash", MST_POOL_DEV_FACTOR, 0, 0},
    {"stash fp8", "stash:fp8", MST_POOL_DEV_FACTOR, 0, 1},
    {"offload fp8", "offload:fp8", MST_POOL_DEV_FACTOR, 0, 1},
};

typedef struct step_result {
    const step_case* c;
    double step_ms;        /* graph replay (CUDA) or eager step (CPU), median */
    double keep_ms;        /* KEEP's median, replayed in turn with this case */
    double exact_ms;       /* measuring step: exact shapes, eager, no graph   */
    size_t act_bytes;      /* saved activations + compute buffers             */
    size_t pages_peak;     /* device + host pages in use at peak               */
    mst_mem_report_t rep;
    uint64_t hash;         /* of main_grads and dprobs                         */
    uint64_t hash2;        /* the same after one more replay (fp8 cases)      */
} step_result;

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

/* Skewed (Zipf-like, shuffled) counts of `total` rows over E experts. */
static void skewed_counts(int32_t* c, int32_t E, int64_t total, uint64_t* seed) {
    double w[1024], sum = 0;
    for (int32_t g = 0; g < E; g++) sum += (w[g] = 1.0 / pow(g + 1.0, 1.1));
    int64_t given = 0;
    for (int32_t g = 0; g < E; g++) given += (c[g] = (int32_t)(total * w[g] / sum));
    c[0] += (int32_t)(total - given);
    for (int32_t g = E - 1; g > 0; g--) {
        int32_t j = (int32_t)(mst_splitmix64(seed) % (uint64_t)(g + 1)), t = c[g];
        c[g] = c[j], c[j] = t;
    }
}

/* FNV-style hash of backend memory, downloaded in 64 MiB pieces. */
static mst_status hash_buffer(mst_ctx_t* ctx, const void* p, size_t n_bytes, uint64_t* h) {
    enum { PIECE = 64 << 20 };
    uint64_t* buf = (uint64_t*)malloc(PIECE);
    if (!buf) return mst_set_error(MST_ERR_OOM, "hash staging");
    mst_status st = MST_OK;
    for (size_t off = 0; off < n_bytes && st == MST_OK; off += PIECE) {
        size_t len = n_bytes - off < PIECE ? n_bytes - off : PIECE;
        st = mst_copy_b2h(ctx, buf, (const char*)p + off, len);
        for (size_t i = 0; i < len / 8; i++) *h = (*h ^ buf[i]) * 0x100000001b3ull;
    }
    free(buf);
    return st;
}

/* A case ready to replay: its manager and, on CUDA, its step captured in
 * one graph (a cudaGraphExec_t). */
typedef struct step_run {
    mst_memmgr_t* mm;
    void* exec;
} step_run;

/* Size the manager of case c (its measuring step, timed into r->exact_ms)
 * and capture one sized step. */
static mst_status prepare_case(mst_ctx_t* ctx, mst_stack* s, const mst_sched_entry* sch, int32_t n,
                               const step_shape* sh, const step_case* c, step_result* r, step_run* run) {
    memset(r, 0, sizeof *r);
    memset(run, 0, sizeof *run);
    r->c = c;
    mst_memmgr_config mc = {sizeof(mst_memmgr_config), sh->layers, sh->micro, 1, s->max_rows, sh->hidden, sh->ffn, sch, n, 64,
                            c->dev_factor, c->host_factor, NULL, NULL};
    MST_TRY(mst_memmgr_create(ctx, &mc, &run->mm));
    s->mm = run->mm;
    MST_TRY(mst_memmgr_set_policy_spec(s->mm, c->policy));
    double t0 = 1e3 * mst_clock_s();
    MST_TRY(mst_stack_step(s, sch, n, 1));
    MST_TRY(mst_ctx_sync(ctx));
    r->exact_ms = 1e3 * mst_clock_s() - t0;
    MST_TRY(mst_memmgr_step_check(s->mm));
#ifdef MST_HAVE_CUDA
    if (mst_ctx_backend(ctx) == MST_BACKEND_CUDA) {
        cudaStream_t st = (cudaStream_t)mst_ctx_stream(ctx);
        cudaGraph_t g = NULL;
        cudaGraphExec_t ge;
        if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
            return mst_set_error(MST_ERR_BACKEND, "begin capture");
        mst_status rs = mst_stack_step(s, sch, n, 0);
        cudaError_t e = cudaStreamEndCapture(st, &g);
        if (rs == MST_OK && e == cudaSuccess) e = cudaGraphInstantiate(&ge, g, 0);
        if (g) cudaGraphDestroy(g);
        if (rs != MST_OK) return rs;
        if (e != cudaSuccess) return mst_set_error(MST_ERR_BACKEND, "graph of a step: %s", cudaGetErrorString(e));
        run->exec = ge;
    }
#endif
    return MST_OK;
}

/* One sized step of run: a graph replay on CUDA, an eager step on the CPU;
 * *ms its time. */
static mst_status replay(mst_ctx_t* ctx, mst_stack* s, const mst_sched_entry* sch, int32_t n,
                         const step_run* run, double* ms) {
#ifdef MST_HAVE_CUDA
    if (run->exec) {
        cudaStream_t st = (cudaStream_t)mst_ctx_stream(ctx);
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0, st);
        cudaGraphLaunch((cudaGraphExec_t)run->exec, st);
        cudaEventRecord(e1, st);
        cudaError_t e = cudaEventSynchronize(e1);
        float f = 0;
        if (e == cudaSuccess) cudaEventElapsedTime(&f, e0, e1);
        cudaEventDestroy(e0), cudaEventDestroy(e1);
        if (e != cudaSuccess) return mst_set_error(MST_ERR_BACKEND, "step replay: %s", cudaGetErrorString(e));
        *ms = f;
        return MST_OK;
    }
#endif
    s->mm = run->mm;
    double t0 = 1e3 * mst_clock_s();
    MST_TRY(mst_stack_step(s, sch, n, 0));
    MST_TRY(mst_ctx_sync(ctx));
    *ms = 1e3 * mst_clock_s() - t0;
    return MST_OK;
}

/* One more step of run, then the hash of what it left: main_grads, dprobs. */
static mst_status hash_step(mst_ctx_t* ctx, mst_stack* s, const mst_sched_entry* sch, int32_t n,
                            const step_shape* sh, const step_run* run, uint64_t* h) {
    double ms;
    MST_TRY(replay(ctx, s, sch, n, run, &ms));
    *h = 0xcbf29ce484222325ull;
    MST_TRY(hash_buffer(ctx, s->gbuf, s->gbuf_bytes, h));
    for (int32_t i = 0; i < sh->layers * sh->micro; i++) /* rows past n stay as created */
        MST_TRY(hash_buffer(ctx, s->dprobs[i].data, (size_t)sh->rows * 4, h));
    return MST_OK;
}

/* The manager's checks after its replays (no overflow, no page leaked), its
 * memory report; then the run is freed. */
static mst_status finish_case(mst_stack* s, step_run* run, step_result* r) {
    mst_status st = mst_memmgr_step_check(run->mm);
    if (st == MST_OK) st = mst_memmgr_check(run->mm);
    r->rep = (mst_mem_report_t)MST_MEM_REPORT_INIT;
    if (st == MST_OK) st = mst_mem_report(run->mm, &r->rep);
    r->act_bytes = r->rep.kept_bytes + r->rep.compute_bytes + r->rep.dev_pages_bytes;
    r->pages_peak = r->rep.dev_pages_peak_bytes + r->rep.host_pages_peak_bytes;
#ifdef MST_HAVE_CUDA
    if (run->exec) cudaGraphExecDestroy((cudaGraphExec_t)run->exec);
#endif
    mst_memmgr_destroy(run->mm);
    memset(run, 0, sizeof *run);
    s->mm = NULL;
    return st;
}

/* Steps of case c timed against KEEP's: KEEP and c replayed in turn,
 * `rounds` times after one warm-up each, so that both see the same clocks
 * and temperature. r->step_ms and r->keep_ms are the medians; KEEP's times
 * are also added to keep_t[*n_keep]. */
static mst_status time_pair(mst_ctx_t* ctx, mst_stack* s, const mst_sched_entry* sch, int32_t n,
                            const step_run* keep, const step_run* run, int rounds, step_result* r,
                            double* keep_t, int* n_keep) {
    double tc[16], tk[16], ms;
    MST_TRY(replay(ctx, s, sch, n, keep, &ms));
    MST_TRY(replay(ctx, s, sch, n, run, &ms));
    for (int i = 0; i < rounds; i++) {
        MST_TRY(replay(ctx, s, sch, n, keep, &tk[i]));
        MST_TRY(replay(ctx, s, sch, n, run, &tc[i]));
        keep_t[(*n_keep)++] = tk[i];
    }
    qsort(tk, (size_t)rounds, sizeof tk[0], cmp_double);
    qsort(tc, (size_t)rounds, sizeof tc[0], cmp_double);
    r->keep_ms = tk[rounds / 2];
    r->step_ms = tc[rounds / 2];
    return MST_OK;
}

/* Pinned host <-> device copy roof, GB/s of one direction each. */
static void pinned_roof(mst_ctx_t* ctx, double* d2h, double* h2d) {
    *d2h = *h2d = 0;
#ifdef MST_HAVE_CUDA
    if (mst_ctx_backend(ctx) != MST_BACKEND_CUDA) return;
    size_t n = (size_t)1 << 30;
    void *h = NULL, *d = NULL;
    if (cudaMallocHost(&h, n) != cudaSuccess || cudaMalloc(&d, n) != cudaSuccess) return;
    cudaStream_t st = (cudaStream_t)mst_ctx_stream(ctx);
    for (int dir = 0; dir < 2; dir++) {
        double best = 1e30;
        for (int i = 0; i < 4; i++) {
            double t0 = 1e3 * mst_clock_s();
            if (dir) cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, st);
            else cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, st);
            cudaStreamSynchronize(st);
            double t = 1e3 * mst_clock_s() - t0;
            if (i && t < best) best = t;
        }
        *(dir ? h2d : d2h) = n / best / 1e6;
    }
    cudaFreeHost(h);
    cudaFree(d);
#else
    (void)ctx;
#endif
}

static double gib(size_t b) { return (double)b / (1 << 30); }

/* The fp8 cases against their bf16 twins: device pages and step time (each
 * as its ratio to the KEEP replays beside it). */
static void fp8_targets(const step_result* r, const int* run) {
    const step_result *s = &r[CASE_STASH], *s8 = &r[CASE_STASH_FP8], *o = &r[CASE_OFFLOAD], *o8 = &r[CASE_OFFLOAD_FP8];
    if (run[CASE_STASH] && run[CASE_STASH_FP8])
        printf("targets, stash fp8: device pages <= 0.55x stash's (%.3fx: %.3f of %.3f GiB), step <= 1.02x stash's "
               "(%.3fx)\n", (double)s8->rep.dev_pages_bytes / s->rep.dev_pages_bytes, gib(s8->rep.dev_pages_bytes),
               gib(s->rep.dev_pages_bytes), (s8->step_ms / s8->keep_ms) / (s->step_ms / s->keep_ms));
    if (run[CASE_OFFLOAD] && run[CASE_OFFLOAD_FP8])
        printf("targets, offload fp8: >= 1.8x faster than offload (%.3fx; host pages %.3f of %.3f GiB)\n",
               (o->step_ms / o->keep_ms) / (o8->step_ms / o8->keep_ms), gib(o8->rep.host_pages_bytes),
               gib(o->rep.host_pages_bytes));
}

/* 0, or 1 after a line when the file could not be written. */
static int write_json(const char* path, const step_shape* sh, const step_result* r, int n,
                      double d2h, double h2d, const char* device) {
    FILE* f = mst_out_open("moestash bench step", path);
    if (!f) return 1;
    fprintf(f, "{\"bench\": \"step\", \"device\": \"%s\", \"layers\": %d, \"microbatches\": %d, \"rows\": %lld, "
               "\"hidden\": %lld, \"ffn\": %lld, \"experts\": %d, \"schedule\": \"1f1b S=%d rank 0\", "
               "\"pinned_d2h_gbs\": %.2f, \"pinned_h2d_gbs\": %.2f, \"policies\": [",
            device, sh->layers, sh->micro, (long long)sh->rows, (long long)sh->hidden, (long long)sh->ffn, sh->E,
            sh->stages, d2h, h2d);
    for (int i = 0, k = 0; i < n; i++)
        if (r[i].c) /* a case that ran */
            fprintf(f, "%s{\"policy\": \"%s\", \"dev_factor\": %.2f, \"host_factor\": %.2f, \"step_ms\": %.3f, \"keep_ms_beside\": %.3f, \"exact_step_ms\": %.3f, \"act_bytes\": %zu, "
                   "\"kept_bytes\": %zu, \"compute_bytes\": %zu, \"dev_pages_bytes\": %zu, \"dev_pages_peak_bytes\": %zu, "
                   "\"host_pages_bytes\": %zu, \"host_pages_peak_bytes\": %zu, \"exact_bytes\": %zu, "
                   "\"static_keep_bytes\": %zu, \"bit_identical_to_keep\": %s}",
                k++ ? ", " : "", r[i].c->policy, r[i].c->dev_factor, r[i].c->host_factor, r[i].step_ms, r[i].keep_ms, r[i].exact_ms, r[i].act_bytes, r[i].rep.kept_bytes,
                r[i].rep.compute_bytes, r[i].rep.dev_pages_bytes, r[i].rep.dev_pages_peak_bytes,
                r[i].rep.host_pages_bytes, r[i].rep.host_pages_peak_bytes, r[i].rep.exact_bytes,
                r[i].rep.static_keep_bytes, r[i].hash == r[0].hash ? "true" : "false");
    fprintf(f, "]}\n");
    return mst_out_close("moestash bench step", path, f);
}

int mst_bench_step(int argc, char** argv) {
    const char* json = NULL;
    const char* only = NULL; /* NULL: every case */
    mst_backend_kind kind = mst_default_backend();
    int use_small = 0;
    mst_args a;
    mst_args_init(&a, "moestash bench step", argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--backend")) rc = mst_args_backend(&a, &kind);
        else if (mst_args_is(&a, "--small")) rc = mst_args_switch(&a, &use_small);
        else if (mst_args_is(&a, "--only")) rc = mst_args_str(&a, &only);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench step [--json FILE] [--backend cpu|cuda] [--small] [--only LABEL]\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    int run[N_CASES], n_run = 0; /* cases to run: KEEP always */
    for (int i = 0; i < N_CASES; i++) n_run += run[i] = i == CASE_KEEP || !only || strcmp(only, cases[i].label) == 0;
    if (n_run == 1 && only) {
        fprintf(stderr, "moestash bench step: --only '%s': no case has that label\n", only);
        return 2;
    }
    const step_shape* sh = kind == MST_BACKEND_CUDA && !use_small ? &full : &small;
    mst_ctx_t* ctx;
    if (mst_ctx_create(kind, 0, &ctx) != MST_OK) {
        fprintf(stderr, "bench step: %s\n", mst_last_error());
        return 1;
    }
    printf("bench step on %s\n", mst_ctx_describe(ctx));
    mst_mlp_config mlp = mst_mlp_config_default(sh->E, sh->hidden, sh->ffn);
    int64_t R = sh->rows * 3 / 2;
    mst_stack s = {0};
    mst_schedule_config sc = {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, sh->stages, 0, sh->micro, 1};
    int32_t n = 2 * sh->micro;
    mst_sched_entry sch[64];
    int32_t* counts = (int32_t*)malloc(sizeof(int32_t) * (size_t)(sh->layers * sh->micro * sh->E));
    uint64_t seed = 2024;
    for (int32_t i = 0; i < sh->layers * sh->micro; i++) skewed_counts(counts + (int64_t)i * sh->E, sh->E, sh->rows, &seed);
    mst_status st = mst_schedule_make(&sc, sch, n);
    if (st == MST_OK) st = mst_stack_create(ctx, &mlp, sh->layers, sh->micro, 1, R, 7, &s);
    if (st == MST_OK) st = mst_stack_route(&s, counts, 9);
    enum { NP = N_CASES, ROUNDS_MAX = 16 };
    const int rounds = kind == MST_BACKEND_CUDA ? 7 : 3;
    step_result r[NP];
    step_run keep = {0}, cur = {0};
    double keep_t[NP * ROUNDS_MAX];
    int n_keep = 0;
    memset(r, 0, sizeof r);
    if (st == MST_OK) st = prepare_case(ctx, &s, sch, n, sh, &cases[CASE_KEEP], &r[0], &keep);
    if (st == MST_OK) st = hash_step(ctx, &s, sch, n, sh, &keep, &r[0].hash);
    for (int i = 1; i < NP && st == MST_OK; i++) {
        if (!run[i]) continue;
        st = prepare_case(ctx, &s, sch, n, sh, &cases[i], &r[i], &cur);
        if (st == MST_OK) st = time_pair(ctx, &s, sch, n, &keep, &cur, rounds, &r[i], keep_t, &n_keep);
        if (st == MST_OK) st = hash_step(ctx, &s, sch, n, sh, &cur, &r[i].hash);
        if (st == MST_OK && cases[i].fp8) st = hash_step(ctx, &s, sch, n, sh, &cur, &r[i].hash2);
        mst_status fs = cur.mm ? finish_case(&s, &cur, &r[i]) : MST_OK;
        if (st == MST_OK) st = fs;
        if (st == MST_OK)
            printf("  %-62s dev %.2f host %.2f  step %9.2f ms (keep beside it %9.2f ms: %.3fx)  exact-shape step %9.2f ms  "
                   "activations %7.3f GiB  %s\n", cases[i].policy, cases[i].dev_factor, cases[i].host_factor,
                   r[i].step_ms, r[i].keep_ms, r[i].step_ms / r[i].keep_ms, r[i].exact_ms, gib(r[i].act_bytes),
                   cases[i].fp8 ? (r[i].hash == r[i].hash2 && r[i].hash != r[0].hash ? "fp8: deterministic"
                                                                                    : "fp8: NOT DETERMINISTIC or exact")
                                : r[i].hash == r[0].hash ? "bit-identical" : "DIFFERS");
    }
    if (keep.mm) {
        mst_status fs = finish_case(&s, &keep, &r[0]);
        if (st == MST_OK) st = fs;
    }
    if (st == MST_OK) { /* KEEP: the median of all its replays */
        qsort(keep_t, (size_t)n_keep, sizeof keep_t[0], cmp_double);
        r[0].step_ms = r[0].keep_ms = keep_t[n_keep / 2];
    }
    if (st != MST_OK) {
        fprintf(stderr, "bench step: %s\n", mst_last_error());
        mst_stack_destroy(&s);
        mst_ctx_destroy(ctx);
        free(counts);
        return 1;
    }
    int same = 1;
    for (int i = 1; i < NP; i++)
        same &= !run[i] || (cases[i].fp8 ? r[i].hash == r[i].hash2 && r[i].hash != r[0].hash : r[i].hash == r[0].hash);
    double d2h, h2d;
    pinned_roof(ctx, &d2h, &h2d);
    size_t exact = r[0].rep.exact_bytes;
    printf("\nweights %.2f GiB bf16, main_grads %.2f GiB fp32 (not counted below)\n",
           gib(s.gbuf_bytes / 2), gib(s.gbuf_bytes));
    printf("exact shapes: saved activations at peak %.3f GiB; all-KEEP static: %.3f GiB\n", gib(exact),
           gib(r[0].rep.static_keep_bytes));
    if (d2h > 0) printf("pinned copy roof: D2H %.1f GB/s, H2D %.1f GB/s\n", d2h, h2d);
    printf("\n%-11s %9s %9s %12s %10s %10s %10s\n", "policy", "step ms", "vs keep", "act GiB", "vs exact",
           "vs keep", "pages pk");
    for (int i = 0; i < NP; i++)
        if (run[i]) printf("%-11.11s %9.2f %8.3fx %12.3f %9.3fx %9.3fx %10.3f\n", cases[i].label, r[i].step_ms,
               r[i].step_ms / r[i].keep_ms, gib(r[i].act_bytes), (double)r[i].act_bytes / exact,
               (double)r[i].act_bytes / r[0].act_bytes, gib(r[i].pages_peak));
    if (d2h > 0 && run[CASE_OFFLOAD]) { /* OFFLOAD moves each saved byte out and back within its step */
        const step_result* o = &r[CASE_OFFLOAD];
        double bytes = 2.0 * (double)o->rep.host_pages_peak_bytes;
        double roof_ms = bytes / 2 / d2h / 1e6 + bytes / 2 / h2d / 1e6; /* out at the D2H roof, back at H2D's */
        printf("offload: >= %.2f GB moved per step in %.2f ms: %.1f GB/s (%.0f%% of the pinned D2H roof; "
               "%.0f%% of D2H + H2D); out at the D2H roof and back at the H2D roof take %.2f ms: %.0f%%\n",
               bytes / 1e9, o->step_ms, bytes / o->step_ms / 1e6, 100 * bytes / o->step_ms / 1e6 / d2h,
               100 * bytes / o->step_ms / 1e6 / (d2h + h2d), roof_ms, 100 * roof_ms / o->step_ms);
    }
    for (int i = CASE_STASH; i <= CASE_STASH_SPILL; i++)
        if (run[i]) printf("targets, stash dev %.2f host %.2f: act <= 1.10x exact (%.3fx) and <= 0.75x keep (%.3fx); "
               "step <= 1.05x keep (%.3fx)\n", cases[i].dev_factor, cases[i].host_factor,
               (double)r[i].act_bytes / exact, (double)r[i].act_bytes / r[0].act_bytes, r[i].step_ms / r[i].keep_ms);
    fp8_targets(r, run);
    printf("all bf16 policies bit-identical to keep, fp8 deterministic: %s\n", same ? "yes" : "NO");
    const int json_failed = json && write_json(json, sh, r, NP, d2h, h2d, mst_ctx_describe(ctx));
    mst_stack_destroy(&s);
    mst_ctx_destroy(ctx);
    free(counts);
    return same && !json_failed ? 0 : 1;
}
