"""Build hook of the moestash package (metadata in pyproject.toml): puts
libmoestash.so into the package (moestash/lib/), where moestash._lib finds
it after $MOESTASH_LIB. Which library, first that applies:

  MOESTASH_BUNDLE_LIB=/path/to/libmoestash.so   that file, copied (no build)
  MOESTASH_LIB set, or MOESTASH_BUILD=0         none: Python only (the package
                                                loads $MOESTASH_LIB, or finds
                                                an installed or built library)
  this folder inside the source tree            built with CMake from the tree
                                                (target moestash, in
                                                build-pip/ at its root): the
                                                CUDA backend where CMake finds
                                                nvcc, else the CPU one
                                                (MOESTASH_CUDA=0: CPU only);
                                                MOESTASH_BUILD_JOBS: parallel
                                                jobs (default: every core)
  otherwise (no sources)                        none: Python only

A wheel that holds the library is tagged for this platform (py3-none-<plat>:
ctypes, no Python ABI); one without stays pure Python.
"""
import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:  # an older one (--no-build-isolation): the wheel package's, if any
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # python/ -> the source tree
BUILD_DIR = os.path.join(ROOT, "build-pip")


def _source_tree():
    return os.path.isfile(os.path.join(ROOT, "CMakeLists.txt")) and os.path.isfile(
        os.path.join(ROOT, "include", "moestash.h"))


def _plan():
    """'bundle' (MOESTASH_BUNDLE_LIB), 'build' (CMake from the tree) or None."""
    if os.environ.get("MOESTASH_BUNDLE_LIB"):
        return "bundle"
    if os.environ.get("MOESTASH_LIB") or os.environ.get("MOESTASH_BUILD") == "0" or not _source_tree():
        return None
    return "build"


def _run(cmd):
    print("moestash:", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError:
        raise SystemExit(f"moestash: '{cmd[0]}' not found: building libmoestash needs CMake >= 3.24 and a C "
                         "compiler (or set MOESTASH_BUNDLE_LIB to a built libmoestash.so)")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"moestash: building libmoestash failed ({' '.join(cmd)}: exit {e.returncode}); "
                         "its output is above")


def build_library():
    """Configures and builds libmoestash in build-pip/; returns its path."""
    cuda = os.environ.get("MOESTASH_CUDA", "1") != "0"
    jobs = os.environ.get("MOESTASH_BUILD_JOBS") or str(os.cpu_count() or 1)
    _run(["cmake", "-S", ROOT, "-B", BUILD_DIR, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
          f"-DMST_CUDA={'ON' if cuda else 'OFF'}"])
    _run(["cmake", "--build", BUILD_DIR, "--target", "moestash", "-j", jobs])
    lib = os.path.join(BUILD_DIR, "libmoestash.so")
    if not os.path.isfile(lib):
        raise SystemExit(f"moestash: the build left no {lib}")
    return lib


class BuildPy(build_py):
    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "moestash", "lib")
        shutil.rmtree(dst, ignore_errors=True)  # no stale copy from an earlier build
        plan = _plan()
        if plan is None:
            return
        src = os.environ["MOESTASH_BUNDLE_LIB"] if plan == "bundle" else build_library()
        if not os.path.isfile(src):
            raise SystemExit(f"MOESTASH_BUNDLE_LIB={src}: no such file")
        os.makedirs(dst)
        shutil.copy2(src, os.path.join(dst, "libmoestash.so"))  # follows the SONAME symlink


class WithLibrary(Distribution):
    def has_ext_modules(self):
        """A bundled library makes the package platform-specific (platlib)."""
        return _plan() is not None


commands = {"build_py": BuildPy}
if bdist_wheel is not None:
    class BdistWheel(bdist_wheel):
        def finalize_options(self):
            """Platform-specific whenever a library is bundled, whatever
            this setuptools makes of has_ext_modules (seen on a GPU machine's
            setuptools: a py3-none-any wheel holding the library)."""
            super().finalize_options()
            if _plan() is not None:
                self.root_is_pure = False

        def get_tag(self):
            python, abi, plat = super().get_tag()
            return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)

    commands["bdist_wheel"] = BdistWheel

setup(distclass=WithLibrary, cmdclass=commands)
