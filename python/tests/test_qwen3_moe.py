"""patch_qwen3_moe: a transformers Qwen3MoeForCausalLM patched onto moestash
against the same model unpatched, on one batch (padding masked): logits,
loss with the load-balancing loss on (output_router_logits,
router_aux_loss_coef), the router logits and every parameter's gradient;
norm_topk_prob on and off; fp32 and bf16 models; against transformers'
default experts implementation (grouped_mm: sort by expert, grouped GEMMs,
the routing weights applied after the down projection, the k rows of a
token summed) and its eager one (a loop over experts, index_add); on the
CPU and, where there is one, on CUDA.

Tolerances (relative norm error, |a - b| / |b|): the library computes the
experts in bf16 whatever the model's dtype (an fp32 model's experts get x
and weights cast to bf16, and act_input, fc2_input and the output are bf16
by the library's contract), so an fp32 model matches within bf16 rounding
carried through the model: 2e-2 for logits and gradients, 1e-3 on the loss
(measured on the CPU: 2.6e-3, 7.3e-3 and 5e-5 at worst). A bf16 model against
transformers' bf16 model: both round at every op, in different places (the
reference rounds h, silu(gate) * up, the output and its weighting
separately, the eager one index_adds in bf16): 3e-2 logits, 6e-2 gradients
(layer norms' weights reduce over every token), 2e-3 on the loss (measured
on the CPU: 8e-3, 2.9e-2 and 1.1e-4 at worst; transformers' eager and
grouped_mm experts give the same bits there).
What is exact is checked bit for bit: layer 0's router logits (the same
router on the same input), the parameters (the same objects), and every
policy against keep.

A top-k near-tie can flip in a later layer between two roundings of the
same model, and then the two are different functions (a token sent to
other experts): the batch is the first of a few seeds whose routing agrees
in every layer (checked from the recorded router logits), as a wrong
routing would disagree on every seed.
"""
import copy

import pytest
import torch

import moestash.torch as mt

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

V, K = 256, 2
TOL = {torch.float32: dict(logits=2e-2, grad=2e-2, loss=1e-3),
       torch.bfloat16: dict(logits=3e-2, grad=6e-2, loss=2e-3)}


def make_model(dtype, norm_topk_prob, device="cpu", experts="grouped_mm"):
    """3 layers (the middle one dense: mlp_only_layers), 8 experts top-2,
    hidden 64, moe width 32, GQA 4 / 2 heads of 16; weights drawn at 0.1
    (transformers' 0.02 leaves the experts' share of the residual stream
    small enough to hide a wrong expert in the logits)."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_experts=8, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
                         router_aux_loss_coef=0.5, initializer_range=0.1, attn_implementation="eager")
    model = Qwen3MoeForCausalLM(cfg)
    model.set_experts_implementation(experts)
    return model.to(device=device, dtype=dtype)


def batch(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the aux loss's masked branch
    return ids.to(device), mask.to(device)


def run(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def routing(out):
    return [torch.topk(r.float(), K, dim=-1).indices.sort(-1).values for r in out.router_logits]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def agreeing_runs(ref, ours, device="cpu"):
    for seed in range(4):
        ids, mask = batch(seed, device)
        want, got = run(ref, ids, mask), run(ours, ids, mask)
        if all(torch.equal(a, b) for a, b in zip(routing(want[0]), routing(got[0]))):
            return want, got
    pytest.fail("the patched model's routing differs from transformers' on every batch tried")


FP32, BF16 = torch.float32, torch.bfloat16
CASES = [(FP32, True, "grouped_mm"), (FP32, False, "grouped_mm"), (BF16, True, "grouped_mm"),
         (BF16, False, "grouped_mm"), (BF16, True, "eager")]
CASE_IDS = [f"{'fp32' if d == FP32 else 'bf16'}-{'norm' if n else 'no_norm'}-{e}" for d, n, e in CASES]


@pytest.mark.parametrize("dtype,norm_topk_prob,experts", CASES, ids=CASE_IDS)
def test_patched_matches_transformers(device, dtype, norm_topk_prob, experts):
    ref = make_model(dtype, norm_topk_prob, device, experts)
    ours = copy.deepcopy(ref)
    before = {n: p for n, p in ours.named_parameters()}
    blocks = mt.patch_qwen3_moe(ours)
    assert len(blocks) == 2 and all(isinstance(ours.model.layers[i].mlp, mt.Qwen3MoeBlock) for i in (0, 2))
    after = dict(ours.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before), "parameters copied"

    (want, wg), (got, gg) = agreeing_runs(ref, ours, device)
    tol = TOL[dtype]
    assert got.aux_loss is not None and len(got.router_logits) == 2
    assert torch.equal(got.router_logits[0], want.router_logits[0])  # the same router on the same input
    assert rel(got.logits, want.logits) < tol["logits"], rel(got.logits, want.logits)
    assert abs(got.loss.item() - want.loss.item()) < tol["loss"] * abs(want.loss.item())
    assert abs(got.aux_loss.item() - want.aux_loss.item()) < tol["loss"] * abs(want.aux_loss.item())
    for n, g in wg.items():
        assert g is not None and gg[n] is not None and gg[n].dtype == g.dtype, n
        assert rel(gg[n], g) < tol["grad"], f"{n}: {rel(gg[n], g):.3g}"


def test_experts_matter():
    """The test above can fail: a wrong expert (each token's rows sent to the
    next expert's weights) moves the logits and the gradients far past the
    tolerances."""
    ref = make_model(torch.float32, True)
    bent = copy.deepcopy(ref)
    with torch.no_grad():
        for layer in (0, 2):
            experts = bent.model.layers[layer].mlp.experts
            for w in (experts.gate_up_proj, experts.down_proj):
                w.copy_(w.roll(1, dims=0))
    (want, wg), (got, gg) = (run(m, *batch(0)) for m in (ref, bent))
    assert rel(got.logits, want.logits) > 5 * TOL[torch.float32]["logits"]
    for n in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight", "model.embed_tokens.weight"):
        assert rel(gg[n], wg[n]) > 5 * TOL[torch.float32]["grad"], n


@pytest.mark.parametrize("policy,paged", [
    ("stash", {"fc1_input", "act_input", "fc2_input", "probs"}),
    ("fc1_input=offload,act_input=stash,fc2_input=recompute,probs=stash", {"fc1_input", "act_input", "probs"})])
def test_policies_change_no_bit(device, policy, paged):
    """The stash and offload policies inside the patched model give keep's
    bits: logits, loss and every gradient."""
    keep = make_model(torch.bfloat16, True, device)
    model = copy.deepcopy(keep)
    mt.patch_qwen3_moe(keep)
    stash = mt.StashManager(page_rows=16)
    mt.patch_qwen3_moe(model, policy=policy, stash=stash)
    ids, mask = batch(0, device)
    want, wg = run(keep, ids, mask)
    for _ in range(3):  # the first steps grow the pools: rerun
        stash.step_begin()
        got, gg = run(model, ids, mask)
        if stash.step_check():
            break
    else:
        pytest.fail("the stash pools still overflow after 3 steps")
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    for n, g in wg.items():
        assert torch.equal(gg[n], g), n
    assert {r["name"] for r in stash.report()} == paged


def _saved_storages(model, ids, mask):
    """{storage address: bytes} of what autograd saves in one step, the
    parameters excluded; and the step's outputs and gradients."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(model, ids, mask)
    return seen, out


@pytest.mark.parametrize("policy", ["keep", "act_input=stash:fp8,fc2_input=recompute,probs=stash"])
def test_regather_changes_no_bit_and_saves_no_rows(device, policy):
    """regather=True: the kept fc1_input rows (T k x H a layer) are not
    saved, the backward gathers them again: the bits of keep's step, and
    autograd holds exactly those rows' bytes less."""
    base = make_model(torch.bfloat16, True, device)
    model = copy.deepcopy(base)
    stash = mt.StashManager(page_rows=16)
    mt.patch_qwen3_moe(base, policy=policy, stash=stash)
    mt.patch_qwen3_moe(model, policy=policy, stash=stash, regather=True)
    ids, mask = batch(0, device)
    for _ in range(3):  # the first steps grow the pools: rerun
        stash.step_begin()
        (want, wg), (got, gg) = run(base, ids, mask), run(model, ids, mask)
        if stash.step_check():
            break
    saved = []
    for m in (base, model):
        stash.step_begin()
        saved.append(_saved_storages(m, ids, mask)[0])
        assert stash.step_check()
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    for n, g in wg.items():
        assert torch.equal(gg[n], g), n
    rows = 2 * ids.numel() * K * 64 * 2  # two MoE layers of T k rows of H bf16
    assert sum(saved[0].values()) - sum(saved[1].values()) == rows
    with pytest.raises(ValueError, match="fc1_input kept"):
        mt.patch_qwen3_moe(make_model(torch.bfloat16, True, device), policy="stash", stash=stash,
                           regather=True)[0](torch.randn(1, 4, 64, device=device, dtype=torch.bfloat16))


def test_router_logits_recorded_when_patched_after_first_use():
    """transformers installs its output recorders on the first forward that
    asks for them: a model patched after that keeps recording its router
    logits (the block calls the same router module)."""
    model = make_model(torch.float32, True)
    ids, mask = batch(0)
    before = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    mt.patch_qwen3_moe(model)
    after = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    assert len(after) == 2 and torch.equal(after[0], before[0])


def test_patch_refuses():
    model = make_model(torch.float32, True)
    mt.patch_qwen3_moe(model)
    with pytest.raises(ValueError, match="no Qwen3MoeSparseMoeBlock"):
        mt.patch_qwen3_moe(model)
    gelu = make_model(torch.float32, True)
    gelu.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        mt.patch_qwen3_moe(gelu)


def test_copies_and_checkpointing_keep_the_bits():
    """A patched model deep-copied (its blocks get Bindings of their own on
    the same StashManager) and run with transformers' gradient checkpointing
    (each layer's forward run again in the backward) gives the bits of the
    model it was copied from."""
    model = make_model(torch.float32, True)
    stash = mt.StashManager(page_rows=16)
    mt.patch_qwen3_moe(model, policy="stash", stash=stash)
    twin = copy.deepcopy(model)
    assert twin.model.layers[0].mlp.binding.id != model.model.layers[0].mlp.binding.id
    assert twin.model.layers[0].mlp.binding.saver.manager is stash
    # transformers >= 5.2x names it activation_checkpointing_enable (the old
    # name warns); the GPU machines' 5.17 has only gradient_checkpointing_enable
    (getattr(twin, "activation_checkpointing_enable", None) or twin.gradient_checkpointing_enable)()
    model.train()
    twin.train()
    calls = []
    twin.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))
    ids, mask = batch(0)
    outs = []
    for m in (model, twin):
        for _ in range(3):  # the first steps grow the pools: rerun
            stash.step_begin()
            out, grads = run(m, ids, mask)
            if stash.step_check():
                break
        outs.append((out, grads))
    (want, wg), (got, gg) = outs
    assert len(calls) >= 2 and len(calls) % 2 == 0, f"{len(calls)} forwards: no recompute in the backward"
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    for n, g in wg.items():
        assert torch.equal(gg[n], g), n


def test_block_compiles_fullgraph():
    """torch.compile(fullgraph=True) of a patched block: no graph break (the
    router, the routing and the grouped MLP trace), the eager bits (aot_eager:
    the same tracing, no C++ build on a 2-core CI machine)."""
    model = make_model(torch.bfloat16, True)
    block = mt.patch_qwen3_moe(model)[0]
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert torch._dynamo.explain(block)(x).graph_break_count == 0
    outs = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        xx = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        y = fn(xx)
        y.float().square().sum().backward()
        outs.append([y.detach(), xx.grad] + [p.grad.clone() for p in block.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def ep_reference(world, device="cpu"):
    """The fp32 model, W copies of it, a batch of 2 W sequences whose top-k
    agrees between transformers' experts and the patched model's, and the
    unpatched model's output and gradients on all of it."""
    ref_model = make_model(FP32, True, device)
    local = copy.deepcopy(ref_model)
    mt.patch_qwen3_moe(local)
    for seed in range(4):  # a batch whose top-k has no near-tie between the two roundings
        ids = torch.randint(0, V, (2 * world, 24), generator=torch.Generator().manual_seed(seed)).to(device)
        outs = [m(input_ids=ids, output_router_logits=True) for m in (ref_model, local)]
        if all(torch.equal(a, b) for a, b in zip(routing(outs[0]), routing(outs[1]))):
            break
    else:
        pytest.fail("the patched model's routing differs from transformers' on every batch tried")
    copies = [copy.deepcopy(ref_model) for _ in range(world)]
    ref_model.zero_grad(set_to_none=True)
    want = ref_model(input_ids=ids, labels=ids)
    want.loss.backward()
    return copies, ids, want, {n: p.grad for n, p in ref_model.named_parameters()}


def ep_rank_step(model, ids, rank, world, group, device="cpu"):
    """Rank `rank`'s step of the expert-parallel model on its two sequences:
    logits, loss, every gradient (the replicated ones summed over the
    ranks), and its experts' count."""
    ep = mt.ExpertParallel(8, K, 64, max_tokens=2 * 24, device=device, group=group)
    mt.patch_qwen3_moe(model, ep=ep)
    mine = ids[2 * rank:2 * rank + 2]
    out = model(input_ids=mine, labels=mine)
    (out.loss / world).backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        if "experts" not in n:
            group.allreduce([g]).wait()  # the replicated parameters: every rank's share
        grads[n] = g.cpu()
    assert ep.check()
    ep.close()
    return out.logits.detach().cpu(), out.loss.detach().cpu(), grads, ep.n_local


def check_ep_rank(res, rank, world, want, wg):
    """One rank's ep_rank_step against the reference (logits, gradients)."""
    logits, _, grads, El = res
    tol = TOL[FP32]
    assert rel(logits, want.logits[2 * rank:2 * rank + 2].cpu()) < tol["logits"]
    assert grads.keys() == wg.keys()
    for n, g in wg.items():
        want_g = (g[rank * El:(rank + 1) * El] if "experts" in n else g).cpu()
        assert grads[n].shape == want_g.shape, n
        assert rel(grads[n], want_g) < tol["grad"], f"rank {rank} {n}: {rel(grads[n], want_g):.3g}"


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_transformers(world):
    """patch_qwen3_moe(ep=): W ranks (threads of this process, each with a
    gloo group and the library's CPU twin communicator, tests/ranks.py),
    each holding the whole fp32 model and two sequences of its own, against
    the unpatched model on the W ranks' sequences together: each rank's
    logits, the loss (the mean of the ranks' means, equal token counts), the
    replicated parameters' gradients (each rank's of loss / W, summed over
    the ranks, as data parallelism does) and each rank's experts' gradients
    (their rows of the reference's). The load-balancing loss is off: it is
    not a mean over tokens (a product of the batch's loads and probs), so
    no per-rank share sums to it. fp32 tolerances (the experts in bf16;
    the combine rounds each token's sum to bf16 once more). The same on
    GPUs over NCCL: test_ep_gpu.py."""
    from ranks import run_ranks

    copies, ids, want, wg = ep_reference(world)
    res = run_ranks(world, lambda rank, group: ep_rank_step(copies[rank], ids, rank, world, group))
    loss = sum(r[1] for r in res) / world
    assert abs(loss.item() - want.loss.item()) < TOL[FP32]["loss"] * abs(want.loss.item())
    for rank in range(world):
        check_ep_rank(res[rank], rank, world, want, wg)
