"""The ctypes mirrors of moestash._lib against the C layouts of
include/moestash.h: a program compiled against the header at test time
prints sizeof and, for every field, offsetof and its size; each mirror
(every ctypes.Structure of _lib, named by its _c_name) must match them, and
must list the header's fields in the header's order. Needs python3, ctypes and
a C compiler ($CC, else cc); no PyTorch.

Also run as a script by CTest (label abi): python3 test_layout.py CC."""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.environ.get("MOESTASH_HEADER", os.path.join(HERE, "..", "..", "include", "moestash.h"))
if __name__ == "__main__":
    sys.path.insert(0, os.path.join(HERE, ".."))  # the package of this tree

from moestash import _lib  # noqa: E402


def mirrors():
    """Every struct mirror of _lib: {C name: ctypes class}."""
    out = {}
    for v in vars(_lib).values():
        if isinstance(v, type) and issubclass(v, ctypes.Structure) and v.__module__ == _lib.__name__ \
                and "_fields_" in vars(v):
            assert getattr(v, "_c_name", None), f"_lib.{v.__name__} mirrors no C struct: give it a _c_name"
            out[v._c_name] = v
    return out


def header_fields(text, name):
    """Field names of `typedef struct ... { ... } name;` in order (comments
    stripped; function pointers by their name; arrays without their extent)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    m = re.search(r"typedef struct \w*\s*\{([^{}]*)\}\s*" + re.escape(name) + r"\s*;", text)
    assert m, f"{name}: no typedef struct of that name in {HEADER}"
    names = []
    for decl in m.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        fp = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)
        if fp:
            names.append(fp.group(1))
            continue
        for part in decl.split(","):
            names.append(re.findall(r"(\w+)\s*(?:\[[^\]]*\])*\s*$", part)[0])
    return names


def c_layouts(cc, structs):
    """{name: (sizeof, {field: (offsetof, size)})} from a program built against the header."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "moestash.h"', "int main(void) {"]
    for name, cls in structs.items():
        lines.append(f'    printf("S {name} %zu\\n", sizeof({name}));')
        for f in cls._fields_:
            lines.append(f'    printf("F {name} {f[0]} %zu %zu\\n", offsetof({name}, {f[0]}), '
                         f"sizeof((({name}*)0)->{f[0]}));")
    lines += ["    return 0;", "}"]
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
        with open(src, "w") as f:
            f.write("\n".join(lines) + "\n")
        build = subprocess.run([cc, "-std=c11", "-I", os.path.dirname(HEADER), src, "-o", exe],
                               capture_output=True, text=True)
        assert build.returncode == 0, f"the layout program does not compile:\n{build.stderr}"
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    layouts = {}
    for line in out.splitlines():
        kind, name, *rest = line.split()
        if kind == "S":
            layouts[name] = (int(rest[0]), {})
        else:
            layouts[name][1][rest[0]] = (int(rest[1]), int(rest[2]))
    return layouts


def mismatches(cc):
    """Each difference between a mirror and its C struct, one line each."""
    structs = mirrors()
    with open(HEADER) as f:
        text = f.read()
    bad = []
    for name, cls in structs.items():
        want = header_fields(text, name)
        have = [f[0] for f in cls._fields_]
        if have != want:
            bad.append(f"{name}: header fields {want}, _lib.{cls.__name__} mirrors {have}")
    if bad:
        return bad  # offsetof of a field the header lacks would not compile
    for name, (size, fields) in c_layouts(cc, structs).items():
        cls = structs[name]
        if ctypes.sizeof(cls) != size:
            bad.append(f"{name}: sizeof {size} in C, {ctypes.sizeof(cls)} in _lib.{cls.__name__}")
        for field, (off, fsize) in fields.items():
            d = getattr(cls, field)
            if (d.offset, d.size) != (off, fsize):
                bad.append(f"{name}.{field}: offset {off} size {fsize} in C, offset {d.offset} size {d.size} "
                           f"in _lib.{cls.__name__}")
    return bad


def compiler():
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def test_every_mirror_matches_the_c_layout():
    cc = compiler()
    assert cc, "no C compiler ($CC, cc, gcc): the layout check needs one"
    assert len(mirrors()) >= 7
    assert mismatches(cc) == []


def test_a_moved_field_is_caught():
    """The check itself: a mirror with two fields swapped must be reported."""
    cc = compiler()
    assert cc, "no C compiler"

    class Swapped(ctypes.Structure):
        _c_name = "mst_pool_config"
        _fields_ = [("struct_size", ctypes.c_size_t), ("n_dev_pages", ctypes.c_int64),
                    ("page_rows", ctypes.c_int64), ("n_host_pages", ctypes.c_int64), ("copy_sms", ctypes.c_int32)]

    class Short(ctypes.Structure):
        _c_name = "mst_mlp_config"
        _fields_ = [("struct_size", ctypes.c_size_t), ("n_groups", ctypes.c_int32), ("hidden", ctypes.c_int32)]

    layouts = c_layouts(cc, {"mst_pool_config": Swapped, "mst_mlp_config": Short})
    assert layouts["mst_pool_config"][1]["page_rows"][0] != Swapped.page_rows.offset
    assert layouts["mst_mlp_config"][1]["hidden"] != (Short.hidden.offset, Short.hidden.size)
    with open(HEADER) as f:
        assert header_fields(f.read(), "mst_pool_config") != [f[0] for f in Swapped._fields_]


def test_sized_mirrors_carry_their_size():
    for cls in mirrors().values():
        if cls._fields_[0][0] == "struct_size":
            assert issubclass(cls, _lib._Sized), cls.__name__
            assert cls().struct_size == ctypes.sizeof(cls)


def test_a_struct_of_another_size_is_refused():
    """What a ctypes client built on an older header passes: a shorter
    struct. The library refuses it with a message naming the struct."""
    ctx = ctypes.c_void_p()
    _lib.call("mst_ctx_create", _lib.BACKEND_CPU, 0, ctypes.byref(ctx))
    try:
        cfg, pool = _lib.PoolConfig(64, 4, 0, 0), ctypes.c_void_p()
        cfg.struct_size -= 8
        try:
            _lib.call("mst_pool_create", ctx, _lib.DTYPE_BF16, 16, ctypes.byref(cfg), ctypes.byref(pool))
            raise AssertionError("a mst_pool_config of another size was accepted")
        except _lib.InvalidArgument as e:
            want = f"cfg (mst_pool_config) has struct_size {cfg.struct_size}, this library knows {cfg.struct_size + 8}"
            assert want in str(e), str(e)
        assert not pool.value
    finally:
        _lib.lib.mst_ctx_destroy(ctx)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.environ["CC"] = sys.argv[1]
    problems = mismatches(compiler())
    try:
        test_a_struct_of_another_size_is_refused()
    except AssertionError as e:
        problems.append(f"a struct of another size: {e}")
    for p in problems:
        print("MISMATCH", p)
    print(f"{len(mirrors())} mirrors checked, {len(problems)} mismatches")
    sys.exit(1 if problems else 0)
