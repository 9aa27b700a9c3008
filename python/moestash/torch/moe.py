"""A routed MoE layer's experts on the grouped MLP: the router's top-k
choices in, the tokens' combined output out.

    y = routed_experts(x, top_k_index, top_k_weights, w1, w2, binding)

x [T, H]; top_k_index int64 [T, k] (expert of each choice); top_k_weights
[T, k] (its weight, any float dtype); w1 [E, 2F, H] (the gate's F rows
first, then the up projection's: SwiGLU silu(gate) * up); w2 [E, H, F].

The T*k (token, choice) slots are sorted by expert, stable (expert-major rows,
tokens in order within an expert), the counts per expert summed on the
device (no host sync: capturable); the grouped MLP scales each row by its
choice's weight (fp32) before fc2; the rows go back to slot order and each
token sums its k rows (fp32 accumulation, one rounding: deterministic, no
atomics). The experts run in bf16, the library's dtype: x, w1 and w2 of
another dtype are cast to bf16 for the call (autograd returns their
gradients in their own dtype), bf16 ones are passed as they are (zero copy;
a `main_grad` on them takes their gradient, as in moestash.torch.ops).
"""
import torch

from .ops import grouped_mlp


def expert_order(top_k_index, num_experts):
    """order int64 [T k]: the slot (t * k + s) of each expert-major row;
    counts int32 [E]: rows per expert."""
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts


def routed_experts(x, top_k_index, top_k_weights, w1, w2, binding=None, activation="swiglu"):
    """The combined experts' output [T, H] in x's dtype (see the module doc)."""
    T, H = x.shape
    k = top_k_index.shape[-1]
    order, counts = expert_order(top_k_index, w1.shape[0])
    bf = torch.bfloat16
    rows = x.to(bf)[order // k]  # [T k, H] expert-major
    probs = top_k_weights.reshape(-1)[order].float()  # [T k] fp32
    y = grouped_mlp(rows, w1.to(bf), w2.to(bf), counts, probs, activation, binding=binding)  # [T k, H]
    slots = y.new_empty(y.shape).index_copy(0, order, y)  # [T k, H] in (token, choice) order
    return slots.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)
