/*
 * test_mem_table.c — the memory table's KEEP and exact-shapes columns count
 * what a run of that policy holds under the same schedule. A STASH run's
 * "KEEP, static max_rows" column, row by row, against the "this run" column
 * of a KEEP run of the same model, data and schedule: M = 3 microbatches
 * under 1F1B on one stage (one activation set in flight) and under the
 * plain schedule (M sets). The exact-shapes column of the grouped MLP is
 * checked against the test's own count: sets x the peak rows of each layer
 * x one routed row's saved bytes (x, h [2F], z bf16; prob fp32).
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/run/trainer.h"

static mst_train_config tiny(const char* policy, mst_schedule_kind sched) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 48, .n_head = 2, .n_kv_head = 2, .head_dim = 16,
                          .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 16, .batch = 2,
                          .layers = 2, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f, .seed = 5};
    mst_optim_config o = {.lr = 1e-3f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 1, .steps = 3};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    CHECK_OK(mst_policy_spec_parse(policy, t.mem.policy.name));
    t.mem.schedule = sched;
    t.microbatches = 3;
    t.steps = 3;
    return t;
}

static void one_schedule(mst_ctx_t* ctx, mst_schedule_kind sched, int64_t sets) {
    mst_train_config ck = tiny("keep", sched), cs = tiny("stash", sched);
    mst_train_result keep = {0}, stash = {0};
    CHECK_OK(mst_train_run(ctx, &ck, NULL, &keep));
    CHECK_OK(mst_train_run(ctx, &cs, NULL, &stash));
    const char* sn = mst_schedule_kind_str(sched);
    for (int k = 0; k < MST_ROW_OTHER; k++) /* OTHER: the context's workspaces, whatever ran before */
        CHECK(stash.mem.keep[k] == keep.mem.run[k], "%s: row '%s': KEEP column of the STASH run %zu bytes, the KEEP "
              "run held %zu", sn, mst_mem_row_str(k), stash.mem.keep[k], keep.mem.run[k]);
    CHECK(stash.mem.keep[MST_ROW_MLP_KEPT] == keep.mem.keep[MST_ROW_MLP_KEPT], "%s: the KEEP column differs between runs", sn);
    /* the exact column: sets x sum over layers of the layer's peak rows (all groups) x row bytes */
    const mst_model_config* c = &cs.model;
    const size_t row = (size_t)(c->hidden + 3 * c->ffn) * 2 + 4;
    size_t want = 0;
    for (int64_t l = 0; l < stash.n_layers; l++) {
        size_t rows = 0;
        for (int64_t g = 0; g < stash.n_groups; g++) rows += (size_t)stash.peak_rows[l * stash.n_groups + g];
        want += rows * (size_t)sets * row;
    }
    CHECK(stash.mem.exact[MST_ROW_MLP_KEPT] == want, "%s: exact shapes %zu bytes, expected %zu (%lld sets)", sn,
          stash.mem.exact[MST_ROW_MLP_KEPT], want, (long long)sets);
    CHECK(stash.mem.exact[MST_ROW_MLP_KEPT] < stash.mem.keep[MST_ROW_MLP_KEPT] + 1, "%s: exact above KEEP", sn);
    mst_train_result_free(&keep);
    mst_train_result_free(&stash);
}

static void run(mst_ctx_t* ctx) {
    one_schedule(ctx, MST_SCHEDULE_1F1B, 1);
    one_schedule(ctx, MST_SCHEDULE_PLAIN, 3);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
