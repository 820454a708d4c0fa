"""The hop trace on CPU: the in-process engine pair of gpu_test_inprocess.py
(inprocess_gpu_engine.py) with host memory, 32 layers x 8 blocks x 64 KiB
pushed from P to D over the built-in backend and NIXL, both servers
tracing their hops ("hop_trace") and the engines their own; hoptrace.py
makes the table of every hop of the timed transfers. And hoptrace.py's
grouping and arithmetic on lines made up here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpu_test_inprocess as pair
import harness
import hoptrace

# The hops of a push over the in-process pair: each timed transfer passes
# every one.
PUSH_HOPS = [
    "D: python step -> Worker.Step",
    "D: Worker.Step -> loop took the step",
    "D: loop took the step -> registration sent",
    "D: registration Notify call",
    "D registration sent -> P drained it",
    "P: registration drained -> WRITE posted",
    "P: WRITE Post call",
    "P: WRITE posted -> P saw it done",
    "P WRITE posted -> D drained its notice",
    "D: notice drained -> outcome published",
    "D: outcome published -> stream sender woke",
    "D: stream sender: drain, encode, Send",
    "D: stream sender woke -> python poll returned",
    "P: WRITE seen done -> outcome published",
    "total D: python step -> python poll returned",
    "total D: Worker.Step -> outcome published",
]


# The hops of a pull: D READs, P hears the READ is done.
PULL_HOPS = [
    "D: python step -> Worker.Step",
    "D: Worker.Step -> loop took the step",
    "D: loop took the step -> READ posted",
    "D: READ Post call",
    "D: READ posted -> D saw it done",
    "D READ posted -> P drained its notice",
    "D: READ seen done -> outcome published",
    "D: outcome published -> stream sender woke",
    "D: stream sender: drain, encode, Send",
    "D: stream sender woke -> python poll returned",
    "total D: python step -> python poll returned",
    "total D: Worker.Step -> outcome published",
]


@pytest.fixture(scope="module")
def libkvxfer(tmp_path_factory) -> Path:
    return harness.build_libkvxfer(tmp_path_factory.mktemp("lib"))


def rows(lines: list[str]) -> dict[str, list[float]]:
    """The table's rows: hop -> [n, median, min, max]."""
    out = {}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.split("|")]
        out[cells[2]] = [float(c) for c in cells[3:7]]
    return out


@pytest.mark.parametrize("backend,mode", [("builtin", "push"), ("builtin", "pull"), ("nixl", "push"), ("nixl", "pull")])
def test_hop_table_of_the_inprocess_pair(libkvxfer, tmp_path, backend, mode, monkeypatch):
    pytest.importorskip("torch")
    config = pair.CASES[backend]
    if backend == "nixl":
        harness.need_nixl(pair.nixl_library() is not None)
    timed = 5
    xf = pair.transfers(8, check_blocks=6, timed=timed, seed=8)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))  # as test/gpu/run sets it
    work = tmp_path / "pair"
    pres, dres, logs = pair.run_pair(libkvxfer, work, config, memory="host", blocks=8, xfers=xf, hops=True, mode=mode)
    pair.check_pair(pres, dres, logs, len(xf))
    files = pair.hop_files(work)
    names = ["D.hops.jsonl", "D.py.hops.jsonl", "P.hops.jsonl", "P.py.hops.jsonl"]
    assert [f.name for f in files] == names, files
    lines = pair.report_hops(f"{backend} {mode} (CPU, host memory), 32x8x64KiB", work)
    assert (out / "inprocess-hops.txt").read_text().splitlines() == lines
    kept = out / "inprocess-hops" / f"{backend}_{mode}_CPU_host_memory_32x8x64KiB"
    assert sorted(f.name for f in kept.iterdir()) == names
    assert lines[0].startswith(f"in-process hops | {backend}") and f"{timed} transfers timed (1 skipped), 4 files, 0 events dropped" in lines[0], lines
    got = rows(lines)
    want = list(PUSH_HOPS if mode == "push" else PULL_HOPS)
    if backend == "nixl" and mode == "push":  # NIXL times its transfers itself (telemetry)
        want.insert(want.index("P: WRITE posted -> P saw it done") + 1, "P: WRITE as the backend timed it (NIXL telemetry)")
    if backend == "nixl" and mode == "pull":
        want.insert(want.index("D: READ posted -> D saw it done") + 1, "D: READ as the backend timed it (NIXL telemetry)")
    assert list(got) == want, "\n".join(lines)
    for hop, (n, med, lo, hi) in got.items():
        assert n == timed and 0 <= lo <= med <= hi, f"{hop}: n {n}, median {med}, min {lo}, max {hi}\n" + "\n".join(lines)
    # The parts of D's path add up to no more than its whole.
    path = sum(got[h][1] for h in want[:3])
    assert path < got["total D: python step -> python poll returned"][1], "\n".join(lines)


@pytest.mark.parametrize("mode,moves", [("push", True), ("pull", True), ("push", False), ("pull", False)])
def test_nixl_beside_the_inprocess_pair(libkvxfer, tmp_path, mode, moves, monkeypatch):
    """NIXL's own Python API alternated with kvxfer's transfers in the same
    two engine processes (host memory here), push (P's WRITE) and pull
    (D's READ): every timed transfer gets both rates, and D checks the
    bytes NIXL moved too, so a NIXL that moved nothing fails the run
    instead of posting a rate."""
    pytest.importorskip("torch")
    harness.need_nixl(pair.nixl_library() is not None)
    timed = 3
    xf = pair.transfers(8, check_blocks=6, timed=timed, seed=8)
    out = tmp_path / "out"
    out.mkdir()
    pres, dres, logs = pair.run_pair(libkvxfer, tmp_path / "pair", pair.CASES["nixl"], memory="host", blocks=8, xfers=xf,
                                     mode=mode, beside=4, beside_moves_nothing=not moves)
    if not moves:
        assert "error" in dres and "wrong after NIXL's own WRITE" in dres["error"], dres
        return
    recs = pair.check_pair(pres, dres, logs, len(xf))
    for r in recs:
        assert r["nixl"]["checked_bytes"] == r["bytes"] and r["nixl"]["seconds"] > 0, r
    # P kept its memory (and, pushing, served) until D was through with NIXL.
    assert pres.get("beside_kept_until_d_ended"), pres
    monkeypatch.setenv("OUT", str(out))  # as test/gpu/run sets it
    op = "WRITE" if mode == "push" else "READ"
    ours, theirs, line = pair.report_beside(f"nixl {mode} (CPU, host memory)", recs, op=op)
    assert len(ours) == len(theirs) == timed and min(ours + theirs) > 0, line
    assert line.startswith(f"in-process GB/s | nixl {mode} (CPU, host memory) and NIXL's Python API, alternated") and \
        f"NIXL {op}, post to done" in line and "ratio of the medians" in line
    assert (out / "inprocess-gbps.txt").read_text() == line + "\n"


def _line(t: int, ev: str, side: str, **kw) -> str:
    return json.dumps({"t": t, "ev": ev, "side": side, "engine": side, "tp": 0, "pp": 0, **kw, "pid": 1})


def test_table_of_made_up_lines(tmp_path):
    """Events join a transfer through any id they share with it (P's
    outcome names only P's request); a hop runs from its first event to the
    first of its end at or after it; a call is its call_ns; the first
    transfers skipped are those that started first; dropped events are
    summed from trace.end lines."""
    d, p = tmp_path / "d.jsonl", tmp_path / "p.jsonl"
    dl, pl = ['{"t": 0, "ev": "trace.start", "pid": 1}'], []
    for k, base in enumerate([1_000_000, 2_000_000, 3_000_000]):
        ids = {"d_req": f"d-{k}", "p_req": f"p-{k}", "tid": f"t-{k}"}
        dl += [_line(base, "py.step", "D", **ids),
               _line(base + 100_000 * (k + 1), "recv.step", "D", **ids),
               _line(base + 200_000, "reg.sent", "D", call_ns=7_000 * (k + 1), **ids),
               _line(base + 900_000, "outcome", "D", d_req=f"d-{k}", result="done")]
        pl += [_line(base + 250_000, "reg.recv", "P", **ids),
               _line(base + 260_000, "write.post", "P", d_req=f"d-{k}", p_req=f"p-{k}", tid=f"t-{k}", call_ns=1000),
               _line(base + 700_000, "write.done", "P", d_req=f"d-{k}", p_req=f"p-{k}", tid=f"t-{k}", xfer_ns=400_000),
               _line(base + 710_000, "outcome", "P", p_req=f"p-{k}", result="done")]
    dl.append('{"t": 9000000, "ev": "trace.end", "pid": 1, "dropped": 3}')
    dl.append('{"t": 9000001, "ev": "outc')  # torn: its process was killed mid-write
    d.write_text("\n".join(dl) + "\n")
    p.write_text("\n".join(reversed(pl)) + "\n")  # order in the file does not matter
    got = rows(hoptrace.table([d, p], skip=1))
    assert got["D: python step -> Worker.Step"] == [2, 250.0, 200.0, 300.0]
    assert got["D: registration Notify call"] == [2, 17.5, 14.0, 21.0]
    assert got["D registration sent -> P drained it"] == [2, 50.0, 50.0, 50.0]
    assert got["P: WRITE seen done -> outcome published"] == [2, 10.0, 10.0, 10.0]
    assert got["P: WRITE as the backend timed it (NIXL telemetry)"] == [2, 400.0, 400.0, 400.0]
    assert got["total D: Worker.Step -> outcome published"] == [2, 650.0, 600.0, 700.0]
    assert "D: Worker.Step -> loop took the step" not in got  # no transfer passed it
    per = hoptrace.each([d, p], skip=1)
    assert per[0] == "hop | d-1 | d-2 |", per
    assert "D: python step -> Worker.Step | 200.0 | 300.0 |" in per, per
    head = hoptrace.table([d, p], skip=1)[0]
    assert "2 transfers timed (1 skipped), 2 files, 3 events dropped, 1 lines unreadable" in head, head
