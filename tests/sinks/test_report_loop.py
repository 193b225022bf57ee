"""The run report's loop: fault → decision → isolation → job restart on one timeline."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

from sinks.report import LoopStep, write_report
from streams.commands import IsolationCommand

pytestmark = pytest.mark.timeout(60)


def test_loop_steps_are_drawn_and_tabled_per_decision(tmp_path: Path) -> None:
    cmd = IsolationCommand(
        id="c4-1", ts_us=30_000_000, job="j", host="node-003", gpu=5, fault="straggler",
        action="cordon", confidence=0.9, reason="node-003 GPU 5 <late>", evidence={},
        dry_run=True,
    )  # fmt: skip
    other = IsolationCommand(
        id="c4-2", ts_us=60_000_000, job="j", host="node-012", nic="mlx5_1",
        fault="slow_nic", action="cordon", confidence=0.9, reason="slow", evidence={},
    )  # fmt: skip
    truth = {
        "faults": [
            {"host": "node-003", "start_us": 20_000_000, "expected_fault": "straggler"},
            {"host": "node-012", "start_us": 50_000_000, "expected_fault": "slow_nic"},
        ]
    }
    loop = [
        LoopStep("c4-1", "node-003", "isolate", 30_050_000, "dry_run", "would drain node-003"),
        LoopStep("c4-1", "node-003", "restart", 30_080_000, "dry_run", "would requeue <4242>"),
        LoopStep("c4-2", "node-012", "isolate", 60_010_000, "done", "drained node-012"),
        LoopStep("c4-2", "node-012", "restart", 60_020_000, "dry_skipped", "would skip: busy"),
    ]
    with_loop = write_report(tmp_path / "a.html", [], [cmd, other], truth=truth, loop=loop)
    without = write_report(tmp_path / "b.html", [], [cmd, other], truth=truth)
    html = with_loop.read_text()
    assert "Closing the loop" in html and "Closing the loop" not in without.read_text()
    # no lateness maps: times count from the first decision
    cell = r"<tr><td>(straggler|slow_nic) at (-?[0-9.]+)</td><td>([0-9.]+)</td>"
    assert re.findall(cell, html) == [("straggler", "-10.0", "0.0"), ("slow_nic", "20.0", "30.0")]
    assert "would requeue &lt;4242&gt;" in html  # escaped
    assert "<b>dry run</b> at 0.08" in html and "<b>dry skipped</b> at 30.02" in html
    pngs = re.findall(r'alt="timeline" src="data:image/png;base64,([^"]+)"', html)
    plain = re.findall(r'alt="timeline" src="data:image/png;base64,([^"]+)"', without.read_text())
    assert len(pngs) == len(plain) == 1
    assert base64.b64decode(pngs[0])[:4] == b"\x89PNG" and pngs[0] != plain[0]
