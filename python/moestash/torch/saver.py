"""A grouped MLP's saved activations, per name and policy, as an mst_saver
written in Python (ctypes callbacks the library calls during the op).

  keep       the tensor stays a torch tensor that autograd saves (the op's
             extra outputs act_input / fc2_input, or its inputs x / probs)
  recompute  fc2_input only: not saved, the library recomputes it in backward
  stash      packed into the device pages of the StashManager's pool
  offload    packed into its pinned host pages

A Saver serves one call at a time; what a forward stashed is a Record (the
handles of its names), which the backward of the same forward takes back.
Stashed fc1_input, act_input and fc2_input are read by the backward straight
from their device pages (no restore); offloaded names, probs, and every name
whose wgrad is deferred, are restored into a torch buffer.
"""
import contextlib

import torch

from .. import _lib
from ._core import as_mst

FC1_INPUT, ACT_INPUT, FC2_INPUT, PROBS = range(4)
_IN_PLACE = (FC1_INPUT, ACT_INPUT, FC2_INPUT)  # the library's readers take their pages
_CLAIMABLE = (ACT_INPUT, FC2_INPUT)  # their producer (the activation) writes pages itself
_TORCH_DTYPE = {_lib.DTYPE_BF16: torch.bfloat16, _lib.DTYPE_FP32: torch.float32,
                _lib.DTYPE_FP8: torch.bfloat16}  # a pool's rows: fp8 pages hold bf16 rows


def parse_policy(policy):
    """'keep' | 'stash' | ... for every name, or {name: policy}; returns the
    tuple of four policies in mst_saved_name order. Stash and offload take a
    page format: 'stash:fp8' (e4m3 pages, bf16 tensors: a bare one leaves
    probs, fp32, the plain policy) or 'stash:bf16' (= 'stash')."""
    if isinstance(policy, str):
        policy = {n: policy.replace(":fp8", "") if n == "probs" else policy for n in _lib.SAVED_NAMES} \
            if "=" not in policy else dict(kv.split("=", 1) for kv in policy.split(","))
    policy = {n: p[:-len(":bf16")] if p in ("stash:bf16", "offload:bf16") else p for n, p in policy.items()}
    out = ["keep"] * len(_lib.SAVED_NAMES)
    for name, p in policy.items():
        if name not in _lib.SAVED_NAMES:
            raise ValueError(f"saved name '{name}': expected one of {', '.join(_lib.SAVED_NAMES)}")
        if p not in _lib.POLICIES + _lib.FP8_POLICIES:
            raise ValueError(f"policy '{p}' of {name}: expected one of {', '.join(_lib.POLICIES + _lib.FP8_POLICIES)}")
        if p in _lib.FP8_POLICIES and name == "probs":
            raise ValueError(f"policy {p} of probs: probs is fp32, fp8 pages hold bf16 tensors")
        if p == "recompute" and name != "fc2_input":
            raise ValueError(f"policy recompute of {name}: the grouped MLP recomputes fc2_input only")
        out[_lib.SAVED_NAMES.index(name)] = p
    return tuple(out)


def capturing(device):
    """A CUDA graph capture is under way on device's current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Record:
    """What one forward left for its backward: handles of paged names.
    captured: the forward ran inside a CUDA graph capture; its handles then
    belong to that graph, whose replays save into them (see Saver._release)."""

    def __init__(self, captured=False, rows=0):
        self.handles = {}  # name -> (pool, handle, max_rows)
        self.claimed = set()  # names whose pages the producer wrote (no save)
        self.captured = captured
        self.rows = rows  # R of the forward
        self.prefetched = {}  # name -> (buffer [R, width], event): restores started early

    def prefetch(self, manager):
        """Starts the restores of its names in pools with a copy stream
        (StashManager.offload_stream), once each; none of a captured record
        (its graph's replays restore them)."""
        for name, (pool, handle, _) in self.handles.items():
            if self.captured or name in self.prefetched:
                continue
            pre = manager.prefetch(pool, handle, self.rows)
            if pre is not None:
                self.prefetched[name] = pre


class Saver:
    """The mst_saver of one grouped MLP layer (policies fixed at creation)."""

    def __init__(self, policies, manager=None):
        self.policies = policies
        self.manager = manager
        if manager is None and any(p.split(":")[0] in ("stash", "offload") for p in policies):
            raise ValueError("stash and offload need a moestash.torch.StashManager")
        self.error = None
        self._cb = (_lib.PRODUCE(self._guarded(self._produce)), _lib.COMMIT(self._guarded(self._commit)),
                    _lib.FETCH(self._guarded(self._fetch)), _lib.RELEASE(self._guarded(self._release)))
        self._claim_cb = _lib.CLAIM(self._guarded(self._claim))
        self.struct = _lib.Saver(None, *self._cb, self._claim_cb)
        self._begin(None, None, None)

    def kept(self, name):
        return self.policies[name] == "keep"

    def paged(self, name):
        return self.policies[name].split(":")[0] in ("stash", "offload")

    def in_place(self, name):
        """The backward reads the name from its device pages (no restore).
        Offloaded names are restored: read in place, over PCIe, the wgrad
        GEMM would read them once per row block of its output (an H100 took
        94 ms for a fc1_input of 65536 x 2048 where keep took 4.3 ms)."""
        return name in _IN_PLACE and self.policies[name] == "stash" and not self.restore_all

    # ---- one call --------------------------------------------------------

    def _begin(self, device, record, saved, restore=False, max_rows=0, widths=None, inputs=()):
        self.device, self.record, self.saved, self.inputs = device, record, saved or {}, inputs
        self.restore_all, self.max_rows, self.widths = restore, max_rows, widths
        self.produced, self.keepalive = {}, []

    def forward(self, device, max_rows, ffn, inputs=()):
        """Arms the saver for one forward; returns its Record. inputs: the
        op's torch tensors a save may read (x, probs, counts)."""
        self._begin(device, Record(capturing(device), max_rows), None, max_rows=max_rows,
                    widths={ACT_INPUT: 2 * ffn, FC2_INPUT: ffn}, inputs=inputs)
        return self.record

    def backward(self, device, record, saved, restore_all):
        """Arms the saver for the backward of `record`; `saved` maps kept
        names to their tensors; restore_all: restore paged names into torch
        buffers (deferred wgrads read them after the op)."""
        self._begin(device, record, saved, restore=restore_all)

    def end(self):
        """Ends the call: returns (produced, keepalive), the tensors the
        forward produced and what the library still reads after the call, and
        holds no tensor of it any more. (A saved output the saver kept would
        keep its autograd graph alive into the next step, and with it the
        AccumulateGrad nodes of that step's stream: a backward captured on
        another stream would then sync with the default stream.)"""
        out = (self.produced, self.keepalive)
        self._begin(None, None, None)
        return out

    @contextlib.contextmanager
    def calling(self):
        """Around the library call: re-raises what a callback raised."""
        self.error = None
        try:
            yield
        except _lib.MoestashError:
            if self.error is not None:
                raise self.error
            raise
        if self.error is not None:
            raise self.error

    def _guarded(self, fn):
        def cb(_self, *args):
            try:
                fn(*args)
                return _lib.OK
            except Exception as e:  # noqa: BLE001 (carried back by calling())
                self.error = e
                return _lib.ERR_STATE
        return cb

    # ---- the callbacks -------------------------------------------------------

    def _produce(self, name, rows, cols, dtype, out):
        t = torch.empty((rows, cols), dtype=_TORCH_DTYPE[dtype], device=self.device)
        self.produced[name] = t
        out[0] = as_mst(t, _lib.SAVED_NAMES[name], self.device)

    def _claim(self, name, counts, out):
        """Stashed act_input / fc2_input: pages taken now, written by the
        activation (device pages only; offloaded names are saved by commit)."""
        out[0] = _lib.Pages()  # table NULL: not claimed
        if name not in _CLAIMABLE or self.policies[name] != "stash":
            return
        pool, handle = self.manager.take("stash", name, self.device, self.max_rows, self.widths[name])
        self.record.handles[name] = (pool, handle, self.max_rows)
        self.record.claimed.add(name)
        self.manager.claim(pool, handle, self.max_rows, counts)
        out[0] = self.manager.pages(handle)

    def _commit(self, name, src, counts):
        if not self.paged(name) or name in self.record.claimed:
            return
        pool, handle = self.manager.take(self.policies[name], name, self.device, self.max_rows, src[0].cols)
        self.record.handles[name] = (pool, handle, self.max_rows)
        reads = (src[0].data, counts[0].data)
        tensors = [t for t in (*self.inputs, *self.produced.values())
                   if t is not None and t.numel() and t.data_ptr() in reads]
        self.manager.save(pool, handle, src, counts, tensors)

    def _fetch(self, name, out):
        policy = self.policies[name]
        if policy == "recompute":
            return self._absent(name, out)
        if policy == "keep":
            out[0] = as_mst(self.saved[name], _lib.SAVED_NAMES[name], self.device)
            return
        pool, handle, _ = self.record.handles[name]
        rows = self.saved["rows"]
        if self.in_place(name):
            pages = self.manager.pages(handle)
            self.keepalive.append(pages)
            out[0] = _lib.tensor(pages.table, pool.dtype, rows, pool.width, pages)
            return
        pre = self.record.prefetched.pop(name, None)
        if pre is not None:  # started by the backward before this one, on the copy stream
            buf = pre[0]
            self.manager.prefetched(*pre)
        else:
            buf = torch.empty((rows, pool.width), dtype=_TORCH_DTYPE[pool.dtype], device=self.device)
            self.manager.restore(pool, handle, buf)
        self.keepalive.append(buf)
        out[0] = as_mst(buf, _lib.SAVED_NAMES[name], self.device)

    def _absent(self, name, out):
        """A RECOMPUTE fc2_input [R, F]: data NULL, the library recomputes it."""
        out[0] = _lib.tensor(None, _lib.DTYPE_BF16, self.saved["rows"], self.saved["ffn"])

    def _release(self, name):
        if not self.paged(name) or name not in self.record.handles:
            return
        pool, handle, max_rows = self.record.handles.pop(name)
        if self.in_place(name):
            self.manager.give_back(pool, handle)
        if not (self.record.captured or capturing(self.device)):
            pool.put(max_rows, handle)
        # else the handle stays the graph's: its replays save into and read from it (a partial graph's
        # forward and backward; a whole captured step), so no other forward may take it
