#!/usr/bin/env python3
"""A Megatron-style MoE layer trained with moestash's GroupedMLP beside the
same layer in pure PyTorch (torch._grouped_mm), from the same initial weights.

The layer: router (linear H -> E, softmax, top-k, probabilities renormalized
over the k picks), permutation of the (token, expert) pairs into expert-major
rows (a stable sort by expert; counts per expert summed on the device: no
host sync, capturable), the experts' SwiGLU MLP with the router probability
scaling each row, and the unpermutation (index_add into the token rows).
Training: a regression onto a fixed random teacher, fp32 master weights and
AdamW; the experts' gradients reach the fp32 main_grad directly from the
library's wgrad GEMM (the TransformerEngine contract), PyTorch's through
autograd.

Printed: the losses of both, checked against torch._grouped_mm's: step 1
(the same weights) within 1e-3 relative, bf16 rounding; every step within
the drift that roundings alone cause in this run, measured: AdamW turns
two sides' different roundings into different updates (e.g. torch rounds
silu(a) * b to bf16 op by op, the library once), and the relative
difference of the losses grows with the steps, the more so as the loss
falls. "torch round-once" is the torch._grouped_mm layer rounding the
activation once, as the library does: the same function, other roundings.
Its largest difference from torch over the steps, d_r, measures how far
roundings alone move the losses here; moestash and torch are two such
perturbations of the same training, so by the triangle inequality they may
differ by about 2 d_r: every step must stay within max(5e-2, 2 d_r).
Step time and torch.cuda.max_memory_allocated side by side, eager and under
torch.cuda.graph, for PyTorch (torch._grouped_mm, its round-once variant,
and a static-capacity layer: [E, C, H] buffers and batched matmuls,
capacity factor 2, whose dropped rows exempt it from the loss check) and
moestash under each memory policy of its saved tensors alone: keep, stash
(every saved tensor in device pages), offload (every one in pinned host
pages), and the mix (fc1_input offloaded, act_input and probs stashed,
fc2_input recomputed); "offload+s" and "mix+s" are the same with the
StashManager's copy stream (offload_stream=True: the copies beside the
compute in eager steps; a captured step keeps them on its stream). Peak memory counts the library's own device memory
(workspaces, pages) beside torch's, from a peak reset at each run's start.
Offload: the bytes a step moves each way (the pools' pages in use), the
time they take at the pinned-copy roof (host <-> device copies of pinned
memory, measured in the same run), the step's time over keep's, and the
share of the copies hidden behind compute (1 - extra / roof time; 0: the
copies run serialized with the compute).

usage: python3 examples/torch_moe_layer.py [--steps 50] [--small] [--json FILE]
(--small, or no CUDA device: a small shape on the CPU backend, eager only)
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as Fn

import moestash.torch as mt


CAPACITY_FACTOR = 2.0  # of the static-capacity PyTorch layer
FIRST_STEP_RTOL = 1e-3  # loss of step 1 vs torch: the same weights, only roundings differ
DRIFT_RTOL = 5e-2  # loss of any step vs torch: the floor of the drift bound (see above)
# the memory policies of the moestash layers' saved tensors, each alone, and the mix
MIX = "fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash"
POLICY = {"keep": "keep", "stash": "stash", "offload": "offload", "mix": MIX,
          "offload+s": "offload", "mix+s": MIX}  # +s: StashManager(offload_stream=True)
TORCH_KINDS = ("torch", "torch_round1", "torch_capacity")
NAMES = {"torch": "torch", "torch_round1": "torch round-once", "torch_capacity": "torch cap {cf:g}"}


class Router(torch.nn.Module):
    def __init__(self, H, E, k, device):
        super().__init__()
        self.k = k
        self.proj = torch.nn.Linear(H, E, bias=False, device=device, dtype=torch.bfloat16)

    def forward(self, x):
        """Returns the expert-major permutation: token index per row [T k],
        probability per row [T k] fp32, counts int32 [E]."""
        E = self.proj.out_features
        probs = torch.softmax(self.proj(x).float(), dim=-1)
        top_p, top_e = probs.topk(self.k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        flat_e = top_e.flatten()
        order = torch.sort(flat_e, stable=True).indices
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat_e, torch.ones_like(flat_e, dtype=torch.int32))
        return order // self.k, top_p.flatten()[order], counts


class TorchExperts(torch.nn.Module):
    """The experts in pure PyTorch: torch._grouped_mm with device offsets."""

    def __init__(self, E, H, F, device):
        super().__init__()
        self.F = F
        self.w1 = torch.nn.Parameter(torch.empty(E, 2 * F, H, device=device, dtype=torch.bfloat16))
        self.w2 = torch.nn.Parameter(torch.empty(E, H, F, device=device, dtype=torch.bfloat16))

    def forward(self, x, counts, probs):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
        z = Fn.silu(h[:, : self.F]) * h[:, self.F:] * probs[:, None].to(h.dtype)
        return torch._grouped_mm(z, self.w2.transpose(-2, -1), offs=offs)


class RoundOnceExperts(TorchExperts):
    """torch._grouped_mm with the activation computed in fp32 and rounded to
    bf16 once (silu(gate) * up * prob), as the library rounds it: the same
    function as TorchExperts with other roundings (the drift reference)."""

    def forward(self, x, counts, probs):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs).float()
        z = (Fn.silu(h[:, : self.F]) * h[:, self.F:] * probs[:, None]).to(torch.bfloat16)
        return torch._grouped_mm(z, self.w2.transpose(-2, -1), offs=offs)


class CapacityExperts(TorchExperts):
    """The experts in pure PyTorch with static capacity buffers, as a layer
    without ragged GEMMs does it: each expert gets C = ceil(cf * rows / E)
    rows of an [E, C, H] buffer (rows past an expert's C are dropped; their
    output is 0), batched matmuls over the buffer, and back."""

    def __init__(self, E, H, F, device, capacity_factor):
        super().__init__(E, H, F, device)
        self.cf = capacity_factor

    def forward(self, x, counts, probs):
        R, H = x.shape
        E = counts.shape[0]
        C = math.ceil(self.cf * R / E)
        start = torch.cumsum(counts, 0) - counts  # [E] first row of each expert
        expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts.long(), output_size=R)
        pos = torch.arange(R, device=x.device) - start[expert]
        slot = torch.where(pos < C, expert * C + pos, E * C)  # [R]; E * C: the trash row
        xe = x.new_zeros(E * C + 1, H).index_copy(0, slot, x)[: E * C].view(E, C, H)
        pe = probs.new_zeros(E * C + 1).index_copy(0, slot, probs)[: E * C].view(E, C, 1)
        h = torch.bmm(xe, self.w1.transpose(-2, -1))
        z = Fn.silu(h[..., : self.F]) * h[..., self.F:] * pe.to(h.dtype)
        ye = torch.bmm(z, self.w2.transpose(-2, -1)).view(E * C, H)
        return torch.cat([ye, ye.new_zeros(1, H)])[slot]


class MoeLayer(torch.nn.Module):
    def __init__(self, experts, router):
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x):
        tok, p, counts = self.router(x)
        y = self.experts(x[tok], counts, p)
        return torch.zeros_like(x).index_add_(0, tok, y)


def build(kind, H, F, E, k, device, manager):
    torch.manual_seed(0)  # same initial weights for every kind
    router = Router(H, E, k, device)
    if kind == "torch":
        experts = TorchExperts(E, H, F, device)
    elif kind == "torch_round1":
        experts = RoundOnceExperts(E, H, F, device)
    elif kind == "torch_capacity":
        experts = CapacityExperts(E, H, F, device, CAPACITY_FACTOR)
    else:
        experts = mt.GroupedMLP(E, H, F, policy=POLICY[kind], stash_manager=manager, device=device)
    with torch.no_grad():
        g = torch.Generator(device="cpu").manual_seed(1)
        experts.w1.copy_(torch.randn(experts.w1.shape, generator=g) * H ** -0.5)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g) * F ** -0.5)
    layer = MoeLayer(experts, router)
    # fp32 master weights; main_grad on the experts' weights of the moestash layers
    masters = [p.detach().float().clone().requires_grad_(False) for p in layer.parameters()]
    if not kind.startswith("torch"):
        for p in (experts.w1, experts.w2):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    return layer, masters


class Trainer:
    """One kind of layer, its optimizer on the fp32 masters, its loss."""

    def __init__(self, kind, args, device, data):
        self.manager = (mt.StashManager(offload_stream=kind.endswith("+s"))
                        if kind in POLICY and kind != "keep" else None)
        self.layer, self.masters = build(kind, args.hidden, args.ffn, args.experts, args.topk, device, self.manager)
        self.params = list(self.layer.parameters())
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.opt = torch.optim.AdamW(self.masters, lr=args.lr, weight_decay=0.0,
                                     capturable=device.type == "cuda")
        self.x, self.target = data
        self.loss = torch.zeros((), device=device)

    def fwd_bwd(self):
        for p in self.params:
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        y = self.layer(self.x)
        loss = Fn.mse_loss(y.float(), self.target)
        loss.backward()
        self.loss.copy_(loss.detach())

    def optim(self):
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.grad.copy_(p.main_grad if hasattr(p, "main_grad") else p.grad.float())
            self.opt.step()
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def offloaded_bytes(self):
        """Bytes one step moves each way through the offload pools (their pages in use)."""
        if not self.manager:
            return 0
        return sum(r["peak_pages"] * r["page_bytes"] for r in self.manager.report() if r["policy"] == "offload")

    def close(self):
        """Gives the stash pools back: the next run's library memory starts without them."""
        if self.manager:
            self.manager.close()

    def step(self):
        while True:
            if self.manager:
                self.manager.step_begin()
            self.fwd_bwd()
            if self.manager is None or self.manager.step_check():
                break  # else: a pool overflowed and grew: rerun the step
        self.optim()


def run(kind, args, device, data):
    """Every step eager."""
    t = Trainer(kind, args, device, data)
    t.step()  # step 1 sizes the stash pools and the library's workspaces
    out = timed(t, args, device, t.step) + (t.offloaded_bytes(),)
    t.close()
    return out


def capture(t):
    """One CUDA graph of the forward and backward (the optimizer stays eager)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        t.fwd_bwd()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if t.manager:
            t.manager.step_begin()
        t.fwd_bwd()
    return graph


def run_graphed(kind, args, device, data):
    """Step 1 eager, then the captured forward + backward replayed; a stash
    overflow (the pools grew) reruns that step eagerly and recaptures."""
    t = Trainer(kind, args, device, data)
    t.step()
    state = {}

    def step():
        state["graph"].replay()
        if t.manager and not t.manager.step_check():
            t.step()
            state["graph"] = capture(t)
            return
        t.optim()

    out = timed(t, args, device, step, prepare=lambda: state.update(graph=capture(t))) + (t.offloaded_bytes(),)
    del state["graph"]
    t.close()
    return out


def timed(t, args, device, step, prepare=None):
    """The losses of step 1 (done) and steps 2..N; their mean step time; the
    peak memory from step 2 on, and that peak above what was allocated before
    it (the persistent weights, optimizer state and data), both with the
    library's own device memory (workspaces, pages) added. prepare (the
    capture) runs first: it counts in the memory (a graph's private pool),
    not in the time."""
    losses = [t.loss.item()]
    base = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mt.reset_library_peak(device)
        base = torch.cuda.memory_allocated()
    if prepare:
        prepare()
    t0 = time.perf_counter()
    for _ in range(args.steps - 1):
        step()
        losses.append(t.loss.item())
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / (args.steps - 1)
    if device.type != "cuda":
        return losses, dt, 0, 0
    lib = mt.library_memory(device)[1]  # its peak since the reset above
    peak = torch.cuda.max_memory_allocated()
    return losses, dt, peak + lib, peak - base + lib


def pinned_roof(device, n_bytes=256 << 20, reps=5):
    """(host -> device, device -> host) bytes/s of copies between pinned host
    memory and the device, the best of `reps` (the roof of offload's copies)."""
    host = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    out = []
    for dst, src in ((dev, host), (host, dev)):
        best = float("inf")
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src, non_blocking=True)
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) / 1e3)
        out.append(n_bytes / best)
    return tuple(out)


def name_of(kind):
    return NAMES[kind].format(cf=CAPACITY_FACTOR) if kind in NAMES else f"moestash {kind}"


def print_policies(results, graphed, roof):
    """Each policy against keep: step time, step memory, and offload's
    copies against the pinned roof."""
    keep = results[("keep", graphed)]
    mode = "graph" if graphed else "eager"
    print(f"{mode} policies | {'step ms':>8} {'x keep':>7} | {'step MiB':>9} {'x keep':>7} | "
          f"offload MiB/step each way, at the roof ms, step ms over keep, copies hidden")
    for kind in POLICY:
        r = results[(kind, graphed)]
        r["step_vs_keep"] = r["step_ms"] / keep["step_ms"]
        mem = f"{r['step_peak_mib'] / keep['step_peak_mib']:>6.3f}x" if keep["step_peak_mib"] else f"{'-':>7}"
        line = f"{'':>5} {kind:>9} | {r['step_ms']:>8.2f} {r['step_vs_keep']:>6.3f}x | {r['step_peak_mib']:>9.1f} "
        line += f"{mem} |"
        if r["offload_bytes"] and roof:
            roof_ms = 1e3 * (r["offload_bytes"] / roof[1] + r["offload_bytes"] / roof[0])  # out in fwd, back in bwd
            extra = r["step_ms"] - keep["step_ms"]
            r["offload_roof_ms"], r["offload_hidden"] = roof_ms, max(0.0, 1 - extra / roof_ms)
            line += (f" {r['offload_bytes'] / 2 ** 20:.1f} MiB, {roof_ms:.2f} ms, {extra:+.2f} ms, "
                     f"{r['offload_hidden']:.2f}")
        print(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = torch.device("cuda" if cuda else "cpu")
    # tokens, hidden, ffn per expert, experts, top-k
    args.tokens, args.hidden, args.ffn, args.experts, args.topk = (
        (16384, 2048, 1024, 32, 4) if cuda else (256, 64, 32, 8, 2))
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(args.tokens, args.hidden, generator=g)).to(torch.bfloat16).to(device)
    target = torch.randn(args.tokens, args.hidden, generator=g).mul(0.5).to(device)
    data = (x, target)
    print("moestash policies: " + "; ".join(f"{k} = {v}" for k, v in POLICY.items()))
    print(f"MoE layer: {args.tokens} tokens, H {args.hidden}, F {args.ffn}, {args.experts} experts top-{args.topk}, "
          f"{args.steps} steps on {torch.cuda.get_device_name() if cuda else 'cpu'} (torch {torch.__version__})")
    roof = pinned_roof(device) if cuda else None
    if roof:
        print(f"pinned-copy roof: host -> device {roof[0] / 1e9:.1f} GB/s, device -> host {roof[1] / 1e9:.1f} GB/s")
    results = {}
    for graphed in ([False, True] if cuda else [False]):
        for kind in TORCH_KINDS + tuple(POLICY):
            losses, dt, peak, step_peak, offload = (run_graphed if graphed else run)(kind, args, device, data)
            results[(kind, graphed)] = {"losses": losses, "step_ms": dt * 1e3, "peak_mib": peak / 2 ** 20,
                                        "step_peak_mib": step_peak / 2 ** 20, "offload_bytes": offload}
    ok = True
    print(f"{'mode':>6} {'layer':>18} | {'step ms':>8} | {'peak MiB':>9} | {'step MiB':>9} | "
          f"loss first -> last | rel. diff vs torch: step 1, max (bound)")
    for (kind, graphed), r in results.items():
        base = results[("torch", graphed)]["losses"]
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], base)]
        rounding = max(abs(a - b) / abs(b) for a, b in zip(results[("torch_round1", graphed)]["losses"], base))
        bound = max(DRIFT_RTOL, 2 * rounding)
        # the torch layers are the references (the static-capacity one may drop rows: shown, not checked)
        ok &= kind in TORCH_KINDS or (diffs[0] < FIRST_STEP_RTOL and max(diffs) < bound)
        r["rel_loss_diff_vs_torch_step1"], r["max_rel_loss_diff_vs_torch"] = diffs[0], max(diffs)
        r["drift_bound"] = bound
        mode = "graph" if graphed else "eager"
        print(f"{mode:>6} {name_of(kind):>18} | {r['step_ms']:>8.2f} | {r['peak_mib']:>9.1f} | "
              f"{r['step_peak_mib']:>9.1f} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | "
              f"{diffs[0]:.2e}, {max(diffs):.2e}"
              + ("" if kind in TORCH_KINDS else f" ({bound:.2e})"))
    print("peak MiB: torch.cuda.max_memory_allocated + the library's own; step MiB: that peak above the memory "
          "held before step 2 (weights, optimizer state, data), the graph's pool included")
    for graphed in ([False, True] if cuda else [False]):
        print_policies(results, graphed, roof)
    print("targets (issue 30): stash alone <= 1.05x keep's step; offload's copies hidden behind compute")
    print(f"losses agree with torch (step 1 within {FIRST_STEP_RTOL:g}, every step within max({DRIFT_RTOL:g}, "
          "2 x the round-once layer's largest drift) relative): " + ("yes" if ok else "NO"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "shape": vars(args),
                       "pinned_roof_bytes_per_s": {"h2d": roof[0], "d2h": roof[1]} if roof else None,
                       "results": [{"kind": k, "graph": gr, **v} for (k, gr), v in results.items()]}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
