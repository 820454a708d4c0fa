"""Layer-wise push: a producer request that goes on decoding after its
prefill step (its max_tokens above 1) is listed once, in the step that
completes its prompt; its decode steps are no prefill steps."""
from __future__ import annotations

import random

import pytest

import harness as H
from test_vllm import Run


# Relay "daemon" needs the daemon placement.
CASES = [("daemon", "daemon"), ("daemon", "metadata"), ("in-process", "metadata")]


@pytest.mark.parametrize("placement,relay", CASES, ids=[f"{pl}-{rl}" for pl, rl in CASES])
def test_layerwise_decoding_producer_signals_its_prefill_step_only(tmp_path, placement, daemons, relay):
    """Each decode step of a listed producer request listed it again: the
    daemon's Scheduler ignored the repeat, but the connector flagged the
    step a prefill step (relay "daemon": the ranks signalled every layer
    of every decode step, each counted by the daemon as a LayerSaved no
    request took, layer_saved_unknown_step, and each step was published
    for the repeat alone). Now only the step that completes a prompt is a
    prefill step: each P rank signals each layer once, and D gets every
    byte."""
    rng = random.Random(f"lw-decode-{relay}")
    r = Run(tmp_path, daemons, "push", 1, layerwise=True, p_kw={"relay": relay}, d_kw={"relay": relay})
    try:
        toks = [rng.randrange(100, 50000) for _ in range(40)]
        r.add(0, toks, p_max_tokens=6)
        r.run_until(lambda: "d-0" in r.D.finished and "p-0" in r.P.finished and not r.P.sched.requests
                    and not r.D.sched.requests, limit_s=30)
        assert "d-0" in r.checked and not r.D.failed, (sorted(r.checked), r.D.failed)
        assert r.p_computed["p-0"] > len(toks), r.p_computed  # it decoded after its prefill
        assert r.layer_signals == H.LAYERS * r.p_tp, \
            f"{r.layer_signals} LayerSaved signals, want {H.LAYERS * r.p_tp} (one per layer and rank, its prefill step's)"
    finally:
        r.close()
