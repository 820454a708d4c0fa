"""build_hello's layout under vLLM's hybrid KV cache manager (on GPUs,
with a connector that supports it, as kvxfer's does): one tensor holds a
layer of each cache group, each group's blocks in it. The region must be
listed in every group whose layers use it, or the blocks of the other
groups in it never move (D reported done on stale KV) or a group is left
with no region at all."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import vllm  # noqa: F401,E402  (kvxfer.vllm needs it; CI installs it)

import kvxfer.vllm as kv  # noqa: E402
from kvxfer.v1 import kvxfer_pb2 as pb  # noqa: E402

FA, SW = pb.CACHE_KIND_FULL_ATTENTION, pb.CACHE_KIND_SLIDING_WINDOW


def _hybrid(monkeypatch, fa: list[int], sw: list[int], layerwise: bool = False):
    """A hello of a model whose full-attention layers are fa and sliding-
    window layers sw, the i-th layer of each group sharing tensor i (as
    vLLM's hybrid allocator lays them out)."""
    monkeypatch.setattr(kv, "share_memory", lambda w, tensors, ranges: [])
    monkeypatch.setattr(kv, "compat_hash", lambda cfg, mode, backoff=0: "h")
    name = "model.layers.{}.self_attn.attn".format
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[name(i) for i in fa], kv_cache_spec=None),
                                           SimpleNamespace(layer_names=[name(i) for i in sw], kv_cache_spec=None)])
    c = SimpleNamespace(groups=[(FA, 0), (SW, 32)], tp_size=1, pp_size=1, engine_id="p", block_size=16,
                        in_process=False)
    w = SimpleNamespace(kv_cache_config=cfg, c=c, tp_rank=0, pp_rank=0, layer_index={},
                        cfg=SimpleNamespace(mode=pb.MODE_PUSH, layerwise=layerwise), vllm_config=None)
    tensors = [torch.zeros(8, 2, 16, 8, dtype=torch.float16) for _ in fa]
    caches = {}
    for i, (f, s) in enumerate(zip(fa, sw)):
        caches[name(f)], caches[name(s)] = tensors[i], tensors[i]
    return kv.build_hello(w, caches), tensors


@pytest.mark.parametrize("fa,sw", [([0, 3], [1, 2]), ([1, 3], [0, 2]), ([0, 2], [1, 3])])
def test_shared_tensor_listed_in_every_group(monkeypatch, fa, sw):
    h, tensors = _hybrid(monkeypatch, fa, sw)
    bases = [r.base for r in h.layout.regions]
    assert sorted(bases) == sorted(t.data_ptr() for t in tensors), "one region per tensor"
    want = sorted(range(len(tensors)))
    for g in h.layout.groups:
        assert sorted(g.regions) == want, (
            f"group {pb.CacheKind.Name(g.kind)} lists regions {list(g.regions)}: each tensor holds one of its layers, "
            "so each group's blocks in every region must move")


def test_shared_tensor_refused_layerwise(monkeypatch):
    with pytest.raises(ValueError, match="another cache group"):
        _hybrid(monkeypatch, [0, 3], [1, 2], layerwise=True)
