"""One rank process of a TP 2 engine in the in-process placement (each
rank a process of its own, with its own libkvxfer server on its rank's
peer port) SIGKILLed while push transfers are in flight, over real
processes on loopback (inprocess_rank.py):

- a producer rank: the consumer requests that need it fail (peer_gone)
  within the liveness bound, each with exactly one outcome, their blocks
  let go; the surviving producer rank's requests, and the consumer ranks
  fed by it, end done (the request as a whole failed: the engine's
  connector fails a request any of whose ranks failed); once the dead
  rank's process is back (a new generation on the same port), new
  requests go through, every byte checked;
- a consumer rank: the producer rank feeding it fails its requests within
  the liveness bound and holds nothing afterwards; the other producer
  rank's requests end done.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

import harness

HERE = Path(__file__).resolve().parent
PY = sys.executable
RANK = str(HERE / "inprocess_rank.py")

# Liveness settings of every server here: a consumer probes a producer it
# waits on every PEER_TIMEOUT/5 and judges a rank silent for PEER_TIMEOUT
# gone; a producer's lease on a request's blocks lapses LEASE after its
# consumer's last heartbeat.
# gone; it fails a request whose heartbeats to a producer rank fail for
# LEASE/3, and waits up to 2 x LEASE (FenceTimeout) for a producer's
# confirmation of a cancel, unless the rank is judged gone.
PEER_TIMEOUT, LEASE = 1.0, 6.0
SERVER = {"peer_timeout": f"{PEER_TIMEOUT}s", "lease": f"{LEASE}s"}
# What a failure may take: the liveness bound (silent for PEER_TIMEOUT,
# probed every PEER_TIMEOUT/5, a probe answered within PEER_TIMEOUT/2),
# plus slack for a loaded 2-core machine; far below the fence timeout
# (12 s) and the requests' deadline (DEADLINE), which a stranded request
# would wait for.
BOUND = PEER_TIMEOUT * 1.7 + 3.0
DEADLINE = 60.0
SHORT = 0.9  # the deadline of requests that expire just after a rank's death (settle: 0.5 s)
TOKENS = 32  # two blocks of 16


@pytest.fixture(scope="module")
def libkvxfer(tmp_path_factory) -> Path:
    return harness.build_libkvxfer(tmp_path_factory.mktemp("lib"))


class Rank:
    """One rank process: its stdout lines, timestamped as they arrive."""

    def __init__(self, lib: Path, engine: str, role: str, tp_rank: int, tp_size: int, base: int, secret: str,
                 mode: str = "push", env: dict | None = None, server: dict | None = None):
        env = dict(os.environ if env is None else env)
        env["KVXFER_LIBKVXFER"] = str(lib)
        env["PYTHONPATH"] = os.pathsep.join([str(harness.REPO / "python"), env.get("PYTHONPATH", "")])
        cfg = {"engine": engine, "role": role, "tp_rank": tp_rank, "tp_size": tp_size, "base": base, "secret": secret,
               "mode": mode, "server": {**SERVER, **(server or {})}}
        self.name = f"{engine}{tp_rank}"
        self.p = subprocess.Popen([PY, RANK, json.dumps(cfg)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.outcomes: dict[str, list[tuple[float, dict]]] = {}
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.p.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            kind, _, rest = line.strip().partition(" ")
            self.lines.put((time.monotonic(), kind, json.loads(rest) if rest else None))
        self.lines.put((time.monotonic(), "eof", None))

    def cmd(self, **c) -> None:
        self.p.stdin.write(json.dumps(c) + "\n")
        self.p.stdin.flush()

    def take(self, kind: str, timeout: float = 30.0):
        """Waits for the next line of kind (outcomes on the way noted)."""
        end = time.monotonic() + timeout
        while True:
            try:
                t, k, v = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no {kind} line within {timeout}s; stderr:\n{''.join(self.err)}")
            if k == "outcome":
                self.outcomes.setdefault(v["id"], []).append((t, v))
            if k == "error":
                raise AssertionError(f"{self.name}: step error {v}")
            if k == kind:
                return t, v
            if k == "eof":
                raise AssertionError(f"{self.name}: exited ({self.p.wait()}) waiting for {kind}; stderr:\n{''.join(self.err)}")

    def wait_outcomes(self, ids: list[str], timeout: float) -> None:
        end = time.monotonic() + timeout
        while not all(i in self.outcomes for i in ids):
            try:
                self.take("outcome", max(0.0, end - time.monotonic()))
            except AssertionError as e:
                missing = [i for i in ids if i not in self.outcomes]
                raise AssertionError(f"{self.name}: no outcome for {missing} within {timeout}s") from e

    def result(self, rid: str) -> dict:
        got = self.outcomes[rid]
        assert len(got) == 1, f"{self.name}: {len(got)} outcomes for {rid}: {got}"
        return got[0][1]

    def at(self, rid: str) -> float:
        return self.outcomes[rid][0][0]

    def bye(self) -> None:
        """Ends the rank's stream: nothing more comes out (every request it
        had already ended: the rank holds none), and the process exits."""
        self.cmd(op="bye")
        _, v = self.take("bye", 30)
        assert v["outcomes"] == [], f"{self.name}: outcomes at bye (requests still held): {v['outcomes']}"
        extra = {i: o for i, o in self.outcomes.items() if len(o) != 1}
        assert not extra, f"{self.name}: requests with more than one outcome: {extra}"
        assert self.p.wait(timeout=30) == 0, "".join(self.err)

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=10)


@contextlib.contextmanager
def running() -> Iterator[list[Rank]]:
    """The list a test puts the ranks it starts in: each one still running
    is killed when the test ends, however it ends."""
    ranks: list[Rank] = []
    try:
        yield ranks
    finally:
        for r in ranks:
            r.stop()


def start(lib: Path, engine: str, role: str, tp: int, base: int, secret: str, ranks=None, mode: str = "push",
          env: dict | None = None, server: dict | None = None) -> list[Rank]:
    rs = [Rank(lib, engine, role, r, tp, base, secret, mode, env, server) for r in (ranks if ranks is not None else range(tp))]
    for r in rs:
        r.take("ready", 60)
    return rs


def pair(lib: Path, tmp_path: Path, ranks: list[Rank], mode: str = "push") -> tuple[list[Rank], list[Rank], int, int, str]:
    """Starts P and D, TP 2 each, in mode, on ports of their own, both put
    in ranks (running); returns them, P's and D's rank port bases, and
    their peer secret file."""
    secret = harness.secret_file(tmp_path)
    p_base, d_base = harness.free_ports(2), harness.free_ports(2)
    P = start(lib, "P", "P", 2, p_base, secret, mode=mode)
    D = start(lib, "D", "D", 2, d_base, secret, mode=mode)
    ranks += P + D
    return P, D, p_base, d_base, secret


def blocks(i: int) -> tuple[list[int], list[int]]:
    """Request i's producer and consumer blocks (two each)."""
    return [2 * i, 2 * i + 1], [63 - 2 * i, 62 - 2 * i]


def recv(d: Rank, p_base: int, ids: list[int], tag: str, deadline: float = DEADLINE, pull: bool = False,
         engine: str = "P", p_tp: int = 2) -> None:
    d.cmd(op="recv", reqs=[{"id": f"d-{tag}{i}", "tid": f"t-{tag}{i}", "blocks": blocks(i)[1], "engine": engine,
                            "addr": f"127.0.0.1:{p_base}", "preq": f"p-{tag}{i}", "tp_size": p_tp, "tokens": TOKENS,
                            "deadline_s": deadline, **({"remote_blocks": blocks(i)[0]} if pull else {})} for i in ids])


def send(p: Rank, ids: list[int], tag: str, deadline: float = DEADLINE) -> None:
    """deadline: the producer request's lease as its engine gives it."""
    p.cmd(op="send", reqs=[{"id": f"p-{tag}{i}", "tid": f"t-{tag}{i}", "blocks": blocks(i)[0], "tokens": TOKENS,
                            "deadline_s": deadline} for i in ids])


def check_bytes(d: Rank, ids: list[int]) -> None:
    d.cmd(op="check", pairs=[[dd, pp] for i in ids for pp, dd in zip(*blocks(i))])
    _, v = d.take("check", 30)
    assert v["wrong_bytes"] == 0, (d.name, v)


def settle(rs: list[Rank]) -> None:
    """Lets registrations reach their producer ranks (loopback: well
    within this)."""
    time.sleep(0.5)


def test_producer_rank_killed(libkvxfer, tmp_path):
    """P (TP 2) and D (TP 2): D's requests registered with both of P's
    ranks, P's rank 1 SIGKILLed before it writes. D's rank 1 (fed by P's
    rank 1) fails each request once, peer_gone naming the rank, within the
    liveness bound, and holds nothing; P's rank 0 carries on and its
    requests, and D's rank 0's, end done (the request as a whole failed:
    one of its ranks did). Requests whose deadline passes just after the
    death (P's engine never scheduled them) expire on both of D's ranks,
    rank 1's within the liveness bound too: before, it waited for the dead
    rank's confirmation of its cancel until its fence timed out (2 x
    lease). New requests after the death fail on D's rank 1 (its
    handshake fails: the rank's port refuses) and leave the requests
    already waiting judged by liveness: before, the failed handshake
    stopped the probes, and they waited for their deadline. P's rank 1
    restarted on its port (a new generation): new
    requests go through on both ranks, every byte checked."""
    with running() as ranks:
        P, D, p_base, d_base, secret = pair(libkvxfer, tmp_path, ranks)
        first, short = list(range(4)), list(range(4, 8))
        for d in D:
            recv(d, p_base, first, "a")
            recv(d, p_base, short, "s", deadline=SHORT)
        settle(D)
        P[1].kill()
        t_kill = time.monotonic()
        send(P[0], first, "a")
        # New requests after the death: D's rank 1 finds P's rank 1 gone as
        # it registers, and its handshake again fails (the rank's port
        # refuses); D's rank 0 registers with P's rank 0 and is served.
        late = list(range(12, 16))
        for d in D:
            recv(d, p_base, late, "n")
        send(P[0], late, "n")
        ids = [f"d-a{i}" for i in first]
        for d in D:
            d.wait_outcomes(ids + [f"d-s{i}" for i in short] + [f"d-n{i}" for i in late], 20)
        P[0].wait_outcomes([f"p-a{i}" for i in first] + [f"p-n{i}" for i in late], 20)
        for i in late:
            r1 = D[1].result(f"d-n{i}")
            assert r1["result"] == "RESULT_FAILED", r1
            assert r1["kind"] in ("FAILURE_KIND_HANDSHAKE", "FAILURE_KIND_PEER_GONE", "FAILURE_KIND_REGISTRATION"), r1
            assert D[1].at(f"d-n{i}") - t_kill < BOUND, (i, D[1].at(f"d-n{i}") - t_kill, r1)
            assert D[0].result(f"d-n{i}")["result"] == "RESULT_DONE", D[0].result(f"d-n{i}")
            assert P[0].result(f"p-n{i}")["result"] == "RESULT_DONE", P[0].result(f"p-n{i}")
        for i in ids:
            r1 = D[1].result(i)
            assert r1["result"] == "RESULT_FAILED" and r1["kind"] == "FAILURE_KIND_PEER_GONE", r1
            assert "rank tp 1 pp 0" in r1["reason"], r1
            assert D[1].at(i) - t_kill < BOUND, (i, D[1].at(i) - t_kill, r1)
            assert D[0].result(i)["result"] == "RESULT_DONE", D[0].result(i)
        for i in short:
            for d in D:
                # Expired, or on D's rank 1, failed first if the rank
                # is judged gone before the deadline passes (a loaded
                # machine).
                r = d.result(f"d-s{i}")
                assert r["result"] == "RESULT_EXPIRED" or d is D[1] and r["kind"] == "FAILURE_KIND_PEER_GONE", (d.name, r)
                assert d.at(f"d-s{i}") - t_kill < BOUND, (d.name, i, d.at(f"d-s{i}") - t_kill, r)
        for i in first:
            assert P[0].result(f"p-a{i}")["result"] == "RESULT_DONE", P[0].result(f"p-a{i}")
        check_bytes(D[0], first)

        # P's rank 1 is back (a new process on its port): new requests go
        # through on both ranks, every byte checked.
        P[1] = start(libkvxfer, "P", "P", 2, p_base, secret, ranks=[1])[0]
        ranks.append(P[1])
        second = list(range(8, 12))
        for d in D:
            recv(d, p_base, second, "b")
        for p in P:
            send(p, second, "b")
        for d in D:
            d.wait_outcomes([f"d-b{i}" for i in second], 30)
        for p in P:
            p.wait_outcomes([f"p-b{i}" for i in second], 30)
        for rank in P + D:
            for i in second:
                rid = f"{'p' if rank in P else 'd'}-b{i}"
                assert rank.result(rid)["result"] == "RESULT_DONE", (rank.name, rank.result(rid))
        for d in D:
            check_bytes(d, second)
        for rank in D + P:
            rank.bye()


def test_consumer_rank_killed(libkvxfer, tmp_path):
    """P (TP 2) and D (TP 2): D's requests registered with both of P's
    ranks, D's rank 1 SIGKILLed, then P's ranks given the requests. P's
    rank 1 (feeding the dead rank) fails each request once within the
    bound (its WRITE to the dead rank is refused: transfer_failed) and
    holds nothing; P's rank 0 and D's rank 0 end done. (A producer request
    whose consumer rank died before its registration arrived names no
    consumer to watch: it ends at its deadline, as any request nobody
    asks for.)"""
    with running() as ranks:
        P, D, p_base, d_base, secret = pair(libkvxfer, tmp_path, ranks)
        first = list(range(4))
        for d in D:
            recv(d, p_base, first, "a")
        settle(D)
        D[1].kill()
        t_kill = time.monotonic()
        for p in P:
            send(p, first, "a")
        for p in P:
            p.wait_outcomes([f"p-a{i}" for i in first], BOUND + 5)
        D[0].wait_outcomes([f"d-a{i}" for i in first], BOUND + 5)
        for i in first:
            r1 = P[1].result(f"p-a{i}")
            assert r1["result"] == "RESULT_FAILED", r1
            assert P[1].at(f"p-a{i}") - t_kill < BOUND, (i, P[1].at(f"p-a{i}") - t_kill)
            assert P[0].result(f"p-a{i}")["result"] == "RESULT_DONE", P[0].result(f"p-a{i}")
            assert D[0].result(f"d-a{i}")["result"] == "RESULT_DONE", D[0].result(f"d-a{i}")
        check_bytes(D[0], first)
        for rank in [D[0]] + P:
            rank.bye()


def test_producer_rank_killed_pull(libkvxfer, tmp_path):
    """Pull: D's ranks read from P's before P's engine holds the blocks (the
    READs refused, tried again), P's rank 1 SIGKILLed, then P's rank 0
    given the requests. D's rank 1 fails each request once within the
    liveness bound and holds nothing; D's rank 0 reads P's rank 0's bytes
    and ends done, as P's rank 0 does."""
    with running() as ranks:
        P, D, p_base, d_base, secret = pair(libkvxfer, tmp_path, ranks, mode="pull")
        first = list(range(4))
        for d in D:
            recv(d, p_base, first, "a", pull=True)
        settle(D)
        P[1].kill()
        t_kill = time.monotonic()
        send(P[0], first, "a")
        ids = [f"d-a{i}" for i in first]
        for d in D:
            d.wait_outcomes(ids, 20)
        P[0].wait_outcomes([f"p-a{i}" for i in first], 20)
        for i in ids:
            r1 = D[1].result(i)
            assert r1["result"] == "RESULT_FAILED", r1
            assert D[1].at(i) - t_kill < BOUND, (i, D[1].at(i) - t_kill, r1)
            assert D[0].result(i)["result"] == "RESULT_DONE", D[0].result(i)
        for i in first:
            assert P[0].result(f"p-a{i}")["result"] == "RESULT_DONE", P[0].result(f"p-a{i}")
        check_bytes(D[0], first)
        for rank in D + [P[0]]:
            rank.bye()
