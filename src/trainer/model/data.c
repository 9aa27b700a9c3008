/*
 * data.c — training tokens: a built-in deterministic synthetic corpus (short
 * English-like sentences from a fixed grammar, seeded, one token a byte), a
 * text file (one token a byte), or a pre-tokenized file in the llm.c /
 * nanoGPT `.bin` layout (data.h, mst_data_file); batches are B random
 * windows of T+2 tokens (inputs, next tokens for the main loss, tokens after
 * next for the MTP loss).
 */
#include <stdio.h>
#include <string.h>

#include "lib/internal.h"
#include "data.h"

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

static uint64_t sampler_seed(uint64_t seed) { return seed * MST_SPLITMIX_GAMMA + 7; }

mst_status mst_data_synthetic(mst_data* d, uint64_t seed, int64_t n_bytes) {
    memset(d, 0, sizeof *d);
    char* text = (char*)malloc((size_t)n_bytes + 128);
    d->tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)n_bytes);
    if (!text || !d->tok) {
        free(text);
        mst_data_free(d);
        return mst_set_error(MST_ERR_OOM, "synthetic corpus of %lld bytes", (long long)n_bytes);
    }
    uint64_t s = seed ^ 0x5DEECE66Dull;
    for (int64_t n = 0; n < n_bytes;) n += sentence(&s, text + n, 128);
    for (int64_t i = 0; i < n_bytes; i++) d->tok[i] = (unsigned char)text[i];
    free(text);
    d->n = n_bytes;
    d->rng = sampler_seed(seed);
    return MST_OK;
}

/* ---- files ----------------------------------------------------------------- */

/* The token file layouts: llm.c's GPT-2 (uint16 tokens) and Llama-3 (uint32). */
static const struct { int32_t magic, version, width; } layouts[] = {{MST_DATA_MAGIC, 1, 2}, {20240801, 7, 4}};

typedef struct src {
    const char *flag, *path;
    FILE* f;
    int64_t size;  /* file bytes                                  */
    int64_t vocab; /* V: every token below it                     */
} src;

static mst_status bad(const src* s, int64_t offset, const char* fmt, long long v, long long w) {
    char why[192];
    snprintf(why, sizeof why, fmt, v, w);
    return mst_set_error(MST_ERR_INVALID, "%s '%s': offset %lld: %s", s->flag, s->path, (long long)offset, why);
}

/* Reads n tokens of `width` bytes (1, 2, 4; little-endian) from the file's
 * position `first` into tok [n], each checked against the vocabulary. */
static mst_status read_tokens(const src* s, int64_t first, int width, int64_t n, int32_t* tok) {
    enum { CHUNK = 1 << 16 };
    unsigned char* buf = (unsigned char*)malloc((size_t)CHUNK * (size_t)width);
    if (!buf) return mst_set_error(MST_ERR_OOM, "%s '%s': read buffer", s->flag, s->path);
    mst_status st = MST_OK;
    for (int64_t i = 0; i < n && st == MST_OK; i += CHUNK) {
        const int64_t c = n - i < CHUNK ? n - i : CHUNK;
        const size_t got = fread(buf, (size_t)width, (size_t)c, s->f);
        if ((int64_t)got != c) {
            st = bad(s, first + (i + (int64_t)got) * width, "the file ends there: read %lld of %lld tokens",
                     (long long)(i + (int64_t)got), (long long)n);
            break;
        }
        for (int64_t j = 0; j < c; j++) {
            const unsigned char* b = buf + j * width;
            uint32_t v = b[0];
            if (width > 1) v |= (uint32_t)b[1] << 8;
            if (width > 2) v |= (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
            if ((int64_t)v >= s->vocab) {
                st = bad(s, first + (i + j) * width, "token %lld is not below the vocabulary (%lld)", (long long)v,
                         (long long)s->vocab);
                break;
            }
            tok[i + j] = (int32_t)v;
        }
    }
    free(buf);
    return st;
}

static int32_t le32(const unsigned char* b) {
    return (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24);
}

static int ends_with(const char* s, const char* tail) {
    const size_t n = strlen(s), k = strlen(tail);
    return n >= k && strcmp(s + n - k, tail) == 0;
}

/* The file's layout: *width bytes a token (1: text), *first the offset of the
 * first token, *n the token count; the header checked. */
static mst_status layout(const src* s, int* width, int64_t* first, int64_t* n) {
    unsigned char h[MST_DATA_HEADER_BYTES];
    const size_t got = fread(h, 1, sizeof h, s->f);
    const int32_t magic = got >= 4 ? le32(h) : 0;
    int k = -1;
    for (int i = 0; i < N_OF(layouts); i++)
        if (magic == layouts[i].magic) k = i;
    if (k < 0) {
        if (ends_with(s->path, ".bin"))
            return bad(s, 0, "magic %lld: a .bin token file starts with %lld (llm.c layout)", got >= 4 ? magic : -1,
                       MST_DATA_MAGIC);
        *width = 1, *first = 0, *n = s->size; /* text: one token a byte */
        return fseek(s->f, 0, SEEK_SET) == 0 ? MST_OK : mst_set_error(MST_ERR_IO, "%s '%s': cannot seek", s->flag, s->path);
    }
    if (got < sizeof h)
        return bad(s, (int64_t)got, "the file ends inside the %lld-byte header (%lld bytes)", MST_DATA_HEADER_BYTES,
                   (long long)got);
    if (le32(h + 4) != layouts[k].version)
        return bad(s, 4, "version %lld, expected %lld for this magic", le32(h + 4), layouts[k].version);
    const int64_t count = le32(h + 8), want = MST_DATA_HEADER_BYTES + count * layouts[k].width;
    if (count < 0) return bad(s, 8, "token count %lld is negative", (long long)count, 0);
    if (s->size < want)
        return bad(s, s->size, "truncated: the header's %lld tokens need %lld bytes", (long long)count, (long long)want);
    if (s->size > want)
        return bad(s, 8, "token count %lld does not match the file's size (%lld bytes)", (long long)count,
                   (long long)s->size);
    *width = layouts[k].width, *first = MST_DATA_HEADER_BYTES, *n = count;
    return MST_OK;
}

static mst_status open_src(src* s) {
    s->f = fopen(s->path, "rb");
    if (!s->f) return mst_set_error(MST_ERR_IO, "%s '%s': cannot open", s->flag, s->path);
    long n = -1;
    if (fseek(s->f, 0, SEEK_END) == 0) n = ftell(s->f);
    if (n < 0 || fseek(s->f, 0, SEEK_SET) != 0) return mst_set_error(MST_ERR_IO, "%s '%s': not a regular file", s->flag, s->path);
    s->size = n;
    return MST_OK;
}

mst_status mst_data_file(mst_data* d, const char* flag, const char* path, int64_t vocab, int64_t min_tokens,
                         uint64_t seed) {
    memset(d, 0, sizeof *d);
    src s = {flag, path, NULL, 0, vocab};
    int width = 1;
    int64_t first = 0, n = 0;
    mst_status st = open_src(&s);
    if (st == MST_OK) st = layout(&s, &width, &first, &n);
    if (st == MST_OK && n < min_tokens)
        st = mst_set_error(MST_ERR_INVALID, "%s '%s': %lld tokens, need at least %lld (one window)", flag, path,
                           (long long)n, (long long)min_tokens);
    if (st == MST_OK && !(d->tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)n)))
        st = mst_set_error(MST_ERR_OOM, "%s '%s': %lld tokens", flag, path, (long long)n);
    if (st == MST_OK) st = read_tokens(&s, first, width, n, d->tok);
    if (s.f) fclose(s.f);
    if (st != MST_OK) {
        mst_data_free(d);
        return st;
    }
    d->n = n;
    d->rng = sampler_seed(seed);
    return MST_OK;
}

/* ---- batches ------------------------------------------------------------------ */

void mst_data_batch(mst_data* d, int64_t batch, int64_t seq, int32_t* tok) {
    const int64_t w = seq + 2, span = d->n - w + 1;
    for (int64_t b = 0; b < batch; b++) {
        int64_t start = (int64_t)(mst_splitmix64(&d->rng) % (uint64_t)span);
        memcpy(tok + b * w, d->tok + start, sizeof(int32_t) * (size_t)w);
    }
}

void mst_data_free(mst_data* d) {
    free(d->tok);
    d->tok = NULL;
    d->n = 0;
}

mst_status mst_data_split(mst_data* d, double fraction, int64_t w, mst_data* eval) {
    memset(eval, 0, sizeof *eval);
    if (!(fraction > 0 && fraction < 1))
        return mst_set_error(MST_ERR_INVALID, "--eval-fraction %g: expected a number between 0 and 1", fraction);
    const int64_t tail = (int64_t)((double)d->n * fraction), head = d->n - tail;
    if (tail < w || head < w)
        return mst_set_error(MST_ERR_INVALID, "--eval-fraction %g: %lld of %lld tokens held out, each side needs %lld",
                             fraction, (long long)tail, (long long)d->n, (long long)w);
    eval->tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)tail);
    if (!eval->tok) return mst_set_error(MST_ERR_OOM, "eval tokens (%lld)", (long long)tail);
    memcpy(eval->tok, d->tok + head, sizeof(int32_t) * (size_t)tail);
    eval->n = tail;
    eval->rng = d->rng ^ 0xE7A1E7A1E7A1E7A1ull;
    d->n = head;
    return MST_OK;
}
