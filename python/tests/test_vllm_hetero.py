"""Byte-exact transfers between P and D engines whose configurations differ:
TP sizes either way, vLLM block sizes either way, attention kernel blocks
smaller than vLLM's, GQA models whose KV heads are replicated across TP
ranks, and a pipeline-parallel producer; in both placements and both
modes, through the real connector under vLLM's own Scheduler (test_vllm's
Run). Each pair moves a mix of prompts: one token, exactly one block of
either side, lengths off every block boundary, prefix hits on D (partial,
and off P's block boundary where the block sizes differ), and a wave of
concurrent requests over blocks scattered by earlier frees. Every byte D
loads is checked against what P computed."""

from __future__ import annotations

import random

import pytest

import harness as H
from test_vllm import Run, _free_both, _push_params


def _geo(p_tp=1, d_tp=1, p_block=H.BLOCK, d_block=H.BLOCK, kv_heads=H.HEADS, p_pp=1, p_kernel=None, d_kernel=None):
    return {"p_tp": p_tp, "d_tp": d_tp, "p": {"block": p_block, "kv_heads": kv_heads, "pp": p_pp, "kernel": p_kernel},
            "d": {"block": d_block, "kv_heads": kv_heads, "kernel": d_kernel}}


# (id, geometry): each kind of difference once per mode and placement,
# kept few (each case runs two engines and every request through both).
GEOS = [
    ("tp1to2", _geo(1, 2)),
    ("tp2to4", _geo(2, 4)),
    ("tp4to2", _geo(4, 2)),
    ("tp4to1", _geo(4, 1)),
    ("block16to32", _geo(p_block=16, d_block=32)),
    ("block32to16-tp2to1", _geo(2, 1, p_block=32, d_block=16)),
    ("kernel16-block32to16", _geo(p_block=32, p_kernel=16)),
    ("block16to32-kernel16", _geo(d_block=32, d_kernel=16)),
    # 2 KV heads: replicated on the TP 4 side (one head a rank).
    ("gqa2-tp4to1", _geo(4, 1, kv_heads=2)),
    ("gqa2-tp1to4", _geo(1, 4, kv_heads=2)),
    ("gqa2-tp4to2", _geo(4, 2, kv_heads=2)),
    ("pp2to1", _geo(p_pp=2)),
    ("pp2tp2to1", _geo(2, 1, p_pp=2)),
    # P's prefills chunked (24 tokens a step) over blocks larger than D's.
    ("chunked-block32to16-tp2to1", {**_geo(2, 1, p_block=32), "p": {**_geo(p_block=32)["p"], "batched": 24}}),
    # Layer-wise push (each layer written once P's forward saved it).
    ("layerwise-tp2to4-block16to32", {**_geo(2, 4, d_block=32), "layerwise": True}),
    ("layerwise-pp2to1", {**_geo(p_pp=2), "layerwise": True}),
    # MLA: the one latent every rank holds, read from one P rank.
    ("mla-tp2to1", {**_geo(2, 1), "p": {"mla": True}, "d": {"mla": True}}),
    ("mla-tp1to2", {**_geo(1, 2), "p": {"mla": True}, "d": {"mla": True}}),
]


def _exchange(r: Run, rng: random.Random) -> set[str]:
    """Moves the mix of prompts through r; returns the D requests whose
    bytes must have been checked."""
    pb, db = r.P.block, r.D.block
    big = max(pb, db)

    def toks(n):
        return [rng.randrange(100, 50000) for _ in range(n)]

    shared = toks(2 * big + pb // 2)  # ends off P's block boundary
    first = {0: shared + toks(7), 1: toks(1), 2: toks(pb), 3: toks(db), 4: toks(big + 3)}
    for n, t in first.items():
        r.add(n, t)
    r.run_until(lambda: {f"d-{n}" for n in first} <= set(r.D.finished))
    # Prefix hits on D (shared with d-0, cached there), and a wave of
    # concurrent requests over the blocks the first wave freed.
    second = {5: shared[:big + 1] + toks(9), 6: shared + toks(big - 1), 7: shared[:db] + toks(2)}
    second.update({n: toks(rng.randrange(2, 3 * big)) for n in range(8, 20)})
    for n, t in second.items():
        r.add(n, t)
    ids = set(first) | set(second)
    r.run_until(lambda: {f"d-{n}" for n in ids} <= set(r.D.finished) and {f"p-{n}" for n in ids} <= set(r.P.finished)
                and not r.P.sched.requests and not r.D.sched.requests)
    # A one-token prompt leaves D nothing to load (it computes its one token).
    return {f"d-{n}" for n in ids if len(r.prompts[f"d-{n}"]) > 1}


CASES = [(g, m) for g in GEOS for m in ("push", "pull") if m == "push" or not g[1].get("layerwise")]


@pytest.mark.parametrize("geo,mode", CASES, ids=[f"{g[0]}-{m}" for g, m in CASES])
def test_hetero_transfer(tmp_path, daemons, placement, geo, mode):
    name, g = geo
    rng = random.Random(f"{name}-{mode}")
    r = Run(tmp_path, daemons, mode, g["p_tp"], g.get("layerwise", False), d_tp=g["d_tp"], p_kw=g["p"], d_kw=g["d"])
    try:
        want = _exchange(r, rng)
        assert not r.D.failed, sorted(r.D.failed)
        assert want <= r.checked, sorted(want - r.checked)
        assert r.checked_bytes > 0
        assert not r.held_violations, r.held_violations
        assert not r.nixl_diffs and not r.nixl_diffs_d, r.nixl_diffs + r.nixl_diffs_d
        poster = r.P if mode == "push" else r.D
        assert poster.stats.get("failed_transfers", 0) == 0, poster.stats
        assert _free_both(r), (r.P.sched.kv_cache_manager.block_pool.get_num_free_blocks(), r.P.initial_free,
                               r.D.sched.kv_cache_manager.block_pool.get_num_free_blocks(), r.D.initial_free)
    finally:
        r.close()



# Pairs kvxfer refuses at handshake, with what the refusal must name.
# "d-first": D's requests are scheduled, refused and recomputed before P
# holds its requests (push only: in pull D waits for P's params), so the
# consumer ranks' give-ups reach P before its requests do.
REFUSED = [
    ("tp3to2", _geo(3, 2), ("TP 3", "TP 2", "not a multiple")),
    ("tp2to3", _geo(2, 3), ("TP 2", "TP 3", "not a multiple")),
    ("block16to24-tp1to2", _geo(1, 2, d_block=24), ("block 16", "block 24", "kernel block sizes")),
    ("dpp2", {**_geo(), "d": {"pp": 2}}, ("PP 2", "PPSize = 2")),
    ("kvheads12to4", {**_geo(), "d": {"kv_heads": 4}}, ("compatibility hash", "total_kv_heads")),
]
RCASES = [(g, m, o) for g in REFUSED for m, o in (("push", "p-first"), ("push", "d-first"), ("pull", "p-first"))]


@pytest.mark.parametrize("geo,mode,order", RCASES, ids=[f"{g[0]}-{m}-{o}" for g, m, o in RCASES])
def test_hetero_refused(tmp_path, daemons, placement, geo, mode, order, caplog):
    """A pair kvxfer refuses: every D request fails with an error naming
    what differs, counted on both sides, is recomputed on D (one outcome
    each), and P frees its blocks at once: its lease (300 s) never runs
    out in the test. Before, P held them for its whole lease where no
    consumer rank maps to a producer rank (TP sizes neither of which
    divides the other: nobody told P), and where a consumer of more ranks
    than P gave up before P held the request (the second rank's cancel
    dropped the first one's waiting give-up)."""
    name, g, names = geo
    rng = random.Random(f"{name}-{mode}-{order}")
    r = Run(tmp_path, daemons, mode, g["p_tp"], d_tp=g["d_tp"], p_kw={**g["p"], "lease_s": 300}, d_kw=g["d"])
    ids = range(3)
    toks = {n: [rng.randrange(100, 50000) for _ in range(40)] for n in ids}
    try:
        with caplog.at_level("WARNING", logger="kvxfer.vllm"):
            if order == "d-first":
                for n in ids:
                    r.prompts[f"d-{n}"] = r.prompts[f"p-{n}"] = toks[n]
                    params = {**_push_params(r.dp, f"t{n}"), "tp_size": g["p_tp"]}
                    r.D.sched.add_request(H.make_request(f"d-{n}", toks[n], 3, params, r.D.block))
                r.run_until(lambda: {f"d-{n}" for n in ids} <= set(r.D.finished), limit_s=20)
                for n in ids:
                    r.P.sched.add_request(H.make_request(f"p-{n}", list(toks[n]), 1, {"do_remote_decode": True,
                                                                                      "transfer_id": f"t{n}"}, r.P.block))
            else:
                for n in ids:
                    r.add(n, toks[n])
            r.run_until(lambda: {f"d-{n}" for n in ids} <= set(r.D.finished) and {f"p-{n}" for n in ids} <= set(r.P.finished)
                        and not r.P.sched.requests and not r.D.sched.requests, limit_s=20)
        assert not r.checked and r.D.failed == {f"d-{n}" for n in ids}, (r.checked, r.D.failed)
        # Each D request ended once, finished by vLLM after recomputing.
        assert all(r.D.finished[f"d-{n}"].finish_reason is not None for n in ids)
        msgs = [m for m in caplog.messages if "d-0" in m and "failed" in m]
        assert msgs and all(x in msgs[0] for x in names), (names, msgs[:1])
        assert r.D.stats.get("failed_recv", 0) >= len(ids) and r.P.stats.get("failed_send", 0) >= len(ids), (r.D.stats, r.P.stats)
        assert r.P.stats.get("expired", 0) == 0, r.P.stats
        assert _free_both(r)
    finally:
        r.close()
