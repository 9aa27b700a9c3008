/*
 * data.c — training text: a built-in deterministic synthetic corpus (short
 * English-like sentences from a fixed grammar, seeded), or any text file;
 * batches are B random windows of T+2 bytes (inputs, next tokens for the
 * main loss, tokens after next for the MTP loss).
 */
#include <stdio.h>
#include <string.h>

#include "lib/internal.h"
#include "model.h"

static const char* pick(uint64_t* s, const char* const* w, int n) { return w[mst_splitmix64(s) % (uint64_t)n]; }

#define N_OF(a) ((int)(sizeof(a) / sizeof *(a)))

/* One sentence: "the <adj> <noun> <verb> the <noun> <place>." */
static int sentence(uint64_t* s, char* out, int cap) {
    static const char* const adj[] = {"small", "red", "quiet", "old", "bright", "heavy", "quick", "green"};
    static const char* const noun[] = {"cat", "dog", "bird", "model", "expert", "router", "token", "page"};
    static const char* const verb[] = {"sees", "moves", "stashes", "routes", "keeps", "finds", "reads"};
    static const char* const place[] = {"on the mat", "in the pool", "near the ring", "at the gate",
                                        "under the tree", "by the river"};
    return snprintf(out, (size_t)cap, "the %s %s %s the %s %s. ", pick(s, adj, N_OF(adj)),
                    pick(s, noun, N_OF(noun)), pick(s, verb, N_OF(verb)), pick(s, noun, N_OF(noun)),
                    pick(s, place, N_OF(place)));
}

mst_status mst_data_synthetic(mst_data* d, uint64_t seed, int64_t n_bytes) {
    memset(d, 0, sizeof *d);
    d->bytes = (uint8_t*)malloc((size_t)n_bytes + 128);
    if (!d->bytes) return mst_set_error(MST_ERR_OOM, "synthetic corpus of %lld bytes", (long long)n_bytes);
    uint64_t s = seed ^ 0x5DEECE66Dull;
    while (d->n < n_bytes) d->n += sentence(&s, (char*)d->bytes + d->n, 128);
    d->n = n_bytes;
    d->rng = seed * MST_SPLITMIX_GAMMA + 7;
    return MST_OK;
}

mst_status mst_data_file(mst_data* d, const char* path, int64_t min_bytes, uint64_t seed) {
    memset(d, 0, sizeof *d);
    FILE* f = fopen(path, "rb");
    if (!f) return mst_set_error(MST_ERR_IO, "--data '%s': cannot open", path);
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return mst_set_error(MST_ERR_IO, "--data '%s': not a regular file", path);
    }
    if (n < min_bytes) {
        fclose(f);
        return mst_set_error(MST_ERR_INVALID, "--data '%s': %ld bytes, need at least %lld (--seq + 2)",
                             path, n, (long long)min_bytes);
    }
    d->bytes = (uint8_t*)malloc((size_t)n);
    if (!d->bytes) {
        fclose(f);
        return mst_set_error(MST_ERR_OOM, "--data '%s': %ld bytes", path, n);
    }
    size_t got = fread(d->bytes, 1, (size_t)n, f);
    fclose(f);
    if (got != (size_t)n) {
        mst_data_free(d);
        return mst_set_error(MST_ERR_IO, "--data '%s': read %zu of %ld bytes", path, got, n);
    }
    d->n = n;
    d->rng = seed * MST_SPLITMIX_GAMMA + 7;
    return MST_OK;
}

void mst_data_batch(mst_data* d, int64_t batch, int64_t seq, int32_t* tok) {
    const int64_t w = seq + 2, span = d->n - w + 1;
    for (int64_t b = 0; b < batch; b++) {
        int64_t start = (int64_t)(mst_splitmix64(&d->rng) % (uint64_t)span);
        for (int64_t i = 0; i < w; i++) tok[b * w + i] = d->bytes[start + i];
    }
}

void mst_data_free(mst_data* d) {
    free(d->bytes);
    d->bytes = NULL;
    d->n = 0;
}

mst_status mst_data_split(mst_data* d, double fraction, int64_t w, mst_data* eval) {
    memset(eval, 0, sizeof *eval);
    if (!(fraction > 0 && fraction < 1))
        return mst_set_error(MST_ERR_INVALID, "--eval-fraction %g: expected a number between 0 and 1", fraction);
    const int64_t tail = (int64_t)((double)d->n * fraction), head = d->n - tail;
    if (tail < w || head < w)
        return mst_set_error(MST_ERR_INVALID, "--eval-fraction %g: %lld of %lld bytes held out, each side needs %lld",
                             fraction, (long long)tail, (long long)d->n, (long long)w);
    eval->bytes = (uint8_t*)malloc((size_t)tail);
    if (!eval->bytes) return mst_set_error(MST_ERR_OOM, "eval text of %lld bytes", (long long)tail);
    memcpy(eval->bytes, d->bytes + head, (size_t)tail);
    eval->n = tail;
    eval->rng = d->rng ^ 0xE7A1E7A1E7A1E7A1ull;
    d->n = head;
    return MST_OK;
}
