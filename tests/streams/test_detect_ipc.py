"""Arrow IPC files (and stream files) of events as an input of ``detect`` and ``replay``:
read as a Parquet file of events is (same validation, message order and columns), so the
same simulator trace as JSON lines, Parquet and Arrow IPC gives the same commands; bad
files are one bad line each; replay publishes every event to a real broker."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from c4base.kafka import KafkaConfig
from producers.columnar import content_type_of, decode_events
from producers.columnar import events_table as contract_table
from producers.events import Event
from producers.replay import ReplayConfig, replay
from producers.simulator import SCENARIOS, FaultSpec, write_trace
from producers.sources import open_source, open_sources, sniff
from producers.traces import BadLine, TraceLine, read_trace
from sinks.archive.tables import MessageSources
from sinks.archive.tables import events_table as archive_table
from streams.detect import run_detect
from tests.kafka_helpers import consume


def _write_ipc(table: pa.Table, path: Path, flavour: str, chunk: int = 5000) -> Path:
    """``table`` as an Arrow IPC file (``file``) or stream file (``stream``), in batches
    of ``chunk`` rows."""
    new = pa.ipc.new_file if flavour == "file" else pa.ipc.new_stream
    with new(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=chunk)
    return path


def _lines(trace: Path) -> list[list[Event]]:
    return [list(x.events) for x in read_trace(trace) if isinstance(x, TraceLine)]


def _with_origin(trace: Path) -> pa.Table:
    """The trace's lines with Kafka origin columns, one line per message, as the
    archiver writes them (one partition: offsets in trace order)."""
    lines = _lines(trace)
    msgs = [(0, k, ln[0].ts_us // 1000, len(ln)) for k, ln in enumerate(lines)]
    events = [e for ln in lines for e in ln]
    return archive_table(events, MessageSources.build("c4.events", msgs)).table


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A straggler and a link hang (the hang detector follows progress connections)."""
    d = tmp_path_factory.mktemp("ipc")
    cfg = msgspec.structs.replace(
        SCENARIOS["healthy"], job="ipc", hosts=8, duration_s=44, seed=11,
        faults=[
            FaultSpec(kind="straggler", host=2, gpu=5, start_s=8, severity=1.5),
            FaultSpec(kind="link_hang", host=6, nic=3, peer_host=7, start_s=28),
        ],
    )  # fmt: skip
    write_trace(cfg, d / "trace.jsonl.gz", d / "truth.json")
    return d / "trace.jsonl.gz"


@pytest.fixture(scope="module")
def from_json(trace: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("ipc-json") / "commands.jsonl"
    res = run_detect([trace], out)
    assert {c.fault for c in res.commands} >= {"comm_hang"}, "the link hang is isolated"
    assert {c.host for c in res.commands} >= {"node-002", "node-006"}, "and the straggler"
    return out.read_bytes()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flavour", ["file", "stream"])
def test_ipc_with_kafka_origin_gives_the_commands_of_the_trace(
    trace: Path, from_json: bytes, tmp_path: Path, flavour: str
) -> None:
    """With origin columns the messages are the trace's lines, as in the archive (whose
    rows have no `job`: it comes from the `job=` directory, as for Parquet)."""
    table = _with_origin(trace)
    assert "job" not in table.column_names
    d = tmp_path / "job=ipc"
    d.mkdir()
    pq.write_table(table, d / "events.parquet")
    f = _write_ipc(table, tmp_path / "job=ipc" / f"events.{flavour}", flavour)
    assert sniff(f) == "arrow_ipc"
    bad: list[BadLine] = []
    res = run_detect([f], tmp_path / "from-ipc.jsonl", on_bad=bad.append)
    run_detect([d / "events.parquet"], tmp_path / "from-parquet.jsonl")
    assert bad == []
    assert res.n_events == sum(map(len, _lines(trace)))
    assert (tmp_path / "from-ipc.jsonl").read_bytes() == from_json
    assert (tmp_path / "from-parquet.jsonl").read_bytes() == from_json


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flavour", ["file", "stream"])
def test_plain_ipc_of_events_reads_as_plain_parquet(
    trace: Path, from_json: bytes, tmp_path: Path, flavour: str
) -> None:
    """Without origin columns: one message per communicator per second, as plain
    Parquet of events is cut; both give the same messages, and the trace's commands."""
    table = contract_table([e for ln in _lines(trace) for e in ln])
    pq.write_table(table, tmp_path / "plain.parquet")
    f = _write_ipc(table, tmp_path / f"plain.{flavour}", flavour, chunk=777)
    from_pq = [list(b.events) for b in open_source(tmp_path / "plain.parquet")]
    from_ipc = [list(b.events) for b in open_source(f)]
    assert from_ipc == from_pq
    assert all(len({e.comm for e in m}) == 1 for m in from_ipc)
    assert all(len({e.ts_us // 1_000_000 for e in m}) == 1 for m in from_ipc)
    run_detect([tmp_path / "plain.parquet"], tmp_path / "pq.jsonl")
    res = run_detect([f], tmp_path / "ipc.jsonl")
    assert res.commands, "the faults are found"
    assert (tmp_path / "ipc.jsonl").read_bytes() == (tmp_path / "pq.jsonl").read_bytes()
    assert (tmp_path / "ipc.jsonl").read_bytes() == from_json
    # in blocks (as detect reads it) and message by message: the same rows
    blocks = [b for b in open_sources([f], blocks=True)]
    assert all(b.block is not None for b in blocks)
    assert sum(b.block.n for b in blocks if b.block) == table.num_rows


def _events(trace: Path, n: int) -> list[Event]:
    return [e for ln in _lines(trace) for e in ln][:n]


def _bad_of(path: Path) -> list[BadLine]:
    bad: list[BadLine] = []
    got = list(open_source(path, on_bad=bad.append))
    assert got == [], "nothing is read from a bad file"
    return bad


@pytest.mark.parametrize("flavour", ["file", "stream"])
def test_bad_ipc_files_are_one_bad_line_each(trace: Path, tmp_path: Path, flavour: str) -> None:
    table = contract_table(_events(trace, 300))
    good = _write_ipc(table, tmp_path / "good", flavour, chunk=100)
    data = good.read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) * 2 // 3])
    bad = _bad_of(tmp_path / "cut")
    assert len(bad) == 1 and bad[0].lineno == 0 and bad[0].path == str(tmp_path / "cut")
    assert bad[0].reason.startswith("unreadable Arrow IPC file: "), bad[0].reason

    # an extension-typed column (a canonical one pyarrow knows: JSON over strings)
    host = table.column("host").combine_chunks()
    ext = pa.ExtensionArray.from_storage(pa.json_(pa.string()), host)
    t = table.set_column(table.schema.get_field_index("host"), "host", ext)
    bad = _bad_of(_write_ipc(t, tmp_path / "ext", flavour))
    assert len(bad) == 1 and "column `host` has extension type" in bad[0].reason
    assert "only plain Arrow types" in bad[0].reason

    # a schema that breaks the contract: `v` must be 1
    t = table.set_column(1, "v", pa.array([1, 2] + [1] * (table.num_rows - 2), pa.int8()))
    bad = _bad_of(_write_ipc(t, tmp_path / "v2", flavour))
    assert len(bad) == 1
    assert bad[0].reason.startswith("Arrow IPC events break the contract: ")
    assert "row 1, column `v`" in bad[0].reason
    # a column of the wrong type
    t = table.set_column(
        table.schema.get_field_index("rank"), "rank", pa.array(["x"] * table.num_rows)
    )
    bad = _bad_of(_write_ipc(t, tmp_path / "rank", flavour))
    assert len(bad) == 1 and "column `rank` must be" in bad[0].reason
    # not events at all
    bad = _bad_of(_write_ipc(pa.table({"a": [1, 2]}), tmp_path / "other", flavour))
    assert len(bad) == 1 and "Arrow IPC file is not an events archive" in bad[0].reason


def test_a_bad_ipc_file_loses_nothing_else(trace: Path, tmp_path: Path) -> None:
    """A directory with a good and a cut IPC file: the good one is read whole."""
    events = _events(trace, 400)
    d = tmp_path / "d"
    d.mkdir()
    _write_ipc(contract_table(events), d / "a.arrow", "file")
    data = _write_ipc(contract_table(events), tmp_path / "b", "stream").read_bytes()
    (d / "b.arrows").write_bytes(data[:-300])
    bad: list[BadLine] = []
    got = [e for b in open_sources([d], on_bad=bad.append) for e in b.events]
    key = msgspec.json.encode
    assert sorted(map(key, got)) == sorted(map(key, events))
    assert [b.path for b in bad] == [str(d / "b.arrows")]


@pytest.mark.kafka
@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire", ["json", "arrow"])
def test_replay_of_an_ipc_file_publishes_every_event(
    trace: Path, tmp_path: Path, kafka_bootstrap: str, make_topics, wire: str
) -> None:
    events = _events(trace, 3000)
    f = _write_ipc(contract_table(events), tmp_path / "events.arrow", "file", chunk=500)
    topics = make_topics({"events": 4, "deadletter": 1})
    cfg = ReplayConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        events_topic=topics["events"],
        deadletter_topic=topics["deadletter"],
        speed=None,
        progress=False,
        format=wire,  # type: ignore[arg-type]
    )
    stats = replay([f], cfg)
    assert stats.ok and stats.bad == 0 and stats.events == len(events)
    got = consume(kafka_bootstrap, topics["events"], expect=stats.messages)
    assert len(got) == stats.messages
    sent = [e for m in got for e in decode_events(m.value(), content_type_of(m.headers()))]
    for m in got:  # keyed by communicator, as every replayed message
        assert {e.comm for e in decode_events(m.value(), content_type_of(m.headers()))} == {
            m.key().decode()
        }
    key = msgspec.json.encode
    assert Counter(map(key, sent)) == Counter(map(key, events))
