"""The connector across vLLM's request lifecycle under churn: many P/D pairs
in small block pools (blocks freed and handed out again every few steps),
aborts in every state on both sides, and preemptions of running requests,
driven by vLLM's own Scheduler in both placements and modes. Every byte D
receives is checked against the prompt that request carries (random
tokens: a cross-wired block shows), each rank reports each request at most
once, every request ends, and every block goes back to both pools."""

from __future__ import annotations

import os
import random
import time
from collections import Counter

import pytest

import harness as H
from test_vllm import Run, _free_both, _push_params


def _count_outcomes(e: H.Engine, seen: dict) -> None:
    """Counts, per rank, the outcomes each request gets from the connector."""
    for i, rank in enumerate(e.ranks):
        c = rank.connector
        orig = c.get_transfer_results

        def results(finished, _orig=orig, _i=i):
            res = _orig(finished)
            for rid in res.finished_sending or ():
                seen[("send", _i, rid)] += 1
            for rid in res.finished_recving or ():
                seen[("recv", _i, rid)] += 1
            return res

        c.get_transfer_results = results


def _abort(e: H.Engine, rid: str) -> bool:
    from vllm.v1.request import RequestStatus
    done = e.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    for req in done:
        e.finished[req.request_id] = req
    return bool(done)


class ChurnRun(Run):
    """Run whose steps may leave one engine out: P and D step at their own
    pace (one engine stalls while the other moves)."""

    # P's and D's requests of a pair: the router's one id on both engines
    # (vLLM's own proxy and llm-d send the same id to P and D).
    same_ids = False

    def add(self, n, tokens, max_tokens=3, abort_d_before=False, p_max_tokens=1):
        if not self.same_ids:
            return super().add(n, tokens, max_tokens, abort_d_before, p_max_tokens)
        rid, tid = f"r-{n}", f"t{n}"
        self.prompts[rid] = tokens
        self.P.sched.add_request(H.make_request(rid, list(tokens), p_max_tokens, {"do_remote_decode": True, "transfer_id": tid},
                                                self.P.block))
        if self.mode == "push":
            params = {**_push_params(self.dp, tid), "tp_size": self.p_tp}
            self.D.sched.add_request(H.make_request(rid, tokens, max_tokens, params, self.D.block))
        else:
            self.pending_d[rid] = (rid, tokens, max_tokens, False)

    def step(self, do_p: bool = True, do_d: bool = True):
        if do_p:
            so, _ = H.step(self.P, self.prompts)
            for rid, n in so.num_scheduled_tokens.items():
                self.p_computed[rid] = self.p_computed.get(rid, 0) + n
            for rid, o in list(self.P.finished.items()):
                if rid in self.pending_d and o.kv_transfer_params is not None:
                    did, tokens, mt, _ = self.pending_d.pop(rid)
                    # (D's block size: its block hashes are of blocks of
                    # that many tokens, or its prefix cache hits blocks of
                    # other prompts.)
                    self.D.sched.add_request(H.make_request(did, tokens, mt, dict(o.kv_transfer_params), self.D.block))
        if do_d:
            before = set(self.D.recvd)
            # D computes what it does not load (a recompute after a failed
            # load or a preemption) as P would: its prefix cache holds
            # the same bytes as P's.
            H.step(self.D, self.prompts)
            for rid in self.D.recvd - before:
                if rid in self.D.sched.requests and rid not in self.D.failed:
                    tokens = self.prompts[rid]
                    self.checked_bytes += H.check_kv(self.D, rid, tokens, self.loaded(len(tokens)))
                    self.checked.add(rid)


class _LatePolls:
    """Holds back what an engine's ranks poll from their streams while
    set: outcomes the daemon sends in a step reach the connector a step
    later (they travel apart from the step, so they may)."""

    def __init__(self, e: H.Engine):
        from kvxfer.client import Finished
        self.on = False
        for rank in e.ranks:
            stream = rank.connector._worker.stream
            orig = stream.poll

            def poll(*a, _orig=orig, **k):
                return Finished() if self.on else _orig(*a, **k)

            stream.poll = poll

    def one_step_late(self, step) -> None:
        """Runs step with polls held, then lets the daemon's outcomes of it
        arrive before the next step polls."""
        self.on = True
        try:
            step()
            time.sleep(0.5)
        finally:
            self.on = False


def _preempt(e: H.Engine, req) -> None:
    """Preempts a running request between steps, as vLLM's schedule() does
    when it runs out of blocks (and reset_prefix_cache does for all)."""
    e.sched.running.remove(req)
    e.sched._preempt_request(req, time.monotonic(), drop_stale_output=True)
    e.sched.prev_step_scheduled_req_ids.discard(req.request_id)


# (mode, P's TP, D's TP, layer-wise, verify: off as in production,
# max_num_batched_tokens: 24 chunks prefills, preempted mid-prompt too)
CHURN = [(m, p, d, False, True, 4096) for m in ("push", "pull") for p, d in ((1, 1), (2, 1), (1, 2), (2, 2))] + \
    [("push", 2, 1, True, True, 4096), ("push", 2, 1, True, True, 24), ("push", 1, 2, False, False, 24),
     ("pull", 2, 1, False, False, 4096)]


@pytest.mark.parametrize("mode,p_tp,d_tp,layerwise,verify,batched", CHURN,
                         ids=[f"{m}-tp{p}to{d}{'-layerwise' if lw else ''}{'' if v else '-noverify'}{'-chunked' if b < 100 else ''}"
                              for m, p, d, lw, v, b in CHURN])
def test_churn_aborts_and_preemptions(tmp_path, daemons, mode, p_tp, d_tp, layerwise, verify, batched):
    # CHURN_SEED and CHURN_PAIRS explore further (by hand).
    rng = random.Random(f"churn-{mode}{os.environ.get('CHURN_SEED', '')}")
    # Small pools: D's decodes run out of blocks (vLLM preempts), and the
    # blocks of finished requests come back into use at once.
    common = {"num_blocks": 20, "verify": verify, "batched": batched}
    r = ChurnRun(tmp_path, daemons, mode, p_tp, d_tp=d_tp, layerwise=layerwise, p_kw={**common, "lease_s": 4},
                 d_kw={**common, "registration_timeout_s": 4})
    seen: Counter = Counter()
    for e in (r.P, r.D):
        _count_outcomes(e, seen)
    added_ids = {"P": set(), "D": set()}
    for e in (r.P, r.D):
        orig_add = e.sched.add_request

        def add_request(req, _orig=orig_add, _ids=added_ids[e.role]):
            _ids.add(req.request_id)
            return _orig(req)

        e.sched.add_request = add_request
    try:
        n_pairs = int(os.environ.get("CHURN_PAIRS", 24))
        added = 0
        aborted_p: set[str] = set()
        aborted_d: set[str] = set()
        preempts = 0
        shared = [rng.randrange(100, 50000) for _ in range(2 * H.BLOCK)]
        deadline = time.monotonic() + 240
        while True:
            assert time.monotonic() < deadline, (sorted(r.P.sched.requests), sorted(r.D.sched.requests))
            if added < n_pairs and rng.random() < 0.5:
                n = added
                added += 1
                body = [rng.randrange(100, 50000) for _ in range(rng.randrange(5, 70))]
                toks = (shared + body) if rng.random() < 0.3 else body
                # P decodes a few tokens too (aborted or preempted after its
                # prompt, its layer-wise send under way).
                r.add(n, toks, max_tokens=rng.randrange(2, 30), p_max_tokens=rng.randrange(1, 4))
            # Aborts in whatever state the request is in.
            if rng.random() < 0.15 and r.D.sched.requests:
                rid = rng.choice(sorted(r.D.sched.requests))
                if _abort(r.D, rid):
                    aborted_d.add(rid)
            if rng.random() < 0.08 and r.P.sched.requests:
                rid = rng.choice(sorted(r.P.sched.requests))
                if _abort(r.P, rid):
                    aborted_p.add(rid)
                    # Pull: its D request is never sent (no params).
                    r.pending_d.pop(rid, None)
            # Preemption of whatever runs.
            if rng.random() < 0.05:
                e = rng.choice((r.P, r.D))
                if e.sched.running:
                    _preempt(e, rng.choice(e.sched.running))
                    preempts += 1
            x = rng.random()
            r.step(do_p=x > 0.2, do_d=x < 0.8)
            if added == n_pairs and not r.P.sched.requests and not r.D.sched.requests and not r.pending_d:
                break
        # Each rank reported each request at most once, each way.
        twice = {k: v for k, v in seen.items() if v > 1}
        assert not twice, twice
        # Every request either engine got ended, with vLLM's finish (or
        # the abort), and none is left (the loop's end).
        assert added_ids["P"] == {f"p-{n}" for n in range(n_pairs)}
        assert added_ids["P"] <= set(r.P.finished) and added_ids["D"] <= set(r.D.finished), \
            (sorted(added_ids["P"] - set(r.P.finished)), sorted(added_ids["D"] - set(r.D.finished)))
        assert r.checked, "no request was received"
        # Nothing is left held on either side.
        deadline = time.monotonic() + 30
        while not (r.P.sched.kv_cache_manager.block_pool.get_num_free_blocks() == r.P.initial_free
                   and r.D.sched.kv_cache_manager.block_pool.get_num_free_blocks() == r.D.initial_free):
            assert time.monotonic() < deadline, "blocks never came back"
            r.step()
        print(f"churn {mode} tp {p_tp}->{d_tp}: {len(r.checked)} checked, {len(r.D.failed)} failed, aborted P {len(aborted_p)} "
              f"D {len(aborted_d)}, preemptions {preempts}, bytes {r.checked_bytes}")
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_prefix_hit_on_both_leaves_the_hit_alone(tmp_path, daemons, mode, p_tp, d_tp):
    """P and D both hold a 3-block prefix in their prefix caches; P's copy
    is overwritten with junk once it is cached (P never computes it again:
    its next request hits it). D's next request loads only the blocks past
    its own hit: D's bytes over the whole prompt are its own prefix plus
    P's freshly computed rest, so junk anywhere means the transfer read or
    wrote a block of the hit."""
    rng = random.Random(f"hit-{mode}-{p_tp}-{d_tp}")
    r = Run(tmp_path, daemons, mode, p_tp, d_tp=d_tp)
    try:
        shared = [rng.randrange(100, 50000) for _ in range(3 * H.BLOCK)]
        r.add(0, shared + [1, 2, 3])
        held = []

        def p0_held():
            req = r.P.sched.requests.get("p-0")
            if req is not None and req.is_finished() and not held:
                held.append(list(r.P.sched.kv_cache_manager.get_block_ids("p-0")[0]))
            return "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests

        r.run_until(p0_held)
        assert "d-0" in r.checked and held
        for rank in r.P.ranks:
            for t in rank.kv.values():
                for b in held[0][:3]:
                    t[b] = 1234.0
        r.add(1, shared + [4, 5, 6, 7, 8])
        r.run_until(lambda: "d-1" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests)
        assert r.p_computed["p-1"] == 5, r.p_computed  # P's hit: it computed the rest only
        assert "d-1" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("one_daemon", [False, True], ids=["two-servers", "one-server"])
def test_same_request_ids_on_p_and_d(tmp_path, daemons, placement, mode, one_daemon):
    """The router names each request the same on P and D (vLLM's proxy
    does), and the two engines may share one server (in-process: one per
    process; a node's kvxferd): each engine gets its own requests' outcomes
    only, D's bytes check, and every block comes back."""
    rng = random.Random(f"same-{mode}-{one_daemon}")
    if one_daemon:
        server = daemons("pd")
        shared_daemons = lambda name: server  # noqa: E731
    else:
        shared_daemons = daemons
    ChurnRun.same_ids = True
    try:
        r = ChurnRun(tmp_path, shared_daemons, mode, 1)
    finally:
        ChurnRun.same_ids = False
    r.same_ids = True
    seen: Counter = Counter()
    for e in (r.P, r.D):
        _count_outcomes(e, seen)
    try:
        for n in range(12):
            r.add(n, [rng.randrange(100, 50000) for _ in range(rng.randrange(5, 70))], max_tokens=rng.randrange(2, 6))
            r.step(do_p=rng.random() < 0.7, do_d=rng.random() < 0.7)
        ids = {f"r-{n}" for n in range(12)}
        r.run_until(lambda: ids <= set(r.D.finished) and ids <= set(r.P.finished) and not r.pending_d
                    and not r.P.sched.requests and not r.D.sched.requests, limit_s=60)
        assert not {k: v for k, v in seen.items() if v > 1}
        assert r.checked == ids and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("how", ["skip-prefix-cache", "abort-before-scheduled"])
def test_d_loading_nothing_frees_p_at_once(tmp_path, daemons, mode, how):
    """D's request loads nothing after all: vLLM drops the connector's match
    for a request that skips reading the prefix cache (prompt logprobs:
    update_state_after_alloc with no external tokens), or the request is
    aborted before it is scheduled. P holds the request's blocks for D
    (lease and registration far longer than the test): D's engine tells
    P's at once, and P frees them; nothing is received on D."""
    rng = random.Random(f"nothing-{mode}-{how}")
    r = ChurnRun(tmp_path, daemons, mode, 1, p_kw={"lease_s": 300}, d_kw={"registration_timeout_s": 300})
    try:
        toks = [rng.randrange(100, 50000) for _ in range(40)]
        r.prompts["p-0"] = r.prompts["d-0"] = toks
        r.P.sched.add_request(H.make_request("p-0", list(toks), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        r.run_until(lambda: "p-0" in r.P.finished, limit_s=20)
        assert "p-0" in r.P.sched.requests  # held for D
        params = dict(r.P.finished["p-0"].kv_transfer_params) if mode == "pull" else \
            {**_push_params(r.dp, "t0"), "tp_size": 1}
        req = H.make_request("d-0", toks, 2, params)
        if how == "skip-prefix-cache":
            req.skip_reading_prefix_cache = True
        r.D.sched.add_request(req)
        if how == "abort-before-scheduled":
            assert _abort(r.D, "d-0")
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert "d-0" not in r.D.recvd and "p-0" in r.P.sent, (r.D.recvd, r.P.sent)
        assert _free_both(r)
    finally:
        r.close()


def _sched_stats(e: H.Engine) -> Counter:
    """The scheduler side's stats (vLLM adds them to the workers' each
    step), summed over the run."""
    side = e.sched.connector._sched
    total: Counter = Counter()
    orig = side.take_stats

    def take():
        s = orig()
        if s is not None:
            total.update(s.data)
        return s

    side.take_stats = take
    return total


@pytest.mark.parametrize("relay", ["auto", "metadata"])
def test_daemon_answers_count_without_verify(tmp_path, daemons, placement, relay):
    """An engine as production runs it (verify off): D's daemon Scheduler
    refuses one request's params (a second block group D does not have).
    The refusal is counted in the scheduler side's stats (bad_params, what
    vLLM's connector metrics show), as with verify; and while P holds a
    request's blocks for D, its connector says it has pending work, as the
    daemon's answers say."""
    rng = random.Random(f"noverify-{relay}")
    r = ChurnRun(tmp_path, daemons, "pull", 1, p_kw={"lease_s": 2, "verify": False, "relay": relay},
                 d_kw={"verify": False, "relay": relay})
    d_stats = _sched_stats(r.D)
    try:
        assert not r.D.sched.connector._sched.verify
        for n in range(2):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", r.prompts[f"p-{n}"], 1, {"do_remote_decode": True, "transfer_id": f"t{n}"}))
        r.run_until(lambda: {"p-0", "p-1"} <= set(r.P.finished))
        r.step(do_d=False)  # P's answers for the step that held them are in
        assert {"p-0", "p-1"} <= set(r.P.sched.requests)  # held for D
        assert r.P.sched.connector.has_pending_push_work(), "P holds blocks for D, its connector says no work is pending"
        bad = dict(r.P.finished["p-1"].kv_transfer_params)
        bad["remote_block_ids"] = [list(bad["remote_block_ids"][0]), [1, 2]]
        bad["remote_block_starts"] = [0, 0]
        r.D.sched.add_request(H.make_request("d-0", r.prompts["d-0"], 2, dict(r.P.finished["p-0"].kv_transfer_params)))
        r.D.sched.add_request(H.make_request("d-1", r.prompts["d-1"], 2, bad))
        r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests)
        for _ in range(3):  # the last answers
            r.step()
        assert "d-0" in r.checked and "d-1" in r.D.failed
        assert d_stats["bad_params"] >= 1, f"the daemon refused d-1's params; D's stats say {dict(d_stats)}"
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("d_tp", [1, 2])
def test_failed_load_after_prefix_hit_names_only_the_loaded_blocks(tmp_path, daemons, mode, d_tp):
    """D holds a 3-block prefix and waits for the rest of d-1 from P; the
    load fails (push: P aborts its request; pull: P's blocks are gone once
    its lease ran out, P's rank having dropped them). The blocks D's ranks
    report as not loaded are exactly d-1's blocks past its hit, never one
    of the hit (shared with the prefix cache and other requests), and d-1
    is recomputed (reported failed) and ends, its blocks freed."""
    rng = random.Random(f"fail-hit-{mode}-{d_tp}")
    r = ChurnRun(tmp_path, daemons, mode, 1, d_tp=d_tp, p_kw={"lease_s": 2})
    invalid: list[set] = []
    for rank in r.D.ranks:
        c = rank.connector
        orig = c.get_block_ids_with_load_errors

        def take(_orig=orig):
            ids = _orig()
            if ids:
                invalid.append(set(ids))
            return ids

        c.get_block_ids_with_load_errors = take
    blocks = []  # d-1's blocks, as vLLM allocated them for the load
    conn = r.D.sched.connector
    orig_alloc = conn.update_state_after_alloc

    def alloc(request, kv_blocks, external):
        if request.request_id == "d-1" and external:
            blocks.append([b.block_id for b in kv_blocks.blocks[0]])
        return orig_alloc(request, kv_blocks, external)

    conn.update_state_after_alloc = alloc
    try:
        shared = [rng.randrange(100, 50000) for _ in range(3 * H.BLOCK)]
        r.add(0, shared + [1, 2, 3])
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests)
        toks = shared + [rng.randrange(100, 50000) for _ in range(40)]
        r.prompts["p-1"] = r.prompts["d-1"] = toks
        if mode == "push":
            r.P.sched.add_request(H.make_request("p-1", list(toks), 1, {"do_remote_decode": True, "transfer_id": "t1"}))
            r.D.sched.add_request(H.make_request("d-1", toks, 2, {**_push_params(r.dp, "t1"), "tp_size": 1}))
            r.step(do_p=False)
            assert _abort(r.P, "p-1")
        else:
            r.P.sched.add_request(H.make_request("p-1", list(toks), 1, {"do_remote_decode": True, "transfer_id": "t1"}))
            r.run_until(lambda: "p-1" in r.P.finished)
            params = dict(r.P.finished["p-1"].kv_transfer_params)
            r.run_until(lambda: not r.P.sched.requests, limit_s=20)  # the lease ran out: P freed them
            r.D.sched.add_request(H.make_request("d-1", toks, 2, params))
        r.run_until(lambda: "d-1" in r.D.recvd, limit_s=30)
        assert "d-1" in r.D.failed, (r.D.recvd, r.D.failed)
        assert len(blocks) == 1 and len(blocks[0]) == 6, blocks
        past_hit = set(blocks[0][3:])
        # Every rank names exactly the blocks the load was to fill.
        assert len(invalid) == d_tp and all(ids == past_hit for ids in invalid), (invalid, blocks[0])
        r.run_until(lambda: "d-1" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests)
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.parametrize("p_tp", [1, 2])
def test_layerwise_producer_preempted_resumes_from_its_prefix_cache(tmp_path, daemons, p_tp):
    """Layer-wise push: p-0's prompt (5 full blocks and a token) is listed
    and its layers saved in its prefill step; it is preempted while it
    decodes, and resumes at once from P's prefix cache (the same blocks,
    only its last tokens computed again), so the step that abandons its
    first listing lists it anew, and it finishes. D registers only after
    that, once P's blocks may have gone to other requests. What D receives
    must be p-0's KV (or fail): never another request's bytes reported
    done."""
    rng = random.Random(f"lw-resume-{p_tp}")
    r = ChurnRun(tmp_path, daemons, "push", p_tp, layerwise=True, p_kw={"num_blocks": 16})
    try:
        toks = [rng.randrange(100, 50000) for _ in range(5 * H.BLOCK + 1)]
        r.prompts["p-0"] = r.prompts["d-0"] = toks
        # Two tokens: the resumed step computes the prompt's last token
        # again and samples the second, so p-0 finishes in the step that
        # lists it anew.
        r.P.sched.add_request(H.make_request("p-0", list(toks), 2, {"do_remote_decode": True, "transfer_id": "t0"}))
        r.step(do_d=False)  # prefill: listed, every layer saved
        req = r.P.sched.requests["p-0"]
        assert req.num_computed_tokens >= len(toks) and not req.is_finished()
        _preempt(r.P, req)
        # The step that abandons the first listing (its outcome read a step
        # late) lists p-0 anew and finishes it.
        _LatePolls(r.P).one_step_late(lambda: r.step(do_d=False))
        for _ in range(3):
            r.step(do_d=False)
        assert "p-0" in r.P.finished
        # Other requests take whatever P freed, and write their own KV.
        for n in range(3):
            r.prompts[f"x-{n}"] = [rng.randrange(100, 50000) for _ in range(4 * H.BLOCK - 1)]
            r.P.sched.add_request(H.make_request(f"x-{n}", r.prompts[f"x-{n}"], 2, None))
        for _ in range(3):
            r.step(do_d=False)
        # Its blocks are held for D until its send ends: no outcome of the
        # abandoned first listing ends that wait.
        assert "p-0" in r.P.sched.requests and "p-0" not in r.P.sent, "P freed p-0's blocks before D registered"
        r.D.sched.add_request(H.make_request("d-0", toks, 2, {**_push_params(r.dp, "t0"), "tp_size": p_tp}))
        r.run_until(lambda: "d-0" in r.D.recvd and not r.P.sched.requests, limit_s=40)
        assert "d-0" in r.checked and not r.D.failed, (r.checked, r.D.failed)
        r.run_until(lambda: not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert _free_both(r)
    finally:
        r.close()


# In push, the old d-0's release (an empty registration for t0) waits at
# P for a producer request not there yet; the new d-0's registration for
# t1 must not be taken as a duplicate of it (it was, and P never wrote t1:
# TestConsumerIDReusedForAnotherTransfer).
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_d_request_id_reused_after_abort_before_scheduled(tmp_path, daemons, mode):
    """D's d-0 is aborted before it was scheduled (the router gave up), and
    the router sends a new request under the same id right after, with
    another transfer (the step after: the abort reached the daemon first).
    The abort's outcome is about the old d-0, which vLLM does not wait on:
    the new d-0 waits for its own KV and gets it, byte for byte, never
    ended early (vLLM would free its blocks while P's WRITE or D's READ is
    still to land)."""
    rng = random.Random(f"d-reuse-abort-{mode}")
    r = ChurnRun(tmp_path, daemons, mode, 1, p_kw={"lease_s": 3})
    try:
        old = [rng.randrange(100, 50000) for _ in range(40)]
        new = [rng.randrange(100, 50000) for _ in range(50)]
        r.prompts["p-0"], r.prompts["p-1"] = old, new
        for n, toks in ((0, old), (1, new)):
            r.P.sched.add_request(H.make_request(f"p-{n}", list(toks), 1, {"do_remote_decode": True, "transfer_id": f"t{n}"}))
        if mode == "pull":
            r.run_until(lambda: {"p-0", "p-1"} <= set(r.P.finished))
            p_old, p_new = (dict(r.P.finished[f"p-{n}"].kv_transfer_params) for n in (0, 1))
        else:
            p_old, p_new = ({**_push_params(r.dp, f"t{n}"), "tp_size": 1} for n in (0, 1))
        r.D.sched.add_request(H.make_request("d-0", old, 2, p_old))
        assert _abort(r.D, "d-0")
        # The abort goes to the daemon; its outcome is read a step late.
        _LatePolls(r.D).one_step_late(lambda: r.step(do_p=False))
        r.prompts["d-0"] = new
        r.D.sched.add_request(H.make_request("d-0", new, 2, p_new))
        r.run_until(lambda: "d-0" in r.D.recvd and "p-1" in r.P.finished, limit_s=30)
        assert "d-0" not in r.D.failed, "the new d-0 was ended by the old one's abort"
        assert "d-0" in r.checked
        r.run_until(lambda: not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert _free_both(r)
    finally:
        r.close()


def test_pull_consumer_preempted_after_its_load_is_not_read_again(tmp_path, daemons, placement):
    """Pull, both engines' lease 2 s: d-0 is loaded and runs, then vLLM
    preempts it back to D's waiting queue and holds it there 4 s, twice
    P's lease, before it runs again. vLLM preempts only a running request
    (one whose receive is staged waits in WAITING_FOR_REMOTE_KVS, in the
    waiting queue, never preempted), so its load is over: P let p-0's
    blocks go after the READ, and nothing is held for heartbeats to keep.
    d-0 is not read (nor awaited) again, it is recomputed on D from its
    blocks' loss, each rank reports each side once, no receive fails, and
    both engines give every block back."""
    rng = random.Random("preempted-pull")

    def leased(name):
        if placement == "in-process":
            return H.InProcess(tmp_path, name, server={"lease": "2s"})
        return daemons(name, ["-lease", "2s"])

    r = Run(tmp_path, leased, "pull", 1, p_kw={"lease_s": 2}, d_kw={"lease_s": 2})
    seen: Counter = Counter()
    for e in (r.P, r.D):
        _count_outcomes(e, seen)
    new_requests = []
    side = r.D.sched.connector._sched
    orig_new = side.new_request

    def new_request(req, _orig=orig_new):
        new_requests.append(req.request_id)
        return _orig(req)

    side.new_request = new_request
    try:
        r.prompts["p-0"] = r.prompts["d-0"] = toks0 = [rng.randrange(100, 50000) for _ in range(40)]
        r.P.sched.add_request(H.make_request("p-0", list(toks0), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        r.run_until(lambda: "p-0" in r.P.finished)
        d0 = H.make_request("d-0", toks0, 6, dict(r.P.finished["p-0"].kv_transfer_params))
        r.D.sched.add_request(d0)
        r.run_until(lambda: "d-0" in r.D.recvd and d0 in r.D.sched.running)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        _preempt(r.D, d0)
        assert d0.kv_transfer_params.get("do_remote_prefill") is False, d0.kv_transfer_params
        r.D.sched.waiting.remove_request(d0)
        until = time.time_ns() + 4_000_000_000
        r.run_until(lambda: time.time_ns() >= until, limit_s=10)
        r.D.sched.waiting.add_request(d0)
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert new_requests == ["d-0"], new_requests
        assert r.d_first["d-0"] == 1 and not r.D.failed, (r.d_first, r.D.failed)
        twice = {k: v for k, v in seen.items() if v > 1}
        assert not twice, twice
        assert seen[("send", 0, "p-0")] == 1 and seen[("recv", 0, "d-0")] == 1, seen
        assert _free_both(r)
    finally:
        r.close()
