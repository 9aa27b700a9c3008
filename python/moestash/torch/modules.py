"""Modules over the ops: GroupedLinear and GroupedMLP (experts' weights in one
parameter each, [E, out, in], bf16 by default).

    mlp = GroupedMLP(num_experts=64, hidden=4096, ffn=1024,
                     policy={"fc1_input": "stash", "act_input": "stash",
                             "fc2_input": "recompute"},
                     stash_manager=manager)
    y = mlp(x, counts, probs)     # x [R, H] expert-major rows, counts int32 [E] on the device

`policy`: one policy for every saved tensor ("keep", "stash", "offload") or
a dict / "name=policy,..." string; stash and offload need a StashManager
(moestash.torch.StashManager) whose step_begin() / step_check() the training
loop calls once per step. delay_wgrad_compute: the wgrads wait for
backward_dw() (the weights need main_grad then).
"""
import math

import torch

from .ops import Binding, grouped_linear, grouped_mlp


def _experts_param(E, out_f, in_f, device, dtype):
    """[E, out_f, in_f], each expert as nn.Linear initializes its weight,
    drawn on the CPU from torch's default generator, then moved: the same
    weights on every device for one torch.manual_seed, and no use of a CUDA
    generator (whose state a failed graph capture leaves broken)."""
    w = torch.empty(E, out_f, in_f, dtype=torch.float32)
    bound = 1 / math.sqrt(in_f)
    torch.nn.init.uniform_(w, -bound, bound)
    return torch.nn.Parameter(w.to(device=device, dtype=dtype))


def _bias_param(E, out_f, device, dtype):
    return torch.nn.Parameter(torch.zeros(E, out_f, device=device, dtype=dtype))


class GroupedLinear(torch.nn.Module):
    """y[r] = x[r] W[g]^T (+ bias[g] * row_scale[r]) for the rows of group g."""

    def __init__(self, num_groups, in_features, out_features, bias=False, delay_wgrad_compute=False,
                 device=None, dtype=torch.bfloat16):
        super().__init__()
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.weight = _experts_param(num_groups, out_features, in_features, device, dtype)
        self.bias = _bias_param(num_groups, out_features, device, dtype) if bias else None
        self.binding = Binding(delay_wgrad=delay_wgrad_compute)

    def forward(self, x, counts, row_scale=None):
        return grouped_linear(x, self.weight, counts, self.bias, row_scale, binding=self.binding)

    def backward_dw(self):
        """Runs the wgrads deferred by the last backward (delay_wgrad_compute)."""
        self.binding.backward_dw()


class GroupedMLP(torch.nn.Module):
    """fc1 (H -> 2F) -> gated activation * probs -> fc2 (F -> H), per expert."""

    def __init__(self, num_experts, hidden, ffn, activation="swiglu", bias=False, policy="keep",
                 stash_manager=None, clamp_limit=7.0, clamp_alpha=1.702, delay_wgrad_compute=False,
                 device=None, dtype=torch.bfloat16):
        super().__init__()
        self.num_experts, self.hidden, self.ffn, self.activation = num_experts, hidden, ffn, activation
        self.clamp_limit, self.clamp_alpha = clamp_limit, clamp_alpha
        self.w1 = _experts_param(num_experts, 2 * ffn, hidden, device, dtype)
        self.w2 = _experts_param(num_experts, hidden, ffn, device, dtype)
        self.b1 = _bias_param(num_experts, 2 * ffn, device, dtype) if bias else None
        self.b2 = _bias_param(num_experts, hidden, device, dtype) if bias else None
        self.binding = Binding(policy, stash_manager, delay_wgrad_compute)

    def forward(self, x, counts, probs):
        return grouped_mlp(x, self.w1, self.w2, counts, probs, self.activation, self.b1, self.b2,
                           self.clamp_limit, self.clamp_alpha, binding=self.binding)

    def backward_dw(self):
        """Runs the wgrads deferred by the last backward (delay_wgrad_compute)."""
        self.binding.backward_dw()
