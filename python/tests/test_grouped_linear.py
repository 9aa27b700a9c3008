"""grouped_linear against a float64 reference: forward and every gradient, on
ragged counts (zero-size groups, skew, padding rows), the out= calls' padding
rows untouched, bit-exactness against the library call, main_grad and
delayed wgrad contracts."""
import pytest
import torch

import moestash.torch as mt
from moestash.torch import functional as Fm
import ref

E, R, I, O = 6, 96, 32, 24


def problem(device, pattern, seed, bias=True, scale=True):
    g = torch.Generator().manual_seed(seed)
    c = ref.make_counts(E, R, pattern, g)
    t = {"x": ref.rand((R, I), g), "w": ref.rand((E, O, I), g, I ** -0.5),
         "b": ref.rand((E, O), g, 0.5) if bias else None,
         "s": (0.1 + torch.rand(R, generator=g)) if scale else None,
         "dy": ref.rand((R, O), g)}
    t = {k: (v.to(device) if v is not None else None) for k, v in t.items()}
    t["c"] = c.to(device)
    return t, c


@pytest.mark.parametrize("pattern", ref.PATTERNS)
@pytest.mark.parametrize("bias,scale", [(False, False), (True, False), (True, True)])
def test_forward_backward_vs_float64(device, pattern, bias, scale):
    t, c = problem(device, pattern, 1 + ref.PATTERNS.index(pattern), bias, scale)
    n = int(c.sum())
    leaves = {k: t[k].clone().requires_grad_() for k in ("x", "w", "b", "s") if t[k] is not None}
    y = mt.grouped_linear(leaves["x"], leaves["w"], t["c"], leaves.get("b"), leaves.get("s"))
    ref.assert_close(y[:n], ref.linear(t["x"].cpu(), t["w"].cpu(), c, _cpu(t["b"]), _cpu(t["s"])), "y")
    y[:n].backward(t["dy"][:n])

    r = {k: v.detach().cpu().double().requires_grad_() for k, v in leaves.items()}
    ref.linear(r["x"], r["w"], c, r.get("b"), r.get("s")).backward(t["dy"][:n].cpu().double())
    ref.assert_close(leaves["x"].grad[:n], r["x"].grad[:n], "dx")
    for k in r:
        if k != "x":
            ref.assert_close(leaves[k].grad, r[k].grad, "d" + k)
    assert leaves["w"].grad.dtype == torch.bfloat16


def _cpu(t):
    return t.cpu() if t is not None else None


def test_out_calls_leave_padding_rows_and_match_the_ops_bit_for_bit(device):
    t, c = problem(device, "padded", 7)
    n = int(c.sum())
    y = torch.full((R, O), 3.0, dtype=torch.bfloat16, device=device)  # poisoned
    Fm.linear_forward(t["x"], t["w"], t["c"], t["b"], t["s"], y)
    assert (y[n:] == 3.0).all(), "forward wrote a padding row"
    y_op = mt.grouped_linear(t["x"], t["w"], t["c"], t["b"], t["s"])
    assert torch.equal(y_op[:n], y[:n])
    dx = torch.full((R, I), -5.0, dtype=torch.bfloat16, device=device)
    Fm.linear_dgrad(t["dy"], t["w"], t["c"], dx)
    assert (dx[n:] == -5.0).all(), "dgrad wrote a padding row"


def test_main_grad_accumulates_and_autograd_gets_no_weight_grad(device):
    t, c = problem(device, "ragged", 11)
    n = int(c.sum())
    w = t["w"].clone().requires_grad_()
    x = t["x"].clone().requires_grad_()
    w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32, device=device)  # sentinel
    mt.grouped_linear(x, w, t["c"])[:n].backward(t["dy"][:n])
    assert w.grad is None
    rw = t["w"].cpu().double().requires_grad_()
    ref.linear(t["x"].cpu(), rw, c).backward(t["dy"][:n].cpu().double())
    ref.assert_close(w.main_grad - 0.5, rw.grad, "main_grad - 0.5")
    # empty groups keep the sentinel exactly
    for g in torch.nonzero(c == 0).flatten().tolist():
        assert (w.main_grad[g] == 0.5).all()
    assert x.grad is not None


def test_delayed_wgrad_runs_at_backward_dw(device):
    t, c = problem(device, "skew", 13)
    n = int(c.sum())
    binding = mt.Binding(delay_wgrad=True)
    w = t["w"].clone().requires_grad_()
    w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32, device=device)
    mt.grouped_linear(t["x"], w, t["c"], binding=binding)[:n].backward(t["dy"][:n])
    assert (w.main_grad == 0.5).all(), "the deferred wgrad ran before backward_dw()"
    binding.backward_dw()
    rw = t["w"].cpu().double().requires_grad_()
    ref.linear(t["x"].cpu(), rw, c).backward(t["dy"][:n].cpu().double())
    ref.assert_close(w.main_grad - 0.5, rw.grad, "main_grad - 0.5")
    assert w.grad is None


def test_delayed_wgrad_needs_main_grad(device):
    t, c = problem(device, "ragged", 17)
    w = t["w"].clone().requires_grad_()
    y = mt.grouped_linear(t["x"], w, t["c"], binding=mt.Binding(delay_wgrad=True))
    with pytest.raises(ValueError, match="main_grad"):
        y.sum().backward()


def test_delayed_wgrad_needs_main_grad_on_the_bias_too(device):
    t, c = problem(device, "ragged", 19)
    w, b = t["w"].clone().requires_grad_(), t["b"].clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape, device=device)
    y = mt.grouped_linear(t["x"], w, t["c"], b, binding=mt.Binding(delay_wgrad=True))
    with pytest.raises(ValueError, match="every weight and bias"):
        y.sum().backward()
