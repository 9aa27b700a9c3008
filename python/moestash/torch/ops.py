"""The autograd ops, registered with torch.library (namespace `moestash`):

  grouped_linear(x, weight, counts, bias=None, row_scale=None)
      y[r] = x[r] W[g]^T + bias[g] * row_scale[r] for the rows r of group g
  grouped_mlp(x, w1, w2, counts, probs, activation="swiglu", b1=None, b2=None, ...)
      y = fc2(act(fc1(x) + b1) * probs) + b2 * probs

Shapes: x [R, I] bf16 (rows grouped by expert: counts[0] rows of group 0,
then group 1, ...), counts int32 [E] on x's device (read on the device: no
host sync, capturable), weight [E, O, I] bf16, bias [E, O] bf16, row_scale /
probs [R] fp32, w1 [E, 2F, H], w2 [E, H, F]. Rows past sum(counts) of y
and dx are left unwritten, as torch._grouped_mm leaves them (zeroing them
would cost a pass over [R, H]); the small per-row gradients (row_scale,
probs) are 0 there.

Weight gradients: a weight (or bias) with a `main_grad` attribute (fp32, its
shape) gets its gradient added into main_grad inside the wgrad GEMM and none
through autograd; otherwise autograd gets it in the weight's dtype. With a
Binding of delay_wgrad=True (the modules' delay_wgrad_compute) the wgrads are
recorded (MST_WGRAD_DEFERRED) and run by Binding.backward_dw().

The op bodies (custom ops forward and backward, fake implementations for
torch.compile) take a `binding` int: which Binding (context, saver, deferred
state) the call uses; 0 is the default one (shared context of the device,
every saved tensor kept).
"""
import itertools
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import _lib
from . import functional as Fm
from ._core import Context, context
from .saver import ACT_INPUT, FC1_INPUT, FC2_INPUT, PROBS, Saver, parse_policy

# ---- bindings and records ---------------------------------------------------


class Binding:
    """What an op call is bound to: a saver (policies), its own context when
    wgrads are deferred (the deferred queue and the MLP scratch it reads are
    per context), and the tensors deferred wgrads still read."""

    _ids = itertools.count()
    registry = {}

    def __init__(self, policy="keep", manager=None, delay_wgrad=False):
        self.policy = policy
        self.saver = Saver(parse_policy(policy), manager)
        self.delay_wgrad = delay_wgrad
        self.own_ctx = {}  # device -> Context (delay_wgrad only)
        self.pending = []  # tensors the deferred wgrads read until backward_dw()
        self.id = next(Binding._ids)
        Binding.registry[self.id] = self

    def __deepcopy__(self, memo):
        """copy.deepcopy of a module holding a Binding (a reference model, an
        EMA copy): a Binding of its own, same policy and the same
        StashManager (shared, as the manager is meant to be)."""
        return Binding(self.policy, self.saver.manager, self.delay_wgrad)

    def ctx(self, device):
        if not self.delay_wgrad:
            return context(device)
        if device not in self.own_ctx:
            self.own_ctx[device] = Context(device)
        return self.own_ctx[device]

    def hold(self, *objs):
        """Keeps what a deferred wgrad reads or writes alive until
        backward_dw(): tensors detached (their storage, not their autograd
        graph, which would keep the step's AccumulateGrad nodes alive)."""
        self.pending += [o.detach() if isinstance(o, torch.Tensor) else o for o in objs if o is not None]

    def backward_dw(self):
        """Runs the deferred wgrads (into the weights' main_grad), in order."""
        for ctx in self.own_ctx.values():
            Fm.wgrad_flush(ctx)
        self.pending.clear()


DEFAULT = Binding()
_record_ids = itertools.count()  # the records themselves: the binding's StashManager


def _wgrad_mode(binding, params, main_grads):
    """The wgrad mode of a call whose gradient-taking parameters (None:
    absent) have these main_grads (None: none). Deferred wgrads add into
    main_grad later, so then every such parameter needs one."""
    taken = [m for p, m in zip(params, main_grads) if p is not None]
    if binding.delay_wgrad:
        if any(m is None for m in taken):
            raise ValueError("delay_wgrad_compute needs main_grad on every weight and bias that takes a "
                             "gradient (the deferred wgrads add into it at backward_dw())")
        return _lib.WGRAD_DEFERRED
    return _lib.WGRAD_ACCUMULATE if any(m is not None for m in taken) else _lib.WGRAD_OVERWRITE


def _grad_buf(param, main_grad, mode):
    """Where a parameter's gradient is written: its main_grad, else an fp32
    buffer (zeros when the call accumulates)."""
    if param is None:
        return None
    if main_grad is not None:
        return main_grad
    alloc = torch.zeros if mode != _lib.WGRAD_OVERWRITE else torch.empty
    return alloc(param.shape, dtype=torch.float32, device=param.device)


def _none_if_empty(t):
    return None if t.numel() == 0 and t.dim() == 1 else t


def _empty(device, dtype=torch.bfloat16):
    """The [0] tensor an op returns where it has no tensor to return."""
    return torch.empty((0,), dtype=dtype, device=device)


# ---- grouped linear -------------------------------------------------------------


def _out_features(weight, counts):
    return weight.shape[1] if weight.dim() == 3 else weight.shape[0] // max(counts.shape[0], 1)


@torch.library.custom_op("moestash::grouped_linear_fwd", mutates_args=())
def _gl_fwd(x: Tensor, weight: Tensor, counts: Tensor, bias: Optional[Tensor], row_scale: Optional[Tensor],
            binding: int) -> Tensor:
    y = x.new_empty((x.shape[0], _out_features(weight, counts)))
    if x.shape[0]:  # the library takes no empty tensor; no rows, nothing to do
        Fm.linear_forward(x, weight, counts, bias, row_scale, y, Binding.registry[binding].ctx(x.device))
    return y


@_gl_fwd.register_fake
def _(x, weight, counts, bias, row_scale, binding):
    return x.new_empty((x.shape[0], _out_features(weight, counts)))


@torch.library.custom_op("moestash::grouped_linear_bwd", mutates_args=("main_grad_w", "main_grad_b"))
def _gl_bwd(dy: Tensor, x: Tensor, weight: Tensor, counts: Tensor, bias: Optional[Tensor],
            row_scale: Optional[Tensor], main_grad_w: Optional[Tensor], main_grad_b: Optional[Tensor],
            needs: List[bool], binding: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """needs: (dx, dweight, dbias, drow_scale). Returns them (empty when not needed)."""
    b = Binding.registry[binding]
    ctx, d, rows = b.ctx(dy.device), dy.device, x.shape[0]
    dy = dy.contiguous()
    dx = x.new_empty(x.shape) if needs[0] else _empty(d)
    if needs[0] and rows:
        Fm.linear_dgrad(dy, weight, counts, dx, ctx)
    want_w, want_b, want_s = needs[1], needs[2] and bias is not None, needs[3] and bias is not None
    dw, db, ds = _empty(d), _empty(d), _empty(d, torch.float32)
    if want_w or want_b or want_s:
        main_grad_w = main_grad_w if want_w else None  # a weight without grad: into scratch
        main_grad_b = main_grad_b if want_b else None
        mode = _wgrad_mode(b, (weight if want_w else None, bias if want_b else None), (main_grad_w, main_grad_b))
        if mode == _lib.WGRAD_DEFERRED and want_s:
            raise ValueError("delay_wgrad_compute: the row_scale gradient comes from the wgrad GEMM, "
                             "which is deferred; give row_scale no gradient or do not delay the wgrad")
        zeroed = mode if rows else _lib.WGRAD_ACCUMULATE  # no rows: zero gradients
        gw = _grad_buf(weight, main_grad_w, zeroed)
        gb = _grad_buf(bias, main_grad_b, zeroed) if want_b else None
        ds = torch.zeros_like(row_scale) if want_s else ds  # [R]: padding rows 0
        if rows:
            Fm.linear_wgrad(dy, x, counts, gw, mode, row_scale, bias if want_s else None, gb,
                            ds if want_s else None, ctx)
        if mode == _lib.WGRAD_DEFERRED:
            b.hold(dy, x, row_scale, gw, gb)  # what the deferred wgrad reads and writes
        if want_w and main_grad_w is None:
            dw = gw.to(weight.dtype)
        if want_b and main_grad_b is None:
            db = gb.to(bias.dtype)
    return dx, dw, db, ds


@_gl_bwd.register_fake
def _(dy, x, weight, counts, bias, row_scale, main_grad_w, main_grad_b, needs, binding):
    d = dy.device
    dx = x.new_empty(x.shape) if needs[0] else _empty(d)
    dw = weight.new_empty(weight.shape) if needs[1] and main_grad_w is None else _empty(d)
    db = bias.new_empty(bias.shape) if needs[2] and bias is not None and main_grad_b is None else _empty(d)
    ds = row_scale.new_empty(row_scale.shape) if needs[3] and bias is not None else _empty(d, torch.float32)
    return dx, dw, db, ds


def _gl_setup(ctx, inputs, output):
    x, weight, counts, bias, row_scale, binding = inputs
    ctx.save_for_backward(x, weight, counts, bias, row_scale)
    ctx.binding = binding
    ctx.main_grad_w = getattr(weight, "main_grad", None)
    ctx.main_grad_b = getattr(bias, "main_grad", None) if bias is not None else None


def _gl_backward(ctx, dy):
    x, weight, counts, bias, row_scale = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:2]) + [ctx.needs_input_grad[3], ctx.needs_input_grad[4]]
    dx, dw, db, ds = _gl_bwd(dy, x, weight, counts, bias, row_scale, ctx.main_grad_w, ctx.main_grad_b,
                             needs, ctx.binding)
    ds = ds.view(row_scale.shape) if row_scale is not None and ds.numel() else None
    return (_none_if_empty(dx), _none_if_empty(dw), None, _none_if_empty(db), ds, None)


_gl_fwd.register_autograd(_gl_backward, setup_context=_gl_setup)


def grouped_linear(x, weight, counts, bias=None, row_scale=None, binding=None):
    """y [R, O] = x [R, I] W[g]^T (+ bias[g] * row_scale[r]) per group g of rows."""
    return _gl_fwd(x, weight, counts, bias, row_scale, (binding or DEFAULT).id)


# ---- grouped MLP -------------------------------------------------------------------


def _mlp_cfg(x, w1, counts, activation, clamp_limit, clamp_alpha):
    E = counts.shape[0]
    return Fm.mlp_config(E, x.shape[1], w1.numel() // (E * x.shape[1] * 2), activation, clamp_limit, clamp_alpha)


def _saved_shapes(binding, R, F):
    """Shapes of the op's extra outputs act_input, fc2_input (empty unless kept)."""
    s = Binding.registry[binding].saver
    h = (R, 2 * F) if s.kept(ACT_INPUT) else (0,)
    z = (R, F) if s.kept(FC2_INPUT) else (0,)
    return h, z


@torch.library.custom_op("moestash::grouped_mlp_fwd", mutates_args=())
def _mlp_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], counts: Tensor,
             probs: Tensor, activation: str, clamp_limit: float, clamp_alpha: float,
             binding: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns y, the kept act_input and fc2_input (empty otherwise) and the
    record id (int64 [1] on the CPU) of what was stashed."""
    b = Binding.registry[binding]
    d, R = x.device, x.shape[0]
    cfg = _mlp_cfg(x, w1, counts, activation, clamp_limit, clamp_alpha)
    y = x.new_empty((R, x.shape[1]))
    record = b.saver.forward(d, R, cfg.ffn, (x, probs, counts))
    hs, zs = _saved_shapes(binding, R, cfg.ffn)
    try:
        if R:  # the library takes no empty tensor; no rows, nothing to do
            Fm.mlp_forward(cfg, Fm.mlp_weights(d, w1, b1, w2, b2), x, probs, counts, b.saver, y, b.ctx(d))
    finally:
        produced, _ = b.saver.end()
    h = produced[ACT_INPUT] if R and b.saver.kept(ACT_INPUT) else x.new_empty(hs)
    z = produced[FC2_INPUT] if R and b.saver.kept(FC2_INPUT) else x.new_empty(zs)
    rid = -1
    if record.handles:
        rid = next(_record_ids)
        b.saver.manager.hold(rid, record)
    return y, h, z, torch.tensor([rid], dtype=torch.int64)


@_mlp_fwd.register_fake
def _(x, w1, b1, w2, b2, counts, probs, activation, clamp_limit, clamp_alpha, binding):
    R, H = x.shape
    F = w1.numel() // (counts.shape[0] * H * 2)
    hs, zs = _saved_shapes(binding, R, F)
    return x.new_empty((R, H)), x.new_empty(hs), x.new_empty(zs), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("moestash::grouped_mlp_bwd",
                         mutates_args=("main_grad_w1", "main_grad_b1", "main_grad_w2", "main_grad_b2"))
def _mlp_bwd(dy: Tensor, x: Tensor, h: Tensor, z: Tensor, probs: Tensor, rid: Tensor, w1: Tensor,
             b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], counts: Tensor,
             main_grad_w1: Optional[Tensor], main_grad_b1: Optional[Tensor], main_grad_w2: Optional[Tensor],
             main_grad_b2: Optional[Tensor], activation: str, clamp_limit: float, clamp_alpha: float,
             binding: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x, probs: the saved inputs (empty when paged); h, z: kept act_input
    and fc2_input (empty otherwise). Returns dx, dprobs and the autograd
    gradients of w1, b1, w2, b2 (empty where main_grad took them)."""
    b = Binding.registry[binding]
    d, R = dy.device, dy.shape[0]
    dy = dy.contiguous()
    cfg = _mlp_cfg(dy, w1, counts, activation, clamp_limit, clamp_alpha)
    mgs = (main_grad_w1, main_grad_b1, main_grad_w2, main_grad_b2)
    params = (w1, b1, w2, b2)
    mode = _wgrad_mode(b, params, mgs)
    grads = [_grad_buf(p, m, mode if R else _lib.WGRAD_ACCUMULATE) for p, m in zip(params, mgs)]  # no rows: 0
    record = None
    if int(rid[0]) >= 0:
        record = b.saver.manager.release(int(rid[0]))
        if record is None:
            raise RuntimeError("grouped_mlp backward: the stashed activations of its forward were reset by "
                               "StashManager.step_begin() in between (call it once per step, before the forwards)")
    saved = {FC1_INPUT: x, ACT_INPUT: h, FC2_INPUT: z, PROBS: probs, "rows": R, "ffn": cfg.ffn}
    b.saver.backward(d, record, saved, restore_all=mode == _lib.WGRAD_DEFERRED)
    dx, dprobs = dy.new_empty((R, cfg.hidden)), torch.zeros(R, dtype=torch.float32, device=d)  # padding 0
    try:
        if R:
            Fm.mlp_backward(cfg, Fm.mlp_weights(d, *params, *grads), dy, counts, b.saver, dx, dprobs, mode,
                            b.ctx(d))
    finally:
        _, keepalive = b.saver.end()
    if record is not None:  # the next backward's offloaded names, beside this one's compute (offload_stream)
        b.saver.manager.prefetch_before(int(rid[0]))
    if mode == _lib.WGRAD_DEFERRED:
        b.hold(dy, x, z, probs, *keepalive)
    out = [g.to(p.dtype) if p is not None and m is None else _empty(d) for p, m, g in zip(params, mgs, grads)]
    return (dx, dprobs, *out)


@_mlp_bwd.register_fake
def _(dy, x, h, z, probs, rid, w1, b1, w2, b2, counts, mg_w1, mg_b1, mg_w2, mg_b2, activation, clamp_limit,
      clamp_alpha, binding):
    R = dy.shape[0]
    out = [p.new_empty(p.shape) if p is not None and m is None else dy.new_empty((0,))
           for p, m in zip((w1, b1, w2, b2), (mg_w1, mg_b1, mg_w2, mg_b2))]
    return (dy.new_empty(dy.shape), dy.new_empty((R,), dtype=torch.float32), *out)


def _mlp_setup(ctx, inputs, output):
    x, w1, b1, w2, b2, counts, probs, activation, limit, alpha, binding = inputs
    _, h, z, rid = output
    s = Binding.registry[binding].saver
    # a paged fc1_input / probs is not kept by autograd (the pages hold it)
    x_kept = x if s.kept(FC1_INPUT) else x.new_empty((0,))
    p_kept = probs if s.kept(PROBS) else probs.new_empty((0,))
    ctx.save_for_backward(x_kept, h, z, p_kept, rid, w1, b1, w2, b2, counts)
    ctx.args = (activation, limit, alpha, binding)
    ctx.probs_shape = probs.shape
    ctx.main_grads = tuple(getattr(p, "main_grad", None) if p is not None else None for p in (w1, b1, w2, b2))


def _mlp_backward(ctx, dy, _dh, _dz, _drid):
    x, h, z, p, rid, w1, b1, w2, b2, counts = ctx.saved_tensors
    dx, dprobs, dw1, db1, dw2, db2 = _mlp_bwd(dy, x, h, z, p, rid, w1, b1, w2, b2, counts, *ctx.main_grads,
                                              *ctx.args)
    grads = [_none_if_empty(g) for g in (dw1, db1, dw2, db2)]
    return (dx, grads[0], grads[1], grads[2], grads[3], None, dprobs.view(ctx.probs_shape), None, None, None, None)


_mlp_fwd.register_autograd(_mlp_backward, setup_context=_mlp_setup)


def grouped_mlp(x, w1, w2, counts, probs, activation="swiglu", b1=None, b2=None, clamp_limit=7.0,
                clamp_alpha=1.702, binding=None):
    """y [R, H] = (act(x W1[g]^T + b1[g]) * probs) W2[g]^T + b2[g] * probs."""
    b = binding or DEFAULT
    return _mlp_fwd(x, w1, b1, w2, b2, counts, probs, activation, float(clamp_limit), float(clamp_alpha), b.id)[0]
