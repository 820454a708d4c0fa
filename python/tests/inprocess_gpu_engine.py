"""One engine process with kvxfer in-process (libkvxfer), for
gpu_test_inprocess.py: a rank whose KV cache is GPU memory this process
allocated with torch (or, to check this script's logic on a machine
without a GPU, host memory), named by address (SharedMemory.in_process),
that produces (P) or receives (D) a series of transfers, pushed (P
WRITEs into D's blocks) or pulled (D READs P's).

Usage: python inprocess_gpu_engine.py SPEC_JSON
SPEC_JSON keys: role ("P" or "D"), secret (peer secret file), config (the
in-process server's configuration, kvxferd serve's flag names), memory
("device" or "host"), layers, blocks, block_len, transfers (a list of
[p_ids, d_ids]: transfer k moves P's blocks p_ids into D's d_ids, in every
layer), timeout (seconds for the whole run), result (a file for the JSON
result), mode ("push", the default, or "pull"), and peer_file: where P writes its Peer service address once its
sends are stepped, and D, started beside P, reads it (waiting up to
peer_wait seconds) before its first step. Optional: py_hop_trace, a file
for this process's own hop-trace lines (hoptrace.py): "py.step" as it
calls step for a request, "py.poll" as a poll returns a request's
outcome, stamped with time.monotonic_ns() (CLOCK_MONOTONIC, as the
in-process server's "hop_trace" lines); kept in memory and written at the
end, so the timed path does no I/O. Optional: beside ({"dir": a directory
both processes share, "threads": the UCX backend's num_threads}): NIXL's
own Python API (nixl_cu12) in these same two processes, on these same
caches, alternated with kvxfer's transfers (see Beside).

The caches: P's is one tensor, its layers views of it (one allocation, a
memory entry per layer); D's is one tensor per layer (an allocation and a
memory entry per layer). Every byte of both is a pattern of its position
(P's and D's differ). D checks every byte of its cache after each
transfer: the blocks moved equal P's, all others are what they were.
Exit status 0 when the run went through (wrong bytes are reported in the
result, not by the status); the result has "error" when it did not.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

import kvxfer
from kvxfer import inprocess
from kvxfer.v1 import kvxfer_pb2 as pb

BLOCK, ELEM = 16, 2  # tokens per block, bytes per element
SEED = {"P": 1, "D": 2}


def pattern(layer: int, layer_bytes: int, seed: int, device: str) -> torch.Tensor:
    """Layer layer's bytes of the cache of seed: each a hash of its
    position in the whole cache, so a block in the wrong place (layer or
    block) or from the wrong side is caught."""
    i = torch.arange(layer * layer_bytes, (layer + 1) * layer_bytes, dtype=torch.int64, device=device)
    return ((i * 2654435761 + (i >> 10) + seed * 7919) % 251 + 1).to(torch.uint8)


def heads_of(block_len: int) -> tuple[int, int]:
    """total_kv_heads and head_size of a packed HND block of block_len
    bytes (K and V, BLOCK tokens, ELEM bytes)."""
    per = block_len // (2 * BLOCK * ELEM)
    if per * 2 * BLOCK * ELEM != block_len or per == 0:
        raise ValueError(f"block_len {block_len} is not a multiple of {2 * BLOCK * ELEM}")
    heads = max(1, per // 128)
    while per % heads:
        heads -= 1
    return heads, per // heads


def put_file(path: str, text: str) -> None:
    """Writes path whole: a reader polling for it sees all of it or none."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class Beside:
    """NIXL's own Python API (nixl_cu12) in this very process, on this
    process's own cache, alternated with kvxfer's transfers, so that both
    are timed in the same processes, on the same memory, milliseconds
    apart: the ratio issue 24's in-process goal is read from. Each agent
    registers its whole cache (VRAM, or DRAM with host memory) and
    publishes its metadata and its layers' addresses ("P.nixl", "D.nixl" in
    the shared directory). Once D has checked kvxfer's transfer k it marks
    transfer k's blocks, and NIXL moves them again, timed from
    initialize_xfer to check_xfer_state saying DONE (as NIXL's own
    benchmarks and gpubench's python contender time it): push, P WRITEs
    them (D asks with a file "go-k", P answers "done-k" with the seconds);
    pull, D READs them itself. D then checks every byte of those blocks
    again. The UCX backend gets num_threads and READs over cuda_ipc
    (nixl.GPUEngineConfig) as kvxfer's own VRAM agents do, but not their
    split_batch_size: this is NIXL as vLLM configures it, the issue's
    yardstick (gpubench's python-split gives NIXL the split too)."""

    def __init__(self, run: "Run", spec: dict):
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.run, self.dir = run, spec["dir"]
        self.mem = "DRAM" if run.device == "cpu" else "VRAM"
        self.agent = nixl_agent(f"beside-{run.role}-{os.getpid()}-{time.time_ns()}", nixl_agent_config(backends=[]))
        params = {"num_threads": str(spec.get("threads", 4))}
        if run.device == "cpu":
            params["ucx_error_handling_mode"] = "none"  # host memory over shared memory transports
        elif "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ:
            params["engine_config"] = "CUDA_IPC_ENABLE_GET_ZCOPY=y"
        self.agent.create_backend("UCX", params)
        self.agent.register_memory(run.kv if run.role == "D" else [run.whole])
        self.peer = None
        self.next = 0  # P: the next transfer to answer
        # Tests of D's check: NIXL is asked, moves not a byte, and says done.
        self.idle = bool(spec.get("move_nothing"))
        self._put(f"{run.role}.nixl", json.dumps({"meta": self.agent.get_agent_metadata().hex(),
                                                  "bases": [t.data_ptr() for t in run.kv]}))

    def _put(self, name: str, text: str) -> None:
        put_file(os.path.join(self.dir, name), text)

    def _get(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.dir, name)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _connect(self) -> None:
        """The other side's agent and its layers' addresses."""
        if self.peer is None:
            other = json.loads(self._get("D.nixl" if self.run.role == "P" else "P.nixl"))
            self.peer = self.agent.add_remote_agent(bytes.fromhex(other["meta"]))
            self.bases = other["bases"]

    def serve(self) -> None:
        """P (push): answers every "go-k" there is now, in order."""
        while (self._get(f"go-{self.next}")) is not None:
            k = self.next
            try:
                self._put(f"done-{k}", json.dumps({"seconds": self.move(k)}))
            except Exception as e:  # noqa: BLE001 - D reports it
                self._put(f"done-{k}", json.dumps({"error": f"{type(e).__name__}: {e}"}))
            self.next += 1

    def move(self, k: int) -> float:
        """Transfer k by NIXL from this side: P WRITEs, D READs; the
        seconds from initialize_xfer to DONE."""
        import numpy as np

        run = self.run
        self._connect()
        p_ids, d_ids = run.spec["transfers"][k]
        mine, theirs = (p_ids, d_ids) if run.role == "P" else (d_ids, p_ids)
        dev = 0 if run.device == "cpu" else torch.cuda.current_device()
        n, bl = len(p_ids) * run.layers, run.block_len
        local, remote = np.empty((n, 3), dtype=np.uint64), np.empty((n, 3), dtype=np.uint64)
        local[:, 1] = remote[:, 1] = bl
        local[:, 2] = remote[:, 2] = dev
        for i in range(run.layers):
            rows = slice(i * len(p_ids), (i + 1) * len(p_ids))
            local[rows, 0] = run.kv[i].data_ptr() + np.asarray(mine, dtype=np.uint64) * bl
            remote[rows, 0] = self.bases[i] + np.asarray(theirs, dtype=np.uint64) * bl
        local, remote = self.agent.get_xfer_descs(local, self.mem), self.agent.get_xfer_descs(remote, self.mem)
        if self.idle:
            return 1.0
        op = "WRITE" if run.role == "P" else "READ"
        t0 = time.perf_counter()
        h = self.agent.initialize_xfer(op, local, remote, self.peer, b"")
        state = self.agent.transfer(h)
        while state == "PROC" and time.perf_counter() - t0 < 30:
            state = self.agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL's {op} of transfer {k} ended {state}")
        return dt

    def ask(self, k: int) -> dict:
        """D: transfer k by NIXL (push: P's WRITE, asked for and waited
        on; pull: D's own READ)."""
        if self.run.mode == pb.MODE_PULL:
            return {"seconds": self.move(k)}
        self._put(f"go-{k}", "")
        while (got := self._get(f"done-{k}")) is None:
            if self.run.left() <= 0:
                raise TimeoutError(f"D: P did not answer NIXL's transfer {k} within the run's time")
            time.sleep(0.002)
        return json.loads(got)


class Run:
    def __init__(self, spec: dict):
        self.spec = spec
        self.role = spec["role"]
        self.layers, self.blocks, self.block_len = spec["layers"], spec["blocks"], spec["block_len"]
        self.layer_bytes = self.blocks * self.block_len
        self.device = "cuda:0" if spec["memory"] == "device" else "cpu"
        self.deadline = time.monotonic() + spec["timeout"]
        self.mode = {"push": pb.MODE_PUSH, "pull": pb.MODE_PULL}[spec.get("mode", "push")]
        self.res: dict = {"role": self.role, "pid": os.getpid()}
        # Hop-trace lines (py_hop_trace), written at the end.
        self.hops: list[dict] | None = [] if spec.get("py_hop_trace") else None
        self.beside: Beside | None = None

    def hop(self, t: int, ev: str, side: str, **ids: str) -> None:
        if self.hops is not None:
            self.hops.append({"t": t, "ev": ev, "side": side, "engine": self.role, **ids, "pid": os.getpid()})

    def write_hops(self) -> None:
        if self.hops is not None:
            with open(self.spec["py_hop_trace"], "a") as f:
                f.writelines(json.dumps(h) + "\n" for h in self.hops)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()

    def alloc(self) -> None:
        """This process's KV cache, filled with its pattern, and its
        memory entries (one per layer) named by address."""
        n, lb = self.layers, self.layer_bytes
        if self.role == "P":
            self.whole = torch.empty(n * lb, dtype=torch.uint8, device=self.device)
            self.kv = [self.whole[i * lb:(i + 1) * lb] for i in range(n)]
        else:
            # Every layer allocated before anything else, so that each is
            # an allocation of its own (no temporary's cached segment).
            self.kv = [torch.empty(lb, dtype=torch.uint8, device=self.device) for _ in range(n)]
        for i, t in enumerate(self.kv):
            t.copy_(pattern(i, lb, SEED[self.role], self.device))
        self.sync()  # the pattern is written before any transfer reads it
        if self.device == "cpu":
            self.memory = [inprocess.host_memory(t.data_ptr(), lb) for t in self.kv]
        else:
            from kvxfer import cuda as kcuda
            uuid = kcuda.export_tensor(self.kv[0]).device_uuid
            self.res["device_uuid"] = uuid
            self.memory = [pb.SharedMemory(base=t.data_ptr(), size=lb, device=0, device_uuid=uuid,
                                           in_process=pb.IN_PROCESS_MEMORY_DEVICE) for t in self.kv]
            self.res["allocations"] = len({kcuda.export_tensor(t).base for t in self.kv})

    def connect(self) -> None:
        self.endpoint = inprocess.start(self.spec["config"])
        self.client = kvxfer.Client(self.endpoint)
        heads, head_size = heads_of(self.block_len)
        dev = 0
        layout = pb.KvLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=heads, head_size=head_size,
                             elem_bytes=ELEM, order=pb.KV_LAYOUT_ORDER_HND, packing=pb.KV_PACKING_PACKED,
                             logical_block_size=BLOCK, kernel_block_size=BLOCK,
                             regions=[pb.Region(kind=pb.CACHE_KIND_FULL_ATTENTION, base=t.data_ptr(), block_len=self.block_len,
                                                num_blocks=self.blocks, device_id=dev) for t in self.kv])
        t0 = time.monotonic()
        self.w = self.client.connect(pb.WorkerHello(engine_id=self.role, mode=self.mode, layout=layout, compat_hash="h",
                                                    memory=self.memory), ready_timeout=min(60.0, self.left()))
        self.res["attach_s"] = round(time.monotonic() - t0, 3)

    def wait_outcomes(self, want: set[str]) -> dict[str, tuple[str, str]]:
        """Polls until every request of want has an outcome (or the run's
        deadline), failing on a step error."""
        got: dict[str, tuple[str, str]] = {}
        while not want <= got.keys():
            if self.left() <= 0:
                raise TimeoutError(f"{self.role}: no outcome for {sorted(want - got.keys())} within the run's "
                                   f"{self.spec['timeout']} s (outcomes so far: {got})")
            if self.beside is not None and self.role == "P" and self.mode == pb.MODE_PUSH:
                self.beside.serve()
            f = self.w.poll(wait=min(0.05 if self.beside is None else 0.01, self.left()))
            t = time.monotonic_ns()
            for o in f.recving:
                self.hop(t, "py.poll", "D", d_req=o.request_id)
            for o in f.sending:
                self.hop(t, "py.poll", "P", p_req=o.request_id)
            if f.step_errors:
                raise RuntimeError(f"{self.role}: step errors: {[e.message for e in f.step_errors]}")
            for o in list(f.sending) + list(f.recving):
                got[o.request_id] = (pb.Outcome.Result.Name(o.result), o.reason)
        return got

    def produce(self) -> None:
        """P: every transfer's send stepped at once (each waits for D's
        request), then the Peer address published, then every outcome."""
        now = time.time_ns()
        sends = [pb.SendRequest(request_id=f"p-{k}", transfer_id=f"t-{k}", deadline_unix_nanos=now + int(max(5.0, self.left() - 5) * 1e9),
                                blocks=[pb.Span(block_ids=p_ids)], tokens=BLOCK * len(p_ids))
                 for k, (p_ids, _) in enumerate(self.spec["transfers"])]
        self.w.step(pb.StepMeta(step=1, scheduler_clock_unix_nanos=now, send=sends))
        c = kvxfer.Client(self.endpoint)
        try:
            peer = c.scheduler("P").open(pb.SchedulerConfig(mode=self.mode, tp_size=1, logical_block_size=BLOCK))
        finally:
            c.close()
        put_file(self.spec["peer_file"], peer)
        got = self.wait_outcomes({s.request_id for s in sends})
        self.res["outcomes"] = [[k, *got[k]] for k in sorted(got)]
        if self.beside is not None:
            # D moves the last transfers by NIXL after their kvxfer
            # outcomes, from or into this process's memory: kept (push:
            # the WRITEs served) until D says it is through.
            while self.beside._get("end") is None:
                if self.left() <= 0:
                    raise TimeoutError("P: D did not finish NIXL's transfers within the run's time")
                if self.mode == pb.MODE_PUSH:
                    self.beside.serve()
                time.sleep(0.002)
            self.res["beside_kept_until_d_ended"] = True

    def await_peer(self) -> str:
        """P's Peer address, once P has published it."""
        path = self.spec["peer_file"]
        by = time.monotonic() + min(self.left(), self.spec.get("peer_wait", 60))
        t0 = time.monotonic()
        while not os.path.exists(path):
            if time.monotonic() > by:
                raise TimeoutError(f"D: P published no Peer address ({path}) within {time.monotonic() - t0:.0f} s")
            time.sleep(0.02)
        self.res["peer_wait_s"] = round(time.monotonic() - t0, 3)
        with open(path) as f:
            return f.read().strip()

    def consume(self) -> None:
        """D: each transfer in turn, timed from its step to its outcome,
        then every byte of the cache checked (and with beside, the same
        transfer by NIXL's own API)."""
        try:
            self._consume()
        finally:
            if self.beside is not None:
                self.beside._put("end", "")

    def _consume(self) -> None:
        want = [t.clone() for t in self.kv]  # what D's cache must hold
        p_peer = self.await_peer()
        src = None
        records = []
        for k, (p_ids, d_ids) in enumerate(self.spec["transfers"]):
            now = time.time_ns()
            meta = pb.StepMeta(step=k + 1, scheduler_clock_unix_nanos=now, recv=[pb.RecvRequest(
                request_id=f"d-{k}", transfer_id=f"t-{k}", local=[pb.Span(block_ids=d_ids)],
                deadline_unix_nanos=now + int(self.left() * 1e9),
                remote=pb.RemoteRef(engine_id="P", addr=p_peer, request_id=f"p-{k}", tp_size=1,
                                    tokens=BLOCK * len(p_ids),
                                    blocks=[pb.Span(block_ids=p_ids)] if self.mode == pb.MODE_PULL else []))])
            self.hop(time.monotonic_ns(), "py.step", "D", d_req=f"d-{k}", p_req=f"p-{k}", tid=f"t-{k}")
            t0 = time.perf_counter()
            self.w.step(meta)
            got = self.wait_outcomes({f"d-{k}"})
            dt = time.perf_counter() - t0
            rec = {"transfer": k, "blocks": len(d_ids), "bytes": self.layers * len(d_ids) * self.block_len,
                   "seconds": dt, "outcome": list(got[f"d-{k}"])}
            # What D must hold now, then every byte of it.
            self.sync()
            pi = torch.tensor(p_ids, dtype=torch.int64, device=self.device)
            di = torch.tensor(d_ids, dtype=torch.int64, device=self.device)
            wrong, first = 0, None
            for i in range(self.layers):
                src = pattern(i, self.layer_bytes, SEED["P"], self.device).view(self.blocks, self.block_len)
                if rec["outcome"][0] == "RESULT_DONE":
                    want[i].view(self.blocks, self.block_len)[di] = src[pi]
                bad = torch.nonzero(self.kv[i] != want[i])
                if bad.numel():
                    wrong += bad.numel()
                    if first is None:
                        off = int(bad[0, 0])
                        first = {"layer": i, "block": off // self.block_len, "offset": off % self.block_len,
                                 "got": int(self.kv[i][off]), "want": int(want[i][off])}
            rec["wrong_bytes"], rec["first_wrong"] = wrong, first
            rec["checked_bytes"] = self.layers * self.layer_bytes
            records.append(rec)
            self.res["transfers"] = records
            if rec["outcome"][0] != "RESULT_DONE":
                break  # P's remaining sends time out; the test reports this one
            if self.beside is not None:
                rec["nixl"] = self.nixl_beside(k, d_ids, want)

    def nixl_beside(self, k: int, d_ids: list[int], want: list) -> dict:
        """D: transfer k again, by NIXL's own Python API (Beside: P's WRITE
        or D's READ) into its blocks marked first; every byte of them
        checked after."""
        di = torch.tensor(d_ids, dtype=torch.int64, device=self.device)
        for t in self.kv:
            t.view(self.blocks, self.block_len)[di] = 0xEE
        self.sync()
        got = self.beside.ask(k)
        if "error" in got:
            raise RuntimeError(f"NIXL beside, transfer {k}: {got['error']}")
        self.sync()
        wrong = sum(int((self.kv[i].view(self.blocks, self.block_len)[di] != want[i].view(self.blocks, self.block_len)[di]).sum())
                    for i in range(self.layers))
        if wrong:
            raise RuntimeError(f"NIXL beside, transfer {k}: {wrong} bytes of D's blocks wrong after NIXL's own WRITE")
        return {"seconds": got["seconds"], "checked_bytes": self.layers * len(d_ids) * self.block_len}

    def run(self) -> int:
        self.alloc()
        if self.spec.get("beside"):
            self.beside = Beside(self, self.spec["beside"])
        self.connect()
        if self.role == "P":
            self.produce()
        else:
            self.consume()
        t0 = time.monotonic()
        self.w.bye(timeout=max(1.0, min(20.0, self.left())))
        self.client.close()
        inprocess.stop()
        self.res["bye_stop_s"] = round(time.monotonic() - t0, 3)
        return 0


def main() -> int:
    spec = json.loads(sys.argv[1])
    r = Run(spec)
    code = 0
    try:
        code = r.run()
    except BaseException as e:  # noqa: BLE001 - reported in the result
        r.res["error"] = f"{type(e).__name__}: {e}"
        r.res["traceback"] = traceback.format_exc()
        code = 1
    r.write_hops()
    put_file(spec["result"], json.dumps(r.res))
    print("result", json.dumps({k: v for k, v in r.res.items() if k != "traceback"}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
