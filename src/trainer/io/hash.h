/*
 * hash.h — FNV-1a and the weights hash of a model (the runs' weights hash,
 * the checkpoints' data hashes).
 */
#ifndef MST_HASH_H
#define MST_HASH_H

#include "trainer/model/model.h"

/* FNV-1a over 8-byte words (the tail bytes one by one), continuing from h
 * (MST_FNV1A_SEED to start). */
#define MST_FNV1A_SEED 0xCBF29CE484222325ull
uint64_t mst_fnv1a(uint64_t h, const void* p, size_t n);

/* Every parameter's hash (fp32 master, then bf16 weights) in *all; the
 * replicated ones' (all but the experts on W ranks: the same bits on every
 * rank) in *replicated. */
mst_status mst_weights_hash(mst_model* m, uint64_t* all, uint64_t* replicated);

#endif
