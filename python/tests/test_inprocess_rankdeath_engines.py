"""Rank death in the in-process placement (each rank a process of its own,
inprocess_rank.py, the helpers of test_inprocess_rankdeath.py), beyond one
pair of engines and the built-in backend:

- two producer engines feed one consumer engine at once, a rank of the
  first SIGKILLed: the second's requests are untouched (done on every
  rank, every byte exact), as are the first's surviving rank's;
- the NIXL backend, a producer rank SIGKILLed with push transfers in
  flight: the consumer rank it fed fails each request once within the
  liveness bound (its writer's exit is proven through its pidfd on this
  host: ErrPeerExited), and nothing is held at bye.
"""

from __future__ import annotations

import time

from test_inprocess_rankdeath import (BOUND, blocks, check_bytes, libkvxfer, recv, send, settle,  # noqa: F401
                                      pair, running, start)
from test_inprocess_signals import _nixl_env

import harness


def test_second_producer_unaffected(libkvxfer, tmp_path):
    """P and Q (TP 2 each) both push to D (TP 2) at once; P's rank 1
    SIGKILLed before it writes. D's rank 1 fails P's requests once within
    the bound (peer_gone); every one of Q's requests ends done on Q's and
    D's ranks, its bytes exact; P's rank 0's requests, and D's rank 0's
    from P, end done."""
    secret = harness.secret_file(tmp_path)
    p_base, q_base, d_base = harness.free_ports(2), harness.free_ports(2), harness.free_ports(2)
    with running() as ranks:
        P = start(libkvxfer, "P", "P", 2, p_base, secret)
        Q = start(libkvxfer, "Q", "P", 2, q_base, secret)
        D = start(libkvxfer, "D", "D", 2, d_base, secret)
        ranks += P + Q + D
        a, q = list(range(4)), list(range(8, 12))
        for d in D:
            recv(d, p_base, a, "a")
            recv(d, q_base, q, "q", engine="Q")
        settle(D)
        P[1].kill()
        t_kill = time.monotonic()
        send(P[0], a, "a")
        for r in Q:
            send(r, q, "q")
        for d in D:
            d.wait_outcomes([f"d-a{i}" for i in a] + [f"d-q{i}" for i in q], 20)
        P[0].wait_outcomes([f"p-a{i}" for i in a], 20)
        for r in Q:
            r.wait_outcomes([f"p-q{i}" for i in q], 20)
        for i in q:
            for r in D + Q:
                rid = f"{'d' if r in D else 'p'}-q{i}"
                assert r.result(rid)["result"] == "RESULT_DONE", (r.name, r.result(rid))
        for i in a:
            r1 = D[1].result(f"d-a{i}")
            assert r1["result"] == "RESULT_FAILED" and r1["kind"] == "FAILURE_KIND_PEER_GONE", r1
            assert D[1].at(f"d-a{i}") - t_kill < BOUND, (i, D[1].at(f"d-a{i}") - t_kill, r1)
            assert D[0].result(f"d-a{i}")["result"] == "RESULT_DONE", D[0].result(f"d-a{i}")
            assert P[0].result(f"p-a{i}")["result"] == "RESULT_DONE", P[0].result(f"p-a{i}")
        for d in D:
            check_bytes(d, q)
        check_bytes(D[0], a)
        for r in D + Q + [P[0]]:
            r.bye()


def test_producer_rank_killed_nixl(libkvxfer, tmp_path):
    """NIXL: P (TP 2) and D (TP 2), D's requests registered with both of
    P's ranks, P's rank 1 SIGKILLed, P's rank 0 given the requests. D's
    rank 1 fails each once within the bound; D's rank 0 and P's rank 0 end
    done, every byte checked; nothing held at bye."""
    env = _nixl_env()
    harness.need_nixl(env is not None)
    secret = harness.secret_file(tmp_path)
    p_base, d_base = harness.free_ports(2), harness.free_ports(2)
    with running() as ranks:
        P = start(libkvxfer, "P", "P", 2, p_base, secret, env=env, server={"backend": "nixl"})
        D = start(libkvxfer, "D", "D", 2, d_base, secret, env=env, server={"backend": "nixl"})
        ranks += P + D
        first = list(range(4))
        for d in D:
            recv(d, p_base, first, "a")
        settle(D)
        P[1].kill()
        t_kill = time.monotonic()
        send(P[0], first, "a")
        for d in D:
            d.wait_outcomes([f"d-a{i}" for i in first], 20)
        P[0].wait_outcomes([f"p-a{i}" for i in first], 20)
        for i in first:
            r1 = D[1].result(f"d-a{i}")
            # peer_gone: its writer's exit proven (pidfd), or the rank
            # judged gone by liveness, whichever comes first.
            assert r1["result"] == "RESULT_FAILED" and r1["kind"] == "FAILURE_KIND_PEER_GONE", r1
            assert D[1].at(f"d-a{i}") - t_kill < BOUND, (i, D[1].at(f"d-a{i}") - t_kill, r1)
            assert D[0].result(f"d-a{i}")["result"] == "RESULT_DONE", D[0].result(f"d-a{i}")
            assert P[0].result(f"p-a{i}")["result"] == "RESULT_DONE", P[0].result(f"p-a{i}")
        check_bytes(D[0], first)
        for r in D + [P[0]]:
            r.bye()


def test_consumer_after_producer_rank_died(libkvxfer, tmp_path):
    """D (TP 2) starts after P's rank 1 was SIGKILLed: its first handshake
    with P fails (rank 1's port refuses), and each of D's ranks fails its
    requests once within the bound. P's rank 0, holding its blocks for D's
    rank 0, is told (the handshake's ranks that answered name its agent)
    and ends each request once within the bound too, not at its deadline:
    before, no handshake named P's rank 0, the cancel never left D, and P's
    rank 0 held its blocks until its lease or deadline."""
    secret = harness.secret_file(tmp_path)
    p_base, d_base = harness.free_ports(2), harness.free_ports(2)
    with running() as ranks:
        P = start(libkvxfer, "P", "P", 2, p_base, secret)
        ranks += P
        P[1].kill()
        first = list(range(4))
        send(P[0], first, "a")
        D = start(libkvxfer, "D", "D", 2, d_base, secret)
        ranks += D
        t0 = time.monotonic()
        for d in D:
            recv(d, p_base, first, "a")
        for d in D:
            d.wait_outcomes([f"d-a{i}" for i in first], 20)
        P[0].wait_outcomes([f"p-a{i}" for i in first], 20)
        for i in first:
            for d in D:
                r = d.result(f"d-a{i}")
                assert r["result"] == "RESULT_FAILED", (d.name, r)
                assert d.at(f"d-a{i}") - t0 < BOUND, (d.name, i, d.at(f"d-a{i}") - t0, r)
            r = P[0].result(f"p-a{i}")
            assert r["result"] == "RESULT_FAILED", r
            assert P[0].at(f"p-a{i}") - t0 < BOUND, (i, P[0].at(f"p-a{i}") - t0, r)
        for r in D + [P[0]]:
            r.bye()


def test_producer_after_consumer_rank_died(libkvxfer, tmp_path):
    """P (TP 2) starts after D's rank 1 was SIGKILLed: D's rank 0 registers
    with P's rank 0, whose first handshake with D fails (rank 1's port
    refuses). P's rank 0 still hears D's rank 0 (the ranks that answered
    name its agent) and fails each request once within the bound, telling
    D's rank 0, which fails it once too. Before, P's rank 0 refused the
    registrations (no handshake named D's rank 0's agent), and D's rank 0
    waited for a WRITE until its deadline."""
    secret = harness.secret_file(tmp_path)
    p_base, d_base = harness.free_ports(2), harness.free_ports(2)
    with running() as ranks:
        D = start(libkvxfer, "D", "D", 2, d_base, secret)
        ranks += D
        D[1].kill()
        P = start(libkvxfer, "P", "P", 2, p_base, secret)
        ranks += P
        first = list(range(4))
        t0 = time.monotonic()
        recv(D[0], p_base, first, "a")
        send(P[0], first, "a")
        D[0].wait_outcomes([f"d-a{i}" for i in first], 20)
        P[0].wait_outcomes([f"p-a{i}" for i in first], 20)
        for i in first:
            for r, rid in ((D[0], f"d-a{i}"), (P[0], f"p-a{i}")):
                assert r.at(rid) - t0 < BOUND, (r.name, rid, r.at(rid) - t0, r.result(rid))
                # Failed, naming the handshake that failed (the request as
                # a whole cannot complete: D's rank 1 is gone).
                got = r.result(rid)
                assert got["result"] == "RESULT_FAILED" and got["kind"] == "FAILURE_KIND_HANDSHAKE", (r.name, got)
        for r in D[:1] + P[:1]:
            r.bye()


def test_producer_rank_killed_survivor_late(libkvxfer, tmp_path):
    """P (TP 2) and D (TP 2): P's rank 1 SIGKILLed, and P's rank 0 given
    the requests only after D's ranks decided them (a long prefill). Each
    of D's ranks ends each request once within the bound; P's rank 0,
    told by D's rank 0, ends each once within the bound of its engine
    handing it the request, not at its deadline, and holds nothing."""
    with running() as ranks:
        P, D, p_base, d_base, secret = pair(libkvxfer, tmp_path, ranks)
        first = list(range(4))
        for d in D:
            recv(d, p_base, first, "a")
        settle(D)
        P[1].kill()
        t_kill = time.monotonic()
        for d in D:
            d.wait_outcomes([f"d-a{i}" for i in first], 20)
        for i in first:
            for d in D:
                r = d.result(f"d-a{i}")
                assert r["result"] == "RESULT_FAILED", (d.name, r)
                assert d.at(f"d-a{i}") - t_kill < BOUND, (d.name, i, d.at(f"d-a{i}") - t_kill, r)
        t_send = time.monotonic()
        send(P[0], first, "a")
        P[0].wait_outcomes([f"p-a{i}" for i in first], 20)
        for i in first:
            r = P[0].result(f"p-a{i}")
            assert r["result"] != "RESULT_DONE", r
            assert P[0].at(f"p-a{i}") - t_send < BOUND, (i, P[0].at(f"p-a{i}") - t_send, r)
        for r in D + [P[0]]:
            r.bye()


def test_engines_back_at_other_ports(libkvxfer, tmp_path):
    """In-process, P and D (TP 2 each) served a request; then every rank
    process of P is SIGKILLed and P comes back under its id at another
    rank port base (another host or port range), and likewise D. New
    requests name the engines at their new ports: each is done on every
    rank with its own bytes, at once. Before, each side knew the other by
    its id alone, kept its old address until a handshake there failed,
    and the first requests after the move failed (D's, naming P's new
    base) or got no outcome within 20 s (P's, for D back elsewhere)."""
    with running() as ranks:
        P, D, p_base, d_base, secret = pair(libkvxfer, tmp_path, ranks)

        def served(P, D, p_base, ids, tag):
            for d in D:
                recv(d, p_base, ids, tag)
            settle(D)
            for p in P:
                send(p, ids, tag)
            for r in P + D:
                r.wait_outcomes([f"{'p' if r in P else 'd'}-{tag}{i}" for i in ids], 20)
                for i in ids:
                    o = r.result(f"{'p' if r in P else 'd'}-{tag}{i}")
                    assert o["result"] == "RESULT_DONE", (r.name, tag, i, o)
            for d in D:
                check_bytes(d, ids)

        served(P, D, p_base, [0, 1], "a")
        p_base = harness.free_ports(2)  # while P's ranks hold theirs: another base
        for r in P:
            r.kill()
        P = start(libkvxfer, "P", "P", 2, p_base, secret)
        ranks += P
        served(P, D, p_base, [2, 3], "b")
        d_base = harness.free_ports(2)
        for r in D:
            r.kill()
        D = start(libkvxfer, "D", "D", 2, d_base, secret)
        ranks += D
        served(P, D, p_base, [4, 5], "c")
        for r in D + P:
            r.bye()
