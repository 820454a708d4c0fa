"""The plain Python client against a real kvxferd: scheduler calls, the
batched Step, worker streams, peer handshakes and typed errors."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import harness
import kvxfer
from kvxfer.peerauth import Bridge, load_secret
from kvxfer import errors, params, shm
from kvxfer.v1 import kvxfer_pb2 as pb

# kvxferd's own services, over its socket.
pytestmark = pytest.mark.placement("daemon")


def _hello(d, engine="e1", size=1 << 20):
    buf = shm.create(size, d.shm_dir)
    layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                         order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16,
                         kernel_block_size=16,
                         regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=buf.base, block_len=1024, num_blocks=64)])
    return buf, pb.WorkerHello(engine_id=engine, mode=pb.MODE_PUSH, layout=layout,
                               memory=[pb.SharedMemory(path=buf.path, base=buf.base, size=buf.size)], compat_hash="h")


def test_scheduler_and_step(daemons):
    d = daemons("a")
    with kvxfer.Client(d.socket) as c:
        s = c.scheduler("D")
        assert s.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16)) == d.peer
        host, port = d.peer.rsplit(":", 1)
        good = pb.EngineRequest(request_id="d-1", prompt_tokens=40, params=params.to_proto(
            {"do_remote_prefill": True, "transfer_id": "t1", "remote_engine_id": "P", "remote_host": host,
             "remote_port": int(port), "tp_size": 1}))
        bad = pb.EngineRequest(request_id="d-2", prompt_tokens=40, params=pb.TransferParams(do_remote_prefill=True, remote_addr="x:1"))
        op = lambda r: pb.SchedulerOp(after_alloc=pb.AfterAllocRequest(request=r, blocks=[pb.BlockList(block_ids=[1, 2, 3])], external=40))
        res = s.step([op(good), op(bad)])
        assert list(res.errors) == [1]
        assert isinstance(res.errors[1], errors.InvalidArgument) and "RemoteEngineID" in res.errors[1].details
        assert [r.request_id for r in res.meta.recv] == ["d-1"] and res.counters.bad_params == 1
        with pytest.raises(errors.NotFound, match="OpenScheduler"):
            c.scheduler("nobody").build_meta()
        with pytest.raises(errors.InvalidArgument, match="engine_id"):
            c.scheduler("").build_meta()
        s.close()


def test_pull_step_answers_carry_the_generation(daemons):
    """A pull scheduler's step answers (Step and the Steps stream) carry
    the engine's generation as its peers' handshakes report it, once a rank
    of the engine is attached (0 before); a push scheduler's carry none."""
    d = daemons("a")
    c = kvxfer.Client(d.socket)
    buf, hello = _hello(d, engine="P")
    hello.mode = pb.MODE_PULL
    try:
        s = c.scheduler("P")
        s.open(pb.SchedulerConfig(mode=pb.MODE_PULL, tp_size=1, logical_block_size=16))
        assert s.step([]).generation == 0  # no rank attached: unknown
        w = c.connect(hello)
        peer = kvxfer.Client(d.peer, peer_secret=load_secret(d.secret))
        gen = peer.handshake("P").generation
        peer.close()
        assert gen and s.step([]).generation == gen
        st = s.stream()
        st.send(pb.StepsRequest(step=pb.StepRequest(publish_step=1)))
        answers = st.results(wait=10, count=1)
        assert [kvxfer.client.step_result(a).generation for a in answers] == [gen], answers
        st.close()
        s.close()
        push = c.scheduler("P")
        push.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16))
        assert push.step([]).generation == 0
        push.close()
        w.bye(timeout=10)
    finally:
        c.close()
        buf.close()


def test_worker_stream_and_handshake(daemons):
    d = daemons("a")
    c = kvxfer.Client(d.socket)
    buf, hello = _hello(d)
    try:
        w = c.connect(hello)
        assert w.agent_name
        # The rank is published to peers (PeerService on the TCP port),
        # which answers only clients holding the daemon's peer secret.
        peer = kvxfer.Client(d.peer, peer_secret=load_secret(d.secret))
        hs = peer.handshake("e1")
        assert hs.engine_id == "e1" and hs.payload
        peer.close()
        for secret in (None, b"not the daemon's secret at all"):
            outsider = kvxfer.Client(d.peer, timeout=5, peer_secret=secret)
            with pytest.raises(errors.Unavailable) as ei:
                outsider.handshake("e1")
            if secret is not None:
                assert "its proof does not match our secret" in str(ei.value)
            outsider.close()
        # A step with a bad entry gets a StepError naming it; the stream lives.
        w.step(pb.StepMeta(step=1, send=[pb.SendRequest(request_id="")]))
        deadline = time.monotonic() + 10
        f = w.poll()
        while not f.step_errors and time.monotonic() < deadline:
            f = w.poll(wait=0.5)
        assert f.step_errors and "ReqID" in f.step_errors[0].message
        w.bye()
        assert w.closed
        with pytest.raises(errors.StreamClosed):
            w.step(pb.StepMeta(step=2))
    finally:
        c.close()
        buf.close()


def test_bad_hello_is_typed(daemons):
    d = daemons("a")
    c = kvxfer.Client(d.socket)
    buf, hello = _hello(d)
    hello.memory[0].size = buf.size * 4  # larger than the file
    try:
        with pytest.raises(errors.DaemonError) as ei:
            c.connect(hello)
        assert ei.value.code.name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"), ei.value
    finally:
        c.close()
        buf.close()


def test_no_daemon_is_unavailable(tmp_path):
    c = kvxfer.Client(str(tmp_path / "none.sock"), timeout=2)
    with pytest.raises(errors.Unavailable):
        c.scheduler("x").build_meta()
    c.close()


def test_params_round_trip():
    p = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t", "remote_engine_id": "p0",
         "remote_host": "::1", "remote_port": 7600, "remote_request_id": "r", "remote_block_ids": [[1, 2], [3]],
         "remote_block_starts": [0, 16], "tp_size": 2, "remote_pp_size": 1, "remote_num_tokens": 30, "mode": "pull",
         "remote_generation": (1 << 64) - 3}
    t = params.to_proto(p)
    assert t.remote_addr == "[::1]:7600" and [list(s.block_ids) for s in t.remote_block_ids] == [[1, 2], [3]]
    assert params.from_proto(t) == p
    # vLLM's NIXL shape: a flat list is one group; its key spellings.
    t = params.to_proto({"transfer_mode": "push", "pp_size": 2})
    assert t.mode == pb.MODE_PUSH and t.remote_pp_size == 2
    assert [list(s.block_ids) for s in params.to_proto({"remote_block_ids": [4, 5]}).remote_block_ids] == [[4, 5]]
    for bad, field in [({"remote_block_ids": [[1, -2]]}, "remote_block_ids[0][1]"), ({"remote_host": "h", "remote_port": "x"}, "remote_port")]:
        with pytest.raises(params.ParamsError, match=field.replace("[", r"\[").replace("]", r"\]")):
            params.to_proto(bad)
    with pytest.raises(params.ParamsError, match="remote_engine_id"):
        params.validate_remote({"remote_host": "h", "remote_port": 1, "transfer_id": "t"}, pb.MODE_PUSH)
    with pytest.raises(params.ParamsError, match="remote_block_ids"):
        params.validate_remote({"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "transfer_id": "t"}, pb.MODE_PULL)


def test_params_bad_values_are_params_errors():
    """A malformed kv_transfer_params value raises ParamsError naming the
    key and the value (what the connector catches: it computes such a
    request locally), never another exception from deep inside (a
    ValueError from int() or from protobuf's range check, which the
    connector does not catch, out of vLLM's scheduler loop), and a value
    of the wrong type is not converted into a valid one (True is no port,
    2.7 no TP size)."""
    base = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "transfer_id": "t", "remote_block_ids": [[1]]}
    for extra, key in [({"remote_block_starts": ["x"]}, "remote_block_starts"), ({"remote_block_starts": [None]}, "remote_block_starts"),
                       ({"remote_block_starts": [-16]}, "remote_block_starts"), ({"remote_block_starts": [True]}, "remote_block_starts"),
                       ({"remote_port": True}, "remote_port"), ({"tp_size": True}, "tp_size"), ({"tp_size": 2.7}, "tp_size"),
                       ({"tp_size": 1 << 40}, "tp_size"), ({"remote_num_tokens": 1 << 70}, "remote_num_tokens"),
                       ({"remote_blocks_expiry_unix_nanos": 1 << 64}, "remote_blocks_expiry_unix_nanos"),
                       ({"remote_generation": 1 << 64}, "remote_generation"), ({"remote_generation": -1}, "remote_generation")]:
        p = {**base, **extra}
        for what, call in [("validate_remote", lambda: params.validate_remote(p, pb.MODE_PUSH)), ("to_proto", lambda: params.to_proto(p))]:
            try:
                call()
            except params.ParamsError as e:
                assert key in str(e), (what, extra, e)
                continue
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{what}({extra}): {type(e).__name__}: {e}, want ParamsError naming {key}") from e
            raise AssertionError(f"{what}({extra}) accepted, want ParamsError naming {key}")
    # Integral values as routers may write them still go through.
    t = params.to_proto({**base, "tp_size": 2.0, "remote_port": "7600", "remote_block_starts": [16]})
    assert t.remote_tp_size == 2 and t.remote_addr == "h:7600" and t.remote_block_ids[0].start == 16


def _new_threads(before: set[int], wait: float = 5.0) -> list[str]:
    """The threads started since before (idents) still alive after up to
    wait seconds for them to exit."""
    deadline = time.monotonic() + wait
    while True:
        left = [t.name for t in threading.enumerate() if t.ident not in before]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_stream_end_leaves_no_thread_or_fd(daemons):
    """However a rank's stream or a Steps stream ends (the daemon killed
    under it, the daemon refusing its hello, the client closed under an
    open stream), no thread the client made for it outlives it, and no fd:
    gRPC's thread that feeds the stream its requests blocked forever on
    the request queue unless bye or cancel had queued its end (one thread
    leaked per stream lost, e.g. per daemon restart)."""
    d = daemons("a")

    def cycle():
        c = kvxfer.Client(d.socket)
        buf, hello = _hello(d)
        try:
            c.connect(hello).bye()
            c.scheduler("s").stream().close()
        finally:
            c.close()
            buf.close()

    cycle()  # gRPC's process-wide threads and fds, made once
    before, fds = {t.ident for t in threading.enumerate()}, _fds()
    # The daemon killed under a rank's stream and a Steps stream.
    c = kvxfer.Client(d.socket)
    buf, hello = _hello(d)
    w = c.connect(hello)
    s = c.scheduler("s")
    s.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16))
    st = s.stream()
    d.kill()
    deadline = time.monotonic() + 10
    with pytest.raises(errors.StreamClosed):
        while time.monotonic() < deadline:
            w.poll(wait=0.2)
    assert w.closed
    while not st.closed and time.monotonic() < deadline:
        try:
            st.results(wait=0.2)
        except errors.KvxferError:
            break
    assert st.closed and st.error is not None
    w.bye()
    c.close()
    buf.close()
    assert _new_threads(before) == [], "threads left after the daemon died under the streams"
    # Attaching again while the daemon is down (the connector retries once
    # a second until it is back).
    c = kvxfer.Client(d.socket)
    buf, hello = _hello(d)
    for _ in range(3):
        with pytest.raises(errors.Unavailable):
            c.connect(hello, ready_timeout=5)
    c.close()
    buf.close()
    assert _new_threads(before) == [], "threads left after attaching to no daemon"
    d.restart()
    # A hello the daemon refuses.
    c = kvxfer.Client(d.socket)
    buf, hello = _hello(d)
    hello.memory[0].size = buf.size * 4
    with pytest.raises(errors.DaemonError):
        c.connect(hello)
    c.close()
    buf.close()
    assert _new_threads(before) == [], "threads left after a refused hello"
    # The client closed under open streams.
    c = kvxfer.Client(d.socket)
    buf, hello = _hello(d)
    w = c.connect(hello)
    st = c.scheduler("s").stream()
    c.close()
    buf.close()
    assert _new_threads(before) == [], "threads left after the client closed under open streams"
    assert w.closed and st.closed
    deadline = time.monotonic() + 5
    while _fds() > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds() <= fds, f"{_fds() - fds} fds left: {_fd_names()}"


def test_peer_client_close_stops_its_bridge(daemons):
    """A Client made with a peer secret (its authenticating bridge, a
    unix socket) leaves no thread and no listening port once closed: the
    bridge's accept, blocked in accept(2), kept the listening socket alive
    after close (close(2) does not wake it) and accepted and relayed the
    next connection to it, one thread and one port leaked per client."""
    d = daemons("a")
    secret = load_secret(d.secret)
    c = kvxfer.Client(d.peer, peer_secret=secret)
    with pytest.raises(errors.NotFound):
        c.handshake("nobody")
    c.close()
    before, fds = {t.ident for t in threading.enumerate()}, _fds()
    for _ in range(3):
        c = kvxfer.Client(d.peer, peer_secret=secret)
        with pytest.raises(errors.NotFound):
            c.handshake("nobody")
        path = c._bridge.path
        time.sleep(0.1)  # the bridge's accept is waiting
        c.close()
        with socket.socket(socket.AF_UNIX) as s, pytest.raises((ConnectionRefusedError, FileNotFoundError)):
            s.settimeout(5)
            s.connect(path)
    assert _new_threads(before) == []
    deadline = time.monotonic() + 5
    while _fds() > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds() <= fds, f"{_fds() - fds} fds left: {_fd_names()}"


def _fd_names() -> list[str]:
    out = []
    for n in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{n}"))
        except OSError:
            pass
    return sorted(out)


def test_bridge_keeps_few_errors():
    """A bridge to a peer that cannot be reached keeps its latest failures
    only: a channel retries for as long as it lives, and every failed
    connection added one to a list that grew without bound."""
    port = harness.free_port()  # nothing listens there
    b = Bridge(f"127.0.0.1:{port}", b"s" * 16, timeout=2)
    try:
        for _ in range(48):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(b.path)
                assert s.recv(1) == b""  # the bridge hangs up: the peer is unreachable
        assert 0 < len(b.errors) <= 16, len(b.errors)
        assert "refused" in b.errors[-1]
    finally:
        b.close()


_CONNECT_AS_NOBODY = """
import socket, sys
addr = sys.argv[1]
try:
    if addr.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(addr[len("unix:"):])
    else:
        host, _, port = addr.rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(5)
    s.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")
    got = s.recv(64)
    print("RELAYED" if got else "HUNG UP")
except OSError as e:
    print("REFUSED", type(e).__name__, e)
"""


def test_bridge_refuses_other_users(daemons):
    """A peer-secret bridge is for its own user: another local user who
    connects to it would reach the peer authenticated with this process's
    secret. Before, it listened on a loopback port and relayed any local
    user's connection to the peer, authenticated (here uid 65534's, whose
    HTTP/2 preface the daemon answered)."""
    # A Python another user can run (the test's own may lie under a home
    # only its user enters): the system's.
    py = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), sys.executable)
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("switching to another uid needs root and setpriv; CI runs as root")
    d = daemons("a")
    b = Bridge(d.peer, load_secret(d.secret), timeout=5)
    try:
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py, "-c", _CONNECT_AS_NOBODY, b.address],
                             capture_output=True, text=True, timeout=30, cwd="/")
        assert out.stdout.startswith(("REFUSED", "HUNG UP")), f"another user's connection to the bridge: {out.stdout} {out.stderr}"
        # Its own user still gets through.
        c = kvxfer.Client(d.peer, peer_secret=load_secret(d.secret))
        try:
            with pytest.raises(errors.NotFound):
                c.handshake("nobody")
        finally:
            c.close()
    finally:
        b.close()


def test_params_string_fields_refused_naming_them():
    """A string param that kvxfer.v1 cannot carry (a lone surrogate, as
    JSON's "\\ud800" reads) or that is no string (an object, a list, a
    boolean, bytes) raises ParamsError naming the key and the value from
    validate_remote and to_proto alike; before, validate_remote passed it,
    and to_proto raised UnicodeEncodeError from protobuf or sent the
    object's repr as the id. A numeric id still goes through as its
    digits, and valid non-ASCII text as it is."""
    base = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "transfer_id": "t", "remote_request_id": "r"}
    for key in ("remote_engine_id", "remote_host", "transfer_id", "remote_request_id"):
        for v in ("x\ud800", "\udfff", {"a": 1}, ["t"], True, b"t", 1.5):
            p = {**base, key: v}
            for what, call in [("validate_remote", lambda: params.validate_remote(p, pb.MODE_PUSH)),
                               ("to_proto", lambda: params.to_proto(p))]:
                try:
                    call()
                except params.ParamsError as e:
                    assert f"kv_transfer_params.{key}" in str(e), (what, key, v, e)
                    continue
                except Exception as e:  # noqa: BLE001
                    raise AssertionError(f"{what}({key}={v!r}): {type(e).__name__}: {e}, want ParamsError naming {key}") from e
                raise AssertionError(f"{what}({key}={v!r}) accepted, want ParamsError naming {key}")
    p = {**base, "transfer_id": 42, "remote_engine_id": "préfill-ü"}
    params.validate_remote(p, pb.MODE_PUSH)
    t = params.to_proto(p)
    assert t.transfer_id == "42" and t.remote_engine_id == "préfill-ü"


def test_bad_arguments_refused_before_sending(daemons):
    """An engine's bad argument to the client (a block id negative, past
    int32 or no integer, a block list that is no list, an engine id or a
    request id that is no string protobuf can carry, a negative or
    fractional count, step or layer) raises InvalidArgument naming the
    argument and its value, and nothing goes to the daemon; before, it
    raised protobuf's TypeError or ValueError naming neither ("bad
    argument type for built-in operation", "Value out of range: -1"), or
    went out as it was. The client and the stream stay usable."""
    d = daemons("a")
    c = kvxfer.Client(d.socket)
    buf, hello = _hello(d)
    try:
        s = c.scheduler("D")
        s.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16))
        req = pb.EngineRequest(request_id="d-1", prompt_tokens=40)
        cases = [
            ("blocks[0][1] = -2", lambda: s.after_alloc(req, [[1, -2]], 0, 0)),
            ("blocks[1][0] = 4294967296", lambda: s.after_alloc(req, [[1], [1 << 32]], 0, 0)),
            ("blocks[0][0] = '3'", lambda: s.request_finished(req, pb.FINISH_STATUS_STOPPED, [["3"]], 0)),
            ("blocks[0][0] = True", lambda: s.request_finished(req, pb.FINISH_STATUS_STOPPED, [[True]], 0)),
            ("blocks[0] = 7", lambda: s.after_alloc(req, [7], 0, 0)),
            ("computed = -1", lambda: s.after_alloc(req, [[1]], -1, 0)),
            ("external = 2.5", lambda: s.after_alloc(req, [[1]], 0, 2.5)),
            ("computed = None", lambda: s.matched_tokens(req, None)),
            ("engine_id = 5", lambda: c.scheduler(5)),
            ("engine_id = 'e\\ud800'", lambda: c.scheduler("e\ud800")),
        ]
        w = c.connect(hello)
        cases += [
            ("step = -1", lambda: w.step_ref(-1)),
            ("recv[1] = 7", lambda: w.step_ref(1, recv=["a", 7])),
            ("send[0] = '\\udfff'", lambda: w.step_ref(1, send=["\udfff"])),
            ("layer = -3", lambda: w.layer_saved(1, -3)),
            ("step = 'x'", lambda: w.layer_saved("x", 0)),
        ]
        for want, call in cases:
            try:
                call()
            except errors.InvalidArgument as e:
                assert want in str(e), (want, e)
                continue
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{want}: {type(e).__name__}: {e}, want InvalidArgument naming it") from e
            raise AssertionError(f"{want}: accepted, want InvalidArgument naming it")
        # Nothing of that reached the daemon: the stream is as it was.
        w.step(pb.StepMeta(step=1))
        f = w.poll(wait=0.5)
        assert not f.step_errors, f.step_errors
        assert s.matched_tokens(req, 0) == (0, False)
        w.bye()
        s.close()
    finally:
        c.close()
        buf.close()


def test_shm_files_go_when_their_process_exits(tmp_path):
    """A shared-memory file create made and nothing closed goes when the
    process that made it exits (a tmpfs file holds its memory until it is
    removed: an engine exiting without closing its buffers left its whole
    KV cache in /dev/shm), and not when a child forked from that process
    exits: the parent may still use it. A file closed with remove=False
    stays until then too; one a process did not make is left alone."""
    code = textwrap.dedent(f"""
        import os, sys
        from kvxfer import shm
        a = shm.create(1 << 16, {str(tmp_path)!r}, name="a")
        b = shm.create(1 << 16, {str(tmp_path)!r}, name="b")
        b.close(remove=False)
        open(os.path.join({str(tmp_path)!r}, "other"), "w").close()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # atexit handlers run in the child
        os.waitpid(pid, 0)
        print(sorted(os.listdir({str(tmp_path)!r})), flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(harness.REPO / "python")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['a', 'b', 'other']", r.stdout  # the child's exit removed none
    assert sorted(os.listdir(tmp_path)) == ["other"]


def test_remote_host_must_be_a_host():
    """kv_transfer_params.remote_host names a host as peers dial it: one
    with its port, a space, a slash or a control character is refused,
    naming the field and the value (it made a peer address no peer has);
    names, IPv4, IPv6 (bare, bracketed, with a zone) and the unspecified
    address a daemon may advertise are taken."""
    base = {"remote_engine_id": "e", "remote_port": 7600, "transfer_id": "t"}
    for host in ("127.0.0.1", "::1", "[::1]", "fe80::1%eth0", "0.0.0.0", "p0.example.com", "decode_0.svc"):
        params.validate_remote({**base, "remote_host": host}, pb.MODE_PUSH)
    for host in ("127.0.0.1:7600", "h ", "[127.0.0.1]", "a/b", "x\n", "p0..example"):
        with pytest.raises(params.ParamsError, match=re.escape(f"kv_transfer_params.remote_host = {host!r}, want a host")):
            params.validate_remote({**base, "remote_host": host}, pb.MODE_PUSH)
