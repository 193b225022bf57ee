"""The one configuration file: `c4stream config check`, environment overrides, bad values,
and the precedence flags > environment > file > defaults of the service commands."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from c4base.settings_loader import SettingsError
from c4stream.cli import app
from c4stream.config import check_config, load_section

EXAMPLE = Path(__file__).resolve().parents[1] / "c4stream" / "example.toml"
SLACK = {"C4_SLACK_URL": "https://hooks.slack.com/services/T0/B0/secret"}

pytestmark = pytest.mark.timeout(30)


def _errors(text: str, env: dict[str, str] | None = None) -> dict[str, str]:
    return {r.section: r.message for r in check_config(text=text, env=env or {}) if not r.ok}


# ------------------------------------------------------------------ the example file


def test_example_passes_with_the_webhook_variable_set() -> None:
    reports = check_config(EXAMPLE, env=SLACK)
    assert [r.section for r in reports if not r.ok] == []
    # every service's table is in the example, so the check covers them all
    assert {r.section for r in reports} == {
        "kafka",
        "metrics",
        "log",
        "worker",
        "exporter",
        "actuator",
        "archive",
        "alert",
    }


def test_example_without_the_webhook_variable_names_it() -> None:
    bad = {r.section: r.message for r in check_config(EXAMPLE, env={}) if not r.ok}
    assert list(bad) == ["alert"]
    assert "C4_SLACK_URL" in bad["alert"] and "not set" in bad["alert"]


def test_cli_config_check_exit_status(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runner = CliRunner()
    monkeypatch.setenv("C4_SLACK_URL", SLACK["C4_SLACK_URL"])
    ok = runner.invoke(app, ["config", "check", str(EXAMPLE)])
    assert ok.exit_code == 0, ok.output
    assert "8 tables, all valid" in ok.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[wokrer]\nbatch_max = 5\n")
    res = runner.invoke(app, ["config", "check", str(bad)])
    assert res.exit_code == 1
    assert "unknown table [wokrer]" in res.output


def test_cli_prints_the_example_and_it_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    res = CliRunner().invoke(app, ["config", "example"])
    assert res.exit_code == 0
    assert not _errors(res.output, SLACK)


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("text", "section", "words"),
    [
        ("[wokrer]\nx = 1", "wokrer", ["unknown table [wokrer]", "worker"]),
        ("[worker]\nbatch_max = -1", "worker", ["batch_max", ">= 1"]),
        ('[worker.detect]\nwindow_us = "5s"', "worker", ["[worker.detect]", "window_us"]),
        ("[worker.policy]\ndryrun = true", "worker", ["[worker.policy]", "dryrun", "dry_run"]),
        ('[metrics]\nport = "x"', "metrics", ["port", "int"]),
        ("[metrics]\nprot = 9464", "metrics", ["unknown setting", "prot"]),
        ('[exporter]\ndirectory = "/d"\ninterval = 1', "exporter", ["interval", "interval_s"]),
        ("[exporter]\ninterval_s = 1.0", "exporter", ["directory"]),
        ('[actuator]\nbackend = "pbs"', "actuator", ["backend", "pbs"]),
        ("[actuator]\nexecute = 1", "actuator", ["execute", "bool"]),
        ("[archive]\nroll_seconds = 1", "archive", ["out"]),
        ("[kafka]\nbootstrap = 9092", "kafka", ["bootstrap", "str"]),
        ("[alert]\nresolve_timeout_s = 600", "alert", ["destination"]),
        (
            '[[alert.destination]]\ntype = "slak"\nurl = "https://x.example/h"',
            "alert",
            ["type"],
        ),
        ("log = 5", "log", ["[log] table"]),
    ],
)
def test_bad_values_are_reported_with_the_setting(
    text: str, section: str, words: list[str]
) -> None:
    errors = _errors(text)
    assert section in errors, errors
    for w in words:
        assert w in errors[section], errors[section]


def test_alert_secret_never_echoed() -> None:
    text = '[[alert.destination]]\ntype = "slack"\nurl = "ftp://h/T0/SECRETTOKEN"'
    msg = _errors(text)["alert"]
    assert "http" in msg and "SECRETTOKEN" not in msg


# ------------------------------------------------------------------ overrides


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    env = {
        "C4STREAM__ARCHIVE__ROLL_SECONDS": "5",
        "C4STREAM__KAFKA__TOPIC_PREFIX": "prod.",
        "C4STREAM__METRICS__PORT": "9999",
        "C4STREAM__KAFKA__EXTRA__SASL.PASSWORD": "pw",
    }
    archive = load_section("archive", EXAMPLE, env=env)
    assert archive.roll_seconds == 5.0
    assert archive.out == "/var/lib/c4stream/archive"  # from the file
    assert archive.kafka.topic_prefix == "prod."  # the shared [kafka] table, overridden
    assert archive.kafka.extra == {"sasl.password": "pw"}
    assert load_section("metrics", EXAMPLE, env=env).port == 9999
    # a bad override is reported like a bad file value, naming where it came from
    with pytest.raises(SettingsError, match=r"environment.*roll_seconds"):
        load_section("archive", EXAMPLE, env={"C4STREAM__ARCHIVE__ROLL_SECONDS": "soon"})
    reports = check_config(EXAMPLE, env={**SLACK, "C4STREAM__WORKER__BATCH_MAX": "0"})
    assert [r.section for r in reports if not r.ok] == ["worker"]


def test_kafka_bootstrap_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP", "broker-from-env:9093")
    cfg = load_section("actuator", EXAMPLE, env={}, overrides={"kafka.bootstrap": "flag:1"})
    assert cfg.kafka.bootstrap == "flag:1"
    assert cfg.kafka.consumer_config("g")["bootstrap.servers"] == "broker-from-env:9093"


def _ctx(command: str, argv: list[str]):
    """The real Click context the service command gets for ``argv``."""
    sub = get_command(app).get_command(None, command)  # type: ignore[attr-defined]
    return sub.make_context(command, argv)


def test_flags_win_over_the_file_which_wins_over_defaults(tmp_path: Path) -> None:
    from c4base.cli_options import given
    from sinks.actuator.cli import actuate

    cfg_file = tmp_path / "c4stream.toml"
    cfg_file.write_text(
        '[kafka]\nbootstrap = "file:9092"\n'
        '[actuator]\ngroup = "from-file"\nbackend = "command"\nattempts = 7\n'
    )
    ctx = _ctx("actuate", ["--config", str(cfg_file), "--group", "from-flag", "--deny", "a,b"])
    flags = given(ctx, actuate, deny=["a", "b"])
    assert flags == {"group": "from-flag", "deny": ["a", "b"]}  # defaults are not flags
    # The option declarations carry their config keys: no hand-written table.
    assert given(_ctx("actuate", ["--attempts", "2", "-b", "h:1"]), actuate) == {
        "attempts": 2,
        "kafka.bootstrap": "h:1",
    }
    cfg = load_section("actuator", cfg_file, env={}, overrides=flags)
    assert cfg.group == "from-flag"  # flag > file
    assert cfg.attempts == 7 and cfg.backend == "command"  # file > default
    assert cfg.kafka.bootstrap == "file:9092"  # shared [kafka]
    assert cfg.retry_backoff_s == 1.0  # default
    assert cfg.deny == ("a", "b")


def test_exporter_directory_from_file_or_flag(tmp_path: Path) -> None:
    from c4base.cli_options import given
    from producers.cli import exporter

    f = tmp_path / "c4.toml"
    f.write_text('[exporter]\ndirectory = "/from/file"\ninterval_s = 0.5\n')
    cfg = load_section("exporter", f, env={})
    assert str(cfg.directory) == "/from/file" and cfg.interval_s == 0.5
    ctx = _ctx("exporter", ["--config", str(f), "--dir", "/from/flag"])
    cfg = load_section("exporter", f, env={}, overrides=given(ctx, exporter))
    assert str(cfg.directory) == "/from/flag" and cfg.interval_s == 0.5


# ------------------------------------------------------------------ the alerter's two files


def test_alerter_reads_its_own_file_and_the_unified_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from c4stream.demo.receiver import WebhookReceiver

    with WebhookReceiver() as rx:
        monkeypatch.setenv("C4_TEST_HOOK", rx.url + "/hook")
        own = tmp_path / "alert.toml"
        own.write_text('[[destination]]\ntype = "slack"\nurl_env = "C4_TEST_HOOK"\n')
        unified = tmp_path / "c4stream.toml"
        unified.write_text(
            '[kafka]\nbootstrap = "127.0.0.1:1"\n[alert]\nresolve_timeout_s = 60\n'
            '[[alert.destination]]\ntype = "mattermost"\nurl_env = "C4_TEST_HOOK"\n'
        )
        runner = CliRunner()
        for path in (own, unified):
            res = runner.invoke(app, ["alert", "test", "--config", str(path)])
            assert res.exit_code == 0, res.output
        assert len(rx.received) == 2
        bad = tmp_path / "bad.toml"
        bad.write_text('[alert]\n[[alert.destination]]\ntype = "slack"\nurl_env = "C4_NOPE"\n')
        res = runner.invoke(app, ["alert", "test", "--config", str(bad)])
        assert res.exit_code == 2 and "C4_NOPE" in res.output


# ------------------------------------------------------------------ warnings


def test_config_check_warns_when_execute_meets_a_dry_run_worker(tmp_path: Path) -> None:
    """Issue 13, defect 2: --execute with the worker's default dry_run acted on nothing."""
    runner = CliRunner()
    f = tmp_path / "c.toml"
    f.write_text("[actuator]\nexecute = true\n[worker.policy]\ndry_run = true\n")
    res = runner.invoke(app, ["config", "check", str(f)])
    assert res.exit_code == 0, res.output
    assert "warn" in res.output and "[worker.policy] dry_run is true" in res.output
    f.write_text("[actuator]\nexecute = true\n[worker.policy]\ndry_run = false\n")
    assert "dry_run" not in runner.invoke(app, ["config", "check", str(f)]).output
    f.write_text(
        '[alert]\n[[alert.destination]]\ntype = "alertmanager"\nurl = "http://127.0.0.1:9"\n'
    )
    res = runner.invoke(app, ["config", "check", str(f)])
    assert res.exit_code == 0 and "alertmanager_api" in res.output
