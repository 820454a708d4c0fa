"""A router's kv_transfer_params gone wrong, as an outside user's router may
send them, in both placements: each request ends once on each side (loaded
byte for byte, or failed, or computed on D), a warning names the field and
its value where the connector refuses it, nothing else in the step is lost,
and both block pools come back to where they started."""

from __future__ import annotations

import copy
import logging
import os
import random
import time

import pytest

import harness as H
from test_vllm import Run, _free_both, _push_params


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 50000) for _ in range(n)]


def _ended(r: Run, rids) -> bool:
    return set(rids) <= set(r.D.finished) and not r.P.sched.requests and not r.D.sched.requests


def _extra_block(p):
    ids = p["remote_block_ids"][0]
    return {**p, "remote_block_ids": [ids + [max(ids) + 1]]}


# (id, how the router's params for D differ from P's own, how d-1 ends:
# "loaded" byte for byte, "failed" (recomputed on D) or "local" (refused
# by the connector, computed on D), what its warning says)
PULL_TAMPER = [
    ("block-past-pool", lambda p: {**p, "remote_block_ids": [p["remote_block_ids"][0][:-1] + [10 ** 6]]},
     "failed", "id 1000000, want 0..95"),
    ("blocks-short", lambda p: {**p, "remote_block_ids": [p["remote_block_ids"][0][:-1]]}, "failed", "short of the destination's"),
    ("blocks-extra", _extra_block, "loaded", ""),
    ("blocks-repeated", lambda p: {**p, "remote_block_ids": [[p["remote_block_ids"][0][0]] * len(p["remote_block_ids"][0])]},
     "failed", "the same block as block 0"),
    # (The blocks P holds for the good request beside it, p-0: P grants
    # d-1's READs none of them, and D gives up at its deadline.)
    ("blocks-of-another-request", None, "failed", "RESULT_EXPIRED"),
    ("start-shifted", lambda p: {**p, "remote_block_starts": [H.BLOCK]}, "failed", "the source's blocks hold tokens 16..80"),
    ("port-negative", lambda p: {**p, "remote_port": -5}, "local", "kv_transfer_params.remote_port = -5"),
    ("port-zero", lambda p: {**p, "remote_port": 0}, "local", "kv_transfer_params.remote_port = 0"),
    ("port-huge", lambda p: {**p, "remote_port": 70000}, "local", "kv_transfer_params.remote_port = 70000"),
    ("port-word", lambda p: {**p, "remote_port": "http"}, "local", "kv_transfer_params.remote_port = 'http'"),
    ("tp-huge", lambda p: {**p, "tp_size": (1 << 31) - 1}, "failed", "TPSize = 2147483647, want 0..4096"),
    ("tp-negative", lambda p: {**p, "tp_size": -1}, "local", "kv_transfer_params.tp_size = -1"),
    ("pp-huge", lambda p: {**p, "remote_pp_size": 1 << 20}, "failed", "PPSize = 1048576, want 0..4096"),
    ("engine-unknown", lambda p: {**p, "remote_engine_id": "no-such-engine"}, "failed", 'engine "no-such-engine"'),
    # (P holds no such request: D waits for its deadline.)
    ("request-unknown", lambda p: {**{k: v for k, v in p.items() if k != "transfer_id"}, "remote_request_id": "p-nope"},
     "failed", "RESULT_EXPIRED"),
    ("tokens-more", lambda p: {**p, "remote_num_tokens": 10 ** 6}, "loaded", ""),
    ("tokens-negative", lambda p: {**p, "remote_num_tokens": -3}, "local", "kv_transfer_params.remote_num_tokens = -3"),
]


def _outcome(r: Run, rid: str) -> str:
    if rid in r.checked and rid not in r.D.failed:
        return "loaded"
    if rid in r.D.failed:
        return "failed"
    assert rid not in r.D.recvd, (rid, sorted(r.D.recvd))  # reported received, never checked
    return "local"


def _check(r: Run, rid: str, want: str | None, says: str, messages) -> None:
    got = _outcome(r, rid)
    assert want is None or got == want, (rid, got, want, [m for m in messages if rid in m])
    assert not says or any(rid in m and says in m for m in messages), (rid, says, messages)


@pytest.mark.parametrize("tamper", PULL_TAMPER, ids=[t[0] for t in PULL_TAMPER])
def test_pull_params_tampered_by_the_router(tmp_path, daemons, placement, tamper, caplog):
    """Pull: P's params reach D with one field changed; the well-formed
    request beside it in the same step moves byte for byte."""
    name, change, want, says = tamper
    rng = random.Random(f"tamper-{name}")
    r = Run(tmp_path, daemons, "pull", 1, p_kw={"lease_s": 2}, d_kw={"registration_timeout_s": 2}, d_timeout=3)
    try:
        for n in range(2):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = _toks(rng, 3 * H.BLOCK + 5)
            r.P.sched.add_request(H.make_request(f"p-{n}", list(r.prompts[f"p-{n}"]), 1,
                                                 {"do_remote_decode": True, "transfer_id": f"t{n}"}))
        r.run_until(lambda: {"p-0", "p-1"} <= set(r.P.finished))
        good = dict(r.P.finished["p-0"].kv_transfer_params)
        bad = dict(r.P.finished["p-1"].kv_transfer_params)
        bad = change(bad) if change else {**bad, "remote_block_ids": good["remote_block_ids"]}
        r.D.sched.add_request(H.make_request("d-1", r.prompts["d-1"], 2, bad))
        r.D.sched.add_request(H.make_request("d-0", r.prompts["d-0"], 2, good))
        with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
            r.run_until(lambda: _ended(r, ("d-0", "d-1")), limit_s=40)
        assert "d-0" in r.checked and "d-0" not in r.D.failed, (sorted(r.checked), sorted(r.D.failed))
        # d-1: loaded (and checked byte for byte by Run.step), failed, or
        # computed on D; never loaded with other bytes.
        _check(r, "d-1", want, says, caplog.messages)
        assert _free_both(r), (r.P.sched.kv_cache_manager.block_pool.get_num_free_blocks(), r.P.initial_free,
                               r.D.sched.kv_cache_manager.block_pool.get_num_free_blocks(), r.D.initial_free)
    finally:
        r.close()


PUSH_TAMPER = [
    ("port-negative", {"remote_port": -5}, "local", "kv_transfer_params.remote_port = -5"),
    ("port-huge", {"remote_port": 70000}, "local", "kv_transfer_params.remote_port = 70000"),
    ("tp-huge", {"tp_size": (1 << 31) - 1}, "failed", "TPSize = 2147483647, want 0..4096"),
    ("tp-wrong", {"tp_size": 2}, "failed", "producer p0 has TP 1, the request says 2"),
    ("tp-negative", {"tp_size": -2}, "local", "kv_transfer_params.tp_size = -2"),
    ("tp-word", {"tp_size": "two"}, "local", "kv_transfer_params.tp_size = 'two'"),
    ("pp-huge", {"remote_pp_size": 1 << 20}, "failed", "PPSize = 1048576, want 0..4096"),
    ("ranks-huge", {"tp_size": 64, "remote_pp_size": 128}, "failed", "TPSize*PPSize = 64*128"),
    ("engine-unknown", {"remote_engine_id": "no-such-engine"}, "failed", 'engine "no-such-engine"'),
    # P0 at another port than the one P0 was handshaken at.
    ("engine-elsewhere", {"remote_port": 1}, "failed", "p0 at 127.0.0.1:1"),
    ("flag-string", {"do_remote_prefill": "yes"}, "loaded", ""),
    ("tokens-more", {"remote_num_tokens": 10 ** 6}, "loaded", ""),
]


@pytest.mark.parametrize("tamper", PUSH_TAMPER, ids=[t[0] for t in PUSH_TAMPER])
def test_push_params_tampered_by_the_router(tmp_path, daemons, placement, tamper, caplog):
    """Push: D's params name P with one field wrong; the well-formed pair
    beside it moves byte for byte."""
    name, extra, want, says = tamper
    rng = random.Random(f"push-tamper-{name}")
    r = Run(tmp_path, daemons, "push", 1, p_kw={"lease_s": 2}, d_kw={"registration_timeout_s": 2}, d_timeout=3)
    try:
        for n in (1, 0):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = toks = _toks(rng, 3 * H.BLOCK + 5)
            r.P.sched.add_request(H.make_request(f"p-{n}", list(toks), 1, {"do_remote_decode": True, "transfer_id": f"t{n}"}))
            p = {**_push_params(r.dp, f"t{n}"), "tp_size": 1, **(extra if n == 1 else {})}
            r.D.sched.add_request(H.make_request(f"d-{n}", toks, 2, p))
        with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
            r.run_until(lambda: _ended(r, ("d-0", "d-1")), limit_s=40)
        assert "d-0" in r.checked and "d-0" not in r.D.failed, (sorted(r.checked), sorted(r.D.failed))
        _check(r, "d-1", want, says, caplog.messages)
        assert _free_both(r), (r.P.sched.kv_cache_manager.block_pool.get_num_free_blocks(), r.P.initial_free,
                               r.D.sched.kv_cache_manager.block_pool.get_num_free_blocks(), r.D.initial_free)
    finally:
        r.close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_sizes_no_producer_has_grow_nothing(tmp_path, daemons, placement, mode, caplog):
    """A router's params name a producer of 2^21 PP stages (or 64x128
    ranks), and D's engine aborts the request before it was scheduled
    (its release goes to the producer ranks its params name: no handshake
    has told their number yet). The request ends once, the warning names
    the field and its value, the server (the daemon, or this process
    in-process) does not grow, and the pair beside it moves byte for byte.
    Before, the release listed (and queued a notice to) each of the
    2,097,152 ranks: the daemon grew from ~25 MB to ~820 MB, and
    remote_pp_size 2^31-1, which the connector let through, would have run
    it out of memory."""
    rng = random.Random(f"ranks-{mode}")
    r = Run(tmp_path, daemons, mode, 1, p_kw={"lease_s": 2}, d_kw={"registration_timeout_s": 2}, d_timeout=3)
    try:
        pid = r.dd.proc.pid if placement == "daemon" else os.getpid()
        before = _rss_kib(pid)
        odd = {1: {"remote_pp_size": 1 << 21}, 2: {"tp_size": 64, "remote_pp_size": 128}}
        with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
            for n, extra in odd.items():
                toks = _toks(rng, 40)
                p = {**_push_params(r.dp, f"x{n}"), "tp_size": 1, **extra}
                if mode == "pull":
                    p.update({"mode": "pull", "remote_request_id": f"p-x{n}", "remote_block_ids": [[1, 2, 3]]})
                r.D.sched.add_request(H.make_request(f"d-{n}", toks, 2, p))
                r.abort_d(f"d-{n}")
            for _ in range(3):
                H.step(r.D, r.prompts, fill=False)
            r.add(0, _toks(rng, 3 * H.BLOCK + 5))
            r.run_until(lambda: _ended(r, ("d-0",)), limit_s=30)
        grown = _rss_kib(pid) - before
        assert grown < 100 << 10, f"{placement} server grew {grown} KiB"
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), sorted(r.D.failed))
        assert {"d-1", "d-2"} <= set(r.D.finished)
        assert _free_both(r)
    finally:
        r.close()


# (phase P's request is aborted in, layer-wise P)
P_ABORTS = [("queued", False), ("mid-prefill", False), ("mid-prefill", True)]


@pytest.mark.parametrize("phase,layerwise", P_ABORTS, ids=[f"{p}{'-layerwise' if lw else ''}" for p, lw in P_ABORTS])
def test_push_producer_aborted_after_d_registered_ends_d_at_once(tmp_path, daemons, placement, phase, layerwise):
    """Push, every timeout and lease a minute: D's d-0 registers and waits;
    then P's engine aborts p-0 before it was scheduled, or halfway through
    its chunked prefill (layer-wise: some chunks' layers already written
    into D's blocks). d-0 fails within seconds (never reported loaded, its
    blocks recomputed), not at its deadline; both pools come back; the pair
    beside it moves byte for byte."""
    rng = random.Random(f"p-abort-{phase}-{layerwise}")
    long = {"lease_s": 60, "registration_timeout_s": 60}
    r = Run(tmp_path, daemons, "push", 1, layerwise, d_timeout=60, p_kw={**long, "batched": 16}, d_kw=long)
    try:
        for n in (0, 1):
            r.prompts[f"p-{n}"] = r.prompts[f"d-{n}"] = toks = _toks(rng, 5 * H.BLOCK + 3)
            p = {**_push_params(r.dp, f"t{n}"), "tp_size": 1}
            r.D.sched.add_request(H.make_request(f"d-{n}", toks, 2, p))
        # D registers both; P has neither yet.
        for _ in range(2):
            H.step(r.D, r.prompts, fill=False)
        r.P.sched.add_request(H.make_request("p-0", list(r.prompts["p-0"]), 1, {"do_remote_decode": True, "transfer_id": "t0"}))
        if phase == "mid-prefill":
            for _ in range(2):
                H.step(r.P, r.prompts)
            req = r.P.sched.requests["p-0"]
            assert 0 < req.num_computed_tokens < req.num_prompt_tokens, req.num_computed_tokens
        from vllm.v1.request import RequestStatus
        assert r.P.sched.finish_requests("p-0", RequestStatus.FINISHED_ABORTED)
        t = time.monotonic()
        r.run_until(lambda: "d-0" in r.D.failed or "d-0" in r.D.recvd, limit_s=10)
        took = time.monotonic() - t
        assert "d-0" in r.D.failed and "d-0" not in r.checked, (sorted(r.D.failed), sorted(r.checked))
        assert took < 5, f"d-0 ended {took:.1f} s after P's abort"
        r.P.sched.add_request(H.make_request("p-1", list(r.prompts["p-1"]), 1, {"do_remote_decode": True, "transfer_id": "t1"}))
        r.run_until(lambda: _ended(r, ("d-0", "d-1")), limit_s=30)
        assert "d-1" in r.checked and "d-1" not in r.D.failed, (sorted(r.checked), sorted(r.D.failed))
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_consumer_aborted_while_waiting_frees_p_at_once(tmp_path, daemons, placement, mode):
    """Every timeout and lease a minute. D's d-0 is allocated and waits for
    its KV (push: registered before P prefilled; pull: its READ posted),
    and D's engine aborts it. P's blocks held for it go back within
    seconds, not at the lease; D's go back once kvxfer reports the receive
    ended (vLLM delays their free), each reported once; the pair beside it
    moves byte for byte."""
    rng = random.Random(f"d-abort-{mode}")
    long = {"lease_s": 60, "registration_timeout_s": 60}
    r = Run(tmp_path, daemons, mode, 1, d_timeout=60, p_kw=long, d_kw=long)
    try:
        r.add(0, _toks(rng, 4 * H.BLOCK + 3))
        if mode == "push":
            H.step(r.D, r.prompts, fill=False)  # d-0 registers
            assert "d-0" in r.D.sched.requests
        else:
            r.run_until(lambda: "p-0" in r.P.finished, limit_s=20)
            r.step()  # d-0 allocated, its READ posted
        assert "d-0" not in r.D.recvd
        r.abort_d("d-0")
        t = time.monotonic()
        r.run_until(lambda: not r.P.sched.requests and not r.D.sched.requests, limit_s=15)
        took = time.monotonic() - t
        assert took < 5, f"P held p-0 {took:.1f} s after D's abort"
        assert "d-0" not in r.checked or "d-0" in r.D.recvd
        r.add(1, _toks(rng, 3 * H.BLOCK + 1))
        r.run_until(lambda: _ended(r, ("d-1",)) and not r.pending_d, limit_s=30)
        assert "d-1" in r.checked and not r.D.failed, (sorted(r.checked), sorted(r.D.failed))
        assert _free_both(r)
    finally:
        r.close()


JUNK = [("string", "do_remote_prefill"), ("list", [{"do_remote_prefill": True}]), ("number", 5), ("flags-only", {"do_remote_prefill": True})]


@pytest.mark.parametrize("junk", JUNK, ids=[j[0] for j in JUNK])
@pytest.mark.parametrize("side", ["P", "D"])
def test_params_that_are_no_object_are_ignored_not_raised(tmp_path, daemons, placement, side, junk, caplog):
    """A caller of the engine's Python API (vLLM's HTTP API types them)
    hands P or D a request whose kv_transfer_params are no object: a
    string, a list, a number; or an object with the flag and nothing else.
    vLLM's add_request never sees an exception: the request runs as one of
    the engine's own, a warning names kv_transfer_params and its value,
    and the pair beside it moves byte for byte. Before, the first three
    raised AttributeError ("'str' object has no attribute 'get'") out of
    add_request (the connector's on_new_request)."""
    name, params = junk
    rng = random.Random(f"junk-{side}-{name}")
    r = Run(tmp_path, daemons, "push", 1, p_kw={"lease_s": 2}, d_kw={"registration_timeout_s": 2}, d_timeout=3)
    try:
        for x in (r.P, r.D):
            # vLLM's own NixlConnector, which the harness runs beside ours,
            # raises on such params itself.
            for attr in ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
                         "request_finished_all_groups"):
                delattr(x.sched.connector, attr)
        e = r.P if side == "P" else r.D
        r.prompts["x-1"] = toks = _toks(rng, 2 * H.BLOCK + 3)
        with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
            # (A copy: the connector clears a refused request's flag.)
            e.sched.add_request(H.make_request("x-1", toks, 2, copy.deepcopy(params)))
            r.add(0, _toks(rng, 3 * H.BLOCK + 5))
            r.run_until(lambda: _ended(r, ("d-0",)) and "x-1" in e.finished, limit_s=30)
        assert "d-0" in r.checked and not r.D.failed and "x-1" not in e.recvd | e.sent, (sorted(r.checked), r.D.failed)
        says = "kv_transfer_params = " if name != "flags-only" else "kv_transfer_params.remote_engine_id is missing"
        if side == "D" or name != "flags-only":
            assert any("x-1" in m and says in m for m in caplog.messages), [m for m in caplog.messages if "x-1" in m]
        assert _free_both(r)
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_engines_that_back_off_differently_move_nothing(tmp_path, daemons, placement, mode, monkeypatch, caplog):
    """One MTP model (MiMo's, 3 modules) on both engines, P speculating 3
    tokens (it prefills all but the last 2 prompt tokens), D 2 (it loads
    all but the last 1). Nothing D loads may be a token P never computed:
    each request fails on D (recomputed there), named, and both pools come
    back. Before, push moved every request and D's last loaded token held
    no KV of it (check_kv: 'position 51 (block 4) holds [0. 0. 0. 0.]');
    the engines' compatibility hashes left the backoff out."""
    orig = H.model_dir
    monkeypatch.setattr(H, "model_dir", lambda work, mtp=0, *a, **k: orig(work, 3, *a, **k))
    rng = random.Random(f"backoffs-{mode}")
    r = Run(tmp_path, daemons, mode, 1, p_kw={"mtp": 3, "relay": "metadata", "lease_s": 2},
            d_kw={"mtp": 2, "relay": "metadata", "registration_timeout_s": 2}, d_timeout=3, backoff=1)
    try:
        r.add(0, _toks(rng, 3 * H.BLOCK + 5))
        with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
            r.run_until(lambda: _ended(r, ("d-0",)) and not r.pending_d, limit_s=30)
        says = "compatibility hash" if mode == "push" else "more than the producer holds"
        _check(r, "d-0", "failed", says, caplog.messages)
        assert _free_both(r)
    finally:
        r.close()


def test_pull_params_given_to_several_d_requests(tmp_path, daemons, placement):
    """A router hands P's params for p-1 to four D requests (two in one
    step, two in the next) while P's small pool hands blocks to P's own
    requests as they free. None is loaded with bytes not p-1's (each is
    loaded and checked, or fails and is recomputed), the first is loaded,
    and both pools come back."""
    rng = random.Random("several-d")
    r = Run(tmp_path, daemons, "pull", 1, p_kw={"lease_s": 2, "num_blocks": 16}, d_kw={"registration_timeout_s": 2}, d_timeout=3)
    try:
        toks = _toks(rng, 3 * H.BLOCK + 5)
        r.prompts["p-1"] = toks
        r.P.sched.add_request(H.make_request("p-1", list(toks), 1, {"do_remote_decode": True, "transfer_id": "t1"}))
        r.run_until(lambda: "p-1" in r.P.finished)
        p = dict(r.P.finished["p-1"].kv_transfer_params)
        for k in range(4):
            r.prompts[f"d-{k}"] = toks
            r.D.sched.add_request(H.make_request(f"d-{k}", toks, 2, dict(p)))
            if k == 1:
                r.step()
        for k in range(3):
            r.prompts[f"x-{k}"] = _toks(rng, 3 * H.BLOCK)
            r.P.sched.add_request(H.make_request(f"x-{k}", r.prompts[f"x-{k}"], 3, None))
        r.run_until(lambda: _ended(r, [f"d-{k}" for k in range(4)]), limit_s=30)
        assert _outcome(r, "d-0") == "loaded"
        assert all(_outcome(r, f"d-{k}") in ("loaded", "failed") for k in range(1, 4)), [_outcome(r, f"d-{k}") for k in range(4)]
        assert _free_both(r)
    finally:
        r.close()
