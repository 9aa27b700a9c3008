/*
 * transport_local.c — the CPU twin of the NCCL exchange: ranks are threads
 * of one process, each with its own CPU context, and a group in shared
 * memory. An exchange publishes this rank's planes, waits for every rank,
 * copies block `rank` of each peer's send plane into its own receive plane
 * (block = peer), and waits again so that no rank reuses its send buffers
 * before every peer has read them. Copies the valid rows of each block only
 * (as the NCCL device-API path moves them), so counts that undercount the
 * rows a block holds lose rows here too. All-reduce and reduce-scatter sum
 * in rank order by sum_order.h (the NCCL transport's bits; the same bits for
 * a block either way). Direct dispatch stores into the peers' window rows as the lsa kernel does (the same offset math,
 * ep_ops.h), a wait for each of its barriers. Point-to-point transfers
 * (mst_ep_p2p) meet as NCCL's do: a rank posts its group's sends, takes each
 * receive from its peer's posted group (the first send to it not yet taken:
 * the pair's order), and returns once its own sends were taken; so two
 * ranks whose groups wait on each other in another order never return here
 * either (a wait ends after MST_EP_P2P_TIMEOUT_S, naming both ranks).
 */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "ep.h"
#include "sum_order.h"

enum { MAX_PLANES = 4 };

struct mst_ep_group {
    int world;                    /* W                                         */
    pthread_mutex_t wait_mu;      /* the barrier of all W ranks: arrived, gen,  */
    pthread_cond_t wait_cv;       /* left                                       */
    int arrived;                  /* ranks in the current wait                  */
    unsigned gen;                 /* waits completed                            */
    int left;                     /* a rank left the group (its communicator was
                                     destroyed): every later wait fails, so no
                                     rank waits for one that is gone (-1: none)  */
    const mst_ep_plane** planes;  /* [W] each rank's planes while it exchanges */
    int* n_planes;                /* [W]                                       */
    int* joined;                  /* [W] 1 once a communicator took the rank   */
    mst_ep_t** eps;               /* [W] each rank's communicator (its window:
                                     direct dispatch stores into the peers')    */
    pthread_mutex_t mu;           /* guards joined                             */
    /* point-to-point: each rank's group while it is in mst_ep_p2p (under
     * wait_mu, waking on wait_cv) */
    const mst_ep_p2p_op** posted; /* [W] the group's transfers, NULL: none      */
    int* n_posted;                /* [W]                                       */
    int** taken;                  /* [W] [n_posted] 1 once a send was received */
};

typedef struct local_comm {
    mst_ep_group_t* group;
} local_comm;

mst_status mst_ep_group_create(int world, mst_ep_group_t** out) {
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (world < 1 || world > 1024) return mst_set_error(MST_ERR_INVALID, "world = %d: must be in [1, 1024]", world);
    mst_ep_group_t* g = (mst_ep_group_t*)calloc(1, sizeof *g);
    if (!g) return mst_set_error(MST_ERR_OOM, "ep group");
    g->world = world;
    g->planes = (const mst_ep_plane**)calloc((size_t)world, sizeof *g->planes);
    g->n_planes = (int*)calloc((size_t)world, sizeof *g->n_planes);
    g->joined = (int*)calloc((size_t)world, sizeof *g->joined);
    g->eps = (mst_ep_t**)calloc((size_t)world, sizeof *g->eps);
    g->posted = (const mst_ep_p2p_op**)calloc((size_t)world, sizeof *g->posted);
    g->n_posted = (int*)calloc((size_t)world, sizeof *g->n_posted);
    g->taken = (int**)calloc((size_t)world, sizeof *g->taken);
    if (!g->planes || !g->n_planes || !g->joined || !g->eps || !g->posted || !g->n_posted || !g->taken) {
        free(g->planes), free(g->n_planes), free(g->joined), free(g->eps), free(g->posted), free(g->n_posted);
        free(g->taken), free(g);
        return mst_set_error(MST_ERR_OOM, "ep group");
    }
    pthread_mutex_init(&g->wait_mu, NULL);
    pthread_cond_init(&g->wait_cv, NULL);
    g->left = -1;
    pthread_mutex_init(&g->mu, NULL);
    *out = g;
    return MST_OK;
}

void mst_ep_group_destroy(mst_ep_group_t* g) {
    if (!g) return;
    pthread_mutex_destroy(&g->wait_mu);
    pthread_cond_destroy(&g->wait_cv);
    pthread_mutex_destroy(&g->mu);
    free(g->planes), free(g->n_planes), free(g->joined), free(g->eps), free(g->posted), free(g->n_posted);
    free(g->taken), free(g);
}

/* Waits for every rank; MST_ERR_STATE when a rank left the group before
 * the wait completed. */
static mst_status group_wait(mst_ep_group_t* g, int rank) {
    pthread_mutex_lock(&g->wait_mu);
    const unsigned gen = g->gen;
    if (g->left < 0 && ++g->arrived == g->world) {
        g->arrived = 0;
        g->gen++;
        pthread_cond_broadcast(&g->wait_cv);
    }
    while (g->gen == gen && g->left < 0) pthread_cond_wait(&g->wait_cv, &g->wait_mu);
    const int left = g->gen == gen ? g->left : -1;
    pthread_mutex_unlock(&g->wait_mu);
    if (left < 0) return MST_OK;
    return mst_set_error(MST_ERR_STATE, "rank %d: rank %d left the group while this one waited for it", rank, left);
}

/* Marks rank as gone and wakes every waiter. */
static void group_leave(mst_ep_group_t* g, int rank) {
    pthread_mutex_lock(&g->wait_mu);
    if (g->left < 0) g->left = rank;
    pthread_cond_broadcast(&g->wait_cv);
    pthread_mutex_unlock(&g->wait_mu);
}

/* Bytes of block `to` of plane p that matter: its valid rows, or all. */
static size_t valid_bytes(const mst_ep_plane* p, int to) {
    if (!p->valid) return p->block_bytes;
    const int32_t v = p->valid[(int64_t)to * p->valid_stride];
    const size_t n = v > 0 ? (size_t)v * p->row_bytes : 0;
    return n < p->block_bytes ? n : p->block_bytes;
}

static mst_status local_exchange(mst_ep_t* ep, const mst_ep_plane* pl, int n) {
    mst_ep_group_t* g = ((local_comm*)ep->comm)->group;
    const int me = ep->rank;
    MST_ASSERT(n <= MAX_PLANES);
    g->planes[me] = pl;
    g->n_planes[me] = n;
    MST_TRY(group_wait(g, me));
    for (int j = 0; j < g->world; j++) {
        MST_ASSERT(g->n_planes[j] == n); /* every rank exchanges the same planes */
        for (int p = 0; p < n; p++) {
            const mst_ep_plane* src = &g->planes[j][p];
            MST_ASSERT(src->block_bytes == pl[p].block_bytes);
            memcpy((char*)pl[p].recv + (size_t)j * pl[p].block_bytes,
                   (const char*)src->send + (size_t)me * src->block_bytes, valid_bytes(src, me));
        }
    }
    return group_wait(g, me);
}

/* acc [count] after rank j's src [count], element by element: the float
 * sums by sum_order.h (the NCCL transport's order), the rest exact. */
static void reduce_into(void* acc, const void* src, int64_t count, mst_ep_reduce kind, int j) {
    const int first = j == 0;
    for (int64_t i = 0; i < count; i++) switch (kind) {
        case MST_EP_SUM_F32: ((float*)acc)[i] = mst_ep_sum_f32(((float*)acc)[i], ((const float*)src)[i], j); break;
        case MST_EP_SUM_F64: ((double*)acc)[i] = mst_ep_sum_f64(((double*)acc)[i], ((const double*)src)[i], j); break;
        case MST_EP_SUM_I32: ((int32_t*)acc)[i] = first ? ((const int32_t*)src)[i] : ((int32_t*)acc)[i] + ((const int32_t*)src)[i]; break;
        case MST_EP_MAX_I32: {
            const int32_t v = ((const int32_t*)src)[i];
            ((int32_t*)acc)[i] = !first && ((int32_t*)acc)[i] > v ? ((int32_t*)acc)[i] : v;
            break;
        }
        case MST_EP_MAX_F64: {
            const double v = ((const double*)src)[i];
            ((double*)acc)[i] = !first && ((double*)acc)[i] > v ? ((double*)acc)[i] : v;
            break;
        }
        }
}

/* The collectives' tags in n_planes (an exchange's is its plane count >= 0). */
enum { TAG_ALLREDUCE = -1, TAG_REDUCE_SCATTER = -16, TAG_ALLGATHER = -32 };

/* A collective over `data` (block_bytes its bytes on a rank; a window's
 * lo and hi in row_bytes and valid_stride) of tag: published, every rank
 * waited for, checked alike (MST_ERR_STATE naming `what` when the ranks
 * passed different sizes, windows or kinds, after the second wait). */
static mst_status publish(mst_ep_t* ep, mst_ep_plane* me, int tag, int* same) {
    mst_ep_group_t* g = ((local_comm*)ep->comm)->group;
    g->planes[ep->rank] = me;
    g->n_planes[ep->rank] = tag;
    MST_TRY(group_wait(g, ep->rank));
    for (int j = 0; j < g->world; j++)
        *same &= g->n_planes[j] == tag && g->planes[j]->block_bytes == me->block_bytes &&
                 g->planes[j]->row_bytes == me->row_bytes && g->planes[j]->valid_stride == me->valid_stride;
    return MST_OK;
}

static mst_status finish(mst_ep_t* ep, int same, int oom, const char* what) {
    return same ? MST_OK
                : mst_set_error(oom ? MST_ERR_OOM : MST_ERR_STATE, "%s (rank %d): %s", what, ep->rank,
                                oom ? "out of host memory" : "the ranks passed different counts, windows or kinds");
}

/* Every rank reduces elements [at, at + len) of the ranks' data (n elements
 * each; all of them for an all-reduce, its part of the window for a
 * reduce-scatter: `me` the published plane) in rank order into its scratch
 * (the same bits everywhere), then, once every rank has read every buffer,
 * copies it into its own data. */
static mst_status reduce_part(mst_ep_t* ep, mst_ep_plane* me, int64_t at, int64_t len, mst_ep_reduce kind, int tag,
                              const char* what) {
    mst_ep_group_t* g = ((local_comm*)ep->comm)->group;
    const size_t es = mst_ep_reduce_size(kind), off = (size_t)at * es;
    void* acc = malloc((size_t)len * es + 1);
    int same = acc != NULL;
    const int oom = !same;
    mst_status st = publish(ep, me, tag - (int)kind, &same);
    if (st != MST_OK) {
        free(acc);
        return st;
    }
    for (int j = 0; same && j < g->world; j++) reduce_into(acc, (const char*)g->planes[j]->send + off, len, kind, j);
    st = group_wait(g, ep->rank);
    if (same && st == MST_OK) memcpy((char*)me->send + off, acc, (size_t)len * es);
    free(acc);
    if (st != MST_OK) return st;
    return finish(ep, same, oom, what);
}

static mst_status local_allreduce(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind) {
    mst_ep_plane me = {.send = data, .block_bytes = (size_t)count * mst_ep_reduce_size(kind)};
    return reduce_part(ep, &me, 0, count, kind, TAG_ALLREDUCE, "mst_ep_allreduce");
}

/* This rank's part of the window: [max(lo, r q), min(hi, (r + 1) q)). */
static mst_status local_reduce_scatter(mst_ep_t* ep, void* data, int64_t q, int64_t lo, int64_t hi, mst_ep_reduce kind) {
    const int64_t a = (int64_t)ep->rank * q > lo ? (int64_t)ep->rank * q : lo;
    const int64_t e = (int64_t)(ep->rank + 1) * q < hi ? (int64_t)(ep->rank + 1) * q : hi;
    mst_ep_plane me = {.send = (void*)data, .block_bytes = (size_t)(ep->world * q) * mst_ep_reduce_size(kind),
                       .row_bytes = (size_t)lo, .valid_stride = hi};
    return reduce_part(ep, &me, a, e > a ? e - a : 0, kind, TAG_REDUCE_SCATTER, "mst_ep_reduce_scatter");
}

/* Each rank copies block j of rank j's buffer into its own block j; rank j
 * writes only its other blocks meanwhile. */
static mst_status local_allgather(mst_ep_t* ep, void* data, size_t block_bytes) {
    mst_ep_group_t* g = ((local_comm*)ep->comm)->group;
    int same = 1;
    mst_ep_plane me = {.send = data, .block_bytes = block_bytes};
    MST_TRY(publish(ep, &me, TAG_ALLGATHER, &same));
    for (int j = 0; same && j < g->world; j++)
        if (j != ep->rank)
            memcpy((char*)data + (size_t)j * block_bytes, (const char*)g->planes[j]->send + (size_t)j * block_bytes,
                   block_bytes);
    MST_TRY(group_wait(g, ep->rank));
    return finish(ep, same, 0, "mst_ep_allgather");
}

/* Direct dispatch as the lsa kernel runs it, a wait for each of its
 * barriers: this rank's send counts into every peer's gathered and
 * recv_counts, then each row (and prob) straight into its expert row of the
 * destination's window. */
static mst_status local_dispatch_direct(mst_ep_t* ep, const mst_ep_args* a) {
    mst_ep_group_t* g = ((local_comm*)ep->comm)->group;
    const int me = ep->rank, W = g->world, El = ep->n_local;
    MST_TRY(group_wait(g, me)); /* every peer is in dispatch: done with its window rows */
    for (int d = 0; d < W; d++) {
        mst_ep_t* peer = g->eps[d];
        memcpy(peer->gathered + (int64_t)me * W * El, a->send_counts, (size_t)W * (size_t)El * sizeof(int32_t));
        memcpy(peer->recv_counts + (int64_t)me * El, a->send_counts + (int64_t)d * El, (size_t)El * sizeof(int32_t));
    }
    MST_TRY(group_wait(g, me)); /* every peer's counts are in ep->gathered */
    int32_t* shift = (int32_t*)malloc((size_t)W * (size_t)El * sizeof(int32_t)); /* [W, El] */
    for (int d = 0; shift && d < W; d++) mst_ep_direct_shift(a, ep->gathered, d, shift + (int64_t)d * El);
    const int64_t H = a->cols;
    for (int64_t u = 0; shift && u < a->n_tok * a->top_k; u++) {
        int32_t d;
        const int64_t r = mst_ep_direct_row(a, shift, u, &d);
        if (r < 0) continue;
        mst_ep_t* peer = g->eps[d];
        MST_ASSERT(peer->win_rows && r < peer->cfg.window_rows);
        memcpy(peer->win_rows + r * H, a->tok + (u / a->top_k) * H, (size_t)H * 2);
        if (a->tok_p) peer->win_p[r] = a->tok_p[u];
    }
    const int oom = shift == NULL;
    free(shift);
    MST_TRY(group_wait(g, me)); /* every peer's rows have landed */
    return oom ? mst_set_error(MST_ERR_OOM, "ep direct dispatch (rank %d): shift table", me) : MST_OK;
}

/* ---- point-to-point ---- */

/* Seconds a point-to-point wait may take: MOESTASH_P2P_TIMEOUT_S, else
 * MST_EP_P2P_TIMEOUT_S. */
static int p2p_timeout_s(void) {
    const char* v = getenv("MOESTASH_P2P_TIMEOUT_S");
    const int t = v ? atoi(v) : 0;
    return t > 0 ? t : MST_EP_P2P_TIMEOUT_S;
}

/* Waits on wait_cv until the deadline: 0, or ETIMEDOUT. */
static int timed_wait(mst_ep_group_t* g, const struct timespec* deadline) {
    return pthread_cond_timedwait(&g->wait_cv, &g->wait_mu, deadline);
}

/* Receive o (from o->peer) out of the peer's posted group, under wait_mu:
 * the first send to `me` in it not taken yet. */
static mst_status take_recv(mst_ep_group_t* g, int me, const mst_ep_p2p_op* o, const struct timespec* deadline) {
    for (;;) {
        if (g->left >= 0) return mst_set_error(MST_ERR_STATE, "rank %d: rank %d left the group while this one waited for it", me, g->left);
        const mst_ep_p2p_op* p = g->posted[o->peer];
        for (int i = 0; p && i < g->n_posted[o->peer]; i++) {
            if (p[i].recv || p[i].peer != me || g->taken[o->peer][i]) continue;
            g->taken[o->peer][i] = 1;
            pthread_cond_broadcast(&g->wait_cv);
            if (p[i].bytes != o->bytes)
                return mst_set_error(MST_ERR_STATE, "rank %d: a receive of %zu bytes from rank %d met its send of %zu bytes",
                                     me, o->bytes, o->peer, p[i].bytes);
            memcpy(o->data, p[i].data, o->bytes);
            return MST_OK;
        }
        if (timed_wait(g, deadline) == ETIMEDOUT)
            return mst_set_error(MST_ERR_STATE, "rank %d: no send from rank %d within %d s (the ranks' transfers do not "
                                 "pair: a deadlock on NCCL)", me, o->peer, p2p_timeout_s());
    }
}

/* Posts the group's sends, takes its receives in order, waits until every
 * send was taken, then withdraws the group. */
static mst_status local_sendrecv(mst_ep_t* ep, const mst_ep_p2p_op* ops, int n) {
    mst_ep_group_t* g = ((local_comm*)ep->comm)->group;
    const int me = ep->rank;
    int* taken = (int*)calloc((size_t)n, sizeof *taken); /* [n] */
    if (!taken) return mst_set_error(MST_ERR_OOM, "mst_ep_p2p (rank %d): %d transfers", me, n);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += p2p_timeout_s();
    pthread_mutex_lock(&g->wait_mu);
    g->taken[me] = taken, g->n_posted[me] = n, g->posted[me] = ops;
    pthread_cond_broadcast(&g->wait_cv);
    mst_status st = MST_OK;
    for (int i = 0; i < n && st == MST_OK; i++)
        if (ops[i].recv) st = take_recv(g, me, &ops[i], &deadline);
    for (int i = 0; i < n && st == MST_OK; i++)
        while (st == MST_OK && !ops[i].recv && !taken[i]) {
            if (g->left >= 0)
                st = mst_set_error(MST_ERR_STATE, "rank %d: rank %d left the group while this one waited for it", me, g->left);
            else if (timed_wait(g, &deadline) == ETIMEDOUT)
                st = mst_set_error(MST_ERR_STATE, "rank %d: rank %d took no send within %d s (the ranks' transfers do not "
                                   "pair: a deadlock on NCCL)", me, ops[i].peer, p2p_timeout_s());
        }
    g->posted[me] = NULL, g->n_posted[me] = 0, g->taken[me] = NULL;
    pthread_mutex_unlock(&g->wait_mu);
    free(taken);
    return st;
}

static void local_destroy(mst_ep_t* ep) {
    local_comm* lc = (local_comm*)ep->comm;
    if (!lc) return;
    pthread_mutex_lock(&lc->group->mu);
    lc->group->joined[ep->rank] = 0;
    lc->group->eps[ep->rank] = NULL;
    pthread_mutex_unlock(&lc->group->mu);
    group_leave(lc->group, ep->rank);
    free(lc);
    ep->comm = NULL;
}

const mst_ep_transport mst_ep_transport_local = {
    .name = "local threads (CPU twin)",
    .exchange = local_exchange,
    .destroy = local_destroy,
    .allreduce = local_allreduce,
    .reduce_scatter = local_reduce_scatter,
    .allgather = local_allgather,
    .dispatch_direct = local_dispatch_direct,
    .sendrecv = local_sendrecv,
};

/* Takes `rank` of the group for ep; MST_ERR_INVALID when it is taken. */
static mst_status join(mst_ep_t* ep, mst_ep_group_t* g, int rank) {
    local_comm* lc = (local_comm*)calloc(1, sizeof *lc);
    if (!lc) return mst_set_error(MST_ERR_OOM, "ep local comm");
    pthread_mutex_lock(&g->mu);
    const int taken = g->joined[rank];
    g->joined[rank] = 1;
    if (!taken) g->eps[rank] = ep;
    pthread_mutex_unlock(&g->mu);
    if (taken) {
        free(lc);
        return mst_set_error(MST_ERR_INVALID, "rank = %d: already taken in this group", rank);
    }
    lc->group = g;
    ep->comm = lc;
    ep->tr = &mst_ep_transport_local;
    return MST_OK;
}

mst_status mst_ep_create_local(mst_ctx_t* ctx, const mst_ep_config* cfg, mst_ep_group_t* group,
                               int rank, mst_ep_t** out) {
    MST_TRY(mst_check_ctx(ctx));
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (!group) return mst_set_error(MST_ERR_INVALID, "group is NULL");
    if (ctx->kind != MST_BACKEND_CPU) /* cfg NULL: bare (ep.h) */
        return mst_set_error(MST_ERR_UNSUPPORTED, "mst_ep_create_local: the CPU twin needs a CPU context (got %s); "
                             "CUDA contexts exchange through NCCL (mst_ep_create)", ctx->be->name);
    if (rank < 0 || rank >= group->world)
        return mst_set_error(MST_ERR_INVALID, "rank = %d: must be in [0, %d)", rank, group->world);
    mst_ep_t* ep;
    MST_TRY(mst_ep_alloc(&ep));
    mst_status st = mst_ep_init(ep, ctx, cfg, rank, group->world);
    if (st == MST_OK) st = join(ep, group, rank);
    if (st != MST_OK) {
        mst_ep_destroy(ep);
        return st;
    }
    *out = ep;
    return MST_OK;
}
