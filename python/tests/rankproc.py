"""What the in-process rank processes share (inprocess_rank.py and
inprocess_soak_rank.py): a worker rank with its own libkvxfer server on its
rank's peer port (rank-port-base + tp_rank), one rank stream over a host KV
cache named by its address, steered by JSON lines on stdin.

CONFIG_JSON (argv[1]): {"engine", "role" ("P" or "D"), "tp_rank",
"tp_size", "base", "secret", "mode" ("push", the default, or "pull"),
"server": {extra libkvxfer keys}}.
"""

from __future__ import annotations

import json
import queue
import sys
import threading

import numpy as np

import kvxfer
from kvxfer import inprocess
from kvxfer.v1 import kvxfer_pb2 as pb

HEADS, HEAD_SIZE, BLOCK, ELEM = 4, 8, 16, 2
BLOCKS = 64


def block_len(tp_size: int) -> int:
    return 2 * (HEADS // tp_size) * BLOCK * HEAD_SIZE * ELEM  # K and V, packed


def config() -> dict:
    return json.loads(sys.argv[1])


def connect(cfg: dict, kv: np.ndarray):
    """Starts the rank's server and opens its rank stream over kv.
    Returns (client, worker)."""
    rank, tp = cfg["tp_rank"], cfg["tp_size"]
    server = {"peer_secret_file": cfg["secret"], "log_level": "warn", "rank_port_base": cfg["base"],
              "peer_listen": f"127.0.0.1:{cfg['base'] + rank}", **cfg.get("server", {})}
    endpoint = inprocess.start(server)
    base, size = kv.ctypes.data, kv.nbytes
    client = kvxfer.Client(endpoint)
    layout = pb.KvLayout(tp_rank=rank, tp_size=tp, pp_rank=0, pp_size=1, total_kv_heads=HEADS, head_size=HEAD_SIZE,
                         elem_bytes=ELEM, order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED,
                         logical_block_size=BLOCK, kernel_block_size=BLOCK,
                         regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=base,
                                            block_len=block_len(tp), num_blocks=BLOCKS)])
    mode = pb.MODE_PULL if cfg.get("mode") == "pull" else pb.MODE_PUSH
    w = client.connect(pb.WorkerHello(engine_id=cfg["engine"], mode=mode, layout=layout, compat_hash="h",
                                      memory=[inprocess.host_memory(base, size)]))
    return client, w


def commands() -> queue.SimpleQueue:
    """stdin's JSON lines, one command each, then {"op": "eof"}."""
    cmds: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            cmds.put(json.loads(line))
        cmds.put({"op": "eof"})

    threading.Thread(target=read, daemon=True).start()
    return cmds


def recv_step(step: int, now: int, reqs: list) -> pb.StepMeta:
    """A step with consumer requests {"id", "tid", "blocks", "engine", "addr",
    "preq", "tp_size", "tokens", "deadline_s", "remote_blocks" (pull)}."""
    return pb.StepMeta(step=step, scheduler_clock_unix_nanos=now, recv=[pb.RecvRequest(
        request_id=r["id"], transfer_id=r["tid"], local=[pb.Span(block_ids=r["blocks"])],
        deadline_unix_nanos=now + int(r["deadline_s"] * 1e9),
        remote=pb.RemoteRef(engine_id=r["engine"], addr=r["addr"], request_id=r["preq"], tp_size=r["tp_size"],
                            tokens=r["tokens"],
                            blocks=[pb.Span(block_ids=r["remote_blocks"])] if "remote_blocks" in r else [])
    ) for r in reqs])


def send_step(step: int, now: int, reqs: list) -> pb.StepMeta:
    """A step with producer requests {"id", "tid", "blocks", "tokens", "deadline_s"}."""
    return pb.StepMeta(step=step, scheduler_clock_unix_nanos=now, send=[pb.SendRequest(
        request_id=r["id"], transfer_id=r["tid"], deadline_unix_nanos=now + int(r["deadline_s"] * 1e9),
        blocks=[pb.Span(block_ids=r["blocks"])], tokens=r["tokens"]) for r in reqs])


def outcome(o) -> dict:
    return {"id": o.request_id, "result": pb.Outcome.Result.Name(o.result),
            "kind": pb.FailureKind.Name(o.failure_kind), "reason": o.reason}


def close(client, w, timeout: float):
    """Ends the stream (bye) and the server; returns the bye's completions."""
    f = w.bye(timeout=timeout)
    err = None if w.error is None else str(w.error)
    client.close()
    inprocess.stop()
    return f, err
