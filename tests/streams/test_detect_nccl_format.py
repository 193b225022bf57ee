"""``c4stream detect`` on NCCL-backend Flight Recorder dumps of an 8-rank tensor ×
pipeline × data parallel job, written from PyTorch's format for dump versions 1.4 and
2.2 (pickle), 2.3, 2.4, 2.7 and 2.10 (pickle and JSON) (tools/fr_capture/nccl_format.py; not
captured: no GPU here). Truth and dump times from the fixtures' ``manifest.json``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from producers.formats.flight_recorder import read_snapshot_with_facts
from streams.detect import DetectResult, run_detect

DATA = Path(__file__).parents[1] / "producers" / "data" / "nccl_format"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
VERSIONS = ["v1.4", "v2.2", "v2.3", "v2.4", "v2.7", "v2.10"]
FORMATS = ["pickle", "json"]
PICKLE_ONLY = {"v1.4", "v2.2"}
VERSION_FORMATS = [
    (v, f) for v in VERSIONS for f in FORMATS if v not in PICKLE_ONLY or f == "pickle"
]
HANGS = ["crash", "wedged", "dp-hang", "pp-hang"]


def _copy(case: str, version: str, fmt: str, tmp_path: Path, dump_time: bool) -> Path:
    dst = tmp_path / case / version / fmt
    shutil.copytree(DATA / case / version / fmt, dst)
    ns = MANIFEST["cases"][case]["dump_time_ns"]
    for f in dst.iterdir():
        if dump_time:
            os.utime(f, ns=(ns, ns))
        else:
            os.utime(f)  # a copy: now, long after the dump
    return dst


def _detect(path: Path, tmp_path: Path) -> tuple[DetectResult, list]:
    bad: list = []
    res = run_detect([path], tmp_path / "c.jsonl", on_bad=bad.append)
    assert all("not a Flight Recorder dump" in b.reason for b in bad)
    return res, bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("version", "fmt"), VERSION_FORMATS)
@pytest.mark.parametrize("case", HANGS)
def test_culprit_named_and_nobody_else_isolated(
    case: str, version: str, fmt: str, tmp_path: Path
) -> None:
    res, _ = _detect(_copy(case, version, fmt, tmp_path, dump_time=True), tmp_path)
    culprit = MANIFEST["cases"][case]["culprit"]
    acting = [c for c in res.commands if c.action != "alert_only"]
    assert [(c.host, c.fault) for c in acting] == [(f"host-rank{culprit}", "noncomm_hang")]
    assert len(res.commands) == 1
    if case == "crash":
        assert "left no dump" in res.commands[0].reason
    if case == "wedged":
        assert "wrote an empty dump" in res.commands[0].reason


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("version", "fmt"), VERSION_FORMATS)
@pytest.mark.parametrize("case", HANGS)
def test_without_a_dump_time_only_alerts(case: str, version: str, fmt: str, tmp_path: Path) -> None:
    res, _ = _detect(_copy(case, version, fmt, tmp_path, dump_time=False), tmp_path)
    culprit = MANIFEST["cases"][case]["culprit"]
    assert [c.action for c in res.commands] == ["alert_only"]
    [cmd] = res.commands
    assert cmd.host == f"host-rank{culprit}"
    assert "dump time unknown" in cmd.reason and "--dump-time" in cmd.reason


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", HANGS)
def test_dump_time_given_isolates_again(case: str, tmp_path: Path) -> None:
    src = _copy(case, "v2.4", "pickle", tmp_path, dump_time=False)
    ns = MANIFEST["cases"][case]["dump_time_ns"]
    res = run_detect([src], tmp_path / "c.jsonl", dump_time_us=ns // 1000)
    culprit = MANIFEST["cases"][case]["culprit"]
    assert [(c.host, c.action != "alert_only") for c in res.commands] == [
        (f"host-rank{culprit}", True)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dump_time", [True, False])
@pytest.mark.parametrize("version", VERSIONS)
def test_healthy_gives_nothing(version: str, dump_time: bool, tmp_path: Path) -> None:
    res, _ = _detect(_copy("healthy", version, "pickle", tmp_path, dump_time), tmp_path)
    assert res.commands == []


@pytest.mark.timeout(30)
def test_groups_by_name_local_pg_ids_and_absent_ranks(tmp_path: Path) -> None:
    src = _copy("wedged", "v2.10", "json", tmp_path, dump_time=True)
    _, facts = read_snapshot_with_facts(sorted(p for p in src.iterdir()), job="j")
    assert facts.absent == {6: "empty dump"}
    dp = [g for g in facts.groups.values() if g.desc == "DATA_PARALLEL_GROUP"]
    assert sorted(g.members for g in dp) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert facts.p2p_recorded
    assert {(w.rank, w.peer, w.op) for w in facts.p2p_waits} == {(4, 6, "send"), (5, 7, "recv")}
    crash = _copy("crash", "v2.3", "pickle", tmp_path, dump_time=True)
    _, facts = read_snapshot_with_facts(sorted(crash.iterdir()), job="j")
    assert facts.absent == {5: "no dump"} and facts.dump_time_known


@pytest.mark.timeout(30)
def test_old_layouts_read_as_the_new_one(tmp_path: Path) -> None:
    """1.4 (seq_id, groups known only by their members), 2.2 (no pg_status) and 2.7
    (the dump's ``nccl_version``) give the same groups and the same collectives as 2.4."""

    def read(version: str) -> tuple[dict, set]:
        src = _copy("dp-hang", version, "pickle", tmp_path / version, dump_time=True)
        dumps = sorted(p for p in src.iterdir() if p.suffix != ".txt")
        got, facts = read_snapshot_with_facts(dumps, job="j")
        ops = {(e.rank, e.seq, e.op) for _, es in got for e in es if hasattr(e, "seq")}
        return {tuple(g.members) for g in facts.groups.values()}, ops

    groups, ops = read("v2.4")
    for version in ("v2.2", "v1.4", "v2.7"):
        g, o = read(version)
        assert g == groups and o == ops and len(ops) > 30, version


@pytest.mark.timeout(30)
def test_a_log_beside_the_dumps_is_skipped_with_one_line(tmp_path: Path) -> None:
    src = _copy("dp-hang", "v2.4", "pickle", tmp_path, dump_time=True)
    assert (src / "train_rank_logs.txt").exists()
    _, bad = _detect(src, tmp_path)
    assert [(Path(b.path).name, b.lineno) for b in bad] == [("train_rank_logs.txt", 0)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("given", ["1760000181.2", "2025-10-09T08:56:21.2Z", None, "soon"])
def test_cli_dump_time(given: str | None, tmp_path: Path) -> None:
    """``c4stream detect DIR --dump-time T`` on copied dumps: isolates with a time,
    alerts without one, refuses a time it cannot read."""
    import subprocess
    import sys

    src = _copy("dp-hang", "v2.4", "pickle", tmp_path, dump_time=False)
    out = tmp_path / "c.jsonl"
    cmd = [
        str(Path(sys.executable).parent / "c4stream"),
        "detect",
        str(src),
        "--out",
        str(out),
        "-q",
    ]
    if given is not None:
        cmd += ["--dump-time", given]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    if given == "soon":
        assert run.returncode != 0 and "neither ISO 8601 nor seconds" in run.stderr
        return
    assert run.returncode == 0, run.stderr
    assert "train_rank_logs.txt:0: not a Flight Recorder dump" in run.stderr
    [c] = [json.loads(x) for x in out.read_text().splitlines()]
    assert c["host"] == "host-rank2"
    assert (c["action"] == "alert_only") == (given is None)
