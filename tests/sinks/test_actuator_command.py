"""The command backend with real programs, and the actuator's retry/ledger policy around it.

The "scheduler" is a small Python script run as argv (no shell anywhere in our code):
it appends its arguments as one JSON line to a file, optionally fails or sleeps.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sinks.actuator.backends import (
    ActuatorConfigError,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.command_backend import CommandBackend, CommandTemplate
from sinks.actuator.config import ActuatorConfig, CommandSettings
from sinks.actuator.consumer import Actuator, Interrupted
from sinks.actuator.ledger import Ledger
from streams.commands import IsolationCommand

pytestmark = pytest.mark.timeout(30)

SCHEDULER = """\
import json, os, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
with open(out, "a") as f:
    f.write(json.dumps(sys.argv[3:]) + "\\n")
if mode == "fail":
    print("scontrol: error: Invalid node state specified", file=sys.stderr)
    sys.exit(1)
if mode.startswith("fail-first-"):  # fail the first N calls, then succeed
    n = int(mode.rsplit("-", 1)[1])
    if sum(1 for _ in open(out)) <= n:
        print("slurmctld busy", file=sys.stderr)
        sys.exit(3)
if mode == "hang":  # a child that would outlive us, then hang
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(out + ".child", "w") as f:
        f.write(str(child.pid))
    time.sleep(60)
"""


@pytest.fixture
def scheduler(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "fake_scontrol.py"
    script.write_text(SCHEDULER)
    return script, tmp_path / "calls.jsonl"


def template(scheduler: tuple[Path, Path], mode: str = "ok", args: str = "") -> str:
    script, out = scheduler
    prog = " ".join(shlex.quote(str(p)) for p in (sys.executable, script, out))
    return (
        f'{prog} {mode} update nodename={{host}} state=drain reason="{{reason}}" {args}'
    ).strip()


def calls(scheduler: tuple[Path, Path]) -> list[list[str]]:
    out = scheduler[1]
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def command(**kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id="c4-1",
        ts_us=1,
        job="j",
        host="node017",
        fault="slow_nic",
        action="cordon",
        confidence=0.9,
        reason="node017 NIC mlx5_1 sends at 40% of its peers",
        evidence={},
        dry_run=False,  # absent means dry run
    )
    base.update(kw)
    return IsolationCommand(**base)


def test_runs_the_template_as_argv_and_values_cannot_inject(
    scheduler: tuple[Path, Path], tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    evil = f'late"; touch {marker}; echo "$(touch {marker}) state=resume'
    be = CommandBackend(
        CommandSettings(template=template(scheduler, args="gpu={gpu} nic={nic} id={id}"))
    )
    out = be.apply(command(reason=evil, gpu=3, nic="mlx5_1"))
    assert out.changed and "exit 0" in out.detail
    assert calls(scheduler) == [
        [
            "update",
            "nodename=node017",
            "state=drain",
            f"reason={evil}",
            "gpu=3",
            "nic=mlx5_1",
            "id=c4-1",
        ]
    ]
    assert not marker.exists()


def test_timeout_kills_the_command_and_its_children(
    scheduler: tuple[Path, Path],
) -> None:
    be = CommandBackend(CommandSettings(template=template(scheduler, "hang"), timeout_s=1.5))
    t0 = time.monotonic()
    with pytest.raises(TransientActionError, match="timed out after 1.5s"):
        be.apply(command())
    assert time.monotonic() - t0 < 5.0
    child = int(Path(str(scheduler[1]) + ".child").read_text())
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the command's child outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_nonzero_exit_is_transient_with_stderr(scheduler: tuple[Path, Path]) -> None:
    be = CommandBackend(CommandSettings(template=template(scheduler, "fail")))
    with pytest.raises(TransientActionError, match="exited 1: scontrol: error: Invalid node"):
        be.apply(command())


def test_configuration_errors_fail_fast(scheduler: tuple[Path, Path]) -> None:
    with pytest.raises(ActuatorConfigError, match="unknown placeholder"):
        CommandTemplate("scontrol update nodename={hostname}")
    with pytest.raises(ActuatorConfigError, match="must be fixed"):
        CommandTemplate("{host} drain")
    with pytest.raises(ActuatorConfigError, match="empty"):
        CommandTemplate("  ")
    with pytest.raises(ActuatorConfigError, match="No closing quotation"):
        CommandTemplate('scontrol reason="{reason}')
    with pytest.raises(ActuatorConfigError, match="not on PATH"):
        CommandBackend(CommandSettings(template="no-such-scontrol-xyz update {host}"))
    with pytest.raises(ActuatorConfigError, match="needs --command-template"):
        CommandBackend(CommandSettings())
    # Dry-run does not need the program installed.
    dry = CommandBackend(
        CommandSettings(template="no-such-scontrol-xyz update {host}"), check_programs=False
    )
    assert dry.describe(command()) == (
        "command: run no-such-scontrol-xyz update node017 (no shell, timeout 30s)"
    )
    with pytest.raises(PermanentActionError, match=r"needs \['gpu'\]"):
        CommandTemplate("scontrol {host} {gpu}").render(command())


def test_restart_job_runs_only_its_own_template(scheduler: tuple[Path, Path]) -> None:
    be = CommandBackend(CommandSettings(template=template(scheduler)))
    out = be.apply(command(action="restart_job"))
    assert not out.changed and calls(scheduler) == []
    be = CommandBackend(
        CommandSettings(
            template=template(scheduler),
            restart_template=f"{shlex.quote(sys.executable)} "
            f"{shlex.quote(str(scheduler[0]))} {shlex.quote(str(scheduler[1]))} ok requeue {{job}}",
        )
    )
    be.apply(command(action="restart_job"))
    assert calls(scheduler) == [["requeue", "j"]]


def test_retries_then_dead_letters_and_a_failure_does_not_block_a_later_delivery(
    scheduler: tuple[Path, Path], tmp_path: Path
) -> None:
    cfg = ActuatorConfig(execute=True, attempts=3, retry_backoff_s=0.01)
    failing = CommandBackend(CommandSettings(template=template(scheduler, "fail")))
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        h = Actuator(cfg, failing, led).handle(command())
        assert h.status == "failed" and h.deadletter_reason is not None
        assert "gave up after 3 attempt(s)" in h.deadletter_reason
        assert len(calls(scheduler)) == 3
        assert not led.is_done("c4-1")
        # Delivered again once the scheduler recovers: acts (fails twice more first).
        flaky = CommandBackend(CommandSettings(template=template(scheduler, "fail-first-4")))
        h = Actuator(cfg, flaky, led).handle(command())
        assert h.status == "done" and len(calls(scheduler)) == 5
        assert led.is_done("c4-1")
        # A third delivery: the ledger stops it.
        h = Actuator(cfg, flaky, led).handle(command())
        assert h.decision == "duplicate" and len(calls(scheduler)) == 5
        assert led.get("c4-1").deliveries == 3  # type: ignore[union-attr]


def test_dry_run_records_but_does_not_block_a_real_run(
    scheduler: tuple[Path, Path], tmp_path: Path
) -> None:
    be = CommandBackend(CommandSettings(template=template(scheduler)))
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        h = Actuator(ActuatorConfig(), be, led).handle(command())
        assert h.decision == "dry_run" and calls(scheduler) == []
        assert "would command: run " in h.detail and "state=drain" in h.detail
        assert led.get("c4-1").status == "dry_run"  # type: ignore[union-attr]
        h = Actuator(ActuatorConfig(execute=True), be, led).handle(command())
        assert h.decision == "act" and len(calls(scheduler)) == 1


def test_ledger_survives_reopen_and_prunes_old_rows(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ledger.sqlite3"
    with Ledger(path) as led:
        led.record("old", status="done", host="h", action="cordon", detail="x", now_us=1)
        led.record("new", status="done", host="h", action="cordon", detail="x")
    with Ledger(path, retention_days=1.0) as led:  # opening prunes
        assert led.is_done("new") and not led.is_done("old")
        assert [e.id for e in led.entries()] == ["new"]
    assert os.path.getsize(path) > 0


def test_a_stop_during_retries_records_no_outcome_that_blocks(
    scheduler: tuple[Path, Path], tmp_path: Path
) -> None:
    stop = threading.Event()
    stop.set()  # as if SIGTERM arrived during the first failure
    failing = CommandBackend(CommandSettings(template=template(scheduler, "fail")))
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        actuator = Actuator(ActuatorConfig(execute=True, attempts=5), failing, led, stop=stop)
        with pytest.raises(Interrupted):
            actuator.handle(command())
        # Recorded failed (not in_progress: the attempt ended), which blocks nothing:
        # uncommitted, it is delivered again after the restart and acts.
        e = led.get("c4-1")
        assert e is not None and e.status == "failed" and not led.is_done("c4-1")
    assert len(calls(scheduler)) == 1


def test_a_command_the_template_cannot_render_is_dead_lettered_not_run(
    scheduler: tuple[Path, Path], tmp_path: Path
) -> None:
    be = CommandBackend(CommandSettings(template=template(scheduler, args="gpu={gpu}")))
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        h = Actuator(ActuatorConfig(execute=True), be, led).handle(command())  # no gpu
        assert h.status == "failed" and "needs ['gpu']" in (h.deadletter_reason or "")
        dry = Actuator(ActuatorConfig(), be, led).handle(command(id="c4-2"))
        assert dry.decision == "dry_run" and "would fail" in dry.detail
    assert calls(scheduler) == []


def test_restart_job_without_a_template_is_skipped_with_the_reason(
    scheduler: tuple[Path, Path], tmp_path: Path
) -> None:
    """Issue 13, defect 8: it was logged DONE and recorded done, so a template added
    later never ran for it."""
    be = CommandBackend(CommandSettings(template=template(scheduler)))
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        h = Actuator(ActuatorConfig(execute=True), be, led).handle(command(action="restart_job"))
        assert (h.decision, h.status) == ("act", "skipped")
        assert "no restart template" in h.detail
        assert not led.is_done("c4-1") and led.get("c4-1").status == "skipped"  # type: ignore[union-attr]
        with_template = CommandBackend(
            CommandSettings(
                template=template(scheduler),
                restart_template=f"{shlex.quote(sys.executable)} {shlex.quote(str(scheduler[0]))} "
                f"{shlex.quote(str(scheduler[1]))} ok requeue {{job}}",
            )
        )
        h = Actuator(ActuatorConfig(execute=True), with_template, led).handle(
            command(action="restart_job")
        )
        assert h.status == "done" and calls(scheduler) == [["requeue", "j"]]


def test_a_dry_run_names_the_switch_that_held_it_back(
    scheduler: tuple[Path, Path], tmp_path: Path
) -> None:
    """Issue 13, defect 2: two switches, and the log did not say which one to flip."""
    be = CommandBackend(CommandSettings(template=template(scheduler)))
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        worker = Actuator(ActuatorConfig(execute=True), be, led).handle(command(dry_run=True))
        actuator = Actuator(ActuatorConfig(), be, led).handle(command(id="c4-2"))
    assert "[worker.policy] dry_run" in worker.detail and "--execute alone" in worker.detail
    assert "[actuator] execute = false" in actuator.detail
    assert calls(scheduler) == []
