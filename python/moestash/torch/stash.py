"""StashManager: the library's paged pools behind the stash and offload
policies, shared by every layer that names the manager.

One pool per (device, saved name, policy, width): device pages for stash,
pinned host pages for offload; fp8 pages for "stash:fp8" / "offload:fp8"
(bf16 rows as e4m3 with a scale per 128 values, restored as bf16). A save packs the rows [0, sum(counts)) into
pages on torch's current stream (no host sync, capturable); a pool that runs
out of pages raises its overflow flag on the device, the save takes nothing,
and the backward reads zeros. The training loop checks once per step:

    while True:
        manager.step_begin()            # resets the pools (capturable)
        loss = train_step()             # forward + backward (+ optimizer that may read manager.overflowed())
        if manager.step_check():        # one small read per pool
            break                       # the step is good
        zero the gradients              # the pools overflowed and were grown: rerun the step

On overflow the pools double; after a step that follows a growth the pools
are sized to ceil(peak pages * factor) (as the C memory manager sizes them
from its measuring step). A growth replaces the pools: a CUDA graph captured
with the old ones must be captured again (rerun the step eagerly first).

Partial graphs (torch.cuda.make_graphed_callables over MoE blocks, the rest
eager) share the pools with the eager layers: step_begin() stays eager, the
captured forwards save into pages that their captured backwards read. The
handles a capture takes belong to its graph from then on (never handed to
another forward); a capture makes none (that allocates), so run one whole
step eagerly before capturing, and size the pools first (initial_rows, or
eager steps until step_check() passes): a growth after the capture would
replace the pools the graphs hold.
"""
import contextlib
import ctypes
import math

import torch

from .. import _lib
from ._core import as_mst, context, device_guard
from .saver import capturing

_WIDTH_DTYPE = {"probs": _lib.DTYPE_FP32}


class Pool:
    """One mst_pool_t and its handles, by max_rows."""

    def __init__(self, ctx, dtype, width, pages, page_rows, host):
        self.ctx, self.dtype, self.width, self.pages, self.page_rows, self.host = (
            ctx, dtype, width, pages, page_rows, host)
        cfg = _lib.PoolConfig(page_rows, 0 if host else pages, pages if host else 0, 0)
        ptr = ctypes.c_void_p()
        ctx.call("mst_pool_create", dtype, width, ctypes.byref(cfg), ctypes.byref(ptr))
        self.ptr = ptr
        self.free = {}  # max_rows -> [handle]
        self.handles = []
        self.max_rows = 0  # the largest save asked for

    @contextlib.contextmanager
    def on_current_stream(self):
        """The pool's operations run on its context's stream: torch's current
        stream and device."""
        with device_guard(self.ctx.device):
            self.ctx.bind()
            yield

    def call(self, name, *args):
        """lib.name(pool, *args) on torch's current stream and device."""
        with self.on_current_stream():
            _lib.call(name, self.ptr, *args)

    def poll(self):
        """mst_pool_poll after the work on torch's current stream: its status
        (MST_ERR_OVERFLOW when the pool overflowed since its reset)."""
        with self.on_current_stream():
            return _lib.lib.mst_pool_poll(self.ptr)

    def take(self, max_rows):
        free = self.free.setdefault(max_rows, [])
        if free:
            return free.pop()
        if capturing(self.ctx.device):  # making one allocates: not inside a capture
            raise RuntimeError(f"moestash: a stash handle of {max_rows} rows is needed inside a CUDA graph capture "
                               "and none is free: run the captured part eagerly once, within a whole step, "
                               "before capturing it (handles are made outside captures)")
        h = ctypes.c_void_p()
        self.call("mst_stash_handle_create", max_rows, ctypes.byref(h))
        self.handles.append(h)
        return h

    def put(self, max_rows, handle):
        self.free.setdefault(max_rows, []).append(handle)

    def stats(self):
        s = _lib.PoolStats()
        self.call("mst_pool_stats_get", ctypes.byref(s))
        return s

    def close(self):
        if self.ptr:
            with self.on_current_stream():  # the library waits for that stream before it frees
                for h in self.handles:
                    _lib.lib.mst_stash_handle_destroy(h)
                _lib.lib.mst_pool_destroy(self.ptr)
            self.ptr, self.handles, self.free = None, [], {}


class StashManager:
    """The pools of the stash / offload policies (see the module doc).
    initial_rows: rows each pool holds before the first growth (default:
    the max_rows of the first save); factor: pages over the measured peak."""

    def __init__(self, page_rows=64, factor=1.10, initial_rows=None):
        self.page_rows, self.factor, self.initial_rows = page_rows, factor, initial_rows
        self.pools = {}  # (device, name, policy, width) -> Pool
        self.resize = False  # the pools grew: size them from the next good step's peak
        self.overflows = 0
        self.records = {}  # record id -> Record of a forward whose backward has not run

    # ---- the saver's side ---------------------------------------------------

    def take(self, policy, name, device, max_rows, width):
        key = (device, name, policy, width)
        pool = self.pools.get(key)
        if pool is None:
            rows = self.initial_rows or max_rows
            dtype = _lib.DTYPE_FP8 if policy in _lib.FP8_POLICIES else _WIDTH_DTYPE.get(_lib.SAVED_NAMES[name],
                                                                                         _lib.DTYPE_BF16)
            pool = self.pools[key] = Pool(context(device), dtype, width, max(1, math.ceil(rows / self.page_rows)),
                                          self.page_rows, policy.startswith("offload"))
        pool.max_rows = max(pool.max_rows, max_rows)
        return pool, pool.take(max_rows)

    def save(self, pool, handle, src, counts):
        pool.call("mst_stash_save", handle, src, counts)

    def claim(self, pool, handle, rows, counts):
        """Takes the pages of a save whose producer writes them itself."""
        pool.call("mst_stash_claim", handle, rows, counts)

    def pages(self, handle):
        pages = _lib.Pages()
        _lib.call("mst_stash_handle_pages", handle, ctypes.byref(pages))
        return pages

    def restore(self, pool, handle, dst):
        t = as_mst(dst, "restore buffer", dst.device)
        pool.call("mst_stash_restore", handle, ctypes.byref(t))

    def give_back(self, pool, handle):
        pool.call("mst_stash_restore_return", handle)

    def hold(self, rid, record):
        """Keeps the record of forward `rid` for its backward (until the next
        step_begin())."""
        self.records[rid] = record

    def release(self, rid):
        """The record of forward `rid`, no longer held; None when a
        step_begin() came between the forward and its backward."""
        return self.records.pop(rid, None)

    # ---- the training loop's side -------------------------------------------

    def step_begin(self):
        """Resets every pool (one kernel each, on torch's current stream). The
        records of forwards whose backward never ran (a forward under
        torch.no_grad(), an output dropped unused) end here: their pages are
        reset and their handles go back to the pools."""
        for pool in self.pools.values():
            pool.call("mst_pool_reset")
        for record in self.records.values():
            if record.captured:
                continue  # its handles are its graph's
            for pool, handle, max_rows in record.handles.values():
                pool.put(max_rows, handle)
        self.records.clear()

    def overflowed(self, device):
        """int32 [n_pools] on `device`, nonzero where a pool overflowed this
        step (a device-side copy of the flags: for an optimizer that skips
        itself without a host sync)."""
        device = context(device).device  # cuda -> cuda:<current>
        pools = [p for k, p in self.pools.items() if k[0] == device]
        out = torch.zeros(max(len(pools), 1), dtype=torch.int32, device=device)
        for i, p in enumerate(pools):
            p.ctx.call("mst_copy_b2b", ctypes.c_void_p(out.data_ptr() + 4 * i),
                       _lib.lib.mst_pool_overflow_flag(p.ptr), 4)
        return out

    def step_check(self):
        """Host: True when no pool overflowed this step. On overflow every
        overflowed pool doubles (the step must be rerun: False)."""
        over = []
        for key, pool in self.pools.items():
            st = pool.poll()
            if st == _lib.ERR_OVERFLOW:
                over.append(key)
            else:
                _lib.check(st, "mst_pool_poll")
        if over:
            self.overflows += 1
            for key in over:  # at least one more largest save
                pool = self.pools[key]
                self._recreate(key, 2 * pool.pages + math.ceil(pool.max_rows / pool.page_rows))
            self.resize = True
            return False
        if self.resize:
            for key, pool in list(self.pools.items()):
                peak = pool.stats().total_peak
                if peak > 0:  # a pool this step did not use keeps its size
                    self._recreate(key, math.ceil(peak * self.factor))
            self.resize = False
        return True

    def _recreate(self, key, pages):
        old = self.pools[key]
        old.close()
        new = self.pools[key] = Pool(old.ctx, old.dtype, old.width, pages, old.page_rows, old.host)
        new.max_rows = old.max_rows

    def report(self):
        """Per pool: name, policy, width, pages, pages in use at peak, bytes per page."""
        rows = []
        for (device, name, policy, width), pool in self.pools.items():
            s = pool.stats()
            rows.append({"device": str(device), "name": _lib.SAVED_NAMES[name], "policy": policy, "width": width,
                         "pages": pool.pages, "peak_pages": s.total_peak, "page_bytes": s.page_bytes})
        return rows

    def close(self):
        for pool in self.pools.values():
            pool.close()
        self.pools = {}
