"""build_hello's total_kv_heads when a model has fewer KV heads than TP
ranks (vLLM replicates them: each rank's view holds one head). The layout
must name the model's heads, not heads·tp: a producer at TP 4 and a
consumer at TP 2 of a model with 2 KV heads otherwise announce 4 and 2
heads, and kvxferd refuses the pair as different models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import vllm  # noqa: F401,E402  (kvxfer.vllm needs it; CI installs it)

import kvxfer.vllm as kv  # noqa: E402
from kvxfer.v1 import kvxfer_pb2 as pb  # noqa: E402


def _hello(monkeypatch, tp_size: int, local_heads: int, total_heads: int | None):
    monkeypatch.setattr(kv, "share_memory", lambda w, tensors, ranges: [])
    monkeypatch.setattr(kv, "compat_hash", lambda cfg, mode, backoff=0: "h")
    c = SimpleNamespace(groups=[(pb.CACHE_KIND_FULL_ATTENTION, 0)], tp_size=tp_size, pp_size=1, engine_id="p",
                        block_size=16, in_process=False)
    vc = None
    if total_heads is not None:
        vc = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: total_heads))
    w = SimpleNamespace(kv_cache_config=None, c=c, tp_rank=0, pp_rank=0, layer_index={},
                        cfg=SimpleNamespace(mode=pb.MODE_PUSH, layerwise=False), vllm_config=vc)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, local_heads, 16, 8, dtype=torch.float16) for i in range(2)}
    return kv.build_hello(w, caches)


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_replicated_heads_name_the_models_heads(monkeypatch, tp_size):
    # 2 KV heads: one per rank (replicated past TP 2).
    h = _hello(monkeypatch, tp_size, 1, 2)
    assert h.layout.total_kv_heads == 2, f"TP {tp_size}: the model has 2 KV heads"


def test_sharded_heads_unchanged(monkeypatch):
    assert _hello(monkeypatch, 2, 4, 8).layout.total_kv_heads == 8
    # No model config (tests, other engines): heads per rank times TP.
    assert _hello(monkeypatch, 2, 4, None).layout.total_kv_heads == 8


def test_heads_that_disagree_with_the_view_keep_the_views(monkeypatch):
    # A model config whose heads do not give the view's per-rank count
    # (e.g. a cache of another model's shape) is not trusted.
    assert _hello(monkeypatch, 2, 4, 2).layout.total_kv_heads == 8
