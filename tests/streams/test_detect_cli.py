"""``c4stream detect`` end to end: real trace files in, command JSON lines out."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import msgspec
import pytest

from producers.simulator import SCENARIOS, FaultSpec, write_trace
from streams.commands import decode_command

SCHEMA = json.loads(
    (Path(__file__).parents[2] / "streams/contracts/isolation-command.schema.json").read_text()
)
C4 = [str(Path(sys.executable).parent / "c4stream")]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*C4, "detect", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def hang_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("detect")
    cfg = msgspec.structs.replace(
        SCENARIOS["healthy"], job="cli-hang", hosts=16, duration_s=45,
        faults=[FaultSpec(kind="link_hang", host=4, nic=2, peer_host=5, start_s=30)],
    )  # fmt: skip
    trace = d / "trace.jsonl"
    write_trace(cfg, trace, d / "truth.json")
    with open(trace, "ab") as fh:  # a bad line must be reported, counted and skipped
        fh.write(b'{"kind": "op", "v": 1}\n')
    return trace


@pytest.mark.timeout(120)
def test_detect_writes_contract_commands_and_reports_bad_lines(
    hang_trace: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cmds.jsonl"
    r = _run(str(hang_trace), "--out", str(out))
    assert r.returncode == 0, r.stderr
    lines = out.read_bytes().splitlines()
    cmds = [decode_command(line) for line in lines]
    for line in lines:
        jsonschema.validate(json.loads(line), SCHEMA)
    hits = [c for c in cmds if c.fault == "comm_hang" and c.host == "node-004"]
    assert hits and hits[0].nic == "mlx5_2" and hits[0].peer_host == "node-005"
    assert all(c.dry_run for c in cmds)
    n_lines = len(hang_trace.read_bytes().splitlines())
    assert f"{hang_trace}:{n_lines}:" in r.stderr and "missing required field" in r.stderr
    assert "1 bad" in r.stderr
    assert "comm_hang" in r.stdout and "node-004" in r.stdout  # the summary table


@pytest.mark.timeout(120)
def test_detect_is_deterministic_and_writes_gzip(hang_trace: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    assert _run(str(hang_trace), "--out", str(a), "-q").returncode == 0
    assert _run(str(hang_trace), "--out", str(b), "-q").returncode == 0
    assert a.read_bytes() == gzip.decompress(b.read_bytes()) and a.read_bytes()


@pytest.mark.timeout(60)
def test_detect_unreadable_input_fails_clearly(tmp_path: Path) -> None:
    r = _run(str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2
    assert "nope.jsonl" in r.stderr and "no such file" in r.stderr


def test_the_table_names_components_as_the_demo_does() -> None:
    """A NIC fault reads "NIC mlx5_1" (not "GPU 1, mlx5_1"), a straggler "GPU 5"."""
    from rich.console import Console

    from streams.commands import IsolationCommand
    from streams.detect import DetectResult, summary_table

    def cmd(fault: str, gpu: int | None, nic: str | None) -> IsolationCommand:
        return IsolationCommand(
            id=fault,
            ts_us=1,
            job="j",
            host="node-001",
            gpu=gpu,
            nic=nic,
            fault=fault,
            action="cordon",
            confidence=0.9,
            reason="r",
            evidence={},
        )

    res = DetectResult(commands=[cmd("slow_nic", 1, "mlx5_1"), cmd("straggler", 5, None)])
    console = Console(width=200, record=True)
    console.print(summary_table(res))
    text = console.export_text()
    assert "NIC mlx5_1" in text and "GPU 5" in text
    assert "GPU 1" not in text
