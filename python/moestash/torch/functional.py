"""The library's ops on torch tensors, no autograd: each writes into the
tensors it is given (out= style), on torch's current stream, exactly as the C
call does (rows past sum(counts) are neither read nor written). The autograd
ops (moestash.torch.ops) are built on these; tests call them to check the
contracts the C library promises (padding rows untouched, bit-exact results).

Shapes: E groups, R rows, I in, O out, H hidden, F ffn. counts int32 [E] on
the device of x; weights [E, O, I] (or [E*O, I]) bf16; bias [E, O] bf16;
row_scale [R] fp32; main gradients fp32 of their parameter's shape.
"""
import ctypes

import torch

from .. import _lib
from ._core import as_mst, context


def _call(ctx, name, *args):
    """lib.name(ctx, ...) through the context: library structs by reference."""
    ctx.call(name, *[ctypes.byref(a) if isinstance(a, ctypes.Structure) else a for a in args])


def linear_forward(x, weight, counts, bias, row_scale, y, ctx=None):
    """y[r] = x[r] W[g]^T + bias[g] * row_scale[r]; x [R, I], y [R, O]."""
    d = x.device
    ctx = ctx or context(d)
    _call(ctx, "mst_grouped_linear_forward", as_mst(x, "x", d), as_mst(weight, "weight", d),
          as_mst(bias, "bias", d), as_mst(row_scale, "row_scale", d), as_mst(counts, "counts", d),
          as_mst(y, "y", d))


def linear_dgrad(dy, weight, counts, dx, ctx=None):
    """dx[r] = dy[r] W[g]; dy [R, O], dx [R, I]."""
    d = dy.device
    ctx = ctx or context(d)
    _call(ctx, "mst_grouped_linear_dgrad", as_mst(dy, "dy", d), as_mst(weight, "weight", d),
          as_mst(counts, "counts", d), as_mst(dx, "dx", d))


def linear_wgrad(dy, x, counts, main_grad_w, mode, row_scale=None, bias=None, main_grad_b=None,
                 d_row_scale=None, ctx=None):
    """main_grad_w[g] (+)= dy^T x over group g's rows (mode: _lib.WGRAD_*);
    main_grad_b[g] (+)= sum dy[r] row_scale[r]; d_row_scale[r] = dy[r] . bias[g]
    (bias and d_row_scale together)."""
    d = dy.device
    ctx = ctx or context(d)
    _call(ctx, "mst_grouped_linear_wgrad", as_mst(dy, "dy", d), as_mst(x, "x", d),
          as_mst(row_scale, "row_scale", d), as_mst(bias, "bias", d), as_mst(counts, "counts", d),
          as_mst(main_grad_w, "main_grad_w", d), as_mst(main_grad_b, "main_grad_b", d),
          as_mst(d_row_scale, "d_row_scale", d), mode)


def wgrad_flush(ctx):
    """Runs the DEFERRED wgrads recorded on ctx (moestash.torch._core.Context)."""
    ctx.call("mst_wgrad_flush")


def mlp_config(n_groups, hidden, ffn, activation, clamp_limit, clamp_alpha):
    if activation not in _lib.ACTIVATIONS:
        raise ValueError(f"activation '{activation}': expected one of {', '.join(_lib.ACTIVATIONS)}")
    return _lib.MlpConfig(n_groups, hidden, ffn, _lib.ACTIVATIONS.index(activation), clamp_limit, clamp_alpha)


def mlp_weights(d, w1, b1, w2, b2, g_w1=None, g_b1=None, g_w2=None, g_b2=None):
    names = ("w1", "b1", "w2", "b2", "main_grad_w1", "main_grad_b1", "main_grad_w2", "main_grad_b2")
    ts = (w1, b1, w2, b2, g_w1, g_b1, g_w2, g_b2)
    return _lib.MlpWeights(*(as_mst(t, n, d) for t, n in zip(ts, names)))


def mlp_forward(cfg, weights, x, probs, counts, saver, y, ctx=None):
    """y = fc2(act(fc1(x)) * probs) through the library; saved tensors go
    through `saver` (a moestash.torch.saver.Saver)."""
    d = x.device
    ctx = ctx or context(d)
    with saver.calling():
        _call(ctx, "mst_grouped_mlp_forward", cfg, weights, as_mst(x, "x", d), as_mst(probs, "probs", d),
              as_mst(counts, "counts", d), saver.struct, as_mst(y, "y", d))


def mlp_backward(cfg, weights, dy, counts, saver, dx, dprobs, mode, ctx=None):
    """dx, dprobs and the weight gradients (into weights' main grads, by mode)."""
    d = dy.device
    ctx = ctx or context(d)
    with saver.calling():
        _call(ctx, "mst_grouped_mlp_backward", cfg, weights, as_mst(dy, "dy", d), as_mst(counts, "counts", d),
              saver.struct, as_mst(dx, "dx", d), as_mst(dprobs, "dprobs", d), mode)
