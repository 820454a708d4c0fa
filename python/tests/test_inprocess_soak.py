"""The in-process soak's own accounting (inprocess_soak.py): a rank's
stdout line cut short by the soak's SIGKILL is no violation, and a rank
writes each line in one write, so that a kill cannot cut one."""

from __future__ import annotations

import io
import json
import queue
import sys
from types import SimpleNamespace

import inprocess_soak as soak


def _rank(stdout: str, killed: bool) -> soak.Rank:
    rk = object.__new__(soak.Rank)
    rk.p = SimpleNamespace(stdout=io.StringIO(stdout))
    rk.name, rk.lines, rk.foreign, rk.ready, rk.eof, rk.bye = "P0.1", queue.SimpleQueue(), 0, False, False, None
    rk.killed = killed
    return rk


def _soak() -> soak.Soak:
    s = object.__new__(soak.Soak)
    s.violations, s.events = [], io.StringIO()
    return s


def test_a_line_cut_by_the_soaks_kill_is_no_violation():
    rk, s = _rank('soak: ready {"pid": 1}\nsoak:', killed=True), _soak()
    rk._read()
    s.take(rk)
    assert rk.ready and rk.eof
    assert s.violations == []


def test_a_line_cut_short_without_a_kill_is_a_violation():
    rk, s = _rank('soak: ready {"pid": 1}\nsoak: outc', killed=False), _soak()
    rk._read()
    s.take(rk)
    assert rk.eof
    assert s.violations == ["P0.1: a line cut short: 'soak: outc'"]


class _Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_a_rank_writes_each_line_in_one_write(monkeypatch):
    rank = __import__("inprocess_soak_rank")
    w = _Writes()
    monkeypatch.setattr(sys, "stdout", w)
    rank.out("outcome", {"id": "p-1", "result": "RESULT_DONE"})
    assert w.writes == ["soak: outcome " + json.dumps({"id": "p-1", "result": "RESULT_DONE"}) + "\n"]
