"""The run report names each command's component as the terminal table does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sinks.report import LoopStep, write_report
from streams.commands import IsolationCommand
from streams.scoring import component_label

pytestmark = pytest.mark.timeout(60)


def _cmd(id: str, **kw: object) -> IsolationCommand:
    base: dict[str, object] = dict(
        ts_us=30_000_000, job="j", host="node-003", fault="straggler", action="cordon",
        confidence=0.9, reason="r", evidence={}, dry_run=True,
    )  # fmt: skip
    base.update(kw)
    return IsolationCommand(id=id, **base)  # type: ignore[arg-type]


def test_components_read_gpu_nic_link_and_host(tmp_path: Path) -> None:
    cmds = [
        _cmd("a", gpu=5),
        # a slow NIC's command carries the GPU of the rank that saw it, too
        _cmd("b", ts_us=40_000_000, host="node-012", gpu=1, nic="mlx5_1", fault="slow_nic"),
        _cmd("c", ts_us=50_000_000, nic="mlx5_3", peer_host="node-002", fault="slow_link"),
        _cmd("d", ts_us=60_000_000, host="node-008", fault="noncomm_hang"),
    ]
    loop = [LoopStep(c.id, c.host, "isolate", c.ts_us + 1, "dry_run", "would drain") for c in cmds]
    page = write_report(tmp_path / "r.html", [], cmds, loop=loop).read_text()
    want = ["GPU 5", "NIC mlx5_1", "NIC mlx5_3 → node-002", "host"]
    # the same words as the terminal's table (component_label), in both tables
    assert [component_label(c.gpu, c.nic, c.peer_host, c.fault) for c in cmds] == want
    isolations = page.split("<h2>Timeline</h2>")[0]
    closing = page.split("<h2>Closing the loop</h2>")[1]
    for table in (isolations, closing):
        cells = re.findall(r"<td>([^<]*)</td>", table)
        assert all(w in cells for w in want), cells
        # never the bare number or device, nor the GPU of a NIC fault
        assert not {"5", "mlx5_1", "GPU 1"} & set(cells), cells
