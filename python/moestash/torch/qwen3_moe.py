"""transformers' Qwen3-MoE with moestash's experts, in one call:

    import moestash.torch as mt
    model = Qwen3MoeForCausalLM.from_pretrained(...)          # or (config)
    stash = mt.StashManager()
    mt.patch_qwen3_moe(model, policy="fc1_input=stash,act_input=stash,fc2_input=recompute", stash=stash)
    # a training step: stash.step_begin(); loss = model(...).loss; loss.backward(); stash.step_check()

Every Qwen3MoeSparseMoeBlock becomes a Qwen3MoeBlock holding the same two
modules, `gate` (the Qwen3MoeTopKRouter) and `experts` (Qwen3MoeExperts):
the same parameters, no copy, the same state_dict keys. The block calls the
router module itself, so its top-k (renormalised when config.norm_topk_prob)
is transformers' own, and the output recorder transformers hangs on the
router (router_logits for output_router_logits and the load-balancing loss,
router_aux_loss_coef) records as before. The experts run on the grouped MLP
(moestash.torch.moe.routed_experts): experts.gate_up_proj [E, 2F, H] (gate
rows first, then up) is the MLP's w1 and experts.down_proj [E, H, F] its
w2, as they are. In a bf16 model that is zero copy; in a model of another
dtype the block casts x and the two expert weights to bf16 for the call
(the library computes in bf16), one conversion each per forward.

Expert-parallel (ep=moestash.torch.ExpertParallel over the ranks of a
process group, every rank holding the whole model): each block keeps only
this rank's El = E / W experts, gate_up_proj[r El:(r+1) El] and
down_proj[...] (one copy each, made at patch time; the state_dict keys
stay, with El experts), and the tokens go to their experts' ranks and back
through the library's dispatch and combine (moestash.torch.moe). The
router and every other parameter stay replicated: their gradients are the
rank's own batch's, to be averaged over the ranks as data parallelism does
(the experts' gradients already sum every rank's tokens).
"""
import torch

from .moe import routed_experts
from .ops import Binding


class Qwen3MoeBlock(torch.nn.Module):
    """Qwen3MoeSparseMoeBlock's forward on moestash, over that block's own
    router and experts (see the module doc)."""

    def __init__(self, block, policy="keep", stash=None, ep=None, window=False, regather=False):
        super().__init__()
        _check_experts(block.experts)
        self.gate, self.experts = block.gate, block.experts
        self.binding = Binding(policy, stash)
        self.ep, self.window, self.regather = ep, window, regather
        if ep is not None:
            _shard_experts(self.experts, ep)

    def forward(self, hidden_states):
        """hidden_states [B, S, H] -> [B, S, H], as the block it replaces."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        _, weights, index = self.gate(x)  # [T, k] each, transformers' routing
        y = routed_experts(x, index, weights, self.experts.gate_up_proj, self.experts.down_proj, self.binding,
                           ep=self.ep, window=self.window, regather=self.regather)
        return y.view(shape)


def _check_experts(experts):
    """The layout and activation the grouped MLP computes, or ValueError
    naming what differs."""
    act = getattr(experts.config, "hidden_act", "silu") if hasattr(experts, "config") else "silu"
    if act != "silu":
        raise ValueError(f"patch_qwen3_moe: hidden_act '{act}': the grouped MLP computes SwiGLU (silu) only")
    for flag, want in (("is_transposed", False), ("has_bias", False), ("has_gate", True), ("is_concatenated", True),
                       ("_is_expert_parallel", False)):
        if getattr(experts, flag, want) != want:
            raise ValueError(f"patch_qwen3_moe: experts.{flag} is {getattr(experts, flag)}, expected {want} "
                             "(gate_up_proj [E, 2F, H] gate rows first, down_proj [E, H, F], no bias)")
    E, F2, H = experts.gate_up_proj.shape
    if experts.down_proj.shape != (E, H, F2 // 2):
        raise ValueError(f"patch_qwen3_moe: down_proj shape {tuple(experts.down_proj.shape)}, expected "
                         f"{(E, H, F2 // 2)} for gate_up_proj {tuple(experts.gate_up_proj.shape)}")


def _shard_experts(experts, ep):
    """Keeps this rank's experts (a copy of their rows: the others' memory is freed)."""
    E = experts.gate_up_proj.shape[0]
    if E != ep.n_experts:
        raise ValueError(f"patch_qwen3_moe: the model has {E} experts, the communicator {ep.n_experts}")
    lo, hi = ep.rank * ep.n_local, (ep.rank + 1) * ep.n_local
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        setattr(experts, name, torch.nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
    experts.num_experts = ep.n_local


def patch_qwen3_moe(model, policy="keep", stash=None, ep=None, window=False, regather=False):
    """Replaces every Qwen3MoeSparseMoeBlock under `model` (a
    Qwen3MoeForCausalLM, Qwen3MoeModel, ...) by a Qwen3MoeBlock on the same
    parameters; policy and stash as moestash.torch.GroupedMLP's (policy,
    stash_manager), one Binding per block; ep, window: expert-parallel over
    that communicator (see the module doc); regather: a kept fc1_input is
    gathered again from the block's input in the backward instead of saved
    (moestash.torch.moe.routed_experts). Returns the new blocks, in the
    model's order; raises ValueError when there is none to replace."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, Qwen3MoeSparseMoeBlock)]
    if not targets:
        raise ValueError(f"patch_qwen3_moe: no Qwen3MoeSparseMoeBlock in the {type(model).__name__} given "
                         "(already patched, or not a Qwen3-MoE model)")
    blocks = []
    for parent, name, child in targets:
        block = Qwen3MoeBlock(child, policy, stash, ep, window, regather)
        setattr(parent, name, block)
        blocks.append(block)
    return blocks
