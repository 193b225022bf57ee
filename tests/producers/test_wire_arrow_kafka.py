"""Exporter and replay publishing Arrow IPC batches through the real broker."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from c4base.kafka import KafkaConfig
from c4stream.cli import app
from producers.columnar import ARROW_CONTENT_TYPE, content_type_of, decode_arrow, decode_events
from producers.exporter import Exporter
from producers.replay import ReplayConfig, replay
from producers.simulator import SCENARIOS, with_gpus, write_trace
from producers.traces import iter_events
from tests.kafka_helpers import consume
from tests.producers.test_exporter import COMM_A, COMM_B, FakeClock, _append, _config, _line
from tests.streams.test_detect_archive import _archive


def _events(msgs: list) -> list:
    return [e for m in msgs for e in decode_events(m.value(), content_type_of(m.headers()))]


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_exporter_arrow_batches_carry_the_header_and_the_same_events_as_json(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    got = {}
    for fmt in ("json", "arrow"):
        topics = make_topics({"events": 4, "deadletter": 1})
        d = tmp_path / fmt / "nccl-inspector-77"
        d.mkdir(parents=True)
        ex = Exporter(_config(d, kafka_bootstrap, topics, format=fmt), clock=FakeClock())
        _append(d / "node-001-pid100.log", b"".join(_line(COMM_A, 0, s) for s in range(1, 6)))
        _append(d / "node-002-pid101.log", _line(COMM_B, 1, 1, "node-002") + b"{bad\n")
        ex.poll_once(publish=True)
        ex.close()
        assert ex.stats.delivered == ex.stats.messages == 3  # 2 batches + 1 dead letter
        msgs = consume(kafka_bootstrap, topics["events"], expect=2)
        assert len(msgs) == 2
        types = {content_type_of(m.headers()) for m in msgs}
        assert types == ({ARROW_CONTENT_TYPE.encode()} if fmt == "arrow" else {None})
        for m in msgs:  # one communicator per message, keyed by it
            comms = {e.comm for e in _events([m])}
            assert comms == {m.key().decode()}
            if fmt == "arrow":
                (cols,) = decode_arrow(m.value())
                assert cols.comm == m.key().decode()
        got[fmt] = sorted(_events(msgs), key=lambda e: (e.comm, e.rank, e.seq))
        assert len(consume(kafka_bootstrap, topics["deadletter"], expect=1)) == 1
    assert got["arrow"] == got["json"] and len(got["json"]) == 6


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_replay_arrow_sends_every_event_once_with_the_header(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 8, "deadletter": 1})
    cfg = msgspec.structs.replace(with_gpus(SCENARIOS["healthy"], 32), duration_s=3, seed=2)
    written = write_trace(cfg, tmp_path / "sim.jsonl.gz", tmp_path / "truth.json")
    rc = ReplayConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        events_topic=topics["events"],
        deadletter_topic=topics["deadletter"],
        speed=None,
        progress=False,
        format="arrow",
    )
    stats = replay([tmp_path / "sim.jsonl.gz"], rc)
    assert stats.ok and (stats.events, stats.bad) == (written.events, 0)
    msgs = consume(kafka_bootstrap, topics["events"], expect=stats.messages)
    assert len(msgs) == stats.messages
    assert all(content_type_of(m.headers()) == ARROW_CONTENT_TYPE.encode() for m in msgs)
    key = msgspec.json.encode
    assert Counter(map(key, _events(msgs))) == Counter(
        map(key, iter_events(tmp_path / "sim.jsonl.gz"))
    )


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_replay_of_the_parquet_archive_sends_its_events(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 8, "deadletter": 1})
    cfg = msgspec.structs.replace(with_gpus(SCENARIOS["healthy"], 16), duration_s=4, seed=6)
    written = write_trace(cfg, tmp_path / "sim.jsonl.gz", tmp_path / "truth.json")
    _archive(tmp_path / "sim.jsonl.gz", tmp_path / "archive")
    rc = ReplayConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        events_topic=topics["events"],
        deadletter_topic=topics["deadletter"],
        speed=None,
        progress=False,
    )
    stats = replay([tmp_path / "archive" / "events"], rc)
    assert stats.ok and (stats.events, stats.bad) == (written.events, 0)
    msgs = consume(kafka_bootstrap, topics["events"], expect=stats.messages)
    key = msgspec.json.encode
    assert Counter(map(key, _events(msgs))) == Counter(
        map(key, iter_events(tmp_path / "sim.jsonl.gz"))
    )


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_replay_cli_format_flag(tmp_path: Path, kafka_bootstrap: str, make_topics) -> None:
    topics = make_topics({"events": 2, "deadletter": 1})
    cfg = msgspec.structs.replace(with_gpus(SCENARIOS["healthy"], 16), duration_s=2, seed=1)
    written = write_trace(cfg, tmp_path / "t.jsonl", tmp_path / "truth.json")
    runner = CliRunner()
    bad = runner.invoke(app, ["replay", str(tmp_path / "t.jsonl"), "--format", "xml"])
    assert bad.exit_code == 2 and "--format" in bad.output
    result = runner.invoke(
        app,
        [
            "replay", str(tmp_path / "t.jsonl"), "--format", "arrow", "--speed", "max",
            "--no-progress", "--bootstrap", kafka_bootstrap,
            "--topic", topics["events"], "--deadletter-topic", topics["deadletter"],
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    msgs = consume(kafka_bootstrap, topics["events"], expect=written.lines)
    assert msgs and all(content_type_of(m.headers()) == ARROW_CONTENT_TYPE.encode() for m in msgs)
    assert len(_events(msgs)) == written.events
