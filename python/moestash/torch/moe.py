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

Expert-parallel (ep: a moestash.torch.ExpertParallel): w1, w2 hold this
rank's El = E / W experts (global expert g on rank g // El), top_k_index
the global ids; the library's dispatch takes the token rows and their
weights to the experts' ranks (expert-major rows, counts on the device),
the grouped MLP scales each row by its weight there, and the combine sums
each token's k rows in fp32, rounded once to bf16 (then cast to x's dtype).
window=True dispatches into the communicator's window rows, valid until its
next dispatch: the binding must then stash or offload fc1_input (the pages
copy the rows for the backward; keep would hold the window), and the row
weights are copied (R fp32) for the same reason.

regather=True (one device, fc1_input kept): the grouped MLP's fc1_input,
the T k expert-major rows gathered from x, is not saved for the backward;
the backward gathers them again from x (which the router's linear saves
anyway) and the row indices (which the gather's backward saves): T k x H
bf16 less a layer until its backward (k x the layer's input), one gather
more in the backward, the same bits (a gather is exact). It works through
saved-tensor hooks (Python): tested eager; not for a fullgraph
torch.compile.
"""
import contextlib

import torch

from .ops import DEFAULT, grouped_mlp
from .saver import FC1_INPUT


def expert_order(top_k_index, num_experts):
    """order int64 [T k]: the slot (t * k + s) of each expert-major row;
    counts int32 [E]: rows per expert."""
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts


def routed_experts(x, top_k_index, top_k_weights, w1, w2, binding=None, activation="swiglu", ep=None,
                   window=False, regather=False):
    """The combined experts' output [T, H] in x's dtype (see the module doc)."""
    if regather and (ep is not None or not (binding or DEFAULT).saver.kept(FC1_INPUT)):
        raise ValueError("routed_experts: regather=True needs one device (ep None) and fc1_input kept (it "
                         "gathers the kept rows again in the backward instead of saving them)")
    if ep is not None:
        return _routed_experts_ep(x, top_k_index, top_k_weights, w1, w2, binding, activation, ep, window)
    T, H = x.shape
    k = top_k_index.shape[-1]
    order, counts = expert_order(top_k_index, w1.shape[0])
    bf = torch.bfloat16
    src, index = x.to(bf), order // k  # [T, H], int64 [T k]: the token of each expert-major row
    rows = src[index]  # [T k, H] expert-major
    probs = top_k_weights.reshape(-1)[order].float()  # [T k] fp32
    with _regathered(rows, src, index) if regather else contextlib.nullcontext():
        y = grouped_mlp(rows, w1.to(bf), w2.to(bf), counts, probs, activation, binding=binding)  # [T k, H]
    slots = y.new_empty(y.shape).index_copy(0, order, y)  # [T k, H] in (token, choice) order
    return slots.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


class _Gather:
    """What autograd holds instead of the rows src[index]: the gather's inputs."""

    def __init__(self, src, index):
        self.src, self.index = src, index  # [T, H] bf16, int64 [T k]


class _Outer:
    """A tensor packed by the saved-tensor hooks that were on before ours."""

    def __init__(self, packed):
        self.packed = packed


def _regathered(rows, src, index):
    """Saved-tensor hooks under which a save of `rows` (src[index]) holds
    the gather's inputs instead, and its unpack gathers again; every other
    saved tensor goes to the hooks that were on before (a caller's
    torch.autograd.graph.saved_tensors_hooks: save_on_cpu, a checkpoint, a
    counter), as without ours. The pack hook knows rows by its address and
    shape only (holding rows would keep it)."""
    ptr, shape = rows.data_ptr(), rows.shape
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    outer = top(False) if top is not None else None  # (pack, unpack) or None

    def pack(t):
        if t.data_ptr() == ptr and t.shape == shape:
            return _Gather(src, index)
        return _Outer(outer[0](t)) if outer else t

    def unpack(saved):
        if isinstance(saved, _Gather):
            return saved.src[saved.index]
        return outer[1](saved.packed) if isinstance(saved, _Outer) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _routed_experts_ep(x, top_k_index, top_k_weights, w1, w2, binding, activation, ep, window):
    bf = torch.bfloat16
    if w1.shape[0] != ep.n_local:
        raise ValueError(f"routed_experts: w1 holds {w1.shape[0]} experts, the communicator gives this rank "
                         f"{ep.n_local} (E {ep.n_experts} over {ep.world} ranks)")
    if window and (binding or DEFAULT).saver.kept(FC1_INPUT):
        raise ValueError("routed_experts: window=True needs fc1_input stashed or offloaded (the window rows are "
                         "overwritten by the next dispatch; keep would save them for the backward)")
    rows, row_probs, counts, route = ep.dispatch(x.to(bf), top_k_index, top_k_weights, window=window)
    if window:
        row_probs = row_probs.clone()  # [R] fp32: the grouped MLP may keep it for its backward
    y = grouped_mlp(rows, w1.to(bf), w2.to(bf), counts, row_probs, activation, binding=binding)  # [R, H]
    return ep.combine(y, route).to(x.dtype)
