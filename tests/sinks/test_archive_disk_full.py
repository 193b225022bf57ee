"""The archiver on a full filesystem: it holds, never exits, loses nothing, leaves no temp.

Issue 25's probe: with the archive filesystem full the archiver lost nothing but exited
once with an OSError traceback before retrying, and left 5 ``.inprogress`` files. Here
the archive is a real, small tmpfs (mounted by the test; it skips where mounting is not
allowed) filled up by a ballast file while the archiver runs as its own process against
the real broker; then the ballast is removed.
"""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from confluent_kafka import Producer, TopicPartition

from c4base.kafka import KafkaConfig
from c4base.topics import Topics
from compose.local_broker import create_topics
from producers.events import encode_message
from sinks.archive.dedupe import count_duplicates, drop_duplicates, open_dataset
from sinks.archive.writer import TEMP_SUFFIX
from tests.sinks.test_archive_kafka import (
    committed,
    ends,
    start_archiver,
    trace_messages,
)

SIZE_MB = 4


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of SIZE_MB mounted at tmp_path/fs (needs root and mount rights)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path, leave_bytes: int) -> Path:
    """A ballast file taking all but about ``leave_bytes`` of the filesystem."""
    import os

    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    ballast = path / "ballast"
    with ballast.open("wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
    return ballast


def test_the_writer_on_a_full_filesystem_drops_its_files_and_holds_their_offsets(
    small_fs: Path,
) -> None:
    """No Kafka: the DatasetWriter on the real small filesystem. The failing write
    raises OSError (ENOSPC); discard() leaves no temp; the dropped rows' lowest offsets
    stay pending until forget_lost(); once there is space it writes again."""
    from sinks.archive.schemas import EVENTS
    from sinks.archive.writer import DatasetWriter, RollPolicy
    from tests.sinks.test_archive_writer import batch, make_events

    w = DatasetWriter(small_fs / "events", EVENTS, RollPolicy(row_group_bytes=1))
    ballast = fill(small_fs, leave_bytes=8_000)
    rows = batch(make_events(4000), partition=3, offset0=100, per_msg=10)
    with pytest.raises(OSError) as err:
        for i in range(0, rows.table.num_rows, 200):  # row groups until the disk is full
            w.write(rows.table.slice(i, 200), rows.jobs.slice(i, 200))
        w.close_all()
    assert "No space left" in str(err.value) or err.value.errno == 28
    w.discard()
    assert list(small_fs.rglob(f"*{TEMP_SUFFIX}")) == [] and w.open_files == 0
    assert w.pending_offsets() == {("c4.events", 3): 100}  # nothing committed past it
    w.forget_lost()
    assert w.pending_offsets() == {}
    ballast.unlink()
    w.write(rows.table, rows.jobs)
    [path] = w.close_all()
    assert pq.ParquetFile(path).metadata.num_rows == 4000


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_a_full_archive_filesystem_holds_and_resumes(
    kafka_bootstrap: str, small_fs: Path, tmp_path: Path
) -> None:
    prefix = f"full{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix=prefix)
    create_topics(
        kafka_bootstrap,
        {topics.events: 2, topics.verdicts: 1, topics.isolations: 1, topics.deadletter: 1},
    )
    msgs = trace_messages()
    events = [e for m in msgs for e in m]
    producer = Producer(KafkaConfig(bootstrap=kafka_bootstrap).producer_config(**{"linger.ms": 5}))
    for m in msgs:
        producer.produce(topics.events, encode_message(m), key=m[0].comm)
        producer.poll(0)
    assert producer.flush(30) == 0

    out, log = small_fs / "archive", tmp_path / "archiver.log"
    out.mkdir()
    ballast = fill(small_fs, leave_bytes=40_000)  # a few files fit, then ENOSPC
    group = f"{prefix}archive"
    proc = start_archiver(kafka_bootstrap, prefix, out, log)
    tps = [TopicPartition(topics.events, p) for p in range(2)]
    try:
        deadline = time.monotonic() + 60
        while "filesystem full" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "never full:\n" + log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(3.0)  # held through at least one retry
        assert proc.poll() is None, log.read_text()[-3000:]  # did not exit
        held_commits = committed(kafka_bootstrap, group, tps)
        ballast.unlink()  # space again
        want = ends(kafka_bootstrap, tps)
        deadline = time.monotonic() + 60
        while committed(kafka_bootstrap, group, tps) != want:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "did not catch up:\n" + log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    warned = [x for x in text.splitlines() if "WARNING" in x and "filesystem full" in x]
    assert len(warned) == 1, text[-3000:]  # one clear line, not one per retry
    assert "archive writable again" in text
    assert list(out.rglob(f"*{TEMP_SUFFIX}")) == []  # none left
    for f in out.rglob("*.parquet"):
        pq.ParquetFile(f).read()  # none torn
    table = open_dataset(out, "events").to_table()
    dups = count_duplicates(table)
    clean = drop_duplicates(table)
    assert clean.num_rows == len(events)  # 0 lost (each row once after the dedupe key)
    assert all(held_commits[(topics.events, p)] <= want[(topics.events, p)] for p in range(2))
    print(
        f"\narchive filesystem full ({SIZE_MB} MB tmpfs, ~40 KB free): {len(events)} events, "
        f"0 lost, {dups} duplicate rows before dedupe (0 after), no traceback, no temp left"
    )
