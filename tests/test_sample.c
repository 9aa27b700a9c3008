/*
 * test_sample.c — sampling from a checkpoint (src/trainer/run/sample.h): the
 * sampler's per-token losses on a window equal the trainer's forward on the
 * same window within bf16 tolerance (random weights large enough that the
 * losses spread, so a wrong layer cannot hide); the same seed gives the same
 * text, another seed other text; the picker follows its distribution
 * (temperature, top-k); bad tokens and a full cache are refused.
 */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "trainer/run/sample.h"

enum { T = 24 };

static mst_train_config tiny(void) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 16, .n_head = 4, .seq = T, .batch = 1,
                          .layers = 2, .experts = 4, .top_k = 2, .ep = 1, .capacity_factor = 1.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.25f,
                          .seed = 77};
    t.model = m;
    t.optim = (mst_optim_config){.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .clip = 1.0f, .steps = 1};
    t.mem = mst_mem_config_default();
    t.microbatches = 1;
    t.steps = 1;
    return t;
}


/* Per-token loss from logits [V]: logsumexp - logit[target], in double. */
static double token_loss(const float* lg, int64_t V, int32_t target) {
    double mx = lg[0], s = 0;
    for (int64_t i = 1; i < V; i++) mx = lg[i] > mx ? lg[i] : mx;
    for (int64_t i = 0; i < V; i++) s += exp((double)lg[i] - mx);
    return mx + log(s) - lg[target];
}

static void against_trainer(mst_ctx_t* ctx, const char* dir) {
    mst_train_config cfg = tiny();
    mst_model* m = NULL;
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &m));
    if (!m) return;
    int32_t tok[T + 2];
    mst_rng r = {5};
    for (int i = 0; i < T + 2; i++) tok[i] = (int32_t)mst_rng_int(&r, 0, 255);
    const float hyper[MST_N_HYPER] = {0.0f, 1.0f, 1.0f};
    CHECK_OK(mst_model_stage(m, 0, tok, hyper));
    CHECK_OK(mst_model_upload(m, 0));
    CHECK_OK(mst_model_step(m, 1));
    float loss[T];
    CHECK_OK(mst_copy_b2h(ctx, loss, m->loss_main, sizeof loss));
    CHECK_OK(mst_ckpt_save(m, &cfg, 0, 1, dir));
    mst_model_destroy(m);

    mst_sampler* s = NULL;
    CHECK_OK(mst_sampler_create(dir, T, &s));
    if (!s) return;
    float lg[256];
    double num = 0, den = 0, mean = 0, var = 0;
    for (int t = 0; t < T; t++) {
        CHECK_OK(mst_sampler_feed(s, tok[t], lg));
        const double ref = token_loss(lg, 256, tok[t + 1]);
        num += (ref - loss[t]) * (ref - loss[t]);
        den += ref * ref;
        mean += ref / T;
    }
    for (int t = 0; t < T; t++) var += (loss[t] - mean) * (loss[t] - mean) / T;
    const double rel = sqrt(num / den);
    printf("  sampler vs trainer per-token loss: rel err %.2e (mean %.3f, spread %.3f)\n", rel, mean, sqrt(var));
    CHECK(rel < 2e-2, "sampler losses differ from the trainer's: rel err %.3g", rel);
    CHECK(sqrt(var) > 0.5, "losses barely spread (%.3f): the comparison would not catch a wrong layer", sqrt(var));
    CHECK_STATUS(mst_sampler_feed(s, 3, lg), MST_ERR_INVALID); /* cache of T tokens is full */
    CHECK(strstr(mst_last_error(), "cache") != NULL, "message '%s'", mst_last_error());
    mst_sampler_destroy(s);
    CHECK_OK(mst_sampler_create(dir, 4, &s));
    if (s) {
        CHECK_STATUS(mst_sampler_feed(s, 256, lg), MST_ERR_INVALID);
        CHECK(strstr(mst_last_error(), "token 256") != NULL, "message '%s'", mst_last_error());
        CHECK_STATUS(mst_sampler_feed(s, -1, lg), MST_ERR_INVALID);
        mst_sampler_destroy(s);
    }
}

/* 24 tokens after "ab" with the given seed and temperature. */
static void generate(const char* dir, uint64_t seed, float temp, int32_t* out) {
    mst_sampler* s = NULL;
    float lg[256];
    CHECK_OK(mst_sampler_create(dir, 2 + T, &s));
    if (!s) return;
    mst_sampler_feed(s, 'a', NULL);
    mst_sampler_feed(s, 'b', lg);
    for (int i = 0; i < T; i++) {
        out[i] = mst_sampler_pick(lg, 256, temp, 0, &seed);
        if (i + 1 < T) CHECK_OK(mst_sampler_feed(s, out[i], lg));
    }
    mst_sampler_destroy(s);
}

static void determinism(const char* dir) {
    int32_t a[T], b[T], c[T];
    generate(dir, 11, 1.0f, a);
    generate(dir, 11, 1.0f, b);
    generate(dir, 12, 1.0f, c);
    CHECK(memcmp(a, b, sizeof a) == 0, "the same seed gave other tokens");
    CHECK(memcmp(a, c, sizeof a) != 0, "another seed gave the same %d tokens", T);
}

static void picker(void) {
    float lg[4] = {0.0f, logf(3.0f), -INFINITY, -1.0f};
    uint64_t rng = 9;
    CHECK(mst_sampler_pick(lg, 4, 0.0f, 0, &rng) == 1, "temperature 0 is not the argmax");
    int ones = 0, threes = 0, n = 40000;
    for (int i = 0; i < n; i++) {
        int32_t k = mst_sampler_pick(lg, 4, 1.0f, 2, &rng); /* top-2: tokens 0, 1 with odds 1 : 3 */
        ones += k == 1;
        threes += k == 3;
        CHECK(k == 0 || k == 1, "top-2 picked token %d", k);
    }
    CHECK(fabs((double)ones / n - 0.75) < 0.01, "token 1 picked %.4f of the time, expected 0.75", (double)ones / n);
    CHECK(threes == 0, "top-k let token 3 through");
    for (int i = 0; i < 200; i++) CHECK(mst_sampler_pick(lg, 4, 1.0f, 1, &rng) == 1, "top-1 is not the argmax");
}

static void run(mst_ctx_t* ctx) {
    char dir[128];
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_sample")) {
        CHECK(0, "no temporary directory");
        return;
    }
    against_trainer(ctx, dir);
    determinism(dir);
    picker();
    mst_test_rmtree(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
