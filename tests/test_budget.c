/*
 * test_budget.c — the memory-budget planner (src/trainer/plan/budget.c) on budget
 * models made up here, no backend involved:
 *   - the predicted peak and step time of plans written out by hand: KEEP,
 *     every layer recomputed whole, every tensor stashed (plain schedule,
 *     every name restored), every tensor offloaded (1F1B);
 *   - the search against exhaustive search on a small model: the plan fits,
 *     its time is within 1.10x of the fastest plan that fits, a budget below
 *     the smallest peak is refused with that peak;
 *   - bad models and plans name the field.
 */
#include <string.h>

#include "harness.h"
#include "trainer/plan/budget.h"

enum { H = 64, F = 96, R = 1000, PR = 64 };

static const size_t RB[MST_N_SAVED] = {H * 2, 2 * F * 2, F * 2, 4}; /* bytes of a row of each name */

typedef struct fixture {
    mst_budget_model bm;
    mst_sched_entry sched[64];
    int64_t rows[64];
} fixture;

static void make(fixture* x, mst_rng* r, int32_t L1, int32_t M, mst_schedule_kind kind) {
    memset(x, 0, sizeof *x);
    mst_schedule_config sc = {sizeof(mst_schedule_config), kind, 1, 0, M, 1};
    CHECK_OK(mst_schedule_make(&sc, x->sched, 2 * M));
    for (int32_t i = 0; i < L1 * M; i++) x->rows[i] = mst_rng_int(r, R / 3, R);
    mst_budget_model* b = &x->bm;
    *b = (mst_budget_model){.n_layers = L1, .n_micro = M, .n_sets = kind == MST_SCHEDULE_PLAIN ? M : 1, .sched = x->sched, .n_sched = 2 * M,
                            .layers_per_chunk = L1, .rows = x->rows, .max_rows = R, .hidden = H, .ffn = F,
                            .page_rows = PR, .pool_factor = 1.10};
    b->fixed = 1000000 + (size_t)mst_rng_int(r, 0, 99999);
    b->layer_acts = 40000 + (size_t)mst_rng_int(r, 0, 9999);
    b->layer_out = 8192;
    b->mtp_input = 8192;
    b->mtp_module = 30000 + (size_t)mst_rng_int(r, 0, 999);
    b->t_step = 0.1 + 0.01 * mst_rng_uniform(r);
    b->t_layer = 0.004 * (1 + mst_rng_uniform(r));
    b->t_mtp = 0.001;
    b->dev_bw = 1e11 * (1 + mst_rng_uniform(r));
    b->host_bw = 1e10 * (1 + mst_rng_uniform(r));
}

/* A plan of L1 layers with policy q for every (layer, name), evaluated. */
static void every(const mst_budget_model* b, int32_t L1, mst_policy q, mst_budget_plan* p) {
    CHECK_OK(mst_budget_plan_alloc(L1, p));
    for (int i = 0; i < L1 * MST_N_SAVED; i++) p->policy[i] = q;
    CHECK_OK(mst_budget_eval(b, p));
}

static size_t all_rows(void) { return RB[0] + RB[1] + RB[2] + RB[3]; }
static size_t a256(size_t b) { return (b + 255) / 256 * 256; }
static int64_t pages(int64_t rows) { return (rows + PR - 1) / PR; }

static void near(double got, double want, const char* what) {
    CHECK(got > want * (1 - 1e-12) && got < want * (1 + 1e-12), "%s: %.17g, expected %.17g", what, got, want);
}

/* KEEP: fixed + the layers' activations + an [R, cols] buffer per (layer, mb, name). */
static void keep_plan(mst_rng* r) {
    fixture x;
    make(&x, r, 3, 2, MST_SCHEDULE_PLAIN);
    const mst_budget_model* b = &x.bm;
    mst_budget_plan p;
    CHECK_OK(mst_budget_plan_alloc(3, &p));
    CHECK_OK(mst_budget_eval(b, &p));
    const size_t want = b->fixed + 2 * (3 * b->layer_acts + b->mtp_input + b->mtp_module) + 3 * 2 * R * all_rows();
    CHECK(p.peak == want && p.peak_measuring == want && p.peak_sized == want, "KEEP peak %zu (%zu, %zu), expected %zu",
          p.peak, p.peak_measuring, p.peak_sized, want);
    CHECK(p.acts == want - b->fixed, "KEEP activations %zu, expected %zu", p.acts, want - b->fixed);
    near(p.step_s, b->t_step, "KEEP step");
    mst_budget_plan_free(&p);
}

/* Every layer recomputed whole: each keeps its output (the MTP layer
 * nothing), one shared slot of a layer and of the MTP module, a compute and
 * a rerun buffer per name; a forward per (layer, mb) and the MTP module's. */
static void all_recomputed(mst_rng* r) {
    fixture x;
    make(&x, r, 4, 3, MST_SCHEDULE_PLAIN);
    const mst_budget_model* b = &x.bm;
    mst_budget_plan p;
    CHECK_OK(mst_budget_plan_alloc(4, &p));
    for (int32_t l = 0; l < 4; l++) p.chunk_start[l] = l;
    CHECK_OK(mst_budget_eval(b, &p));
    const size_t want = b->fixed + 3 * (3 * b->layer_out + b->mtp_input) + b->layer_acts + b->mtp_module + 2 * R * all_rows();
    CHECK(p.peak == want, "recomputed peak %zu, expected %zu", p.peak, want);
    near(p.step_s, b->t_step + 12 * b->t_layer + 3 * b->t_mtp, "recomputed step");
    p.full = 0; /* grouped MLP only: the layers keep their own activations */
    CHECK_OK(mst_budget_eval(b, &p));
    const size_t moe = b->fixed + 3 * (4 * b->layer_acts + b->mtp_input + b->mtp_module) + 2 * R * all_rows();
    CHECK(p.peak == moe, "moe-recomputed peak %zu, expected %zu", p.peak, moe);
    near(p.step_s, b->t_step + 12 * b->t_layer, "moe-recomputed step");
    mst_budget_plan_free(&p);
}

/* A pipeline stage before the last (no_mtp_layer): its 4 layers all main
 * layers, so recomputed whole each keeps its output (the top one too: the
 * next stage's input), no MTP module nor its rerun; mtp_input (the
 * next-token embedding passed on) still one a set. */
static void stage_before_last(mst_rng* r) {
    fixture x;
    make(&x, r, 4, 3, MST_SCHEDULE_PLAIN);
    mst_budget_model* b = &x.bm;
    b->no_mtp_layer = 1;
    b->mtp_module = 0;
    mst_budget_plan p;
    CHECK_OK(mst_budget_plan_alloc(4, &p));
    for (int32_t l = 0; l < 4; l++) p.chunk_start[l] = l;
    CHECK_OK(mst_budget_eval(b, &p));
    const size_t want = b->fixed + 3 * (4 * b->layer_out + b->mtp_input) + b->layer_acts + 2 * R * all_rows();
    CHECK(p.peak == want, "stage before the last, recomputed: peak %zu, expected %zu", p.peak, want);
    near(p.step_s, b->t_step + 12 * b->t_layer, "stage before the last, recomputed step (no MTP module rerun)");
    b->no_mtp_layer = 2;
    CHECK_STATUS(mst_budget_eval(b, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "no_mtp_layer = 2"), "message: %s", mst_last_error());
    mst_budget_plan_free(&p);
}

/* Every tensor stashed, plain schedule, nothing read in place: the last
 * layer of the last microbatch stays in the compute buffers (its backward
 * follows); every other (layer, mb) is alive at the end of the forwards. */
static void all_stashed(mst_rng* r) {
    fixture x;
    enum { L1 = 3, M = 3 };
    make(&x, r, L1, M, MST_SCHEDULE_PLAIN);
    const mst_budget_model* b = &x.bm;
    mst_budget_plan p;
    every(b, L1, MST_POLICY_STASH, &p);
    int64_t pg = 0, max_rows = 0;
    size_t exact = 0;
    double copies = 0;
    for (int32_t i = 0; i < L1 * M; i++) {
        if (i == (L1 - 1) * M + M - 1) continue; /* layer L1-1, mb M-1 */
        pg += pages(x.rows[i]);
        exact += (size_t)x.rows[i] * all_rows();
        copies += 2.0 * (double)x.rows[i] * (double)all_rows() / b->dev_bw; /* save, restore */
        max_rows = x.rows[i] > max_rows ? x.rows[i] : max_rows;
    }
    const size_t common = b->fixed + M * (L1 * b->layer_acts + b->mtp_input + b->mtp_module) + R * all_rows();
    /* arenas: act_input, fc2_input, fc1_input, probs (widest first), two views each */
    const int order[MST_N_SAVED] = {MST_SAVED_ACT_INPUT, MST_SAVED_FC2_INPUT, MST_SAVED_FC1_INPUT, MST_SAVED_PROBS};
    int64_t rr = (int64_t)((double)max_rows * 1.1) + 1; /* ceil of a non-integer */
    rr = (rr + PR - 1) / PR * PR;
    rr = rr < R ? rr : R;
    size_t at_meas = 0, at = 0, need = 0;
    for (int k = 0; k < 2 * MST_N_SAVED; k++) {
        const size_t rb = RB[order[k / 2]];
        at_meas += a256((size_t)R * rb);
        need = at + (size_t)R * rb > need ? at + (size_t)R * rb : need;
        at += a256((size_t)rr * rb);
    }
    const size_t arena_sized = at > need ? at : need;
    const int64_t dev = (int64_t)((double)pg * 1.1) + 1;
    size_t pools = 0;
    for (int n = 0; n < MST_N_SAVED; n++)
        pools += sizeof(mst_pool_state) + (size_t)dev * 4 + (size_t)dev * PR * RB[n] +
                 (size_t)(L1 * M) * (sizeof(mst_handle_state) + (size_t)pages(rr) * 4);
    CHECK(p.peak_measuring == common + at_meas + exact, "stashed measuring peak %zu, expected %zu", p.peak_measuring,
          common + at_meas + exact);
    CHECK(p.peak_sized == common + arena_sized + pools, "stashed sized peak %zu, expected %zu", p.peak_sized,
          common + arena_sized + pools);
    near(p.step_s, b->t_step + copies, "stashed step");
    mst_budget_plan_free(&p);
}

/* Every tensor offloaded, 1F1B with one stage (F0 B0 F1 B1 ...): one
 * activation set; every (layer, mb) but the last layer is paged and alive
 * within its microbatch only; the measuring step holds no exact copies on
 * the device; the restore buffers stay; copies over PCIe both ways. */
static void all_offloaded(mst_rng* r) {
    fixture x;
    enum { L1 = 3, M = 2 };
    make(&x, r, L1, M, MST_SCHEDULE_1F1B);
    const mst_budget_model* b = &x.bm;
    mst_budget_plan p;
    every(b, L1, MST_POLICY_OFFLOAD, &p);
    size_t at_meas = 0;
    for (int n = 0; n < MST_N_SAVED; n++) at_meas += 2 * a256((size_t)R * RB[n]);
    const size_t common = b->fixed + (L1 * b->layer_acts + b->mtp_input + b->mtp_module) + R * all_rows(); /* one set */
    CHECK(p.peak_measuring == common + at_meas, "offloaded measuring peak %zu, expected %zu (no device copies)",
          p.peak_measuring, common + at_meas);
    double t = b->t_step;
    for (int32_t l = 0; l < L1 - 1; l++)
        for (int32_t mb = 0; mb < M; mb++) t += 2.0 * (double)x.rows[l * M + mb] * (double)all_rows() / b->host_bw;
    near(p.step_s, t, "offloaded step");
    mst_budget_plan_free(&p);
}

/* Every plan of a 2-layer model: per layer, recomputed or one of the 108
 * policy combinations; both granularities. */
typedef struct best { double t, worst; size_t min_peak; } best;

static best exhaustive(const mst_budget_model* b, size_t budget) {
    static const mst_policy ch[4] = {MST_POLICY_KEEP, MST_POLICY_STASH, MST_POLICY_OFFLOAD, MST_POLICY_RECOMPUTE};
    best out = {1e300, 0, SIZE_MAX};
    mst_budget_plan p;
    CHECK_OK(mst_budget_plan_alloc(2, &p));
    for (int full = 0; full < 2; full++)
        for (int a = 0; a < 257; a++)
            for (int c = 0; c < 257; c++) {
                int ok = 1, code[2] = {a, c};
                p.full = full;
                for (int l = 0; l < 2; l++) {
                    p.chunk_start[l] = code[l] == 256 ? l : -1;
                    for (int n = 0, v = code[l]; n < MST_N_SAVED; n++, v /= 4) {
                        p.policy[l * MST_N_SAVED + n] = ch[v % 4];
                        ok &= code[l] == 256 || v % 4 != 3 || n == MST_SAVED_FC2_INPUT;
                    }
                }
                if (!ok) continue;
                CHECK_OK(mst_budget_eval(b, &p));
                if (p.peak < out.min_peak) out.min_peak = p.peak;
                if (p.peak <= budget && p.step_s < out.t) out.t = p.step_s;
                if (p.peak <= budget && p.step_s > out.worst) out.worst = p.step_s;
            }
    mst_budget_plan_free(&p);
    return out;
}

static void search(mst_rng* r) {
    fixture x;
    make(&x, r, 2, 2, MST_SCHEDULE_PLAIN);
    mst_budget_model* b = &x.bm;
    b->reads_pages[MST_SAVED_ACT_INPUT] = 1; /* claims: stashing h costs no copy */
    b->t_layer = 2e-5;                       /* a rerun about as dear as moving a few tensors */
    b->t_step = 1e-4;                        /* the choices matter: plans that fit differ 10x and more */
    mst_budget_plan keep, p;
    CHECK_OK(mst_budget_plan_alloc(2, &keep));
    CHECK_OK(mst_budget_plan_alloc(2, &p));
    CHECK_OK(mst_budget_eval(b, &keep));
    const best lo = exhaustive(b, 0);
    size_t smallest = 0;
    for (int k = 0; k <= 6; k++) {
        const size_t budget = lo.min_peak + (keep.peak - lo.min_peak) * (size_t)k / 6;
        const best ex = exhaustive(b, budget);
        mst_status st = mst_budget_solve(b, budget, &p, &smallest);
        CHECK(st == MST_OK || smallest > budget, "budget %zu: %s", budget, mst_last_error());
        if (st != MST_OK) continue;
        CHECK(p.peak <= budget, "budget %zu: plan peak %zu", budget, p.peak);
        CHECK(p.step_s <= 1.10 * ex.t, "budget %zu: plan %.9f s, the fastest that fits %.9f s", budget, p.step_s, ex.t);
        CHECK(k == 0 || ex.worst > 2 * ex.t, "budget %zu: every plan that fits within 2x of the fastest (%.9f, %.9f s): "
              "the check above could not fail", budget, ex.worst, ex.t);
        mst_budget_plan check;
        CHECK_OK(mst_budget_plan_alloc(2, &check));
        mst_budget_plan_copy(2, &check, &p);
        CHECK_OK(mst_budget_eval(b, &check));
        CHECK(check.peak == p.peak && check.step_s == p.step_s, "the plan's predictions are its eval's");
        mst_budget_plan_free(&check);
    }
    CHECK(smallest >= lo.min_peak && smallest <= lo.min_peak + lo.min_peak / 20,
          "smallest peak %zu, the least of every plan %zu", smallest, lo.min_peak);
    CHECK_STATUS(mst_budget_solve(b, smallest - 1, &p, &smallest), MST_ERR_INVALID);
    char want[64];
    snprintf(want, sizeof want, "the smallest peak is %zu bytes", smallest);
    CHECK(strstr(mst_last_error(), want), "message '%s' lacks '%s'", mst_last_error(), want);
    CHECK_OK(mst_budget_solve(b, smallest, &p, NULL));
    mst_budget_plan_free(&keep);
    mst_budget_plan_free(&p);
}

static void bad_inputs(mst_rng* r) {
    fixture x;
    make(&x, r, 2, 2, MST_SCHEDULE_PLAIN);
    mst_budget_plan p;
    CHECK_OK(mst_budget_plan_alloc(2, &p));
    x.rows[3] = R + 1;
    CHECK_STATUS(mst_budget_eval(&x.bm, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "rows[3] = 1001"), "message: %s", mst_last_error());
    x.rows[3] = R;
    x.bm.host_bw = 0;
    CHECK_STATUS(mst_budget_eval(&x.bm, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "host_bw = 0"), "message: %s", mst_last_error());
    x.bm.host_bw = 1e9;
    p.chunk_start[0] = 1;
    CHECK_STATUS(mst_budget_eval(&x.bm, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "chunk_start[0] = 1"), "message: %s", mst_last_error());
    p.chunk_start[0] = -1;
    p.policy[1 * MST_N_SAVED + MST_SAVED_FC1_INPUT] = MST_POLICY_RECOMPUTE;
    CHECK_STATUS(mst_budget_eval(&x.bm, &p), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "(layer 1, fc1_input)"), "message: %s", mst_last_error());
    mst_budget_plan_free(&p);
}

static void run(mst_ctx_t* ctx) {
    (void)ctx; /* the planner runs on the host */
    mst_rng r = {0xB0D9E7};
    keep_plan(&r);
    all_recomputed(&r);
    stage_before_last(&r);
    all_stashed(&r);
    all_offloaded(&r);
    search(&r);
    bad_inputs(&r);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
