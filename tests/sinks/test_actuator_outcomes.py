"""The actuator's outcome records (``c4.actions``) against their JSON Schema."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from sinks.actuator.command_backend import CommandBackend
from sinks.actuator.config import ActuatorConfig, CommandSettings
from sinks.actuator.consumer import Actuator, report_for
from sinks.actuator.ledger import Ledger
from sinks.actuator.outcomes import ReportDecodeError, decode_report, encode_report
from streams.commands import IsolationCommand

SCHEMA = json.loads(
    (Path(__file__).parents[2] / "sinks" / "contracts" / "action-report.schema.json").read_text()
)


def command(**kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id="c4-1", ts_us=1, job="j", host="node017.cluster.local", fault="slow_nic",
        action="cordon", confidence=0.9, reason="NIC at 40%", evidence={}, dry_run=False,
    )  # fmt: skip
    base.update(kw)
    return IsolationCommand(**base)


def test_every_outcome_is_a_valid_record(tmp_path: Path) -> None:
    ok = f"{shlex.quote(sys.executable)} -c pass"
    fail = f"{shlex.quote(sys.executable)} -c 'import sys; sys.exit(3)'"
    live = ActuatorConfig(execute=True, strip_domain=True, attempts=1, deny=("login-*",))
    dry = ActuatorConfig(strip_domain=True)
    capped = ActuatorConfig(execute=True, strip_domain=True, max_actions_per_job_per_hour=2)
    cases = [
        (live, ok, command(), ("act", "done")),
        (live, ok, command(id="c4-1"), ("duplicate", "done")),
        (dry, ok, command(id="c4-2", nic="mlx5_3"), ("dry_run", "dry_run")),
        (live, ok, command(id="c4-3", host="login-1"), ("denied", "skipped")),
        (live, ok, command(id="c4-4", action="alert_only"), ("alert_only", "skipped")),
        (live, ok, command(id="c4-5", action="restart_job"), ("act", "skipped")),
        (live, fail, command(id="c4-6", nic="mlx5_1"), ("act", "failed")),
        (live, ok, command(id="c4-7", nic="mlx5_1"), ("act", "done")),  # a failure is retried
        (live, ok, command(id="c4-8"), ("duplicate", "skipped")),  # same fault, new id
        (capped, ok, command(id="c4-9", nic="mlx5_2"), ("capped", "skipped")),
    ]
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        for cfg, tmpl, cmd, want in cases:
            h = Actuator(cfg, CommandBackend(CommandSettings(template=tmpl)), led).handle(cmd)
            assert (h.decision, h.status) == want, cmd.id
            r = report_for(cmd, h)
            jsonschema.validate(json.loads(encode_report(r)), SCHEMA)
            assert decode_report(encode_report(r)) == r
            assert r.host == cmd.host and r.node == cfg.node_name(cmd.host)
            assert r.dry_run == (want[0] == "dry_run")


def test_a_bad_record_is_refused_with_the_reason() -> None:
    with pytest.raises(ReportDecodeError, match="command_id"):
        decode_report(b'{"v": 1, "kind": "action"}')
