"""Rank death in the in-process placement (each rank a process of its own,
inprocess_rank.py, the helpers of test_inprocess_rankdeath.py) where the
two engines' TP differ, and a consumer rank's death in pull mode:

- P at TP 2, D at TP 1 (D's one rank takes both P ranks' heads), P's rank
  1 SIGKILLed: D's request fails once within the liveness bound, and the
  surviving P rank ends its side of it once (its WRITE confirmed, or the
  request let go), holding nothing;
- P at TP 1, D at TP 2 (P's one rank feeds both D ranks), D's rank 1
  SIGKILLed: P's request ends once within the bound, D's rank 0's once;
- pull, D's rank 1 SIGKILLed: P's rank 1 lets the blocks it holds for the
  dead rank go (the lease lapses) and ends once; P's rank 0 and D's rank 0
  read and end done, every byte checked.
"""

from __future__ import annotations

import time

from test_inprocess_rankdeath import (BOUND, DEADLINE, LEASE, TOKENS, blocks, check_bytes, libkvxfer, recv, send,  # noqa: F401
                                      pair, running, settle, start)

import harness


def test_hetero_producer_rank_killed(libkvxfer, tmp_path):
    """P (TP 2) and D (TP 1): D's requests registered with both of P's
    ranks, P's rank 1 SIGKILLed, P's rank 0 given half the requests at
    once and the other half after D failed them. D fails each once,
    peer_gone naming the rank, within the bound; P's rank 0 ends each of
    its requests once, within the bound too (not at its deadline), and
    holds nothing at bye."""
    secret = harness.secret_file(tmp_path)
    p_base, d_base = harness.free_ports(2), harness.free_ports(1)
    with running() as ranks:
        P = start(libkvxfer, "P", "P", 2, p_base, secret)
        D = start(libkvxfer, "D", "D", 1, d_base, secret)
        ranks += P + D
        now, after = list(range(4)), list(range(4, 8))
        recv(D[0], p_base, now + after, "a")
        settle(D)
        P[1].kill()
        t_kill = time.monotonic()
        send(P[0], now, "a")
        D[0].wait_outcomes([f"d-a{i}" for i in now + after], 20)
        for i in now + after:
            r = D[0].result(f"d-a{i}")
            assert r["result"] == "RESULT_FAILED" and r["kind"] == "FAILURE_KIND_PEER_GONE", r
            assert "rank tp 1 pp 0" in r["reason"], r
            assert D[0].at(f"d-a{i}") - t_kill < BOUND, (i, D[0].at(f"d-a{i}") - t_kill, r)
        t_after = time.monotonic()
        send(P[0], after, "a")
        P[0].wait_outcomes([f"p-a{i}" for i in now + after], 20)
        for i in now:
            assert P[0].at(f"p-a{i}") - t_kill < BOUND, (i, P[0].at(f"p-a{i}") - t_kill, P[0].result(f"p-a{i}"))
        for i in after:
            r = P[0].result(f"p-a{i}")
            assert r["result"] != "RESULT_DONE", r
            assert P[0].at(f"p-a{i}") - t_after < BOUND, (i, P[0].at(f"p-a{i}") - t_after, r)
        for rank in D + [P[0]]:
            rank.bye()


def test_hetero_consumer_rank_killed(libkvxfer, tmp_path):
    """P (TP 1) and D (TP 2): D's ranks registered with P's one rank, D's
    rank 1 SIGKILLed, then P given the requests. P fails each once within
    the bound (its WRITE to the dead rank refused) and holds nothing; D's
    rank 0 ends each once (its part written, or the request let go)."""
    secret = harness.secret_file(tmp_path)
    p_base, d_base = harness.free_ports(1), harness.free_ports(2)
    with running() as ranks:
        P = start(libkvxfer, "P", "P", 1, p_base, secret)
        D = start(libkvxfer, "D", "D", 2, d_base, secret)
        ranks += P + D
        first = list(range(4))
        for d in D:
            recv(d, p_base, first, "a", p_tp=1)
        settle(D)
        D[1].kill()
        t_kill = time.monotonic()
        send(P[0], first, "a")
        P[0].wait_outcomes([f"p-a{i}" for i in first], BOUND + 5)
        D[0].wait_outcomes([f"d-a{i}" for i in first], BOUND + 5)
        for i in first:
            r = P[0].result(f"p-a{i}")
            assert r["result"] == "RESULT_FAILED", r
            assert P[0].at(f"p-a{i}") - t_kill < BOUND, (i, P[0].at(f"p-a{i}") - t_kill, r)
            D[0].result(f"d-a{i}")
            assert D[0].at(f"d-a{i}") - t_kill < BOUND, (i, D[0].at(f"d-a{i}") - t_kill, D[0].result(f"d-a{i}"))
        for rank in D[:1] + P:
            rank.bye()


def test_consumer_rank_killed_pull(libkvxfer, tmp_path):
    """Pull, P (TP 2) and D (TP 2): D's ranks read before P's engine holds
    the blocks (the READs refused, tried again), D's rank 1 SIGKILLed, then
    P's ranks given the requests under a lease of LEASE (as an engine
    gives it). P's rank 1 lets go the blocks it holds for the dead rank
    once the lease lapses (a heartbeat of D's rank 0, which names the
    request to every P rank, extends it by 2/3 of a lease at most) and
    ends each request once, holding nothing. P's rank 0 and D's rank 0 end
    done, every byte checked: before, P's rank 0 refused D's rank 0's
    completion notices (the handshake with D failed, D's rank 1's port
    refusing, so nothing said who speaks for rank 0) and held the blocks
    until the lease lapsed, reporting them expired."""
    with running() as ranks:
        P, D, p_base, d_base, secret = pair(libkvxfer, tmp_path, ranks, mode="pull")
        first = list(range(4))
        for d in D:
            recv(d, p_base, first, "a", pull=True)
        settle(D)
        D[1].kill()
        t_kill = time.monotonic()
        for p in P:
            send(p, first, "a", deadline=LEASE)  # the lease, as a vLLM engine gives it (kv_lease_duration)
        D[0].wait_outcomes([f"d-a{i}" for i in first], 20)
        for p in P:
            p.wait_outcomes([f"p-a{i}" for i in first], LEASE + BOUND + 5)
        for i in first:
            assert D[0].result(f"d-a{i}")["result"] == "RESULT_DONE", D[0].result(f"d-a{i}")
            assert P[0].result(f"p-a{i}")["result"] == "RESULT_DONE", P[0].result(f"p-a{i}")
            r = P[1].result(f"p-a{i}")
            assert r["result"] != "RESULT_DONE", r
            assert P[1].at(f"p-a{i}") - t_kill < LEASE + BOUND, (i, P[1].at(f"p-a{i}") - t_kill, r)
        check_bytes(D[0], first)
        for rank in D[:1] + P:
            rank.bye()


def test_hetero_producer_rank_killed_pull(libkvxfer, tmp_path):
    """Pull, P (TP 2) and D (TP 1): D's one rank reads from both of P's
    ranks before P's engine holds the blocks (the READs refused, tried
    again), P's rank 1 SIGKILLed, then P's rank 0 given the requests under
    a long lease (the test's deadline: a request stranded on it would wait
    for it). D fails each request once within the bound; P's rank 0 ends
    each once within the bound too (D's failure notice lets its blocks
    go), holding nothing at bye."""
    secret = harness.secret_file(tmp_path)
    p_base, d_base = harness.free_ports(2), harness.free_ports(1)
    with running() as ranks:
        P = start(libkvxfer, "P", "P", 2, p_base, secret, mode="pull")
        D = start(libkvxfer, "D", "D", 1, d_base, secret, mode="pull")
        ranks += P + D
        first = list(range(4))
        recv(D[0], p_base, first, "a", pull=True)
        settle(D)
        P[1].kill()
        t_kill = time.monotonic()
        send(P[0], first, "a")
        D[0].wait_outcomes([f"d-a{i}" for i in first], 20)
        P[0].wait_outcomes([f"p-a{i}" for i in first], 20)
        for i in first:
            r = D[0].result(f"d-a{i}")
            assert r["result"] == "RESULT_FAILED", r
            assert D[0].at(f"d-a{i}") - t_kill < BOUND, (i, D[0].at(f"d-a{i}") - t_kill, r)
            r = P[0].result(f"p-a{i}")
            assert P[0].at(f"p-a{i}") - t_kill < BOUND, (i, P[0].at(f"p-a{i}") - t_kill, r)
        for rank in D + [P[0]]:
            rank.bye()
