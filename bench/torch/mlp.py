#!/usr/bin/env python3
"""PyTorch baseline of `moestash bench mlp`: the same grouped MLP
(fc1 + b1 -> SwiGLU * prob -> fc2 + b2 * prob), forward and autograd backward,
on the same shapes and counts, two ways:

  grouped_mm  torch._grouped_mm for fc1 and fc2 (offsets on the device)
  loop        one matmul per expert (counts known on the host)

FLOPs as in the moestash bench: forward 6 rows H F, backward 12 rows H F.
Counts: the moestash generator (same LCG, same seeds); when bench-mlp.json sits
beside --json FILE, its counts are used and checked, and the ratio
moestash / PyTorch is printed last.

usage: python3 bench/torch/mlp.py [--json FILE] [--iters N] [--shape I]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as Fn

SHAPES = [  # rows, hidden, ffn, E, skewed  (as bench/bench_mlp.c)
    (131072, 4096, 1024, 64, 0),
    (32768, 7168, 2048, 4, 0),
    (32768, 7168, 2048, 8, 0),
    (65536, 2048, 768, 128, 0),
    (32768, 7168, 2048, 32, 0),
    (32768, 7168, 2048, 32, 1),
    (65536, 2048, 768, 128, 1),
    (262144, 2048, 768, 128, 0),
    (262144, 2048, 768, 128, 1),
]


def splitmix64(s):
    """src/lib/core/rng.h mst_splitmix64: (new state, value)."""
    mask = (1 << 64) - 1
    s = (s + 0x9E3779B97F4A7C15) & mask
    z = s
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return s, z ^ (z >> 31)


def make_counts(E, rows, skewed, seed):
    """bench_mlp.c make_counts: each row to expert splitmix64() % E, or,
    skewed, to expert e with weight 1/(e+1)^1.2 (the same doubles as the C
    code)."""
    s = seed
    counts = [0] * E
    cdf, total = [], 0.0
    for e in range(E):
        total += 1.0 / (e + 1.0) ** 1.2 if skewed else 1.0
        cdf.append(total)
    for _ in range(rows):
        s, z = splitmix64(s)
        if not skewed:
            counts[z % E] += 1
            continue
        u = (z >> 11) * 2.0 ** -53 * total
        e = 0
        while e + 1 < E and cdf[e] <= u:
            e += 1
        counts[e] += 1
    return counts


class Mlp:
    def __init__(self, rows, H, F, E, counts, dev):
        g = torch.Generator(device=dev).manual_seed(1234)
        bf = torch.bfloat16

        def param(*shape, scale):
            return (torch.randn(*shape, device=dev, generator=g, dtype=torch.float32) * scale).to(bf).requires_grad_()

        self.F = F
        self.counts = counts
        self.w1 = param(E, 2 * F, H, scale=H ** -0.5)
        self.b1 = param(E, 2 * F, scale=0.1)
        self.w2 = param(E, H, F, scale=F ** -0.5)
        self.b2 = param(E, H, scale=0.1)
        self.x = torch.randn(rows, H, device=dev, generator=g).to(bf).requires_grad_()
        self.p = (0.05 + 0.95 * torch.rand(rows, device=dev, generator=g)).requires_grad_()
        self.dy = torch.randn(rows, H, device=dev, generator=g).to(bf)
        c = torch.tensor(counts, device=dev, dtype=torch.int32)
        self.offs = torch.cumsum(c, 0, dtype=torch.int32)
        self.gidx = torch.repeat_interleave(torch.arange(E, device=dev), c.long(), output_size=rows)

    def act(self, h, p):
        a, b = h[:, : self.F], h[:, self.F :]
        return Fn.silu(a) * b * p[:, None].to(h.dtype)

    def grouped(self):
        h = torch._grouped_mm(self.x, self.w1.transpose(-2, -1), offs=self.offs) + self.b1[self.gidx]
        z = self.act(h, self.p)
        y = torch._grouped_mm(z, self.w2.transpose(-2, -1), offs=self.offs)
        return y + self.b2[self.gidx] * self.p[:, None].to(y.dtype)

    def loop(self):
        # split / unbind (not indexing): one backward for all the pieces, no
        # full-size zero gradient per expert
        out = []
        xs, ps = self.x.split(self.counts), self.p.split(self.counts)
        w1, b1, w2, b2 = self.w1.unbind(0), self.b1.unbind(0), self.w2.unbind(0), self.b2.unbind(0)
        for e, (x, p) in enumerate(zip(xs, ps)):
            if x.shape[0] == 0:
                continue
            h = x @ w1[e].t() + b1[e]
            z = self.act(h, p)
            out.append(z @ w2[e].t() + b2[e] * p[:, None].to(z.dtype))
        return torch.cat(out)


def time_fwd_bwd(fn, dy, iters):
    """Mean ms of the forward and of the backward (autograd), timed apart."""
    fwd = bwd = 0.0
    for i in range(iters + 2):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        y = fn()
        e1.record()
        y.backward(dy)
        e2.record()
        torch.cuda.synchronize()
        if i >= 2:
            fwd += e0.elapsed_time(e1)
            bwd += e1.elapsed_time(e2)
        del y
    return fwd / iters, bwd / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shape", type=int, default=-1)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch mlp: no CUDA device", file=sys.stderr)
        return 2
    dev = "cuda"
    ours = {}
    if args.json:
        path = os.path.join(os.path.dirname(os.path.abspath(args.json)), "bench-mlp.json")
        if os.path.exists(path):
            with open(path) as f:
                for s in json.load(f)["shapes"]:
                    ours[s["index"]] = s
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    results = []
    for i, (rows, H, F, E, skewed) in enumerate(SHAPES):
        if args.shape >= 0 and i != args.shape:
            continue
        mine = ours.get(i)
        counts = mine["counts"] if mine else make_counts(E, rows, skewed, 1000 + i)
        if mine and (mine["rows"], mine["hidden"], mine["ffn"], mine["E"], mine["skewed"]) != (rows, H, F, E, skewed):
            print(f"torch mlp: shape {i}: differs from bench-mlp.json", file=sys.stderr)
            return 1
        m = Mlp(rows, H, F, E, counts, dev)
        with torch.no_grad():  # the two baselines agree before they are timed
            a, b = m.grouped().float(), m.loop().float()
            err = ((a - b).norm() / b.norm()).item()
        if not err < 1e-2:
            print(f"torch mlp: shape {i}: grouped_mm vs loop rel err {err:.3g}", file=sys.stderr)
            return 1
        flop = rows * H * F
        res = {"index": i, "rows": rows, "hidden": H, "ffn": F, "E": E, "skewed": skewed}
        for name, fn in (("grouped_mm", m.grouped), ("loop", m.loop)):
            f_ms, b_ms = time_fwd_bwd(fn, m.dy, args.iters)
            res[name] = {"fwd_ms": f_ms, "bwd_ms": b_ms,
                         "fwd_tflops": 6 * flop / f_ms / 1e9, "bwd_tflops": 12 * flop / b_ms / 1e9}
        results.append(res)
        del m
        torch.cuda.empty_cache()
        print(f"shape {i} done", flush=True)

    hdr = f"{'#':>2} {'rows':>7} {'H':>5} {'F':>5} {'E':>4} {'skew':>4} | {'torch gmm f/b TFLOP/s':>22} | {'loop f/b':>12}"
    if ours:
        hdr += f" | {'moestash f/b':>13} | {'ratio vs gmm f/b':>16} | {'vs loop f/b':>11}"
    print(hdr)
    for r in results:
        g, l = r["grouped_mm"], r["loop"]
        line = (f"{r['index']:>2} {r['rows']:>7} {r['hidden']:>5} {r['ffn']:>5} {r['E']:>4} {r['skewed']:>4} | "
                f"{g['fwd_tflops']:>10.0f} {g['bwd_tflops']:>11.0f} | {l['fwd_tflops']:>5.0f} {l['bwd_tflops']:>6.0f}")
        o = ours.get(r["index"])
        if o:
            r["ratio_vs_grouped_mm"] = [o["fwd_tflops"] / g["fwd_tflops"], o["bwd_tflops"] / g["bwd_tflops"]]
            r["ratio_vs_loop"] = [o["fwd_tflops"] / l["fwd_tflops"], o["bwd_tflops"] / l["bwd_tflops"]]
            line += (f" | {o['fwd_tflops']:>6.0f} {o['bwd_tflops']:>6.0f} | "
                     f"{r['ratio_vs_grouped_mm'][0]:>7.2f}x {r['ratio_vs_grouped_mm'][1]:>7.2f}x | "
                     f"{r['ratio_vs_loop'][0]:>4.2f}x {r['ratio_vs_loop'][1]:>4.2f}x")
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "torch-mlp", "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "shapes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
