"""Restart after isolation through the command backend, with real programs as argv.

The "scheduler" is two small Python scripts run without a shell: ``squeue`` prints the
job ids written in a file (what runs on the node), ``scontrol`` appends its arguments
to a calls file and can fail. The real-Slurm test is ``test_actuator_restart_slurm.py``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from c4base.cli_options import option_keys
from c4stream.cli import app
from sinks.actuator.backends import ActuatorConfigError
from sinks.actuator.cli import actuate, make_restarter
from sinks.actuator.command_backend import CommandBackend
from sinks.actuator.config import (
    ActuatorConfig,
    CommandSettings,
    RestartSettings,
    SlurmSettings,
)
from sinks.actuator.consumer import Actuator
from sinks.actuator.ledger import Ledger
from sinks.actuator.restart import RestartHook, RestartInterrupted, RestartLog
from sinks.actuator.restart_command import CommandRestarter
from sinks.actuator.restart_kubernetes import KubernetesRestarter
from streams.commands import IsolationCommand

pytestmark = pytest.mark.timeout(30)

SCONTROL = """\
import json, sys
out, mode = sys.argv[1], sys.argv[2]
with open(out, "a") as f:
    f.write(json.dumps(sys.argv[3:]) + "\\n")
if mode == "fail":
    print("scontrol: error: Requested operation is presently disabled", file=sys.stderr)
    sys.exit(1)
"""

SQUEUE = """\
import json, sys
jobs, calls = sys.argv[1], sys.argv[2]
with open(calls, "a") as f:
    f.write(json.dumps(sys.argv[3:]) + "\\n")
print(open(jobs).read(), end="")
"""

HOUR_US = 3_600_000_000


class Slurmish:
    """The two scripts, their files, and templates that run them."""

    def __init__(self, tmp: Path) -> None:
        self.scontrol, self.squeue = tmp / "scontrol.py", tmp / "squeue.py"
        self.scontrol.write_text(SCONTROL)
        self.squeue.write_text(SQUEUE)
        self.calls, self.lookups, self.jobs = tmp / "calls.jsonl", tmp / "lookups.jsonl", tmp / "j"
        self.jobs.write_text("4242\n")
        self.ledger = tmp / "ledger.sqlite3"

    def _prog(self, *parts: Path) -> str:
        return " ".join(shlex.quote(str(p)) for p in (sys.executable, *parts))

    def drain(self) -> str:
        prog = self._prog(self.scontrol, self.calls)
        return f'{prog} ok update nodename={{host}} state=drain reason="{{reason}}"'

    def requeue(self, mode: str = "ok") -> str:
        return f"{self._prog(self.scontrol, self.calls)} {mode} requeue {{jobid}}"

    def lookup(self) -> str:
        return f"{self._prog(self.squeue, self.jobs, self.lookups)} -h -w {{host}} -n {{job}} -o %i"

    def read(self, path: Path) -> list[list[str]]:
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def requeues(self) -> list[list[str]]:
        return [c for c in self.read(self.calls) if c[0] == "requeue"]


@pytest.fixture
def slurm(tmp_path: Path) -> Slurmish:
    return Slurmish(tmp_path)


def command(**kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id="c4-1",
        ts_us=1_000_000,
        job="llm-70b",
        host="node017",
        fault="noncomm_hang",
        action="cordon_and_taint",
        confidence=0.95,
        reason="node017 GPU 3 hangs",
        evidence={},
        gpu=3,
        dry_run=False,  # the worker decided to act (a command without it is a dry run)
    )
    base.update(kw)
    return IsolationCommand(**base)


def settings(slurm: Slurmish, **kw: Any) -> RestartSettings:
    base: dict[str, Any] = dict(
        jobs=("llm-*",),
        execute=True,
        requeue_template=slurm.requeue(),
        jobid_lookup=slurm.lookup(),
    )
    base.update(kw)
    return RestartSettings(**base)


def actuator(
    slurm: Slurmish, led: Ledger, rl: RestartLog, *, execute: bool = True, **kw: Any
) -> Actuator:
    cfg = ActuatorConfig(
        execute=execute,
        backend="command",
        command=CommandSettings(template=slurm.drain()),
        retry_backoff_s=0.01,
    )
    rs = settings(slurm, **kw)
    hook = RestartHook(rs, CommandRestarter(cfg.command, rs, check_programs=True), rl)
    return Actuator(cfg, CommandBackend(cfg.command), led, restart=hook)


def test_isolation_then_one_requeue_and_a_redelivery_requeues_nothing(slurm: Slurmish) -> None:
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        h = actuator(slurm, led, rl).handle(command())
        assert (h.decision, h.status) == ("act", "done")
        assert "; job restart done: ran " in h.detail and h.detail.endswith("requeue 4242: exit 0")
        assert led.get("c4-1").detail == h.detail  # type: ignore[union-attr]
        assert slurm.read(slurm.calls)[0][:3] == ["update", "nodename=node017", "state=drain"]
        assert slurm.requeues() == [["requeue", "4242"]]
        # the lookup asked for this job on this node
        assert slurm.read(slurm.lookups) == [["-h", "-w", "node017", "-n", "llm-70b", "-o", "%i"]]
        [row] = rl.entries()
        assert (row.id, row.job, row.target, row.status) == ("c4-1", "llm-70b", "4242", "done")
        assert row.cmd_ts_us == 1_000_000
        again = actuator(slurm, led, rl).handle(command())
        assert again.decision == "duplicate"
    # a restarted actuator (files reopened) does not requeue either
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        assert actuator(slurm, led, rl).handle(command()).decision == "duplicate"
        assert rl.get("c4-1").deliveries == 1  # type: ignore[union-attr]
    assert slurm.requeues() == [["requeue", "4242"]]


def test_a_crash_between_restart_and_ledger_row_repeats_only_the_isolation(
    slurm: Slurmish,
) -> None:
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        act = actuator(slurm, led, rl)
        assert act.restart is not None
        act.restart.after(command(), "act")  # restarted, then "crashed" before the ledger
        assert slurm.requeues() == [["requeue", "4242"]]
        h = act.handle(command())  # redelivered: the isolation repeats (a safe repeat)
        assert h.status == "done"
    drains = [c for c in slurm.read(slurm.calls) if c[0] == "update"]
    assert len(drains) == 1 and slurm.requeues() == [["requeue", "4242"]]


def test_rails_in_progress_and_per_hour(slurm: Slurmish) -> None:
    with RestartLog(slurm.ledger) as rl:
        rs = settings(slurm, in_progress_s=600, max_per_hour=2)
        hook = RestartHook(rs, CommandRestarter(CommandSettings(), rs, check_programs=True), rl)
        t = 10 * HOUR_US
        assert hook.after(command(id="a"), "act", now_us=t).status == "done"  # type: ignore[union-attr]
        busy = hook.after(command(id="b", host="node018"), "act", now_us=t + 60_000_000)
        assert busy is not None and busy.status == "skipped" and "in progress" in busy.detail
        ok = hook.after(command(id="c", host="node019"), "act", now_us=t + 700_000_000)
        assert ok is not None and ok.status == "done"
        capped = hook.after(command(id="d", host="node020"), "act", now_us=t + 1_400_000_000)
        assert capped is not None and capped.status == "skipped"
        assert "2 times in the last hour" in capped.detail
        # an hour after the first two, the job may be restarted again
        later = hook.after(command(id="e", host="node021"), "act", now_us=t + HOUR_US + 800_000_000)
        assert later is not None and later.status == "done"
        # skipped is final: "b" redelivered never restarts
        assert hook.after(command(id="b", host="node018"), "act", now_us=t + 5 * HOUR_US) is None
        # another job has its own budget
        other = hook.after(command(id="f", job="llm-8b"), "act", now_us=t + 60_000_000)
        assert other is not None and other.status == "done"
    assert len(slurm.requeues()) == 4


def test_dry_run_describes_the_exact_requeue_and_counts_for_the_rails(slurm: Slurmish) -> None:
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        act = actuator(slurm, led, rl, execute=True)
        dry_hook = RestartHook(
            settings(slurm, execute=False),
            CommandRestarter(CommandSettings(), settings(slurm), check_programs=True),
            rl,
        )
        act.restart = dry_hook
        assert act.handle(command()).status == "done"
        [row] = rl.entries()
        assert row.status == "dry_run" and "would command: run" in row.detail
        assert "requeue 4242" in row.detail and "job id 4242 from `" in row.detail
        assert slurm.requeues() == []
        # a second fault of the job right after: a real run would be in progress
        assert act.handle(command(id="c4-2", host="node018")).status == "done"
        second = rl.get("c4-2")
        assert second is not None and second.status == "dry_skipped"
        assert second.detail.startswith("would skip: a restart of job llm-70b is in progress")
        # the same fault delivered again in dry run: described again, not "in progress"
        # because of its own earlier dry run
        act.ledger = Ledger(slurm.ledger.with_name("again.sqlite3"))
        act.handle(command())
        act.ledger.close()
        assert rl.get("c4-1").status == "dry_run"  # type: ignore[union-attr]
        assert rl.get("c4-1").deliveries == 2  # type: ignore[union-attr]
        # the same fault delivered again to a restart-executing actuator acts
        act.restart = RestartHook(
            settings(slurm),
            CommandRestarter(CommandSettings(), settings(slurm), check_programs=True),
            rl,
        )
        led_free = Ledger(slurm.ledger.with_name("fresh.sqlite3"))
        act.ledger = led_free
        assert act.handle(command()).status == "done"
        led_free.close()
        assert rl.get("c4-1").status == "done"  # type: ignore[union-attr]
    assert slurm.requeues() == [["requeue", "4242"]]


def test_an_isolation_dry_run_never_restarts(slurm: Slurmish) -> None:
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        h = actuator(slurm, led, rl, execute=False).handle(command())
        assert h.decision == "dry_run"
        [row] = rl.entries()
        assert row.status == "dry_run" and "requeue 4242" in row.detail
    assert slurm.read(slurm.calls) == []


def test_jobs_not_enabled_and_alert_only_leave_no_trace(slurm: Slurmish) -> None:
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        act = actuator(slurm, led, rl)
        act.handle(command(job="other-job"))
        act.handle(command(id="c4-2", action="alert_only"))
        act.handle(command(id="c4-3", action="restart_job"))
        assert rl.entries() == []
        off = actuator(slurm, led, rl, jobs=())
        off.handle(command(id="c4-4"))
        assert rl.entries() == []
    assert slurm.requeues() == []


@pytest.mark.parametrize(
    ("jobs_on_node", "words"),
    [("", "no job named 'llm-70b' runs on node017"), ("4242\n4243\n", "2 jobs on node017")],
)
def test_lookup_finding_no_job_or_several_restarts_nothing(
    slurm: Slurmish, jobs_on_node: str, words: str
) -> None:
    slurm.jobs.write_text(jobs_on_node)
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        actuator(slurm, led, rl).handle(command())
        [row] = rl.entries()
    assert row.status == "skipped" and words in row.detail
    assert slurm.requeues() == []


def test_jobid_regex_rule(slurm: Slurmish) -> None:
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        act = actuator(slurm, led, rl, jobs=("slurm-*",), jobid_regex=r"slurm-(?P<jobid>\d+)")
        act.handle(command(job="slurm-77"))
        assert slurm.read(slurm.lookups) == []  # the rule needs no lookup
        act.handle(command(id="c4-2", job="slurm-x"))
        assert rl.get("c4-2").status == "skipped"  # type: ignore[union-attr]
    assert slurm.requeues() == [["requeue", "77"]]


def test_a_failing_requeue_is_retried_then_failed_and_the_isolation_stands(
    slurm: Slurmish,
) -> None:
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        act = actuator(slurm, led, rl, requeue_template=slurm.requeue("fail"))
        act.restart.attempts = 2  # type: ignore[union-attr]
        act.restart.retry_backoff_s = 0.01  # type: ignore[union-attr]
        h = act.handle(command())
        assert (h.decision, h.status) == ("act", "done")
        [row] = rl.entries()
    assert row.status == "failed" and "presently disabled" in row.detail
    assert len(slurm.requeues()) == 2


def test_configuration_errors(slurm: Slurmish) -> None:
    cs = CommandSettings()
    with pytest.raises(ActuatorConfigError, match="requeue_template"):
        CommandRestarter(cs, RestartSettings(jobs=("*",)), check_programs=False)
    with pytest.raises(ActuatorConfigError, match="jobid_regex .* or"):
        CommandRestarter(
            cs, RestartSettings(requeue_template="scontrol requeue {jobid}"), check_programs=False
        )
    with pytest.raises(ActuatorConfigError, match="group named jobid"):
        CommandRestarter(
            cs,
            RestartSettings(requeue_template="scontrol requeue {jobid}", jobid_regex=r"(\d+)"),
            check_programs=False,
        )
    with pytest.raises(ActuatorConfigError, match="not on PATH"):
        CommandRestarter(
            cs,
            RestartSettings(requeue_template="no-such-scontrol requeue {job}"),
            check_programs=True,
        )
    with pytest.raises(ActuatorConfigError, match="max_per_hour"):
        RestartHook(
            RestartSettings(max_per_hour=0),
            CommandRestarter(cs, settings(slurm), check_programs=False),
            RestartLog(slurm.ledger),
        )


def test_a_dry_run_whose_lookup_fails_still_says_what_it_would_run(slurm: Slurmish) -> None:
    slurm.squeue.write_text(
        "import sys\nprint('slurm_load_jobs error', file=sys.stderr)\nsys.exit(1)\n"
    )
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        actuator(slurm, led, rl, execute=False).handle(command())
        [row] = rl.entries()
        assert row.status == "dry_run"
        assert "not available now" in row.detail and "slurm_load_jobs error" in row.detail
        assert "requeue {jobid}" in row.detail
        # executing, the same failure is a failed restart (retried), never a guess
        act = actuator(slurm, led, rl)
        act.restart.retry_backoff_s = 0.01  # type: ignore[union-attr]
        act.handle(command(id="c4-2"))
        assert rl.get("c4-2").status == "failed"  # type: ignore[union-attr]
    assert slurm.requeues() == []


def test_make_restarter_per_backend_and_the_cli_flags() -> None:
    assert make_restarter(ActuatorConfig(backend="slurm")) is None  # off by default
    on = RestartSettings(jobs=("llm-*",))
    slurm = make_restarter(
        ActuatorConfig(
            backend="slurm", restart=on, slurm=SlurmSettings(command_prefix=("sudo", "-n"))
        )
    )
    assert isinstance(slurm, CommandRestarter)
    assert slurm.requeue.argv == ["sudo", "-n", "scontrol", "requeue", "{jobid}"]
    assert slurm.lookup is not None and slurm.lookup.argv[:3] == ["squeue", "-h", "-w"]
    assert slurm.status is not None and slurm.status.argv == [
        "squeue",
        "-h",
        "-j",
        "{jobid}",
        "-o",
        "%T",
    ]
    with pytest.raises(ActuatorConfigError, match="requeue_template"):
        make_restarter(ActuatorConfig(backend="command", restart=on))
    kube = make_restarter(ActuatorConfig(backend="kubernetes", restart=on))
    assert isinstance(kube, KubernetesRestarter) and kube._core is None  # dry run: no cluster
    with pytest.raises(ActuatorConfigError, match="must name"):
        make_restarter(
            ActuatorConfig(
                backend="kubernetes",
                restart=RestartSettings(jobs=("x",), pod_selector="app=trainer"),
            )
        )
    # every restart flag maps onto a [actuator.restart] key
    root = get_command(app)
    ctx = root.make_context("c4stream", ["actuate"], resilient_parsing=True)
    params = {p.name for p in root.get_command(ctx, "actuate").params}  # type: ignore[attr-defined]
    restart_flags = {k: v for k, v in option_keys(actuate).items() if v.startswith("restart.")}
    assert set(restart_flags) <= params and len(restart_flags) == 10
    for key in restart_flags.values():
        assert key.split(".", 1)[1] in RestartSettings.__struct_fields__


def test_restart_log_prunes_old_rows_on_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    with RestartLog(path) as rl:
        old = time.time_ns() // 1000 - 40 * 86_400_000_000
        rl.record("old", job="j", host="h", target="1", status="done", detail="", cmd_ts_us=1,
                  now_us=old)  # fmt: skip
        rl.record("new", job="j", host="h", target="2", status="done", detail="", cmd_ts_us=1)
    with RestartLog(path, retention_days=30) as rl:
        assert [e.id for e in rl.entries()] == ["new"]


@pytest.mark.parametrize(("state", "restarted"), [("PENDING", False), ("RUNNING", True)])
def test_the_schedulers_job_state_tells_a_restart_in_progress(
    slurm: Slurmish, tmp_path: Path, state: str, restarted: bool
) -> None:
    state_file = tmp_path / "state"
    state_file.write_text(state + "\n")
    status = f"{slurm._prog(slurm.squeue, state_file, slurm.lookups)} -h -j {{jobid}} -o %T"
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        actuator(slurm, led, rl, status_template=status).handle(command())
        [row] = rl.entries()
    assert ["-h", "-j", "4242", "-o", "%T"] in slurm.read(slurm.lookups)
    if restarted:
        assert row.status == "done" and slurm.requeues() == [["requeue", "4242"]]
    else:
        assert row.status == "skipped" and "job 4242 is PENDING" in row.detail
        assert slurm.requeues() == []


def test_a_stop_while_retrying_the_restart_records_no_restart(slurm: Slurmish) -> None:
    with Ledger(slurm.ledger) as led, RestartLog(slurm.ledger) as rl:
        act = actuator(slurm, led, rl, requeue_template=slurm.requeue("fail"))
        assert act.restart is not None
        act.restart.retry_backoff_s = 5.0
        act.restart.stop.set()  # SIGTERM arrived: the first back-off returns at once
        with pytest.raises(RestartInterrupted):
            act.handle(command())
        assert rl.entries() == []
        assert len(slurm.requeues()) == 1
        # Delivered again after the restart: the drain is known done (not run again,
        # not "unknown"), only the job restart is carried out.
        e = led.get("c4-1")
        assert e is not None and e.status == "in_progress"
        h = actuator(slurm, led, rl).handle(command())
        assert h.status == "done" and "job restart done" in h.detail
    drains = [c for c in slurm.read(slurm.calls) if c[0] == "update"]
    assert len(drains) == 1 and len(slurm.requeues()) == 2


def test_check_reports_the_restart_and_fails_on_a_missing_program(slurm: Slurmish) -> None:
    base = ["actuate", "--backend", "command", "--command-template", slurm.drain(), "--check"]
    off = CliRunner().invoke(app, base)
    assert off.exit_code == 0, off.output
    assert "restart after isolation: off" in off.output
    on = [*base, "--restart-jobs", "llm-*", "--requeue-template", slurm.requeue()]
    on += ["--jobid-lookup", slurm.lookup()]
    ok = CliRunner().invoke(app, on)
    assert ok.exit_code == 0, ok.output
    assert "restart after isolation: jobs llm-* via command (dry run)" in ok.output
    bad = CliRunner().invoke(app, [*on[:-1], "no-such-squeue -w {host}"])
    assert bad.exit_code == 2
    assert "restart FAILED" in bad.output and "no-such-squeue" in bad.output
