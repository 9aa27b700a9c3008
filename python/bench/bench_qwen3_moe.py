#!/usr/bin/env python3
"""Training steps of a transformers Qwen3-MoE (made locally from a config,
random weights, never downloaded) with each experts implementation that
transformers offers, beside the same model patched onto moestash
(mt.patch_qwen3_moe), all from the same initial weights and batches, in one
run on one device.

Variants: every experts implementation the installed transformers offers
("eager" and the keys of transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS:
grouped_mm, batched_mm, ...; one that fails, e.g. out of memory or a
kernel package missing, is listed with its error; eager is skipped with
--no-eager and --large); the model patched onto moestash under each policy
of POLICIES: keep (every saved tensor kept), stash (every saved tensor in
device pages: the same bytes as keep, in the library's pools), stash:fp8
(e4m3 pages), fp8+recompute (fc2_input recomputed), mix (fc1_input
offloaded to pinned host pages, act_input and probs stashed, fc2_input
recomputed: the mix of examples/torch_moe_layer.py), offload (fc1_input and
act_input offloaded), and with fc1_input regathered (not saved: gathered
again from the block's input in the backward, patch_qwen3_moe(regather=True))
regather (the rest kept), regather+fp8 and regather+offload (act_input fp8
pages or offloaded, fc2_input recomputed). --variants picks some.

Each variant: bf16 parameters, AdamW (lr 1e-4), --steps steps on the same
random token batches (labels = inputs, the model shifts them), the
load-balancing loss on (output_router_logits, router_aux_loss_coef 1e-3).
Printed: mean step time over steps 2..N (each step synced), the speedup
over transformers' fastest implementation that ran, the peak memory
(torch.cuda.max_memory_allocated plus the library's own peak: an upper
bound of their sum, the library's memory being pools and workspaces made in
the first step and kept) and its ratio to that implementation's, and the losses: first, last and the
largest relative difference from grouped_mm's over the steps (bf16 drift:
both sides round differently and AdamW turns that into different updates).
Targets (issue 30): step >= 1.3x faster than the fastest transformers
implementation, peak memory with stash <= 0.8x. Then (CUDA) the memory
table: each variant's peak, the static part (weights + grads + AdamW state,
allocated after step 1), the peak of each phase (forward, backward,
optimizer), the bytes autograd saves for a backward (distinct device
storages, parameters excluded: one extra step, untimed), the library's
pool bytes (device | pinned host) and its peak, the attempts (steps +
reruns); and what share of the fastest implementation's peak the experts'
saved activations are (from the shapes), beside what 0.8x of it asks for.

Under torchrun (WORLD_SIZE > 1, one GPU a rank, NCCL): expert parallelism.
Rank 0 first trains the moestash model alone (--ep-policy, the same tokens
a step as each rank below) while the others wait: the one-GPU baseline of
the same run; then every rank trains it with its experts spread over the
ranks (mt.ExpertParallel, patch_qwen3_moe(ep=): E / W experts a rank,
dispatch and combine through the library), its own batches, the
replicated parameters' gradients summed over the ranks (each rank's loss
/ W: the gradients of the mean over all ranks' tokens). Printed: tokens/s
of both, their ratio (target >= 3.4x on 4 GPUs), the exchange path, each
rank's peak memory, the mean loss over the ranks per step. Budgets: a rank
receives at most --capacity x its tokens x k rows and sends one rank at
most --capacity x tokens x k / W (an over-budget step is an error naming
--capacity).

JSON (--json, else $OUT/bench_qwen3_moe.json or $OUT/bench_qwen3_moe_ep<W>.json
when $OUT is set). Offline: the model is made from a config in code
(HF_HUB_OFFLINE=1 is set; nothing is downloaded).

The default model is about 1.4 B parameters (8 layers, hidden 2048, 32
experts top-4 of width 768, GQA 16 / 4 heads of 128, vocabulary 32000) at
8 x 1024 tokens a step, 50 steps; --large: 16 x 2048 tokens a step, 20
steps, no eager (about 3 min on an H200, estimated); --small (or no CUDA device): a
tiny one on the CPU.

usage: python3 python/bench/bench_qwen3_moe.py [--steps 50] [--large | --small] [--variants a,b] [--no-eager]
                                               [--json FILE]
       torchrun --standalone --nproc-per-node 4 python/bench/bench_qwen3_moe.py [--steps 20]
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is made from a config: nothing to download

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import moestash.torch as mt  # noqa: E402

MIX = "fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash"
POLICIES = {  # name -> the policy of every block (moestash.torch.saver.parse_policy)
    "keep": "keep",  # autograd keeps every saved tensor (the transformers implementations' way)
    "stash": "stash",  # every saved tensor in device pages: the same bytes as keep, in the library's pools
    "stash:fp8": "stash:fp8",  # e4m3 pages with a scale per 128 values (probs: fp32 pages)
    "fp8+recompute": "fc1_input=stash:fp8,act_input=stash:fp8,fc2_input=recompute,probs=stash",
    "mix": MIX,
    "offload": "fc1_input=offload,act_input=offload,fc2_input=recompute,probs=stash",
    # fc1_input kept but regathered (patch_qwen3_moe(regather=True)): not saved, gathered again in backward
    "regather": "keep",
    "regather+fp8": "act_input=stash:fp8,fc2_input=recompute,probs=stash",
    "regather+offload": "act_input=offload,fc2_input=recompute,probs=stash",  # the least device memory
}
REGATHER = {"regather", "regather+fp8", "regather+offload"}
PRESETS = {"default": {"batch": 8, "seq": 1024, "steps": 50},
           "large": {"batch": 16, "seq": 2048, "steps": 20}}  # --large: 4x the default's tokens a step


def implementations():
    """Every experts implementation this transformers offers."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        return ["eager"] + sorted(ALL_EXPERTS_FUNCTIONS.keys())
    except ImportError:  # an older layout
        return ["eager", "grouped_mm", "batched_mm"]


def config(args):
    return Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          moe_intermediate_size=args.moe_ffn, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                          num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True,
                          router_aux_loss_coef=1e-3, output_router_logits=True, max_position_embeddings=args.seq,
                          attn_implementation="sdpa")


def build(args, device, variant, ep=None, window=False):
    """The model of `variant` ("hf:<experts implementation>" or "moestash:<policy>", a
    policy or a name of POLICIES)
    and its StashManager (or None); ep: expert-parallel over that communicator."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config(args)).to(torch.bfloat16)
    kind, what = variant.split(":", 1)
    stash = None
    if kind == "hf":
        model.set_experts_implementation(what)
    else:
        regather, what = what in REGATHER, POLICIES.get(what, what)
        stash = mt.StashManager() if what != "keep" else None
        mt.patch_qwen3_moe(model, policy=what, stash=stash, ep=ep, window=window, regather=regather)
    return model, stash


def batches(args, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(args.steps)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def replicated_grads_sum(model, group):
    """Sums the gradients of every parameter but the experts' over the ranks
    (one flat all-reduce): data parallelism of the replicated parameters."""
    grads = [p.grad for n, p in model.named_parameters() if p.grad is not None and ".experts." not in n]
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.allreduce([flat]).wait()
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


class Memory:
    """torch's allocated bytes by phase of a step (forward, backward,
    optimizer): the peak of each, through reset_peak_memory_stats between
    them (the allocator's host-side counters: no sync, no effect on the
    timing); nothing off CUDA."""

    PHASES = ("forward", "backward", "optimizer")

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.peaks = dict.fromkeys(self.PHASES, 0)
        self.static = 0  # bytes allocated after the first step: weights + grads + optimizer state

    def start(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def end(self, phase):
        if self.cuda:
            self.peaks[phase] = max(self.peaks[phase], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def peak(self):
        return max(self.peaks.values())


def forward_backward(model, stash, opt, ids, world=1, mem=None):
    """One step's forward and backward (the loss / world's gradients), rerun
    while the stash pools overflow (they grew): (loss, attempts)."""
    mem = mem or Memory(torch.device("cpu"))
    attempts = 0
    while True:
        attempts += 1
        opt.zero_grad(set_to_none=True)
        if stash:
            stash.step_begin()
        mem.start()
        loss = model(input_ids=ids, labels=ids).loss
        mem.end("forward")
        (loss / world).backward()
        mem.end("backward")
        if stash is None or stash.step_check():
            return loss, attempts


_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profile_steps(model, stash, opt, data, device):
    """Whole training steps under torch.profiler (after the timed ones): per
    step, the kernels launched and their GPU time, the host syncs (CUDA
    runtime calls that wait: stream / device / event synchronize, blocking
    cudaMemcpy), the .item() reads, the aten ops (nested ones counted), the
    ten kernels (CPU: aten ops) that took the most time, and the MoE blocks'
    share: the time (GPU and host) inside their forwards and backwards, each
    block's call wrapped in a profiler range by module hooks (the backward's
    through full backward hooks, in these steps only)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    hooks = block_ranges(model)
    try:
        with profile(activities=acts) as prof:
            for ids in data:
                forward_backward(model, stash, opt, ids)
                opt.step()
                sync(device)
    finally:
        for h in hooks:
            h.remove()
    n = len(data)
    ev = prof.key_averages()

    def own_us(e):  # the event's own time on its device (names differ across torch versions)
        for a in (("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)):
            if getattr(e, a, None) is not None:
                return getattr(e, a)
        return 0

    timed = [e for e in ev if e.device_type == DeviceType.CUDA] if cuda else \
        [e for e in ev if e.key.startswith("aten::")]
    top = sorted(timed, key=own_us, reverse=True)[:10]
    # the ranges' host-side events (on CUDA the profiler also lists them on the GPU's timeline: not those)
    raw = prof.events()
    ranges = {k: [e for e in raw if e.name == k and e.device_type == DeviceType.CPU] for k in ("moe_forward",
                                                                                              "moe_backward")}
    return {"steps": n,
            "kernels_per_step": sum(e.count for e in timed) / n if cuda else None,
            "gpu_ms_per_step": sum(own_us(e) for e in timed) / n / 1e3 if cuda else None,
            "host_syncs_per_step": sum(e.count for e in ev if e.key in _SYNCS) / n,
            "items_per_step": sum(e.count for e in ev if e.key == "aten::item") / n,
            "aten_ops_per_step": sum(e.count for e in ev if e.key.startswith("aten::")) / n,
            "top": [(e.key[:90], own_us(e) / n / 1e3, e.count / n) for e in top],
            "moe": {k: {"gpu_ms_per_step": sum(_device_us(e) for e in ranges[k]) / n / 1e3 if cuda else None,
                        "host_ms_per_step": sum(e.cpu_time_total for e in ranges[k]) / n / 1e3}
                    for k in ranges}}


def _device_us(e):
    """An event's device time with its children's (names differ across torch versions)."""
    for a in ("device_time_total", "cuda_time_total"):
        if getattr(e, a, None) is not None:
            return getattr(e, a)
    return 0


def block_ranges(model):
    """Profiler ranges "moe_forward" / "moe_backward" around every MoE
    block's forward and backward (transformers' or ours); returns the hook
    handles to remove."""
    from torch.profiler import record_function
    handles = []
    for m in model.modules():
        if type(m).__name__ not in ("Qwen3MoeSparseMoeBlock", "Qwen3MoeBlock"):
            continue

        def enter(name, mod):
            mod._bench_range = record_function(name)
            mod._bench_range.__enter__()

        def leave(mod):
            r = getattr(mod, "_bench_range", None)
            if r is not None:
                mod._bench_range = None
                r.__exit__(None, None, None)

        handles += [m.register_forward_pre_hook(lambda mod, args, e=enter: e("moe_forward", mod)),
                    m.register_forward_hook(lambda mod, args, out, lv=leave: lv(mod)),
                    m.register_full_backward_pre_hook(lambda mod, go, e=enter: e("moe_backward", mod)),
                    m.register_full_backward_hook(lambda mod, gi, go, lv=leave: lv(mod))]
    return handles


def print_profiles(results):
    for variant, r in results.items():
        p = r.get("profile")
        if not p:
            continue
        k = f"{p['kernels_per_step']:.0f} kernels, {p['gpu_ms_per_step']:.1f} ms of GPU time, " \
            if p["kernels_per_step"] is not None else ""
        print(f"\nprofile of {name_of(variant)} ({p['steps']} steps), per step: {k}{p['host_syncs_per_step']:.0f} host "
              f"syncs, {p['items_per_step']:.0f} .item(), {p['aten_ops_per_step']:.0f} aten ops; the most time:")
        moe = " | ".join(f"{k.split('_')[1]}: " + (f"{v['gpu_ms_per_step']:.1f} ms GPU, " if v["gpu_ms_per_step"]
                                                      is not None else "") + f"{v['host_ms_per_step']:.1f} ms host"
                         for k, v in p["moe"].items())
        print(f"  in the MoE blocks, per step: {moe}")
        for name, ms, count in p["top"]:
            print(f"  {ms:>8.2f} ms {count:>6.0f}x  {name}")


def saved_bytes(model, ids, stash, device):
    """Bytes of the distinct device storages autograd saves for the backward
    of one step (the parameters excluded): a forward and backward under a
    saved_tensors_hooks that counts them, outside the timed steps."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if t.device.type == device.type and st.data_ptr() not in params:  # "cuda" is not "cuda:0"
            seen[st.data_ptr()] = st.nbytes()
        return t

    while True:
        model.zero_grad(set_to_none=True)
        if stash:
            stash.step_begin()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if stash is None or stash.step_check():
            break
        seen.clear()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def pool_bytes(stash):
    """(device, pinned host) bytes of the StashManager's pools: the saved
    activations that live in the library's pages."""
    dev = host = 0
    for r in stash.report() if stash else ():
        if r["policy"].startswith("offload"):
            host += r["pages"] * r["page_bytes"]
        else:
            dev += r["pages"] * r["page_bytes"]
    return dev, host


def train(args, device, variant, data, ep=None):
    """The run of `variant`: losses per step, mean step ms over steps 2..N,
    peak bytes (torch's max allocated plus the library's own peak, from a
    reset at the start: an upper bound of their sum, the library's memory
    being its pools and workspaces, made in the first step and kept) and the
    memory breakdown (see Memory, saved_bytes, pool_bytes). ep:
    expert-parallel (each rank's loss / W, the replicated gradients summed;
    the mean loss over the ranks is returned)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        mt.reset_library_peak(device)
    mem = Memory(device)
    model, stash = build(args, device, variant, ep, ep is not None and args.window)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    world = ep.world if ep else 1
    losses, times, attempts = [], [], 0
    for ids in data:
        sync(device)
        t0 = time.perf_counter()
        loss, n = forward_backward(model, stash, opt, ids, world, mem)
        attempts += n
        if ep:
            if not ep.check():
                raise SystemExit(f"bench: an expert-parallel budget was passed (rank {ep.rank}): rerun with a "
                                 f"larger --capacity (now {args.capacity})")
            replicated_grads_sum(model, ep.group)
            loss = loss.detach().clone()
            ep.group.allreduce([loss]).wait()
            loss /= world
        opt.step()
        mem.end("optimizer")
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if len(times) == 1 and mem.cuda:
            mem.static = torch.cuda.memory_allocated()
    out = {"losses": losses, "step_ms": 1e3 * sum(times[1:]) / max(len(times) - 1, 1), "peak_bytes": 0,
           "attempts": attempts}
    if mem.cuda:
        lib_in_use, lib_peak = mt.library_memory(device)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out.update(peak_bytes=mem.peak() + lib_peak, torch_peak_bytes=mem.peak(), library_peak_bytes=lib_peak,
                   library_bytes=lib_in_use, phase_peak_bytes=dict(mem.peaks), weights_bytes=params,
                   grads_bytes=params, optimizer_bytes=mem.static - 2 * params, static_bytes=mem.static)
    if ep is None:
        dev, host = pool_bytes(stash)
        out.update(pool_bytes=dev, pool_host_bytes=host, saved_bytes=saved_bytes(model, data[0], stash, device))
    if variant.split(":", 1)[1] in args.profile:
        try:
            out["profile"] = profile_steps(model, stash, opt, data[-3:], device)
        except Exception as e:  # noqa: BLE001 (the profile is extra: the timed results stand)
            out["profile_error"] = f"{type(e).__name__}: {e}"
            print(f"bench: profile of {variant} failed: {out['profile_error']}")
    if stash:  # its pools are the library's memory, kept while the manager lives (Binding.registry holds it)
        stash.close()
    del model, opt, stash
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 50; --large: 20)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-ffn", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=None, help="sequences a step (default 8; --large: 16)")
    ap.add_argument("--seq", type=int, default=None, help="tokens a sequence (default 1024; --large: 2048)")
    ap.add_argument("--ep-policy", default="keep", choices=sorted(set(POLICIES) - REGATHER),
                    help="the moestash policy of the torchrun (expert-parallel) run")
    ap.add_argument("--capacity", type=float, default=2.0,
                    help="expert-parallel budgets over the mean rows a rank receives / sends a rank")
    ap.add_argument("--window", action="store_true",
                    help="expert-parallel dispatch into the communicator's window rows (--ep-policy stash or mix)")
    ap.add_argument("--small", action="store_true", help="a tiny model on the CPU")
    ap.add_argument("--large", action="store_true",
                    help="16 x 2048 tokens a step (4x the default's: MoE activations and compute weigh more), "
                         "20 steps, eager skipped; explicit --batch / --seq / --steps win")
    ap.add_argument("--variants", help="comma-separated variants to run (default: all): transformers "
                    f"implementations (eager, grouped_mm, ...) and moestash policies ({', '.join(POLICIES)})")
    ap.add_argument("--profile", default="",
                    help="comma-separated variants to profile: 3 more steps each under torch.profiler (kernels, "
                         "GPU time, host syncs, .item(), top kernels per step), after the timed ones")
    ap.add_argument("--no-eager", action="store_true",
                    help="skip transformers' eager experts (about 4x slower than grouped_mm; off with --large)")
    ap.add_argument("--json", help="write the results here (default: under $OUT when it is set)")
    args = ap.parse_args()
    for k, v in PRESETS["large" if args.large else "default"].items():
        if getattr(args, k) is None:  # a flag given wins over the preset
            setattr(args, k, v)
    args.no_eager = args.no_eager or args.large
    args.profile = [v for v in args.profile.split(",") if v]
    if args.variants:
        unknown = set(args.variants.split(",")) - set(implementations()) - set(POLICIES)
        if unknown:
            ap.error(f"--variants: unknown {', '.join(sorted(unknown))} (transformers: {', '.join(implementations())};"
                     f" moestash: {', '.join(POLICIES)})")
    if args.small or not torch.cuda.is_available():
        args.steps = min(args.steps, 5)
        args.layers, args.hidden, args.moe_ffn, args.experts, args.topk = 2, 64, 32, 8, 2
        args.heads, args.kv_heads, args.head_dim, args.vocab, args.batch, args.seq = 4, 2, 16, 256, 2, 32
    return args


def describe(args, device, world=1):
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Qwen3MoeForCausalLM(config(args)).parameters())
    return (f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
            f"{f' x {world}' if world > 1 else ''}, torch {torch.__version__}; {args.layers} layers, hidden "
            f"{args.hidden}, {args.experts} experts top-{args.topk} of width {args.moe_ffn} ({n_params / 1e9:.2f} B "
            f"parameters), {args.batch} x {args.seq} tokens a step{' a GPU' if world > 1 else ''}, {args.steps} steps")


def write_json(args, name, payload):
    path = args.json or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {path}")


def fresh_context(device):
    """Closes the library's shared context of `device` (made again on first
    use): the MLP workspaces an earlier variant sized (a recompute's z among
    them) are not counted in the next one's library memory. The earlier
    variant's model and StashManager are gone by then."""
    from moestash.torch import _core
    if device.type == "cuda":
        ctx = _core._contexts.pop(_core._canonical(device), None)
    else:
        ctx, _core._cpu.ctx = getattr(_core._cpu, "ctx", None), None
    if ctx is not None:
        ctx.close()


def variants(args):
    """The variants to run, in order: "hf:<implementation>", "moestash:<policy name>"."""
    chosen = args.variants.split(",") if args.variants else None
    hf = [i for i in implementations() if (chosen is None or i in chosen) and not (i == "eager" and args.no_eager
                                                                                   and chosen is None)]
    ours = [p for p in POLICIES if chosen is None or p in chosen]
    return [f"hf:{i}" for i in hf] + [f"moestash:{p}" for p in ours]


def experts_saved_bytes(args):
    """What every layer's experts save under keep, from the shapes: fc1_input
    [T k, H], act_input [T k, 2F], fc2_input [T k, F] bf16 and probs [T k]
    fp32 (routing indices and the router's own tensors not counted)."""
    rows = args.batch * args.seq * args.topk
    return args.layers * rows * (2 * (args.hidden + 3 * args.moe_ffn) + 4)


def gib(n):
    return f"{n / 2 ** 30:.2f}"


def print_memory(args, results, best):
    """The peak's breakdown per variant, and what the 0.8x target asks for."""
    print(f"\nmemory (GiB): peak = torch's max allocated + the library's peak (pools + workspaces, kept from the "
          f"first step); static = weights + grads + optimizer state, allocated after step 1; saved = what autograd "
          f"keeps for the backward (distinct device storages, parameters excluded); pages = the library's pools "
          f"(device | pinned host); grads are freed before each forward (zero_grad set_to_none)")
    print(f"{'variant':>26} | {'peak':>6} | {'static':>6} | {'peak-st':>7} | {'fwd pk':>6} | {'bwd pk':>6} | "
          f"{'opt pk':>6} | {'saved':>6} | {'pages':>13} | {'lib':>5} | attempts")
    for variant, r in results.items():
        if "error" in r or "static_bytes" not in r:
            continue
        ph = r["phase_peak_bytes"]
        print(f"{name_of(variant):>26} | {gib(r['peak_bytes']):>6} | {gib(r['static_bytes']):>6} | "
              f"{gib(r['peak_bytes'] - r['static_bytes']):>7} | {gib(ph['forward']):>6} | {gib(ph['backward']):>6} | "
              f"{gib(ph['optimizer']):>6} | {gib(r['saved_bytes']):>6} | "
              f"{gib(r['pool_bytes']):>5} | {gib(r['pool_host_bytes']):>5} | {gib(r['library_peak_bytes']):>5} | "
              f"{r['attempts']}")
    b = results[best]
    if "static_bytes" not in b:
        return
    moe = experts_saved_bytes(args)
    above = b["peak_bytes"] - b["static_bytes"]
    print(f"{name_of(best)}: weights {gib(b['weights_bytes'])} + grads {gib(b['grads_bytes'])} + optimizer "
          f"{gib(b['optimizer_bytes'])} = {gib(b['static_bytes'])} GiB static, {gib(above)} GiB above it at the peak; "
          f"the experts' saved activations (keep, from the shapes): {gib(moe)} GiB = "
          f"{100 * moe / b['peak_bytes']:.0f} % of its peak. 0.8x its peak is {gib(0.8 * b['peak_bytes'])} GiB: "
          f"{gib(0.2 * b['peak_bytes'])} GiB less, {0.2 * b['peak_bytes'] / moe:.2f}x the experts' saved activations")


def name_of(variant):
    kind, what = variant.split(":", 1)
    return what if kind == "hf" else "moestash " + what


def one_device(args):
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    data = batches(args, device)
    print(describe(args, device), flush=True)
    results = {}
    for variant in variants(args):
        fresh_context(device)
        t0 = time.perf_counter()
        try:
            r = results[variant] = train(args, device, variant, data)
            print(f"  {name_of(variant)}: {r['step_ms']:.1f} ms a step, peak {gib(r['peak_bytes'])} GiB, "
                  f"{r['attempts']} attempts ({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 (out of memory, a kernel package missing: listed, the rest run)
            results[variant] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ran = {v: r for v, r in results.items() if "error" not in r and v.startswith("hf:")}
    if not ran:
        print("no transformers implementation ran")
        return 1
    best = min(ran, key=lambda v: ran[v]["step_ms"])
    base = results.get("hf:grouped_mm", ran[best])
    base = base if "error" not in base else ran[best]
    print(f"{'variant':>26} | {'step ms':>8} | {'vs best':>7} | {'peak GiB':>8} | {'vs best':>7} | "
          f"loss first -> last | max rel. diff vs grouped_mm")
    for variant, r in results.items():
        name = name_of(variant)
        if "error" in r:
            print(f"{name:>26} | failed: {r['error']}")
            continue
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])]
        r["speedup_vs_best"] = ran[best]["step_ms"] / r["step_ms"]
        r["peak_vs_best"] = r["peak_bytes"] / ran[best]["peak_bytes"] if ran[best]["peak_bytes"] else None
        r["max_rel_loss_diff"] = max(diffs)
        peak = f"{r['peak_bytes'] / 2 ** 30:>8.2f} | {r['peak_vs_best']:>6.2f}x" if r["peak_vs_best"] else \
            f"{'-':>8} | {'-':>7}"
        print(f"{name:>26} | {r['step_ms']:>8.1f} | {r['speedup_vs_best']:>6.2f}x | {peak} | "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {max(diffs):.2e}")
    print(f"best transformers implementation: {best.split(':')[1]}; targets: moestash >= 1.3x its step time, "
          "peak with stash <= 0.8x its peak")
    if device.type == "cuda":
        print_memory(args, results, best)
    else:
        print("saved bytes (autograd | pages device | host), CPU: " + "; ".join(
            f"{name_of(v)} {r['saved_bytes']} | {r['pool_bytes']} | {r['pool_host_bytes']}"
            for v, r in results.items() if "error" not in r))
    print_profiles(results)
    write_json(args, "bench_qwen3_moe.json",
               {"device": str(device), "shape": vars(args), "best": best, "results": results})
    return 0


def expert_parallel(args):
    """The torchrun run: one-GPU baseline on rank 0, then every rank expert-parallel."""
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    if args.experts % world:
        raise SystemExit(f"bench: --experts {args.experts} is not a multiple of the {world} ranks")
    variant = f"moestash:{args.ep_policy}"
    tokens = args.batch * args.seq
    if rank == 0:
        print(describe(args, device, world))
    single = None
    if rank == 0:  # the same-run baseline: one GPU, the same tokens a step as each rank below
        single = train(args, device, variant, batches(args, device))
        single["tokens_per_s"] = tokens / single["step_ms"] * 1e3
    dist.barrier()
    rows = args.capacity * tokens * args.topk
    ep = mt.ExpertParallel(args.experts, args.topk, args.hidden, max_tokens=tokens, max_rows=int(rows),
                           pair_rows=int(rows / world) + 1, window_rows=int(rows) if args.window else 0,
                           device=device, group=group)
    r = train(args, device, variant, batches(args, device, seed=1 + rank), ep)
    losses, ms, peak = r["losses"], r["step_ms"], r["peak_bytes"]
    peaks = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([float(peak)], dtype=torch.float64, device=device))
    steps = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    path = ep.path
    ep.close()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    ms = steps.item()
    multi = {"losses": losses, "step_ms": ms, "tokens_per_s": world * tokens / ms * 1e3, "path": path,
             "peak_bytes_per_rank": [p.item() for p in peaks]}
    ratio = multi["tokens_per_s"] / single["tokens_per_s"]
    print(f"{'run':>22} | {'step ms':>8} | {'tokens/s':>10} | peak GiB | loss first -> last")
    print(f"{'1 GPU':>22} | {single['step_ms']:>8.1f} | {single['tokens_per_s']:>10.0f} | "
          f"{single['peak_bytes'] / 2 ** 30:>8.2f} | {single['losses'][0]:.4f} -> {single['losses'][-1]:.4f}")
    print(f"{f'{world} GPUs expert-parallel':>22} | {ms:>8.1f} | {multi['tokens_per_s']:>10.0f} | "
          f"{max(multi['peak_bytes_per_rank']) / 2 ** 30:>8.2f} | {losses[0]:.4f} -> {losses[-1]:.4f} "
          "(mean over ranks)")
    print(f"policy {args.ep_policy}{', window rows' if args.window else ''}, exchange: {path}; tokens/s {world} "
          f"GPUs / 1 GPU at the same tokens a GPU: {ratio:.2f}x (target >= {0.85 * world:.1f}x)")
    write_json(args, f"bench_qwen3_moe_ep{world}.json",
               {"device": torch.cuda.get_device_name(device), "world": world, "shape": vars(args),
                "single": single, "expert_parallel": multi, "scaling": ratio})
    return 0


def main():
    args = parse()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return expert_parallel(args)
    return one_device(args)


if __name__ == "__main__":
    sys.exit(main())
