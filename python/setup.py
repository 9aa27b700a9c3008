"""Build hook of the moestash package (metadata in pyproject.toml): with
MOESTASH_BUNDLE_LIB=/path/to/libmoestash.so set at install time, that library
is copied into the package (moestash/lib/), where moestash._lib finds it
first after $MOESTASH_LIB. Without it the package holds Python only and
finds an installed or built library at import."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def run(self):
        super().run()
        src = os.environ.get("MOESTASH_BUNDLE_LIB")
        dst = os.path.join(self.build_lib, "moestash", "lib")
        shutil.rmtree(dst, ignore_errors=True)  # no stale copy from an earlier build
        if not src:
            return
        if not os.path.isfile(src):
            raise SystemExit(f"MOESTASH_BUNDLE_LIB={src}: no such file")
        os.makedirs(dst)
        shutil.copy2(src, os.path.join(dst, "libmoestash.so"))  # follows the SONAME symlink


setup(cmdclass={"build_py": BuildPy})
