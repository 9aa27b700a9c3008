/*
 * bench_stash.c — `moestash bench stash [--json FILE] [--iters N]`: the paged
 * stash on CUDA beside the copies it competes with, measured in the same run.
 *
 *   device: save and restore GB/s (bytes moved = 2 x valid bytes: read +
 *           write) beside cudaMemcpyAsync device-to-device of the same valid
 *           bytes; widths 2048, 4096, 7168 bf16 and 1 fp32 (router probs);
 *           rows 4k .. 128k valid, max_rows = 1.5 x rows, counts over 8
 *           groups read on the device.
 *   spill:  a pool with no device pages: save = device -> pinned host over
 *           PCIe, restore = host -> device; GB/s of the valid bytes beside
 *           pinned cudaMemcpyAsync device-to-host / host-to-device.
 *   fp8:    pools of fp8 pages (bf16 rows as e4m3 + a scale per 128): the
 *           bytes moved are the bf16 rows read and the fp8 pages written (a
 *           save; the other way for a restore), beside the same D2D copy
 *           roof; spill: the fp8 page bytes over PCIe beside pinned D2H /
 *           H2D. The rows are finite bf16 of a wide range.
 *
 * Each configuration is validated first (restore bit-exact, fp8: the bytes
 * of the CPU twin's round trip, fp8_page.h; rows past n untouched,
 * mst_pool_check clean, no page left); then save, restore and the
 * baseline are timed with events, interleaved, and the median is kept.
 * Ratios and a short table come last. --width W keeps the cases of that
 * width only (A/B runs of one kernel change).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"
#include "moestash.h"

#ifdef MST_HAVE_CUDA
#include <cuda_runtime_api.h>

enum { N_GROUPS = 8, WARMUP = 3 };
#define TARGET 0.90

typedef struct stash_case {
    mst_dtype dtype;         /* of the rows (bf16 for fp8 pages)           */
    int64_t width, rows;
    int spill;               /* pool without device pages                  */
    int fp8;                 /* fp8 pages                                  */
} stash_case;

typedef struct stash_result {
    stash_case c;
    double valid_bytes;      /* rows * row bytes                            */
    double save_gbs, restore_gbs, base_gbs, base2_gbs; /* base2: H2D (spill) */
    int ok;                  /* validated                                   */
} stash_result;

/* Buffers shared by every case: sized for the largest. */
typedef struct bench_bufs {
    mst_ctx_t* ctx;
    cudaStream_t stream;
    void *src, *dst, *counts; /* backend memory [max bytes], [max bytes], [E] */
    void* pinned;             /* pinned host [max valid bytes] (baselines)   */
    unsigned char* host;      /* [max bytes] random pattern                  */
    uint16_t* finite;         /* [max bytes / 2] random finite bf16 (fp8 cases) */
    unsigned char* twin;      /* [max bytes] the CPU twin's fp8 round trip    */
    unsigned char* back;      /* [max bytes] downloads                       */
    size_t max_bytes;
    cudaEvent_t ev[3];
    int iters;
} bench_bufs;

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}

static double median(double* v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int cuda_ok(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return 1;
    fprintf(stderr, "bench stash: %s: %s\n", what, cudaGetErrorString(e));
    return 0;
}

static int st_ok(mst_status st, const char* what) {
    if (st == MST_OK) return 1;
    fprintf(stderr, "bench stash: %s: %s (%s)\n", what, mst_status_str(st), mst_last_error());
    return 0;
}

static float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    return ms;
}

/* The rows of a case: the random pattern, or finite bf16 for fp8 pages. */
static const void* source(const bench_bufs* b, const stash_case* c) { return c->fp8 ? (const void*)b->finite : b->host; }

/* What a restore gives back of `valid` bytes of rows w wide: the source, or
 * for fp8 pages the CPU twin's round trip of it (b->twin). */
static const unsigned char* expected(bench_bufs* b, const stash_case* c, size_t valid) {
    if (!c->fp8) return b->host;
    uint8_t q[MST_FP8_BLOCK];
    float scale;
    uint16_t* x = (uint16_t*)b->twin;
    memcpy(x, b->finite, valid);
    for (size_t i = 0; i < valid / 2; i += MST_FP8_BLOCK) { /* w is a multiple of 128 */
        mst_fp8_block_save(x + i, MST_FP8_BLOCK, q, &scale);
        mst_fp8_block_restore(q, scale, MST_FP8_BLOCK, x + i);
    }
    return b->twin;
}

/* Restore into poisoned dst as expected (bit-exact), rows past n untouched,
 * no page left. */
static int validate(bench_bufs* b, const stash_case* c, const unsigned char* want, mst_pool_t* pool,
                    mst_stash_handle_t* h, const mst_tensor* src, mst_tensor* dst, const mst_tensor* counts,
                    size_t valid, size_t all) {
    if (!st_ok(mst_fill(b->ctx, b->dst, 0xFF, all), "poison dst")) return 0;
    if (!st_ok(mst_stash_save(pool, h, src, counts), "save")) return 0;
    if (!st_ok(mst_fill(b->ctx, b->src, 0x5A, valid), "overwrite src")) return 0; /* pages must hold it */
    if (!st_ok(mst_stash_restore(pool, h, dst), "restore")) return 0;
    if (!st_ok(mst_copy_b2h(b->ctx, b->back, b->dst, all), "download")) return 0;
    if (!st_ok(mst_copy_h2b(b->ctx, b->src, source(b, c), valid), "re-upload src")) return 0;
    if (memcmp(b->back, want, valid) != 0) {
        fprintf(stderr, "bench stash: restore differs from the %s\n", c->fp8 ? "CPU twin's fp8 round trip" : "source");
        return 0;
    }
    if (!st_ok(mst_ctx_check(b->ctx), "error flag")) return 0;
    for (size_t i = valid; i < all; i++)
        if (b->back[i] != 0xFF) {
            fprintf(stderr, "bench stash: byte %zu past the valid rows was written\n", i);
            return 0;
        }
    mst_pool_stats s = MST_POOL_STATS_INIT;
    if (!st_ok(mst_pool_check(pool), "pool check") || !st_ok(mst_pool_stats_get(pool, &s), "stats") ||
        !st_ok(mst_pool_poll(pool), "poll"))
        return 0;
    if (s.dev_used || s.host_used) {
        fprintf(stderr, "bench stash: %lld + %lld pages left after restore\n", (long long)s.dev_used,
                (long long)s.host_used);
        return 0;
    }
    return 1;
}

/* One case: validate, then time save / restore / baselines interleaved. */
static int run_case(bench_bufs* b, const stash_case* c, stash_result* r) {
    const int64_t row_bytes = c->width * (int64_t)mst_dtype_size(c->dtype);
    const int64_t R = c->rows + c->rows / 2;
    const size_t valid = (size_t)(c->rows * row_bytes), all = (size_t)(R * row_bytes);
    const double paged = c->fp8 ? (double)(c->rows * mst_fp8_row_bytes(c->width)) : (double)valid; /* bytes in pages */
    memset(r, 0, sizeof *r);
    r->c = *c;
    r->valid_bytes = (double)valid;
    int32_t counts[N_GROUPS];
    uint64_t seed = (uint64_t)c->rows * 31 + (uint64_t)c->width;
    memset(counts, 0, sizeof counts);
    for (int64_t i = 0; i < c->rows; i++) counts[mst_splitmix64(&seed) % N_GROUPS]++;
    const int64_t pages = (c->rows + MST_POOL_PAGE_ROWS - 1) / MST_POOL_PAGE_ROWS;
    mst_pool_config cfg = {sizeof(mst_pool_config), MST_POOL_PAGE_ROWS, c->spill ? 0 : pages, c->spill ? pages : 0, 0}; /* all SMs: nothing runs beside */
    mst_pool_t* pool = NULL;
    mst_stash_handle_t* h = NULL;
    if (!st_ok(mst_pool_create(b->ctx, c->fp8 ? MST_DTYPE_FP8 : c->dtype, c->width, &cfg, &pool), "pool create"))
        return 0;
    int ok = st_ok(mst_stash_handle_create(pool, R, &h), "handle create") &&
             st_ok(mst_copy_h2b(b->ctx, b->counts, counts, sizeof counts), "counts") &&
             st_ok(mst_copy_h2b(b->ctx, b->src, source(b, c), all), "src");
    mst_tensor src = mst_tensor_make(b->src, c->dtype, R, c->width);
    mst_tensor dst = mst_tensor_make(b->dst, c->dtype, R, c->width);
    mst_tensor tc = mst_tensor_make(b->counts, MST_DTYPE_INT32, N_GROUPS, 1);
    const unsigned char* want = expected(b, c, valid);
    ok = ok && validate(b, c, want, pool, h, &src, &dst, &tc, valid, all);
    r->ok = ok;
    double* t = (double*)calloc((size_t)b->iters * 4, sizeof(double));
    for (int it = 0; ok && it < WARMUP + b->iters; it++) {
        ok = cuda_ok(cudaEventRecord(b->ev[0], b->stream), "event") &&
             st_ok(mst_stash_save(pool, h, &src, &tc), "save") &&
             cuda_ok(cudaEventRecord(b->ev[1], b->stream), "event") &&
             st_ok(mst_stash_restore(pool, h, &dst), "restore") &&
             cuda_ok(cudaEventRecord(b->ev[2], b->stream), "event") &&
             cuda_ok(cudaEventSynchronize(b->ev[2]), "sync");
        if (!ok) break;
        const double ts = elapsed_ms(b->ev[0], b->ev[1]), tr = elapsed_ms(b->ev[1], b->ev[2]);
        /* baselines: D2D of the valid bytes, or pinned D2H then H2D */
        ok = cuda_ok(cudaEventRecord(b->ev[0], b->stream), "event") &&
             cuda_ok(c->spill ? cudaMemcpyAsync(b->pinned, b->src, valid, cudaMemcpyDeviceToHost, b->stream)
                              : cudaMemcpyAsync(b->dst, b->src, valid, cudaMemcpyDeviceToDevice, b->stream),
                     "baseline copy") &&
             cuda_ok(cudaEventRecord(b->ev[1], b->stream), "event") &&
             (!c->spill || cuda_ok(cudaMemcpyAsync(b->dst, b->pinned, valid, cudaMemcpyHostToDevice, b->stream),
                                   "baseline copy")) &&
             cuda_ok(cudaEventRecord(b->ev[2], b->stream), "event") &&
             cuda_ok(cudaEventSynchronize(b->ev[2]), "sync");
        if (!ok || it < WARMUP) continue;
        const int k = it - WARMUP;
        t[k] = ts;
        t[b->iters + k] = tr;
        t[2 * b->iters + k] = elapsed_ms(b->ev[0], b->ev[1]);
        t[3 * b->iters + k] = elapsed_ms(b->ev[1], b->ev[2]);
    }
    if (ok) {
        const double moved = c->spill ? (double)valid : 2.0 * (double)valid; /* bytes per baseline op */
        const double op = c->spill ? paged : (double)valid + paged;          /* bytes per save, restore */
        r->save_gbs = op / (median(t, b->iters) * 1e6);
        r->restore_gbs = op / (median(t + b->iters, b->iters) * 1e6);
        r->base_gbs = moved / (median(t + 2 * b->iters, b->iters) * 1e6);
        if (c->spill) r->base2_gbs = moved / (median(t + 3 * b->iters, b->iters) * 1e6);
        ok = validate(b, c, want, pool, h, &src, &dst, &tc, valid, all); /* still right after timing */
        r->ok = ok;
    }
    free(t);
    mst_stash_handle_destroy(h);
    mst_pool_destroy(pool);
    return ok;
}

static void write_json(FILE* f, const char* device, const stash_result* r, int n) {
    fprintf(f, "{\n  \"bench\": \"stash\",\n  \"device\": \"%s\",\n  \"page_rows\": %d,\n  \"results\": [\n",
            device, MST_POOL_PAGE_ROWS);
    for (int i = 0; i < n; i++) {
        const stash_result* x = &r[i];
        fprintf(f,
                "    {\"kind\": \"%s\", \"dtype\": \"%s\", \"pages\": \"%s\", \"width\": %lld, \"rows\": %lld, \"max_rows\": %lld, "
                "\"valid_bytes\": %.0f, \"ok\": %d, \"save_gbs\": %.1f, \"restore_gbs\": %.1f, "
                "\"%s_gbs\": %.1f, ",
                x->c.spill ? "spill" : "device", mst_dtype_name(x->c.dtype), x->c.fp8 ? "fp8" : mst_dtype_name(x->c.dtype),
                (long long)x->c.width,
                (long long)x->c.rows, (long long)(x->c.rows * 3 / 2), x->valid_bytes, x->ok, x->save_gbs,
                x->restore_gbs, x->c.spill ? "d2h" : "d2d", x->base_gbs);
        if (x->c.spill)
            fprintf(f, "\"h2d_gbs\": %.1f, \"save_ratio\": %.3f, \"restore_ratio\": %.3f}", x->base2_gbs,
                    x->save_gbs / x->base_gbs, x->restore_gbs / x->base2_gbs);
        else
            fprintf(f, "\"save_ratio\": %.3f, \"restore_ratio\": %.3f}", x->save_gbs / x->base_gbs,
                    x->restore_gbs / x->base_gbs);
        fprintf(f, "%s\n", i + 1 < n ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
}

/* In the target: device cases of width >= 4096 from 16k rows, and spills. */
static int in_target(const stash_case* c) {
    return c->spill || (c->width >= 4096 && c->rows >= 16384);
}

static void print_table(const stash_result* r, int n) {
    double worst_dev = 1e9, worst_spill = 1e9;
    printf("\n%-6s %-5s %5s %7s | %9s %9s %9s | %6s %6s | %s\n", "kind", "pages", "width", "rows", "save",
           "restore", "baseline", "save/", "rest./", "ok");
    printf("%-6s %-5s %5s %7s | %9s %9s %9s | %6s %6s |\n", "", "", "", "", "GB/s", "GB/s", "GB/s", "base", "base");
    for (int i = 0; i < n; i++) {
        const stash_result* x = &r[i];
        const double base_r = x->c.spill ? x->base2_gbs : x->base_gbs;
        const double rs = x->save_gbs / x->base_gbs, rr = x->restore_gbs / base_r;
        printf("%-6s %-5s %5lld %7lld | %9.1f %9.1f %9.1f | %6.3f %6.3f | %s%s\n", x->c.spill ? "spill" : "device",
               x->c.fp8 ? "fp8" : mst_dtype_name(x->c.dtype), (long long)x->c.width, (long long)x->c.rows, x->save_gbs, x->restore_gbs, x->base_gbs, rs, rr,
               x->ok ? "yes" : "NO", in_target(&x->c) ? " *" : "");
        if (!in_target(&x->c)) continue;
        if (x->c.spill) worst_spill = rs < worst_spill ? rs : worst_spill;
        else {
            worst_dev = rs < worst_dev ? rs : worst_dev;
            worst_dev = rr < worst_dev ? rr : worst_dev;
        }
    }
    printf("baseline: device = cudaMemcpyAsync D2D of the valid bytes (GB/s of 2 x bytes); spill = pinned\n"
           "D2H (restore column ratio against pinned H2D, %s); * = in the target\n",
           "GB/s of the valid bytes");
    printf("target save/restore >= %.2f x D2D (width >= 4096, rows >= 16k): worst %.3f %s\n", TARGET, worst_dev,
           worst_dev >= TARGET ? "MET" : "NOT MET");
    printf("target spill >= %.2f x pinned D2H: worst %.3f %s\n", TARGET, worst_spill,
           worst_spill >= TARGET ? "MET" : "NOT MET");
    printf("fp8 pages: bytes moved = bf16 rows + fp8 pages (spill: the fp8 pages over PCIe)\n");
    for (int i = 0; i < n; i++) /* fp8 spill against the bf16 spill of the same rows: time ratios */
        for (int j = 0; r[i].c.fp8 && r[i].c.spill && j < n; j++)
            if (!r[j].c.fp8 && r[j].c.spill && r[j].c.width == r[i].c.width && r[j].c.rows == r[i].c.rows) {
                const double paged = (double)(r[i].c.rows * mst_fp8_row_bytes(r[i].c.width));
                printf("spill W=%lld rows=%lld: fp8 save %.2fx, restore %.2fx faster than bf16\n",
                       (long long)r[i].c.width, (long long)r[i].c.rows,
                       (r[j].valid_bytes / r[j].save_gbs) / (paged / r[i].save_gbs),
                       (r[j].valid_bytes / r[j].restore_gbs) / (paged / r[i].restore_gbs));
            }
}

static int bench_bufs_open(bench_bufs* b, mst_ctx_t* ctx, size_t max_bytes, size_t max_valid) {
    memset(b, 0, sizeof *b);
    b->ctx = ctx;
    b->stream = (cudaStream_t)mst_ctx_stream(ctx);
    b->max_bytes = max_bytes;
    b->host = (unsigned char*)malloc(max_bytes);
    b->back = (unsigned char*)malloc(max_bytes);
    b->finite = (uint16_t*)malloc(max_bytes);
    b->twin = (unsigned char*)malloc(max_bytes);
    if (!b->host || !b->back || !b->finite || !b->twin) return 0;
    uint64_t fseed = 0xf8;
    for (size_t i = 0; i < max_bytes / 2; i++) { /* sign, exponent 2^-27 .. 2^13, mantissa: random */
        const uint64_t v = mst_splitmix64(&fseed);
        b->finite[i] = (uint16_t)((v & 0x8000) | ((100 + (v >> 16) % 41) << 7) | ((v >> 32) & 0x7f));
    }
    uint64_t seed = 0x57a54;
    for (size_t i = 0; i + 8 <= max_bytes; i += 8) { /* random bits, never zeros */
        uint64_t v = mst_splitmix64(&seed) | 0x0101010101010101ull;
        memcpy(b->host + i, &v, 8);
    }
    for (int i = 0; i < 3; i++)
        if (!cuda_ok(cudaEventCreate(&b->ev[i]), "event create")) return 0;
    return st_ok(mst_alloc(ctx, max_bytes, &b->src), "src") && st_ok(mst_alloc(ctx, max_bytes, &b->dst), "dst") &&
           st_ok(mst_alloc(ctx, sizeof(int32_t) * N_GROUPS, &b->counts), "counts") &&
           cuda_ok(cudaHostAlloc(&b->pinned, max_valid, cudaHostAllocDefault), "pinned baseline buffer");
}

static void bench_bufs_close(bench_bufs* b) {
    for (int i = 0; i < 3; i++)
        if (b->ev[i]) cudaEventDestroy(b->ev[i]);
    if (b->pinned) cudaFreeHost(b->pinned);
    mst_free(b->ctx, b->src);
    mst_free(b->ctx, b->dst);
    mst_free(b->ctx, b->counts);
    free(b->host);
    free(b->back);
    free(b->finite);
    free(b->twin);
}

int mst_bench_stash(int argc, char** argv) {
    const char* json = NULL;
    int32_t iters = 20;
    int64_t only_width = 0; /* 0: every width */
    const char* pages = "all";
    mst_args a;
    mst_args_init(&a, "moestash bench stash", argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--iters")) rc = mst_args_int32(&a, 1, 1000000, &iters);
        else if (mst_args_is(&a, "--width")) rc = mst_args_int(&a, 1, INT32_MAX, &only_width);
        else if (mst_args_is(&a, "--pages")) {
            rc = mst_args_str(&a, &pages);
            if (!rc && strcmp(pages, "all") && strcmp(pages, "bf16") && strcmp(pages, "fp8"))
                rc = mst_args_bad(&a, pages, "expected all, bf16 or fp8");
        }
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench stash [--json FILE] [--iters N (20)] [--width W (every width)]\n"
                   "                           [--pages all|bf16|fp8 (all: the pages of the rows' dtype, then fp8)]\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (!mst_backend_available(MST_BACKEND_CUDA)) {
        fprintf(stderr, "moestash bench stash: needs a CUDA device\n");
        return 2;
    }
    static const int64_t widths[] = {2048, 4096, 7168, 1};
    static const int64_t rows[] = {4096, 16384, 65536, 131072};
    enum { N_W = 4, N_R = 4, N_CASES = N_W * N_R + 3 * N_R + 2 * 3 * N_R };
    stash_case cases[N_CASES];
    int n = 0;
    for (int fp8 = 0; fp8 < 2; fp8++)
        for (int spill = 0; spill < 2 && strcmp(pages, fp8 ? "bf16" : "fp8"); spill++)
            for (int w = 0; w < N_W - (spill || fp8); w++) /* spill, fp8: bf16 widths only */
                for (int r = 0; r < N_R && (only_width == 0 || only_width == widths[w]); r++)
                    cases[n++] = (stash_case){widths[w] == 1 ? MST_DTYPE_FP32 : MST_DTYPE_BF16, widths[w], rows[r],
                                              spill, fp8};
    if (n == 0) {
        fprintf(stderr, "moestash bench stash: --width %lld: expected 2048, 4096, 7168 or 1\n", (long long)only_width);
        return 2;
    }
    mst_ctx_t* ctx = NULL;
    if (!st_ok(mst_ctx_create(MST_BACKEND_CUDA, 0, &ctx), "context")) return 1;
    printf("bench stash on %s (page_rows %d, max_rows = 1.5 x rows, %d groups, median of %d)\n",
           mst_ctx_describe(ctx), MST_POOL_PAGE_ROWS, N_GROUPS, iters);
    const size_t max_valid = (size_t)(131072 * 7168 * 2);
    bench_bufs b;
    int ok = bench_bufs_open(&b, ctx, max_valid + max_valid / 2, max_valid);
    b.iters = iters;
    stash_result res[N_CASES];
    int n_done = 0, all_ok = ok;
    for (int i = 0; ok && i < n; i++) {
        all_ok &= run_case(&b, &cases[i], &res[n_done]);
        const stash_result* x = &res[n_done++];
        printf("%-6s %-4s W=%-5lld rows=%-6lld save %8.1f GB/s  restore %8.1f GB/s  base %8.1f GB/s%s\n",
               cases[i].spill ? "spill" : "device", cases[i].fp8 ? "fp8" : mst_dtype_name(cases[i].dtype), (long long)cases[i].width,
               (long long)cases[i].rows, x->save_gbs, x->restore_gbs, x->base_gbs, x->ok ? "" : "  FAILED");
        fflush(stdout);
    }
    if (json) {
        FILE* f = mst_out_open("moestash bench stash", json);
        if (f) write_json(f, mst_ctx_describe(ctx), res, n_done);
        if (!f || mst_out_close("moestash bench stash", json, f)) all_ok = 0;
    }
    print_table(res, n_done);
    bench_bufs_close(&b);
    mst_ctx_destroy(ctx);
    return all_ok ? 0 : 1;
}

#else /* no CUDA */

int mst_bench_stash(int argc, char** argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moestash bench stash: built without the CUDA backend\n");
    return 2;
}

#endif
