/*
 * test_sample.c — sampling from a Hugging Face Qwen3-MoE directory
 * (src/trainer/run/sample.h), on a random model written here through
 * trainer/io/hf.h (hf_model.h; GQA 4 over 2 heads, head dim 16, untied head):
 * - the picker: temperature 0 is the argmax; at temperatures 0.5, 1 and 2
 *   the draws follow softmax(logits / T) (a sampler that multiplied by T
 *   sharpens where it should flatten: caught); top-k keeps the k largest;
 * - the same seed gives the same tokens, another seed others;
 * - fresh caches give the same logits; 7 9 5 and 9 7 5 give other logits
 *   (what RoPE adds: attention alone is blind to the order);
 * - a token outside the vocabulary, a full cache, a directory of another
 *   model_type, a missing tensor and a tensor of another shape are refused.
 * Exact parity with transformers' generate is tests/hf's.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "harness.h"
#include "hf_model.h"
#include "trainer/run/sample.h"

enum { V = 256, T = 24 };

static mst_model_config tiny(void) {
    return (mst_model_config){.vocab = V, .hidden = 32, .ffn = 16, .n_head = 4, .n_kv_head = 2, .head_dim = 16,
                              .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 0, .seq = T, .batch = 1,
                              .layers = 2, .experts = 4, .top_k = 2, .ep = 1, .norm_eps = 1e-6f, .init_std = 0.02f};
}

/* Frequencies of n draws at temperature t against softmax(lg / t). */
static void temperature(float t) {
    const float lg[4] = {0.5f, 1.5f, -0.5f, 1.0f};
    double want[4], sum = 0;
    for (int i = 0; i < 4; i++) sum += want[i] = exp((double)lg[i] / t);
    int got[4] = {0}, n = 60000;
    uint64_t rng = 31;
    for (int i = 0; i < n; i++) got[mst_sampler_pick(lg, 4, t, 0, &rng)]++;
    double worst = 0;
    for (int i = 0; i < 4; i++) worst = fmax(worst, fabs((double)got[i] / n - want[i] / sum));
    CHECK(worst < 0.01, "temperature %g: frequencies off softmax(logits / T) by %.4f (token 1: %.4f, expected %.4f)",
          (double)t, worst, (double)got[1] / n, want[1] / sum);
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
    temperature(0.5f);
    temperature(1.0f);
    temperature(2.0f);
}

/* T tokens after "ab" with the given seed and temperature. */
static void generate(const char* dir, uint64_t seed, float temp, int32_t* out) {
    mst_sampler* s = NULL;
    float lg[V];
    CHECK_OK(mst_sampler_create(dir, 2 + T, &s));
    if (!s) return;
    CHECK_OK(mst_sampler_feed(s, 'a', NULL));
    CHECK_OK(mst_sampler_feed(s, 'b', lg));
    for (int i = 0; i < T; i++) {
        out[i] = mst_sampler_pick(lg, V, temp, 0, &seed);
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

/* Fresh caches give the same logits; the prompts 7 9 5 and 9 7 5 give other
 * last logits (attention without positions cannot tell them apart: RoPE
 * must); a full cache and bad tokens are refused. */
static void cache(const char* dir) {
    mst_sampler *s = NULL, *u = NULL;
    CHECK_OK(mst_sampler_create(dir, 3, &s));
    CHECK_OK(mst_sampler_create(dir, 3, &u));
    if (!s || !u) return;
    float a[V], b[V];
    CHECK_OK(mst_sampler_feed(s, 7, a));
    CHECK_OK(mst_sampler_feed(u, 7, b));
    CHECK(memcmp(a, b, sizeof a) == 0, "two fresh samplers disagree on the first token's logits");
    mst_sampler_destroy(u);
    CHECK_OK(mst_sampler_create(dir, 3, &u));
    CHECK_OK(mst_sampler_feed(s, 9, NULL));
    CHECK_OK(mst_sampler_feed(s, 5, a));
    CHECK_OK(mst_sampler_feed(u, 9, NULL));
    CHECK_OK(mst_sampler_feed(u, 7, NULL));
    CHECK_OK(mst_sampler_feed(u, 5, b));
    double d = 0;
    for (int i = 0; i < V; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    CHECK(d > 1e-3, "7 9 5 and 9 7 5 give the same logits (%.2e): no position in the model", d);
    CHECK_STATUS(mst_sampler_feed(s, 2, a), MST_ERR_INVALID); /* a cache of 3 tokens is full */
    CHECK(strstr(mst_last_error(), "cache") != NULL, "message '%s'", mst_last_error());
    mst_sampler_destroy(s), mst_sampler_destroy(u);
    CHECK_OK(mst_sampler_create(dir, 3, &s));
    CHECK_STATUS(mst_sampler_feed(s, V, a), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "token 256") != NULL, "message '%s'", mst_last_error());
    CHECK_STATUS(mst_sampler_feed(s, -1, a), MST_ERR_INVALID);
    mst_sampler_destroy(s);
}

/* Bad directories: refused at create, naming what is wrong. */
static void bad_dirs(const char* root, mst_rng* r) {
    const mst_model_config c = tiny();
    char dir[400], path[512];
    mst_sampler* s = NULL;
    snprintf(dir, sizeof dir, "%s/skip", root);
    mkdir(dir, 0700);
    mst_test_write_hf_model(dir, &c, r, 0.3, 5, -1); /* a tensor of layer 0 left out */
    CHECK_STATUS(mst_sampler_create(dir, 4, &s), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "model.layers.0.") != NULL, "missing tensor: message '%s'", mst_last_error());
    snprintf(dir, sizeof dir, "%s/shape", root);
    mkdir(dir, 0700);
    mst_test_write_hf_model(dir, &c, r, 0.3, -1, 3);
    CHECK_STATUS(mst_sampler_create(dir, 4, &s), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "model.layers.0.") != NULL, "wrong shape: message '%s'", mst_last_error());
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE* f = fopen(path, "w");
    fprintf(f, "{\"model_type\": \"llama\", \"vocab_size\": 256}\n");
    fclose(f);
    CHECK_STATUS(mst_sampler_create(dir, 4, &s), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "qwen3_moe") != NULL, "another model_type: message '%s'", mst_last_error());
    CHECK(s == NULL, "a refused directory gave a sampler");
}

static void run(mst_ctx_t* ctx) {
    (void)ctx;
    char dir[128];
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_sample")) {
        CHECK(0, "no temporary directory");
        return;
    }
    picker();
    mst_rng r = {77};
    const mst_model_config c = tiny();
    mst_test_write_hf_model(dir, &c, &r, 0.3, -1, -1);
    determinism(dir);
    cache(dir);
    bad_dirs(dir, &r);
    mst_test_rmtree(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
