"""Archive writer, tables and dedupe on real files (no Kafka): rolling, atomic publish,
partition layout, offsets held back, and reading back with pyarrow and DuckDB."""

from __future__ import annotations

import os
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from producers.events import Conn, OpEvent, ProgressEvent
from sinks.archive.dedupe import count_duplicates, dedupe_archive, open_dataset
from sinks.archive.schemas import EVENTS, ISOLATIONS, VERDICTS
from sinks.archive.tables import (
    MAX_JOB_BYTES,
    MessageSources,
    events_table,
    isolations_table,
    verdicts_table,
)
from sinks.archive.writer import TEMP_SUFFIX, DatasetWriter, RollPolicy, sweep_stale_temps
from streams.commands import IsolationCommand
from streams.verdicts import Verdict

pytestmark = pytest.mark.timeout(60)

HOUR_US = 3_600_000_000
T0 = 1_795_982_400_000_000  # 2026-11-29T20:00:00Z


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_events(n: int, *, job: str = "job-a", t0: int = T0, seq0: int = 0) -> list:
    """n events of 4 ranks: ops with conns, every 5th a progress heartbeat."""
    out = []
    for i in range(n):
        rank, ts = i % 4, t0 + i * 1000
        ident = dict(v=1, job=job, comm="0xc0", nranks=4, rank=rank, host=f"h{rank}", ts_us=ts)
        if i % 5 == 4:
            out.append(
                ProgressEvent(
                    **ident,
                    started=seq0 + i,
                    completed=seq0 + i - 1,
                    inflight_op="AllReduce",
                    inflight_us=12.0,
                )
            )
        else:
            conns = [Conn(peer=(rank + 1) % 4, dir="send", bytes=4096 + i, time_us=3.5)]
            out.append(
                OpEvent(
                    **ident,
                    op="AllReduce",
                    seq=seq0 + i,
                    bytes=1 << 20,
                    exec_us=100.0 + i,
                    gpu=rank,
                    conns=conns if i % 3 else None,
                )
            )
    return out


def batch(events: list, *, partition: int = 0, offset0: int = 0, per_msg: int = 10):
    """Rows of ``events`` as if they came in messages of ``per_msg`` events."""
    msgs = [
        (partition, offset0 + k, 1, len(events[i : i + per_msg]))
        for k, i in enumerate(range(0, len(events), per_msg))
    ]
    return events_table(events, MessageSources.build("c4.events", msgs))


def visible_files(root: Path) -> list[str]:
    return sorted(ds.dataset(root, format="parquet", partitioning="hive").files)


def test_events_round_trip_through_a_file(tmp_path: Path) -> None:
    evs = make_events(50)
    rows = batch(evs, per_msg=7)
    w = DatasetWriter(tmp_path / "events", EVENTS, RollPolicy())
    w.write(rows.table, rows.jobs)
    [path] = w.close_all()
    back = pq.read_table(path)
    assert back.schema.equals(EVENTS)
    got = back.to_pylist()
    assert [r["kind"] for r in got] == ["progress" if i % 5 == 4 else "op" for i in range(50)]
    assert got[1]["conns"] == [
        {"peer": 2, "dir": "send", "bytes": 4097, "time_us": 3.5, "retrans": None}
    ]
    assert got[3]["conns"] is None and got[4]["seq"] is None and got[4]["started"] == 4
    assert got[0]["exec_us"] == 100.0 and got[0]["gpu"] == 0 and got[4]["gpu"] is None
    # source columns: message k of 7 events at offset k, index within the message
    assert [r["kafka_offset"] for r in got[:9]] == [0] * 7 + [1] * 2
    assert [r["kafka_index"] for r in got[:9]] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"


def test_rolls_by_size_and_every_file_is_complete(tmp_path: Path) -> None:
    policy = RollPolicy(roll_bytes=8_000, row_group_bytes=20_000, roll_seconds=3600)
    w = DatasetWriter(tmp_path / "events", EVENTS, policy)
    done = []
    total = 0
    for k in range(20):
        evs = make_events(200, seq0=k * 200)
        rows = batch(evs, offset0=k * 20)
        done += w.write(rows.table, rows.jobs)
        total += len(evs)
    assert len(done) >= 3, "small roll_bytes must roll several files"
    for p in done:  # each completed file already at least roll_bytes on disk
        assert p.stat().st_size >= policy.roll_bytes
    done += w.close_all()
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in done) == total
    assert not list(tmp_path.rglob(f"*{TEMP_SUFFIX}"))
    table = open_dataset(tmp_path, "events").to_table()
    assert table.num_rows == total and count_duplicates(table) == 0
    assert sorted(table.column("kafka_offset").to_pylist()) == sorted(
        o for o in range(400) for _ in range(10)
    )


def test_open_file_is_invisible_until_complete_then_atomic(tmp_path: Path) -> None:
    clock = FakeClock()
    w = DatasetWriter(tmp_path / "verdicts", VERDICTS, RollPolicy(roll_seconds=5), clock=clock)
    v = Verdict(
        id="v1",
        ts_us=T0,
        job="j",
        comm="0xa",
        host="h1",
        fault="straggler",
        score=0.8,
        reason="late",
        window_start_us=0,
        window_end_us=1,
        evidence={"late_ratio": 1.2},
        ranks=[3],
    )
    rows = verdicts_table([v], MessageSources.build("c4.verdicts", [(0, 9, 5, 1)]))
    assert w.write(rows.table, rows.jobs) == []
    [tmp] = list(tmp_path.rglob("*" + TEMP_SUFFIX))
    assert tmp.name.startswith(".")
    assert visible_files(tmp_path / "verdicts") == []
    n = duckdb.sql(f"select count(*) from glob('{tmp_path}/verdicts/**/*.parquet')").fetchall()
    assert n == [(0,)]
    assert w.pending_offsets() == {("c4.verdicts", 0): 9}
    clock.now += 4.9
    assert w.roll_due() == []
    clock.now += 0.2
    [done] = w.roll_due()
    assert not tmp.exists() and done.name == tmp.name[1 : -len(TEMP_SUFFIX)]
    assert w.pending_offsets() == {}
    back = open_dataset(tmp_path, "verdicts").to_table().to_pylist()
    assert back[0]["evidence"] == '{"late_ratio":1.2}' and back[0]["ranks"] == [3]
    assert back[0]["job"] == "j" and back[0]["hour"] == "2026-11-29T20"
    ratio = duckdb.sql(
        f"SELECT json_extract(evidence, '$.late_ratio')::DOUBLE FROM read_parquet("
        f"'{tmp_path}/verdicts/**/*.parquet', hive_partitioning = true)"
    ).fetchall()
    assert ratio == [(1.2,)]


def test_partitions_by_job_and_hour_and_holds_back_lowest_offsets(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path / "events", EVENTS, RollPolicy(roll_seconds=3600))
    a = make_events(40, job="train/llama 70b", t0=T0 + HOUR_US - 20_000)  # spans 2 hours
    b = make_events(10, job="123", t0=T0)
    rows_a = batch(a, partition=0, offset0=100)
    rows_b = batch(b, partition=3, offset0=7)
    w.write(rows_a.table, rows_a.jobs)
    w.write(rows_b.table, rows_b.jobs)
    assert w.open_files == 3
    assert w.pending_offsets() == {("c4.events", 0): 100, ("c4.events", 3): 7}
    w.close_all()
    dirs = sorted(
        p.relative_to(tmp_path / "events").as_posix() for p in (tmp_path / "events").glob("*/*")
    )
    assert dirs == [
        "job=123/hour=2026-11-29T20",
        "job=train%2Fllama%2070b/hour=2026-11-29T20",
        "job=train%2Fllama%2070b/hour=2026-11-29T21",
    ]
    t = open_dataset(tmp_path, "events").to_table()
    assert t.schema.field("job").type == pa.string()
    per = t.group_by(["job", "hour"]).aggregate([([], "count_all")]).sort_by("hour").to_pylist()
    assert {(r["job"], r["hour"], r["count_all"]) for r in per} == {
        ("123", "2026-11-29T20", 10),
        ("train/llama 70b", "2026-11-29T20", 20),
        ("train/llama 70b", "2026-11-29T21", 20),
    }
    con = duckdb.connect()
    got = con.sql(
        f"select job, hour, count(*) from read_parquet('{tmp_path}/events/**/*.parquet', "
        "hive_partitioning=true, hive_types={'job': VARCHAR, 'hour': VARCHAR}) "
        "group by all order by all"
    ).fetchall()
    assert got == [
        ("123", "2026-11-29T20", 10),
        ("train/llama 70b", "2026-11-29T20", 20),
        ("train/llama 70b", "2026-11-29T21", 20),
    ]


def test_max_open_files_closes_the_oldest(tmp_path: Path) -> None:
    clock = FakeClock()
    w = DatasetWriter(tmp_path / "events", EVENTS, RollPolicy(max_open_files=2), clock=clock)
    done = []
    for k, job in enumerate(["a", "b", "c"]):
        clock.now += 1
        rows = batch(make_events(5, job=job), offset0=k)
        done += w.write(rows.table, rows.jobs)
    assert [p.parent.parent.name for p in done] == ["job=a"]
    assert w.open_files == 2 and w.pending_offsets() == {("c4.events", 0): 1}


def test_isolations_table_and_abort(tmp_path: Path) -> None:
    cmd = IsolationCommand(
        id="c4-1",
        ts_us=T0,
        job="j",
        host="h3",
        fault="slow_nic",
        action="cordon",
        confidence=0.9,
        reason="NIC slow",
        evidence={"comms": ["0xa"]},
        nic="mlx5_0",
    )
    rows = isolations_table([cmd], MessageSources.build("c4.isolations", [(0, 0, -1, 1)]))
    assert rows.table.schema.equals(ISOLATIONS)
    r = rows.table.to_pylist()[0]
    assert (r["kind"], r["nic"], r["dry_run"], r["kafka_ts_ms"]) == (
        "isolate",
        "mlx5_0",
        None,
        None,
    )
    w = DatasetWriter(tmp_path / "isolations", ISOLATIONS, RollPolicy())
    w.write(rows.table, rows.jobs)
    w.abort_all()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_sweep_removes_only_old_temp_files(tmp_path: Path) -> None:
    d = tmp_path / "events" / "job=j" / "hour=h"
    d.mkdir(parents=True)
    old, new, data = (
        d / f".part-1.parquet{TEMP_SUFFIX}",
        d / f".part-2.parquet{TEMP_SUFFIX}",
        d / "part-3.parquet",
    )
    for p in (old, new, data):
        p.write_bytes(b"x")
    os.utime(old, (time.time() - 1000, time.time() - 1000))
    assert sweep_stale_temps(tmp_path, older_than_s=100) == [old]
    assert new.exists() and data.exists()


def test_dedupe_removes_duplicates_and_keeps_every_row(tmp_path: Path) -> None:
    evs = make_events(300)
    first, again = batch(evs[:200]), batch(evs, per_msg=10)  # rows 0..199 written twice
    for rows in (first, again):
        w = DatasetWriter(
            tmp_path / "events", EVENTS, RollPolicy(roll_bytes=6_000, row_group_bytes=6_000)
        )
        w.write(rows.table, rows.jobs)
        w.close_all()
    before = open_dataset(tmp_path, "events").to_table()
    assert before.num_rows == 500 and count_duplicates(before) == 200
    # read-time de-duplication as documented in docs/archive.md
    deduped = duckdb.sql(
        f"""WITH ev AS (
              SELECT * FROM read_parquet('{tmp_path}/events/**/*.parquet',
                                         hive_partitioning = true)
              QUALIFY row_number() OVER (
                PARTITION BY kafka_topic, kafka_partition, kafka_offset, kafka_index) = 1)
            SELECT count(*), count(DISTINCT (comm, rank, kind, seq, started)) FROM ev"""
    ).fetchall()
    assert deduped == [(300, 300)]
    [ev, *_] = dedupe_archive(tmp_path, apply=False)
    assert (ev.rows, ev.duplicates, ev.rewritten_directories) == (500, 200, 0)
    [ev, *_] = dedupe_archive(tmp_path, apply=True)
    assert ev.rewritten_directories == 1
    after = open_dataset(tmp_path, "events").to_table()
    assert after.num_rows == 300 and count_duplicates(after) == 0
    assert len(list((tmp_path / "events").rglob("*.parquet"))) == 1
    seqs = after.filter(pa.compute.equal(after.column("kind"), "op")).column("seq").to_numpy()
    assert np.array_equal(np.sort(seqs), [i for i in range(300) if i % 5 != 4])
    assert dedupe_archive(tmp_path, apply=False)[0].duplicates == 0


def test_job_name_too_long_for_a_directory_is_rejected_not_written() -> None:
    [ev] = make_events(1, job="j" * (MAX_JOB_BYTES + 1))
    with pytest.raises(ValueError, match="cannot name a partition directory"):
        batch([ev])
    [ok] = make_events(1, job="j" * MAX_JOB_BYTES)
    assert batch([ok]).table.num_rows == 1
