"""W ranks as threads of this process, each with its own gloo process group
(torch.distributed.ProcessGroupGloo over one in-process store): what the
library's CPU twin of expert parallelism joins (ranks as threads), over the
same process-group calls a torchrun job makes. Each rank's ops need their
own Binding (a Binding's saver serves one call at a time; the default one
is shared by every thread)."""
import datetime
import itertools
import threading

import torch.distributed as dist

_runs = itertools.count()


def run_ranks(world, fn, timeout_s=60):
    """[fn(rank, group) for rank in range(world)], each on its own thread;
    re-raises the first rank's exception (a rank that hangs fails the run)."""
    store = dist.PrefixStore(f"run{next(_runs)}", dist.HashStore())
    out, errors = [None] * world, [None] * world

    def body(rank):
        try:
            group = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))
            out[rank] = fn(rank, group)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for r, t in enumerate(threads):
        t.join(timeout_s)
        if t.is_alive():
            raise TimeoutError(f"rank {r} of {world} did not finish in {timeout_s} s")
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r} of {world} failed: {type(e).__name__}: {e}") from e
    return out
