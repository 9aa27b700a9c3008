/*
 * bench_optim.c — `moestash bench optim [--params N] [--reps N] [--backend
 * cpu|cuda] [--json FILE]`: the optimizer's passes over the parameters once
 * a step, as the trainer runs them (model_backend.h's ops), with the bytes
 * each moves per parameter:
 *   zero    main_grad zeroed at the step's start             write 4        =  4
 *   sumsq   the squared gradient norm                        read 4         =  4
 *   adamw   fp32 moments: read grad, m, v, master; write     16 + 14        = 30
 *           m, v, master and the bf16 weight
 *   adamw   bf16 moments (--adam-moments bf16)               12 + 10        = 22
 * so a step's optimizer moves 38 bytes a parameter with fp32 moments and 30
 * with bf16, in three passes. Each figure beside the device copy roof
 * (bench/roof.c: cudaMemcpyAsync device to device, bytes read + written)
 * measured in the same run; on the CPU the roof is a host memcpy of 256 MiB.
 *
 * Validation first: one AdamW step of each kind on 65536 parameters against
 * a float64 host reference (the master weights' update within 3e-4
 * relative, norm: an fp32 weight of 0.1 resolves a step of 1e-4 to about
 * 6e-5 of it; the stored bf16 moments the reference's nearest-even
 * rounding or one ulp from it, at most 1 %), and the sum of squares within
 * 1e-5; exit 1 before timing otherwise. Timing: the mean of N calls between
 * two syncs (host clock) after one warm-up call.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"
#include "roof.h"
#include "trainer/model_ops/model_backend.h"

enum { N_OPS = 4, CHECK_N = 65536 };
static const char* const op_names[N_OPS] = {"zero main_grad", "sum of squares", "AdamW, fp32 moments", "AdamW, bf16 moments"};
static const double op_bytes[N_OPS] = {4, 4, 30, 22}; /* per parameter */

typedef struct optim_bufs {
    int64_t n;
    float *grad, *master, *m32, *v32;   /* [n] fp32               */
    uint16_t *m16, *v16, *w;            /* [n] bf16               */
    float *partial, *sumsq, *hyper;     /* [PARTS], [1], [3]      */
    int32_t* flag;                      /* [1] 0                  */
} optim_bufs;

static void bufs_free(mst_ctx_t* ctx, optim_bufs* b) {
    void* p[] = {b->grad, b->master, b->m32, b->v32, b->m16, b->v16, b->w, b->partial, b->sumsq, b->hyper, b->flag};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        if (p[i]) mst_free(ctx, p[i]);
}

/* Host [n] fp32 uniform in (lo, hi), from seed. */
static void uniform(float* h, int64_t n, double lo, double hi, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) h[i] = (float)(lo + (hi - lo) * mst_splitmix_unit(&seed));
}

/* Every buffer allocated and filled with fresh values: gradients, master
 * weights, moments (v > 0), the step's hyper-parameters (lr 1e-4, step 3). */
static mst_status bufs_make(mst_ctx_t* ctx, int64_t n, optim_bufs* b) {
    memset(b, 0, sizeof *b);
    b->n = n;
    const size_t f = sizeof(float) * (size_t)n, h = sizeof(uint16_t) * (size_t)n;
    MST_TRY(mst_alloc(ctx, f, (void**)&b->grad));
    MST_TRY(mst_alloc(ctx, f, (void**)&b->master));
    MST_TRY(mst_alloc(ctx, f, (void**)&b->m32));
    MST_TRY(mst_alloc(ctx, f, (void**)&b->v32));
    MST_TRY(mst_alloc(ctx, h, (void**)&b->m16));
    MST_TRY(mst_alloc(ctx, h, (void**)&b->v16));
    MST_TRY(mst_alloc(ctx, h, (void**)&b->w));
    MST_TRY(mst_alloc(ctx, sizeof(float) * MST_SUMSQ_PARTS, (void**)&b->partial));
    MST_TRY(mst_alloc(ctx, sizeof(float), (void**)&b->sumsq));
    MST_TRY(mst_alloc(ctx, sizeof(float) * MST_N_HYPER, (void**)&b->hyper));
    MST_TRY(mst_alloc(ctx, sizeof(int32_t), (void**)&b->flag));
    float* x = (float*)malloc(f);
    uint16_t* y = (uint16_t*)malloc(h);
    mst_status st = x && y ? MST_OK : mst_set_error(MST_ERR_OOM, "bench optim: host staging of %zu bytes", f);
    float* const dst[4] = {b->grad, b->master, b->m32, b->v32};
    const double lo[4] = {-1e-2, -0.1, -1e-3, 1e-7}, hi[4] = {1e-2, 0.1, 1e-3, 1e-5};
    for (int k = 0; k < 4 && st == MST_OK; k++) {
        uniform(x, n, lo[k], hi[k], 101 + (uint64_t)k);
        st = mst_copy_h2b(ctx, dst[k], x, f);
        if (st == MST_OK && k >= 2) { /* the bf16 moments: the same values rounded */
            mst_fp32_to_bf16_array(y, x, (size_t)n);
            st = mst_copy_h2b(ctx, k == 2 ? b->m16 : b->v16, y, h);
        }
    }
    const float hyper[MST_N_HYPER] = {1e-4f, 1.0f - 0.9f * 0.9f * 0.9f, 1.0f - 0.95f * 0.95f * 0.95f};
    const int32_t zero = 0;
    if (st == MST_OK) st = mst_copy_h2b(ctx, b->hyper, hyper, sizeof hyper);
    if (st == MST_OK) st = mst_copy_h2b(ctx, b->flag, &zero, sizeof zero);
    free(x);
    free(y);
    return st;
}

static mst_adamw_args adamw_of(const optim_bufs* b, int64_t n, int bf16) {
    mst_adamw_args a = {.n = n, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .clip = 1.0f,
                        .hyper = b->hyper, .master = b->master, .grad = b->grad, .m = bf16 ? (void*)b->m16 : (void*)b->m32,
                        .v = bf16 ? (void*)b->v16 : (void*)b->v32, .moments_bf16 = bf16, .w = b->w,
                        .grad_sumsq = b->sumsq, .flag = b->flag};
    return a;
}

static mst_sumsq_args sumsq_of(const optim_bufs* b, int64_t n) {
    mst_sumsq_args s = {.n = n, .x = b->grad, .partial = b->partial, .out = b->sumsq};
    return s;
}

/* One AdamW step of kind bf16 on the first n parameters against float64;
 * *err: the master update's relative error, *off: the moments not the
 * reference's rounding (bf16), *far: more than one ulp off. */
static mst_status check_adamw(mst_ctx_t* ctx, const mst_model_backend* mo, const optim_bufs* b, int64_t n, int bf16,
                              double* err, int64_t* off, int64_t* far) {
    const size_t f = sizeof(float) * (size_t)n, h = sizeof(uint16_t) * (size_t)n;
    float *g = (float*)malloc(f), *p0 = (float*)malloc(f), *p1 = (float*)malloc(f), *m0 = (float*)malloc(f),
          *v0 = (float*)malloc(f);
    uint16_t *m16 = (uint16_t*)malloc(h), *v16 = (uint16_t*)malloc(h);
    mst_status st = g && p0 && p1 && m0 && v0 && m16 && v16 ? MST_OK : mst_set_error(MST_ERR_OOM, "bench optim: check");
    mst_sumsq_args s = sumsq_of(b, n);
    mst_adamw_args a = adamw_of(b, n, bf16);
    float ss = 0, hy[MST_N_HYPER];
    if (st == MST_OK) st = mst_copy_b2h(ctx, g, b->grad, f);
    if (st == MST_OK) st = mst_copy_b2h(ctx, p0, b->master, f);
    if (st == MST_OK && !bf16) st = mst_copy_b2h(ctx, m0, b->m32, f);
    if (st == MST_OK && !bf16) st = mst_copy_b2h(ctx, v0, b->v32, f);
    if (st == MST_OK && bf16) st = mst_copy_b2h(ctx, m16, b->m16, h);
    if (st == MST_OK && bf16) st = mst_copy_b2h(ctx, v16, b->v16, h);
    for (int64_t i = 0; st == MST_OK && bf16 && i < n; i++) m0[i] = mst_bf16_to_fp32(m16[i]), v0[i] = mst_bf16_to_fp32(v16[i]);
    if (st == MST_OK) st = mo->sumsq(ctx, &s);
    if (st == MST_OK) st = mo->adamw(ctx, &a);
    if (st == MST_OK) st = mst_copy_b2h(ctx, &ss, b->sumsq, sizeof ss);
    if (st == MST_OK) st = mst_copy_b2h(ctx, hy, b->hyper, sizeof hy);
    if (st == MST_OK) st = mst_copy_b2h(ctx, p1, b->master, f);
    if (st == MST_OK && bf16) st = mst_copy_b2h(ctx, m16, b->m16, h);
    if (st == MST_OK && bf16) st = mst_copy_b2h(ctx, v16, b->v16, h);
    double num = 0, den = 0, ref_ss = 0;
    *off = *far = 0;
    for (int64_t i = 0; st == MST_OK && i < n; i++) ref_ss += (double)g[i] * g[i];
    const float nk = sqrtf(ss), gk = nk > a.clip ? a.clip / nk : 1.0f; /* the kernel's own scale */
    for (int64_t i = 0; st == MST_OK && i < n; i++) {
        const double gg = (double)(g[i] * gk), lr = hy[MST_HYPER_LR];
        const double mm = a.beta1 * (double)m0[i] + (1 - (double)a.beta1) * gg, vv = a.beta2 * (double)v0[i] + (1 - (double)a.beta2) * gg * gg;
        const double dw = -lr * a.weight_decay * p0[i] - lr * (mm / hy[MST_HYPER_BC1]) / (sqrt(vv / hy[MST_HYPER_BC2]) + a.eps);
        const double d = ((double)p1[i] - p0[i]) - dw;
        num += d * d, den += dw * dw;
        if (!bf16) continue;
        const uint16_t want[2] = {mst_fp32_to_bf16((float)mm), mst_fp32_to_bf16((float)vv)}, got[2] = {m16[i], v16[i]};
        for (int k = 0; k < 2; k++) *off += got[k] != want[k], *far += abs((int)got[k] - (int)want[k]) > 1;
    }
    *err = st == MST_OK && fabs(ss - ref_ss) <= 1e-5 * ref_ss ? sqrt(num / den) : INFINITY;
    free(g), free(p0), free(p1), free(m0), free(v0), free(m16), free(v16);
    return st;
}

/* Mean ms of `reps` calls of op k after a warm-up call. */
static mst_status time_op(mst_ctx_t* ctx, const mst_model_backend* mo, const optim_bufs* b, int k, int reps, double* ms) {
    const mst_sumsq_args s = sumsq_of(b, b->n);
    const mst_adamw_args a = adamw_of(b, b->n, k == 3);
    double t0 = 0;
    for (int i = 0; i <= reps; i++) {
        if (i == 1) {
            MST_TRY(mst_ctx_sync(ctx));
            t0 = mst_clock_s();
        }
        if (k == 0) MST_TRY(mst_fill(ctx, b->grad, 0, sizeof(float) * (size_t)b->n));
        else if (k == 1) MST_TRY(mo->sumsq(ctx, &s));
        else MST_TRY(mo->adamw(ctx, &a));
    }
    MST_TRY(mst_ctx_sync(ctx));
    *ms = 1e3 * (mst_clock_s() - t0) / reps;
    return MST_OK;
}

/* The copy roof: the device's (roof.c) on CUDA; a host memcpy of 256 MiB
 * (best of 5, bytes read + written) on the CPU. */
static mst_status copy_roof(mst_ctx_t* ctx, double* gbps) {
    if (ctx->kind != MST_BACKEND_CPU) {
        mst_bench_roofs r;
        MST_TRY(mst_bench_roofs_measure(ctx, NULL, &r));
        *gbps = r.copy_gbps;
        return MST_OK;
    }
    const size_t n = (size_t)256 << 20;
    char *a = (char*)malloc(n), *c = (char*)malloc(n);
    if (!a || !c) {
        free(a), free(c);
        return mst_set_error(MST_ERR_OOM, "bench optim: host copy roof");
    }
    memset(a, 1, n), memset(c, 2, n);
    double best = INFINITY;
    for (int i = 0; i < 5; i++) {
        const double t0 = mst_clock_s();
        memcpy(c, a, n);
        const double t = mst_clock_s() - t0;
        best = t < best ? t : best;
    }
    volatile char sink = c[n / 2]; /* the copy is used */
    (void)sink;
    *gbps = 2.0 * (double)n / best / 1e9;
    free(a), free(c);
    return MST_OK;
}

static int write_json(const char* path, const char* device, int64_t n, double roof, const double ms[N_OPS]) {
    FILE* j = mst_out_open("moestash bench optim", path);
    if (!j) return 1;
    fprintf(j, "{\n  \"device\": \"%s\",\n  \"params\": %lld,\n  \"copy_roof_gbps\": %.1f,\n  \"ops\": [\n", device,
            (long long)n, roof);
    for (int k = 0; k < N_OPS; k++) {
        const double gbps = op_bytes[k] * (double)n / (ms[k] * 1e6);
        fprintf(j, "    {\"op\": \"%s\", \"bytes_per_param\": %.0f, \"ms\": %.4f, \"gbps\": %.1f, \"roof_fraction\": %.3f}%s\n",
                op_names[k], op_bytes[k], ms[k], gbps, gbps / roof, k + 1 < N_OPS ? "," : "");
    }
    const double s32 = ms[0] + ms[1] + ms[2], s16 = ms[0] + ms[1] + ms[3];
    fprintf(j, "  ],\n  \"step\": [\n    {\"moments\": \"fp32\", \"bytes_per_param\": 38, \"ms\": %.4f, \"roof_fraction\": %.3f},\n"
               "    {\"moments\": \"bf16\", \"bytes_per_param\": 30, \"ms\": %.4f, \"roof_fraction\": %.3f}\n  ]\n}\n",
            s32, 38.0 * (double)n / (s32 * 1e6) / roof, s16, 30.0 * (double)n / (s16 * 1e6) / roof);
    return mst_out_close("moestash bench optim", path, j);
}

/* Checks, times, prints; 0, 1 (a check failed) or 2 (setup). */
static int run(mst_ctx_t* ctx, const mst_model_backend* mo, int64_t n, int reps, const char* json) {
    optim_bufs b;
    double roof = 0, ms[N_OPS] = {0}, err[2] = {0, 0};
    int64_t off = 0, far = 0, o2 = 0, f2 = 0;
    mst_status st = bufs_make(ctx, n, &b);
    if (st == MST_OK) st = check_adamw(ctx, mo, &b, n < CHECK_N ? n : CHECK_N, 0, &err[0], &o2, &f2);
    if (st == MST_OK) st = check_adamw(ctx, mo, &b, n < CHECK_N ? n : CHECK_N, 1, &err[1], &off, &far);
    const int64_t nc = n < CHECK_N ? n : CHECK_N;
    const int good = st == MST_OK && err[0] < 3e-4 && err[1] < 3e-4 && far == 0 && off * 100 <= 2 * nc;
    if (st == MST_OK)
        printf("check on %lld parameters against float64: master update rel err %.2e (fp32 moments), %.2e (bf16 moments); "
               "bf16 moments %lld of %lld one ulp from the reference's rounding, %lld further%s\n", (long long)nc, err[0],
               err[1], (long long)off, (long long)(2 * nc), (long long)far, good ? "" : "  FAILED");
    for (int k = 0; st == MST_OK && good && k < N_OPS; k++) st = time_op(ctx, mo, &b, k, reps, &ms[k]);
    if (st == MST_OK && good) st = copy_roof(ctx, &roof);
    bufs_free(ctx, &b);
    if (st != MST_OK) {
        fprintf(stderr, "moestash bench optim: %s\n", mst_last_error());
        return 2;
    }
    if (!good) return 1;
    printf("%-22s %9s %10s %9s %8s\n", "pass", "bytes/par", "ms", "GB/s", "of roof");
    for (int k = 0; k < N_OPS; k++) {
        const double gbps = op_bytes[k] * (double)n / (ms[k] * 1e6);
        printf("%-22s %9.0f %10.3f %9.1f %8.3f\n", op_names[k], op_bytes[k], ms[k], gbps, gbps / roof);
    }
    const double s[2] = {ms[0] + ms[1] + ms[2], ms[0] + ms[1] + ms[3]}, bytes[2] = {38, 30};
    for (int i = 0; i < 2; i++)
        printf("%-22s %9.0f %10.3f %9.1f %8.3f\n", i ? "step, bf16 moments" : "step, fp32 moments", bytes[i], s[i],
               bytes[i] * (double)n / (s[i] * 1e6), bytes[i] * (double)n / (s[i] * 1e6) / roof);
    printf("copy roof %.1f GB/s (read + write, %s, same run); %lld parameters, mean of %d calls\n", roof,
           ctx->kind == MST_BACKEND_CPU ? "host memcpy of 256 MiB" : "cudaMemcpyAsync device to device", (long long)n, reps);
    return json && write_json(json, mst_ctx_describe(ctx), n, roof, ms) ? 1 : 0;
}

int mst_bench_optim(int argc, char** argv) {
    mst_args a;
    mst_backend_kind kind = mst_default_backend();
    int64_t n = 0, reps = 0;
    const char* json = NULL;
    int rc = 0;
    mst_args_init(&a, "moestash bench optim", argc, argv);
    while (mst_args_next(&a)) {
        if (mst_args_is(&a, "--params")) rc = mst_args_int(&a, 1, (int64_t)1 << 34, &n);
        else if (mst_args_is(&a, "--reps")) rc = mst_args_int(&a, 1, 100000, &reps);
        else if (mst_args_is(&a, "--backend")) rc = mst_args_backend(&a, &kind);
        else if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench optim [--params N (cuda 268435456, cpu 16777216)] [--reps N (cuda 20, cpu 3)] "
                   "[--backend cpu|cuda] [--json FILE]\n"
                   "  the optimizer's passes (zero main_grad, sum of squares, AdamW with fp32 and bf16 moments): bytes a\n"
                   "  parameter, ms, GB/s and the fraction of the copy roof measured in the same run\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    mst_ctx_t* ctx = NULL;
    const mst_model_backend* mo = NULL;
    if (mst_ctx_create(kind, 0, &ctx) != MST_OK || mst_model_backend_of(ctx, &mo) != MST_OK) {
        fprintf(stderr, "moestash bench optim: --backend: %s\n", mst_last_error());
        mst_ctx_destroy(ctx);
        return 2;
    }
    const int cpu = kind == MST_BACKEND_CPU;
    if (!n) n = cpu ? (int64_t)1 << 24 : (int64_t)1 << 28;
    if (!reps) reps = cpu ? 3 : 20;
    printf("moestash bench optim on %s: the optimizer's passes over %lld parameters\n", mst_ctx_describe(ctx), (long long)n);
    rc = run(ctx, mo, n, (int)reps, json);
    mst_ctx_destroy(ctx);
    return rc;
}
