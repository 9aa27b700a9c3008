/*
 * ep_hello.c — `moestash ep-hello [--gpus N] [--backend cpu|cuda] [--rounds N]`
 * (hidden): the launch path of `train --gpus N` without the trainer, for
 * tests and for checking a machine. Each rank prints who it is (rank, world,
 * local rank, pid), meets the others at the rendezvous, and
 *   cpu:  prints a hash of the id it got (all ranks print the same);
 *   cuda: takes device LOCAL_RANK, builds the NCCL communicator and checks a
 *         dispatch and combine of random routing (identity experts: every
 *         token comes back as bf16(k x), bit for bit); rank 0 prints the path.
 * --rounds N keeps the ranks busy (cuda: N checked dispatch + combine
 * rounds, the same count on every rank: a rank that stopped on its own clock
 * would leave the others waiting in a collective; cpu: N naps of 10 ms), so
 * a test can kill one mid-run. Runs
 * under `--gpus N` (this program starts the ranks) or any launcher that sets
 * RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lib/internal.h"
#include "args.h"
#include "cli.h"
#include "launch.h"

static const char* const CMD = "moestash ep-hello";

typedef struct hello {
    mst_launch l;
    mst_backend_kind kind;
    int32_t gpus, rounds;
} hello;

static uint64_t fnv(const void* p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char*)p)[i]) * 1099511628211ull;
    return h;
}

static int fail(const hello* h, const char* what) {
    fprintf(stderr, "%s: %s: %s\n", h->l.who, what, mst_last_error());
    return 1;
}

/* cpu: the rendezvous alone (rank 0's id: bytes of its time and pid). */
static int run_cpu(hello* h) {
    mst_ep_id id;
    memset(&id, 0, sizeof id);
    if (h->l.rank == 0) {
        const uint64_t seed[2] = {(uint64_t)mst_clock_s() * 1000003u, (uint64_t)getpid()};
        for (size_t i = 0; i < sizeof id.bytes; i++) id.bytes[i] = (char)(fnv(seed, sizeof seed) >> (i % 8 * 8)) + (char)i;
    }
    if (h->l.world > 1 && mst_ep_id_share(&id, h->l.rank, h->l.world, h->l.addr, h->l.port, h->l.timeout_ms) != MST_OK)
        return fail(h, "rendezvous");
    mst_launch_fail_point(&h->l, "run");
    printf("rank %d: id %016llx\n", h->l.rank, (unsigned long long)fnv(id.bytes, sizeof id.bytes));
    const struct timespec nap = {0, 10 * 1000 * 1000};
    for (int32_t i = 1; i < h->rounds; i++) nanosleep(&nap, NULL);
    return 0;
}

enum { N_TOK = 512, HID = 256, TOPK = 2, EXPERTS_PER_RANK = 4 };

typedef struct ep_check {
    mst_ctx_t* ctx;
    mst_ep_t* ep;
    mst_ep_handle_t* h;
    void *x, *idx, *rows, *counts, *y; /* backend memory                     */
    uint16_t hx[N_TOK * HID], hy[N_TOK * HID];
    int32_t hidx[N_TOK * TOPK];
    uint64_t seed;
} ep_check;

static uint64_t next(uint64_t* s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 17;
}

/* New random tokens and routing (TOPK distinct experts per token), one
 * dispatch and combine, the check: 0, or 1 after the line. */
static int exchange_once(const hello* he, ep_check* c) {
    const int32_t E = EXPERTS_PER_RANK * he->l.world;
    const int64_t R = (int64_t)N_TOK * TOPK * he->l.world; /* every token may come here */
    for (int i = 0; i < N_TOK * HID; i++) c->hx[i] = mst_fp32_to_bf16((float)(next(&c->seed) % 2001) / 1000.0f - 1.0f);
    for (int t = 0; t < N_TOK; t++) {
        const int32_t a = (int32_t)(next(&c->seed) % (uint64_t)E), b = (int32_t)(next(&c->seed) % (uint64_t)(E - 1));
        c->hidx[t * TOPK] = a, c->hidx[t * TOPK + 1] = b >= a ? b + 1 : b;
    }
    memset(c->hy, 0xff, sizeof c->hy); /* poisoned */
    mst_tensor x = mst_tensor_make(c->x, MST_DTYPE_BF16, N_TOK, HID), y = mst_tensor_make(c->y, MST_DTYPE_BF16, N_TOK, HID);
    mst_tensor idx = mst_tensor_make(c->idx, MST_DTYPE_INT32, N_TOK, TOPK);
    mst_tensor rows = mst_tensor_make(c->rows, MST_DTYPE_BF16, R, HID);
    mst_tensor counts = mst_tensor_make(c->counts, MST_DTYPE_INT32, EXPERTS_PER_RANK, 1);
    mst_status st = mst_copy_h2b(c->ctx, c->x, c->hx, sizeof c->hx);
    if (st == MST_OK) st = mst_copy_h2b(c->ctx, c->idx, c->hidx, sizeof c->hidx);
    if (st == MST_OK) st = mst_ep_dispatch(c->ep, c->h, &x, &idx, NULL, &rows, NULL, &counts);
    if (st == MST_OK) st = mst_ep_combine(c->ep, c->h, &rows, NULL, &y);
    if (st == MST_OK) st = mst_ctx_check(c->ctx);
    if (st == MST_OK) st = mst_copy_b2h(c->ctx, c->hy, c->y, sizeof c->hy);
    if (st != MST_OK) return fail(he, "dispatch and combine");
    for (int i = 0; i < N_TOK * HID; i++)
        if (c->hy[i] != mst_fp32_to_bf16(TOPK * mst_bf16_to_fp32(c->hx[i]))) {
            fprintf(stderr, "%s: combine of the dispatched rows differs at token %d, column %d\n", he->l.who, i / HID,
                    i % HID);
            return 1;
        }
    return 0;
}

static int run_cuda(hello* he) {
    ep_check* c = calloc(1, sizeof *c);
    c->seed = 1234567u + (uint64_t)he->l.rank;
    const int64_t R = (int64_t)N_TOK * TOPK * he->l.world;
    mst_ep_config cfg = {.struct_size = sizeof(mst_ep_config), .n_experts = EXPERTS_PER_RANK * he->l.world, .top_k = TOPK, .hidden = HID,
                         .max_tokens = N_TOK, .max_rows = R};
    int rc = 1;
    if (mst_ctx_create(MST_BACKEND_CUDA, he->l.local_rank, &c->ctx) != MST_OK) fail(he, "device LOCAL_RANK");
    else if (mst_launch_ep(&he->l, c->ctx, &cfg, &c->ep) != MST_OK) fail(he, "communicator");
    else if (mst_ep_handle_create(c->ep, &c->h) != MST_OK || mst_alloc(c->ctx, sizeof c->hx, &c->x) != MST_OK ||
             mst_alloc(c->ctx, sizeof c->hidx, &c->idx) != MST_OK ||
             mst_alloc(c->ctx, (size_t)R * HID * 2, &c->rows) != MST_OK ||
             mst_alloc(c->ctx, EXPERTS_PER_RANK * sizeof(int32_t), &c->counts) != MST_OK ||
             mst_alloc(c->ctx, sizeof c->hy, &c->y) != MST_OK)
        fail(he, "buffers");
    else {
        mst_launch_fail_point(&he->l, "run");
        rc = 0;
        for (int32_t i = 0; i < he->rounds && rc == 0; i++) rc = exchange_once(he, c);
        if (rc == 0 && he->l.rank == 0)
            printf("ep-hello: %d ranks, %s: %d dispatch + combine of %d tokens checked\n", he->l.world,
                   mst_ep_path(c->ep), he->rounds, N_TOK);
    }
    if (c->ctx) {
        mst_free(c->ctx, c->x), mst_free(c->ctx, c->idx), mst_free(c->ctx, c->rows);
        mst_free(c->ctx, c->counts), mst_free(c->ctx, c->y);
    }
    mst_ep_handle_destroy(c->h);
    mst_ep_destroy(c->ep);
    mst_ctx_destroy(c->ctx);
    free(c);
    return rc;
}

int mst_cmd_ep_hello(int argc, char** argv) {
    hello he = {.kind = mst_default_backend(), .rounds = 1};
    mst_args a;
    mst_args_init(&a, CMD, argc, argv);
    while (mst_args_next(&a)) {
        int rc;
        if (mst_args_is(&a, "--gpus")) rc = mst_args_int32(&a, 1, 65536, &he.gpus);
        else if (mst_args_is(&a, "--backend")) rc = mst_args_backend(&a, &he.kind);
        else if (mst_args_is(&a, "--rounds")) rc = mst_args_int32(&a, 1, 100000000, &he.rounds);
        else if (mst_args_is(&a, "--help") || mst_args_is(&a, "-h")) {
            printf("usage: moestash ep-hello [--gpus N] [--backend cpu|cuda] [--rounds N]\n"
                   "  the launch of train --gpus N without the trainer: rendezvous and (cuda) a checked\n"
                   "  dispatch + combine on every rank; --rounds N: N of them (cpu: N naps of 10 ms)\n");
            return 0;
        } else rc = mst_args_unknown(&a);
        if (rc) return rc;
    }
    if (mst_launch_env(CMD, &he.l)) return 2;
    if (he.gpus > 1 && !he.l.launched) {
        if (he.kind == MST_BACKEND_CUDA && mst_launch_check_devices(CMD, he.gpus)) return 2;
        return mst_launch_spawn(CMD, "ep-hello", he.gpus, argc, argv);
    }
    if (he.gpus && mst_launch_check_gpus(&he.l, he.gpus)) return 2;
    printf("rank %d of %d: local rank %d, pid %d\n", he.l.rank, he.l.world, he.l.local_rank, (int)getpid());
    mst_launch_fail_point(&he.l, "start");
    return he.kind == MST_BACKEND_CUDA ? run_cuda(&he) : run_cpu(&he);
}
