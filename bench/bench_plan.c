/*
 * bench_plan.c — `moestash bench plan [--backend cpu|cuda] [--preset h100]
 * [--layers L] [--experts E] [--microbatches M] [--steps S] [--budgets
 * F,G,...] [--json FILE]`: the memory-budget planner (train --memory-budget)
 * against a hand-written grid of memory settings, in the same run.
 *
 * The grid: every uniform policy (keep, stash, offload, recompute) and two
 * per-tensor mixes without layer recompute; keep and stash with the first N
 * layers recomputed whole (block:N, N = 2, 4, 6 and every layer); offload with
 * half the layers recomputed; stash with every layer's grouped MLP recomputed
 * (uniform:1, granularity moe). Each is one training run of S steps; its
 * peak is the backend peak of the run, its step time the median of steps
 * 2 .. S (the graph replayed on CUDA from step 3).
 *
 * Budgets: KEEP's peak less (1 - F) of KEEP's activation memory (the memory
 * table's saved rows: attention, norms, router, embedding and head, MTP,
 * rerun buffers, the grouped MLP's buffers and pages), F = 0.3, 0.5, 0.8 by
 * default. For each: the planner's run (its probe included, its own step
 * time and peak measured the same way) against the fastest grid point whose
 * peak fits; the ratio of their step times (target <= 1.10).
 */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "trainer/run/planner.h"

typedef struct grid_point {
    const char* policy;
    const char* recompute; /* none, block:N, uniform:N */
    int full;              /* granularity of recomputed layers */
    char label[160];
    size_t peak;
    double step_s;
    int ok;                /* the run finished (it may not fit the device) */
} grid_point;

static double gib(size_t b) { return (double)b / 1073741824.0; }

/* One run of cfg; its peak and median step time, and KEEP's activations. */
static mst_status measure(mst_ctx_t* ctx, const mst_train_config* cfg, size_t* peak, double* step_s, size_t* acts,
                          mst_train_result* keep_res) {
    mst_train_result r = {0};
    mst_status st = mst_train_run(ctx, cfg, NULL, &r);
    if (st == MST_OK) {
        *peak = r.mem.peak;
        *step_s = mst_plan_step_s(&r, cfg);
        if (acts)
            for (int k = MST_ROW_SAVED_ATTN; k <= MST_ROW_MLP_DEV_PAGES; k++) *acts += r.mem.run[k];
    }
    if (keep_res && st == MST_OK) *keep_res = r;
    else mst_train_result_free(&r);
    return st;
}

/* The plan in one line: recomputed layers, then each name's letters. */
static void plan_line(const mst_plan_report* r, char* out, size_t n) {
    const mst_budget_plan* p = &r->plan;
    const int32_t L1 = r->bm.n_layers;
    size_t at = (size_t)snprintf(out, n, "%s rec:", p->full ? "full" : "moe");
    for (int32_t l = 0; l < L1 && at < n; l++) at += (size_t)snprintf(out + at, n - at, "%c", p->chunk_start[l] >= 0 ? 'R' : '.');
    for (int k = 0; k < MST_N_SAVED && at < n; k++) {
        at += (size_t)snprintf(out + at, n - at, " %s:", mst_saved_name_str((mst_saved_name)k));
        for (int32_t l = 0; l < L1 && at < n; l++)
            at += (size_t)snprintf(out + at, n - at, "%c", p->chunk_start[l] >= 0 ? '-' : "KSOR"[p->policy[l * MST_N_SAVED + k]]);
    }
}

static grid_point point(const char* policy, const char* recompute, int full, const char* name) {
    grid_point g = {policy, recompute, full, "", 0, 0, 0};
    snprintf(g.label, sizeof g.label, "%s, --recompute %s%s", name ? name : policy, recompute, full ? "" : " (moe)");
    return g;
}

static int grid(grid_point* g, int32_t L1) {
    static const char* const uniform[] = {"keep", "stash", "offload", "recompute"};
    int n = 0;
    for (size_t i = 0; i < sizeof uniform / sizeof uniform[0]; i++) g[n++] = point(uniform[i], "none", 1, NULL);
    g[n++] = point("fc1_input=offload,act_input=stash,fc2_input=recompute,probs=offload", "none", 1, "mix O/S/R/O");
    g[n++] = point("fc1_input=stash,act_input=stash,fc2_input=recompute,probs=stash", "none", 1, "mix S/S/R/S");
    static char block[4][24], half[24];
    const int32_t Ns[4] = {2 < L1 ? 2 : L1, 4 < L1 ? 4 : L1, 6 < L1 ? 6 : L1, L1};
    for (int k = 0; k < 4; k++) {
        snprintf(block[k], sizeof block[k], "block:%d", Ns[k]);
        if (k && Ns[k] == Ns[k - 1]) continue;
        g[n++] = point("keep", block[k], 1, NULL);
        g[n++] = point("stash", block[k], 1, NULL);
    }
    snprintf(half, sizeof half, "block:%d", (L1 + 1) / 2);
    g[n++] = point("offload", half, 1, NULL);
    g[n++] = point("stash", "uniform:1", 0, NULL);
    return n;
}

typedef struct budget_fig {
    double f;
    size_t budget, pred_peak, peak;
    double pred_step, step;
    int best;               /* grid point, -1: none fits */
    char plan[256];
    int ok;
} budget_fig;

static int write_json(const char* path, const char* device, const mst_train_config* c, const grid_point* g, int ng,
                      const budget_fig* b, int nb, size_t keep_acts) {
    FILE* j = mst_out_open("moestash bench plan", path);
    if (!j) return 1;
    fprintf(j, "{\n  \"device\": \"%s\",\n  \"config\": {\"hidden\": %lld, \"layers\": %d, \"experts\": %d, \"microbatches\": %d, "
               "\"schedule\": \"%s\", \"seq\": %lld, \"batch\": %lld},\n  \"keep_activation_bytes\": %zu,\n  \"grid\": [\n",
            device, (long long)c->model.hidden, c->model.layers, c->model.experts, c->microbatches,
            mst_schedule_kind_str(c->mem.schedule), (long long)c->model.seq, (long long)c->model.batch, keep_acts);
    for (int i = 0; i < ng; i++)
        fprintf(j, "    {\"setting\": \"%s\", \"ok\": %s, \"peak\": %zu, \"step_s\": %.6g}%s\n", g[i].label,
                g[i].ok ? "true" : "false", g[i].peak, g[i].step_s, i + 1 < ng ? "," : "");
    fprintf(j, "  ],\n  \"budgets\": [\n");
    for (int i = 0; i < nb; i++)
        fprintf(j, "    {\"fraction\": %g, \"budget\": %zu, \"planner\": {\"ok\": %s, \"plan\": \"%s\", \"predicted_peak\": %zu, "
                   "\"peak\": %zu, \"predicted_step_s\": %.6g, \"step_s\": %.6g}, \"best_grid\": %s%s%s, \"best_grid_step_s\": %.6g, "
                   "\"ratio\": %.4f}%s\n",
                b[i].f, b[i].budget, b[i].ok ? "true" : "false", b[i].plan, b[i].pred_peak, b[i].peak, b[i].pred_step,
                b[i].step, b[i].best >= 0 ? "\"" : "", b[i].best >= 0 ? g[b[i].best].label : "null",
                b[i].best >= 0 ? "\"" : "", b[i].best >= 0 ? g[b[i].best].step_s : 0.0,
                b[i].best >= 0 && b[i].ok ? b[i].step / g[b[i].best].step_s : 0.0, i + 1 < nb ? "," : "");
    fprintf(j, "  ]\n}\n");
    return mst_out_close("moestash bench plan", path, j);
}

int mst_bench_plan(int argc, char** argv) {
    const char *json = NULL, *preset = NULL, *budgets = "0.3,0.5,0.8";
    mst_backend_kind kind = mst_default_backend();
    const char* backend = mst_args_find(argc, argv, "--backend");
    if (backend) kind = strcmp(backend, "cuda") == 0 ? MST_BACKEND_CUDA : MST_BACKEND_CPU;
    int64_t S = 6, layers = 0, experts = 0, micro = 0;
    mst_train_config cfg;
    mst_train_defaults(&cfg, kind);
    mst_args a;
    mst_args_init(&a, "moestash bench plan", argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
        else if (mst_args_is(&a, "--backend")) rc = mst_args_backend(&a, &kind);
        else if (mst_args_is(&a, "--preset")) rc = mst_train_preset(&a, &cfg, &preset);
        else if (mst_args_is(&a, "--budgets")) rc = mst_args_str(&a, &budgets);
        else if (mst_args_is(&a, "--steps")) rc = mst_args_int(&a, 4, 100000, &S);
        else if (mst_args_is(&a, "--layers")) rc = mst_args_int(&a, 1, 256, &layers);
        else if (mst_args_is(&a, "--experts")) rc = mst_args_int(&a, 1, 1024, &experts);
        else if (mst_args_is(&a, "--microbatches")) rc = mst_args_int(&a, 1, 4096, &micro);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash bench plan [--backend cpu|cuda] [--preset h100] [--layers L] [--experts E] "
                   "[--microbatches M] [--steps S (4 .. 100000, 6)] [--budgets F,G,... (0.3,0.5,0.8)] [--json FILE]\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (layers) cfg.model.layers = (int32_t)layers;
    if (experts) cfg.model.experts = (int32_t)experts;
    if (micro) cfg.microbatches = (int32_t)micro;
    if (cfg.model.capacity_factor == 0.0f) cfg.model.capacity_factor = (float)cfg.model.ep;
    cfg.steps = cfg.optim.steps = S;
    cfg.graph_from = kind == MST_BACKEND_CUDA ? 2 : 0;
    double frac[8];
    int nb = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", budgets);
    for (char* p = strtok(buf, ","); p; p = strtok(NULL, ",")) {
        char* end = NULL;
        const double f = strtod(p, &end);
        if (nb == 8 || end == p || *end || !(f > 0 && f < 1))
            return mst_cli_bad("moestash bench plan", "--budgets", budgets, "expected up to 8 fractions in (0, 1)");
        frac[nb++] = f;
    }
    if (mst_model_config_check(&cfg.model) != MST_OK) {
        fprintf(stderr, "moestash bench plan: %s\n", mst_last_error());
        return 2;
    }
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(kind, 0, &ctx) != MST_OK) {
        fprintf(stderr, "moestash bench plan: %s\n", mst_last_error());
        return 2;
    }
    const int32_t L1 = cfg.model.layers + 1;
    printf("moestash bench plan on %s\n  %s: H %lld, L %d (+ MTP), E %d, k %d, T %lld, B %lld, M %d, schedule %s; %lld "
           "steps a run, step time the median of steps 2 .. %lld%s\n",
           mst_ctx_describe(ctx), preset ? preset : "default", (long long)cfg.model.hidden, cfg.model.layers,
           cfg.model.experts, cfg.model.top_k, (long long)cfg.model.seq, (long long)cfg.model.batch, cfg.microbatches,
           mst_schedule_kind_str(cfg.mem.schedule), (long long)S, (long long)S,
           cfg.graph_from ? " (graph replayed from step 3)" : "");
    grid_point g[24];
    const int ng = grid(g, L1);
    size_t keep_acts = 0;
    mst_status st = MST_OK;
    for (int i = 0; i < ng; i++) {
        mst_train_config c = cfg;
        c.mem.recompute_full = g[i].full;
        st = mst_policy_spec_parse(g[i].policy, c.mem.policy.name);
        if (st == MST_OK) st = mst_recompute_parse(g[i].recompute, &c.mem.recompute);
        if (st == MST_OK) st = measure(ctx, &c, &g[i].peak, &g[i].step_s, i == 0 ? &keep_acts : NULL, NULL);
        g[i].ok = st == MST_OK;
        if (g[i].ok) printf("  grid %-44s peak %8.3f GiB  step %9.3f ms\n", g[i].label, gib(g[i].peak), 1e3 * g[i].step_s);
        else printf("  grid %-44s failed: %s\n", g[i].label, mst_last_error());
        if (i == 0 && !g[i].ok) break; /* KEEP is the reference */
        st = MST_OK;
    }
    budget_fig b[8];
    for (int i = 0; i < nb && g[0].ok; i++) {
        budget_fig* x = &b[i];
        memset(x, 0, sizeof *x);
        x->f = frac[i];
        x->budget = g[0].peak - (size_t)((1.0 - frac[i]) * (double)keep_acts);
        x->best = -1;
        for (int k = 0; k < ng; k++)
            if (g[k].ok && g[k].peak <= x->budget && (x->best < 0 || g[k].step_s < g[x->best].step_s)) x->best = k;
        mst_train_config c = cfg;
        c.memory_budget = x->budget;
        mst_train_result r = {0};
        mst_status s = mst_train_run(ctx, &c, NULL, &r);
        x->ok = s == MST_OK && r.plan;
        if (x->ok) {
            x->peak = r.mem.peak, x->step = mst_plan_step_s(&r, &c);
            x->pred_peak = r.plan->plan.peak, x->pred_step = r.plan->plan.step_s;
            plan_line(r.plan, x->plan, sizeof x->plan);
        }
        printf("  budget %.0f %% of KEEP's activations: %.3f GiB\n", 100 * x->f, gib(x->budget));
        if (x->ok)
            printf("    planner  peak %.3f GiB (predicted %.3f, %+.1f %%)%s  step %.3f ms (predicted %.3f)  %s\n", gib(x->peak),
                   gib(x->pred_peak), 100.0 * ((double)x->pred_peak - (double)x->peak) / (double)x->peak,
                   x->peak <= x->budget ? "" : " OVER BUDGET", 1e3 * x->step, 1e3 * x->pred_step, x->plan);
        else printf("    planner  failed: %s\n", mst_last_error());
        if (x->best >= 0)
            printf("    grid     %s: peak %.3f GiB, step %.3f ms\n", g[x->best].label, gib(g[x->best].peak),
                   1e3 * g[x->best].step_s);
        else printf("    grid     no point fits\n");
        if (x->ok && x->best >= 0) printf("    planner / best fitting grid point: %.3fx (target <= 1.10)\n", x->step / g[x->best].step_s);
        mst_train_result_free(&r);
    }
    printf("  KEEP's activations %.3f GiB of its %.3f GiB peak\n", gib(keep_acts), gib(g[0].peak));
    int rc = g[0].ok ? 0 : 1;
    if (json && g[0].ok && write_json(json, mst_ctx_describe(ctx), &cfg, g, ng, b, nb, keep_acts)) rc = 1;
    mst_ctx_destroy(ctx);
    return rc;
}
