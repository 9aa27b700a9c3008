"""moestash: graph-safe grouped GEMMs, a grouped MLP and a paged activation
stash for mixture-of-experts layers.

`moestash` itself is the ctypes binding of libmoestash (no PyTorch needed);
`moestash.torch` has the PyTorch ops and modules.
"""
from ._lib import InvalidArgument, MoestashError, Overflow, version  # noqa: F401
from ._lib import path as library_path  # noqa: F401

__version__ = "0.2.0"
