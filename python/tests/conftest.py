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


def pytest_configure(config):
    config.addinivalue_line("markers", "placement(*names): run the test in these placements only (default: both)")


def pytest_generate_tests(metafunc):
    """Tests that use the placement fixture (daemons does) run in both
    placements, in-process and daemon, unless a placement mark names
    fewer or the test parametrizes placement itself."""
    if "placement" not in metafunc.fixturenames:
        return
    for m in metafunc.definition.iter_markers("parametrize"):
        names = m.args[0]
        if "placement" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return
    only = metafunc.definition.get_closest_marker("placement")
    metafunc.parametrize("placement", list(only.args) if only else ["daemon", "in-process"])


@pytest.fixture(scope="session")
def libkvxfer(tmp_path_factory) -> Path:
    """libkvxfer.so built once from this checkout, and named by
    $KVXFER_LIBKVXFER for this process and its children (the library
    kvxfer.inprocess loads)."""
    lib = harness.build_libkvxfer(tmp_path_factory.mktemp("lib"))
    os.environ["KVXFER_LIBKVXFER"] = str(lib)
    return lib


@pytest.fixture
def daemons(request, placement, tmp_path):
    """The engines' servers, by placement: a P and a D kvxferd (stopped,
    and their logs shown on failure, after), or in-process stand-ins (the
    engines start libkvxfer in this process)."""
    started = []
    exe = request.getfixturevalue("kvxferd") if placement == "daemon" else None
    if placement == "in-process":
        request.getfixturevalue("libkvxfer")

    def start(name, extra=None):
        if placement == "in-process":
            assert not extra, "kvxferd flags for an in-process engine"
            d = harness.InProcess(tmp_path, name)
        else:
            d = harness.Daemon(exe, tmp_path, name, extra)
        started.append(d)
        return d

    yield start
    if placement == "in-process":
        from kvxfer import placement as pl
        # Every engine the test built shut down: nothing holds the server
        # (a failed test's engines may, and would hold it for the next).
        users = pl.acquire().users
        pl.acquire().reset()
        assert users == 0 or request.node.rep_call_failed, f"{users} connectors still hold the in-process server"
    for d in started:
        d.stop()
        if os.environ.get("KVXFER_SHOW_LOGS") and placement == "daemon":
            print((d.dir / "log").read_text())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if rep.when == "call":
        item.rep_call_failed = rep.failed
