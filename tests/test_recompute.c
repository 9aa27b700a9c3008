/*
 * test_recompute.c — whole-layer recompute (granularity full) and the MTP
 * layer's: for every plan (none, uniform:1, uniform:2, block:1,
 * block:layers, each with and without --recompute-mtp) under every memory
 * policy (plain schedule) and under every schedule (stash), the losses of
 * every step and the final weights are bit-identical to no recompute; a
 * forced over-budget rerun under recompute too. The memory table shows the
 * saving: under uniform:1 the attention, norm and router activations keep
 * only the chunk inputs (a fraction of KEEP's), the MTP module keeps its
 * two inputs under --recompute-mtp, and granularity moe keeps them all.
 * Bad plans are refused with a message naming the flag.
 */
#include <string.h>

#include "harness.h"
#include "trainer/run/trainer.h"

enum { STEPS = 3 };

static mst_train_config tiny(const char* policy, mst_schedule_kind sched) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 16, .n_head = 2,
                          .n_kv_head = 1, .head_dim = 16, .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 8, .batch = 2,
                          .layers = 3, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.05f,
                          .seed = 11};
    mst_optim_config o = {.lr = 1e-2f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 2, .steps = STEPS};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    CHECK_OK(mst_policy_spec_parse(policy, t.mem.policy.name));
    t.mem.schedule = sched;
    t.mem.virtual_stages = sched == MST_SCHEDULE_INTERLEAVED ? 2 : 1;
    t.microbatches = 2;
    t.steps = STEPS;
    return t;
}

typedef struct plan {
    const char* spec;
    int mtp;
} plan;
static const plan plans[] = {{"uniform:1", 0}, {"uniform:2", 0}, {"block:1", 0}, {"block:4", 0}, {"none", 1},
                             {"uniform:1", 1}, {"uniform:2", 1}, {"block:1", 1}, {"block:4", 1}};
#define N_PLANS (int)(sizeof plans / sizeof plans[0])

static int same(const mst_train_result* a, const mst_train_result* b) {
    return a->weights_hash == b->weights_hash &&
           mst_first_diff(a->loss, b->loss, sizeof(double) * STEPS) < 0 &&
           mst_first_diff(a->mtp_loss, b->mtp_loss, sizeof(double) * STEPS) < 0 &&
           mst_first_diff(a->aux_loss, b->aux_loss, sizeof(double) * STEPS) < 0;
}

/* Every plan against no recompute, for one policy and schedule. */
static void identical(mst_ctx_t* ctx, const char* policy, mst_schedule_kind sched) {
    mst_train_config cfg = tiny(policy, sched);
    mst_train_result base = {0};
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &base));
    if (!base.loss) return;
    for (int p = 0; p < N_PLANS; p++) {
        mst_train_config c = cfg;
        CHECK_OK(mst_recompute_parse(plans[p].spec, &c.mem.recompute));
        c.mem.recompute_mtp = plans[p].mtp;
        mst_train_result r = {0};
        mst_status st = mst_train_run(ctx, &c, NULL, &r);
        CHECK(st == MST_OK && same(&r, &base), "%s, %s, --recompute %s%s: %s (loss %.9g vs %.9g)", policy,
              mst_schedule_kind_str(sched), plans[p].spec, plans[p].mtp ? " --recompute-mtp" : "",
              st == MST_OK ? "differs from no recompute" : mst_last_error(), r.loss ? r.loss[STEPS - 1] : 0,
              base.loss[STEPS - 1]);
        mst_train_result_free(&r);
    }
    mst_train_result_free(&base);
}

static size_t own_saved(const mst_mem_table* t, const size_t* col) {
    (void)t;
    return col[MST_ROW_SAVED_ATTN] + col[MST_ROW_SAVED_NORM] + col[MST_ROW_SAVED_ROUTER];
}

static void memory(mst_ctx_t* ctx) {
    mst_train_config c = tiny("keep", MST_SCHEDULE_PLAIN);
    c.steps = 1;
    mst_train_result none = {0}, uni = {0}, mtp = {0}, moe = {0};
    CHECK_OK(mst_train_run(ctx, &c, NULL, &none));
    c.mem.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_UNIFORM, 1};
    CHECK_OK(mst_train_run(ctx, &c, NULL, &uni));
    c.mem.recompute_mtp = 1;
    c.mem.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_NONE, 0};
    CHECK_OK(mst_train_run(ctx, &c, NULL, &mtp));
    c.mem.recompute_mtp = 0;
    c.mem.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_UNIFORM, 1};
    c.mem.recompute_full = 0;
    CHECK_OK(mst_train_run(ctx, &c, NULL, &moe));
    const mst_mem_table *n = &none.mem, *u = &uni.mem, *p = &mtp.mem, *o = &moe.mem;
    /* no recompute: this run is KEEP */
    for (int k = MST_ROW_SAVED_ATTN; k <= MST_ROW_SAVED_MTP; k++)
        CHECK(n->run[k] == n->keep[k], "%s: %zu bytes without recompute, KEEP %zu", mst_mem_row_str(k), n->run[k],
              n->keep[k]);
    CHECK(n->run[MST_ROW_RECOMPUTE] == 0, "no recompute, yet %zu bytes of rerun buffers", n->run[MST_ROW_RECOMPUTE]);
    /* uniform:1: each layer keeps only its output [N, H] bf16 per microbatch (the next chunk's input) */
    const size_t N = 16, H = 32, M = 2, L = 3, outs = L * M * N * H * 2;
    CHECK(own_saved(u, u->run) == outs, "uniform:1 keeps %zu bytes of attention / norms / router, expected the "
          "%zu of the layer outputs", own_saved(u, u->run), outs);
    CHECK(u->keep[MST_ROW_SAVED_ATTN] == n->keep[MST_ROW_SAVED_ATTN], "KEEP column changed under recompute");
    CHECK(own_saved(u, u->run) * 4 < own_saved(u, u->keep), "uniform:1 saves %zu of KEEP's %zu",
          own_saved(u, u->run), own_saved(u, u->keep));
    CHECK(u->run[MST_ROW_RECOMPUTE] > 0, "uniform:1 without rerun buffers");
    /* --recompute-mtp: the module keeps e1 [N, H] per microbatch; its layer nothing */
    CHECK(p->run[MST_ROW_SAVED_MTP] == M * N * H * 2, "MTP module under --recompute-mtp: %zu bytes, expected %zu "
          "(the next tokens' embedding)", p->run[MST_ROW_SAVED_MTP], M * N * H * 2);
    CHECK(p->keep[MST_ROW_SAVED_MTP] == n->run[MST_ROW_SAVED_MTP], "MTP KEEP column");
    CHECK(own_saved(p, p->run) == own_saved(n, n->run), "--recompute-mtp changed the main layers' memory");
    /* moe granularity: the model's own activations all kept */
    CHECK(own_saved(o, o->run) == own_saved(n, n->run) && o->run[MST_ROW_RECOMPUTE] == 0,
          "granularity moe: %zu bytes of the model's activations, %zu without recompute", own_saved(o, o->run),
          own_saved(n, n->run));
    mst_train_result_free(&none), mst_train_result_free(&uni), mst_train_result_free(&mtp), mst_train_result_free(&moe);
}

static void over_budget(mst_ctx_t* ctx) {
    mst_train_config c = tiny("stash", MST_SCHEDULE_1F1B);
    mst_train_result base = {0}, r = {0};
    CHECK_OK(mst_train_run(ctx, &c, NULL, &base));
    c.mem.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_UNIFORM, 2};
    c.mem.recompute_mtp = 1;
    c.force_over_budget = 2;
    c.model.capacity_factor = 0.6f; /* over budget on most steps: exact-shape reruns */
    mst_train_config b = c;
    b.mem.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_NONE, 0};
    b.mem.recompute_mtp = 0;
    mst_train_result_free(&base);
    CHECK_OK(mst_train_run(ctx, &b, NULL, &base));
    CHECK_OK(mst_train_run(ctx, &c, NULL, &r));
    CHECK(r.reruns > 0 && base.reruns == r.reruns, "reruns: %lld with recompute, %lld without", (long long)r.reruns,
          (long long)base.reruns);
    CHECK(base.loss && r.loss && same(&r, &base), "over-budget reruns under recompute differ from no recompute");
    mst_train_result_free(&base), mst_train_result_free(&r);
}

static void refused(mst_ctx_t* ctx) {
    mst_train_config c = tiny("keep", MST_SCHEDULE_PLAIN);
    mst_train_result r = {0};
    c.mem.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_BLOCK, 5}; /* 4 layers with the MTP layer */
    CHECK_STATUS(mst_train_run(ctx, &c, NULL, &r), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "--recompute 'block:5'") != NULL, "message '%s'", mst_last_error());
    mst_train_result_free(&r);
    c.mem.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_NONE, 0};
    c.mem.recompute_mtp = 1;
    c.model.mtp_weight = 0;
    CHECK_STATUS(mst_train_run(ctx, &c, NULL, &r), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "--recompute-mtp") != NULL, "message '%s'", mst_last_error());
    mst_train_result_free(&r);
}

static void run(mst_ctx_t* ctx) {
    static const char* const policies[] = {"keep", "stash", "offload", "recompute",
                                           "fc1_input=stash,act_input=offload,fc2_input=recompute,probs=keep"};
    for (int p = 0; p < 5; p++) identical(ctx, policies[p], MST_SCHEDULE_PLAIN);
    identical(ctx, "stash", MST_SCHEDULE_1F1B);
    identical(ctx, "stash", MST_SCHEDULE_INTERLEAVED);
    memory(ctx);
    over_budget(ctx);
    refused(ctx);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
