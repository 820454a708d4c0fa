"""One worker rank process of a TP engine with kvxfer in-process (libkvxfer)
for the in-process fault soak (inprocess_soak.py); setup and stream in
rankproc.py.

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
import time

import numpy as np

import rankproc
from rankproc import BLOCKS, block_len
from kvxfer.v1 import kvxfer_pb2 as pb

MARK = "soak:"


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
    cfg = rankproc.config()
    rank, tp = cfg["tp_rank"], cfg["tp_size"]
    blen = block_len(tp)
    kv = np.zeros(BLOCKS * blen, dtype=np.uint8)
    client, w = rankproc.connect(cfg, kv)
    cmds = rankproc.commands()
    out("ready", {"pid": os.getpid()})
    step = 0
    expect: dict[str, tuple[list[int], int]] = {}  # a consumer's open requests: blocks, salt

    def report(f) -> list:
        got = []
        for o in list(f.sending) + list(f.recving):
            v = rankproc.outcome(o)
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
            w.step(rankproc.recv_step(step, now, c["reqs"]))
        elif c["op"] == "send":
            for r in c["reqs"]:
                for k, b in enumerate(r["blocks"]):
                    kv[b * blen:(b + 1) * blen] = salted(r["salt"], rank, k, blen)
            w.step(rankproc.send_step(step, now, c["reqs"]))
        if c["op"] in ("recv", "send"):
            out("stepped", {"ids": [r["id"] for r in c["reqs"]]})
        elif c["op"] in ("bye", "eof"):
            f, err = rankproc.close(client, w, timeout=30)
            out("bye", {"outcomes": report(f), "error": err})
            return 0


if __name__ == "__main__":
    sys.exit(main())
