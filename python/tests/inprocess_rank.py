"""One worker rank process of a TP engine with kvxfer in-process (libkvxfer),
for test_inprocess_rankdeath.py: its own server on its rank's peer port
(rank-port-base + tp_rank), one rank stream, a host KV cache named by its
address, steered by JSON lines on stdin.

Usage: python inprocess_rank.py CONFIG_JSON
CONFIG_JSON: {"engine", "role" ("P" or "D"), "tp_rank", "tp_size", "base",
"secret", "mode" ("push", the default, or "pull"), "server": {extra libkvxfer
keys}}.

Commands (one JSON object a line on stdin):
  {"op": "recv", "reqs": [{"id", "tid", "blocks", "engine", "addr", "preq", "tp_size", "tokens", "deadline_s",
      "remote_blocks" (pull: the producer's)}]}
  {"op": "send", "reqs": [{"id", "tid", "blocks", "tokens", "deadline_s"}]}
  {"op": "check", "pairs": [[d_block, p_block], ...]}: D's blocks hold P's
      (the producer rank of the same tp_rank) -> "check {wrong_bytes}"
  {"op": "bye"}: ends the stream -> "bye {outcomes, error}", then exits 0.
Out (stdout, one a line): "ready {...}", "outcome {id, result, kind, reason}"
as each arrives, "error ..." on a step error.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

import numpy as np

import kvxfer
from kvxfer import inprocess
from kvxfer.v1 import kvxfer_pb2 as pb

HEADS, HEAD_SIZE, BLOCK, ELEM = 4, 8, 16, 2
BLOCKS = 64


def block_len(tp_size: int) -> int:
    return 2 * (HEADS // tp_size) * BLOCK * HEAD_SIZE * ELEM  # K and V, packed


def pattern(tp_rank: int, size: int) -> np.ndarray:
    """A producer rank's KV cache: every byte keyed by its rank and position."""
    i = np.arange(size, dtype=np.uint64)
    return ((i * 2654435761 + (i >> 10) + tp_rank * 97) % 251 + 1).astype(np.uint8)


def out(kind: str, obj) -> None:
    print(kind, json.dumps(obj), flush=True)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    role, rank, tp = cfg["role"], cfg["tp_rank"], cfg["tp_size"]
    server = {"peer_secret_file": cfg["secret"], "log_level": "warn", "rank_port_base": cfg["base"],
              "peer_listen": f"127.0.0.1:{cfg['base'] + rank}", **cfg.get("server", {})}
    endpoint = inprocess.start(server)
    blen = block_len(tp)
    kv = pattern(rank, BLOCKS * blen) if role == "P" else np.zeros(BLOCKS * blen, dtype=np.uint8)
    base, size = kv.ctypes.data, kv.nbytes
    client = kvxfer.Client(endpoint)
    layout = pb.KvLayout(tp_rank=rank, tp_size=tp, pp_rank=0, pp_size=1, total_kv_heads=HEADS, head_size=HEAD_SIZE,
                         elem_bytes=ELEM, order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED,
                         logical_block_size=BLOCK, kernel_block_size=BLOCK,
                         regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=base, block_len=blen, num_blocks=BLOCKS)])
    mode = pb.MODE_PULL if cfg.get("mode") == "pull" else pb.MODE_PUSH
    w = client.connect(pb.WorkerHello(engine_id=cfg["engine"], mode=mode, layout=layout, compat_hash="h",
                                      memory=[inprocess.host_memory(base, size)]))
    cmds: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            cmds.put(json.loads(line))
        cmds.put({"op": "eof"})

    threading.Thread(target=read, daemon=True).start()
    out("ready", {"pid": __import__("os").getpid()})
    step = 0

    def report(f) -> list:
        got = []
        for o in list(f.sending) + list(f.recving):
            got.append({"id": o.request_id, "result": pb.Outcome.Result.Name(o.result),
                        "kind": pb.FailureKind.Name(o.failure_kind), "reason": o.reason})
        for e in f.step_errors:
            print("error", json.dumps({"message": e.message}), flush=True)
        return got

    while True:
        for o in report(w.poll(wait=0.02)):
            out("outcome", o)
        try:
            c = cmds.get_nowait()
        except queue.Empty:
            continue
        now = time.time_ns()
        step += 1
        if c["op"] == "recv":
            meta = pb.StepMeta(step=step, scheduler_clock_unix_nanos=now, recv=[pb.RecvRequest(
                request_id=r["id"], transfer_id=r["tid"], local=[pb.Span(block_ids=r["blocks"])],
                deadline_unix_nanos=now + int(r["deadline_s"] * 1e9),
                remote=pb.RemoteRef(engine_id=r["engine"], addr=r["addr"], request_id=r["preq"], tp_size=r["tp_size"],
                                    tokens=r["tokens"], blocks=[pb.Span(block_ids=r["remote_blocks"])] if "remote_blocks" in r else [])
            ) for r in c["reqs"]])
            w.step(meta)
        elif c["op"] == "send":
            meta = pb.StepMeta(step=step, scheduler_clock_unix_nanos=now, send=[pb.SendRequest(
                request_id=r["id"], transfer_id=r["tid"], deadline_unix_nanos=now + int(r["deadline_s"] * 1e9),
                blocks=[pb.Span(block_ids=r["blocks"])], tokens=r["tokens"]) for r in c["reqs"]])
            w.step(meta)
        elif c["op"] == "check":
            src = pattern(rank, BLOCKS * blen)
            wrong = 0
            for d, p in c["pairs"]:
                wrong += int(np.count_nonzero(kv[d * blen:(d + 1) * blen] != src[p * blen:(p + 1) * blen]))
            out("check", {"wrong_bytes": wrong})
        elif c["op"] in ("bye", "eof"):
            f = w.bye(timeout=20)
            out("bye", {"outcomes": report(f), "error": None if w.error is None else str(w.error)})
            client.close()
            inprocess.stop()
            return 0


if __name__ == "__main__":
    sys.exit(main())
