"""Flight Recorder reader on dumps in PyTorch's pickle and JSON formats; unsafe pickles refused."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

from producers.events import OpEvent, ProgressEvent, decode_message, encode_message
from producers.formats.flight_recorder import (
    FlightRecorderError,
    load_flight_recorder_dump,
    read_flight_recorder,
)
from producers.traces import BadLine

DATA = Path(__file__).parent / "data" / "flight_recorder"
T0_US = 1_750_000_000_000_000


def _copy(kind: str, tmp_path: Path, mtime_us: int | None = T0_US + 6_000_000) -> list[Path]:
    """Copies with a known mtime (git does not keep the fixtures' mtimes)."""
    out = []
    for f in sorted((DATA / kind).iterdir()):
        dst = tmp_path / kind / f.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dst)
        if mtime_us is not None:
            os.utime(dst, ns=(mtime_us * 1000, mtime_us * 1000))
        out.append(dst)
    return out


def _events(paths: list[Path]) -> tuple[list[OpEvent], list[ProgressEvent], list[BadLine]]:
    bad: list[BadLine] = []
    events = [e for p in paths for e in read_flight_recorder(p, job="j", on_bad=bad.append)]
    ops = [e for e in events if isinstance(e, OpEvent)]
    progress = [e for e in events if isinstance(e, ProgressEvent)]
    return ops, progress, bad


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["pickle", "json"])
def test_hang_recorded_by_pytorch_shows_in_progress_events(kind: str, tmp_path: Path) -> None:
    ops, progress, bad = _events(_copy(kind, tmp_path))
    assert not bad
    default = {p.rank: p for p in progress if p.comm == "0"}
    assert set(default) == {0, 1, 2, 3}
    # Rank 2 never started collective 5; its peers sit in it.
    assert default[2].started == 4 and default[2].inflight_op is None
    for r in (0, 1, 3):
        p = default[r]
        assert (p.started, p.completed, p.inflight_op) == (5, 4, "AllReduce")
        # started at T0+5s+50us (+rank us); the dump is at the file's mtime, T0+6s
        assert p.inflight_us == pytest.approx(1_000_000 - 50 - r, abs=1)
        assert p.ts_us == T0_US + 6_000_000 and p.nranks == 4 and p.comm_name == "default_pg"
    tp = [p for p in progress if p.comm == "1"]
    assert sorted((p.rank, p.nranks, p.started, p.completed) for p in tp) == [
        (0, 2, 3, 3),
        (1, 2, 3, 3),
    ]
    # op events: collectives 1-4 of the default group on 4 ranks + 1-3 of the tp group on 2.
    assert len(ops) == 4 * 4 + 3 * 2
    first = [e for e in ops if e.comm == "0" and e.rank == 1 and e.seq == 1][0]
    assert first.op == "AllReduce" and first.bytes == 1024 * 1024 * 4
    assert first.exec_us == pytest.approx(7750.0)  # duration_ms 7.75
    assert first.host == "host-rank1"
    tp_op = [e for e in ops if e.comm == "1"][0]
    assert tp_op.op == "AllGather" and tp_op.bytes == 1024 * 1024 * 2  # BFloat16
    assert decode_message(encode_message([*ops, *progress])) == [*ops, *progress]


@pytest.mark.timeout(10)
def test_pickle_and_json_dumps_give_the_same_events(tmp_path: Path) -> None:
    a = _events(_copy("pickle", tmp_path))
    b = _events(_copy("json", tmp_path))
    assert a == b


@pytest.mark.timeout(10)
def test_copied_file_mtime_is_not_trusted(tmp_path: Path) -> None:
    paths = _copy("pickle", tmp_path, mtime_us=T0_US + 86_400_000_000)  # a day later
    _, progress, _ = _events(paths)
    # The dump time falls back to the newest timestamp inside the dump.
    assert all(p.ts_us < T0_US + 6_000_000 for p in progress)


@pytest.mark.timeout(10)
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = DATA.parent / "PWNED"
    marker.unlink(missing_ok=True)
    path = DATA / "malicious" / "nccl_trace_rank_0"
    with pytest.raises(FlightRecorderError, match="refused to unpickle posix.system"):
        load_flight_recorder_dump(path)
    bad: list[BadLine] = []
    assert read_flight_recorder(path, job="j", on_bad=bad.append) == []
    assert len(bad) == 1 and bad[0].lineno == 0 and "refused" in bad[0].reason
    assert not marker.exists()
    # Any class, not only os.system, is refused.
    evil = tmp_path / "nccl_trace_rank_1"
    evil.write_bytes(pickle.dumps({"entries": [Path("/")]}, protocol=2))
    with pytest.raises(FlightRecorderError, match="refused"):
        load_flight_recorder_dump(evil)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("nccl_trace_rank_0", b"\x80\x02}q\x00(X", "corrupt dump"),
        ("nccl_trace_rank_1", b"hello", "neither a pickle nor a JSON object"),
        ("nccl_trace_rank_2", pickle.dumps([1, 2], protocol=2), "expected a dict"),
        ("nccl_trace_rank_3", pickle.dumps({"a": 1}, protocol=2), "not a Flight Recorder"),
        ("dump", pickle.dumps({"entries": []}, protocol=2), "no rank at the end"),
    ],
)
def test_unreadable_dumps_are_reported(
    tmp_path: Path, name: str, content: bytes, reason: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    bad: list[BadLine] = []
    assert read_flight_recorder(path, job="j", on_bad=bad.append) == []
    assert len(bad) == 1 and reason in bad[0].reason, bad


@pytest.mark.timeout(10)
def test_missing_pg_config_is_reported_and_the_rest_kept(tmp_path: Path) -> None:
    dump = load_flight_recorder_dump(DATA / "pickle" / "nccl_trace_rank_0")
    del dump["pg_config"]["1"]
    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps(dump, protocol=2))
    bad: list[BadLine] = []
    events = read_flight_recorder(path, job="j", on_bad=bad.append)
    assert {e.comm for e in events} == {"0"}
    assert len(bad) == 1 and "no rank list in pg_config" in bad[0].reason
