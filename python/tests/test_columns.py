"""The scheduler side's columnar fast path (encode_rows) encodes exactly what
the row-by-row path (_Columns) does, and hands every row that is not plain
to that path; no daemon needed."""

from __future__ import annotations

import pytest

from kvxfer import vllm as V
from kvxfer.v1 import kvxfer_pb2 as pb

# Columns and their defaults, for reading a RequestColumns row by row (an
# empty column holds its default in every row).
_ROW_COLUMNS = {name: "" if name in ("transfer_id", "remote_engine_id", "remote_addr", "remote_request_id") else 0
                for name in V._Columns._FIXED if name != "request_id"}


class Req:
    def __init__(self, rid, prompt=64, computed=0):
        self.request_id = rid
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = computed


def rows_of(c: pb.RequestColumns, groups: int) -> list[dict]:
    """c's rows, every column read with its default when left out."""
    out = []
    pos = 0
    for i, rid in enumerate(c.request_id):
        row = {"request_id": rid}
        for name, default in _ROW_COLUMNS.items():
            col = getattr(c, name)
            row[name] = col[i] if len(col) else default
        lens = list(c.block_lens[i * groups:(i + 1) * groups]) if len(c.block_lens) else [0] * groups
        row["blocks"] = []
        for n in lens:
            row["blocks"].append(list(c.block_ids[pos:pos + n]))
            pos += n
        rl = list(c.remote_block_lens[i * groups:(i + 1) * groups]) if len(c.remote_block_lens) else [0] * groups
        row["remote"] = rl
        out.append(row)
    return out


def both(ps, blocks, groups=1, flags=None, status=None):
    reqs = [Req(f"r-{i}", 64 + i, i) for i in range(len(ps))]
    flags = flags or [0] * len(ps)
    computed = [r.num_computed_tokens for r in reqs]
    count = [i * 16 for i in range(len(ps))]
    fast = pb.RequestColumns()
    ok = V.encode_rows(fast, groups, reqs, ps, flags, computed, count, status, blocks, {})
    slow = pb.RequestColumns()
    cols = V._Columns(groups)
    for i, (r, p, b) in enumerate(zip(reqs, ps, blocks)):
        assert cols.add("recv", r, p, b, computed[i], count[i], status=status[i] if status else 0, addrs={},
                        flags=flags[i])
    cols.encode(slow, status is not None)
    return ok, fast, slow, cols


PUSH_D = {"do_remote_prefill": False, "do_remote_decode": False, "transfer_id": "t", "remote_engine_id": "p0",
          "remote_host": "10.0.0.1", "remote_port": 4000, "tp_size": 2, "mode": "push"}


@pytest.mark.parametrize("ps", [
    [dict(PUSH_D, transfer_id=f"t{i}") for i in range(5)],  # D's push registrations
    [{"do_remote_decode": True, "transfer_id": f"t{i}"} for i in range(3)],  # P's requests
    # NixlConnector's spellings, several producers, IPv6, a remote_pp_size that wins over pp_size
    [{"do_remote_prefill": True, "remote_engine_id": "a", "remote_host": "::1", "remote_port": 5, "pp_size": 2,
      "transfer_mode": "pull", "remote_request_id": "x", "remote_num_tokens": 40},
     {"do_remote_prefill": True, "remote_engine_id": "b", "remote_host": "h", "remote_port": 6, "pp_size": 2,
      "remote_pp_size": 3, "tp_size": None, "mode": "push"},
     dict(PUSH_D, mode=None, tp_size=None)],
    # A pull producer's hold's end (NixlConnector's spelling of P's params)
    [dict(PUSH_D, mode="pull", remote_blocks_expiry_unix_nanos=1_800_000_000_000_000_000 + i) for i in range(3)],
])
def test_fast_path_encodes_what_rows_do(ps):
    blocks = [[[i, i + 1]] for i in range(len(ps))]
    ok, fast, slow, cols = both(ps, blocks, flags=[1] * len(ps), status=[pb.FINISH_STATUS_STOPPED] * len(ps))
    assert ok
    assert rows_of(fast, 1) == rows_of(slow, 1)
    assert cols.bad == 0
    # Columns of defaults only are left out.
    assert not len(fast.remote_request_id) or any(fast.remote_request_id)
    assert not len(fast.remote_block_lens)


def test_fast_path_rows_with_fewer_block_lists():
    """update_state_after_alloc rows that load nothing carry no block lists."""
    ps = [dict(PUSH_D), dict(PUSH_D, transfer_id="u")]
    ok, fast, slow, _ = both(ps, [[[1, 2], [3]], ()], groups=2)
    assert ok
    assert rows_of(fast, 2) == rows_of(slow, 2)
    assert rows_of(fast, 2)[1]["blocks"] == [[], []]


@pytest.mark.parametrize("odd", [
    {"transfer_id": 7},  # not a str
    {"tp_size": "2"},  # not an int
    {"tp_size": True},
    {"tp_size": -1},  # out of range
    {"remote_num_tokens": 1 << 40},
    {"remote_port": [1]},  # unhashable
    {"mode": ["push"]},
    {"remote_port": "x"},  # not a port
    {"remote_block_ids": [[1, 2]]},  # remote lists take the row path
    {"remote_blocks_expiry_unix_nanos": "5"},  # not an int
    {"remote_blocks_expiry_unix_nanos": 5.0},
])
def test_odd_rows_take_the_row_path(odd):
    ps = [dict(PUSH_D), dict(PUSH_D, **odd)]
    ok, fast, slow, cols = both(ps, [[[1]], [[2]]])
    assert not ok
    assert fast.ByteSize() == 0, "the fast path leaves nothing behind when it gives up"
    # The row path takes the same rows without raising; what it cannot use
    # is counted, not raised into vLLM's scheduler loop.
    rows = rows_of(slow, 1)
    assert [r["request_id"] for r in rows] == ["r-0", "r-1"]
    assert rows[0]["transfer_id"] == "t"


# A producer's generation as its params carry it (the clock's nanoseconds:
# past 2^53, as a real one is).
GEN = 1_764_000_000_123_456_789


def test_generation_column_fast_and_row_paths_agree():
    """remote_generation (pull params) is a column of its own: rows that
    carry it (any number up to 2^64-1) and rows that do not encode the same
    on both paths, and the column is left out when no row has one."""
    ps = [dict(PUSH_D, remote_generation=GEN), dict(PUSH_D, transfer_id="u"),
          dict(PUSH_D, transfer_id="v", remote_generation=(1 << 64) - 1), dict(PUSH_D, transfer_id="w", remote_generation=0)]
    ok, fast, slow, cols = both(ps, [[[i]] for i in range(len(ps))], flags=[1] * len(ps),
                                status=[pb.FINISH_STATUS_STOPPED] * len(ps))
    assert ok
    assert rows_of(fast, 1) == rows_of(slow, 1)
    assert [r["remote_generation"] for r in rows_of(fast, 1)] == [GEN, 0, (1 << 64) - 1, 0]
    assert cols.bad == 0
    ok, fast, slow, _ = both([dict(PUSH_D), dict(PUSH_D, transfer_id="u")], [[[1]], [[2]]])
    assert ok and not len(fast.remote_generation) and not len(slow.remote_generation)


def test_generation_on_a_pull_consumer_row():
    """A pull D's row (remote block lists: the row-by-row path, as before)
    carries its params' remote_generation, as a string of digits too."""
    p = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "h", "remote_port": 5, "mode": "pull",
         "remote_request_id": "x", "remote_block_ids": [[3, 4]], "remote_block_starts": [0], "remote_generation": GEN}
    for gen in (GEN, str(GEN)):
        ok, _, slow, cols = both([dict(p, remote_generation=gen)], [[[1, 2]]])
        assert not ok  # remote lists take the row path
        assert list(slow.remote_generation) == [GEN] and cols.bad == 0


@pytest.mark.parametrize("junk", [-1, 1 << 64, "x", "1.5", 1.5, float(GEN), True, [GEN], {"g": 1}])
def test_junk_generation_is_counted_not_sent(junk):
    """A remote_generation that is no integer 0..2^64-1 (a float too,
    integral or not: a generation past 2^53 loses digits as one) takes the
    row path, which counts it as bad params and keeps the row's flags
    alone; the row beside it keeps its own."""
    ps = [dict(PUSH_D, remote_generation=GEN), dict(PUSH_D, transfer_id="u", remote_generation=junk)]
    ok, fast, slow, cols = both(ps, [[[1]], [[2]]])
    assert not ok and fast.ByteSize() == 0
    assert cols.bad == 1
    rows = rows_of(slow, 1)
    assert [r["remote_generation"] for r in rows] == [GEN, 0]
    assert rows[0]["remote_engine_id"] == "p0" and rows[1]["remote_engine_id"] == ""  # its remote fields dropped
    assert rows[1]["transfer_id"] == "u"


@pytest.mark.parametrize("junk", [-1, 1 << 64, "x", 1.5, float(GEN), True])
def test_junk_generation_refused_by_params(junk):
    """params refuses the same junk with a message naming the field (a D's
    matched-tokens check: the request is computed locally and counted)."""
    from kvxfer import params as P
    p = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "h", "remote_port": 5, "mode": "pull",
         "remote_request_id": "x", "remote_block_ids": [[3]], "remote_generation": junk}
    with pytest.raises(P.ParamsError, match="kv_transfer_params.remote_generation"):
        P.validate_remote(p, pb.MODE_PULL)
    with pytest.raises(P.ParamsError, match="kv_transfer_params.remote_generation"):
        P.to_proto(p)
    assert P.to_proto(dict(p, remote_generation=GEN)).remote_generation == GEN
    assert P.from_proto(P.to_proto(dict(p, remote_generation=GEN)))["remote_generation"] == GEN


@pytest.mark.parametrize("fast", [True, False])
def test_rows_carry_the_producers_hold_expiry(fast):
    """Pull params carry when the producer's hold of its blocks ends
    (remote_blocks_expiry_unix_nanos): every row carries it to the daemon,
    whose scheduler bounds the consumer's READs by it, by either path (D's
    rows, naming the producer's blocks, take the row path). Before, the
    columns had no such field: the daemon read such params with no bound,
    past the hold, into blocks the producer may have reused."""
    exp = 1_800_000_000_123_456_789
    ps = [dict(PUSH_D, mode="pull", remote_blocks_expiry_unix_nanos=exp), dict(PUSH_D, mode="pull")]
    if not fast:
        ps = [dict(p, do_remote_prefill=True, remote_block_ids=[[3, 4]]) for p in ps]
    ok, fc, slow, _ = both(ps, [[[1]], [[2]]])
    assert ok == fast
    c = fc if fast else slow
    assert list(c.remote_blocks_expiry_unix_nanos) == [exp, 0]
    # Junk there is refused by the row path, naming the field, and counted.
    cols = V._Columns(1)
    assert cols.add("recv", Req("r-9"), dict(ps[0], remote_blocks_expiry_unix_nanos=-1), [[1]], 0, addrs={})
    assert cols.bad == 1
