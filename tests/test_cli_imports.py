"""Imports follow the command: `c4stream --help` and a Flight Recorder `detect` load only
what they use.

Each case runs the real CLI in a fresh interpreter and reads back the modules it
loaded: an import added at the top of a module the CLI reaches (river pulls in
scipy.stats, ~2 s; Faust, matplotlib, the Kubernetes client...) fails here, naming the
command and the library. CPU seconds are measured by bench/bench_cli.py, not here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SNAPSHOT = REPO / "tests/producers/data/real/torch-2.15-gloo/hang/after_timeout/pickle"
"""A real 4-rank Flight Recorder snapshot (torch 2.15, gloo) taken after rank 2 hung."""

# Run the app in-process, then report every top-level package it loaded.
_PROBE = """
import json, sys
from c4stream.cli import app
code = 0
try:
    app(sys.argv[2:], prog_name="c4stream")
except SystemExit as e:
    code = e.code or 0
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}, f)
"""

NEVER = {"river", "scipy", "sklearn", "matplotlib", "faust", "mode", "aiokafka", "kubernetes"}
"""Libraries no command below uses: the stream worker, the report, the actuator's
Kubernetes backend import them when they run."""
NOT_FOR_HELP = NEVER | {"pyarrow", "numpy", "confluent_kafka", "httpx", "prometheus_client"}
"""Help only lists commands and options: not even the Kafka client or numpy."""


def _loaded(tmp_path: Path, *argv: str) -> tuple[int, set[str]]:
    out = tmp_path / "modules.json"
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(out), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.exists(), proc.stderr
    got = json.loads(out.read_text())
    return got["code"], set(got["modules"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["detect", "--help"],
        ["worker", "--help"],
        ["actuate", "--help"],
        ["alert", "--help"],
        ["archive", "--help"],
        ["broker", "--help"],
        ["demo", "--help"],
        ["replay", "--help"],
        ["exporter", "--help"],
    ],
    ids=lambda a: " ".join(a),
)
def test_help_loads_no_implementation(tmp_path: Path, argv: list[str]) -> None:
    code, mods = _loaded(tmp_path, *argv)
    assert code == 0
    assert not mods & NOT_FOR_HELP, f"c4stream {' '.join(argv)} imported {mods & NOT_FOR_HELP}"
    assert "typer" in mods  # the probe did run the CLI


def test_snapshot_detect_loads_only_the_core(tmp_path: Path) -> None:
    out = tmp_path / "commands.jsonl"
    code, mods = _loaded(tmp_path, "detect", str(SNAPSHOT), "--out", str(out), "-q")
    assert code == 0
    # it did the work: the hung rank's host is taken out
    commands = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c["host"] for c in commands] == ["host-rank2"]
    # pyarrow too: a snapshot is neither the Parquet archive nor Arrow IPC
    unused = NEVER | {"pyarrow"}
    assert not mods & unused, f"c4stream detect (snapshot) imported {mods & unused}"
    assert {"numpy", "streams"} <= mods


def test_river_models_are_still_checked_when_named() -> None:
    """The other side of a lazy river: a config naming a model is still checked when
    loaded (not when the worker first builds it), and the default still builds."""
    from streams.core.config import DetectConfig, RiverConfig
    from streams.core.river_detector import RiverDetector

    assert RiverConfig(model="LODA").model == "LODA"
    for bad in ("NoSuchModel", "_private", "river.anomaly.HalfSpaceTrees"):
        with pytest.raises(ValueError, match="is not a river.anomaly detector"):
            RiverConfig(model=bad)
    d = RiverDetector(DetectConfig(detectors=["river"]))
    assert type(d.template).__name__ == "HalfSpaceTrees"
