/*
 * train_ranks.c — a run on W ranks as threads of this process. CPU: each
 * thread a CPU context and the CPU twin's communicator
 * (mst_ep_create_local), the stand-in for W GPUs that CI runs (`moestash
 * train --backend cpu --gpus W`); a rank that fails is named, and the
 * others leave the collective they wait in with an error (the group notices
 * a rank that left). CUDA (tests): thread r on GPU r with an NCCL
 * communicator of the W threads (one NCCL id made here); a rank that fails
 * there leaves the others waiting in NCCL, so it says why on stderr at
 * once. Rank 0 prints.
 * With cfg->pp = P > 1 stages the W ranks form the grid of stage.c: rank r
 * is data-parallel rank r % D of stage r / D (D = W / P); its stage's
 * communicator (D > 1) is a group of its own on the CPU, a split of the
 * grid's NCCL communicator on CUDA; the grid's (pipe) spans every rank.
 */
#include <pthread.h>
#include <string.h>

#include "trainer.h"

typedef struct rank_job {
    const mst_train_config* cfg;
    mst_backend_kind kind;
    mst_ep_group_t* group;     /* CPU: the stage's data-parallel ranks       */
    mst_ep_group_t* pipe;      /* CPU, P > 1: every rank                      */
    const mst_ep_id* id;       /* CUDA                                         */
    int32_t rank, world, stages, check_policies;
    FILE *out, *json;          /* rank 0's                                     */
    mst_train_result* res;     /* this rank's                                  */
    mst_status st;
    char err[512];
} rank_job;

static int32_t stages_of(const mst_train_config* cfg) { return cfg->pp > 1 ? cfg->pp : 1; }

/* This rank's communicators: the stage's (*ep: mst_model_stage_comm) and
 * the grid's (*pipe, P > 1). */
static mst_status comms(rank_job* j, mst_ctx_t* ctx, const mst_ep_config* ec, mst_ep_t** ep, mst_ep_t** pipe) {
    const int32_t P = j->stages, D = j->world / P, s = j->rank / D, d = j->rank % D;
    if (j->kind == MST_BACKEND_CPU) {
        if (P > 1) MST_TRY(mst_ep_create_local(ctx, NULL, j->pipe, j->rank, pipe));
        return j->group ? mst_ep_create_local(ctx, ec, j->group, d, ep) : MST_OK;
    }
    if (P == 1) return mst_ep_create(ctx, ec, j->id, j->rank, j->world, ep);
    /* P > 1: the grid's from the one id, the stage's split from it */
    MST_TRY(mst_ep_create(ctx, NULL, j->id, j->rank, j->world, pipe));
    return mst_model_stage_comm(P, j->world) ? mst_ep_create_split(ctx, ec, *pipe, s, d, ep) : MST_OK;
}

static mst_status rank_run(rank_job* j, mst_ctx_t** ctx, mst_ep_t** ep, mst_ep_t** pipe) {
    mst_train_config cfg = *j->cfg;
    const int32_t P = j->stages, D = j->world / P;
    mst_ep_config ec; /* the stage's communicator (none for one rank a stage) */
    if (mst_model_stage_comm(P, j->world)) MST_TRY(mst_model_ep_config(&cfg.model, D, &ec));
    MST_TRY(mst_ctx_create(j->kind, j->kind == MST_BACKEND_CPU ? 0 : j->rank, ctx));
    MST_TRY(comms(j, *ctx, &ec, ep, pipe));
    cfg.dist = (mst_dist){j->rank % D, D, *ep, j->rank / D, P, *pipe};
    if (j->check_policies) return mst_train_check_policies(*ctx, &cfg, j->out, j->json);
    return mst_train_run(*ctx, &cfg, j->out, j->res);
}

static void* rank_main(void* p) {
    rank_job* j = (rank_job*)p;
    mst_ctx_t* ctx = NULL;
    mst_ep_t *ep = NULL, *pipe = NULL;
    j->st = rank_run(j, &ctx, &ep, &pipe);
    if (j->st != MST_OK) snprintf(j->err, sizeof j->err, "%s", mst_last_error());
    if (j->st != MST_OK && j->kind != MST_BACKEND_CPU) /* now: the other ranks may wait in NCCL for it forever */
        fprintf(stderr, "moestash: rank %d of %d failed: %s\n", j->rank, j->world, j->err);
    mst_ep_destroy(ep); /* a rank that failed leaves the groups: the others' next wait fails */
    mst_ep_destroy(pipe);
    mst_ctx_destroy(ctx);
    return NULL;
}

/* CPU: rank r, whose thread did not start, joins its groups and leaves
 * them at once, so the ranks that run fail their first wait instead of
 * hanging. */
static void leave(const mst_train_config* cfg, mst_ep_group_t* g, mst_ep_group_t* pipe, int32_t r, int32_t world) {
    mst_ctx_t* ctx = NULL;
    mst_ep_t *ep = NULL, *pp = NULL;
    const int32_t P = stages_of(cfg), D = world / P;
    mst_ep_config ec;
    if ((!g || mst_model_ep_config(&cfg->model, D, &ec) == MST_OK) && mst_ctx_create(MST_BACKEND_CPU, 0, &ctx) == MST_OK) {
        if (g) mst_ep_create_local(ctx, &ec, g, r % D, &ep);
        if (pipe) mst_ep_create_local(ctx, NULL, pipe, r, &pp);
    }
    mst_ep_destroy(ep);
    mst_ep_destroy(pp);
    mst_ctx_destroy(ctx);
}

/* CPU: the stages' groups [P] (where mst_model_stage_comm gives them one)
 * and the grid's (P > 1). */
static mst_status groups(int32_t P, int32_t D, mst_ep_group_t** g, mst_ep_group_t** pipe) {
    for (int32_t s = 0; mst_model_stage_comm(P, P * D) && s < P; s++) MST_TRY(mst_ep_group_create(D, &g[s]));
    return P > 1 ? mst_ep_group_create(P * D, pipe) : MST_OK;
}

mst_status mst_train_ranks(mst_backend_kind kind, const mst_train_config* cfg, int32_t world, int check_policies,
                           FILE* out, FILE* json, mst_train_result* res) {
    if (world < 1 || world > 1024) return mst_set_error(MST_ERR_INVALID, "--gpus %d: expected 1 .. 1024", world);
    if (cfg->dist.ep || cfg->dist.pipe) return mst_set_error(MST_ERR_INVALID, "cfg->dist: the ranks are made here");
    const int32_t P = stages_of(cfg);
    MST_TRY(mst_model_grid_check(&cfg->model, P, world, cfg->mem.schedule, cfg->mem.virtual_stages));
    const int32_t D = world / P;
    mst_ep_group_t** g = (mst_ep_group_t**)calloc((size_t)P, sizeof *g); /* [P] */
    mst_ep_group_t* pipe = NULL;
    mst_ep_id id;
    rank_job* jobs = (rank_job*)calloc((size_t)world, sizeof *jobs);
    pthread_t* th = (pthread_t*)calloc((size_t)world, sizeof *th);
    mst_status st = jobs && th && g ? MST_OK : mst_set_error(MST_ERR_OOM, "%d rank threads", world);
    if (st == MST_OK) st = kind == MST_BACKEND_CPU ? groups(P, D, g, &pipe) : mst_ep_id_create(&id);
    int32_t started = 0;
    while (st == MST_OK && started < world) {
        const int32_t r = started;
        jobs[r] = (rank_job){.cfg = cfg, .kind = kind, .group = g[r / D], .pipe = pipe, .id = &id, .rank = r,
                             .world = world, .stages = P, .check_policies = check_policies,
                             .out = r == 0 ? out : NULL, .json = r == 0 ? json : NULL, .res = res ? &res[r] : NULL};
        if (pthread_create(&th[r], NULL, rank_main, &jobs[r]) != 0) st = mst_set_error(MST_ERR_OOM, "rank thread %d", r);
        else started++;
    }
    if (started > 0 && started < world && kind == MST_BACKEND_CPU) /* the started ranks stop waiting for it */
        leave(cfg, g[started / D], pipe, started, world);
    for (int32_t r = 0; r < started; r++) pthread_join(th[r], NULL);
    /* the first rank that failed of itself (others may only have seen it leave) */
    int32_t bad = -1;
    for (int32_t r = 0; st == MST_OK && r < world; r++)
        if (jobs[r].st != MST_OK && (bad < 0 || (jobs[bad].st == MST_ERR_STATE && strstr(jobs[bad].err, "left the group"))))
            bad = r;
    if (bad >= 0) st = mst_set_error(jobs[bad].st, "rank %d: %s", bad, jobs[bad].err);
    free(jobs);
    free(th);
    for (int32_t s = 0; g && s < P; s++) mst_ep_group_destroy(g[s]);
    free(g);
    mst_ep_group_destroy(pipe);
    return st;
}
