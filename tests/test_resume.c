/*
 * test_resume.c — the trainer as a tool: a run of 6 steps that saves at
 * step 3, and a run resumed from that step-3 checkpoint, end with
 * bit-identical losses for steps 4-6 and the same weights hash (the step
 * graph on where the backend captures: CUDA); a resume with another
 * configuration or past the run's steps is refused; held-out evaluation
 * (--eval-fraction) takes its windows from the tail only and does not change
 * the training losses; the final checkpoint, the loss plot and the memory
 * timeline (this run and KEEP) are written.
 */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "trainer/run/checkpoint.h"

enum { STEPS = 6 };

static mst_train_config tiny(const char* data) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = 32, .ffn = 16, .n_head = 2,
                          .n_kv_head = 1, .head_dim = 16, .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 16, .batch = 2,
                          .layers = 2, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f,
                          .seed = 5};
    mst_optim_config o = {.lr = 1e-2f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 2, .steps = STEPS};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    CHECK_OK(mst_policy_spec_parse("stash", t.mem.policy.name));
    t.microbatches = 2;
    t.steps = STEPS;
    t.graph_from = 2; /* CUDA: steps after the first replayed from the captured step */
    t.data_path = data;
    return t;
}


static void resume(mst_ctx_t* ctx, const char* dir) {
    mst_train_config cfg = tiny(NULL);
    cfg.save_dir = dir;
    cfg.save_every = 3;
    mst_train_result a = {0}, b = {0};
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &a));
    char ck[600];
    snprintf(ck, sizeof ck, "%s/step-3", dir);
    mst_ckpt_meta meta;
    CHECK_OK(mst_ckpt_read_meta(ck, &meta));
    CHECK(meta.step == 3, "step-3 checkpoint says step %lld", (long long)meta.step);
    mst_train_config r = meta.cfg; /* the configuration stored in the checkpoint */
    r.resume_dir = ck;
    r.graph_from = 2;
    CHECK_OK(mst_train_run(ctx, &r, NULL, &b));
    if (!a.loss || !b.loss) return;
    CHECK(b.first_step == 4, "resumed at step %lld", (long long)b.first_step);
    CHECK(mst_first_diff(a.loss + 3, b.loss + 3, sizeof(double) * 3) < 0 &&
              mst_first_diff(a.mtp_loss + 3, b.mtp_loss + 3, sizeof(double) * 3) < 0,
          "steps 4-6: losses %.9g %.9g %.9g, resumed %.9g %.9g %.9g", a.loss[3], a.loss[4], a.loss[5], b.loss[3],
          b.loss[4], b.loss[5]);
    CHECK(a.weights_hash == b.weights_hash, "weights hash %016llx, resumed %016llx", (unsigned long long)a.weights_hash,
          (unsigned long long)b.weights_hash);
    /* the final checkpoint holds the final weights: resuming it has nothing left to do */
    snprintf(ck, sizeof ck, "%s/final", dir);
    CHECK_OK(mst_ckpt_read_meta(ck, &meta));
    CHECK(meta.step == STEPS, "final checkpoint at step %lld", (long long)meta.step);
    mst_train_result c = {0};
    r.resume_dir = ck;
    CHECK_STATUS(mst_train_run(ctx, &r, NULL, &c), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "nothing to do") != NULL, "message '%s'", mst_last_error());
    mst_train_result_free(&c);
    /* another configuration */
    snprintf(ck, sizeof ck, "%s/step-3", dir);
    r.resume_dir = ck;
    r.model.hidden = 64;
    CHECK_STATUS(mst_train_run(ctx, &r, NULL, &c), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "another configuration") != NULL, "message '%s'", mst_last_error());
    mst_train_result_free(&a), mst_train_result_free(&b), mst_train_result_free(&c);
}

static void split(void) {
    mst_data d, e;
    CHECK_OK(mst_data_synthetic(&d, 3, 10000));
    const int64_t w = 18;
    int32_t* all = (int32_t*)malloc(sizeof(int32_t) * (size_t)d.n);
    memcpy(all, d.tok, sizeof(int32_t) * (size_t)d.n);
    CHECK_OK(mst_data_split(&d, 0.1, w, &e));
    CHECK(d.n == 9000 && e.n == 1000 && memcmp(e.tok, all + 9000, sizeof(int32_t) * 1000) == 0, "split %lld + %lld", (long long)d.n,
          (long long)e.n);
    /* every training window lies in the head: its bytes never come from the tail */
    int32_t tok[64 * 18];
    int64_t past = 0;
    for (int r = 0; r < 200; r++) {
        mst_data_batch(&d, 64, w - 2, tok);
        for (int b = 0; b < 64; b++) {
            const int32_t* hit = NULL;
            for (int64_t s = 0; s + w <= 10000 && !hit; s++) {
                int same = 1;
                for (int64_t i = 0; i < w && same; i++) same = all[s + i] == tok[b * w + i];
                if (same) hit = all + s;
            }
            past += hit && hit - all + w > 9000;
        }
    }
    CHECK(past == 0, "%lld training windows reach the held-out tail", (long long)past);
    mst_data_free(&d), mst_data_free(&e);
    mst_data x, none;
    CHECK_OK(mst_data_synthetic(&x, 3, 100));
    CHECK_STATUS(mst_data_split(&x, 0.05, w, &none), MST_ERR_INVALID); /* 5 bytes held out: no window */
    CHECK(strstr(mst_last_error(), "--eval-fraction 0.05") != NULL, "message '%s'", mst_last_error());
    CHECK_STATUS(mst_data_split(&x, 1.0, w, &none), MST_ERR_INVALID);
    mst_data_free(&x);
    free(all);
}

static void eval(mst_ctx_t* ctx, const char* dir) {
    char path[600], plot[600];
    snprintf(path, sizeof path, "%s/text.txt", dir);
    FILE* f = fopen(path, "w");
    mst_rng r = {17};
    for (int i = 0; i < 20000; i++) fputc("abcdefgh ."[mst_rng_int(&r, 0, 9)], f);
    fclose(f);
    mst_train_config cfg = tiny(path);
    cfg.eval_fraction = 0.2;
    mst_train_result a = {0}, b = {0};
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &a)); /* no evaluation, same split */
    cfg.eval_every = 2;
    cfg.eval_batches = 2;
    snprintf(plot, sizeof plot, "%s/loss.svg", dir);
    cfg.plot_path = plot;
    char tl[600], tlk[600];
    snprintf(tl, sizeof tl, "%s/memory.svg", dir);
    snprintf(tlk, sizeof tlk, "%s/memory-keep.svg", dir);
    cfg.timeline_path = tl;
    CHECK_OK(mst_train_run(ctx, &cfg, NULL, &b));
    FILE* f2 = fopen(tl, "r");
    char svg[1 << 16] = "";
    if (f2) svg[fread(svg, 1, sizeof svg - 1, f2)] = 0, fclose(f2);
    CHECK(strstr(svg, "data-series=\"saved: grouped MLP, pages in use\"") && strstr(svg, ">B1<"),
          "timeline %s lacks the pages series or the marks", tl);
    CHECK(access(tlk, R_OK) == 0, "no KEEP timeline at %s", tlk);
    if (!a.loss || !b.loss) return;
    CHECK(mst_first_diff(a.loss, b.loss, sizeof(double) * STEPS) < 0 && a.weights_hash == b.weights_hash,
          "evaluation changed the training");
    for (int i = 0; i < STEPS; i++)
        CHECK(((i + 1) % 2 == 0) == isfinite(b.eval_loss[i]), "step %d: eval loss %g", i + 1, b.eval_loss[i]);
    CHECK(b.eval_loss[STEPS - 1] > 0.5 && b.eval_loss[STEPS - 1] < 7, "eval loss %g", b.eval_loss[STEPS - 1]);
    CHECK(access(plot, R_OK) == 0, "no plot at %s", plot);
    mst_train_result_free(&a), mst_train_result_free(&b);
}

static void run(mst_ctx_t* ctx) {
    char dir[128];
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_resume")) {
        CHECK(0, "no temporary directory");
        return;
    }
    resume(ctx, dir);
    split();
    eval(ctx, dir);
    mst_test_rmtree(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
