/*
 * bench_train.c — `moestash bench train [--steps S] [--preset h100]
 * [--policies keep,stash] [--ops] [--json FILE]`: the trainer's whole optimizer step,
 * eager against replayed from its captured CUDA graph, on the GPU default
 * configuration of `moestash train` and, with --preset, on that preset.
 *
 * Each (configuration, policy) is one training run of 2 S steps on one
 * model: steps 1 .. S eager (step 1 measures), steps S+1 .. 2S with the
 * graph (S+1 runs eagerly since the sizes are known, S+2 captures and
 * replays). Timed: the median step of steps 3 .. S (eager) and S+3 .. 2S
 * (graph), host wall clock from the upload of the step's inputs to its
 * record read back.
 *
 * Model FLOPs of a step (stated in the output), Qwen3-MoE with grouped-
 * query attention (NH query heads, KV key-value heads of dim D) and top-k:
 *   6 x active parameters x tokens + attention,
 *   active parameters per token = (L + 1) ((NH + 2 KV) D H + H NH D + E H
 *     + k 3 F H) (q/k/v and o projections, router over all E experts, the
 *     k chosen experts' gate/up 2F x H and down H x F; the MTP layer
 *     counted as layer L) + 2 H^2 (MTP projection) + 2 H V (the head, used
 *     by the next-token and the MTP loss, tied or not),
 *   attention = 6 T^2 NH D per layer and sequence (QK^T and PV of every
 *     query head, forward and backward, the causal half of the score
 *     matrix; grouping the keys and values saves no FLOPs).
 * QK-norm, rotary embedding, norms, softmax and SwiGLU's elementwise work
 * are not counted.
 * MFU = model TFLOP/s / the dense cuBLAS bf16 TFLOP/s of an 8192^3 GEMM
 * (bf16 in, fp32 accumulate) measured in the same run. --ops adds a per-op
 * time table of one eager sized step for each run (see op_table).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "lib/internal.h"
#include "trainer/model_ops/model_backend.h"
#include "trainer/model/model.h"
#include "trainer/run/trainer.h"

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

/* Median of v[0 .. n) (sorted in place). */
static double median(double* v, int64_t n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}


/* Dense cuBLAS bf16 TFLOP/s: n^3 GEMMs (bf16 out), 20 timed after 3. */
static mst_status dense_tflops(mst_ctx_t* ctx, double* out) {
    const int64_t n = 8192;
    void *a = NULL, *b = NULL, *c = NULL;
    const mst_model_backend* ops = NULL;
    MST_TRY(mst_model_backend_of(ctx, &ops));
    mst_status st = mst_alloc(ctx, (size_t)(n * n * 2), &a);
    if (st == MST_OK) st = mst_alloc(ctx, (size_t)(n * n * 2), &b);
    if (st == MST_OK) st = mst_alloc(ctx, (size_t)(n * n * 2), &c);
    if (st == MST_OK) st = mst_fill(ctx, a, 0x3c, (size_t)(n * n * 2)); /* bf16 0x3c3c: about 0.0115 */
    if (st == MST_OK) st = mst_fill(ctx, b, 0x3c, (size_t)(n * n * 2));
    mst_mm_args g = {.trans_b = 1, .m = n, .n = n, .k = n, .a = a, .lda = n, .b = b, .ldb = n, .c16 = c, .ldc = n};
    double t0 = 0;
    for (int i = 0; i < 23 && st == MST_OK; i++) {
        if (i == 3) {
            st = mst_ctx_sync(ctx);
            t0 = mst_clock_s();
        }
        if (st == MST_OK) st = ops->mm(ctx, &g);
    }
    if (st == MST_OK) st = mst_ctx_sync(ctx);
    if (st == MST_OK) *out = 20 * 2.0 * (double)n * n * n / (mst_clock_s() - t0) / 1e12;
    mst_free(ctx, a), mst_free(ctx, b), mst_free(ctx, c);
    return st;
}

/* ---- per-op time table of one eager sized step ------------------------------
 * The context's library ops and the model's ops are swapped for wrappers
 * that synchronize before and after each call and add its wall time to its
 * row: the ops serialized (side-stream copies no longer overlap), each
 * with its launch cost, so the rows add up to more than the step. */

typedef struct op_row {
    const char* name;
    double s;
    int64_t n;
} op_row;

static op_row g_rows[48];
static int g_n_rows;
static const mst_backend* g_be;        /* the real tables */
static const mst_model_backend* g_mo;

static void op_add(const char* name, double s) {
    int i = 0;
    while (i < g_n_rows && strcmp(g_rows[i].name, name) != 0) i++;
    if (i == g_n_rows) {
        if (g_n_rows == 48) return;
        g_rows[g_n_rows++] = (op_row){name, 0, 0};
    }
    g_rows[i].s += s;
    g_rows[i].n++;
}

#define TIMED(name, call)                       \
    do {                                        \
        g_be->sync(ctx);                        \
        const double t0_ = mst_clock_s();             \
        const mst_status st_ = (call);          \
        g_be->sync(ctx);                        \
        op_add(name, mst_clock_s() - t0_);            \
        return st_;                             \
    } while (0)
#define WRAP_MODEL(slot, T) \
    static mst_status wm_##slot(mst_ctx_t* ctx, const T* a) { TIMED(#slot, g_mo->slot(ctx, a)); }
#define WRAP_LIB(slot, T) \
    static mst_status wl_##slot(mst_ctx_t* ctx, const T* a) { TIMED(#slot, g_be->slot(ctx, a)); }
WRAP_MODEL(mm, mst_mm_args)
WRAP_MODEL(norm_forward, mst_norm_args)
WRAP_MODEL(norm_backward, mst_norm_args)
WRAP_MODEL(add, mst_add_args)
WRAP_MODEL(embed_forward, mst_embed_args)
WRAP_MODEL(embed_backward, mst_embed_args)
WRAP_MODEL(xent, mst_xent_args)
WRAP_MODEL(attn_forward, mst_attn_args)
WRAP_MODEL(attn_backward, mst_attn_args)
WRAP_MODEL(attn_flash_forward, mst_attn_args)
WRAP_MODEL(attn_flash_backward, mst_attn_args)
WRAP_MODEL(attn_cudnn_forward, mst_attn_args)
WRAP_MODEL(attn_cudnn_backward, mst_attn_args)
WRAP_MODEL(route_forward, mst_route_args)
WRAP_MODEL(route_backward, mst_route_args)
WRAP_MODEL(rows_gather, mst_rows_args)
WRAP_MODEL(rows_sum, mst_rows_args)
WRAP_MODEL(sumsq, mst_sumsq_args)
WRAP_MODEL(adamw, mst_adamw_args)
WRAP_MODEL(sum, mst_sum_args)
WRAP_LIB(gl_forward, mst_gl_args)
WRAP_LIB(gl_dgrad, mst_gl_args)
WRAP_LIB(gl_wgrad, mst_gl_args)
WRAP_LIB(act_forward, mst_act_args)
WRAP_LIB(act_backward, mst_act_args)
WRAP_LIB(stash_reset, struct mst_stash_args)
WRAP_LIB(stash_save, struct mst_stash_args)
WRAP_LIB(stash_restore, struct mst_stash_args)
WRAP_LIB(stash_batch, struct mst_stash_batch)
static mst_status wl_copy(mst_ctx_t* ctx, void* dst, const void* src, size_t n, mst_copy_dir dir) {
    TIMED("copy", g_be->copy(ctx, dst, src, n, dir));
}
static mst_status wl_fill(mst_ctx_t* ctx, void* dst, int byte, size_t n) { TIMED("fill", g_be->fill(ctx, dst, byte, n)); }

static int cmp_row(const void* a, const void* b) {
    double x = ((const op_row*)a)->s, y = ((const op_row*)b)->s;
    return (x < y) - (x > y);
}

/* One model of cfg: a measuring and a sized step, then one sized step
 * timed whole and one with every op timed; the table to stdout. */
static mst_status op_table(mst_ctx_t* ctx, const mst_train_config* cfg, const char* label) {
    mst_data d;
    MST_TRY(mst_data_synthetic(&d, cfg->model.seed, 1 << 20));
    const int64_t per = cfg->model.batch * (cfg->model.seq + 2);
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)(per * cfg->microbatches));
    mst_model* m = NULL;
    mst_status st = tok ? mst_model_create(ctx, &cfg->model, cfg->microbatches, &cfg->mem, &m)
                        : mst_set_error(MST_ERR_OOM, "token batch");
    float hyper[MST_N_HYPER];
    mst_optim_hyper(&cfg->optim, 1, hyper);
    for (int32_t mb = 0; st == MST_OK && mb < cfg->microbatches; mb++)
        mst_data_batch(&d, cfg->model.batch, cfg->model.seq, tok + mb * per);
    if (st == MST_OK) st = mst_model_stage(m, 0, tok, hyper);
    double whole = 0;
    for (int i = 0; i < 3 && st == MST_OK; i++) {
        st = mst_model_upload(m, 0);
        const double t0 = mst_clock_s();
        if (st == MST_OK) st = mst_step_run(m, &cfg->optim, i == 0);
        if (st == MST_OK) st = mst_ctx_sync(ctx);
        whole = mst_clock_s() - t0;
    }
    mst_backend wb;
    mst_model_backend wm;
    if (st == MST_OK) {
        g_be = ctx->be, g_mo = m->ops, g_n_rows = 0;
        wb = *g_be, wm = *g_mo;
#define SET(t, slot, w) if (t.slot) t.slot = w##_##slot
        SET(wm, mm, wm); SET(wm, norm_forward, wm); SET(wm, norm_backward, wm); SET(wm, add, wm);
        SET(wm, embed_forward, wm); SET(wm, embed_backward, wm); SET(wm, xent, wm); SET(wm, attn_forward, wm);
        SET(wm, attn_backward, wm); SET(wm, attn_flash_forward, wm); SET(wm, attn_flash_backward, wm);
        SET(wm, attn_cudnn_forward, wm); SET(wm, attn_cudnn_backward, wm);
        SET(wm, route_forward, wm); SET(wm, route_backward, wm);
        SET(wm, rows_gather, wm); SET(wm, rows_sum, wm); SET(wm, sumsq, wm); SET(wm, adamw, wm); SET(wm, sum, wm);
        SET(wb, gl_forward, wl); SET(wb, gl_dgrad, wl); SET(wb, gl_wgrad, wl); SET(wb, act_forward, wl);
        SET(wb, act_backward, wl); SET(wb, stash_reset, wl); SET(wb, stash_save, wl); SET(wb, stash_restore, wl);
        SET(wb, stash_batch, wl);
        SET(wb, copy, wl); SET(wb, fill, wl);
#undef SET
        ctx->be = &wb, m->ops = &wm;
        st = mst_model_upload(m, 0);
        if (st == MST_OK) st = mst_step_run(m, &cfg->optim, 0);
        if (st == MST_OK) st = mst_ctx_sync(ctx);
        ctx->be = g_be, m->ops = g_mo;
    }
    if (st == MST_OK) {
        double sum = 0;
        for (int i = 0; i < g_n_rows; i++) sum += g_rows[i].s;
        qsort(g_rows, (size_t)g_n_rows, sizeof *g_rows, cmp_row);
        char policy[MST_POLICY_SPEC_MAX] = "?";
        mst_policy_spec_format(cfg->mem.policy.name, policy, sizeof policy);
        printf("  per-op time of one eager sized step, %s, policy %s: step %.2f ms eager unsynchronized; ops "
               "synchronized one by one:\n", label, policy, 1e3 * whole);
        for (int i = 0; i < g_n_rows; i++)
            printf("    %-16s %8.3f ms %5.1f%%  %5lld calls\n", g_rows[i].name, 1e3 * g_rows[i].s,
                   100 * g_rows[i].s / sum, (long long)g_rows[i].n);
        printf("    %-16s %8.3f ms\n", "sum", 1e3 * sum);
    }
    mst_model_destroy(m);
    mst_data_free(&d);
    free(tok);
    return st;
}

typedef struct train_fig {
    const char* config;        /* "gpu default" or the preset's name           */
    const char* policy;        /* the --policies item                          */
    mst_policy name[MST_N_SAVED]; /* policy, parsed                           */
    double eager_tok_s, graph_tok_s;  /* medians                               */
    double flops;              /* model FLOPs of one step                      */
    double tokens;             /* tokens of one step                           */
    size_t peak, saved, mlp;   /* backend peak; saved attention/norm/router;
                                  grouped MLP kept + stash pages (bytes)       */
    int64_t captures, replays, reruns;
} train_fig;

static mst_status measure(mst_ctx_t* ctx, mst_train_config cfg, int64_t S, train_fig* f) {
    cfg.steps = 2 * S;
    cfg.optim.steps = cfg.steps;
    cfg.graph_from = S + 1;
    memcpy(cfg.mem.policy.name, f->name, sizeof f->name);
    mst_train_result r = {0};
    mst_status st = mst_train_run(ctx, &cfg, NULL, &r);
    if (st == MST_OK) {
        f->tokens = (double)(cfg.model.batch * cfg.model.seq * cfg.microbatches);
        f->flops = mst_model_flops_per_token(&cfg.model) * f->tokens;
        f->eager_tok_s = median(r.tok_per_s + 2, S - 2);
        f->graph_tok_s = median(r.tok_per_s + S + 2, S - 2);
        f->peak = r.mem.peak;
        for (int k = MST_ROW_SAVED_ATTN; k <= MST_ROW_RECOMPUTE; k++) f->saved += r.mem.run[k];
        f->mlp = r.mem.run[MST_ROW_MLP_KEPT] + r.mem.run[MST_ROW_MLP_DEV_PAGES];
        f->captures = r.captures, f->replays = r.replays, f->reruns = r.reruns;
    }
    mst_train_result_free(&r);
    return st;
}

static void print_fig(const train_fig* f, double dense) {
    const double te = f->flops / (f->tokens / f->eager_tok_s) / 1e12, tg = f->flops / (f->tokens / f->graph_tok_s) / 1e12;
    printf("  %-12s %-7s eager %9.0f tok/s %7.1f TFLOP/s (MFU %4.1f%%) | graph %9.0f tok/s %7.1f TFLOP/s (MFU %4.1f%%) "
           "| graph/eager %.2fx | peak %.2f GiB, saved attn/norm/router/head/MTP + rerun %.2f GiB, grouped MLP %.2f GiB | "
           "%lld captures, %lld replays, %lld reruns\n",
           f->config, f->policy, f->eager_tok_s, te, 100 * te / dense, f->graph_tok_s, tg, 100 * tg / dense,
           f->graph_tok_s / f->eager_tok_s, f->peak / 1073741824.0, f->saved / 1073741824.0, f->mlp / 1073741824.0,
           (long long)f->captures, (long long)f->replays, (long long)f->reruns);
}

/* 0, or 1 after a line when the file could not be written. */
static int write_json(const char* path, const char* device, double dense, const train_fig* f, int n) {
    FILE* j = mst_out_open("moestash bench train", path);
    if (!j) return 1;
    fprintf(j, "{\n  \"device\": \"%s\",\n  \"dense_cublas_bf16_tflops\": %.1f,\n  \"flops\": \"6 x active params x tokens "
               "+ 6 T^2 H per layer and sequence (causal attention)\",\n  \"runs\": [\n", device, dense);
    for (int i = 0; i < n; i++) {
        const double te = f[i].flops * f[i].eager_tok_s / f[i].tokens / 1e12;
        const double tg = f[i].flops * f[i].graph_tok_s / f[i].tokens / 1e12;
        fprintf(j, "    {\"config\": \"%s\", \"policy\": \"%s\", \"tokens_per_step\": %.0f, \"flops_per_step\": %.4g, "
                   "\"eager_tokens_per_s\": %.1f, \"graph_tokens_per_s\": %.1f, \"eager_tflops\": %.2f, "
                   "\"graph_tflops\": %.2f, \"eager_mfu\": %.4f, \"graph_mfu\": %.4f, \"peak_bytes\": %zu, "
                   "\"saved_bytes\": %zu, \"grouped_mlp_bytes\": %zu, \"captures\": %lld, \"replays\": %lld, "
                   "\"reruns\": %lld}%s\n",
                f[i].config, f[i].policy, f[i].tokens, f[i].flops, f[i].eager_tok_s, f[i].graph_tok_s, te, tg,
                te / dense, tg / dense, f[i].peak, f[i].saved, f[i].mlp, (long long)f[i].captures,
                (long long)f[i].replays, (long long)f[i].reruns, i + 1 < n ? "," : "");
    }
    fprintf(j, "  ]\n}\n");
    return mst_out_close("moestash bench train", path, j);
}

int mst_bench_train(int argc, char** argv) {
    const char *json = NULL, *preset = NULL, *policies = "keep,stash";
    int64_t S = 20, layers = 0, micro = 0;
    int ops = 0, moments = -1;
    static const char* const dtypes[] = {"fp32", "bf16", NULL};
    mst_train_config base, pre;
    mst_train_defaults(&base, MST_BACKEND_CUDA);
    base.model.capacity_factor = (float)base.model.ep;
    pre = base;
    mst_args a;
    mst_args_init(&a, "moestash bench train", argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--preset")) rc = mst_train_preset(&a, &pre, &preset);
        else if (mst_args_is(&a, "--policies")) rc = mst_args_str(&a, &policies);
        else if (mst_args_is(&a, "--ops")) rc = mst_args_switch(&a, &ops);
        else if (mst_args_is(&a, "--steps")) rc = mst_args_int(&a, 5, 100000, &S);
        else if (mst_args_is(&a, "--layers")) rc = mst_args_int(&a, 1, 1024, &layers);
        else if (mst_args_is(&a, "--microbatches")) rc = mst_args_int(&a, 1, 4096, &micro);
        else if (mst_args_is(&a, "--adam-moments")) rc = mst_args_choice(&a, dtypes, &moments);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench train [--steps S (5 .. 100000, 20)] [--preset h100|qwen3-30b-a3b] "
                   "[--layers N (the preset's layers)] [--microbatches M (the preset's: its optimizer step once per M)] "
                   "[--adam-moments fp32|bf16 (fp32)] [--policies P,Q (keep,stash)] [--ops] [--json FILE]\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (layers) pre.model.layers = (int32_t)layers; /* a preset cut to what fits one GPU */
    if (micro) pre.microbatches = base.microbatches = (int32_t)micro; /* tokens a step: the optimizer's share */
    if (moments >= 0) pre.mem.moments_bf16 = base.mem.moments_bf16 = moments;
    pre.model.capacity_factor = (float)pre.model.ep;
    char buf[256];
    const char* pol[8];
    mst_policy pv[8][MST_N_SAVED];
    int n_pol = 0;
    snprintf(buf, sizeof buf, "%s", policies);
    for (char* p = strtok(buf, ","); p && n_pol < 8; p = strtok(NULL, ",")) {
        if (mst_policy_spec_parse(p, pv[n_pol]) != MST_OK)
            return mst_cli_bad("moestash bench train", "--policies", policies, mst_last_error());
        pol[n_pol++] = p;
    }
    if (!mst_backend_available(MST_BACKEND_CUDA)) {
        fprintf(stderr, "moestash bench train: needs a CUDA device\n");
        return 2;
    }
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(MST_BACKEND_CUDA, 0, &ctx) != MST_OK) {
        fprintf(stderr, "moestash bench train: %s\n", mst_last_error());
        return 1;
    }
    double dense = 0;
    mst_status st = dense_tflops(ctx, &dense);
    printf("moestash bench train on %s\n  dense cuBLAS bf16 8192^3: %.1f TFLOP/s (the MFU denominator)\n"
           "  model FLOPs = 6 x active params x tokens (per layer (NH + 2 KV) D H + H NH D + E H + 3 k F H; the "
           "heads 2 H V, the MTP projection 2 H^2) + 6 T^2 NH D per layer and sequence (causal attention); "
           "%lld eager then %lld graph steps per run, medians\n",
           mst_ctx_describe(ctx), dense, (long long)S, (long long)S);
    train_fig figs[16];
    int n = 0;
    for (int c = 0; c < (preset ? 2 : 1) && st == MST_OK; c++)
        for (int i = 0; i < n_pol && st == MST_OK; i++) {
            train_fig* f = &figs[n];
            memset(f, 0, sizeof *f);
            f->config = c ? preset : "gpu default";
            f->policy = pol[i];
            memcpy(f->name, pv[i], sizeof f->name);
            st = measure(ctx, c ? pre : base, S, f);
            if (st == MST_OK) print_fig(&figs[n++], dense);
            if (st == MST_OK && ops) {
                mst_train_config oc = c ? pre : base;
                memcpy(oc.mem.policy.name, pv[i], sizeof pv[i]);
                st = op_table(ctx, &oc, f->config);
            }
        }
    if (st != MST_OK) fprintf(stderr, "moestash bench train: %s\n", mst_last_error());
    if (json && n && write_json(json, mst_ctx_describe(ctx), dense, figs, n)) st = MST_ERR_IO;
    mst_ctx_destroy(ctx);
    return st == MST_OK ? 0 : 1;
}
