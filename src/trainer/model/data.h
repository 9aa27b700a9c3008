/*
 * data.h — the trainer's token data (data.c): the built-in synthetic corpus,
 * token files and text, random windows, the held-out split.
 */
#ifndef MST_DATA_H
#define MST_DATA_H

#include <stdint.h>

#include "lib/internal.h"

/* Token files: the llm.c / nanoGPT `.bin` layout. A header of 256 int32
 * little-endian values: [0] magic, [1] version, [2] token count n; the rest
 * zero. Then n tokens, little-endian: magic 20240520 version 1 (GPT-2):
 * uint16; magic 20240801 version 7 (Llama-3): uint32. The file is exactly
 * 1024 + n * width bytes. */
#define MST_DATA_MAGIC 20240520
#define MST_DATA_HEADER_BYTES 1024

typedef struct mst_data {
    int32_t* tok;            /* [n] token ids, each in [0, V)                 */
    int64_t n;
    uint64_t rng;            /* window sampler state                          */
} mst_data;
/* The built-in synthetic corpus (deterministic in seed, byte tokens). */
mst_status mst_data_synthetic(mst_data* d, uint64_t seed, int64_t n_bytes);
/* Reads path: a token file when it starts with a known magic (above), else
 * text, one token a byte (a name ending in .bin must be a token file).
 * Refused (MST_ERR_INVALID, the message naming flag, path and the offending
 * byte offset and value): a header whose version or count does not match its
 * magic and the file's size, a file that ends early, a token not below
 * vocab, fewer than min_tokens tokens. MST_ERR_IO: the file cannot be read. */
mst_status mst_data_file(mst_data* d, const char* flag, const char* path, int64_t vocab, int64_t min_tokens,
                         uint64_t seed);
/* Fills tok [B, T+2] with B random windows. */
void mst_data_batch(mst_data* d, int64_t batch, int64_t seq, int32_t* tok);
void mst_data_free(mst_data* d);
/* Holds out the last `fraction` of d's tokens (0 < fraction < 1) as eval:
 * d keeps the head (its windows never reach the tail), eval gets a copy of
 * the tail with its own sampler. Both need room for one window of w tokens. */
mst_status mst_data_split(mst_data* d, double fraction, int64_t w, mst_data* eval);

#endif
