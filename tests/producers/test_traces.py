"""JSON-lines traces: plain and gzip, batches, bad lines reported and skipped."""

from __future__ import annotations

import gzip
import tracemalloc
from pathlib import Path

import pytest

from producers.events import ProgressEvent, encode_message
from producers.traces import BadLine, TraceLine, TraceWriter, iter_events, read_trace


def _ev(i: int) -> ProgressEvent:
    return ProgressEvent(
        v=1,
        job="j",
        comm=f"c{i % 3}",
        nranks=8,
        rank=i % 8,
        host=f"h{i % 4}",
        ts_us=i,
        started=i,
        completed=i,
    )


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip_with_batches_and_bad_lines(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    with TraceWriter(path) as w:
        w.write(_ev(0))
        w.write([_ev(1), _ev(2)])
        w.write_raw(b'{"kind":"progress","v":1}')
        w.write_raw(b"")
        w.write([_ev(3)])
    items = list(read_trace(path))
    assert [type(i) for i in items] == [TraceLine, TraceLine, BadLine, TraceLine]
    bad = items[2]
    assert isinstance(bad, BadLine)
    assert bad.lineno == 3 and bad.path == str(path) and "required field" in bad.reason
    assert str(bad).startswith(f"{path}:3: ")
    bads: list[BadLine] = []
    assert list(iter_events(path, bads.append)) == [_ev(0), _ev(1), _ev(2), _ev(3)]
    assert len(bads) == 1
    if name.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"


def test_gzip_detected_by_content_not_name(tmp_path: Path) -> None:
    path = tmp_path / "trace.log"
    path.write_bytes(gzip.compress(encode_message(_ev(7)) + b"\n"))
    assert list(iter_events(path)) == [_ev(7)]


def test_truncated_gzip_reports_and_keeps_what_was_read(tmp_path: Path) -> None:
    whole = gzip.compress(b"".join(encode_message(_ev(i)) + b"\n" for i in range(2000)))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    items = list(read_trace(path))
    assert isinstance(items[-1], BadLine) and "gzip" in items[-1].reason
    good = [i for i in items if isinstance(i, TraceLine)]
    assert 0 < len(good) < 2000


def test_reading_streams_in_constant_memory(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl.gz"
    with TraceWriter(path) as w:
        for i in range(0, 60_000, 100):
            w.write([_ev(j) for j in range(i, i + 100)])
    tracemalloc.start()
    n = sum(1 for _ in iter_events(path))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n == 60_000
    # 60k events held at once would take tens of MB; a streaming read holds one line.
    assert peak < 2_000_000, peak
