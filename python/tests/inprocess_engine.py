"""One engine process with kvxfer in-process (libkvxfer), for
test_inprocess.py: a rank whose KV cache is a host tensor named by its
address, that produces (P) or receives (D) one push transfer.

Usage: python inprocess_engine.py ROLE SECRET_FILE [P_PEER_ADDR]
It prints "peer ADDR" once its server serves, and at the end one JSON line
("result ...") with its outcome; D's says whether every byte of its cache
is what it must be. Nothing stops the server explicitly: the interpreter's
exit does (atexit).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch

import kvxfer
from kvxfer import inprocess
from kvxfer.v1 import kvxfer_pb2 as pb

HEADS, HEAD_SIZE, BLOCK, ELEM = 2, 8, 16, 2
BLOCK_LEN = 2 * HEADS * BLOCK * HEAD_SIZE * ELEM  # K and V, packed
BLOCKS = 32
P_IDS = [3, 4, 5, 9, 10, 20]
D_IDS = [7, 1, 2, 30, 0, 11]


def pattern() -> np.ndarray:
    """P's KV cache: every byte keyed by its position."""
    i = np.arange(BLOCKS * BLOCK_LEN, dtype=np.uint64)
    return ((i * 2654435761 + (i >> 10)) % 251 + 1).astype(np.uint8)


def main() -> int:
    role, secret = sys.argv[1], sys.argv[2]
    endpoint = inprocess.start({"peer_secret_file": secret, "log_level": "warn"})
    assert inprocess.start({"peer_secret_file": secret, "log_level": "warn"}) == endpoint  # idempotent
    # Python's own SIGINT handling still works with the Go runtime loaded.
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
        print("error SIGINT not delivered to Python", flush=True)
        return 1
    except KeyboardInterrupt:
        pass
    if role == "P":
        kv = torch.from_numpy(pattern().copy())  # a torch CPU tensor
        base, size = kv.data_ptr(), kv.numel()
    else:
        kv = np.zeros(BLOCKS * BLOCK_LEN, dtype=np.uint8)  # a numpy array
        base, size = kv.ctypes.data, kv.nbytes
    client = kvxfer.Client(endpoint)
    layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=HEADS, head_size=HEAD_SIZE,
                         elem_bytes=ELEM, order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED,
                         logical_block_size=BLOCK, kernel_block_size=BLOCK,
                         regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=base, block_len=BLOCK_LEN, num_blocks=BLOCKS)])
    w = client.connect(pb.WorkerHello(engine_id=role, mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                      memory=[inprocess.host_memory(base, size)]))
    now = time.time_ns()
    tokens = BLOCK * len(P_IDS)
    if role == "P":
        print("peer", _peer(endpoint), flush=True)
        meta = pb.StepMeta(step=1, scheduler_clock_unix_nanos=now, send=[pb.SendRequest(
            request_id="p-1", transfer_id="t-1", deadline_unix_nanos=now + 30 * 10**9,
            blocks=[pb.Span(block_ids=P_IDS)], tokens=tokens)])
    else:
        p_peer = sys.argv[3]
        meta = pb.StepMeta(step=1, scheduler_clock_unix_nanos=now, recv=[pb.RecvRequest(
            request_id="d-1", transfer_id="t-1", local=[pb.Span(block_ids=D_IDS)], deadline_unix_nanos=now + 30 * 10**9,
            remote=pb.RemoteRef(engine_id="P", addr=p_peer, request_id="p-1", tp_size=1, tokens=tokens))])
    w.step(meta)
    outcomes = []
    deadline = time.monotonic() + 30
    while not outcomes and time.monotonic() < deadline:
        f = w.poll(wait=0.5)
        outcomes += [(o.request_id, pb.Outcome.Result.Name(o.result), o.reason) for o in (f.sending + f.recving)]
        if f.step_errors:
            print("result", json.dumps({"error": [e.message for e in f.step_errors]}), flush=True)
            return 1
    res = {"outcomes": outcomes}
    if role == "D":
        want = np.zeros_like(kv)
        src = pattern()
        for p, d in zip(P_IDS, D_IDS):
            want[d * BLOCK_LEN:(d + 1) * BLOCK_LEN] = src[p * BLOCK_LEN:(p + 1) * BLOCK_LEN]
        bad = np.nonzero(kv != want)[0]
        res["bytes"] = int(kv.nbytes)
        res["wrong_bytes"] = int(bad.size)
        res["first_wrong"] = int(bad[0]) if bad.size else -1
    w.bye(timeout=20)
    client.close()
    print("result", json.dumps(res), flush=True)
    return 0


def _peer(endpoint: str) -> str:
    """This server's Peer service address, as its Scheduler service hands
    it out (OpenScheduler's answer)."""
    c = kvxfer.Client(endpoint)
    try:
        return c.scheduler("P").open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=BLOCK))
    finally:
        c.close()


if __name__ == "__main__":
    sys.exit(main())
