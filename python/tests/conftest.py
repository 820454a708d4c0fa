import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


def _gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


# GPU-only tests are collected only where there is a GPU (CPU CI must skip
# nothing); run them on a GPU machine with test/run -k gpu.
collect_ignore_glob = [] if _gpu() else ["gpu_test_*.py"]


@pytest.fixture(autouse=True)
def no_disagreement():
    """Fails any test in which a connector's decision differed from the
    daemon's Scheduler's (harness.vllm_config sets verify): the connector
    raises at once, and this catches what was swallowed on the way."""
    mod = sys.modules.get("kvxfer.vllm")
    if mod is not None:
        mod.DISAGREEMENTS.clear()
    yield
    mod = sys.modules.get("kvxfer.vllm")
    if mod is not None and mod.DISAGREEMENTS:
        found = list(mod.DISAGREEMENTS)
        mod.DISAGREEMENTS.clear()
        pytest.fail("the connector and the daemon's Scheduler disagreed:\n" + "\n".join(found))


@pytest.fixture(scope="session")
def kvxferd(tmp_path_factory) -> Path:
    """The kvxferd binary, built once from this checkout."""
    return harness.build_kvxferd(tmp_path_factory.mktemp("bin"))


@pytest.fixture
def daemons(kvxferd, tmp_path):
    """A P and a D kvxferd; stopped (and their logs shown on failure) after."""
    started = []

    def start(name, extra=None):
        d = harness.Daemon(kvxferd, tmp_path, name, extra)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
        if os.environ.get("KVXFER_SHOW_LOGS"):
            print((d.dir / "log").read_text())
