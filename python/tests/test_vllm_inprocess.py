"""KvxferConnector in placement in-process across processes: an engine in a
process of its own (vllm_engine_proc.py: vLLM's Scheduler and a worker
connector, libkvxfer started by the connector at the engine's base peer
port) and an engine in this test's process. No kvxferd and no shared-memory
file anywhere: both KV caches are plain host tensors."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import harness as H

import vllm  # noqa: E402,F401  (a missing vLLM fails the run: CI installs it)

HERE = Path(__file__).resolve().parent
# D's server gives up on a producer engine silent this long (libkvxfer's
# peer-timeout): the liveness bound a killed P's consumers must end within.
PEER_TIMEOUT_S = 2.0


class EngineProc:
    """vllm_engine_proc.py as a child: its lines, read as they come."""

    def __init__(self, work: Path, name: str, role: str, mode: str, base: int, step_s: float):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(H.REPO / "python"), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, str(HERE / "vllm_engine_proc.py"), str(work), name, role, mode,
                                      str(base), str(step_s)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(work / f"{name}.log", "w"), text=True)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.log = work / f"{name}.log"

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if line.startswith(prefix):
                    return line
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout} s; lines {self.seen}; log:\n{self.log.read_text()}")
            if line is None:
                raise AssertionError(f"the engine process exited ({self.proc.wait()}) before {prefix!r}; lines {self.seen}; "
                                     f"log:\n{self.log.read_text()}")
            self.seen.append(line)

    def drain(self) -> None:
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line is not None:
                self.seen.append(line)

    def send(self, rid: str, tokens: list[int], params: dict, max_tokens: int = 1) -> None:
        self.proc.stdin.write(json.dumps({"rid": rid, "tokens": tokens, "params": params, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _push(base: int, tid: str) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid, "remote_engine_id": "p0",
            "remote_host": "127.0.0.1", "remote_port": base, "tp_size": 1, "mode": "push"}


def _step_until(e: H.Engine, prompts: dict, done, limit_s: float) -> float:
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < limit_s, f"not done within {limit_s} s: D recvd {e.recvd}, failed {e.failed}, " \
            f"finished {sorted(e.finished)}"
        H.step(e, prompts, fill=False)
        time.sleep(0.01)
    return time.monotonic() - t0


def test_p_killed_mid_transfer_d_ends_within_peer_timeout(tmp_path, libkvxfer):
    """P and D, each a vLLM engine in a process of its own with kvxfer
    in-process (P at a base peer port; D in this process). First a push
    between them lands every byte in D's cache (checked). Then P, its
    second request mid-prefill (chunked, one chunk a step) and D's blocks
    registered with it for the WRITE, is SIGKILLed: D's request ends
    (failed, so vLLM recomputes it) within D's server's peer timeout, well
    before D's registration watchdog (60 s) could end it, and every block
    of D's goes back to its pool."""
    base = H.free_port()
    p = EngineProc(tmp_path, "p0", "P", "push", base, step_s=0.25)
    d = None
    try:
        addr = p.wait_for("ready ").split()[1]
        assert addr == f"127.0.0.1:{base}", addr  # transfer params name P by its base
        srv = H.InProcess(tmp_path, "d", server={"peer_timeout": f"{PEER_TIMEOUT_S}s"})
        d = H.make_engine(tmp_path, "d0", "D", srv, "push", 1, registration_timeout_s=60)
        prompts = {}
        # A whole transfer across the two processes: every byte checked.
        toks = list(range(2000, 2000 + 3 * H.BLOCK + 5))
        prompts["d-1"] = toks
        p.send("p-1", toks, {"do_remote_decode": True, "transfer_id": "t1"})
        d.sched.add_request(H.make_request("d-1", toks, 2, _push(base, "t1")))
        _step_until(d, prompts, lambda: "d-1" in d.recvd, 60)
        assert "d-1" not in d.failed
        assert H.check_kv(d, "d-1", toks, len(toks)) > 0
        _step_until(d, prompts, lambda: "d-1" in d.finished, 30)
        p.wait_for("sent p-1", 30)
        # The second: P's prefill takes 10 steps of 0.25 s; D registers its
        # blocks with P at once.
        toks = list(range(5000, 5000 + 10 * H.BLOCK))
        prompts["d-2"] = toks
        p.send("p-2", toks, {"do_remote_decode": True, "transfer_id": "t2"})
        d.sched.add_request(H.make_request("d-2", toks, 2, _push(base, "t2")))
        until = time.monotonic() + 1.0
        _step_until(d, prompts, lambda: time.monotonic() >= until, 10)
        p.drain()
        assert not any(x.endswith("p-2") for x in p.seen), p.seen  # mid-transfer: P not done
        assert "d-2" not in d.recvd
        p.proc.send_signal(signal.SIGKILL)
        p.proc.wait(10)
        took = _step_until(d, prompts, lambda: "d-2" in d.recvd, 30)
        assert "d-2" in d.failed, (d.recvd, d.failed)
        # peer-timeout, plus a step's and a probe's slack.
        assert took < PEER_TIMEOUT_S + 3, took
        # vLLM recomputes it (policy recompute) and finishes it; nothing of
        # D's is held any more.
        _step_until(d, prompts, lambda: "d-2" in d.finished and not d.sched.requests, 30)
        assert d.sched.kv_cache_manager.block_pool.get_num_free_blocks() == d.initial_free
    finally:
        p.close()
        if d is not None:
            H.shutdown(d)
    from kvxfer import placement
    assert placement.acquire().users == 0  # the engine's shutdown let this process's server go


def test_metrics_and_data_ports_checked(tmp_path, libkvxfer):
    """server.metrics_listen and server.data_port_base are bases, as
    peer_port is (each rank's process serves its own /metrics and KV
    listener): one whose ranks' ports would pass 65535, or whose range
    overlaps another's on a host they share, is refused at once, naming
    the keys and their values, before any server starts."""
    import pytest
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer import placement
    from kvxfer.vllm import KvxferConnector
    srv = H.InProcess(tmp_path, "m", peer_port=20000, server={"metrics_listen": "127.0.0.1:65535"})
    cfg = H.vllm_config(tmp_path, "m0", srv, "push", 2)
    with pytest.raises(ValueError, match=r"server.metrics_listen = '127.0.0.1:65535'.*65536"):
        KvxferConnector(cfg, KVConnectorRole.SCHEDULER, H.kv_cache_config(cfg, 2, 96))
    # Ranges of the deployment's ranks that overlap on a host they share:
    # refused naming both keys (rank 1's server, or its KV listener, could
    # not listen).
    for i, (server, want) in enumerate([
            ({"data_port_base": 20001}, r"server.data_port_base = 20001 and peer_port = 20000"),
            ({"metrics_listen": "0.0.0.0:19999"}, r"server.metrics_listen = '0.0.0.0:19999' and peer_port = 20000"),
            ({"metrics_listen": "127.0.0.1:21000", "data_port_base": 21001},
             r"server.data_port_base = 21001 and server.metrics_listen = '127.0.0.1:21000'")]):
        srv = H.InProcess(tmp_path, f"o{i}", peer_port=20000, server=server)
        cfg = H.vllm_config(tmp_path, f"o{i}", srv, "push", 2)
        with pytest.raises(ValueError, match=want):
            KvxferConnector(cfg, KVConnectorRole.SCHEDULER, H.kv_cache_config(cfg, 2, 96))
    # Apart, or on other hosts: accepted.
    srv = H.InProcess(tmp_path, "a", peer_port=H.free_ports(2), server={"metrics_listen": "10.9.9.9:20001", "data_port_base": 30000})
    cfg = H.vllm_config(tmp_path, "a0", srv, "push", 2)
    cfg.kv_transfer_config.kv_connector_extra_config["server"]["metrics_listen"] = \
        f"10.9.9.9:{cfg.kv_transfer_config.kv_connector_extra_config['peer_port'] + 1}"
    KvxferConnector(cfg, KVConnectorRole.SCHEDULER, H.kv_cache_config(cfg, 2, 96)).shutdown()
    assert placement.acquire().users == 0


def test_base_port_zero_with_ranks_elsewhere_refused(tmp_path, libkvxfer):
    """peer_port 0 (the system picks each server's port) works only where
    the engine's ranks run in its scheduler's process. An engine whose
    ranks run in processes of their own (vLLM's multiprocess executor: its
    scheduler side starts first with no rank's server in its process) is
    refused at once, naming the key: its transfer params would name a
    server where no rank ever attaches, and every transfer would fail."""
    import pytest
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer import placement
    from kvxfer.vllm import KvxferConnector
    srv = H.InProcess(tmp_path, "z", peer_port=0)
    cfg = H.vllm_config(tmp_path, "z0", srv, "push", 2)
    cfg.parallel_config.distributed_executor_backend = "mp"  # as vLLM's CPU platform sets it (the harness runs ranks here)
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.peer_port = 0: .*2 worker rank"):
        KvxferConnector(cfg, KVConnectorRole.SCHEDULER, H.kv_cache_config(cfg, 2, 96))
    assert placement.acquire().users == 0
    # An external launcher runs one rank and a scheduler per process:
    # with a rank's server running here, still refused.
    cfg.parallel_config.distributed_executor_backend = "external_launcher"
    placement.acquire().acquire_rank({"insecure-peers": True, "log-level": "error", "backend": "builtin"}, "127.0.0.1", 0, 0)
    try:
        with pytest.raises(ValueError, match=r"kv_connector_extra_config.peer_port = 0: .*'external_launcher'"):
            KvxferConnector(cfg, KVConnectorRole.SCHEDULER, H.kv_cache_config(cfg, 2, 96))
    finally:
        placement.release()
    # Its ranks in this process first (as the test harness runs them):
    # the scheduler side shares their server.
    e = H.make_engine(tmp_path, "z1", "P", srv, "push", 2)
    try:
        assert e.sched.connector._sched.addr
    finally:
        H.shutdown(e)


def test_server_keys_checked_as_the_connector_is_built(tmp_path, libkvxfer):
    """Every key of kv_connector_extra_config.server, and its value, is
    checked as the connector is constructed, on either side (the scheduler
    and a worker rank refuse it the same way, naming the key and the
    value): a worker rank starts its server only at its KV registration,
    after vLLM loaded the model, where an unknown key, a value of the wrong
    type or one out of range was found only then, and the scheduler side
    said it only as a failed start (RuntimeError). Nothing starts, and
    nothing is held."""
    import pytest
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer import placement
    from kvxfer.vllm import KvxferConnector
    cases = [
        ({"no_such_key": 1}, r"kv_connector_extra_config.server.no_such_key = 1: .*unknown"),
        ({"drain_timeout": 5}, r"kv_connector_extra_config.server.drain_timeout = 5: .*\"drain-timeout\" = 5"),
        ({"conns": "many"}, r"kv_connector_extra_config.server.conns = 'many': "),
        ({"conns": 0}, r"kv_connector_extra_config.server.conns = 0: .*want > 0"),
        ({"log_level": "loud"}, r"kv_connector_extra_config.server.log_level = 'loud': "),
        ({"peer_timeout": "1ms"}, r"kv_connector_extra_config.server.peer_timeout = '1ms': .*want at least"),
        ({"no-same-host": "maybe"}, r"kv_connector_extra_config.server.no-same-host = 'maybe': "),
        ({"hop_trace": "/nonexistent/kvxfer/trace"}, r"kv_connector_extra_config.server.hop_trace = '/nonexistent/kvxfer/trace': "),
        ({"shm_dir": "/nonexistent/kvxfer"}, r"kv_connector_extra_config.server.shm_dir = '/nonexistent/kvxfer': "),
        ({"data_host": "10.0.0.1:7600"}, r"kv_connector_extra_config.server.data_host = '10.0.0.1:7600': .*-data-host"),
    ]
    for i, (server, want) in enumerate(cases):
        srv = H.InProcess(tmp_path, f"k{i}", peer_port=H.free_ports(2), server=server)
        cfg = H.vllm_config(tmp_path, f"k{i}", srv, "push", 2)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match=want):
                KvxferConnector(cfg, role, H.kv_cache_config(cfg, 2, 96))
            assert placement.acquire().users == 0, (server, role)
        from kvxfer import inprocess
        assert inprocess.endpoint() is None, server


def test_peer_security_files_checked_as_the_connector_is_built(tmp_path, libkvxfer):
    """The files that secure peers (peer_secret_file; tls_cert, tls_key,
    tls_ca) are read and checked as the connector is built, on either side
    alike, as libkvxfer reads them at its start: a secret other users may
    read, or too short, and a key pair that does not load, were found only
    as a worker rank's server started, after vLLM loaded the model. The
    error names the key and the file."""
    import pytest
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer import placement
    from kvxfer.vllm import KvxferConnector

    def secret(name, text, mode):
        p = tmp_path / name
        p.write_text(text)
        p.chmod(mode)
        return str(p)

    pem = secret("junk.pem", "not a certificate\n", 0o600)
    cases = [
        ({"peer_secret_file": secret("open.secret", "0123456789abcdef0123456789abcdef\n", 0o644)},
         r"kv_connector_extra_config.peer_secret_file = '.*open.secret': .*lets other users read it"),
        ({"peer_secret_file": secret("short.secret", "tiny\n", 0o600)},
         r"kv_connector_extra_config.peer_secret_file = '.*short.secret': .*want at least"),
        ({"tls_cert": pem, "tls_key": pem, "tls_ca": pem}, r"kv_connector_extra_config.tls_cert, tls_key, tls_ca = .*junk.pem"),
    ]
    for i, (keys, want) in enumerate(cases):
        srv = H.InProcess(tmp_path, f"s{i}", peer_port=H.free_ports(2))
        cfg = H.vllm_config(tmp_path, f"s{i}", srv, "push", 2)
        extra = cfg.kv_transfer_config.kv_connector_extra_config
        del extra["peer_secret_file"]
        extra.update(keys)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match=want):
                KvxferConnector(cfg, role, H.kv_cache_config(cfg, 2, 96))
            assert placement.acquire().users == 0, (keys, role)


def test_rank_port_in_use_is_named(tmp_path, libkvxfer):
    """A worker rank whose peer port (peer_port + its index) another
    process holds cannot start its server: the error names the rank, its
    port and how it is made (kv_connector_extra_config.peer_port plus the
    rank's index), not only the listener's bind error; nothing is held."""
    import socket

    import pytest
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    from kvxfer import inprocess, placement
    from kvxfer.vllm import KvxferConnector
    base = H.free_ports(2)
    taken = socket.socket()
    taken.bind(("127.0.0.1", base + 1))
    taken.listen()
    try:
        srv = H.InProcess(tmp_path, "u", peer_port=base)
        cfg = H.vllm_config(tmp_path, "u0", srv, "push", 2)
        kvc = H.kv_cache_config(cfg, 2, 96)
        cfg.parallel_config.rank = 1
        conn = KvxferConnector(cfg, KVConnectorRole.WORKER, kvc)
        conn._worker.tp_rank = 1
        raw = torch.zeros(kvc.kv_cache_tensors[0].size, dtype=torch.int8)
        kv = {}
        for t in kvc.kv_cache_tensors:
            kv.update(zip(t.layers, create_kv_cache_views(raw, kvc.kv_cache_groups[0].kv_cache_spec, kvc.num_blocks,
                                                          cfg.cache_config.get_resolved_kv_cache_layout(), t)))
        with pytest.raises(RuntimeError, match=rf"rank tp=1 pp=0 .*port {base + 1} = kv_connector_extra_config.peer_port "
                                               rf"{base} \+ 1"):
            conn.register_kv_caches(kv)
        conn.shutdown()
        assert placement.acquire().users == 0 and inprocess.endpoint() is None
    finally:
        taken.close()
        cfg.parallel_config.rank = 0
