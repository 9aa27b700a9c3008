/*
 * sample.h — text from a trained checkpoint: the model's main path (embedding,
 * the L transformer layers with their MoE blocks, final norm, tied head) run
 * one token at a time on the host in fp32 from the checkpoint's bf16
 * weights, with a KV cache per layer, and a seeded sampler (temperature,
 * top-k). The MTP module is not used for sampling.
 *
 * The math is the training forward's (src/trainer/model/layer.c, moe.c) without its
 * bf16 rounding of activations: per-token losses agree with the trainer's
 * within bf16 tolerance (tests/test_sample.c).
 */
#ifndef MST_SAMPLE_H
#define MST_SAMPLE_H

#include "checkpoint.h"

typedef struct mst_sampler mst_sampler;

/* Loads dir's configuration and bf16 weights; max_tokens: KV cache length
 * (prompt + generated). */
mst_status mst_sampler_create(const char* dir, int64_t max_tokens, mst_sampler** out);
void mst_sampler_destroy(mst_sampler* s);
const mst_model_config* mst_sampler_config(const mst_sampler* s);

/* Feeds one token at the next position; logits [V] of the token after it
 * (NULL: not needed). MST_ERR_INVALID past max_tokens or for a token
 * outside [0, V). */
mst_status mst_sampler_feed(mst_sampler* s, int32_t token, float* logits);

/* Picks a token from logits [V]: argmax when temperature <= 0, else from
 * softmax(logits / temperature) restricted to the top_k largest (0: all),
 * with the generator state *rng. */
int32_t mst_sampler_pick(const float* logits, int64_t vocab, float temperature, int32_t top_k, uint64_t* rng);

#endif
