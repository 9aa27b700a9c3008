#!/usr/bin/env python3
"""PyTorch baseline of `moestash bench attn`: causal attention through
torch.nn.functional.scaled_dot_product_attention on each backend this
PyTorch has (flash, cudnn, efficient), forward and autograd backward timed
apart, on the same cases (B, heads, head dim, T, KV) as the moestash bench.

FLOPs as in the moestash bench: the causal half, forward 2 B NH T^2 D,
backward 2.5 times that (KV key-value heads: the same FLOPs). A backend
that refuses a case (e.g. grouped heads) is shown as n/a. Each backend's
output is checked against the math backend's on a small slice first.

When bench-attn.json sits beside --json FILE, its cases are run and the
ratio moestash / best PyTorch backend is printed last for our flash kernels
and for cuDNN through moestash (the issue's target: >= 0.95 forward and
backward at head dim 128, T 2048 and 8192).

usage: python3 bench/torch/attn.py [--json FILE] [--iters N]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as Fn
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
DEFAULT = {"B": 2, "heads": 16, "head_dim": 128, "cases": [{"T": t, "KV": kv} for t in (2048, 8192) for kv in (16, 4)]}


def sdpa(q, k, v, backend):
    """Causal SDPA of [B, T, heads, D] rows (seen as [B, heads, T, D], as
    the trainer's qkv rows) on one backend."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel([backend]):
        return Fn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def check(q, k, v, backend):
    """The backend's output on the first 256 rows against the math backend's."""
    qs, ks, vs = q[:, :256], k[:, :256], v[:, :256]
    with torch.no_grad():
        got = sdpa(qs, ks, vs, backend).float()
        want = sdpa(qs, ks, vs, SDPBackend.MATH).float()
    return ((got - want).norm() / want.norm()).item()


def time_fwd_bwd(q, k, v, do, backend, iters):
    """Mean ms of the forward and of the backward, timed apart (CUDA events)."""
    fwd = bwd = 0.0
    for i in range(iters + 2):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        o = sdpa(q, k, v, backend)
        e1.record()
        o.backward(do)
        e2.record()
        torch.cuda.synchronize()
        if i >= 2:
            fwd += e0.elapsed_time(e1)
            bwd += e1.elapsed_time(e2)
        del o
        q.grad = k.grad = v.grad = None
    return fwd / iters, bwd / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch attn: no CUDA device", file=sys.stderr)
        return 2
    ours = None
    if args.json:
        path = os.path.join(os.path.dirname(os.path.abspath(args.json)), "bench-attn.json")
        if os.path.exists(path):
            with open(path) as f:
                ours = json.load(f)
    spec = ours or DEFAULT
    B, NH, D = spec["B"], spec["heads"], spec["head_dim"]
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: causal SDPA, B {B}, heads {NH}, D {D}; "
          f"cuDNN {torch.backends.cudnn.version()}; deterministic algorithms "
          f"{torch.are_deterministic_algorithms_enabled()}")
    g = torch.Generator(device="cuda").manual_seed(1234)
    results = []
    for case in spec["cases"]:
        T, KV = case["T"], case["KV"]
        def rnd(h):  # [B, T, heads, D]
            return torch.randn(B, T, h, D, device="cuda", generator=g).to(torch.bfloat16)
        q, k, v = (x.requires_grad_() for x in (rnd(NH), rnd(KV), rnd(KV)))
        do = rnd(NH).transpose(1, 2)
        fl = 2.0 * B * NH * T * T * D
        res = {"T": T, "KV": KV}
        for name, be in BACKENDS:
            try:
                err = check(q, k, v, be)
                if not err < 2e-2:
                    print(f"torch attn: T {T} KV {KV}: {name} vs math rel err {err:.3g}", file=sys.stderr)
                    return 1
                f_ms, b_ms = time_fwd_bwd(q, k, v, do, be, args.iters)
                res[name] = {"fwd_ms": f_ms, "bwd_ms": b_ms, "fwd_tflops": fl / f_ms / 1e9,
                             "bwd_tflops": 2.5 * fl / b_ms / 1e9, "err": err}
            except RuntimeError as e:  # the backend refuses this case
                res[name] = {"error": str(e).splitlines()[0][:160]}
            torch.cuda.empty_cache()
        results.append(res)
        del q, k, v, do
        torch.cuda.empty_cache()
        print(f"T {T} KV {KV} done", flush=True)

    def fig(r, name, key):
        x = r.get(name, {})
        return x.get(key)

    hdr = f"{'T':>6} {'KV':>4} |" + "".join(f" {n + ' f/b':>15} |" for n, _ in BACKENDS)
    mine_impls = ("flash", "cudnn", "cudnn_nondet")  # ours: our kernels, cuDNN (deterministic bwd, nondeterministic)
    if ours:
        hdr += "".join(f" {'ours ' + n + ' f/b':>20} |" for n in mine_impls)
        hdr += "".join(f" {n + ' / best torch f/b':>29} |" for n in mine_impls)
    print(hdr)
    for r in results:
        line = f"{r['T']:>6} {r['KV']:>4} |"
        for n, _ in BACKENDS:
            f, b = fig(r, n, "fwd_tflops"), fig(r, n, "bwd_tflops")
            line += f" {f:>7.0f} {b:>7.0f} |" if f else f" {'n/a':>15} |"
        best = [max([fig(r, n, k) or 0 for n, _ in BACKENDS]) for k in ("fwd_tflops", "bwd_tflops")]
        r["best_torch_tflops"] = best
        mine = next((c for c in ours["cases"] if c["T"] == r["T"] and c["KV"] == r["KV"]), None) if ours else None
        if mine:
            for impl in mine_impls:
                m = mine.get(impl)
                line += f" {m['fwd_tflops']:>10.0f} {m['bwd_tflops']:>9.0f} |" if m else f" {'n/a':>20} |"
            for impl in mine_impls:
                m = mine.get(impl)
                if m and best[0] > 0 and best[1] > 0:
                    ratio = [m["fwd_tflops"] / best[0], m["bwd_tflops"] / best[1]]
                    r[f"{impl}_ratio_vs_best"] = ratio
                    line += f" {ratio[0]:>13.2f}x {ratio[1]:>13.2f}x |"
                else:
                    line += f" {'n/a':>29} |"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "torch-attn", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                       "cudnn": torch.backends.cudnn.version(), "B": B, "heads": NH, "head_dim": D,
                       "cases": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
