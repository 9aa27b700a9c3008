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

On overflow a pool grows to the pages its saves of that step could need at
most (the manager counts, on the host, ceil(max_rows / page_rows) for every
handle taken and not yet given back, and keeps the step's largest sum: the
exact need when every save fills its max_rows, as a non-expert-parallel
layer's does), so one rerun suffices; where that bound is not above the
pool's pages (saves it did not see: a captured graph's), it doubles. After
a step that follows a growth the pools are sized to ceil(peak pages *
factor), at most that bound (as the C memory manager sizes them from its
measuring step). A pool is made again only when its size changes. A growth replaces the pools: a CUDA graph captured
with the old ones must be captured again (rerun the step eagerly first).

Partial graphs (torch.cuda.make_graphed_callables over MoE blocks, the rest
eager) share the pools with the eager layers: step_begin() stays eager, the
captured forwards save into pages that their captured backwards read. The
handles a capture takes belong to its graph from then on (never handed to
another forward); a capture makes none (that allocates), so run one whole
step eagerly before capturing, and size the pools first (initial_rows, or
eager steps until step_check() passes): a growth after the capture would
replace the pools the graphs hold.

offload_stream=True (CUDA, eager steps): the offload pools' copies run on a
copy stream of the manager's, beside the compute. A save waits for what
torch's current stream enqueued before it (its rows exist) and its source
tensors are kept from reuse until it is done (Tensor.record_stream); the
current stream does not wait for it. A restore waits for the current
stream, and the current stream waits for the restore before the backward
reads it. After a backward, the restores of the forward held just before
its own (the next backward in a model's reverse order) start on the copy
stream, into buffers allocated there (they wait for nothing of the
current stream); that next backward waits for their event only. The
library context keeps the op's stream: a save or restore called back in
the middle of an op sets the context's stream to the copy stream and back
(Context.on_stream). The manager joins the copy stream into the current
one before it resets, polls, reads or closes its pools; a forward whose
backward ran has nothing left on it. Inside a CUDA graph capture every
copy stays on the capture stream, and a pool a capture used keeps its
copies on the current stream from then on (the replays update its rings
there). As for a tensor autograd saves, the inputs of an offloaded name
must not be written in place before its backward.
"""
import contextlib
import ctypes
import math
import weakref

import torch

from .. import _lib
from ._core import as_mst, context, device_guard
from .saver import _TORCH_DTYPE, capturing

_WIDTH_DTYPE = {"probs": _lib.DTYPE_FP32}
_with_streams = weakref.WeakSet()  # the StashManagers with offload_stream


def join_copy_streams(device):
    """torch's current stream of `device` waits for the copy streams of every
    StashManager: before memory that is not torch's (the expert-parallel
    window rows) is written again, which a save may still read (outside a
    capture; inside one, the eager copies were joined before it)."""
    if device.type != "cuda" or capturing(device):
        return
    for manager in list(_with_streams):
        side = manager.streams.get(device)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)


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
        self.live = 0  # pages the handles taken and not given back may hold: sum ceil(max_rows / page_rows)
        self.demand = 0  # the largest live since the last step_begin (host-side bound of the step's peak)
        self.in_graph = False  # a capture used it: its copies stay on the current stream (its rings)

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

    def call_on(self, stream, name, *args):
        """lib.name(pool, *args) on torch CUDA stream `stream`; the context's
        stream is what it was before afterwards."""
        with self.ctx.on_stream(stream):
            _lib.call(name, self.ptr, *args)

    def poll(self):
        """mst_pool_poll after the work on torch's current stream: its status
        (MST_ERR_OVERFLOW when the pool overflowed since its reset)."""
        with self.on_current_stream():
            return _lib.lib.mst_pool_poll(self.ptr)

    def take(self, max_rows):
        free = self.free.setdefault(max_rows, [])
        if free:
            h = free.pop()
        elif capturing(self.ctx.device):  # making one allocates: not inside a capture
            raise RuntimeError(f"moestash: a stash handle of {max_rows} rows is needed inside a CUDA graph capture "
                               "and none is free: run the captured part eagerly once, within a whole step, "
                               "before capturing it (handles are made outside captures)")
        else:
            h = ctypes.c_void_p()
            self.call("mst_stash_handle_create", max_rows, ctypes.byref(h))
            self.handles.append(h)
        self.live += -(-max_rows // self.page_rows)
        self.demand = max(self.demand, self.live)
        return h

    def put(self, max_rows, handle):
        self.live -= -(-max_rows // self.page_rows)
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
    the max_rows of the first save); factor: pages over the measured peak.
    close() frees the pools (device and pinned host pages): dropping the
    manager does not, the Bindings that name it keep it alive
    (Binding.registry)."""

    def __init__(self, page_rows=64, factor=1.10, initial_rows=None, offload_stream=False):
        self.page_rows, self.factor, self.initial_rows = page_rows, factor, initial_rows
        self.offload_stream = offload_stream
        self.streams = {}  # device -> the copy stream of its offload pools (offload_stream)
        if offload_stream:
            _with_streams.add(self)
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

    def copy_stream(self, pool):
        """The stream of pool's copies: the manager's copy stream for an offload
        pool with offload_stream outside a capture; None: torch's current one."""
        d = pool.ctx.device
        if not (self.offload_stream and pool.host and d.type == "cuda"):
            return None
        if capturing(d):
            pool.in_graph = True  # its replays update the rings on the replaying stream
        if pool.in_graph:
            return None
        if d not in self.streams:
            self.streams[d] = torch.cuda.Stream(d)
        return self.streams[d]

    def _join(self):
        """torch's current streams wait for the copy streams' work (not inside
        a capture: its copies are on the capture stream, and the eager ones
        before it were joined by the backwards that restored them)."""
        for d, side in self.streams.items():
            if not capturing(d):
                torch.cuda.current_stream(d).wait_stream(side)

    def save(self, pool, handle, src, counts, tensors=()):
        """Saves src's rows [0, sum(counts)); tensors: the torch tensors the
        save reads (kept from reuse while the copy stream reads them)."""
        side = self.copy_stream(pool)
        if side is None:
            return pool.call("mst_stash_save", handle, src, counts)
        side.wait_stream(torch.cuda.current_stream(pool.ctx.device))  # the rows exist
        for t in tensors:
            t.record_stream(side)
        pool.call_on(side, "mst_stash_save", handle, src, counts)

    def claim(self, pool, handle, rows, counts):
        """Takes the pages of a save whose producer writes them itself."""
        pool.call("mst_stash_claim", handle, rows, counts)

    def pages(self, handle):
        pages = _lib.Pages()
        _lib.call("mst_stash_handle_pages", handle, ctypes.byref(pages))
        return pages

    def restore(self, pool, handle, dst):
        """Restores the handle's rows into dst, for torch's current stream."""
        t = as_mst(dst, "restore buffer", dst.device)
        side = self.copy_stream(pool)
        if side is None:
            return pool.call("mst_stash_restore", handle, ctypes.byref(t))
        main = torch.cuda.current_stream(pool.ctx.device)
        side.wait_stream(main)  # dst's memory is free of main's earlier work
        pool.call_on(side, "mst_stash_restore", handle, ctypes.byref(t))
        main.wait_stream(side)

    def prefetch(self, pool, handle, rows):
        """Starts the restore of the handle's rows [rows, width] on the copy
        stream into a buffer allocated on it (so it waits for nothing of
        torch's current stream): (buffer, event of its end), or None without
        a copy stream. Its reader calls prefetched(buffer, event) first."""
        side = self.copy_stream(pool)
        if side is None:
            return None
        with torch.cuda.stream(side):
            buf = torch.empty((rows, pool.width), dtype=_TORCH_DTYPE[pool.dtype], device=pool.ctx.device)
        t = as_mst(buf, "restore buffer", buf.device)
        pool.call_on(side, "mst_stash_restore", handle, ctypes.byref(t))
        return buf, side.record_event()

    def prefetched(self, buf, done):
        """Before the current stream reads buffer `buf` of prefetch(): it
        waits for the restore's event `done` (None: nothing to wait for),
        and buf's memory goes back to the copy stream's pool only after the
        current stream read it."""
        if done is None:
            return
        main = torch.cuda.current_stream(buf.device)
        main.wait_event(done)
        buf.record_stream(main)

    def prefetch_before(self, rid):
        """Starts, on the copy stream, the restores of the offloaded names of
        the record held just before forward `rid`'s (offload_stream): the
        backward that comes next in a model's reverse order."""
        earlier = [r for r in self.records if r < rid]
        if self.offload_stream and earlier:
            self.records[max(earlier)].prefetch(self)

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
        self._join()
        for pool in self.pools.values():
            pool.call("mst_pool_reset")
        for record in self.records.values():
            if record.captured:
                continue  # its handles are its graph's
            for pool, handle, max_rows in record.handles.values():
                pool.put(max_rows, handle)
        self.records.clear()
        for pool in self.pools.values():
            pool.demand = pool.live  # a captured graph's handles stay out: its replays save into them

    def overflowed(self, device):
        """int32 [n_pools] on `device`, nonzero where a pool overflowed this
        step (a device-side copy of the flags: for an optimizer that skips
        itself without a host sync)."""
        device = context(device).device  # cuda -> cuda:<current>
        self._join()
        pools = [p for k, p in self.pools.items() if k[0] == device]
        out = torch.zeros(max(len(pools), 1), dtype=torch.int32, device=device)
        for i, p in enumerate(pools):
            p.ctx.call("mst_copy_b2b", ctypes.c_void_p(out.data_ptr() + 4 * i),
                       _lib.lib.mst_pool_overflow_flag(p.ptr), 4)
        return out

    def step_check(self):
        """Host: True when no pool overflowed this step. On overflow every
        overflowed pool grows to the step's bound of its pages, or doubles
        where that bound is not larger (the step must be rerun: False)."""
        over = []
        self._join()
        for key, pool in self.pools.items():
            st = pool.poll()
            if st == _lib.ERR_OVERFLOW:
                over.append(key)
            else:
                _lib.check(st, "mst_pool_poll")
        if over:
            self.overflows += 1
            for key in over:
                pool = self.pools[key]
                grown = 2 * pool.pages + math.ceil(pool.max_rows / pool.page_rows)  # one more largest save
                self._recreate(key, pool.demand if pool.demand > pool.pages else grown)
            self.resize = True
            return False
        if self.resize:
            for key, pool in list(self.pools.items()):
                peak = pool.stats().total_peak
                if peak > 0:  # a pool this step did not use keeps its size
                    self._recreate(key, min(math.ceil(peak * self.factor), max(peak, pool.demand)))
            self.resize = False
        return True

    def _recreate(self, key, pages):
        old = self.pools[key]
        if pages == old.pages:
            return
        old.close()
        new = self.pools[key] = Pool(old.ctx, old.dtype, old.width, pages, old.page_rows, old.host)
        new.max_rows, new.demand = old.max_rows, old.demand

    def report(self):
        """Per pool: name, policy, width, pages, pages in use at peak, bytes per page."""
        rows = []
        self._join()
        for (device, name, policy, width), pool in self.pools.items():
            s = pool.stats()
            rows.append({"device": str(device), "name": _lib.SAVED_NAMES[name], "policy": policy, "width": width,
                         "pages": pool.pages, "peak_pages": s.total_peak, "page_bytes": s.page_bytes})
        return rows

    def close(self):
        self._join()
        for pool in self.pools.values():
            pool.close()
        self.pools = {}
