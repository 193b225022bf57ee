"""What the command line prints is meant for people and for grep (issue 9, defects 4, 5)."""

from __future__ import annotations

import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from c4stream.demo.run import _commands_view
from streams.commands import IsolationCommand

C4 = str(Path(sys.executable).parent / "c4stream")


def _run(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm"}
    return subprocess.run(
        [C4, *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )


@pytest.mark.parametrize(
    ("command", "table"),
    [
        (["exporter"], "[exporter]"),
        (["worker"], "[worker]"),
        (["actuate"], "[actuator]"),
        (["archive"], "[archive]"),
        (["replay"], "[kafka]"),
    ],
)
def test_help_keeps_bracketed_table_names(command: list[str], table: str) -> None:
    r = _run(*command, "--help", columns=200)
    assert r.returncode == 0, r.stderr
    assert table in r.stdout, r.stdout
    assert "(, )" not in r.stdout and "(,)" not in r.stdout


def test_bad_input_lines_are_never_wrapped(tmp_path: Path) -> None:
    # A long path in a narrow, non-interactive terminal: the line must stay whole.
    deep = tmp_path.joinpath(*(["a-rather-long-directory-name"] * 4))
    deep.mkdir(parents=True)
    trace = deep / "trace.jsonl"
    trace.write_bytes(b'{"kind": "op", "v": 1}\n')
    r = _run("detect", str(trace), "--out", str(tmp_path / "o.jsonl"), "-q", columns=40)
    assert r.returncode == 0, r.stderr
    bad = [line for line in r.stderr.splitlines() if line.startswith("bad input:")]
    assert len(bad) == 1, r.stderr
    assert f"{trace}:1:" in bad[0] and "missing required field" in bad[0], r.stderr


def test_demo_tables_name_components_whole_at_80_columns() -> None:
    """Issue 9, defect 7: the decision table showed "1" for mlx5_1 and "5" for GPU 5."""

    def cmd(i: int, **kw: object) -> IsolationCommand:
        return IsolationCommand(
            id=f"c{i}", ts_us=10_000_000 + i, job="j", host="node-012", action="cordon",
            confidence=0.93, reason="a long reason " * 8, evidence={}, **kw,
        )  # fmt: skip

    cmds = [
        cmd(1, fault="slow_nic", nic="mlx5_1"),
        cmd(2, fault="straggler", gpu=5),
        cmd(3, fault="slow_link", nic="mlx5_3", peer_host="node-002"),
    ]
    buf = StringIO()
    Console(file=buf, width=80, force_terminal=False).print(_commands_view(cmds, 0))
    text = buf.getvalue()
    assert "NIC mlx5_1" in text and "GPU 5" in text and "NIC mlx5_3 → node-002" in text, text
