/*
 * sample.h — tokens from a Hugging Face Qwen3-MoE model directory (the
 * directories `moestash train --save` writes, or transformers'
 * save_pretrained; read through trainer/io/hf.h): the model's main path run
 * one token at a time on the host in fp32 (weights converted to fp32 from
 * the file's dtype), with a KV cache per layer, and a seeded picker
 * (temperature, top-k). The MTP module is not used for sampling.
 *
 * The forward is transformers' Qwen3MoeForCausalLM in fp32: embedding; per
 * layer RMSNorm, q/k/v projections, per-head RMSNorm of q and k (QK-norm)
 * then rotary embedding (rotate-half pairs (i, i + D/2), frequencies
 * theta^(-2i/D) and their angles in fp32), causal attention of query head h
 * over key-value head h / (NH / KV), o_proj, residual; RMSNorm, the router
 * (softmax over E, top-k, renormalised when norm_topk_prob), each chosen
 * expert's SwiGLU MLP scaled by its weight, residual; final norm; lm_head
 * (the embedding when tied). The cache holds each position's k after
 * QK-norm and RoPE and its v, per key-value head: [max_tokens, KV D].
 */
#ifndef MST_SAMPLE_H
#define MST_SAMPLE_H

#include "trainer/model/model.h"

typedef struct mst_sampler mst_sampler;

/* Loads dir's config.json and the weights of its "model" file set;
 * max_tokens: KV cache length (prompt + generated). MST_ERR_INVALID naming
 * the file: not a qwen3_moe directory, a tensor missing or of another shape. */
mst_status mst_sampler_create(const char* dir, int64_t max_tokens, mst_sampler** out);
void mst_sampler_destroy(mst_sampler* s);
const mst_model_config* mst_sampler_config(const mst_sampler* s);

/* Feeds one token at the next position; logits [V] of the token after it
 * (NULL: not needed). MST_ERR_INVALID past max_tokens or for a token
 * outside [0, V). */
mst_status mst_sampler_feed(mst_sampler* s, int32_t token, float* logits);

/* Picks a token from logits [V]: argmax (the lowest index of the largest)
 * when temperature <= 0, else from softmax(logits / temperature) restricted
 * to the top_k largest (0: all; ties at the cut all stay), with the
 * generator state *rng. */
int32_t mst_sampler_pick(const float* logits, int64_t vocab, float temperature, int32_t top_k, uint64_t* rng);

#endif
