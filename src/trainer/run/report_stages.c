/*
 * report_stages.c — the memory picture of a pipeline grid (--pp P > 1):
 * each stage's memory table (its data-parallel rank 0's), gathered over the
 * grid onto every rank, printed as one line a stage and written into the
 * JSON document. Stage 0 holds the most microbatches in flight (min(P, M)
 * activation sets under 1F1B): where saving grouped-MLP activations pays.
 */
#include <stdlib.h>
#include <string.h>

#include "planner.h"
#include "report.h"

enum { PER = 3 * MST_N_ROWS + 4 }; /* a table's doubles: run, keep, exact, pages peaks, peak, sets */

mst_status mst_train_stage_tables(mst_model* m, mst_train_result* res) {
    const int32_t P = m->stages, N = mst_model_grid_size(m);
    res->stages = P;
    if (P <= 1) return MST_OK;
    double* v = (double*)calloc((size_t)P * PER + (size_t)N, sizeof(double)); /* [P, PER], then [N] every rank's peak */
    res->stage_mem = (mst_mem_table*)calloc((size_t)P, sizeof *res->stage_mem);
    res->stage_sets = (int32_t*)calloc((size_t)P, sizeof *res->stage_sets);
    res->grid_peak = (uint64_t*)calloc((size_t)N, sizeof *res->grid_peak);
    if (!v || !res->stage_mem || !res->stage_sets || !res->grid_peak) {
        free(v);
        return mst_set_error(MST_ERR_OOM, "memory by stage");
    }
    const mst_mem_table* t = &res->mem;
    if (m->dist.rank == 0) { /* this stage's row; the others' zero: the sum is exact */
        double* row = v + (size_t)m->stage * PER;
        for (int k = 0; k < MST_N_ROWS; k++)
            row[k] = (double)t->run[k], row[MST_N_ROWS + k] = (double)t->keep[k], row[2 * MST_N_ROWS + k] = (double)t->exact[k];
        row[PER - 4] = (double)t->dev_pages_peak, row[PER - 3] = (double)t->host_pages_peak;
        row[PER - 2] = (double)t->peak, row[PER - 1] = (double)m->n_sets;
    }
    v[(size_t)P * PER + (size_t)mst_model_grid_rank(m)] = (double)t->peak;
    mst_status st = mst_model_allreduce_host_world(m, v, (int64_t)P * PER + N, MST_EP_SUM_F64);
    for (int32_t k = 0; st == MST_OK && k < N; k++) res->grid_peak[k] = (uint64_t)v[(size_t)P * PER + (size_t)k];
    for (int32_t s = 0; st == MST_OK && s < P; s++) {
        const double* row = v + (size_t)s * PER;
        mst_mem_table* o = &res->stage_mem[s];
        for (int k = 0; k < MST_N_ROWS; k++)
            o->run[k] = (size_t)row[k], o->keep[k] = (size_t)row[MST_N_ROWS + k], o->exact[k] = (size_t)row[2 * MST_N_ROWS + k];
        o->dev_pages_peak = (size_t)row[PER - 4], o->host_pages_peak = (size_t)row[PER - 3], o->peak = (size_t)row[PER - 2];
        res->stage_sets[s] = (int32_t)row[PER - 1];
    }
    free(v);
    return st;
}

static double mib(size_t b) { return (double)b / (1 << 20); }

size_t mst_train_stage_peak(const mst_train_result* r, int32_t s) {
    size_t p = 0;
    for (int32_t d = 0; r->grid_peak && d < r->world; d++)
        if (r->grid_peak[s * r->world + d] > p) p = (size_t)r->grid_peak[s * r->world + d];
    return p;
}

static size_t saved_mlp(const size_t* col) { return col[MST_ROW_MLP_KEPT] + col[MST_ROW_MLP_DEV_PAGES]; }

static size_t saved_other(const size_t* col) {
    return col[MST_ROW_SAVED_ATTN] + col[MST_ROW_SAVED_NORM] + col[MST_ROW_SAVED_ROUTER] + col[MST_ROW_SAVED_HEAD] +
           col[MST_ROW_SAVED_MTP] + col[MST_ROW_RECOMPUTE];
}

static size_t state(const size_t* col) { return col[MST_ROW_WEIGHTS] + col[MST_ROW_GRADS] + col[MST_ROW_OPTIM]; }

void mst_train_print_stages(FILE* f, const mst_train_result* r) {
    if (r->stages <= 1 || !r->stage_mem) return;
    fprintf(f, "\nmemory by pipeline stage (MiB, data-parallel rank 0 of each; peak max: over the stage's ranks)\n"
               "  stage  in flight   grouped MLP saved (this run | KEEP)   pages peak in use   other saved   "
               "weights+grads+optim   backend peak | max%s\n", r->plan ? "   planned peak   plan (tensors; layers recomputed)" : "");
    for (int32_t s = 0; s < r->stages; s++) {
        const mst_mem_table* t = &r->stage_mem[s];
        fprintf(f, "  %5d  %9d   %17.2f | %-16.2f   %17.2f   %11.2f   %19.2f   %12.2f | %-8.2f", s, r->stage_sets[s],
                mib(saved_mlp(t->run)), mib(saved_mlp(t->keep)), mib(t->dev_pages_peak), mib(saved_other(t->run)),
                mib(state(t->run)), mib(t->peak), mib(mst_train_stage_peak(r, s)));
        char plan[160];
        if (r->plan) mst_plan_stage_summary(r->plan, s, plan, sizeof plan);
        if (r->plan) fprintf(f, "   %12.2f   %s", mib(r->plan->by_stage[s].peak), plan);
        fprintf(f, "\n");
    }
}

void mst_train_json_stages(FILE* f, const mst_train_result* r) {
    if (r->stages <= 1 || !r->stage_mem) return;
    fprintf(f, "  \"stages\": [");
    for (int32_t s = 0; s < r->stages; s++) {
        const mst_mem_table* t = &r->stage_mem[s];
        fprintf(f, "%s\n    {\"stage\": %d, \"sets\": %d, \"mlp_saved\": %zu, \"mlp_saved_keep\": %zu, \"dev_pages_peak\": %zu, "
                   "\"other_saved\": %zu, \"state\": %zu, \"backend_peak\": %zu, \"backend_peak_max\": %zu",
                s ? "," : "", s, r->stage_sets[s], saved_mlp(t->run), saved_mlp(t->keep), t->dev_pages_peak,
                saved_other(t->run), state(t->run), t->peak, mst_train_stage_peak(r, s));
        if (r->plan) mst_plan_stage_json(f, r->plan, s);
        fprintf(f, "}");
    }
    fprintf(f, "\n  ],\n");
}
