"""The ctypes binding of libmoestash's public C API (include/moestash.h).

PyTorch-free: structs, prototypes, error translation and the search for the
shared library. Everything above it (moestash.torch) passes tensors to the
library by data pointer through these structs.

Where the library is looked for, first hit wins:
  1. $MOESTASH_LIB (a path to the .so);
  2. a copy bundled in this package (moestash/lib/libmoestash.so*);
  3. pkg-config's libdir of `moestash`;
  4. the build folders of the source tree this package sits in
     (build-gpu/, build/), for `pip install -e` and running from the tree;
  5. the system's library path (ctypes.util.find_library).
"""
import ctypes
import ctypes.util
import glob
import os
import subprocess

# ---- enums (values as in moestash.h) ---------------------------------------

OK, ERR_INVALID, ERR_OOM, ERR_COUNTS, ERR_OVERFLOW, ERR_BACKEND, ERR_UNSUPPORTED, ERR_STATE, ERR_IO = range(9)
DTYPE_BF16, DTYPE_FP32, DTYPE_INT32, DTYPE_FP8 = range(4)  # fp8: a pool's pages only
BACKEND_CPU, BACKEND_CUDA = range(2)
WGRAD_OVERWRITE, WGRAD_ACCUMULATE, WGRAD_DEFERRED = range(3)
SAVED_NAMES = ("fc1_input", "act_input", "fc2_input", "probs")  # mst_saved_name order
POLICIES = ("keep", "stash", "offload", "recompute")  # mst_policy order
FP8_POLICIES = ("stash:fp8", "offload:fp8")  # stash and offload with fp8 pages (MST_POLICY_FP8)
ACTIVATIONS = ("swiglu", "clamped_swiglu")  # mst_activation order
EP_PATHS = ("auto", "p2p", "lsa")  # mst_ep_path_kind order


class MoestashError(RuntimeError):
    """A failed library call: .status (mst_status), .func and the library's
    message (mst_last_error()) in str()."""

    def __init__(self, func, status, message):
        self.func, self.status, self.message = func, status, message
        super().__init__(f"{func}: {message} [{status_name(status)}]")


class InvalidArgument(MoestashError, ValueError):
    """MST_ERR_INVALID: a bad argument, named with its value by the library."""


class Overflow(MoestashError):
    """MST_ERR_OVERFLOW: a stash pool ran out of pages: rerun the step."""


# ---- structs ---------------------------------------------------------------
# Each mirrors the C struct named by its _c_name, field for field (checked
# against the header by python/tests/test_layout.py, which compiles a program
# that prints the C sizes and offsets).


class _Sized(ctypes.Structure):
    """A struct that may grow: its first field, struct_size, is set to this
    mirror's size (moestash.h, "struct sizes"); positional arguments fill the
    fields after it."""

    def __init__(self, *args, **kw):
        super().__init__(ctypes.sizeof(type(self)), *args, **kw)


class Pages(ctypes.Structure):
    _c_name = "mst_pages"
    _fields_ = [("table", ctypes.c_void_p), ("block", ctypes.c_void_p * 2),
                ("n_pages", ctypes.c_int64 * 2), ("page_rows", ctypes.c_int64),
                ("table_rows", ctypes.c_int64)]


class Tensor(ctypes.Structure):
    _c_name = "mst_tensor"
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("rows", ctypes.c_int64),
                ("cols", ctypes.c_int64), ("pages", ctypes.POINTER(Pages))]


PRODUCE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_int, ctypes.POINTER(Tensor))
COMMIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(Tensor),
                          ctypes.POINTER(Tensor))
FETCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(Tensor))
RELEASE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
CLAIM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(Tensor),
                         ctypes.POINTER(Pages))


class Saver(_Sized):
    _c_name = "mst_saver"
    _fields_ = [("struct_size", ctypes.c_size_t), ("self", ctypes.c_void_p), ("produce", PRODUCE),
                ("commit", COMMIT), ("fetch", FETCH), ("release", RELEASE), ("claim", CLAIM)]


class MlpConfig(_Sized):
    _c_name = "mst_mlp_config"
    _fields_ = [("struct_size", ctypes.c_size_t), ("n_groups", ctypes.c_int32), ("hidden", ctypes.c_int64),
                ("ffn", ctypes.c_int64), ("act", ctypes.c_int), ("clamp_limit", ctypes.c_float),
                ("clamp_alpha", ctypes.c_float)]


class MlpWeights(ctypes.Structure):
    _c_name = "mst_mlp_weights"
    _fields_ = [(n, Tensor) for n in ("w1", "b1", "w2", "b2", "g_w1", "g_b1", "g_w2", "g_b2")]


class PoolConfig(_Sized):
    _c_name = "mst_pool_config"
    _fields_ = [("struct_size", ctypes.c_size_t), ("page_rows", ctypes.c_int64),
                ("n_dev_pages", ctypes.c_int64), ("n_host_pages", ctypes.c_int64), ("copy_sms", ctypes.c_int32)]


class PoolStats(_Sized):
    _c_name = "mst_pool_stats"
    _fields_ = [("struct_size", ctypes.c_size_t)] + [(n, ctypes.c_int64) for n in (
        "page_rows", "page_bytes", "n_dev_pages", "n_host_pages", "dev_used", "host_used",
        "dev_peak", "host_peak", "total_peak", "spilled_pages")] + [("overflowed", ctypes.c_int32)]


class EpConfig(_Sized):
    _c_name = "mst_ep_config"
    _fields_ = [("struct_size", ctypes.c_size_t), ("n_experts", ctypes.c_int32), ("top_k", ctypes.c_int32),
                ("hidden", ctypes.c_int64), ("max_tokens", ctypes.c_int64), ("max_rows", ctypes.c_int64),
                ("pair_rows", ctypes.c_int64), ("path", ctypes.c_int32), ("window_rows", ctypes.c_int64)]


class EpId(ctypes.Structure):
    _c_name = "mst_ep_id"
    _fields_ = [("bytes", ctypes.c_char * 128)]


# ---- prototypes --------------------------------------------------------------

_P = ctypes.c_void_p
_T = ctypes.POINTER(Tensor)
_I, _I64, _S = ctypes.c_int, ctypes.c_int64, ctypes.c_size_t
# name: (restype, argtypes); restype _I is an mst_status, checked by call().
_PROTOS = {
    "mst_version": (ctypes.c_char_p, []),
    "mst_status_str": (ctypes.c_char_p, [_I]),
    "mst_last_error": (ctypes.c_char_p, []),
    "mst_backend_available": (_I, [_I]),
    "mst_fp32_to_bf16_array": (None, [_P, _P, _S]),
    "mst_bf16_to_fp32_array": (None, [_P, _P, _S]),
    "mst_ctx_create": (_I, [_I, _I, ctypes.POINTER(_P)]),
    "mst_ctx_destroy": (None, [_P]),
    "mst_ctx_describe": (ctypes.c_char_p, [_P]),
    "mst_ctx_sync": (_I, [_P]),
    "mst_ctx_check": (_I, [_P]),
    "mst_ctx_mem": (None, [_P, ctypes.POINTER(_S), ctypes.POINTER(_S)]),
    "mst_ctx_mem_reset_peak": (None, [_P]),
    "mst_ctx_stream": (_P, [_P]),
    "mst_ctx_set_stream": (_I, [_P, _P]),
    "mst_alloc": (_I, [_P, _S, ctypes.POINTER(_P)]),
    "mst_free": (None, [_P, _P]),
    "mst_copy_b2b": (_I, [_P, _P, _P, _S]),
    "mst_fill": (_I, [_P, _P, _I, _S]),
    "mst_grouped_linear_forward": (_I, [_P, _T, _T, _T, _T, _T, _T]),
    "mst_grouped_linear_dgrad": (_I, [_P, _T, _T, _T, _T]),
    "mst_grouped_linear_wgrad": (_I, [_P, _T, _T, _T, _T, _T, _T, _T, _T, _I]),
    "mst_wgrad_flush": (_I, [_P]),
    "mst_wgrad_pending": (_I, [_P]),
    "mst_mlp_config_default": (MlpConfig, [ctypes.c_int32, _I64, _I64]),
    "mst_grouped_mlp_forward": (_I, [_P, ctypes.POINTER(MlpConfig), ctypes.POINTER(MlpWeights), _T, _T, _T,
                                     ctypes.POINTER(Saver), _T]),
    "mst_grouped_mlp_backward": (_I, [_P, ctypes.POINTER(MlpConfig), ctypes.POINTER(MlpWeights), _T, _T,
                                      ctypes.POINTER(Saver), _T, _T, _I]),
    "mst_pool_create": (_I, [_P, _I, _I64, ctypes.POINTER(PoolConfig), ctypes.POINTER(_P)]),
    "mst_pool_destroy": (None, [_P]),
    "mst_pool_reset": (_I, [_P]),
    "mst_pool_check": (_I, [_P]),
    "mst_pool_stats_get": (_I, [_P, ctypes.POINTER(PoolStats)]),
    "mst_pool_poll": (_I, [_P]),
    "mst_pool_overflow_flag": (_P, [_P]),
    "mst_stash_handle_create": (_I, [_P, _I64, ctypes.POINTER(_P)]),
    "mst_stash_handle_destroy": (None, [_P]),
    "mst_stash_save": (_I, [_P, _P, _T, _T]),
    "mst_stash_claim": (_I, [_P, _P, _I64, _T]),
    "mst_stash_restore": (_I, [_P, _P, _T]),
    "mst_stash_restore_return": (_I, [_P, _P]),
    "mst_stash_handle_pages": (_I, [_P, ctypes.POINTER(Pages)]),
    "mst_ep_id_create": (_I, [ctypes.POINTER(EpId)]),
    "mst_ep_create": (_I, [_P, ctypes.POINTER(EpConfig), ctypes.POINTER(EpId), _I, _I, ctypes.POINTER(_P)]),
    "mst_ep_group_create": (_I, [_I, ctypes.POINTER(_P)]),
    "mst_ep_group_destroy": (None, [_P]),
    "mst_ep_create_local": (_I, [_P, ctypes.POINTER(EpConfig), _P, _I, ctypes.POINTER(_P)]),
    "mst_ep_destroy": (None, [_P]),
    "mst_ep_rank": (_I, [_P]),
    "mst_ep_world": (_I, [_P]),
    "mst_ep_path": (ctypes.c_char_p, [_P]),
    "mst_ep_window_rows": (_I, [_P, _T, _T]),
    "mst_ep_handle_create": (_I, [_P, ctypes.POINTER(_P)]),
    "mst_ep_handle_destroy": (None, [_P]),
    "mst_ep_dispatch": (_I, [_P, _P, _T, _T, _T, _T, _T, _T]),
    "mst_ep_dispatch_backward": (_I, [_P, _P, _T, _T, _T, _T]),
    "mst_ep_combine": (_I, [_P, _P, _T, _T, _T]),
    "mst_ep_combine_backward": (_I, [_P, _P, _T, _T, _T, _T, _T]),
}


def _candidates():
    env = os.environ.get("MOESTASH_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield from sorted(glob.glob(os.path.join(here, "lib", "libmoestash.so*")))
    try:
        libdir = subprocess.run(["pkg-config", "--variable=libdir", "moestash"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        if libdir:
            yield os.path.join(libdir, "libmoestash.so")
    except (OSError, subprocess.SubprocessError):
        pass
    root = os.path.dirname(os.path.dirname(here))  # python/moestash -> the source tree
    for build in ("build-gpu", "build"):
        yield from sorted(glob.glob(os.path.join(root, build, "libmoestash.so*")))
    found = ctypes.util.find_library("moestash")
    if found:
        yield found


def _load():
    tried = []
    for path in _candidates():
        if not (os.path.isabs(path) and not os.path.exists(path)):
            try:
                return ctypes.CDLL(path), path
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
        tried.append(f"{path} (missing)")
    raise ImportError("moestash: libmoestash.so not found; set MOESTASH_LIB to its path, or build it "
                      "(cmake -S . -B build && cmake --build build). Tried: " + (", ".join(tried) or "nothing"))


lib, path = _load()
for _name, (_res, _args) in _PROTOS.items():
    _f = getattr(lib, _name)
    _f.restype, _f.argtypes = _res, _args


def status_name(status):
    return lib.mst_status_str(status).decode()


def last_error():
    return lib.mst_last_error().decode()


def check(status, func):
    """Raises the MoestashError of a failed call, with the library's message."""
    if status == OK:
        return
    cls = {ERR_INVALID: InvalidArgument, ERR_OVERFLOW: Overflow}.get(status, MoestashError)
    raise cls(func, status, last_error())


def call(name, *args):
    """lib.name(*args), raising on a status other than MST_OK."""
    check(getattr(lib, name)(*args), name)


def version():
    """The library's version, "MAJOR.MINOR.PATCH" (mst_version())."""
    return lib.mst_version().decode()


def tensor(data, dtype, rows, cols, pages=None):
    """An mst_tensor view of `data` (an address, or None for an absent tensor)."""
    t = Tensor(data, dtype, rows, cols)
    if pages is not None:
        t.pages = ctypes.pointer(pages)
    return t


ABSENT = Tensor(None, DTYPE_BF16, 0, 0)
