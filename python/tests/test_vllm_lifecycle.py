"""Block lifecycle at vLLM's edges: aborts and preemptions while KV moves,
request ids reused, load errors, in both placements and modes."""

from __future__ import annotations

import random
import time

import pytest

import harness as H
from test_vllm import Run, _free_both, _push_params


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_request_id_reused_after_finish(tmp_path, daemons, mode):
    """A request id used again once its request finished (an engine run with
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, or any caller of the engine core
    that names its requests) is a new request: its KV moves and checks byte
    for byte, as the first one's did, on both P and D."""
    rng = random.Random(f"reuse-{mode}")
    # A short registration timeout: a D request whose registration P
    # ignores gives up (and cancels) within the test.
    r = Run(tmp_path, daemons, mode, 1, d_kw={"registration_timeout_s": 3})
    try:
        toks = [rng.randrange(100, 50000) for _ in range(40)]
        r.add(0, toks)
        r.run_until(lambda: "d-0" in r.D.finished and "p-0" in r.P.sent and not r.P.sched.requests
                    and not r.D.sched.requests, limit_s=30)
        assert "d-0" in r.checked and not r.D.failed
        # The same ids again, another prompt, another transfer.
        for e in (r.P, r.D):
            e.finished.clear()
            e.sent.discard("p-0")
            e.recvd.discard("d-0")
        r.checked.clear()
        toks2 = [rng.randrange(100, 50000) for _ in range(40)]
        r.prompts["p-0"] = r.prompts["d-0"] = toks2
        r.P.sched.add_request(H.make_request("p-0", list(toks2), 1, {"do_remote_decode": True, "transfer_id": "t0b"}))
        if mode == "push":
            r.D.sched.add_request(H.make_request("d-0", toks2, 3, {**_push_params(r.dp, "t0b"), "tp_size": 1}))
        else:
            r.pending_d["p-0"] = ("d-0", toks2, 3, False)
        r.run_until(lambda: "d-0" in r.D.finished and "p-0" in r.P.sent and not r.P.sched.requests
                    and not r.D.sched.requests, limit_s=15)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
    finally:
        r.close()


def test_layerwise_producer_preempted_after_prefill(tmp_path, daemons):
    """Layer-wise push: P's request saves every layer in its prefill step,
    then (still decoding) is preempted: vLLM frees its blocks, gives them to
    another request, and prefills it again into other blocks. D registers
    only then. What D receives must be p-0's KV, from the blocks it holds
    at its finish: never the other request's, reported done."""
    rng = random.Random("lw-preempt")
    # A small pool: the freed blocks are the next ones handed out.
    r = Run(tmp_path, daemons, "push", 1, layerwise=True, p_kw={"num_blocks": 8})
    try:
        toks = [rng.randrange(100, 50000) for _ in range(40)]  # 3 blocks
        r.prompts["p-0"] = r.prompts["d-0"] = toks
        r.P.sched.add_request(H.make_request("p-0", list(toks), 6, {"do_remote_decode": True, "transfer_id": "t0"}))
        # Prefill (every layer saved), then one decode step.
        for _ in range(2):
            r.step()
        req = r.P.sched.requests["p-0"]
        assert req.num_computed_tokens >= len(toks) and "p-0" not in r.P.finished
        old = list(r.P.sched.kv_cache_manager.get_block_ids("p-0")[0])
        # Preempted (as memory pressure or a prefix-cache reset does), and
        # resumed at once beside another request, which gets the blocks
        # p-0 held (the pool hands out its freed blocks last).
        assert r.P.sched.reset_prefix_cache(reset_running_requests=True)
        r.prompts["p-x"] = [rng.randrange(100, 50000) for _ in range(4 * H.BLOCK - 2)]
        r.P.sched.add_request(H.make_request("p-x", r.prompts["p-x"], 2, None))
        r.step()
        new_x = set(r.P.sched.kv_cache_manager.get_block_ids("p-x")[0])
        assert new_x & set(old), (old, new_x)
        # p-0 is prefilled again (other blocks) and finishes; D registers.
        r.run_until(lambda: "p-0" in r.P.finished, limit_s=20)
        r.D.sched.add_request(H.make_request("d-0", toks, 3, {**_push_params(r.dp, "t0"), "tp_size": 1}))
        # D's registration reaches P before p-0's finish does (P's next
        # step): P holds p-0 again from its second prefill, not only from
        # its finish, so the registration pairs with it; the withdrawn
        # first prefill's abort fails nothing.
        H.step(r.D, r.prompts, fill=False)
        r._stepped(r.D)
        time.sleep(0.5)
        r.run_until(lambda: "d-0" in r.D.finished and "p-0" in r.P.sent, limit_s=30)
        # Received from the blocks p-0 holds at its finish, and checked
        # byte for byte (Run.step).
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        r.run_until(lambda: not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert _free_both(r)
    finally:
        r.close()


def test_layerwise_producer_preempted_while_paired(tmp_path, daemons):
    """Layer-wise push: D registers first; P prefills p-0 (its layers go to
    D as they are saved), then, still decoding, p-0 is preempted: vLLM frees
    its blocks and gives them to another request, and prefills p-0 again
    into other blocks. The pairing carries over: every layer is written
    again from the new blocks into D's same blocks, and D's request
    completes without recomputing, its KV checked byte for byte; one
    outcome per side, every block back. Before, the preemption was sent to
    the daemon as an abort: D's request failed and was recomputed whole."""
    rng = random.Random("lw-preempt-paired")
    r = Run(tmp_path, daemons, "push", 1, layerwise=True, p_kw={"num_blocks": 8}, d_kw={"registration_timeout_s": 60})
    try:
        toks = [rng.randrange(100, 50000) for _ in range(40)]  # 3 blocks
        r.prompts["p-0"] = r.prompts["d-0"] = toks
        r.D.sched.add_request(H.make_request("d-0", toks, 3, {**_push_params(r.dp, "t0"), "tp_size": 1}))
        H.step(r.D, r.prompts, fill=False)
        r._stepped(r.D)
        time.sleep(0.5)  # D's registration reaches P first
        r.P.sched.add_request(H.make_request("p-0", list(toks), 6, {"do_remote_decode": True, "transfer_id": "t0"}))
        for _ in range(2):
            r.step()
        req = r.P.sched.requests["p-0"]
        assert req.num_computed_tokens >= len(toks) and "p-0" not in r.P.finished
        old = list(r.P.sched.kv_cache_manager.get_block_ids("p-0")[0])
        assert r.P.sched.reset_prefix_cache(reset_running_requests=True)
        r.prompts["p-x"] = [rng.randrange(100, 50000) for _ in range(4 * H.BLOCK - 2)]
        r.P.sched.add_request(H.make_request("p-x", r.prompts["p-x"], 2, None))
        r.step()
        new_x = set(r.P.sched.kv_cache_manager.get_block_ids("p-x")[0])
        assert new_x & set(old), (old, new_x)
        r.run_until(lambda: "d-0" in r.D.finished and "p-0" in r.P.sent, limit_s=30)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        r.run_until(lambda: not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert _free_both(r)
        assert not r.held_violations, r.held_violations
    finally:
        r.close()


def test_layerwise_producer_preempted_while_paired_old_daemon(tmp_path, daemons):
    """As test_layerwise_producer_preempted_while_paired, against a daemon
    that does not take FINISH_STATUS_PREEMPTED (an older build: its
    OpenSchedulerResponse.takes_preempted is false). The connector tells it
    the preemption as an abort: D's request fails and is recomputed, and
    never completes from what the first attempt's WRITEs read from the
    freed blocks (before, an abort with the last layers in flight told D
    its KV had arrived: it decoded from another request's KV). P's request,
    prefilled again, waits for a consumer that gave up until its lease
    (short here) ends."""
    rng = random.Random("lw-preempt-paired")
    r = Run(tmp_path, daemons, "push", 1, layerwise=True, p_kw={"num_blocks": 8, "lease_s": 3}, d_kw={"registration_timeout_s": 60})
    try:
        r.P.sched.connector._sched.sched.takes_preempted = False
        toks = [rng.randrange(100, 50000) for _ in range(40)]  # 3 blocks
        r.prompts["p-0"] = r.prompts["d-0"] = toks
        r.D.sched.add_request(H.make_request("d-0", toks, 3, {**_push_params(r.dp, "t0"), "tp_size": 1}))
        H.step(r.D, r.prompts, fill=False)
        r._stepped(r.D)
        time.sleep(0.5)
        r.P.sched.add_request(H.make_request("p-0", list(toks), 6, {"do_remote_decode": True, "transfer_id": "t0"}))
        for _ in range(2):
            r.step()
        old = list(r.P.sched.kv_cache_manager.get_block_ids("p-0")[0])
        assert r.P.sched.reset_prefix_cache(reset_running_requests=True)
        r.prompts["p-x"] = [rng.randrange(100, 50000) for _ in range(4 * H.BLOCK - 2)]
        r.P.sched.add_request(H.make_request("p-x", r.prompts["p-x"], 2, None))
        r.step()
        assert set(r.P.sched.kv_cache_manager.get_block_ids("p-x")[0]) & set(old)
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert "d-0" in r.D.failed and "d-0" not in r.checked, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.placement("daemon")  # relay daemon: the ranks take the step by reference
def test_refused_request_id_reused_ends_once(tmp_path, daemons, caplog):
    """Pull, relay daemon: the daemon's Scheduler refuses D's d-0 (its params
    name two block groups; D has one). The rank ends it at once, from its own
    stream (the published step does not stage it), and vLLM recomputes it,
    while the scheduler side's answer to that step, saying the same, is slow
    to come back. d-0 then finishes, and the router sends a new request
    under the same id, with good params: the late answer is about the old
    d-0, and must not end the new one, whose KV the daemon is still to read
    into its blocks (vLLM would free them, or recompute into them, while
    the READ lands)."""
    rng = random.Random("refused-reused")
    # A short lease: P holds p-0's blocks, which no D reads, that long.
    r = Run(tmp_path, daemons, "pull", 1, p_kw={"lease_s": 2})
    side = r.D.sched.connector._sched
    assert side.relay == "daemon"
    real = side.stream.results
    hold = [True]

    def results(*a, **k):
        return [] if hold[0] else real(*a, **k)

    side.stream.results = results
    try:
        for n in range(2):
            r.prompts[f"p-{n}"] = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", list(r.prompts[f"p-{n}"]), 1,
                                                 {"do_remote_decode": True, "transfer_id": f"t{n}"}))
        r.run_until(lambda: {"p-0", "p-1"} <= set(r.P.finished))
        bad = dict(r.P.finished["p-0"].kv_transfer_params)
        bad["remote_block_ids"] = [list(bad["remote_block_ids"][0]), [1, 2]]
        bad["remote_block_starts"] = [0, 0]
        r.prompts["d-0"] = r.prompts["p-0"]
        caplog.set_level("WARNING", logger="kvxfer.vllm")
        r.D.sched.add_request(H.make_request("d-0", list(r.prompts["d-0"]), 2, bad))
        # The rank's own outcome ends the refused d-0 (recomputed), the
        # scheduler side's answers held back meanwhile.
        r.run_until(lambda: "d-0" in r.D.finished and "d-0" not in r.D.sched.requests, limit_s=30)
        assert "d-0" in r.D.failed and "d-0" not in r.checked
        assert side.inflight, "the step answers were not held back"
        # The same id again, another prompt, good params; the late answers
        # come back in the step that starts its wait.
        for s in (r.D.failed, r.D.recvd, r.checked):
            s.discard("d-0")
        del r.D.finished["d-0"]
        r.prompts["d-0"] = r.prompts["p-1"]
        r.D.sched.add_request(H.make_request("d-0", list(r.prompts["d-0"]), 2, dict(r.P.finished["p-1"].kv_transfer_params)))
        hold[0] = False
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert not side.inflight
        assert "d-0" not in r.D.failed, "the new d-0 was ended by the old one's refusal, its KV still to land"
        assert "d-0" in r.checked and r.D.stats.get("failed_recv") == 1, r.D.stats
        assert _free_both(r)
    finally:
        r.close()
