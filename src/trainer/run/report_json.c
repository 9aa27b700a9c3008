/*
 * report_json.c — `train --json FILE`: the run's configuration, losses,
 * timings, peak rows, the memory table and the memory manager's report.
 */
#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "trainer/io/json.h"
#include "trainer/run/planner.h"
#include "report.h"

/* Values of the steps this run made (from its first); null where not finite. */
void mst_train_json_array(FILE* f, const char* name, const double* v, int64_t first, int64_t n) {
    fprintf(f, "  \"%s\": [", name);
    for (int64_t i = first - 1; i < n; i++) {
        fprintf(f, i >= first ? ", " : "");
        if (isfinite(v[i])) fprintf(f, "%.9g", v[i]);
        else fprintf(f, "null");
    }
    fprintf(f, "],\n");
}

static void json_mem(FILE* f, const char* name, const size_t* v) {
    fprintf(f, "    \"%s\": {", name);
    for (int k = 0; k < MST_N_ROWS; k++) fprintf(f, "%s\"%s\": %zu", k ? ", " : "", mst_mem_row_str(k), v[k]);
    fprintf(f, "},\n");
}

mst_status mst_train_write_json(const char* path, const mst_train_config* cfg,
                                const mst_train_result* r, const char* device) {
    FILE* f = fopen(path, "w");
    if (!f) return mst_set_error(MST_ERR_IO, "--json '%s': cannot open for writing", path);
    const mst_model_config* c = &cfg->model;
    static const char* const recompute[] = {"none", "uniform", "block"};
    char rec[32] = "none", policy[MST_POLICY_SPEC_MAX] = "?";
    mst_policy_spec_format(cfg->mem.policy.name, policy, sizeof policy);
    if (cfg->mem.recompute.method != MST_RECOMPUTE_NONE)
        snprintf(rec, sizeof rec, "%s:%d", recompute[cfg->mem.recompute.method], cfg->mem.recompute.num_layers);
    fprintf(f, "{\n  \"device\": ");
    mst_json_write_string(f, device);
    fprintf(f, ",\n  \"config\": {\"vocab\": %lld, \"hidden\": %lld, \"ffn\": %lld, \"heads\": %lld, "
               "\"kv_heads\": %lld, \"head_dim\": %lld, \"rope_theta\": %g, \"norm_topk_prob\": %s, "
               "\"tie_embeddings\": %s, \"seq\": %lld, "
               "\"batch\": %lld, \"layers\": %d, \"experts\": %d, \"top_k\": %d, \"ep\": %d, "
               "\"capacity_factor\": %g, \"microbatches\": %d, \"schedule\": \"%s\", \"policy\": ",
            (long long)c->vocab, (long long)c->hidden, (long long)c->ffn, (long long)c->n_head,
            (long long)c->n_kv_head, (long long)c->head_dim, (double)c->rope_theta,
            c->norm_topk_prob ? "true" : "false", c->tie_embeddings ? "true" : "false", (long long)c->seq,
            (long long)c->batch, c->layers, c->experts, c->top_k, c->ep, (double)c->capacity_factor,
            cfg->microbatches, mst_schedule_kind_str(cfg->mem.schedule));
    mst_json_write_string(f, cfg->memory_budget || cfg->mem.policy.per_layer ? "planned" : policy);
    fprintf(f, ", \"recompute\": \"%s\", \"mtp_weight\": %g, \"steps\": %lld, \"lr\": %g, \"seed\": %llu, \"data\": ",
            rec, (double)c->mtp_weight, (long long)cfg->steps, (double)cfg->optim.lr, (unsigned long long)c->seed);
    if (cfg->data_path) mst_json_write_string(f, cfg->data_path);
    else fprintf(f, "\"synthetic\"");
    fprintf(f, "},\n");
    fprintf(f, "  \"first_step\": %lld,\n  \"ranks\": %d,\n", (long long)r->first_step, r->world > 1 ? (int)r->world : 1);
    fprintf(f, "  \"model_flops_per_token\": %.6g,\n", mst_model_flops_per_token(c)); /* MFU's numerator a token */
    mst_train_json_array(f, "loss", r->loss, r->first_step, r->steps);
    mst_train_json_array(f, "mtp_loss", r->mtp_loss, r->first_step, r->steps);
    mst_train_json_array(f, "aux_loss", r->aux_loss, r->first_step, r->steps);
    mst_train_json_array(f, "tokens_per_s", r->tok_per_s, r->first_step, r->steps);
    mst_train_json_array(f, "eval_loss", r->eval_loss, r->first_step, r->steps);
    const double last_eval = r->eval_loss[r->steps - 1];
    if (isfinite(last_eval)) { /* bits per token; per byte too where the tokens are bytes */
        fprintf(f, "  \"eval\": {\"loss\": %.9g, \"bits_per_token\": %.9g", last_eval, last_eval / log(2.0));
        if (c->vocab == 256) fprintf(f, ", \"bits_per_byte\": %.9g", last_eval / log(2.0));
        fprintf(f, "},\n");
    }
    fprintf(f, "  \"graph_from_step\": %lld,\n  \"captures\": %lld,\n  \"replays\": %lld,\n", (long long)cfg->graph_from,
            (long long)r->captures, (long long)r->replays);
    fprintf(f, "  \"reruns\": %lld,\n  \"over_budget_reruns\": %lld,\n  \"seconds\": %.3f,\n  \"max_rows\": %lld,\n"
               "  \"weights_hash\": \"%016llx\",\n  \"peak_rows\": [",
            (long long)r->reruns, (long long)r->over_budget, r->seconds, (long long)r->max_rows,
            (unsigned long long)r->weights_hash);
    for (int64_t i = 0; i < (int64_t)(c->layers + 1) * c->ep; i++)
        fprintf(f, "%s%d", i ? ", " : "", r->peak_rows ? r->peak_rows[i] : 0);
    fprintf(f, "],\n");
    if (r->plan) mst_plan_json(f, r->plan, r, cfg);
    mst_train_json_stages(f, r);
    if (r->world > 1) /* the replicated gradients' all-reduce, timed alone */
        fprintf(f, "  \"allreduce\": {\"bytes\": %zu, \"ms\": %.4f, \"overlap\": %d},\n", r->allreduce_bytes,
                r->allreduce_ms, r->grad_overlap);
    if (r->world > 1)
        fprintf(f, "  \"optimizer\": {\"shard\": %d, \"replicated_bytes\": %zu, \"replicated_whole_bytes\": %zu},\n",
                r->optim_shard, r->optim_rep_bytes, r->optim_rep_whole_bytes);
    fprintf(f, "  \"memory_bytes\": {\n");
    json_mem(f, "run", r->mem.run);
    json_mem(f, "keep_static", r->mem.keep);
    json_mem(f, "exact_shapes", r->mem.exact);
    if (r->world > 1) { /* each entry's max over the ranks */
        json_mem(f, "run_max_over_ranks", r->mem_max.run);
        fprintf(f, "    \"backend_peak_max_over_ranks\": %zu,\n", r->mem_max.peak);
    }
    const mst_mem_report_t* q = &r->mem.manager;
    fprintf(f, "    \"dev_pages_peak\": %zu,\n    \"host_pages_peak\": %zu,\n    \"backend_peak\": %zu,\n",
            r->mem.dev_pages_peak, r->mem.host_pages_peak, r->mem.peak);
    fprintf(f, "    \"manager\": {\"kept\": %zu, \"compute\": %zu, \"dev_pages\": %zu, \"host_pages\": %zu, "
               "\"recompute_not_saved\": %zu, \"static_keep\": %zu, \"exact_measured\": %zu, \"overflows\": %d, "
               "\"reruns\": %d}\n  }\n}\n",
            q->kept_bytes, q->compute_bytes, q->dev_pages_bytes, q->host_pages_bytes, q->recompute_bytes,
            q->static_keep_bytes, q->exact_bytes, q->overflows, q->reruns);
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    return bad ? mst_set_error(MST_ERR_IO, "--json '%s': write failed", path) : MST_OK;
}
