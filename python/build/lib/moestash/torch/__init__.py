"""PyTorch ops and modules over libmoestash (see ops.py, modules.py)."""
from .ops import Binding, grouped_linear, grouped_mlp  # noqa: F401
