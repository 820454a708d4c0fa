"""gpubench's python contender: NIXL's own Python API (nixl_cu12) moving
KV pieces between two processes, each on a torch tensor it allocated
itself (CUDA, registered as VRAM; --device cpu: host memory, for tests).

The shape is gpubench's: LAYERS x BLOCKS pieces of PIECE bytes, one per
layer-block, from scattered source blocks into scattered destination
blocks (a pool of 2 x BLOCKS blocks per layer on each side, fixed-seed
random permutations). This process is the source; a spawned process is
the destination, reached over a multiprocessing pipe. A timed transfer
runs from initialize_xfer (NIXL prepares both descriptor lists and the
request) through transfer to check_xfer_state saying DONE, like kvxfer's
Post and State. The UCX backend is created with num_threads (vLLM sets
4). After the timed transfers the destination checks every byte of its
destination pieces against the pattern it recomputes.

With --modes push (or write,push) it also times, per case, the push
round trip a disaggregated engine pays through this API, which is what
kvxfer's whole path does (its in-process check times D's step to D's
outcome): the destination sends the source a notification (the
registration), the source waits for it, posts the same WRITE with a
notification of its own, and the destination waits for that one; timed at
the destination, from its send to the notification's arrival. Both agents
poll without sleeping.

Prints one line per case and mode, "gpubench-py " + JSON: {"Mode",
"Piece", "Blocks", "Layers", "GBps": [...]} or with "Error"; or one
{"Skip": reason} when it cannot run here (no torch, no nixl_cu12, no GPU).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

PREFIX = "gpubench-py "
MARKER = 0xEE


def emit(**kw):
    print(PREFIX + json.dumps(kw), flush=True)


def shape(piece, blocks, layers):
    """The pool size and, for every piece in order, its row (layer-block
    index, in pieces) on the source and on the destination."""
    import numpy as np

    pool = 2 * blocks
    rng = np.random.default_rng([piece, blocks, layers])
    src_ids, dst_ids = rng.permutation(pool)[:blocks], rng.permutation(pool)[:blocks]
    base = (np.arange(layers, dtype=np.int64) * pool)[:, None]
    return pool, (base + src_ids[None, :]).reshape(-1), (base + dst_ids[None, :]).reshape(-1)


def source_pattern(nbytes, seed, device):
    """A case's source bytes: every 8-byte word a hash of its index and the
    seed, computed where the tensor lives (both sides compute the same)."""
    import torch

    w = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    w = (w + seed) * 0x5851F42D4C957F2D
    w = w ^ (w >> 29)
    w = w * 0x2545F4914F6CDD1D
    return w.view(torch.uint8)


def seed_of(piece, blocks, layers):
    return (piece * 1_000_003 + blocks * 131 + layers) & 0xFFFFFFFF


def make_agent(role, threads, device, engine_config="", split=0):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    a = nixl_agent(f"gpubench-py-{role}-{os.getpid()}-{time.time_ns()}", nixl_agent_config(backends=[]))
    params = {"num_threads": str(threads)} if threads > 0 else {}
    if split > 0:
        params["split_batch_size"] = str(split)  # as kvxfer's VRAM agents get it
    if engine_config:
        params["engine_config"] = engine_config  # UCX settings, as kvxfer's agents get them
    if device == "cpu":
        params["ucx_error_handling_mode"] = "none"  # host memory over shared memory transports
    a.create_backend("UCX", params)
    return a


def sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def push_rounds(agent, peer, reps, deadline_s=30.0):
    """The destination's side of the push round trips: for each rep, a
    registration notification to the source, then a wait for the source's
    WRITE notification; returns the seconds of each."""
    out = []
    for rep in range(reps):
        want = f"done {rep}".encode()
        t0 = time.perf_counter()
        agent.send_notif(peer, f"reg {rep}".encode())
        while not any(want in msgs for msgs in agent.get_new_notifs().values()):
            if time.perf_counter() - t0 > deadline_s:
                raise RuntimeError(f"no WRITE notification for round {rep} within {deadline_s} s")
        out.append(time.perf_counter() - t0)
    return out


def destination(conn, span, threads, device, engine_config, split=0):
    """The destination process: its own tensor, its agent; marks, checks and
    push round trips on request."""
    try:
        import torch

        buf = torch.empty(span, dtype=torch.uint8, device=device)
        agent = make_agent("d", threads, device, engine_config, split)
        agent.register_memory(buf)
        conn.send(("hello", agent.get_agent_metadata(), buf.data_ptr()))
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    peer = None
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "exit":
                conn.send(("ok",))
                return
            if msg[0] == "peer":
                peer = agent.add_remote_agent(msg[1])
                conn.send(("ok",))
            elif msg[0] == "push":
                conn.send(("ok", push_rounds(agent, peer, msg[1])))
            elif msg[0] == "mark":
                buf[: msg[1]].fill_(MARKER)
                sync(device)
                conn.send(("ok",))
            elif msg[0] == "verify":
                bad = misplaced(buf, *msg[1:], device)
                conn.send(("error", bad) if bad else ("ok",))
            elif msg[0] == "fill":
                # The source pattern here: the remote side of a READ.
                piece, blocks, layers = msg[1:]
                pool, _, _ = shape(piece, blocks, layers)
                n = layers * pool * piece
                buf[:n].copy_(source_pattern(n, seed_of(piece, blocks, layers), device))
                sync(device)
                conn.send(("ok",))
            else:
                conn.send(("error", f"unknown request {msg[0]!r}"))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))


def misplaced(buf, piece, blocks, layers, device):
    """Why buf does not hold a case's pieces where they belong, or None."""
    import torch

    pool, src_rows, dst_rows = shape(piece, blocks, layers)
    n = layers * pool * piece
    want = source_pattern(n, seed_of(piece, blocks, layers), device).view(-1, piece)
    got = buf[:n].view(-1, piece)
    si, di = torch.as_tensor(src_rows, device=device), torch.as_tensor(dst_rows, device=device)
    bad = (got[di] != want[si]).any(dim=1).nonzero()
    if bad.numel():
        i = int(bad[0])
        return f"piece {i} of {len(dst_rows)} (destination row {int(dst_rows[i])}) differs"
    return None


def ask(conn, *msg):
    conn.send(msg)
    r = conn.recv()
    if r[0] != "ok":
        raise RuntimeError(f"destination: {r[1]}")
    return r


def write_once(agent, local, remote, peer, notif=b"", op="WRITE"):
    """One timed WRITE (or READ): prepared, posted and polled until DONE."""
    t0 = time.perf_counter()
    h = agent.initialize_xfer(op, local, remote, peer, notif)
    state = agent.transfer(h)
    deadline = t0 + 30
    while state == "PROC" and time.perf_counter() < deadline:
        state = agent.check_xfer_state(h)
    dt = time.perf_counter() - t0
    agent.release_xfer_handle(h)
    if state != "DONE":
        raise RuntimeError(f"transfer state {state}")
    return dt


def push_source(conn, agent, local, remote, peer, reps):
    """The source's side of the push round trips (push_rounds): it answers
    each registration with the WRITE and its notification; returns the
    destination's timings."""
    conn.send(("push", reps))
    for rep in range(reps):
        want, t0 = f"reg {rep}".encode(), time.perf_counter()
        while not any(want in msgs for msgs in agent.get_new_notifs().values()):
            if time.perf_counter() - t0 > 30:
                raise RuntimeError(f"no registration for round {rep} within 30 s")
        write_once(agent, local, remote, peer, f"done {rep}".encode())
    r = conn.recv()
    if r[0] != "ok":
        raise RuntimeError(f"destination: {r[1]}")
    return r[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pieces", default="65536,4096")
    ap.add_argument("--blocks", default="8,64,256")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--modes", default="write", help="comma-separated: write (post to completion), push (the round trip), "
                    "read (a READ of the destination's copy of the source, post to completion)")
    ap.add_argument("--engine-config", default="", help="the UCX plugin's engine_config (UCX settings, KEY=VALUE,...)")
    ap.add_argument("--split", type=int, default=0, help="the UCX plugin's split_batch_size (0: NIXL's default)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or any(m not in ("write", "push", "read") for m in modes):
        ap.error(f"--modes {args.modes!r}: want some of write, push and read")
    pieces = [int(x) for x in args.pieces.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    try:
        import numpy as np
        import torch
        import nixl_cu12._api  # noqa: F401
    except Exception as e:  # noqa: BLE001
        emit(Skip=f"cannot import torch, numpy and nixl_cu12 in {sys.executable}: {type(e).__name__}: {e}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        emit(Skip="torch sees no GPU")
        return 0
    dev = args.device
    mem = "VRAM" if dev == "cuda" else "DRAM"
    dev_id = torch.cuda.current_device() if dev == "cuda" else 0
    span = max(args.layers * 2 * b * p for p in pieces for b in blocks)

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=destination, args=(child_conn, span, args.threads, dev, args.engine_config, args.split), daemon=True)
    proc.start()
    try:
        hello = conn.recv()
        if hello[0] != "hello":
            emit(Skip=f"the destination process: {hello[1]}")
            return 0
        _, meta, dst_base = hello
        src = torch.empty(span, dtype=torch.uint8, device=dev)
        agent = make_agent("p", args.threads, dev, args.engine_config, args.split)
        agent.register_memory(src)
        peer = agent.add_remote_agent(meta)
        if "push" in modes:
            ask(conn, "peer", agent.get_agent_metadata())
        src_base = src.data_ptr()
        for piece in pieces:
            for nb in blocks:
                case = dict(Piece=piece, Blocks=nb, Layers=args.layers)
                for mode in modes:
                    try:
                        pool, src_rows, dst_rows = shape(piece, nb, args.layers)
                        n = args.layers * pool * piece
                        src[:n].copy_(source_pattern(n, seed_of(piece, nb, args.layers), dev))
                        sync(dev)
                        ask(conn, "mark", n)
                        col = lambda base, rows: np.stack(  # noqa: E731
                            [base + rows * piece, np.full(len(rows), piece), np.full(len(rows), dev_id)], axis=1).astype(np.uint64)
                        local = agent.get_xfer_descs(col(src_base, src_rows), mem)
                        remote = agent.get_xfer_descs(col(dst_base, dst_rows), mem)
                        total = len(src_rows) * piece
                        if mode == "write":
                            times = [write_once(agent, local, remote, peer) for _ in range(args.warmup + args.reps)]
                        elif mode == "push":
                            times = push_source(conn, agent, local, remote, peer, args.warmup + args.reps)
                        else:
                            # Pull: the destination holds the source
                            # pattern, this side READs it into its own
                            # (marked) tensor and checks there.
                            ask(conn, "fill", piece, nb, args.layers)
                            src[:n].fill_(MARKER)
                            sync(dev)
                            mine = agent.get_xfer_descs(col(src_base, dst_rows), mem)
                            theirs = agent.get_xfer_descs(col(dst_base, src_rows), mem)
                            times = [write_once(agent, mine, theirs, peer, op="READ") for _ in range(args.warmup + args.reps)]
                            bad = misplaced(src, piece, nb, args.layers, dev)
                            if bad:
                                raise RuntimeError(bad)
                        if mode != "read":
                            ask(conn, "verify", piece, nb, args.layers)
                        emit(Mode=mode, **case, GBps=[total / dt / 1e9 for dt in times[args.warmup:]])
                    except Exception as e:  # noqa: BLE001
                        traceback.print_exc()
                        emit(Mode=mode, **case, Error=f"{type(e).__name__}: {e}")
    finally:
        try:
            ask(conn, "exit")
        except Exception:  # noqa: BLE001
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
