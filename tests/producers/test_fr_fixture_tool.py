"""``tools/fr_capture/to_fixture.py``: a ``capture.py`` run becomes a committed set.

The committed torch 2.15 gloo dp-hang case is laid back out as ``capture.py`` leaves it
(``capture.json`` and one directory per moment with the pickle and JSON dumps side by
side, a log beside them) and converted: the set written must be byte for byte the one
committed, and ``c4stream detect`` on it must name the culprit. This is the path by
which dumps captured on a GPU machine (``--backend nccl``) become fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streams.detect import run_detect

ROOT = Path(__file__).parents[2]
SET = ROOT / "tests" / "producers" / "data" / "real" / "torch-2.15-gloo-3d"
TOOL = ROOT / "tools" / "fr_capture" / "to_fixture.py"


def _as_captured(case: str, tmp: Path) -> Path:
    meta = json.loads((SET / "captures.json").read_text())[case]
    cap = tmp / "capture" / case
    for moment in (SET / case).iterdir():
        (cap / moment.name).mkdir(parents=True)
        for f in moment.glob("*/*"):
            shutil.copyfile(f, cap / moment.name / f.name)
    (cap / "during" / "rank0.log").write_text("[rank0]: Watchdog caught collective timeout\n")
    (cap / "capture.json").write_text(json.dumps(meta, indent=1) + "\n")
    return cap


def _tree(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


@pytest.mark.timeout(60)
def test_a_capture_becomes_the_committed_layout_and_is_judged(tmp_path: Path) -> None:
    cap = _as_captured("dp-hang", tmp_path)
    out = tmp_path / "torch-x-gloo-3d"
    run = subprocess.run(
        [sys.executable, str(TOOL), str(cap), "--out", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "rank0.log: not a dump: left out" in run.stderr
    assert _tree(out / "dp-hang") == _tree(SET / "dp-hang")
    meta = json.loads((SET / "captures.json").read_text())["dp-hang"]
    assert json.loads((out / "captures.json").read_text()) == {"dp-hang": meta}

    snap = out / "dp-hang" / "during" / "pickle"
    for f in snap.iterdir():  # the dump times, as the tests put them back
        ns = meta["file_mtime_ns"][f"during/{f.name}"]
        os.utime(f, ns=(ns, ns))
    res = run_detect([snap], tmp_path / "c.jsonl")
    assert [(c.host, c.action) for c in res.commands] == [
        (f"host-rank{meta['bad_rank']}", "cordon_and_taint")
    ]


@pytest.mark.timeout(30)
def test_a_dump_without_its_time_is_refused(tmp_path: Path) -> None:
    cap = _as_captured("crash", tmp_path)
    meta = json.loads((cap / "capture.json").read_text())
    meta["file_mtime_ns"].pop(next(iter(meta["file_mtime_ns"])))
    (cap / "capture.json").write_text(json.dumps(meta))
    run = subprocess.run(
        [sys.executable, str(TOOL), str(cap), "--out", str(tmp_path / "set")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode != 0 and "no mtime in" in run.stderr
