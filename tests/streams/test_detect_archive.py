"""The Parquet archive of c4.events as an input of ``detect``: same commands as the
original trace, duplicates read once, non-event files reported."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producers.columnar import events_table as contract_table
from producers.columnar.blocks import BlockColumns
from producers.simulator import SCENARIOS, FaultSpec, write_trace
from producers.sources import open_source, open_sources, sniff
from producers.traces import BadLine, TraceLine, read_trace
from sinks.archive.schemas import EVENTS, VERDICTS
from sinks.archive.tables import MessageSources, events_table
from sinks.archive.writer import DatasetWriter, RollPolicy
from streams.commands import decode_command
from streams.core import DetectionPipeline
from streams.core.columns import PartsBlock
from streams.detect import run_detect


def _archive(
    trace: Path, root: Path, *, duplicate: int | None = None, per_msg: int = 1,
    roll_bytes: int = 20_000,
) -> int:  # fmt: skip
    """Write the trace's lines to the archive as the archiver would have, after they
    went through an 8-partition ``c4.events`` (keyed by communicator); returns the
    number of files. ``duplicate``: that batch is written twice (an archiver crash).
    ``per_msg``: lines per Kafka message (> 1: messages of several communicators)."""
    w = DatasetWriter(
        root / "events", EVENTS, RollPolicy(roll_bytes=roll_bytes, row_group_bytes=50_000)
    )
    offsets = [0] * 8
    lines = [x for x in read_trace(trace) if isinstance(x, TraceLine)]
    lines = [
        TraceLine("", 0, b"", [e for x in lines[k : k + per_msg] for e in x.events])
        for k in range(0, len(lines), per_msg)
    ]
    files = []
    for k in range(0, len(lines), 40):  # consumer batches of 40 messages
        events, msgs = [], []
        for line in lines[k : k + 40]:
            p = zlib.crc32(line.events[0].comm.encode()) % 8
            msgs.append((p, offsets[p], line.events[0].ts_us // 1000, len(line.events)))
            offsets[p] += 1
            events += line.events
        rows = events_table(events, MessageSources.build("c4.events", msgs))
        files += w.write(rows.table, rows.jobs)
        if duplicate == k // 40:
            files += w.write(rows.table, rows.jobs)
    files += w.close_all()
    return len(files)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("arch")
    cfg = msgspec.structs.replace(
        SCENARIOS["healthy"], job="arch/job 1", hosts=8, duration_s=40, seed=4,
        faults=[
            FaultSpec(kind="straggler", host=2, gpu=5, start_s=10, severity=1.5),
            FaultSpec(kind="rank_hang", host=6, gpu=1, start_s=28),
        ],
    )  # fmt: skip
    write_trace(cfg, d / "trace.jsonl.gz", d / "truth.json")
    return d / "trace.jsonl.gz"


@pytest.fixture(scope="module")
def net_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Network faults: the hang detector follows progress connections (as arrays when
    the archive comes in blocks)."""
    d = tmp_path_factory.mktemp("arch-net")
    cfg = msgspec.structs.replace(
        SCENARIOS["healthy"], job="net", hosts=8, duration_s=44, seed=11,
        faults=[
            FaultSpec(kind="slow_nic", host=4, nic=1, start_s=6, end_s=20, severity=0.4),
            FaultSpec(kind="link_hang", host=6, nic=3, peer_host=7, start_s=28),
        ],
    )  # fmt: skip
    write_trace(cfg, d / "trace.jsonl.gz", d / "truth.json")
    return d / "trace.jsonl.gz"


@pytest.mark.timeout(180)
def test_archive_gives_the_same_commands_as_the_trace(trace: Path, tmp_path: Path) -> None:
    n_files = _archive(trace, tmp_path / "a", duplicate=3)
    assert n_files >= 3, "several files: the reader merges them by event time"
    a = run_detect([trace], tmp_path / "from-trace.jsonl")
    bad: list[BadLine] = []
    b = run_detect([tmp_path / "a" / "events"], tmp_path / "from-archive.jsonl", on_bad=bad.append)
    assert bad == []
    assert len(a.commands) >= 2, "the straggler and the hang are isolated"
    assert {c.host for c in a.commands} >= {"node-002", "node-006"}
    assert b.n_events == a.n_events  # the duplicated batch is read once
    assert (tmp_path / "from-archive.jsonl").read_bytes() == (
        tmp_path / "from-trace.jsonl"
    ).read_bytes()


def _decide(events_dir: Path, blocks: bool) -> tuple[list[bytes], int]:
    """Verdicts and commands of the pipeline fed the archive message by message
    (each message a part) or a block of messages at a time."""
    pipe = DetectionPipeline()
    n_blocks = 0
    for b in open_sources([events_dir], blocks=blocks):
        if b.block is not None:
            n_blocks += 1
            pipe.feed_block(b.block)
        else:
            assert b.columns is not None
            pipe.feed_block(PartsBlock(b.columns))
    pipe.finish()
    out = [msgspec.json.encode(v) for v in pipe.verdicts]
    return out + [msgspec.json.encode(c) for c in pipe.commands], n_blocks


@pytest.mark.timeout(180)
@pytest.mark.parametrize("per_msg", [1, 3])
def test_blocks_of_messages_decide_like_messages_one_by_one(
    trace: Path, tmp_path: Path, per_msg: int
) -> None:
    """Several files in one directory (merged by second), duplicates, and (per_msg 3)
    messages of several communicators: blocks give the same verdicts, in order."""
    _archive(trace, tmp_path, duplicate=2, per_msg=per_msg)
    one_by_one, none = _decide(tmp_path / "events", blocks=False)
    blocked, n_blocks = _decide(tmp_path / "events", blocks=True)
    assert none == 0 and n_blocks > 0
    n_msgs = sum(1 for _ in open_sources([tmp_path / "events"]))
    assert n_blocks < n_msgs / 10, "blocks hold many messages"
    assert any(b'"noncomm_hang"' in v for v in one_by_one), "the faults are found"
    assert blocked == one_by_one


@pytest.mark.timeout(180)
@pytest.mark.parametrize("roll_bytes", [20_000, 1 << 30])
def test_network_faults_from_blocks_decide_like_the_trace(
    net_trace: Path, tmp_path: Path, roll_bytes: int
) -> None:
    """Several files (blocks cut by second for the merge) and one file (blocks of up
    to 64k rows, slices spanning two blocks)."""
    n_files = _archive(net_trace, tmp_path, roll_bytes=roll_bytes)
    assert (n_files == 1) == (roll_bytes > 1 << 20)
    one_by_one, _ = _decide(tmp_path / "events", blocks=False)
    blocked, n_blocks = _decide(tmp_path / "events", blocks=True)
    assert n_blocks > 0
    assert any(b'"comm_hang"' in v for v in blocked) and any(b'"slow_nic"' in v for v in blocked)
    assert blocked == one_by_one
    a = run_detect([net_trace], tmp_path / "from-trace.jsonl")
    run_detect([tmp_path / "events"], tmp_path / "from-archive.jsonl")
    assert {c.fault for c in a.commands} >= {"comm_hang", "slow_nic"}
    assert (tmp_path / "from-archive.jsonl").read_bytes() == (
        tmp_path / "from-trace.jsonl"
    ).read_bytes()


def test_the_archive_is_sniffed_and_its_job_comes_from_the_directory(
    trace: Path, tmp_path: Path
) -> None:
    _archive(trace, tmp_path)
    files = sorted((tmp_path / "events").rglob("*.parquet"))
    assert sniff(files[0]) == "parquet"
    assert "job=arch%2Fjob%201" in str(files[0])
    batches = list(open_source(files[0]))
    assert batches and all(e.job == "arch/job 1" for b in batches for e in b.events)
    # the messages as archived: here the trace's first lines, in their order
    lines = [x.events for x in read_trace(trace) if isinstance(x, TraceLine)]
    assert [list(b.events) for b in batches] == lines[: len(batches)]
    assert all(b.columns and b.columns[0].n == len(b.events) for b in batches)


def test_plain_parquet_of_events_and_foreign_parquet(trace: Path, tmp_path: Path) -> None:
    events = [e for x in read_trace(trace) if isinstance(x, TraceLine) for e in x.events][:500]
    pq.write_table(contract_table(events), tmp_path / "plain.parquet")
    got = [e for b in open_source(tmp_path / "plain.parquet") for e in b.events]
    key = msgspec.json.encode
    assert sorted(map(key, got)) == sorted(map(key, events))
    pq.write_table(VERDICTS.empty_table(), tmp_path / "verdicts.parquet")
    bad: list[BadLine] = []
    assert list(open_source(tmp_path / "verdicts.parquet", on_bad=bad.append)) == []
    assert len(bad) == 1 and "not an events archive" in bad[0].reason
    t = contract_table(events[:3]).set_column(1, "v", pa.array([1, 2, 1], pa.int8()))
    pq.write_table(t, tmp_path / "broken.parquet")
    bad.clear()
    assert list(open_source(tmp_path / "broken.parquet", on_bad=bad.append)) == []
    assert "break the contract" in bad[0].reason and "row 1, column `v`" in bad[0].reason


@pytest.mark.timeout(180)
def test_cli_judges_an_archived_day_with_other_thresholds(trace: Path, tmp_path: Path) -> None:
    _archive(trace, tmp_path)
    c4 = str(Path(sys.executable).parent / "c4stream")

    def detect(*extra: str) -> list[tuple[str, str]]:
        out = tmp_path / "cmds.jsonl"
        r = subprocess.run(
            [c4, "detect", str(tmp_path / "events"), "--out", str(out), "-q", *extra],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        return [(c.host, c.fault) for c in map(decode_command, out.read_bytes().splitlines())]

    default = detect()
    assert ("node-006", "noncomm_hang") in default and ("node-002", "straggler") in default
    cfg = tmp_path / "lenient.toml"
    # a hang must last ten minutes and a straggler arrive last always (in a window, and
    # in the longer evidence of an intermittent one): nothing isolated
    cfg.write_text(
        "[worker.detect]\nhang_floor_us = 600000000\nstraggler_last_frac = 1.01\n"
        "straggler_long_last_frac = 1.01\n"
    )
    assert detect("--config", str(cfg)) == []
    cfg.write_text("[worker.detect]\nhang_flor_us = 1\n")  # a typo is an error, not ignored
    args = [c4, "detect", str(tmp_path / "events"), "-o", str(tmp_path / "x"), "--config", str(cfg)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "hang_flor_us" in r.stderr


def test_progress_conns_and_identities_of_rows_joined_across_blocks_are_the_events(
    net_trace: Path, tmp_path: Path
) -> None:
    """A communicator's rows of several blocks (a slice cut by a block's end) give the
    hang detector their connections as arrays, and new ranks their identities as lists,
    equal to the events' own; so do one block's rows (read for the whole slice)."""
    _archive(net_trace, tmp_path)
    blocks = [b.block for b in open_sources([tmp_path / "events"], blocks=True)]
    per_comm: dict[str, list[BlockColumns]] = {}
    for blk in blocks:
        assert blk is not None
        for c in blk.select(np.arange(len(blk.part_comm))):
            per_comm.setdefault(c.comm, []).append(c)
    # the communicator whose progress rows carry the most connections (in-flight ops)
    parts = max(per_comm.values(), key=lambda ps: sum(
        int(p.conn_counts()[~p.is_op].sum()) for p in ps))  # fmt: skip
    assert len(parts) >= 3
    joined = BlockColumns.concat(parts)
    events = joined.to_events()
    idx = np.flatnonzero(~joined.is_op)  # every progress row, in order
    got = joined.progress_conns(idx)
    assert got is not None
    off, peer, send, nbytes, retrans = (a.tolist() for a in got)
    want = [[(c.peer, c.dir == "send", c.bytes, c.retrans or 0) for c in events[i].conns or []]
            for i in idx.tolist()]  # fmt: skip
    assert sum(map(len, want)) > 0, "the rows carry connections"
    have = [list(zip(peer[a:b], send[a:b], nbytes[a:b], retrans[a:b], strict=True))
            for a, b in zip(off[:-1], off[1:], strict=True)]  # fmt: skip
    assert have == want
    for cols in (joined, parts[0], parts[-1]):
        rows = np.arange(cols.n)[::-1][::3]  # any rows, any order
        objs = cols.to_events()
        want_ids = [(objs[i].host, objs[i].gpu, objs[i].nic) for i in rows.tolist()]
        assert list(zip(*cols.identities(rows), strict=True)) == want_ids
        assert any(g is not None for _, g, _ in want_ids)
    some = idx[len(idx) // 3 :: 2]  # a subset spanning blocks
    sub = joined.progress_conns(some)
    assert (
        sub is not None
        and sub[0].tolist()
        == np.concatenate(
            [[0], np.cumsum([len(want[i]) for i in (np.searchsorted(idx, some)).tolist()])]
        ).tolist()
    )


def test_a_cut_reads_its_first_op_from_the_columns_not_from_event_objects(
    net_trace: Path, tmp_path: Path
) -> None:
    """Block rows give one value without building event objects: a cut's first op name
    (``first_op``) is read on every slice of every communicator, and reading it from an
    object made the slice's shared objects convert the whole slice each time."""
    from streams.core.cut import first_op

    _archive(net_trace, tmp_path)
    blk = next(b.block for b in open_sources([tmp_path / "events"], blocks=True))
    assert blk is not None
    cols = blk.select(np.arange(len(blk.part_comm)))
    joined = BlockColumns.concat([c for c in cols if c.comm == cols[0].comm])
    judged = 0
    for c in (*cols, joined):
        ops = np.flatnonzero(c.is_op)
        if ops.size:
            assert first_op(c, ops) == c.to_events()[int(ops[0])].op
            judged += 1
    assert judged > 2
    shared = cols[0]._objs
    assert shared is not None and not shared[0]._cache, "no event object was built"
    for c in (*cols[:3], joined):
        events = c.to_events()
        for i in (0, c.n // 2, c.n - 1):
            for name in ("op", "host", "comm_name", "ts_us"):
                assert c.value_at(name, i) == getattr(events[i], name, None)
