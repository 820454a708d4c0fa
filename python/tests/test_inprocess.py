"""kvxfer in the engine's own process (libkvxfer through kvxfer.inprocess):
two Python processes, each with its own in-process server, move real KV
bytes between host tensors named by address; a forked child gets a clear
error; another process cannot use a server's endpoint; start, stop and
interpreter exit never hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import harness

HERE = Path(__file__).resolve().parent
PY = sys.executable


@pytest.fixture(scope="session")
def libkvxfer(tmp_path_factory) -> Path:
    return harness.build_libkvxfer(tmp_path_factory.mktemp("lib"))


def _env(lib: Path) -> dict:
    env = dict(os.environ)
    env["KVXFER_LIBKVXFER"] = str(lib)
    env["PYTHONPATH"] = os.pathsep.join([str(harness.REPO / "python"), env.get("PYTHONPATH", "")])
    return env


def _run(lib: Path, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", textwrap.dedent(code)], env=_env(lib), capture_output=True, text=True, timeout=timeout)


def _result(out: str) -> dict:
    for line in out.splitlines():
        if line.startswith("result "):
            return json.loads(line[len("result "):])
    raise AssertionError(f"no result line in:\n{out}")


def test_push_between_two_processes(libkvxfer, tmp_path):
    """P and D, each a Python process with its own in-process server, push
    P's blocks into D's; both KV caches are tensors named by address (a
    torch tensor on P, a numpy array on D). Every byte of D's cache is
    checked, the transferred blocks and the untouched ones; both processes
    exit (the server stopped at exit) promptly."""
    secret = harness.secret_file(tmp_path)
    engine = str(HERE / "inprocess_engine.py")
    p = subprocess.Popen([PY, engine, "P", secret], env=_env(libkvxfer), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("peer "), line + p.stderr.read()
        d = subprocess.run([PY, engine, "D", secret, line.split()[1]], env=_env(libkvxfer), capture_output=True, text=True, timeout=90)
        t0 = time.monotonic()
        p_out, p_err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert d.returncode == 0, d.stdout + d.stderr
    assert p.returncode == 0, p_out + p_err
    assert time.monotonic() - t0 < 30
    dres, pres = _result(d.stdout), _result(p_out)
    assert dres["outcomes"] == [["d-1", "RESULT_DONE", ""]], dres
    assert pres["outcomes"] == [["p-1", "RESULT_DONE", ""]], pres
    assert dres["bytes"] == 32 * 1024 and dres["wrong_bytes"] == 0, dres


def test_forked_child_gets_a_clear_error(libkvxfer):
    """A child forked from a process that started the server gets
    ForkedChildError from every call, also straight through the C ABI
    (KVXFER_EFORK), instead of a hang; the parent's server is unharmed."""
    r = _run(libkvxfer, """
        import os, sys
        from kvxfer import inprocess
        ep = inprocess.start({"insecure_peers": True, "log_level": "error"})
        import kvxfer as kx
        before = kx.Client(ep, timeout=3, direct=False)  # a client of the parent's, made before the fork
        before.wait_ready(5)
        pid = os.fork()
        if pid == 0:
            code = 0
            # The parent's client, used here: refused as a new one is,
            # saying why (not gRPC's bare "connection reset by peer").
            from kvxfer import errors as kerr
            from kvxfer.v1 import kvxfer_pb2 as kpb
            for call in (lambda: before.scheduler("E").build_meta(),
                         lambda: before.connect(kpb.WorkerHello(engine_id="E"), ready_timeout=10)):
                try:
                    call()
                    code = 17
                except kerr.Unavailable as e:
                    if "forked" not in str(e) or "spawn" not in str(e):
                        print("child: the parent's client:", e, flush=True)
                        code = 18
            for call in (lambda: inprocess.start(), lambda: inprocess.stop(), inprocess.endpoint, inprocess.version):
                try:
                    call()
                    code = 10
                except inprocess.ForkedChildError as e:
                    if "forked child" not in str(e) or "spawn" not in str(e):
                        code = 11
            # A client of a kvxferd (any address but the parent's
            # server) still works here: no ForkedChildError from the
            # direct-call check (this one refuses: nothing listens).
            import kvxfer
            from kvxfer import errors
            try:
                kvxfer.Client("/nonexistent/kvxferd.sock", timeout=1).scheduler("E").build_meta()
                code = 13
            except inprocess.ForkedChildError:
                code = 14
            except errors.KvxferError:
                pass
            # A client of the parent's server: refused, saying why.
            try:
                kvxfer.Client(ep, timeout=3).scheduler("E").build_meta()
                code = 15
            except errors.Unavailable as e:
                if "forked" not in str(e) or "spawn" not in str(e):
                    print("child: parent's server:", e, flush=True)
                    code = 16
            import ctypes
            buf = ctypes.create_string_buffer(256)
            rc = inprocess._lib.kvxfer_start(b"{}", buf, len(buf))
            msg = inprocess._lib.kvxfer_last_error().decode()
            if rc != inprocess.EFORK or "forked child" not in msg:
                code = 12
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert inprocess.start({"insecure_peers": True, "log_level": "error"}) == ep
        import kvxfer
        c = kvxfer.Client(ep)
        c.wait_ready(5)
        c.close()
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_forked_child_stream_gets_a_clear_error(libkvxfer):
    """A rank's stream made in the parent and used in a child forked while
    another thread of the parent waited in its poll: each method raises
    ForkedChildError at once. A direct stream's locks were copied held
    (their holder is no thread of the child), and poll, bye and cancel
    waited for them for ever; a gRPC stream took steps and a bye that went
    nowhere (no thread of the child carries them) and said nothing."""
    r = _run(libkvxfer, """
        import os, signal, threading, time
        import numpy as np
        import kvxfer
        from kvxfer import inprocess
        from kvxfer.client import DirectWorkerStream, WorkerStream
        from kvxfer.v1 import kvxfer_pb2 as pb
        ep = inprocess.start({"insecure_peers": True, "log_level": "error"})
        kv = np.zeros(64 * 1024, dtype=np.uint8)
        layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                             order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16,
                             kernel_block_size=16, regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION,
                                                                      base=kv.ctypes.data, block_len=1024, num_blocks=64)])
        for direct, kind in [(None, DirectWorkerStream), (False, WorkerStream)]:
            c = kvxfer.Client(ep, direct=direct)
            w = c.connect(pb.WorkerHello(engine_id="E" + kind.__name__, mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                         memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
            assert type(w) is kind, type(w)
            poller = threading.Thread(target=lambda: w.poll(3), daemon=True)
            poller.start()
            time.sleep(0.5)  # the poller waits, holding a direct stream's take lock
            pid = os.fork()
            if pid == 0:
                signal.alarm(10)  # a hang kills the child
                code = 0
                for name, call in (("poll", lambda: w.poll()), ("poll(1)", lambda: w.poll(1)),
                                   ("step", lambda: w.step(pb.StepMeta(step=1))), ("bye", lambda: w.bye(2)), ("cancel", w.cancel)):
                    try:
                        call()
                        print("child:", kind.__name__, name, "raised nothing", flush=True)
                        code = 10
                    except inprocess.ForkedChildError as e:
                        if "forked child" not in str(e):
                            code = 11
                os._exit(code)
            _, st = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(st) == 0, (kind.__name__, os.waitstatus_to_exitcode(st))
            poller.join()
            w.bye(10)
            assert w.error is None, w.error
            c.close()
        print("ok", flush=True)
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_forked_child_keeps_no_listening_port(libkvxfer):
    """A child forked without exec closes its copies of the server's
    listening sockets at once (the library's fork handler): while such a
    child lives, the parent stops its server and starts it again on the
    same peer port. Before, the child kept the port bound ("address already
    in use") until it exec'd or exited."""
    r = _run(libkvxfer, """
        import os, signal, socket, time
        from kvxfer import inprocess
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        cfg = {"insecure_peers": True, "log_level": "error", "peer_listen": f"127.0.0.1:{port}"}
        inprocess.start(cfg)
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(wfd, b"r")  # running: the fork handlers have run
            time.sleep(30)  # killed long before
            os._exit(0)
        assert os.read(rfd, 1) == b"r"
        try:
            inprocess.stop()
            inprocess.start(cfg)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        inprocess.stop()
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_forked_child_placement_gets_a_clear_error(libkvxfer):
    """The connectors' shared server (kvxfer.placement) in a child forked
    from a process whose connector started it: acquiring it raises
    ForkedChildError at once (not the parent's endpoint, whose calls then
    fail as a connection reset, or as a scheduler the connector cannot
    open at each step), also when a thread of the parent held it at the
    fork (no hang); letting go of it raises nothing; the parent's is
    unharmed."""
    r = _run(libkvxfer, """
        import os, signal
        from kvxfer import inprocess, placement as pl
        common = {"insecure-peers": True, "log-level": "error", "backend": "builtin"}
        ep = pl.acquire().acquire_scheduler(common, "127.0.0.1", 0)
        for held in (False, True):
            if held:
                pl.acquire()._lock.acquire()  # as a thread of the parent in the middle of a call
            pid = os.fork()
            if pid == 0:
                signal.alarm(10)  # a hang kills the child
                code = 0
                for acq in (lambda: pl.acquire().acquire_scheduler(common, "127.0.0.1", 0),
                            lambda: pl.acquire().acquire_rank(common, "127.0.0.1", 0, 0)):
                    try:
                        print("child: acquired", acq(), flush=True)
                        code = 10
                    except inprocess.ForkedChildError as e:
                        if "forked child" not in str(e):
                            code = 12
                try:
                    pl.release()
                except Exception as e:  # noqa: BLE001
                    print("child: release raised", repr(e), flush=True)
                    code = 11
                os._exit(code)
            if held:
                pl.acquire()._lock.release()
            _, st = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(st) == 0, (held, os.waitstatus_to_exitcode(st))
        assert pl.acquire().acquire_scheduler(common, "127.0.0.1", 0) == ep
        assert pl.acquire().users == 2
        pl.release()
        pl.release()
        assert inprocess.endpoint() is None
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_other_process_is_refused(libkvxfer, tmp_path):
    """The endpoint serves its own process only: another process's
    connection is refused (the abstract socket is reachable, the server
    is not)."""
    server = subprocess.Popen([PY, "-c", textwrap.dedent("""
        import sys
        from kvxfer import inprocess
        print(inprocess.start({"insecure_peers": True, "log_level": "error"}), flush=True)
        sys.stdin.read()
    """)], env=_env(libkvxfer), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ep = server.stdout.readline().strip()
        assert ep.startswith("unix-abstract:"), ep
        import kvxfer
        from kvxfer import errors
        from kvxfer.v1 import kvxfer_pb2 as pb
        # Said plainly, naming the server's process and this one (the
        # server refuses as the socket opens: gRPC alone says "connection
        # reset by peer"), for calls, rank streams and scheduler streams.
        c = kvxfer.Client(ep, timeout=3)

        def steps():
            st = c.scheduler("x").stream()
            st.send(pb.StepRequest(engine_id="x"))
            st._done.wait(10)
            raise st.error

        for call in (lambda: c.scheduler("x").build_meta(), lambda: c.connect(pb.WorkerHello(engine_id="x"), ready_timeout=10),
                     steps, lambda: c.wait_ready(1)):
            with pytest.raises(errors.Unavailable) as exc:
                call()
            msg = str(exc.value)
            assert f"process {server.pid}" in msg and "its own process only" in msg and f"process {os.getpid()}" in msg, msg
        c.close()
    finally:
        server.stdin.close()
        server.wait(30)
    assert server.returncode == 0


def test_start_stop_and_exit_do_not_hang(libkvxfer):
    """Start is idempotent (same configuration, same endpoint), refuses a
    different one while running, and a bad key names it; stop is
    idempotent and a new start after it works; an interpreter that exits
    with a rank's stream still open exits promptly; the environment is
    unchanged."""
    r = _run(libkvxfer, """
        import os, time
        env = dict(os.environ)
        from kvxfer import inprocess
        import kvxfer
        from kvxfer.v1 import kvxfer_pb2 as pb
        import numpy as np
        assert inprocess.version().startswith("0.2.0")
        cfg = {"insecure_peers": True, "log_level": "error"}
        ep = inprocess.start(cfg)
        assert inprocess.start(dict(cfg)) == ep == inprocess.endpoint()
        try:
            inprocess.start({"insecure_peers": True, "log_level": "warn"})
            raise SystemExit("a second configuration was accepted")
        except inprocess.InProcessError as e:
            assert e.code == inprocess.ESTARTED, e
        inprocess.stop()
        inprocess.stop()
        assert inprocess.endpoint() is None
        try:
            inprocess.start({"no_such_key": 1})
            raise SystemExit("a bad key was accepted")
        except inprocess.InProcessError as e:
            assert e.code == inprocess.ECONFIG and "no_such_key" in str(e), e
        ep2 = inprocess.start(cfg)
        assert ep2 != ep
        kv = np.zeros(64 * 1024, dtype=np.uint8)
        c = kvxfer.Client(ep2)
        layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                             order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16, kernel_block_size=16,
                             regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=kv.ctypes.data, block_len=1024, num_blocks=64)])
        w = c.connect(pb.WorkerHello(engine_id="E", mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                     memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
        assert w.agent_name
        assert dict(os.environ) == env, "the library changed the environment"
        print("ok", flush=True)
        # Exit with the stream open: atexit stops the server.
    """, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_direct_streams(libkvxfer):
    """A rank's stream to this process's own server is direct (no gRPC:
    kvxfer_stream_* through the library) and behaves as the gRPC one:
    Ready names the agent, steps go in, a refused hello raises the typed
    error with the server's reason, bye ends it cleanly (nothing after it
    is taken), cancel ends it at once, the server's stop ends what is still
    open (poll then raises StreamClosed); ``direct=False`` keeps gRPC, with the same answers.
    Scheduler calls go direct too (kvxfer_call), with gRPC's answers and
    errors."""
    r = _run(libkvxfer, """
        import time
        import numpy as np
        import kvxfer
        from kvxfer import errors, inprocess
        from kvxfer.client import DirectWorkerStream, WorkerStream
        from kvxfer.v1 import kvxfer_pb2 as pb
        ep = inprocess.start({"insecure_peers": True, "log_level": "error"})
        assert inprocess.has_direct_streams()
        kv = np.zeros(64 * 1024, dtype=np.uint8)

        def hello(engine, base=kv.ctypes.data, size=kv.nbytes):
            layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                                 order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16,
                                 kernel_block_size=16,
                                 regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=base, block_len=1024, num_blocks=64)])
            return pb.WorkerHello(engine_id=engine, mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                  memory=[inprocess.host_memory(base, size)])

        for direct, kind in [(None, DirectWorkerStream), (False, WorkerStream)]:
            c = kvxfer.Client(ep, direct=direct)
            w = c.connect(hello(f"E-{kind.__name__}"))
            assert type(w) is kind, type(w)
            assert w.agent_name
            w.step(pb.StepMeta(step=1))
            assert w.poll(0.01).step_errors == []
            w.bye(10)
            assert w.closed and w.error is None, w.error
            assert w.poll().step_errors == []  # a clean end: nothing left, no error
            try:
                w.step(pb.StepMeta(step=2))
                raise SystemExit(f"{kind.__name__}: a step after bye was taken")
            except errors.StreamClosed:
                pass
            # A hello whose memory is not this process's memory (a range
            # past the array) is refused with the server's reason.
            try:
                c.connect(hello(f"bad-{kind.__name__}", size=kv.nbytes * 4096))
                raise SystemExit(f"{kind.__name__}: a bad hello was accepted")
            except errors.KvxferError as e:
                assert "memory" in str(e), (kind.__name__, e)
                bad = type(e).__name__
            print(kind.__name__, "refused as", bad, flush=True)
            # Cancel: ended at once, no error, nothing left.
            w = c.connect(hello(f"cancelled-{kind.__name__}"))
            w.cancel()
            assert w.closed and w.error is None, (kind.__name__, w.error)
            assert w.poll().recving == []
            c.close()

        # Scheduler calls: direct (kvxfer_call) and over gRPC, the same
        # answers and the same typed errors; direct is quicker.
        answers = {}
        for direct in (None, False):
            c = kvxfer.Client(ep, direct=direct)
            assert bool(c._direct_methods()) == (direct is None)
            s = c.scheduler(f"S{direct}")
            addr = s.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16))
            req = pb.EngineRequest(request_id="d-1", prompt_tokens=40, params=pb.TransferParams(
                transfer_id="t1", do_remote_prefill=True, remote_engine_id="P", remote_addr=addr, remote_tp_size=1))
            got = s.matched_tokens(req, 0)
            try:
                c.scheduler("nobody").matched_tokens(req, 0)
                raise SystemExit("a call for an engine with no scheduler succeeded")
            except errors.KvxferError as e:
                err = type(e).__name__
            t0 = time.perf_counter()
            for _ in range(200):
                s.matched_tokens(req, 0)
            answers[direct] = (addr, got, err)
            print("calls", "direct" if direct is None else "grpc", round((time.perf_counter() - t0) / 200 * 1e6), "us", flush=True)
            c.close()
        assert answers[None] == answers[False], answers

        c = kvxfer.Client(ep)
        w2 = c.connect(hello("open-at-stop"))
        inprocess.stop()
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 20:
                w2.poll(0.2)
            raise SystemExit("the server's stop left a direct stream open")
        except errors.StreamClosed as e:
            assert w2.closed and w2.error is not None, e
        print("ok", flush=True)
    """, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    print("\n".join(line for line in r.stdout.splitlines() if line.startswith("calls ")))
    kinds = dict(line.split(" refused as ") for line in r.stdout.splitlines() if " refused as " in line)
    assert kinds["DirectWorkerStream"] == kinds["WorkerStream"], kinds


def test_rank_servers_metrics_apart(libkvxfer):
    """An engine's servers run one per process (each worker rank's, and
    the scheduler side's own in vLLM's engine-core process), all from the
    connector's one ``server`` object: its metrics_listen is where rank
    (pp, tp) serves /metrics at PORT + pp*tp_size + tp (the peer ports'
    scheme), and the scheduler side's own server serves none. Given
    unchanged to every server, only the first process's could listen:
    each other rank failed to start at its KV registration."""
    base, metrics = harness.free_ports(2), harness.free_ports(2)
    code = """
        import sys, urllib.request
        from kvxfer import placement as pl
        common = {"insecure-peers": True, "log-level": "error", "backend": "builtin", "metrics-listen": "127.0.0.1:%d"}
        base, rank = %d, int(sys.argv[1])
        s = pl.acquire()
        if rank < 0:
            print("scheduler", s.acquire_scheduler(common, "127.0.0.1", base), flush=True)
        else:
            ep = s.acquire_rank(common, "127.0.0.1", base, pl.rank_port(base, 2, 0, rank))
            body = urllib.request.urlopen("http://127.0.0.1:%%d/metrics" %% (%d + rank), timeout=10).read().decode()
            print("rank", rank, ep, "metrics" if "kvxfer_" in body else "no kvxfer metrics", flush=True)
        sys.stdin.read()
        pl.release()
        print("ok", flush=True)
    """ % (metrics, base, metrics)
    procs = []
    try:
        for rank in (0, 1, -1):
            procs.append(subprocess.Popen([PY, "-c", textwrap.dedent(code), str(rank)], env=_env(libkvxfer), stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            line = procs[-1].stdout.readline()
            if not line:
                raise AssertionError(f"rank {rank}: {procs[-1].stderr.read()}")
            assert "unix-abstract:" in line and ("scheduler" in line or line.rstrip().endswith(" metrics")), line
    finally:
        outs = []
        for p in procs:
            out, err = p.communicate("", timeout=60)
            outs.append((p.returncode, out, err))
    for rc, out, err in outs:
        assert rc == 0 and "ok" in out, out + err


def test_data_parallel_engines_data_ports_apart(libkvxfer):
    """Data-parallel ranks are engines of their own on one host, their
    ranks' ports after the previous ones' (peer_port); with the built-in
    backend's data_port_base, their ranks' KV listeners too: rank (pp, tp)
    of data-parallel rank r listens at data_port_base + r*tp*pp +
    pp*tp_size + tp. Given unchanged to every engine's servers, rank 0 of
    every data-parallel rank took the same data port: all but the first
    failed to attach."""
    peer, data = harness.free_ports(2), harness.free_ports(2)
    code = """
        import sys
        import numpy as np
        import kvxfer
        from kvxfer import inprocess, placement as pl
        from kvxfer.v1 import kvxfer_pb2 as pb
        common = {"insecure-peers": True, "log-level": "error", "backend": "builtin", "data-port-base": %d}
        peer_port, dp = %d, int(sys.argv[1])
        base = pl.engine_base(peer_port, dp, 1, 1)
        port = pl.rank_port(base, 1, 0, 0)
        ep = pl.acquire().acquire_rank(common, "127.0.0.1", base, port, port - peer_port)
        kv = np.zeros(64 * 1024, dtype=np.uint8)
        layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                             order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16, kernel_block_size=16,
                             regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=kv.ctypes.data, block_len=1024, num_blocks=64)])
        w = kvxfer.Client(ep).connect(pb.WorkerHello(engine_id=f"E{dp}", mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                                     memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
        print("attached", dp, flush=True)
        sys.stdin.read()
        w.bye(20)
        pl.release()
        print("ok", flush=True)
    """ % (data, peer)
    procs = []
    try:
        for dp in (0, 1):
            procs.append(subprocess.Popen([PY, "-c", textwrap.dedent(code), str(dp)], env=_env(libkvxfer), stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            line = procs[-1].stdout.readline()
            assert line.startswith("attached"), f"data-parallel rank {dp}: {line}{procs[-1].stderr.read()}"
        with open(f"/proc/net/tcp") as f:
            listening = {int(cols[1].split(":")[1], 16) for cols in (ln.split() for ln in f.readlines()[1:]) if cols[3] == "0A"}
        assert {data, data + 1} <= listening, (data, sorted(p for p in listening if data - 2 <= p <= data + 3))
    finally:
        outs = []
        for p in procs:
            out, err = p.communicate("", timeout=60)
            outs.append((p.returncode, out, err))
    for rc, out, err in outs:
        assert rc == 0 and "ok" in out, out + err


def test_direct_stream_errors_are_the_grpc_streams(libkvxfer):
    """A direct stream's connect fails with the errors a gRPC stream's
    does, which the connector tells apart: no Ready within ready_timeout
    is DeadlineExceeded (a server that is slow, e.g. still fencing the
    rank's previous stream, may yet move bytes: the connector must not
    take it for gone), never Unavailable, which says it is gone (the
    connector then hands back blocks a WRITE may still land in); and no
    server to open a stream on is Unavailable, a KvxferError, never the
    library's InProcessError, which the connector does not catch."""
    r = _run(libkvxfer, """
        import numpy as np
        import kvxfer
        from kvxfer import errors, inprocess
        from kvxfer.client import DirectWorkerStream, WorkerStream
        from kvxfer.v1 import kvxfer_pb2 as pb
        ep = inprocess.start({"insecure_peers": True, "log_level": "error"})
        kv = np.zeros(64 * 1024, dtype=np.uint8)
        layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                             order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16,
                             kernel_block_size=16, regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION,
                                                                      base=kv.ctypes.data, block_len=1024, num_blocks=64)])
        got = {}
        for direct in (None, False):
            c = kvxfer.Client(ep, direct=direct)
            hello = pb.WorkerHello(engine_id=f"E{direct}", mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                   memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)])
            try:
                c.connect(hello, ready_timeout=1e-9)
                got[str(direct)] = "connected"
            except Exception as e:  # noqa: BLE001
                got[str(direct)] = type(e).__name__
            c.close()
        print("no ready:", got, flush=True)
        assert got == {"None": "DeadlineExceeded", "False": "DeadlineExceeded"}, got
        inprocess.stop()
        try:
            DirectWorkerStream(hello, 5)
            raise SystemExit("a direct stream opened with no server")
        except errors.Unavailable as e:
            assert "no in-process server" in str(e), e
        print("ok", flush=True)
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_stop_from_a_signal_handler_during_start(libkvxfer):
    """A SIGTERM handler that stops the server (kvxfer.inprocess.stop) may
    run on a thread inside start, check_config or version (Python runs
    handlers between bytecodes, on the main thread): it stops the server
    instead of waiting for itself for ever on the module's lock, and the
    start it interrupted records no running server."""
    r = _run(libkvxfer, """
        import os, signal
        from kvxfer import inprocess
        signal.signal(signal.SIGUSR1, lambda *_: inprocess.stop())
        cfg = {"insecure_peers": True, "log_level": "error"}
        inprocess.start(cfg)
        with inprocess._lock:  # as start, check_config and version hold it
            os.kill(os.getpid(), signal.SIGUSR1)
        assert inprocess.endpoint() is None, inprocess.endpoint()
        # A stop that lands inside start, after the library started it.
        real = inprocess._lib.kvxfer_start
        class Interrupted:
            def __call__(self, *a):
                code = real(*a)
                os.kill(os.getpid(), signal.SIGUSR1)
                return code
        inprocess._lib.kvxfer_start = Interrupted()
        ep = inprocess.start(cfg)
        inprocess._lib.kvxfer_start = real
        assert ep and inprocess.endpoint() is None, (ep, inprocess.endpoint())
        assert inprocess.start(cfg) == inprocess.endpoint() != ep
        inprocess.stop()
        print("result {}")
    """, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    _result(r.stdout)


def test_scheduler_call_while_stopping_is_unavailable(libkvxfer):
    """A scheduler call made without gRPC while another thread's stop
    waits for the server's drain (a producer rank holds a request for a
    consumer that never comes) fails at once with Unavailable, a
    KvxferError as a gRPC call's is, which the connector fails its
    requests on. It waited for the whole stop, then raised InProcessError,
    which went past every handler, out of the engine's loop."""
    r = _run(libkvxfer, """
        import threading, time
        import numpy as np
        import kvxfer
        from kvxfer import errors, inprocess
        from kvxfer.v1 import kvxfer_pb2 as pb
        ep = inprocess.start({"insecure_peers": True, "log_level": "error", "drain_timeout": "20s"})
        kv = np.zeros(64 * 1024, dtype=np.uint8)
        c = kvxfer.Client(ep)
        layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                             order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16,
                             kernel_block_size=16,
                             regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=kv.ctypes.data, block_len=1024, num_blocks=64)])
        w = c.connect(pb.WorkerHello(engine_id="P", mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                     memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
        s = c.scheduler("S")
        s.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16))
        now = time.time_ns()
        w.step(pb.StepMeta(step=1, scheduler_clock_unix_nanos=now, send=[pb.SendRequest(
            request_id="p-1", transfer_id="t-1", deadline_unix_nanos=now + 60 * 10**9,
            blocks=[pb.Span(block_ids=[1, 2])], tokens=20)]))
        w.poll(0.2)
        stopping = threading.Thread(target=inprocess.stop)
        stopping.start()
        time.sleep(0.5)  # the stop began: its drain waits for the rank's request
        assert stopping.is_alive(), "the stop did not wait for the held request"
        t0 = time.monotonic()
        try:
            s.matched_tokens(pb.EngineRequest(request_id="d-1", prompt_tokens=40), 0)
            raise SystemExit("a call to a stopping server succeeded")
        except errors.Unavailable as e:
            print("unavailable", e, flush=True)
        except Exception as e:
            raise SystemExit(f"a call to a stopping server raised {type(e).__name__}: {e}, want Unavailable")
        took = time.monotonic() - t0
        assert took < 5, f"the call waited {took:.1f} s for the stop"
        stopping.join()
        print("ok", flush=True)
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_ctrl_c_interrupts_the_stop_at_exit(libkvxfer):
    """An interpreter exiting while its server drains a held request (the
    stop at exit waits up to the drain-timeout, here 60 s) exits at once on
    Ctrl-C (SIGINT) and says so. The stop was one C call: Python could not
    run its SIGINT handler until the call returned, so the process stayed
    for the whole drain."""
    code = textwrap.dedent("""
        import time
        import numpy as np
        import kvxfer
        from kvxfer import inprocess
        from kvxfer.v1 import kvxfer_pb2 as pb
        ep = inprocess.start({"insecure_peers": True, "log_level": "error", "drain_timeout": "60s"})
        kv = np.zeros(64 * 1024, dtype=np.uint8)
        c = kvxfer.Client(ep)
        layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                             order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16,
                             kernel_block_size=16,
                             regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=kv.ctypes.data, block_len=1024, num_blocks=64)])
        w = c.connect(pb.WorkerHello(engine_id="P", mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                     memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
        now = time.time_ns()
        w.step(pb.StepMeta(step=1, scheduler_clock_unix_nanos=now, send=[pb.SendRequest(
            request_id="p-1", transfer_id="t-1", deadline_unix_nanos=now + 120 * 10**9,
            blocks=[pb.Span(block_ids=[1, 2])], tokens=20)]))
        w.poll(0.2)
        print("exiting", flush=True)
    """)
    p = subprocess.Popen([PY, "-c", code], env=_env(libkvxfer), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "exiting", line + p.stderr.read()
        time.sleep(1.0)  # the stop at exit began: it drains the held request
        assert p.poll() is None, "the process exited without draining its held request"
        p.send_signal(2)
        t0 = time.monotonic()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the process still ran {time.monotonic() - t0:.0f} s after Ctrl-C (SIGINT) during its stop at exit")
        err = p.stderr.read()
        assert "stop interrupted at exit" in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_client_refuses_bad_arguments_and_use_after_close(libkvxfer):
    """An engine author's mistakes with the plain client are a KvxferError
    (InvalidArgument naming the argument and its value, nothing sent)
    rather than an AttributeError or TypeError from inside the module; a
    closed client is Unavailable on every path: before, its gRPC calls
    raised gRPC's ValueError ("Cannot invoke RPC on closed channel!") and
    its direct calls to the in-process server went on working."""
    r = _run(libkvxfer, """
        import json
        import pathlib
        import threading
        import time
        import kvxfer
        from kvxfer import errors, inprocess
        from kvxfer.v1 import kvxfer_pb2 as pb
        ep = inprocess.start({"insecure_peers": True, "log_level": "error"})
        bad = []

        def refused(what, fn, cls, *words):
            try:
                fn()
            except cls as e:
                if not all(w in str(e) for w in words):
                    bad.append(f"{what}: {e!r} does not say {words}")
                return
            except BaseException as e:
                bad.append(f"{what}: {type(e).__name__}: {e}")
                return
            bad.append(f"{what}: raised nothing")

        inv = errors.InvalidArgument
        refused("address None", lambda: kvxfer.Client(None), inv, "address = None")
        if kvxfer.Client(pathlib.Path("/run/x.sock")).address != "/run/x.sock":
            bad.append("a pathlib.Path socket is not taken as its path")
        refused("timeout str", lambda: kvxfer.Client(ep, timeout="10"), inv, "timeout = '10'")
        refused("timeout 0", lambda: kvxfer.Client(ep, timeout=0), inv, "timeout = 0")
        for direct in (None, False):
            c = kvxfer.Client(ep, direct=direct)
            s = c.scheduler("E")
            refused(f"{direct} open None", lambda: s.open(None), inv, "config = None", "SchedulerConfig")
            refused(f"{direct} step_request dict", lambda: s.step_request({"ops": []}), inv, "req = {'ops': []}")
            refused(f"{direct} call timeout -1", lambda: c.call("BuildMeta", c._sched.BuildMeta, pb.BuildMetaRequest(engine_id="E"), timeout=-1),
                    inv, "timeout = -1")
            refused(f"{direct} connect None", lambda: c.connect(None), inv, "hello = None", "WorkerHello")
            refused(f"{direct} connect ready_timeout", lambda: c.connect(pb.WorkerHello(engine_id="E"), ready_timeout="5"),
                    inv, "ready_timeout = '5'")
            st = s.stream()
            refused(f"{direct} send None", lambda: st.send(None), inv, "req = None")
            st.close()
            s.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16))
            c.close()
            c.close()  # twice: nothing
            refused(f"{direct} step after close", lambda: s.step([]), errors.Unavailable, "closed")
            refused(f"{direct} connect after close", lambda: c.connect(pb.WorkerHello(engine_id="E")), errors.Unavailable, "closed")
            refused(f"{direct} stream after close", lambda: s.stream(), errors.Unavailable, "closed")
            kvxfer.Client(ep, direct=direct).scheduler("E").close()
        # Calls in flight as the client closes (gRPC: the direct calls
        # cannot be interrupted, and end well); a few times, for the
        # moments a close can fall on.
        for _ in range(4):
            c = kvxfer.Client(ep, direct=False)
            s = c.scheduler("E")
            s.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16))
            got = []

            def calls():
                try:
                    while True:
                        s.build_meta()
                except BaseException as e:
                    got.append(e)

            ts = [threading.Thread(target=calls) for _ in range(8)]
            for t in ts:
                t.start()
            time.sleep(0.2)
            c.close()
            for t in ts:
                t.join(10)
            bad += [f"a call in flight at close: {e!r}" for e in got
                    if not isinstance(e, errors.Unavailable) or "closed" not in str(e)]
        kvxfer.Client(ep).scheduler("E").close()
        inprocess.stop()
        print("result", json.dumps(bad), flush=True)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _result(r.stdout) == [], r.stdout
