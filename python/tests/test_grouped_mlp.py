"""grouped_mlp against a float64 reference, under every activation and memory
policy (keep / stash / offload / recompute, per name), on ragged counts; every
policy gives the same bits as keep; main_grad and delayed-wgrad contracts;
the stash pools' overflow check and rerun."""
import pytest
import torch

import moestash.torch as mt
from moestash.torch.saver import parse_policy
from moestash.torch.stash import StashManager
import ref

E, R, H, F = 5, 80, 32, 16
POLICIES = ("keep", "fc2_input=recompute", "stash", "offload",
            "fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash")


def problem(device, pattern, seed, bias):
    g = torch.Generator().manual_seed(seed)
    c = ref.make_counts(E, R, pattern, g)
    t = {"x": ref.rand((R, H), g), "w1": ref.rand((E, 2 * F, H), g, H ** -0.5),
         "w2": ref.rand((E, H, F), g, F ** -0.5), "p": 0.05 + 0.95 * torch.rand(R, generator=g),
         "b1": ref.rand((E, 2 * F), g, 0.3) if bias else None, "b2": ref.rand((E, H), g, 0.3) if bias else None,
         "dy": ref.rand((R, H), g)}
    t = {k: (v.to(device) if v is not None else None) for k, v in t.items()}
    t["c"] = c.to(device)
    return t, c


LEAVES = ("x", "w1", "w2", "p", "b1", "b2")


def run(t, activation, binding=None, manager=None, main_grad=False):
    """Forward + backward over the valid rows; returns y and the gradients
    (main_grad - 0.5 for the weights when main_grad)."""
    n = int(t["c"].sum())
    lv = {k: t[k].clone().requires_grad_() for k in LEAVES if t[k] is not None}
    if main_grad:
        for k in ("w1", "w2", "b1", "b2"):
            if k in lv:
                lv[k].main_grad = torch.full(lv[k].shape, 0.5, dtype=torch.float32, device=lv[k].device)
    for _ in range(4):  # a stash step that overflowed is rerun
        if manager:
            manager.step_begin()
        y = mt.grouped_mlp(lv["x"], lv["w1"], lv["w2"], t["c"], lv["p"], activation, lv.get("b1"),
                           lv.get("b2"), binding=binding)
        y[:n].backward(t["dy"][:n])
        if binding and binding.delay_wgrad:
            binding.backward_dw()
        if manager is None or manager.step_check():
            break
        for v in lv.values():
            v.grad = None
            if hasattr(v, "main_grad"):
                v.main_grad.fill_(0.5)
    else:
        raise AssertionError("the stash pools overflowed four times")
    out = {"y": y[:n].detach(), "x": lv["x"].grad[:n], "p": lv["p"].grad[:n]}
    for k in ("w1", "w2", "b1", "b2"):
        if k in lv:
            if main_grad:
                assert lv[k].grad is None, f"{k}.grad set although it has main_grad"
                out[k] = lv[k].main_grad - 0.5
            else:
                out[k] = lv[k].grad
    return out


def reference(t, c, activation):
    n = int(c.sum())
    lv = {k: t[k].detach().cpu().double().requires_grad_() for k in LEAVES if t[k] is not None}
    y = ref.mlp(lv["x"], lv["w1"], lv["w2"], c, lv["p"], activation, lv.get("b1"), lv.get("b2"))
    y.backward(t["dy"][:n].cpu().double())
    out = {"y": y.detach(), "x": lv["x"].grad[:n], "p": lv["p"].grad[:n]}
    out.update({k: lv[k].grad for k in ("w1", "w2", "b1", "b2") if k in lv})
    return out


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("pattern", ref.PATTERNS)
@pytest.mark.parametrize("bias", [False, True])
def test_keep_vs_float64(device, activation, pattern, bias):
    t, c = problem(device, pattern, 3 + ref.PATTERNS.index(pattern), bias)
    if activation == "clamped_swiglu":
        t["x"] = t["x"] * 6  # reach the clamps
    if activation == "clamped_swiglu":
        far = ref.far_from_clamps(t["x"].cpu(), t["w1"].cpu(), c, _cpu(t["b1"]))
        assert far.double().mean() > 0.6, "too few rows away from the clamps"
        t["dy"][: int(c.sum())][~far.to(device)] = 0  # no gradient through a row at an edge
    got, want = run(t, activation), reference(t, c, activation)
    for k in want:
        ref.assert_close(got[k], want[k], k)


def _cpu(t):
    return t.cpu() if t is not None else None


@pytest.mark.parametrize("policy", POLICIES[1:])
@pytest.mark.parametrize("pattern", ["ragged", "padded"])
def test_every_policy_gives_the_bits_of_keep(device, policy, pattern):
    t, _ = problem(device, pattern, 21, True)
    keep = run(t, "swiglu")
    manager = StashManager(page_rows=8, initial_rows=R // 4)  # too small at first: overflow, grow, rerun
    got = run(t, "swiglu", mt.Binding(policy, manager), manager)
    for k in keep:
        assert torch.equal(got[k], keep[k]), f"{policy}: {k} differs from keep"
    if manager.pools:
        assert manager.overflows >= 1
        assert all(r["peak_pages"] >= 0 for r in manager.report())


@pytest.mark.parametrize("policy", ["keep", "stash"])
def test_main_grad_sentinel(device, policy):
    t, c = problem(device, "skew", 31, True)
    manager = StashManager(page_rows=8) if policy == "stash" else None
    got = run(t, "swiglu", mt.Binding(policy, manager), manager, main_grad=True)
    want = reference(t, c, "swiglu")
    for k in want:
        ref.assert_close(got[k], want[k], k)


@pytest.mark.parametrize("policy", ["keep", "stash"])
def test_delayed_wgrad(device, policy):
    t, c = problem(device, "ragged", 41, True)
    manager = StashManager(page_rows=8) if policy == "stash" else None
    binding = mt.Binding(policy, manager, delay_wgrad=True)
    got = run(t, "swiglu", binding, manager, main_grad=True)
    want = reference(t, c, "swiglu")
    for k in want:
        ref.assert_close(got[k], want[k], k)
    keep = run(t, "swiglu", main_grad=True)
    for k in keep:
        assert torch.equal(got[k], keep[k]), f"delayed: {k} differs from the immediate wgrad"


FP8 = "fc1_input=stash:fp8,act_input=offload:fp8,fc2_input=stash:fp8,probs=stash"


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("policy", [FP8, "stash:fp8"])
def test_fp8_pages(device, policy):
    """fp8 pages (e4m3, a scale per 128 values): the forward is keep's bit for
    bit, the backward within the error of its quantized activations (not
    keep's bits), the same bits run to run; the pools hold fp8 rows (W codes
    and a 4-byte scale per row of these widths) and probs plain pages."""
    t, _ = problem(device, "ragged", 51, True)
    keep = run(t, "swiglu")
    got = []
    for _ in range(2):
        manager = StashManager(page_rows=8, initial_rows=R // 4)
        got.append(run(t, "swiglu", mt.Binding(policy, manager), manager))
        pages = {r["name"]: (r["policy"], r["page_bytes"]) for r in manager.report()}
        widths = {"fc1_input": H, "act_input": 2 * F, "fc2_input": F}
        for name, w in widths.items():
            assert pages[name] == (parse_policy(policy)[("fc1_input", "act_input", "fc2_input").index(name)],
                                   8 * (w + 4)), pages
        assert pages["probs"] == ("stash", 8 * 4), pages
    assert torch.equal(got[0]["y"], keep["y"])
    for k in keep:
        assert torch.equal(got[0][k], got[1][k]), f"{policy}: {k} differs run to run"
        if k != "y":
            assert _rel(got[0][k], keep[k]) < 0.05, f"{policy}: {k} off keep's by {_rel(got[0][k], keep[k]):.4f}"
    assert any(not torch.equal(got[0][k], keep[k]) for k in keep), "fp8 pages gave keep's bits: were they fp8?"


def test_fp8_policy_spelling():
    assert parse_policy("stash:fp8") == ("stash:fp8", "stash:fp8", "stash:fp8", "stash")
    assert parse_policy("act_input=stash:bf16") == ("keep", "stash", "keep", "keep")
    with pytest.raises(ValueError, match="probs is fp32"):
        parse_policy("probs=stash:fp8")
    with pytest.raises(ValueError, match="stash:fp9"):
        parse_policy("stash:fp9")
