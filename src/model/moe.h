/*
 * moe.h — the MoE block and the transformer layer around it (layer.c).
 */
#ifndef MST_MOE_H
#define MST_MOE_H

#include "model.h"

/* y [N, H] = MoE(acts[l].b); the plan and saved activations go in acts[l]. */
mst_status mst_moe_forward(mst_model* m, int32_t l, uint16_t* y);
/* dy [N, H] -> dx [N, H] (d of acts[l].b); weight gradients accumulate. */
mst_status mst_moe_backward(mst_model* m, int32_t l, const uint16_t* dy, uint16_t* dx);

/* Layer l: out = in + attn(norm1(in)), then out += MoE(norm2(out)). */
mst_status mst_layer_forward(mst_model* m, int32_t l, const uint16_t* in);
/* d [N, H]: in, d(out); out, d(in). Uses m->t1, m->t2, m->dqkv. */
mst_status mst_layer_backward(mst_model* m, int32_t l, uint16_t* d);

#endif
