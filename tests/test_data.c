/*
 * test_data.c — the token reader (src/trainer/model/data.c, mst_data_file):
 * llm.c `.bin` token files (uint16 and uint32 layouts) and text read back
 * token for token (fresh random tokens, the vocabulary's last id included);
 * each bad file refused with MST_ERR_INVALID and a message naming the flag,
 * the file and the exact offset and value: a .bin without the magic, a wrong
 * version, a header cut short, a count past the file's end or short of it, a
 * negative count, a token not below the vocabulary (in a token file and in
 * text), too few tokens; the batch windows are slices of the tokens.
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/model/model.h"

static char dir[128];

/* Writes a token file: header (magic, version, count) then n tokens of
 * `width` bytes, little-endian, then `extra` stray bytes; n_header: how many
 * header bytes are written (1024: all). Returns the path (static). */
static const char* write_bin(const char* name, int32_t magic, int32_t version, int32_t count, int width,
                             const uint32_t* tok, int64_t n, int extra, int n_header) {
    static char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE* f = fopen(path, "wb");
    unsigned char h[1024] = {0};
    const int32_t head[3] = {magic, version, count};
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < 4; b++) h[4 * i + b] = (unsigned char)((uint32_t)head[i] >> (8 * b));
    fwrite(h, 1, (size_t)n_header, f);
    for (int64_t i = 0; i < n; i++)
        for (int b = 0; b < width; b++) fputc((int)((tok[i] >> (8 * b)) & 0xFF), f);
    for (int i = 0; i < extra; i++) fputc(0x5A, f);
    fclose(f);
    return path;
}

/* Expects path to be refused naming the flag, path and `want`. */
static void refused(const char* path, int64_t vocab, const char* want) {
    mst_data d;
    CHECK_STATUS(mst_data_file(&d, "--eval-data", path, vocab, 4, 1), MST_ERR_INVALID);
    const char* m = mst_last_error();
    CHECK(strstr(m, "--eval-data '") && strstr(m, path) && strstr(m, want), "%s: message '%s', expected '%s'", path, m,
          want);
    CHECK(d.tok == NULL && d.n == 0, "a refused file left tokens");
}

enum { N = 5000 };

static void good_files(mst_rng* r) {
    uint32_t tok[N];
    mst_data d;
    const struct { int32_t magic, version; int width; int64_t vocab; } kinds[] = {{20240520, 1, 2, 50257},
                                                                                 {20240801, 7, 4, 151936}};
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < N; i++) tok[i] = (uint32_t)mst_rng_int(r, 0, kinds[k].vocab - 1);
        tok[17] = (uint32_t)(kinds[k].vocab - 1); /* the last id is in */
        const char* p = write_bin("good.bin", kinds[k].magic, kinds[k].version, N, kinds[k].width, tok, N, 0, 1024);
        CHECK_OK(mst_data_file(&d, "--data", p, kinds[k].vocab, 10, 3));
        int same = d.n == N;
        for (int i = 0; i < N && same; i++) same = d.tok[i] == (int32_t)tok[i];
        CHECK(same, "layout %d: %lld tokens read, not the %d written", k, (long long)d.n, N);
        /* windows: contiguous slices of the tokens, T+2 long */
        int32_t w[3 * 10];
        mst_data_batch(&d, 3, 8, w);
        for (int b = 0; b < 3; b++) {
            int found = 0;
            for (int64_t s = 0; s + 10 <= d.n && !found; s++) found = memcmp(d.tok + s, w + b * 10, sizeof(int32_t) * 10) == 0;
            CHECK(found, "window %d is not a slice of the tokens", b);
        }
        mst_data_free(&d);
    }
    /* text: one token a byte; a byte at or past the vocabulary refused */
    char path[256];
    snprintf(path, sizeof path, "%s/text.txt", dir);
    FILE* f = fopen(path, "wb");
    unsigned char text[N];
    for (int i = 0; i < N; i++) text[i] = (unsigned char)mst_rng_int(r, 0, 255);
    text[0] = 0x00; /* no magic */
    fwrite(text, 1, N, f);
    fclose(f);
    CHECK_OK(mst_data_file(&d, "--data", path, 256, 10, 3));
    int same = d.n == N;
    for (int i = 0; i < N && same; i++) same = d.tok[i] == text[i];
    CHECK(same, "text: %lld tokens, not its %d bytes", (long long)d.n, N);
    mst_data_free(&d);
    int at = 0;
    for (int i = 0; i < N && !at; i++) at = text[i] >= 128 ? i : 0;
    char want[96];
    snprintf(want, sizeof want, "offset %d: token %d is not below the vocabulary (128)", at, text[at]);
    refused(path, 128, want);
}

static void bad_files(mst_rng* r) {
    uint32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = (uint32_t)mst_rng_int(r, 0, 999);
    char want[128];
    refused(write_bin("nomagic.bin", 20240521, 1, N, 2, tok, N, 0, 1024), 1000, "offset 0: magic 20240521");
    refused(write_bin("version.bin", 20240520, 2, N, 2, tok, N, 0, 1024), 1000, "offset 4: version 2, expected 1");
    refused(write_bin("version7.bin", 20240801, 1, N, 4, tok, N, 0, 1024), 1000, "offset 4: version 1, expected 7");
    refused(write_bin("header.bin", 20240520, 1, N, 2, tok, 0, 0, 600), 1000, "offset 600: the file ends inside");
    /* a count past the end: truncated at the file's end */
    snprintf(want, sizeof want, "offset %d: truncated: the header's %d tokens need %d bytes", 1024 + 2 * (N - 1), N,
             1024 + 2 * N);
    refused(write_bin("short.bin", 20240520, 1, N, 2, tok, N - 1, 0, 1024), 1000, want);
    snprintf(want, sizeof want, "offset %d: truncated", 1024 + 2 * (N - 1) + 1); /* half a token at the end */
    refused(write_bin("half.bin", 20240520, 1, N, 2, tok, N - 1, 1, 1024), 1000, want);
    snprintf(want, sizeof want, "offset 8: token count %d does not match the file's size (%d bytes)", N,
             1024 + 2 * N + 1);
    refused(write_bin("long.bin", 20240520, 1, N, 2, tok, N, 1, 1024), 1000, want);
    refused(write_bin("neg.bin", 20240520, 1, -3, 2, tok, 0, 0, 1024), 1000, "offset 8: token count -3 is negative");
    /* a token not below the vocabulary, at its exact offset (the last id passes) */
    const int at = (int)mst_rng_int(r, 100, N - 1);
    tok[at] = 1000;
    tok[at - 50] = 999;
    snprintf(want, sizeof want, "offset %d: token 1000 is not below the vocabulary (1000)", 1024 + 2 * at);
    refused(write_bin("vocab.bin", 20240520, 1, N, 2, tok, N, 0, 1024), 1000, want);
    tok[at] = 70000;
    snprintf(want, sizeof want, "offset %d: token 70000 is not below", 1024 + 4 * at);
    refused(write_bin("vocab32.bin", 20240801, 7, N, 4, tok, N, 0, 1024), 1000, want);
    tok[at] = 5;
    refused(write_bin("few.bin", 20240520, 1, 3, 2, tok, 3, 0, 1024), 1000, "3 tokens, need at least 4");
    mst_data d;
    char missing[256];
    snprintf(missing, sizeof missing, "%s/missing.bin", dir);
    CHECK_STATUS(mst_data_file(&d, "--data", missing, 1000, 4, 1), MST_ERR_IO);
}

static void run(mst_ctx_t* ctx) {
    (void)ctx;
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_data")) {
        CHECK(0, "no temporary directory");
        return;
    }
    mst_rng r = {2024};
    good_files(&r);
    bad_files(&r);
    mst_test_rmtree(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
