"""Torch tensors as library tensors, and the library contexts.

One library context per torch device (CPU tensors: the CPU backend, whose
backend memory is host memory, one context per thread; cuda:i: the CUDA
backend on device i), created on first use. Every call sets the context's stream to torch's current stream
of that device first, so the library's kernels are ordered with torch's (and
captured by torch.cuda.graph). Tensors pass by data pointer, zero-copy, after
the checks the library cannot make itself (device, layout, a dtype it has no
name for); dtype and shape are then checked by the library, whose message the
raised exception carries.
"""
import contextlib
import ctypes
import threading

import torch

from .. import _lib

_CUDA_STREAM_LEGACY = 1  # cudaStreamLegacy
_DTYPES = {torch.bfloat16: _lib.DTYPE_BF16, torch.float32: _lib.DTYPE_FP32, torch.int32: _lib.DTYPE_INT32}


class Context:
    """A library context (mst_ctx_t*) bound to one torch device."""

    def __init__(self, device):
        self.device = device
        kind = _lib.BACKEND_CUDA if device.type == "cuda" else _lib.BACKEND_CPU
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"moestash: device {device} is neither cpu nor cuda")
        if kind == _lib.BACKEND_CUDA and not _lib.lib.mst_backend_available(kind):
            raise RuntimeError(f"moestash: {_lib.path} has no CUDA backend (built without it, or no device)")
        ptr = ctypes.c_void_p()
        with device_guard(device):  # the CUDA backend sets the current device
            _lib.call("mst_ctx_create", kind, device.index or 0, ctypes.byref(ptr))
        self.ptr = ptr

    def bind(self):
        """Sets the context's stream to torch's current stream; returns the pointer.
        torch's default stream is the legacy default stream (handle 0), which
        the library reads as "my own stream": it is passed as cudaStreamLegacy."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device).cuda_stream or _CUDA_STREAM_LEGACY
            _lib.call("mst_ctx_set_stream", self.ptr, ctypes.c_void_p(stream))
        return self.ptr

    def call(self, name, *args):
        """lib.name(ctx, *args) on torch's current stream and device."""
        with device_guard(self.device):
            _lib.call(name, self.bind(), *args)

    @contextlib.contextmanager
    def on_stream(self, stream):
        """The context enqueues on torch CUDA stream `stream` inside the block
        and on the stream it had before after it. A saver callback runs in
        the middle of a library op on this same context: the op's kernels
        after the callback must stay on the op's stream."""
        before = _lib.lib.mst_ctx_stream(self.ptr)
        with device_guard(self.device):
            _lib.call("mst_ctx_set_stream", self.ptr, ctypes.c_void_p(stream.cuda_stream or _CUDA_STREAM_LEGACY))
            try:
                yield self.ptr
            finally:
                _lib.call("mst_ctx_set_stream", self.ptr, ctypes.c_void_p(before))

    def close(self):
        if self.ptr:
            _lib.lib.mst_ctx_destroy(self.ptr)
            self.ptr = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


def device_guard(device):
    """torch.cuda.device(device) for a CUDA device (the library launches on
    the current device), nothing for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


_contexts = {}  # cuda device -> Context
_lock = threading.Lock()
_cpu = threading.local()  # .ctx: this thread's CPU context


def _canonical(device):
    """torch.device(device), cuda with its index (cuda -> cuda:<current>)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _existing(device):
    """The context of a canonical device made so far on this thread (CPU) or
    process (CUDA), or None."""
    return getattr(_cpu, "ctx", None) if device.type == "cpu" else _contexts.get(device)


def context(device):
    """The shared context of a torch device, created on first use: one per
    CUDA device, and for the CPU one per thread (a context is not made for
    concurrent calls, and the CPU twin of expert parallelism runs its ranks
    as threads of one process, each with its own context; see ep.py)."""
    device = _canonical(device)
    if device.type == "cpu":
        if getattr(_cpu, "ctx", None) is None:
            _cpu.ctx = Context(device)
        return _cpu.ctx
    with _lock:
        ctx = _contexts.get(device)
        if ctx is None:
            ctx = _contexts[device] = Context(device)
    return ctx


def library_memory(device):
    """(in use, peak) bytes the library allocated itself on `device` (its
    workspaces, stash pages): memory torch.cuda.max_memory_allocated does
    not see. For the CPU: this thread's context."""
    ctx = _existing(_canonical(device))
    if ctx is None:
        return 0, 0
    in_use, peak = ctypes.c_size_t(), ctypes.c_size_t()
    _lib.lib.mst_ctx_mem(ctx.ptr, ctypes.byref(in_use), ctypes.byref(peak))
    return in_use.value, peak.value


def reset_library_peak(device):
    """Starts a new peak of library_memory(device): the bytes in use now
    (mst_ctx_mem_reset_peak), so that a later peak is that of what ran after."""
    ctx = _existing(_canonical(device))
    if ctx is not None:
        _lib.lib.mst_ctx_mem_reset_peak(ctx.ptr)


def as_mst(t, name, device):
    """An mst_tensor view of torch tensor `t` (None: absent), 2-D as the
    library sees it: [n] -> [n, 1]; [a, b] as is; [a, b, c] -> [a*b, c].
    Raises ValueError / TypeError naming `name` for what the library cannot
    check: device, layout, an unknown dtype, a dimension count. A known dtype
    and the shape are the library's to check."""
    if t is None:
        return _lib.Tensor(None, _lib.DTYPE_BF16, 0, 0)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}, expected a torch.Tensor")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of x)")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}.dtype is {t.dtype}: moestash takes bfloat16, float32 and int32 tensors")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    if t.dim() == 1:
        rows, cols = t.shape[0], 1
    elif t.dim() == 2:
        rows, cols = t.shape
    elif t.dim() == 3:
        rows, cols = t.shape[0] * t.shape[1], t.shape[2]
    else:
        raise ValueError(f"{name} has {t.dim()} dimensions (shape {tuple(t.shape)}), expected 1 to 3")
    return _lib.Tensor(t.data_ptr() if t.numel() else None, _DTYPES[t.dtype], rows, cols)


def device_of(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x is a {type(x).__name__}, expected a torch.Tensor")
    return x.device
