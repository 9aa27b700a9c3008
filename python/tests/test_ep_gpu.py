"""Expert parallelism over NCCL on 2 GPUs (MST_EP_GPUS: another count):
ep_gpu_worker.py under torchrun (its doc says what it checks). Skipped
below 2 GPUs or without the library's CUDA backend; scripts/gpu-check.sh
runs it in its `ep` section, on a machine with several GPUs."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import _cuda_ok

HERE = os.path.dirname(os.path.abspath(__file__))


def test_ep_over_nccl_under_torchrun():
    n = int(os.environ.get("MST_EP_GPUS", "2"))
    if not _cuda_ok() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices and libmoestash with the CUDA backend")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           os.path.join(HERE, "ep_gpu_worker.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[rank")]
    print("\n".join(lines))
    assert r.returncode == 0, "\n".join(lines) + "\n" + r.stderr[-6000:]
    assert sum("all checks passed" in ln for ln in lines) == n
