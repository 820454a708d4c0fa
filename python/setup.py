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
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


class BuildPyWithLibkvxfer(build_py):
    def run(self):
        super().run()
        want = os.environ.get("KVXFER_BUILD_LIBKVXFER", "")
        if want == "0":
            return
        go = shutil.which("go")
        if go is None or not (REPO / "go.mod").is_file() or not (REPO / "cmd" / "libkvxfer").is_dir():
            why = "no Go toolchain on PATH" if go is None else f"no kvxfer Go sources at {REPO}"
            if want == "1":
                raise SystemExit(f"kvxfer: cannot build libkvxfer: {why}")
            print(f"kvxfer: not building libkvxfer ({why}): placement in-process will need $KVXFER_LIBKVXFER")
            return
        out = Path(self.build_lib).resolve() / "kvxfer" / "libkvxfer.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"kvxfer: go build -buildmode=c-shared -o {out} ./cmd/libkvxfer")
        r = subprocess.run([go, "build", "-buildmode=c-shared", "-o", str(out), "./cmd/libkvxfer"], cwd=REPO)
        if r.returncode != 0:
            raise SystemExit("kvxfer: go build of libkvxfer failed (KVXFER_BUILD_LIBKVXFER=0 installs without it)")
        out.with_suffix(".h").unlink(missing_ok=True)  # the C header go build writes beside it


setup(cmdclass={"build_py": BuildPyWithLibkvxfer})
