"""Shared fixtures: the devices a test runs on (cpu always; cuda when torch
sees a GPU, skipped cleanly otherwise) and random ragged problems."""
import pytest

try:
    import torch
except ImportError:  # test_binding.py runs without PyTorch; the rest skip
    torch = None
collect_ignore = [] if torch else ["test_grouped_linear.py", "test_grouped_mlp.py", "test_errors.py",
                                   "test_capture.py", "test_compile.py", "test_modules.py",
                                   "test_qwen3_moe.py", "test_torchtitan_moe.py"]


def _cuda_ok():
    if torch is None or not torch.cuda.is_available():
        return False
    import moestash._lib as L
    return bool(L.lib.mst_backend_available(L.BACKEND_CUDA))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _cuda_ok(), reason="no CUDA device or "
                                                                   "libmoestash without the CUDA backend"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def cuda():
    if not _cuda_ok():
        pytest.skip("no CUDA device or libmoestash without the CUDA backend")
    return torch.device("cuda")
