"""Prometheus side of operations, checked with the real promtool (built once by ``./run``).

- the shipped alerting rules pass ``promtool check rules`` and their unit tests
  (``promtool test rules``: each rule fires on the series it is for, and only then);
- every stage's ``/metrics`` passes ``promtool check metrics`` and exports its counters
  at 0 from the start (issue 13, defect 9: panels said "No data");
- the dashboard's rates use ``$__rate_interval`` (defect 9: ``rate(...[1m])`` is empty
  at Prometheus's default 1-minute scrape interval).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from c4base.metrics import OUTCOMES, Metrics, MetricsConfig
from tests.tools import free_port, require_tool

COMPOSE = Path(__file__).resolve().parents[1] / "compose"
RULES = COMPOSE / "prometheus" / "c4stream-rules.yml"

pytestmark = pytest.mark.timeout(60)


Promtool = Callable[..., subprocess.CompletedProcess[bytes]]


@pytest.fixture
def promtool() -> Promtool:
    """Runs the real promtool (a test taking it is marked ``promtool``)."""
    binary = require_tool("promtool")

    def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([binary, *args], input=stdin, capture_output=True, timeout=60)

    return run


def test_rules_pass_promtool_check_and_their_unit_tests(promtool: Promtool) -> None:
    res = promtool("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    assert b"SUCCESS: 5 rules found" in res.stdout
    res = promtool("test", "rules", str(RULES.with_name("c4stream-rules.test.yml")))
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_rules_cover_what_operations_needs() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    exprs = {r["alert"]: r["expr"] for r in rules}
    assert "c4stream_consumer_lag" in exprs["C4streamConsumerLagHigh"]
    assert "c4stream_deadletters_total" in exprs["C4streamDeadLetters"]
    assert 'outcome="failed"' in exprs["C4streamActuatorFailures"]
    assert 'stage="exporter"' in exprs["C4streamNoEventsFromExporter"]


@pytest.mark.parametrize("stage", ["exporter", "worker", "actuator", "alerter", "archiver"])
def test_each_stages_metrics_pass_promtool_and_start_at_zero(
    stage: str, promtool: Promtool
) -> None:
    m = Metrics()
    m.prime(stage)  # what start_service does for every service
    port = m.serve(MetricsConfig(host="127.0.0.1", port=free_port()))
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).content
    res = promtool("check", "metrics", stdin=text)
    assert res.returncode == 0, res.stdout + res.stderr
    for family in ("events_in", "messages_in", "deadletters"):
        assert f'c4stream_{family}_total{{stage="{stage}"}} 0.0'.encode() in text
    for outcome in OUTCOMES.get(stage, ()):
        line = f'c4stream_sink_actions_total{{outcome="{outcome}",stage="{stage}"}} 0.0'
        assert line.encode() in text, line


def test_dashboard_rates_use_the_rate_interval() -> None:
    dash = json.loads((COMPOSE / "grafana" / "c4stream-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    rates = [e for e in exprs if "rate(" in e]
    assert rates
    for expr in rates:
        windows = re.findall(r"\brate\([^\[]*\[([^\]]+)\]", expr)
        assert windows and set(windows) == {"$__rate_interval"}, expr
