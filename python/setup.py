"""Builds libkvxfer (the in-process placement's server, Go) into the
package when `pip install ./python` runs from a kvxfer checkout with the Go
toolchain on PATH: `go build -buildmode=c-shared` of ../cmd/libkvxfer, the
library installed as kvxfer/libkvxfer.so (where kvxfer.inprocess looks).

KVXFER_BUILD_LIBKVXFER=0 skips it (placement daemon needs no library; or
name one with $KVXFER_LIBKVXFER at run time); =1 makes a failed or
impossible build fail the install instead of warning.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools 70.1 and later
except ImportError:  # older: the wheel package's
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _builds_libkvxfer() -> bool:
    """Whether build_py builds libkvxfer (or fails the build trying)."""
    return os.environ.get("KVXFER_BUILD_LIBKVXFER", "") != "0" and shutil.which("go") is not None and \
        (REPO / "go.mod").is_file() and (REPO / "cmd" / "libkvxfer").is_dir()


class DistributionWithLibkvxfer(Distribution):
    """A distribution that carries libkvxfer is for this machine's
    platform: a wheel of it is not py3-none-any (the library is machine
    code: a pure wheel built on one machine installed anywhere, where
    kvxfer.inprocess then failed to load it), and it installs into
    platlib."""

    def has_ext_modules(self):
        return _builds_libkvxfer()


class WheelForThisPlatform(bdist_wheel):
    """Such a wheel's tag: py3-none-PLATFORM (linux_x86_64, ...): Python's
    own ABI does not matter to the library (loaded with ctypes)."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        if not self.root_is_pure:
            python, abi = "py3", "none"
        return python, abi, plat


class BuildPyWithLibkvxfer(build_py):
    def run(self):
        super().run()
        want = os.environ.get("KVXFER_BUILD_LIBKVXFER", "")
        out = Path(self.build_lib).resolve() / "kvxfer" / "libkvxfer.so"
        if not _builds_libkvxfer():
            # An earlier build's library left in the build directory would
            # go into this wheel, built for no platform.
            out.unlink(missing_ok=True)
        if want == "0":
            return
        go = shutil.which("go")
        if not _builds_libkvxfer():
            why = "no Go toolchain on PATH" if go is None else f"no kvxfer Go sources at {REPO}"
            if want == "1":
                raise SystemExit(f"kvxfer: cannot build libkvxfer: {why}")
            print(f"kvxfer: not building libkvxfer ({why}): placement in-process will need $KVXFER_LIBKVXFER")
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"kvxfer: go build -buildmode=c-shared -o {out} ./cmd/libkvxfer")
        r = subprocess.run([go, "build", "-buildmode=c-shared", "-o", str(out), "./cmd/libkvxfer"], cwd=REPO)
        if r.returncode != 0:
            raise SystemExit("kvxfer: go build of libkvxfer failed (KVXFER_BUILD_LIBKVXFER=0 installs without it)")
        out.with_suffix(".h").unlink(missing_ok=True)  # the C header go build writes beside it


setup(distclass=DistributionWithLibkvxfer, cmdclass={"build_py": BuildPyWithLibkvxfer, "bdist_wheel": WheelForThisPlatform})
