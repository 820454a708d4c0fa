"""kv_transfer_params: the dict a request carries between engines through the
router, in the shape vLLM's routers already send, converted to and from
kvxfer.v1's TransferParams.

Keys (all optional unless a transfer needs them):

- ``do_remote_prefill`` (D: receive this request's KV), ``do_remote_decode``
  (P: keep this request's KV for a D);
- ``transfer_id``: the router's id for the transfer, the matching key on both
  engines when present (push routers must set it: D registers before P knows
  its own request id);
- ``remote_engine_id``, ``remote_host``, ``remote_port``: the other engine and
  its kvxferd's peer address;
- ``remote_request_id``: the request's id on the other engine;
- ``remote_block_ids``: the other side's block ids, one list per KV-cache
  group (a flat list means one group); ``remote_block_starts``: the token index
  of each list's first block (default 0);
- ``tp_size`` (the other engine's TP size), ``remote_pp_size``,
  ``remote_num_tokens``, ``remote_blocks_expiry_unix_nanos``, ``remote_generation``
  (the producer engine's generation when it issued the params: a pull
  consumer handshakes again before reading when its handshake is of another
  generation, and does not read params of an older one; an integer, never a
  float: past 2^53 a double rounds it);
- ``mode``: ``"push"`` or ``"pull"``, the mode the sender used.

vLLM's NixlConnector spellings are accepted too: ``pp_size`` for
``remote_pp_size`` and ``transfer_mode`` for ``mode``.
"""

from __future__ import annotations

from typing import Any

from kvxfer.placement import is_host
from kvxfer.v1 import kvxfer_pb2 as pb

MODES = {"push": pb.MODE_PUSH, "pull": pb.MODE_PULL}
MODE_NAMES = {v: k for k, v in MODES.items()}


def mode_of(v) -> int:
    """The kvxfer.v1 Mode a params mode names (push, pull); anything else
    is MODE_UNSPECIFIED."""
    try:
        return MODES.get(v, pb.MODE_UNSPECIFIED)
    except TypeError:  # unhashable
        return pb.MODE_UNSPECIFIED


class ParamsError(ValueError):
    """A kv_transfer_params field is missing or malformed; the message names it."""


def _canonical(p: dict) -> dict:
    if "transfer_mode" in p and "mode" not in p:
        p = {**p, "mode": p["transfer_mode"]}
    if "pp_size" in p and "remote_pp_size" not in p:
        p = {**p, "remote_pp_size": p["pp_size"]}
    return p


_INT32_MAX = (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1
INT64_MAX = _INT64_MAX
_UINT64_MAX = (1 << 64) - 1


def _int(p: dict, key: str, default: int = 0, minimum: int = 0, maximum: int = _INT64_MAX) -> int:
    v = p.get(key, default)
    if v is None:
        return default
    return _intval(f"kv_transfer_params.{key}", v, minimum, maximum)


def _intval(name: str, v, minimum: int = 0, maximum: int = _INT64_MAX) -> int:
    """v as an integer in [minimum, maximum] (kvxfer.v1's field holds it),
    or ParamsError naming name: a boolean or a fraction is no integer (an
    integral float or a numeric string, as a router may write one, is)."""
    if type(v) is not int:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ParamsError(f"{name} = {v!r}, want an integer")
        try:
            v = int(v)
        except (TypeError, ValueError, OverflowError):
            raise ParamsError(f"{name} = {v!r}, want an integer") from None
    if v < minimum:
        raise ParamsError(f"{name} = {v}, want >= {minimum}")
    if v > maximum:
        raise ParamsError(f"{name} = {v}, want <= {maximum}")
    return v


def _strval(name: str, v) -> str:
    """v as a string kvxfer.v1 can carry, or ParamsError naming name: a
    str of valid Unicode (protobuf cannot encode a lone surrogate, which
    JSON's "\\ud800" gives), or an int (a numeric id, as a router may
    write one); never another object's repr, nor a boolean's."""
    if type(v) is not str:
        if type(v) is int:
            return str(v)
        raise ParamsError(f"{name} = {v!r}, want a string")
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ParamsError(f"{name} = {v!r}, not valid Unicode (a lone surrogate at index {e.start})") from None
    return v


def str_field(p: dict, key: str) -> str:
    """p's string param key ("" when absent or empty), or ParamsError
    naming it (_strval)."""
    v = p.get(key)
    return "" if v is None or v == "" else _strval(f"kv_transfer_params.{key}", v)


def is_str(v) -> bool:
    """Whether v is a string param kvxfer.v1 can carry as it is (_strval)."""
    try:
        _strval("", v)
    except ParamsError:
        return False
    return True


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def addr(p: dict) -> str:
    """The remote kvxferd's address (host:port) from remote_host and remote_port."""
    port = p.get("remote_port")
    return _addr(_strval("kv_transfer_params.remote_host", p.get("remote_host")),
                 port if type(port) is int else _int(p, "remote_port", 0))


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def block_lists(p: dict) -> tuple[list[list[int]], list[int]]:
    ids = p.get("remote_block_ids") or []
    if not isinstance(ids, (list, tuple)):
        raise ParamsError(f"kv_transfer_params.remote_block_ids = {ids!r}, want a list")
    if ids and not isinstance(ids[0], (list, tuple)):
        ids = [ids]
    out = []
    for g, lst in enumerate(ids):
        if not isinstance(lst, (list, tuple)):
            raise ParamsError(f"kv_transfer_params.remote_block_ids[{g}] = {lst!r}, want a list")
        for i, b in enumerate(lst):
            if isinstance(b, bool) or not isinstance(b, int) or b < 0 or b >= 1 << 31:
                raise ParamsError(f"kv_transfer_params.remote_block_ids[{g}][{i}] = {b!r}, want an int32 >= 0")
        out.append(list(lst))
    starts = p.get("remote_block_starts") or [0] * len(out)
    if not isinstance(starts, (list, tuple)) or len(starts) != len(out):
        raise ParamsError(f"kv_transfer_params.remote_block_starts = {starts!r}, want {len(out)} integers")
    return out, [_intval(f"kv_transfer_params.remote_block_starts[{g}]", s) for g, s in enumerate(starts)]


# Keys a push registration's fast check covers; any other key takes the
# full check.
_FAST_KEYS = frozenset(("do_remote_prefill", "do_remote_decode", "transfer_id", "remote_engine_id", "remote_host",
                        "remote_port", "tp_size", "mode", "remote_request_id"))


def validate_remote(p: dict, mode: int) -> None:
    """Checks what a consumer needs to reach its producer; raises ParamsError."""
    get = p.get
    port, tp, tid, rrid = get("remote_port"), get("tp_size"), get("transfer_id"), get("remote_request_id")
    if (mode == pb.MODE_PUSH and _ascii(get("remote_engine_id")) and _remote_host(get("remote_host")) and type(port) is int
            and 0 < port < 65536 and (tid or rrid) and (tid is None or _ascii(tid)) and (rrid is None or _ascii(rrid))
            and get("mode", "push") == "push" and (tp is None or type(tp) is int and 0 <= tp <= _INT32_MAX)
            and _FAST_KEYS.issuperset(p)):
        return  # a well-formed push registration, the common case, checked fast
    p = _canonical(p)
    for key in ("remote_engine_id", "remote_host", "transfer_id", "remote_request_id"):
        str_field(p, key)
    if not p.get("remote_engine_id"):
        raise ParamsError("kv_transfer_params.remote_engine_id is missing")
    if not p.get("remote_host"):
        raise ParamsError("kv_transfer_params.remote_host is missing")
    if not _remote_host(p["remote_host"]):
        raise ParamsError(f"kv_transfer_params.remote_host = {p['remote_host']!r}, want a host name or IP address, "
                          "without a port (remote_port carries it)")
    port = _int(p, "remote_port", 0)
    if not 0 < port < 65536:
        raise ParamsError(f"kv_transfer_params.remote_port = {p.get('remote_port')!r}, want 1..65535")
    if not p.get("transfer_id") and not p.get("remote_request_id"):
        raise ParamsError("kv_transfer_params.transfer_id and remote_request_id are both missing")
    for key, _, maximum in _INT_FIELDS:
        _int(p, key, 0, maximum=maximum)
    generation(p)
    m = p.get("mode")
    if m is not None and mode_of(m) == pb.MODE_UNSPECIFIED:  # (a list or object too: unhashable)
        raise ParamsError(f"kv_transfer_params.mode = {m!r}, want push or pull")
    if m is not None and MODES[m] != mode:
        raise ParamsError(f"kv_transfer_params.mode = {m!r}, but this engine runs {MODE_NAMES[mode]}")
    ids, _ = block_lists(p)
    if mode == pb.MODE_PULL and not any(ids):
        raise ParamsError("kv_transfer_params.remote_block_ids is empty (pull mode reads the producer's blocks)")


def _ascii(v) -> bool:
    return type(v) is str and v != "" and v.isascii()


def _remote_host(v) -> bool:
    """Whether v names a host as peers dial it: a host name or an IP
    address (IPv6 bare or in brackets; the unspecified address too, which a
    daemon listening on it may advertise), never one with its port, a space
    or a control character, which would make a peer address no peer has."""
    if type(v) is not str:
        return False
    if v.startswith("[") and v.endswith("]") and ":" in v:
        v = v[1:-1]
    return is_host(v) or v in ("0.0.0.0", "::")


def to_proto(p: dict[str, Any] | None) -> pb.TransferParams | None:
    if p is None:
        return None
    out = pb.TransferParams()
    fill_proto(out, p)
    return out


def fill_proto(out: pb.TransferParams, p: dict[str, Any] | None) -> None:
    """Sets out's fields from p, in place: the scheduler's per-request path,
    so it sets only what is present and converts only what is not already
    of its type (to_proto's checks still apply to anything else)."""
    if not p:
        return
    get = p.get
    if get("do_remote_prefill"):
        out.do_remote_prefill = True
    if get("do_remote_decode"):
        out.do_remote_decode = True
    for key, attr in _STR_FIELDS:
        v = get(key)
        if v:
            setattr(out, attr, v if type(v) is str and v.isascii() else str_field(p, key))
    for key, attr, maximum in _INT_FIELDS:
        v = get(key)
        if v is not None:
            setattr(out, attr, v if type(v) is int and 0 <= v <= maximum else _int(p, key, 0, maximum=maximum))
    if get("remote_generation") is not None:
        out.remote_generation = generation(p)
    m = get("mode") or get("transfer_mode")
    if m is not None:
        out.mode = mode_of(m)
    host = get("remote_host")
    if host:
        port = get("remote_port")
        out.remote_addr = addr(p) if type(host) is not str or not host.isascii() or type(port) is not int else _addr(host, port)
    if get("remote_block_ids"):
        ids, starts = block_lists(p)
        for lst, st in zip(ids, starts):
            sp = out.remote_block_ids.add()
            sp.start = st
            sp.block_ids.extend(lst)


_STR_FIELDS = (("transfer_id", "transfer_id"), ("remote_engine_id", "remote_engine_id"),
               ("remote_request_id", "remote_request_id"))
# pp_size (NixlConnector's spelling) first: remote_pp_size wins when both are set.
# (key, TransferParams field, the largest value the field holds)
_INT_FIELDS = (("tp_size", "remote_tp_size", _INT32_MAX), ("pp_size", "remote_pp_size", _INT32_MAX),
               ("remote_pp_size", "remote_pp_size", _INT32_MAX), ("remote_num_tokens", "remote_num_tokens", _INT64_MAX),
               ("remote_blocks_expiry_unix_nanos", "remote_blocks_expiry_unix_nanos", _INT64_MAX))


def generation(p: dict) -> int:
    """p's remote_generation (0 when absent: unknown), or ParamsError naming
    it: an integer 0..2^64-1 (a numeric string too, as the other integers),
    never a boolean nor a float, integral or not. A generation counts from
    the producer's clock in nanoseconds (~1.8e18), past 2^53: one that went
    through a double (a router's JSON library reading numbers as floats)
    may have lost its last digits and name another generation, whose
    params the consumer would refuse with a misleading reason."""
    v = p.get("remote_generation")
    if type(v) is int and 0 <= v <= _UINT64_MAX:
        return v
    if v is None:
        return 0
    if isinstance(v, float):
        raise ParamsError(f"kv_transfer_params.remote_generation = {v!r}, want an integer (a float may have lost the "
                          "generation's last digits: pass kv_transfer_params through as they are, JSON integers kept)")
    return _intval("kv_transfer_params.remote_generation", v, 0, _UINT64_MAX)


def expiry(p: dict) -> int:
    """p's remote_blocks_expiry_unix_nanos (0 when absent), or ParamsError
    naming it: an integer 0..2^63-1 (an integral float or a numeric string,
    as for the other integers, converted)."""
    return _int(p, "remote_blocks_expiry_unix_nanos", 0, maximum=_INT64_MAX)


def from_proto(t: pb.TransferParams) -> dict[str, Any]:
    out: dict[str, Any] = {
        "do_remote_prefill": t.do_remote_prefill,
        "do_remote_decode": t.do_remote_decode,
        "remote_engine_id": t.remote_engine_id,
        "remote_request_id": t.remote_request_id,
        "remote_block_ids": [list(s.block_ids) for s in t.remote_block_ids],
        "remote_block_starts": [s.start for s in t.remote_block_ids],
        "tp_size": t.remote_tp_size or 1,
        "remote_pp_size": t.remote_pp_size or 1,
        "remote_num_tokens": t.remote_num_tokens,
    }
    if t.transfer_id:
        out["transfer_id"] = t.transfer_id
    if t.remote_addr:
        out["remote_host"], out["remote_port"] = split_addr(t.remote_addr)
    if t.mode in MODE_NAMES:
        out["mode"] = MODE_NAMES[t.mode]
    if t.remote_blocks_expiry_unix_nanos:
        out["remote_blocks_expiry_unix_nanos"] = t.remote_blocks_expiry_unix_nanos
    if t.remote_generation:
        out["remote_generation"] = t.remote_generation
    return out
