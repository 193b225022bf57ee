"""The README's first command, end to end: the demo finds what was injected."""

from __future__ import annotations

import html as html_lib
import io
import re
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from rich.console import Console

from c4stream.demo.run import DemoConfig, run_demo
from streams.scoring import component_label


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_demo_finds_every_injected_fault_and_leaves_report_and_archive(
    kafka_bootstrap: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = io.StringIO()
    result = run_demo(
        DemoConfig(out_dir=tmp_path, speed=12.0, bootstrap=kafka_bootstrap),
        console=Console(file=out, width=120),
    )
    faults = result.truth["faults"]
    assert len(faults) == 3
    assert result.matched == len(faults), out.getvalue()
    assert result.false_isolations == 0, out.getvalue()
    assert all(c.dry_run for c in result.commands)

    # The chat stand-in got Alertmanager and Slack posts naming the isolated hosts.
    paths = {a["path"] for a in result.alerts}
    assert {"/alertmanager", "/slack"} <= paths
    posted = str([a["body"] for a in result.alerts])
    assert all(f["host"] in posted for f in faults)

    # The report names every decision; the archive holds the events, readable by pyarrow.
    assert result.report is not None
    html = result.report.read_text()
    assert all(c.host in html for c in result.commands) and "data:image/png" in html
    events = ds.dataset(tmp_path / "archive" / "events", format="parquet", partitioning="hive")
    assert events.count_rows() > 0
    assert "found 3/3 injected faults, 0 false isolations" in out.getvalue()

    # The loop is closed: every decision was isolated (dry run) and its job's restart
    # described — the requeue of the job found on the drained node — on the timeline.
    stages = {(s.cmd_id, s.stage): s for s in result.loop}
    for c in result.commands:
        iso, restart = stages[(c.id, "isolate")], stages[(c.id, "restart")]
        assert iso.status == "dry_run" and "scontrol update nodename=" + c.host in iso.detail
        assert restart.status == "dry_run" and "scontrol requeue" in restart.detail
        assert f"-w {c.host} -n {result.truth['job']}" in restart.detail
        assert c.ts_us <= iso.ts_us <= restart.ts_us
    assert "Closing the loop" in html and "scontrol requeue" in html

    # The report names components as the terminal does ("GPU 5", "NIC mlx5_1").
    assert {"<td>GPU 5</td>", "<td>NIC mlx5_1</td>"} <= set(re.findall(r"<td>[^<]*</td>", html))
    for c in result.commands:
        label = component_label(c.gpu, c.nic, c.peer_host, c.fault)
        assert f"<td>{html_lib.escape(label)}</td>" in html
    # No client library's own lines on the terminal: librdkafka's go to logs/demo.log.
    printed = capfd.readouterr()
    for text in (printed.out, printed.err, out.getvalue()):
        assert not re.search(r"^%\d\|\d+\.\d+\||rdkafka|idempotence PID", text, re.M), text
    assert (tmp_path / "logs" / "demo.log").exists()
