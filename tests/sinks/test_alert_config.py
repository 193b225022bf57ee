"""The TOML config: destinations, env-provided secrets, redaction, operator-facing errors."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sinks.alert.config import ConfigError, load_config

TOML = """
resolve_timeout_s = 120
external_url = "https://grafana.example.org/d/c4"

[[destination]]
type = "slack"
url = "https://hooks.slack.com/services/T000/B000/slack-token-xyz"
min_severity = "info"

[[destination]]
type = "dingtalk"
name = "oncall"
url = "https://oapi.dingtalk.com/robot/send?access_token=ding-token-abc"
secret_env = "C4_TEST_DING_SECRET"
min_severity = "critical"
send_resolved = false
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "alert.toml"
    p.write_text(text)
    return p


def test_load_resolves_env_and_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, TOML), env={"C4_TEST_DING_SECRET": "SEC-very-secret"})
    slack, ding = cfg.destination
    assert (slack.name, slack.min_severity, slack.secret) == ("slack-0", "info", None)
    assert (ding.name, ding.secret, ding.send_resolved) == ("oncall", "SEC-very-secret", False)
    assert cfg.resolve_timeout_s == 120 and cfg.queue_size == 1000


def test_repr_and_logs_redact_urls_and_secrets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(_write(tmp_path, TOML), env={"C4_TEST_DING_SECRET": "SEC-very-secret"})
    caplog.set_level(logging.DEBUG)
    logging.getLogger("c4stream.test").info("loaded %s and %r", cfg, cfg.destination)
    shown = repr(cfg) + str(cfg.destination[1]) + caplog.text
    for leak in ("SEC-very-secret", "slack-token-xyz", "ding-token-abc", "/services/"):
        assert leak not in shown
    assert "https://oapi.dingtalk.com/…" in shown and "secret='***'" in shown


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        (TOML, {}, "C4_TEST_DING_SECRET"),
        ('[[destination]]\ntype = "telegram"\nurl = "https://x"\n', {}, "telegram"),
        ('[[destination]]\ntype = "slack"\nurl = "ftp://x/y"\n', {}, "http:// or https://"),
        (
            '[[destination]]\ntype = "slack"\nurl = "https://a/b"\nname = "x"\n'
            '[[destination]]\ntype = "teams"\nurl = "https://a/c"\nname = "x"\n',
            {},
            "used twice",
        ),
        ("resolve_timeout_s = 5\n", {}, "[[destination]]"),
        ("not toml [", {}, "not valid TOML"),
        (
            '[[destination]]\ntype = "slack"\nurl = "https://a/b"\nmin_severity = "loud"\n',
            {},
            "loud",
        ),
    ],
)
def test_errors_tell_the_operator_what_to_fix(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        load_config(_write(tmp_path, text), env=env)
    assert message in str(err.value) and "alert.toml" in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such alert config"):
        load_config(tmp_path / "nope.toml")
