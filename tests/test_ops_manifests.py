"""Deployment files kept in step with the code: every Kubernetes and compose command line
parses with the real CLI, their config files pass `config check`, metrics ports agree,
and every Grafana query names a metric family and labels the services really expose."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.main import get_command

from c4base.metrics import Metrics
from c4stream.cli import app
from c4stream.config import check_config

COMPOSE = Path(__file__).resolve().parents[1] / "compose"
K8S = COMPOSE / "k8s"

pytestmark = pytest.mark.timeout(30)


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _parse_cli(args: list[str]) -> Any:
    """Parse ``c4stream ARGS`` as the container would (no command runs)."""
    root = get_command(app)
    ctx = root.make_context("c4stream", list(args), resilient_parsing=False)
    sub = root.get_command(ctx, args[0])  # type: ignore[attr-defined]
    return sub.make_context(args[0], list(args[1:]))


def _containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _docs(path):
            if doc.get("kind") in ("Deployment", "DaemonSet"):
                pod = doc["spec"]["template"]
                for c in pod["spec"]["containers"]:
                    out.append((doc["metadata"]["name"], pod, c))
    return out


def test_configmap_passes_config_check() -> None:
    (cm,) = _docs(K8S / "configmap.yaml")
    text = cm["data"]["c4stream.toml"]
    reports = check_config(text=text, env={})
    assert [r.message for r in reports if not r.ok] == []
    doc = tomllib.loads(text)
    assert doc["metrics"] == {"host": "0.0.0.0", "port": 9464}


@pytest.mark.parametrize("name", ["c4stream-exporter", "c4stream-actuator", "c4stream-worker"])
def test_k8s_container_args_parse_and_ports_agree(name: str) -> None:
    (pod, c) = next((p, c) for n, p, c in _containers() if n == name)
    ctx = _parse_cli(c["args"])
    assert ctx.params["config"] is not None and str(ctx.params["config"]) == (
        "/etc/c4stream/c4stream.toml"
    )
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/etc/c4stream" in mounts
    ports = {p["containerPort"] for p in c.get("ports", [])}
    assert ports == {9464}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9464"
    assert ctx.params["metrics_port"] == 9464 and ctx.params["metrics_host"] == "0.0.0.0"


def test_compose_commands_parse_and_config_checks() -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("worker", "archiver", "actuator", "alerter"):
        args = services[name]["command"]
        ctx = _parse_cli(args)
        assert str(ctx.params["config"]) == "/etc/c4stream/c4stream.toml", name
        # published on the host's loopback only
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), name
    reports = check_config(COMPOSE / "c4stream.toml", env={"C4_SLACK_URL": "https://h.example/x"})
    assert [r.message for r in reports if not r.ok] == []


def _exposed() -> dict[str, set[str]]:
    """Sample name -> label names, for every family of :class:`Metrics`."""
    m = Metrics()
    out: dict[str, set[str]] = {}
    for fam in m.registry.collect():
        collector = next(v for v in vars(m).values() if getattr(v, "_name", None) == fam.name)
        labels = set(collector._labelnames)
        suffixes = {
            "counter": ["_total"],
            "gauge": [""],
            "histogram": ["_bucket", "_count", "_sum"],
        }
        for suffix in suffixes[fam.type]:
            out[fam.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def test_dashboard_queries_use_exposed_metrics_and_labels() -> None:
    import json

    dash = json.loads((COMPOSE / "grafana" / "c4stream-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    exposed = _exposed()
    seen = set()
    for expr in exprs:
        names = re.findall(r"c4stream_[a-z_]+", expr)
        assert names, expr
        for name in names:
            assert name in exposed, f"{name} in {expr!r} is not a metric the services expose"
            seen.add(name)
            for group in re.findall(r"by \(([^)]*)\)", expr):
                labels = {x.strip() for x in group.split(",")}
                assert labels <= exposed[name], f"{expr!r}: {labels - exposed[name]}"
            for label in re.findall(r"(\w+)=~?\"", expr):
                assert label in exposed[name], f"{expr!r}: label {label}"
    # the dashboard shows every family
    families = {n.removesuffix("_total").removesuffix("_bucket") for n in seen}
    assert {
        "c4stream_events_in",
        "c4stream_consumer_lag",
        "c4stream_deadletters",
        "c4stream_isolations",
        "c4stream_verdicts",
        "c4stream_processing_latency_seconds",
        "c4stream_sink_actions",
    } <= families
