/*
 * bench_attn.c — `moestash bench attn [--seq T] [--batch B] [--heads NH]
 * [--kv-heads KV] [--head-dim D] [--reps N] [--backend cpu|cuda] [--json
 * FILE]`: the trainer's causal grouped-query attention, in the same run:
 * our flash kernels and cuDNN's fused attention (both the flash contract:
 * save the output and the row logsumexp; cuDNN's backward deterministic,
 * and its nondeterministic one to say what determinism costs) against the
 * probabilities path (saves P [B, NH, T, T]; cuBLAS on CUDA). cuDNN where
 * the library loads (else the reason is printed and the rest measured).
 * Defaults: the h100 preset's attention (B 2, 16 heads, D 128) at T 2048
 * and 8192 (--seq picks one T), each with KV = NH (no grouping) and KV 4
 * (groups of 4 query heads at NH 16; Qwen3-30B-A3B has 32 / 4); --kv-heads
 * picks one KV. bench/torch/attn.py times PyTorch's SDPA backends on the
 * cases of --json's file and prints the ratios.
 *
 * Each case is checked first (each implementation against the probabilities
 * path: bf16 relative error of out and dqkv < 2e-2, else exit 1), then forward and
 * backward are timed apart: the mean of N calls between two syncs (host
 * clock), after one warm-up call. FLOPs counted: the causal half of the
 * GEMMs, per query head (KV does not change them: every query head still
 * scores T^2 / 2 keys; grouping only shares the k and v operands),
 * forward 2 B NH T^2 D (q k^T and P v), backward 5 B NH T^2 D (recomputed
 * q k^T, dO v^T, P^T dO, dS^T q, dS k); the flash backward runs two more
 * (q k^T and dO v^T again in its dq pass) that are not counted.
 * Memory: what forward saves for backward, and the backward's scratch.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/model_ops/model_backend.h"
#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"

/* The implementations timed: our flash kernels, cuDNN's fused attention
 * (deterministic backward, and the nondeterministic one to price it), the
 * probabilities path. */
enum { IMPL_FLASH = 0, IMPL_CUDNN, IMPL_CUDNN_ND, IMPL_PROBS, N_IMPL };
static const char* const impl_name[N_IMPL] = {"flash", "cudnn", "cudnn_nondet", "probabilities"};

typedef struct attn_fig {
    int64_t T, KV;
    int has[N_IMPL];              /* measured (cuDNN: the library loads and takes the dims) */
    double ms[N_IMPL][2];         /* [impl][forward, backward]                               */
    double err[N_IMPL][2];        /* out, dqkv against the probabilities path               */
    double saved[2], scratch[2];  /* bytes: [flash contract, probabilities]                  */
} attn_fig;

/* Backend buffers of one T (both contracts). */
typedef struct attn_mem {
    uint16_t *qkv, *dout, *out, *dqkv, *out_p, *dqkv_p, *s16; /* [N, W] [N, HO] ... [B, NH, T, T] */
    float *lse, *delta, *probs, *s32;                          /* [B, NH, T] x2, [B, NH, T, T] x2 */
} attn_mem;

/* Row widths: qkv W = (NH + 2 KV) D, out HO = NH D. */
static size_t width_qkv(const mst_attn_args* z) { return (size_t)((z->n_head + 2 * z->n_kv_head) * z->head_dim); }
static size_t width_out(const mst_attn_args* z) { return (size_t)(z->n_head * z->head_dim); }

static mst_status mem_alloc(mst_ctx_t* ctx, const mst_attn_args* z, attn_mem* b) {
    const size_t N = (size_t)(z->batch * z->seq), H = width_out(z), W = width_qkv(z);
    const size_t rows = (size_t)(z->batch * z->n_head * z->seq), tt = rows * (size_t)z->seq;
    MST_TRY(mst_alloc(ctx, 2 * N * W, (void**)&b->qkv));
    MST_TRY(mst_alloc(ctx, 2 * N * H, (void**)&b->dout));
    MST_TRY(mst_alloc(ctx, 2 * N * H, (void**)&b->out));
    MST_TRY(mst_alloc(ctx, 2 * N * W, (void**)&b->dqkv));
    MST_TRY(mst_alloc(ctx, 2 * N * H, (void**)&b->out_p));
    MST_TRY(mst_alloc(ctx, 2 * N * W, (void**)&b->dqkv_p));
    MST_TRY(mst_alloc(ctx, 4 * rows, (void**)&b->lse));
    MST_TRY(mst_alloc(ctx, 4 * rows, (void**)&b->delta));
    MST_TRY(mst_alloc(ctx, 4 * tt, (void**)&b->probs));
    MST_TRY(mst_alloc(ctx, 4 * tt, (void**)&b->s32));
    return mst_alloc(ctx, 2 * tt, (void**)&b->s16);
}

static void mem_free(mst_ctx_t* ctx, attn_mem* b) {
    void* all[] = {b->qkv, b->dout, b->out, b->dqkv, b->out_p, b->dqkv_p, b->s16, b->lse, b->delta, b->probs, b->s32};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (all[i]) mst_free(ctx, all[i]);
}

/* n random bf16 in [-1, 1) from seed into backend memory dst. */
static mst_status upload_random(mst_ctx_t* ctx, uint16_t* dst, size_t n, uint64_t seed) {
    float* f = (float*)malloc(4 * n);
    uint16_t* h = (uint16_t*)malloc(2 * n);
    mst_status st = f && h ? MST_OK : mst_set_error(MST_ERR_OOM, "bench attn inputs");
    for (size_t i = 0; st == MST_OK && i < n; i++) f[i] = (float)(2.0 * mst_splitmix_unit(&seed) - 1.0);
    if (st == MST_OK) mst_fp32_to_bf16_array(h, f, n);
    if (st == MST_OK) st = mst_copy_h2b(ctx, dst, h, 2 * n);
    free(f), free(h);
    return st;
}

/* ||x - y|| / ||y|| over n bf16 values of backend memory. */
static mst_status rel_err(mst_ctx_t* ctx, const uint16_t* x, const uint16_t* y, size_t n, double* err) {
    uint16_t *a = (uint16_t*)malloc(2 * n), *b = (uint16_t*)malloc(2 * n);
    mst_status st = a && b ? MST_OK : mst_set_error(MST_ERR_OOM, "bench attn check");
    if (st == MST_OK) st = mst_copy_b2h(ctx, a, x, 2 * n);
    if (st == MST_OK) st = mst_copy_b2h(ctx, b, y, 2 * n);
    double num = 0, den = 0;
    for (size_t i = 0; st == MST_OK && i < n; i++) {
        const double u = mst_bf16_to_fp32(a[i]), v = mst_bf16_to_fp32(b[i]);
        num += (u - v) * (u - v);
        den += v * v;
    }
    *err = den > 0 ? sqrt(num / den) : sqrt(num);
    free(a), free(b);
    return st;
}

typedef mst_status (*attn_op)(mst_ctx_t* ctx, const mst_attn_args* a);

/* Mean ms of `reps` calls of one slot after a warm-up call. */
static mst_status time_op(mst_ctx_t* ctx, attn_op op, const mst_attn_args* a, int reps, double* ms) {
    MST_TRY(op(ctx, a));
    MST_TRY(mst_ctx_sync(ctx));
    const double t0 = mst_clock_s();
    for (int i = 0; i < reps; i++) MST_TRY(op(ctx, a));
    MST_TRY(mst_ctx_sync(ctx));
    *ms = 1e3 * (mst_clock_s() - t0) / reps;
    return MST_OK;
}

/* cuDNN on a call: the library and its plans for a's dims (MST_OK), or
 * MST_ERR_UNSUPPORTED with the reason in why (not a failure of the bench). */
static mst_status cudnn_ready(mst_ctx_t* ctx, const mst_model_backend* mo, const mst_attn_args* a, char* why,
                              size_t n) {
    mst_status st = mo->attn_cudnn_check ? mo->attn_cudnn_check(ctx, a)
                                         : mst_set_error(MST_ERR_UNSUPPORTED, "backend %s has none", mo->name);
    if (st == MST_ERR_UNSUPPORTED) snprintf(why, n, "%s", mst_last_error());
    return st;
}

/* Forward and backward of one implementation, then its out and dqkv
 * against the probabilities path's. */
static mst_status check_impl(mst_ctx_t* ctx, const attn_op ops[2], const mst_attn_args* a, const attn_mem* b,
                             double err[2]) {
    MST_TRY(ops[0](ctx, a));
    MST_TRY(ops[1](ctx, a));
    const size_t N = (size_t)(a->batch * a->seq);
    MST_TRY(rel_err(ctx, b->out, b->out_p, N * width_out(a), &err[0]));
    return rel_err(ctx, b->dqkv, b->dqkv_p, N * width_qkv(a), &err[1]);
}

static mst_status run_t(mst_ctx_t* ctx, const mst_model_backend* mo, mst_attn_args z, int reps, attn_fig* f,
                        char* cudnn_why, size_t why_n) {
    attn_mem b = {0};
    mst_status st = mem_alloc(ctx, &z, &b);
    const size_t N = (size_t)(z.batch * z.seq), H = width_out(&z), W = width_qkv(&z);
    const double rows = (double)(z.batch * z.n_head * z.seq), tt = rows * (double)z.seq;
    if (st == MST_OK) st = upload_random(ctx, b.qkv, N * W, 11);
    if (st == MST_OK) st = upload_random(ctx, b.dout, N * H, 12);
    mst_attn_args a[N_IMPL];
    for (int i = 0; i < N_IMPL; i++) {
        a[i] = z;
        a[i].qkv = b.qkv, a[i].dout = b.dout;
        a[i].out = b.out, a[i].dqkv = b.dqkv, a[i].lse = b.lse, a[i].delta = b.delta;
    }
    a[IMPL_CUDNN_ND].nondeterministic = 1;
    a[IMPL_PROBS].out = b.out_p, a[IMPL_PROBS].dqkv = b.dqkv_p, a[IMPL_PROBS].lse = NULL, a[IMPL_PROBS].delta = NULL;
    a[IMPL_PROBS].probs = b.probs;
    if (mo->attn_scratch) a[IMPL_PROBS].scratch32 = b.s32, a[IMPL_PROBS].scratch16 = b.s16;
    const attn_op op[N_IMPL][2] = {{mo->attn_flash_forward, mo->attn_flash_backward},
                                   {mo->attn_cudnn_forward, mo->attn_cudnn_backward},
                                   {mo->attn_cudnn_forward, mo->attn_cudnn_backward},
                                   {mo->attn_forward, mo->attn_backward}};
    /* which run here: flash where the backend takes the dims, cuDNN where it loads */
    f->has[IMPL_PROBS] = 1;
    f->has[IMPL_FLASH] = st == MST_OK && (!mo->attn_flash_check || mo->attn_flash_check(ctx, &a[IMPL_FLASH]) == MST_OK);
    for (int i = IMPL_CUDNN; i <= IMPL_CUDNN_ND && st == MST_OK; i++) {
        const mst_status c = cudnn_ready(ctx, mo, &a[i], cudnn_why, why_n);
        f->has[i] = c == MST_OK;
        if (c != MST_OK && c != MST_ERR_UNSUPPORTED) st = c;
    }
    /* checked: each against the probabilities path */
    if (st == MST_OK) st = op[IMPL_PROBS][0](ctx, &a[IMPL_PROBS]);
    if (st == MST_OK) st = op[IMPL_PROBS][1](ctx, &a[IMPL_PROBS]);
    for (int i = 0; i < IMPL_PROBS && st == MST_OK; i++)
        if (f->has[i]) st = check_impl(ctx, op[i], &a[i], &b, f->err[i]);
    for (int i = 0; i < N_IMPL && st == MST_OK; i++) {
        if (!f->has[i]) continue;
        if (i == IMPL_CUDNN_ND) f->ms[i][0] = f->ms[IMPL_CUDNN][0]; /* the same forward */
        else st = time_op(ctx, op[i][0], &a[i], reps, &f->ms[i][0]);
        if (st == MST_OK) st = time_op(ctx, op[i][1], &a[i], reps, &f->ms[i][1]);
    }
    f->T = z.seq, f->KV = z.n_kv_head;
    f->saved[0] = 2.0 * (double)(N * H) + 4 * rows;
    f->saved[1] = 2.0 * (double)(N * H) + 4 * tt;
    f->scratch[0] = 4 * rows;
    f->scratch[1] = mo->attn_scratch ? 6 * tt : 0;
    mem_free(ctx, &b);
    return st;
}

/* TFLOP/s of the causal half: forward 2 B NH T^2 D, backward 2.5 times that. */
static double tflops(const mst_attn_args* z, double ms, int backward) {
    const double T = (double)z->seq, fl = 2.0 * (double)(z->batch * z->n_head) * T * T * (double)z->head_dim;
    return (backward ? 2.5 : 1.0) * fl / ms * 1e-9;
}

/* One case: checked, timed, its lines printed; 0 when it failed. */
static int run_case(mst_ctx_t* ctx, const mst_model_backend* mo, mst_attn_args z, int reps, attn_fig* f,
                    char* cudnn_why, size_t why_n) {
    if (run_t(ctx, mo, z, reps, f, cudnn_why, why_n) != MST_OK) {
        fprintf(stderr, "moestash bench attn: T %lld KV %lld: %s\n", (long long)z.seq, (long long)z.n_kv_head,
                mst_last_error());
        return 0;
    }
    const double MiB = 1 << 20;
    int good = 1;
    printf("T %5lld KV %3lld       fwd ms  TFLOP/s     bwd ms  TFLOP/s   rel err out  dqkv (vs probabilities)\n",
           (long long)f->T, (long long)f->KV);
    for (int i = 0; i < N_IMPL; i++) {
        if (!f->has[i]) continue;
        const int ok = i == IMPL_PROBS || (f->err[i][0] < 2e-2 && f->err[i][1] < 2e-2);
        good &= ok;
        printf("  %-13s %9.3f %8.1f  %9.3f %8.1f", impl_name[i], f->ms[i][0], tflops(&z, f->ms[i][0], 0),
               f->ms[i][1], tflops(&z, f->ms[i][1], 1));
        if (i != IMPL_PROBS) printf("   %.2e  %.2e%s", f->err[i][0], f->err[i][1], ok ? "" : "  FAILED");
        printf("\n");
    }
    if (f->has[IMPL_CUDNN] && f->has[IMPL_FLASH])
        printf("  cudnn / flash: fwd %.2fx bwd %.2fx faster", f->ms[IMPL_FLASH][0] / f->ms[IMPL_CUDNN][0],
               f->ms[IMPL_FLASH][1] / f->ms[IMPL_CUDNN][1]);
    if (f->has[IMPL_CUDNN] && f->has[IMPL_CUDNN_ND])
        printf("; cudnn's deterministic backward takes %.2fx the nondeterministic one's time",
               f->ms[IMPL_CUDNN][1] / f->ms[IMPL_CUDNN_ND][1]);
    printf("\n  saved per layer: flash contract %.1f MiB, probabilities %.1f MiB; backward scratch %.1f / %.1f MiB\n",
           f->saved[0] / MiB, f->saved[1] / MiB, f->scratch[0] / MiB, f->scratch[1] / MiB);
    return good;
}

static void write_json(FILE* out, const char* device, const mst_attn_args* z0, const char* cudnn, const attn_fig* f,
                       int n) {
    fprintf(out, "{\n  \"bench\": \"attn\",\n  \"device\": \"%s\",\n  \"B\": %lld,\n  \"heads\": %lld,\n"
                 "  \"head_dim\": %lld,\n  \"causal\": true,\n  \"cudnn\": \"%s\",\n  \"cases\": [\n",
            device, (long long)z0->batch, (long long)z0->n_head, (long long)z0->head_dim, cudnn);
    for (int k = 0; k < n; k++) {
        mst_attn_args z = *z0;
        z.seq = f[k].T;
        fprintf(out, "    {\"T\": %lld, \"KV\": %lld", (long long)f[k].T, (long long)f[k].KV);
        for (int i = 0; i < N_IMPL; i++)
            if (f[k].has[i])
                fprintf(out, ", \"%s\": {\"fwd_ms\": %.4f, \"bwd_ms\": %.4f, \"fwd_tflops\": %.1f, \"bwd_tflops\": "
                             "%.1f, \"err_out\": %.3e, \"err_dqkv\": %.3e}",
                        impl_name[i], f[k].ms[i][0], f[k].ms[i][1], tflops(&z, f[k].ms[i][0], 0),
                        tflops(&z, f[k].ms[i][1], 1), f[k].err[i][0], f[k].err[i][1]);
        fprintf(out, "}%s\n", k + 1 < n ? "," : "");
    }
    fprintf(out, "  ]\n}\n");
}

int mst_bench_attn(int argc, char** argv) {
    mst_args a;
    int64_t T = 0, B = 2, NH = 16, KV = 0, D = 128, reps = 10;
    mst_backend_kind kind = mst_default_backend();
    const char* json = NULL;
    int rc = 0;
    mst_args_init(&a, "moestash bench attn", argc, argv);
    while (mst_args_next(&a)) {
        if (mst_args_is(&a, "--seq")) rc = mst_args_int(&a, 2, 32768, &T);
        else if (mst_args_is(&a, "--batch")) rc = mst_args_int(&a, 1, 4096, &B);
        else if (mst_args_is(&a, "--heads")) rc = mst_args_int(&a, 1, 1024, &NH);
        else if (mst_args_is(&a, "--kv-heads")) rc = mst_args_int(&a, 1, 1024, &KV);
        else if (mst_args_is(&a, "--head-dim")) rc = mst_args_int(&a, 8, 1024, &D);
        else if (mst_args_is(&a, "--reps")) rc = mst_args_int(&a, 1, 10000, &reps);
        else if (mst_args_is(&a, "--backend")) rc = mst_args_backend(&a, &kind);
        else if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench attn [--seq T (2048 and 8192)] [--batch B (2)] [--heads NH (16)] "
                   "[--kv-heads KV (NH and 4)] [--head-dim D (128)] [--reps N (10)] [--backend cpu|cuda] "
                   "[--json FILE]\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (KV && NH % KV != 0) {
        char v[32];
        snprintf(v, sizeof v, "%lld", (long long)KV);
        return mst_cli_bad("moestash bench attn", "--kv-heads", v, "must divide --heads");
    }
    mst_ctx_t* ctx = NULL;
    const mst_model_backend* mo = NULL;
    if (mst_ctx_create(kind, 0, &ctx) != MST_OK || mst_model_backend_of(ctx, &mo) != MST_OK) {
        fprintf(stderr, "moestash bench attn: --backend: %s\n", mst_last_error());
        mst_ctx_destroy(ctx);
        return 2;
    }
    const int64_t seqs[2] = {T ? T : 2048, 8192};
    const int n_seq = T ? 1 : 2;
    const int64_t kvs[2] = {KV ? KV : NH, 4};
    const int n_kv = !KV && NH > 4 && NH % 4 == 0 ? 2 : 1;
    printf("moestash bench attn on %s: causal attention, B %lld, heads %lld, D %lld; our flash kernels and cuDNN's "
           "fused attention (both save out + lse; cuDNN's backward deterministic, and nondeterministic to price it) "
           "vs the probabilities path (saves P; cuBLAS on cuda), %lld calls each; TFLOP/s of the causal half: fwd "
           "2 B NH T^2 D, bwd 5 B NH T^2 D (KV key-value heads: the same FLOPs)\n",
           mst_ctx_describe(ctx), (long long)B, (long long)NH, (long long)D, (long long)reps);
    char cudnn_why[400] = "";
    attn_fig figs[4];
    int ok = 1, n = 0;
    for (int i = 0; i < n_seq && ok; i++)
        for (int j = 0; j < n_kv && ok; j++) {
            const mst_attn_args z = {.batch = B, .seq = seqs[i], .n_head = NH, .n_kv_head = kvs[j], .head_dim = D};
            memset(&figs[n], 0, sizeof figs[n]);
            ok = run_case(ctx, mo, z, (int)reps, &figs[n], cudnn_why, sizeof cudnn_why);
            n += ok;
        }
    if (cudnn_why[0]) printf("cudnn: not measured: %s\n", cudnn_why);
    if (n) { /* the short table */
        printf("\n%6s %4s | %-21s | %-21s | %s\n", "T", "KV", "flash fwd/bwd TFLOP/s", "cudnn fwd/bwd TFLOP/s",
               "cudnn bwd nondet");
        for (int k = 0; k < n; k++) {
            mst_attn_args z = {.batch = B, .seq = figs[k].T, .n_head = NH, .head_dim = D};
            const attn_fig* f = &figs[k];
            printf("%6lld %4lld | %9.1f %9.1f   | ", (long long)f->T, (long long)f->KV,
                   f->has[IMPL_FLASH] ? tflops(&z, f->ms[IMPL_FLASH][0], 0) : 0.0,
                   f->has[IMPL_FLASH] ? tflops(&z, f->ms[IMPL_FLASH][1], 1) : 0.0);
            if (f->has[IMPL_CUDNN])
                printf("%9.1f %9.1f   | %9.1f\n", tflops(&z, f->ms[IMPL_CUDNN][0], 0), tflops(&z, f->ms[IMPL_CUDNN][1], 1),
                       f->has[IMPL_CUDNN_ND] ? tflops(&z, f->ms[IMPL_CUDNN_ND][1], 1) : 0.0);
            else printf("%21s | %s\n", "n/a", "n/a");
        }
    }
    if (json) {
        const mst_attn_args z0 = {.batch = B, .n_head = NH, .head_dim = D};
        FILE* out = mst_out_open("moestash bench attn", json);
        if (!out) ok = 0;
        else {
            write_json(out, mst_ctx_describe(ctx), &z0, cudnn_why[0] ? "unavailable" : "measured", figs, n);
            if (mst_out_close("moestash bench attn", json, out)) ok = 0;
        }
    }
    mst_ctx_destroy(ctx);
    return ok ? 0 : 1;
}
