"""One worker rank process of a TP engine with kvxfer in-process (libkvxfer)
for the in-process fault soak (inprocess_soak.py): its own server on its
rank's peer port (rank-port-base + tp_rank), one rank stream, a host KV
cache named by its address, steered by JSON lines on stdin.

Every request's bytes are salted: a producer rank writes request n's
pattern (salt n, its rank, the block's place in the request) into the
request's blocks just before it hands the request to its server, and a
consumer rank checks its blocks against that pattern the moment its
server reports the request done, before the soak can give the blocks to
another request. Stale bytes of an earlier request, bytes of another
rank, or a WRITE that landed after the blocks were let go, count.

Usage: python inprocess_soak_rank.py CONFIG_JSON
CONFIG_JSON: {"engine", "role" ("P" or "D"), "tp_rank", "tp_size", "base",
"secret", "mode" ("push" or "pull"), "server": {extra libkvxfer keys}}.

Commands (one JSON object a line on stdin):
  {"op": "send", "reqs": [{"id", "tid", "blocks", "tokens", "deadline_s", "salt"}]}
  {"op": "recv", "reqs": [{"id", "tid", "blocks", "engine", "addr", "preq", "tp_size", "tokens",
      "deadline_s", "salt", "remote_blocks" (pull: the producer's)}]}
  {"op": "bye"}: ends the stream -> "bye {outcomes, error}", then exits 0.
Out (stdout, one a line, each after "soak: "): "ready {pid}", "stepped {ids}" once a step with
them returned, "outcome {id, result, kind, reason,
wrong_bytes (a consumer's done request)}" as each arrives, "error {message}"
on a step error.
"""

from __future__ import annotations

import json
import os
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
MARK = "soak:"


def block_len(tp_size: int) -> int:
    return 2 * (HEADS // tp_size) * BLOCK * HEAD_SIZE * ELEM  # K and V, packed


def salted(salt: int, tp_rank: int, k: int, blen: int) -> np.ndarray:
    """The bytes of the k-th block of request salt on producer rank tp_rank."""
    i = np.arange(blen, dtype=np.uint64)
    return ((i * 2654435761 + salt * 7919 + k * 131 + tp_rank * 97) % 251 + 1).astype(np.uint8)


def out(kind: str, obj) -> None:
    # Marked: other lines on stdout are not the soak's (UCX logs there).
    # One write a line: print writes each argument on its own, and under
    # PYTHONUNBUFFERED (write-through) each is a write(2), so a SIGKILL
    # between them left the soak a line cut short ("soak:" alone).
    sys.stdout.write(f"{MARK} {kind} {json.dumps(obj)}\n")
    sys.stdout.flush()


def main() -> int:
    cfg = json.loads(sys.argv[1])
    role, rank, tp = cfg["role"], cfg["tp_rank"], cfg["tp_size"]
    server = {"peer_secret_file": cfg["secret"], "log_level": "warn", "rank_port_base": cfg["base"],
              "peer_listen": f"127.0.0.1:{cfg['base'] + rank}", **cfg.get("server", {})}
    endpoint = inprocess.start(server)
    blen = block_len(tp)
    kv = np.zeros(BLOCKS * blen, dtype=np.uint8)
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
    out("ready", {"pid": os.getpid()})
    step = 0
    expect: dict[str, tuple[list[int], int]] = {}  # a consumer's open requests: blocks, salt

    def report(f) -> list:
        got = []
        for o in list(f.sending) + list(f.recving):
            v = {"id": o.request_id, "result": pb.Outcome.Result.Name(o.result),
                 "kind": pb.FailureKind.Name(o.failure_kind), "reason": o.reason}
            if o.request_id in expect:
                ids, salt = expect.pop(o.request_id)
                if o.result == pb.Outcome.RESULT_DONE:
                    v["wrong_bytes"] = sum(int(np.count_nonzero(kv[d * blen:(d + 1) * blen] != salted(salt, rank, k, blen)))
                                           for k, d in enumerate(ids))
            got.append(v)
        for e in f.step_errors:
            out("error", {"message": e.message})
        return got

    while True:
        try:
            c = cmds.get_nowait()
        except queue.Empty:
            for o in report(w.poll(wait=0.05)):
                out("outcome", o)
            continue
        now = time.time_ns()
        step += 1
        if c["op"] == "recv":
            for r in c["reqs"]:
                expect[r["id"]] = (r["blocks"], r["salt"])
            w.step(pb.StepMeta(step=step, scheduler_clock_unix_nanos=now, recv=[pb.RecvRequest(
                request_id=r["id"], transfer_id=r["tid"], local=[pb.Span(block_ids=r["blocks"])],
                deadline_unix_nanos=now + int(r["deadline_s"] * 1e9),
                remote=pb.RemoteRef(engine_id=r["engine"], addr=r["addr"], request_id=r["preq"], tp_size=r["tp_size"],
                                    tokens=r["tokens"], blocks=[pb.Span(block_ids=r["remote_blocks"])] if "remote_blocks" in r else [])
            ) for r in c["reqs"]]))
        elif c["op"] == "send":
            for r in c["reqs"]:
                for k, b in enumerate(r["blocks"]):
                    kv[b * blen:(b + 1) * blen] = salted(r["salt"], rank, k, blen)
            w.step(pb.StepMeta(step=step, scheduler_clock_unix_nanos=now, send=[pb.SendRequest(
                request_id=r["id"], transfer_id=r["tid"], deadline_unix_nanos=now + int(r["deadline_s"] * 1e9),
                blocks=[pb.Span(block_ids=r["blocks"])], tokens=r["tokens"]) for r in c["reqs"]]))
        if c["op"] in ("recv", "send"):
            out("stepped", {"ids": [r["id"] for r in c["reqs"]]})
        elif c["op"] in ("bye", "eof"):
            f = w.bye(timeout=30)
            out("bye", {"outcomes": report(f), "error": None if w.error is None else str(w.error)})
            client.close()
            inprocess.stop()
            return 0


if __name__ == "__main__":
    sys.exit(main())
