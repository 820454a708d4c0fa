"""Round trips between a Python engine and its own process's in-process
kvxfer server, direct (libkvxfer's kvxfer_stream_* and kvxfer_call) and
over gRPC (Client(..., direct=False)), alternated: a rank stream's step
answered at once by a StepError (a RecvRequest with no remote), and a
SchedulerService call (MatchedTokens). Prints the median and the 10th and
90th percentiles in microseconds.

    KVXFER_LIBKVXFER=libkvxfer.so PYTHONPATH=python python bench/inprocess/roundtrip.py
"""

import statistics
import time

import numpy as np

import kvxfer
from kvxfer import inprocess
from kvxfer.v1 import kvxfer_pb2 as pb

N = 300


def summary(ts):
    s = sorted(ts)
    return f"median {statistics.median(s):.0f} p10 {s[len(s) // 10]:.0f} p90 {s[len(s) * 9 // 10]:.0f}"


def main():
    ep = inprocess.start({"insecure_peers": True, "log_level": "error"})
    kv = np.zeros(64 * 1024, dtype=np.uint8)
    layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2, head_size=8, elem_bytes=2,
                         order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED, logical_block_size=16, kernel_block_size=16,
                         regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=kv.ctypes.data, block_len=1024, num_blocks=64)])
    for rnd in range(2):
        for direct in (None, False):
            name = "direct" if direct is None else "grpc"
            c = kvxfer.Client(ep, direct=direct)
            w = c.connect(pb.WorkerHello(engine_id=f"E-{name}-{rnd}", mode=pb.MODE_PUSH, layout=layout, compat_hash="h",
                                         memory=[inprocess.host_memory(kv.ctypes.data, kv.nbytes)]))
            steps = []
            for i in range(N):
                t0 = time.perf_counter()
                w.step(pb.StepMeta(step=i + 1, recv=[pb.RecvRequest(request_id=f"r{i}")]))
                while not w.poll(1.0).step_errors:
                    pass
                steps.append((time.perf_counter() - t0) * 1e6)
            w.cancel()
            s = c.scheduler(f"S-{name}-{rnd}")
            addr = s.open(pb.SchedulerConfig(mode=pb.MODE_PUSH, tp_size=1, logical_block_size=16))
            req = pb.EngineRequest(request_id="d-1", prompt_tokens=40, params=pb.TransferParams(
                transfer_id="t1", do_remote_prefill=True, remote_engine_id="P", remote_addr=addr, remote_tp_size=1))
            calls = []
            for _ in range(N):
                t0 = time.perf_counter()
                s.matched_tokens(req, 0)
                calls.append((time.perf_counter() - t0) * 1e6)
            c.close()
            print(f"{name:6} step -> its StepError: {summary(steps)} us; MatchedTokens call: {summary(calls)} us", flush=True)
    inprocess.stop()


if __name__ == "__main__":
    main()
