"""torch.cuda.graph: forward + backward of GroupedMLP and GroupedLinear
captured once and replayed with new counts (and new inputs) in the same
buffers gives the bits of an eager run on those counts; under the stash
policy too (the pools reset inside the graph)."""
import pytest
import torch

import moestash.torch as mt
import ref

E, R, H, F = 8, 256, 64, 32


def make(device, policy):
    torch.manual_seed(0)
    manager = mt.StashManager(page_rows=16) if policy != "keep" else None
    mlp = mt.GroupedMLP(E, H, F, bias=True, policy=policy, stash_manager=manager, device=device)
    lin = mt.GroupedLinear(E, H, H, device=device)
    return mlp, lin, manager


def step(mlp, lin, manager, x, counts, p, dy):
    if manager:
        manager.step_begin()
    y = mlp(lin(x, counts), counts, p)
    y.backward(dy)
    return y


@pytest.mark.parametrize("policy", ["keep", "stash", "fc1_input=offload,act_input=stash,fc2_input=recompute"])
def test_replay_with_new_counts(cuda, policy):
    mlp, lin, manager = make(cuda, policy)
    g = torch.Generator().manual_seed(5)
    problems = []
    for pattern in ("ragged", "skew", "one", "padded"):
        problems.append((ref.rand((R, H), g).to(cuda), ref.make_counts(E, R, pattern, g).to(cuda),
                         torch.rand(R, generator=g).to(cuda), ref.rand((R, H), g).to(cuda)))
    params = list(mlp.parameters()) + list(lin.parameters())

    def eager(x, c, p, dy):
        for q in params:
            q.grad = None
        xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
        for _ in range(3):  # a stash step that overflowed is rerun
            y = step(mlp, lin, manager, xx, c, pp, dy)
            if manager is None or manager.step_check():
                break
            for q in params + [xx, pp]:
                q.grad = None
        n = int(c.sum())
        # detached: a kept graph would keep its AccumulateGrad nodes (on the default stream) into the capture
        return [y[:n].detach().clone(), xx.grad[:n].clone(), pp.grad[:n].clone()] + [q.grad.clone() for q in params]

    want = [eager(*pr) for pr in problems]  # also sizes the pools on the largest

    sx, sc, sp, sdy = (t.clone() for t in problems[0])
    sx.requires_grad_()
    sp.requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        step(mlp, lin, manager, sx, sc, sp, sdy)
    torch.cuda.current_stream().wait_stream(s)
    for q in params + [sx, sp]:
        q.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = step(mlp, lin, manager, sx, sc, sp, sdy)
    for (x, c, p, dy), w in zip(reversed(problems), reversed(want)):
        with torch.no_grad():
            sx.copy_(x)
            sc.copy_(c)
            sp.copy_(p)
            sdy.copy_(dy)
        graph.replay()
        torch.cuda.synchronize()
        assert manager is None or manager.step_check()
        n = int(c.sum())
        got = [sy[:n], sx.grad[:n], sp.grad[:n]] + [q.grad for q in params]
        for i, (a, b) in enumerate(zip(got, w)):
            assert torch.equal(a, b), f"replay output {i} differs from eager"
