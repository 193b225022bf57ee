"""open_source: recognises traces, Inspector directories and Flight Recorder dumps by content."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from producers.events import OpEvent, ProgressEvent, encode_message
from producers.sources import SourceError, iter_source_events, open_source, open_sources, sniff
from producers.traces import BadLine, TraceWriter

DATA = Path(__file__).parent / "data"
INSPECTOR = DATA / "inspector" / "nccl-inspector-4242"


def _ev(i: int) -> ProgressEvent:
    return ProgressEvent(
        v=1, job="j", comm=f"c{i % 2}", nranks=2, rank=i % 2, host="h", ts_us=1000 * i,
        started=i, completed=i,
    )  # fmt: skip


@pytest.mark.timeout(10)
def test_sniff_by_content_not_name(tmp_path: Path) -> None:
    assert sniff(INSPECTOR / "node-001-pid1001.log") == "inspector"
    assert sniff(DATA / "flight_recorder" / "pickle" / "nccl_trace_rank_0") == "flight_recorder"
    assert sniff(DATA / "flight_recorder" / "json" / "nccl_trace_rank_0.json") == "flight_recorder"
    renamed = tmp_path / "whatever.txt"
    shutil.copyfile(INSPECTOR / "node-001-pid1001.log", renamed)
    assert sniff(renamed) == "inspector"
    gz = tmp_path / "insp.log.gz"
    gz.write_bytes(gzip.compress((INSPECTOR / "node-001-pid1001.log").read_bytes()))
    assert sniff(gz) == "inspector"
    with TraceWriter(tmp_path / "t.jsonl.gz") as w:
        w.write([_ev(1)])
    assert sniff(tmp_path / "t.jsonl.gz") == "trace"


@pytest.mark.timeout(10)
def test_inspector_directory_is_merged_in_event_time() -> None:
    bad: list[BadLine] = []
    batches = list(open_source(INSPECTOR, on_bad=bad.append))
    ts = [b.ts_us for b in batches]
    assert ts == sorted(ts)
    assert len(batches) == 32 and all(len(b.events) == 1 and b.raw is None for b in batches)
    assert all(isinstance(b.events[0], OpEvent) for b in batches)
    assert {b.events[0].job for b in batches} == {"4242"}  # from nccl-inspector-<jobid>
    assert [(x.lineno, x.path.endswith("node-002-pid2001.log")) for x in bad] == [(3, True)]
    assert batches[0].source.endswith("node-001-pid1001.log:1")


@pytest.mark.timeout(10)
def test_trace_lines_keep_their_bytes_and_mixed_inputs_merge(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write([_ev(1), _ev(2)])
        w.write_raw(b'{"kind":"op"}')
        w.write(_ev(3))
    lines = path.read_bytes().splitlines()
    bad: list[BadLine] = []
    batches = list(open_sources([path, DATA / "flight_recorder" / "json"], on_bad=bad.append))
    trace = [b for b in batches if b.raw is not None]
    assert [b.raw for b in trace] == [lines[0], lines[2]]
    assert [b.source for b in trace] == [f"{path}:1", f"{path}:3"]
    assert len(bad) == 1 and bad[0].lineno == 2 and "missing required field" in bad[0].reason
    assert len([b for b in batches if b.events]) == 2 + 28  # + one facts batch per snapshot
    events = list(iter_source_events([path], job="x"))
    assert [e.ts_us for e in events] == [1000, 2000, 3000]


@pytest.mark.timeout(10)
def test_directory_with_flight_recorder_dumps_and_a_malicious_one(tmp_path: Path) -> None:
    d = tmp_path / "dumps"
    shutil.copytree(DATA / "flight_recorder" / "pickle", d)
    shutil.copyfile(DATA / "flight_recorder" / "malicious" / "nccl_trace_rank_0", d / "x_rank_9")
    bad: list[BadLine] = []
    events = [e for b in open_source(d, on_bad=bad.append, job="job7") for e in b.events]
    assert len(events) == 28 and {e.job for e in events} == {"job7"}
    assert len(bad) == 1 and bad[0].path.endswith("x_rank_9") and "refused" in bad[0].reason


@pytest.mark.timeout(10)
def test_unusable_paths_raise_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        list(open_source(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="empty directory"):
        list(open_source(tmp_path / "empty"))


SCHEMA = Path(__file__).parents[2] / "producers" / "contracts" / "collective-event.schema.json"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "path",
    [
        INSPECTOR,
        DATA / "flight_recorder" / "pickle",
        DATA / "flight_recorder" / "json",
    ],
    ids=["inspector", "flight_recorder_pickle", "flight_recorder_json"],
)
def test_every_reader_emits_what_the_contract_schema_accepts(path: Path) -> None:
    """One check over every reader, with the schema file as the oracle."""
    import json

    import jsonschema

    from producers.events import encode_message

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    bad: list[BadLine] = []
    batches = list(open_source(path, on_bad=bad.append, job="j"))
    assert batches
    for b in batches:
        doc = json.loads(encode_message(b.events))
        errors = list(validator.iter_errors(doc))
        assert not errors, (b.source, errors[0].message)
        assert b.source.rsplit(":", 1)[1].isdigit()
    for x in bad:  # bad input always says where and why
        assert x.path and x.lineno >= 0 and x.reason


@pytest.mark.timeout(30)
def test_one_trace_read_as_blocks_holds_the_events_of_its_lines(tmp_path: Path) -> None:
    """detect's read of a JSON-lines trace (open_sources(blocks=True)): the same events
    as the lines read one by one (within a line, grouped by communicator as an archived
    message is); a bad line is reported as ever, and lines whose values no column holds
    (a rank beyond int32) come as events, line by line."""
    big = OpEvent(v=1, job="j", comm="c0", nranks=2, rank=2**40, host="h", ts_us=5_500,
                  op="AllReduce", seq=1, bytes=8, exec_us=1.0)  # fmt: skip
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        for i in range(0, 40, 4):
            w.write([_ev(i), _ev(i + 1), _ev(i + 2), _ev(i + 3)])
        w.write_raw(b'{"kind":"op","v":1}')
    bad: list[BadLine] = []
    batches = list(open_sources([path], blocks=True, on_bad=bad.append))
    assert all(b.block is not None for b in batches)
    got = [e for b in batches for e in b.events]
    want = list(iter_source_events(path))
    assert sorted(map(encode_message, got)) == sorted(map(encode_message, want))
    assert [e.ts_us // 4000 for e in got] == [e.ts_us // 4000 for e in want]  # line order
    assert [x.lineno for x in bad] == [11] and "missing required field" in bad[0].reason
    with TraceWriter(path) as w:
        w.write([_ev(1)])
        w.write([big])
    batches = list(open_sources([path], blocks=True))
    assert [(b.block, list(b.events)) for b in batches] == [(None, [_ev(1)]), (None, [big])]
