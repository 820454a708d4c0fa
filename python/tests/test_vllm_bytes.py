"""KV bytes over time, in both placements and modes: every byte D loaded is
checked again after every later step for as long as its request runs (a
WRITE or READ landing late, for an aborted or earlier request, in blocks
handed out again since, shows), and every byte P holds for a transfer is
checked after every step until P reports the send (P reusing or
overwriting a held block before D has its bytes shows). Scenarios the other
vLLM tests leave out: prompts of every length around a block boundary sent
twice (D and P then hold all of the prompt but what vLLM recomputes: the
remote part is a lone token, a partial block, or one whole block) and
their prefixes and extensions; D requests aborted in each phase (waiting
for the KV with the transfer under way, just after the load, while
decoding) in small pools whose freed blocks go at once to local requests
and new transfers, their ids used again at once."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

import harness as H
from test_vllm import _free_both, _push_params
from test_vllm_churn import ChurnRun, _abort, _count_outcomes


class GuardedRun(ChurnRun):
    """ChurnRun whose every step is followed by the re-checks: D's loaded
    requests still running, P's requests held for a transfer."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.rechecks = 0
        self.incarnations: dict[int, int] = {}
        # True: a router that names a pair's transfer by its number only
        # (every incarnation of pair n the same transfer id).
        self.reuse_tids = False
        self.p_held_checks = 0
        # Outcomes each rank reported for each request, per incarnation
        # of its id (pair clears them when it uses an id again).
        self.seen: Counter = Counter()
        for e in (self.P, self.D):
            _count_outcomes(e, self.seen)

    def step(self, do_p: bool = True, do_d: bool = True):
        super().step(do_p, do_d)
        self.guard()

    def guard(self) -> None:
        from vllm.v1.request import RequestStatus
        for rid in sorted(self.checked):
            req = self.D.sched.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or rid in self.D.failed:
                continue
            tokens = self.prompts[rid]
            # (A request preempted since recomputes its prompt, maybe in
            # chunks: what it holds is what it computed again so far.)
            self.check(self.D, rid, tokens, min(self.loaded(len(tokens)), req.num_computed_tokens))
            self.rechecks += 1
        for rid, o in self.P.finished.items():
            req = self.P.sched.requests.get(rid)
            if o.kv_transfer_params is None or rid in self.P.sent or req is None or not req.is_finished():
                continue
            upto = min(req.num_computed_tokens, req.num_prompt_tokens)
            self.check(self.P, rid, self.prompts[rid], upto)
            self.p_held_checks += 1

    @staticmethod
    def check(e: H.Engine, rid: str, tokens, upto: int) -> None:
        try:
            H.check_kv(e, rid, tokens, upto)
        except AssertionError as err:
            raise AssertionError(f"after a later step: {err}") from None

    def pair(self, n: int, tokens, max_tokens: int = 3) -> None:
        """A pair n (p-n, d-n), its D request id maybe used before: the
        old incarnation's check is not the new one's."""
        self.checked.discard(f"d-{n}")
        for k in [k for k in self.seen if k[2] in (f"p-{n}", f"d-{n}")]:
            assert self.seen[k] == 1, (k, self.seen[k])
            del self.seen[k]
        for e, rid in ((self.D, f"d-{n}"), (self.P, f"p-{n}")):
            e.recvd.discard(rid)
            e.sent.discard(rid)
            e.failed.discard(rid)
            e.finished.pop(rid, None)
        self.incarnations[n] = self.incarnations.get(n, -1) + 1
        tid = f"t{n}" if self.reuse_tids or not self.incarnations[n] else f"t{n}.{self.incarnations[n]}"
        self.prompts[f"p-{n}"] = self.prompts[f"d-{n}"] = tokens
        self.P.sched.add_request(H.make_request(f"p-{n}", list(tokens), 1, {"do_remote_decode": True, "transfer_id": tid},
                                                self.P.block))
        if self.mode == "push":
            params = {**_push_params(self.dp, tid), "tp_size": self.p_tp}
            self.D.sched.add_request(H.make_request(f"d-{n}", tokens, max_tokens, params, self.D.block))
        else:
            self.pending_d[f"p-{n}"] = (f"d-{n}", tokens, max_tokens, False)

    def local(self, e: H.Engine, rid: str, tokens, max_tokens: int = 4) -> None:
        """A request of e's own (no transfer): it takes whatever blocks the
        pool hands out next and writes its own KV into them."""
        self.prompts[rid] = tokens
        e.sched.add_request(H.make_request(rid, list(tokens), max_tokens, None, e.block))


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 50000) for _ in range(n)]


def _done(r: GuardedRun) -> bool:
    return not r.P.sched.requests and not r.D.sched.requests and not r.pending_d


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_block_boundaries_sent_again(tmp_path, daemons, mode):
    """Prompts of 1, 2, B-1, B, B+1, 2B-1, 2B, 2B+1 and 3B tokens; then the
    same prompts again (D and P hit every full block vLLM lets them: the
    remote part is one token, a partial block or a whole block); then each
    one token longer and one token shorter. Every byte of every D request
    over its whole prompt (hit and loaded) is P's, and stays so."""
    rng = random.Random(f"bounds-{mode}")
    r = GuardedRun(tmp_path, daemons, mode, 1)
    B = H.BLOCK
    try:
        lengths = [1, 2, B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B]
        base = {i: _toks(rng, n) for i, n in enumerate(lengths)}
        waves = [base, base, {i: t + _toks(rng, 1) for i, t in base.items()},
                 {i: t[:-1] for i, t in base.items() if len(t) > 1}]
        n = 0
        want = set()
        for wave in waves:
            ids = []
            for _, t in sorted(wave.items()):
                r.pair(n, t)
                ids.append(n)
                if len(t) > 1:
                    want.add(f"d-{n}")
                n += 1
            r.run_until(lambda: {f"d-{i}" for i in ids} <= set(r.D.finished) and _done(r), limit_s=60)
        assert not r.D.failed, sorted(r.D.failed)
        assert want <= r.checked, sorted(want - r.checked)
        assert not r.held_violations, r.held_violations
        assert r.rechecks > 0
        assert _free_both(r)
    finally:
        r.close()


# (id, P's TP, D's TP, P's block, D's block)
GEOS = [("same", 1, 1, 16, 16), ("tp2to1-block32to16", 2, 1, 32, 16), ("tp1to2-block16to32", 1, 2, 16, 32)]


@pytest.mark.parametrize("geo", GEOS, ids=[g[0] for g in GEOS])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_aborts_in_each_phase_with_blocks_reused(tmp_path, daemons, mode, geo):
    """Small pools on both sides. D requests are aborted in each phase: (a)
    waiting for the KV, its transfer started (push: P prefilled and posted
    its WRITE in the step before; pull: D posted its READ), (b) in the step
    its load was reported, (c) while it decodes; each time local requests
    on D take the freed blocks at once, and the aborted id comes back at
    once as a new pair with another prompt. P's freed blocks go to P's own
    local requests at once too. Then a wave of concurrent pairs with random
    aborts in any phase. Every byte stays each request's own."""
    _, p_tp, d_tp, p_block, d_block = geo
    # BYTES_SEED explores further (by hand).
    rng = random.Random(f"abort-phases-{mode}-{geo[0]}{os.environ.get('BYTES_SEED', '')}")
    r = GuardedRun(tmp_path, daemons, mode, p_tp, d_tp=d_tp, p_kw={"num_blocks": 14 * 16 // p_block, "lease_s": 4, "block": p_block},
                   d_kw={"num_blocks": 14 * 16 // d_block, "registration_timeout_s": 4, "block": d_block})
    x = 0

    def fill(e: H.Engine, blocks: int) -> None:
        nonlocal x
        r.local(e, f"x-{x}", _toks(rng, blocks * H.BLOCK - 3))
        x += 1

    try:
        # (a) aborted while waiting, its transfer started.
        r.pair(0, _toks(rng, 3 * H.BLOCK + 5))
        if mode == "push":
            r.step(do_p=False)  # D registers and waits
            r.step(do_d=False)  # P prefills and posts its WRITE
        else:
            r.run_until(lambda: "p-0" in r.P.finished)
            r.step(do_p=False)  # D allocates and posts its READ
        assert "d-0" in r.D.sched.requests and "d-0" not in r.D.recvd
        assert _abort(r.D, "d-0")
        fill(r.D, 4)
        fill(r.P, 4)
        r.run_until(lambda: "d-0" not in r.D.sched.requests and "p-0" not in r.P.sched.requests, limit_s=30)
        r.pair(0, _toks(rng, 2 * H.BLOCK + 7))
        fill(r.D, 3)
        r.run_until(lambda: "d-0" in r.D.finished and _done(r), limit_s=30)
        assert "d-0" in r.checked and "d-0" not in r.D.failed, (sorted(r.checked), r.D.failed)

        # (b) aborted in the step its load was reported.
        r.first_prompt = _toks(rng, 2 * H.BLOCK + 5)
        r.pair(1, r.first_prompt, max_tokens=8)
        r.run_until(lambda: "d-1" in r.D.recvd, limit_s=30)
        assert "d-1" in r.checked
        assert _abort(r.D, "d-1")
        fill(r.D, 3)
        r.run_until(lambda: "p-1" not in r.P.sched.requests, limit_s=30)
        r.pair(1, _toks(rng, 3 * H.BLOCK - 1))
        r.run_until(lambda: "d-1" in r.D.finished and _done(r), limit_s=30)
        assert "d-1" in r.checked and "d-1" not in r.D.failed

        # (c) aborted while it decodes.
        r.pair(2, _toks(rng, 40), max_tokens=20)
        r.run_until(lambda: "d-2" in r.D.recvd, limit_s=30)
        for _ in range(3):
            r.step()
        assert _abort(r.D, "d-2")
        fill(r.D, 3)
        r.run_until(lambda: "p-2" not in r.P.sched.requests, limit_s=30)
        r.pair(2, _toks(rng, 33))
        r.run_until(lambda: "d-2" in r.D.finished and _done(r), limit_s=30)
        assert "d-2" in r.checked and "d-2" not in r.D.failed

        # A wave: concurrent pairs, random aborts on D, local requests on
        # both sides, ids used again.
        # (Some share a prefix with d-1's first prompt, loaded then aborted
        # in the step of its load: D's prefix cache may hold its blocks.)
        shared = r.first_prompt[:2 * H.BLOCK + 3]
        for k in range(30):
            n = 3 + k % 6
            if f"d-{n}" not in r.D.sched.requests and f"p-{n}" not in r.P.sched.requests and f"p-{n}" not in r.pending_d:
                body = _toks(rng, rng.randrange(2, 60))
                r.pair(n, shared[:rng.randrange(H.BLOCK - 1, len(shared) + 1)] + body if rng.random() < 0.4 else body,
                       max_tokens=rng.randrange(2, 8))
            if rng.random() < 0.3:
                fill(rng.choice((r.P, r.D)), rng.randrange(1, 3))
            if rng.random() < 0.3 and r.D.sched.requests:
                rid = rng.choice(sorted(r.D.sched.requests))
                _abort(r.D, rid)
            y = rng.random()
            r.step(do_p=y > 0.2, do_d=y < 0.8)
        r.run_until(lambda: _done(r), limit_s=60)
        for _ in range(3):
            r.step()
        assert r.rechecks > 0 and r.p_held_checks > 0, (r.rechecks, r.p_held_checks)
        assert not {k: v for k, v in r.seen.items() if v > 1}, r.seen
        assert not r.held_violations, r.held_violations
        assert _free_both(r), (r.P.sched.kv_cache_manager.block_pool.get_num_free_blocks(), r.P.initial_free,
                               r.D.sched.kv_cache_manager.block_pool.get_num_free_blocks(), r.D.initial_free)
    finally:
        r.close()


REUSE = [("push", 1, False), ("pull", 1, False), ("push", 2, True), ("pull", 2, False)]


@pytest.mark.parametrize("mode,p_tp,layerwise", REUSE, ids=[f"{m}-tp{t}to1{'-layerwise' if lw else ''}" for m, t, lw in REUSE])
def test_transfer_id_reused_never_loads_another_requests_bytes(tmp_path, daemons, mode, p_tp, layerwise):
    """A router that reuses its transfer ids along with its request ids: a
    pair completes, then the next pair comes under the same P id, D id and
    transfer id, over blocks D's local requests wrote meanwhile. It moves
    byte for byte, or fails (D recomputes it): never a load reported done
    over blocks nothing wrote. (Push: P's tombstone of the first pair
    named the new registration as a copy of the old one and dropped it; D
    waited for its deadline, cancelled, and P answered the cancel with the
    first transfer's completion notice: d-0 reported loaded, its blocks
    holding a local request's KV.)"""
    rng = random.Random(f"tid-reuse-{mode}")
    r = GuardedRun(tmp_path, daemons, mode, p_tp, layerwise, p_kw={"num_blocks": 14, "lease_s": 3},
                   d_kw={"num_blocks": 14, "registration_timeout_s": 3})
    r.reuse_tids = True
    try:
        r.pair(0, _toks(rng, 3 * H.BLOCK + 5))
        r.run_until(lambda: "d-0" in r.D.finished and _done(r), limit_s=30)
        assert "d-0" in r.checked and not r.D.failed
        for k in range(3):
            r.local(r.D, f"x-{k}", _toks(rng, 4 * H.BLOCK - 3))
        r.run_until(lambda: _done(r), limit_s=30)
        r.pair(0, _toks(rng, 2 * H.BLOCK + 7))
        r.run_until(lambda: "d-0" in r.D.finished and _done(r), limit_s=30)
        # Loaded and checked (GuardedRun's check at the load), or failed.
        assert "d-0" in r.D.recvd and ("d-0" in r.checked) != ("d-0" in r.D.failed), \
            (sorted(r.D.recvd), sorted(r.checked), sorted(r.D.failed))
        assert _free_both(r)
    finally:
        r.close()


CHURN = [("push", 1, 1, 4096), ("pull", 2, 1, 4096), ("push", 1, 2, 24)]


@pytest.mark.parametrize("mode,p_tp,d_tp,batched", CHURN, ids=[f"{m}-tp{p}to{d}{'-chunked' if b < 100 else ''}" for m, p, d, b in CHURN])
def test_churn_rechecked_every_step(tmp_path, daemons, mode, p_tp, d_tp, batched, monkeypatch):
    """test_vllm_churn's churn (aborts in every state on both sides,
    preemptions, small pools) with GuardedRun's re-checks after every
    step: a byte D loaded that changes while its request runs, or a byte P
    holds for D that changes before its send, fails it."""
    import test_vllm_churn
    runs = []

    class Run(GuardedRun):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            runs.append(self)

    monkeypatch.setattr(test_vllm_churn, "ChurnRun", Run)
    monkeypatch.setenv("CHURN_PAIRS", "12")
    test_vllm_churn.test_churn_aborts_and_preemptions(tmp_path, daemons, mode, p_tp, d_tp, False, True, batched)
    assert runs and runs[0].rechecks > 0, [r.rechecks for r in runs]
