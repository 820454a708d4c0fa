"""A vLLM engine in a process of its own, placement in-process (its
connectors start libkvxfer in this process at a given base peer port),
for test_vllm_inprocess.py: vLLM's real Scheduler and one worker-role
connector over a plain host tensor, driven step by step (harness.step).

Usage: python vllm_engine_proc.py WORK NAME ROLE MODE BASE STEP_S [SERVER_JSON]

It prints "ready HOST:PORT" (the engine's peer address, as its transfer
params carry it) once serving, then reads one JSON request per stdin line,
{"rid": ..., "tokens": [...], "max_tokens": n, "params": {...}}, and steps
its engine every STEP_S seconds, printing "finished RID" as requests
finish, "sent RID" / "recvd RID" / "failed RID" as the connector reports
them. It runs until killed or stdin closes (then it shuts down cleanly and
prints "bye").
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as H  # noqa: E402


def main() -> int:
    work, name, role, mode, base, step_s = sys.argv[1:7]
    server = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None
    srv = H.InProcess(Path(work), name, peer_port=int(base), server=server)
    # Chunked prefill (16 tokens a step): a long prompt takes many steps.
    e = H.make_engine(Path(work), name, role, srv, mode, 1, batched=16, registration_timeout_s=60)
    print("ready", srv.peer, flush=True)
    lines: queue.SimpleQueue = queue.SimpleQueue()

    def read():
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    prompts: dict[str, list[int]] = {}
    seen: dict[str, set] = {"finished": set(), "sent": set(), "recvd": set(), "failed": set()}
    while True:
        try:
            while True:
                line = lines.get_nowait()
                if line is None:
                    H.shutdown(e)
                    print("bye", flush=True)
                    return 0
                r = json.loads(line)
                prompts[r["rid"]] = r["tokens"]
                e.sched.add_request(H.make_request(r["rid"], list(r["tokens"]), r.get("max_tokens", 1), r.get("params")))
        except queue.Empty:
            pass
        H.step(e, prompts, fill=role == "P")
        for what, got in (("finished", set(e.finished)), ("sent", e.sent), ("recvd", e.recvd), ("failed", e.failed)):
            for rid in sorted(got - seen[what]):
                print(what, rid, flush=True)
            seen[what] |= got
        time.sleep(float(step_s))


if __name__ == "__main__":
    sys.exit(main())
