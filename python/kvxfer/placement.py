"""Where an engine's kvxfer server runs, for the vLLM connector: in the
engine's own processes (``in-process``: libkvxfer, one server per process)
or in a kvxferd daemon (``daemon``).

In-process, an engine with base peer port BASE on host HOST is reached by
its peers at ``HOST:BASE``: its worker rank (pp, tp) runs a server of its
own listening at :func:`rank_port` (BASE + pp_rank*tp_size + tp_rank, with
``rank-port-base`` BASE so a peer's handshake at BASE learns the other
ranks' ports), and its scheduler side (vLLM's EngineCore process) uses the
server of the rank in its process when there is one (vLLM's single-process
executor), else starts one of its own that listens on a port the system
picks and names the engine by ``HOST:BASE`` (what transfer params carry).

Base port 0 is for tests and single-process engines: the system picks the
port, and every rank and the scheduler of the engine must live in the one
process (they share its server, which serves them as a daemon would).

One server per process: a process's connectors (an engine's scheduler
side and its ranks; in tests, several engines) share it through
:class:`ProcessServer`, which starts it once and stops it when the last of
them lets go (and at interpreter exit, kvxfer.inprocess).

This module imports no vLLM.
"""

from __future__ import annotations

import ipaddress
import os
import re
import threading

from kvxfer import inprocess

__all__ = ["PLACEMENTS", "is_host", "rank_port", "engine_base", "server_config", "ProcessServer", "acquire", "release"]

PLACEMENTS = ("in-process", "daemon")

# Keys of libkvxfer's configuration the connector sets itself: an engine's
# own server must listen where its peers look for it.
# (Those the connector has keys of its own for are set through them.)
OWNED_KEYS = frozenset(("peer-listen", "peer-advertise", "rank-port-base", "socket", "own-process-only", "ready-file",
                        "backend", "peer-secret-file", "insecure-peers", "tls-cert", "tls-key", "tls-ca"))


def is_host(host) -> bool:
    """Whether host names one host as peers reach it: an IP address (IPv6
    with its zone, if any), not a wildcard, or a host name (labels of
    letters, digits, "-" and "_", joined by dots); never a port, a space
    or a control character, which each server of the engine would fail
    to listen at, long after the configuration was read."""
    if not isinstance(host, str) or not host or len(host) > 253:
        return False
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0] if ":" in host else host)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.is_unspecified:
            return False
        zone = host.partition("%")[2]
        return "%" not in host or (isinstance(ip, ipaddress.IPv6Address) and bool(_LABEL.fullmatch(zone)))
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    return all(_LABEL.fullmatch(label) for label in labels)


# One label of a host name (RFC 1123, with "_" as container and service
# names have it); also an IPv6 zone (an interface name).
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def rank_port(base: int, tp_size: int, pp_rank: int, tp_rank: int) -> int:
    """The peer port of rank (pp_rank, tp_rank) of an engine whose base is
    ``base`` (the Go side's server.RankPort)."""
    return base + pp_rank * tp_size + tp_rank


def engine_base(peer_port: int, dp_index: int, tp_size: int, pp_size: int) -> int:
    """An engine's base port: data-parallel rank dp_index of a deployment
    configured with peer_port is an engine of its own, its ranks after the
    previous DP ranks' (0 stays 0: the system picks)."""
    if peer_port == 0:
        return 0
    return peer_port + dp_index * tp_size * pp_size


def server_config(common: dict, host: str, port: int, base: int, index: int | None = None) -> dict:
    """libkvxfer's JSON configuration for a server listening at host:port
    (0: the system picks) of the engine with base ``base`` (0: none; the
    server serves whatever ranks attach, as a daemon does). common holds
    the keys every server of the process shares (authentication, backend,
    the user's extra keys). With a base, each rank's server runs in a
    process of its own, and ports in common are bases as the peer port
    is, for ``index``, the rank's index in the deployment (data-parallel
    ranks included; default: port - base): the rank's server serves
    /metrics at metrics-listen's port plus index (the scheduler side's own
    server, port 0, serves none), and its built-in backend's KV listener
    is at data-port-base plus index (the server adds the rank's index in
    its engine: here the engine's offset in the deployment)."""
    cfg = dict(common)
    cfg["peer-listen"] = _join(host, port)
    if base:
        cfg["rank-port-base"] = base
        if index is None:
            index = port - base if port else 0
        metrics = cfg.get("metrics-listen")
        if metrics:
            cfg["metrics-listen"] = _offset(metrics, index) if port else ""
        dpb = cfg.get("data-port-base")
        if isinstance(dpb, str) and dpb.strip().isdigit():
            dpb = int(dpb)
        if port and type(dpb) is int and dpb > 0:
            cfg["data-port-base"] = dpb + index - (port - base)
    return cfg


def _offset(addr: str, n: int) -> str:
    """addr (HOST:PORT) with its port n further on (a port 0 stays 0: the
    system picks)."""
    h, sep, p = addr.rpartition(":")
    if not sep or not p.isdigit() or int(p) == 0:
        return addr  # the server names what is wrong with it
    return f"{h}:{int(p) + n}"


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class ProcessServer:
    """This process's kvxfer server (one per process), shared by the
    connectors in it. Safe for concurrent use."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._config: dict | None = None
        self._endpoint: str | None = None
        # The engine (common keys, host, base) the running server serves.
        self._engine: tuple | None = None

    def acquire_rank(self, common: dict, host: str, base: int, port: int, index: int | None = None) -> str:
        """The endpoint of this process's server for a worker rank whose
        peer port is ``port`` (rank_port; 0 with base 0) and whose index in
        the deployment is ``index`` (server_config). Starts the server, or
        finds it running with the same configuration (another rank or
        engine of a base-0 process, or this rank's scheduler side that
        started it first with base 0)."""
        cfg = server_config(common, host, port, base, index)
        with self._lock:
            if self._config is not None and self._config != cfg:
                raise inprocess.InProcessError(
                    inprocess.ESTARTED,
                    f"kvxfer: this process's in-process server runs with {self._describe()}, and a worker rank wants one "
                    f"listening at {cfg['peer-listen']} (base {base or 'none'}): one process runs one server, so it serves one "
                    "rank of a placement in-process engine with a base port, or every rank of engines with peer_port 0 "
                    "(all in this process)")
            return self._start(cfg, (_key(common), host, base))

    def acquire_scheduler(self, common: dict, host: str, base: int) -> str:
        """The endpoint of this process's server for an engine's scheduler
        side: a rank's server of the same engine running in this process
        (vLLM's single-process executor), or else one of its own listening
        on a port the system picks, naming the engine by host:base."""
        engine = (_key(common), host, base)
        with self._lock:
            if self._config is not None:
                if self._engine != engine:
                    raise inprocess.InProcessError(
                        inprocess.ESTARTED,
                        f"kvxfer: this process's in-process server runs with {self._describe()}, not for an engine at "
                        f"{_join(host, base)} with the same settings: one process runs one engine's server")
                self._users += 1
                return self._endpoint
            return self._start(server_config(common, host, 0, base), engine)

    def _start(self, cfg: dict, engine: tuple) -> str:
        ep = inprocess.start(cfg)
        if self._config is None:
            self._config, self._engine = cfg, engine
        self._endpoint = ep
        self._users += 1
        return ep

    def _describe(self) -> str:
        c = self._config or {}
        return f"peer-listen {c.get('peer-listen')} rank-port-base {c.get('rank-port-base', 'none')}"

    def release(self) -> None:
        """One user lets go; the last one stops the server (transfers in
        flight finish within its drain-timeout)."""
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users:
                return
            self._config = self._engine = self._endpoint = None
            inprocess.stop()

    def reset(self) -> None:
        """Stops the server whoever still uses it (tests: engines a failed
        test left behind)."""
        with self._lock:
            self._users = 0
            self._config = self._engine = self._endpoint = None
            inprocess.stop()

    @property
    def users(self) -> int:
        return self._users


def _key(common: dict) -> str:
    import json
    return json.dumps(common, sort_keys=True)


_server = ProcessServer()


def _after_fork_in_child() -> None:
    # The server is the parent's, not this child's: the child starts with
    # none, so that its first acquire asks kvxfer.inprocess (which raises
    # ForkedChildError where the parent loaded libkvxfer) instead of
    # handing out the parent's endpoint; and a lock a thread of the parent
    # held at the fork is not held here.
    _server._lock = threading.Lock()
    _server._users = 0
    _server._config = _server._engine = _server._endpoint = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def acquire() -> ProcessServer:
    """This process's shared server."""
    return _server


def release() -> None:
    _server.release()
