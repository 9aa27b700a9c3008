"""Partial graphs: MoE blocks captured alone (torch.cuda.make_graphed_callables)
while attention runs eagerly over packed sequences whose lengths change
every step, the stash's pages shared by captured and eager blocks.

test_partial_graph_matches_eager (CUDA): a 3-layer model (RMSNorm,
causal attention over the step's sequences, RMSNorm, MoE block: router,
top-2, mt.routed_experts on the grouped MLP), every block's MLP paged
through one StashManager; the MoE blocks of layers 0 and 2 captured, layer
1's eager. Four steps, new sequence lengths, inputs and routing each (the
captured blocks replay with new counts), against the same model all eager:
output, loss and every parameter's gradient bit for bit, and the pools the
graphs hold still the manager's (no growth after the capture).

test_partial_capture_owns_its_handles (CPU, a capture simulated): the
stash handles a captured forward takes stay its graph's after its backward,
captured or not (never handed to an eager forward), a capture with no free handle
is refused before the library allocates, and step_begin() leaves a
captured record's handles alone.
"""
import pytest
import torch

import moestash.torch as mt
import moestash.torch.saver as saver_mod
import moestash.torch.stash as stash_mod
import ref

T, H, NH, HD, E, K, F, LAYERS = 256, 64, 4, 16, 8, 2, 32, 3
GRAPHED = (0, 2)  # layers whose MoE block is captured; the others' run eagerly
POLICIES = ["stash", "fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash"]


def rms(x):
    return (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def param(g, shape, scale, device):
    """Drawn on the CPU (the same weights for every model of one seed)."""
    return torch.nn.Parameter((torch.randn(shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16))


class Attention(torch.nn.Module):
    """Causal attention within each of the packed sequences (lengths: a host
    list summing to T, new every step: the shapes a capture cannot take).
    Plain matmuls in fp32: deterministic, so both runs see the same bits."""

    def __init__(self, g, device):
        super().__init__()
        self.qkv = param(g, (3 * NH * HD, H), H ** -0.5, device)
        self.o = param(g, (H, NH * HD), (NH * HD) ** -0.5, device)

    def forward(self, x, lens):
        q, k, v = torch.nn.functional.linear(x, self.qkv).view(T, 3, NH, HD).float().unbind(1)  # [T, NH, HD]
        outs, start = [], 0
        for n in lens:
            qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [NH, n, HD]
            s = (qs @ ks.transpose(1, 2)) * HD ** -0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            outs.append((s.softmax(-1) @ vs).transpose(0, 1).reshape(n, NH * HD))
            start += n
        return torch.nn.functional.linear(torch.cat(outs).to(x.dtype), self.o)


class Moe(torch.nn.Module):
    """Router (softmax, top-k renormalised) and the routed grouped MLP."""

    def __init__(self, g, device, binding):
        super().__init__()
        self.gate = param(g, (E, H), 1.0, device)
        self.w1 = param(g, (E, 2 * F, H), H ** -0.5, device)
        self.w2 = param(g, (E, H, F), F ** -0.5, device)
        self.binding = binding

    def forward(self, x):
        probs = torch.softmax(torch.nn.functional.linear(x, self.gate).float(), dim=-1)
        top_p, top_i = probs.topk(K, dim=-1)
        return mt.routed_experts(x, top_i, top_p / top_p.sum(-1, keepdim=True), self.w1, self.w2, self.binding)


class Model(torch.nn.Module):
    def __init__(self, device, policy, manager):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.attn = torch.nn.ModuleList(Attention(g, device) for _ in range(LAYERS))
        self.moe = torch.nn.ModuleList(Moe(g, device, mt.Binding(policy, manager)) for _ in range(LAYERS))

    def forward(self, x, lens):
        for attn, moe in zip(self.attn, self.moe):
            x = x + attn(rms(x), lens)
            x = x + moe(rms(x))
        return x


def batches(device, n=4):
    """(x [T, H], sequence lengths, loss weights [T, H]) per step."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        cuts = sorted(torch.randperm(T - 1, generator=g)[: int(torch.randint(1, 6, (1,), generator=g))] + 1)
        lens = [b - a for a, b in zip([0] + [int(c) for c in cuts], [int(c) for c in cuts] + [T])]
        out.append((ref.rand((T, H), g).to(device), lens, torch.randn(T, H, generator=g).to(device)))
    return out


def step(model, manager, x, lens, w):
    model.zero_grad(set_to_none=True)
    manager.step_begin()
    y = model(x, lens)
    loss = (y.float() * w).sum()
    loss.backward()
    assert manager.step_check(), "a pool overflowed: the test sizes them to never grow"
    # cloned: a graphed block's gradients live in its graph's static buffers, which the next replay overwrites
    return [y.detach().clone(), loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]


def manager():
    return mt.StashManager(page_rows=16, initial_rows=8 * T * K)  # never grows: the graphs keep their pools


@pytest.mark.parametrize("policy", POLICIES)
def test_partial_graph_matches_eager(cuda, policy):
    data = batches(cuda)
    eager_mgr = manager()
    eager = Model(cuda, policy, eager_mgr)
    want = [step(eager, eager_mgr, *b) for b in data]

    mgr = manager()
    model = Model(cuda, policy, mgr)
    step(model, mgr, *data[0])  # eager once: workspaces, pools and the handles the captures take
    pools = {key: pool.ptr.value for key, pool in mgr.pools.items()}
    g = torch.Generator().manual_seed(2)
    samples = tuple((ref.rand((T, H), g).to(cuda).requires_grad_(),) for _ in GRAPHED)
    torch.cuda.make_graphed_callables(tuple(model.moe[i] for i in GRAPHED), samples)  # their forward replaced

    names = ["y", "loss"] + [n for n, _ in model.named_parameters()]
    for i, (b, w) in enumerate(zip(data, want)):
        got = step(model, mgr, *b)
        for name, a, c in zip(names, got, w):
            assert torch.equal(a, c), f"step {i} (lengths {b[1]}): {name} differs from the all-eager run"
    assert {key: pool.ptr.value for key, pool in mgr.pools.items()} == pools


def test_partial_capture_owns_its_handles(monkeypatch):
    """On the CPU, with the capture state forced: what make_graphed_callables
    does to the manager's handles (see the module doc)."""
    capture = [False]
    for mod in (saver_mod, stash_mod):
        monkeypatch.setattr(mod, "capturing", lambda device: capture[0])
    mgr = mt.StashManager(page_rows=16)
    mlp = mt.GroupedMLP(E, H, F, policy="stash", stash_manager=mgr, device="cpu")
    g = torch.Generator().manual_seed(3)
    x, counts, p = ref.rand((T, H), g), ref.make_counts(E, T, "ragged", g), torch.rand(T, generator=g)

    def fwd_bwd(captured):
        capture[0] = captured
        try:
            mlp(x.clone().requires_grad_(), counts, p).float().sum().backward()
        finally:
            capture[0] = False

    def free():
        return {key: [h.value for hs in pool.free.values() for h in hs] for key, pool in mgr.pools.items()}

    mgr.step_begin()
    fwd_bwd(False)  # eager: one handle per pool, free again after the backward
    assert mgr.step_check()
    eager_free = free()
    assert eager_free and all(len(hs) == 1 for hs in eager_free.values())

    mgr.step_begin()
    fwd_bwd(True)  # "captured" forward and backward: the graph keeps the handles
    assert mgr.step_check()
    assert all(not hs for hs in free().values()), "a captured backward gave its handles back"

    mgr.step_begin()
    fwd_bwd(False)  # an eager forward now makes new handles, never the graph's
    assert mgr.step_check()
    for key, hs in free().items():
        assert len(hs) == 1 and hs[0] not in eager_free[key]

    mgr.step_begin()
    capture[0] = True
    y = mlp(x.clone().requires_grad_(), counts, p)  # a captured forward, its backward eager: the graph keeps them
    capture[0] = False
    y.float().sum().backward()
    assert mgr.step_check() and all(not hs for hs in free().values())

    mgr.step_begin()
    fwd_bwd(False)  # new handles again
    capture[0] = True
    y = mlp(x.clone().requires_grad_(), counts, p)  # a captured forward whose backward is not run yet
    capture[0] = False
    held = free()
    assert all(not hs for hs in held.values())
    mgr.step_begin()  # drops the record, not the graph's handles
    assert free() == held
    del y

    capture[0] = True
    with pytest.raises(RuntimeError, match="none is free"):
        mlp(x, counts, p)
    capture[0] = False
