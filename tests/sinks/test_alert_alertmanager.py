"""The ``alertmanager_api`` target against a real Alertmanager (built by ``./run``) on loopback.

Checked through Alertmanager's own ``GET /api/v2/alerts`` (which lists active alerts
only): a warning verdict fires; the critical cordon that follows replaces it (the
warning does not stay active beside it — issue 13, defect 5); a refresh moves
``endsAt`` forward while firing; what the actuator reported shows on the alert; after
the resolve timeout the alert is gone. The old webhook-format target is refused by
Alertmanager (400), as the issue found.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from sinks.actuator.outcomes import new_report
from sinks.alert.alerter import Alerter
from sinks.alert.config import AlertConfig, Destination
from sinks.alert.samples import sample_command, sample_notification
from sinks.alert.targets import make_target
from streams.verdicts import Verdict
from tests.tools import free_port, require_tool

pytestmark = pytest.mark.timeout(60)

AM_CONFIG = """\
route:
  receiver: blackhole
  group_wait: 1s
receivers:
  - name: blackhole
"""


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """A real Alertmanager on 127.0.0.1 (no clustering); yields its base URL."""
    binary = require_tool("alertmanager")
    (tmp_path / "am.yml").write_text(AM_CONFIG)
    port = free_port()
    log = (tmp_path / "am.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'am.yml'}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",  # a single Alertmanager: no gossip port
            "--log.level=warn",
        ],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"alertmanager did not start: {(tmp_path / 'am.log').read_text()}"
                )
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def active(url: str) -> list[dict[str, Any]]:
    alerts = httpx.get(f"{url}/api/v2/alerts", params={"active": "true"}, timeout=5).json()
    return sorted(alerts, key=lambda a: a["labels"]["severity"])


def verdict(score: float, **kw: Any) -> Verdict:
    base: dict[str, Any] = dict(
        id="v1",
        ts_us=1,
        job="llm-pretrain-7b",
        comm="0xa",
        host="gpu-node-17",
        fault="straggler",
        score=score,
        reason="gpu-node-17 GPU 3 late in 0xa",
        window_start_us=0,
        window_end_us=1,
    )
    base.update(kw)
    return Verdict(**base)


def test_firing_escalation_refresh_outcome_and_resolution(alertmanager: str) -> None:
    cfg = AlertConfig(
        destination=[
            Destination(
                type="alertmanager_api",
                url=alertmanager,
                min_severity="info",
                refresh_interval_s=1.0,
            )
        ],
        resolve_timeout_s=4.0,
        include_verdicts=True,
    )

    async def go() -> None:
        async with Alerter.from_config(cfg) as a:
            a.on_verdict(verdict(0.9))
            assert await a.delivery.drain(10)
            [warn] = active(alertmanager)
            assert warn["labels"] == {
                "alertname": "C4FaultyHost",
                "job": "llm-pretrain-7b",
                "host": "gpu-node-17",
                "severity": "warning",
            }
            assert warn["status"]["state"] == "active"

            cmd = msgspec.structs.replace(sample_command(), action="cordon")
            a.on_command(cmd)
            assert await a.delivery.drain(10)
            [crit] = active(alertmanager)  # the warning was resolved, not left beside it
            assert crit["labels"]["severity"] == "critical"
            assert crit["annotations"]["action"] == "cordon"
            assert crit["startsAt"][:19] == warn["startsAt"][:19]  # the same open alert

            a.on_action(
                new_report(
                    command_id=cmd.id,
                    job=cmd.job,
                    host=cmd.host,
                    node=cmd.host,
                    action="cordon",
                    fault=cmd.fault,
                    decision="act",
                    status="failed",
                    detail="slurm: Invalid user id",
                )  # fmt: skip
            )
            assert await a.delivery.drain(10)
            [failed] = active(alertmanager)
            assert failed["annotations"]["actuator"] == "failed"
            assert "Invalid user id" in failed["annotations"]["actuator_detail"]

            ends_before = failed["endsAt"]
            time.sleep(1.1)
            a.tick()  # refresh due: re-posted with a later endsAt
            assert await a.delivery.drain(10)
            [refreshed] = active(alertmanager)
            assert refreshed["endsAt"] > ends_before

            time.sleep(4.1)
            a.tick()  # quiet for the resolve timeout: resolved by endsAt
            assert await a.delivery.drain(10)
            assert active(alertmanager) == []

    asyncio.run(go())


def test_a_dry_run_command_is_a_warning_that_says_so(alertmanager: str) -> None:
    cfg = AlertConfig(
        destination=[Destination(type="alertmanager_api", url=alertmanager, min_severity="info")]
    )

    async def go() -> None:
        async with Alerter.from_config(cfg) as a:
            a.on_command(msgspec.structs.replace(sample_command(), dry_run=True))
            assert await a.delivery.drain(10)

    asyncio.run(go())
    [alert] = active(alertmanager)
    assert alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["dry_run"] == "true"


def test_bookkeeping_verdicts_are_not_alerts_by_default(alertmanager: str) -> None:
    census = verdict(0.0, benign=True, reason="tp-node-000 spans 1 hosts.")

    async def go(include: bool) -> None:
        cfg = AlertConfig(
            destination=[
                Destination(type="alertmanager_api", url=alertmanager, min_severity="info")
            ],
            include_bookkeeping=include,
        )
        async with Alerter.from_config(cfg) as a:
            a.on_verdict(census)
            assert await a.delivery.drain(10)

    asyncio.run(go(False))
    assert active(alertmanager) == []
    asyncio.run(go(True))
    assert [a["labels"]["severity"] for a in active(alertmanager)] == ["info"]


def test_the_webhook_format_cannot_feed_alertmanager(alertmanager: str) -> None:
    """Why the old target was renamed: Alertmanager's API refuses its payload."""
    t = make_target(Destination(type="alertmanager", url=f"{alertmanager}/api/v2/alerts"))
    req = t.request(sample_notification())
    resp = httpx.post(req.url, content=req.body(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    assert type(t).__name__ == "AlertmanagerWebhookTarget"
