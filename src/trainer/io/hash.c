/*
 * hash.c — FNV-1a over 8-byte words, and the hash of a model's weights (fp32
 * master then bf16 copy): the runs' weights hash, the checkpoints' data hashes.
 */
#include <stdlib.h>
#include <string.h>

#include "hash.h"

/* Over 8-byte words: a hash of weights of billions of bytes in seconds. */
uint64_t mst_fnv1a(uint64_t h, const void* p, size_t n) {
    const unsigned char* b = (const unsigned char*)p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001B3ull;
    }
    for (; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}

/* The hash of parameters [lo, hi): fp32 master (from master [n_params],
 * host), then bf16 weights, continuing from *x. */
static mst_status hash_params(mst_model* m, const float* master, int64_t lo, int64_t hi, uint64_t* x) {
    const size_t n = (size_t)(hi - lo);
    void* h = malloc(n * sizeof(uint16_t) + 1);
    if (!h) return mst_set_error(MST_ERR_OOM, "weights readback");
    *x = mst_fnv1a(*x, master + lo, n * sizeof(float));
    mst_status st = mst_copy_b2h(m->ctx, h, m->w + lo, n * sizeof(uint16_t));
    if (st == MST_OK) *x = mst_fnv1a(*x, h, n * sizeof(uint16_t));
    free(h);
    return st;
}

/* Every parameter's hash; and the replicated ones' (all but the experts on
 * W ranks: the same bits on every rank). The master weights gathered from
 * their shards (collective on W ranks): the same hash sharded or not. */
mst_status mst_weights_hash(mst_model* m, uint64_t* out, uint64_t* replicated) {
    *out = *replicated = MST_FNV1A_SEED;
    const size_t n_runs = m->opt_shard ? (size_t)(m->rep[0].n + m->rep[1].n) : 0;
    float* master = (float*)malloc(sizeof(float) * (size_t)m->n_params + 1); /* [n_params] */
    float* runs = (float*)malloc(sizeof(float) * n_runs + 1);                /* sharded: the replicated runs' */
    mst_status st = master && runs ? mst_optim_gather_runs(m, 0, runs) : mst_set_error(MST_ERR_OOM, "weights readback");
    if (st == MST_OK) st = mst_optim_state_get(m, 0, 0, m->n_params, runs, master);
    if (st == MST_OK) st = hash_params(m, master, 0, m->n_params, out);
    if (st == MST_OK) st = hash_params(m, master, 0, m->n_dense, replicated);
    if (st == MST_OK) st = hash_params(m, master, m->n_decay, m->n_params, replicated);
    free(master);
    free(runs);
    return st;
}
