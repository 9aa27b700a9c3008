/*
 * dist.c — the model's ranks (model.h, mst_dist): the checks of a dist
 * against its communicators and the grid, and the sums and maxima over the
 * stage's data-parallel ranks (dist.ep) or over the whole grid (dist.pipe),
 * on backend or host memory.
 */
#include "model.h"

#define BAD(...) mst_set_error(MST_ERR_INVALID, __VA_ARGS__)

/* The ranks of dist (NULL, or no communicator: one rank): checked against
 * the communicator and the model's groups. */
mst_status mst_model_dist_check(const mst_model_config* cfg, const mst_mem_config* mem, const mst_dist* dist, mst_dist* out) {
    mst_dist one = {0, 1, NULL, 0, 1, NULL};
    *out = dist && (dist->ep || dist->pipe) ? *dist : one;
    if (out->stages < 1) out->stages = 1;
    if (out->stages > 1 || out->pipe) {
        if (!out->pipe || out->stage < 0 || out->stage >= out->stages || out->world < 1)
            return BAD("dist: stage %d of %d, pipe %s", out->stage, out->stages, out->pipe ? "given" : "NULL");
        if (mst_ep_world(out->pipe) != out->stages * out->world ||
            mst_ep_rank(out->pipe) != out->stage * out->world + out->rank)
            return BAD("dist: rank %d of stage %d (%d x %d), but the pipe is rank %d of %d", out->rank, out->stage,
                       out->stages, out->world, mst_ep_rank(out->pipe), mst_ep_world(out->pipe));
        MST_TRY(mst_model_grid_check(cfg, out->stages, out->stages * out->world, mem->schedule, mem->virtual_stages));
    }
    if (!out->ep) {
        if (out->world != 1) return BAD("dist: %d data-parallel ranks a stage without a communicator", out->world);
        return MST_OK;
    }
    if (out->world != mst_ep_world(out->ep) || out->rank != mst_ep_rank(out->ep))
        return BAD("dist: rank %d of %d, but the communicator is rank %d of %d", out->rank, out->world,
                   mst_ep_rank(out->ep), mst_ep_world(out->ep));
    if (cfg->ep != out->world)
        return BAD("--ep %d: on %d ranks the expert groups are the ranks (--ep %d)", cfg->ep, out->world, out->world);
    return MST_OK;
}

mst_status mst_model_allreduce(mst_model* m, void* data, int64_t count, mst_ep_reduce kind) {
    return m->dist.ep ? mst_ep_allreduce(m->dist.ep, data, count, kind) : MST_OK;
}

/* host [count] in pieces of what m->needs holds: each piece copied in,
 * reduced and copied back (no allocation, see model.h). */
static mst_status allreduce_host(mst_model* m, void* host, int64_t count, mst_ep_reduce kind, int world) {
    if (!(world ? (m->dist.pipe || m->dist.ep) : m->dist.ep != NULL) || count == 0) return MST_OK;
    const size_t es = mst_ep_reduce_size(kind);
    const int64_t per = (int64_t)(sizeof(double) * MST_MODEL_NEEDS / es);
    MST_ASSERT(m->needs);
    for (int64_t o = 0; o < count; o += per) {
        const int64_t n = count - o < per ? count - o : per;
        char* at = (char*)host + (size_t)o * es;
        MST_TRY(mst_copy_h2b(m->ctx, m->needs, at, (size_t)n * es));
        MST_TRY(world ? mst_model_allreduce_world(m, m->needs, n, kind) : mst_model_allreduce(m, m->needs, n, kind));
        MST_TRY(mst_copy_b2h(m->ctx, at, m->needs, (size_t)n * es));
    }
    return MST_OK;
}

mst_status mst_model_allreduce_host(mst_model* m, void* host, int64_t count, mst_ep_reduce kind) {
    return allreduce_host(m, host, count, kind, 0);
}

mst_status mst_model_allreduce_host_world(mst_model* m, void* host, int64_t count, mst_ep_reduce kind) {
    return allreduce_host(m, host, count, kind, 1);
}

mst_status mst_model_max_over_ranks(mst_model* m, double* v, int64_t n) {
    return mst_model_allreduce_host(m, v, n, MST_EP_MAX_F64);
}

mst_status mst_model_allreduce_world(mst_model* m, void* data, int64_t count, mst_ep_reduce kind) {
    return m->dist.pipe ? mst_ep_allreduce(m->dist.pipe, data, count, kind) : mst_model_allreduce(m, data, count, kind);
}

