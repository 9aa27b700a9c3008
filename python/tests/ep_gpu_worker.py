"""Expert parallelism over NCCL, one rank per GPU: run by test_ep_gpu.py as
    torchrun --standalone --nproc-per-node 2 python/tests/ep_gpu_worker.py
(any number of GPUs dividing 8). Every rank prints one line per check, "ok"
or "FAIL <why>", and the job exits 1 when a check failed on any rank.

- dispatch -> grouped MLP -> combine, forward and backward, against the
  float64 single-process reference of test_ep.py (the CPU test's checks, on
  the GPUs, over the library's own NCCL communicator made from its unique
  id broadcast through torch's process group): the send/recv path, the
  path `auto` picks (the device API where every GPU is load/store
  reachable), probs applied by the experts or by the combine, and into the
  communicator's window rows (then with the same bits as fresh rows);
- the forward and backward captured in one torch.cuda.graph and replayed
  on new tokens: the bits of the eager step on the same tokens;
- patch_qwen3_moe(ep=) against transformers' model on all ranks' batches
  (test_qwen3_moe.py's checks).
"""
import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moestash.torch as mt  # noqa: E402
import test_ep as T  # noqa: E402
import test_qwen3_moe as Q  # noqa: E402


def layers(rank, world, group, dev):
    w1, w2, ranks = T.problem(world, 500)
    for path in ("p2p", "auto"):
        for probs_in, window in (("experts", False), ("combine", False), ("experts", True)):
            got = T.layer(rank, group, w1, w2, ranks[rank], probs_in, window, dev, path)
            T.check_rank(got, rank, world, w1, w2, ranks, probs_in)
            if window:  # the same bits as into fresh rows
                fresh = T.layer(rank, group, w1, w2, ranks[rank], probs_in, False, dev, path)
                for k in got:
                    assert torch.equal(got[k], fresh[k]), f"{path} window: {k} differs from fresh rows"


def capture(rank, world, group, dev, path):
    w1, w2, _ = T.problem(world, 600)
    ep = mt.ExpertParallel(T.E, T.K, T.H, max_tokens=T.N_MAX, device=dev, group=group, path=path)
    El = ep.n_local
    binding = mt.Binding()
    lw1, lw2 = (w[rank * El:(rank + 1) * El].to(dev).requires_grad_() for w in (w1, w2))
    n = T.tokens(rank)
    sx = torch.empty(n, T.H, dtype=torch.bfloat16, device=dev)
    sidx = torch.empty(n, T.K, dtype=torch.int64, device=dev)
    sp = torch.empty(n, T.K, dtype=torch.float32, device=dev)
    sdy = torch.empty(n, T.H, dtype=torch.bfloat16, device=dev)

    def load(seed):
        rk = T.problem(world, seed)[2][rank]
        for dst, k in ((sx, "x"), (sidx, "idx"), (sp, "p"), (sdy, "dy")):
            dst.copy_(rk[k])

    def step():
        x, p = sx.detach().requires_grad_(), sp.detach().requires_grad_()
        y = mt.routed_experts(x, sidx, p, lw1, lw2, binding, ep=ep)
        return (y.detach(), *torch.autograd.grad(y, (x, p, lw1, lw2), sdy))

    load(601)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture: makes the route the capture takes
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (602, 603):
        load(seed)
        graph.replay()
        got = [o.clone() for o in outs]
        want = step()
        for name, a, b in zip(("y", "dx", "dprobs", "dw1", "dw2"), got, want):
            assert torch.isfinite(a).all() and torch.equal(a, b), f"{path} replay {seed}: {name} differs from eager"
    assert ep.check()
    ep.close()


def qwen3(rank, world, group, dev):
    copies, ids, want, wg = Q.ep_reference(world, dev)
    Q.check_ep_rank(Q.ep_rank_step(copies[rank], ids, rank, world, group, dev), rank, world, want, wg)


def main():
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    T.ep_mod._out = T.poisoned  # the library's outputs poisoned first, as in the CPU test
    # a rank stuck in a collective (a check failed on a peer mid-way) ends the job in minutes, not hours
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=180))
    group = dist.group.WORLD
    probe = mt.ExpertParallel(T.E, T.K, T.H, max_tokens=T.N_MAX, device=dev, group=group)
    print(f"[rank {rank}] {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, auto path: {probe.path}",
          flush=True)
    probe.close()
    checks = [("layers vs float64 reference", lambda: layers(rank, world, group, dev)),
              ("graph capture p2p", lambda: capture(rank, world, group, dev, "p2p")),
              ("graph capture auto", lambda: capture(rank, world, group, dev, "auto")),
              ("qwen3-moe ep vs transformers", lambda: qwen3(rank, world, group, dev))]
    failed = 0
    for name, fn in checks:
        try:
            fn()
            print(f"[rank {rank}] {name}: ok", flush=True)
        except Exception as e:  # noqa: BLE001 (reported, counted)
            failed += 1
            print(f"[rank {rank}] {name}: FAIL {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
    flag = torch.tensor([failed], device=dev)
    dist.all_reduce(flag)
    dist.destroy_process_group()
    print(f"[rank {rank}] {'all checks passed' if flag.item() == 0 else f'{flag.item()} check(s) failed'}", flush=True)
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
