"""The fault soak of the in-process placement (libkvxfer): a P and a D engine,
each rank a process of its own that runs its own server in-process on its
rank's peer port (inprocess_soak_rank.py), transferring salted KV bytes
(push or pull, over the built-in backend or NIXL) while faults are injected
at random: a rank process, or every rank of an engine, SIGKILLed (server
and engine die together) and started again on the same ports (a new
generation), a rank process, or a whole engine, frozen (SIGSTOP) for 0.5
to 3 s. It accounts for every request on every rank and exits non-zero on
a violation:

  - a rank reports a request more than once, or one it was never given;
  - a rank that lives does not end a request within --bound of its issue
    (45 s: a request's deadline, 20 s, plus a producer's fence, 2 x the
    6 s lease, and slack; a request of a rank process that was killed ends
    with it);
  - a consumer rank does not end a request within the liveness bound
    (--live, 9 s: the peer timeout, 2 s, probed, plus a freeze and slack)
    of the death of the producer rank it waits on;
  - a consumer rank reports a request done with a wrong byte (each request
    salted: stale bytes of an earlier request count);
  - a surviving rank still holds a request at its bye, or does not exit
    cleanly; a block stays held by a request that ended.

Usage (from python/tests, under the vLLM venv's Python):
  python inprocess_soak.py --duration 120 [--mode pull] [--backend nixl] [--tp 1|2]
[--lib libkvxfer.so: else built from this checkout] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RANK = str(HERE / "inprocess_soak_rank.py")
BLOCKS = 64  # rankproc.BLOCKS
TOKENS = 32  # two blocks of 16
PEER_TIMEOUT, LEASE, DEADLINE = 2.0, 6.0, 20.0
SERVER = {"peer_timeout": f"{PEER_TIMEOUT}s", "lease": f"{LEASE}s"}
NIXL_LIBS = "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/.nixl_cu12.mesonpy.libs"


class Rank:
    """One incarnation of one rank process: its stdout lines, timestamped
    as they arrive."""

    def __init__(self, soak: "Soak", side: "Side", r: int, epoch: int):
        self.side, self.r, self.epoch = side, r, epoch
        self.name = f"{side.name}{r}.{epoch}"
        cfg = {"engine": side.name, "role": side.name, "tp_rank": r, "tp_size": soak.tp, "base": side.base,
               "secret": soak.secret, "mode": soak.mode, "server": soak.server}
        self.log = soak.work / f"{self.name}.log"
        with open(self.log, "w") as err:
            self.p = subprocess.Popen([sys.executable, RANK, json.dumps(cfg)], env=soak.env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = False
        self.eof = False
        self.bye: dict | None = None
        self.foreign = 0  # lines on stdout not the soak's
        self.killed = False  # the soak SIGKILLed it
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if not line.endswith("\n"):
                # Its last write, cut short by its death (a SIGKILL
                # between two writes of one line): whatever it was, the
                # process did not get to say it.
                self.lines.put((time.monotonic(), "cut", line))
                break
            mark, _, line = line.strip().partition(" ")
            if mark != "soak:":
                self.foreign += 1  # not the soak's (UCX logs on stdout)
                continue
            kind, _, rest = line.partition(" ")
            try:
                v = json.loads(rest) if rest else None
            except ValueError:
                kind, v = "garbage", line
            self.lines.put((time.monotonic(), kind, v))
        self.lines.put((time.monotonic(), "eof", None))

    def cmd(self, **c) -> None:
        try:
            self.p.stdin.write(json.dumps(c) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: the soak finds out from its eof

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text()[-n:]
        except OSError:
            return ""


class Side:
    def __init__(self, name: str, base: int):
        self.name, self.base = name, base
        self.ranks: list[Rank] = []
        self.free = list(range(BLOCKS))


class Req:
    def __init__(self, n: int, p_ids: list[int], d_ids: list[int], issued: float, p_epochs: list[int], d_epochs: list[int]):
        self.n, self.p_ids, self.d_ids, self.issued = n, p_ids, d_ids, issued
        self.epochs = {"P": p_epochs, "D": d_epochs}
        self.ended: dict[tuple[str, int], tuple[str, float]] = {}  # (side, rank): (how, when)
        self.stepped: dict[tuple[str, int], float] = {}  # (side, rank): when its server took the request
        self.live: dict[int, float] = {}  # D rank: when it must end by (its producer rank died)
        self.late = False


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.tp, self.mode = a.tp, a.mode
        self.work = Path(tempfile.mkdtemp(prefix="kvxfer-inprocsoak-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self.secret = str(self.work / "peer.secret")
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        self.events = open(self.work / "events.txt", "w")  # what happened when, for a violation's post-mortem
        self.server = dict(SERVER)
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), self.env.get("PYTHONPATH", "")])
        if a.backend == "nixl":
            self.server["backend"] = "nixl"
            if not self.env.get("NIXL_CAPI_LIB"):
                self.env.update(NIXL_CAPI_LIB=f"{NIXL_LIBS}/libnixl_capi.so", NIXL_PLUGIN_DIR=f"{NIXL_LIBS}/plugins")
            self.env.setdefault("UCX_MEMTYPE_CACHE", "n")
        self.env["KVXFER_LIBKVXFER"] = str(a.lib or self.build())
        self.P, self.D = Side("P", free_ports(self.tp)), Side("D", free_ports(self.tp))
        self.reqs: dict[int, Req] = {}
        self.next = 0
        self.faults: Counter = Counter()
        self.results: Counter = Counter()
        self.violations: list[str] = []
        self.frozen: dict[Rank, float] = {}  # rank: when it thaws
        self.longest_start = 0.0
        self.held: list = []  # pull: (request, D's part) until P's ranks hold its bytes
        self.later: list = []  # (when, request, (side, op, its command)): the second side's part of a request

    def build(self) -> Path:
        lib = self.work / "libkvxfer.so"
        subprocess.run(["go", "build", "-buildmode=c-shared", "-o", str(lib), "./cmd/libkvxfer"], cwd=REPO, check=True)
        return lib

    def violate(self, msg: str) -> None:
        self.violations.append(msg)
        self.event("VIOLATION: " + msg)
        print("VIOLATION:", msg, file=sys.stderr, flush=True)

    def event(self, what: str) -> None:
        self.events.write(f"{time.monotonic():.3f} {what}\n")

    # Ranks.

    def start(self, side: Side, r: int) -> None:
        epoch = side.ranks[r].epoch + 1 if r < len(side.ranks) else 0
        rk = Rank(self, side, r, epoch)
        if r < len(side.ranks):
            side.ranks[r] = rk
        else:
            side.ranks.append(rk)
        t0 = time.monotonic()
        while not rk.ready:
            if time.monotonic() - t0 > 90:
                raise RuntimeError(f"{rk.name}: not ready within 90 s; stderr:\n{rk.stderr_tail()}")
            self.take(rk, wait=0.05)
            self.thaw(time.monotonic())
            if rk.eof:
                raise RuntimeError(f"{rk.name}: exited ({rk.p.wait()}) before it was ready; stderr:\n{rk.stderr_tail()}")
        self.longest_start = max(self.longest_start, time.monotonic() - t0)
        self.event(f"started {rk.name} (pid {rk.p.pid})")

    def take(self, rk: Rank, wait: float = 0.0) -> None:
        """Takes in what rk said so far (waiting up to wait for a first line)."""
        while True:
            try:
                t, kind, v = rk.lines.get(timeout=wait) if wait > 0 else rk.lines.get_nowait()
            except queue.Empty:
                return
            wait = 0.0
            if kind == "ready":
                rk.ready = True
            elif kind == "outcome":
                self.outcome(rk, t, v)
            elif kind == "error":
                self.violate(f"{rk.name}: step error {v}")
            elif kind == "stepped":
                for i in v["ids"]:
                    q = self.reqs.get(int(i.partition("-")[2]))
                    if q is not None:
                        q.stepped[(rk.side.name, rk.r)] = t
            elif kind == "bye":
                rk.bye = v
            elif kind == "cut":
                if rk.killed:
                    self.event(f"{rk.name}: its last line cut by its kill: {v!r}")
                else:
                    self.violate(f"{rk.name}: a line cut short: {v!r}")
            elif kind == "eof":
                rk.eof = True
                return
            else:
                self.violate(f"{rk.name}: unexpected line {kind} {v}")

    def kill(self, side: Side, r: int) -> None:
        """SIGKILLs rank r of side (its server dies with it), ends what it
        held, and starts it again on its port."""
        rk = side.ranks[r]
        rk.killed = True
        rk.p.send_signal(signal.SIGKILL)
        rk.p.wait(timeout=30)
        self.frozen.pop(rk, None)
        t_kill = time.monotonic()
        self.event(f"killed {rk.name}")
        while not rk.eof:  # what it said before it died counts
            self.take(rk, wait=1.0)
        self.drain()
        for q in self.reqs.values():
            if (side.name, r) not in q.ended and q.epochs[side.name][r] == rk.epoch:
                self.end(q, side.name, r, "lost-with-process", t_kill)
            stepped = q.stepped.get(("D", r))
            if (side is self.P and ("D", r) not in q.ended and q.epochs["P"][r] == rk.epoch and r not in q.live
                    and stepped is not None and stepped < t_kill):
                # D's rank r took the request, and waits on this rank
                # (TP equal: rank r feeds rank r), while it lived.
                q.live[r] = t_kill + self.a.live
        self.start(side, r)

    def freeze(self, rk: Rank, secs: float) -> None:
        if rk in self.frozen:
            return
        rk.p.send_signal(signal.SIGSTOP)
        self.event(f"froze {rk.name} for {secs:.1f}s")
        self.frozen[rk] = time.monotonic() + secs

    def thaw(self, now: float, every: bool = False) -> None:
        for rk, t in list(self.frozen.items()):
            if every or now >= t:
                rk.p.send_signal(signal.SIGCONT)
                self.event(f"thawed {rk.name}")
                del self.frozen[rk]

    # Requests.

    def issue(self) -> None:
        if len(self.P.free) < 2 or len(self.D.free) < 2:
            return
        pi, di = self.rng.sample(range(len(self.P.free)), 2), self.rng.sample(range(len(self.D.free)), 2)
        p_ids, d_ids = [self.P.free[i] for i in pi], [self.D.free[i] for i in di]
        for b in p_ids:
            self.P.free.remove(b)
        for b in d_ids:
            self.D.free.remove(b)
        self.next += 1
        n = self.next
        self.reqs[n] = Req(n, p_ids, d_ids, time.monotonic(), [rk.epoch for rk in self.P.ranks], [rk.epoch for rk in self.D.ranks])
        send = {"id": f"p-{n}", "tid": f"t-{n}", "blocks": p_ids, "tokens": TOKENS, "deadline_s": DEADLINE, "salt": n}
        recv = {"id": f"d-{n}", "tid": f"t-{n}", "blocks": d_ids, "engine": "P", "addr": f"127.0.0.1:{self.P.base}",
                "preq": f"p-{n}", "tp_size": self.tp, "tokens": TOKENS, "deadline_s": DEADLINE, "salt": n}
        self.event(f"issued {n}")
        if self.mode == "pull":
            recv["remote_blocks"] = p_ids
            first, then = ("P", "send", send), ("D", "recv", recv)
        else:
            first, then = ("D", "recv", recv), ("P", "send", send)
        # The second side follows after a while (push: P's prefill; pull:
        # D's turn to read), so that faults find requests in flight. In
        # pull, D is given the request only once P's ranks hold its bytes
        # (stepped it, after writing them), as a real engine's params leave
        # P only after its forward pass: over NIXL nothing refuses a READ
        # before that (per-request grants are the built-in backend's).
        self.give(self.reqs[n], *first)
        if self.mode == "pull":
            self.held.append((self.reqs[n], then))
        else:
            self.later.append((time.monotonic() + self.rng.uniform(0, self.a.lag), self.reqs[n], then))

    def give(self, q: Req, side: str, op: str, req: dict) -> None:
        """Hands request q to the ranks of side it was issued to (one that
        died since lost it with the process)."""
        for rk in (self.P if side == "P" else self.D).ranks:
            if rk.epoch == q.epochs[side][rk.r]:
                rk.cmd(op=op, reqs=[req])

    def stale(self, q: Req) -> bool:
        """Pull: whether a P rank process that held q died since (its params,
        which carry no generation here, name blocks the restarted rank may
        hold for another request: a consumer reads such params, which carry
        no generation, only once the producer says it holds the request
        (the pre-READ hold check), and a real engine's carry
        remote_generation, which this soak's do not; they are handed to D
        only with --stale-params)."""
        return self.mode == "pull" and not self.a.stale_params and \
            any(q.epochs["P"][i] != self.P.ranks[i].epoch for i in range(self.tp))

    def not_given(self, q: Req, now: float) -> None:
        self.event(f"not given to D: {q.n} (its producer rank died)")
        for i in range(self.tp):
            if ("D", i) not in q.ended:
                self.end(q, "D", i, "not-given", now)

    def due(self, now: float, every: bool = False) -> None:
        held = []
        for q, what in self.held:
            if self.stale(q):
                self.not_given(q, now)
            elif every or all(("P", i) in q.stepped or ("P", i) in q.ended for i in range(self.tp)):
                self.later.append((now + (0 if every else self.rng.uniform(0, self.a.lag)), q, what))
            else:
                held.append((q, what))
        self.held = held
        keep = []
        for t, q, what in self.later:
            if what[0] == "D" and self.stale(q):
                self.not_given(q, now)
            elif every or now >= t:
                self.give(q, *what)
            else:
                keep.append((t, q, what))
        self.later = keep

    def outcome(self, rk: Rank, t: float, v: dict) -> None:
        side, _, num = v["id"].partition("-")
        q = self.reqs.get(int(num)) if num.isdigit() else None
        if q is None or side.upper() != rk.side.name:
            self.violate(f"{rk.name}: outcome for a request it was never given: {v}")
            return
        if q.epochs[rk.side.name][rk.r] != rk.epoch:
            self.violate(f"{rk.name}: outcome for request {q.n} given to its incarnation {q.epochs[rk.side.name][rk.r]}: {v}")
            return
        if v["result"] == "RESULT_DONE" and v.get("wrong_bytes"):
            self.violate(f"{rk.name}: request {q.n} done with {v['wrong_bytes']} wrong bytes")
        if v["result"] == "RESULT_DONE" and rk.side is self.D and "wrong_bytes" not in v:
            self.violate(f"{rk.name}: request {q.n} done but not checked: {v}")
        self.event(f"{rk.name} {v}")
        how = v["result"].removeprefix("RESULT_").lower()
        if how != "done":
            how += " " + v["kind"].removeprefix("FAILURE_KIND_").lower()
        self.end(q, rk.side.name, rk.r, how, t, v)

    def end(self, q: Req, side: str, r: int, how: str, t: float, v: dict | None = None) -> None:
        key = (side, r)
        if key in q.ended:
            self.violate(f"{side}{r}: request {q.n} ended twice ({how} {v} after {q.ended[key][0]})")
            return
        q.ended[key] = (how, t)
        self.results[f"{side} {how}"] += 1
        if t - q.issued > self.a.bound and how != "lost-with-process":
            self.violate(f"{side}{r}: request {q.n} ended {t - q.issued:.1f}s after its issue (bound {self.a.bound}s): {how} {v}")
        if side == "D" and r in q.live and t > q.live[r] and how != "lost-with-process":
            self.violate(f"D{r}: request {q.n} ended {t - q.live[r] + self.a.live:.1f}s after its producer rank died "
                         f"(liveness bound {self.a.live}s): {how} {v}")
        for s, sd in (("P", self.P), ("D", self.D)):
            if s == side and all((s, i) in q.ended for i in range(self.tp)):
                sd.free += q.p_ids if s == "P" else q.d_ids

    def check(self, now: float) -> None:
        for q in self.reqs.values():
            if q.late:
                continue
            open_ = [k for k in [("P", i) for i in range(self.tp)] + [("D", i) for i in range(self.tp)] if k not in q.ended]
            if open_ and now - q.issued > self.a.bound:
                self.violate(f"request {q.n} not ended {self.a.bound}s after its issue on {open_}")
                q.late = True
            late = [i for i in q.live if ("D", i) not in q.ended and now > q.live[i]]
            if late:
                self.violate(f"request {q.n} not ended on D ranks {late} {self.a.live}s after its producer rank died")
                q.late = True

    def open(self) -> int:
        return sum(1 for q in self.reqs.values() if len(q.ended) < 2 * self.tp)

    def drain(self) -> None:
        for rk in self.P.ranks + self.D.ranks:
            self.take(rk)

    # Faults.

    def fault(self) -> None:
        k = self.rng.randrange(9)
        side = self.P if k % 2 == 0 else self.D
        r = self.rng.randrange(self.tp)
        secs = 0.5 + 2.5 * self.rng.random()
        if k in (0, 1):
            self.faults[f"kill {side.name} rank"] += 1
            self.kill(side, r)
        elif k in (2, 3):
            self.faults[f"kill {side.name} engine"] += 1
            for i in range(self.tp):
                self.kill(side, i)
        elif k in (4, 5):
            self.faults[f"freeze {side.name} rank"] += 1
            self.freeze(side.ranks[r], secs)
        elif k in (6, 7):
            self.faults[f"freeze {side.name} engine"] += 1
            for rk in side.ranks:
                self.freeze(rk, secs)
        else:
            self.faults["none"] += 1

    def run(self) -> int:
        a = self.a
        try:
            for side in (self.P, self.D):
                for r in range(self.tp):
                    self.start(side, r)
            print(f"in-process soak: seed {a.seed}, {a.backend} {self.mode}, TP {self.tp}, {a.duration}s of faults "
                  f"every ~{a.fault_every}s, bound {a.bound}s, liveness {a.live}s, work dir {self.work}", flush=True)
            t0 = time.monotonic()
            next_fault = t0 + self.rng.uniform(0, 2 * a.fault_every)
            next_issue = t0
            while time.monotonic() - t0 < a.duration:
                now = time.monotonic()
                if now >= next_issue:
                    self.issue()
                    next_issue = now + a.issue_every
                self.drain()
                now = time.monotonic()
                self.due(now)
                self.thaw(now)
                if now >= next_fault:
                    self.fault()
                    self.drain()
                    next_fault = time.monotonic() + self.rng.uniform(0, 2 * a.fault_every)
                self.check(time.monotonic())
                time.sleep(0.01)
            self.thaw(0, every=True)
            deadline = time.monotonic() + a.bound + 10
            while self.open() and time.monotonic() < deadline:
                self.drain()
                self.due(time.monotonic())
                self.check(time.monotonic())
                time.sleep(0.05)
            for q in self.reqs.values():
                if len(q.ended) < 2 * self.tp:
                    self.violate(f"request {q.n} never ended: ended {sorted(q.ended)}")
            if len(self.P.free) != BLOCKS or len(self.D.free) != BLOCKS:
                self.violate(f"blocks held after every request ended: P {len(self.P.free)} of {BLOCKS} free, "
                             f"D {len(self.D.free)} of {BLOCKS}")
            self.byes()
            print(f"in-process soak: {self.next} requests in {time.monotonic() - t0:.0f}s")
        finally:
            for rk in self.P.ranks + self.D.ranks:
                if rk.p.poll() is None:
                    rk.p.send_signal(signal.SIGCONT)
                    rk.p.kill()
                    rk.p.wait()
        print("faults:")
        for k in sorted(self.faults):
            print(f"  {k:20} {self.faults[k]}")
        print("endings (per rank):")
        for k in sorted(self.results):
            print(f"  {k:40} {self.results[k]}")
        print(f"longest rank start: {self.longest_start:.1f}s")
        print(f"violations: {len(self.violations)}")
        self.events.close()
        if self.violations:
            print(f"logs kept in {self.work}")
            return 1
        shutil.rmtree(self.work, ignore_errors=True)
        return 0

    def byes(self) -> None:
        """Every surviving rank ends its stream: it must hold no request
        (its bye reports none) and exit 0."""
        ranks = self.P.ranks + self.D.ranks
        for rk in ranks:
            rk.bye = None
            rk.cmd(op="bye")
        end = time.monotonic() + 40
        for rk in ranks:
            while rk.bye is None and not rk.eof and time.monotonic() < end:
                self.take(rk, wait=0.2)
            if rk.bye is None:
                self.violate(f"{rk.name}: no bye within 40 s; stderr:\n{rk.stderr_tail()}")
                continue
            if rk.bye["outcomes"] or rk.bye["error"]:
                self.violate(f"{rk.name}: held requests at its bye: {rk.bye}")
            try:
                rc = rk.p.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.violate(f"{rk.name}: did not exit after its bye")
                continue
            if rc != 0:
                self.violate(f"{rk.name}: exited {rc} after its bye; stderr:\n{rk.stderr_tail()}")


def free_ports(n: int) -> int:
    """The first of n consecutive TCP ports free on loopback now."""
    for _ in range(200):
        base = random.randrange(20000, 30000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60, help="seconds of faults")
    ap.add_argument("--fault-every", type=float, default=4, help="mean seconds between faults")
    ap.add_argument("--issue-every", type=float, default=0.03, help="seconds between requests (while blocks are free)")
    ap.add_argument("--lag", type=float, default=1.5,
                    help="the most seconds between a request's first side and its second (push: P's prefill)")
    ap.add_argument("--bound", type=float, default=45, help="seconds a request may take to end on every live rank")
    ap.add_argument("--live", type=float, default=PEER_TIMEOUT * 1.7 + 3 + 3,
                    help="seconds a consumer rank may take to end a request after its producer rank died")
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    ap.add_argument("--mode", choices=["push", "pull"], default="push")
    ap.add_argument("--backend", choices=["builtin", "nixl"], default="builtin")
    ap.add_argument("--tp", type=int, choices=[1, 2], default=2)
    ap.add_argument("--stale-params", action="store_true",
                    help="pull: hand D the params of a request whose producer rank died since (they carry no generation: "
                         "D reads them only once the producer says it holds the request: the restarted one does not, and they fail)")
    ap.add_argument("--lib", type=Path, help="libkvxfer.so (else built from this checkout, or $KVXFER_LIBKVXFER)")
    a = ap.parse_args(argv)
    if a.lib is None and os.environ.get("KVXFER_LIBKVXFER"):
        a.lib = Path(os.environ["KVXFER_LIBKVXFER"])
    return Soak(a).run()


if __name__ == "__main__":
    sys.exit(main())
