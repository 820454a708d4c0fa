"""`pip install ./python` / `pip wheel ./python`: a wheel that carries
libkvxfer (built with Go) is tagged for this machine's platform, not
py3-none-any; one built without it (KVXFER_BUILD_LIBKVXFER=0) is pure and
carries no library, not even one an earlier build left in the build
directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import harness


def _wheel(out, **env) -> str:
    e = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                        str(harness.REPO / "python")], env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = [p for p in os.listdir(out) if p.endswith(".whl")]
    return str(out / whl)


@pytest.mark.skipif(shutil.which("go") is None, reason="needs the Go toolchain (builds libkvxfer)")
def test_wheel_with_libkvxfer_is_for_this_platform(tmp_path):
    whl = _wheel(tmp_path / "with")
    names = zipfile.ZipFile(whl).namelist()
    assert "kvxfer/libkvxfer.so" in names, names
    assert not whl.endswith("-none-any.whl"), f"{os.path.basename(whl)} carries libkvxfer (machine code) but installs anywhere"
    assert "-py3-none-linux_" in os.path.basename(whl), os.path.basename(whl)

    pure = _wheel(tmp_path / "without", KVXFER_BUILD_LIBKVXFER="0")
    assert pure.endswith("-py3-none-any.whl"), pure
    names = zipfile.ZipFile(pure).namelist()
    assert "kvxfer/libkvxfer.so" not in names, "a wheel built without libkvxfer carries the one an earlier build left"
