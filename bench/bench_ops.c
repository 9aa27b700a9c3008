/*
 * bench_ops.c — `moestash bench ops [--preset qwen3-30b-a3b|h100] [--reps N]`:
 * the trainer's memory-bound model ops (model_backend.h) alone, at the
 * shapes one microbatch of a preset gives them, each beside the device copy
 * roof for its bytes (roof.h, measured in the same run):
 *   qwen3-30b-a3b: N 2048 tokens (B 1, T 2048), H 2048, vocab 151 936,
 *     128 experts top-8;
 *   h100: N 4096 (B 2, T 2048), H 2048, vocab 256, 64 experts top-4.
 * Bytes are each op's minimum traffic: inputs read once, outputs written
 * once, an accumulated fp32 gradient read and written once (the embedding
 * backward: the table rows of the batch's distinct ids). Timed: the mean of
 * N calls between two syncs (host clock), after one warm-up call; the
 * inputs are random (token ids skewed toward low ids, as text is), the
 * router's plan never over budget. The results are checked against
 * references in test_model_ops (label gpu: test_model_ops_cuda) at these
 * shapes, not here.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"
#include "roof.h"
#include "trainer/model_ops/model_backend.h"

#ifdef MST_HAVE_CUDA
#include <cuda_runtime_api.h>

typedef struct ops_shape {
    const char* name;
    int64_t N, H, V;
    int32_t E, K;
} ops_shape;

static const ops_shape shapes[] = {
    {"qwen3-30b-a3b", 2048, 2048, 151936, 128, 8},
    {"h100", 4096, 2048, 256, 64, 4},
};

/* The backend buffers of one shape. */
typedef struct ops_mem {
    uint16_t *x, *dy, *dx, *y, *w, *rows, *table, *logits16, *dlogits16, *drl; /* bf16 */
    float *rstd, *dw, *dtable, *logits, *probs, *topk_w, *dtopk_w, *prow, *loss, *aux; /* fp32 */
    int32_t *tokens, *order, *targets, *idx, *pos, *counts, *load, *peak;
} ops_mem;

static uint64_t g_seed = 12345;

/* Backend buffer of n_bytes: random bf16 in (-1, 1) (kind 0), random fp32 (1), or left as is (2). */
static mst_status buf(mst_ctx_t* ctx, size_t n_bytes, int kind, void** out) {
    MST_TRY(mst_alloc(ctx, n_bytes, out));
    if (kind == 2) return mst_fill(ctx, *out, 0, n_bytes);
    void* h = malloc(n_bytes);
    if (!h) return mst_set_error(MST_ERR_OOM, "bench ops: host buffer of %zu bytes", n_bytes);
    if (kind == 0)
        for (size_t i = 0; i < n_bytes / 2; i++)
            ((uint16_t*)h)[i] = mst_fp32_to_bf16((float)(2 * mst_splitmix_unit(&g_seed) - 1));
    else
        for (size_t i = 0; i < n_bytes / 4; i++) ((float*)h)[i] = (float)(4 * mst_splitmix_unit(&g_seed) - 2);
    mst_status st = mst_copy_h2b(ctx, *out, h, n_bytes);
    free(h);
    return st;
}

/* N ids in [0, V), skewed toward low ids (u^3); *distinct: how many differ. */
static mst_status ids(mst_ctx_t* ctx, int64_t N, int64_t V, int32_t** out, int64_t* distinct) {
    int32_t* h = (int32_t*)malloc(sizeof(int32_t) * (size_t)N);
    unsigned char* seen = (unsigned char*)calloc((size_t)V, 1);
    if (!h || !seen) {
        free(h), free(seen);
        return mst_set_error(MST_ERR_OOM, "bench ops: token ids");
    }
    *distinct = 0;
    for (int64_t t = 0; t < N; t++) {
        const double u = mst_splitmix_unit(&g_seed);
        h[t] = (int32_t)((double)V * u * u * u);
        *distinct += !seen[h[t]];
        seen[h[t]] = 1;
    }
    mst_status st = mst_alloc(ctx, sizeof(int32_t) * (size_t)N, (void**)out);
    if (st == MST_OK) st = mst_copy_h2b(ctx, *out, h, sizeof(int32_t) * (size_t)N);
    free(h), free(seen);
    return st;
}

static mst_status mem_alloc(mst_ctx_t* ctx, const ops_shape* s, ops_mem* m, int64_t* distinct) {
    const size_t N = (size_t)s->N, H = (size_t)s->H, V = (size_t)s->V, E = (size_t)s->E, K = (size_t)s->K;
    MST_TRY(buf(ctx, 2 * N * H, 0, (void**)&m->x));
    MST_TRY(buf(ctx, 2 * N * H, 0, (void**)&m->dy));
    MST_TRY(buf(ctx, 2 * N * H, 2, (void**)&m->dx));
    MST_TRY(buf(ctx, 2 * N * H, 2, (void**)&m->y));
    MST_TRY(buf(ctx, 2 * H, 0, (void**)&m->w));
    MST_TRY(buf(ctx, 2 * N * K * H, 0, (void**)&m->rows));
    MST_TRY(buf(ctx, 2 * V * H, 0, (void**)&m->table));
    MST_TRY(buf(ctx, 2 * N * V, 0, (void**)&m->logits16));
    MST_TRY(buf(ctx, 2 * N * V, 2, (void**)&m->dlogits16));
    MST_TRY(buf(ctx, 2 * N * E, 2, (void**)&m->drl));
    MST_TRY(buf(ctx, 4 * N, 2, (void**)&m->rstd));
    MST_TRY(buf(ctx, 4 * H, 2, (void**)&m->dw));
    MST_TRY(buf(ctx, 4 * V * H, 2, (void**)&m->dtable));
    MST_TRY(buf(ctx, 4 * N * E, 1, (void**)&m->logits));
    MST_TRY(buf(ctx, 4 * N * E, 2, (void**)&m->probs));
    MST_TRY(buf(ctx, 4 * N * K, 2, (void**)&m->topk_w));
    MST_TRY(buf(ctx, 4 * N * K, 1, (void**)&m->dtopk_w));
    MST_TRY(buf(ctx, 4 * N * K, 1, (void**)&m->prow));
    MST_TRY(buf(ctx, 4 * N, 2, (void**)&m->loss));
    MST_TRY(buf(ctx, 4, 2, (void**)&m->aux));
    MST_TRY(ids(ctx, s->N, s->V, &m->tokens, distinct));
    int64_t unused;
    MST_TRY(ids(ctx, s->N, s->V, &m->targets, &unused));
    MST_TRY(buf(ctx, 4 * (size_t)mst_embed_order_len(s->N), 2, (void**)&m->order));
    MST_TRY(buf(ctx, 4 * N * K, 2, (void**)&m->idx));
    MST_TRY(buf(ctx, 4 * N * K, 2, (void**)&m->pos));
    MST_TRY(buf(ctx, 4 * E, 2, (void**)&m->counts));
    MST_TRY(buf(ctx, 4 * E, 2, (void**)&m->load));
    MST_TRY(buf(ctx, 4, 2, (void**)&m->peak));
    return MST_OK;
}

static void mem_free(mst_ctx_t* ctx, ops_mem* m) {
    void** p = (void**)m;
    for (size_t i = 0; i < sizeof *m / sizeof(void*); i++)
        if (p[i]) mst_free(ctx, p[i]);
    memset(m, 0, sizeof *m);
}

/* The figures of the run, for --json. */
typedef struct ops_fig {
    const char* preset;
    const char* op;
    double ms, bytes;
} ops_fig;

static ops_fig g_figs[32];
static int g_n_figs;

/* One op of the table: its name, bytes and one call. */
typedef struct ops_case {
    const char* name;
    double bytes;
    mst_status (*call)(mst_ctx_t* ctx, const mst_model_backend* mo, const void* args);
    const void* args;
} ops_case;

#define CALL(slot, T) \
    static mst_status call_##slot(mst_ctx_t* ctx, const mst_model_backend* mo, const void* args) { \
        return mo->slot(ctx, (const T*)args);                                                     \
    }
CALL(embed_forward, mst_embed_args)
CALL(embed_backward, mst_embed_args)
CALL(xent, mst_xent_args)
CALL(route_forward, mst_route_args)
CALL(route_backward, mst_route_args)
CALL(rows_gather, mst_rows_args)
CALL(rows_sum, mst_rows_args)
CALL(norm_forward, mst_norm_args)
CALL(norm_backward, mst_norm_args)
CALL(add, mst_add_args)

/* ms per call: the mean of reps calls between two syncs, after one. */
static mst_status time_case(mst_ctx_t* ctx, const mst_model_backend* mo, const ops_case* c, int reps, double* ms) {
    MST_TRY(c->call(ctx, mo, c->args));
    MST_TRY(mst_ctx_sync(ctx));
    const double t0 = mst_clock_s();
    for (int i = 0; i < reps; i++) MST_TRY(c->call(ctx, mo, c->args));
    MST_TRY(mst_ctx_sync(ctx));
    *ms = (mst_clock_s() - t0) * 1e3 / reps;
    return MST_OK;
}

static mst_status run_shape(mst_ctx_t* ctx, const mst_model_backend* mo, const ops_shape* s, int reps,
                            const mst_bench_roofs* roofs) {
    ops_mem m;
    memset(&m, 0, sizeof m);
    int64_t U = 0;
    mst_status st = mem_alloc(ctx, s, &m, &U);
    const double N = (double)s->N, H = (double)s->H, V = (double)s->V, E = s->E, K = s->K;
    const mst_embed_args emb = {.n_tok = s->N, .vocab = s->V, .cols = s->H, .tokens = m.tokens, .table = m.table,
                                .x = m.y, .dx = m.dy, .dtable = m.dtable, .order = m.order};
    const mst_xent_args xe = {.rows = s->N, .vocab = s->V, .scale = 1.0f / (float)s->N, .logits = m.logits16,
                              .targets = m.targets, .loss = m.loss, .dlogits = m.dlogits16};
    const mst_route_args ro = {.n_tok = s->N, .n_experts = s->E, .top_k = s->K, .n_groups = 1, .norm_topk = 1,
                               .max_rows = s->N * s->K, .aux_coef = 0.001f, .grad_scale = 0.125f, .n_layers = 1,
                               .loads = m.load, .logits = m.logits, .probs = m.probs, .topk_idx = m.idx,
                               .topk_w = m.topk_w, .pos = m.pos, .counts = m.counts, .load = m.load,
                               .peak_rows = m.peak, .aux_loss = m.aux, .world = 1, .flag = ctx->err_flag,
                               .dtopk_w = m.dtopk_w, .dlogits = m.drl};
    const mst_rows_args gather = {.n_tok = s->N, .top_k = s->K, .cols = s->H, .pos = m.pos, .src = m.x,
                                  .dst = m.rows, .src_p = m.topk_w, .dst_p = m.prow};
    const mst_rows_args sum = {.n_tok = s->N, .top_k = s->K, .cols = s->H, .pos = m.pos, .src = m.rows,
                               .dst = m.dx, .src_p = m.prow, .dst_p = m.dtopk_w};
    const mst_norm_args norm = {.rows = s->N, .cols = s->H, .eps = 1e-6f, .x = m.x, .w = m.w, .y = m.y,
                                .rstd = m.rstd, .dy = m.dy, .dx = m.dx, .dw = m.dw};
    const mst_add_args add = {.n = s->N * s->H, .a = m.x, .b = m.dy, .y = m.y};
    const ops_case cases[] = {
        {"embed_forward", 4 * N * H, call_embed_forward, &emb},
        {"embed_backward", 2 * N * H + 8 * (double)U * H + 4 * N, call_embed_backward, &emb},
        {"xent", 4 * N * V + 8 * N, call_xent, &xe},
        {"route_forward", 8 * N * E + 12 * N * K, call_route_forward, &ro},
        {"route_backward", 6 * N * E + 12 * N * K, call_route_backward, &ro},
        {"rows_gather", 2 * N * H + 2 * N * K * H + 8 * N * K, call_rows_gather, &gather},
        {"rows_sum", 2 * N * K * H + 2 * N * H + 8 * N * K, call_rows_sum, &sum},
        {"norm_forward", 4 * N * H + 2 * H + 4 * N, call_norm_forward, &norm},
        {"norm_backward", 6 * N * H + 2 * H + 8 * H + 4 * N, call_norm_backward, &norm},
        {"add", 6 * N * H, call_add, &add},
    };
    if (st == MST_OK) st = mo->route_forward(ctx, &ro); /* the plan the rows ops read */
    printf("\n%s: N %lld tokens, H %lld, vocab %lld (%lld distinct ids), %d experts top-%d\n", s->name,
           (long long)s->N, (long long)s->H, (long long)s->V, (long long)U, s->E, s->K);
    printf("  %-15s %10s %10s %10s %8s\n", "op", "ms", "MB", "GB/s", "of roof");
    for (size_t i = 0; i < sizeof cases / sizeof *cases && st == MST_OK; i++) {
        double ms = 0;
        st = time_case(ctx, mo, &cases[i], reps, &ms);
        if (st != MST_OK) break;
        const double roof_ms = mst_bench_roofline_ms(roofs, 0, cases[i].bytes);
        printf("  %-15s %10.4f %10.2f %10.0f %7.0f%%\n", cases[i].name, ms, cases[i].bytes / 1e6,
               cases[i].bytes / (ms * 1e6), 100 * roof_ms / ms);
        if (g_n_figs < 32) g_figs[g_n_figs++] = (ops_fig){s->name, cases[i].name, ms, cases[i].bytes};
    }
    if (st == MST_OK) st = mst_ctx_check(ctx);
    mem_free(ctx, &m);
    return st;
}

/* 0, or 1 after a line when the file could not be written. */
static int write_json(const char* path, const char* device, double copy_gbps) {
    FILE* j = mst_out_open("moestash bench ops", path);
    if (!j) return 1;
    fprintf(j, "{\n  \"device\": \"%s\",\n  \"copy_gbps\": %.1f,\n  \"ops\": [\n", device, copy_gbps);
    for (int i = 0; i < g_n_figs; i++) {
        const ops_fig* f = &g_figs[i];
        fprintf(j, "    {\"preset\": \"%s\", \"op\": \"%s\", \"ms\": %.5f, \"bytes\": %.0f, \"gbps\": %.1f, "
                   "\"of_roof\": %.3f}%s\n",
                f->preset, f->op, f->ms, f->bytes, f->bytes / (f->ms * 1e6), f->bytes / (f->ms * 1e6) / copy_gbps,
                i + 1 < g_n_figs ? "," : "");
    }
    fprintf(j, "  ]\n}\n");
    return mst_out_close("moestash bench ops", path, j);
}

static int run_ops(int which, int64_t reps, const char* json) {
    if (!mst_backend_available(MST_BACKEND_CUDA)) {
        fprintf(stderr, "moestash bench ops: needs the cuda backend (no device or not built in)\n");
        return 2;
    }
    mst_ctx_t* ctx = NULL;
    const mst_model_backend* mo = NULL;
    if (mst_ctx_create(MST_BACKEND_CUDA, 0, &ctx) != MST_OK || mst_model_backend_of(ctx, &mo) != MST_OK) {
        fprintf(stderr, "moestash bench ops: %s\n", mst_last_error());
        mst_ctx_destroy(ctx);
        return 1;
    }
    mst_bench_roofs roofs = {0, 0};
    cudaStream_t stream = NULL;
    mst_status st = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess
                        ? mst_bench_roofs_measure(ctx, stream, &roofs)
                        : mst_set_error(MST_ERR_BACKEND, "cudaStreamCreate");
    if (st == MST_OK)
        printf("moestash bench ops on %s: the trainer's memory-bound ops alone, mean of %lld calls; copy roof "
               "%.0f GB/s (read + write), bytes = each op's minimum traffic\n",
               mst_ctx_describe(ctx), (long long)reps, roofs.copy_gbps);
    for (int i = 0; i < 2 && st == MST_OK; i++)
        if (which < 0 || which == i) st = run_shape(ctx, mo, &shapes[i], (int)reps, &roofs);
    if (st != MST_OK) fprintf(stderr, "moestash bench ops: %s\n", mst_last_error());
    if (st == MST_OK && json && write_json(json, mst_ctx_describe(ctx), roofs.copy_gbps)) st = MST_ERR_IO;
    if (stream) cudaStreamDestroy(stream);
    mst_ctx_destroy(ctx);
    return st == MST_OK ? 0 : 1;
}

#else

static int run_ops(int which, int64_t reps, const char* json) {
    (void)which, (void)reps, (void)json;
    fprintf(stderr, "moestash bench ops: needs the cuda backend (built without it)\n");
    return 2;
}

#endif

int mst_bench_ops(int argc, char** argv) {
    mst_args a;
    int64_t reps = 20;
    int which = -1;
    const char* json = NULL;
    static const char* const names[] = {"qwen3-30b-a3b", "h100", NULL};
    int rc = 0;
    mst_args_init(&a, "moestash bench ops", argc, argv);
    while (mst_args_next(&a)) {
        if (mst_args_is(&a, "--preset")) rc = mst_args_choice(&a, names, &which);
        else if (mst_args_is(&a, "--reps")) rc = mst_args_int(&a, 1, 100000, &reps);
        else if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench ops [--preset qwen3-30b-a3b|h100 (both)] [--reps N (20)] [--json FILE]\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    return run_ops(which, reps, json);
}
