"""build_hello's layout for a pipeline-parallel producer: regions pair with
the consumer's (one engine, PP 1) by global index, so a stage after the
first must say where its regions start (RegionOffset); at 0 its layers'
KV would land in the consumer's first layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import vllm  # noqa: F401,E402  (kvxfer.vllm needs it; CI installs it)

import kvxfer.vllm as kv  # noqa: E402
from kvxfer.v1 import kvxfer_pb2 as pb  # noqa: E402


def _hello(monkeypatch, pp_rank: int, pp_size: int, layers: range):
    monkeypatch.setattr(kv, "share_memory", lambda w, tensors, ranges: [])
    monkeypatch.setattr(kv, "compat_hash", lambda cfg, mode, backoff=0: "h")
    c = SimpleNamespace(groups=[(pb.CACHE_KIND_FULL_ATTENTION, 0)], tp_size=1, pp_size=pp_size, engine_id="p",
                        block_size=16, in_process=False)
    w = SimpleNamespace(kv_cache_config=None, c=c, tp_rank=0, pp_rank=pp_rank, layer_index={},
                        cfg=SimpleNamespace(mode=pb.MODE_PUSH, layerwise=True), vllm_config=None)
    # [blocks, heads, tokens, K|V] views, one per layer of this stage.
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 2, 16, 8, dtype=torch.float16) for i in layers}
    return kv.build_hello(w, caches), w


def test_later_stage_region_offset(monkeypatch):
    # 8 layers over 2 stages: stage 1 holds layers 4..7, the consumer's
    # regions 4..7.
    h, _ = _hello(monkeypatch, 1, 2, range(4, 8))
    assert len(h.layout.regions) == 4
    assert h.layout.region_offset == 4, "stage 1's regions must pair with the consumer's regions 4..7"


def test_first_stage_and_single_stage_start_at_zero(monkeypatch):
    h, _ = _hello(monkeypatch, 0, 2, range(0, 4))
    assert h.layout.region_offset == 0
    h, _ = _hello(monkeypatch, 0, 1, range(0, 8))
    assert h.layout.region_offset == 0


def test_layer_saved_names_regions(monkeypatch):
    # Layer-wise LayerSaved names a layer as the server counts them: its
    # region's global index. A layer that shares another's cache (KV
    # sharing) has no region and is not reported; the layers after it
    # keep their regions' indices.
    monkeypatch.setattr(kv, "share_memory", lambda w, tensors, ranges: [])
    monkeypatch.setattr(kv, "compat_hash", lambda cfg, mode, backoff=0: "h")
    c = SimpleNamespace(groups=[(pb.CACHE_KIND_FULL_ATTENTION, 0)], tp_size=1, pp_size=1, engine_id="p",
                        block_size=16, in_process=False)
    w = SimpleNamespace(kv_cache_config=None, c=c, tp_rank=0, pp_rank=0, layer_index={},
                        cfg=SimpleNamespace(mode=pb.MODE_PUSH, layerwise=True), vllm_config=None)
    own = [torch.zeros(4, 2, 16, 8, dtype=torch.float16) for _ in range(3)]
    caches = {"model.layers.0.self_attn.attn": own[0], "model.layers.1.self_attn.attn": own[1],
              "model.layers.2.self_attn.attn": own[0],  # shares layer 0's cache
              "model.layers.3.self_attn.attn": own[2]}
    h = kv.build_hello(w, caches)
    assert len(h.layout.regions) == 3
    assert w.layer_index == {"model.layers.0.self_attn.attn": 0, "model.layers.1.self_attn.attn": 1,
                             "model.layers.3.self_attn.attn": 2}


def test_later_stage_layer_saved(monkeypatch):
    _, w = _hello(monkeypatch, 1, 2, range(4, 8))
    assert sorted(w.layer_index.values()) == [4, 5, 6, 7]
