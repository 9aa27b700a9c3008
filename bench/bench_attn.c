/*
 * bench_attn.c — `moestash bench attn [--seq T] [--batch B] [--heads NH]
 * [--kv-heads KV] [--head-dim D] [--reps N] [--backend cpu|cuda]`: the
 * trainer's causal grouped-query attention under its two contracts
 * (model_backend.h), in the same run: flash (saves the output and the row
 * logsumexp; fused kernels on CUDA) against the probabilities path (saves
 * P [B, NH, T, T]; cuBLAS on CUDA). Defaults: the h100 preset's attention
 * (B 2, 16 heads, D 128) at T 2048 and 4096 (--seq picks one T), each with
 * KV = NH (no grouping) and KV 4 (groups of 4 query heads at NH 16;
 * Qwen3-30B-A3B has 32 / 4); --kv-heads picks one KV.
 *
 * Each case is checked first (flash against the probabilities path: bf16
 * relative error of out and dqkv < 2e-2, else exit 1), then forward and
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

#include "trainer/model_ops/model_backend.h"
#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"

typedef struct attn_fig {
    int64_t T, KV;
    double ms[2][2];          /* [flash, probabilities][forward, backward] */
    double err_out, err_dqkv; /* flash against the probabilities path     */
    double saved[2], scratch[2]; /* bytes                                  */
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

/* Mean ms of `reps` calls of one slot after a warm-up call. */
static mst_status time_op(mst_ctx_t* ctx, mst_status (*op)(mst_ctx_t*, const mst_attn_args*),
                          const mst_attn_args* a, int reps, double* ms) {
    MST_TRY(op(ctx, a));
    MST_TRY(mst_ctx_sync(ctx));
    const double t0 = mst_clock_s();
    for (int i = 0; i < reps; i++) MST_TRY(op(ctx, a));
    MST_TRY(mst_ctx_sync(ctx));
    *ms = 1e3 * (mst_clock_s() - t0) / reps;
    return MST_OK;
}

static mst_status run_t(mst_ctx_t* ctx, const mst_model_backend* mo, mst_attn_args z, int reps, attn_fig* f) {
    attn_mem b = {0};
    mst_status st = mem_alloc(ctx, &z, &b);
    const size_t N = (size_t)(z.batch * z.seq), H = width_out(&z), W = width_qkv(&z);
    const double rows = (double)(z.batch * z.n_head * z.seq), tt = rows * (double)z.seq;
    if (st == MST_OK) st = upload_random(ctx, b.qkv, N * W, 11);
    if (st == MST_OK) st = upload_random(ctx, b.dout, N * H, 12);
    mst_attn_args fl = z, pr = z;
    fl.qkv = pr.qkv = b.qkv;
    fl.dout = pr.dout = b.dout;
    fl.out = b.out, fl.dqkv = b.dqkv, fl.lse = b.lse, fl.delta = b.delta;
    pr.out = b.out_p, pr.dqkv = b.dqkv_p, pr.probs = b.probs;
    if (mo->attn_scratch) pr.scratch32 = b.s32, pr.scratch16 = b.s16;
    if (st == MST_OK && mo->attn_flash_check) st = mo->attn_flash_check(ctx, &fl);
    if (st == MST_OK) st = mo->attn_flash_forward(ctx, &fl);
    if (st == MST_OK) st = mo->attn_flash_backward(ctx, &fl);
    if (st == MST_OK) st = mo->attn_forward(ctx, &pr);
    if (st == MST_OK) st = mo->attn_backward(ctx, &pr);
    if (st == MST_OK) st = rel_err(ctx, b.out, b.out_p, N * H, &f->err_out);
    if (st == MST_OK) st = rel_err(ctx, b.dqkv, b.dqkv_p, N * W, &f->err_dqkv);
    if (st == MST_OK) st = time_op(ctx, mo->attn_flash_forward, &fl, reps, &f->ms[0][0]);
    if (st == MST_OK) st = time_op(ctx, mo->attn_flash_backward, &fl, reps, &f->ms[0][1]);
    if (st == MST_OK) st = time_op(ctx, mo->attn_forward, &pr, reps, &f->ms[1][0]);
    if (st == MST_OK) st = time_op(ctx, mo->attn_backward, &pr, reps, &f->ms[1][1]);
    f->T = z.seq, f->KV = z.n_kv_head;
    f->saved[0] = 2.0 * (double)(N * H) + 4 * rows;
    f->saved[1] = 2.0 * (double)(N * H) + 4 * tt;
    f->scratch[0] = 4 * rows;
    f->scratch[1] = mo->attn_scratch ? 6 * tt : 0;
    mem_free(ctx, &b);
    return st;
}

/* One case: checked, timed, two lines printed; 0 when it failed. */
static int run_case(mst_ctx_t* ctx, const mst_model_backend* mo, mst_attn_args z, int reps) {
    attn_fig f = {0};
    if (run_t(ctx, mo, z, reps, &f) != MST_OK) {
        fprintf(stderr, "moestash bench attn: T %lld KV %lld: %s\n", (long long)z.seq, (long long)z.n_kv_head,
                mst_last_error());
        return 0;
    }
    const double T = (double)z.seq, MiB = 1 << 20;
    const double fl = 2.0 * (double)(z.batch * z.n_head) * T * T * (double)z.head_dim;
    const int good = f.err_out < 2e-2 && f.err_dqkv < 2e-2;
    printf("T %5lld KV %3lld  flash fwd %8.3f ms %6.1f TFLOP/s  bwd %8.3f ms %6.1f TFLOP/s | probabilities fwd "
           "%8.3f ms %6.1f TFLOP/s  bwd %8.3f ms %6.1f TFLOP/s | flash faster: fwd %.2fx bwd %.2fx\n",
           (long long)f.T, (long long)f.KV, f.ms[0][0], fl / f.ms[0][0] * 1e-9, f.ms[0][1],
           2.5 * fl / f.ms[0][1] * 1e-9, f.ms[1][0], fl / f.ms[1][0] * 1e-9, f.ms[1][1],
           2.5 * fl / f.ms[1][1] * 1e-9, f.ms[1][0] / f.ms[0][0], f.ms[1][1] / f.ms[0][1]);
    printf("                saved per layer: flash %.1f MiB, probabilities %.1f MiB; backward scratch %.1f / %.1f "
           "MiB; flash vs probabilities rel err out %.2e dqkv %.2e%s\n",
           f.saved[0] / MiB, f.saved[1] / MiB, f.scratch[0] / MiB, f.scratch[1] / MiB, f.err_out, f.err_dqkv,
           good ? "" : "  FAILED");
    return good;
}

int mst_bench_attn(int argc, char** argv) {
    mst_args a;
    int64_t T = 0, B = 2, NH = 16, KV = 0, D = 128, reps = 10;
    mst_backend_kind kind = mst_default_backend();
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
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench attn [--seq T (2048 and 4096)] [--batch B (2)] [--heads NH (16)] "
                   "[--kv-heads KV (NH and 4)] [--head-dim D (128)] [--reps N (10)] [--backend cpu|cuda]\n");
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
    const int64_t seqs[2] = {T ? T : 2048, 4096};
    const int n_seq = T ? 1 : 2;
    const int64_t kvs[2] = {KV ? KV : NH, 4};
    const int n_kv = !KV && NH > 4 && NH % 4 == 0 ? 2 : 1;
    printf("moestash bench attn on %s: causal attention, B %lld, heads %lld, D %lld; flash (saves out + lse) vs "
           "the probabilities path (saves P; cuBLAS on cuda), %lld calls each; TFLOP/s of the causal half: fwd "
           "2 B NH T^2 D, bwd 5 B NH T^2 D (KV key-value heads: the same FLOPs)\n",
           mst_ctx_describe(ctx), (long long)B, (long long)NH, (long long)D, (long long)reps);
    int ok = 1;
    for (int i = 0; i < n_seq && ok; i++)
        for (int j = 0; j < n_kv && ok; j++) {
            const mst_attn_args z = {.batch = B, .seq = seqs[i], .n_head = NH, .n_kv_head = kvs[j], .head_dim = D};
            ok = run_case(ctx, mo, z, (int)reps);
        }
    mst_ctx_destroy(ctx);
    return ok ? 0 : 1;
}
