#!/usr/bin/env python3
"""Training steps of a transformers Qwen3-MoE (made locally from a config,
random weights, never downloaded) with each experts implementation that
transformers offers, beside the same model patched onto moestash
(mt.patch_qwen3_moe), all from the same initial weights and batches, in one
run on one device.

Variants: transformers' experts implementations (eager, grouped_mm,
batched_mm; one that fails, e.g. out of memory, is listed with its error);
moestash keep (every saved tensor kept); moestash mix (fc1_input offloaded
to pinned host pages, act_input and probs stashed in device pages,
fc2_input recomputed: the memory saving mix of examples/torch_moe_layer.py).

Each variant: bf16 parameters, AdamW (lr 1e-4), --steps steps on the same
random token batches (labels = inputs, the model shifts them), the
load-balancing loss on (output_router_logits, router_aux_loss_coef 1e-3).
Printed: mean step time over steps 2..N (each step synced), the speedup
over transformers' fastest implementation that ran, the peak memory
(torch.cuda.max_memory_allocated plus the library's own device memory) and
its ratio to that implementation's, and the losses: first, last and the
largest relative difference from grouped_mm's over the steps (bf16 drift:
both sides round differently and AdamW turns that into different updates).
Targets (issue 30): step >= 1.3x faster than the fastest transformers
implementation, peak memory with the mix <= 0.8x.

The default model is about 1.4 B parameters (8 layers, hidden 2048, 32
experts top-4 of width 768, GQA 16 / 4 heads of 128, vocabulary 32000) at
8 x 1024 tokens a step; --small (or no CUDA device): a tiny one on the CPU.

usage: python3 python/bench/bench_qwen3_moe.py [--steps 50] [--small] [--json FILE]
"""
import argparse
import json
import sys
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import moestash.torch as mt

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
MIX = "fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash"


def config(args):
    return Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          moe_intermediate_size=args.moe_ffn, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                          num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True,
                          router_aux_loss_coef=1e-3, output_router_logits=True, max_position_embeddings=args.seq,
                          attn_implementation="sdpa")


def build(args, device, variant):
    """The model of `variant` ("hf:<experts implementation>" or "moestash:<policy>")
    and its StashManager (or None)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config(args)).to(torch.bfloat16)
    kind, what = variant.split(":", 1)
    stash = None
    if kind == "hf":
        model.set_experts_implementation(what)
    else:
        stash = mt.StashManager() if what != "keep" else None
        mt.patch_qwen3_moe(model, policy=what, stash=stash)
    return model, stash


def batches(args, device):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(args.steps)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(args, device, variant, data):
    """Losses per step, mean step ms over steps 2..N, peak bytes."""
    model, stash = build(args, device, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for ids in data:
        sync(device)
        t0 = time.perf_counter()
        while True:  # a stash step whose pools overflowed is rerun (the pools grew)
            opt.zero_grad(set_to_none=True)
            if stash:
                stash.step_begin()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if stash is None or stash.step_check():
                break
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = 0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() + mt.library_memory(device)[1]
    del model, opt, stash
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses, 1e3 * sum(times[1:]) / max(len(times) - 1, 1), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-ffn", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--small", action="store_true", help="a tiny model on the CPU")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    if device.type == "cpu":
        args.steps = min(args.steps, 5)
        args.layers, args.hidden, args.moe_ffn, args.experts, args.topk = 2, 64, 32, 8, 2
        args.heads, args.kv_heads, args.head_dim, args.vocab, args.batch, args.seq = 4, 2, 16, 256, 2, 32
    data = batches(args, device)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Qwen3MoeForCausalLM(config(args)).parameters())
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}; "
          f"{args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.topk} of width "
          f"{args.moe_ffn} ({n_params / 1e9:.2f} B parameters), {args.batch} x {args.seq} tokens a step, "
          f"{args.steps} steps")

    results = {}
    for variant in [f"hf:{i}" for i in IMPLEMENTATIONS] + ["moestash:keep", f"moestash:{MIX}"]:
        try:
            losses, ms, peak = train(args, device, variant, data)
            results[variant] = {"losses": losses, "step_ms": ms, "peak_bytes": peak}
        except (RuntimeError, KeyError, ValueError) as e:  # out of memory, an implementation not available here
            results[variant] = {"error": str(e).splitlines()[0][:160]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ran = {v: r for v, r in results.items() if "error" not in r and v.startswith("hf:")}
    if not ran:
        print("no transformers implementation ran")
        return 1
    best = min(ran, key=lambda v: ran[v]["step_ms"])
    base = results.get("hf:grouped_mm", ran[best])
    base = base if "error" not in base else ran[best]
    print(f"{'variant':>16} | {'step ms':>8} | {'vs best':>7} | {'peak GiB':>8} | {'vs best':>7} | "
          f"loss first -> last | max rel. diff vs grouped_mm")
    for variant, r in results.items():
        name = variant.split(":")[1] if variant.startswith("hf:") else (
            "moestash " + ("keep" if variant.endswith("keep") else "mix"))
        if "error" in r:
            print(f"{name:>16} | failed: {r['error']}")
            continue
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])]
        r["speedup_vs_best"] = ran[best]["step_ms"] / r["step_ms"]
        r["peak_vs_best"] = r["peak_bytes"] / ran[best]["peak_bytes"] if ran[best]["peak_bytes"] else None
        r["max_rel_loss_diff"] = max(diffs)
        peak = f"{r['peak_bytes'] / 2 ** 30:>8.2f} | {r['peak_vs_best']:>6.2f}x" if r["peak_vs_best"] else \
            f"{'-':>8} | {'-':>7}"
        print(f"{name:>16} | {r['step_ms']:>8.1f} | {r['speedup_vs_best']:>6.2f}x | {peak} | "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {max(diffs):.2e}")
    print(f"best transformers implementation: {best.split(':')[1]}; targets: moestash >= 1.3x its step time, "
          "the mix's peak <= 0.8x its peak")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "shape": vars(args), "best": best, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
