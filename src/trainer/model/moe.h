/*
 * moe.h — the MoE block (moe.c) and the transformer layer around it
 * (layer.c), forward and backward for one (microbatch, layer).
 */
#ifndef MST_MOE_H
#define MST_MOE_H

#include "model.h"

/* y [N, H] = MoE(a->b); the plan goes into a, the grouped MLP's saved
 * activations through `saver` (from the memory manager). */
mst_status mst_moe_forward(mst_model* m, int32_t l, mst_layer_acts* a, const mst_saver* saver, uint16_t* y);
/* dy [N, H] -> dx [N, H] (d of a->b); weight gradients accumulate. */
mst_status mst_moe_backward(mst_model* m, int32_t l, mst_layer_acts* a, const mst_saver* saver,
                            const uint16_t* dy, uint16_t* dx);

/* Layer l: x1 = in + attn(norm1(in)); out = x1 + MoE(norm2(x1)). */
mst_status mst_layer_forward(mst_model* m, int32_t l, mst_layer_acts* a, const uint16_t* in,
                             const mst_saver* saver);
/* d [N, H]: in, d(out); out, d(in). Uses m->t1, m->t2, m->dqkv. */
mst_status mst_layer_backward(mst_model* m, int32_t l, mst_layer_acts* a, const mst_saver* saver, uint16_t* d);

#endif
