"""GPU-only checks of kvxfer.cuda against a real driver. conftest.py
collects this file only where torch sees a GPU, so CPU CI runs it nowhere
and skips nothing; on a GPU machine: test/run -k gpu."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from kvxfer import cuda as kcuda

PYTHON_DIR = Path(__file__).resolve().parents[1]


def test_real_gpu_tensor():
    import torch

    # vLLM's shape of things: one allocation, layer views into it.
    t = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    views = {f"layers.{i}": t[i << 20:(i + 1) << 20] for i in range(8)}
    shares = kcuda.export_tensors(views)
    assert len(shares) == 1, shares
    s = shares[0]
    assert s.base <= t.data_ptr() and t.data_ptr() + t.nbytes <= s.base + s.size
    assert s.offset == views["layers.0"].data_ptr() - s.base
    assert len(s.handle) == 64 and any(s.handle)
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", s.device_uuid)
    props = torch.cuda.get_device_properties(t.device)
    if hasattr(props, "uuid"):  # torch prints it without the prefix
        assert s.device_uuid == "GPU-" + str(props.uuid).lower()
    one = kcuda.export_tensor(views["layers.5"])
    assert (one.base, one.size, one.offset) == (s.base, s.size, views["layers.5"].data_ptr() - s.base)

    # Expandable segments allocate through CUDA's virtual-memory API: refused.
    code = textwrap.dedent("""
        import torch
        from kvxfer import cuda
        t = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
        try:
            cuda.export_tensor(t)
            print("exported")
        except cuda.NotShareableError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(PYTHON_DIR),
                              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:"), out.stdout
