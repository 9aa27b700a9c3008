"""PyTorch ops and modules over libmoestash: ops.py (the torch.library ops),
modules.py (GroupedLinear, GroupedMLP), stash.py (StashManager),
functional.py (the library calls without autograd), moe.py (a routed MoE
layer's experts, optionally expert-parallel), ep.py (ExpertParallel:
dispatch and combine over a torch.distributed process group), qwen3_moe.py
and torchtitan_moe.py (transformers' Qwen3-MoE and torchtitan's MoE patched
onto them)."""
from ._core import library_memory, reset_library_peak  # noqa: F401
from .moe import routed_experts  # noqa: F401
from .modules import GroupedLinear, GroupedMLP  # noqa: F401
from .ops import Binding, grouped_linear, grouped_mlp  # noqa: F401
from .stash import StashManager  # noqa: F401
from .qwen3_moe import Qwen3MoeBlock, patch_qwen3_moe  # noqa: F401
from .torchtitan_moe import patch_torchtitan_moe  # noqa: F401
from .ep import ExpertParallel, Route  # noqa: F401
