"""torchtitan's MoE (torchtitan.models.common.moe.MoE) with moestash's
experts, in one call:

    mt.patch_torchtitan_moe(model, policy="keep", stash=None)

Every GroupedExperts under `model` keeps its instance, parameters and
state_dict keys (w1_EFD, w2_EDF, w3_EFD); its class becomes a subclass
whose forward runs the grouped MLP instead of torch._grouped_mm three
times. Everything around the experts stays torchtitan's: the router
(score function, top-k, route_norm, route_scale, the expert bias of
aux-loss-free load balancing), the token dispatcher (sort by expert,
scores applied in combine after the experts, scatter-add), the shared
experts and the token counts. The grouped MLP gets probs = 1 for that
reason (exact: the scores are applied in combine, as before).

One conversion: torchtitan keeps the gate (w1_EFD [E, F, D]) and the up
projection (w3_EFD [E, F, D]) apart, the grouped MLP takes them as one
w1 [E, 2F, D] (gate rows first), so the forward concatenates them (a copy
of 2EFD in bf16; autograd splits the gradient back). w2_EDF [E, D, F] is
the MLP's w2 as it is. The experts compute in bf16, as torchtitan's do.
"""
import torch

from .ops import Binding, grouped_mlp

_classes = {}  # torchtitan's experts class -> its moestash subclass


def _local(w):
    """A DTensor parameter's local shard (as torchtitan's forward takes it)."""
    return w.to_local() if hasattr(w, "to_local") else w


def _forward(self, x_RD, num_tokens_per_expert_E):
    """x_RD [R, D] expert-major rows, num_tokens_per_expert_E [E] -> [R, D]
    in x's dtype, unscaled (combine applies the routing scores)."""
    bf = torch.bfloat16
    w1, w2, w3 = (_local(w).to(bf) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    counts = num_tokens_per_expert_E.to(torch.int32)
    ones = torch.ones(x_RD.shape[0], dtype=torch.float32, device=x_RD.device)
    return grouped_mlp(x_RD.to(bf), torch.cat([w1, w3], dim=1), w2, counts, ones,
                       binding=self.moestash_binding).type_as(x_RD)


def _moestash_class(base):
    if base not in _classes:
        _classes[base] = type(f"Moestash{base.__name__}", (base,), {"forward": _forward, "__doc__": __doc__})
    return _classes[base]


def patch_torchtitan_moe(model, policy="keep", stash=None):
    """Turns every torchtitan GroupedExperts under `model` into moestash's
    (see the module doc); policy and stash as moestash.torch.GroupedMLP's.
    Returns the patched experts modules; ValueError when there is none."""
    from torchtitan.models.common.moe import GroupedExperts

    found = [m for m in model.modules() if isinstance(m, GroupedExperts) and type(m) not in _classes.values()]
    if not found:
        raise ValueError(f"patch_torchtitan_moe: no torchtitan GroupedExperts in the {type(model).__name__} given "
                         "(already patched, or not a torchtitan MoE model)")
    for m in found:
        m.__class__ = _moestash_class(type(m))
        m.moestash_binding = Binding(policy, stash)
    return found
