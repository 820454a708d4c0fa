"""GPU-only: kvxfer in the engine's own process (libkvxfer through
kvxfer.inprocess) moving GPU memory named by its address. Two Python
processes, P and D (inprocess_gpu_engine.py), each start their own
in-process server and attach a rank whose KV cache is torch CUDA memory
of GPU 0 they allocated, named by address (SharedMemory.in_process =
DEVICE, with the device's UUID); P pushes scattered blocks into D, and D
checks every byte of its cache after each transfer. Once per in-process
backend: the built-in one (its same-host path exports the engine's own
allocation's CUDA IPC handle; the peer imports it and copies with
internal/cuda's kernel) and NIXL (registering the memory as VRAM; with
UCX's default single worker and with num_threads=4, as vLLM sets it).

The first transfer (40 blocks of 256, scattered, a run of adjacent ones
among them) checks that the untouched blocks stay as they were; the next
three move all 256 blocks of all 32 layers (64 KiB each: 8,192 pieces,
512 MiB, source and destination permuted) and are timed from D's step to
its outcome; the rates are printed (pytest -s; test/gpu/run shows them in
its summary) and, with $OUT set, written to $OUT/inprocess-gbps.txt. No
speed is asserted.

Over NIXL, NIXL's own Python API moves each transfer again in the same two
processes, on the same caches (Beside in inprocess_gpu_engine.py: P WRITEs
the blocks with its own agent once D has checked kvxfer's transfer and marked
them, and D checks them again), timed from initialize_xfer to DONE as NIXL's
benchmarks time it; the two rates and the ratio of their medians are
printed beside the others: the in-process goal's comparison (issue 24) made
on the same memory, minutes apart at most, instead of in two runs.

Every case runs with the hop trace on (the servers' "hop_trace", the
engines' own "py.step" and "py.poll" lines): the table of where the timed
transfers' time went, hop by hop (hoptrace.py), is printed beside the
rates and, with $OUT set, written to $OUT/inprocess-hops.txt (the traces
themselves under $OUT/inprocess-hops/); test/gpu/run shows it in its
summary too.

conftest.py collects this file only where torch sees a GPU; the library is
$KVXFER_LIBKVXFER (test/gpu/run: built into its bundle) or built here with
go. NIXL is found as the server finds it (NIXL_CAPI_LIB, NIXL_PREFIX,
$VIRTUAL_ENV's nixl-cu12 wheel, the system's site-packages); the
in-process server sets no environment variable, so the engines get
NIXL_PLUGIN_DIR (the wheel's plugins) and UCX_MEMTYPE_CACHE=n here where
they are not set already."""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

import harness
import hoptrace

HERE = Path(__file__).resolve().parent
PYTHON_DIR = HERE.parent
ENGINE = HERE / "inprocess_gpu_engine.py"

LAYERS, BLOCKS, BLOCK_LEN = 32, 256, 64 << 10
CHECK_BLOCKS = 40  # the first transfer's blocks, of BLOCKS
TIMED = 9  # transfers of every block, timed (the first of them often slow for NIXL too; runs 1 and 2 on the H100 had ratios 0.87-1.04 from five)

# The in-process server's configuration per case (kvxferd serve's flag
# names: internal/daemon/daemon.go).
CASES = {
    "builtin": {"backend": "builtin"},
    "nixl": {"backend": "nixl"},
    "nixl-threads4": {"backend": "nixl", "nixl_params": "num_threads=4"},
    # Eight UCX threads: a transfer of 8,192 descriptors is issued by eight
    # workers, 1,024 each (NIXL shares it out as max(n / num_threads,
    # split_batch_size)), where issuing the pieces is most of its time.
    "nixl-threads8": {"backend": "nixl", "nixl_params": "num_threads=8"},
}

# Per case: how long D waits for P's Peer address, and the whole pair
# (seconds; the engines' own deadline is 10 s less). Expected: some 10 s
# a case on an H100, mostly the processes' start; 60 lets two hung cases
# still report within test/gpu/run's 120 s phase.
START_TIMEOUT = 45
PAIR_TIMEOUT = 60


@pytest.fixture(scope="module")
def libkvxfer(tmp_path_factory) -> Path:
    return harness.build_libkvxfer(tmp_path_factory.mktemp("lib"))


def nixl_library() -> str | None:
    """libnixl_capi.so where the server would find it (internal/nixl
    FindLibrary), or None."""
    lib = "libnixl_capi.so"
    if p := os.environ.get("NIXL_CAPI_LIB"):
        return p if os.path.isfile(p) else None
    cands = []
    if pre := os.environ.get("NIXL_PREFIX"):
        cands += [os.path.join(pre, d, lib) for d in ("lib", "lib64", "lib/x86_64-linux-gnu")]
    pats = [os.path.join(os.environ["VIRTUAL_ENV"], "lib/python3*/site-packages")] if os.environ.get("VIRTUAL_ENV") else []
    pats += ["/usr/local/lib/python3*/site-packages", "/usr/local/lib/python3*/dist-packages",
             "/usr/lib/python3*/site-packages", "/usr/lib/python3/dist-packages"]
    for pat in pats:
        for d in sorted(glob.glob(pat)):
            cands += [os.path.join(d, sub, lib) for sub in (".nixl_cu12.mesonpy.libs", ".nixl_cu13.mesonpy.libs", ".nixl.mesonpy.libs")]
    return next((c for c in cands if os.path.isfile(c)), None)


def engine_env(lib: Path, config: dict, beside: bool = False) -> dict:
    """The engines' environment: the library, this checkout's python
    package and, for NIXL, what NIXL and UCX read when they load (the
    in-process server sets none of it). Skips when NIXL is wanted and its
    library is not found (or, beside, NIXL's Python API does not import;
    CI fails instead). Beside, the server loads the very NIXL that
    NIXL's Python API loads: one copy of it in each engine process."""
    env = dict(os.environ)
    env["KVXFER_LIBKVXFER"] = str(lib)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(PYTHON_DIR), env.get("PYTHONPATH", "")] if p)
    if beside:
        libs = harness.nixl_python_libs()
        harness.need_nixl(libs is not None, f"NIXL's Python API (nixl_cu12 with its libraries, in {sys.executable})")
        env["NIXL_CAPI_LIB"] = os.path.join(libs, "libnixl_capi.so")
        env["NIXL_PLUGIN_DIR"] = os.path.join(libs, "plugins")
    if config.get("backend") == "nixl":
        nl = nixl_library()
        if nl is None:
            pytest.skip("NIXL is not available: libnixl_capi.so not found (set NIXL_CAPI_LIB, or VIRTUAL_ENV to an "
                        "environment with the nixl-cu12 wheel; test/gpu/run sets both)")
        plugins = os.path.join(os.path.dirname(nl), "plugins")
        if not env.get("NIXL_PLUGIN_DIR") and os.path.isdir(plugins):
            env["NIXL_PLUGIN_DIR"] = plugins
        env.setdefault("UCX_MEMTYPE_CACHE", "n")
    return env


def transfers(layers_blocks: int = BLOCKS, check_blocks: int = CHECK_BLOCKS, timed: int = TIMED, seed: int = 24) -> list:
    """[p_ids, d_ids] per transfer: a scattered subset with a run of four
    adjacent blocks on both sides (which kvxfer may coalesce), then timed
    permutations of every block."""
    rng = random.Random(seed)
    n = layers_blocks
    first = min(10, n - 4)
    run_p, run_d = list(range(first, first + 4)), list(range(n // 2, n // 2 + 4))
    p = run_p + rng.sample([b for b in range(n) if b not in run_p], check_blocks - 4)
    d = run_d + rng.sample([b for b in range(n) if b not in run_d], check_blocks - 4)
    out = [[p, d]]
    for _ in range(timed):
        out.append([rng.sample(range(n), n), rng.sample(range(n), n)])
    return out


def _tail(path: Path, n: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"({path.name}: {e})"
    return text[-n:] if text else f"({path.name} is empty)"


def _stop(p: subprocess.Popen | None) -> None:
    if p is not None and p.poll() is None:
        p.kill()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def run_pair(lib: Path, work: Path, config: dict, *, memory: str = "device", layers: int = LAYERS, blocks: int = BLOCKS,
             block_len: int = BLOCK_LEN, xfers: list | None = None, timeout: float = PAIR_TIMEOUT,
             env: dict | None = None, hops: bool = False, mode: str = "push", beside: int = 0,
             beside_moves_nothing: bool = False) -> tuple[dict, dict, str]:
    """Runs P and D (inprocess_gpu_engine.py) side by side with config: D
    steps its first request once P has stepped its sends and published its
    Peer address. Returns their results and a text of both logs' tails for
    failure messages. Both processes are gone when it returns. hops: each
    process traces its hops into work (hop_files). mode: "push" (P
    WRITEs) or "pull" (D READs). beside: NIXL's own Python API with that
    many UCX threads moves each transfer again in the same processes, timed
    (inprocess_gpu_engine.Beside); beside_moves_nothing (tests of D's
    check): NIXL is asked and moves not a byte."""
    work.mkdir(parents=True, exist_ok=True)
    env = env if env is not None else engine_env(lib, config, beside=beside > 0)
    secret = harness.secret_file(work)
    common = {"secret": secret, "memory": memory, "layers": layers, "blocks": blocks, "block_len": block_len,
              "transfers": xfers if xfers is not None else transfers(blocks), "timeout": timeout - 10,
              "peer_file": str(work / "p.peer"), "peer_wait": START_TIMEOUT, "mode": mode,
              "config": {"peer_secret_file": secret, "log_level": "warn", **config}}
    if beside:
        (work / "beside").mkdir(exist_ok=True)
        common["beside"] = {"dir": str(work / "beside"), "threads": beside, "move_nothing": beside_moves_nothing}
    spec = {r: {**common, "role": r, "result": str(work / f"{r}.result.json")} for r in "PD"}
    if hops:
        for r in "PD":
            spec[r]["config"] = {**common["config"], "hop_trace": str(work / f"{r}.hops.jsonl")}
            spec[r]["py_hop_trace"] = str(work / f"{r}.py.hops.jsonl")
    logs = {r: work / f"{r}.log" for r in "PD"}
    procs: dict[str, subprocess.Popen] = {}
    deadline = time.monotonic() + timeout

    def why() -> str:
        return "\n".join(f"--- {r}'s log ({logs[r]}):\n{_tail(logs[r])}" for r in "PD")

    try:
        for r in "PD":
            with open(logs[r], "w") as log:
                procs[r] = subprocess.Popen([sys.executable, str(ENGINE), json.dumps(spec[r])], env=env, stdout=log,
                                            stderr=subprocess.STDOUT)
        p, d = procs["P"], procs["D"]
        while d.poll() is None:
            if p.poll() not in (None, 0):
                break  # D would wait for P's address or outcomes in vain
            if time.monotonic() > deadline:
                pytest.fail(f"D did not finish within {timeout} s\n{why()}")
            time.sleep(0.05)
        if d.poll() is None or d.returncode != 0:
            # D failed (or P did): P's sends may never end; a short wait.
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        else:
            try:
                p.wait(max(1.0, min(30.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"P did not finish within 30 s of D\n{why()}")
    finally:
        for r in "DP":
            _stop(procs.get(r))
    res = {}
    for r in "PD":
        f = Path(spec[r]["result"])
        proc = procs.get(r)
        res[r] = json.loads(f.read_text()) if f.exists() else {
            "error": f"{r} wrote no result (exit status {proc.returncode if proc else 'not started'})"}
    return res["P"], res["D"], why()


def check_pair(pres: dict, dres: dict, logs: str, n: int) -> list[dict]:
    """Fails unless both ran through, every transfer is done and every
    byte of D's cache is right; returns D's transfer records."""
    failed = [f"{who} failed: {r['error']}\n{r.get('traceback', '')}" for who, r in (("P", pres), ("D", dres)) if "error" in r]
    assert not failed, "\n".join(failed) + "\n" + logs
    recs = dres.get("transfers", [])
    assert len(recs) == n, f"D ran {len(recs)} transfers of {n}: {recs}\n{logs}"
    for rec in recs:
        assert rec["outcome"][0] == "RESULT_DONE", f"transfer {rec['transfer']}: {rec['outcome']}\n{logs}"
        assert rec["wrong_bytes"] == 0, (f"transfer {rec['transfer']}: {rec['wrong_bytes']} of {rec['checked_bytes']} bytes of "
                                         f"D's cache wrong, the first: {rec['first_wrong']}\n{logs}")
    assert [o[1] for o in pres["outcomes"]] == ["RESULT_DONE"] * n, f"P's outcomes: {pres['outcomes']}\n{logs}"
    return recs


def report(name: str, recs: list[dict], layers: int = LAYERS, block_len: int = BLOCK_LEN, note: str = "") -> str:
    """One line of the timed transfers' rates (GB/s: 1e9 bytes a second,
    D's step to its outcome), printed and kept under $OUT."""
    timed = recs[1:]
    if not timed:
        return ""
    mib = timed[0]["bytes"] / (1 << 20)
    rates = [r["bytes"] / r["seconds"] / 1e9 for r in timed]
    line = (f"in-process GB/s | {name} | {layers} layers x {timed[0]['blocks']} blocks x {block_len >> 10} KiB scattered "
            f"({layers * timed[0]['blocks']} pieces, {mib:.0f} MiB), D's step to done | "
            + " | ".join(f"{g:.2f} ({r['seconds'] * 1e3:.0f} ms)" for g, r in zip(rates, timed)) + " |"
            + (f" {note}" if note else ""))
    print("\n" + line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "inprocess-gbps.txt"), "a") as f:
            f.write(line + "\n")
    return line


def report_beside(name: str, recs: list[dict], layers: int = LAYERS, block_len: int = BLOCK_LEN,
                  op: str = "WRITE") -> tuple[list[float], list[float], str]:
    """The timed transfers of a run_pair(beside=...) both ways, alternated
    in the same processes: kvxfer's (D's step to its outcome) and NIXL's
    own Python API's op of the same blocks (WRITE for push, READ for pull;
    post to completion), GB/s, and the ratio of their medians; printed and
    kept under $OUT."""
    timed = recs[1:]
    if not timed or any("nixl" not in r for r in timed):
        raise AssertionError(f"{name}: a timed transfer without NIXL's beside it: {timed}")
    ours = [r["bytes"] / r["seconds"] / 1e9 for r in timed]
    theirs = [r["bytes"] / r["nixl"]["seconds"] / 1e9 for r in timed]
    ratio = statistics.median(ours) / statistics.median(theirs)
    line = (f"in-process GB/s | {name} and NIXL's Python API, alternated in the same two processes | {layers} layers x "
            f"{timed[0]['blocks']} blocks x {block_len >> 10} KiB scattered ({layers * timed[0]['blocks']} pieces) | "
            f"kvxfer, D's step to done: {', '.join(f'{g:.2f}' for g in ours)} | NIXL {op}, post to done: "
            f"{', '.join(f'{g:.2f}' for g in theirs)} | ratio of the medians {ratio:.2f} |")
    print("\n" + line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "inprocess-gbps.txt"), "a") as f:
            f.write(line + "\n")
    return ours, theirs, line


def hop_files(work: Path) -> list[Path]:
    """The hop traces a run_pair(hops=True) in work left."""
    return sorted(work.glob("*.hops.jsonl"))


def report_hops(name: str, work: Path, skip: int = 1) -> list[str]:
    """The hop table of a run_pair(hops=True) in work, over its transfers
    after the first skip (the first pays the handshake, and is the untimed
    check): printed, and kept under $OUT (inprocess-hops.txt). A trace
    that does not make a table says why in its one line instead: the rates
    stand without it."""
    try:
        lines = hoptrace.table(hop_files(work), skip=skip, name=name, prefix="in-process hops")
    except Exception as e:  # noqa: BLE001 - reported in the table's place
        lines = [f"in-process hops | {name} | no table: {type(e).__name__}: {e} |"]
    print("\n" + "\n".join(lines), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "inprocess-hops.txt"), "a") as f:
            f.write("\n".join(lines) + "\n")
        # The traces themselves, for a closer look (hoptrace.py --each).
        keep = Path(os.environ["OUT"]) / "inprocess-hops" / re.sub(r"[^A-Za-z0-9.-]+", "_", name)
        keep.mkdir(parents=True, exist_ok=True)
        for f in hop_files(work):
            shutil.copy(f, keep / f.name)
    return lines


@pytest.mark.parametrize("name", list(CASES))
def test_push_gpu_memory_by_address(libkvxfer, tmp_path, name):
    """P pushes scattered blocks of its torch CUDA memory, named by address,
    into D's: every byte of D's cache checked after each transfer (the
    blocks moved equal P's, the others unchanged); the timed transfers'
    rates are printed."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no GPU here (torch sees none)")
    xf = transfers()
    beside = 4 if CASES[name]["backend"] == "nixl" else 0
    pres, dres, logs = run_pair(libkvxfer, tmp_path, CASES[name], xfers=xf, hops=True, beside=beside)
    recs = check_pair(pres, dres, logs, len(xf))
    # P's layers are views of one allocation, D's (most likely: the
    # caching allocator decides) an allocation each.
    report(name, recs, note=f"P's cache in {pres.get('allocations')} allocation(s), D's in {dres.get('allocations')}; "
           f"attach P {pres.get('attach_s')} s, D {dres.get('attach_s')} s")
    report_hops(f"{name}, {LAYERS}x{BLOCKS}x{BLOCK_LEN >> 10}KiB", tmp_path)
    if beside:
        report_beside(name, recs)


@pytest.mark.parametrize("name", ["nixl", "builtin"])
def test_push_gpu_memory_by_address_8_blocks(libkvxfer, tmp_path, name):
    """The small transfer of the goal: 32 layers x 8 scattered blocks of
    64 KiB (256 pieces, 16 MiB), every byte of D checked, seven timed
    transfers (small ones are noisy) printed."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no GPU here (torch sees none)")
    xf = transfers(8, check_blocks=6, timed=7, seed=8)
    beside = 4 if name == "nixl" else 0
    pres, dres, logs = run_pair(libkvxfer, tmp_path, CASES[name], blocks=8, xfers=xf, hops=True, beside=beside)
    recs = check_pair(pres, dres, logs, len(xf))
    report(name, recs)
    report_hops(f"{name}, {LAYERS}x8x{BLOCK_LEN >> 10}KiB", tmp_path)
    if beside:
        report_beside(name, recs)


@pytest.mark.parametrize("blocks", [BLOCKS, 8])
@pytest.mark.parametrize("backend", ["nixl", "builtin"])
def test_pull_gpu_memory_by_address(libkvxfer, tmp_path, backend, blocks):
    """Pull, vLLM's default mode, over NIXL and over the built-in backend
    (its same-host READ: D imports P's allocation and copies with the
    kernel): D READs P's scattered blocks of torch CUDA memory named by
    address, no registration leg before the transfer (D knows P's blocks
    from the params); every byte of D checked after each transfer, the
    timed ones printed beside push's (over NIXL, NIXL's own READ beside
    them)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no GPU here (torch sees none)")
    xf = transfers() if blocks == BLOCKS else transfers(8, check_blocks=6, timed=7, seed=8)
    beside = 4 if backend == "nixl" else 0
    pres, dres, logs = run_pair(libkvxfer, tmp_path, CASES[backend], blocks=blocks, xfers=xf, hops=True, mode="pull", beside=beside)
    recs = check_pair(pres, dres, logs, len(xf))
    report(f"{backend}, pull", recs)
    report_hops(f"{backend}, pull, {LAYERS}x{blocks}x{BLOCK_LEN >> 10}KiB", tmp_path)
    if beside:
        report_beside(f"{backend}, pull", recs, op="READ")
