/*
 * test_planner_pp.c — `train --pp P --memory-budget` (planner.c, each stage
 * planning its own layers along its own schedule): the ranks of a grid are
 * threads over the CPU twin (`--backend cpu`), or GPUs over NCCL (`--backend
 * cuda`, label gpu: skipped below 2 GPUs, the 2 x 2 case below 4).
 *
 * --pp 2 x 1, 1F1B, M 4: stage 0 holds 2 microbatches in flight of its 3
 * layers, stage 1 one of its 3 and the MTP layer. First a budget no stage
 * binds (1 TiB): every stage's plan is all-KEEP and the run is bit for bit
 * the run without a budget (losses, MTP losses, weights on every rank); the
 * KEEP peaks it predicts per stage are within 5 % of the stage's measured
 * peak. Then a budget between stage 1's predicted KEEP peak and stage 0's
 * (checked: stage 0 needs more, and can fit it): stage 1 keeps everything,
 * stage 0 does not (the stages' plans differ), every rank's measured peak
 * within the budget, each stage's predicted peak within 5 % of its measured
 * one (max over its ranks, as res->grid_peak has it, checked against the
 * ranks' own), every rank holds the same whole plan, the bits again those
 * of the run without a budget. Then a budget 1 byte under the largest of
 * the stages' smallest peaks: refused on every rank (MST_ERR_INVALID)
 * naming --memory-budget, the stage that fits no plan and that peak; at
 * that peak: it runs, every rank within it.
 *
 * --pp 2 x 2: the two ranks of a stage probe different rows (checked) and
 * plan from the max over the stage's ranks (entry by entry against their
 * own probes), so both make the stage's plan; every rank within the budget
 * and the bits those of the run without a budget.
 */
#include <stdint.h>
#include <string.h>

#include "harness.h"
#include "trainer/run/planner.h"
#include "trainer/run/report.h"

static mst_backend_kind kind = MST_BACKEND_CPU;
enum { STEPS = 2, MAXW = 4 };

/* D data-parallel ranks a stage (--ep D; one rank a stage: 2 groups on it). */
static mst_train_config cfg_pp(int32_t D) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 128, .n_head = 2, .n_kv_head = 1, .head_dim = 16,
                          .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 64, .batch = 8,
                          .layers = 6, .experts = 4, .top_k = 2, .ep = D > 1 ? D : 2, .capacity_factor = 2.0f, .mtp_weight = 0.3f,
                          .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f, .seed = 21};
    /* a small step: step 2 routes about as step 1, so no stash pool the first
     * step sized (1.5 times its pages) overflows whatever plan the measured
     * times pick (an overflow's rerun grows the pools past any plan's peak:
     * docs/DESIGN.md 14.7, "Not predicted") */
    mst_optim_config o = {.lr = 1e-4f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 2, .steps = STEPS};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.mem.schedule = MST_SCHEDULE_1F1B;
    t.mem.pool_factor = 1.5; /* no overflow rerun (whose grown pools no plan predicts) */
    t.microbatches = 4;
    t.steps = STEPS;
    t.graph_from = 2;
    t.pp = 2;
    return t;
}

static void free_all(mst_train_result* r, int32_t n) {
    for (int32_t k = 0; k < n; k++) mst_train_result_free(&r[k]);
}

static int same_bits(const mst_train_result* a, const mst_train_result* b) {
    const size_t n = sizeof(double) * STEPS;
    return a->loss && b->loss && mst_first_diff(a->loss, b->loss, n) < 0 && mst_first_diff(a->mtp_loss, b->mtp_loss, n) < 0 &&
           a->weights_hash == b->weights_hash;
}

/* Every (layer, name) of stage s kept and no layer of it recomputed. */
static int all_keep(const mst_plan_report* p, int32_t s) {
    for (int32_t l = 0; l < p->n_all; l++) {
        if (p->stage_of[l] != s) continue;
        if (p->chunk_all[l] >= 0) return 0;
        for (int n = 0; n < MST_N_SAVED; n++)
            if (p->policy_all[l * MST_N_SAVED + n] != MST_POLICY_KEEP) return 0;
    }
    return 1;
}

/* The whole plan the same on ranks a and b. */
static int same_plan(const mst_plan_report* a, const mst_plan_report* b) {
    const int32_t L1 = a->n_all;
    return a->stages == b->stages && L1 == b->n_all &&
           !memcmp(a->policy_all, b->policy_all, sizeof(mst_policy) * (size_t)L1 * MST_N_SAVED) &&
           !memcmp(a->chunk_all, b->chunk_all, sizeof(int32_t) * (size_t)L1) &&
           !memcmp(a->stage_of, b->stage_of, sizeof(int32_t) * (size_t)L1) &&
           !memcmp(a->by_stage, b->by_stage, sizeof(mst_plan_stage) * (size_t)a->stages);
}

static double rel(double pred, double meas) { return (pred - meas) / meas; }

/* A planned run of cfg (budget set) on P x D ranks, checked against the
 * run without a budget (keep [P D]): every rank the same plan, within the
 * budget, each stage's prediction within 5 % of its measured peak, the
 * bits of keep. r [P D] keeps the results. */
static void planned(const mst_train_config* cfg, int32_t D, const mst_train_result* keep, mst_train_result* r,
                    const char* what) {
    const int32_t P = cfg->pp, W = P * D;
    memset(r, 0, sizeof *r * (size_t)W);
    const mst_status st = mst_train_ranks(kind, cfg, W, 0, NULL, NULL, r);
    CHECK(st == MST_OK, "%s: %s", what, mst_last_error());
    if (st != MST_OK) return;
    for (int32_t k = 0; k < W; k++) {
        CHECK(r[k].plan && same_plan(r[0].plan, r[k].plan), "%s: rank %d's plan is not rank 0's", what, k);
        CHECK(r[k].mem.peak <= cfg->memory_budget, "%s: rank %d's measured peak %zu over the budget %zu", what, k,
              r[k].mem.peak, cfg->memory_budget);
        CHECK(r[0].grid_peak && r[0].grid_peak[k] == r[k].mem.peak, "%s: the grid's peak of rank %d %llu, its own %zu",
              what, k, r[0].grid_peak ? (unsigned long long)r[0].grid_peak[k] : 0ull, r[k].mem.peak);
        CHECK(same_bits(&keep[k], &r[k]), "%s: rank %d's losses or weights differ from the run without a budget", what, k);
        CHECK(r[k].reruns == 0, "%s: rank %d reran %lld steps", what, k, (long long)r[k].reruns);
    }
    for (int32_t s = 0; s < P && r[0].plan; s++) {
        const double pred = (double)r[0].plan->by_stage[s].peak, meas = (double)mst_train_stage_peak(&r[0], s);
        CHECK(meas > 0 && rel(pred, meas) >= -0.05 && rel(pred, meas) <= 0.05, "%s: stage %d predicted peak %.0f, "
              "measured %.0f (max over its ranks)", what, s, pred, meas);
        printf("  %-34s stage %d: %d in flight, predicted %.0f, measured %.0f (%+.2f %%), KEEP %zu, smallest %zu%s\n",
               what, s, r[0].plan->by_stage[s].sets, pred, meas, 100 * rel(pred, meas), r[0].plan->by_stage[s].keep_peak,
               r[0].plan->by_stage[s].smallest, all_keep(r[0].plan, s) ? ", all KEEP" : "");
    }
}

/* --pp 2 x 1: all-KEEP at a budget nothing binds, the stages' plans apart
 * at a budget between them, a refusal under the smallest peak. */
static void two_stages(void) {
    mst_train_config c = cfg_pp(1);
    mst_train_result keep[2], big[2], r[2];
    memset(keep, 0, sizeof keep);
    CHECK_OK(mst_train_ranks(kind, &c, 2, 0, NULL, NULL, keep));
    c.memory_budget = (size_t)1 << 40;
    planned(&c, 1, keep, big, "--pp 2, 1 TiB");
    if (!big[0].plan || !big[1].plan) {
        free_all(keep, 2), free_all(big, 2);
        return;
    }
    const mst_plan_stage* b = big[0].plan->by_stage;
    for (int32_t s = 0; s < 2; s++) {
        CHECK(all_keep(big[0].plan, s), "--pp 2, 1 TiB: stage %d's plan is not all KEEP", s);
        const double km = (double)keep[0].stage_mem[s].peak; /* one rank a stage */
        CHECK(rel((double)b[s].keep_peak, km) >= -0.05 && rel((double)b[s].keep_peak, km) <= 0.05,
              "stage %d: KEEP predicted %zu, the run without a budget measured %.0f", s, b[s].keep_peak, km);
    }
    CHECK(b[0].sets == 2 && b[1].sets == 1, "in flight: stage 0 %d, stage 1 %d (1F1B, M 4: 2 and 1)", b[0].sets, b[1].sets);
    /* stage 0 needs more than stage 1 under KEEP and can fit stage 1's */
    const size_t k0 = b[0].keep_peak, k1 = b[1].keep_peak;
    CHECK(k0 > k1 && b[0].smallest < k1, "KEEP: stage 0 %zu, stage 1 %zu; stage 0's smallest %zu: no budget between", k0,
          k1, b[0].smallest);
    if (k0 > k1 && b[0].smallest < k1) {
        c.memory_budget = k1 + (k0 - k1) / 2;
        planned(&c, 1, keep, r, "--pp 2, between the stages");
        if (r[0].plan) {
            CHECK(!all_keep(r[0].plan, 0) && all_keep(r[0].plan, 1), "budget %zu: stage 0's plan %s all KEEP, stage 1's %s",
                  c.memory_budget, all_keep(r[0].plan, 0) ? "is" : "is not", all_keep(r[0].plan, 1) ? "is" : "is not");
            char s0[160], s1[160];
            mst_plan_stage_summary(r[0].plan, 0, s0, sizeof s0);
            mst_plan_stage_summary(r[0].plan, 1, s1, sizeof s1);
            printf("  %-34s budget %zu: stage 0 %s | stage 1 %s\n", "--pp 2, between the stages", c.memory_budget, s0, s1);
        }
        free_all(r, 2);
    }
    /* under the largest smallest peak: every rank refuses, naming the stage */
    const int32_t worst = b[1].smallest > b[0].smallest;
    const size_t need = b[worst].smallest;
    c.memory_budget = need - 1;
    memset(r, 0, sizeof r);
    CHECK_STATUS(mst_train_ranks(kind, &c, 2, 0, NULL, NULL, r), MST_ERR_INVALID);
    char want[160];
    snprintf(want, sizeof want, "no plan fits pipeline stage %d of 2; the smallest peak that would is %zu bytes", worst, need);
    CHECK(strstr(mst_last_error(), "--memory-budget") && strstr(mst_last_error(), want), "message '%s' lacks '%s'",
          mst_last_error(), want);
    for (int32_t k = 0; k < 2; k++)
        CHECK(r[k].plan && r[k].plan->by_stage && r[k].plan->by_stage[worst].failed == 1 &&
                  r[k].plan->by_stage[!worst].failed == 0,
              "budget %zu: rank %d does not see stage %d alone fitting no plan", need - 1, k, worst);
    printf("  %-34s budget %zu: refused: %s\n", "--pp 2, under the smallest", need - 1, mst_last_error());
    free_all(r, 2);
    c.memory_budget = need;
    planned(&c, 1, keep, r, "--pp 2, at the smallest");
    free_all(r, 2);
    free_all(keep, 2);
    free_all(big, 2);
}

/* --pp 2 x 2: a stage's ranks plan from the max over them. */
static void stage_ranks_agree(void) {
    mst_train_config c = cfg_pp(2);
    mst_train_result keep[4], big[4], r[4];
    memset(keep, 0, sizeof keep);
    CHECK_OK(mst_train_ranks(kind, &c, 4, 0, NULL, NULL, keep));
    c.memory_budget = (size_t)1 << 40;
    planned(&c, 2, keep, big, "--pp 2 x 2, 1 TiB");
    size_t budget = 0; /* the largest of the stages' midpoints between smallest and KEEP: each fits, one binds */
    for (int32_t s = 0; big[0].plan && s < 2; s++) {
        const mst_plan_stage* b = &big[0].plan->by_stage[s];
        if (b->smallest + (b->keep_peak - b->smallest) / 2 > budget) budget = b->smallest + (b->keep_peak - b->smallest) / 2;
    }
    free_all(big, 4);
    if (!budget) {
        free_all(keep, 4);
        return;
    }
    c.memory_budget = budget;
    planned(&c, 2, keep, r, "--pp 2 x 2, between");
    for (int32_t s = 0; s < 2 && r[0].plan && r[3].plan; s++) {
        const mst_plan_report *a = r[2 * s].plan, *b = r[2 * s + 1].plan; /* the stage's two ranks */
        const int64_t n = (int64_t)a->bm.n_layers * a->bm.n_micro;
        int64_t differ = 0, bad = -1;
        for (int64_t i = 0; i < n; i++) {
            differ += a->own.rows[i] != b->own.rows[i];
            const int64_t mx = a->own.rows[i] > b->own.rows[i] ? a->own.rows[i] : b->own.rows[i];
            if (bad < 0 && (a->bm.rows[i] != mx || b->bm.rows[i] != mx)) bad = i;
        }
        CHECK(differ > 0, "stage %d: its ranks' probes saved the same rows in all %lld (layer, microbatch)", s, (long long)n);
        CHECK(bad < 0, "stage %d: rows[%lld] planned is not the max over its ranks' own", s, (long long)bad);
        CHECK(a->bm.fixed == b->bm.fixed && a->bm.fixed == (a->own.fixed > b->own.fixed ? a->own.fixed : b->own.fixed) &&
                  !memcmp(a->plan.policy, b->plan.policy, sizeof(mst_policy) * (size_t)a->bm.n_layers * MST_N_SAVED),
              "stage %d: fixed %zu / %zu (own %zu, %zu) or the plans differ", s, a->bm.fixed, b->bm.fixed, a->own.fixed,
              b->own.fixed);
    }
    free_all(r, 4);
    free_all(keep, 4);
}

int main(int argc, char** argv) {
    kind = mst_test_backend_arg(argc, argv);
    const int n_dev = mst_test_devices(kind, MAXW);
    if (n_dev < 2) return mst_test_skip_devices(argv[0], n_dev, "a pipeline of 2 stages needs 2");
    printf("%s on %s\n", argv[0], kind == MST_BACKEND_CPU ? "cpu (ranks as threads)" : "cuda (a GPU a rank)");
    two_stages();
    if (n_dev >= 4) stage_ranks_agree();
    else printf("  --pp 2 x 2 skipped: %d devices\n", n_dev);
    printf("%s: %d passed, %d failed\n", argv[0], mst_test_checks - mst_test_failures, mst_test_failures);
    return mst_test_failures ? 1 : 0;
}
