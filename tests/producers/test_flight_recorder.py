"""Flight Recorder reader on dumps in PyTorch's pickle and JSON formats; unsafe pickles refused."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from producers.events import OpEvent, ProgressEvent, decode_message, encode_message
from producers.formats.flight_recorder import (
    FlightRecorderError,
    load_flight_recorder_dump,
    rank_from_filename,
    read_flight_recorder,
    read_flight_recorder_snapshot,
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


class _Evil:
    """Unpickled, it would run ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.timeout(10)
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = Path.cwd() / "c4stream-PWNED"  # where the fixture's command would touch
    marker.unlink(missing_ok=True)
    path = DATA / "malicious" / "nccl_trace_rank_0"
    with pytest.raises(FlightRecorderError, match="refused to unpickle posix.system"):
        load_flight_recorder_dump(path)
    bad: list[BadLine] = []
    assert read_flight_recorder(path, job="j", on_bad=bad.append) == []
    assert len(bad) == 1 and bad[0].lineno == 0 and "refused" in bad[0].reason
    assert not marker.exists()
    # The same payload made here, its marker in tmp_path (independent of the checkout).
    fresh, made = tmp_path / "nccl_trace_rank_0", tmp_path / "PWNED"
    fresh.write_bytes(pickle.dumps({"version": "2.4", "entries": [_Evil(made)]}, protocol=2))
    with pytest.raises(FlightRecorderError, match="refused to unpickle posix.system"):
        load_flight_recorder_dump(fresh)
    assert not made.exists()
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


REAL = Path(__file__).parent / "data" / "real" / "torch-2.15-gloo"


def _real(case: str, moment: str, fmt: str) -> dict[int, list]:
    """Events per global rank of one real snapshot, read together."""
    files = sorted((REAL / case / moment / fmt).iterdir())
    bad: list[BadLine] = []
    read = read_flight_recorder_snapshot(files, job="j", on_bad=bad.append)
    out = {rank_from_filename(p): evs for p, evs in read}
    assert bad == []
    return out


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_gloo_dump_membership_comes_from_the_entries(fmt: str) -> None:
    """ProcessGroupGloo writes the same unusable pg_config on every rank; the groups'
    members come from which ranks' dumps hold their entries."""
    dump = load_flight_recorder_dump(REAL / "hang" / "during" / fmt / sorted(
        p.name for p in (REAL / "hang" / "during" / fmt).iterdir())[0])  # fmt: skip
    assert list(dump["pg_config"]) == [""]  # what torch 2.15 writes for gloo
    events = _real("hang", "during", fmt)
    groups: dict[str, set[tuple[int, int, int]]] = {}
    for rank, evs in events.items():
        for e in evs:
            groups.setdefault(e.comm, set()).add((rank, e.rank, e.nranks))
    # world, the pairs [0, 1] and [2, 3], the even ranks [0, 2] (tools/fr_capture)
    assert groups["0"] == {(r, r, 4) for r in range(4)}
    pairs = sorted(sorted(g) for name, g in groups.items() if name != "0")
    assert pairs == [[(0, 0, 2), (1, 1, 2)], [(0, 0, 2), (2, 1, 2)], [(2, 0, 2), (3, 1, 2)]]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_gloo_progress_from_enqueued_and_completed(fmt: str) -> None:
    """gloo keeps last_started_collective at -1: started is last_enqueued; the hung
    rank (2) is one behind; during the hang its peers have collective 61 in flight, after
    the timeout they count it as completed."""
    during = _real("hang", "during", fmt)
    after = _real("hang", "after_timeout", fmt)
    for snap, peers_completed in ((during, 60), (after, 61)):
        world = {r: [e for e in evs if isinstance(e, ProgressEvent) and e.comm == "0"][0]
                 for r, evs in snap.items()}  # fmt: skip
        assert (world[2].started, world[2].completed, world[2].inflight_op) == (60, 60, None)
        for r in (0, 1, 3):
            assert (world[r].started, world[r].completed) == (61, peers_completed)
    in_flight = [e for evs in during.values() for e in evs
                 if isinstance(e, ProgressEvent) and e.comm == "0" and e.inflight_op]  # fmt: skip
    assert {e.inflight_op for e in in_flight} == {"AllReduce"} and len(in_flight) == 3
    # retired entries are finished ops: enqueue time as ts_us, no kernel time (untimed)
    ops = [e for e in during[0] if isinstance(e, OpEvent) and e.comm == "0"]
    assert [e.seq for e in ops] == list(range(1, 61))
    assert {e.op for e in ops} == {"AllReduce", "Broadcast", "AllGather"}
    assert all(e.exec_us == 0.0 for e in ops) and ops[0].bytes == 4096 * 4


@pytest.mark.timeout(10)
def test_gloo_pickle_and_json_give_the_same_events() -> None:
    """The same ops and counters; the dump times differ (two dump calls, ms apart)."""

    def key(evs: dict[int, list]) -> list:
        return [
            (r, e.comm, e.seq, e.ts_us)
            if isinstance(e, OpEvent)
            else (r, e.comm, e.started, e.completed)
            for r, es in sorted(evs.items())
            for e in es
        ]

    assert key(_real("straggler", "end", "pickle")) == key(_real("straggler", "end", "json"))


@pytest.mark.timeout(10)
def test_one_gloo_dump_alone_says_what_is_missing() -> None:
    path = REAL / "healthy" / "end" / "pickle" / "comm_lib_trace_rank_0"
    bad: list[BadLine] = []
    events = read_flight_recorder(path, job="j", on_bad=bad.append)
    assert events == []
    assert len(bad) == 3 and all("read all ranks' dumps together" in b.reason for b in bad)


@pytest.mark.timeout(10)
def test_a_second_dump_of_a_rank_in_one_snapshot_is_reported(tmp_path: Path) -> None:
    d = tmp_path / "snap"
    shutil.copytree(REAL / "healthy" / "end" / "pickle", d)
    shutil.copyfile(REAL / "healthy" / "end" / "json" / "comm_lib_trace_rank_1.json",
                    d / "comm_lib_trace_rank_1.json")  # fmt: skip
    bad: list[BadLine] = []
    out = read_flight_recorder_snapshot(sorted(d.iterdir()), job="j", on_bad=bad.append)
    assert len(bad) == 1 and "second dump of rank 1" in bad[0].reason
    assert sum(len(evs) for _, evs in out) == sum(
        len(v) for v in _real("healthy", "end", "pickle").values()
    )


@pytest.mark.timeout(10)
def test_one_dump_alone_says_nothing_of_absent_peers(tmp_path: Path) -> None:
    from producers.formats.flight_recorder import read_snapshot_with_facts

    [path] = [p for p in _copy("pickle", tmp_path) if p.name.endswith("_3")]
    _, facts = read_snapshot_with_facts([path], job="j")
    assert facts.absent == {}
    _, facts = read_snapshot_with_facts(_copy("pickle", tmp_path)[:3], job="j")
    assert facts.absent == {3: "no dump"}  # ranks 0-2 read: the world's rank 3 is missing


@pytest.mark.timeout(10)
def test_the_published_real_nccl_dump_reads_as_pytorch_wrote_it() -> None:
    """The one real NCCL dump published with a licence to commit it (PyTorch's tutorial,
    BSD-3-Clause; data/flight_recorder/published/README.md): rank 0 of 2, version 2.3,
    timing off (completions discovered by the watchdog, no starts)."""
    path = DATA / "published" / "pytorch-tutorial-v2.3" / "nccl_trace_rank_0.json"
    ops, progress, bad = _events([path])
    assert bad == []
    [op] = ops
    assert (op.comm, op.nranks, op.rank, op.op, op.seq) == ("0", 2, 0, "AllReduce", 1)
    assert op.bytes == 3 * 4 * 4 and op.exec_us == 0.0  # float 3×4; no start: not timed
    assert op.ts_us == 1724779239975811724 // 1000  # the discovered completion
    [p] = progress
    # last_started_collective -1 (starts not recorded): the enqueued counter stands in
    assert (p.started, p.completed, p.inflight_op) == (2, 2, None)
    assert p.ts_us == 1724779239975811724 // 1000  # copied: the newest entry, not the mtime
