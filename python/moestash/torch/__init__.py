"""PyTorch ops and modules over libmoestash: ops.py (the torch.library ops),
modules.py (GroupedLinear, GroupedMLP), stash.py (StashManager),
functional.py (the library calls without autograd)."""
from ._core import library_memory  # noqa: F401
from .modules import GroupedLinear, GroupedMLP  # noqa: F401
from .ops import Binding, grouped_linear, grouped_mlp  # noqa: F401
from .stash import StashManager  # noqa: F401
