/*
 * test_overlap.c — --overlap (src/trainer/model/overlap.c): the replicated
 * gradients' sums started a layer at a time during the backward give the
 * bits of the sums after the backward (--overlap off: the two runs whole),
 * on W ranks and on a pipeline grid. `--backend cpu`: ranks as threads
 * over the CPU twin, the sums in program order at the same points (the
 * buckets, what starts them and what they cover); `--backend cuda`: thread
 * r on GPU r over NCCL, the sums on a communication stream of their own
 * joined before the optimizer, the steps from step 2 on replayed from one
 * captured graph (needs >= 2 GPUs; the 4-rank cases 4).
 *
 * Cases: W 2, plain schedule, 2 microbatches; W 4, 1F1B, 4 microbatches;
 * --pp 2 x 2, interleaved (7 layers, 2 chunks a stage), tied embeddings;
 * W 2 and --pp 2 x 2 with --optimizer-shard on (a layer's part of a run's
 * body reduce-scattered as a window, its part of the tail all-reduced; on
 * also against unsharded). Each: 6 steps clipped every step (the norm's
 * bits reach every update), on against off: every loss (main, MTP,
 * load-balancing) and every rank's weights hash bit-identical, the
 * result's overlap flag 1 (on) and 0 (off), the loss falling.
 */
#include <string.h>

#include "harness.h"
#include "trainer/run/trainer.h"

static mst_backend_kind kind = MST_BACKEND_CPU;

/* V 257, H 40, D 18: runs of odd sizes; L layers, D ranks a stage. */
static mst_train_config small(int32_t D, int32_t L, int32_t M, mst_schedule_kind schedule) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 257, .hidden = 40, .ffn = 32, .n_head = 2, .n_kv_head = 1, .head_dim = 18,
                          .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 0, .seq = 16, .batch = 2,
                          .layers = L, .experts = 8, .top_k = 2, .ep = D, .capacity_factor = (float)D,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f, .seed = 11};
    mst_optim_config o = {.lr = 3e-3f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 0.05f, .warmup = 2, .steps = 6};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.mem.schedule = schedule;
    t.microbatches = M;
    t.steps = 6;
    t.graph_from = 2;
    return t;
}

/* Every rank's losses (main, MTP, load-balancing) and weights hash equal. */
static int same_runs(const mst_train_result* a, const mst_train_result* b, int32_t world, int64_t steps) {
    const size_t n = sizeof(double) * (size_t)steps;
    int same = 1;
    for (int32_t r = 0; r < world; r++)
        same &= !memcmp(a[r].loss, b[r].loss, n) && !memcmp(a[r].mtp_loss, b[r].mtp_loss, n) &&
                !memcmp(a[r].aux_loss, b[r].aux_loss, n) && a[r].weights_hash == b[r].weights_hash;
    return same;
}

/* cfg on `world` ranks (pp stages) with --overlap on and off; sharded
 * (cfg.mem.optimizer_shard), also against the unsharded run with
 * --overlap on. */
static void on_vs_off(mst_train_config cfg, int32_t world, const char* what) {
    mst_train_result on[4], off[4], plain[4];
    memset(on, 0, sizeof on);
    memset(off, 0, sizeof off);
    memset(plain, 0, sizeof plain);
    cfg.mem.overlap = 1;
    CHECK_OK(mst_train_ranks(kind, &cfg, world, 0, NULL, NULL, on));
    cfg.mem.overlap = 0;
    CHECK_OK(mst_train_ranks(kind, &cfg, world, 0, NULL, NULL, off));
    const int shard = cfg.mem.optimizer_shard;
    if (shard) {
        cfg.mem.optimizer_shard = 0, cfg.mem.overlap = 1;
        CHECK_OK(mst_train_ranks(kind, &cfg, world, 0, NULL, NULL, plain));
    }
    if (on[0].loss && off[0].loss) {
        const int64_t T = cfg.steps;
        CHECK(same_runs(on, off, world, T), "%s: --overlap on and off differ (last loss %.17g vs %.17g, rank 0 hash "
              "%016llx vs %016llx)", what, on[0].loss[T - 1], off[0].loss[T - 1], (unsigned long long)on[0].weights_hash,
              (unsigned long long)off[0].weights_hash);
        CHECK(on[0].grad_overlap == 1 && off[0].grad_overlap == 0 && on[0].optim_shard == shard,
              "%s: overlap flags on %d off %d, shard %d", what, on[0].grad_overlap, off[0].grad_overlap, on[0].optim_shard);
        CHECK(on[0].loss[T - 1] < on[0].loss[0], "%s: the loss did not fall (%.4f -> %.4f)", what, on[0].loss[0],
              on[0].loss[T - 1]);
        if (shard && plain[0].loss)
            CHECK(same_runs(on, plain, world, T), "%s: sharded with --overlap on differs from unsharded (last loss "
                  "%.17g vs %.17g)", what, on[0].loss[T - 1], plain[0].loss[T - 1]);
        printf("  %-48s %d ranks: 6 steps and every rank's hash bit-identical on and off%s\n", what, world,
               shard ? " and unsharded" : "");
    }
    for (int32_t r = 0; r < world; r++) {
        mst_train_result_free(&on[r]);
        mst_train_result_free(&off[r]);
        if (shard) mst_train_result_free(&plain[r]);
    }
}

int main(int argc, char** argv) {
    kind = mst_test_backend_arg(argc, argv);
    const int n_dev = mst_test_devices(kind, 4);
    if (n_dev < 2) return mst_test_skip_devices(argv[0], n_dev, "data parallelism needs 2");
    on_vs_off(small(2, 2, 2, MST_SCHEDULE_PLAIN), 2, "W 2, plain, M 2");
    mst_train_config shard = small(2, 2, 2, MST_SCHEDULE_PLAIN);
    shard.mem.optimizer_shard = 1;
    on_vs_off(shard, 2, "W 2, --optimizer-shard on");
    if (n_dev >= 4) {
        on_vs_off(small(4, 3, 4, MST_SCHEDULE_1F1B), 4, "W 4, 1F1B, M 4, 3 layers");
        mst_train_config pp = small(2, 7, 4, MST_SCHEDULE_INTERLEAVED);
        pp.pp = 2;
        pp.mem.virtual_stages = 2;
        pp.model.tie_embeddings = 1;
        on_vs_off(pp, 4, "--pp 2 x 2, interleaved, tied");
        pp.mem.optimizer_shard = 1;
        on_vs_off(pp, 4, "--pp 2 x 2, interleaved, tied, sharded");
    } else {
        printf("  4-rank cases skipped: %d devices\n", n_dev);
    }
    printf("%s: %d passed, %d failed\n", argv[0], mst_test_checks - mst_test_failures, mst_test_failures);
    return mst_test_failures ? 1 : 0;
}
