"""patch_torchtitan_moe: torchtitan's MoE module (torchtitan 0.3, built
locally: 8 experts top-2, dim 64, hidden 32, softmax router with an expert
bias) patched onto moestash against the same module unpatched, on one
batch: output, the input's gradient and every parameter's gradient;
route_norm on and off; fp32 and bf16 parameters; CPU and CUDA. Both sides compute the
experts in bf16 (torchtitan casts x and the weights to bf16 for
torch._grouped_mm) and round in different places (torchtitan: silu(x w1)
and its product with x w3 each to bf16; the library: act_input, then
silu(gate) * up once), so the tolerance is bf16's, relative norm error
2e-2 (measured: 7.5e-3 at worst); the token counts (torchtitan's load-balancing state) are exact.
Skipped where torchtitan is not installed: it is not in make test's venv
(its dependencies, datasets, wandb, tensorboard, pyarrow, ..., are not
the project's); `pip install torchtitan==0.3.0` installs beside torch 2.15
in a venv that sees torch's, and there these tests pass."""
import copy

import pytest
import torch

import moestash.torch as mt

moe = pytest.importorskip("torchtitan.models.common.moe")
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

E, K, D, F = 8, 2, 64, 32
TOL = 2e-2


def make(dtype, route_norm, device="cpu"):
    cfg = moe.MoE.Config(
        num_experts=E,
        routed_experts=moe.RoutedExperts.Config(
            inner_experts=moe.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=moe.TokenChoiceTopKRouter.Config(num_experts=E, top_k=K, score_func="softmax", route_norm=route_norm,
                                                gate=Linear.Config(in_features=D, out_features=E, bias=False)))
    m = cfg.build()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        m.expert_bias_E.copy_(torch.randn(E, generator=g) * 0.05)
    return m.to(device=device, dtype=dtype)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def run(m, x):
    xx = x.clone().requires_grad_()
    y = m(xx)
    y.float().square().sum().backward()
    return y.detach(), xx.grad, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("route_norm", [True, False], ids=["norm", "no_norm"])
def test_patched_matches_torchtitan(device, dtype, route_norm):
    ref = make(dtype, route_norm, device)
    ours = copy.deepcopy(ref)
    before = dict(ours.named_parameters())
    (experts,) = mt.patch_torchtitan_moe(ours)
    assert experts is ours.routed_experts.inner_experts
    assert dict(ours.named_parameters()) == before  # the same parameter objects, the same names
    x = torch.randn(3, 16, D, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    (y0, dx0, g0), (y1, dx1, g1) = run(ref, x), run(ours, x)
    assert torch.equal(ours.tokens_per_expert_E, ref.tokens_per_expert_E)
    assert y1.dtype == y0.dtype and rel(y1, y0) < TOL, rel(y1, y0)
    assert rel(dx1, dx0) < TOL, rel(dx1, dx0)
    for n, g in g0.items():
        assert g1[n] is not None and g1[n].dtype == g.dtype and rel(g1[n], g) < TOL, f"{n}: {rel(g1[n], g):.3g}"


def test_stash_changes_no_bit(device):
    keep = make(torch.bfloat16, True, device)
    paged = copy.deepcopy(keep)
    stash = mt.StashManager(page_rows=16)
    mt.patch_torchtitan_moe(keep)
    mt.patch_torchtitan_moe(paged, policy="stash", stash=stash)
    x = torch.randn(3, 16, D, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=torch.bfloat16)
    want = run(keep, x)
    for _ in range(3):
        stash.step_begin()
        got = run(paged, x)
        if stash.step_check():
            break
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], g) for n, g in want[2].items())
    with pytest.raises(ValueError, match="no torchtitan GroupedExperts"):
        mt.patch_torchtitan_moe(paged)
