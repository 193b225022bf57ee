"""Node exporter against the real broker: tailing, partial lines, rotation, truncation,
dead letters, and restarts (crash between polls, SIGTERM, SIGKILL) without loss or repeat."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from producers.events import decode_message
from producers.exporter import Exporter, ExporterConfig
from tests.kafka_helpers import consume


def _load_fixture_maker():  # tests/ is not a package: load the fixture writer by path
    import importlib.util

    path = Path(__file__).parent / "data" / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("c4_make_fixtures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


inspector_line = _load_fixture_maker().inspector_line

COMM_A = "0xaaaa"
COMM_B = "0xbbbb"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _line(comm: str, rank: int, sn: int, host: str = "node-001") -> bytes:
    return inspector_line(
        comm=comm, rank=rank, n_ranks=4, nnodes=2, host=host, pid=100 + rank,
        ts_us=1_750_000_000_000_000 + sn * 1000, coll="AllReduce", sn=sn, size=1 << 20,
        exec_us=500 + sn, algbw=10.0, busbw=15.0,
    ).encode()  # fmt: skip


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def _seqs(msgs: list) -> Counter:
    """(comm, rank, seq) of every event in the messages, with multiplicity."""
    return Counter((e.comm, e.rank, e.seq) for m in msgs for e in decode_message(m.value()))


def _config(directory: Path, bootstrap: str, topics: dict[str, str], **kw) -> ExporterConfig:
    return ExporterConfig(
        directory=directory,
        kafka=KafkaConfig(bootstrap=bootstrap),
        events_topic=topics["events"],
        deadletter_topic=topics["deadletter"],
        job="job-x",
        flush_timeout_s=15.0,
        **kw,
    )


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_tailing_appends_partial_rotation_truncation_and_dead_letters(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 4, "deadletter": 1})
    d = tmp_path / "nccl-inspector-77"
    d.mkdir()
    a = d / "node-001-pid100.log"
    b = d / "node-002-pid102.log"
    clock = FakeClock()
    ex = Exporter(_config(d, kafka_bootstrap, topics, rotate_grace_s=0.0), clock=clock)

    # 1. A new file: every line, one message per communicator per interval.
    _append(a, _line(COMM_A, 0, 1) + _line(COMM_B, 0, 1) + _line(COMM_A, 0, 2))
    ex.poll_once()  # interval not up yet: read and batched, nothing sent
    assert ex.stats.events == 3 and ex.stats.messages == 0
    clock.t += 1.0
    ex.poll_once()
    assert ex.stats.messages == 2 and ex.stats.delivered == 2

    # 2. Appends, with a partial last line that is not consumed until its newline.
    partial = _line(COMM_A, 0, 4)
    _append(a, _line(COMM_A, 0, 3) + partial[:30])
    ex.poll_once(publish=True)
    assert ex.stats.events == 4
    _append(a, partial[30:])
    ex.poll_once(publish=True)
    assert ex.stats.events == 5

    # 3. A second file, with one bad line among good ones.
    _append(b, _line(COMM_A, 2, 1, "node-002") + b'{"header": broken\n')
    _append(b, _line(COMM_A, 2, 2, "node-002"))
    ex.poll_once(publish=True)
    assert ex.stats.events == 7 and ex.stats.deadletters == 1

    # 4. Rotation: rename, the writer finishes its old file, a new file takes the name.
    os.rename(a, d / "node-001-pid100.log.1")
    _append(d / "node-001-pid100.log.1", _line(COMM_A, 0, 5))
    _append(a, _line(COMM_A, 0, 6) + _line(COMM_B, 0, 6))
    ex.poll_once(publish=True)
    assert ex.stats.events == 10
    ex.poll_once(publish=True)  # the drained rotated file is closed (grace 0)

    # 5. Truncation (copytruncate): read again from the start.
    with open(b, "wb") as fh:
        fh.write(_line(COMM_A, 2, 7, "node-002"))
    ex.poll_once(publish=True)
    assert ex.stats.events == 11
    ex.close()
    assert ex.stats.delivered == ex.stats.messages

    got = consume(kafka_bootstrap, topics["events"], expect=ex.stats.messages - 1)
    expected = Counter(
        [(COMM_A, 0, s) for s in (1, 2, 3, 4, 5, 6)]
        + [(COMM_B, 0, 1), (COMM_B, 0, 6)]
        + [(COMM_A, 2, s) for s in (1, 2, 7)]
    )
    assert _seqs(got) == expected
    # Keyed by communicator, one message per communicator per cycle.
    assert all({e.comm for e in decode_message(m.value())} == {m.key().decode()} for m in got)
    assert len(got) == 8  # per cycle: {A,B} {A} {A} {A} {A,B} {A}
    dead = consume(kafka_bootstrap, topics["deadletter"], expect=1)
    assert len(dead) == 1
    dl = DeadLetter.decode(dead[0].value())
    assert dl.source == f"{b}:2" and dl.stage == "exporter"
    assert dl.payload() == b'{"header": broken' and "malformed" in dl.reason.lower()


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_crash_between_polls_then_restart_neither_loses_nor_repeats(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 2, "deadletter": 1})
    d = tmp_path / "dumps"
    d.mkdir()
    state = tmp_path / "state" / "positions.json"
    f = d / "node-001-pid100.log"
    clock = FakeClock()
    cfg = _config(d, kafka_bootstrap, topics, state_file=state)

    ex1 = Exporter(cfg, clock=clock)
    for sn in range(1, 51):
        _append(f, _line(COMM_A, 0, sn) + _line(COMM_B, 1, sn))
        if sn % 10 == 0:
            ex1.poll_once(publish=True)
    assert state.exists()
    # Lines read but not yet published when the process dies: must not be lost.
    for sn in range(51, 61):
        _append(f, _line(COMM_A, 0, sn) + _line(COMM_B, 1, sn))
    ex1.poll_once(publish=False)
    assert ex1.stats.events == 120
    del ex1  # crash: no close(), nothing flushed or saved after the last cycle

    # Rotation while down: the old file keeps its tail, a new file appears.
    os.rename(f, d / "node-001-pid100.log.1")
    _append(d / "node-001-pid100.log.1", _line(COMM_A, 0, 61))
    _append(f, _line(COMM_A, 0, 62) + b"garbage\n")
    ex2 = Exporter(cfg, clock=clock)
    ex2.poll_once(publish=True)
    ex2.close()
    assert ex2.stats.events == 22 and ex2.stats.deadletters == 1

    got = consume(kafka_bootstrap, topics["events"], expect=10)
    expected = Counter(
        [(COMM_A, 0, s) for s in range(1, 63)] + [(COMM_B, 1, s) for s in range(1, 61)]
    )
    assert _seqs(got) == expected  # every line exactly once
    dead = consume(kafka_bootstrap, topics["deadletter"], expect=1)
    assert [DeadLetter.decode(m.value()).source for m in dead] == [f"{f}:2"]


def _start(d: Path, state: Path, bootstrap: str, topics: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable, "-c", "from c4stream.cli import main; main()", "exporter",
            "--dir", str(d), "--bootstrap", bootstrap, "--interval", "0.2",
            "--state-file", str(state), "--topic", topics["events"],
            "--deadletter-topic", topics["deadletter"], "--job", "j",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def _wait_events(bootstrap: str, topic: str, n_events: int, timeout: float = 30.0) -> Counter:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _seqs(consume(bootstrap, topic, expect=0, timeout=2.0))
        if sum(got.values()) >= n_events:
            return got
    raise AssertionError(f"fewer than {n_events} events arrived in {timeout}s")


@pytest.mark.kafka
@pytest.mark.timeout(150)
def test_exporter_process_sigterm_flushes_and_sigkill_between_polls_repeats_nothing(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 2, "deadletter": 1})
    d = tmp_path / "dumps"
    d.mkdir()
    state = tmp_path / "positions.json"
    f = d / "node-001-pid100.log"
    _append(f, b"".join(_line(COMM_A, 0, s) for s in range(1, 101)))

    p = _start(d, state, kafka_bootstrap, topics)
    try:
        _wait_events(kafka_bootstrap, topics["events"], 100)
        _append(f, b"".join(_line(COMM_A, 0, s) for s in range(101, 121)))
        time.sleep(0.1)
        p.send_signal(signal.SIGTERM)  # must flush what it has read before exiting
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0, out.decode()
    finally:
        if p.poll() is None:
            p.kill()
    _wait_events(kafka_bootstrap, topics["events"], 120)

    # Restart, let it settle, SIGKILL it between polls, restart again.
    _append(f, b"".join(_line(COMM_A, 0, s) for s in range(121, 151)))
    p = _start(d, state, kafka_bootstrap, topics)
    try:
        _wait_events(kafka_bootstrap, topics["events"], 150)
        time.sleep(0.5)  # the positions of the last cycle are saved right after its flush
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    _append(f, b"".join(_line(COMM_A, 0, s) for s in range(151, 161)))
    p = _start(d, state, kafka_bootstrap, topics)
    try:
        got = _wait_events(kafka_bootstrap, topics["events"], 160)
        time.sleep(1.0)
        got = _seqs(consume(kafka_bootstrap, topics["events"], expect=0, timeout=3.0))
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    assert got == Counter((COMM_A, 0, s) for s in range(1, 161))


@pytest.mark.kafka
@pytest.mark.timeout(60)
def test_full_local_queue_applies_backpressure_and_loses_nothing(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 2, "deadletter": 1})
    d = tmp_path / "dumps"
    d.mkdir()
    _append(d / "node-001-pid100.log", b"".join(_line(COMM_A, 0, s) for s in range(1, 301)))
    # One event per message and room for only 2 queued messages: produce() must wait.
    cfg = _config(d, kafka_bootstrap, topics, max_batch_events=1, queue_max_messages=2)
    ex = Exporter(cfg, clock=FakeClock())
    ex.poll_once(publish=True)
    ex.close()
    assert ex.stats.messages == 300 and ex.stats.delivered == 300
    assert ex._publisher.backpressure_waits > 0
    got = consume(kafka_bootstrap, topics["events"], expect=300)
    assert _seqs(got) == Counter((COMM_A, 0, s) for s in range(1, 301))


@pytest.mark.kafka
@pytest.mark.timeout(60)
def test_overlong_line_is_dead_lettered_and_the_rest_flows(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 1, "deadletter": 1})
    d = tmp_path / "dumps"
    d.mkdir()
    f = d / "node-001-pid100.log"
    _append(f, _line(COMM_A, 0, 1) + b"x" * 5000 + b"\n" + _line(COMM_A, 0, 2))
    cfg = _config(d, kafka_bootstrap, topics, max_bytes_per_file=1024)
    ex = Exporter(cfg, clock=FakeClock())
    for _ in range(10):
        ex.poll_once(publish=True)
    ex.close()
    assert ex.stats.events == 2 and ex.stats.deadletters == 1
    dead = consume(kafka_bootstrap, topics["deadletter"], expect=1)
    dl = DeadLetter.decode(dead[0].value())
    assert dl.source == f"{f}:2" and "longer than 1024 bytes" in dl.reason
    assert _seqs(consume(kafka_bootstrap, topics["events"], expect=1)) == Counter(
        [(COMM_A, 0, 1), (COMM_A, 0, 2)]
    )


@pytest.mark.kafka
@pytest.mark.timeout(60)
def test_stop_while_kafka_is_unreachable_then_resume_on_a_live_broker(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 1, "deadletter": 1})
    d = tmp_path / "dumps"
    d.mkdir()
    state = tmp_path / "positions.json"
    _append(d / "node-001-pid100.log", b"".join(_line(COMM_A, 0, s) for s in range(1, 41)))
    dead_cfg = ExporterConfig(
        directory=d,
        kafka=KafkaConfig(bootstrap="127.0.0.1:1"),  # nothing listens there
        events_topic=topics["events"],
        deadletter_topic=topics["deadletter"],
        state_file=state,
        max_batch_events=1,
        queue_max_messages=5,
        flush_timeout_s=1.0,
    )
    ex = Exporter(dead_cfg, clock=FakeClock())
    ex.request_stop()  # as the SIGTERM handler does: a full queue must not block forever
    t = time.monotonic()
    ex.poll_once(publish=True)
    ex.close()
    assert time.monotonic() - t < 10
    assert ex.stats.delivered == 0
    # Nothing was confirmed, so nothing is marked done...
    import json

    saved = json.loads(state.read_bytes())["files"]
    assert [p["offset"] for p in saved.values()] == [0]
    # ...and a restart against a live broker sends every line once.
    live = Exporter(_config(d, kafka_bootstrap, topics, state_file=state), clock=FakeClock())
    live.poll_once(publish=True)
    live.close()
    got = consume(kafka_bootstrap, topics["events"], expect=1)
    assert _seqs(got) == Counter((COMM_A, 0, s) for s in range(1, 41))


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_v4_2_dump_stats_records_are_neither_events_nor_dead_letters(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    """NCCL Inspector format v4.2 writes one dump_stats record per communicator and
    dump: nothing to publish, and not bad input either."""
    topics = make_topics({"events": 1, "deadletter": 1})
    d = tmp_path / "dumps"
    d.mkdir()
    src = Path(__file__).parent / "data" / "inspector_2_30" / "v4_2" / "nccl-inspector-7312"
    f = sorted(src.iterdir())[0]
    (d / f.name).write_bytes(f.read_bytes())
    n_stats = f.read_bytes().count(b'"dump_stats"')
    assert n_stats == 6
    ex = Exporter(_config(d, kafka_bootstrap, topics), clock=FakeClock())
    ex.poll_once(publish=True)
    ex.close()
    assert ex.stats.lines == 36 and ex.stats.events == 30 and ex.stats.deadletters == 0
    got = consume(kafka_bootstrap, topics["events"], expect=ex.stats.messages)
    assert sum(len(decode_message(m.value())) for m in got) == 30
    assert consume(kafka_bootstrap, topics["deadletter"], expect=0, timeout=2.0) == []
