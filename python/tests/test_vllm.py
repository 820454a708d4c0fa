"""KvxferConnector under vLLM's own v1 Scheduler, against real kvxferd processes.

P and D are two vLLM engines (real Scheduler, real KV cache manager and block
pool, connector loaded through kv_connector_module_path), each rank's KV cache
a real CPU tensor in a shared-memory file the daemon maps. Only the model's
forward pass is replaced: P writes a known pattern into its KV. Every byte D
receives is checked per layer, head and position."""

from __future__ import annotations

import random
import time
from collections import deque

import pytest

import harness as H
from kvxfer import errors
from kvxfer.v1 import kvxfer_pb2 as pb

import vllm  # noqa: E402,F401  (a missing vLLM fails the run: CI installs it)


def _push_params(p_daemon, tid):
    host, port = p_daemon.peer.rsplit(":", 1)
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid, "remote_engine_id": "p0",
            "remote_host": host, "remote_port": int(port), "tp_size": None, "mode": "push"}


class Run:
    """Drives a P and a D engine as a router and two engine cores would."""

    def __init__(self, tmp_path, daemons, mode, p_tp, layerwise=False, policy="recompute", d_timeout=5, p_kw=None, d_kw=None,
                 backoff=0, d_tp=1):
        self.mode = mode
        # The trailing prompt tokens P leaves to D (kvxfer.vllm's
        # prefill_backoff) that the test expects: D's bytes are checked
        # over the rest.
        self.backoff = backoff
        self.dp, self.dd = daemons("p"), daemons("d")
        self.P = H.make_engine(tmp_path, "p0", "P", self.dp, mode, p_tp, layerwise, **(p_kw or {}))
        self.D = H.make_engine(tmp_path, "d0", "D", self.dd, mode, d_tp, policy=policy, timeout_s=d_timeout, **(d_kw or {}))
        self.p_tp = p_tp
        self.prompts: dict[str, list[int]] = {}
        self.checked_bytes = 0
        self.checked: set[str] = set()
        self.pending_d: dict[str, tuple] = {}  # pull: D requests waiting for P's params
        self.p_done_params: dict[str, dict] = {}
        self.held_violations: list[str] = []
        # Prompt tokens each P request computed, and the tokens each D
        # request's first scheduled step computed (after its KV arrived).
        self.p_computed: dict[str, int] = {}
        self.d_first: dict[str, int] = {}
        # vLLM's own NixlConnector decides beside ours, on both engines.
        self.nixl_diffs, self.nixl_calls = H.attach_nixl_shadow(self.P, mode)
        self.nixl_diffs_d, self.nixl_calls_d = H.attach_nixl_shadow(self.D, mode)
        # What each scheduler-side connector sends the daemon per step:
        # unary calls (round trips) and messages on its Steps stream.
        self.trips = {"p0": 0, "d0": 0}
        self.sends = {"p0": 0, "d0": 0}
        self.max_trips = self.max_sends = 0
        for e in (self.P, self.D):
            side = e.sched.connector._sched
            client = e.sched.connector.client
            orig_call = client.call

            def call(*a, _orig=orig_call, _name=e.name, **k):
                self.trips[_name] += 1
                return _orig(*a, **k)

            client.call = call
            if side.stream is not None:
                orig_send = side.stream.send

                def send(*a, _orig=orig_send, _name=e.name, **k):
                    self.sends[_name] += 1
                    return _orig(*a, **k)

                side.stream.send = send
        # Layer-wise push: count the LayerSaved signals P's ranks send, and
        # those naming another step than the one whose forward saves the
        # layer (the step bound to the connector then): such a signal comes
        # a step late, after the forward that could have overlapped it.
        self.layer_signals = 0
        self.late_signals = 0
        for rank in self.P.ranks:
            stream = rank.connector._worker.stream
            orig = stream.layer_saved

            def counted(step, layer, _orig=orig, _c=rank.connector):
                self.layer_signals += 1
                meta = _c._get_connector_metadata()
                bound = meta.step_ref or (pb.StepMeta.FromString(meta.step_meta).step if meta.step_meta else 0)
                self.late_signals += step != bound
                return _orig(step, layer)

            stream.layer_saved = counted

    def add(self, n, tokens, max_tokens=3, abort_d_before=False, p_max_tokens=1, router_tid=True):
        tid = f"t{n}"
        self.prompts[f"p-{n}"] = tokens
        self.prompts[f"d-{n}"] = tokens
        # P gets its own copy: the connector may trim P's prompt in place.
        # (router_tid False: a router that names no transfer, pull only.)
        p_params = {"do_remote_decode": True, "transfer_id": tid} if router_tid else {"do_remote_decode": True}
        self.P.sched.add_request(H.make_request(f"p-{n}", list(tokens), p_max_tokens, p_params, self.P.block))
        if self.mode == "push":
            params = _push_params(self.dp, tid)
            params["tp_size"] = self.p_tp
            self.D.sched.add_request(H.make_request(f"d-{n}", tokens, max_tokens, params, self.D.block))
            if abort_d_before:
                self.abort_d(f"d-{n}")
        else:
            self.pending_d[f"p-{n}"] = (f"d-{n}", tokens, max_tokens, abort_d_before)

    def abort_d(self, rid):
        from vllm.v1.request import RequestStatus
        for req in self.D.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED):
            self.D.finished[req.request_id] = req

    def _stepped(self, e):
        self.max_trips = max(self.max_trips, self.trips[e.name])
        self.max_sends = max(self.max_sends, self.sends[e.name])
        self.trips[e.name] = self.sends[e.name] = 0

    def step(self):
        so, _ = H.step(self.P, self.prompts)
        for rid, n in so.num_scheduled_tokens.items():
            self.p_computed[rid] = self.p_computed.get(rid, 0) + n
        self._stepped(self.P)
        for rid, o in list(self.P.finished.items()):
            if rid in self.pending_d and o.kv_transfer_params is not None:
                did, tokens, mt, abort = self.pending_d.pop(rid)
                self.D.sched.add_request(H.make_request(did, tokens, mt, dict(o.kv_transfer_params), self.D.block))
                if abort:
                    self.abort_d(did)
        # Blocks held for a transfer stay allocated until P reports the send.
        for rid, o in self.P.finished.items():
            if o.kv_transfer_params is not None and rid not in self.P.sent and rid not in self.P.sched.requests:
                self.held_violations.append(rid)
        before = set(self.D.recvd)
        so, _ = H.step(self.D, self.prompts, fill=False)
        for rid, n in so.num_scheduled_tokens.items():
            # Less the draft slots a speculative decoder schedules beside.
            self.d_first.setdefault(rid, n - len(so.scheduled_spec_decode_tokens.get(rid, ())))
        self._stepped(self.D)
        for rid in self.D.recvd - before:
            if rid in self.D.sched.requests and rid not in self.D.failed:
                tokens = self.prompts[rid]
                loaded = self.loaded(len(tokens))
                self.checked_bytes += H.check_kv(self.D, rid, tokens, loaded)
                self.checked.add(rid)

    def loaded(self, prompt: int) -> int:
        """The prompt tokens D loads (the backoff's rule)."""
        return prompt - self.backoff if self.backoff and prompt > self.backoff else prompt

    def run_until(self, done, limit_s=90):
        deadline = time.monotonic() + limit_s
        while not done():
            assert time.monotonic() < deadline, f"not done: P finished {sorted(self.P.finished)}, D finished {sorted(self.D.finished)}, " \
                f"P sent {sorted(self.P.sent)}, D recvd {sorted(self.D.recvd)}, P waiting {len(self.P.sched.requests)}, " \
                f"D waiting {len(self.D.sched.requests)}"
            self.step()
            time.sleep(0.002)

    def close(self):
        H.shutdown(self.P)
        H.shutdown(self.D)


CASES = [
    ("daemon", "push", 1, False, "daemon"), ("daemon", "push", 2, False, "daemon"),
    ("daemon", "pull", 1, False, "daemon"), ("daemon", "pull", 2, False, "daemon"),
    ("daemon", "push", 1, True, "daemon"), ("daemon", "push", 2, True, "daemon"),
    # The metadata relay (ranks on other hosts than the scheduler).
    ("daemon", "push", 2, False, "metadata"), ("daemon", "pull", 2, False, "metadata"),
    ("daemon", "push", 2, True, "metadata"),
    # In-process (relay auto: the metadata inside vLLM's), plain host
    # tensors named by address.
    ("in-process", "push", 1, False, "auto"), ("in-process", "push", 2, False, "auto"),
    ("in-process", "pull", 1, False, "auto"), ("in-process", "pull", 2, False, "auto"),
    ("in-process", "push", 2, True, "auto"),
]


@pytest.mark.parametrize("placement,mode,p_tp,layerwise,relay", CASES,
                         ids=[f"{pl}-{m}-tp{t}to1{'-layerwise' if lw else ''}-{rl}" for pl, m, t, lw, rl in CASES])
def test_transfer(tmp_path, daemons, placement, mode, p_tp, layerwise, relay):
    rng = random.Random(f"{mode}{p_tp}{layerwise}{relay}")
    r = Run(tmp_path, daemons, mode, p_tp, layerwise, p_kw={"relay": relay}, d_kw={"relay": relay})
    try:
        shared = [rng.randrange(100, 50000) for _ in range(2 * H.BLOCK)]
        # A first wave, then requests sharing its prefix (prefix hits on D),
        # plus one D request aborted before it is scheduled.
        r.add(0, shared + [rng.randrange(100, 50000) for _ in range(21)])
        for n in range(1, 4):
            r.add(n, [rng.randrange(100, 50000) for _ in range(rng.randrange(10, 90))])
        r.run_until(lambda: {"d-0", "d-1", "d-2", "d-3"} <= set(r.D.finished))
        for n in range(4, 8):
            r.add(n, shared + [rng.randrange(100, 50000) for _ in range(rng.randrange(1, 60))])
        r.add(8, [rng.randrange(100, 50000) for _ in range(50)], abort_d_before=True)
        want_d = {f"d-{n}" for n in range(9)}
        want_p = {f"p-{n}" for n in range(9)}
        r.run_until(lambda: want_d <= set(r.D.finished) and want_p <= set(r.P.finished)
                    and not r.P.sched.requests and not r.D.sched.requests)
        # Every request reached vLLM's finished state on both sides.
        assert all(r.D.finished[f"d-{n}"].finish_reason is not None for n in range(8))
        assert r.D.finished["d-8"].is_finished()
        # Every received request's bytes were checked.
        assert not r.D.failed, r.D.failed
        assert {f"d-{n}" for n in range(8)} <= r.checked, sorted(r.checked)
        assert r.checked_bytes > 0
        assert r.D.recvd >= {f"d-{n}" for n in range(8)}
        # Blocks were held for the transfer until P reported the send, and
        # every block went back to the pool on both sides.
        assert not r.held_violations, r.held_violations
        # Blocks are held and freed exactly when vLLM's NixlConnector would.
        assert not r.nixl_diffs and not r.nixl_diffs_d, r.nixl_diffs + r.nixl_diffs_d
        assert r.nixl_calls["finished"] >= 9 and r.nixl_calls_d["matched"] >= 8 and r.nixl_calls_d["finished"] >= 9, \
            (r.nixl_calls, r.nixl_calls_d)
        assert r.P.sent >= {f"p-{n}" for n in range(8)}
        assert r.P.sched.kv_cache_manager.block_pool.get_num_free_blocks() == r.P.initial_free
        assert r.D.sched.kv_cache_manager.block_pool.get_num_free_blocks() == r.D.initial_free
        # The connector's stats (vLLM logs them) count the transfers, on the
        # side that posts them: P writes in push, D reads in pull.
        poster = r.P if mode == "push" else r.D
        assert poster.stats.get("transfers", 0) >= 8 * (p_tp if mode == "push" else 1), poster.stats
        assert poster.stats.get("failed_transfers", 0) == 0, poster.stats
        # Prefix hits moved less: d-4..d-7 found the shared prefix (2
        # blocks, d-0's, cached on D) and received only the blocks after
        # it; the others received every block of their prompt. A block
        # holds all layers' K and V of all heads (the P ranks' shares sum
        # to it), so the bytes moved are exactly those blocks'.
        block_bytes = H.LAYERS * H.HEADS * H.BLOCK * 2 * H.HEAD_SIZE * H.DTYPE.itemsize
        hit = {n: (2 if n >= 4 else 0) for n in range(8)}
        blocks = {n: -(-len(r.prompts[f"d-{n}"]) // H.BLOCK) - hit[n] for n in range(8)}
        assert poster.stats.get("bytes", 0) == sum(blocks.values()) * block_bytes, \
            (poster.stats.get("bytes"), blocks, block_bytes)
        from kvxfer.vllm import KvxferConnector
        summary = KvxferConnector.build_kv_connector_stats(dict(poster.stats)).reduce()
        assert summary["avg_mib"] > 0, summary
        # (In-process, both engines of this test share the process's one
        # server, whose same-process copy completes inside its post: the
        # Go worker's clock sees no time pass.)
        assert summary["avg_transfer_ms"] > 0 or placement == "in-process", summary
        # The scheduler side talked to the daemon once per step: one message
        # on its Steps stream and no round trip (relay "daemon"), or one
        # Step call (relay "metadata").
        if relay == "daemon":
            assert (r.max_trips, r.max_sends) == (0, 1), (r.max_trips, r.max_sends)
        else:
            assert (r.max_trips, r.max_sends) == (1, 0), (r.max_trips, r.max_sends)
        if layerwise:
            # Every prefill completed in a step of its own here: each P rank
            # signalled all its layers for each request's prefill step.
            assert r.layer_signals >= H.LAYERS * p_tp, r.layer_signals
            assert r.late_signals == 0, f"{r.late_signals} of {r.layer_signals} LayerSaved signals named the step before the forward's"
        else:
            assert r.layer_signals == 0
    finally:
        r.close()
    # Every decision was also the daemon's Scheduler's, in this relay mode:
    # each matched-token count, and each request_finished answer (the last
    # ones sent and checked at shutdown).
    assert _verified(r.P)["finished"] >= 9 and _verified(r.D)["finished"] >= 9, (_verified(r.P), _verified(r.D))
    assert _verified(r.P)["matched"] >= 9 and _verified(r.D)["matched"] >= 8, (_verified(r.P), _verified(r.D))


def test_pull_hold_without_transfer_id_is_named(tmp_path, daemons):
    """Pull, a router that names no transfer: P's params name each hold by a
    transfer id of its own (its consumer echoes it, so a late consumer of an
    earlier request under the same id can neither read nor end this one),
    the daemon's Scheduler agrees (verify), and the transfers go through
    byte for byte. Before, the params named none."""
    rng = random.Random("hold-tid")
    r = Run(tmp_path, daemons, "pull", 1)
    try:
        for n in range(2):
            r.add(n, [rng.randrange(100, 50000) for _ in range(40)], router_tid=False)
        want = {"p-0", "p-1"}
        r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and want <= set(r.P.finished) and want <= r.P.sent
                    and not r.P.sched.requests and not r.D.sched.requests)
        tids = [r.P.finished[f"p-{n}"].kv_transfer_params.get("transfer_id") for n in range(2)]
        assert all(isinstance(t, str) and t.startswith("kvxfer-") for t in tids) and tids[0] != tids[1], tids
        assert not r.D.failed, r.D.failed
        assert {"d-0", "d-1"} <= r.checked, sorted(r.checked)
    finally:
        r.close()
    assert _verified(r.P)["finished"] >= 2, _verified(r.P)


GEN_CASES = [("daemon", "daemon"), ("daemon", "metadata"), ("in-process", "auto")]


@pytest.mark.parametrize("placement,relay", GEN_CASES, ids=[f"{pl}-{rl}" for pl, rl in GEN_CASES])
def test_pull_params_carry_the_producers_generation(tmp_path, daemons, placement, relay):
    """Pull: the params P's scheduler side makes for a finished request,
    its very first included, carry P's generation (remote_generation: one
    empty step as its scheduler opens asks it, then every answer's
    StepResponse.generation), the same the daemon's Scheduler stamps on its
    own answer for the row (verify: counted where both know it), in both
    relays and placements; D, reading them, moves and checks every byte.
    Before, the connector's params carried none: a consumer could not tell
    them from a restarted producer's."""
    rng = random.Random(f"gen-{placement}-{relay}")
    r = Run(tmp_path, daemons, "pull", 1, p_kw={"relay": relay}, d_kw={"relay": relay})
    try:
        r.add(0, [rng.randrange(100, 50000) for _ in range(40)])  # P's first params
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests)
        for n in range(1, 4):
            r.add(n, [rng.randrange(100, 50000) for _ in range(rng.randrange(20, 70))])
        want = {f"d-{n}" for n in range(1, 4)}
        r.run_until(lambda: want <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests)
        gens = {r.P.finished[f"p-{n}"].kv_transfer_params.get("remote_generation") for n in range(4)}
        assert len(gens) == 1 and isinstance(next(iter(gens)), int) and next(iter(gens)) > 0, gens
        assert not r.D.failed, r.D.failed
        assert want | {"d-0"} <= r.checked, sorted(r.checked)
        assert _free_both(r)
    finally:
        r.close()
    # The daemon's Scheduler stamped the same generation on each of those
    # rows (the comparison that verify makes apart from the rest).
    assert _verified(r.P)["generation"] >= 3, _verified(r.P)


def _restart_p(r, tmp_path):
    """P's engine goes and a new one of the same id comes up on the same
    server (its rank attaches again: a new generation), as a restarted
    engine's would; Run's P is the new one."""
    H.shutdown(r.P)
    r.P = H.make_engine(tmp_path, "p0", "P", r.dp, "pull", 1)


def test_pull_params_of_a_restarted_producer_are_not_read(tmp_path, daemons, caplog):
    """Pull: P issues a request's params, then restarts (its rank attaches
    again: a new generation) before D reads them. D's handshake is by then
    the new P's (a request issued after the restart moved), whose blocks
    under the old params' ids may hold another request's KV: the old
    params' request fails (recomputed here, never reported loaded), its
    failure naming both generations, and the requests issued after the
    restart move and check byte for byte. Before, the connector's params
    carried no generation and D could not tell them from the new P's."""
    rng = random.Random("gen-restart")
    r = Run(tmp_path, daemons, "pull", 1)
    try:
        r.add(0, [rng.randrange(100, 50000) for _ in range(40)])  # D's handshake with P; P's first answers
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests)
        assert "d-0" in r.checked
        # p-1's params, which the router holds on to while P restarts.
        r.prompts["p-1"] = r.prompts["d-1"] = toks1 = [rng.randrange(100, 50000) for _ in range(40)]
        r.P.sched.add_request(H.make_request("p-1", list(toks1), 1, {"do_remote_decode": True, "transfer_id": "t1"}))
        deadline = time.monotonic() + 30
        while "p-1" not in r.P.finished:
            assert time.monotonic() < deadline, "p-1 never finished"
            H.step(r.P, r.prompts)
        old = dict(r.P.finished["p-1"].kv_transfer_params)
        assert old.get("remote_generation"), old
        _restart_p(r, tmp_path)
        # Requests after the restart, one after the other (the new P's
        # first params may carry no generation yet: relay "daemon" has had
        # no answer then): D now handshakes the new P.
        for n in (2, 3):
            r.add(n, [rng.randrange(100, 50000) for _ in range(40)])
            r.run_until(lambda: f"d-{n}" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests)
        assert {"d-2", "d-3"} <= r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        new = r.P.finished["p-3"].kv_transfer_params.get("remote_generation")
        assert new and new != old["remote_generation"], (new, old)
        # The new P holds blocks for a request of its own (p-4) while D
        # reads the old params.
        r.add(4, [rng.randrange(100, 50000) for _ in range(40)])
        r.D.sched.add_request(H.make_request("d-1", toks1, 2, old))
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            r.run_until(lambda: {"d-1", "d-4"} <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests)
        assert "d-1" in r.D.failed and "d-1" not in r.checked, (sorted(r.D.failed), sorted(r.checked))
        assert not str(r.D.finished["d-1"].finish_reason).lower().endswith("error")  # recomputed
        why = [m for m in caplog.messages if "d-1" in m and "failed" in m]
        assert any(f"issued this request's params at generation {old['remote_generation']} and is at generation {new}"
                   in m for m in why), why
        assert "d-4" in r.checked and r.D.failed == {"d-1"}, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
    finally:
        r.close()


def test_pull_read_after_the_lease_is_not_loaded(tmp_path, daemons, caplog):
    """Pull, P's lease 2 s: the router hands D p-0's params only after
    p-0's lease lapsed (D's request waited; nothing extended the hold) and
    P gave its blocks back, another request held since. D's d-0 is not
    loaded: it fails before any READ, naming the expiry its params carry,
    and is recomputed (over NIXL, which has no grant to refuse it, a READ
    of blocks P reused loads another request's KV); d-1, read in time,
    moves and checks byte for byte; both engines give every block back.
    Before, the connector's pull params carried no expiry: d-0 was READ
    (refused here by the built-in backend's grants, after its retries)."""
    rng = random.Random("late-pull")
    r = Run(tmp_path, daemons, "pull", 1, p_kw={"lease_s": 2})
    try:
        r.prompts["p-0"] = r.prompts["d-0"] = toks0 = [rng.randrange(100, 50000) for _ in range(40)]
        r.P.sched.add_request(H.make_request("p-0", list(toks0), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        r.run_until(lambda: "p-0" in r.P.finished)
        late = dict(r.P.finished["p-0"].kv_transfer_params)
        assert late.get("remote_blocks_expiry_unix_nanos", 0) > time.time_ns(), late
        # p-0's lease lapses unread: P gives its blocks back.
        r.run_until(lambda: "p-0" in r.P.sent and not r.P.sched.requests, limit_s=15)
        assert time.time_ns() >= late["remote_blocks_expiry_unix_nanos"]
        r.add(1, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: "p-1" in r.P.finished)
        r.D.sched.add_request(H.make_request("d-0", toks0, 2, late))
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests,
                        limit_s=30)
        assert "d-0" in r.D.failed and "d-0" not in r.checked, (sorted(r.D.failed), sorted(r.checked))
        assert not str(r.D.finished["d-0"].finish_reason).lower().endswith("error")  # recomputed
        why = [m for m in caplog.messages if "d-0" in m]
        assert any("expire" in m for m in why), why
        assert "d-1" in r.checked and r.D.failed == {"d-0"}, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
    finally:
        r.close()


def test_pull_queued_past_the_lease_is_loaded(tmp_path, daemons, placement):
    """Pull, both engines' lease 2 s (their servers' too: D heartbeats
    every third of a second): D's d-0 waits in D's queue (not
    allocated, as vLLM keeps a request while its run slots are taken) 4 s,
    twice P's lease, then is scheduled. D's ranks heartbeat P for it from
    its arrival (on_new_request), P keeps its hold and answers with it, so
    d-0 is loaded and checks byte for byte, and both engines give every
    block back. Before, D's heartbeats began with the request's
    allocation: P's hold lapsed while d-0 waited, and d-0 was recomputed."""
    rng = random.Random("queued-pull")

    def leased(name):
        if placement == "in-process":
            return H.InProcess(tmp_path, name, server={"lease": "2s"})
        return daemons(name, ["-lease", "2s"])

    r = Run(tmp_path, leased, "pull", 1, p_kw={"lease_s": 2}, d_kw={"lease_s": 2})
    try:
        r.prompts["p-0"] = r.prompts["d-0"] = toks0 = [rng.randrange(100, 50000) for _ in range(40)]
        r.P.sched.add_request(H.make_request("p-0", list(toks0), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        r.run_until(lambda: "p-0" in r.P.finished)
        prm = dict(r.P.finished["p-0"].kv_transfer_params)
        d0 = H.make_request("d-0", toks0, 2, prm)
        r.D.sched.add_request(d0)
        # Held out of D's waiting queue: vLLM does not schedule it.
        r.D.sched.waiting.remove_request(d0)
        until = time.time_ns() + 4_000_000_000
        r.run_until(lambda: time.time_ns() >= until, limit_s=10)
        assert time.time_ns() > prm["remote_blocks_expiry_unix_nanos"] + 1_000_000_000
        assert "p-0" not in r.P.sent, "P let p-0's blocks go while d-0 waited"
        r.D.sched.waiting.add_request(d0)
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
    finally:
        r.close()


def _sum_stats(e) -> dict:
    """Sums the stats engine e's scheduler-side connector reports from now
    on (vLLM takes and clears them each step), by key, into the returned
    dict."""
    seen = {}
    orig = e.sched.connector.get_kv_connector_stats

    def stats():
        s = orig()
        for k, v in (s.data if s is not None else {}).items():
            seen[k] = seen.get(k, 0) + v
        return s

    e.sched.connector.get_kv_connector_stats = stats
    return seen


@pytest.mark.parametrize("junk", [-1, 1 << 64, "x", 1.5, float(1 << 60)])
def test_junk_generation_on_d_is_refused_and_counted(tmp_path, daemons, junk, caplog):
    """Pull: D gets P's params with remote_generation tampered (no integer
    0..2^64-1, or a float, which may have lost a generation's digits): that
    request is refused with a warning naming the field and its value,
    counted in the connector's bad_params and computed on D; the request
    beside it moves and checks byte for byte."""
    rng = random.Random(f"gen-junk-{junk!r}")
    r = Run(tmp_path, daemons, "pull", 1, p_kw={"lease_s": 2})
    seen = _sum_stats(r.D)
    try:
        for n in range(2):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", r.prompts[f"p-{n}"], 1, {"do_remote_decode": True, "transfer_id": f"t{n}"}))
        r.run_until(lambda: {"p-0", "p-1"} <= set(r.P.finished))
        good = dict(r.P.finished["p-0"].kv_transfer_params)
        bad = dict(r.P.finished["p-1"].kv_transfer_params, remote_generation=junk)
        r.D.sched.add_request(H.make_request("d-0", r.prompts["d-0"], 2, good))
        r.D.sched.add_request(H.make_request("d-1", r.prompts["d-1"], 2, bad))
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests,
                        limit_s=30)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert "d-1" not in r.D.recvd, r.D.recvd  # computed on D, nothing awaited
        assert any("d-1" in m and f"kv_transfer_params.remote_generation = {junk!r}" in m for m in caplog.messages), \
            caplog.messages
        assert seen.get("bad_params", 0) >= 1, seen
        assert _free_both(r)
    finally:
        r.close()


def test_prefix_hit_on_d_moves_only_the_rest(tmp_path, daemons):
    """D already holds the shared prefix: the transfer fills only the blocks
    after it (checked in what the connector sends the daemon), and D's
    bytes are right over the whole prompt."""
    rng = random.Random(7)
    r = Run(tmp_path, daemons, "push", 1)
    try:
        shared = [rng.randrange(100, 50000) for _ in range(3 * H.BLOCK)]
        r.add(0, shared + [1, 2, 3])
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests)
        # Same prefix again: D's prefix cache holds 3 blocks.
        r.add(1, shared + [4, 5, 6, 7])
        seen = []
        side = r.D.sched.connector._sched
        # Each step goes out on the Steps stream (relay daemon) or in a
        # Step call (relay metadata, in-process).
        target, attr = (side.stream, "send") if side.stream is not None else (side.sched, "step_request")
        orig = getattr(target, attr)

        def spy(req):
            step = req.step if req.DESCRIPTOR.name == "StepsRequest" else req
            c = step.columns.after_alloc  # one cache group: one block list per row
            ids, pos = list(c.block_ids), 0
            for i, rid in enumerate(c.request_id):
                seen.append((rid, [ids[pos:pos + c.block_lens[i]]], c.computed[i]))
                pos += c.block_lens[i]
            return orig(req)

        setattr(target, attr, spy)
        r.run_until(lambda: "d-1" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests)
        d1 = [x for x in seen if x[0] == "d-1"]
        assert d1 and d1[0][2] == 3 * H.BLOCK and len(d1[0][1][0]) == 1, d1
        assert "d-1" in r.checked
    finally:
        r.close()


def test_factory_loads_the_module_path(tmp_path, daemons, placement):
    """vLLM's KVConnectorFactory loads the connector from
    kv_connector_module_path, exactly as a user's --kv-transfer-config."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA

    from kvxfer.vllm import KvxferConnector
    ktc = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.vllm", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc) is KvxferConnector
    assert issubclass(KvxferConnector, SupportsHMA)
    d = daemons("p")
    cfg = H.vllm_config(tmp_path, "p0", d, "push", 1)
    kvc = H.kv_cache_config(cfg, 1, 32)
    c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kvc)
    assert isinstance(c, KvxferConnector)
    if placement == "daemon":
        assert c._sched.addr == d.peer
        c.shutdown()
        return
    # In-process: this process's own server (an abstract socket of its
    # own), at a peer port the system picked (peer_port 0).
    host, port = c._sched.addr.rsplit(":", 1)
    assert c.address.startswith("unix-abstract:") and host == "127.0.0.1" and int(port) > 0, (c.address, c._sched.addr)
    c.shutdown()
    # With a base port, the scheduler side (no rank in its process) names
    # the engine by HOST:BASE, where its rank 0 listens, and data-parallel
    # rank 1 of TP 2 by BASE + 2; its own server listens elsewhere.
    base = H.free_port()
    for dp, want in ((0, base), (1, base + 2)):
        cfg = H.vllm_config(tmp_path, f"p0_dp{dp}", d, "push", 2)
        cfg.kv_transfer_config.kv_connector_extra_config["peer_port"] = base
        cfg.parallel_config.data_parallel_index = dp
        c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, H.kv_cache_config(cfg, 2, 32))
        try:
            assert c._sched.addr == f"127.0.0.1:{want}", (dp, c._sched.addr)
        finally:
            c.shutdown()


@pytest.mark.placement("daemon")  # the daemon process itself is what the test breaks
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_daemon_killed(tmp_path, daemons, policy):
    """D's kvxferd dies while D waits for KV: every affected request ends
    (recomputed or failed, per kv_load_failure_policy), nothing hangs, and
    shutdown returns."""
    rng = random.Random(policy)
    r = Run(tmp_path, daemons, "push", 1, policy=policy, d_timeout=2)
    try:
        # P never runs: D's requests stay waiting for their KV.
        for n in range(4):
            r.prompts[f"d-{n}"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
            p = _push_params(r.dp, f"t{n}")
            p["tp_size"] = 1
            r.D.sched.add_request(H.make_request(f"d-{n}", toks, 2, p))
        for _ in range(5):
            H.step(r.D, r.prompts, fill=False)
        assert len(r.D.sched.requests) == 4 and not r.D.finished
        r.dd.kill()
        deadline = time.monotonic() + 30
        while len(r.D.finished) < 4:
            assert time.monotonic() < deadline, f"D finished only {sorted(r.D.finished)} after its daemon died"
            H.step(r.D, r.prompts, fill=False)
            time.sleep(0.01)
        reasons = {o.finish_reason for o in r.D.finished.values()}
        if policy == "fail":
            assert all(str(x).lower().endswith("error") for x in reasons), reasons
        else:
            assert not any(str(x).lower().endswith("error") for x in reasons), reasons
        # Steps go on without a daemon: no exception, no hang.
        t0 = time.monotonic()
        H.step(r.D, r.prompts, fill=False)
        assert time.monotonic() - t0 < 10
    finally:
        t0 = time.monotonic()
        r.close()
        assert time.monotonic() - t0 < 60


def _free_both(r):
    return (r.P.sched.kv_cache_manager.block_pool.get_num_free_blocks() == r.P.initial_free
            and r.D.sched.kv_cache_manager.block_pool.get_num_free_blocks() == r.D.initial_free)


def test_bad_params_lose_nothing_else(tmp_path, daemons, caplog):
    """Pull: P's params reach D tampered for one request (a second block
    group the engine does not have). The daemon refuses that request alone:
    it is recomputed on D, its P blocks go back when P's lease expires, and
    the request beside it in the same step moves and checks byte for byte."""
    rng = random.Random(3)
    r = Run(tmp_path, daemons, "pull", 1, p_kw={"lease_s": 2})
    try:
        for n in range(2):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", r.prompts[f"p-{n}"], 1, {"do_remote_decode": True, "transfer_id": f"t{n}"}))
        r.run_until(lambda: {"p-0", "p-1"} <= set(r.P.finished))
        good = dict(r.P.finished["p-0"].kv_transfer_params)
        bad = dict(r.P.finished["p-1"].kv_transfer_params)
        bad["remote_block_ids"] = [list(bad["remote_block_ids"][0]), [1, 2]]
        bad["remote_block_starts"] = [0, 0]
        r.D.sched.add_request(H.make_request("d-0", r.prompts["d-0"], 2, good))
        r.D.sched.add_request(H.make_request("d-1", r.prompts["d-1"], 2, bad))
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests)
        assert "d-0" in r.checked and "d-1" in r.D.failed
        assert not str(r.D.finished["d-1"].finish_reason).lower().endswith("error")
        assert any("d-1" in m and "RemoteBlockIDs has 2 groups" in m for m in caplog.messages), caplog.messages
        assert _free_both(r)
    finally:
        r.close()


def test_unhashable_mode_param_is_refused_not_raised(tmp_path, daemons, caplog):
    """Push: a router hands D requests whose mode (or NixlConnector's
    transfer_mode) is a list or an object, not a string. vLLM's scheduler
    loop never sees an exception (get_num_new_matched_tokens is called
    inside schedule()): each such request is refused with a warning naming
    the field and its value and computed on D, its P blocks go back when
    P's lease expires, and the well-formed request beside them moves and
    checks byte for byte."""
    rng = random.Random(23)
    r = Run(tmp_path, daemons, "push", 1, p_kw={"lease_s": 2})
    try:
        odd = {1: {"mode": ["push"]}, 2: {"transfer_mode": {"push": True}}}
        for n in range(3):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", list(toks), 1, {"do_remote_decode": True, "transfer_id": f"t{n}"}))
            p = {**_push_params(r.dp, f"t{n}"), "tp_size": 1, **odd.get(n, {})}
            if "transfer_mode" in p:
                del p["mode"]
            r.D.sched.add_request(H.make_request(f"d-{n}", toks, 2, p))
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            r.run_until(lambda: {"d-0", "d-1", "d-2"} <= set(r.D.finished) and not r.P.sched.requests
                        and not r.D.sched.requests, limit_s=30)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert not ({"d-1", "d-2"} & r.D.recvd), r.D.recvd  # computed on D, nothing awaited
        for rid, field in (("d-1", "kv_transfer_params.mode = ['push']"), ("d-2", "kv_transfer_params.mode = {'push': True}")):
            assert any(rid in m and field in m for m in caplog.messages), (rid, caplog.messages)
        assert _free_both(r)
    finally:
        r.close()


def test_malformed_remote_host_is_refused_and_loses_nothing_else(tmp_path, daemons, caplog):
    """Push: a router hands D requests whose remote_host is no host (the
    host with its port, as HOST:PORT; a space in it), first in the step,
    beside a well-formed request for the same producer. Each is refused
    with a warning naming kv_transfer_params.remote_host and its value,
    counted in bad_params and computed on D; P's blocks go back when P's
    lease expires. Before, such a host went on into a peer address no peer
    has ("[127.0.0.1:7600]:7600"): the first request's address became the
    producer engine's, its handshake failed, and the well-formed request
    for that engine failed with it."""
    rng = random.Random(29)
    r = Run(tmp_path, daemons, "push", 1, p_kw={"lease_s": 2})
    try:
        host, port = r.dp.peer.rsplit(":", 1)
        odd = {1: {"remote_host": f"{host}:{port}"}, 2: {"remote_host": f"{host} "}}
        for n in (1, 2, 0):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", list(toks), 1, {"do_remote_decode": True, "transfer_id": f"t{n}"}))
            p = {**_push_params(r.dp, f"t{n}"), "tp_size": 1, **odd.get(n, {})}
            r.D.sched.add_request(H.make_request(f"d-{n}", toks, 2, p))
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            r.run_until(lambda: {"d-0", "d-1", "d-2"} <= set(r.D.finished) and not r.P.sched.requests
                        and not r.D.sched.requests, limit_s=30)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert not ({"d-1", "d-2"} & r.D.recvd), r.D.recvd  # computed on D, nothing awaited
        for rid, v in (("d-1", f"{host}:{port}"), ("d-2", f"{host} ")):
            assert any(rid in m and f"kv_transfer_params.remote_host = {v!r}" in m for m in caplog.messages), (rid, caplog.messages)
        assert _free_both(r)
    finally:
        r.close()


def test_d_abort_while_waiting(tmp_path, daemons):
    """A D request aborted while it waits for its KV keeps its blocks (vLLM
    delays the free) until kvxfer reports the receive ended; then they go."""
    rng = random.Random(5)
    r = Run(tmp_path, daemons, "push", 1)
    try:
        r.prompts["d-0"] = r.prompts["p-0"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
        p = _push_params(r.dp, "t0")
        p["tp_size"] = 1
        r.D.sched.add_request(H.make_request("d-0", toks, 3, p))
        for _ in range(3):
            H.step(r.D, r.prompts, fill=False)
        r.abort_d("d-0")
        assert "d-0" in r.D.sched.requests  # blocks held: a WRITE may still land
        r.P.sched.add_request(H.make_request("p-0", toks, 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        r.run_until(lambda: not r.P.sched.requests and not r.D.sched.requests)
        assert "d-0" in r.D.recvd and "p-0" in r.P.sent
        assert _free_both(r)
    finally:
        r.close()


def test_incompatible_layouts_refused_with_one_clear_error(tmp_path, daemons, caplog):
    """D runs NHD (VLLM_KV_CACHE_LAYOUT=LBNHC), P HND: the pair is refused at
    handshake with an error naming both layouts; D recomputes, P frees."""
    rng = random.Random(9)
    r = Run(tmp_path, daemons, "push", 1, d_kw={"layout": "LBNHC"})
    try:
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            for n in range(3):
                r.add(n, [rng.randrange(100, 50000) for _ in range(40)])
            r.run_until(lambda: {"d-0", "d-1", "d-2"} <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests)
        msgs = [m for m in caplog.messages if "incompatible KV layouts" in m]
        assert msgs, caplog.messages
        assert "HND" in msgs[0] and "NHD" in msgs[0], msgs[0]
        assert not r.checked and r.D.failed == {"d-0", "d-1", "d-2"}  # nothing was received
        assert all(not str(o.finish_reason).lower().endswith("error") for o in r.D.finished.values())
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.placement("daemon")  # the daemon process itself is what the test breaks
def test_p_daemon_killed(tmp_path, daemons):
    """P's kvxferd dies while P holds blocks for transfers and D waits: P
    frees them, D's requests end within its registration timeout
    (recomputed), nothing hangs."""
    rng = random.Random(11)
    r = Run(tmp_path, daemons, "push", 1, d_kw={"registration_timeout_s": 3})
    try:
        for n in range(3):
            r.prompts[f"p-{n}"] = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", r.prompts[f"p-{n}"], 1, {"do_remote_decode": True, "transfer_id": f"x{n}"}))
        r.run_until(lambda: {"p-0", "p-1", "p-2"} <= set(r.P.finished))
        assert len(r.P.sched.requests) == 3  # held for D's registrations
        r.dp.kill()
        for n in range(3):
            r.prompts[f"d-{n}"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
            p = _push_params(r.dp, f"t{n}")
            p["tp_size"] = 1
            r.D.sched.add_request(H.make_request(f"d-{n}", toks, 2, p))
        t0 = time.monotonic()
        r.run_until(lambda: not r.P.sched.requests and {"d-0", "d-1", "d-2"} <= set(r.D.finished)
                    and not r.D.sched.requests, limit_s=30)
        assert time.monotonic() - t0 < 3 + 10
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.placement("daemon")  # the daemon process itself is what the test breaks
def test_d_daemon_restarted(tmp_path, daemons, caplog):
    """D's kvxferd restarts mid-run (pull): the requests it held end (here
    recomputed), D's scheduler side opens a new scheduler and its rank
    attaches again with the same memory, and the requests after that move
    and check byte for byte: the engine does not stay broken."""
    rng = random.Random(13)
    # P's lease is short: what the old daemon left held on P expires soon.
    r = Run(tmp_path, daemons, "pull", 1, d_timeout=2, p_kw={"lease_s": 3})
    try:
        r.add(0, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: "d-0" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests)
        assert "d-0" in r.checked
        r.dd.restart()
        caplog.set_level("WARNING", logger="kvxfer.vllm")
        for n in range(1, 4):
            r.add(n, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: {"d-1", "d-2", "d-3"} <= set(r.D.finished) and not r.P.sched.requests
                    and not r.D.sched.requests, limit_s=60)
        # Whatever was in flight when the old daemon went failed and was
        # recomputed; once attached again, transfers go through.
        for n in range(4, 7):
            r.add(n, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: {"d-4", "d-5", "d-6"} <= set(r.D.finished) and not r.P.sched.requests
                    and not r.D.sched.requests, limit_s=60)
        assert {"d-4", "d-5", "d-6"} <= r.checked, (sorted(r.checked), sorted(r.D.failed))
        assert any("attached to kvxferd again" in m for m in caplog.messages), caplog.messages
        assert _free_both(r)
    finally:
        r.close()


def test_junk_params_on_p_are_counted_not_raised(tmp_path, daemons):
    """A router hands P requests whose remote fields are junk (P does not use
    them): vLLM's scheduler loop never sees an exception, the requests
    finish, their blocks come back, and the junk is counted in the
    connector's stats."""
    rng = random.Random(17)
    r = Run(tmp_path, daemons, "push", 1, p_kw={"lease_s": 2})
    seen = _sum_stats(r.P)
    try:
        junk = [{"remote_block_ids": "junk"}, {"remote_host": "h", "remote_port": "not a port"},
                {"remote_block_ids": [[1, -5]], "tp_size": "x"},
                # JSON's Infinity, as Python's json reads it: no integer.
                {"tp_size": float("inf"), "remote_num_tokens": float("-inf")}]
        for n, extra in enumerate(junk):
            r.prompts[f"p-{n}"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", toks, 1, {"do_remote_decode": True, "transfer_id": f"j{n}", **extra}))
        want = {f"p-{n}" for n in range(len(junk))}
        r.run_until(lambda: want <= set(r.P.finished) and not r.P.sched.requests)
        assert seen.get("bad_params", 0) >= 3, seen
        assert _free_both(r)
    finally:
        r.close()


def test_unencodable_or_non_string_ids_are_refused_not_raised(tmp_path, daemons, caplog):
    """A router hands both engines requests whose string params are no
    strings kvxfer.v1 can carry: a lone surrogate (JSON's "\\ud800", as
    Python's json reads it; protobuf cannot encode it) or an object where
    an id goes. vLLM's scheduler loop never sees an exception (before, the
    surrogate passed validate_remote and raised UnicodeEncodeError out of
    the step's encoding, and an object was sent as its repr): each such D
    request is refused with a warning naming the field and computed
    locally, each such P request finishes with its blocks back, and the
    well-formed request beside them moves and checks byte for byte."""
    rng = random.Random(29)
    r = Run(tmp_path, daemons, "push", 1, p_kw={"lease_s": 2})
    try:
        odd_d = {1: {"transfer_id": "t1\ud800"}, 2: {"remote_engine_id": "p\udcff"}, 3: {"remote_host": "h\ud800"},
                 4: {"remote_engine_id": {"id": "p0"}}, 5: {"transfer_id": ["t5"]}}
        n_d = 1 + len(odd_d)
        for n in range(n_d):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"p-{n}", list(toks), 1, {"do_remote_decode": True, "transfer_id": f"t{n}"}))
            r.D.sched.add_request(H.make_request(f"d-{n}", toks, 2, {**_push_params(r.dp, f"t{n}"), "tp_size": 1,
                                                                     **odd_d.get(n, {})}))
        odd_p = [{"transfer_id": "j\ud800"}, {"remote_request_id": "\udfff"}, {"transfer_id": {"a": 1}}]
        for n, extra in enumerate(odd_p):
            r.prompts[f"pj-{n}"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
            r.P.sched.add_request(H.make_request(f"pj-{n}", toks, 1, {"do_remote_decode": True, **extra}))
        want_d = {f"d-{n}" for n in range(n_d)}
        want_p = {f"pj-{n}" for n in range(len(odd_p))}
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            r.run_until(lambda: want_d <= set(r.D.finished) and want_p <= set(r.P.finished) and not r.P.sched.requests
                        and not r.D.sched.requests, limit_s=30)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert not (set(odd_d) and {f"d-{n}" for n in odd_d} & r.D.recvd), r.D.recvd
        for n, extra in odd_d.items():
            key = next(iter(extra))
            assert any(f"d-{n}" in m and f"kv_transfer_params.{key}" in m for m in caplog.messages), (n, caplog.messages)
        assert _free_both(r)
    finally:
        r.close()


def _daemon_disagreements(caplog):
    """The connector checks its decisions against the daemon's Scheduler
    (Go) and logs where they differ ("daemon says"); with verify (set by the
    harness) it raises too, and conftest fails the test."""
    return [m for m in caplog.messages if "daemon says" in m]


def _verified(e) -> dict:
    """How many of e's scheduler-side decisions were checked against the
    daemon's Scheduler (verify), by kind."""
    return e.sched.connector._sched.verified


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_mtp_prefill_backoff(tmp_path, daemons, mode, caplog):
    """Multi-module MTP with 3 speculative tokens (vLLM's
    num_prefill_lookahead_tokens = 3): P prefills all but the last 2 prompt
    tokens, whatever max_tokens the router sent samples one token, and
    returns remote_num_tokens = N-2; D loads those N-2 tokens' KV (checked
    byte for byte) and computes the last 2 itself. A prompt of at most 2
    tokens is not trimmed. At every call the connector decides as vLLM's
    NixlConnector does, and the daemon's Scheduler as the connector."""
    from vllm.v1.engine import FinishReason
    rng = random.Random(f"mtp{mode}")
    caplog.set_level("WARNING", logger="kvxfer.vllm")
    kw = {"mtp": 3, "relay": "metadata"}
    r = Run(tmp_path, daemons, mode, 1, p_kw=kw, d_kw=kw, backoff=2)
    try:
        lengths = {0: 64, 1: 33, 2: 17, 3: 3, 4: 2}
        for n, length in lengths.items():
            # A trimmed request samples one token, whatever it asked for;
            # an untrimmed one keeps its max_tokens (the router's 1 here).
            r.add(n, [rng.randrange(100, 50000) for _ in range(length)], p_max_tokens=8 if length > 2 else 1)
        want_d = {f"d-{n}" for n in lengths}
        r.run_until(lambda: want_d <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests)
        assert not r.nixl_diffs and not r.nixl_diffs_d, r.nixl_diffs + r.nixl_diffs_d
        assert r.nixl_calls["new"] >= 5 and r.nixl_calls["finished"] >= 5, r.nixl_calls
        assert r.nixl_calls_d["matched"] >= 5 and _verified(r.D)["matched"] >= 5, (r.nixl_calls_d, _verified(r.D))
        assert not _daemon_disagreements(caplog), caplog.messages
        for n, length in lengths.items():
            loaded = length - 2 if length > 2 else length
            p = r.P.finished[f"p-{n}"]
            assert p.finish_reason == FinishReason.LENGTH, (n, p.finish_reason)
            assert r.p_computed[f"p-{n}"] == loaded, (n, r.p_computed)
            assert p.kv_transfer_params["remote_num_tokens"] == loaded, (n, p.kv_transfer_params)
            # D's first step after its KV arrived computes what was not
            # loaded (a prompt loaded whole recomputes its last token).
            assert r.d_first[f"d-{n}"] == max(length - loaded, 1), (n, r.d_first)
        assert r.checked == want_d and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_hybrid_prefill_backoff(tmp_path, daemons, mode, caplog):
    """vLLM's test_p_side_chunked_prefill_mamba, carried through to D: a
    hybrid model (attention and Mamba groups) under vLLM's scheduler with
    32-token steps. P trims the 64-token prompt to 63 and max_tokens to 1,
    prefills it in two chunks (32 + 31), finishes LENGTH_CAPPED holding its
    blocks, and returns remote_num_tokens = 63, so its recurrent state
    covers tokens 0..62; D loads 63 tokens and computes token 63 itself, on
    a state that does not hold it yet. Each decision equals
    NixlConnector's and the daemon's Scheduler's. Scheduler side only: the
    worker side does not register Mamba state (harness docstring)."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus
    caplog.set_level("WARNING", logger="kvxfer.vllm")
    dp, dd = daemons("p"), daemons("d")
    kw = {"mamba": True, "batched": 32, "relay": "metadata"}
    P = H.make_engine(tmp_path, "p0", "P", dp, mode, 1, **kw)
    D = H.make_engine(tmp_path, "d0", "D", dd, mode, 1, **kw)
    try:
        p_diffs, p_calls = H.attach_nixl_shadow(P, mode)
        d_diffs, d_calls = H.attach_nixl_shadow(D, mode)
        tokens = list(range(1000, 1064))
        req = H.make_request("p-0", list(tokens), 128, {"do_remote_decode": True, "transfer_id": "t0"})
        P.sched.add_request(req)
        assert (req.num_prompt_tokens, len(req.prompt_token_ids), req.num_tokens, req.max_tokens) == (63, 63, 63, 1)
        assert H.sched_step(P).num_scheduled_tokens == {"p-0": 32}
        assert H.sched_step(P).num_scheduled_tokens == {"p-0": 31}
        out = P.finished["p-0"]
        assert out.finish_reason == FinishReason.LENGTH
        assert out.kv_transfer_params["remote_num_tokens"] == 63, out.kv_transfer_params
        assert "p-0" in P.sched.requests  # held for the transfer

        params = dict(out.kv_transfer_params) if mode == "pull" else {**_push_params(dp, "t0"), "tp_size": 1}
        D.sched.add_request(H.make_request("d-0", list(tokens), 3, params))
        assert H.sched_step(D).num_scheduled_tokens == {}
        assert D.sched.requests["d-0"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        # What kvxfer's workers report once the KV arrived.
        H.sched_step(D, finished_recving={"d-0"})
        assert D.sched.requests["d-0"].num_computed_tokens == 63
        assert H.sched_step(D).num_scheduled_tokens == {"d-0": 1}
        H.sched_step(P, finished_sending={"p-0"})
        for _ in range(10):
            if "d-0" in D.finished:
                break
            H.sched_step(D)
        assert "d-0" in D.finished and not P.sched.requests and not D.sched.requests
        assert not p_diffs and not d_diffs, p_diffs + d_diffs
        assert p_calls["new"] == 1 and p_calls["finished"] == 1, p_calls
        assert d_calls["matched"] >= 1 and _verified(D)["matched"] >= 1, (d_calls, _verified(D))
        # P's answer, its Mamba group clipped to the state block, was the
        # daemon's Scheduler's too.
        assert _verified(P)["finished"] >= 1, _verified(P)
        assert not _daemon_disagreements(caplog), caplog.messages
        for e in (P, D):
            assert e.sched.kv_cache_manager.block_pool.get_num_free_blocks() == e.initial_free, e.name
    finally:
        H.shutdown(P)
        H.shutdown(D)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_request_finished_without_blocks(tmp_path, daemons, mode, caplog):
    """A producer that finishes with no blocks to hold returns
    remote_num_tokens 0 (nothing can be read from it), as NixlConnector
    does, and the daemon's Scheduler agrees."""
    import copy
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector, NixlPushConnector
    from vllm.v1.request import RequestStatus
    caplog.set_level("WARNING", logger="kvxfer.vllm")
    d = daemons("p")
    cfg = H.vllm_config(tmp_path, "p0", d, mode, 1, relay="metadata")
    kvc = H.kv_cache_config(cfg, 1, 32)
    c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kvc)
    ncfg = copy.deepcopy(cfg)
    ncfg.kv_transfer_config.kv_connector_extra_config = {}
    nixl = (NixlPushConnector if mode == "push" else NixlPullConnector)(ncfg, KVConnectorRole.SCHEDULER, kvc)
    try:
        got = {}
        for name, conn in (("kvxfer", c), ("nixl", nixl)):
            req = H.make_request("p-0", list(range(100, 140)), 1, {"do_remote_decode": True, "transfer_id": "t0"})
            req.status, req.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 40
            delay, params = conn.request_finished_all_groups(req, ([],))
            got[name] = (delay, params["remote_num_tokens"])
        assert got == {"kvxfer": (False, 0), "nixl": (False, 0)}, got
        c.build_connector_meta(SimpleNamespace())  # the row goes to the daemon, which answers
        assert not _daemon_disagreements(caplog), caplog.messages
    finally:
        c.shutdown()


def _names(outer) -> set[str]:
    """The request ids a scheduler-side StepsRequest carries."""
    step = outer.step
    ids = set(step.columns.request_finished.request_id) | set(step.columns.after_alloc.request_id)
    for op in step.ops:
        kind = op.WhichOneof("op")
        if kind in ("after_alloc", "request_finished"):
            ids.add(getattr(op, kind).request.request_id)
    return ids


def _lose_step_naming(e, rid, lost):
    """The daemon never gets e's first scheduler-side step that carries rid,
    and the scheduler side never misses it (its Steps stream lives on,
    later steps are answered): the step's metadata is never published, and
    the ranks' step_ref for it finds none. Appends (engine, step) to lost."""
    side = e.sched.connector._sched
    orig = side.stream.send

    def send(outer):
        if rid in _names(outer) and all(name != e.name for name, _ in lost):
            lost.append((e.name, outer.step.publish_step))
            return None
        return orig(outer)

    class Unanswered(deque):  # no answer is awaited for a lost step
        def append(self, x):
            if (e.name, x[0]) not in lost:
                super().append(x)

    side.stream.send = send
    side.inflight = Unanswered(side.inflight)


@pytest.mark.placement("daemon")  # the daemon process itself is what the test breaks
def test_dropped_step_fails_its_requests(tmp_path, daemons, caplog):
    """The daemon never publishes the step that starts D's wait for d-0's KV,
    nor the one that has P hold p-0's blocks for it: each rank's step_ref
    for it is dropped (a StepError naming the requests the rank listed),
    and the connector ends those requests as failed ones instead of waiting
    forever: D recomputes d-0 (kv_load_failure_policy), P frees p-0's
    blocks. The next pair moves and checks byte for byte."""
    rng = random.Random(23)
    r = Run(tmp_path, daemons, "push", 1)
    lost = []
    try:
        _lose_step_naming(r.D, "d-0", lost)
        _lose_step_naming(r.P, "p-0", lost)
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            r.add(0, [rng.randrange(100, 50000) for _ in range(40)])
            r.run_until(lambda: {name for name, _ in lost} == {"p0", "d0"}, limit_s=30)
            # The next steps published end the ranks' wait for the lost ones.
            r.add(1, [rng.randrange(100, 50000) for _ in range(40)])
            r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and {"p-0", "p-1"} <= r.P.sent
                        and not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert len(lost) == 2, lost
        assert "d-0" in r.D.failed and "d-0" not in r.checked
        assert not str(r.D.finished["d-0"].finish_reason).lower().endswith("error")  # recomputed
        assert "d-1" in r.checked and "d-1" not in r.D.failed
        assert any("d-0" in m and "dropped" in m for m in caplog.messages), caplog.messages
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.placement("daemon")  # the daemon process itself is what the test breaks
def test_dropped_finish_ends_layerwise_prefill(tmp_path, daemons, caplog):
    """Layer-wise push: the daemon never publishes the step that carries
    p-0's finish (its prefill step, published, has P's rank hold p-0
    prefilling: no lease, only its finish or abort ends it). P's rank's
    step_ref for it is dropped; the daemon's worker ends p-0 (its consumer
    told) and reports it failed, naming the step: that outcome, not the
    dropped error, ends p-0 on P (once, its blocks freed after its WRITEs
    ended), and D recomputes d-0. Before, the dropped error freed p-0's
    blocks while the rank held p-0 prefilling for ever, and D waited out
    its timeout. The next pair moves and checks byte for byte."""
    rng = random.Random(29)
    r = Run(tmp_path, daemons, "push", 1, layerwise=True)
    lost = []
    try:
        _lose_step_naming(r.P, "p-0", lost)
        with caplog.at_level("INFO", logger="kvxfer.vllm"):
            r.add(0, [rng.randrange(100, 50000) for _ in range(40)])
            r.run_until(lambda: bool(lost), limit_s=30)
            # The next steps published end the rank's wait for the lost one.
            r.add(1, [rng.randrange(100, 50000) for _ in range(40)])
            r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and {"p-0", "p-1"} <= r.P.sent
                        and not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert len(lost) == 1, lost
        ended = [m for m in caplog.messages if "send of request p-0 ended" in m]
        assert len(ended) == 1 and "was dropped" in ended[0], caplog.messages
        assert not any("p-0" in m and "dropped by kvxferd" in m for m in caplog.messages), caplog.messages
        assert "d-0" in r.D.failed and "d-0" not in r.checked
        assert "d-1" in r.checked and "d-1" not in r.D.failed
        assert _free_both(r)
    finally:
        r.close()


def _fail_step_naming(e, rid, failed):
    """e's scheduler-side Steps stream breaks as the first step that carries
    rid is sent (the daemon alive): the step never reaches the daemon, and
    the connector ends its calls itself (_lost). Appends the step's number
    to failed."""
    side = e.sched.connector._sched
    stream = side.stream
    orig = stream.send

    def send(outer):
        if failed or rid not in _names(outer):
            return orig(outer)
        failed.append(outer.step.publish_step)
        stream._call.cancel()
        raise errors.Unavailable("Steps", "stream broken (test)")

    stream.send = send


@pytest.mark.placement("daemon")
def test_lost_finish_ends_layerwise_prefill(tmp_path, daemons, caplog):
    """Layer-wise push: P's Steps stream breaks as the step carrying p-0's
    finish is sent (its prefill step reached the daemon: P's rank holds
    p-0 prefilling, no lease). The connector ends p-0 itself, and its ranks
    tell their workers p-0 is aborted: the worker ends it there and tells
    its consumer at once, so D's d-0 fails as cancelled (and recomputes)
    instead of waiting out its timeout. Before, P's rank held p-0
    prefilling for ever and D's d-0 expired. The next pair moves and
    checks byte for byte."""
    rng = random.Random(31)
    r = Run(tmp_path, daemons, "push", 1, layerwise=True, d_timeout=20)
    failed = []
    try:
        _fail_step_naming(r.P, "p-0", failed)
        with caplog.at_level("INFO", logger="kvxfer.vllm"):
            r.add(0, [rng.randrange(100, 50000) for _ in range(40)])
            r.run_until(lambda: bool(failed) and "d-0" in r.D.finished, limit_s=15)
            r.add(1, [rng.randrange(100, 50000) for _ in range(40)])
            r.run_until(lambda: {"d-0", "d-1"} <= set(r.D.finished) and {"p-0", "p-1"} <= r.P.sent
                        and not r.P.sched.requests and not r.D.sched.requests, limit_s=30)
        assert len(failed) == 1, failed
        why = [m for m in caplog.messages if "receive of request d-0 failed" in m]
        assert len(why) == 1 and "producer aborted" in why[0], caplog.messages
        assert "d-0" in r.D.failed and "d-0" not in r.checked
        assert "d-1" in r.checked and "d-1" not in r.D.failed
        assert _free_both(r)
    finally:
        r.close()


def _break_steps_after(e, rid, broke):
    """e's scheduler-side Steps stream breaks right after the daemon applied,
    published and answered the first step that carries rid, the daemon
    staying alive: the answer never reaches the connector (it is lost with
    the stream), but the engine's ranks take the step by reference as
    usual. Appends the step's number to broke."""
    side = e.sched.connector._sched
    stream = side.stream
    orig = stream.send

    def send(outer):
        orig(outer)
        if broke or rid not in _names(outer):
            return
        step = outer.step.publish_step
        with stream._lock:
            deadline = time.monotonic() + 10
            while not any(a.publish_step == step for a in stream._answers):
                assert time.monotonic() < deadline, f"{e.name}: no answer for step {step}"
                stream._arrived.wait(0.1)
            # The answer is lost: it arrived, the stream broke before the
            # connector read it.
            stream._answers = [a for a in stream._answers if a.publish_step != step]
        stream._call.cancel()
        assert stream._done.wait(10)
        broke.append(step)

    stream.send = send


def _step_numbers(e) -> list[int]:
    """The publish_step of every step e's scheduler side sends, on each
    Steps stream it opens from now on."""
    side = e.sched.connector._sched
    out = []

    def watch(stream):
        orig = stream.send

        def send(outer):
            out.append(outer.step.publish_step)
            return orig(outer)

        stream.send = send
        return stream

    watch(side.stream)
    opener = side.sched.stream
    side.sched.stream = lambda: watch(opener())
    return out


@pytest.mark.placement("daemon")  # the daemon process itself is what the test breaks
@pytest.mark.parametrize("side", ["p", "d"])
def test_steps_stream_breaks_daemon_alive(tmp_path, daemons, side, caplog):
    """The scheduler side's Steps stream breaks, its daemon alive, right
    after the daemon applied the step that has P hold p-0's blocks for D
    (side p) or D register d-0's blocks for P's WRITE (side d), and before
    its answer reached the connector. The daemon's worker holds that
    request: the connector must not end it (P: free its blocks, which the
    daemon WRITEs from once D registers; D: fail it, its blocks still
    granted to P's WRITE). It stays held until the daemon reports it on the
    rank's stream; the transfer then completes byte for byte, and the pair
    after it (over the scheduler the connector opened again) too.

    On P the blocks are made scarce: had the connector freed p-0's, the
    plain request p-x admitted next would be prefilled into them before
    D registers, and D would receive p-x's bytes."""
    rng = random.Random(f"break-{side}")
    r = Run(tmp_path, daemons, "push", 1, p_kw={"num_blocks": 6})
    broke = []
    # The step numbers the broken side publishes, over every Steps stream
    # it opens: they never repeat (a rank still to take an old step by
    # reference must find it as the old scheduler published it, or
    # dropped, never a new step under its number).
    numbers = _step_numbers(r.P if side == "p" else r.D)
    try:
        toks = [rng.randrange(100, 50000) for _ in range(40)]  # 3 of P's 5 usable blocks
        r.prompts["p-0"] = r.prompts["d-0"] = toks
        caplog.set_level("WARNING", logger="kvxfer.vllm")
        if side == "p":
            _break_steps_after(r.P, "p-0", broke)
            r.P.sched.add_request(H.make_request("p-0", list(toks), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
            r.run_until(lambda: broke, limit_s=30)
            # A plain request that needs p-0's blocks, were they free.
            r.prompts["p-x"] = [rng.randrange(100, 50000) for _ in range(5 * H.BLOCK)]
            r.P.sched.add_request(H.make_request("p-x", r.prompts["p-x"], 1, None))
        else:
            _break_steps_after(r.D, "d-0", broke)
            p = _push_params(r.dp, "t0")
            p["tp_size"] = 1
            r.D.sched.add_request(H.make_request("d-0", toks, 3, p))
            r.run_until(lambda: broke, limit_s=30)
        # The connector notices at its next steps and opens a new scheduler;
        # the request stays held meanwhile.
        for _ in range(30):
            r.step()
            time.sleep(0.01)
        assert any("Steps" in m or "steps" in m for m in caplog.messages), caplog.messages
        if side == "p":
            assert "p-0" not in r.P.sent and "p-0" in r.P.sched.requests, \
                "P freed p-0's blocks while its daemon held the send (a WRITE from them still to come)"
            assert "p-x" not in r.P.finished  # it waits for blocks
            r.D.sched.add_request(H.make_request("d-0", toks, 3, {**_push_params(r.dp, "t0"), "tp_size": 1}))
        else:
            assert "d-0" not in r.D.failed and "d-0" not in r.D.recvd, \
                "D ended d-0 while its daemon had its blocks registered for P's WRITE"
            r.P.sched.add_request(H.make_request("p-0", list(toks), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        r.run_until(lambda: "d-0" in r.D.finished and "p-0" in r.P.sent and not r.D.sched.requests
                    and (side == "d" or "p-x" in r.P.finished), limit_s=40)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        # The next pair moves over the scheduler opened again.
        r.add(1, [rng.randrange(100, 50000) for _ in range(20)])
        r.run_until(lambda: "d-1" in r.D.finished and not r.P.sched.requests and not r.D.sched.requests, limit_s=40)
        assert "d-1" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert _free_both(r)
        after = [n for n in numbers if n > broke[0]]
        assert after and numbers == sorted(set(numbers)), (broke, numbers)
    finally:
        r.close()


@pytest.mark.placement("daemon")  # the daemon process itself is what the test breaks
def test_steps_stream_breaks_refused_request_ends(tmp_path, daemons, caplog):
    """Pull: the daemon's Scheduler refuses d-bad (its params name two
    block groups; D has one) in the step whose answer is then lost with the
    broken Steps stream, the daemon alive. The connector leaves d-bad to the
    rank's outcome, and the daemon gives it one (the published step does
    not stage it, or the step never reached the daemon and its reference
    is dropped unpublished): D recomputes it instead of waiting forever."""
    rng = random.Random("refused")
    r = Run(tmp_path, daemons, "pull", 1)
    broke = []
    try:
        host, port = r.dp.peer.rsplit(":", 1)
        r.prompts["d-bad"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
        _break_steps_after(r.D, "d-bad", broke)
        caplog.set_level("WARNING", logger="kvxfer.vllm")
        r.D.sched.add_request(H.make_request("d-bad", toks, 2, {
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t-bad", "remote_engine_id": "p0",
            "remote_host": host, "remote_port": int(port), "remote_request_id": "p-bad", "tp_size": 1,
            "remote_block_ids": [[1, 2, 3], [1, 2]], "remote_block_starts": [0, 0], "remote_num_tokens": 40, "mode": "pull"}))
        r.run_until(lambda: broke, limit_s=30)
        r.run_until(lambda: "d-bad" in r.D.finished and not r.D.sched.requests, limit_s=30)
        assert "d-bad" in r.D.failed and "d-bad" not in r.checked
        assert not str(r.D.finished["d-bad"].finish_reason).lower().endswith("error")  # recomputed
        # Its one outcome says why: the published step did not stage it,
        # or (the stream broke before the daemon took the step, as under
        # load) the step was never published.
        assert any("d-bad" in m and ("does not stage it" in m or "not published within" in m) for m in caplog.messages), \
            caplog.messages
        assert _free_both(r)
    finally:
        r.close()


# Decisions the connector makes that the daemon's Scheduler makes too, each
# made to diverge on purpose: (engine, what diverges, the message's marker).
_DIVERGE = {
    # P clips one block too many: kv_transfer_params' remote_block_ids.
    "clip": ("P", lambda side: setattr(side, "_clip", _drop_last(side._clip)), "remote_block_ids"),
    # P holds nothing, the daemon holds the blocks: delay (and params).
    "delay": ("P", lambda side: setattr(side, "_clip", lambda blocks: ([[] for _ in blocks], [0] * len(blocks))),
              "connector said (False"),
    # D expects one token fewer than P computes: matched tokens.
    "matched": ("D", lambda side: setattr(side, "backoff", 1), "matched tokens"),
}


def _drop_last(clip):
    def clipped(blocks):
        ids, starts = clip(blocks)
        return [g[:-1] for g in ids], starts
    return clipped


@pytest.mark.parametrize("placement,relay", [("daemon", "daemon"), ("daemon", "metadata"), ("in-process", "metadata")])
@pytest.mark.parametrize("what", sorted(_DIVERGE))
def test_verify_catches_disagreement(tmp_path, daemons, placement, relay, what):
    """With verify (every engine the tests build has it) each decision the
    connector makes in place of the daemon's Scheduler is checked against
    it on every step, in both relays: made to diverge, the connector raises
    Disagreement out of vLLM's scheduler loop, naming the request and both
    answers, and records it (conftest fails a test that swallowed it)."""
    from kvxfer import vllm as V
    name, diverge, marker = _DIVERGE[what]
    # A short lease: P's daemon may hold what the connector freed.
    r = Run(tmp_path, daemons, "push", 1, p_kw={"relay": relay, "lease_s": 1}, d_kw={"relay": relay})
    e = r.P if name == "P" else r.D
    side = e.sched.connector._sched
    try:
        diverge(side)
        toks = list(range(1000, 1040))
        r.prompts["p-0"] = r.prompts["d-0"] = toks
        if e is r.P:  # P alone: no consumer waits on what the failed step left
            e.sched.add_request(H.make_request("p-0", list(toks), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        else:
            e.sched.add_request(H.make_request("d-0", toks, 3, {**_push_params(r.dp, "t0"), "tp_size": 1}))
        with pytest.raises(V.Disagreement) as exc:
            r.run_until(lambda: False, limit_s=20)
        msg = str(exc.value)
        assert f"engine {e.name}" in msg and "-0" in msg and "daemon says" in msg and marker in msg, msg
        assert V.DISAGREEMENTS == [msg], V.DISAGREEMENTS
    finally:
        V.DISAGREEMENTS.clear()
        for x in (r.P, r.D):
            x.sched.connector._sched.verify = False  # the engines' state is the test's, not theirs
        r.close()


@pytest.mark.placement("daemon")  # the daemon process itself is what the test breaks
def test_rank_stream_breaks_daemon_alive(tmp_path, daemons):
    """D's rank stream breaks on the engine's side, its kvxferd alive, while
    d-0 is registered with P (its blocks granted to P's WRITE). kvxferd
    fences the rank as it lets it go (its grants revoked, what lands cut
    short); until then the connector must not fail d-0 and hand its blocks
    back. It ends once kvxferd let the rank go (the rank attaches again),
    per kv_load_failure_policy, and the next pair transfers byte for byte."""
    rng = random.Random("rank-break")
    r = Run(tmp_path, daemons, "push", 1)
    try:
        r.prompts["d-0"] = toks = [rng.randrange(100, 50000) for _ in range(40)]
        p = _push_params(r.dp, "t0")
        p["tp_size"] = 1
        r.D.sched.add_request(H.make_request("d-0", toks, 2, p))
        for _ in range(5):
            H.step(r.D, r.prompts, fill=False)
        rank = r.D.ranks[0].connector._worker
        assert "d-0" in rank.waiting_recv, sorted(rank.waiting_recv)
        # The daemon will be slow to let the rank go: until it does, d-0
        # must stay held.
        real_reattach = rank._reattach
        held = {"until": time.monotonic() + 2.0}

        def slow_reattach():
            if time.monotonic() < held["until"]:
                return False  # kvxferd still holds the old rank (fencing)
            return real_reattach()

        rank._reattach = slow_reattach
        # The stream breaks under the connector (as a reset transport does).
        rank.stream._call.cancel()
        assert rank.stream._done.wait(5)
        t0 = time.monotonic()
        while time.monotonic() < held["until"] - 0.2:
            H.step(r.D, r.prompts, fill=False)
            assert "d-0" not in r.D.failed and "d-0" not in r.D.finished, \
                f"D ended d-0 {time.monotonic() - t0:.2f}s after its rank's stream broke, kvxferd still holding it"
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while "d-0" not in r.D.finished and "d-0" not in r.D.failed:
            assert time.monotonic() < deadline, ("d-0 never ended after kvxferd let the rank go", rank.dead,
                                                 sorted(rank.waiting_recv), sorted(rank.failed), sorted(r.D.sched.requests))
            H.step(r.D, r.prompts, fill=False)
            time.sleep(0.01)
        assert rank.dead is None and rank.stream is not None, "the rank did not attach again"
        # The next pair goes through the rank attached again.
        r.add(1, [rng.randrange(100, 50000) for _ in range(40)])
        r.run_until(lambda: "d-1" in r.checked, limit_s=30)
    finally:
        r.close()
