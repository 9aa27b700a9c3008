"""The modules: parameters laid out as the ops take them, a policy given as a
dict or a string, delayed wgrad through backward_dw(), the same bits as the
ops they wrap."""
import pytest
import torch

import moestash.torch as mt
import ref

E, R, H, F = 4, 48, 32, 16


def inputs(device, seed):
    g = torch.Generator().manual_seed(seed)
    return (ref.rand((R, H), g).to(device), ref.make_counts(E, R, "ragged", g).to(device),
            torch.rand(R, generator=g).to(device))


def test_grouped_linear_module(device):
    torch.manual_seed(0)
    m = mt.GroupedLinear(E, H, 2 * H, bias=True, device=device)
    assert m.weight.shape == (E, 2 * H, H) and m.bias.shape == (E, 2 * H) and m.weight.dtype == torch.bfloat16
    with torch.no_grad():
        m.bias.normal_()
    x, c, s = inputs(device, 1)
    assert torch.equal(m(x, c, s), mt.grouped_linear(x, m.weight, c, m.bias, s))


@pytest.mark.parametrize("policy", [{"fc1_input": "stash", "fc2_input": "recompute"},
                                    "act_input=offload,probs=stash"])
def test_grouped_mlp_module_policies(device, policy):
    torch.manual_seed(0)
    manager = mt.StashManager(page_rows=8)
    keep = mt.GroupedMLP(E, H, F, bias=True, device=device)
    torch.manual_seed(0)
    paged = mt.GroupedMLP(E, H, F, bias=True, policy=policy, stash_manager=manager, device=device)
    x, c, p = inputs(device, 2)
    dy = torch.randn(R, H, device=device).bfloat16()
    n = int(c.sum())
    outs = []
    for m in (keep, paged):
        manager.step_begin()
        xx = x.clone().requires_grad_()
        y = m(xx, c, p)
        y[:n].backward(dy[:n])
        assert manager.step_check()
        outs.append([y[:n], xx.grad[:n]] + [q.grad for q in m.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_grouped_mlp_module_backward_dw(device):
    torch.manual_seed(0)
    m = mt.GroupedMLP(E, H, F, delay_wgrad_compute=True, device=device)
    for q in m.parameters():
        q.main_grad = torch.full(q.shape, 0.5, device=device)
    x, c, p = inputs(device, 3)
    n = int(c.sum())
    m(x, c, p)[:n].float().sum().backward()
    assert all((q.main_grad == 0.5).all() for q in m.parameters()), "a wgrad ran before backward_dw()"
    m.backward_dw()
    assert all(not (q.main_grad == 0.5).all() for q in m.parameters())
    assert all(q.grad is None for q in m.parameters())


def test_no_rows(device):
    """An empty batch (an expert-parallel rank that got no token): empty
    outputs, zero weight gradients, a main_grad left as it was."""
    torch.manual_seed(0)
    lin = mt.GroupedLinear(E, H, H, bias=True, device=device)
    mlp = mt.GroupedMLP(E, H, F, bias=True, device=device)
    mlp.w2.main_grad = torch.full(mlp.w2.shape, 0.5, device=device)
    x = torch.empty(0, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    p = torch.empty(0, device=device, requires_grad=True)
    c = torch.zeros(E, dtype=torch.int32, device=device)
    y = mlp(lin(x, c, p), c, p)
    assert y.shape == (0, H)
    y.sum().backward()
    assert x.grad.shape == (0, H) and p.grad.shape == (0,)
    for q in (lin.weight, lin.bias, mlp.w1, mlp.b1, mlp.b2):
        assert q.grad is not None and not q.grad.any()
    assert mlp.w2.grad is None and (mlp.w2.main_grad == 0.5).all()
