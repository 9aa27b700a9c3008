"""StashManager(offload_stream=True) on CUDA: the offload pools' copies on
the manager's copy stream beside the compute (saves after the rows exist,
the sources kept from reuse, the backward of a layer starting the restores
of the layer before it) give keep's bits: three GroupedMLP layers in a
chain, every name offloaded and the offload / stash / recompute mix, two
steps (the second on handles and buffers reused), big enough rows that a
missing wait reads rows the copy has not written yet; a step whose forward
had no backward; and the same chain captured in a CUDA graph (copies on the
capture stream) replaying with keep's bits. The CPU has no streams: the
option changes nothing there (checked too)."""
import pytest
import torch

import moestash.torch as mt
import ref

E, F, LAYERS = 8, 64, 3
SHAPE = {"cuda": (4096, 512), "cpu": (256, 64)}  # R, H: on CUDA a copy outlasts the kernel after it
POLICIES = ("offload", "fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash")


def chain(device, policy, manager):
    torch.manual_seed(0)
    H = SHAPE[device.type][1]
    return [mt.GroupedMLP(E, H, F, policy=policy, stash_manager=manager, device=device) for _ in range(LAYERS)]


def data(device, seed):
    g = torch.Generator().manual_seed(seed)
    R, H = SHAPE[device.type]
    c = ref.make_counts(E, R, "padded", g).to(device)
    x, p, dy = ref.rand((R, H), g), 0.05 + torch.rand(R, generator=g), ref.rand((R, H), g)
    return x.to(device), c, p.to(device), dy.to(device)


def step(layers, manager, x, c, p, dy):
    """Forward through the chain and backward; returns y and every gradient."""
    n = int(c.sum())
    for _ in range(4):
        if manager:
            manager.step_begin()
        xx = x.clone().requires_grad_()
        for m in layers:
            m.zero_grad(set_to_none=True)
        h = xx
        for m in layers:
            h = m(h, c, p)
        h[:n].backward(dy[:n])
        if manager is None or manager.step_check():
            break
    else:
        raise AssertionError("the pools overflowed 4 times")
    return [h[:n].detach(), xx.grad[:n]] + [w.grad for m in layers for w in (m.w1, m.w2)]


@pytest.mark.parametrize("policy", POLICIES)
def test_copy_stream_gives_keeps_bits(device, policy):
    keep = chain(device, "keep", None)
    manager = mt.StashManager(offload_stream=True)
    mine = chain(device, policy, manager)
    for seed in (1, 2):
        batch = data(device, seed)
        want, got = step(keep, None, *batch), step(mine, manager, *batch)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"seed {seed}: output {i} differs from keep's"
    with torch.no_grad():  # a forward without backward: its record ends at the next step_begin
        mine[0](batch[0], batch[1], batch[2])
    got = step(mine, manager, *batch)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert (len(manager.streams) == 1) == (device.type == "cuda")
    manager.close()


def test_captured_chain_replays_keeps_bits(cuda):
    keep = chain(cuda, "keep", None)
    manager = mt.StashManager(offload_stream=True)
    mine = chain(cuda, POLICIES[1], manager)
    x, c, p, dy = data(cuda, 3)
    step(mine, manager, x, c, p, dy)  # eager: sizes the pools, makes the handles

    def fwd_bwd():
        for m in mine:
            m.zero_grad(set_to_none=True)
        h = x
        for m in mine:
            h = m(h, c, p)
        h.backward(dy)
        return h

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        manager.step_begin()
        fwd_bwd()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        manager.step_begin()
        out = fwd_bwd()
    for seed in (4, 5):
        xs, cs, ps, dys = data(cuda, seed)
        for dst, src in ((x, xs), (c, cs), (p, ps), (dy, dys)):
            dst.copy_(src)
        graph.replay()
        assert manager.step_check()
        n = int(c.sum())
        got = [out[:n].clone()] + [w.grad.clone() for m in mine for w in (m.w1, m.w2)]
        want = step(keep, None, x, c, p, dy)
        want = want[:1] + want[2:]
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"replay {seed}: output {i} differs from keep's"
