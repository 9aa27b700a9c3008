"""StashManager(offload_stream=True): the offload pools' copies on a copy
stream beside the compute give the bits of keep and of offload without it,
in the call pattern of examples/torch_moe_layer.py: MoE layers (router
GEMM, softmax, top-k, sort, counts on the device, the gather into
expert-major rows, GroupedMLP, the rows back to their tokens), torch ops on
the current stream before and after each grouped MLP, fp32 masters with
main_grad on the experts' weights and AdamW, several steps on new data
(the first one rerun after the pools grew), a forward without backward
between steps, eager and graphed as the example graphs (step 1 eager, a
warm-up on a side stream, the forward and backward captured with
step_begin inside, replays with step_check and the optimizer eager).

One MoE layer (the example's count) and three (the backward of a layer
then starts the restores of the layer before it); offload of every saved
tensor and the example's mix (fc1_input offloaded, act_input and probs
stashed, fc2_input recomputed). Per step, bit for bit: the loss, the
output, every parameter's gradient (main_grad for the experts) and every
fp32 master after AdamW; a mismatch names the first step and tensor, and
whether it is a NaN. On CUDA also:

- the library context's stream after each forward and backward is torch's
  current stream (a save or restore called back in the middle of an op
  must not move the op's remaining kernels onto the copy stream: the
  reverted bd1216a did, and torch then read outputs not yet written);
- "slow copy": a ~10 ms spin on the copy stream before each MoE layer's
  forward and backward (a missing wait of the current stream on the copy
  stream then reads rows not yet written, whatever the timing of the card);
  "slow main": the same spin on the current stream (a copy that does not
  wait for the current stream reads rows not yet produced).

On the CPU there are no streams: the option changes nothing, and the same
runs check that (graph and slow variants skip); test_prefetch_bookkeeping
runs the prefetch there with restores done at once (the record held
before each backward's, its names restored early into poisoned buffers
and taken by that backward, once each: keep's bits)."""
import pytest
import torch
import torch.nn.functional as Fn

import moestash.torch as mt
from moestash import _lib
from moestash.torch._core import context
from moestash.torch.saver import _TORCH_DTYPE

MIX = "fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash"
POLICIES = {"offload": "offload", "mix": MIX}
SHAPE = {"cuda": (4096, 1024, 256, 16, 4), "cpu": (96, 64, 32, 8, 2)}  # tokens, H, F, E, top-k
STEPS = 3
SPIN_CYCLES = 20_000_000  # torch.cuda._sleep: about 10 ms on an H100
_CUDA_STREAM_LEGACY = 1


class MoeLayer(torch.nn.Module):
    """The example's MoE layer with a deterministic permutation (its
    index_add_ unpermutation adds k rows per token with atomics on CUDA):
    rows gathered through a permutation of the (token, choice) slots, sent
    back by index_copy and summed over the k choices in fp32."""

    def __init__(self, g, H, F, E, k, policy, manager, device, spin):
        super().__init__()
        self.k, self.spin = k, spin
        self.router = torch.nn.Parameter((torch.randn(E, H, generator=g) * H ** -0.5).to(device, torch.bfloat16))
        if policy == "keep":
            self.experts = mt.GroupedMLP(E, H, F, device=device)
        else:
            self.experts = mt.GroupedMLP(E, H, F, policy=policy, stash_manager=manager, device=device)
        with torch.no_grad():
            self.experts.w1.copy_(torch.randn(self.experts.w1.shape, generator=g) * H ** -0.5)
            self.experts.w2.copy_(torch.randn(self.experts.w2.shape, generator=g) * F ** -0.5)
        for p in (self.experts.w1, self.experts.w2):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)

    def forward(self, x):
        self.spin()
        T, H = x.shape
        E, k = self.router.shape[0], self.k
        probs = torch.softmax(Fn.linear(x, self.router).float(), dim=-1)
        top_p, top_e = probs.topk(k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        flat_e = top_e.flatten()
        order = torch.sort(flat_e, stable=True).indices  # [T k]: the slot of each expert-major row
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat_e, torch.ones_like(flat_e, dtype=torch.int32))
        rows = x.unsqueeze(1).expand(T, k, H).reshape(T * k, H)[order]
        y = self.experts(rows, counts, top_p.flatten()[order])
        out = y.new_empty(y.shape).index_copy(0, order, y).view(T, k, H).sum(1, dtype=torch.float32)
        out = out.to(x.dtype)
        if out.requires_grad:
            out.register_hook(self._spin_grad)
        return out

    def _spin_grad(self, grad):
        self.spin()  # before this layer's backward
        return grad


def _spinner(mode, manager, device):
    """The spin of a 'slow' mode, enqueued where it is asked (never inside a capture)."""
    def spin():
        if mode == "none" or torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(device) if mode == "main" else manager.streams.get(device)
        if stream is not None:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SPIN_CYCLES)
    return spin


class Run:
    """One model (policy, copy stream or not) trained STEPS steps as the
    example trains; what each step gives, for the comparison."""

    def __init__(self, device, layers, policy, stream, slow="none", manager=None):
        T, H, F, E, k = SHAPE[device.type]
        self.device, self.T, self.H = device, T, H
        self.name = f"{policy}{' +stream' if stream else ''}"
        self.manager = None if policy == "keep" else manager or mt.StashManager(offload_stream=stream)
        canon = context(device).device
        spin = _spinner(slow, self.manager, canon) if device.type == "cuda" else (lambda: None)
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(MoeLayer(g, H, F, E, k, POLICIES.get(policy, policy), self.manager,
                                                   device, spin) for _ in range(layers))
        self.params = dict(self.layers.named_parameters())
        self.masters = {n: p.detach().float().clone() for n, p in self.params.items()}
        for m in self.masters.values():
            m.grad = torch.zeros_like(m)
        self.opt = torch.optim.AdamW(self.masters.values(), lr=1e-2, weight_decay=0.0,
                                     capturable=device.type == "cuda")
        self.x = torch.empty(T, H, dtype=torch.bfloat16, device=device)  # static: the graph reads them
        self.target = torch.empty(T, H, dtype=torch.float32, device=device)
        self.loss = torch.zeros((), device=device)
        self.out = None
        self.step_no = 0

    def data(self, step):
        g = torch.Generator().manual_seed(100 + step)
        self.x.copy_(torch.randn(self.T, self.H, generator=g).to(torch.bfloat16))
        self.target.copy_(torch.randn(self.T, self.H, generator=g) * 0.5)

    def model(self, x):
        h = x
        for layer in self.layers:
            h = h + layer(h)
        return h

    def check_stream(self, after):
        """The library context enqueues on torch's current stream again."""
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        ctx = context(self.device)
        want = torch.cuda.current_stream(ctx.device).cuda_stream or _CUDA_STREAM_LEGACY
        got = _lib.lib.mst_ctx_stream(ctx.ptr)
        assert got == want, (f"{self.name}, step {self.step_no}: after the {after} the library context enqueues "
                             f"on stream {got:#x}, not torch's current stream {want:#x} (its later kernels race "
                             "torch's)")

    def fwd_bwd(self):
        for p in self.params.values():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        h = self.model(self.x)
        self.check_stream("forward")
        loss = Fn.mse_loss(h.float(), self.target)
        loss.backward()
        self.check_stream("backward")
        self.loss.copy_(loss.detach())
        self.out = h.detach()

    def optim(self):
        with torch.no_grad():
            for n, p in self.params.items():
                self.masters[n].grad.copy_(p.main_grad if hasattr(p, "main_grad") else p.grad.float())
            self.opt.step()
            for n, p in self.params.items():
                p.copy_(self.masters[n])

    def eager_step(self):
        while True:
            if self.manager:
                self.manager.step_begin()
            self.fwd_bwd()
            if self.manager is None or self.manager.step_check():
                break
        self.optim()

    def capture(self):
        """As the example: a warm-up on a side stream, then the forward and
        backward captured with step_begin inside."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.fwd_bwd()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            if self.manager:
                self.manager.step_begin()
            self.fwd_bwd()
        return graph

    def snapshot(self):
        """What the step gave (after its optimizer step)."""
        got = {"loss": self.loss.clone(), "output": self.out.clone()}
        for n, p in self.params.items():
            got[f"grad of {n}"] = (p.main_grad if hasattr(p, "main_grad") else p.grad).clone()
        for n, m in self.masters.items():
            got[f"fp32 master of {n}"] = m.clone()
        return got

    def train(self, graphed):
        """STEPS steps; a forward without backward after step 1 (its record
        and its copies end at the next step_begin)."""
        out, graph = [], None
        for step in range(1, STEPS + 1):
            self.step_no = step
            self.data(step)
            if step == 1 or not graphed:
                self.eager_step()
            else:
                graph = graph or self.capture()
                graph.replay()
                if self.manager and not self.manager.step_check():  # the pools grew: rerun, capture again
                    self.eager_step()
                    graph = None
                else:
                    self.optim()
            out.append(self.snapshot())
            if step == 1:
                with torch.no_grad():
                    self.layers[0](self.x)
        if self.manager:
            if self.device.type == "cuda":
                assert list(self.manager.streams) == ([context(self.device).device] if self.name.endswith("+stream")
                                                       else []), "the copy stream was not used as asked"
            self.manager.close()
        return out


def first_difference(got, want, what):
    """The first step and tensor where `got` differs from `want` (a NaN or
    differing bits), or None."""
    for step, (g, w) in enumerate(zip(got, want), 1):
        for name, a in g.items():
            b = w[name]
            if torch.equal(a, b):
                continue
            nan = int(torch.isnan(a.float()).sum())
            if nan and not torch.isnan(b.float()).any():
                return f"step {step}: {name} has {nan} NaN of {a.numel()} ({what} has none)"
            diff = a.float() != b.float()
            worst = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item()
            return (f"step {step}: {name} differs from {what} in {int(diff.sum())} of {a.numel()} elements "
                    f"(largest difference {worst:.3g})")
    return None


_refs = {}


def reference(device, layers, policy, graphed):
    """The training of keep, or of a policy without the copy stream (no spin:
    they have no copy stream; bits do not depend on timing)."""
    key = (device.type, layers, policy, graphed)
    if key not in _refs:
        _refs[key] = Run(device, layers, policy, stream=False).train(graphed)
    return _refs[key]


@pytest.mark.parametrize("slow", ["none", "copy", "main"])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("layers", [1, 3])
def test_copy_stream_gives_keeps_bits(device, layers, policy, graphed, slow):
    if device.type == "cpu" and (graphed or slow != "none"):
        pytest.skip("CUDA only: graph capture and stream timings")
    got = Run(device, layers, policy, stream=True, slow=slow).train(graphed)
    mode = f"{layers} layer(s), {policy}, {'graph' if graphed else 'eager'}, slow {slow}"
    for ref_policy in ("keep", policy):
        what = f"{ref_policy}{' without the copy stream' if ref_policy != 'keep' else ''}"
        diff = first_difference(got, reference(device, layers, ref_policy, graphed), what)
        assert diff is None, f"{policy} with offload_stream ({mode}): {diff}"


class AtOnce(mt.StashManager):
    """offload_stream's prefetch on a device without streams: the restore
    runs at once into a NaN-poisoned buffer; counts what was started and
    what the backwards took."""

    def __init__(self):
        super().__init__(offload_stream=True)
        self.started, self.taken = [], []

    def prefetch(self, pool, handle, rows):
        if not pool.host:  # only offload pools have a copy stream
            return None
        buf = torch.full((rows, pool.width), float("nan"), dtype=_TORCH_DTYPE[pool.dtype], device=pool.ctx.device)
        self.restore(pool, handle, buf)
        self.started.append(buf.data_ptr())
        return buf, None

    def prefetched(self, buf, done):
        self.taken.append(buf.data_ptr())
        super().prefetched(buf, done)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("layers", [1, 3])
def test_prefetch_bookkeeping(layers, policy):
    cpu = torch.device("cpu")
    manager = AtOnce()
    got = Run(cpu, layers, policy, stream=True, manager=manager).train(graphed=False)
    diff = first_difference(got, reference(cpu, layers, "keep", False), "keep")
    assert diff is None, f"{policy}, prefetched at once, {layers} layer(s): {diff}"
    names = 4 if policy == "offload" else 1  # offloaded names of a record
    backwards = STEPS + manager.overflows  # the steps and their reruns
    assert sorted(manager.started) == sorted(manager.taken), "a prefetched restore was not taken by its backward, or twice"
    assert len(manager.taken) == (layers - 1) * names * backwards, \
        f"{len(manager.taken)} restores prefetched: expected one per offloaded name of each layer but the last"
