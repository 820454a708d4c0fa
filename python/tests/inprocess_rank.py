"""One worker rank process of a TP engine with kvxfer in-process (libkvxfer),
for test_inprocess_rankdeath.py (setup and stream in rankproc.py).

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
import os
import queue
import sys
import time

import numpy as np

import rankproc
from rankproc import BLOCKS, block_len


def pattern(tp_rank: int, size: int) -> np.ndarray:
    """A producer rank's KV cache: every byte keyed by its rank and position."""
    i = np.arange(size, dtype=np.uint64)
    return ((i * 2654435761 + (i >> 10) + tp_rank * 97) % 251 + 1).astype(np.uint8)


def out(kind: str, obj) -> None:
    print(kind, json.dumps(obj), flush=True)


def main() -> int:
    cfg = rankproc.config()
    role, rank, tp = cfg["role"], cfg["tp_rank"], cfg["tp_size"]
    blen = block_len(tp)
    kv = pattern(rank, BLOCKS * blen) if role == "P" else np.zeros(BLOCKS * blen, dtype=np.uint8)
    client, w = rankproc.connect(cfg, kv)
    cmds = rankproc.commands()
    out("ready", {"pid": os.getpid()})
    step = 0

    def report(f) -> list:
        got = [rankproc.outcome(o) for o in list(f.sending) + list(f.recving)]
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
            w.step(rankproc.recv_step(step, now, c["reqs"]))
        elif c["op"] == "send":
            w.step(rankproc.send_step(step, now, c["reqs"]))
        elif c["op"] == "check":
            src = pattern(rank, BLOCKS * blen)
            wrong = 0
            for d, p in c["pairs"]:
                wrong += int(np.count_nonzero(kv[d * blen:(d + 1) * blen] != src[p * blen:(p + 1) * blen]))
            out("check", {"wrong_bytes": wrong})
        elif c["op"] in ("bye", "eof"):
            f, err = rankproc.close(client, w, timeout=20)
            out("bye", {"outcomes": report(f), "error": err})
            return 0


if __name__ == "__main__":
    sys.exit(main())
