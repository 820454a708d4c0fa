"""libkvxfer at home in a Python process: with the Go runtime loaded and a
rank attached (its backend open: the built-in one, and NIXL, which brings
UCX, where its library is found), Python's handlers still get the signals
a Python engine relies on (SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, from this
thread and another's pthread_kill; SIGINT as KeyboardInterrupt), a
subprocess is waited for (SIGCHLD), a write to a closed pipe raises
BrokenPipeError instead of killing the process (SIGPIPE), the server still
answers afterwards, and the C environment (what UCX and NIXL read) is the
same before and after: the library sets no variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import harness

PY = sys.executable

CHILD = r"""
import ctypes, json, os, signal, subprocess, sys, threading, time
import numpy as np
import torch  # loaded as in an engine: its own handlers, if any, come first

def c_environ():
    libc = ctypes.CDLL(None)
    envp = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, "environ")
    out, i = [], 0
    while envp[i]:
        out.append(envp[i])
        i += 1
    return sorted(out)

before = c_environ()
# The engine's handlers are in place before kvxfer starts (vLLM installs
# its own early), and must stay in charge.
got = []
sigs = [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2]
for s in sigs:
    signal.signal(s, lambda n, f: got.append(n))
from kvxfer import inprocess
import kvxfer
from kvxfer.v1 import kvxfer_pb2 as pb

backend = sys.argv[1]
ep = inprocess.start({"insecure_peers": True, "log_level": "error", "backend": backend})
kv = np.zeros(64 * 1024, dtype=np.uint8)
c = kvxfer.Client(ep)
layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                     order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16, kernel_block_size=16,
                     regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=kv.ctypes.data, block_len=1024, num_blocks=64)])
w = c.connect(pb.WorkerHello(engine_id="E", mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                             memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
res = {}
for s in sigs:
    os.kill(os.getpid(), s)
main = threading.get_ident()
t = threading.Thread(target=lambda: [signal.pthread_kill(main, s) for s in sigs])
t.start(); t.join()
by = time.monotonic() + 5
while len(got) < 2 * len(sigs) and time.monotonic() < by:
    time.sleep(0.01)
res["handled"] = sorted(int(n) for n in got)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)
    res["sigint"] = "not delivered"
except KeyboardInterrupt:
    res["sigint"] = "KeyboardInterrupt"
res["child"] = subprocess.run([sys.executable, "-c", "raise SystemExit(7)"], timeout=30).returncode
r, wfd = os.pipe()
os.close(r)
try:
    os.write(wfd, b"x")
    res["pipe"] = "written"
except BrokenPipeError:
    res["pipe"] = "BrokenPipeError"
# The server still answers: a step of nothing, and an orderly end.
w.step(pb.StepMeta(step=1, scheduler_clock_unix_nanos=time.time_ns()))
w.bye(timeout=20)
c.close()
inprocess.stop()
res["env_changed"] = [e.decode(errors="replace") for e in sorted(set(c_environ()) ^ set(before))]
print("result", json.dumps(res), flush=True)
"""


def _nixl_env() -> dict | None:
    """The environment under which the in-process server finds NIXL, or
    None when it cannot (internal/nixl FindLibrary's ways)."""
    env = dict(os.environ)
    if env.get("NIXL_CAPI_LIB") and os.path.exists(env["NIXL_CAPI_LIB"]):
        return env
    libs = harness.nixl_python_libs()  # the wheel, in this Python
    if libs is None:
        return None
    env["NIXL_CAPI_LIB"] = os.path.join(libs, "libnixl_capi.so")
    env["NIXL_PLUGIN_DIR"] = os.path.join(libs, "plugins")
    return env


@pytest.fixture(scope="module")
def libkvxfer(tmp_path_factory) -> Path:
    return harness.build_libkvxfer(tmp_path_factory.mktemp("lib"))


@pytest.mark.parametrize("backend", ["builtin", "nixl"])
def test_signals_with_the_server_running(libkvxfer, backend):
    env = dict(os.environ) if backend == "builtin" else _nixl_env()
    harness.need_nixl(env is not None)
    env["KVXFER_LIBKVXFER"] = str(libkvxfer)
    env["PYTHONPATH"] = os.pathsep.join([str(harness.REPO / "python"), env.get("PYTHONPATH", "")])
    p = subprocess.run([PY, "-c", textwrap.dedent(CHILD), backend], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"exit status {p.returncode}\n{p.stdout}\n{p.stderr}"
    line = [x for x in p.stdout.splitlines() if x.startswith("result ")]
    assert line, f"no result\n{p.stdout}\n{p.stderr}"
    res = json.loads(line[0][len("result "):])
    import signal
    want = sorted(int(s) for s in [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2] * 2)
    assert res["handled"] == want, f"Python's handlers ran for {res['handled']}, want {want}\n{p.stderr}"
    assert res["sigint"] == "KeyboardInterrupt", res
    assert res["child"] == 7, res
    assert res["pipe"] == "BrokenPipeError", res
    assert res["env_changed"] == [], f"the C environment changed: {res['env_changed']}"


CLOSED_STDERR = r"""
import json, os, sys, time
import numpy as np
r, w = os.pipe()
os.close(r)
os.dup2(w, 2)  # stderr: a pipe whose reader is gone (a log collector that exited)
os.close(w)
from kvxfer import inprocess
import kvxfer
from kvxfer.v1 import kvxfer_pb2 as pb

res = {}
ep = inprocess.start({"insecure_peers": True, "log_level": "debug"})  # the server logs as it starts
kv = np.zeros(64 * 1024, dtype=np.uint8)
c = kvxfer.Client(ep)
layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                     order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16, kernel_block_size=16,
                     regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=kv.ctypes.data, block_len=1024, num_blocks=64)])
w = c.connect(pb.WorkerHello(engine_id="E", mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                             memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
w.step(pb.StepMeta(step=1, scheduler_clock_unix_nanos=time.time_ns()))
w.bye(timeout=20)
c.close()
inprocess.stop()
try:
    os.write(2, b"python's own write\n")
    res["python_write"] = "written"
except BrokenPipeError:
    res["python_write"] = "BrokenPipeError"
print("result", json.dumps(res), flush=True)
"""


def test_closed_stderr_does_not_kill_the_process(libkvxfer):
    """An engine whose stderr is a pipe nobody reads any more (its log
    collector exited) lives on, as Python does without kvxfer (it ignores
    SIGPIPE: a write fails with BrokenPipeError): the Go runtime kills its
    process with SIGPIPE when Go code writes to a broken stdout or stderr,
    unless SIGPIPE is asked for, and the server logs to stderr."""
    env = dict(os.environ)
    env["KVXFER_LIBKVXFER"] = str(libkvxfer)
    env["PYTHONPATH"] = os.pathsep.join([str(harness.REPO / "python"), env.get("PYTHONPATH", "")])
    p = subprocess.run([PY, "-c", textwrap.dedent(CLOSED_STDERR)], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True, timeout=120)
    assert p.returncode == 0, f"exit status {p.returncode} (-13: killed by SIGPIPE)\n{p.stdout}"
    line = [x for x in p.stdout.splitlines() if x.startswith("result ")]
    assert line, f"no result\n{p.stdout}"
    assert json.loads(line[0][len("result "):]) == {"python_write": "BrokenPipeError"}


WAITS = r"""
import json, os, signal, threading, time
import numpy as np
import kvxfer
from kvxfer import inprocess
from kvxfer.client import DirectWorkerStream, WorkerStream
from kvxfer.v1 import kvxfer_pb2 as pb

ep = inprocess.start({"insecure_peers": True, "log_level": "error"})
kv = np.zeros(64 * 1024, dtype=np.uint8)
res = {}
for direct, kind in [(None, DirectWorkerStream), (False, WorkerStream)]:
    c = kvxfer.Client(ep, direct=direct)
    layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                         order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16, kernel_block_size=16,
                         regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=kv.ctypes.data, block_len=1024, num_blocks=64)])
    w = c.connect(pb.WorkerHello(engine_id="E" + kind.__name__, mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                 memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
    assert type(w) is kind, type(w)
    r = res[kind.__name__] = {}
    # A negative wait is no wait (nothing is coming here); a poll that
    # hangs is ended by the stream's cancel, 10 s on.
    ender = threading.Timer(10, w.cancel)
    ender.start()
    t0 = time.monotonic()
    try:
        w.poll(-1)
    except kvxfer.errors.StreamClosed:
        pass
    r["poll_negative_s"] = round(time.monotonic() - t0, 1)
    ender.cancel()
    if w.closed:
        w = c.connect(pb.WorkerHello(engine_id="E2" + kind.__name__, mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                     memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
    # Ctrl-C while the main thread waits in poll: KeyboardInterrupt soon.
    t0 = time.monotonic()
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        w.poll(30)
        r["sigint"] = "not raised"
    except KeyboardInterrupt:
        r["sigint"] = "KeyboardInterrupt"
    r["sigint_s"] = round(time.monotonic() - t0, 1)
    w.bye(10)
    c.close()
inprocess.stop()
print("result", json.dumps(res), flush=True)
"""


def test_direct_stream_waits_as_the_grpc_stream(libkvxfer):
    """A rank's direct stream waits as the gRPC one does: Ctrl-C while the
    main thread waits in poll raises KeyboardInterrupt at once (a wait
    inside the library, the GIL released, ran Python's handler only once
    it ended: 30 s later), and a negative wait is no wait (it waited
    without limit)."""
    env = dict(os.environ)
    env["KVXFER_LIBKVXFER"] = str(libkvxfer)
    env["PYTHONPATH"] = os.pathsep.join([str(harness.REPO / "python"), env.get("PYTHONPATH", "")])
    p = subprocess.run([PY, "-c", textwrap.dedent(WAITS)], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"exit status {p.returncode}\n{p.stdout}\n{p.stderr}"
    line = [x for x in p.stdout.splitlines() if x.startswith("result ")]
    assert line, f"no result\n{p.stdout}\n{p.stderr}"
    res = json.loads(line[0][len("result "):])
    for kind, r in res.items():
        assert r["poll_negative_s"] < 5, (kind, r)
        assert r["sigint"] == "KeyboardInterrupt" and r["sigint_s"] < 10, (kind, r)
