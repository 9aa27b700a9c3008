/*
 * test_planner.c — `train --memory-budget` end to end (src/model/planner.c):
 * for budgets between the all-OFFLOAD and the all-KEEP peaks, the planned
 * run's measured backend peak is within the budget, the plan's predicted
 * peak is within 5 % of the measured one (KEEP's and all-OFFLOAD's too), and the losses, MTP losses and
 * final weights are bit-identical to KEEP's (the step graph on where the
 * backend captures); a budget below the smallest peak is refused
 * (MST_ERR_INVALID) naming that peak, and that peak fits.
 */
#include <string.h>

#include "harness.h"
#include "model/planner.h"

enum { STEPS = 2 };

static mst_train_config tiny(void) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 64, .n_head = 2, .seq = 32, .batch = 4,
                          .layers = 3, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f,
                          .seed = 11};
    mst_optim_config o = {.lr = 1e-2f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 2, .steps = STEPS};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.microbatches = 2;
    t.steps = STEPS;
    t.graph_from = 2; /* CUDA: steps after the first replayed from the captured step */
    return t;
}

static int same_run(const mst_train_result* a, const mst_train_result* b) {
    return a->loss && b->loss && mst_first_diff(a->loss, b->loss, sizeof(double) * STEPS) < 0 &&
           mst_first_diff(a->mtp_loss, b->mtp_loss, sizeof(double) * STEPS) < 0 && a->weights_hash == b->weights_hash;
}

/* Budgets at fractions `at` of the way from the all-OFFLOAD to the all-KEEP
 * peak under schedule `sched`; returns the smallest peak the planner said it
 * reaches, and KEEP's run in *keep. */
static size_t budgets(mst_ctx_t* ctx, mst_schedule_kind sched, const double* at, int n_at, mst_train_result* keep) {
    mst_train_config cfg = tiny();
    cfg.mem.schedule = sched;
    mst_train_result off = {0};
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, keep));
    cfg.mem.policy = "offload";
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &off));
    const size_t hi = keep->mem.peak, lo = off.mem.peak;
    CHECK(lo < hi && same_run(keep, &off), "%s: all-OFFLOAD peak %zu, all-KEEP %zu (bits %s)",
          mst_schedule_kind_str(sched), lo, hi, same_run(keep, &off) ? "same" : "differ");
    size_t smallest = 0;
    for (int k = 0; k < n_at; k++) {
        mst_train_config b = tiny();
        b.mem.schedule = sched;
        b.memory_budget = lo + (size_t)((double)(hi - lo) * at[k]);
        mst_train_result r = {0};
        CHECK_OK(mst_train_run(ctx, &b, NULL, &r));
        if (!r.plan) {
            mst_train_result_free(&r);
            continue;
        }
        const double pred = (double)r.plan->plan.peak, meas = (double)r.mem.peak;
        CHECK(r.mem.peak <= b.memory_budget, "budget %zu: measured peak %zu", b.memory_budget, r.mem.peak);
        CHECK(pred >= 0.95 * meas && pred <= 1.05 * meas, "%s, budget %zu: predicted peak %.0f, measured %.0f",
              mst_schedule_kind_str(sched), b.memory_budget, pred, meas);
        CHECK(same_run(keep, &r), "budget %zu: losses or weights differ from KEEP's", b.memory_budget);
        const double kp = (double)r.plan->keep.peak, km = (double)keep->mem.peak;
        CHECK(kp >= 0.95 * km && kp <= 1.05 * km, "%s, KEEP: predicted peak %.0f, measured %.0f",
              mst_schedule_kind_str(sched), kp, km);
        mst_budget_plan o; /* all-OFFLOAD as the planner sees it: no device copies in the measuring step */
        CHECK_OK(mst_budget_plan_alloc(r.plan->bm.n_layers, &o));
        for (int32_t i = 0; i < r.plan->bm.n_layers * MST_N_SAVED; i++) o.policy[i] = MST_POLICY_OFFLOAD;
        CHECK_OK(mst_budget_eval(&r.plan->bm, &o));
        CHECK(o.peak >= 0.95 * (double)lo && o.peak <= 1.05 * (double)lo, "%s, all-OFFLOAD: predicted peak %zu, "
              "measured %zu", mst_schedule_kind_str(sched), o.peak, lo);
        mst_budget_plan_free(&o);
        smallest = r.plan->smallest;
        mst_train_result_free(&r);
    }
    CHECK(smallest > 0 && smallest <= lo, "smallest peak %zu, all-OFFLOAD's %zu", smallest, lo);
    mst_train_result_free(&off);
    return smallest;
}

static void run(mst_ctx_t* ctx) {
    mst_train_result keep = {0};
    const double plain[] = {0.25, 0.9}, one_f_one_b[] = {0.5};
    budgets(ctx, MST_SCHEDULE_PLAIN, plain, 2, &keep);
    mst_train_result_free(&keep);
    const size_t smallest = budgets(ctx, MST_SCHEDULE_1F1B, one_f_one_b, 1, &keep); /* one activation set */
    mst_train_config b = tiny();
    b.mem.schedule = MST_SCHEDULE_1F1B;
    b.memory_budget = smallest - 1;
    mst_train_result r = {0};
    CHECK_STATUS(mst_train_run(ctx, &b, NULL, &r), MST_ERR_INVALID);
    char want[96];
    snprintf(want, sizeof want, "the smallest peak that would is %zu bytes", smallest);
    CHECK(strstr(mst_last_error(), "--memory-budget") && strstr(mst_last_error(), want), "message '%s' lacks '%s'",
          mst_last_error(), want);
    mst_train_result_free(&r);
    b.memory_budget = smallest;
    CHECK_OK(mst_train_run(ctx, &b, NULL, &r));
    CHECK(r.mem.peak <= smallest && same_run(&keep, &r), "at the smallest peak %zu: measured %zu", smallest, r.mem.peak);
    mst_train_result_free(&r);
    mst_train_result_free(&keep);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
