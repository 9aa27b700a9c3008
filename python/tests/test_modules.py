"""The modules: parameters laid out as the ops take them, a policy given as a
dict or a string, delayed wgrad through backward_dw(), the same bits as the
ops they wrap."""
import weakref

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
        m.bias.copy_(ref.rand(m.bias.shape, torch.Generator().manual_seed(4)))
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
    dy = ref.rand((R, H), torch.Generator().manual_seed(5)).to(device)
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


class _Probe:
    """Lives as long as the AccumulateGrad node it hangs on (weakref-able)."""


def _probe_accumulator(param):
    """A weakref that dies with the AccumulateGrad node autograd uses for
    `param` now (the node of the graph alive at the call)."""
    probe = _Probe()
    acc = param.expand_as(param).grad_fn.next_functions[0][0]
    acc.register_prehook(lambda *_, _probe=probe: None)
    return weakref.ref(probe)


@pytest.mark.parametrize("policy,delay", [("keep", False), ("fc1_input=stash,act_input=offload,"
                                                            "fc2_input=recompute,probs=stash", False),
                                          ("keep", True)])
def test_step_graph_dies_with_its_outputs(device, policy, delay):
    """Once a step's outputs are gone, nothing the ops hold keeps its autograd
    graph alive: a kept graph keeps the weights' AccumulateGrad nodes, made on
    that step's stream, into the next step, and a backward captured on a side
    stream (torch.cuda.graph) then syncs with the default stream and fails."""
    torch.manual_seed(0)
    manager = mt.StashManager(page_rows=8)
    lin = mt.GroupedLinear(E, H, H, bias=True, delay_wgrad_compute=delay, device=device)
    mlp = mt.GroupedMLP(E, H, F, bias=True, policy=policy, stash_manager=manager, delay_wgrad_compute=delay,
                        device=device)
    if delay:
        for q in list(lin.parameters()) + list(mlp.parameters()):
            q.main_grad = torch.zeros(q.shape, device=device)
    x, c, p = inputs(device, 6)
    xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
    manager.step_begin()
    y = mlp(lin(xx, c), c, pp)  # (a deferred wgrad takes no row_scale gradient)
    probes = [_probe_accumulator(q) for q in (lin.weight, mlp.w1, mlp.w2)]
    y.backward(ref.rand((R, H), torch.Generator().manual_seed(7)).to(device))
    assert manager.step_check()
    del y  # no gc.collect(): a graph kept by a reference cycle lives into the next step too
    assert all(r() is None for r in probes), "a weight's AccumulateGrad node outlived its step's outputs"
    if delay:
        lin.backward_dw()
        mlp.backward_dw()


def test_library_memory(device):
    """The library's own memory (workspaces, stash pages), which torch's
    allocator does not see, is reported for the device however it is named."""
    torch.manual_seed(0)
    manager = mt.StashManager(page_rows=8)
    mlp = mt.GroupedMLP(E, H, F, policy="stash", stash_manager=manager, device=device)
    x, c, p = inputs(device, 8)
    manager.step_begin()
    mlp(x.clone().requires_grad_(), c, p).float().sum().backward()
    assert manager.step_check()
    names = [device, str(device)]  # cuda: "cuda" and cuda:<current> name one device
    if device.type == "cuda":
        names.append(torch.device("cuda", torch.cuda.current_device()))
    in_use, peak = mt.library_memory(device)
    pool_bytes = sum(r["pages"] * r["page_bytes"] for r in manager.report())
    assert peak >= in_use >= pool_bytes > 0
    assert all(mt.library_memory(n) == (in_use, peak) for n in names)


def test_only_device_pages_are_read_in_place():
    """The backward reads stashed fc1_input / act_input / fc2_input from their
    device pages; offloaded ones (host pages, over PCIe) and probs are
    restored first, and so is every name when the wgrads are deferred."""
    from moestash.torch.saver import ACT_INPUT, FC1_INPUT, FC2_INPUT, PROBS, Saver, parse_policy
    s = Saver(parse_policy("fc1_input=offload,act_input=stash,fc2_input=stash,probs=stash"), mt.StashManager())
    s.backward(torch.device("cpu"), None, None, restore_all=False)
    assert [s.in_place(n) for n in (FC1_INPUT, ACT_INPUT, FC2_INPUT, PROBS)] == [False, True, True, False]
    s.backward(torch.device("cpu"), None, None, restore_all=True)
    assert not any(s.in_place(n) for n in (FC1_INPUT, ACT_INPUT, FC2_INPUT, PROBS))


def test_forward_without_backward(device):
    """A forward whose backward never runs (under torch.no_grad(), or an
    output dropped) holds its record and handles until the next
    step_begin() only: steps of such forwards reuse the same handles. A
    backward across a step_begin() is refused, not fed reset pages."""
    torch.manual_seed(0)
    manager = mt.StashManager(page_rows=8)
    mlp = mt.GroupedMLP(E, H, F, policy="stash", stash_manager=manager, device=device)
    x, c, p = inputs(device, 9)
    handles = []
    for _ in range(3):
        manager.step_begin()
        assert not manager.records
        with torch.no_grad():
            for _ in range(4):
                mlp(x, c, p)
        assert len(manager.records) == 4
        handles.append(sum(len(pool.handles) for pool in manager.pools.values()))
    assert handles[0] > 0 and handles == [handles[0]] * 3, f"handles made per step: {handles}"
    y = mlp(x.clone().requires_grad_(), c, p)
    manager.step_begin()
    with pytest.raises(RuntimeError, match="step_begin"):
        y.float().sum().backward()


@pytest.mark.parametrize("policy", ["stash", "fc1_input=offload,act_input=stash:fp8,fc2_input=recompute,probs=stash"])
def test_pools_sized_in_one_rerun(device, policy):
    """A stack of layers sharing one manager: the first step overflows the
    pools made for one layer's save, they grow to the step's need at once
    (every save fills its max_rows here: the need is exact, no margin), the
    rerun passes, later steps keep the same pools, and the bits are keep's."""
    n_layers, page_rows = 5, 32  # R = 48 rows: 2 pages a save, 16 rows of the second unused
    counts = torch.tensor([20, 0, 13, 15], dtype=torch.int32, device=device)  # sum R: every row a save's
    x, _, p = inputs(device, 10)

    def stack(policy, manager):
        torch.manual_seed(0)
        return [mt.GroupedMLP(E, H, H // 2, policy=policy, stash_manager=manager, device=device)
                for _ in range(n_layers)]

    def step(layers, manager):
        xx = x.clone().requires_grad_()
        for attempt in range(1, 4):
            for m in layers:
                m.zero_grad(set_to_none=True)
            xx.grad = None
            if manager:
                manager.step_begin()
            y = xx
            for m in layers:
                y = m(y, counts, p)
            y.float().square().sum().backward()
            if manager is None or manager.step_check():
                return attempt, [y, xx.grad] + [q.grad for m in layers for q in m.parameters()]
        raise AssertionError("three attempts and the pools still overflow")

    _, want = step(stack("keep", None), None)
    manager = mt.StashManager(page_rows=page_rows)
    layers = stack(policy, manager)
    attempts, got = step(layers, manager)
    assert attempts == 2 and manager.overflows == 1
    need = n_layers * -(-R // page_rows)
    pools = dict(manager.pools)
    assert pools and all(r["pages"] == need == r["peak_pages"] for r in manager.report()), manager.report()
    for _ in range(2):
        attempts, again = step(layers, manager)
        assert attempts == 1 and manager.pools == pools and all(a is b for a, b in zip(manager.pools.values(),
                                                                                        pools.values()))
        for a, b in zip(got, again):
            assert torch.equal(a, b)
    if ":fp8" not in policy:
        for a, b in zip(got, want):
            assert torch.equal(a, b), "a paged policy changed the bits of keep"
