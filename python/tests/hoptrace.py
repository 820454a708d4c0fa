"""Times each hop of kvxfer transfers from hop traces: the JSON lines
kvxferd -hop-trace (libkvxfer: "hop_trace") writes in each process
(internal/hoptrace), plus the engines' own lines in the same form
(inprocess_gpu_engine.py: "py.step" when it calls step, "py.poll" when a
poll returned the outcome). Every line is stamped with CLOCK_MONOTONIC
(Python's time.monotonic_ns()), so the lines of P's and D's processes on
one host merge into one timeline per transfer.

Usage: python hoptrace.py [--skip N] [--name NAME] [--each] FILE...

prints, per hop, how many transfers passed it and the median, min and max
microseconds it took, over the transfers (the first N skipped: the first
pays the handshake); --each adds every transfer's own microseconds, per
hop. The events of one transfer are those that share an id with it (D's
request id, P's, the transfer id), on either side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# The hops, in path order: (label, from, to), each end (side, event); a
# "to" of "call" times the backend call of the from event (its call_ns),
# one of "xfer" the transfer as the backend measured it (xfer_ns: NIXL's
# telemetry). Push, then pull; hops no transfer passed are left out.
HOPS = [
    ("D: python step -> Worker.Step", ("D", "py.step"), ("D", "recv.step")),
    ("D: Worker.Step -> loop took the step", ("D", "recv.step"), ("D", "recv.loop")),
    ("D: loop took the step -> registration sent", ("D", "recv.loop"), ("D", "reg.sent")),
    ("D: registration Notify call", ("D", "reg.sent"), "call"),
    ("D registration sent -> P drained it", ("D", "reg.sent"), ("P", "reg.recv")),
    ("P: registration drained -> WRITE posted", ("P", "reg.recv"), ("P", "write.post")),
    ("P: WRITE Post call", ("P", "write.post"), "call"),
    ("P: WRITE posted -> P saw it done", ("P", "write.post"), ("P", "write.done")),
    ("P: WRITE as the backend timed it (NIXL telemetry)", ("P", "write.done"), "xfer"),
    ("P WRITE posted -> D drained its notice", ("P", "write.post"), ("D", "done.recv")),
    ("P: bare completion notice Notify call", ("P", "done.sent"), "call"),
    ("P bare notice sent -> D drained it", ("P", "done.sent"), ("D", "done.recv")),
    ("D: notice drained -> outcome published", ("D", "done.recv"), ("D", "outcome")),
    # pull
    ("D: loop took the step -> READ posted", ("D", "recv.loop"), ("D", "read.post")),
    ("D: READ Post call", ("D", "read.post"), "call"),
    ("D: READ posted -> D saw it done", ("D", "read.post"), ("D", "read.done")),
    ("D: READ as the backend timed it (NIXL telemetry)", ("D", "read.done"), "xfer"),
    ("D READ posted -> P drained its notice", ("D", "read.post"), ("P", "done.recv")),
    ("D: READ seen done -> outcome published", ("D", "read.done"), ("D", "outcome")),
    # both
    ("D: outcome published -> stream sender woke", ("D", "outcome"), ("D", "outcome.sent")),
    ("D: stream sender: drain, encode, Send", ("D", "outcome.sent"), "call"),
    ("D: stream sender woke -> python poll returned", ("D", "outcome.sent"), ("D", "py.poll")),
    ("P: WRITE seen done -> outcome published", ("P", "write.done"), ("P", "outcome")),
    ("total D: python step -> python poll returned", ("D", "py.step"), ("D", "py.poll")),
    ("total D: Worker.Step -> outcome published", ("D", "recv.step"), ("D", "outcome")),
]

ID_FIELDS = ("tid", "d_req", "p_req")


def load(paths) -> tuple[list[dict], int, int]:
    """Every event line of the files, the events their traces dropped
    (trace.end lines), and the lines that are no event (a process killed
    mid-write leaves one torn)."""
    events, dropped, bad = [], 0, 0
    for p in paths:
        with open(p) as f:
            for ln in f:
                ln = ln.strip()
                if not ln:
                    continue
                try:
                    e = json.loads(ln)
                except ValueError:
                    bad += 1
                    continue
                if not isinstance(e, dict) or not isinstance(e.get("t"), int) or not isinstance(e.get("ev"), str):
                    bad += 1
                    continue
                if e.get("ev") == "trace.end":
                    dropped += int(e.get("dropped", 0))
                if not e["ev"].startswith("trace."):
                    events.append(e)
    return events, dropped, bad


def transfers(events: list[dict]) -> list[list[dict]]:
    """The events grouped by transfer (events that share an id, directly
    or through others), each group in time order, the groups by their
    first event."""
    parent: dict = {}

    def find(k):
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    keyed = []
    for e in events:
        keys = [(f, e[f]) for f in ID_FIELDS if e.get(f)]
        if not keys:
            continue
        for k in keys[1:]:
            parent[find(k)] = find(keys[0])
        keyed.append((keys[0], e))
    groups: dict = defaultdict(list)
    for k, e in keyed:
        groups[find(k)].append(e)
    out = [sorted(g, key=lambda e: e["t"]) for g in groups.values()]
    return sorted(out, key=lambda g: g[0]["t"])


def hop_times(group: list[dict]) -> dict[str, float]:
    """Microseconds of each hop one transfer passed: from the first event
    of its from end to the first of its to end at or after it."""
    at: dict = defaultdict(list)
    for e in group:
        at[(e.get("side", ""), e["ev"])].append(e)
    out = {}
    for label, a, b in HOPS:
        if not at.get(a):
            continue
        first = at[a][0]
        if b in ("call", "xfer"):
            if f"{b}_ns" in first:
                out[label] = first[f"{b}_ns"] / 1e3
            continue
        later = [e for e in at.get(b, []) if e["t"] >= first["t"]]
        if later:
            out[label] = (later[0]["t"] - first["t"]) / 1e3
    return out


def table(paths, skip: int = 0, name: str = "-", prefix: str = "hops") -> list[str]:
    """The hop table of the traces in paths, as lines ("PREFIX | NAME |
    hop | n | median us | min us | max us |", a header first), over the
    transfers after the first skip."""
    events, dropped, bad = load(paths)
    groups = transfers(events)
    timed = groups[skip:]
    per: dict = defaultdict(list)
    for g in timed:
        for label, us in hop_times(g).items():
            per[label].append(us)
    head = f"{prefix} | {name} |"
    lines = [f"{head} {len(timed)} transfers timed ({min(skip, len(groups))} skipped), {len(paths)} files, "
             f"{dropped} events dropped{f', {bad} lines unreadable' if bad else ''} | n | median us | min us | max us |"]
    for label, _, _ in HOPS:
        v = per.get(label)
        if v:
            lines.append(f"{head} {label} | {len(v)} | {statistics.median(v):.1f} | {min(v):.1f} | {max(v):.1f} |")
    return lines


def each(paths, skip: int = 0) -> list[str]:
    """Every transfer's microseconds per hop (after the first skip): a line
    per hop, a column per transfer (named by its D request id)."""
    events, _, _ = load(paths)
    timed = transfers(events)[skip:]
    times = [hop_times(g) for g in timed]
    names = [next((e["d_req"] for e in g if e.get("d_req")), "?") for g in timed]
    lines = ["hop | " + " | ".join(names) + " |"]
    for label, _, _ in HOPS:
        if any(label in t for t in times):
            lines.append(f"{label} | " + " | ".join(f"{t[label]:.1f}" if label in t else "-" for t in times) + " |")
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip", type=int, default=0, help="transfers to leave out first (the first pays the handshake)")
    ap.add_argument("--name", default="-", help="a name for the table's lines")
    ap.add_argument("--each", action="store_true", help="also every transfer's own microseconds, per hop")
    ap.add_argument("files", nargs="+", type=Path)
    a = ap.parse_args(argv)
    print("\n".join(table(a.files, a.skip, a.name)))
    if a.each:
        print("\n".join(each(a.files, a.skip)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
