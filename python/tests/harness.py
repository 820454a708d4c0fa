"""Test harness: real kvxferd processes, and vLLM's own v1 Scheduler (with its
real KV cache manager) plus worker-role connectors over real CPU tensors
shared with the daemons, driven step by step as vLLM's engine core and model
runner drive them. Nothing here fakes kvxfer: only the model's forward pass is
replaced by writing a known pattern into P's KV cache.

What it does not exercise (a real vLLM engine does; none runs on this CPU
machine):

- vLLM's executors: every worker-role connector lives in the test's process
  and is called directly; no multiprocess executor, no worker processes, no
  pickling of the connector metadata between processes (the metadata
  relay's StepMeta bytes are decoded in-process).
- Async scheduling: each step here is schedule, then the workers, then
  update_from_output; vLLM's async scheduler schedules step n+1 before step
  n's output is back, which this harness never does.
- vLLM's own call order: step() calls the worker hooks in a fixed order
  written after kv_connector_model_runner_mixin (bind, the "forward",
  save_kv_layer for every layer after it, then start_load_kv, as vLLM 0.32
  starts asynchronous loads after the forward launch (before it when the
  step has synchronous loads), wait_for_save,
  get_transfer_results, get_block_ids_with_load_errors,
  get_kv_connector_stats, clear), not through vLLM's model runner: no
  forward context, no wait_for_layer_load between layers, save_kv_layer
  never interleaved with compute, no CUDA graphs, no preemption.
- Hybrid (Mamba) models' workers: the connector's worker side registers
  attention caches only, so hybrid engines here are scheduler-only (see
  make_engine's mamba).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]

# The model: an OPT-like config (12 layers, 12 KV heads of 64), no weights.
LAYERS = 12
HEADS = 12
HEAD_SIZE = 64
BLOCK = 16
DTYPE = torch.float16
# An MLA model's (mla=True) latent per token: kv_lora_rank 64 + rope 32.
MLA_LATENT = 96


def build_kvxferd(out_dir: Path) -> Path:
    """kvxferd built from this checkout, or $KVXFER_KVXFERD: a binary built
    already (test/gpu/run: the GPU machine has no Go toolchain)."""
    if os.environ.get("KVXFER_KVXFERD"):
        return Path(os.environ["KVXFER_KVXFERD"])
    exe = out_dir / "kvxferd"
    subprocess.run(["go", "build", "-o", str(exe), "./cmd/kvxferd"], cwd=REPO, check=True)
    return exe


def build_libkvxfer(out_dir: Path) -> Path:
    """libkvxfer.so built from this checkout (go build -buildmode=c-shared),
    or $KVXFER_LIBKVXFER: a library built already."""
    if os.environ.get("KVXFER_LIBKVXFER"):
        return Path(os.environ["KVXFER_LIBKVXFER"])
    lib = out_dir / "libkvxfer.so"
    subprocess.run(["go", "build", "-buildmode=c-shared", "-o", str(lib), "./cmd/libkvxfer"], cwd=REPO, check=True)
    return lib


def freeze(proc) -> None:
    """SIGSTOP the process proc (a subprocess.Popen) and wait until every
    thread of it has stopped (state T in /proc), up to 10 s: a stop is not
    in force when kill(2) returns, and on a loaded host the process runs on
    for milliseconds (as daemontest.Proc.Freeze)."""
    import glob
    import signal
    proc.send_signal(signal.SIGSTOP)
    if not os.path.isdir(f"/proc/{proc.pid}/task"):
        time.sleep(0.1)
        return
    deadline = time.monotonic() + 10
    while True:
        running = []
        for f in glob.glob(f"/proc/{proc.pid}/task/*/stat"):
            try:
                with open(f) as fh:
                    st = fh.read()
            except OSError:
                continue  # the thread ended
            state = st[st.rfind(")") + 2:st.rfind(")") + 3]
            if state not in ("T", "t", ""):
                running.append(f"{f.split('/')[-2]}:{state}")
        if not running:
            return
        assert time.monotonic() < deadline, f"pid {proc.pid}: threads {running} not stopped 10 s after SIGSTOP"
        time.sleep(0.001)


_GIVEN_PORTS: set = set()


def free_port() -> int:
    """A TCP port free on loopback now, below the kernel's ephemeral range
    (as internal/testport picks them): a port the system picks for :0 may
    become another connection's source port before the test binds it.
    Never one given before in this process (free again or not): two
    servers that each picked a port before either bound it would
    collide."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    for _ in range(1000 if high > 10100 else 0):
        port = random.randrange(10000, high)
        if port in _GIVEN_PORTS:
            continue
        _GIVEN_PORTS.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # an unusual range: the system's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of n consecutive TCP ports free on loopback now (as
    free_port picks them), none of them given before in this process."""
    import socket
    for _ in range(200):
        base = free_port()
        if any(p in _GIVEN_PORTS for p in range(base + 1, base + n)):
            continue
        _GIVEN_PORTS.update(range(base, base + n))
        held = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def nixl_python_libs() -> str | None:
    """The directory of the libraries NIXL's Python API (nixl_cu12, in this
    Python) loads, libnixl_capi.so among them, or None where it does not
    import."""
    try:
        import nixl_cu12
    except ImportError:
        return None
    libs = Path(nixl_cu12.__file__).resolve().parent.parent / ".nixl_cu12.mesonpy.libs"
    return str(libs) if (libs / "libnixl_capi.so").is_file() else None


def need_nixl(found: bool, what: str = "NIXL") -> None:
    """Skips a test whose NIXL (what) is not found here; in CI, which
    installs the nixl-cu12 wheel and sets NIXL_CAPI_LIB, fails it instead."""
    if found:
        return
    import pytest
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not available (CI installs the nixl-cu12 wheel and sets NIXL_CAPI_LIB)")
    pytest.skip(f"{what} is not available here (no nixl-cu12 wheel, no NIXL_CAPI_LIB)")


def secret_file(work: Path) -> str:
    """The peer secret every daemon of work shares (made once, mode 0600):
    kvxferd authenticates its peers, and daemons peer only with the same
    secret."""
    path = work / "peer.secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
    return str(path)


class Daemon:
    """One kvxferd serve process on a unix socket and a loopback peer port,
    peering with the other daemons of work (one shared secret)."""

    def __init__(self, exe: Path, work: Path, name: str, extra: list[str] | None = None):
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = str(self.dir / "kvxferd.sock")
        self.shm_dir = str(self.dir / "shm")
        os.makedirs(self.shm_dir, exist_ok=True)
        self.exe, self.extra, self.name = exe, extra, name
        self.secret = secret_file(work)
        self.log = open(self.dir / "log", "w")
        self._start()

    def _start(self) -> None:
        ready = self.dir / "ready"
        ready.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [str(self.exe), "serve", "-socket", self.socket, "-peer-listen", "127.0.0.1:0", "-metrics-listen", "",
             "-shm-dir", self.shm_dir, "-ready-file", str(ready), "-log-level", "warn", "-peer-secret-file", self.secret,
             *(self.extra or [])],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvxferd {self.name} did not start: {(self.dir / 'log').read_text()}")
            time.sleep(0.02)
        self.peer = ready.read_text().strip()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> None:
        """A new kvxferd on the same socket and shm dir (a new peer port)."""
        if self.proc.poll() is None:
            self.kill()
        self._start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class InProcess:
    """Stands in for a Daemon where the engines run placement in-process:
    each engine's connectors start (or share) this process's libkvxfer
    server; the peer address is known once the engine's scheduler opened
    (make_engine sets it). The test's engines all live in this process, so
    they share one server and peer_port 0 (the system picks)."""

    placement = "in-process"

    def __init__(self, work: Path, name: str, peer_port: int = 0, server: dict | None = None):
        self.name = name
        self.peer_port = peer_port
        self.server = {"log_level": "warn", **(server or {})}
        self.secret = secret_file(work)
        self.peer = ""
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)

    def stop(self) -> None:
        pass


def model_dir(work: Path, mtp: int = 0, kv_heads: int = HEADS, mla: bool = False) -> Path:
    """A model directory holding only a config.json: an OPT-like model, or
    with mtp > 0 one of the same geometry with mtp multi-token-prediction
    modules (MiMo's architecture on a Qwen2 config, which vLLM's
    SpeculativeConfig(method="mtp") turns into a multi-module MTP drafter),
    or with kv_heads < HEADS a GQA model of the same geometry (Qwen2) with
    kv_heads KV heads, or with mla an MLA model of the same depth (DeepSeek
    V2: one latent of MLA_LATENT per token, the same on every TP rank)."""
    if mla:
        d = work / "model-mla"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps({
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "num_hidden_layers": LAYERS,
            "hidden_size": HEADS * HEAD_SIZE, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "kv_lora_rank": 64,
            "q_lora_rank": None, "qk_rope_head_dim": MLA_LATENT - 64, "qk_nope_head_dim": 32, "v_head_dim": HEAD_SIZE,
            "intermediate_size": 1024, "moe_intermediate_size": 256, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "first_k_dense_replace": LAYERS, "vocab_size": 50272, "max_position_embeddings": 2048,
            "torch_dtype": "float16", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        }))
        return d
    if kv_heads != HEADS:
        assert not mtp and HEADS % kv_heads == 0, (mtp, kv_heads)
        d = work / f"model-kv{kv_heads}"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": LAYERS,
            "hidden_size": HEADS * HEAD_SIZE, "num_attention_heads": HEADS, "num_key_value_heads": kv_heads,
            "head_dim": HEAD_SIZE, "intermediate_size": 3072, "vocab_size": 50272, "max_position_embeddings": 2048,
            "torch_dtype": "float16", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False,
        }))
        return d
    if not mtp:
        d = work / "model"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps({
            "architectures": ["OPTForCausalLM"], "model_type": "opt", "num_hidden_layers": LAYERS, "hidden_size": HEADS * HEAD_SIZE,
            "num_attention_heads": HEADS, "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048,
            "word_embed_proj_dim": HEADS * HEAD_SIZE, "torch_dtype": "float16", "do_layer_norm_before": True,
        }))
        return d
    d = work / f"model-mtp{mtp}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "num_hidden_layers": LAYERS, "hidden_size": HEADS * HEAD_SIZE,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_SIZE, "intermediate_size": 3072,
        "vocab_size": 50272, "max_position_embeddings": 2048, "torch_dtype": "float16", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "num_nextn_predict_layers": mtp,
    }))
    return d


def vllm_config(work: Path, engine_id: str, daemon: Daemon, mode: str, tp: int, layerwise: bool = False,
                policy: str = "recompute", timeout_s: float = 5, num_blocks: int = 96, lease_s: float = 30,
                registration_timeout_s: float = 20, layout: str | None = None, relay: str = "auto", mtp: int = 0,
                batched: int = 4096, verify: bool = True, block: int = BLOCK, kv_heads: int = HEADS, pp: int = 1,
                mla: bool = False):
    """The engine's VllmConfig. mtp > 0: a multi-module MTP drafter with mtp
    speculative tokens (vLLM's num_prefill_lookahead_tokens = mtp).
    batched: max_num_batched_tokens (small values chunk prefills).
    verify False: as a production engine runs (no comparison with the
    daemon's Scheduler). block: vLLM's block_size; kv_heads: the model's
    KV heads (fewer than HEADS: GQA); pp: pipeline_parallel_size; mla: an
    MLA model."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    mc = ModelConfig(model=str(model_dir(work, mtp, kv_heads, mla)), skip_tokenizer_init=True, dtype="float16", seed=0,
                     max_model_len=1024)
    # verify: every decision the connector makes is checked against the
    # daemon's Scheduler, on every step; a disagreement raises (and
    # conftest fails the test whatever became of the exception).
    extra = {"mode": mode, "timeout_s": timeout_s, "registration_timeout_s": registration_timeout_s, "lease_s": lease_s,
             "relay": relay, "verify": verify}
    if getattr(daemon, "placement", "daemon") == "in-process":
        extra.update({"placement": "in-process", "peer_host": "127.0.0.1", "peer_port": daemon.peer_port,
                      "peer_secret_file": daemon.secret, "server": dict(daemon.server)})
    else:
        extra.update({"placement": "daemon", "socket": daemon.socket, "shm_dir": daemon.shm_dir})
    if layerwise:
        extra["layerwise"] = True
    ktc = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.vllm", kv_role="kv_both",
                           engine_id=engine_id, kv_connector_extra_config=extra, kv_load_failure_policy=policy)
    cc = CacheConfig(block_size=block, enable_prefix_caching=True)
    cc.num_gpu_blocks = num_blocks
    sc = SchedulerConfig(max_num_seqs=min(64, batched), max_num_batched_tokens=batched, max_model_len=1024, is_encoder_decoder=False,
                         enable_chunked_prefill=True)
    pc = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=mtp, target_model_config=mc, target_parallel_config=pc) \
        if mtp else None
    cfg = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, parallel_config=pc,
                     device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc, speculative_config=spec)
    assert cfg.num_prefill_lookahead_tokens == mtp, cfg.num_prefill_lookahead_tokens
    # The harness runs every worker-role connector in the test's process, as
    # vLLM's uniprocess executor does (vLLM's CPU platform asks for its
    # multiprocess one, whose workers would run in processes of their own).
    cfg.parallel_config.distributed_executor_backend = "uni"
    # As the engine core does: the attention backend offers its layouts
    # (NHD first, as FlashAttention does) and the connector's required one
    # wins.
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    if layout is not None:
        cfg.cache_config.kv_cache_layout = layout  # as VLLM_KV_CACHE_LAYOUT would
    resolve_kv_cache_layout(cfg, [["LBNHC", "LBHNC"]])
    assert layout is not None or mla or cfg.cache_config.kv_cache_layout in ("LBHNC", "HND"), cfg.cache_config.kv_cache_layout
    return cfg


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """The KV heads each TP rank holds: a share, or one (replicated) where
    the model has fewer KV heads than TP ranks, as vLLM gives them."""
    return max(1, kv_heads // tp)


def kv_cache_config(cfg, tp: int, num_blocks: int, mamba: bool = False, block: int = BLOCK, kv_heads: int = HEADS,
                    layers: range = range(LAYERS), mla: bool = False):
    """One full-attention group over the layers given (all, or a pipeline
    stage's); with mamba, a hybrid model instead: half the layers
    attention, half Mamba (a MambaSpec group), block lists only (no
    tensors: no worker can register it)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec
    if mla:
        spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=MLA_LATENT, dtype=DTYPE)
    else:
        spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads_per_rank(kv_heads, tp), head_size=HEAD_SIZE, dtype=DTYPE)
    if mamba:
        half = LAYERS // 2
        state = MambaSpec(block_size=block, shapes=((HEADS // tp, HEAD_SIZE),), dtypes=(DTYPE,))
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"model.decoder.layers.{i}.self_attn.attn" for i in range(half)], spec),
            KVCacheGroupSpec([f"model.decoder.layers.{i}.mixer" for i in range(half, LAYERS)], state)])
    names = [f"model.decoder.layers.{i}.self_attn.attn" for i in layers]
    page = spec.page_size_bytes
    return get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(names, spec)], page * len(names) * num_blocks)


def pattern(layer: int, heads: np.ndarray, pos: np.ndarray, toks: np.ndarray, width: int = 2 * HEAD_SIZE) -> np.ndarray:
    """The K|V content (width elements: 2D, or an MLA latent) P writes for
    (layer, global heads, positions): [H, N, width] float16, a function of
    the token id at each position, so prefix hits on D (same prompt prefix)
    hold the same bytes and any mix-up of requests, layers, heads or
    positions shows."""
    base = (layer * 131 + heads[:, None] * 31 + pos[None, :] * 7 + toks[None, :] * 13) % 2039
    return ((np.arange(width, dtype=np.int64)[None, None, :] * 3 + base[:, :, None]) % 2048).astype(np.float16)


def _runs(e: "Engine", blocks: list[int], start: int, end: int):
    """(kernel block, first offset, positions) for positions [start, end)
    of e's cache: a block of e.block tokens is e.block // e.kernel kernel
    blocks of e.kernel tokens in the views."""
    ratio = e.block // e.kernel
    pos = start
    while pos < end:
        b, off = blocks[pos // e.block] * ratio + (pos % e.block) // e.kernel, pos % e.kernel
        n = min(e.kernel - off, end - pos)
        yield b, off, np.arange(pos, pos + n)
        pos += n


@dataclass
class Rank:
    connector: object
    kv: dict
    buf: object
    tp_rank: int
    pp_rank: int = 0


@dataclass
class Engine:
    """One vLLM engine: its real Scheduler and one worker connector per rank."""

    name: str
    role: str  # "P" or "D"
    sched: object
    ranks: list[Rank]
    tp: int
    kvc: object
    aggregator: object
    initial_free: int
    sent: set = field(default_factory=set)
    recvd: set = field(default_factory=set)
    failed: set = field(default_factory=set)  # receives reported failed
    finished: dict = field(default_factory=dict)  # request id -> finish status
    layers_saved: int = 0
    stats: dict = field(default_factory=dict)  # the workers' KvxferStats, summed
    block: int = BLOCK  # vLLM's block_size
    kernel: int = BLOCK  # the attention kernel's block size (divides block)
    kv_heads: int = HEADS  # the model's KV heads
    pp: int = 1
    mla: bool = False

    @property
    def width(self) -> int:
        """Elements per head and token: K and V, or the MLA latent."""
        return MLA_LATENT if self.mla else 2 * HEAD_SIZE

    def heads(self, rank: Rank) -> np.ndarray:
        """The model's KV heads rank holds (global indices): its share, or
        the one head it replicates where tp > kv_heads; an MLA latent (one
        "head", 0) on every rank."""
        if self.mla:
            return np.arange(1)
        per = kv_heads_per_rank(self.kv_heads, self.tp)
        first = rank.tp_rank * self.kv_heads // self.tp if self.tp > self.kv_heads else rank.tp_rank * per
        return np.arange(first, first + per)


def make_engine(work: Path, name: str, role: str, daemon: Daemon, mode: str, tp: int, layerwise: bool = False,
                policy: str = "recompute", num_blocks: int = 96, timeout_s: float = 5, mamba: bool = False,
                block: int = BLOCK, kernel: int | None = None, kv_heads: int = HEADS, pp: int = 1, mla: bool = False,
                **kw) -> Engine:
    """An engine over daemon. mamba: a hybrid model (kv_cache_config's),
    scheduler side only: it has no ranks, so drive it with sched_step.
    block: vLLM's block_size; kernel: the attention kernel's block size
    (vLLM's views split each block into block // kernel kernel blocks);
    kv_heads: the model's KV heads (GQA); pp: pipeline stages, each rank of
    a stage holding its layers only (vLLM's get_pp_indices); mla: an MLA
    model (model_dir's)."""
    from kvxfer import shm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import create_kv_cache_views
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm.distributed.utils import get_pp_indices

    cfg = vllm_config(work, name, daemon, mode, tp, layerwise, policy, timeout_s, num_blocks, block=block, kv_heads=kv_heads,
                      pp=pp, mla=mla, **kw)
    geo = {"block": block, "kv_heads": kv_heads, "mla": mla}
    kvc = kv_cache_config(cfg, tp, num_blocks, mamba, **geo)
    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    in_process = getattr(daemon, "placement", "daemon") == "in-process"
    ranks = []
    for r in range(0 if mamba else tp * pp):
        stage, tp_rank = divmod(r, tp)
        rkvc = kvc if pp == 1 else kv_cache_config(cfg, tp, num_blocks, **geo, layers=range(*get_pp_indices(LAYERS, stage, pp)))
        cfg.parallel_config.rank = r
        conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, rkvc)
        conn._worker.tp_rank, conn._worker.pp_rank = tp_rank, stage
        if in_process:
            # A plain host tensor: the in-process server takes it by address.
            buf = None
            raw = torch.zeros(rkvc.kv_cache_tensors[0].size, dtype=torch.int8)
        else:
            buf = shm.create(rkvc.kv_cache_tensors[0].size, daemon.shm_dir)
            raw = torch.frombuffer(buf.buffer, dtype=torch.int8, count=rkvc.kv_cache_tensors[0].size)
        kv = {}
        for t in rkvc.kv_cache_tensors:
            spec = rkvc.kv_cache_groups[0].kv_cache_spec
            kv.update(zip(t.layers, create_kv_cache_views(raw, spec, rkvc.num_blocks, layout, t,
                                                          kernel_block_size=kernel if kernel not in (None, block) else None)))
        conn.register_kv_caches(kv)
        ranks.append(Rank(conn, kv, buf, tp_rank, stage))
    cfg.parallel_config.rank = 0
    # The scheduler after the workers, as vLLM's engine core builds them
    # (its executor first): in-process, a scheduler side finds the server
    # of a rank in its process, or starts its own.
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(cfg),
                      block_size=block, log_stats=True)
    if in_process:
        daemon.peer = sched.connector._sched.addr
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    return Engine(name, role, sched, ranks, tp, kvc, KVOutputAggregator(tp * pp), free, block=block, kernel=kernel or block,
                  kv_heads=kv_heads, pp=pp, mla=mla)


_HASH_READY = False


def make_request(rid: str, tokens: list[int], max_tokens: int, kv_params: dict | None, block: int = BLOCK):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    global _HASH_READY
    if not _HASH_READY:
        init_none_hash(sha256)  # once per process, as the engine core does
        _HASH_READY = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.extra_args = {"kv_transfer_params": kv_params} if kv_params is not None else None
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(block, sha256))


def _layers(rank) -> list[tuple[int, object]]:
    return sorted(((int(n.split(".")[3]), t) for n, t in rank.kv.items()), key=lambda x: x[0])


def write_kv(e: Engine, rid: str, tokens: list[int], start: int, n: int) -> None:
    """P's forward pass: the KV of positions [start, start+n) of request rid."""
    blocks = e.sched.kv_cache_manager.get_block_ids(rid)[0]
    toks = np.asarray(tokens)
    for rank in e.ranks:
        heads = e.heads(rank)
        for li, v in _layers(rank):  # v: [B, H, N, 2D] float16
            for b, off, pos in _runs(e, blocks, start, start + n):
                v[b, :, off:off + len(pos)] = torch.from_numpy(pattern(li, heads, pos, toks[pos], e.width))


def check_kv(e: Engine, rid: str, tokens: list[int], upto: int) -> int:
    """Every byte of D's blocks for positions [0, upto) equals P's pattern;
    returns the bytes checked. Raises AssertionError naming the first bad
    (layer, head, position)."""
    blocks = e.sched.kv_cache_manager.get_block_ids(rid)[0]
    toks = np.asarray(tokens)
    checked = 0
    for rank in e.ranks:
        heads = e.heads(rank)
        for li, v in _layers(rank):
            for b, off, pos in _runs(e, blocks, 0, upto):
                got = v[b, :, off:off + len(pos)].numpy()
                want = pattern(li, heads, pos, toks[pos], e.width)
                if not np.array_equal(got, want):
                    h, n = [int(x[0]) for x in np.nonzero((got != want).any(axis=2))]
                    raise AssertionError(f"{e.name} request {rid}: layer {li} head {heads[h]} position {pos[n]} (block {b}) "
                                         f"holds {got[h, n, :4]}..., want {want[h, n, :4]}...")
                checked += want.nbytes
    return checked


def step(e: Engine, prompts: dict[str, list[int]], fill: bool = True):
    """One engine step: schedule, the workers' connector calls around a
    forward pass that writes P's KV (and signals each layer saved), vLLM's
    own output aggregation, then update_from_output."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    so = e.sched.schedule()
    outs = []
    sync_loads = getattr(so, "has_sync_kv_loads", False)
    for rank in e.ranks:
        c = rank.connector
        c.bind_connector_metadata(so.kv_connector_metadata)
        if sync_loads:
            c.start_load_kv(None)
    if fill:
        for rid, n in so.num_scheduled_tokens.items():
            req = e.sched.requests[rid]
            start = req.num_computed_tokens - n
            upto = min(start + n, req.num_prompt_tokens)
            if start < upto:
                write_kv(e, rid, prompts[rid], start, upto - start)
    for rank in e.ranks:
        c = rank.connector
        for li, (name, t) in enumerate(sorted(rank.kv.items(), key=lambda kv: int(kv[0].split(".")[3]))):
            c.save_kv_layer(name, t, None)
        if not sync_loads:
            c.start_load_kv(None)  # after the forward launch (vLLM 0.32)
        c.wait_for_save()
    for rank in e.ranks:
        c = rank.connector
        res = c.get_transfer_results(so.finished_req_ids)
        stats = c.get_kv_connector_stats()
        if stats is not None:
            for k, v in stats.data.items():
                e.stats[k] = e.stats.get(k, 0) + v
        kvo = KVConnectorOutput(finished_sending=res.finished_sending or None, finished_recving=res.finished_recving or None,
                                failed_recving=res.failed_recving, invalid_block_ids=c.get_block_ids_with_load_errors(),
                                kv_connector_stats=stats)
        c.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = e.sched.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        outs.append(ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                      sampled_token_ids=sampled, kv_connector_output=kvo))
    out = e.aggregator.aggregate(outs)
    kvo = out.kv_connector_output
    if kvo is not None:
        e.sent |= set(kvo.finished_sending or ())
        e.recvd |= set(kvo.finished_recving or ())
        e.failed |= set(kvo.failed_recving or ())
    eco = e.sched.update_from_output(so, out)
    for outs_ in eco.values():
        for o in outs_.outputs:
            if o.finish_reason is not None:
                e.finished[o.request_id] = o
    return so, out


def sched_step(e: Engine, finished_sending=(), finished_recving=()):
    """One step of an engine without ranks (make_engine's mamba): schedule,
    then update_from_output with the finished sets given (what its workers
    would have reported) and a token sampled for each request whose prompt
    is computed, as vLLM's own connector unit tests drive a scheduler."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    so = e.sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if e.sched.requests[r].num_computed_tokens >= e.sched.requests[r].num_tokens else [] for r in ids]
    kvo = KVConnectorOutput(finished_sending=set(finished_sending) or None, finished_recving=set(finished_recving) or None)
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
                            kv_connector_output=kvo)
    e.sent |= set(finished_sending)
    e.recvd |= set(finished_recving)
    for outs_ in e.sched.update_from_output(so, out).values():
        for o in outs_.outputs:
            if o.finish_reason is not None:
                e.finished[o.request_id] = o
    return so


def shutdown(e: Engine) -> None:
    for r in e.ranks:
        r.connector.shutdown()
    e.sched.shutdown()
    for r in e.ranks:
        if r.buf is not None:
            r.buf.close(unmap=False)  # tensors over it may outlive the engine


def attach_nixl_shadow(e: Engine, mode: str) -> tuple[list[str], dict]:
    """Runs vLLM's own NixlConnector (scheduler side, push or pull) beside
    ours on every on_new_request, get_num_new_matched_tokens and
    request_finished call, on a copy of the request, and records every
    decision where they differ: how P trims a prompt it prefills for a
    remote decode (prompt length, max_tokens), how many tokens arrive
    remotely, whether blocks are held for a transfer (delay_free_blocks)
    and the remote_num_tokens P returns. (The daemon's own Scheduler, Go,
    is compared by the connector itself: vllm_config's verify.) Returns the
    list the mismatches go to and the number of calls compared."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector, NixlPushConnector
    from vllm.v1.utils import ConstantList

    cfg = copy.deepcopy(e.sched.vllm_config)
    cfg.kv_transfer_config.kv_connector_extra_config = {}
    nixl = (NixlPushConnector if mode == "push" else NixlPullConnector)(cfg, KVConnectorRole.SCHEDULER, e.kvc)
    ours = e.sched.connector
    diffs: list[str] = []
    calls = {"new": 0, "matched": 0, "finished": 0}

    def twin(request, tokens=False):
        r = copy.copy(request)
        r.kv_transfer_params = copy.deepcopy(request.kv_transfer_params)
        if tokens:  # NixlConnector trims these in place
            if request.prompt_token_ids is not None:
                r.prompt_token_ids = list(request.prompt_token_ids)
            r._all_token_ids = list(request._all_token_ids)
            r.all_token_ids = ConstantList(r._all_token_ids)
        return r

    def shape(r):
        return {"prompt": r.num_prompt_tokens, "tokens": r.num_tokens, "max_tokens": r.max_tokens}

    orig_new, orig_match = ours.on_new_request, ours.get_num_new_matched_tokens
    orig_alloc, orig_fin = ours.update_state_after_alloc, ours.request_finished_all_groups

    def new(request):
        calls["new"] += 1
        t = twin(request, tokens=True)
        nixl.on_new_request(t)
        orig_new(request)
        if shape(request) != shape(t) or list(request.prompt_token_ids or ()) != list(t.prompt_token_ids or ()):
            diffs.append(f"{e.name} {request.request_id}: on_new_request left {shape(request)}, NixlConnector {shape(t)}")

    def match(request, computed):
        calls["matched"] += 1
        want = nixl.get_num_new_matched_tokens(twin(request), computed)
        got = orig_match(request, computed)
        if tuple(got) != tuple(want):
            diffs.append(f"{e.name} {request.request_id}: matched tokens {got}, NixlConnector {want}")
        return got

    def alloc(request, blocks, external):
        nixl.update_state_after_alloc(twin(request), blocks, external)
        return orig_alloc(request, blocks, external)

    def fin(request, block_ids):
        calls["finished"] += 1
        want, wparams = nixl.request_finished_all_groups(twin(request), block_ids)
        got, params = orig_fin(request, block_ids)
        if got != want:
            diffs.append(f"{e.name} {request.request_id} ({request.status.name}): delay_free_blocks {got}, NixlConnector {want}")
        wt = None if wparams is None else wparams.get("remote_num_tokens")
        gt = None if params is None else params.get("remote_num_tokens")
        if wt != gt:
            diffs.append(f"{e.name} {request.request_id} ({request.status.name}): remote_num_tokens {gt}, NixlConnector {wt}")
        return got, params

    ours.on_new_request, ours.get_num_new_matched_tokens = new, match
    ours.update_state_after_alloc, ours.request_finished_all_groups = alloc, fin
    return diffs, calls
