"""The vLLM connector (placement daemon) against a kvxferd whose rank stream
ends, that freezes or that hands the rank what it does not expect."""

from __future__ import annotations

import random
import time

import pytest

import harness as H
from test_vllm import Run, _push_params
from kvxfer.v1 import kvxfer_pb2 as pb


def _pending_recv(rank, rid) -> bool:
    """Whether rid's receive outcome reached the rank's stream, not polled yet."""
    with rank.stream._lock:
        return any(o.request_id == rid for o in rank.stream._pending.recving)


@pytest.mark.placement("daemon")  # the daemon's stream is what the test breaks
@pytest.mark.parametrize("relay", ["daemon", "metadata"])
def test_rank_stream_end_keeps_outcomes_it_delivered(tmp_path, daemons, relay):
    """d-0's KV arrived and its done outcome reached D's rank stream; the
    stream then ends (its daemon alive) before the connector polled, and
    the step vLLM starts next is the first to notice. The outcome the
    stream delivered before its end is d-0's: d-0 is received (its bytes
    check), not failed and recomputed (nor, with kv_load_failure_policy
    fail, errored) as a request whose outcome was lost."""
    rng = random.Random(f"keep-{relay}")
    r = Run(tmp_path, daemons, "push", 1, p_kw={"relay": relay}, d_kw={"relay": relay})
    try:
        toks = [rng.randrange(100, 50000) for _ in range(40)]
        r.prompts["p-0"] = r.prompts["d-0"] = toks
        p = _push_params(r.dp, "t0")
        p["tp_size"] = 1
        r.D.sched.add_request(H.make_request("d-0", toks, 3, p))
        for _ in range(3):  # D registers d-0's blocks with P
            H.step(r.D, r.prompts, fill=False)
        rank = r.D.ranks[0].connector._worker
        assert "d-0" in rank.waiting_recv
        r.P.sched.add_request(H.make_request("p-0", list(toks), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        deadline = time.monotonic() + 30
        while not _pending_recv(rank, "d-0"):  # P alone steps: D polls nothing
            assert time.monotonic() < deadline, "d-0's outcome never reached D's rank"
            H.step(r.P, r.prompts)
            time.sleep(0.01)
        # The stream ends under the connector (a reset transport), its
        # outcome for d-0 taken from the wire already.
        rank.stream._call.cancel()
        assert rank.stream._done.wait(5)
        # D's next step hands its rank a step (a new request to load).
        r.add(1, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and not r.P.sched.requests
                    and not r.D.sched.requests, limit_s=60)
        assert "d-0" not in r.D.failed, "d-0's done outcome, delivered before the stream ended, was dropped"
        assert "d-0" in r.checked
    finally:
        r.close()


def _deliver(rank, m: pb.ConnectResponse) -> None:
    """m as the rank's stream's reader takes it off the wire."""
    from kvxfer import client
    with rank.stream._lock:
        client._gather(rank.stream._pending, m)
        rank.stream._arrived.notify_all()


@pytest.mark.placement("daemon")
def test_unexpected_outcomes_are_ignored(tmp_path, daemons, caplog):
    """kvxferd (a newer one, or a buggy one) hands D's rank outcomes it
    cannot place: a result value this client does not know, for a request
    the rank never started and for one it waits on, and a second outcome
    for that one. None raises into vLLM's worker loop; the waiting request
    ends once, failed; and the engine goes on: the next pair moves."""
    rng = random.Random("unexpected")
    r = Run(tmp_path, daemons, "push", 1)
    try:
        toks = [rng.randrange(100, 50000) for _ in range(40)]
        r.prompts["d-0"] = toks
        p = _push_params(r.dp, "t0")
        p["tp_size"] = 1
        r.D.sched.add_request(H.make_request("d-0", toks, 3, p))
        for _ in range(3):
            H.step(r.D, r.prompts, fill=False)
        rank = r.D.ranks[0].connector._worker
        assert "d-0" in rank.waiting_recv
        future = 17  # a Result value this client has no name for
        _deliver(rank, pb.ConnectResponse(finished=pb.Finished(recving=[
            pb.Outcome(request_id="never-started", result=future),
            pb.Outcome(request_id="d-0", result=future, reason="what a newer daemon says"),
            pb.Outcome(request_id="d-0", result=pb.Outcome.RESULT_DONE)],
            sending=[pb.Outcome(request_id="never-sent", result=future)])))
        caplog.set_level("WARNING", logger="kvxfer.vllm")
        deadline = time.monotonic() + 30
        while "d-0" not in r.D.finished:
            assert time.monotonic() < deadline
            H.step(r.D, r.prompts, fill=False)
        assert "d-0" in r.D.failed and r.D.stats.get("failed_recv") == 1, (r.D.failed, r.D.stats)
        r.add(1, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: "d-1" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests, limit_s=60)
        assert "d-1" in r.checked
    finally:
        r.close()


@pytest.mark.placement("daemon")
@pytest.mark.parametrize("what", ["index", "extra"])
def test_unexpected_step_answers_are_ignored(tmp_path, daemons, what, caplog):
    """The daemon's answer to D's step names an op the step does not have
    (index), or an answer comes for no step sent (extra). Neither raises
    into vLLM's scheduler loop nor fails a request it does not name, and
    the request of the step moves byte for byte."""
    rng = random.Random(f"answers-{what}")
    r = Run(tmp_path, daemons, "push", 1)
    try:
        side = r.D.sched.connector._sched
        stream = side.stream
        real = stream.results
        bent = []

        def results(*a, **k):
            out = real(*a, **k)
            if out and not bent:
                bent.append(True)
                if what == "index":
                    out[0].results.add(index=len(out[0].results) + 1000, code=3, error="no such op")
                    out[0].results.add(index=-1, code=3, error="no such op either")
                else:
                    out.append(pb.StepResponse(publish_step=out[-1].publish_step + 1))
            return out

        stream.results = results
        caplog.set_level("WARNING", logger="kvxfer.vllm")
        r.add(0, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests, limit_s=60)
        assert bent
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
    finally:
        r.close()


@pytest.mark.placement("daemon")  # the daemon process itself is what the test freezes
def test_frozen_daemon_is_not_gone(tmp_path, daemons):
    """D's rank stream breaks, its kvxferd alive, while d-0's blocks are
    granted to P's WRITE; then kvxferd freezes (SIGSTOP) before it let the
    rank go. The rank's attempts to attach again get no Ready: a daemon
    that does not answer is not one that is gone (it resumes, fences and
    may land bytes first), so d-0 stays held, as for a daemon still
    fencing (up to the connector's 12 s), and every attempt is bounded by
    timeout_s. Resumed, kvxferd lets the rank go, d-0 ends, and the next
    pair moves."""
    import signal

    from kvxfer import vllm as V

    rng = random.Random("frozen")
    r = Run(tmp_path, daemons, "push", 1, d_timeout=2)
    stopped = False
    try:
        r.prompts["d-0"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
        p = _push_params(r.dp, "t0")
        p["tp_size"] = 1
        r.D.sched.add_request(H.make_request("d-0", toks, 2, p))
        for _ in range(5):
            H.step(r.D, r.prompts, fill=False)
        rank = r.D.ranks[0].connector._worker
        assert "d-0" in rank.waiting_recv
        rank.stream._call.cancel()
        assert rank.stream._done.wait(5)
        stopped = True
        H.freeze(r.dd.proc)
        t0 = time.monotonic()
        while time.monotonic() - t0 < V._DAEMON_FENCE_S - 4:
            s0 = time.monotonic()
            H.step(r.D, r.prompts, fill=False)
            assert time.monotonic() - s0 < 2 + 1.5, "a step waited past timeout_s on a frozen daemon"
            assert "d-0" not in r.D.failed and "d-0" not in r.D.finished, \
                f"D ended d-0 {time.monotonic() - t0:.1f}s after its rank's stream broke, kvxferd frozen, not gone"
            time.sleep(0.05)
        r.dd.proc.send_signal(signal.SIGCONT)
        stopped = False
        deadline = time.monotonic() + 30
        while "d-0" not in r.D.finished:
            assert time.monotonic() < deadline, "d-0 never ended"
            H.step(r.D, r.prompts, fill=False)
            time.sleep(0.01)
        r.add(1, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: "d-1" in r.checked, limit_s=30)
    finally:
        if stopped:
            r.dd.proc.send_signal(signal.SIGCONT)
        r.close()
