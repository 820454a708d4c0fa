"""The reference's way of posting one request through prepared lists,
timed, for bench/nixlprep (which drives this over stdin and stdout).

Written from the behaviour SPEC.md section 3 describes (vLLM's NIXL
connector, not its code): one local and one remote prepared descriptor
list, region-major (region r, block b at index r*NB + b); per request,
the block ids become descriptor ids with numpy (region ids broadcast
against block ids, flattened), then make_prepped_xfer and transfer.

Protocol: one JSON line in (layers, block_len, num_blocks, src_ids,
dst_ids), "ready" out; then per "run N" line, N timed posts and one JSON
line out: per post, seconds for ids, make_prepped_xfer and transfer.
Each transfer completes and is released outside the timings.
"""
import json
import os
import sys
import time
import uuid

# The protocol keeps the original stdout; everything else (NIXL's and
# UCX's logs) goes to stderr.
proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import numpy as np  # noqa: E402
from nixl_cu12._api import nixl_agent, nixl_agent_config  # noqa: E402


def main():
    cfg = json.loads(sys.stdin.readline())
    layers, block_len, nb = cfg["layers"], cfg["block_len"], cfg["num_blocks"]
    src_ids, dst_ids = cfg["src_ids"], cfg["dst_ids"]
    conf = nixl_agent_config(backends=["UCX"])
    a = nixl_agent("vllm-way-a-" + uuid.uuid4().hex, conf)
    b = nixl_agent("vllm-way-b-" + uuid.uuid4().hex, conf)
    region = block_len * nb
    mem_a = np.zeros(layers * region, dtype=np.uint8)
    mem_b = np.zeros(layers * region, dtype=np.uint8)
    base_a, base_b = mem_a.ctypes.data, mem_b.ctypes.data
    # One registration per layer, as the connector registers each cache.
    for agent, base in ((a, base_a), (b, base_b)):
        regs = [(base + r * region, region, 0, "") for r in range(layers)]
        agent.register_memory(agent.get_reg_descs(regs, "DRAM"))
    peer = a.add_remote_agent(b.get_agent_metadata())

    def dlist(base):
        return [(base + r * region + k * block_len, block_len, 0) for r in range(layers) for k in range(nb)]

    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs(dlist(base_a), "DRAM"))
    remote = a.prep_xfer_dlist(peer, a.get_xfer_descs(dlist(base_b), "DRAM"))
    regions = np.arange(layers, dtype=np.int64)
    notif = b"done:0123456789abcdef"
    print("ready", file=proto, flush=True)

    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "run":
            break
        out = []
        for _ in range(int(cmd[1])):
            t0 = time.perf_counter()
            # _compute_desc_ids: region * NB + block, region-major.
            lb = np.asarray(src_ids, dtype=np.int64)
            rb = np.asarray(dst_ids, dtype=np.int64)
            local_ids = (regions[:, None] * nb + lb[None, :]).flatten()
            remote_ids = (regions[:, None] * nb + rb[None, :]).flatten()
            t1 = time.perf_counter()
            h = a.make_prepped_xfer("WRITE", local, local_ids, remote, remote_ids, notif)
            t2 = time.perf_counter()
            st = a.transfer(h)
            t3 = time.perf_counter()
            if st == "ERR":
                raise RuntimeError("transfer failed")
            while True:
                st = a.check_xfer_state(h)
                if st == "DONE":
                    break
                if st == "ERR":
                    raise RuntimeError("transfer failed")
            a.release_xfer_handle(h)
            out.append([t1 - t0, t2 - t1, t3 - t2])
        print(json.dumps(out), file=proto, flush=True)
    # Notifications pile up at b; nothing reads them.
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)


if __name__ == "__main__":
    main()
