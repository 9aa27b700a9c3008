/*
 * test_train_pp.c — the trainer over a pipeline grid (stage.c): P stages of
 * D data-parallel ranks, against the same model on one stage (--pp 1) of D
 * ranks training the same global batch. `--backend cpu`: the ranks are
 * threads over the CPU twin (activations between stages through its
 * point-to-point rendezvous); `--backend cuda`: thread r on GPU r over NCCL
 * (send/recv inside each rank's step, captured from step 2: graph on),
 * skipped on fewer GPUs than a case needs.
 *
 * What is bit-identical. A stage runs its layers on the same inputs with
 * the same ops as one stage does, and every gradient accumulates in one
 * stage's order: the backward of microbatch 0, 1, .. (1F1B on both), the
 * MTP module's d(next-token embedding) sent back to stage 0 and added into
 * the table's gradient where one stage adds it. So with untied embeddings
 * step 1's losses and every tensor of the checkpoint after it (bf16
 * weights, fp32 master weights, AdamW moments: read back by name from the
 * Hugging Face directory each grid writes) are the bits of one stage, with
 * clipping off: the global norm is summed per stage, then over the stages
 * (another order), so a clip factor below 1 would differ in its last bit.
 * A table tied across stages has two copies whose gradients are summed over
 * the grid (another order): step 1's loss is still one stage's, and the
 * runs then drift apart as rounding does (20 steps within 1e-3 relative).
 *
 * Cases: bad grids refused before any work (P not dividing the layers or
 * the world, D not dividing the experts, interleaved chunks that do not
 * split the layers), each naming --pp; 1F1B at --pp 2 x 1, 2 x 2, 4 x 1
 * and interleaved (2 and 3 chunks a stage, a stage 0 all warm-up) bit for
 * bit against --pp 1 x D with the same schedule after one step
 * (checkpoint tensors by name); --pp 2 x 2 with tied embeddings
 * over 20 steps; KEEP, STASH and layer recompute bit-identical on a grid,
 * and the optimizer sharded over each stage's ranks (ZeRO-1) against not;
 * a --pp 2 x 2 run resumed from its step-3 checkpoint matches the run
 * without a stop.
 */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "trainer/io/hf.h"
#include "trainer/run/checkpoint.h"

static mst_backend_kind kind = MST_BACKEND_CPU;
static char tmp_root[256];

/* B sequences per data-parallel rank; L layers; D ranks a stage (--ep D). */
static mst_train_config small(int32_t D, int32_t L, int64_t steps) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 32, .n_head = 2, .n_kv_head = 1, .head_dim = 16,
                          .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 0, .seq = 16, .batch = 2,
                          .layers = L, .experts = 8, .top_k = 2, .ep = D > 1 ? D : 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f, .seed = 7};
    mst_optim_config o = {.lr = 3e-3f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1e30f, .warmup = 3, .steps = steps};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.mem.schedule = MST_SCHEDULE_1F1B;
    t.microbatches = 4;
    t.steps = steps;
    t.graph_from = 2; /* CUDA: the step with its sends and receives replayed from a graph */
    return t;
}

/* cfg on `world` ranks in `pp` stages; res [world]. */
static mst_status grid(mst_train_config cfg, int32_t pp, int32_t world, mst_train_result* res) {
    cfg.pp = pp;
    if (world > 1) return mst_train_ranks(kind, &cfg, world, 0, NULL, NULL, res);
    mst_ctx_t* ctx = NULL; /* one rank (its --ep groups as the stages' of one rank) */
    MST_TRY(mst_ctx_create(kind, 0, &ctx));
    mst_status st = mst_train_run(ctx, &cfg, NULL, res);
    mst_ctx_destroy(ctx);
    return st;
}

static void free_all(mst_train_result* res, int32_t n) {
    for (int32_t r = 0; r < n; r++) mst_train_result_free(&res[r]);
}

/* ---- bad grids ------------------------------------------------------------------ */

/* The worst relative difference of a's losses from ref's over the steps (NaN
 * where a difference is NaN). */
static double worst_loss_diff(const mst_train_result* a, const mst_train_result* ref, int64_t steps) {
    double w = 0;
    for (int64_t i = 0; i < steps; i++) {
        const double d = fabs(a->loss[i] - ref->loss[i]) / ref->loss[i];
        w = d > w || isnan(d) ? d : w;
    }
    return w;
}

static void refused(mst_train_config c, int32_t pp, int32_t world, const char* what) {
    char want[32];
    snprintf(want, sizeof want, "--pp %d", pp);
    mst_status st = mst_model_grid_check(&c.model, pp, world, c.mem.schedule, c.mem.virtual_stages);
    CHECK(st == MST_ERR_INVALID && strstr(mst_last_error(), want), "%s: grid check gave %s (%s), want invalid naming %s",
          what, mst_status_str(st), mst_last_error(), want);
    c.pp = pp;
    mst_train_result res[8];
    memset(res, 0, sizeof res);
    st = mst_train_ranks(kind, &c, world, 0, NULL, NULL, res); /* refused before any rank starts */
    CHECK(st == MST_ERR_INVALID && strstr(mst_last_error(), want) && !res[0].loss,
          "%s: mst_train_ranks gave %s (%s)", what, mst_status_str(st), mst_last_error());
    free_all(res, 8);
    printf("  %-40s refused: %s\n", what, mst_last_error());
}

static void bad_grids(void) {
    mst_train_config c = small(1, 2, 1);
    c.model.layers = 3;
    refused(c, 2, 2, "P not dividing the layers");
    refused(small(1, 2, 1), 2, 3, "P not dividing the world");
    refused(small(1, 4, 1), 4, 2, "a world smaller than P");
    c = small(3, 2, 1); /* D 3 does not divide 8 experts */
    refused(c, 2, 6, "D not dividing the experts");
    c = small(1, 4, 1); /* 5 layers do not split over 2 x 2 virtual stages */
    c.mem.schedule = MST_SCHEDULE_INTERLEAVED;
    c.mem.virtual_stages = 2;
    refused(c, 2, 2, "interleaved: P V not dividing L + 1");
    c.model.layers = 3; /* 4 layers over 2 x 2 virtual stages: 1 each */
    refused(c, 2, 2, "interleaved: one layer a virtual stage");
    c = small(2, 2, 1);
    CHECK_OK(mst_model_grid_check(&c.model, 2, 4, MST_SCHEDULE_1F1B, 1));
}

/* ---- bit for bit against one stage ------------------------------------------------ */

/* Every tensor of the checkpoint directories a and b (model, MTP and
 * optimizer sets, by name) the same bits; the number that differ. */
static int64_t ckpt_diff(const mst_model_config* c, const char* a, const char* b, char* first, size_t cap) {
    const int32_t np = mst_hf_n_params(c);
    mst_hf_param* p = (mst_hf_param*)malloc(sizeof *p * (size_t)np);
    mst_hf *h[2][3] = {{NULL}};
    const char* dirs[2] = {a, b};
    int64_t bad = 0;
    first[0] = 0;
    for (int k = 0; k < 2; k++) {
        CHECK_OK(mst_hf_open_set(dirs[k], "model", 1, &h[k][0]));
        CHECK_OK(mst_hf_open_set(dirs[k], "mtp", 1, &h[k][1]));
        CHECK_OK(mst_hf_open_set(dirs[k], "optimizer", 1, &h[k][2]));
    }
    mst_hf_params(c, NULL, p);
    static const char* const opt[3] = {"master.", "adam_m.", "adam_v."};
    for (int32_t i = 0; p && h[0][2] && h[1][2] && i < np; i++) {
        const int64_t n = mst_hf_numel(&p[i]);
        float* x = (float*)malloc(sizeof(float) * (size_t)n * 2);
        for (int t = 0; x && t < 4; t++) { /* the bf16 weight, then master, m, v */
            char name[200];
            snprintf(name, sizeof name, "%s%s", t ? opt[t - 1] : "", p[i].name);
            const int set = t ? 2 : p[i].set == MST_HF_MTP;
            for (int k = 0; k < 2; k++)
                CHECK_OK(mst_hf_read(h[k][set], name, p[i].nd, p[i].dims, MST_ST_F32, x + k * n));
            if (mst_first_diff(x, x + n, sizeof(float) * (size_t)n) >= 0 && !bad++) snprintf(first, cap, "%s", name);
        }
        free(x);
    }
    for (int k = 0; k < 2; k++)
        for (int s = 0; s < 3; s++) mst_hf_close(h[k][s]);
    free(p);
    return bad;
}

/* P x D after one step against 1 x D: losses and the final checkpoint. V
 * > 1: interleaved, V chunks a stage (one stage: V chunks too). */
static void bits_against_one_stage(int32_t P, int32_t D, int32_t L, int32_t V, int32_t M) {
    mst_train_config c = small(D, L, 1);
    c.microbatches = M;
    if (V > 1) c.mem.schedule = MST_SCHEDULE_INTERLEAVED, c.mem.virtual_stages = V;
    char da[400], db[400];
    snprintf(da, sizeof da, "%s/one-%d-%d-%d-%d-%d", tmp_root, P, D, L, V, M);
    snprintf(db, sizeof db, "%s/grid-%d-%d-%d-%d-%d", tmp_root, P, D, L, V, M);
    mst_train_result one[4], res[8];
    memset(one, 0, sizeof one);
    memset(res, 0, sizeof res);
    c.save_dir = da;
    CHECK_OK(grid(c, 1, D, one));
    c.save_dir = db;
    CHECK_OK(grid(c, P, P * D, res));
    if (one[0].loss && res[0].loss) {
        for (int32_t r = 1; r < P * D; r++)
            CHECK(res[r].loss[0] == res[0].loss[0], "--pp %d x %d: rank %d's loss %.17g, rank 0's %.17g", P, D, r,
                  res[r].loss[0], res[0].loss[0]);
        CHECK(res[0].loss[0] == one[0].loss[0] && res[0].mtp_loss[0] == one[0].mtp_loss[0],
              "--pp %d x %d: step 1 loss %.17g (mtp %.17g), one stage %.17g (%.17g)", P, D, res[0].loss[0],
              res[0].mtp_loss[0], one[0].loss[0], one[0].mtp_loss[0]);
        char path[2][500], first[200];
        snprintf(path[0], sizeof path[0], "%s/final", da);
        snprintf(path[1], sizeof path[1], "%s/final", db);
        const int64_t bad = ckpt_diff(&c.model, path[0], path[1], first, sizeof first);
        CHECK(bad == 0, "--pp %d x %d, %d layers: %lld checkpoint tensors differ from one stage's after step 1 (first: %s)",
              P, D, L, (long long)bad, first);
        printf("  %-40s --pp %d x %d, %d layers, %s, M %d: step 1 loss %.6f and every checkpoint tensor %s one "
               "stage's\n", "bits", P, D, L, V > 1 ? (V == 2 ? "interleaved 2 chunks" : "interleaved 3 chunks") : "1f1b",
               M, res[0].loss[0], bad ? "DIFFER from" : "bit-identical to");
    }
    free_all(one, 4);
    free_all(res, 8);
}

/* --pp 2 x 2 with the table tied across the stages: 20 steps. */
static void drift_tied(void) {
    mst_train_config c = small(2, 2, 20);
    c.model.tie_embeddings = 1;
    c.optim.clip = 1.0f;
    mst_train_result one[2], res[4];
    memset(one, 0, sizeof one);
    memset(res, 0, sizeof res);
    CHECK_OK(grid(c, 1, 2, one));
    CHECK_OK(grid(c, 2, 4, res));
    if (one[0].loss && res[0].loss) {
        const double w = worst_loss_diff(&res[0], &one[0], c.steps);
        printf("  %-40s --pp 2 x 2 vs --pp 1 x 2: loss %.5f -> %.5f, worst relative difference over 20 steps %.2e; step 1 "
               "%s\n", "tied embeddings", res[0].loss[0], res[0].loss[19], w,
               res[0].loss[0] == one[0].loss[0] ? "bit-identical" : "DIFFERS");
        CHECK(res[0].loss[0] == one[0].loss[0], "tied: step 1 loss %.17g vs %.17g", res[0].loss[0], one[0].loss[0]);
        CHECK(w <= 1e-3, "tied: the losses differ from one stage by %.3g relative", w);
        CHECK(res[0].loss[19] < 0.8 * res[0].loss[0], "tied: the loss did not fall (%.4f -> %.4f)", res[0].loss[0],
              res[0].loss[19]);
    }
    free_all(one, 2);
    free_all(res, 4);
}

/* Clipping active (clip 1e-3, far under the gradient norm): the norm is
 * summed per stage and then over the stages, one stage's in another order,
 * so the clip factors differ in their last bits at most: 3 steps within
 * 1e-5 relative of one stage (a stage clipping by its own norm is off by
 * far more). */
static void clipped(void) {
    mst_train_config c = small(1, 2, 3);
    c.optim.clip = 1e-3f;
    mst_train_result one[1], res[2];
    memset(one, 0, sizeof one);
    memset(res, 0, sizeof res);
    CHECK_OK(grid(c, 1, 1, one));
    CHECK_OK(grid(c, 2, 2, res));
    if (one[0].loss && res[0].loss) {
        const double w = worst_loss_diff(&res[0], &one[0], c.steps);
        printf("  %-40s --pp 2 x 1 vs one stage, clip 1e-3: worst relative loss difference over 3 steps %.2e\n",
               "clipped", w);
        CHECK(w <= 1e-5, "clipped: the losses differ from one stage by %.3g relative (the gradient norm over the stages)", w);
    }
    free_all(one, 1);
    free_all(res, 2);
}

/* ---- between runs on one grid ------------------------------------------------------ */

static void same_run(const mst_train_result* a, const mst_train_result* b, int64_t from, const char* what) {
    const size_t n = sizeof(double) * (size_t)(a->steps - from);
    CHECK(!memcmp(a->loss + from, b->loss + from, n) && !memcmp(a->mtp_loss + from, b->mtp_loss + from, n) &&
              a->weights_hash == b->weights_hash,
          "%s: not bit-identical (last loss %.17g vs %.17g)", what, a->loss[a->steps - 1], b->loss[b->steps - 1]);
}

static void policies_on_grid(void) {
    static const struct { const char* policy; const char* recompute; } runs[] = {
        {"keep", "none"}, {"stash", "none"}, {"stash", "uniform:1"}};
    mst_train_result base[4], r[4];
    memset(base, 0, sizeof base);
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        mst_train_config c = small(2, 2, 4);
        c.model.tie_embeddings = 1;
        CHECK_OK(mst_policy_spec_parse(runs[i].policy, c.mem.policy.name));
        CHECK_OK(mst_recompute_parse(runs[i].recompute, &c.mem.recompute));
        memset(r, 0, sizeof r);
        CHECK_OK(grid(c, 2, 4, i == 0 ? base : r));
        if (i == 0 || !base[0].loss || !r[0].loss) continue;
        for (int32_t k = 0; k < 4; k++) same_run(&base[k], &r[k], 0, runs[i].policy);
        printf("  %-40s --pp 2 x 2, policy %s, recompute %s: every rank bit-identical to keep\n", "policies",
               runs[i].policy, runs[i].recompute);
        free_all(r, 4);
    }
    free_all(base, 4);
}

/* The seeds' setting: stage 0 of --pp 4 holds 4 microbatches in flight
 * (1F1B, M 8); one rank a stage keeps its --ep 4 groups local, each
 * budgeted for its dropless worst case (capacity factor 4: every row), so
 * KEEP's static buffers are 4x the rows in flight; STASH's pages hold the
 * rows there are. Stage 0's saved grouped-MLP bytes under STASH <= 0.5x
 * KEEP's (the target), and every rank's bits the same. */
static void stash_on_stage0(void) {
    mst_train_config c = small(1, 4, 3);
    c.model.ep = 4;
    c.model.capacity_factor = 4.0f;
    c.microbatches = 8;
    mst_train_result keep[4], stash[4];
    memset(keep, 0, sizeof keep);
    memset(stash, 0, sizeof stash);
    CHECK_OK(grid(c, 4, 4, keep));
    CHECK_OK(mst_policy_spec_parse("stash", c.mem.policy.name));
    CHECK_OK(grid(c, 4, 4, stash));
    if (keep[0].stage_mem && stash[0].stage_mem) {
        for (int32_t k = 0; k < 4; k++) same_run(&keep[k], &stash[k], 0, "--pp 4, stash against keep");
        const size_t* kr = keep[0].stage_mem[0].run;
        const size_t* sr = stash[0].stage_mem[0].run;
        const double kb = (double)(kr[MST_ROW_MLP_KEPT] + kr[MST_ROW_MLP_DEV_PAGES]);
        const double sb = (double)(sr[MST_ROW_MLP_KEPT] + sr[MST_ROW_MLP_DEV_PAGES]);
        CHECK(keep[0].stage_sets[0] == 4 && kb > 0 && sb <= 0.5 * kb,
              "--pp 4, M 8, --ep 4 a stage: stage 0 (%d in flight) saved grouped-MLP bytes STASH %.0f, KEEP %.0f (%.3fx; "
              "expected <= 0.5x)", keep[0].stage_sets[0], sb, kb, sb / kb);
        printf("  %-40s --pp 4 x 1, M 8, --ep 4 a stage: stage 0 (%d in flight) grouped-MLP saved STASH / KEEP %.3f, "
               "bits the same\n", "stash on stage 0", keep[0].stage_sets[0], sb / kb);
    }
    free_all(keep, 4);
    free_all(stash, 4);
}

/* ZeRO-1 over each stage's data-parallel ranks (shard.c): the same bits as
 * unsharded (the reduce-scatter sums as the all-reduce, every transport). */
static void shard_on_grid(void) {
    mst_train_config c = small(2, 2, 4);
    c.model.tie_embeddings = 1;
    mst_train_result off[4], on[4];
    memset(off, 0, sizeof off);
    memset(on, 0, sizeof on);
    CHECK_OK(grid(c, 2, 4, off));
    c.mem.optimizer_shard = 1;
    CHECK_OK(grid(c, 2, 4, on));
    if (off[0].loss && on[0].loss) {
        for (int32_t k = 0; k < 4; k++) same_run(&off[k], &on[k], 0, "--pp 2 x 2 --optimizer-shard on");
        CHECK(on[0].optim_shard && on[0].optim_rep_bytes < off[0].optim_rep_bytes,
              "--optimizer-shard on: %zu bytes of replicated state a rank, off %zu", on[0].optim_rep_bytes,
              off[0].optim_rep_bytes);
        printf("  %-40s --pp 2 x 2: replicated optimizer state %zu -> %zu bytes a rank, %s\n", "optimizer shard",
               off[0].optim_rep_bytes, on[0].optim_rep_bytes,
               "every rank bit-identical to unsharded");
    }
    free_all(off, 4);
    free_all(on, 4);
}

static void resume_on_grid(void) {
    mst_train_config c = small(2, 2, 6);
    char dir[400], ck[500];
    snprintf(dir, sizeof dir, "%s/resume", tmp_root);
    snprintf(ck, sizeof ck, "%s/step-3", dir);
    c.save_dir = dir;
    c.save_every = 3;
    mst_train_result a[4], b[4];
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    CHECK_OK(grid(c, 2, 4, a));
    mst_ckpt_meta meta;
    CHECK_OK(mst_ckpt_read_meta(ck, &meta));
    CHECK(meta.ranks == 4 && meta.cfg.pp == 2, "step-3 checkpoint: %d ranks, pp %d", meta.ranks, meta.cfg.pp);
    mst_train_config r = meta.cfg;
    r.resume_dir = ck;
    r.graph_from = 2;
    CHECK_OK(mst_train_ranks(kind, &r, 4, 0, NULL, NULL, b));
    if (a[0].loss && b[0].loss) {
        CHECK(b[0].first_step == 4, "resumed at step %lld", (long long)b[0].first_step);
        for (int32_t k = 0; k < 4; k++) same_run(&a[k], &b[k], 3, "resumed --pp 2 x 2");
        printf("  %-40s --pp 2 x 2 resumed at step 3: steps 4-6 and every rank's weights bit-identical\n", "resume");
    }
    r.pp = 1; /* the same ranks as one stage: another configuration */
    mst_train_result x[4];
    memset(x, 0, sizeof x);
    CHECK_STATUS(mst_train_ranks(kind, &r, 4, 0, NULL, NULL, x), MST_ERR_INVALID);
    free_all(x, 4);
    free_all(a, 4);
    free_all(b, 4);
}

int main(int argc, char** argv) {
    kind = mst_test_backend_arg(argc, argv);
    const int n_dev = mst_test_devices(kind, 8);
    if (n_dev < 2) return mst_test_skip_devices(argv[0], n_dev, "a pipeline of 2 stages needs 2");
    snprintf(tmp_root, sizeof tmp_root, "/tmp/mst-pp-XXXXXX");
    if (!mkdtemp(tmp_root)) return 1;
    bad_grids();
    bits_against_one_stage(2, 1, 2, 1, 4);
    bits_against_one_stage(2, 1, 7, 2, 4);  /* interleaved: 4 virtual stages of 2 layers */
    bits_against_one_stage(2, 1, 11, 3, 6); /* 6 virtual stages of 2 layers */
    clipped();
    if (n_dev >= 4) {
        bits_against_one_stage(2, 2, 2, 1, 4);
        bits_against_one_stage(4, 1, 4, 1, 4);
        bits_against_one_stage(4, 1, 15, 2, 4); /* every entry of stage 0 a warm-up forward, then the backwards */
        bits_against_one_stage(2, 2, 7, 2, 6);
        drift_tied();
        policies_on_grid();
        stash_on_stage0();
        shard_on_grid();
        resume_on_grid();
    } else {
        printf("  4-rank cases skipped: %d devices\n", n_dev);
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    if (system(cmd) != 0) printf("  could not remove %s\n", tmp_root);
    printf("%s: %d passed, %d failed\n", argv[0], mst_test_checks - mst_test_failures, mst_test_failures);
    return mst_test_failures ? 1 : 0;
}
