/*
 * train_ranks.c — a run on W ranks as threads of this process. CPU: each
 * thread a CPU context and the CPU twin's communicator
 * (mst_ep_create_local), the stand-in for W GPUs that CI runs (`moestash
 * train --backend cpu --gpus W`); a rank that fails is named, and the
 * others leave the collective they wait in with an error (the group notices
 * a rank that left). CUDA (tests): thread r on GPU r with an NCCL
 * communicator of the W threads (one NCCL id made here); a rank that fails
 * there leaves the others waiting in NCCL. Rank 0 prints.
 */
#include <pthread.h>
#include <string.h>

#include "trainer.h"

typedef struct rank_job {
    const mst_train_config* cfg;
    mst_backend_kind kind;
    mst_ep_group_t* group;     /* CPU                                          */
    const mst_ep_id* id;       /* CUDA                                         */
    int32_t rank, world, check_policies;
    FILE *out, *json;          /* rank 0's                                     */
    mst_train_result* res;     /* this rank's                                  */
    mst_status st;
    char err[512];
} rank_job;

static mst_status rank_run(rank_job* j, mst_ctx_t** ctx, mst_ep_t** ep) {
    mst_train_config cfg = *j->cfg;
    mst_ep_config ec;
    MST_TRY(mst_model_ep_config(&cfg.model, j->world, &ec));
    if (j->kind == MST_BACKEND_CPU) {
        MST_TRY(mst_ctx_create(MST_BACKEND_CPU, 0, ctx));
        MST_TRY(mst_ep_create_local(*ctx, &ec, j->group, j->rank, ep));
    } else {
        MST_TRY(mst_ctx_create(j->kind, j->rank, ctx));
        MST_TRY(mst_ep_create(*ctx, &ec, j->id, j->rank, j->world, ep));
    }
    cfg.dist = (mst_dist){j->rank, j->world, *ep};
    if (j->check_policies) return mst_train_check_policies(*ctx, &cfg, j->out, j->json);
    return mst_train_run(*ctx, &cfg, j->out, j->res);
}

static void* rank_main(void* p) {
    rank_job* j = (rank_job*)p;
    mst_ctx_t* ctx = NULL;
    mst_ep_t* ep = NULL;
    j->st = rank_run(j, &ctx, &ep);
    if (j->st != MST_OK) snprintf(j->err, sizeof j->err, "%s", mst_last_error());
    mst_ep_destroy(ep); /* a rank that failed leaves the group: the others' next wait fails */
    mst_ctx_destroy(ctx);
    return NULL;
}

/* CPU: rank r, whose thread did not start, joins the group and leaves it
 * at once, so the ranks that run fail their first wait instead of hanging. */
static void leave(const mst_train_config* cfg, mst_ep_group_t* g, int32_t r, int32_t world) {
    mst_ctx_t* ctx = NULL;
    mst_ep_t* ep = NULL;
    mst_ep_config ec;
    if (mst_model_ep_config(&cfg->model, world, &ec) == MST_OK && mst_ctx_create(MST_BACKEND_CPU, 0, &ctx) == MST_OK)
        mst_ep_create_local(ctx, &ec, g, r, &ep);
    mst_ep_destroy(ep);
    mst_ctx_destroy(ctx);
}

mst_status mst_train_ranks(mst_backend_kind kind, const mst_train_config* cfg, int32_t world, int check_policies,
                           FILE* out, FILE* json, mst_train_result* res) {
    if (world < 1 || world > 1024) return mst_set_error(MST_ERR_INVALID, "--gpus %d: expected 1 .. 1024", world);
    if (cfg->dist.ep) return mst_set_error(MST_ERR_INVALID, "cfg->dist: the ranks are made here");
    mst_ep_group_t* g = NULL;
    mst_ep_id id;
    if (kind == MST_BACKEND_CPU) MST_TRY(mst_ep_group_create(world, &g));
    else MST_TRY(mst_ep_id_create(&id));
    rank_job* jobs = (rank_job*)calloc((size_t)world, sizeof *jobs);
    pthread_t* th = (pthread_t*)calloc((size_t)world, sizeof *th);
    mst_status st = jobs && th ? MST_OK : mst_set_error(MST_ERR_OOM, "%d rank threads", world);
    int32_t started = 0;
    while (st == MST_OK && started < world) {
        const int32_t r = started;
        jobs[r] = (rank_job){.cfg = cfg, .kind = kind, .group = g, .id = &id, .rank = r, .world = world, .check_policies = check_policies,
                             .out = r == 0 ? out : NULL, .json = r == 0 ? json : NULL, .res = res ? &res[r] : NULL};
        if (pthread_create(&th[r], NULL, rank_main, &jobs[r]) != 0) st = mst_set_error(MST_ERR_OOM, "rank thread %d", r);
        else started++;
    }
    if (started < world && g) leave(cfg, g, started, world); /* the started ranks stop waiting for it */
    for (int32_t r = 0; r < started; r++) pthread_join(th[r], NULL);
    /* the first rank that failed of itself (others may only have seen it leave) */
    int32_t bad = -1;
    for (int32_t r = 0; st == MST_OK && r < world; r++)
        if (jobs[r].st != MST_OK && (bad < 0 || (jobs[bad].st == MST_ERR_STATE && strstr(jobs[bad].err, "left the group"))))
            bad = r;
    if (bad >= 0) st = mst_set_error(jobs[bad].st, "rank %d: %s", bad, jobs[bad].err);
    free(jobs);
    free(th);
    mst_ep_group_destroy(g);
    return st;
}
