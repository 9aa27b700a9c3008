/*
 * test_threads.c — results do not depend on the number of CPU threads: a
 * short training (large enough that the CPU backend's GEMMs and row loops
 * run in parallel) in child processes of this program started with
 * OMP_NUM_THREADS = 1, 2 and 3 prints every step's loss, MTP loss and
 * load-balancing loss (hex floats) and the final weights' hash; the three
 * outputs must be the same text. Each child also prints the thread count it
 * ran with, so a run that ignored the variable shows.
 *
 * In process: the gradient norm's sum of squares (the model backend's sumsq)
 * over more than 2^20 values, where the CPU backend runs it in parallel,
 * gives the same bits with 1, 2, 3 and 8 OpenMP threads (omp_set_num_threads),
 * and matches a float64 sum within fp32's tolerance, with and without a base.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "harness.h"
#include "trainer/model_ops/model_backend.h"
#include "trainer/run/trainer.h"

static const char* self_path;

static mst_train_config config(void) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 64, .ffn = 128, .n_head = 4,
                          .n_kv_head = 2, .head_dim = 16, .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 64, .batch = 8,
                          .layers = 2, .experts = 8, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f,
                          .seed = 7};
    mst_optim_config o = {.lr = 3e-3f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 2, .steps = 4};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    CHECK_OK(mst_policy_spec_parse("stash", t.mem.policy.name));
    t.microbatches = 2;
    t.steps = 4;
    return t;
}

/* The child: trains and prints its results; exit code 0 when it trained. */
static int child(mst_backend_kind kind) {
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(kind, 0, &ctx) != MST_OK) return 1;
    mst_train_config cfg = config();
    mst_train_result r = {0};
    mst_status st = mst_train_run(ctx, &cfg, NULL, &r);
    if (st == MST_OK) {
#ifdef _OPENMP
        printf("threads %d\n", omp_get_max_threads());
#endif
        for (int64_t i = 0; i < r.steps; i++)
            printf("step %lld loss %a mtp %a aux %a\n", (long long)i + 1, r.loss[i], r.mtp_loss[i], r.aux_loss[i]);
        printf("weights %016llx\n", (unsigned long long)r.weights_hash);
    } else {
        fprintf(stderr, "%s\n", mst_last_error());
    }
    mst_train_result_free(&r);
    mst_ctx_destroy(ctx);
    return st == MST_OK ? 0 : 1;
}

/* Runs the child with OMP_NUM_THREADS = threads; its output into out. */
static int run_child(mst_ctx_t* ctx, int threads, char* out, size_t cap) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=%d '%s' --child --backend %s", threads, self_path,
             mst_ctx_backend(ctx) == MST_BACKEND_CUDA ? "cuda" : "cpu");
    FILE* p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    return pclose(p);
}

/* sumsq of x [n] fp32 (backend memory) with `threads` OpenMP threads (0: as
 * is); base [1] fp32 or NULL. */
static float sumsq(mst_ctx_t* ctx, const mst_model_backend* mo, int64_t n, const float* x, const float* base,
                   int threads) {
#ifdef _OPENMP
    const int before = omp_get_max_threads();
    if (threads > 0) omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    float *part = NULL, *out = NULL, got = NAN;
    CHECK_OK(mst_alloc(ctx, sizeof(float) * MST_SUMSQ_PARTS, (void**)&part));
    CHECK_OK(mst_alloc(ctx, sizeof(float), (void**)&out));
    CHECK_OK(mst_fill(ctx, out, 0xFF, sizeof(float))); /* NaN */
    mst_sumsq_args a = {.n = n, .x = x, .partial = part, .base = base, .out = out};
    CHECK_OK(mo->sumsq(ctx, &a));
    CHECK_OK(mst_copy_b2h(ctx, &got, out, sizeof got));
    mst_free(ctx, part);
    mst_free(ctx, out);
#ifdef _OPENMP
    omp_set_num_threads(before);
#endif
    return got;
}

static void sumsq_threads(mst_ctx_t* ctx) {
    const mst_model_backend* mo = NULL;
    CHECK_OK(mst_model_backend_of(ctx, &mo));
    if (!mo) return;
    const int64_t n = 3 * ((int64_t)1 << 20) + 4321; /* past the CPU backend's parallel threshold (2^20) */
    mst_rng rng = {2026};
    float* h = (float*)malloc(sizeof(float) * (size_t)(n + 1));
    mst_rng_fp32(&rng, h, (size_t)(n + 1), -1.0, 1.0); /* h[n]: the base */
    h[n] = fabsf(h[n]) * 1000.0f;
    float* x = NULL;
    CHECK_OK(mst_alloc(ctx, sizeof(float) * (size_t)(n + 1), (void**)&x));
    CHECK_OK(mst_copy_h2b(ctx, x, h, sizeof(float) * (size_t)(n + 1)));
    double ref = 0;
    for (int64_t i = 0; i < n; i++) ref += (double)h[i] * h[i];
    for (int with_base = 0; with_base < 2; with_base++) {
        const double want = ref + (with_base ? h[n] : 0.0);
        const float* base = with_base ? x + n : NULL;
        const float one = sumsq(ctx, mo, n, x, base, 1);
        CHECK(fabs(one - want) <= MST_TOL_FP32 * want, "sumsq over %lld values%s: %.9g, float64 %.9g", (long long)n,
              with_base ? " with a base" : "", (double)one, want);
        const int threads[] = {2, 3, 8, 0};
        for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
            const float got = sumsq(ctx, mo, n, x, base, threads[t]);
            CHECK(memcmp(&got, &one, sizeof got) == 0, "sumsq over %lld values%s with %d threads: %a, with 1: %a",
                  (long long)n, with_base ? " with a base" : "", threads[t], (double)got, (double)one);
        }
    }
    mst_free(ctx, x);
    free(h);
}

static void run(mst_ctx_t* ctx) {
    sumsq_threads(ctx);
    static char out[3][4096];
    for (int t = 1; t <= 3; t++) {
        int rc = run_child(ctx, t, out[t - 1], sizeof out[0]);
        CHECK(rc == 0, "the child with OMP_NUM_THREADS=%d failed (status %d)", t, rc);
#ifdef _OPENMP
        char want[32];
        snprintf(want, sizeof want, "threads %d\n", t);
        CHECK(strncmp(out[t - 1], want, strlen(want)) == 0, "the child with OMP_NUM_THREADS=%d ran with: %.20s", t,
              out[t - 1]);
#endif
        CHECK(strstr(out[t - 1], "step 4 loss") && strstr(out[t - 1], "weights "),
              "the child with OMP_NUM_THREADS=%d printed no results: %s", t, out[t - 1]);
    }
    for (int t = 2; t <= 3; t++) {
        const char* a = strstr(out[0], "step 1");
        const char* b = strstr(out[t - 1], "step 1");
        CHECK(a && b && strcmp(a, b) == 0, "OMP_NUM_THREADS=%d gives other results than 1:\n%s--- against ---\n%s", t,
              b ? b : "(none)", a ? a : "(none)");
    }
}

int main(int argc, char** argv) {
    self_path = argv[0];
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--child") == 0) {
            int cuda = i + 2 < argc && strcmp(argv[i + 2], "cuda") == 0;
            return child(cuda ? MST_BACKEND_CUDA : MST_BACKEND_CPU);
        }
    return mst_test_main(argc, argv, run);
}
