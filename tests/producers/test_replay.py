"""Replay against the real broker: counts, keys, byte-identical lines, dead letters, pacing."""

from __future__ import annotations

import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.kafka_admin import create_topics
from c4base.topics import Topics
from c4stream.cli import app
from producers.events import OpEvent, ProgressEvent, decode_message
from producers.exporter import ExporterConfig
from producers.replay import ReplayConfig, replay
from producers.traces import TraceWriter
from tests.kafka_helpers import consume

DATA = Path(__file__).parent / "data"
T0 = 1_750_000_000_000_000


def _op(comm: str, rank: int, seq: int, ts: int) -> OpEvent:
    return OpEvent(
        v=1, job="j", comm=comm, nranks=4, rank=rank, host=f"node-{rank // 2:03d}",
        ts_us=ts, op="AllReduce", seq=seq, bytes=1 << 20, exec_us=100.0 + rank,
    )  # fmt: skip


def _write_trace(path: Path, seconds: float, lines_per_s: int = 10) -> tuple[int, int]:
    """A trace spanning ``seconds`` of event time; returns (good lines, events)."""
    n_lines = int(seconds * lines_per_s) + 1
    events = 0
    with TraceWriter(path) as w:
        for i in range(n_lines):
            ts = T0 + int(i * 1e6 / lines_per_s)
            comm = f"0xc{i % 3}"
            batch = [_op(comm, r, i, ts + r) for r in range(4)]
            if i % 5 == 0:
                batch.append(
                    ProgressEvent(
                        v=1,
                        job="j",
                        comm=comm,
                        nranks=4,
                        rank=0,
                        host="node-000",
                        ts_us=ts,
                        started=i,
                        completed=i,
                    )  # fmt: skip
                )
            w.write(batch)
            events += len(batch)
            if i == 3:
                w.write_raw(b'{"kind":"op","v":1}')  # bad: misses required fields
    return n_lines, events


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_replay_counts_keys_bytes_and_dead_letters(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 4, "deadletter": 1})
    trace = tmp_path / "t.jsonl.gz"
    n_lines, n_events = _write_trace(trace, seconds=3.0)
    cfg = ReplayConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        events_topic=topics["events"],
        deadletter_topic=topics["deadletter"],
        speed=None,
        progress=False,
    )
    stats = replay([trace], cfg)
    assert (stats.messages, stats.events, stats.bad) == (n_lines, n_events, 1)
    assert stats.ok and stats.delivered == n_lines

    got = consume(kafka_bootstrap, topics["events"], expect=n_lines)
    import gzip

    lines = [ln for ln in gzip.decompress(trace.read_bytes()).splitlines() if b'"seq"' in ln]
    assert Counter(m.value() for m in got) == Counter(lines)  # byte for byte
    for m in got:
        assert m.key().decode() == decode_message(m.value())[0].comm
    dead = consume(kafka_bootstrap, topics["deadletter"], expect=1)
    assert len(dead) == 1
    dl = DeadLetter.decode(dead[0].value())
    assert dl.source == f"{trace}:5" and dl.stage == "replay"
    assert dl.payload() == b'{"kind":"op","v":1}' and "missing required field" in dl.reason


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_replay_pacing_follows_speed(tmp_path: Path, kafka_bootstrap: str, make_topics) -> None:
    topics = make_topics({"events": 2, "deadletter": 1})
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, seconds=2.0)

    def run(speed: float | None) -> float:
        cfg = ReplayConfig(
            kafka=KafkaConfig(bootstrap=kafka_bootstrap),
            events_topic=topics["events"],
            deadletter_topic=topics["deadletter"],
            speed=speed,
            progress=False,
        )
        t = time.monotonic()
        stats = replay([trace], cfg)
        assert stats.ok
        return time.monotonic() - t

    run(None)  # warm-up: producer connection and metadata
    slow = run(1.0)
    fast = run(4.0)
    unpaced = run(None)
    assert 1.9 <= slow <= 3.5, slow
    assert 0.45 <= fast <= 1.3, fast
    assert unpaced < 1.5, unpaced


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_replay_inspector_directory_and_flight_recorder_via_cli(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 4, "deadletter": 1})
    insp = tmp_path / "nccl-inspector-4242"
    shutil.copytree(DATA / "inspector" / "nccl-inspector-4242", insp)
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "replay", str(insp), str(DATA / "flight_recorder" / "json"),
            "--bootstrap", kafka_bootstrap, "--speed", "max", "--no-progress",
            "--topic", topics["events"], "--deadletter-topic", topics["deadletter"],
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # 32 Inspector events + 28 Flight Recorder events; 1 truncated Inspector line.
    assert "60 events, 1 bad" in result.output
    n_messages = int(result.output.split("replayed ")[1].split(" messages")[0])
    got = consume(kafka_bootstrap, topics["events"], expect=n_messages)
    assert len(got) == n_messages
    events = [e for m in got for e in decode_message(m.value())]
    assert len(events) == 60
    for m in got:  # grouped per communicator: every event of a message has its key
        assert {e.comm for e in decode_message(m.value())} == {m.key().decode()}
    assert {e.job for e in events if isinstance(e, OpEvent) and e.comm.startswith("0x")} == {"4242"}
    hung = [e for e in events if isinstance(e, ProgressEvent) and e.comm == "0" and e.rank == 2]
    assert len(hung) == 1 and hung[0].started == 4


@pytest.mark.timeout(30)
def test_replay_cli_rejects_bad_speed_and_missing_path(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["replay", str(tmp_path), "--speed", "fast"])
    assert result.exit_code != 0 and "--speed" in result.output
    result = runner.invoke(
        app, ["replay", str(tmp_path / "nope"), "--speed", "max", "--bootstrap", "127.0.0.1:1"]
    )
    assert result.exit_code == 2 and "no such file" in " ".join(result.output.split())


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_replay_of_a_simulator_trace_matches_its_counts(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    import msgspec

    from producers.simulator import SCENARIOS, with_gpus, write_trace

    topics = make_topics({"events": 8, "deadletter": 1})
    cfg = msgspec.structs.replace(with_gpus(SCENARIOS["healthy"], 128), duration_s=5, seed=1)
    written = write_trace(cfg, tmp_path / "sim.jsonl.gz", tmp_path / "truth.json")
    rc = ReplayConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        events_topic=topics["events"],
        deadletter_topic=topics["deadletter"],
        speed=None,
        progress=False,
    )
    stats = replay([tmp_path / "sim.jsonl.gz"], rc)
    assert (stats.messages, stats.events, stats.bad) == (written.lines, written.events, 0)
    assert stats.ok
    got = consume(kafka_bootstrap, topics["events"], expect=written.lines)
    assert len(got) == written.lines
    assert sum(len(decode_message(m.value())) for m in got) == written.events


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_replay_and_exporter_follow_the_shared_topic_prefix(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    """``[kafka] topic_prefix`` is shared: the producers write where the worker reads
    (issue 9, defect 1: they wrote to the unprefixed c4.events)."""
    prefix = f"pfx{uuid.uuid4().hex[:6]}."
    topics = Topics(prefix=prefix)
    create_topics(kafka_bootstrap, {topics.events: 2, topics.deadletter: 1})
    cfg_file = tmp_path / "c4stream.toml"
    cfg_file.write_text(f'[kafka]\nbootstrap = "{kafka_bootstrap}"\ntopic_prefix = "{prefix}"\n')
    trace = tmp_path / "t.jsonl"
    n_lines, _ = _write_trace(trace, seconds=1.0, lines_per_s=5)
    result = CliRunner().invoke(
        app, ["replay", str(trace), "--config", str(cfg_file), "--speed", "max", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert len(consume(kafka_bootstrap, topics.events, expect=n_lines)) == n_lines
    exporter = ExporterConfig(directory=tmp_path, kafka=KafkaConfig(topic_prefix=prefix))
    assert (exporter.events_topic, exporter.deadletter_topic) == (
        topics.events,
        topics.deadletter,
    )
