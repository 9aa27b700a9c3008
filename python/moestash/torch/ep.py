"""Expert parallelism over a torch.distributed process group: the library's
dispatch and combine (include/moestash.h, "expert parallelism") as autograd
ops.

    ep = ExpertParallel(n_experts=64, top_k=8, hidden=2048, max_tokens=8192)   # every rank
    rows, row_probs, counts, route = ep.dispatch(x, topk_idx, probs)
    out = grouped_mlp(rows, w1, w2, counts, row_probs, binding=...)   # this rank's El = E / W experts
    y = ep.combine(out, route)

x [N, H] bf16 token rows, topk_idx [N, k] global expert ids (any integer
dtype), probs [N, k] (float; None: no probs) -> rows [R, H] bf16 of this
rank's experts, expert-major (local expert e owns rows [off_e, off_e +
counts[e]), off the exclusive prefix of counts), row_probs [R] fp32 (each
row's prob), counts int32 [El] on the device (never read by the host), R =
max_rows; rows past sum(counts) are not written. combine: out [R, H] ->
y [N, H] bf16, the sum over each token's k rows in fp32, rounded once,
weighted by probs when given (then the experts did not apply them). Both
have backwards through autograd (the library's dispatch and combine
backwards: dx, dprobs; d_out, dprobs). Deterministic, no host sync:
capturable in torch.cuda.graph.

The communicator (one per group; every rank constructs it, in the same order
as its other collectives):
  CUDA   a communicator of the library's own over NCCL, made from the
         library's unique id (mst_ep_id_create on the group's rank 0, sent
         to every rank by a broadcast over the group) with mst_ep_create.
         Not torch's communicator (ProcessGroupNCCL._comm_ptr exists): an
         ncclComm_t is valid only with the NCCL library that made it, and
         torch's (its nvidia-nccl wheel) need not be the one libmoestash
         links; the lsa path also registers its own symmetric window on the
         communicator, and kernels of one communicator on torch's NCCL
         streams and on ours, unordered, could deadlock.
  CPU    the library's CPU twin (mst_ep_create_local): the ranks are threads
         of one process (each with its own CPU context: moestash.torch's CPU
         contexts are per thread), sharing an mst_ep_group made by rank 0,
         whose address the broadcast carries (with the process id: ranks in
         other processes are refused). For tests and debugging.

Budgets (section 12 of docs/DESIGN.md): a rank sends at most pair_rows rows
to one rank and receives at most max_rows rows; past either the context's
flag is raised and that step's outputs are meaningless: check() (one sync,
once per step) says so, and the step is rerun with larger budgets. The
default max_rows, world * pair_rows, no routing can pass.

Routes: a dispatch's routing (an mst_ep_handle) lives in a Route from the
dispatch to the backwards of the dispatch and the combine; it goes back to
the communicator's free list when nothing refers to it any more (the autograd
graph is freed). Making one allocates, so a dispatch inside a CUDA graph
capture takes a free one (run a whole step eagerly first, or reserve(n)),
and the Routes a capture takes belong to its graph from then on.

Window rows (window_rows > 0, dispatch(..., window=True)): the rows and
row_probs are the communicator's own memory (mst_ep_window_rows), which the
transport may store into directly (lsa, and the CPU twin: no receive blocks,
no unpack). They are valid until this communicator's next dispatch: what
keeps them for a backward must copy them (the grouped MLP's stash or offload
of fc1_input does; see moestash.torch.moe.routed_experts).
"""
import ctypes
import itertools
import os
import threading

import torch

from .. import _lib
from ._core import as_mst, context, device_guard
from .stash import join_copy_streams

_local_groups = {}  # key -> _LocalGroup while its ranks join (CPU twin)
_local_lock = threading.Lock()
_keys = itertools.count(1)


class _LocalGroup:
    """An mst_ep_group_t, destroyed when the last communicator of it is."""

    def __init__(self, world):
        ptr = ctypes.c_void_p()
        _lib.call("mst_ep_group_create", world, ctypes.byref(ptr))
        self.ptr = ptr

    def __del__(self):
        if self.ptr:
            _lib.lib.mst_ep_group_destroy(self.ptr)
            self.ptr = None


class Route:
    """The routing of one dispatch (see the module doc)."""

    def __init__(self, ep, handle, captured):
        self.ep, self.handle, self.captured = ep, handle, captured
        self.n_tok = 0  # tokens of the dispatch (N)

    def __del__(self):
        ep = getattr(self, "ep", None)
        if ep is not None and ep.ptr and not self.captured:
            ep._free.append(self.handle)  # the autograd graph that used it is gone


def _group_of(group):
    import torch.distributed as dist
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError("ExpertParallel: no process group given and torch.distributed is not initialized "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")
    return dist.group.WORLD


def _broadcast(group, t):
    """t from the group's rank 0 to every rank, in place (the group's own
    ranks: a group made by new_group or a bare ProcessGroupGloo alike)."""
    group.broadcast(t, 0).wait()


def _as_tensor(ptr, rows, cols, dtype, device):
    """A torch tensor [rows, cols] over library memory at address ptr (no
    copy; valid while the library keeps that memory)."""
    n, elt = rows * cols, torch.empty((), dtype=dtype).element_size()
    raw = {2: torch.int16, 4: torch.float32}[elt]
    if device.type == "cpu":
        t = torch.frombuffer((ctypes.c_byte * (n * elt)).from_address(ptr), dtype=raw, count=n)
    else:
        class _Cai:
            __cuda_array_interface__ = {"shape": (n,), "typestr": "<i2" if elt == 2 else "<f4",
                                        "data": (ptr, False), "version": 3, "strides": None}
        t = torch.as_tensor(_Cai(), device=device)
    return t.view(dtype).view(rows, cols)


class ExpertParallel:
    """An expert-parallel communicator over a process group (module doc).
    n_experts E over all ranks (a multiple of the group's size W), top_k k,
    hidden H (a multiple of 8), max_tokens N (most tokens of a dispatch on
    this rank), max_rows R (most rows this rank's experts receive; None:
    W * pair_rows), pair_rows C (most rows one rank sends one rank; 0: N k),
    path "auto" | "p2p" | "lsa" (NCCL; the CPU twin ignores it),
    window_rows (rows of the window dispatch outputs; 0: none), device
    (default: cuda:current when CUDA is available, else cpu), group (a
    torch.distributed process group; None: the default group)."""

    def __init__(self, n_experts, top_k, hidden, max_tokens, max_rows=None, pair_rows=0, path="auto",
                 window_rows=0, device=None, group=None):
        self.ptr = None
        self.group = _group_of(group)
        self.rank, self.world = self.group.rank(), self.group.size()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.ctx = context(device)
        self.device = self.ctx.device
        if path not in _lib.EP_PATHS:
            raise ValueError(f"path '{path}': expected one of {', '.join(_lib.EP_PATHS)}")
        C = pair_rows or max_tokens * top_k
        self.max_rows = max_rows if max_rows is not None else self.world * C
        self.cfg = _lib.EpConfig(n_experts, top_k, hidden, max_tokens, self.max_rows, pair_rows,
                                 _lib.EP_PATHS.index(path), window_rows)
        self.n_experts, self.top_k, self.hidden = n_experts, top_k, hidden
        self.n_local = n_experts // self.world if n_experts % self.world == 0 else 0
        self._free, self._handles, self._group_ref = [], [], None
        ptr = ctypes.c_void_p()
        if self.device.type == "cuda":
            self._create_nccl(ptr)
        else:
            self._create_local(ptr)
        self.ptr = ptr
        self.path = _lib.lib.mst_ep_path(ptr).decode()

    def _create_nccl(self, ptr):
        eid = _lib.EpId()
        if self.rank == 0:
            _lib.call("mst_ep_id_create", ctypes.byref(eid))
        raw = ctypes.string_at(ctypes.addressof(eid), ctypes.sizeof(eid))
        t = torch.tensor(list(raw), dtype=torch.uint8, device=self.device)
        _broadcast(self.group, t)
        ctypes.memmove(ctypes.addressof(eid), bytes(t.cpu().tolist()), ctypes.sizeof(eid))
        self.ctx.call("mst_ep_create", ctypes.byref(self.cfg), ctypes.byref(eid), self.rank, self.world,
                      ctypes.byref(ptr))

    def _create_local(self, ptr):
        key = 0
        if self.rank == 0:
            key = next(_keys)
            with _local_lock:
                _local_groups[key] = _LocalGroup(self.world)
        t = torch.tensor([os.getpid(), key], dtype=torch.int64)
        _broadcast(self.group, t)
        pid, key = t.tolist()
        if pid != os.getpid():
            raise RuntimeError(f"ExpertParallel on the CPU: rank {self.rank} is in process {os.getpid()}, rank 0 in "
                               f"{pid}; the library's CPU twin joins ranks that are threads of one process (over "
                               "processes, use CUDA devices: NCCL)")
        with _local_lock:
            self._group_ref = _local_groups[key]
        try:
            self.ctx.call("mst_ep_create_local", ctypes.byref(self.cfg), self._group_ref.ptr, self.rank,
                          ctypes.byref(ptr))
        finally:
            done = torch.zeros(1)
            self.group.allreduce([done]).wait()  # every rank took the group: rank 0 forgets it
            if self.rank == 0:
                with _local_lock:
                    _local_groups.pop(key, None)

    # ---- routes ---------------------------------------------------------------

    def reserve(self, n):
        """Makes routes until n are free (for dispatches inside a capture)."""
        while len(self._free) < n:
            self._free.append(self._make_handle())

    def _make_handle(self):
        h = ctypes.c_void_p()
        with device_guard(self.device):
            _lib.call("mst_ep_handle_create", self.ptr, ctypes.byref(h))
        self._handles.append(h)
        return h

    def _route(self):
        captured = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self._free:
            return Route(self, self._free.pop(), captured)
        if captured:
            raise RuntimeError("moestash: a dispatch inside a CUDA graph capture needs a free route and none is: "
                               "run the captured part eagerly once first, or ExpertParallel.reserve(n) "
                               "(making one allocates)")
        return Route(self, self._make_handle(), False)

    # ---- the ops ----------------------------------------------------------------

    def dispatch(self, x, topk_idx, probs=None, window=False):
        """(rows [R, H] bf16, row_probs [R] fp32 or None, counts int32 [El],
        route); see the module doc."""
        self._check_open()
        route = self._route()
        idx = topk_idx.to(torch.int32).contiguous()
        p = probs.float().contiguous() if probs is not None else None
        route.n_tok = x.shape[0]
        rows, row_probs, counts = _Dispatch.apply(x.contiguous(), idx, p, self, route, bool(window))
        return rows, (row_probs if p is not None else None), counts, route

    def combine(self, out_rows, route, probs=None):
        """y [N, H] bf16 from the expert outputs out_rows [R, H] of the
        dispatch that made `route` (weighted by probs [N, k] when given)."""
        self._check_open()
        p = probs.float().contiguous() if probs is not None else None
        return _Combine.apply(out_rows.contiguous(), p, self, route)

    def check(self):
        """Host (one sync): True when no budget was passed (nor bad counts
        seen by an op of this context) since the last check; False: rerun
        the step, with larger budgets."""
        self._check_open()
        with device_guard(self.device):
            st = _lib.lib.mst_ctx_check(self.ctx.bind())
        if st == _lib.ERR_COUNTS:
            return False
        _lib.check(st, "mst_ctx_check")
        return True

    def window(self):
        """(rows [R, H] bf16, row_probs [R] fp32): the window outputs as
        torch tensors over the communicator's memory (valid until its next
        dispatch; see the module doc)."""
        self._check_open()
        rows, rp = _lib.Tensor(), _lib.Tensor()
        _lib.call("mst_ep_window_rows", self.ptr, ctypes.byref(rows), ctypes.byref(rp))
        return (_as_tensor(rows.data, rows.rows, rows.cols, torch.bfloat16, self.device),
                _as_tensor(rp.data, rp.rows, 1, torch.float32, self.device).view(-1))

    def _call(self, name, route, *tensors):
        """lib.name(ep, route's handle, tensors...) on torch's current stream
        (the context's stream, which the communicator enqueues on)."""
        with device_guard(self.device):
            self.ctx.bind()
            _lib.call(name, self.ptr, route.handle, *[ctypes.byref(t) for t in tensors])

    def _check_open(self):
        if not self.ptr:
            raise RuntimeError("ExpertParallel: the communicator is closed")

    def close(self):
        """Destroys the routes and the communicator (collective on NCCL: every
        rank closes). Tensors of window() dangle after it."""
        if self.ptr:
            with device_guard(self.device):
                self.ctx.bind()
                for h in self._handles:
                    _lib.lib.mst_ep_handle_destroy(h)
                _lib.lib.mst_ep_destroy(self.ptr)
            self.ptr, self._handles, self._free, self._group_ref = None, [], [], None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


# ---- autograd ---------------------------------------------------------------------


def _out(shape, dtype, device):
    """An output the library writes (uninitialized; tests poison it here)."""
    return torch.empty(shape, dtype=dtype, device=device)


class _Dispatch(torch.autograd.Function):
    """x [N, H] bf16, idx [N, k] int32, probs [N, k] fp32 or None -> rows
    [R, H] bf16, row_probs [R] fp32 ([0] without probs), counts int32 [El];
    backward: dx and dprobs from the rows' and row probs' gradients."""

    @staticmethod
    def forward(ctx, x, idx, probs, ep, route, window):
        d, R, H = ep.device, ep.max_rows, ep.hidden
        with_p = probs is not None
        if window:
            join_copy_streams(d)  # a save of the last window rows may still read them (offload_stream)
            rows, row_probs = ep.window()
        else:
            rows = _out((R, H), torch.bfloat16, d)
            row_probs = _out(R if with_p else 0, torch.float32, d)
        counts = _out(ep.n_local, torch.int32, d)
        ep._call("mst_ep_dispatch", route, as_mst(x, "x", d), as_mst(idx, "topk_idx", d), as_mst(probs, "probs", d),
                 as_mst(rows, "rows", d), as_mst(row_probs if with_p else None, "row_probs", d),
                 as_mst(counts, "counts", d))
        ctx.ep, ctx.route, ctx.n_tok = ep, route, x.shape[0]
        ctx.mark_non_differentiable(counts)
        if not with_p:
            row_probs = row_probs.new_empty(0)
            ctx.mark_non_differentiable(row_probs)
        return rows, row_probs, counts

    @staticmethod
    def backward(ctx, d_rows, d_row_probs, _d_counts):
        ep, d = ctx.ep, ctx.ep.device
        want_x, want_p = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        if d_rows is None:
            d_rows = torch.zeros((ep.max_rows, ep.hidden), dtype=torch.bfloat16, device=d)
        if want_p and d_row_probs is None:
            d_row_probs = torch.zeros(ep.max_rows, dtype=torch.float32, device=d)
        dx = _out((ctx.n_tok, ep.hidden), torch.bfloat16, d)
        dprobs = _out((ctx.n_tok, ep.top_k), torch.float32, d) if want_p else None
        ep._call("mst_ep_dispatch_backward", ctx.route, as_mst(d_rows.contiguous(), "d_rows", d),
                 as_mst(d_row_probs.contiguous() if want_p else None, "d_row_probs", d), as_mst(dx, "dx", d),
                 as_mst(dprobs, "dprobs", d))
        return (dx if want_x else None), None, dprobs, None, None, None


class _Combine(torch.autograd.Function):
    """out_rows [R, H] bf16, probs [N, k] fp32 or None -> y [N, H] bf16;
    backward: d_out_rows (dy times the prob, or dy) and dprobs (dy . out)."""

    @staticmethod
    def forward(ctx, out_rows, probs, ep, route):
        d = ep.device
        y = _out((route.n_tok, ep.hidden), torch.bfloat16, d)
        ep._call("mst_ep_combine", route, as_mst(out_rows, "out_rows", d), as_mst(probs, "probs", d), as_mst(y, "y", d))
        ctx.ep, ctx.route = ep, route
        if probs is not None:
            ctx.save_for_backward(out_rows, probs)
        return y

    @staticmethod
    def backward(ctx, dy):
        ep, d = ctx.ep, ctx.ep.device
        saved = ctx.saved_tensors
        out_rows, probs = saved if saved else (None, None)
        d_rows = _out((ep.max_rows, ep.hidden), torch.bfloat16, d)
        dprobs = _out(probs.shape, torch.float32, d) if probs is not None else None
        ep._call("mst_ep_combine_backward", ctx.route, as_mst(dy.contiguous(), "dy", d), as_mst(probs, "probs", d),
                 as_mst(out_rows, "out_rows", d), as_mst(d_rows, "d_rows", d), as_mst(dprobs, "dprobs", d))
        return d_rows, (dprobs if ctx.needs_input_grad[1] else None), None, None
