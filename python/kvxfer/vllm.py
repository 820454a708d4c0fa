"""vLLM's KV connector over kvxfer: ``KvxferConnector``.

Load it without patching vLLM::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_both", "engine_id": "p0",
                           "kv_connector_extra_config": {"peer_host": "10.0.0.5", "peer_port": 7600,
                                                         "peer_secret_file": "/etc/kvxfer/peer.secret"}}'

Placement ``in-process`` (the default) runs kvxfer's server (libkvxfer,
kvxfer.inprocess) inside vLLM's processes, no kvxferd: each worker rank
starts one at the engine's base peer port plus its rank when it registers
its KV cache (memory named by address: the backend registers the engine's
own memory, which NIXL/UCX need for GPU transports), and the scheduler side
shares a rank's server in its process or starts its own (kvxfer.placement).
Placement ``daemon`` talks to a kvxferd over its unix socket, host KV memory
shared as shm files, GPU memory as CUDA IPC handles.

``kv_connector_extra_config`` keys (all optional but peer authentication):

=========================  ===============================  ======================================
key                        default                          meaning
=========================  ===============================  ======================================
``placement``              ``in-process``                   ``in-process`` or ``daemon``
``peer_host``              ``$KVXFER_PEER_HOST`` or         in-process: this host as peers reach
                           ``127.0.0.1``                    it (peer and data ports bound there)
``peer_port``              ``$KVXFER_PEER_PORT`` or 7600    in-process: the engine's base port;
                                                            rank (pp, tp) at base + pp*tp_size +
                                                            tp, DP rank r after r*tp*pp ports;
                                                            0: system-picked, every rank and the
                                                            scheduler in one process (tests)
``peer_secret_file``       ``$KVXFER_PEER_SECRET_FILE``     in-process: the peers' shared secret;
``tls_cert/key/ca``                                         or mutual TLS; or ``insecure_peers``
``insecure_peers``         false                            true: no peer authentication. One of
                                                            the three is required
``backend``                ``nixl`` on GPUs, else           in-process: the transfer backend
                           ``builtin``
``server``                 {}                               in-process: more libkvxfer keys
                                                            (kvxferd serve's flags, e.g.
                                                            ``peer_timeout``); its
                                                            ``metrics_listen`` HOST:PORT and
                                                            ``data_port_base``: rank (pp, tp) at
                                                            the port + its index, as its peer
                                                            port (the scheduler's own server:
                                                            no metrics)
``etcd``                   unset                            in-process: the fleet registry's
                                                            endpoints (kvxferd -etcd); its
                                                            other keys through ``server``
``socket``                 ``$KVXFERD_SOCKET`` or           daemon: kvxferd's unix socket
                           ``/run/kvxferd.sock``
``shm_dir``                ``$KVXFERD_SHM_DIR`` or          daemon: kvxferd's shm dir (host KV
                           ``/dev/shm``                     memory must be a file under it)
``mode``                   ``push``                         ``push`` or ``pull``
``layerwise``              false                            push each layer as it is saved (P)
``timeout_s``              10                               bound of every daemon call; a dead
                                                            daemon fails requests, never hangs
``lease_s``                30                               P holds finished blocks this long
                                                            without D's heartbeat (pull)
``registration_timeout_s`` 480                              D waits this long for P's WRITE (push)
``relay``                  ``auto``                         ``daemon``: the scheduler's step goes
                                                            out without waiting and the ranks take
                                                            its metadata from the daemon (ranks on
                                                            the scheduler's host; placement daemon
                                                            only); ``metadata``: one Step call per
                                                            step, the metadata inside vLLM's;
                                                            ``auto``: daemon on one node with a
                                                            daemon, else metadata
``verify``                 false                            tests: check every decision made here
                                                            against the daemon's Scheduler (see
                                                            below); a disagreement raises
                                                            ``Disagreement``
=========================  ===============================  ======================================

The scheduler side sends one message per engine step to the daemon (from
``build_connector_meta``) and, by default, does not wait for its answer:
what vLLM needs at once (matched tokens, request_finished's answer) is
computed here by the same rules the daemon's Scheduler applies, and the calls
themselves are batched in order.

Those rules are the Go Scheduler's, decided twice; the daemon's Scheduler
still applies every call (it builds the step's metadata) but answers only
errors. Asking it instead would put a round trip inside each
get_num_new_matched_tokens and request_finished call, where vLLM waits
(~0.3 ms each on a loaded 2-core machine, per waiting request per step,
against a per-step budget of 1 ms at 64 requests: python/bench). With
``verify`` (the test suite sets it) the two are compared on every call of
every step: each matched-token count is asked of the daemon's Scheduler
too (SchedulerService.MatchedTokens, on a channel of its own), the daemon
answers every request_finished row in full (relay "daemon" as "metadata")
and its hold decision (delay) and kv_transfer_params (with the clipped
block ids and starts) must equal those returned to vLLM, answers still in
flight at shutdown included (remote_generation apart: each side stamps the
generation it knew then, see below). A disagreement is logged ("daemon says"),
recorded in ``DISAGREEMENTS`` and raised as ``Disagreement``. Without
``verify``, relay "metadata" still compares delay and remote_num_tokens
and logs a disagreement.

A pull producer's kv_transfer_params (made here by request_finished) carry
the engine's generation as its server's last step answer gave it
(``remote_generation``; StepResponse.generation, none before the first
answer nor in push): a consumer does not read params of a generation the
producer is no longer at (it restarted or re-attached a rank since), whose
blocks may hold another request's KV by then. A consumer's rows carry its
params' remote_generation to its server.

The worker side opens one WorkerService stream per rank, shares the rank's
KV cache with the daemon (host memory as shared-memory files, GPU memory as
CUDA IPC handles) and turns the stream's finished sets into vLLM's
finished/failed sets.

Every request vLLM waits on ends, on every rank: done or failed as the
daemon reports it; failed at once when the daemon refused or never got the
scheduler's call (``fail_recv``/``fail_send``; with relay "daemon", a call
the daemon refused in a step it published is failed by the rank's own
stream instead, never by both; a layer-wise producer a rank holds
prefilling whose finish the daemon never got is told to the ranks as
aborted, so that their workers end it and tell its consumer), or the
rank's stream ended; and failed when
the daemon dropped the step that started the wait (a StepError with
``dropped``: its metadata was never published to the rank).
Each rank names, with each step it takes by reference, what vLLM begins
waiting on with that step, and a dropped step's error names those back,
but a layer-wise producer the rank held prefilling from an earlier step:
the daemon's worker ends that one and reports it failed once its WRITEs in
flight end (its blocks are freed only then). A
failed receive goes to vLLM's ``failed_recving`` (``kv_load_failure_policy``
applies); a failed send is reported finished, so its blocks are freed.

No block is freed while the daemon may still move bytes from or into it:
when the Steps stream breaks (its daemon alive or not), the steps sent on it
and not answered are left to the ranks' outcomes, never ended by the
scheduler side, since the daemon may have applied them. Each rank gets one
outcome per request it named, on its own stream: its worker's (the daemon
also fails at once what a published step does not stage), the step's
dropped error, or the rank's stream ending with the daemon.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvxfer import errors, params
from kvxfer import inprocess
from kvxfer import placement as placement_mod
from kvxfer.client import Client, WorkerStream, step_result
from kvxfer.v1 import kvxfer_pb2 as pb

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, KVConnectorTransferResults,
                                                              SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvxfer.vllm")

CONNECTOR_VERSION = "kvxfer.vllm/1"



# How long kvxferd may go on moving a rank's bytes after its stream ended:
# its close of the rank fences the transfers in flight (WorkerConfig's
# CloseTimeout, 10 s) before it lets the memory go; with a margin.
_DAEMON_FENCE_S = 12.0

class Disagreement(AssertionError):
    """A decision of the connector differs from the daemon's Scheduler's
    (``verify`` only): the two implementations of the same rules diverged."""


# Every Disagreement raised in this process, for a test harness to check
# (an exception can be swallowed on its way out of vLLM's loop).
DISAGREEMENTS: list[str] = []


# Keys by placement (the rest apply to both).
_DAEMON_KEYS = frozenset(("socket", "shm_dir"))
_INPROCESS_KEYS = frozenset(("peer_host", "peer_port", "peer_secret_file", "insecure_peers", "tls_cert", "tls_key", "tls_ca",
                             "backend", "server", "etcd"))
_COMMON_KEYS = frozenset(("placement", "mode", "layerwise", "timeout_s", "lease_s", "registration_timeout_s", "relay",
                          "verify"))


# Hosts a listener on which takes a port on every address.
_ANY_HOST = ("", "0.0.0.0", "::")


# The most seconds a duration key (timeout_s, lease_s, ...) may say: about
# 31 years, well within what the server's durations hold.
_MAX_SECONDS = 1e9


@dataclass
class Config:
    mode: int
    layerwise: bool
    timeout_s: float
    lease_s: float
    registration_timeout_s: float
    relay: str = "auto"
    verify: bool = False
    placement: str = "in-process"
    # placement "daemon"
    socket: str = ""
    shm_dir: str = ""
    # placement "in-process"
    peer_host: str = "127.0.0.1"
    peer_port: int = 7600
    # libkvxfer's keys every server of the engine's processes shares:
    # authentication, backend (None: by the engine's device), the user's
    # extra keys (``server``).
    server: dict = field(default_factory=dict)
    backend: str | None = None
    # Where the user named each libkvxfer key the connector passes on as
    # given (libkvxfer's name: what named it, as
    # "kv_connector_extra_config.server.peer_timeout" or
    # "$KVXFER_PEER_SECRET_FILE"; keys checked together share one), for
    # errors that name the key as the user wrote it.
    server_keys: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "Config":
        e = dict(extra or {})
        known = _DAEMON_KEYS | _INPROCESS_KEYS | _COMMON_KEYS
        unknown = sorted(set(e) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}, want some of {sorted(known)}")
        placement = e.get("placement", "in-process")
        if placement not in placement_mod.PLACEMENTS:
            raise ValueError(f"kv_connector_extra_config.placement = {placement!r}, want in-process or daemon")
        other = _INPROCESS_KEYS if placement == "daemon" else _DAEMON_KEYS
        wrong = sorted(set(e) & other)
        if wrong:
            raise ValueError(f"kv_connector_extra_config: {wrong} apply to placement "
                             f"{'in-process' if placement == 'daemon' else 'daemon'} only, and placement is {placement!r}")
        mode = e.get("mode", "push")
        if mode not in params.MODES:
            raise ValueError(f"kv_connector_extra_config.mode = {mode!r}, want push or pull")
        layerwise = e.get("layerwise", False)
        if not isinstance(layerwise, bool):
            raise ValueError(f"kv_connector_extra_config.layerwise = {layerwise!r}, want true or false")
        if layerwise and mode != "push":
            raise ValueError("kv_connector_extra_config.layerwise needs mode push")
        relay = e.get("relay", "auto")
        if relay not in ("auto", "daemon", "metadata"):
            raise ValueError(f"kv_connector_extra_config.relay = {relay!r}, want auto, daemon or metadata")
        if relay == "daemon" and placement == "in-process":
            raise ValueError("kv_connector_extra_config.relay = 'daemon' needs placement daemon (in-process, the scheduler "
                             "and the ranks run servers of their own: the metadata travels inside vLLM's)")
        verify = e.get("verify", False)
        if not isinstance(verify, bool):
            raise ValueError(f"kv_connector_extra_config.verify = {verify!r}, want true or false")

        def num(key: str, default: float) -> float:
            # A number of seconds: finite (JSON as Python reads it has NaN
            # and Infinity), and one the server's durations hold (int64
            # milliseconds as nanoseconds would wrap past 292 years).
            v = e.get(key, default)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v))
                    or not 0 < v <= _MAX_SECONDS):
                raise ValueError(f"kv_connector_extra_config.{key} = {v!r}, want a number > 0 (seconds, "
                                 f"at most {_MAX_SECONDS:.0e})")
            return float(v)

        c = cls(mode=params.MODES[mode], layerwise=layerwise, timeout_s=num("timeout_s", 10), lease_s=num("lease_s", 30),
                registration_timeout_s=num("registration_timeout_s", 480), relay=relay, verify=verify, placement=placement)
        if placement == "daemon":
            for key in ("socket", "shm_dir"):
                # A path: not a number str() would make one of, nor "" (the
                # default, silently).
                if key in e and (not isinstance(e[key], str) or not e[key]):
                    raise ValueError(f"kv_connector_extra_config.{key} = {e[key]!r}, want a path")
            c.socket = e.get("socket") or os.environ.get("KVXFERD_SOCKET") or "/run/kvxferd.sock"
            c.shm_dir = e.get("shm_dir") or os.environ.get("KVXFERD_SHM_DIR") or "/dev/shm"
        else:
            c._in_process(e)
        return c

    def _in_process(self, e: dict[str, Any]) -> None:
        """Reads and checks placement in-process's keys."""
        if "peer_host" in e:
            host, what = e["peer_host"], "kv_connector_extra_config.peer_host"
        else:
            host, what = os.environ.get("KVXFER_PEER_HOST") or "127.0.0.1", "$KVXFER_PEER_HOST"
        if not placement_mod.is_host(host):
            raise ValueError(f"{what} = {host!r}, want a host name or IP address, without a port "
                             "(this host's, as its peers reach it: transfer params carry it; not a wildcard)")
        self.peer_host = host
        if "peer_port" in e:
            port, what = e["peer_port"], "kv_connector_extra_config.peer_port"
        else:
            port, what = os.environ.get("KVXFER_PEER_PORT") or 7600, "$KVXFER_PEER_PORT"
            if isinstance(port, str) and port.strip().isdigit():
                port = int(port)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"{what} = {port!r}, want a port (0-65535; 0: the system picks one, for an engine "
                             "whose ranks and scheduler all run in one process)")
        self.peer_port = port
        # Peers are authenticated unless the user says otherwise, as
        # kvxferd's -peer-secret-file / -tls-* / -insecure-peers.
        secret = e.get("peer_secret_file")
        if "peer_secret_file" in e and (not isinstance(secret, str) or not secret):
            raise ValueError(f"kv_connector_extra_config.peer_secret_file = {secret!r}, want a file name")
        insecure = e.get("insecure_peers", False)
        if not isinstance(insecure, bool):
            raise ValueError(f"kv_connector_extra_config.insecure_peers = {insecure!r}, want true or false")
        tls = {k: e[k] for k in ("tls_cert", "tls_key", "tls_ca") if k in e}
        for k, v in tls.items():
            if not isinstance(v, str) or not v:
                raise ValueError(f"kv_connector_extra_config.{k} = {v!r}, want a file name")
        if tls and len(tls) != 3:
            raise ValueError(f"kv_connector_extra_config: mutual TLS needs tls_cert, tls_key and tls_ca; got only "
                             f"{sorted(tls)}")
        ways = [w for w, on in (("peer_secret_file", bool(secret)), ("tls_*", bool(tls)), ("insecure_peers", insecure)) if on]
        if len(ways) > 1:
            raise ValueError(f"kv_connector_extra_config: {' and '.join(ways)}: choose one way to secure peers")
        if not ways:
            # Named by none of the keys: the environment's secret, or none.
            secret = os.environ.get("KVXFER_PEER_SECRET_FILE") or None
            if secret is None:
                raise ValueError(
                    "kv_connector_extra_config: placement in-process needs peer authentication: peer_secret_file (or "
                    "$KVXFER_PEER_SECRET_FILE; a file of 16+ random bytes, readable by its owner only, the same on every "
                    "engine), or tls_cert, tls_key and tls_ca, or insecure_peers: true (anyone who reaches the peer and "
                    "data ports can then read and write this engine's KV cache)")
        common: dict[str, Any] = {}
        labels: dict[str, str] = {}
        if secret:
            what = "kv_connector_extra_config.peer_secret_file" if "peer_secret_file" in e else "$KVXFER_PEER_SECRET_FILE"
            if not os.path.isfile(secret):
                raise ValueError(f"{what} = {secret!r}: no such file")
            common["peer-secret-file"] = secret
            labels["peer-secret-file"] = what
        elif tls:
            common.update({k.replace("_", "-"): v for k, v in tls.items()})
            labels.update({k.replace("_", "-"): "kv_connector_extra_config.tls_cert, tls_key, tls_ca" for k in tls})
        else:
            common["insecure-peers"] = True
        backend = e.get("backend")
        if backend is not None and backend not in ("builtin", "nixl"):
            raise ValueError(f"kv_connector_extra_config.backend = {backend!r}, want builtin or nixl")
        self.backend = backend
        srv = e.get("server", {})
        if not isinstance(srv, dict):
            raise ValueError(f"kv_connector_extra_config.server = {srv!r}, want an object of libkvxfer keys "
                             "(kvxferd serve's flag names)")
        for k, v in srv.items():
            if not isinstance(k, str) or not k:
                raise ValueError(f"kv_connector_extra_config.server: key {k!r}, want libkvxfer's key names "
                                 "(kvxferd serve's flag names)")
            name = k.replace("_", "-")
            if name in placement_mod.OWNED_KEYS:
                raise ValueError(f"kv_connector_extra_config.server.{k}: set by the connector (peer_host, peer_port, "
                                 "backend, peer_secret_file, tls_*, insecure_peers)")
            if name in labels:
                # One spelling's value would silently replace the other's.
                raise ValueError(f"kv_connector_extra_config.server.{k} and {labels[name]} name the same key ({name}): "
                                 "name it once")
            if isinstance(v, (dict, list)) or v is None:
                raise ValueError(f"kv_connector_extra_config.server.{k} = {v!r}, want a string, a number or a boolean")
            common[name] = v
            labels[name] = f"kv_connector_extra_config.server.{k}"
        etcd = e.get("etcd")
        if etcd is not None:
            # The fleet registry (kvxferd -etcd): the engine's servers
            # publish it under a lease, resolve producers named by id, and
            # fail what waits on one whose lease ends. Its other settings
            # (etcd-ca, etcd-cert, etcd-key, etcd-ttl, etcd-url...) go
            # through server.
            if not isinstance(etcd, str) or not etcd.strip():
                raise ValueError(f"kv_connector_extra_config.etcd = {etcd!r}, want etcd's endpoints, comma-separated (host:port)")
            if "etcd" in srv:
                raise ValueError("kv_connector_extra_config: etcd and server.etcd: name the endpoints once")
            common["etcd"] = etcd
            labels["etcd"] = "kv_connector_extra_config.etcd"
        common.setdefault("data-host", self.peer_host)
        self.server = common
        self.server_keys = labels

    def server_common(self, device: str) -> dict:
        """libkvxfer's keys shared by the engine's servers, the backend by
        the engine's device when the config names none: NIXL for GPUs (its
        GPU transports need the engine's own memory, hence in-process),
        the built-in one otherwise."""
        out = dict(self.server)
        out["backend"] = self.backend or ("nixl" if device == "cuda" else "builtin")
        return out


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """One step's metadata from the scheduler side to every worker rank."""

    # The daemon's StepMeta, serialized (relay "metadata"; empty: none).
    step_meta: bytes = b""
    # The step the daemon keeps the metadata under (relay "daemon"; 0: none).
    step_ref: int = 0
    # The step may list layer-wise prefills (P then signals saved layers).
    prefill: bool = False
    # Requests vLLM now waits on: receives (WAITING_FOR_REMOTE_KVS) and
    # sends (blocks held by request_finished). Workers report only these.
    expect_recv: list[str] = field(default_factory=list)
    expect_send: list[str] = field(default_factory=list)
    # Requests the daemon refused or never got: workers report them at once
    # (receives as failed, so vLLM's kv_load_failure_policy applies; sends
    # as finished, so their blocks are freed).
    fail_recv: dict[str, str] = field(default_factory=dict)
    fail_send: dict[str, str] = field(default_factory=dict)
    # Layer-wise producers listed in a prefill step whose finish (or
    # abort) the daemon never got (the step's calls were lost), by id, with
    # their transfer ids ("": none): every rank tells its worker they are
    # aborted (StepMeta.not_processed), or a rank holding one prefilling
    # (no lease) held it for ever, its consumer waiting out its timeout.
    abort_listed: dict[str, str] = field(default_factory=dict)


@dataclass
class KvxferStats(KVConnectorStats):
    """Transfer counters summed over ranks (worker side) plus the daemon
    scheduler's counters (scheduler side)."""

    KEYS = ("transfers", "failed_transfers", "bytes", "descriptors", "transfer_seconds", "expired",
            "failed_recv", "failed_send", "bad_params", "daemon_errors")

    def __post_init__(self):
        for k in self.KEYS:
            self.data.setdefault(k, 0)

    def reset(self):
        self.data = {k: 0 for k in self.KEYS}

    def aggregate(self, other: KVConnectorStats) -> "KvxferStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out = dict(self.data)
        n = self.data.get("transfers", 0)
        out["avg_transfer_ms"] = 1000 * self.data.get("transfer_seconds", 0) / n if n else 0.0
        out["avg_mib"] = self.data.get("bytes", 0) / n / (1 << 20) if n else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in self.KEYS)


_FINISH = {
    RequestStatus.FINISHED_STOPPED: pb.FINISH_STATUS_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED: pb.FINISH_STATUS_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED: pb.FINISH_STATUS_ABORTED,
    RequestStatus.FINISHED_ERROR: pb.FINISH_STATUS_ERROR,
}


def _group_kinds(kv_cache_config: "KVCacheConfig | None") -> list[tuple[int, int]]:
    """(CacheKind, window) per KV-cache group."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, SlidingWindowSpec
    out = []
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, MLAAttentionSpec):
            out.append((pb.CACHE_KIND_MLA, 0))
        elif isinstance(spec, SlidingWindowSpec):
            out.append((pb.CACHE_KIND_SLIDING_WINDOW, int(spec.sliding_window)))
        elif isinstance(spec, MambaSpec):
            out.append((pb.CACHE_KIND_MAMBA, 0))
        else:
            out.append((pb.CACHE_KIND_FULL_ATTENTION, 0))
    return out or [(pb.CACHE_KIND_FULL_ATTENTION, 0)]


def prefill_backoff(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> int:
    """The trailing prompt tokens a producer (P) leaves uncomputed and its
    consumer (D) computes itself, as vLLM 0.32's NixlConnector has it
    (nixl/base_scheduler.py, _prefill_backoff), so that P and D agree with
    it and with each other:

    - 1 for a model with Mamba (recurrent) layers: D needs the state after
      token N-1 to derive token N's itself; a state that already holds
      token N would take it twice.
    - 1 for a model with a bounded-replay group (a KV-cache spec with
      prefix_replay_tokens > 0, DeepSeek-V4.1's sliding window): its window
      is not replayed after a load, so it must be laid out for the token D
      computes.
    - the drafter's prefill lookahead less one for multi-module MTP
      (vllm_config.num_prefill_lookahead_tokens: num_speculative_tokens
      there, 1 for other EAGLE-family drafters, 0 without one): P must not
      write unverified drafts into the MTP layers' KV, which D would never
      rebuild.

    The largest applies. 0 for anything else."""
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    has_mamba = bool(getattr(kv_cache_config, "has_mamba_layers", False)) or \
        any(k == pb.CACHE_KIND_MAMBA for k, _ in _group_kinds(kv_cache_config))
    replay = any(getattr(g.kv_cache_spec, "prefix_replay_tokens", 0) > 0 for g in groups)
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    return max(1 if has_mamba or replay else 0, lookahead - 1)


def prefill_tokens(prompt_tokens: int, backoff: int) -> int:
    """How many of a prompt's tokens P computes and D loads: all but the
    trailing backoff, unless the prompt is no longer than the backoff (then
    P is not trimmed and D loads it all, as NixlConnector does)."""
    return prompt_tokens - backoff if backoff and prompt_tokens > backoff else prompt_tokens


# Marks a producer's params once its prompt was trimmed, so a request seen
# again (a resumed request re-added with the same params) is not trimmed
# twice. NixlConnector's own key: with both connectors behind a
# MultiConnector the prompt is trimmed once.
_TRIMMED = "_p_side_truncated"


def _window_blocks(window: int, block_size: int) -> int:
    # The blocks a window of tokens can touch, plus the partial block.
    return (window + block_size - 1) // block_size + 1


def compat_hash(vllm_config: "VllmConfig", mode: int, backoff: int = 0) -> str:
    """Engines handshake only when these match (SPEC §2's factors), and
    the prefill backoff (prefill_backoff) where it is not 0: a consumer
    that backs off less than its producer loads tokens the producer never
    computed. Before, a push P with 3 MTP speculative tokens (backoff 2)
    and a D with 2 (backoff 1) of the same model moved every request, D's
    last loaded token holding no KV of it (a pull D refused each request,
    naming RemoteNumTokens)."""
    mc = vllm_config.model_config
    f = {
        "connector": CONNECTOR_VERSION, "mode": params.MODE_NAMES[mode],
        "model": getattr(mc, "model", ""), "dtype": str(getattr(mc, "dtype", "")),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "num_layers": mc.get_total_num_hidden_layers() if hasattr(mc, "get_total_num_hidden_layers") else 0,
        "kv_heads": mc.get_total_num_kv_heads() if hasattr(mc, "get_total_num_kv_heads") else 0,
        "head_size": mc.get_head_size() if hasattr(mc, "get_head_size") else 0,
    }
    if backoff:
        # (Only then: the hash of an engine without one stays as it was.)
        f["prefill_backoff"] = backoff
    return hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest()


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that hands transfers to kvxferd (push or pull)."""

    # KV that arrives over kvxfer comes from a peer engine (vLLM's cache-hit
    # metrics label it so).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg = Config.from_extra(ktc.kv_connector_extra_config)
        self.engine_id = str(ktc.engine_id)
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.groups = _group_kinds(kv_cache_config)
        self._all_groups = tuple(range(len(kv_cache_config.kv_cache_groups))) if kv_cache_config is not None else (0,)
        self.in_process = self.cfg.placement == "in-process"
        # Where this connector's server is: kvxferd's socket, or this
        # process's in-process server's endpoint (a worker's once it
        # registers its KV caches, when its server starts).
        self.address = self.cfg.socket
        self.client: Client | None = None
        self._holds_server = False
        if self.in_process:
            pc = vllm_config.parallel_config
            self.device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
            dp = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
            self.base = placement_mod.engine_base(self.cfg.peer_port, dp, self.tp_size, self.pp_size)
            last = self.base + self.tp_size * self.pp_size - 1
            if self.base and last > 65535:
                raise ValueError(f"kv_connector_extra_config.peer_port = {self.cfg.peer_port}: the ranks of data-parallel "
                                 f"rank {dp} would listen up to port {last}, past 65535")
            if self.base:
                self._check_port_ranges(dp, int(getattr(pc, "data_parallel_size", 1) or 1))
            self._check_server_config()
        else:
            self.client = Client(self.cfg.socket, timeout=self.cfg.timeout_s)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.in_process:
                self._check_base_zero(vllm_config)
                self._attach(lambda s, common: s.acquire_scheduler(common, self.cfg.peer_host, self.base))
            self._sched = _SchedulerSide(self, vllm_config)
        else:
            self._worker = _WorkerSide(self, vllm_config, kv_cache_config)

    def _check_port_ranges(self, dp: int, dp_size: int) -> None:
        """With a base port, the ports of the engine's servers that the
        ``server`` keys give as bases (metrics_listen, data_port_base: rank
        (pp, tp) of data-parallel rank r at base + r*tp*pp + pp*tp_size +
        tp, as its peer port) must lie within 65535 and apart from the
        deployment's peer ports on a host they share: each rank's process
        would otherwise fail to start its server, or to attach, at its KV
        registration."""
        n = dp_size * self.tp_size * self.pp_size
        first = self.base - self.cfg.peer_port  # this engine's first rank's index
        srv = self.cfg.server
        ranges = [("peer_port", self.cfg.peer_port, self.cfg.peer_host, f"{self.cfg.peer_port}")]
        metrics = str(srv.get("metrics-listen") or "")
        mhost, _, mport = metrics.rpartition(":")
        if mport.isdigit() and int(mport):
            ranges.append(("server.metrics_listen", int(mport), mhost.strip("[]"), repr(metrics)))
        dpb = srv.get("data-port-base")
        if (isinstance(dpb, int) or (isinstance(dpb, str) and dpb.strip().isdigit())) and int(dpb) > 0 \
                and self.cfg.server_common(self.device)["backend"] == "builtin":
            ranges.append(("server.data_port_base", int(dpb), str(srv.get("data-host") or self.cfg.peer_host), repr(dpb)))
        for key, start, _, shown in ranges[1:]:
            if start + first + self.tp_size * self.pp_size - 1 > 65535:
                raise ValueError(f"kv_connector_extra_config.{key} = {shown}: rank (pp, tp) of data-parallel rank {dp} would "
                                 f"listen at its port + its index, up to {start + first + self.tp_size * self.pp_size - 1}, "
                                 "past 65535")
        for i, (k1, s1, h1, v1) in enumerate(ranges):
            for k2, s2, h2, v2 in ranges[i + 1:]:
                if s1 < s2 + n and s2 < s1 + n and (h1 == h2 or h1 in _ANY_HOST or h2 in _ANY_HOST):
                    raise ValueError(f"kv_connector_extra_config.{k2} = {v2} and {k1} = {v1}: the {n} ranks of the "
                                     f"deployment listen at each port + their index, so the two ranges overlap: choose "
                                     "ports apart")

    def _check_server_config(self) -> None:
        """Checks the configuration of this engine's servers (the scheduler
        side's own and a rank's) as libkvxfer reads it, starting nothing:
        on either side alike, as the connector is built, so that a key of
        ``server`` libkvxfer does not know, or a value of the wrong type or
        range, is refused here, naming the key and the value as the user
        wrote them, not as a worker rank's server fails to start after
        vLLM loaded the model."""
        common = self.cfg.server_common(self.device)
        labels = self.cfg.server_keys
        host, base = self.cfg.peer_host, self.base

        def problem(c: dict) -> str | None:
            # The scheduler side's own server (port 0) and rank 0's: the
            # other ranks' differ only by their ports (_check_port_ranges).
            configs = [placement_mod.server_config(c, host, 0, base)]
            if base:
                configs.append(placement_mod.server_config(c, host, base, base, base - self.cfg.peer_port))
            for cfg in configs:
                try:
                    inprocess.check_config(cfg)
                except inprocess.ForkedChildError as e:
                    raise RuntimeError(f"{e} (vLLM: VLLM_WORKER_MULTIPROC_METHOD=spawn)") from e
                except inprocess.InProcessError as e:
                    if e.code != inprocess.ECONFIG:
                        raise RuntimeError(f"kvxfer: engine {self.engine_id}: cannot check its in-process server's "
                                           f"configuration: {e}") from e
                    return str(e)
            return None

        why = problem(common)
        if why is None:
            return
        # Name the key: the first of the user's that is refused on its own
        # (with the connector's own keys; those checked together, together),
        # else the keys together.
        own = {k: v for k, v in common.items() if k not in labels}
        mine = problem(own)
        if mine is not None:
            raise ValueError(f"kv_connector_extra_config: {mine}")
        groups: dict[str, list[str]] = {}
        for name, label in labels.items():
            groups.setdefault(label, []).append(name)
        for label, names in groups.items():
            one = problem({**own, **{n: common[n] for n in names}})
            if one is not None:
                shown = ", ".join(repr(common[n]) for n in names)
                raise ValueError(f"{label} = {shown}: {one}")
        srv = {label.rpartition(".server.")[2]: common[k] for k, label in labels.items() if ".server." in label}
        raise ValueError(f"kv_connector_extra_config.server = {srv!r}: {why}")

    def _check_base_zero(self, vllm_config: "VllmConfig") -> None:
        """Refuses peer_port 0 for an engine whose worker ranks run in
        other processes than its scheduler: each such process's server
        then listens on a port of its own choosing, and transfer params
        would name this process's server, where no rank of the engine ever
        attaches (every transfer would fail, as an unknown engine). vLLM
        registers a rank's KV caches before it makes the scheduler, so a
        rank in this process has started the process's server by now."""
        if self.base:
            return
        pc = vllm_config.parallel_config
        backend = getattr(pc, "distributed_executor_backend", None)
        world = int(getattr(pc, "world_size", self.tp_size * self.pp_size) or 1)
        # (An external launcher runs one rank and a scheduler in each
        # process: each would name only its own rank.)
        elsewhere = (world > 1 and backend == "external_launcher") or (
            not placement_mod.acquire().users and (world > 1 or backend in ("mp", "ray", "external_launcher")))
        if elsewhere:
            what = "kv_connector_extra_config.peer_port" if "peer_port" in (vllm_config.kv_transfer_config.kv_connector_extra_config
                                                                            or {}) else "$KVXFER_PEER_PORT"
            raise ValueError(f"{what} = 0: the system picks each server's port, which works only for an engine whose ranks "
                             f"and scheduler all run in one process; this engine's {world} worker rank(s) run in processes "
                             f"of their own (executor {backend!r}): give it a base port (rank (pp, tp) listens at base + "
                             "pp*tp_size + tp)")

    def _attach(self, acquire, what: str = "its in-process server") -> None:
        """In-process: gets this process's server (started, or found
        running) and a client of it."""
        try:
            self.address = acquire(placement_mod.acquire(), self.cfg.server_common(self.device))
        except inprocess.ForkedChildError as e:
            raise RuntimeError(f"{e} (vLLM: VLLM_WORKER_MULTIPROC_METHOD=spawn)") from e
        except inprocess.InProcessError as e:
            raise RuntimeError(f"kvxfer: engine {self.engine_id}: cannot start {what}: {e}") from e
        self._holds_server = True
        self.client = Client(self.address, timeout=self.cfg.timeout_s)

    # ---- class-level hooks ----

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        # Layer-outermost, heads before tokens: one contiguous region per
        # layer whose blocks are [H][N][K|V], what P and D must agree on.
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool((extra_config or {}).get("layerwise", False))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvxferStats(data=dict(data)) if data is not None else KvxferStats()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # A transfer fills the request's blocks in every group.
        return self._all_groups

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        return {CacheHitSource.P2P: num_external_tokens} if num_external_tokens else {}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def on_new_request(self, request: "Request") -> None:
        self._sched.new_request(request)

    def update_connector_output(self, connector_output):
        self._sched.update(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.pending()

    def get_finished_count(self) -> int | None:
        return None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind_step(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata, **kwargs: Any) -> None:
        self._worker.layer_saved(layer_name, kv_layer)

    def wait_for_save(self):
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self._worker.results()
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker or self._sched
        return side.take_stats() if side is not None else None

    def shutdown(self):
        try:
            if self._worker is not None:
                self._worker.shutdown()
            if self._sched is not None:
                self._sched.shutdown()
        finally:
            if self.client is not None:
                self.client.close()
            if self._holds_server:
                # The process's last connector stops its server.
                self._holds_server = False
                placement_mod.release()


class _Columns:
    """One kind of per-request scheduler call, column by column
    (kvxfer.v1 RequestColumns). A row costs one tuple and a few list
    operations; the step transposes the rows once (zip) and encodes each
    column with one extend."""

    __slots__ = ("groups", "kinds", "local", "rows", "bad", "remote_block_lens", "remote_block_starts",
                 "remote_block_ids", "block_lens", "block_ids")

    # The fixed columns, in the order of a row's tuple.
    _FIXED = ("request_id", "prompt_tokens", "flags", "transfer_id", "remote_engine_id", "remote_addr",
              "remote_request_id", "remote_tp_size", "remote_pp_size", "remote_num_tokens", "mode", "computed", "count",
              "status", "remote_generation", "remote_blocks_expiry_unix_nanos")
    _LISTS = ("remote_block_lens", "remote_block_starts", "remote_block_ids", "block_lens", "block_ids")

    def __init__(self, groups: int):
        self.groups = groups
        self.kinds: list[tuple[str, str]] = []
        self.local: dict[int, tuple[bool, int]] = {}
        self.rows: list[tuple] = []
        self.bad = 0  # rows whose params were malformed
        for c in self._LISTS:
            setattr(self, c, [])

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, kind: str, request: "Request", p: dict | None, blocks, computed: int, count: int = 0,
            status: int = 0, addrs: dict | None = None, flags: int = 0) -> bool:
        """Adds a row; False (nothing added) when p's remote block lists do
        not have one list per cache group: the caller sends an op. flags
        are ORed into the row's (p's do_remote_prefill as it was when vLLM
        made the call, since cleared)."""
        g = self.groups
        rid = request.request_id
        try:
            return self._add(kind, request, rid, g, p, blocks, computed, count, status, addrs, flags)
        except params.ParamsError as e:
            # A router's params the connector does not use here (P's own
            # request carrying junk remote fields): counted and dropped,
            # never an exception in vLLM's scheduler loop.
            self.bad += 1
            log.warning("kvxfer: request %s: %s; its remote fields are ignored", rid, e)
            return self._add(kind, request, rid, g, _flags_only(p), blocks, computed, count, status, addrs, flags)

    def _add(self, kind, request, rid, g, p, blocks, computed, count, status, addrs, flags) -> bool:
        if not p:
            self.rows.append((rid, request.num_prompt_tokens, 4, "", "", "", "", 0, 0, 0, 0, computed, count, status, 0, 0))
            self.remote_block_lens.extend([0] * g)
            self.remote_block_starts.extend([0] * g)
        else:
            get = p.get
            ids = get("remote_block_ids")
            remote = None
            if ids:
                remote = params.block_lists(p)
                if len(remote[0]) != g:
                    return False
            host = get("remote_host")
            addr = ""
            if host:
                key = (host, get("remote_port"))
                try:
                    addr = addrs.get(key) if addrs is not None else None
                except TypeError:  # an unhashable host or port
                    addr, addrs = None, None
                if addr is None:
                    addr = params.addr(p)
                    if addrs is not None:
                        _remember(addrs, key, addr)
            pp = get("remote_pp_size")
            gen = get("remote_generation")
            if gen is not None and not (type(gen) is int and 0 <= gen <= _UINT64_MAX):
                gen = params.generation(p)  # converted, or ParamsError naming it
            # The producer's hold's end (a pull consumer's READs end before
            # it): before, rows carried none, and the daemon's scheduler read
            # such params with no bound, past the hold, into blocks the
            # producer may have given to another request.
            exp = get("remote_blocks_expiry_unix_nanos")
            if exp is not None and not (type(exp) is int and 0 <= exp <= params.INT64_MAX):
                exp = params.expiry(p)  # converted, or ParamsError naming it
            self.rows.append((rid, request.num_prompt_tokens,
                              (1 if get("do_remote_prefill") else 0) | (2 if get("do_remote_decode") else 0) | flags,
                              _s(p, "transfer_id"), _s(p, "remote_engine_id"), addr, _s(p, "remote_request_id"),
                              _n(get("tp_size")), _n(pp if pp is not None else get("pp_size")), _n(get("remote_num_tokens")),
                              params.mode_of(get("mode") or get("transfer_mode")), computed, count, status, gen or 0, exp or 0))
            if remote is not None:
                for lst, st in zip(*remote):
                    self.remote_block_lens.append(len(lst))
                    self.remote_block_starts.append(st)
                    self.remote_block_ids.extend(lst)
            else:
                self.remote_block_lens.extend([0] * g)
                self.remote_block_starts.extend([0] * g)
        self.kinds.append((kind, rid))
        n = 0
        for lst in blocks:
            self.block_lens.append(len(lst))
            self.block_ids.extend(lst)
            n += 1
        if n < g:
            self.block_lens.extend([0] * (g - n))
        return True

    def encode(self, dst: pb.RequestColumns, with_status: bool) -> None:
        for name, col in zip(self._FIXED, zip(*self.rows)):
            # (remote_generation, remote_blocks_expiry_unix_nanos: left out
            # when no row has one, as the fast path leaves out a column of
            # defaults: push rows, P's.)
            if (name != "status" or with_status) and (name not in _SPARSE or any(col)):
                getattr(dst, name).extend(col)
        for c in self._LISTS:
            v = getattr(self, c)
            if v:
                getattr(dst, c).extend(v)


# _Columns' fixed columns left out when every row holds the default.
_SPARSE = frozenset(("remote_generation", "remote_blocks_expiry_unix_nanos"))

# The params that say what a request is; enough for a row when the rest is
# malformed.
_FLAG_KEYS = ("do_remote_prefill", "do_remote_decode", "transfer_id")


def _flags_only(p: dict) -> dict:
    """p's _FLAG_KEYS: what a row keeps of params whose other fields are
    malformed (a transfer_id only where it is a string kvxfer.v1 carries)."""
    return {k: v for k, v in p.items() if k in _FLAG_KEYS and (k != "transfer_id" or params.is_str(v))}


def _s(p: dict, key: str) -> str:
    """p's string param key, or ParamsError naming it (params.str_field)."""
    v = p.get(key)
    return v if type(v) is str and v.isascii() else params.str_field(p, key)


def _n(v) -> int:
    """A transfer param's integer; anything else counts as absent (0) here,
    and was refused with a message where it matters (validate_remote)."""
    if type(v) is int and 0 <= v < 1 << 31:
        return v
    if v is None:
        return 0
    try:
        v = int(v)
        return v if 0 <= v < 1 << 31 else 0
    except (TypeError, ValueError, OverflowError):  # (int(inf) overflows)
        return 0


# The params keys the columnar fast path reads (encode_rows; _TRIMMED it
# ignores); a row with any other key (remote block lists included) takes
# _Columns' row-by-row path.
_COLUMN_KEYS = frozenset(("do_remote_prefill", "do_remote_decode", "transfer_id", "remote_engine_id", "remote_host",
                          "remote_port", "remote_request_id", "tp_size", "remote_pp_size", "pp_size",
                          "remote_num_tokens", "mode", "transfer_mode", "remote_generation",
                          "remote_blocks_expiry_unix_nanos", _TRIMMED))
_INT31 = 1 << 31
_UINT64_MAX = (1 << 64) - 1
# Distinct remote addresses remembered per scheduler (a router can name any
# number of producers: the cache is bounded, and emptied when full).
_ADDR_CACHE = 1024


def _remember(addrs: dict, key, addr: str) -> None:
    if len(addrs) >= _ADDR_CACHE:
        addrs.clear()
    addrs[key] = addr


def encode_rows(dst: pb.RequestColumns, groups: int, reqs, ps, flags, computed, count, status, blocks,
                addrs: dict) -> bool:
    """Encodes one kind of per-request call for all the step's requests at
    once, each column one comprehension and one extend: the common case's
    fast path. The arguments are columns (one entry per request); status
    None leaves that column out. Returns False, dst left empty, when a row
    is anything but plain (params keys outside _COLUMN_KEYS, a value not of
    its plain type or range, block lists not one per group): the caller then
    takes _Columns' row-by-row path, which converts, counts and refuses
    field by field. Encodes what _Columns would for the same rows."""
    if not all(ps) or not all(map(_COLUMN_KEYS.issuperset, ps)):
        return False
    mode_of = params.MODES.get
    try:
        # One pass over the params makes a tuple per row; zip turns them
        # into columns.
        (tid, eng, rreq, tp, pp, nt, mode, fl, keys, gen, exp) = zip(*[(
            p.get("transfer_id") or "", p.get("remote_engine_id") or "", p.get("remote_request_id") or "",
            p.get("tp_size") or 0,
            (p["remote_pp_size"] if p.get("remote_pp_size") is not None else p.get("pp_size")) or 0,
            p.get("remote_num_tokens") or 0, mode_of(p.get("mode") or p.get("transfer_mode"), 0),
            (1 if p.get("do_remote_prefill") else 0) | (2 if p.get("do_remote_decode") else 0),
            (p.get("remote_host"), p.get("remote_port")), p.get("remote_generation"),
            p.get("remote_blocks_expiry_unix_nanos") or 0) for p in ps])
        amap = {}
        for k in set(keys):
            a = addrs.get(k)
            if a is None:
                a = params.addr({"remote_host": k[0], "remote_port": k[1]}) if k[0] else ""
                _remember(addrs, k, a)
            amap[k] = a
        for col in (tp, pp, nt):
            if min(col) < 0 or max(col) >= _INT31:
                return False
        if gen.count(None) == len(gen):
            gen = ()  # none (push, P's rows): the column is left out
        elif all(g is None or type(g) is int and 0 <= g <= _UINT64_MAX for g in gen):
            gen = [g or 0 for g in gen]
        else:
            return False  # (a str, a bool, a float... params.generation refuses or converts it, row by row)
        if not all(type(x) is int and 0 <= x <= params.INT64_MAX for x in exp):
            return False  # (a str, a float...: converted or refused row by row)
        if any(flags):
            fl = [x | y for x, y in zip(fl, flags)]

        def put(field, col):
            # A column of defaults only is left out (the daemon reads it as
            # the default in every row).
            if any(col):
                field.extend(col)

        dst.request_id.extend([r.request_id for r in reqs])
        put(dst.prompt_tokens, [r.num_prompt_tokens for r in reqs])
        put(dst.flags, fl)
        put(dst.transfer_id, tid)
        put(dst.remote_engine_id, eng)
        put(dst.remote_addr, [amap[k] for k in keys])
        put(dst.remote_request_id, rreq)
        put(dst.remote_tp_size, tp)
        put(dst.remote_pp_size, pp)
        put(dst.remote_num_tokens, nt)
        put(dst.mode, mode)
        put(dst.computed, computed)
        put(dst.count, count)
        if status is not None:
            dst.status.extend(status)
        put(dst.remote_generation, gen)
        put(dst.remote_blocks_expiry_unix_nanos, exp)
        if all(len(b) == groups for b in blocks):
            dst.block_lens.extend([len(g) for b in blocks for g in b])
            dst.block_ids.extend([i for b in blocks for g in b for i in g])
        else:
            for b in blocks:
                if len(b) > groups:
                    raise ValueError("more block lists than groups")
                dst.block_lens.extend([len(g) for g in b])
                dst.block_lens.extend([0] * (groups - len(b)))
                for g in b:
                    dst.block_ids.extend(g)
    except (TypeError, ValueError, params.ParamsError):
        # Not plain (a str where an int goes, an unhashable value, a port
        # that is not a number...): the row-by-row path sorts it out.
        dst.Clear()
        return False
    return True


class _SchedulerSide:
    """The scheduler-side state: the calls of the coming step, batched in
    place into one StepRequest, and the steps the daemon has not answered.

    With the default relay ("daemon") each step goes out on a Steps stream
    without waiting: the daemon builds the step's metadata and keeps it for
    the engine's ranks, which take it by reference (ConnectRequest.step_ref)
    on the same daemon, so no daemon round trip sits on the step's critical
    path. Answers (errors of single calls, pending work) are read at the
    next step. With relay "metadata" (ranks on other hosts than the
    scheduler) each step is one Step call and the metadata travels inside
    vLLM's connector metadata.
    """

    def __init__(self, conn: KvxferConnector, vllm_config: "VllmConfig"):
        self.c = conn
        self.cfg = conn.cfg
        self.relay = self.cfg.relay
        if self.relay == "auto":
            nnodes = getattr(vllm_config.parallel_config, "nnodes", 1) or 1
            # In-process, the scheduler's server is not its ranks'.
            self.relay = "daemon" if nnodes <= 1 and not conn.in_process else "metadata"
        # Trailing prompt tokens P leaves to D (prefill_backoff); the
        # daemon's Scheduler is told the same (SchedulerConfig).
        self.backoff = prefill_backoff(vllm_config, conn._kv_cache_config)
        self.full = all(k in (pb.CACHE_KIND_FULL_ATTENTION, pb.CACHE_KIND_MLA) for k, _ in conn.groups)
        # The coming step's request, built inside the message the Steps
        # stream sends (no copy at send time).
        self.outer = pb.StepsRequest()
        self.req = self.outer.step
        # For each op of req: (kind, request id) to act on its error.
        self.op_req: list[tuple[str, str]] = []
        self.local_finished: dict[int, tuple[bool, int]] = {}
        # Per-request calls, column by column (they apply after req.ops).
        self.ngroups = len(conn.groups)
        self.pf = _Columns(self.ngroups)
        # The step's request_finished and update_state_after_alloc calls,
        # made into rows by build_meta.
        self.rf_calls: list[tuple] = []
        self.aa_calls: list[tuple] = []
        # Names of pull holds without a router transfer id (_hold_tid): a
        # random prefix per scheduler and a count.
        self.hold_nonce = secrets.token_hex(8)
        self.holds = 0
        self.addrs: dict = {}
        self.prefill_ops = False
        self.expect_recv: list[str] = []
        self.expect_send: list[str] = []
        self.fail_recv: dict[str, str] = {}
        self.fail_send: dict[str, str] = {}
        # Layer-wise producers listed prefilling that this step finishes,
        # with their transfer ids: told to the ranks as aborted should the
        # step's calls be lost (KvxferConnectorMetadata.abort_listed).
        self.finish_listed: dict[str, str] = {}
        # Steps sent and not answered: (step, kinds, local decisions).
        self.inflight: deque = deque()
        self.step_no = 0
        self.stream = None
        self.daemon_pending = False
        # Producer requests by id, for layer-wise push's prefill entries,
        # and those listed in one already (their layers are being written
        # from the blocks they hold: see _preempted).
        self.requests: dict[str, "Request"] = {}
        self.listed: set[str] = set()
        self.stats = KvxferStats()
        self.daemon_bad_params = 0  # the daemon scheduler's count at its last answer
        # Pull: the engine's generation as its peers' handshakes report it,
        # as the daemon's last answer said (StepResponse.generation; 0:
        # unknown, as before the first answer). request_finished stamps it
        # on the params it makes (remote_generation), as the daemon's
        # Scheduler does on those it returns: a consumer refuses params of
        # a generation this engine is no longer at (it restarted, or a rank
        # attached again, since), whose blocks may hold another request's
        # KV by the time it reads them.
        self.pull = self.cfg.mode == pb.MODE_PULL
        self.generation = 0
        self.addr = ""
        self.host, self.port = "", 0
        self.sched = conn.client.scheduler(conn.engine_id)
        # verify: decisions compared with the daemon's Scheduler, by kind.
        # Its MatchedTokens calls go on a channel of their own, apart from
        # the engine's (whose traffic they are not).
        self.verify = self.cfg.verify
        self.verified = {"matched": 0, "finished": 0, "generation": 0}
        self._vclient: Client | None = None
        self._vsched = None
        if self.verify:
            self._vclient = Client(conn.address, timeout=self.cfg.timeout_s)
            self._vsched = self._vclient.scheduler(conn.engine_id)
        self._open()

    def _open(self) -> None:
        cfg = pb.SchedulerConfig(
            mode=self.cfg.mode, tp_size=self.c.tp_size, pp_size=self.c.pp_size, logical_block_size=self.c.block_size,
            groups=[pb.CacheGroup(kind=k, window=w) for k, w in self.c.groups],
            lease_millis=int(self.cfg.lease_s * 1000), registration_timeout_millis=int(self.cfg.registration_timeout_s * 1000),
            layerwise=self.cfg.layerwise, prefill_backoff=self.backoff)
        try:
            self.addr = self.sched.open(cfg)
            self.host, self.port = params.split_addr(self.addr)
            # Step numbers go on from the last one sent, never again from 1:
            # a rank still to take an old step by reference finds it as the
            # old scheduler published it (kvxferd keeps it for the new one,
            # this same process's), or dropped when it never was (older
            # than what the new scheduler publishes), never a new step
            # under its number.
            self.daemon_bad_params = 0
            # A new scheduler: the generation is its answers' (the engine's
            # ranks may have attached again meanwhile). One empty step asks
            # it now, so that the first params made here carry it (a pull
            # producer's steps may send nothing before its first request
            # finishes; the server asked the ranks as the scheduler opened).
            self.generation = self.sched.step([], build_meta=False).generation if self.pull else 0
            if self.relay == "daemon":
                self.stream = self.sched.stream()
        except errors.KvxferError as e:
            # A daemon that is down fails every transfer cleanly; opening
            # is retried at each step.
            self.addr = ""
            log.error("kvxfer: cannot open the scheduler of engine %s on %s: %s", self.c.engine_id, self.c.address, e)

    # -- local answers --

    def matched_tokens(self, request: "Request", computed: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            if self.verify:
                self._verify_matched(request, computed, (0, False))
            return 0, False
        try:
            params.validate_remote(p, self.cfg.mode)
        except params.ParamsError as e:
            # Nothing can be received: the request prefills locally. (The
            # daemon's Scheduler does not validate here, it refuses the
            # params at after_alloc: nothing to compare.)
            self.stats.data["bad_params"] += 1
            log.warning("kvxfer: request %s: %s; computing it locally", request.request_id, e)
            p["do_remote_prefill"] = False
            return 0, False
        n = prefill_tokens(request.num_prompt_tokens, self.backoff) - computed
        out = (n, True) if n > 0 else (0, False)
        if self.verify:
            self._verify_matched(request, computed, out)
        return out

    def _verify_matched(self, request: "Request", computed: int, got: tuple[int, bool]) -> None:
        """verify: the daemon's Scheduler's count for the same call."""
        if not self.addr:
            return  # no scheduler open (the daemon is down): nothing to ask
        er = pb.EngineRequest(request_id=request.request_id, prompt_tokens=request.num_prompt_tokens)
        p = request.kv_transfer_params
        try:
            params.fill_proto(er.params, p)
        except params.ParamsError:
            # As the step sends such params (_request): the flags alone.
            er.ClearField("params")
            params.fill_proto(er.params, _flags_only(p))
        try:
            want = self._vsched.matched_tokens(er, computed)
        except errors.KvxferError as e:
            log.info("kvxfer: verify: MatchedTokens of request %s: %s", request.request_id, e)
            return
        self.verified["matched"] += 1
        if (got[0], bool(got[1])) != (want[0], bool(want[1])):
            self._disagree(f"request {request.request_id}: matched tokens (computed {computed}): daemon says {want}, "
                           f"connector said {got}")

    def _disagree(self, msg: str) -> None:
        msg = f"kvxfer: engine {self.c.engine_id}: {msg}"
        log.error("%s", msg)
        DISAGREEMENTS.append(msg)
        raise Disagreement(msg)

    def _op(self, kind: str, req_id: str) -> pb.SchedulerOp:
        self.op_req.append((kind, req_id))
        return self.req.ops.add()

    def _request(self, dst: pb.EngineRequest, request: "Request") -> None:
        dst.request_id = request.request_id
        dst.prompt_tokens = request.num_prompt_tokens
        p = request.kv_transfer_params
        try:
            params.fill_proto(dst.params, p)
        except params.ParamsError as e:
            self.stats.data["bad_params"] += 1
            log.warning("kvxfer: request %s: %s; its remote fields are ignored", request.request_id, e)
            dst.ClearField("params")
            params.fill_proto(dst.params, _flags_only(p))

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", external: int) -> None:
        p = request.kv_transfer_params
        if not p:
            return
        if p.get("do_remote_prefill"):
            # Only noted here; build_meta makes the row with the step's
            # others, in one loop. The blocks stay as vLLM gave them until
            # then: within schedule(), nothing frees or adds to the blocks of
            # a request it just admitted.
            self.aa_calls.append((request, p, blocks, external))
            if external > 0:
                self.expect_recv.append(request.request_id)
            p["do_remote_prefill"] = False
        # A producer's allocation tells the daemon nothing this connector
        # uses (it stages host-buffer saves and bidirectional turns, which
        # the connector does not offer): no op.

    def _after_alloc_rows(self, calls: list) -> list[tuple[str, str]]:
        """Encodes the step's update_state_after_alloc calls (rows of
        columns.after_alloc; rows the columns cannot carry become ops).
        Returns each row's (kind, request id)."""
        bs, backoff = self.c.block_size, self.backoff
        reqs, ps, blocks, external = zip(*calls)
        computed, local = [], []
        for r, b, e in zip(reqs, blocks, external):
            if e > 0:
                # vLLM passes all the request's blocks before it records the
                # local prefix hit: what the transfer does not fill is the hit.
                c = max(prefill_tokens(r.num_prompt_tokens, backoff) - e, 0)
                skip = c // bs
                computed.append(c)
                local.append([[x.block_id for x in g[skip:]] for g in b.blocks])
            else:
                computed.append(0)
                local.append(())
        kinds = [("recv" if e > 0 else "other", r.request_id) for r, e in zip(reqs, external)]
        dst = self.req.columns.after_alloc
        if encode_rows(dst, self.ngroups, reqs, ps, [1] * len(reqs), computed, external, None, local, self.addrs):
            return kinds
        aa = _Columns(self.ngroups)
        for (kind, rid), r, p, lb, c, e in zip(kinds, reqs, ps, local, computed, external):
            if not aa.add(kind, r, p, lb, c, e, addrs=self.addrs, flags=1):
                op = self._op(kind, rid).after_alloc
                self._request(op.request, r)
                op.request.params.do_remote_prefill = True
                for g in lb:
                    op.blocks.add().block_ids.extend(g)
                op.computed, op.external = c, e
        aa.encode(dst, False)
        self.stats.data["bad_params"] += aa.bad
        return aa.kinds

    def _clip(self, blocks: tuple[list[int], ...]) -> tuple[list[list[int]], list[int]]:
        if self.full:
            # Full attention only (the common case): nothing is clipped.
            return list(blocks), [0] * len(blocks)
        ids, starts = [], []
        for (kind, window), g in zip(self.c.groups, blocks):
            g = list(g)
            start = 0
            if kind == pb.CACHE_KIND_SLIDING_WINDOW:
                n = _window_blocks(window, self.c.block_size)
                if len(g) > n:
                    start = (len(g) - n) * self.c.block_size
                    g = g[len(g) - n:]
            elif kind == pb.CACHE_KIND_MAMBA and g:
                g = g[-1:]
            ids.append(g)
            starts.append(start)
        return ids, starts

    def new_request(self, request: "Request") -> None:
        p = request.kv_transfer_params
        if p is not None and not isinstance(p, dict):
            # Before, params that are no object (a string, a list, a number
            # from a caller of the engine's Python API; its HTTP API types
            # them) raised AttributeError out of vLLM's add_request, here
            # and on every later call that reads them: the request runs as
            # one with no params instead, named and counted.
            self.stats.data["bad_params"] += 1
            log.warning("kvxfer: request %s: kv_transfer_params = %.200r, want an object (a dict); ignored",
                        request.request_id, p)
            request.kv_transfer_params = p = None
        if p and self.pull and p.get("do_remote_prefill") and not p.get("do_remote_decode") and \
                self.sched.takes_new_request:
            # A pull consumer's request: the ranks heartbeat its producer
            # from now on, while it waits in the queue (SPEC §9: tracked
            # from on_new_request), not from its allocation; a request
            # queued longer than the producer's lease otherwise finds the
            # hold lapsed and is recomputed.
            self._request(self._op("new_request", request.request_id).new_request.request, request)
            return
        if not p or not p.get("do_remote_decode"):
            return
        self._trim(request, p)
        if self.cfg.layerwise:
            self.requests[request.request_id] = request

    def _trim(self, request: "Request", p: dict) -> None:
        """P's side of the backoff (prefill_backoff): drops the trailing
        backoff prompt tokens, which D computes itself, and caps the
        request at one output token (P's sample is not used). Skipped for a
        prompt no longer than the backoff, for one trimmed already, and for
        a request that skips reading the prefix cache (prompt logprobs):
        D loads nothing for it and computes its whole prompt. The same
        conditions as NixlConnector's, so D's matched tokens
        (prefill_tokens) are exactly what P computed."""
        b = self.backoff
        if not b or p.get(_TRIMMED) or request.num_prompt_tokens <= b or request.get_skip_reading_prefix_cache():
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-b:]
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-b]
        else:
            return
        # _all_token_ids backs request.all_token_ids (a read-only view) and
        # num_tokens; it holds the prompt alone before the first step.
        del request._all_token_ids[-b:]
        request.num_prompt_tokens -= b
        request.max_tokens = 1
        p[_TRIMMED] = True

    def _hold_tid(self) -> str:
        """The transfer id of a pull hold whose params carry none: unique to
        the hold, and random per scheduler (a restarted engine's holds are
        not named as its earlier one's were)."""
        self.holds += 1
        return f"kvxfer-{self.hold_nonce}-{self.holds:x}"

    def request_finished(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        self.requests.pop(request.request_id, None)
        p = request.kv_transfer_params
        if request.request_id in self.listed:
            self.listed.discard(request.request_id)
            self.finish_listed[request.request_id] = str((p or {}).get("transfer_id") or "")
        if not p:
            return False, None
        status = _FINISH.get(request.status, pb.FINISH_STATUS_ABORTED)
        producer = not p.get("do_remote_prefill") and p.get("do_remote_decode") and \
            status in (pb.FINISH_STATUS_STOPPED, pb.FINISH_STATUS_LENGTH_CAPPED)
        out, delay = None, False
        if producer:
            ids, starts = self._clip(block_ids)
            out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.c.engine_id,
                   "remote_host": self.host, "remote_port": self.port, "remote_request_id": request.request_id,
                   "remote_block_ids": ids, "remote_block_starts": starts, "tp_size": self.c.tp_size,
                   "remote_pp_size": self.c.pp_size, "remote_num_tokens": request.num_computed_tokens,
                   "mode": params.MODE_NAMES[self.cfg.mode]}
            if self.generation:  # pull only (_answered)
                out["remote_generation"] = self.generation
            if p.get("transfer_id") and params.is_str(p["transfer_id"]):
                out["transfer_id"] = p["transfer_id"]
            delay = any(ids)
            if delay and not p.get("transfer_id") and self.cfg.mode == pb.MODE_PULL:
                # A pull hold the router named no transfer for is named by
                # one of its own, which its consumer echoes (in its READs,
                # completion notices and heartbeats): a request id used
                # again once this request's lease lapsed is another hold,
                # which this one's late consumer cannot read or end. The
                # row carries it (p), so the daemon's Scheduler, which
                # names such holds the same way, keeps this one.
                out["transfer_id"] = p["transfer_id"] = self._hold_tid()
            if delay and self.cfg.mode == pb.MODE_PULL:
                # When the hold ends unless its consumer's heartbeats extend
                # it: the consumer's READ must end before it (NIXL cannot
                # refuse a READ of blocks freed and given to another
                # request). The daemon's Scheduler starts the hold when it
                # applies the row, after now: this is never later than it.
                out["remote_blocks_expiry_unix_nanos"] = time.time_ns() + int(self.cfg.lease_s * 1e9)
            if not delay:
                # No blocks held: nothing can be loaded from us.
                out["remote_num_tokens"] = 0
        # The daemon sees the params as they are now: a D request aborted
        # before it was scheduled still has do_remote_prefill (the daemon
        # then tells P to free its blocks). The row is made in build_meta
        # (vLLM's block-id lists are new ones, the request is done).
        if self.verify:
            # Every row's answer is checked, whole (params as a proto: what
            # vLLM got, whatever becomes of the dict later).
            decided = delay, params.to_proto(out)
        else:
            decided = (delay, out["remote_num_tokens"]) if producer else None
        self.rf_calls.append((request, p, block_ids, status, 1 if p.get("do_remote_prefill") else 0, decided))
        p["do_remote_prefill"] = False
        if delay:
            self.expect_send.append(request.request_id)
        return delay, out

    def _finished_rows(self, calls: list) -> tuple[list[tuple[str, str]], dict[int, tuple[bool, int]]]:
        """Encodes the step's request_finished calls (rows of
        columns.request_finished; rows the columns cannot carry become ops).
        Returns each row's (kind, request id) and the rows' decisions made
        here (producers': delay, remote_num_tokens), by row."""
        reqs, ps, blocks, status, flags, delays = zip(*calls)
        kinds = [("send" if d and d[0] else "other", r.request_id) for r, d in zip(reqs, delays)]
        computed = [r.num_computed_tokens for r in reqs]
        dst = self.req.columns.request_finished
        if encode_rows(dst, self.ngroups, reqs, ps, flags, computed, [0] * len(reqs), status, blocks, self.addrs):
            return kinds, {i: d for i, d in enumerate(delays) if d is not None}
        rf = _Columns(self.ngroups)
        for (kind, rid), r, p, b, st, f, d, c in zip(kinds, reqs, ps, blocks, status, flags, delays, computed):
            row = len(rf)
            if rf.add(kind, r, p, b, c, status=st, addrs=self.addrs, flags=f):
                if d is not None:
                    rf.local[row] = d
            else:
                i = len(self.req.ops)
                op = self._op(kind, rid).request_finished
                self._request(op.request, r)
                if f:
                    op.request.params.do_remote_prefill = True
                op.status = st
                for g in b:
                    op.blocks.add().block_ids.extend(g)
                op.computed = c
                if d is not None:
                    self.local_finished[i] = d
        rf.encode(dst, True)
        self.stats.data["bad_params"] += rf.bad
        return rf.kinds, rf.local

    def update(self, out) -> None:
        failed = getattr(out, "failed_recving", None) or ()
        if not out.finished_sending and not out.finished_recving:
            return
        f = self._op("update", "").update.finished
        for r in out.finished_sending or ():
            o = f.sending.add()
            o.request_id, o.result = r, pb.Outcome.RESULT_DONE
        for r in out.finished_recving or ():
            o = f.recving.add()
            o.request_id, o.result = r, pb.Outcome.RESULT_FAILED if r in failed else pb.Outcome.RESULT_DONE

    def _prefill_ops(self, so: "SchedulerOutput | None") -> None:
        mgr = self.c._kv_cache_manager
        if so is None or not self.cfg.layerwise or mgr is None or not self.requests:
            return
        sched = so.num_scheduled_tokens
        reqs = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        reqs += list(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, computed in reqs:
            req = self.requests.get(rid)
            # A request listed already (and not preempted since: see
            # _preempted) is decoding: its step is no prefill step. (Listed
            # again, the daemon ignored it, but the step was flagged a
            # prefill step: with relay "daemon" the ranks signalled every
            # layer of every decode step, each a LayerSaved no request took.)
            if req is None or rid in self.listed or computed + sched.get(rid, 0) < req.num_prompt_tokens:
                continue
            self.pf.add("other", req, req.kv_transfer_params, mgr.get_block_ids(rid), computed, sched.get(rid, 0),
                        addrs=self.addrs)
            self.listed.add(rid)
            self.prefill_ops = True

    def _preempted(self, so: "SchedulerOutput | None") -> None:
        """Layer-wise push: a producer preempted after its prefill step
        listed it lost the blocks its layers were saved in (vLLM freed them
        and may have handed them to another request, whose KV a WRITE would
        then carry to D as this one's). The daemon is told it was preempted
        (FINISH_STATUS_PREEMPTED, no finish): nothing more is written from
        those blocks, its pairing with its consumer carries over, and once
        nothing of the first attempt is in flight every layer is written
        again, into the same consumer blocks, from the blocks of the prefill
        it computes again (listed anew) or of its finish. Its consumer
        completes without recomputing, from fresh layers only. (A daemon
        from before FINISH_STATUS_PREEMPTED takes it as an abort: its
        consumer fails and recomputes, as before.)"""
        preempted = getattr(so, "preempted_req_ids", None)
        if not preempted or not self.listed:
            return
        for rid in sorted(self.listed.intersection(preempted)):
            self.listed.discard(rid)
            req = self.requests.get(rid)
            if req is None:
                continue
            decided = (False, None) if self.verify else None
            # A daemon from before FINISH_STATUS_PREEMPTED refuses it (and
            # would go on writing from the freed blocks): it is told an
            # abort, as before.
            status = pb.FINISH_STATUS_PREEMPTED if self.sched.takes_preempted else pb.FINISH_STATUS_ABORTED
            self.rf_calls.append((req, req.kv_transfer_params, (), status, 0, decided))

    def _fail(self, kinds, why: str) -> None:
        for kind, rid in kinds:
            if kind == "recv":
                self.fail_recv[rid] = why
            elif kind == "send":
                self.fail_send[rid] = why

    def _answered(self, res, kinds, local, by_ref: bool = False) -> None:
        """Acts on a step's answer. by_ref: the step was published for the
        ranks to take by reference (relay "daemon"): each rank named what it
        waits on in its step_ref, and the daemon ends on the rank's own
        stream what the step does not stage (or the whole step, dropped), so
        a refused call is the rank's to end, once. Failing it here too would
        be a second outcome, read steps later: by then the request may have
        ended and its id come back as a new request, whose wait it would
        end while its KV still lands."""
        for i, err in res.errors.items():
            if not 0 <= i < len(kinds):
                # An op the step does not have: nothing to fail (never
                # another request's, by an index counted from the end).
                log.warning("kvxfer: engine %s: kvxferd answered op %d of a step of %d ops: %s; ignored",
                            self.c.engine_id, i, len(kinds), err.details)
                continue
            kind, rid = kinds[i]
            log.warning("kvxfer: engine %s request %s: %s", self.c.engine_id, rid or "-", err.details)
            if not by_ref:
                self._fail([(kind, rid)], err.details)
        # What every answer says, verify or not: the daemon's pending work
        # (has_pending_push_work) and its Scheduler's refusals (the
        # counter is cumulative; stats report intervals).
        self.daemon_pending = res.pending
        self.stats.data["bad_params"] += max(res.counters.bad_params - self.daemon_bad_params, 0)
        self.daemon_bad_params = res.counters.bad_params
        if self.pull:
            self.generation = res.generation
        if self.verify:
            self._verify_finished(res, kinds, local)
        for i, (delay, prm) in res.finished.items():
            want = local.get(i)
            if self.verify or want is None:
                continue
            got = (delay, prm.remote_num_tokens if prm is not None else 0)
            if want != got:
                log.warning("kvxfer: request %s: daemon says (delay, remote_num_tokens) = %s, connector said %s",
                            kinds[i][1], got, want)

    def _verify_finished(self, res, kinds, local) -> None:
        """verify: each request_finished row's answer, as vLLM got it,
        against the daemon's Scheduler's (delay, params). A row the daemon
        refused holds nothing there (False, None)."""
        for i, (delay, prm) in local.items():
            got = res.finished.get(i)
            if got is None:
                if i not in res.errors:
                    self._disagree(f"request {kinds[i][1]}: no answer to request_finished (row {i})")
                got = (False, None)
            self.verified["finished"] += 1
            # The generation is compared apart: the daemon's Scheduler
            # stamps the engine's generation as of applying the row, the
            # connector as of its last answer (0 before the first, the old
            # one until the answer after a rank attached again), so the two
            # may differ without either being wrong. Counted where they are
            # both known and agree (the tests check that they do).
            theirs, mine = got[1], prm
            if theirs is not None and mine is not None and (theirs.remote_generation or mine.remote_generation):
                if theirs.remote_generation == mine.remote_generation:
                    self.verified["generation"] += 1
                theirs, mine = _without_generation(theirs), _without_generation(mine)
            # So is a pull hold's expiry: the connector's, as of the call,
            # must not be past the daemon's, as of applying the row (the
            # consumer reads by the connector's).
            if theirs is not None and mine is not None and (theirs.remote_blocks_expiry_unix_nanos or
                                                            mine.remote_blocks_expiry_unix_nanos):
                if not 0 < mine.remote_blocks_expiry_unix_nanos <= theirs.remote_blocks_expiry_unix_nanos:
                    self._disagree(f"request {kinds[i][1]}: request_finished: the connector's hold expiry "
                                   f"{mine.remote_blocks_expiry_unix_nanos} is not at or before the daemon's "
                                   f"{theirs.remote_blocks_expiry_unix_nanos}")
                theirs, mine = _without_expiry(theirs), _without_expiry(mine)
            if (bool(got[0]), theirs) != (delay, mine):
                fmt = lambda t: None if t is None else params.from_proto(t)  # noqa: E731
                self._disagree(f"request {kinds[i][1]}: request_finished: daemon says (delay, params) = "
                               f"({got[0]}, {fmt(got[1])}), connector said ({delay}, {fmt(prm)})")

    def _lost(self, e: errors.KvxferError, kinds) -> None:
        """The daemon is gone, refused a whole step, or the Steps stream
        broke. kinds are the calls of a step that never reached the daemon
        (not sent, or its Step call failed: relay "metadata" hands the ranks
        no metadata then): every request vLLM waits on there ends here.

        The steps sent on the Steps stream and not answered are not ended
        here: the daemon may have applied them (an answer lost with the
        stream says nothing of that), and then its workers hold their
        requests: P's blocks that a WRITE will read, D's blocks granted to a
        producer's WRITE. Each rank named them in its step_ref and gets
        exactly one outcome for each from the daemon, on its own stream:
        the worker's when the step was applied (once the transfer ended, or
        failed at once when the daemon's Scheduler did not stage it), the
        step dropped, naming them, when it was not (as soon as a later
        step is published, within the daemon's PublishWait otherwise), or
        the rank's stream ending when the daemon does."""
        self.stats.data["daemon_errors"] += 1
        left = sum(len(k) for _, k, _ in self.inflight)
        self.inflight.clear()
        log.error("kvxfer: steps of engine %s lost (%d calls failed here, %d left to the ranks' outcomes): %s",
                  self.c.engine_id, len(kinds), left, e)
        self._fail(kinds, f"kvxferd step failed: {e}")
        self.daemon_pending = False
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        self.addr = ""  # reopen (a restarted daemon has no scheduler for us)

    def _drain(self, wait: float = 0.0) -> None:
        if self.stream is None:
            return
        try:
            answers = self.stream.results(wait=wait, count=len(self.inflight))
        except errors.KvxferError as e:
            self._lost(e, [])
            return
        for a in answers:
            if not self.inflight:
                # An answer for no step sent: the stream is out of step
                # with the daemon (as an answer for another step is).
                self._lost(errors.DaemonError("Steps", f"answer for step {a.publish_step}, none awaited"), [])
                return
            step, kinds, local = self.inflight.popleft()
            if a.publish_step != step:
                self._lost(errors.DaemonError("Steps", f"answer for step {a.publish_step}, want {step}"), [])
                return
            self._answered(step_result(a), kinds, local, by_ref=True)

    def build_meta(self, so: "SchedulerOutput") -> KvxferConnectorMetadata:
        # The step's rows: request_finished's, then update_state_after_alloc's,
        # then layer-wise prefill's; the daemon applies them in that order,
        # after req.ops, their answers' indices continuing the ops'.
        rf_kinds, rf_local, aa_kinds = [], {}, []
        self._preempted(so)
        if self.rf_calls:
            rf_kinds, rf_local = self._finished_rows(self.rf_calls)
            self.rf_calls = []
        if self.aa_calls:
            aa_kinds = self._after_alloc_rows(self.aa_calls)
            self.aa_calls = []
        self._prefill_ops(so)
        req, kinds, local, prefill, pf = self.req, self.op_req, self.local_finished, self.prefill_ops, self.pf
        outer = self.outer
        self.outer = pb.StepsRequest()
        self.req, self.op_req, self.local_finished, self.prefill_ops = self.outer.step, [], {}, False
        self.pf = _Columns(self.ngroups)
        base = len(kinds)
        for row, d in rf_local.items():
            local[base + row] = d
        kinds = kinds + rf_kinds + aa_kinds + pf.kinds
        if len(pf):
            pf.encode(req.columns.prefill, False)
            self.stats.data["bad_params"] += pf.bad
        staged = bool(kinds)
        self._drain()
        try:
            if not self.addr:
                self._open()
                if not self.addr:
                    raise errors.Unavailable("OpenScheduler", f"no scheduler for engine {self.c.engine_id}")
            if self.relay == "daemon" and not staged:
                # Nothing staged: the daemon's metadata would be empty and
                # its pending work is what the last answer said.
                step_ref, step_meta = 0, b""
            elif self.relay == "daemon":
                self.step_no += 1
                req.publish_step = self.step_no
                # request_finished's answers were computed here (answered
                # in full to be checked, with verify).
                req.errors_only = not self.verify
                self.stream.send(outer)
                self.inflight.append((self.step_no, kinds, local))
                step_ref, step_meta = self.step_no, b""
            else:
                req.build_meta = True
                res = self.sched.step_request(req)
                self._answered(res, kinds, local)
                step_ref, step_meta = 0, res.meta.SerializeToString() if res.meta is not None else b""
        except errors.KvxferError as e:
            self._lost(e, kinds)
            step_ref, step_meta = 0, b""
            # Their finishes never reached the daemon (nor will: vLLM is
            # done with them), and ranks hold them prefilling.
            abort_listed = self.finish_listed
        else:
            abort_listed = {}
        meta = KvxferConnectorMetadata(step_meta=step_meta, step_ref=step_ref, prefill=prefill,
                                       expect_recv=self.expect_recv, expect_send=self.expect_send,
                                       fail_recv=self.fail_recv, fail_send=self.fail_send, abort_listed=abort_listed)
        self.expect_recv, self.expect_send, self.fail_recv, self.fail_send = [], [], {}, {}
        self.finish_listed = {}
        return meta

    def pending(self) -> bool:
        return bool(self.op_req or self.rf_calls or self.aa_calls or len(self.pf)) or self.daemon_pending or \
            bool(self.inflight)

    def take_stats(self) -> KvxferStats | None:
        return _take_stats(self)

    def shutdown(self) -> None:
        try:
            if self.verify:
                # The calls not sent yet go in a last step, and every answer
                # still to come is checked too.
                if self.op_req or self.rf_calls or self.aa_calls:
                    self.build_meta(None)
                if self.inflight:
                    self._drain(wait=self.cfg.timeout_s)
        finally:
            if self.stream is not None:
                self.stream.close()
            try:
                self.sched.close()
            except errors.KvxferError as e:
                log.info("kvxfer: closing the scheduler of engine %s: %s", self.c.engine_id, e)
            if self._vclient is not None:
                self._vclient.close()


def _without_generation(t: pb.TransferParams) -> pb.TransferParams:
    """t less its remote_generation (a copy: t is left as it is)."""
    out = pb.TransferParams()
    out.CopyFrom(t)
    out.ClearField("remote_generation")
    return out


def _without_expiry(t: pb.TransferParams) -> pb.TransferParams:
    """t less its remote_blocks_expiry_unix_nanos (a copy)."""
    out = pb.TransferParams()
    out.CopyFrom(t)
    out.ClearField("remote_blocks_expiry_unix_nanos")
    return out


def _take_stats(side) -> KvxferStats | None:
    if side.stats.is_empty():
        return None
    s, side.stats = side.stats, KvxferStats()
    return s


class _WorkerSide:
    """One worker rank: its stream, and the requests vLLM waits on."""

    def __init__(self, conn: KvxferConnector, vllm_config: "VllmConfig", kv_cache_config):
        self.c = conn
        self.cfg = conn.cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        pc = vllm_config.parallel_config
        self.tp_rank = getattr(pc, "rank", 0) % max(conn.tp_size, 1)
        self.pp_rank = getattr(pc, "rank", 0) // max(conn.tp_size, 1)
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group
            self.tp_rank = get_tp_group().rank_in_group
            self.pp_rank = get_pp_group().rank_in_group
        except Exception:  # noqa: BLE001 - not initialized (tests, single process)
            pass
        self.stream: WorkerStream | None = None
        self.layer_index: dict[str, int] = {}
        self.waiting_recv: set[str] = set()
        self.waiting_send: set[str] = set()
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()
        self.invalid: set[int] = set()
        self.stats = KvxferStats()
        self.step = 0
        self.layer_steps: list[int] = []
        self.saver: _LayerSaver | None = None
        self.started: KvxferConnectorMetadata | None = None  # by bind_step, before the forward
        self.dead: str | None = None
        # A stream that ended: when, the requests kvxferd held then (it may
        # still move their bytes: see _fail_dead), and whether kvxferd is
        # unreachable (gone, and its transfers with it).
        self.dead_at = 0.0
        self.held_at_death: set[str] = set()
        self.daemon_gone = False
        self.hello: pb.WorkerHello | None = None
        self.retry_at = 0.0

    # -- memory and layout --

    def register(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        c = self.c
        if c.in_process and c.client is None:
            # This rank's server: listening at its own peer port (the
            # engine's base plus its rank), started now.
            port = placement_mod.rank_port(c.base, c.tp_size, self.pp_rank, self.tp_rank) if c.base else 0
            # Its index in the deployment (data-parallel ranks included):
            # where it serves metrics, with server.metrics_listen.
            index = port - c.cfg.peer_port if c.base else None
            # The error names the port and how it is made (the port may
            # be another's: another engine's rank, or another program).
            what = (f"the in-process server of rank tp={self.tp_rank} pp={self.pp_rank} at port {port} = "
                    f"kv_connector_extra_config.peer_port {c.cfg.peer_port} + {index} (the rank's index"
                    f"{' in the deployment' if c.base != c.cfg.peer_port else ''})" if c.base else
                    f"the in-process server of rank tp={self.tp_rank} pp={self.pp_rank}")
            c._attach(lambda s, common: s.acquire_rank(common, c.cfg.peer_host, c.base, port, index), what)
        hello = self.hello = build_hello(self, kv_caches)
        try:
            self.stream = c.client.connect(hello, ready_timeout=max(self.cfg.timeout_s, 30))
        except errors.KvxferError as e:
            where = f"its in-process server ({c.address})" if c.in_process else f"kvxferd at {c.address}"
            raise RuntimeError(f"kvxfer: rank tp={self.tp_rank} pp={self.pp_rank} of engine {c.engine_id} "
                               f"cannot attach to {where}: {e}") from e
        if self.cfg.layerwise:
            self.saver = _LayerSaver(self.stream)

    # -- per step --

    def bind_step(self, meta: KvxferConnectorMetadata) -> None:
        # vLLM (0.32) calls start_load_kv after the forward pass when the
        # step's loads are asynchronous, and this connector's always are;
        # but a layer-wise producer saves its layers during the forward, and
        # each save names the step the server took last. So a layer-wise
        # step that starts no receive goes to the server here, before the
        # forward; one that does still starts in start_load_kv, after the
        # forward launch, where vLLM orders loads (after its zeroing of new
        # blocks).
        self.started = None
        if self.cfg.layerwise and not meta.expect_recv and not meta.fail_recv:
            self.start_step(meta)
            self.started = meta

    def start_step(self, meta: KvxferConnectorMetadata) -> None:
        if self.started is meta:
            self.started = None  # bind_step started it
            return
        self.waiting_recv.update(meta.expect_recv)
        self.waiting_send.update(meta.expect_send)
        for rid, why in meta.fail_recv.items():
            self._recv_done(rid, failed=True, why=why)
        for rid, why in meta.fail_send.items():
            self._send_done(rid)
        self.layer_steps = []
        if meta.abort_listed and self.stream is not None and self.dead is None:
            # The step's calls were lost: the worker ends what it holds
            # prefilling of them (its consumer told), as their finish would
            # have; its outcome, aborted, is a stale one here (they ended
            # above). A stream that ended meanwhile ended them there too.
            try:
                self.stream.step(pb.StepMeta(not_processed=sorted(meta.abort_listed),
                                             not_processed_transfer_ids={k: v for k, v in meta.abort_listed.items() if v}))
            except errors.KvxferError as e:
                log.warning("kvxfer: rank tp=%d pp=%d could not tell kvxferd of lost finishes %s: %s",
                            self.tp_rank, self.pp_rank, sorted(meta.abort_listed), e)
        if not meta.step_meta and not meta.step_ref:
            return
        if self.dead is not None and not self._reattach():
            self._fail_dead()
            return
        try:
            if meta.step_ref:
                self.step = meta.step_ref
                # What this step starts waits on: should the daemon drop the
                # step, its StepError names them back and _poll ends them.
                self.stream.step_ref(meta.step_ref, meta.expect_recv, meta.expect_send)
                prefill = meta.prefill
            else:
                sm = pb.StepMeta.FromString(meta.step_meta)
                self.step = sm.step
                self.stream.step(sm)
                prefill = bool(sm.prefill)
        except errors.KvxferError as e:
            # The stream ended before this step could go: what it delivered
            # before its end is the requests' outcomes, taken first (the
            # connector polls after the step starts).
            self._salvage()
            self._die(str(e))
            return
        if prefill:
            self.layer_steps.append(self.step)

    def layer_saved(self, layer_name: str, kv_layer) -> None:
        if self.saver is None or not self.layer_steps or self.dead is not None:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for step in self.layer_steps:
            self.saver.saved(step, layer, kv_layer)

    def wait_for_save(self) -> None:
        if self.saver is not None:
            self.saver.flush()

    def _recv_done(self, rid: str, failed: bool, why: str = "") -> None:
        if rid not in self.waiting_recv:
            return
        self.waiting_recv.discard(rid)
        self.recving.add(rid)
        if failed:
            self.failed.add(rid)
            self.stats.data["failed_recv"] += 1
            log.warning("kvxfer: receive of request %s failed: %s", rid, why)

    def _send_done(self, rid: str, failed: bool = False, why: str = "") -> None:
        if rid not in self.waiting_send:
            return
        self.waiting_send.discard(rid)
        self.sending.add(rid)
        if failed:
            self.stats.data["failed_send"] += 1
            log.info("kvxfer: send of request %s ended %s", rid, why)

    def _fail_all(self, why: str) -> None:
        for rid in list(self.waiting_recv):
            self._recv_done(rid, failed=True, why=why)
        for rid in list(self.waiting_send):
            self._send_done(rid, failed=True, why=why)

    def _reattach(self) -> bool:
        """After the stream ended (kvxferd restarted, say), attaches the rank
        again, at most once a second: the memory is the same files, so the
        same hello serves. Requests failed meanwhile stay failed."""
        now = time.monotonic()
        if now < self.retry_at:
            return False
        self.retry_at = now + 1.0
        try:
            stream = self.c.client.connect(self.hello, ready_timeout=min(self.cfg.timeout_s, 5))
        except errors.KvxferError as e:
            # Unreachable: kvxferd is gone, and what it moved with it. Else
            # (the rank still attached: kvxferd still fences its
            # transfers) the requests it held wait (_fail_dead).
            self.daemon_gone = self.daemon_gone or isinstance(e, errors.Unavailable)
            log.info("kvxfer: rank tp=%d pp=%d of engine %s cannot attach again yet: %s",
                     self.tp_rank, self.pp_rank, self.c.engine_id, e)
            return False
        # kvxferd let the old rank go: nothing of it moves any more; what it
        # held ends now (its outcomes were lost with the stream).
        why = self.dead or "the stream ended"
        for rid in sorted(self.held_at_death):
            if rid in self.waiting_recv:
                self._recv_done(rid, failed=True, why=why)
            if rid in self.waiting_send:
                self._send_done(rid, failed=True, why=why)
        self.stream, self.dead, self.daemon_gone = stream, None, False
        self.held_at_death = set()
        if self.saver is not None:
            self.saver.stream = stream
        log.warning("kvxfer: rank tp=%d pp=%d of engine %s attached to kvxferd again", self.tp_rank, self.pp_rank,
                    self.c.engine_id)
        return True

    def _die(self, why: str) -> None:
        if self.dead is None:
            log.error("kvxfer: the stream of engine %s rank tp=%d pp=%d ended: %s; failing its requests once kvxferd "
                      "let the rank go", self.c.engine_id, self.tp_rank, self.pp_rank, why)
            self.dead_at = time.monotonic()
            self.held_at_death = set(self.waiting_recv) | set(self.waiting_send)
        self.dead = why
        self._fail_dead()

    def _fail_dead(self) -> None:
        """Ends the requests of a rank whose stream ended. Those kvxferd held
        then end only once nothing of its can still move their bytes (its
        close of the rank fences the transfers in flight, up to its close
        timeout): once it took the rank back (we attached again), cannot be
        reached, or _DAEMON_FENCE_S passed. Their blocks go back to vLLM
        then, never while a WRITE may still read or land in them. Requests
        of later steps (never sent to kvxferd) end at once."""
        fenced = self.daemon_gone or time.monotonic() - self.dead_at >= _DAEMON_FENCE_S
        why = self.dead or "the stream ended"
        for rid in list(self.waiting_recv):
            if fenced or rid not in self.held_at_death:
                self._recv_done(rid, failed=True, why=why)
        for rid in list(self.waiting_send):
            if fenced or rid not in self.held_at_death:
                self._send_done(rid, failed=True, why=why)

    def _poll(self) -> None:
        if self.stream is None or self.dead is not None:
            if self.dead is not None and not self._reattach():
                # Not back yet: ask again (at most once a second) whether
                # kvxferd let the rank go or is gone, for what it held.
                self._fail_dead()
            return
        try:
            f = self.stream.poll()
        except errors.StreamClosed as e:
            self._die(str(e))
            return
        self._apply(f)

    def _salvage(self) -> None:
        """Takes the outcomes a stream that ended delivered before its end
        (none of them is lost with it)."""
        if self.stream is None or self.dead is not None:
            return
        try:
            f = self.stream.poll()
        except errors.KvxferError:
            return
        self._apply(f)

    def _apply(self, f) -> None:
        """Ends the requests f (what a poll took) reports."""
        ok, aborted = pb.Outcome.RESULT_DONE, pb.Outcome.RESULT_ABORTED
        for o in f.recving:
            if o.result == aborted:
                # The engine aborted that request (a consumer aborted
                # before it was scheduled): vLLM waits on no transfer of
                # it. The outcome, read steps later, must not end a new
                # request under the same id (a router's retry), whose KV
                # may still be on its way into its blocks.
                _stale(o, "receive")
                continue
            if o.result == ok:
                self._recv_done(o.request_id, failed=False)
            else:
                self._recv_done(o.request_id, failed=True, why=_why(o))
        for o in f.sending:
            if o.result == aborted:
                # A producer the engine aborted, or a layer-wise one it
                # abandoned at a preemption (_SchedulerSide._preempted):
                # never one vLLM holds blocks for. Taken as the outcome of
                # the same request's later finish (resumed at once), it
                # would free the blocks its WRITE is still to read.
                _stale(o, "send")
                continue
            if o.result == ok:
                self._send_done(o.request_id)
            else:
                self._send_done(o.request_id, failed=True, why=_why(o))
        self.invalid.update(f.invalid_block_ids)
        for e in f.step_errors:
            if not e.dropped:
                # Entries refused: each named request failed in f already.
                log.warning("kvxfer: step %d: kvxferd refused entries: %s", e.step, e.message)
                continue
            # Nothing of the step reached the rank's worker: no outcome will
            # come for its requests, which end here as failed ones do.
            if e.message:
                log.error("kvxfer: step %d dropped by kvxferd rank tp=%d pp=%d: %s; failing its requests",
                          e.step, self.tp_rank, self.pp_rank, e.message)
            why = f"step {e.step} dropped by kvxferd: {e.message or 'see the step error above'}"
            for rid in e.recv_request_ids:
                self._recv_done(rid, failed=True, why=why)
            for rid in e.send_request_ids:
                self._send_done(rid, failed=True, why=why)
        for s in f.stats:
            d = self.stats.data
            d["transfers"] += s.transfers
            d["failed_transfers"] += s.failed_transfers
            d["bytes"] += s.bytes
            d["descriptors"] += s.descriptors
            d["transfer_seconds"] += s.transfer_seconds
            d["expired"] += s.expired

    def results(self) -> KVConnectorTransferResults:
        self._poll()
        out = KVConnectorTransferResults(finished_sending=self.sending, finished_recving=self.recving,
                                         failed_recving=self.failed & self.recving)
        self.sending, self.recving, self.failed = set(), set(), self.failed - out.failed_recving
        return out

    def take_invalid_blocks(self) -> set[int]:
        # Block ids are unique only within a group: with several groups,
        # failures travel by request (failed_recving) alone.
        inv, self.invalid = self.invalid, set()
        if self.kv_cache_config is not None and len(self.kv_cache_config.kv_cache_groups) > 1:
            return set()
        return inv

    def take_stats(self) -> KvxferStats | None:
        return _take_stats(self)

    def shutdown(self) -> None:
        if self.saver is not None:
            self.saver.close()
        if self.stream is not None and self.dead is None:
            self.stream.bye(timeout=self.cfg.timeout_s + 30)


class _LayerSaver:
    """Sends LayerSaved once a layer's KV is in memory: at once for host
    memory; for GPU memory after a CUDA event recorded on the compute
    stream completes, from a helper thread, so the forward pass never
    waits."""

    def __init__(self, stream: WorkerStream):
        self.stream = stream
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = threading.Event()
        self.idle.set()
        self.thread: threading.Thread | None = None

    def saved(self, step: int, layer: int, kv_layer) -> None:
        if kv_layer is None or not getattr(kv_layer, "is_cuda", False):
            try:
                self.stream.layer_saved(step, layer)
            except errors.KvxferError as e:
                log.warning("kvxfer: LayerSaved(%d, %d): %s", step, layer, e)
            return
        import torch
        ev = torch.cuda.Event()
        ev.record()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="kvxfer-layer-saver", daemon=True)
            self.thread.start()
        self.idle.clear()
        self.q.put((ev, step, layer))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            ev, step, layer = item
            ev.synchronize()
            try:
                self.stream.layer_saved(step, layer)
            except errors.KvxferError as e:
                log.warning("kvxfer: LayerSaved(%d, %d): %s", step, layer, e)
            if self.q.empty():
                self.idle.set()

    def flush(self) -> None:
        self.idle.wait(60)

    def close(self) -> None:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(5)


def _stale(o: pb.Outcome, what: str) -> None:
    """Logs an outcome for a request the engine aborted (RESULT_ABORTED):
    vLLM never waits on a transfer of one (request_finished holds no
    blocks for an aborted producer; a consumer aborted before it was
    scheduled waits for nothing), so it ends nothing here."""
    log.debug("kvxfer: %s of request %s: %s; the engine aborted it, nothing waits on it", what, o.request_id, _why(o))


def _why(o: pb.Outcome) -> str:
    """A failed outcome for a log line: result, failure kind, reason."""
    kind = pb.FailureKind.Name(o.failure_kind) if o.failure_kind in pb.FailureKind.values() else str(o.failure_kind)
    # A value this client has no name for (a newer daemon's) is shown as
    # its number: a log line never raises into vLLM's loop.
    result = pb.Outcome.Result.Name(o.result) if o.result in pb.Outcome.Result.values() else f"result {o.result}"
    return f"{result} ({kind.removeprefix('FAILURE_KIND_').lower()}): {o.reason}"


def _dtype_size(t) -> int:
    return t.element_size()


def build_hello(w: _WorkerSide, kv_caches: dict[str, "torch.Tensor"]) -> pb.WorkerHello:
    """Turns vLLM's per-layer KV views into a kvxfer layout and shares the
    memory holding them. Each attention layer's view is [B, H, N, C] (C: K
    then V of one head and token); under LBHNC each layer is one region of
    B contiguous blocks of H·N·C bytes."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    cfg = w.kv_cache_config
    if not kv_caches:
        raise ValueError("kvxfer: register_kv_caches got no KV caches")
    group_of: dict[str, int] = {}
    spec_of: dict[str, Any] = {}
    if cfg is not None:
        for gi, g in enumerate(cfg.kv_cache_groups):
            for name in g.layer_names:
                group_of[name] = gi
                spec_of[name] = g.kv_cache_spec
    names = sorted(kv_caches, key=lambda n: (extract_layer_index(n), n))
    # Regions pair with the consumer's (one stage holding every layer) by
    # global index: a later pipeline stage's start at its first layer's
    # (one region per layer, as the reference's _remote_region_offset).
    region_offset = min(extract_layer_index(n) for n in names) if w.pp_rank > 0 and names else 0
    regions, groups = [], [[] for _ in w.c.groups]
    head_size = elem = heads = kernel_bs = 0
    order = None
    region_of: dict[tuple, int] = {}
    for name in names:
        t = kv_caches[name]
        spec = spec_of.get(name)
        gi = group_of.get(name, 0)
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in region_of:
            # Layers that share one cache are one region: KV sharing (the
            # layers of one group), or vLLM's hybrid allocator, which gives
            # one tensor to a layer of each cache group, each group's blocks
            # in it. The region is then listed in every group whose layers
            # use it, so each group's blocks in it move.
            ri, g = region_of[key], groups[min(gi, len(groups) - 1)]
            if ri not in g:
                if w.cfg.layerwise:
                    raise ValueError(
                        f"kvxfer: layer {name} shares its KV cache with a layer of another cache group (vLLM's hybrid "
                        "KV cache manager): layer-wise push writes a region once its layer is saved, before the other "
                        "group's layer in it is computed; turn layerwise off for this model, or run vLLM with "
                        "--disable-hybrid-kv-cache-manager")
                g.append(ri)
            continue
        region_of[key] = len(regions)
        if t.dim() != 4:
            raise ValueError(f"kvxfer: layer {name}: KV cache has shape {tuple(t.shape)}, want [blocks, heads, tokens, K|V]"
                             " (vLLM >= 0.32's per-layer views)")
        b, h, n, c = t.shape
        sb, sh, sn, sc = t.stride()
        es = _dtype_size(t)
        if sc != 1:
            raise ValueError(f"kvxfer: layer {name}: the K|V content is not contiguous (stride {sc})")
        lay = pb.KV_LAYOUT_ORDER_HND if sh >= sn * n else pb.KV_LAYOUT_ORDER_NHD
        block_bytes = h * n * c * es
        if sb * es != block_bytes:
            raise ValueError(
                f"kvxfer: layer {name}: blocks are {sb * es} bytes apart but hold {block_bytes}: the KV cache layout "
                "interleaves layers or pads blocks (block-outermost VLLM_KV_CACHE_LAYOUT); kvxfer needs a layer-outermost "
                "layout (LBHNC, which this connector asks vLLM for)")
        if order is None:
            order, heads, kernel_bs, elem = lay, h, n, es
            head_size = c // 2
        elif (lay, h, n, es) != (order, heads, kernel_bs, elem):
            raise ValueError(f"kvxfer: layer {name}: layout differs from the first layer's "
                             f"(order/heads/tokens/elem {lay}/{h}/{n}/{es} vs {order}/{heads}/{kernel_bs}/{elem})")
        # An MLA layer's one latent per token has no V of its own (vLLM's
        # MLAAttentionSpec has head_size_v 0): nothing to compare.
        if isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec) and spec.head_size_v != spec.head_size:
            raise ValueError(f"kvxfer: layer {name}: K and V head sizes differ ({spec.head_size} vs {spec.head_size_v})")
        kind, window = w.c.groups[gi] if gi < len(w.c.groups) else w.c.groups[0]
        groups[min(gi, len(groups) - 1)].append(len(regions))
        # LayerSaved names the layer as the server counts them: the region's
        # global index (a layer sharing another's cache has none and is not
        # reported: it writes no KV of its own).
        w.layer_index[name] = region_offset + len(regions)
        regions.append(pb.Region(kind=kind, window=window, base=t.data_ptr(), block_len=block_bytes,
                                 num_blocks=b, device_id=t.device.index or 0 if t.is_cuda else 0))
    memory = share_memory(w, [kv_caches[n] for n in names], [(r.base, r.block_len * r.num_blocks) for r in regions])
    layout = pb.KvLayout(tp_rank=w.tp_rank, tp_size=w.c.tp_size, pp_rank=w.pp_rank, pp_size=w.c.pp_size,
                         total_kv_heads=_total_kv_heads(w, heads), head_size=head_size, elem_bytes=elem, order=order,
                         packing=pb.KV_PACKING_PACKED, logical_block_size=w.c.block_size, kernel_block_size=kernel_bs,
                         region_offset=region_offset, regions=regions,
                         groups=[pb.CacheGroup(kind=k, window=wd, regions=g) for (k, wd), g in zip(w.c.groups, groups)])
    return pb.WorkerHello(engine_id=w.c.engine_id, mode=w.cfg.mode, layout=layout, memory=memory,
                          compat_hash=compat_hash(w.vllm_config, w.cfg.mode, prefill_backoff(w.vllm_config, w.kv_cache_config)), layerwise=w.cfg.layerwise)


def _total_kv_heads(w: _WorkerSide, local: int) -> int:
    """The model's KV heads over all TP ranks, for a rank whose views hold
    local heads. With fewer KV heads than TP ranks vLLM replicates them (one
    per rank), so local·tp overstates them, and two engines of one model at
    different TP sizes would announce different counts: the model config's
    count is taken when it gives the views' per-rank count."""
    tp = max(w.c.tp_size, 1)
    mc = getattr(getattr(w, "vllm_config", None), "model_config", None)
    try:
        total = int(mc.get_total_num_kv_heads()) if mc is not None else 0
    except Exception:  # noqa: BLE001 - a config without it: the views decide
        total = 0
    if total > 0 and (total % tp == 0 or tp % total == 0) and max(1, total // tp) == local:
        return total
    return local * tp


def share_memory(w: _WorkerSide, tensors: list, ranges: list[tuple[int, int]]) -> list[pb.SharedMemory]:
    """The memory holding the tensors, as the daemon can map it: the
    shared-memory files they live in (host), or CUDA IPC handles (GPU)."""
    from kvxfer import shm
    if w is not None and w.c.in_process:
        return in_process_memory(tensors)
    if tensors[0].is_cuda:
        from kvxfer import cuda
        return [pb.SharedMemory(base=s.base, size=s.size, cuda_ipc_handle=s.handle, device_uuid=s.device_uuid)
                for s in cuda.export_tensors(tensors)]
    out: dict[str, pb.SharedMemory] = {}
    for lo, n in ranges:
        found = shm.find_mapping(lo, max(n, 1), w.cfg.shm_dir)
        if found is None:
            raise ValueError(
                f"kvxfer: the KV cache at 0x{lo:x} is not in a shared-memory file under {w.cfg.shm_dir}, so kvxferd cannot "
                "map it: allocate host KV caches over kvxfer.shm.create() (torch.frombuffer), or run on GPUs")
        path, base, size = found
        out.setdefault(path, pb.SharedMemory(path=path, base=base, size=size))
    return list(out.values())


def in_process_memory(tensors: list) -> list[pb.SharedMemory]:
    """The memory holding the tensors, named by address for this process's
    own server (placement in-process): one entry per allocation (vLLM
    0.32's per-layer views share one), host or GPU. No file, no IPC
    handle: the server registers the engine's own memory."""
    from kvxfer import inprocess as ip
    out: dict[int, pb.SharedMemory] = {}
    for t in tensors:
        st = t.untyped_storage()
        base, size = st.data_ptr(), st.nbytes()
        if base in out:
            continue
        if t.is_cuda:
            out[base] = ip.device_memory(base, size, t.device.index or 0)
        else:
            out[base] = ip.host_memory(base, size)
    return list(out.values())
