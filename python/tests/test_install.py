"""`pip install ./python` from a fresh clone: the wheel builds libmoestash
with CMake (the CPU backend here: MOESTASH_CUDA=0, about 20 s on 2 cores)
and holds it; installed, `import moestash` loads that copy with no
environment variable, from outside the tree, and runs a call. With
MOESTASH_BUILD=0 the wheel is pure Python and holds no library.

The clone is of the committed HEAD (what a user clones), built with
--no-build-isolation (this environment's setuptools: no network). Skipped
outside a git checkout or without git and cmake."""
import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLEAN = {k: v for k, v in os.environ.items() if k not in ("MOESTASH_LIB", "MOESTASH_BUNDLE_LIB", "MOESTASH_BUILD",
                                                          "MOESTASH_CUDA", "PYTHONPATH")}


def _header_version():
    text = open(os.path.join(ROOT, "include", "moestash.h")).read()
    return ".".join(re.search(rf"#define MST_VERSION_{p} (\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if not os.path.exists(os.path.join(ROOT, ".git")) or not shutil.which("git") or not shutil.which("cmake"):
        pytest.skip("not a git checkout, or no git / cmake")
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, env=CLEAN).stdout.strip()
    if dirty:  # a copy of a working tree over an older .git (as the GPU machines get): a clone would test HEAD
        pytest.skip("the working tree differs from HEAD: a clone of HEAD would test other code")
    try:  # what --no-build-isolation builds with
        import setuptools.command.bdist_wheel  # noqa: F401
    except ImportError:
        pytest.importorskip("wheel.bdist_wheel", reason="neither setuptools >= 70.1 nor wheel here")
    where = tmp_path_factory.mktemp("fresh") / "moestash"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", ROOT, str(where)], check=True, env=CLEAN)
    return where


def wheel(clone, out, **env):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(out), str(clone / "python")], check=True, env={**CLEAN, **env}, cwd=str(out.parent))
    (path,) = glob.glob(str(out / "moestash-*.whl"))
    return path


def test_fresh_clone_wheel_builds_and_bundles_the_library(clone, tmp_path):
    whl = wheel(clone, tmp_path / "wheel", MOESTASH_CUDA="0", MOESTASH_BUILD_JOBS="2")
    assert re.search(r"-py3-none-linux_\w+\.whl$", whl), whl  # ctypes: any Python, this platform
    assert "moestash/lib/libmoestash.so" in zipfile.ZipFile(whl).namelist()
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), whl],
                   check=True, env=CLEAN)
    probe = ("import moestash, moestash._lib as L; "
             "print(moestash.library_path); print(moestash.version()); "
             "print(L.lib.mst_backend_available(L.BACKEND_CPU))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                         env={**CLEAN, "PYTHONPATH": str(site)}, cwd=str(tmp_path)).stdout.split()
    assert out[0] == str(site / "moestash" / "lib" / "libmoestash.so"), out
    assert out[1] == _header_version() and out[2] == "1", out


def test_no_build_gives_a_pure_wheel(clone, tmp_path):
    whl = wheel(clone, tmp_path / "wheel", MOESTASH_BUILD="0")
    assert whl.endswith("-py3-none-any.whl"), whl
    assert not [n for n in zipfile.ZipFile(whl).namelist() if "libmoestash" in n]
