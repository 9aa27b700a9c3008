/*
 * report.c — the memory table of a run (trainer.h: mst_mem_table): by
 * category, this run's bytes beside what KEEP with static max_rows buffers
 * and exact shapes would hold under the same schedule (activation sets in
 * flight, not every microbatch), the max over W ranks, and its printout.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/internal.h"
#include "trainer/io/hash.h"
#include "report.h"

/* ---- memory report ------------------------------------------------------------ */

static const char* const row_names[MST_N_ROWS] = {
    "weights (bf16)", "gradients (fp32 main_grad)", "optimizer (master, m, v)", "saved: attention",
    "saved: norms, residuals", "saved: router", "saved: embedding, head", "saved: MTP module",
    "recompute: shared rerun buffers", "saved: grouped MLP, kept", "saved: grouped MLP, stash pages",
    "saved: grouped MLP, offload (host)", "compute buffers", "op workspaces, context"};
const char* mst_mem_row_str(int row) { return row >= 0 && row < MST_N_ROWS ? row_names[row] : "?"; }

/* Bytes of one routed row of the grouped MLP's saved tensors (x, h, z bf16;
 * prob fp32) and of the shared grouped-rows compute buffers (y, dy, dx
 * bf16; dprob fp32). */
static size_t saved_row_bytes(const mst_model_config* c) { return (size_t)(c->hidden + 3 * c->ffn) * 2 + 4; }
static size_t compute_row_bytes(const mst_model_config* c) { return (size_t)c->hidden * 6 + 4; }

/* W ranks: every rank's x in rank order into all [W] (each rank puts its
 * x into its slot of a zeroed vector; the sum over the ranks, by int32
 * halves of disjoint slots, has no carry: the vector of every rank's). */
static mst_status ranks_gather(mst_model* m, uint64_t x, uint64_t* all) {
    memset(all, 0, sizeof *all * (size_t)m->dist.world);
    all[m->dist.rank] = x;
    return mst_model_allreduce_host(m, all, 2 * (int64_t)m->dist.world, MST_EP_SUM_I32);
}

/* W ranks: the ranks' weight hashes in rank order, hashed; P stages: every
 * rank of the grid's, in grid order (the same on every rank). */
static mst_status ranks_hash(mst_model* m, uint64_t* h) {
    const int32_t W = mst_model_grid_size(m);
    uint64_t* all = (uint64_t*)calloc((size_t)W, sizeof *all);
    if (!all) return mst_set_error(MST_ERR_OOM, "ranks' hashes");
    all[mst_model_grid_rank(m)] = *h; /* disjoint slots: the int32 halves' sum has no carry */
    mst_status st = mst_model_allreduce_host_world(m, all, 2 * (int64_t)W, MST_EP_SUM_I32);
    if (st == MST_OK) *h = mst_fnv1a(MST_FNV1A_SEED, all, sizeof *all * (size_t)W);
    free(all);
    return st;
}

/* W ranks: each entry of the memory table, its max over the ranks. */
static mst_status ranks_max(mst_model* m, const mst_mem_table* t, mst_mem_table* out) {
    enum { N = 3 * MST_N_ROWS + 3 };
    double v[N];
    for (int k = 0; k < MST_N_ROWS; k++) v[k] = (double)t->run[k], v[MST_N_ROWS + k] = (double)t->keep[k],
                                         v[2 * MST_N_ROWS + k] = (double)t->exact[k];
    v[N - 3] = (double)t->dev_pages_peak, v[N - 2] = (double)t->host_pages_peak, v[N - 1] = (double)t->peak;
    mst_status st = mst_model_max_over_ranks(m, v, N);
    *out = *t;
    for (int k = 0; k < MST_N_ROWS; k++) out->run[k] = (size_t)v[k], out->keep[k] = (size_t)v[MST_N_ROWS + k],
                                         out->exact[k] = (size_t)v[2 * MST_N_ROWS + k];
    out->dev_pages_peak = (size_t)v[N - 3], out->host_pages_peak = (size_t)v[N - 2], out->peak = (size_t)v[N - 1];
    return st;
}

/* This rank's table (its groups: all G on one rank, its own on W ranks). */
mst_status mst_train_memory_table(mst_model* m, mst_train_result* res) {
    const mst_model_config* c = &m->cfg;
    const int64_t G = c->ep, L1 = c->layers + 1, R = m->static_rows;
    const int64_t S = m->n_sets; /* activation sets the schedule holds at once (1F1B, one stage: 1) */
    const int64_t Gh = m->row_groups, g0 = m->dist.ep ? m->dist.rank : 0;
    res->peak_rows = (int32_t*)malloc(sizeof(int32_t) * (size_t)(L1 * G));
    if (!res->peak_rows) return mst_set_error(MST_ERR_OOM, "peak rows");
    MST_TRY(mst_model_peak_rows(m, res->peak_rows));
    res->mem.manager = (mst_mem_report_t)MST_MEM_REPORT_INIT;
    MST_TRY(mst_mem_report(m->mm, &res->mem.manager));
    size_t exact_saved = 0, exact_rows_max = 0;
    for (int64_t l = 0; l < L1; l++) {
        size_t layer_rows = 0;
        for (int64_t g = g0; g < g0 + Gh; g++) layer_rows += (size_t)res->peak_rows[l * G + g];
        exact_saved += layer_rows * (size_t)S * saved_row_bytes(c);
        if (layer_rows > exact_rows_max) exact_rows_max = layer_rows;
    }
    mst_mem_table* t = &res->mem;
    const mst_mem_report_t* r = &t->manager;
    const size_t rows_compute = (size_t)(Gh * R) * compute_row_bytes(c);
    /* the model's own buffers: this run's, and with every layer keeping its
     * activations (KEEP; exact shapes alike: they do not depend on routing) */
    static const int rows[][2] = {{MST_ROW_WEIGHTS, MST_MEM_WEIGHTS}, {MST_ROW_GRADS, MST_MEM_GRADS},
                                  {MST_ROW_OPTIM, MST_MEM_OPTIM}, {MST_ROW_SAVED_ATTN, MST_MEM_SAVED_ATTN},
                                  {MST_ROW_SAVED_NORM, MST_MEM_SAVED_NORM}, {MST_ROW_SAVED_ROUTER, MST_MEM_SAVED_ROUTER},
                                  {MST_ROW_SAVED_HEAD, MST_MEM_SAVED_HEAD}, {MST_ROW_SAVED_MTP, MST_MEM_SAVED_MTP},
                                  {MST_ROW_RECOMPUTE, MST_MEM_RECOMPUTE}};
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        t->run[rows[k][0]] = m->mem[rows[k][1]];
        t->keep[rows[k][0]] = t->exact[rows[k][0]] = k < 3 ? m->mem[rows[k][1]] : m->mem_keep[rows[k][1]];
    }
    t->run[MST_ROW_MLP_KEPT] = r->kept_bytes;
    t->keep[MST_ROW_MLP_KEPT] = r->static_keep_bytes; /* L1 x sets x max_rows, every name */
    t->exact[MST_ROW_MLP_KEPT] = exact_saved;
    t->run[MST_ROW_MLP_DEV_PAGES] = r->dev_pages_bytes;
    t->run[MST_ROW_MLP_HOST_PAGES] = r->host_pages_bytes;
    t->dev_pages_peak = r->dev_pages_peak_bytes;
    t->host_pages_peak = r->host_pages_peak_bytes;
    t->run[MST_ROW_COMPUTE] = m->mem[MST_MEM_COMPUTE] + r->compute_bytes;
    t->keep[MST_ROW_COMPUTE] = m->mem[MST_MEM_COMPUTE];
    t->exact[MST_ROW_COMPUTE] = m->mem[MST_MEM_COMPUTE] - rows_compute + exact_rows_max * compute_row_bytes(c);
    size_t in_use = 0, known = 0;
    mst_ctx_mem(m->ctx, &in_use, &t->peak);
    for (int k = 0; k < MST_ROW_OTHER; k++)
        if (k != MST_ROW_MLP_HOST_PAGES) known += t->run[k];
    t->run[MST_ROW_OTHER] = t->keep[MST_ROW_OTHER] = t->exact[MST_ROW_OTHER] = in_use > known ? in_use - known : 0;
    res->max_rows = R;
    res->n_layers = L1;
    res->n_groups = G;
    res->world = m->dist.world;
    res->optim_shard = m->opt_shard;
    res->grad_overlap = m->ov != NULL;
    mst_optim_replicated_bytes(m, &res->optim_rep_bytes, &res->optim_rep_whole_bytes);
    res->mem_max = *t;
    MST_TRY(mst_weights_hash(m, &res->weights_hash, &res->replicated_hash));
    MST_TRY(mst_train_stage_tables(m, res));
    if (!m->dist.ep) return m->dist.pipe ? ranks_hash(m, &res->weights_hash) : MST_OK;
    MST_TRY(ranks_max(m, t, &res->mem_max));
    res->rank_peak = (uint64_t*)malloc(sizeof *res->rank_peak * (size_t)m->dist.world);
    if (!res->rank_peak) return mst_set_error(MST_ERR_OOM, "ranks' peaks");
    MST_TRY(ranks_gather(m, t->peak, res->rank_peak));
    return ranks_hash(m, &res->weights_hash);
}

/* ---- output -------------------------------------------------------------------- */

static double mib(size_t b) { return (double)b / (1 << 20); }

/* One table: t's rows and totals. */
static void print_table(FILE* f, const char* title, const mst_mem_table* t) {
    size_t tot[3] = {0, 0, 0};
    fprintf(f, "\n%-37s this run   KEEP, static max_rows   exact shapes\n", title);
    for (int k = 0; k < MST_N_ROWS; k++) {
        fprintf(f, "  %-34s %10.2f   %21.2f   %12.2f", mst_mem_row_str(k), mib(t->run[k]), mib(t->keep[k]),
                mib(t->exact[k]));
        if (k == MST_ROW_MLP_DEV_PAGES && t->run[k]) fprintf(f, "   (peak in use %.2f)", mib(t->dev_pages_peak));
        if (k == MST_ROW_MLP_HOST_PAGES && t->run[k]) fprintf(f, "   (peak in use %.2f; not in total)", mib(t->host_pages_peak));
        fprintf(f, "\n");
        if (k == MST_ROW_MLP_HOST_PAGES) continue;
        tot[0] += t->run[k];
        tot[1] += t->keep[k];
        tot[2] += t->exact[k];
    }
    fprintf(f, "  %-34s %10.2f   %21.2f   %12.2f\n", "total", mib(tot[0]), mib(tot[1]), mib(tot[2]));
}

void mst_train_print_memory(FILE* f, const mst_train_result* r) {
    const mst_mem_table* t = &r->mem;
    char title[80], max_title[80];
    if (r->stages > 1) { /* rank 0 is stage 0's data-parallel rank 0 */
        snprintf(title, sizeof title, "memory (MiB), rank 0: stage 0 of %d", (int)r->stages);
        snprintf(max_title, sizeof max_title, "memory (MiB), max over stage 0's %d ranks", (int)r->world);
    } else {
        snprintf(title, sizeof title, r->world > 1 ? "memory (MiB), rank 0 of %d" : "memory (MiB)", (int)r->world);
        snprintf(max_title, sizeof max_title, "memory (MiB), max over the ranks");
    }
    print_table(f, title, t);
    if (r->world > 1) print_table(f, max_title, &r->mem_max);
    mst_train_print_stages(f, r);
    if (t->manager.recompute_bytes)
        fprintf(f, "  not saved (recomputed in backward): %.2f MiB of KEEP buffers\n", mib(t->manager.recompute_bytes));
    fprintf(f, "  max_rows %lld per group; peak rows per group over the run, by layer:", (long long)r->max_rows);
    const int64_t G = r->n_groups;
    for (int64_t i = 0; r->peak_rows && i < r->n_layers * G; i++)
        fprintf(f, "%s%d%s", i % G ? " " : " [", r->peak_rows[i], i % G == G - 1 ? "]" : "");
    fprintf(f, "\n  backend peak %.2f MiB; reruns %lld (over budget %lld, overflow %lld); step graph: %lld captures, "
               "%lld replays\n", mib(t->peak), (long long)r->reruns, (long long)r->over_budget,
            (long long)(r->reruns - r->over_budget), (long long)r->captures, (long long)r->replays);
    if (r->world <= 1) return;
    fprintf(f, "  replicated gradients: %.2f MiB fp32 %s a step %s, %.3f ms alone "
               "(rank 0, timed after the run)\n", mib(r->allreduce_bytes), r->optim_shard ? "reduce-scattered" : "all-reduced",
            r->grad_overlap ? "a layer at a time during the backward (--overlap on)" : "after the backward", r->allreduce_ms);
    fprintf(f, "  optimizer state of the replicated parameters (master, m, v): %.2f MiB a rank, %s (%.2f MiB unsharded: "
               "%.3fx)\n", mib(r->optim_rep_bytes), r->optim_shard ? "sharded over the ranks" : "whole on every rank",
            mib(r->optim_rep_whole_bytes), r->optim_rep_whole_bytes ? (double)r->optim_rep_bytes / (double)r->optim_rep_whole_bytes : 0.0);
}

