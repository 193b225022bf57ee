"""``c4stream alert test``: one sample alert to every destination, through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from c4stream.cli import app
from sinks.alert.targets import TARGETS
from tests.sinks.test_alert_support import (
    Reply,
    WebhookServer,
    webhook_server_fixture,  # noqa: F401 (the fixture)
)


def _config(tmp_path: Path, server: WebhookServer) -> Path:
    parts = []
    for kind in sorted(TARGETS):
        secret = 'secret = "s3cr3t-value"\n' if kind in ("dingtalk", "feishu") else ""
        parts.append(
            f'[[destination]]\ntype = "{kind}"\nurl = "{server.url("/" + kind)}"\n'
            f'min_severity = "critical"\n{secret}'
        )
    p = tmp_path / "alert.toml"
    p.write_text("max_attempts = 2\nbackoff_base_s = 0.01\n" + "\n".join(parts))
    return p


@pytest.mark.timeout(30)
def test_alert_test_sends_one_sample_to_every_destination(
    tmp_path: Path, webhook_server: WebhookServer
) -> None:
    result = CliRunner().invoke(
        app, ["alert", "test", "--config", str(_config(tmp_path, webhook_server))]
    )
    assert result.exit_code == 0, result.output
    api = "/alertmanager_api/api/v2/alerts"  # Alertmanager's API path under its base URL
    expected = [api if k == "alertmanager_api" else f"/{k}" for k in TARGETS]
    assert sorted(r.path for r in webhook_server.received) == sorted(expected)
    assert result.output.count("ok ") == len(TARGETS)
    assert "s3cr3t-value" not in result.output and "/dingtalk" not in result.output


@pytest.mark.timeout(30)
def test_alert_test_fails_when_a_destination_refuses(
    tmp_path: Path, webhook_server: WebhookServer
) -> None:
    webhook_server.script("/teams", Reply(403, b"forbidden"))
    result = CliRunner().invoke(
        app, ["alert", "test", "--config", str(_config(tmp_path, webhook_server))]
    )
    assert result.exit_code == 1
    assert f"FAILED teams-{sorted(TARGETS).index('teams')}" in result.output
    assert result.output.count("ok ") == len(TARGETS) - 1


def test_alert_without_config_says_what_is_missing() -> None:
    result = CliRunner().invoke(app, ["alert", "--bootstrap", "127.0.0.1:1"])
    assert result.exit_code == 2 and "--config" in result.output
