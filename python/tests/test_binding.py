"""The ctypes binding without PyTorch: the library loads, its prototypes
match (a grouped linear forward on the CPU backend through raw pointers, vs
a reference computed here), and a failed call raises with the library's
message."""
import ctypes
import random
import re

import pytest

import moestash
from moestash import _lib


def bf16_array(values):
    src = (ctypes.c_float * len(values))(*values)
    out = (ctypes.c_uint16 * len(values))()
    _lib.lib.mst_fp32_to_bf16_array(out, src, len(values))
    return out


def to_float(arr):
    out = (ctypes.c_float * len(arr))()
    _lib.lib.mst_bf16_to_fp32_array(out, arr, len(arr))
    return list(out)


@pytest.fixture
def ctx():
    p = ctypes.c_void_p()
    _lib.call("mst_ctx_create", _lib.BACKEND_CPU, 0, ctypes.byref(p))
    yield p
    _lib.lib.mst_ctx_destroy(p)


def test_grouped_linear_forward_through_raw_pointers(ctx):
    rng = random.Random(5)
    E, R, I, O, counts = 3, 7, 5, 4, [2, 0, 4]  # a zero-size group, one padding row
    x = bf16_array([rng.uniform(-1, 1) for _ in range(R * I)])
    w = bf16_array([rng.uniform(-1, 1) for _ in range(E * O * I)])
    y = bf16_array([9.0] * (R * O))  # poisoned
    c = (ctypes.c_int32 * E)(*counts)
    t = lambda data, dt, r, k: _lib.tensor(ctypes.cast(data, ctypes.c_void_p), dt, r, k)  # noqa: E731
    args = [t(x, _lib.DTYPE_BF16, R, I), t(w, _lib.DTYPE_BF16, E * O, I), _lib.ABSENT, _lib.ABSENT,
            t(c, _lib.DTYPE_INT32, E, 1), t(y, _lib.DTYPE_BF16, R, O)]
    _lib.call("mst_grouped_linear_forward", ctx, *[ctypes.byref(a) for a in args])
    xf, wf, yf = to_float(x), to_float(w), to_float(y)
    groups = [g for g, n in enumerate(counts) for _ in range(n)]
    for r, g in enumerate(groups):
        for o in range(O):
            want = sum(xf[r * I + i] * wf[(g * O + o) * I + i] for i in range(I))
            assert abs(yf[r * O + o] - want) <= 1e-2 * (1 + abs(want)), (r, o)
    assert yf[len(groups) * O:] == [9.0] * O, "a padding row was written"


def test_a_bad_argument_raises_with_the_library_message(ctx):
    x = _lib.tensor(None, _lib.DTYPE_BF16, 4, 4)
    with pytest.raises(moestash.InvalidArgument, match=r"mst_grouped_linear_forward: .*counts"):
        _lib.call("mst_grouped_linear_forward", ctx, *([ctypes.byref(x)] * 6))
    assert "counts" in _lib.last_error()


def test_names_and_library_path():
    assert _lib.status_name(_lib.ERR_OVERFLOW)
    assert "libmoestash" in moestash.library_path
    assert re.fullmatch(r"\d+\.\d+\.\d+", moestash.version())
