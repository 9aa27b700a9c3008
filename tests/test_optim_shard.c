/*
 * test_optim_shard.c — the distributed optimizer (ZeRO-1, --optimizer-shard)
 * against the unsharded one on W ranks. `--backend cpu`: the ranks are
 * threads over the CPU twin; `--backend cuda`: thread r on GPU r over NCCL
 * (needs >= 2 GPUs, else MST_TEST_SKIP; the 4-rank cases need 4).
 *
 * What is promised (shard.c): the gradient norm sums the same pieces in the
 * same order sharded or not, AdamW is elementwise, and the reduce-scatter
 * sums in rank order as the all-reduce does on every transport (ep.h); so
 * every step's losses and the final weights (fp32 master and bf16, hashed)
 * are bit-identical sharded or not, on 2 and 4 ranks, on the CPU twin and
 * over NCCL.
 *
 * The same on a pipeline grid (--pp 2 of 2 data-parallel ranks, the
 * embedding tied across the stages).
 *
 * Also: the optimizer bytes of the replicated parameters a rank holds,
 * sharded, <= 0.3x of unsharded at 4 ranks (<= 0.55x at 2), and the memory
 * table's optimizer row smaller; a run that saves at step 4 resumed with
 * the shard setting on and off ends with the uninterrupted run's bits; the twin's collectives on 3 ranks against a serial reference:
 * reduce-scatter's block r the bits of the all-reduce's, the all-gather's
 * blocks the ranks' own, and the sentinels after the buffers untouched.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "trainer/run/checkpoint.h"

static mst_backend_kind kind = MST_BACKEND_CPU;

static mst_train_config small(int32_t W, int64_t steps, int shard) {
    mst_train_config t = {0};
    /* V 257, H 40, D 18: runs that W blocks of a multiple of 4 do not tile
     * (tails: the matrices' 8 elements at 4 ranks, the norms' 12 at 4 and 4 at 2) */
    mst_model_config m = {.vocab = 257, .hidden = 40, .ffn = 32, .n_head = 2, .n_kv_head = 1, .head_dim = 18,
                          .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 16, .batch = 2,
                          .layers = 2, .experts = 8, .top_k = 2, .ep = W, .capacity_factor = (float)W,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f, .seed = 7};
    /* clip 0.05: every step clipped, so the norm's bits reach every update */
    mst_optim_config o = {.lr = 3e-3f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 0.05f, .warmup = 3, .steps = steps};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.mem.optimizer_shard = shard;
    t.microbatches = 2;
    t.steps = steps;
    t.graph_from = 2;
    return t;
}

static mst_status ranks(const mst_train_config* cfg, int32_t W, mst_train_result* res) {
    MST_TRY(mst_train_ranks(kind, cfg, W, 0, NULL, NULL, res));
    const size_t n = sizeof(double) * (size_t)(cfg->steps);
    for (int32_t r = 1; r < W; r++)
        CHECK(!memcmp(res[r].loss, res[0].loss, n) && res[r].weights_hash == res[0].weights_hash &&
                  res[r].replicated_hash == res[0].replicated_hash,
              "W %d shard %d: rank %d's losses or hashes differ from rank 0's", W, cfg->mem.optimizer_shard, r);
    return MST_OK;
}

static void free_ranks(mst_train_result* res, int32_t W) {
    for (int32_t r = 0; r < W; r++) mst_train_result_free(&res[r]);
}

static double rel(double a, double b) { return fabs(a - b) / fabs(b); }

/* Steps [from, steps) of a against b: bit-identical (bits) or within the
 * bound; the worst relative difference printed. */
static void compare(const mst_train_result* a, const mst_train_result* b, int64_t from, int bits, const char* what) {
    double w[2] = {0, 0};
    int same = 1;
    for (int64_t i = from; i < a->steps; i++) {
        same &= a->loss[i] == b->loss[i] && a->mtp_loss[i] == b->mtp_loss[i] && a->aux_loss[i] == b->aux_loss[i];
        const double d[3] = {rel(a->loss[i], b->loss[i]), rel(a->mtp_loss[i], b->mtp_loss[i]), rel(a->aux_loss[i], b->aux_loss[i])};
        for (int k = 0; k < 3; k++) w[k / 2] = d[k] > w[k / 2] || isnan(d[k]) ? d[k] : w[k / 2];
    }
    printf("  %-44s steps %lld-%lld: %s, worst relative difference %.2e (losses) %.2e (load-balancing), hash %s\n", what,
           (long long)from + 1, (long long)a->steps, same ? "bit-identical" : "differ", w[0], w[1],
           a->weights_hash == b->weights_hash ? "equal" : "differs");
    if (bits)
        CHECK(same && a->weights_hash == b->weights_hash, "%s: not bit-identical (last loss %.17g vs %.17g, hash %016llx vs %016llx)",
              what, a->loss[a->steps - 1], b->loss[b->steps - 1], (unsigned long long)a->weights_hash,
              (unsigned long long)b->weights_hash);
    else CHECK(w[0] <= 1e-3 && w[1] <= 1e-2, "%s: losses differ by %.3g, load-balancing by %.3g", what, w[0], w[1]);
}

/* W ranks, 20 steps, sharded against unsharded; the optimizer's bytes. */
static void on_vs_off(int32_t W, int bf16) {
    mst_train_result off[4], on[4];
    memset(off, 0, sizeof off);
    memset(on, 0, sizeof on);
    printf("case: W %d%s, --optimizer-shard off then on, 20 steps ...\n", W, bf16 ? ", bf16 moments" : "");
    mst_train_config c = small(W, 20, 0);
    c.mem.moments_bf16 = bf16;
    CHECK_OK(ranks(&c, W, off));
    c.mem.optimizer_shard = 1;
    CHECK_OK(ranks(&c, W, on));
    if (off[0].loss && on[0].loss) {
        char what[96];
        snprintf(what, sizeof what, "W %d%s: --optimizer-shard on vs off", W, bf16 ? ", bf16 moments" : "");
        CHECK(on[0].loss[0] == off[0].loss[0], "%s: step 1 loss %.17g vs %.17g", what, on[0].loss[0], off[0].loss[0]);
        compare(&on[0], &off[0], 0, 1, what);
        CHECK(on[0].loss[19] < 0.8 * on[0].loss[0], "%s: the loss did not fall (%.4f -> %.4f)", what, on[0].loss[0], on[0].loss[19]);
        const double frac = (double)on[0].optim_rep_bytes / (double)on[0].optim_rep_whole_bytes;
        const double bound = W == 4 ? 0.3 : 0.55;
        printf("  %-44s optimizer state of the replicated parameters %zu bytes a rank, %zu unsharded (%.3fx); "
               "optimizer row %zu vs %zu bytes\n", what, on[0].optim_rep_bytes, on[0].optim_rep_whole_bytes, frac,
               on[0].mem.run[MST_ROW_OPTIM], off[0].mem.run[MST_ROW_OPTIM]);
        CHECK(on[0].optim_shard == 1 && off[0].optim_shard == 0, "%s: shard flags %d %d", what, on[0].optim_shard, off[0].optim_shard);
        CHECK(off[0].optim_rep_bytes == off[0].optim_rep_whole_bytes && off[0].optim_rep_whole_bytes > 0,
              "%s: unsharded holds %zu of %zu bytes", what, off[0].optim_rep_bytes, off[0].optim_rep_whole_bytes);
        CHECK(frac <= bound, "%s: sharded holds %.3fx of the unsharded bytes (want <= %.2f)", what, frac, bound);
        const size_t saved = off[0].optim_rep_whole_bytes - on[0].optim_rep_bytes;
        CHECK(on[0].mem.run[MST_ROW_OPTIM] + saved <= off[0].mem.run[MST_ROW_OPTIM] + 64 * W,
              "%s: the memory table's optimizer row %zu bytes sharded, %zu unsharded, %zu saved", what,
              on[0].mem.run[MST_ROW_OPTIM], off[0].mem.run[MST_ROW_OPTIM], saved);
        /* the trainer's refusal bound (train --gpus N) counts what ZeRO-1
         * holds: on against off, the run's replicated state less its share */
        double need[2], params[2];
        CHECK_OK(mst_model_bytes_at_least(&c.model, bf16, 0, 1, W, &need[0], &params[0]));
        CHECK_OK(mst_model_bytes_at_least(&c.model, bf16, 1, 1, W, &need[1], &params[1]));
        const double want = (double)off[0].optim_rep_whole_bytes * (W - 1) / W;
        CHECK(fabs((params[0] - params[1]) - want) <= 1e-9 * params[0] && need[0] - need[1] == params[0] - params[1],
              "%s: the memory bound drops %.0f bytes sharded (parameters' part %.0f -> %.0f), the run's replicated "
              "state %zu less its share is %.0f", what, need[0] - need[1], params[0], params[1],
              off[0].optim_rep_whole_bytes, want);
    }
    free_ranks(off, W);
    free_ranks(on, W);
}

/* --pp 2 x 2 (tied embeddings: a part of its own on the two stages that
 * hold it), 8 steps sharded against unsharded, every rank's hash. */
static void pp_on_vs_off(void) {
    mst_train_result off[4], on[4];
    memset(off, 0, sizeof off);
    memset(on, 0, sizeof on);
    printf("case: --pp 2 x 2, --optimizer-shard off then on, 8 steps ...\n");
    mst_train_config c = small(2, 8, 0);
    c.pp = 2;
    CHECK_OK(mst_train_ranks(kind, &c, 4, 0, NULL, NULL, off));
    c.mem.optimizer_shard = 1;
    CHECK_OK(mst_train_ranks(kind, &c, 4, 0, NULL, NULL, on));
    if (off[0].loss && on[0].loss) {
        compare(&on[0], &off[0], 0, 1, "--pp 2 x 2: --optimizer-shard on vs off");
        for (int r = 1; r < 4; r++)
            CHECK(on[r].weights_hash == off[r].weights_hash, "--pp 2 x 2: rank %d's weights hash sharded %016llx, "
                  "unsharded %016llx", r, (unsigned long long)on[r].weights_hash, (unsigned long long)off[r].weights_hash);
    }
    free_ranks(off, 4);
    free_ranks(on, 4);
}

/* 8 steps sharded, saved at step 4; resumed sharded and unsharded. */
static void resume_across(int32_t W, int bf16) {
    char dir[512];
    CHECK(mst_test_tmpdir(dir, sizeof dir, "optim_shard"), "a scratch directory");
    mst_train_result full[4], back[4];
    memset(full, 0, sizeof full);
    printf("case: W %d%s, 8 steps sharded saved every 4 (the state gathered), then resumed on and off ...\n", W,
           bf16 ? ", bf16 moments" : "");
    mst_train_config c = small(W, 8, 1);
    c.mem.moments_bf16 = bf16;
    c.save_dir = dir;
    c.save_every = 4;
    CHECK_OK(ranks(&c, W, full));
    char ck[600];
    snprintf(ck, sizeof ck, "%s/step-4", dir);
    mst_ckpt_meta meta;
    CHECK_OK(mst_ckpt_read_meta(ck, &meta));
    for (int shard = 1; shard >= 0 && full[0].loss; shard--) {
        mst_train_config r = meta.cfg;
        r.resume_dir = ck;
        r.graph_from = 2;
        r.mem.optimizer_shard = shard;
        memset(back, 0, sizeof back);
        CHECK_OK(ranks(&r, W, back));
        if (!back[0].loss) continue;
        CHECK(back[0].first_step == 5, "resumed at step %lld", (long long)back[0].first_step);
        char what[96];
        snprintf(what, sizeof what, "W %d%s: saved sharded, resumed shard %s", W, bf16 ? ", bf16 moments" : "", shard ? "on" : "off");
        compare(&back[0], &full[0], 4, 1, what);
        free_ranks(back, W);
    }
    free_ranks(full, W);
    mst_test_rmtree(dir);
}

/* ---- the gradients' reduction and norm, one model a rank ------------------------- */

enum { NW = 4 };
typedef struct norm_job {
    mst_ep_group_t* g;
    int32_t rank, shard;
    float* grad;       /* [n_params] this rank's random gradients in, the model's after the reduction out */
    int64_t n_params, n_dense, n_decay;
    float sumsq;       /* the model's squared norm */
    int64_t host_bad;  /* host values summed / maxed over the ranks: elements wrong */
    size_t host_alloc; /* backend bytes allocated above in_use during those calls */
    mst_status st;
    char err[256];
} norm_job;

enum { HD = 3 * MST_MODEL_NEEDS + 5, HI = 4 * MST_MODEL_NEEDS + 9 }; /* pieces of m->needs and a tail */

/* Host values over the ranks (mst_model_allreduce_host: checkpoints' flags,
 * the memory table): a sum of doubles and a max of int32s longer than
 * m->needs holds, against the exact answers; no backend allocation meanwhile
 * (ranks as threads over NCCL hang on a free or allocation between two
 * collectives). */
static mst_status host_reductions(norm_job* j, mst_ctx_t* ctx, mst_model* m) {
    double hd[HD];
    int32_t hi[HI];
    for (int i = 0; i < HD; i++) hd[i] = 0.5 * (j->rank + 1) * (i + 1); /* sum over the ranks: 5 (i + 1), exact */
    for (int i = 0; i < HI; i++) hi[i] = (i * 7 + j->rank * 13) % 101 - 50;
    size_t in_use = 0, peak = 0;
    mst_ctx_mem_reset_peak(ctx);
    MST_TRY(mst_model_allreduce_host(m, hd, HD, MST_EP_SUM_F64));
    MST_TRY(mst_model_allreduce_host_world(m, hi, HI, MST_EP_MAX_I32));
    mst_ctx_mem(ctx, &in_use, &peak);
    j->host_alloc = peak - in_use;
    j->host_bad = 0;
    for (int i = 0; i < HD; i++) j->host_bad += hd[i] != 5.0 * (i + 1);
    for (int i = 0; i < HI; i++) {
        int32_t want = -1000;
        for (int r = 0; r < NW; r++) want = (i * 7 + r * 13) % 101 - 50 > want ? (i * 7 + r * 13) % 101 - 50 : want;
        j->host_bad += hi[i] != want;
    }
    return MST_OK;
}

static mst_status norm_run(norm_job* j, mst_ctx_t** ctx, mst_ep_t** ep, mst_model** m) {
    mst_train_config c = small(NW, 1, j->shard);
    mst_ep_config ec;
    MST_TRY(mst_model_ep_config(&c.model, NW, &ec));
    MST_TRY(mst_ctx_create(MST_BACKEND_CPU, 0, ctx));
    MST_TRY(mst_ep_create_local(*ctx, &ec, j->g, j->rank, ep));
    mst_dist d = {.rank = j->rank, .world = NW, .ep = *ep};
    MST_TRY(mst_model_create_dist(*ctx, &c.model, 1, &c.mem, &d, m));
    j->n_params = (*m)->n_params, j->n_dense = (*m)->n_dense, j->n_decay = (*m)->n_decay;
    mst_rng rng = {100 + (uint64_t)j->rank};
    j->grad = (float*)malloc(sizeof(float) * (size_t)j->n_params);
    if (!j->grad) return mst_set_error(MST_ERR_OOM, "grad");
    mst_rng_fp32(&rng, j->grad, (size_t)j->n_params, -1.0, 1.0);
    MST_TRY(mst_copy_h2b(*ctx, (*m)->grad, j->grad, sizeof(float) * (size_t)j->n_params));
    MST_TRY(mst_optim_share_grads(*m));
    MST_TRY(mst_optim_grad_sumsq(*m));
    MST_TRY(mst_copy_b2h(*ctx, &j->sumsq, (*m)->gsumsq, sizeof(float)));
    MST_TRY(host_reductions(j, *ctx, *m));
    return mst_copy_b2h(*ctx, j->grad, (*m)->grad, sizeof(float) * (size_t)j->n_params);
}

static void* norm_main(void* p) {
    norm_job* j = (norm_job*)p;
    mst_ctx_t* ctx = NULL;
    mst_ep_t* ep = NULL;
    mst_model* m = NULL;
    j->st = norm_run(j, &ctx, &ep, &m);
    if (j->st != MST_OK) snprintf(j->err, sizeof j->err, "%s", mst_last_error());
    mst_model_destroy(m);
    mst_ep_destroy(ep);
    mst_ctx_destroy(ctx);
    return NULL;
}

/* The random gradients of rank r (regenerated: norm_run's seed). */
static void grads_of(int32_t r, float* g, int64_t n) {
    mst_rng rng = {100 + (uint64_t)r};
    mst_rng_fp32(&rng, g, (size_t)n, -1.0, 1.0);
}

/* 4 ranks, random main_grad each: after mst_optim_share_grads every
 * replicated element this rank holds is the sum over the ranks (fp64
 * reference, 1e-6), sharded: every element of its blocks and the tails;
 * the squared norm within 1e-5 of the fp64 sum of squares of the summed
 * replicated gradients and every rank's experts, every rank the same
 * bits, sharded and not the same bits. */
static void norm_and_reduction(void) {
    float sums[2][NW];
    for (int shard = 0; shard < 2; shard++) {
        norm_job jobs[NW];
        pthread_t th[NW];
        mst_ep_group_t* g = NULL;
        CHECK_OK(mst_ep_group_create(NW, &g));
        for (int r = 0; r < NW; r++) jobs[r] = (norm_job){.g = g, .rank = r, .shard = shard};
        for (int r = 0; r < NW; r++) pthread_create(&th[r], NULL, norm_main, &jobs[r]);
        for (int r = 0; r < NW; r++) pthread_join(th[r], NULL);
        mst_ep_group_destroy(g);
        int ok = 1;
        for (int r = 0; r < NW; r++) {
            CHECK(jobs[r].st == MST_OK, "shard %d rank %d: %s", shard, r, jobs[r].err);
            ok &= jobs[r].st == MST_OK;
        }
        const int64_t n = ok ? jobs[0].n_params : 0, nd = ok ? jobs[0].n_dense : 0, ne = ok ? jobs[0].n_decay : 0;
        float* gr = (float*)malloc(sizeof(float) * (size_t)(n + 1));
        double* sum = (double*)calloc((size_t)(n + 1), sizeof(double));
        double ref = 0;
        for (int r = 0; ok && r < NW; r++) {
            grads_of(r, gr, n);
            for (int64_t i = 0; i < n; i++)
                if (i >= nd && i < ne) ref += (double)gr[i] * gr[i]; /* rank r's experts */
                else sum[i] += gr[i];
        }
        for (int64_t i = 0; ok && i < n; i++)
            if (i < nd || i >= ne) ref += sum[i] * sum[i];
        for (int r = 0; ok && r < NW; r++) {
            /* the elements this rank holds: sharded, its blocks and the tails (body of W q, q a multiple of 4) */
            int64_t bad = 0, held = 0;
            const int64_t lo[2] = {0, ne}, len[2] = {nd, n - ne};
            for (int u = 0; u < 2; u++) {
                const int64_t q = len[u] / (4 * NW) * 4;
                for (int64_t i = 0; i < len[u]; i++) {
                    const int mine = !shard || i >= NW * q || i / q == r;
                    if (!mine) continue;
                    held++;
                    bad += fabs(jobs[r].grad[lo[u] + i] - sum[lo[u] + i]) > 1e-6 * (1 + fabs(sum[lo[u] + i]));
                }
            }
            CHECK(!bad, "shard %d rank %d: %lld of %lld replicated gradients it holds are not the sum over the ranks", shard, r,
                  (long long)bad, (long long)held);
            CHECK(memcmp(&jobs[r].sumsq, &jobs[0].sumsq, sizeof(float)) == 0, "shard %d: rank %d's norm %.9g, rank 0's %.9g",
                  shard, r, jobs[r].sumsq, jobs[0].sumsq);
            CHECK(fabs(jobs[r].sumsq - ref) <= 1e-5 * ref, "shard %d rank %d: squared norm %.9g, fp64 reference %.9g", shard,
                  r, jobs[r].sumsq, ref);
            sums[shard][r] = jobs[r].sumsq;
            CHECK(jobs[r].host_bad == 0 && jobs[r].host_alloc == 0, "shard %d rank %d: host values over the ranks: %lld "
                  "of %d wrong, %zu backend bytes allocated meanwhile", shard, r, (long long)jobs[r].host_bad, HD + HI,
                  jobs[r].host_alloc);
        }
        if (ok) printf("  %-44s shard %d: squared norm %.9g (fp64 %.9g), %lld parameters a rank, tails %lld and %lld; "
                       "host sums and maxima of %d and %d values exact, nothing allocated\n", "4 ranks: reduction, norm",
                       shard, jobs[0].sumsq, ref, (long long)n, (long long)(nd % (4 * NW)), (long long)((n - ne) % (4 * NW)),
                       HD, HI);
        CHECK(!ok || (nd % (4 * NW) && (n - ne) % (4 * NW)), "the test model's runs have no tails at 4 ranks");
        for (int r = 0; r < NW; r++) free(jobs[r].grad);
        free(gr);
        free(sum);
    }
    CHECK(memcmp(sums[0], sums[1], sizeof sums[0]) == 0, "the squared norm sharded %.9g, unsharded %.9g: not the same bits",
          sums[1][0], sums[0][0]);
}

/* ---- the twin's collectives on 3 ranks ---------------------------------------- */

enum { CW = 3, CN = 37, SENT = 8 }; /* ranks, count per block (odd), sentinel floats */

typedef struct coll_job {
    mst_ep_group_t* g;
    int32_t rank;
    float* rs;      /* [CW CN + SENT] reduce-scatter in place */
    float* ar;      /* [CW CN + SENT] all-reduce in place     */
    uint16_t* ag;   /* [CW CN + SENT] all-gather in place     */
    mst_status st;
} coll_job;

static void* coll_main(void* p) {
    coll_job* j = (coll_job*)p;
    mst_ctx_t* ctx = NULL;
    mst_ep_t* ep = NULL;
    mst_ep_config ec = {.struct_size = sizeof ec, .n_experts = CW, .top_k = 1, .hidden = 8, .max_tokens = 4, .max_rows = 4};
    j->st = mst_ctx_create(MST_BACKEND_CPU, 0, &ctx);
    if (j->st == MST_OK) j->st = mst_ep_create_local(ctx, &ec, j->g, j->rank, &ep);
    if (j->st == MST_OK) j->st = mst_ep_reduce_scatter(ep, j->rs, CN, MST_EP_SUM_F32);
    if (j->st == MST_OK) j->st = mst_ep_allreduce(ep, j->ar, CW * CN, MST_EP_SUM_F32);
    if (j->st == MST_OK) j->st = mst_ep_allgather(ep, j->ag, sizeof(uint16_t) * CN);
    mst_ep_destroy(ep);
    mst_ctx_destroy(ctx);
    return NULL;
}

static void twin_collectives(void) {
    coll_job jobs[CW];
    pthread_t th[CW];
    mst_ep_group_t* g = NULL;
    CHECK_OK(mst_ep_group_create(CW, &g));
    mst_rng rng = {11};
    static float in[CW][CW * CN]; /* each rank's input */
    for (int r = 0; r < CW; r++) {
        jobs[r] = (coll_job){.g = g, .rank = r};
        jobs[r].rs = (float*)malloc(sizeof(float) * (CW * CN + SENT));
        jobs[r].ar = (float*)malloc(sizeof(float) * (CW * CN + SENT));
        jobs[r].ag = (uint16_t*)malloc(sizeof(uint16_t) * (CW * CN + SENT));
        mst_rng_fp32(&rng, in[r], CW * CN, -3.0, 3.0);
        memcpy(jobs[r].rs, in[r], sizeof in[r]);
        memcpy(jobs[r].ar, in[r], sizeof in[r]);
        for (int i = 0; i < CW * CN; i++) /* its own block's values, the others poisoned */
            jobs[r].ag[i] = i / CN == r ? (uint16_t)(1000 * r + i) : 0xDEAD;
        for (int i = 0; i < SENT; i++) jobs[r].rs[CW * CN + i] = jobs[r].ar[CW * CN + i] = -7.0f, jobs[r].ag[CW * CN + i] = 0x7777;
    }
    for (int r = 0; r < CW; r++) pthread_create(&th[r], NULL, coll_main, &jobs[r]);
    for (int r = 0; r < CW; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < CW; r++) {
        CHECK(jobs[r].st == MST_OK, "rank %d: %s", r, mst_last_error());
        int bad_rs = 0, bad_ar = 0, bad_ag = 0, bad_sent = 0;
        for (int i = 0; i < CW * CN; i++) {
            const double want = (double)in[0][i] + (double)in[1][i] + (double)in[2][i];
            bad_ar += fabs(jobs[r].ar[i] - want) > 1e-5 * (1 + fabs(want));
            if (i / CN == r) bad_rs += memcmp(&jobs[r].rs[i], &jobs[r].ar[i], sizeof(float)) != 0;
            bad_ag += jobs[r].ag[i] != (uint16_t)(1000 * (i / CN) + i);
        }
        for (int i = 0; i < SENT; i++)
            bad_sent += jobs[r].rs[CW * CN + i] != -7.0f || jobs[r].ar[CW * CN + i] != -7.0f || jobs[r].ag[CW * CN + i] != 0x7777;
        CHECK(!bad_rs && !bad_ar && !bad_ag && !bad_sent, "rank %d: %d reduce-scatter elements not the all-reduce's bits, "
              "%d all-reduce sums off the reference, %d all-gather elements wrong, %d sentinels touched", r, bad_rs, bad_ar,
              bad_ag, bad_sent);
        free(jobs[r].rs), free(jobs[r].ar), free(jobs[r].ag);
    }
    mst_ep_group_destroy(g);
    printf("  %-44s 3 ranks, %d elements a block: reduce-scatter = all-reduce bits, all-gather exact\n", "twin collectives", CN);
}

int main(int argc, char** argv) {
    kind = mst_test_backend_arg(argc, argv);
    const int n_dev = mst_test_devices(kind, 8);
    if (n_dev < 2) return mst_test_skip_devices(argv[0], n_dev, "the sharded optimizer needs 2 ranks");
    /* a line as each case starts (stdout line-buffered): a run cut at its
     * limit shows the case it hung in (ranks as threads over NCCL wait
     * forever for a rank that failed or stalls) */
    if (kind == MST_BACKEND_CPU) twin_collectives();
    if (kind == MST_BACKEND_CPU) norm_and_reduction();
    on_vs_off(2, 0);
    on_vs_off(2, 1);
    if (n_dev >= 4) on_vs_off(4, 0);
    else printf("  4 ranks skipped: %d devices\n", n_dev);
    if (n_dev >= 4) pp_on_vs_off();
    resume_across(2, 0);
    resume_across(2, 1);
    printf("%s: %d passed, %d failed\n", argv[0], mst_test_checks - mst_test_failures, mst_test_failures);
    return mst_test_failures ? 1 : 0;
}
