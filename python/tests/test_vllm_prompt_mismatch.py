"""Push, the router gives D a longer prompt than P's (P prefills 53 tokens,
D's prompt has 54 or 73): D's registration carries how many tokens it takes
as loaded (RecvReq.Tokens), P holds fewer and refuses it, and D's request
fails (recomputed), never reported loaded. Before, a registration carried no
token count: P WRITEs the 53 tokens it holds and D's request was reported
loaded, its blocks past token 53 holding no KV of its prompt (zeros here, a
former request's bytes on a pool that reuses blocks): "d0 request d-1:
layer 0 head 0 position 53 (block 4) holds [0. 0. 0. 0.]..., want [...]".
Pull refuses the same mismatch at D's allocation (RemoteNumTokens)."""

from __future__ import annotations

import random

import pytest

import harness as H
from test_vllm import Run, _free_both, _push_params
from test_vllm_router_params import _ended, _toks


@pytest.mark.parametrize("longer", [1, 20])
def test_push_prompt_longer_on_d_is_not_reported_loaded(tmp_path, daemons, placement, longer):
    rng = random.Random(longer)
    # A lease and a registration timeout of a minute: D's request ends at
    # once, refused, not by either.
    r = Run(tmp_path, daemons, "push", 1, p_kw={"lease_s": 60}, d_kw={"registration_timeout_s": 60}, d_timeout=60)
    try:
        ptoks = _toks(rng, 3 * H.BLOCK + 5)
        r.prompts["p-1"], r.prompts["d-1"] = ptoks, ptoks + _toks(rng, longer)
        r.P.sched.add_request(H.make_request("p-1", list(ptoks), 1, {"do_remote_decode": True, "transfer_id": "t1"}))
        r.D.sched.add_request(H.make_request("d-1", r.prompts["d-1"], 2, {**_push_params(r.dp, "t1"), "tp_size": 1}))
        # Run.step checks every byte of a request D reports loaded.
        r.run_until(lambda: _ended(r, ("d-1",)), limit_s=20)
        assert "d-1" in r.D.failed  # (finished_recving lists it too, with its blocks invalid)
        assert _free_both(r)
    finally:
        r.close()
