"""ExpertParallel (dispatch and combine as autograd ops over a process
group) on the CPU: 2 and 4 ranks as threads of this process, each with a
gloo process group (ranks.py) and the library's CPU twin communicator
(the same ops and the same process-group calls as a torchrun job on GPUs;
tests/test_ep_gpu.py runs those).

- dispatch's layout, bit for bit: each rank's rows are the token rows of
  its experts, expert-major, by source rank, then token, then slot; the row
  probs likewise; counts per local expert.
- dispatch -> this rank's experts (the grouped MLP) -> combine, forward and
  backward, against one process computing the same MoE layer without
  expert parallelism in float64 (every (token, slot) through its expert's
  MLP, the bf16 roundings of the library's contract at the same places):
  each rank's y, dx, dprobs and its experts' weight gradients, with the
  probs applied by the experts (dispatch's row probs) or by the combine,
  into fresh rows or into the communicator's window, fresh random inputs,
  ranks with different token counts. Every output the library writes is
  poisoned first (NaN, counts -1; the window too): rows past sum(counts)
  stay poisoned, so a padding row read, or a row left unwritten, shows.
- routed_experts(..., ep=) gives the same bits as the explicit ops.
- over budget (max_rows too small): check() says so; no crash.
"""
import pytest
import torch

import moestash
import moestash.torch as mt
import moestash.torch.ep as ep_mod
import ref
from ranks import run_ranks


def poisoned(shape, dtype, device):
    """An output dispatch, combine or their backwards write: NaN (counts -1)."""
    return torch.full(shape if isinstance(shape, tuple) else (shape,), -1 if dtype == torch.int32 else float("nan"),
                      dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(ep_mod, "_out", poisoned)

E, K, H, F = 8, 2, 32, 16
N_MAX = 40


def tokens(rank):
    return 24 + 5 * rank  # ranks with different token counts


def problem(world, seed):
    """Global experts' weights, and per rank: x [N, H], topk_idx [N, k]
    (distinct experts per token), probs [N, k], dy [N, H]."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = ref.rand((E, 2 * F, H), g, H ** -0.5), ref.rand((E, H, F), g, F ** -0.5)
    ranks = []
    for r in range(world):
        n = tokens(r)
        idx = torch.rand(n, E, generator=g).topk(K, dim=-1).indices
        ranks.append({"x": ref.rand((n, H), g), "idx": idx, "p": 0.05 + 0.95 * torch.rand(n, K, generator=g),
                      "dy": ref.rand((n, H), g)})
    return w1, w2, ranks


def reference(w1, w2, rk, probs_in):
    """float64 y and the gradients of x, probs, w1, w2 for one rank's tokens
    (the weights' gradients: this rank's tokens' share)."""
    x, p, w1d, w2d = (t.double().requires_grad_() for t in (rk["x"], rk["p"], w1, w2))
    n = x.shape[0]
    e = rk["idx"].reshape(-1)  # [n k]
    xr = x.repeat_interleave(K, 0)  # [n k, H], slot order
    pr = p.reshape(-1)
    h = ref.bf16_round(torch.einsum("rh,rfh->rf", xr, w1d[e]))
    z = ref.bf16_round(torch.nn.functional.silu(h[:, :F]) * h[:, F:] * (pr[:, None] if probs_in == "experts" else 1))
    yr = torch.einsum("rf,rhf->rh", z, w2d[e])
    if probs_in == "experts":
        yr = ref.bf16_round(yr)  # the experts' output rows are bf16; the combine sums them in fp32
    else:
        yr = ref.bf16_round(yr) * pr[:, None]
    y = yr.view(n, K, H).sum(1)
    y.backward(rk["dy"].double())
    return y.detach(), x.grad, p.grad, w1d.grad, w2d.grad


def layer(rank, group, w1, w2, rk, probs_in, window, device="cpu", path="auto"):
    """This rank's MoE layer over a communicator of its own: y, dx,
    dprobs, and its experts' gradients (on the CPU)."""
    ep = mt.ExpertParallel(E, K, H, max_tokens=N_MAX, window_rows=N_MAX * K * 4 if window else 0, device=device,
                           group=group, path=path)
    El, lo = ep.n_local, rank * ep.n_local
    stash = mt.StashManager() if window else None
    binding = mt.Binding("fc1_input=stash" if window else "keep", stash)
    rk = {k: v.to(device) for k, v in rk.items()}
    x, p = rk["x"].clone().requires_grad_(), rk["p"].clone().requires_grad_()
    lw1, lw2 = (w[lo:lo + El].to(device).clone().requires_grad_() for w in (w1, w2))
    for _ in range(3):  # a stash step that overflowed is rerun
        if stash:
            stash.step_begin()
        if window:
            for t in ep.window():
                t.fill_(float("nan"))  # rows past sum(counts) stay NaN: a read of one shows
        rows, row_probs, counts, route = ep.dispatch(x, rk["idx"], p if probs_in == "experts" else None,
                                                     window=window)
        if probs_in == "experts":
            row_probs = row_probs.clone() if window else row_probs
            out = mt.grouped_mlp(rows, lw1, lw2, counts, row_probs, binding=binding)
            y = ep.combine(out, route)
        else:
            ones = torch.ones(ep.max_rows, dtype=torch.float32, device=device)
            out = mt.grouped_mlp(rows, lw1, lw2, counts, ones, binding=binding)
            y = ep.combine(out, route, p)
        y.backward(rk["dy"])
        if stash is None or stash.step_check():
            break
        for t in (x, p, lw1, lw2):
            t.grad = None
    assert ep.check(), "budgets passed"
    res = {"y": y.detach(), "x": x.grad, "p": p.grad, "w1": lw1.grad, "w2": lw2.grad, "counts": counts}
    res = {k: v.cpu() for k, v in res.items()}
    ep.close()
    if stash:
        stash.close()
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_layout(world):
    w1, w2, ranks = problem(world, 11 + world)

    def fn(rank, group):
        ep = mt.ExpertParallel(E, K, H, max_tokens=N_MAX, device="cpu", group=group)
        rk = ranks[rank]
        rows, row_probs, counts, _ = ep.dispatch(rk["x"], rk["idx"], rk["p"])
        out = (rows.clone(), row_probs.clone(), counts.clone(), ep.n_local, ep.path)
        ep.close()
        return out

    out = run_ranks(world, fn)
    for rank, (rows, row_probs, counts, El, path) in enumerate(out):
        assert path.startswith("local threads")
        want_rows, want_p, want_counts = [], [], []
        for e in range(rank * El, (rank + 1) * El):  # expert-major, then source rank, token, slot
            n = 0
            for rk in ranks:
                for t in range(rk["x"].shape[0]):
                    for s in range(K):
                        if rk["idx"][t, s] == e:
                            want_rows.append(rk["x"][t])
                            want_p.append(rk["p"][t, s])
                            n += 1
            want_counts.append(n)
        n = sum(want_counts)
        assert counts.tolist() == want_counts
        assert torch.equal(rows[:n], torch.stack(want_rows)), f"rank {rank}: rows"
        assert torch.equal(row_probs[:n], torch.stack(want_p)), f"rank {rank}: row probs"
        assert rows[n:].isnan().all() and row_probs[n:].isnan().all(), f"rank {rank}: a row past sum(counts) written"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("probs_in,window", [("experts", False), ("combine", False), ("experts", True)])
def test_moe_layer_against_single_process(world, probs_in, window):
    seed = 100 + world * 10 + (probs_in == "combine") * 3 + window
    w1, w2, ranks = problem(world, seed)
    out = run_ranks(world, lambda r, g: layer(r, g, w1, w2, ranks[r], probs_in, window))
    for rank, got in enumerate(out):
        check_rank(got, rank, world, w1, w2, ranks, probs_in)


def check_rank(got, rank, world, w1, w2, ranks, probs_in):
    """One rank's layer() against the float64 single-process reference."""
    refs = [reference(w1, w2, rk, probs_in) for rk in ranks]
    g_w1 = sum(r[3] for r in refs)  # every rank's tokens reach the experts' gradients
    g_w2 = sum(r[4] for r in refs)
    y, dx, dp = refs[rank][:3]
    El = E // world
    for name, a, b in (("y", got["y"], y), ("dx", got["x"], dx), ("dprobs", got["p"], dp),
                       ("dw1", got["w1"], g_w1[rank * El:(rank + 1) * El]),
                       ("dw2", got["w2"], g_w2[rank * El:(rank + 1) * El])):
        assert torch.isfinite(a).all(), f"rank {rank} {name}: not finite (a padding row read?)"
        ref.assert_close(a, b, f"rank {rank} of {world} {name}")


def test_routed_experts_is_the_ops():
    """routed_experts(ep=) against the explicit dispatch, grouped MLP, combine: same bits."""
    world = 2
    w1, w2, ranks = problem(world, 7)

    def fn(rank, group):
        ep = mt.ExpertParallel(E, K, H, max_tokens=N_MAX, device="cpu", group=group)
        El = ep.n_local
        rk = ranks[rank]
        lw1, lw2 = w1[rank * El:(rank + 1) * El], w2[rank * El:(rank + 1) * El]
        y = mt.routed_experts(rk["x"], rk["idx"], rk["p"], lw1, lw2, mt.Binding(), ep=ep)  # a binding per thread
        mine = layer(rank, group, w1, w2, rk, "experts", False)["y"]
        ep.close()
        return y, mine

    for y, mine in run_ranks(world, fn):
        assert torch.equal(y, mine)


def test_over_budget_is_flagged():
    world = 2
    _, _, ranks = problem(world, 3)

    def fn(rank, group):
        ep = mt.ExpertParallel(E, K, H, max_tokens=N_MAX, max_rows=4, device="cpu", group=group)
        rk = ranks[rank]
        rows, _, counts, route = ep.dispatch(rk["x"], rk["idx"])
        ep.combine(rows, route)
        flagged = not ep.check()
        again = ep.check()  # the check clears the flag
        ep.close()
        return flagged, again

    assert run_ranks(world, fn) == [(True, True)] * world


def test_bad_arguments_are_named():
    def fn(rank, group):
        with pytest.raises(ValueError, match="path 'nvlink'"):
            mt.ExpertParallel(E, K, H, max_tokens=N_MAX, path="nvlink", device="cpu", group=group)
        ep = mt.ExpertParallel(E, K, H, max_tokens=N_MAX, device="cpu", group=group)
        x = torch.zeros(N_MAX + 1, H, dtype=torch.bfloat16)
        with pytest.raises(moestash.InvalidArgument, match="max_tokens"):
            ep.dispatch(x, torch.zeros(N_MAX + 1, K, dtype=torch.int64))
        with pytest.raises(ValueError, match="window=True needs fc1_input"):
            mt.routed_experts(x[:4], torch.zeros(4, K, dtype=torch.int64), torch.ones(4, K),
                              torch.zeros(E // 2, 2 * F, H, dtype=torch.bfloat16),
                              torch.zeros(E // 2, H, F, dtype=torch.bfloat16), ep=ep, window=True)
        ep.close()
        with pytest.raises(RuntimeError, match="closed"):
            ep.dispatch(x[:4], torch.zeros(4, K, dtype=torch.int64))
        return True

    assert run_ranks(2, fn) == [True, True]


def test_cpu_ranks_in_other_processes_are_refused():
    """The CPU twin joins ranks that are threads of one process: a rank whose
    rank 0 is in another process (the broadcast carries its pid) is told so."""

    class Done:
        def wait(self):
            return True

    class OtherProcessGroup:  # rank 1 of 2, rank 0 elsewhere
        def rank(self):
            return 1

        def size(self):
            return 2

        def broadcast(self, t, root):
            t.copy_(torch.tensor([-1, 7]))  # no process has id -1
            return Done()

        def allreduce(self, ts):
            return Done()

    with pytest.raises(RuntimeError, match="threads of one process"):
        mt.ExpertParallel(E, K, H, max_tokens=N_MAX, device="cpu", group=OtherProcessGroup())
