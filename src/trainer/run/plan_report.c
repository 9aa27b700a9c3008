/*
 * plan_report.c — the report of `--memory-budget`'s plan (planner.h): the
 * table of every layer's choices (P stages: under the stage that planned
 * each layer), the predicted against the measured peak and step time (P
 * stages: a line a stage, the measured peak the max over the stage's
 * ranks), and the same in the JSON document (a stage's own under its entry
 * of "stages").
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "planner.h"
#include "report.h"

static double mib(size_t b) { return (double)b / (1 << 20); }

static int cmp_double(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

double mst_plan_step_s(const mst_train_result* res, const mst_train_config* cfg) {
    const double tokens = (double)(cfg->model.batch * cfg->model.seq * cfg->microbatches);
    const int64_t first = res->first_step, n = res->steps - first; /* steps after the measuring one */
    if (n < 1) return tokens / res->tok_per_s[res->steps - 1];
    double* t = (double*)malloc(sizeof(double) * (size_t)n);
    if (!t) return NAN;
    for (int64_t i = 0; i < n; i++) t[i] = tokens / res->tok_per_s[first + i];
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    const double med = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
    free(t);
    return med;
}

static mst_policy policy_at(const mst_plan_report* r, int32_t l, int n) { return r->policy_all[l * MST_N_SAVED + n]; }

static char letter(const mst_plan_report* r, int32_t l, int n) {
    return r->chunk_all[l] >= 0 ? '-' : "KSOR"[policy_at(r, l, n)];
}

static const char* choice_str(const mst_plan_report* r, int32_t l, int n) {
    return r->chunk_all[l] >= 0 ? "recomputed layer" : mst_policy_str(policy_at(r, l, n));
}

void mst_plan_stage_summary(const mst_plan_report* r, int32_t s, char* out, size_t cap) {
    int count[MST_N_POLICIES] = {0}, rec = 0;
    for (int32_t l = 0; l < r->n_all; l++) {
        if (r->stage_of[l] != s) continue;
        rec += r->chunk_all[l] >= 0;
        for (int n = 0; n < MST_N_SAVED && r->chunk_all[l] < 0; n++) count[policy_at(r, l, n)]++;
    }
    size_t at = 0;
    out[0] = 0;
    for (int q = 0; q < MST_N_POLICIES && at < cap; q++)
        if (count[q]) at += (size_t)snprintf(out + at, cap - at, "%s%s %d", at ? ", " : "", mst_policy_str((mst_policy)q), count[q]);
    if (rec && at < cap)
        snprintf(out + at, cap - at, "%s%d layer%s (%s)", at ? "; " : "", rec, rec > 1 ? "s" : "",
                 r->by_stage[s].full ? "full" : "moe");
}

/* The table: a column a layer (mtp last), the stage row on P stages. */
static void print_table(FILE* f, const mst_plan_report* r) {
    const int32_t L1 = r->n_all;
    fprintf(f, "  %-18s", "layer");
    for (int32_t l = 0; l < L1; l++) fprintf(f, l + 1 < L1 ? " %3d" : " mtp", l);
    if (r->stages > 1) {
        fprintf(f, "\n  %-18s", "stage");
        for (int32_t l = 0; l < L1; l++) fprintf(f, " %3d", r->stage_of[l]);
    }
    fprintf(f, "\n  %-18s", "layer recompute");
    for (int32_t l = 0; l < L1; l++) fprintf(f, "   %c", r->chunk_all[l] >= 0 ? 'R' : '.');
    for (int n = 0; n < MST_N_SAVED; n++) {
        fprintf(f, "\n  %-18s", mst_saved_name_str((mst_saved_name)n));
        for (int32_t l = 0; l < L1; l++) fprintf(f, "   %c", letter(r, l, n));
    }
    fprintf(f, "\n  K keep, S stash (device pages), O offload (pinned host pages), R recompute, - layer recomputed\n");
}

/* P stages: a line a stage, its measured peak the max over its ranks. */
static void print_stages(FILE* f, const mst_plan_report* r, const mst_train_result* res) {
    fprintf(f, "  stage  in flight  recompute   predicted peak (measuring | sized)   measured, max over its %d rank%s   "
               "KEEP predicted   smallest   predicted step\n", (int)res->world, res->world > 1 ? "s" : "");
    for (int32_t s = 0; s < r->stages; s++) {
        const mst_plan_stage* b = &r->by_stage[s];
        const size_t meas = mst_train_stage_peak(res, s);
        fprintf(f, "  %5d  %9d  %-9s   %10.2f (%8.2f | %8.2f)   %14.2f (%+5.1f %%)          %14.2f   %8.2f   %11.2f ms\n",
                s, b->sets, b->full ? "full" : "moe", mib(b->peak), mib(b->peak_measuring), mib(b->peak_sized), mib(meas),
                100.0 * ((double)b->peak - (double)meas) / (double)(meas ? meas : 1), mib(b->keep_peak), mib(b->smallest),
                1e3 * b->step_s);
    }
}

void mst_plan_print(FILE* f, const mst_plan_report* r, const mst_train_result* res, const mst_train_config* cfg) {
    const mst_budget_plan* p = &r->plan;
    const double step = mst_plan_step_s(res, cfg);
    if (r->stages > 1) {
        fprintf(f, "\nmemory plan for --memory-budget %.2f MiB a rank: each of the %d pipeline stages planned its own "
                   "layers along its own schedule\n", mib(r->budget), (int)r->stages);
        print_table(f, r);
        print_stages(f, r, res);
        fprintf(f, "  step: measured %.2f ms (median); the stages' own predictions above\n", 1e3 * step);
        fprintf(f, "  costs measured (stage %d): device copy %.1f GB/s, host spill %.1f GB/s, one layer's forward %.3f "
                   "ms\n", (int)r->stage, r->bm.dev_bw / 1e9, r->bm.host_bw / 1e9, 1e3 * r->bm.t_layer);
        return;
    }
    fprintf(f, "\nmemory plan for --memory-budget %.2f MiB (recomputed layers: %s)\n", mib(r->budget),
            p->full ? "whole, --recompute-granularity full" : "grouped MLP only, --recompute-granularity moe");
    print_table(f, r);
    const size_t peak = res->mem_max.peak; /* W ranks: the max over the ranks, which the plan predicts */
    char over[48] = "";
    if (res->world > 1) snprintf(over, sizeof over, " (max over %d ranks)", (int)res->world);
    fprintf(f, "  peak%s: predicted %.2f MiB (measuring step %.2f, sized steps %.2f), measured %.2f MiB (%+.1f %%); "
               "KEEP %.2f MiB; smallest reachable %.2f MiB\n", over, mib(p->peak), mib(p->peak_measuring),
            mib(p->peak_sized), mib(peak), 100.0 * ((double)p->peak - (double)peak) / (double)(peak ? peak : 1),
            mib(r->keep.peak), mib(r->smallest));
    fprintf(f, "  step: predicted %.2f ms, measured %.2f ms (median); KEEP %.2f ms (predicted)\n", 1e3 * p->step_s,
            1e3 * step, 1e3 * r->keep.step_s);
    fprintf(f, "  costs measured: device copy %.1f GB/s, host spill %.1f GB/s, one layer's forward %.3f ms\n",
            r->bm.dev_bw / 1e9, r->bm.host_bw / 1e9, 1e3 * r->bm.t_layer);
}

/* "recompute_layers": [...], "policy": {name: [...]} of the layers of stage
 * s (-1: every layer). */
static void json_choices(FILE* f, const mst_plan_report* r, int32_t s) {
    fprintf(f, "\"recompute_layers\": [");
    for (int32_t l = 0, k = 0; l < r->n_all; l++)
        if (r->chunk_all[l] >= 0 && (s < 0 || r->stage_of[l] == s)) fprintf(f, "%s%d", k++ ? ", " : "", l);
    fprintf(f, "],\n    \"policy\": {");
    for (int n = 0; n < MST_N_SAVED; n++) {
        fprintf(f, "%s\"%s\": [", n ? ", " : "", mst_saved_name_str((mst_saved_name)n));
        for (int32_t l = 0, k = 0; l < r->n_all; l++)
            if (s < 0 || r->stage_of[l] == s) fprintf(f, "%s\"%s\"", k++ ? ", " : "", choice_str(r, l, n));
        fprintf(f, "]");
    }
    fprintf(f, "}");
}

void mst_plan_stage_json(FILE* f, const mst_plan_report* r, int32_t s) {
    const mst_plan_stage* b = &r->by_stage[s];
    fprintf(f, ", \"plan\": {\"layers\": [");
    for (int32_t l = 0, k = 0; l < r->n_all; l++)
        if (r->stage_of[l] == s) fprintf(f, "%s%d", k++ ? ", " : "", l);
    fprintf(f, "], \"granularity\": \"%s\", ", b->full ? "full" : "moe");
    json_choices(f, r, s);
    fprintf(f, ",\n      \"predicted_peak\": %zu, \"predicted_peak_measuring\": %zu, \"predicted_peak_sized\": %zu, "
               "\"keep_peak\": %zu, \"smallest_peak\": %zu, \"predicted_step_s\": %.6g, \"keep_step_s\": %.6g}",
            b->peak, b->peak_measuring, b->peak_sized, b->keep_peak, b->smallest, b->step_s, b->keep_step_s);
}

void mst_plan_json(FILE* f, const mst_plan_report* r, const mst_train_result* res, const mst_train_config* cfg) {
    const mst_budget_plan* p = &r->plan;
    fprintf(f, "  \"plan\": {\"budget\": %zu, \"granularity\": \"%s\", ", r->budget, p->full ? "full" : "moe");
    json_choices(f, r, -1);
    fprintf(f, ",\n    \"predicted_peak\": %zu, \"predicted_peak_measuring\": %zu, \"predicted_peak_sized\": %zu, "
               "\"measured_peak\": %zu,\n    \"predicted_step_s\": %.6g, \"measured_step_s\": %.6g, \"keep_peak\": %zu, "
               "\"keep_activations\": %zu, \"keep_step_s\": %.6g, \"smallest_peak\": %zu,\n    \"device_copy_bytes_per_s\": %.6g, "
               "\"host_spill_bytes_per_s\": %.6g, \"layer_forward_s\": %.6g",
            p->peak, p->peak_measuring, p->peak_sized, res->mem_max.peak, p->step_s, mst_plan_step_s(res, cfg),
            r->keep.peak, r->keep.acts, r->keep.step_s, r->smallest, r->bm.dev_bw, r->bm.host_bw, r->bm.t_layer);
    if (res->rank_peak) { /* W ranks: the peaks and times above are the max over the ranks */
        fprintf(f, ",\n    \"measured_peak_per_rank\": [");
        for (int32_t k = 0; k < res->world; k++) fprintf(f, "%s%llu", k ? ", " : "", (unsigned long long)res->rank_peak[k]);
        fprintf(f, "]");
    }
    if (r->stages > 1) { /* the fields above are rank 0's stage's (stage 0); each stage's under "stages" */
        fprintf(f, ",\n    \"stage_of_layer\": [");
        for (int32_t l = 0; l < r->n_all; l++) fprintf(f, "%s%d", l ? ", " : "", r->stage_of[l]);
        fprintf(f, "]");
    }
    fprintf(f, "},\n");
}
