"""The archiver against the real broker: SIGKILL mid-way, restart, and prove every event
is archived exactly once after de-duplication, duplicates stay within the bound, no
file is corrupt, and pyarrow and DuckDB both read the dataset."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import duckdb
import httpx
import msgspec
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.topics import Topics
from compose.local_broker import create_topics
from producers.events import Event, OpEvent, encode_message
from producers.simulator import SimConfig, simulate
from sinks.archive.dedupe import count_duplicates, open_dataset
from sinks.archive.writer import TEMP_SUFFIX
from streams.commands import IsolationCommand, encode_command
from streams.verdicts import Verdict, encode_verdict

REPO = Path(__file__).resolve().parents[2]
HOUR_US = 3_600_000_000


def event_key(e: Event) -> tuple:
    """What identifies an event by content (to compare produced with archived)."""
    n = e.seq if isinstance(e, OpEvent) else e.started
    return (e.job, e.comm, e.rank, "op" if isinstance(e, OpEvent) else "progress", n, e.ts_us)


def trace_messages() -> list[list[Event]]:
    """Two simulated jobs (~5k events, one message per communicator batch); job B starts
    10 s before an hour boundary so it spans two hour partitions."""
    a = list(simulate(SimConfig(job="arch-a", hosts=4, gpus_per_host=8, duration_s=12, seed=1)))
    b_raw = list(simulate(SimConfig(job="arch/b", hosts=2, gpus_per_host=8, duration_s=20, seed=2)))
    t0 = min(e.ts_us for m in b_raw for e in m)
    shift = (HOUR_US - t0 % HOUR_US) - 10_000_000
    b = [[msgspec.structs.replace(e, ts_us=e.ts_us + shift) for e in m] for m in b_raw]
    out = [m for pair in zip(a, b, strict=False) for m in pair]
    return out + a[len(b) :] + b[len(a) :]


def verdicts_and_commands() -> tuple[list[Verdict], list[IsolationCommand]]:
    vs = [
        Verdict(
            id=f"v{i}",
            ts_us=1_750_000_000_000_000 + i,
            job="arch-a",
            comm="0xa",
            host=f"node-00{i % 4}",
            fault="straggler",
            score=0.5,
            reason="late",
            window_start_us=0,
            window_end_us=i,
            evidence={"i": i},
            ranks=[i % 8],
        )
        for i in range(30)
    ]
    cs = [
        IsolationCommand(
            id=f"c4-{i}",
            ts_us=1_750_000_000_000_000 + i,
            job="arch-a",
            host=f"node-00{i}",
            fault="straggler",
            action="cordon",
            confidence=0.9,
            reason="late",
            evidence={"verdicts": [f"v{i}"]},
        )
        for i in range(5)
    ]
    return vs, cs


def start_archiver(
    bootstrap: str, prefix: str, out: Path, log: Path, *extra: str
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "sinks.archive",
        "--out",
        str(out),
        "--bootstrap",
        bootstrap,
        "--topic-prefix",
        prefix,
        "--group",
        f"{prefix}archive",
        "--instance-id",
        "arch-0",
        "--roll-bytes",
        "12k",
        "--roll-seconds",
        "0.4",
        "--row-group-bytes",
        "24k",
        "--log-level",
        "DEBUG",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def committed(bootstrap: str, group: str, tps: list[TopicPartition]) -> dict[tuple, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        return {(tp.topic, tp.partition): tp.offset for tp in c.committed(tps, timeout=10)}
    finally:
        c.close()


def ends(bootstrap: str, tps: list[TopicPartition]) -> dict[tuple, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "ends-probe"})
    try:
        return {(tp.topic, tp.partition): c.get_watermark_offsets(tp, timeout=10)[1] for tp in tps}
    finally:
        c.close()


def visible_event_files(out: Path) -> list[str]:
    return [
        p for p in map(str, (out / "events").rglob("*.parquet")) if not Path(p).name.startswith(".")
    ]


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_sigkill_restart_exactly_once_after_dedupe(kafka_bootstrap: str, tmp_path: Path) -> None:
    prefix = f"arch{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix=prefix)
    create_topics(
        kafka_bootstrap,
        {topics.events: 4, topics.verdicts: 1, topics.isolations: 1, topics.deadletter: 1},
    )
    msgs = trace_messages()
    events = [e for m in msgs for e in m]
    assert 4000 <= len(events) <= 8000
    vs, cs = verdicts_and_commands()
    too_big = msgspec.structs.replace(msgs[0][0], rank=2**40)  # valid contract, not int32
    long_job = msgspec.structs.replace(msgs[0][0], job="j" * 200)  # no directory name fits

    producer = Producer(KafkaConfig(bootstrap=kafka_bootstrap).producer_config(**{"linger.ms": 5}))

    def send(batch: list[list[Event]]) -> None:
        for m in batch:
            producer.produce(topics.events, encode_message(m), key=m[0].comm)
            producer.poll(0)

    split = len(msgs) * 2 // 5
    send(msgs[:split])
    producer.produce(topics.events, b"{not json", key=b"bad")
    producer.produce(topics.events, encode_message([too_big]), key=b"big")
    producer.produce(topics.events, encode_message([long_job]), key=b"long")
    for v in vs:
        producer.produce(topics.verdicts, encode_verdict(v), key=v.host)
    producer.produce(topics.verdicts, b'{"id": 1}', key=b"bad")
    for c in cs:
        producer.produce(topics.isolations, encode_command(c), key=c.host)
    assert producer.flush(30) == 0

    out, log = tmp_path / "archive", tmp_path / "archiver.log"
    group = f"{prefix}archive"
    proc = start_archiver(kafka_bootstrap, prefix, out, log)
    try:
        # --- run 1: let it publish some files, keep producing, then SIGKILL mid-stream
        deadline = time.monotonic() + 30
        while len(visible_event_files(out)) < 3:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no files published:\n" + log.read_text()[-3000:]
            time.sleep(0.05)
        rest = msgs[split:]
        feeder = threading.Thread(
            target=lambda: [
                send(rest[i : i + 15]) or time.sleep(0.05) for i in range(0, len(rest), 15)
            ]
        )
        feeder.start()
        time.sleep(0.6)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        feeder.join(30)
        assert producer.flush(30) == 0

        # the bound: rows already in files whose offsets were not committed at the kill
        event_tps = [TopicPartition(topics.events, p) for p in range(4)]
        at_kill = committed(kafka_bootstrap, group, event_tps)
        before = open_dataset(out, "events").to_table(columns=["kafka_partition", "kafka_offset"])
        bound = sum(
            pc.sum(
                pc.greater_equal(
                    before.filter(pc.equal(before["kafka_partition"], p))["kafka_offset"],
                    max(at_kill[(topics.events, p)], 0),
                )
            ).as_py()
            or 0
            for p in range(4)
        )
        temps_after_kill = list(out.rglob(f"*{TEMP_SUFFIX}"))

        # --- run 2: restart, wait until everything is committed, stop gracefully
        port = free_port()
        proc = start_archiver(kafka_bootstrap, prefix, out, log, "--metrics-port", str(port))
        all_tps = event_tps + [
            TopicPartition(topics.verdicts, 0),
            TopicPartition(topics.isolations, 0),
        ]
        want = ends(kafka_bootstrap, all_tps)
        deadline = time.monotonic() + 45
        while committed(kafka_bootstrap, group, all_tps) != want:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                "restart did not catch up:\n" + (log.read_text()[-3000:])
            )
            time.sleep(0.2)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'c4stream_events_in_total{stage="archiver"}' in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    # --- no corrupt file, no temp file visible to the readers
    files = sorted(out.rglob("*.parquet"))
    for f in files:
        pq.ParquetFile(f).read()
    dataset = ds.dataset(out / "events", format="parquet", partitioning="hive")
    assert all(not Path(f).name.startswith(".") for f in dataset.files)
    assert sorted(dataset.files) == sorted(visible_event_files(out))
    assert not any(TEMP_SUFFIX in f for f in dataset.files)

    # --- duplicates before dedupe are within the bound
    table = open_dataset(out, "events").to_table()
    dups = count_duplicates(table)
    assert dups <= bound, (dups, bound)
    # and exactly the bound: each durable-but-uncommitted row is read again once
    assert dups == bound, (dups, bound)
    assert table.num_rows == len(events) + dups

    # --- dedupe through the CLI: --check fails while duplicates exist, then removes them
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "sinks.archive", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    check = cli("dedupe", str(out), "--check")
    assert check.returncode == (1 if dups else 0), check.stdout + check.stderr
    assert f"{dups} duplicates" in check.stdout.splitlines()[0]
    assert cli("dedupe", str(out)).returncode == 0
    assert cli("dedupe", str(out), "--check").returncode == 0

    # --- every produced event exactly once (by content and by Kafka position)
    table = open_dataset(out, "events").to_table()
    assert count_duplicates(table) == 0
    got = Counter(
        (
            r["job"],
            r["comm"],
            r["rank"],
            r["kind"],
            r["seq"] if r["kind"] == "op" else r["started"],
            r["ts_us"],
        )
        for r in table.select(
            ["job", "comm", "rank", "kind", "seq", "started", "ts_us"]
        ).to_pylist()
    )
    assert got == Counter(event_key(e) for e in events)
    parts = set(zip(table["job"].to_pylist(), table["hour"].to_pylist(), strict=True))
    assert {(j, h[-2:]) for j, h in parts} == {("arch-a", "15"), ("arch/b", "15"), ("arch/b", "16")}

    # --- DuckDB reads the same dataset
    con = duckdb.connect()
    n, keys, jobs = con.sql(
        f"select count(*), count(distinct (kafka_partition, kafka_offset, kafka_index)), "
        f"count(distinct job) from read_parquet('{out}/events/**/*.parquet', "
        "hive_partitioning=true)"
    ).fetchall()[0]
    assert (n, keys, jobs) == (len(events), len(events), 2)

    # --- verdicts and commands archived; malformed input went to the dead-letter topic
    assert open_dataset(out, "verdicts").count_rows() == len(vs)
    assert sorted(open_dataset(out, "isolations").to_table()["id"].to_pylist()) == sorted(
        c.id for c in cs
    )
    c = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"{prefix}dl",
            "auto.offset.reset": "earliest",
        }
    )
    c.subscribe([topics.deadletter])
    dead: dict[str, DeadLetter] = {}
    deadline = time.monotonic() + 20
    while len(dead) < 4 and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and not m.error():
            rec = DeadLetter.decode(m.value())
            dead[rec.source] = rec  # a re-delivered message after the kill counts once
    c.close()
    reasons = sorted(r.reason.split(":")[0] for r in dead.values())
    assert reasons == [
        "events message does not fit the archive schema",
        "events message does not fit the archive schema",
        "undecodable events message",
        "undecodable verdicts message",
    ], reasons
    assert all(r.stage == "archiver" for r in dead.values())
    print(
        f"events={len(events)} files={len(files)} dups_before={dups} bound={bound} "
        f"temps_after_kill={len(temps_after_kill)}"
    )
