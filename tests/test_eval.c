/*
 * test_eval.c — `moestash eval`'s loss (src/trainer/run/eval.h): the
 * trainer's forward on the bf16 weights of a random Qwen3-MoE directory
 * (hf_model.h: vocabulary 300, GQA 4 over 2 heads, untied head) over a .bin
 * token file of 8 windows of T+1 random tokens and 3 tokens more:
 * - each window's mean loss equals the host fp32 sampler's (sample.h, a
 *   forward written apart from the trainer's) on the same window within
 *   bf16 tolerance, and the windows' losses spread (a wrong layer cannot
 *   hide); the loss is their mean;
 * - windows, tokens counted; --windows 3 gives the first 3 windows; B = 1,
 *   2 and 5 (partial last batches) give the same bits on the CPU (CUDA:
 *   within 1e-5);
 * - --windows past the file's, a token not below the vocabulary, a file
 *   without one full window: MST_ERR_INVALID naming the flag.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "hf_model.h"
#include "trainer/run/eval.h"
#include "trainer/run/sample.h"

enum { V = 300, T = 16, W = 8 };

static char dir[128], data[256];
static int32_t tok[W * (T + 1) + 3];

static void write_tokens(const char* path, const int32_t* t, int n) {
    FILE* f = fopen(path, "wb");
    int32_t h[256] = {20240520, 1, n};
    fwrite(h, sizeof h, 1, f); /* little-endian hosts */
    for (int i = 0; i < n; i++) {
        const uint16_t u = (uint16_t)t[i];
        fwrite(&u, 2, 1, f);
    }
    fclose(f);
}

/* The sampler's loss summed over window w's T targets. */
static double window_loss(int w) {
    mst_sampler* s = NULL;
    CHECK_OK(mst_sampler_create(dir, T, &s));
    if (!s) return NAN;
    float lg[V];
    double sum = 0;
    for (int t = 0; t < T; t++) {
        const int32_t* x = tok + w * (T + 1) + t;
        CHECK_OK(mst_sampler_feed(s, x[0], lg));
        double mx = lg[0], z = 0;
        for (int i = 1; i < V; i++) mx = fmax(mx, lg[i]);
        for (int i = 0; i < V; i++) z += exp(lg[i] - mx);
        sum += mx + log(z) - lg[x[1]];
    }
    mst_sampler_destroy(s);
    return sum;
}

/* mst_eval_run of B windows at a time, the first n (0: all); the result
 * (freed by the caller) after the status it must return. */
static mst_eval_result eval(mst_ctx_t* ctx, int64_t batch, int64_t n_windows, mst_status want) {
    mst_eval_config c = {.model_dir = dir, .data_path = data, .seq = T, .batch = batch, .n_windows = n_windows};
    mst_eval_result r;
    CHECK_STATUS(mst_eval_run(ctx, &c, &r), want);
    return r;
}

static void against_sampler(mst_ctx_t* ctx) {
    double ref[W], mean = 0, var = 0, num = 0, den = 0, all = 0;
    for (int w = 0; w < W; w++) mean += (ref[w] = window_loss(w) / T) / W;
    for (int w = 0; w < W; w++) var += (ref[w] - mean) * (ref[w] - mean) / W;
    mst_eval_result r = eval(ctx, 2, 0, MST_OK);
    CHECK(r.windows == W && r.tokens == (int64_t)W * T && r.window_loss, "counted %lld windows, %lld tokens",
          (long long)r.windows, (long long)r.tokens);
    for (int w = 0; r.window_loss && w < W; w++) {
        num += (r.window_loss[w] - ref[w]) * (r.window_loss[w] - ref[w]), den += ref[w] * ref[w];
        all += r.window_loss[w] / W;
    }
    const double rel = sqrt(num / den);
    printf("  eval vs the fp32 sampler, per window: rel err %.2e (mean %.4f, spread %.4f)\n", rel, mean, sqrt(var));
    CHECK(rel < 2e-3, "the windows' losses differ from the fp32 sampler's: rel err %.3g", rel);
    CHECK(sqrt(var) > 0.2, "the windows' losses barely spread (%.3f): a wrong layer could hide", sqrt(var));
    CHECK(fabs(all - r.loss) < 1e-12 * r.loss, "loss %.17g is not the mean of the windows' %.17g", r.loss, all);
    /* the first 3 windows alone; the same bits at B = 1, 5 */
    mst_eval_result f = eval(ctx, 2, 3, MST_OK), a = eval(ctx, 1, 0, MST_OK), c = eval(ctx, 5, 0, MST_OK);
    CHECK(f.windows == 3 && f.tokens == 3 * T && f.window_loss && r.window_loss &&
              memcmp(f.window_loss, r.window_loss, 3 * sizeof(double)) == 0,
          "--windows 3: not the first 3 windows' losses");
    const int cpu = mst_ctx_backend(ctx) == MST_BACKEND_CPU; /* CUDA: GEMM shapes may change the rounding */
    const double tol = cpu ? 0.0 : 1e-5 * r.loss;
    CHECK(fabs(a.loss - r.loss) <= tol && fabs(c.loss - r.loss) <= tol, "B 1, 2, 5 give %.17g, %.17g, %.17g", a.loss,
          r.loss, c.loss);
    mst_eval_result_free(&r), mst_eval_result_free(&f), mst_eval_result_free(&a), mst_eval_result_free(&c);
}

static void bad_input(mst_ctx_t* ctx) {
    eval(ctx, 2, W + 1, MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "--windows 9") != NULL, "message '%s'", mst_last_error());
    int32_t t[W * (T + 1)];
    memcpy(t, tok, sizeof t);
    t[40] = V;
    write_tokens(data, t, W * (T + 1));
    eval(ctx, 2, 0, MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "offset 1104: token 300") != NULL, "message '%s'", mst_last_error());
    write_tokens(data, tok, T);
    eval(ctx, 2, 0, MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "need at least 17") != NULL, "message '%s'", mst_last_error());
}

static void run(mst_ctx_t* ctx) {
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_eval")) {
        CHECK(0, "no temporary directory");
        return;
    }
    mst_rng r = {4242};
    const mst_model_config c = {.vocab = V, .hidden = 32, .ffn = 16, .n_head = 4, .n_kv_head = 2, .head_dim = 16,
                                .rope_theta = 10000.0f, .norm_topk_prob = 1, .layers = 2, .experts = 4, .top_k = 2,
                                .norm_eps = 1e-6f, .aux_coef = 0.01f, .init_std = 0.02f};
    mst_test_write_hf_model(dir, &c, &r, 0.5, -1, -1);
    for (size_t i = 0; i < sizeof tok / sizeof tok[0]; i++) tok[i] = (int32_t)mst_rng_int(&r, 0, V - 1);
    snprintf(data, sizeof data, "%s/tokens.bin", dir);
    write_tokens(data, tok, (int)(sizeof tok / sizeof tok[0]));
    against_sampler(ctx);
    bad_input(ctx);
    mst_test_rmtree(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
