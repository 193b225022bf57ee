"""``c4stream detect`` on one snapshot: real PyTorch Flight Recorder dumps (torch 2.15,
ProcessGroupGloo, written by tools/fr_capture/capture.py) and NCCL-format dumps.

The capture's own record (``captures.json``: which rank was made faulty, at which
collective) is the ground truth; the dumps' mtimes, which git does not keep, are put
back from it, as a dump on disk has them.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from producers.formats.flight_recorder import load_flight_recorder_dump
from producers.sources import open_sources
from streams.core import DetectConfig
from streams.core.snapshot import judge_snapshot
from streams.detect import DetectResult, run_detect

DATA = Path(__file__).parents[1] / "producers" / "data"
REAL = DATA / "real" / "torch-2.15-gloo"
NCCL = DATA / "flight_recorder"


def _capture(case: str) -> dict:
    return json.loads((REAL / "captures.json").read_text())[case]


def _snapshot(case: str, moment: str, fmt: str, tmp_path: Path, mtimes: bool = True) -> Path:
    """A copy of one snapshot directory, with the dump times (mtimes) it was written at."""
    src = REAL / case / moment / fmt
    dst = tmp_path / case / moment / fmt
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        if mtimes:
            ns = _capture(case)["file_mtime_ns"][f"{moment}/{f.name}"]
            os.utime(f, ns=(ns, ns))
        else:  # as a fresh copy or checkout has them: now, long after the dump
            os.utime(f)
    return dst


def _detect(path: Path, tmp_path: Path) -> DetectResult:
    res = run_detect([path], tmp_path / "commands.jsonl")
    assert res.n_bad == 0
    assert res.n_events > 0
    return res


def _acting(res: DetectResult) -> list:
    return [c for c in res.commands if c.action != "alert_only"]


FORMATS = ["pickle", "json"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("moment", ["mid", "end"])
def test_healthy_job_gives_no_command(moment: str, fmt: str, tmp_path: Path) -> None:
    res = _detect(_snapshot("healthy", moment, fmt, tmp_path), tmp_path)
    assert _acting(res) == [] and res.commands == []
    assert res.n_communicators == 4  # the world and three sub-groups, all read


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("moment", ["during", "after_timeout"])
@pytest.mark.parametrize("case", ["hang", "hang-8ranks", "hang-5ranks", "hang-subgroup"])
def test_hung_rank_is_named_non_communication_hang(
    case: str, moment: str, fmt: str, tmp_path: Path
) -> None:
    cap = _capture(case)
    res = _detect(_snapshot(case, moment, fmt, tmp_path), tmp_path)
    [cmd] = _acting(res)
    assert (cmd.host, cmd.fault) == (f"host-rank{cap['bad_rank']}", "noncomm_hang")
    if cap["hang_at_world_collective"]:
        assert f"collective {cap['hang_at_world_collective']}" in cmd.reason
    assert len(res.commands) == 1  # nothing else isolated or reported


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("case", "moment"),
    [
        ("straggler", "mid"),
        ("straggler", "end"),
        ("straggler-8ranks", "mid"),
        ("straggler-5ms", "mid"),
    ],
)
def test_late_rank_is_named_straggler(case: str, moment: str, fmt: str, tmp_path: Path) -> None:
    cap = _capture(case)
    res = _detect(_snapshot(case, moment, fmt, tmp_path), tmp_path)
    [cmd] = res.commands
    assert (cmd.host, cmd.fault, cmd.action) == (
        f"host-rank{cap['bad_rank']}",
        "straggler",
        "cordon",
    )
    assert "by enqueue times" in cmd.reason


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["hang", "straggler", "healthy"])
def test_pickle_and_json_snapshots_decide_alike(case: str, tmp_path: Path) -> None:
    moment = {"hang": "during", "straggler": "end", "healthy": "end"}[case]
    a = _detect(_snapshot(case, moment, "pickle", tmp_path), tmp_path / "a")
    b = _detect(_snapshot(case, moment, "json", tmp_path), tmp_path / "b")
    assert [(c.host, c.fault, c.reason) for c in a.commands] == [
        (c.host, c.fault, c.reason) for c in b.commands
    ]
    assert a.n_events == b.n_events


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["hang", "hang-8ranks", "hang-5ranks", "hang-subgroup"])
def test_after_timeout_needs_no_clock(case: str, fmt: str, tmp_path: Path) -> None:
    """Copied dumps (mtimes far from the entries, so no dump time is trusted): the peers
    counting a collective as completed that the hung rank never entered still name it."""
    res = _detect(_snapshot(case, "after_timeout", fmt, tmp_path, mtimes=False), tmp_path)
    [cmd] = _acting(res)
    assert (cmd.host, cmd.fault) == (f"host-rank{_capture(case)['bad_rank']}", "noncomm_hang")


@pytest.mark.timeout(30)
def test_during_hang_without_a_dump_time_alerts_who_is_missing(tmp_path: Path) -> None:
    """Without a trusted dump time, peers sitting in collective 61 may have waited 1 ms
    or an hour: who is missing is said, as an alert that says why it does not isolate."""
    res = _detect(_snapshot("hang", "during", "pickle", tmp_path, mtimes=False), tmp_path)
    [cmd] = res.commands
    assert (cmd.host, cmd.action) == ("host-rank2", "alert_only")
    assert "collective 61: ranks {2} missing" in cmd.reason
    assert "dump time unknown" in cmd.reason and "--dump-time" in cmd.reason


# --- NCCL format: started/completed states, durations ------------------------------------
T0_US = 1_750_000_000_000_000


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("wait_s", "expect"), [(1.0, False), (10.0, True)])
def test_nccl_format_hang_decided_once_peers_waited_past_the_threshold(
    wait_s: float, expect: bool, tmp_path: Path
) -> None:
    """The NCCL-format fixture: rank 2 never started collective 5, its peers did at
    T0+5 s. Dumped 1 s later that is within what a job does; 10 s later it is a hang,
    and one snapshot is enough (the settle delay no longer blocks the command)."""
    dst = tmp_path / "nccl"
    shutil.copytree(NCCL / "pickle", dst)
    t = int((T0_US + 5_000_000 + wait_s * 1e6) * 1000)
    for f in dst.iterdir():
        os.utime(f, ns=(t, t))
    res = _detect(dst, tmp_path)
    if expect:
        [cmd] = _acting(res)
        assert (cmd.host, cmd.fault) == ("host-rank2", "noncomm_hang")
        assert "collective 5" in cmd.reason
    else:
        assert res.commands == []


def _nccl_dumps(tmp_path: Path, late_rank: int, n_ranks: int = 6, n_coll: int = 40) -> Path:
    """NCCL-format dumps of a bulk-synchronous job with per-op durations: rank
    ``late_rank`` arrives 20 ms late at each collective, so its kernel time is the
    shortest and its peers' include the 20 ms they waited for it."""
    base = load_flight_recorder_dump(NCCL / "pickle" / "nccl_trace_rank_0")
    template = base["entries"][0]
    out = tmp_path / "nccl_straggler"
    out.mkdir()
    for r in range(n_ranks):
        entries = []
        for k in range(1, n_coll + 1):
            arrive = T0_US * 1000 + k * 100_000_000 + (20_000_000 if r == late_rank else r * 50_000)
            end = T0_US * 1000 + k * 100_000_000 + 20_000_000 + 3_000_000
            e = dict(template)
            e.update(collective_seq_id=k, op_id=k, record_id=k - 1, state="completed",
                     time_created_ns=arrive - 1_000, time_discovered_started_ns=arrive,
                     time_discovered_completed_ns=end, duration_ms=(end - arrive) / 1e6,
                     retired=True)  # fmt: skip
            entries.append(e)
        dump = {**base, "entries": entries,
                "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                    "ranks": str(list(range(n_ranks)))}},
                "pg_status": {"0": {"last_enqueued_collective": n_coll,
                                    "last_started_collective": n_coll,
                                    "last_completed_collective": n_coll}}}  # fmt: skip
        path = out / f"nccl_trace_rank_{r}"
        path.write_bytes(pickle.dumps(dump, protocol=2))
        t = (T0_US + (n_coll + 1) * 100_000) * 1000
        os.utime(path, ns=(t, t))
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("late_rank", [0, 4])
def test_nccl_format_straggler_from_durations(late_rank: int, tmp_path: Path) -> None:
    res = _detect(_nccl_dumps(tmp_path, late_rank), tmp_path)
    [cmd] = res.commands
    assert (cmd.host, cmd.fault) == (f"host-rank{late_rank}", "straggler")
    assert "kernel time" in cmd.reason  # judged from within-rank durations, no clock


@pytest.mark.timeout(30)
def test_snapshot_judge_needs_every_rank_for_a_straggler(tmp_path: Path) -> None:
    """Two ranks cannot tell who is late (each is the other's only peer): no verdict."""
    res = _detect(_nccl_dumps(tmp_path, late_rank=1, n_ranks=2), tmp_path)
    assert res.commands == []
    assert judge_snapshot([], DetectConfig()) == []


@pytest.mark.timeout(30)
def test_dumps_in_per_host_directories_are_one_snapshot(tmp_path: Path) -> None:
    """Dumps gathered one directory per host (no rank in common) are one moment; two
    moments side by side (a rank in common) stay two snapshots."""
    snap = _snapshot("hang", "during", "pickle", tmp_path)
    root = tmp_path / "gathered"
    for f in sorted(snap.iterdir()):
        host = "node-a" if f.name[-1] in "01" else "node-b"
        (root / "during" / host).mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, root / "during" / host / f.name)
    shutil.copytree(_snapshot("hang", "after_timeout", "pickle", tmp_path), root / "after")
    batches = list(open_sources([root]))
    assert len({b.snapshot for b in batches}) == 2
    world = [e for b in batches for e in b.events if e.comm == "0"]
    assert {e.nranks for e in world} == {4}  # membership seen across both host directories
    res = _detect(root, tmp_path)
    [cmd] = _acting(res)  # one host, one command (the cool-down joins both moments)
    assert (cmd.host, cmd.fault) == ("host-rank2", "noncomm_hang")


@pytest.mark.timeout(30)
def test_pickle_and_json_dumps_in_one_directory(tmp_path: Path) -> None:
    """As the capture writes them (and as a user may copy them): both formats of every
    rank side by side are two snapshots of one moment, not duplicate input."""
    mixed = tmp_path / "mixed"
    for fmt in FORMATS:
        for f in _snapshot("hang", "after_timeout", fmt, tmp_path).iterdir():
            mixed.mkdir(exist_ok=True)
            shutil.copy2(f, mixed / f.name)
    res = _detect(mixed, tmp_path)  # no bad lines
    [cmd] = res.commands
    assert (cmd.host, cmd.fault) == ("host-rank2", "noncomm_hang")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("case", "moment", "fault"),
    [("healthy", "mid", None), ("healthy", "end", None), ("straggler", "mid", "straggler"),
     ("straggler-5ms", "mid", "straggler")],
)  # fmt: skip
def test_without_dump_times_healthy_stays_quiet_and_stragglers_are_found(
    case: str, moment: str, fault: str | None, tmp_path: Path
) -> None:
    res = _detect(_snapshot(case, moment, "json", tmp_path, mtimes=False), tmp_path)
    assert [c.fault for c in res.commands] == ([fault] if fault else [])


@pytest.mark.timeout(30)
def test_inspector_2_30_layout_through_detect(tmp_path: Path) -> None:
    """NCCL 2.30 Inspector layout (many ops per communicator per dump): 0 bad lines."""
    res = run_detect([DATA / "inspector_2_30"], tmp_path / "c.jsonl")
    assert (res.n_bad, res.n_events) == (0, 2 * 4 * 3 * 10)
    assert res.commands == []  # a healthy job


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["all_reduce_barrier", "all_gather_single", "all_gather_v"])
def test_other_collective_names_end_without_the_member_too(name: str, tmp_path: Path) -> None:
    """A collective named as PyTorch's analyzer lists them (``all_reduce_barrier``,
    ``all_gather_single``…; torch/distributed/flight_recorder/components/types.py) cannot
    complete without every member either: the copied after-timeout hang (no dump time)
    still names rank 2, which never entered the world's collective 61."""
    src = _snapshot("hang", "after_timeout", "json", tmp_path, mtimes=False)
    for f in src.iterdir():
        f.write_text(f.read_text().replace('"gloo:all_reduce"', f'"gloo:{name}"'))
    res = run_detect([src], tmp_path / "c.jsonl")
    assert [(c.host, c.action) for c in res.commands] == [("host-rank2", "cordon_and_taint")]
    assert "61" in res.commands[0].reason
