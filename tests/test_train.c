/*
 * test_train.c — the trainer end to end on a tiny configuration: a 20-step
 * run whose loss falls; the same run again gives the same bits; a step forced
 * over budget, and a capacity factor so small that every step is over
 * budget, are rerun with exact shapes and give bit-identical losses; a
 * forced stash-pool overflow, and pools sized below their measured peak, are
 * rerun as measuring steps with bit-identical losses; two microbatches under
 * each schedule; every policy of --check-policies run here and compared bit
 * for bit, then --check-policies itself (hashes, verdicts, and a run that
 * differs); --graph on against off, bit for bit,
 * under every policy, schedule and layer recompute, with forced reruns
 * (captures counted). Then every bad-input case of
 * `moestash train` (the built program next to this test): exit code 2 and
 * one line naming the flag and its value.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/run/trainer.h"

static const char* self_path; /* argv[0]: the moestash program is beside it */

static mst_train_config tiny(void) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 32, .n_head = 2,
                          .n_kv_head = 1, .head_dim = 16, .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 16, .batch = 4,
                          .layers = 1, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f,
                          .seed = 3};
    mst_optim_config o = {.lr = 1e-2f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 3, .steps = 20};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.microbatches = 1;
    t.steps = 20;
    return t;
}

static double mean(const double* v, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += v[i];
    return s / n;
}

static void same_losses(const mst_train_result* a, const mst_train_result* b, const char* what) {
    CHECK(mst_first_diff(a->loss, b->loss, sizeof(double) * (size_t)a->steps) < 0 &&
              mst_first_diff(a->mtp_loss, b->mtp_loss, sizeof(double) * (size_t)a->steps) < 0,
          "%s: losses differ from the plain run (step 1: %.9g vs %.9g, last: %.9g vs %.9g)", what,
          a->loss[0], b->loss[0], a->loss[a->steps - 1], b->loss[b->steps - 1]);
}

static void check_policies(mst_ctx_t* ctx);
static void fp8_pages(mst_ctx_t* ctx);

static void training(mst_ctx_t* ctx) {
    mst_train_config cfg = tiny();
    mst_train_result base = {0}, again = {0}, forced = {0}, small = {0};
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &base));
    if (!base.loss) return;
    printf("  20 steps: loss %.4f -> %.4f, mtp %.4f -> %.4f\n", base.loss[0], base.loss[19],
           base.mtp_loss[0], base.mtp_loss[19]);
    CHECK(mean(base.loss + 15, 5) < 0.8 * mean(base.loss, 5), "loss did not fall: first 5 %.4f, last 5 %.4f",
          mean(base.loss, 5), mean(base.loss + 15, 5));
    CHECK(mean(base.mtp_loss + 15, 5) < 0.8 * mean(base.mtp_loss, 5), "mtp loss did not fall");
    CHECK(base.reruns == 0, "plain run had %lld reruns", (long long)base.reruns);

    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &again));
    if (again.loss) same_losses(&base, &again, "second run");

    cfg.force_over_budget = 4;
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &forced));
    CHECK(forced.reruns == 1, "forced over budget: %lld reruns, expected 1", (long long)forced.reruns);
    if (forced.loss) same_losses(&base, &forced, "forced over budget");

    cfg = tiny();
    cfg.model.capacity_factor = 0.3f; /* R far below what a group gets */
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &small));
    CHECK(small.reruns >= cfg.steps, "capacity factor 0.3: %lld reruns, expected one or more per step (%lld)",
          (long long)small.reruns, (long long)cfg.steps);
    if (small.loss) same_losses(&base, &small, "capacity factor 0.3");

    mst_train_result overflow = {0}, tight = {0};
    cfg = tiny();
    cfg.force_overflow = 5;
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &overflow));
    CHECK(overflow.reruns == 1 && overflow.over_budget == 0, "forced overflow: %lld reruns (%lld over budget), expected 1 (0)",
          (long long)overflow.reruns, (long long)overflow.over_budget);
    if (overflow.loss) same_losses(&base, &overflow, "forced overflow");

    cfg = tiny();
    CHECK_OK(mst_policy_spec_parse("stash", cfg.mem.policy.name));
    cfg.mem.pool_factor = 0.5; /* pools at half the measured peak: every sized step overflows */
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &tight));
    CHECK(tight.reruns == cfg.steps - 1 && tight.mem.manager.overflows == cfg.steps - 1,
          "stash pools at half their peak: %lld reruns, %d overflows, expected %lld", (long long)tight.reruns,
          tight.mem.manager.overflows, (long long)(cfg.steps - 1));
    if (tight.loss) same_losses(&base, &tight, "stash pool overflows");
    mst_train_result_free(&overflow);
    mst_train_result_free(&tight);

    const mst_schedule_kind kinds[] = {MST_SCHEDULE_PLAIN, MST_SCHEDULE_1F1B, MST_SCHEDULE_INTERLEAVED};
    for (int k = 0; k < 3; k++) {
        cfg = tiny();
        cfg.microbatches = 2;
        cfg.mem.schedule = kinds[k];
        cfg.mem.virtual_stages = kinds[k] == MST_SCHEDULE_INTERLEAVED ? 2 : 1;
        CHECK_OK(mst_policy_spec_parse("stash", cfg.mem.policy.name));
        mst_train_result r = {0};
        CHECK_OK(mst_train_run(ctx, &cfg, NULL, &r));
        if (r.loss)
            CHECK(mean(r.loss + 15, 5) < 0.8 * mean(r.loss, 5), "2 microbatches, %s: loss did not fall",
                  mst_schedule_kind_str(kinds[k]));
        mst_train_result_free(&r);
    }
    mst_train_result* all[] = {&base, &again, &forced, &small};
    for (int i = 0; i < 4; i++) mst_train_result_free(all[i]);

    check_policies(ctx);
    fp8_pages(ctx);
}

/* fp8 pages: run to run the same bits, and a step rerun (over budget, pool
 * overflow) gives the bits of one that never needed it (the measuring step
 * quantizes as the pages do); the losses differ from bf16 STASH's (the
 * pages are fp8) but stay within 1 % of them over the first 5 steps (the
 * tiny model's trajectories part later, as any two roundings' do) and fall
 * as far. */
static void fp8_pages(mst_ctx_t* ctx) {
    mst_train_config cfg = tiny();
    mst_train_result bf16 = {0}, a = {0}, b = {0}, forced = {0};
    CHECK_OK(mst_policy_spec_parse("stash", cfg.mem.policy.name));
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &bf16));
    CHECK_OK(mst_policy_spec_parse("stash:fp8", cfg.mem.policy.name));
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &a));
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &b));
    cfg.force_over_budget = 4;
    cfg.force_overflow = 7;
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &forced));
    if (a.loss && b.loss && forced.loss && bf16.loss) {
        same_losses(&a, &b, "fp8 pages, second run");
        same_losses(&a, &forced, "fp8 pages, reruns at steps 4 and 7");
        CHECK(a.weights_hash == b.weights_hash && a.weights_hash == forced.weights_hash, "fp8 pages: final weights differ");
        int differ = 0;
        for (int64_t i = 0; i < cfg.steps; i++) {
            differ |= a.loss[i] != bf16.loss[i];
            if (i < 5)
                CHECK(fabs(a.loss[i] - bf16.loss[i]) <= 0.01 * bf16.loss[i],
                      "fp8 pages, step %lld: loss %.5f, bf16 stash %.5f", (long long)i + 1, a.loss[i], bf16.loss[i]);
        }
        CHECK(mean(a.loss + 15, 5) < 0.8 * mean(a.loss, 5), "fp8 pages: loss did not fall");
        CHECK(fabs(mean(a.loss + 15, 5) - mean(bf16.loss + 15, 5)) < 0.1 * mean(bf16.loss + 15, 5),
              "fp8 pages: last 5 losses %.4f, bf16 stash's %.4f", mean(a.loss + 15, 5), mean(bf16.loss + 15, 5));
        CHECK(differ, "fp8 pages gave bf16 stash's losses bit for bit: were the pages fp8?");
        CHECK(forced.reruns == 2, "fp8 pages, forced: %lld reruns, expected 2", (long long)forced.reruns);
    }
    mst_train_result* all[] = {&bf16, &a, &b, &forced};
    for (int i = 0; i < 4; i++) mst_train_result_free(all[i]);
}

/* The policies of --check-policies, run here one by one: losses, MTP losses
 * and weights bit for bit those of KEEP. Then --check-policies itself: each
 * line's weights hash is the one found here, and its verdict is right; and
 * its comparison sees a run that differs (a doubled learning rate). */
static void check_policies(mst_ctx_t* ctx) {
    static const char* const runs[][2] = {
        {"keep", "none"}, {"stash", "none"}, {"offload", "none"}, {"recompute", "none"},
        {"fc1_input=stash,act_input=offload,fc2_input=recompute,probs=keep", "none"},
        {"keep", "uniform:1"}, {"stash", "block:1"},
    };
    enum { N = sizeof runs / sizeof *runs };
    mst_train_config cfg = tiny();
    cfg.steps = 4;
    cfg.microbatches = 2;
    cfg.mem.schedule = MST_SCHEDULE_1F1B;
    mst_train_result res[N];
    memset(res, 0, sizeof res);
    for (int i = 0; i < N; i++) {
        mst_train_config c = cfg;
        CHECK_OK(mst_policy_spec_parse(runs[i][0], c.mem.policy.name));
        CHECK_OK(mst_recompute_parse(runs[i][1], &c.mem.recompute));
        CHECK_OK(mst_train_run(ctx, &c, NULL, &res[i]));
        if (!res[i].loss || !res[0].loss || i == 0) continue;
        char what[160];
        snprintf(what, sizeof what, "--policy %s --recompute %s", runs[i][0], runs[i][1]);
        same_losses(&res[0], &res[i], what);
        CHECK(res[i].weights_hash == res[0].weights_hash, "%s: final weights %016llx, KEEP's %016llx", what,
              (unsigned long long)res[i].weights_hash, (unsigned long long)res[0].weights_hash);
    }
    FILE* out = tmpfile();
    if (!out) {
        CHECK(0, "no temporary file");
        return;
    }
    CHECK_OK(mst_train_check_policies(ctx, &cfg, out, NULL));
    rewind(out);
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, out) && n < N) {
        const char* w = strstr(line, "weights ");
        unsigned long long hash = 0;
        CHECK(w && sscanf(w, "weights %llx", &hash) == 1 && hash == res[n].weights_hash,
              "--check-policies line %d names weights %016llx, the run here gave %016llx: %s", n, hash,
              (unsigned long long)res[n].weights_hash, line);
        const char* verdict = n == 0 ? "reference" : res[n].weights_hash == res[0].weights_hash ? "bit-identical" : "DIFFERS";
        CHECK(strstr(line, verdict), "--check-policies line %d: expected the verdict '%s': %s", n, verdict, line);
        n++;
    }
    CHECK(n == N && !fgets(line, sizeof line, out), "--check-policies printed %d lines or more, expected %d", n, N);
    fclose(out);
    for (int i = 0; i < N; i++) mst_train_result_free(&res[i]);

    mst_train_config two[2] = {cfg, cfg};
    two[1].optim.lr *= 2;
    const char* labels[2] = {"lr 1e-2", "lr 2e-2"};
    out = tmpfile();
    if (!out) return;
    CHECK_STATUS(mst_train_compare(ctx, two, labels, 2, out, NULL), MST_ERR_STATE);
    rewind(out);
    char l0[512] = "", l1[512] = "";
    CHECK(fgets(l0, sizeof l0, out) && fgets(l1, sizeof l1, out) && strstr(l0, "lr 1e-2") && strstr(l0, "reference") &&
              strstr(l1, "lr 2e-2") && strstr(l1, "DIFFERS"),
          "compare runs of another learning rate: expected 'reference' then 'DIFFERS': %s%s", l0, l1);
    fclose(out);
}

/* --graph on against --graph off: bit-identical losses and final weights
 * under every policy, schedule and layer recompute, and with forced reruns
 * (after which the step is captured again). On a backend that captures
 * (CUDA) sized steps are replayed from the graph, with the flash attention
 * (head dim 64); elsewhere the same step function runs eagerly. */
static void graph_vs_eager(mst_ctx_t* ctx) {
    static const struct { const char* policy; mst_schedule_kind sched; const char* recompute; int64_t over, flow; } cases[] = {
        {"keep", MST_SCHEDULE_PLAIN, "none", 0, 0},
        {"stash", MST_SCHEDULE_1F1B, "none", 0, 0},
        {"offload", MST_SCHEDULE_INTERLEAVED, "none", 0, 0},
        {"recompute", MST_SCHEDULE_PLAIN, "none", 0, 0},
        {"fc1_input=stash,act_input=offload,fc2_input=recompute,probs=keep", MST_SCHEDULE_1F1B, "uniform:1", 0, 0},
        {"stash", MST_SCHEDULE_INTERLEAVED, "block:1", 0, 0},
        {"keep", MST_SCHEDULE_1F1B, "uniform:2", 0, 0},
        {"stash", MST_SCHEDULE_PLAIN, "none", 4, 0},
        {"stash", MST_SCHEDULE_1F1B, "none", 0, 4},
        {"stash:fp8", MST_SCHEDULE_1F1B, "none", 0, 0},
        {"fc1_input=offload:fp8,act_input=stash:fp8,fc2_input=recompute,probs=stash", MST_SCHEDULE_PLAIN, "none", 0, 4},
    };
    const int capturing = ctx->be->capture_begin != NULL;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        mst_train_config cfg = tiny();
        cfg.steps = 6;
        cfg.microbatches = 2;
        CHECK_OK(mst_policy_spec_parse(cases[i].policy, cfg.mem.policy.name));
        cfg.mem.schedule = cases[i].sched;
        cfg.mem.virtual_stages = cases[i].sched == MST_SCHEDULE_INTERLEAVED ? 2 : 1;
        cfg.force_over_budget = cases[i].over;
        cfg.force_overflow = cases[i].flow;
        if (capturing) { /* a head dim the flash kernels take, so they run in the graph */
            cfg.model.hidden = 64;
            cfg.model.n_head = 1;
            cfg.model.n_kv_head = 1;
            cfg.model.head_dim = 64;
            cfg.model.attention = MST_ATTN_FLASH;
        }
        CHECK_OK(mst_recompute_parse(cases[i].recompute, &cfg.mem.recompute));
        mst_train_result eager = {0}, graph = {0};
        CHECK_OK(mst_train_run(ctx, &cfg, NULL, &eager));
        cfg.graph_from = 1;
        CHECK_OK(mst_train_run(ctx, &cfg, NULL, &graph));
        if (!eager.loss || !graph.loss) {
            mst_train_result_free(&eager);
            mst_train_result_free(&graph);
            continue;
        }
        char what[256];
        snprintf(what, sizeof what, "graph vs eager, %s, %s, recompute %s, forced %lld/%lld", cases[i].policy,
                 mst_schedule_kind_str(cases[i].sched), cases[i].recompute, (long long)cases[i].over,
                 (long long)cases[i].flow);
        same_losses(&eager, &graph, what);
        CHECK(eager.weights_hash == graph.weights_hash, "%s: final weights differ (%016llx vs %016llx)", what,
              (unsigned long long)eager.weights_hash, (unsigned long long)graph.weights_hash);
        CHECK(eager.captures == 0 && eager.replays == 0, "%s: eager run captured %lld, replayed %lld", what,
              (long long)eager.captures, (long long)eager.replays);
        /* step 1 measures, step 2 runs eagerly, 3.. replay; a rerun drops the
         * graph (a flagged replay counts): the step after it runs eagerly,
         * the next is captured again */
        const int64_t reruns = cases[i].over || cases[i].flow;
        const int64_t want_cap = capturing ? 1 + reruns : 0, want_rep = capturing ? cfg.steps - 2 - reruns : 0;
        CHECK(graph.reruns == reruns && graph.captures == want_cap && graph.replays == want_rep,
              "%s: %lld reruns, %lld captures, %lld replays; expected %lld, %lld, %lld", what, (long long)graph.reruns,
              (long long)graph.captures, (long long)graph.replays, (long long)reruns, (long long)want_cap,
              (long long)want_rep);
        mst_train_result_free(&eager);
        mst_train_result_free(&graph);
    }
}

/* Runs `moestash train ARGS`; expects exit code 2 and one stderr line that
 * contains each of `want` (the flag and its value). */
static void bad_input(const char* args, const char* want1, const char* want2) {
    char dir[1024], cmd[3072], err[1024] = "";
    snprintf(dir, sizeof dir, "%s", self_path);
    char* slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    else snprintf(dir, sizeof dir, ".");
    const char* log = "test_train_stderr.txt";
    snprintf(cmd, sizeof cmd, "'%s/moestash' train --steps 1 --quiet %s >/dev/null 2>%s", dir, args, log);
    int rc = system(cmd);
    FILE* f = fopen(log, "r");
    int lines = 0;
    if (f) {
        char line[1024];
        while (fgets(line, sizeof line, f)) {
            if (lines++ == 0) snprintf(err, sizeof err, "%s", line);
        }
        fclose(f);
    }
    remove(log);
    CHECK(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "train %s: exit status %d, expected 2", args,
          rc != -1 && WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
    CHECK(lines == 1, "train %s: %d lines on stderr, expected 1", args, lines);
    CHECK(strstr(err, want1) && strstr(err, want2), "train %s: message '%s' does not name '%s' '%s'", args,
          err, want1, want2);
}

static void cli(mst_ctx_t* ctx) {
    const char* be = mst_ctx_backend(ctx) == MST_BACKEND_CUDA ? "--backend cuda" : "--backend cpu";
    char a[512];
#define BAD(args, w1, w2) (snprintf(a, sizeof a, "%s %s", be, args), bad_input(a, w1, w2))
    BAD("--frobnicate 3", "--frobnicate", "3");
    BAD("--steps", "--steps", "missing value");
    BAD("--steps ten", "--steps", "ten");
    BAD("--hidden 0", "--hidden", "0");
    BAD("--hidden 64 --heads 3", "--heads", "3");
    BAD("--experts 8 --ep 3", "--ep", "3");
    BAD("--experts 4 --top-k 5", "--top-k", "5");
    BAD("--capacity-factor -1", "--capacity-factor", "-1");
    BAD("--mtp-weight nan", "--mtp-weight", "nan");
    BAD("--policy sometimes", "--policy", "sometimes");
    BAD("--schedule zigzag", "--schedule", "zigzag");
    BAD("--data /nonexistent/corpus.txt", "--data", "/nonexistent/corpus.txt");
    FILE* f = fopen("test_train_empty.txt", "w");
    if (f) fclose(f);
    BAD("--data test_train_empty.txt", "--data", "test_train_empty.txt");
    remove("test_train_empty.txt");
    BAD("--force-over-budget 5", "--force-over-budget", "5");
    BAD("--force-overflow 9", "--force-overflow", "9");
    BAD("--policy fc1_input=recompute", "--policy", "fc1_input=recompute");
    BAD("--policy fc3_input=keep", "--policy", "fc3_input=keep");
    BAD("--recompute uniform:0", "--recompute", "uniform:0");
    BAD("--recompute block:9", "--recompute", "block:9");
    BAD("--check-policies --policy stash", "--policy", "stash");
    BAD("--schedule interleaved --layers 2", "--schedule", "interleaved");
    BAD("--microbatches 0", "--microbatches", "0");
    BAD("--graph maybe", "--graph", "maybe");
    BAD("--log-every 0", "--log-every", "0");
    BAD("--preset a100", "--preset", "a100");
#undef BAD
    if (mst_ctx_backend(ctx) == MST_BACKEND_CPU) bad_input("--backend cpu --graph on", "--graph", "on");
    bad_input("--backend tpu", "--backend", "tpu");
    if (!mst_backend_available(MST_BACKEND_CUDA)) bad_input("--backend cuda", "--backend", "cuda");
}

/* --data: a text file trains; one of exactly seq + 2 bytes is enough, one
 * byte fewer is refused naming the file. */
static void data_file(mst_ctx_t* ctx) {
    const char* path = "test_train_corpus.txt";
    mst_train_config cfg = tiny();
    cfg.steps = 5;
    cfg.data_path = path;
    const int64_t sizes[3] = {3000, cfg.model.seq + 2, cfg.model.seq + 1};
    for (int i = 0; i < 3; i++) {
        FILE* f = fopen(path, "w");
        if (!f) {
            CHECK(0, "cannot write %s", path);
            return;
        }
        for (int64_t b = 0; b < sizes[i]; b++) fputc("moe stash pages, "[b % 17], f);
        fclose(f);
        mst_train_result r = {0};
        mst_status st = mst_train_run(ctx, &cfg, NULL, &r);
        if (i < 2) {
            CHECK(st == MST_OK && isfinite(r.loss[4]) && r.loss[4] < r.loss[0],
                  "--data of %lld bytes: %s, loss %.4f -> %.4f", (long long)sizes[i], mst_last_error(),
                  r.loss ? r.loss[0] : 0.0, r.loss ? r.loss[4] : 0.0);
        } else {
            CHECK(st == MST_ERR_INVALID && strstr(mst_last_error(), path),
                  "--data of seq + 1 bytes: %s (%s)", mst_status_str(st), mst_last_error());
        }
        mst_train_result_free(&r);
    }
    remove(path);
}

static void run(mst_ctx_t* ctx) {
    training(ctx);
    graph_vs_eager(ctx);
    data_file(ctx);
    cli(ctx);
}

int main(int argc, char** argv) {
    self_path = argv[0];
    return mst_test_main(argc, argv, run);
}
