#!/usr/bin/env python3
"""GroupedMLP forward + backward through PyTorch (CUDA), three comparisons:

  1. binding overhead: moestash.torch.GroupedMLP (biases, main_grad on every
     parameter: wgrad ACCUMULATE, as `moestash bench mlp` runs it) against
     the C benchmark's figure for the same shape and counts (its JSON,
     --c-json); eager (PyTorch dispatch + ctypes; iterations back to back,
     and each synced), and replayed from a torch.cuda.graph. Target: eager
     <= 1.03x the C time.
  2. against the PyTorch baseline of bench/torch/mlp.py (torch._grouped_mm
     fc1 and fc2, autograd), same shape and counts. Target >= 1.5x on
     131072 x 4096 x 1024, E = 64.
  3. the example's peak memory (examples/torch_moe_layer.py --json,
     --example-json): the moestash mix (offload / stash / recompute) against
     the PyTorch layer with static capacity buffers (target <= 0.75x) and
     against torch._grouped_mm; each policy's step time against keep's
     (stash alone: target <= 1.05x) and offload's copies against the
     pinned roof.

usage: python3 python/bench/bench_mlp.py --c-json bench-mlp.json
           [--example-json py-example.json] [--json FILE] [--iters N] [--shape I]
"""
import argparse
import json
import os
import sys

import torch

import moestash.torch as mt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "torch"))
import mlp as torch_mlp  # noqa: E402  (the PyTorch baseline of `moestash bench mlp`)


def module(rows, H, F, E, counts, dev):
    """GroupedMLP with the baseline's weights and inputs, main_grad everywhere."""
    base = torch_mlp.Mlp(rows, H, F, E, counts, dev)
    m = mt.GroupedMLP(E, H, F, bias=True, device=dev)
    with torch.no_grad():
        for dst, src in ((m.w1, base.w1), (m.b1, base.b1), (m.w2, base.w2), (m.b2, base.b2)):
            dst.copy_(src)
            dst.main_grad = torch.zeros(dst.shape, dtype=torch.float32, device=dev)
    c = torch.tensor(counts, dtype=torch.int32, device=dev)
    return base, m, c


def no_grads(leaves):
    """Every iteration starts as a training step does (zero_grad(set_to_none)):
    backward hands its gradients to the leaves, adding none into an old .grad
    (for x [R, H] that add is a pass of about 1 ms at 131072 x 4096, which the C
    benchmark, writing dx, does not make)."""
    for t in leaves:
        t.grad = None


def time_eager(fn, dy, iters, leaves, sync_each=False):
    """Mean ms of forward and of backward (CUDA events around each) and of
    one iteration: the span of the timed iterations / iters, gaps included.
    Back to back as a training loop runs them (the host runs ahead of the
    GPU, and the span shows whether it keeps up); sync_each: each iteration
    waits for the one before (the GPU idles while the host launches: its
    latency shows in forward and backward)."""
    marks = []
    for i in range(iters + 2):
        no_grads(leaves)
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        y = fn()
        e[1].record()
        y.backward(dy)
        e[2].record()
        if sync_each:
            torch.cuda.synchronize()
        if i >= 2:
            marks.append(e)
        del y
    torch.cuda.synchronize()
    fwd = sum(e[0].elapsed_time(e[1]) for e in marks) / iters
    bwd = sum(e[1].elapsed_time(e[2]) for e in marks) / iters
    return fwd, bwd, marks[0][0].elapsed_time(marks[-1][2]) / iters


def time_graph(fn, dy, iters, leaves):
    """Mean ms of one replay of the captured forward + backward."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    no_grads(leaves)
    with torch.cuda.stream(s):
        fn().backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    no_grads(leaves)  # the captured backward writes fresh gradients, as each eager iteration
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn().backward(dy)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def check_same(base, m, c, x, p):
    """The moestash module and the baseline agree before they are timed."""
    with torch.no_grad():
        a = m(x, c, p).float()
        b = base.grouped().float()
    err = ((a - b).norm() / b.norm()).item()
    if not err < 1e-2:
        raise SystemExit(f"bench: moestash vs torch._grouped_mm rel err {err:.3g}")
    return err


def measure(s, iters, dev):
    """One shape of the C benchmark's JSON: its figure, ours, torch's."""
    rows, H, F, E, counts = s["rows"], s["hidden"], s["ffn"], s["E"], s["counts"]
    base, m, c = module(rows, H, F, E, counts, dev)
    x = base.x.detach().clone().requires_grad_()
    p = base.p.detach().clone().requires_grad_()
    err = check_same(base, m, c, x, p)
    ours_f, ours_b, ours_ms = time_eager(lambda: m(x, c, p), base.dy, iters, [x, p])  # weights: main_grad
    sync_f, sync_b, _ = time_eager(lambda: m(x, c, p), base.dy, iters, [x, p], sync_each=True)
    ours_graph = time_graph(lambda: m(x, c, p), base.dy, iters, [x, p])
    _, _, gmm_ms = time_eager(base.grouped, base.dy, iters, [base.x, base.p, base.w1, base.b1, base.w2, base.b2])
    c_ms = s["fwd_ms"] + s["bwd_ms"]
    return {"rows": rows, "hidden": H, "ffn": F, "E": E, "rel_err_vs_torch": err, "c_ms": c_ms,
            "eager_ms": ours_ms, "eager_fwd_ms": ours_f, "eager_bwd_ms": ours_b,
            "eager_synced_ms": sync_f + sync_b, "graph_ms": ours_graph,
            "overhead_eager": ours_ms / c_ms, "overhead_eager_synced": (sync_f + sync_b) / c_ms,
            "overhead_graph": ours_graph / c_ms,
            "torch_grouped_mm_ms": gmm_ms, "speedup_vs_grouped_mm": gmm_ms / ours_ms}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--c-json", required=True, help="bench-mlp.json of `moestash bench mlp`")
    ap.add_argument("--example-json")
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench: no CUDA device", file=sys.stderr)
        return 2
    dev = "cuda"
    with open(args.c_json) as f:
        c_bench = json.load(f)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; C figures from {args.c_json}")
    out = {"device": torch.cuda.get_device_name(), "shapes": []}
    hdr = (f"{'rows':>7} {'H':>5} {'F':>5} {'E':>4} | {'C f+b ms':>8} | {'eager ms':>8} {'ratio':>6} | "
           f"{'synced ms':>9} {'ratio':>6} | {'graph ms':>8} {'ratio':>6} | {'torch gmm ms':>12} {'speedup':>7}")
    lines = []
    for s in c_bench["shapes"]:
        r = measure(s, args.iters, dev)
        out["shapes"].append(r)
        lines.append(f"{r['rows']:>7} {r['hidden']:>5} {r['ffn']:>5} {r['E']:>4} | {r['c_ms']:>8.3f} | "
                     f"{r['eager_ms']:>8.3f} {r['overhead_eager']:>5.3f}x | "
                     f"{r['eager_synced_ms']:>9.3f} {r['overhead_eager_synced']:>5.3f}x | "
                     f"{r['graph_ms']:>8.3f} {r['overhead_graph']:>5.3f}x | "
                     f"{r['torch_grouped_mm_ms']:>12.3f} {r['speedup_vs_grouped_mm']:>6.2f}x")
        torch.cuda.empty_cache()
    print(hdr)
    print("\n".join(lines))
    print("ratio: moestash through PyTorch / the C benchmark (target eager <= 1.03x); eager: iterations back to "
          "back, as a training loop; synced: each waits for the one before (host latency shows); "
          "speedup: torch._grouped_mm MLP / moestash, both eager (target >= 1.5x on 131072 x 4096 x 1024, E 64)")
    if args.example_json and os.path.exists(args.example_json):
        with open(args.example_json) as f:
            ex = {(r["kind"], r["graph"]): r for r in json.load(f)["results"]}
        out["example_peak_mib"] = {}
        for graphed in (False, True):
            if ("torch", graphed) not in ex:
                continue
            kinds = ("torch", "torch_capacity", "keep", "stash", "offload", "mix", "offload+s", "mix+s")
            peaks = {kind: ex[(kind, graphed)]["step_peak_mib"] for kind in kinds if (kind, graphed) in ex}
            out["example_peak_mib"]["graph" if graphed else "eager"] = peaks
            t, cap, mix = peaks["torch"], peaks["torch_capacity"], peaks.get("mix", peaks.get("stash"))
            print(f"example step peak memory ({'graph' if graphed else 'eager'}): "
                  + ", ".join(f"{kind} {v:.0f} MiB" for kind, v in peaks.items())
                  + f": the mix / static capacity {mix / cap:.2f}x (target <= 0.75x), the mix / grouped_mm "
                  f"{mix / t:.2f}x")
            for kind in ("stash", "offload", "mix", "offload+s", "mix+s"):
                r = ex.get((kind, graphed))
                if r and "step_vs_keep" in r:
                    print(f"  {kind}: step {r['step_ms']:.2f} ms, {r['step_vs_keep']:.3f}x keep's"
                          + (f", offload {r['offload_bytes'] / 2 ** 20:.0f} MiB each way at the pinned roof "
                             f"{r['offload_roof_ms']:.2f} ms, {r['offload_hidden']:.2f} of it hidden"
                             if "offload_roof_ms" in r else "")
                          + (" (target <= 1.05x)" if kind == "stash" else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
