/*
 * test_threads.c — results do not depend on the number of CPU threads: a
 * short training (large enough that the CPU backend's GEMMs and row loops
 * run in parallel) in child processes of this program started with
 * OMP_NUM_THREADS = 1, 2 and 3 prints every step's loss, MTP loss and
 * load-balancing loss (hex floats) and the final weights' hash; the three
 * outputs must be the same text. Each child also prints the thread count it
 * ran with, so a run that ignored the variable shows.
 */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "harness.h"
#include "trainer/run/trainer.h"

static const char* self_path;

static mst_train_config config(void) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 64, .ffn = 128, .n_head = 4, .seq = 64, .batch = 8,
                          .layers = 2, .experts = 8, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f,
                          .seed = 7};
    mst_optim_config o = {.lr = 3e-3f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 2, .steps = 4};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.mem.policy = "stash";
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

static void run(mst_ctx_t* ctx) {
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
