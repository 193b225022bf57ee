"""Restart through a scheduler command, e.g. Slurm's ``scontrol requeue <jobid>``.

The telemetry names a job by the name the exporter was given (``job``); the scheduler
wants its own id. Two documented rules map one to the other:

- ``jobid_regex`` — a regex with a group ``jobid``, searched in the telemetry's job
  name: with ``slurm-(?P<jobid>[0-9]+)`` the job ``slurm-4242`` is Slurm job 4242 (set
  the exporter's job name from ``$SLURM_JOB_ID`` to use it);
- ``jobid_lookup`` — an argv template asking the scheduler which job runs on the
  isolated host, e.g. ``squeue -h -w {host} -n {job} -o %i``: one job id per line on
  stdout. No id: nothing to restart (skipped). Several ids: refused (skipped), because
  requeuing the wrong job is worse than requeuing none — narrow the lookup (``-n``).

Then ``requeue_template`` runs, e.g. ``scontrol requeue {jobid}``, with the command
backend's rules: split with shlex first, filled in afterwards, no shell, own process
group killed whole at the timeout (:mod:`sinks.actuator.process`). Exit status 0 is
success; a failure is classified as the command backend's are (a permission or
configuration error stops the actuator, anything unknown is retried, then ``failed``).

With ``--backend slurm`` the templates default to ``[command_prefix] scontrol requeue
{jobid}``, ``squeue -h -w {host} -n {job} -o %i`` and ``squeue -h -j {jobid} -o %T``
(``squeue`` beside ``scontrol``), run with the backend's ``SLURM_CONF``.

A job id must look like one (letters, digits, ``_ . : -``), so a lookup printing
something else is refused instead of passed on.

With ``status_template`` (Slurm: ``squeue -h -j {jobid} -o %T``), a job that is not
running — pending, configuring, requeued, completing — already is being restarted:
no second restart is started (the rail "none while a restart is in progress", asked of
the scheduler rather than the clock).

>>> from sinks.actuator.config import CommandSettings, RestartSettings
>>> from streams.commands import IsolationCommand
>>> r = CommandRestarter(CommandSettings(), RestartSettings(
...     requeue_template="scontrol requeue {jobid}", jobid_regex="slurm-(?P<jobid>[0-9]+)"),
...     check_programs=False)
>>> cmd = IsolationCommand(id="c4-1", ts_us=1, job="slurm-4242", host="node-3",
...     fault="straggler", action="cordon", confidence=0.9, reason="late", evidence={})
>>> r.plan(cmd, live=False).argv
('scontrol', 'requeue', '4242')
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Mapping

import msgspec

from sinks.actuator.backends import (
    ActionOutcome,
    ActuatorConfigError,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.command_backend import CommandTemplate
from sinks.actuator.config import CommandSettings, RestartSettings, SlurmSettings
from sinks.actuator.process import SLURM_FATAL, SLURM_PERMANENT, classify, run_argv
from sinks.actuator.restart import RestartPlan
from streams.commands import IsolationCommand

__all__ = ["CommandRestarter", "parse_job_ids", "slurm_restarter"]

_JOBID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
#: Slurm job states of a job that is on its way (back) to running.
BUSY_STATES = frozenset(
    {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "COMPLETING"}
)


def parse_job_ids(stdout: str) -> list[str]:
    """Job ids, one per non-empty line, each checked to look like an id.

    >>> parse_job_ids("4242\\n\\n4243_1\\n")
    ['4242', '4243_1']
    >>> parse_job_ids("4242; rm -rf /")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sinks.actuator.backends.PermanentActionError: the job id lookup printed '4242; rm -rf /', ...
    """
    ids = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        if not _JOBID.fullmatch(line):
            raise PermanentActionError(f"the job id lookup printed {line!r}, not a job id")
        ids.append(line)
    return ids


class CommandRestarter:
    """Maps the job to a scheduler id and runs ``requeue_template`` (module docstring)."""

    name = "command"

    def __init__(
        self,
        command: CommandSettings,
        settings: RestartSettings,
        *,
        check_programs: bool,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not settings.requeue_template:
            raise ActuatorConfigError(
                "restarting after an isolation needs [actuator.restart] requeue_template "
                "(--requeue-template), e.g. 'scontrol requeue {jobid}'"
            )
        self.timeout_s = command.timeout_s
        self.env = env
        self.fatal = command.fatal_patterns or SLURM_FATAL
        self.permanent = command.permanent_patterns or SLURM_PERMANENT
        self.requeue = CommandTemplate(settings.requeue_template, extra=frozenset({"jobid"}))
        self.regex: re.Pattern[str] | None = None
        if settings.jobid_regex:
            try:
                self.regex = re.compile(settings.jobid_regex)
            except re.error as err:
                raise ActuatorConfigError(f"jobid_regex {settings.jobid_regex!r}: {err}") from None
            if "jobid" not in self.regex.groupindex:
                raise ActuatorConfigError(
                    f"jobid_regex {settings.jobid_regex!r} needs a group named jobid, "
                    "e.g. 'slurm-(?P<jobid>[0-9]+)'"
                )
        self.lookup = CommandTemplate(settings.jobid_lookup) if settings.jobid_lookup else None
        self.status = (
            CommandTemplate(settings.status_template, extra=frozenset({"jobid"}))
            if settings.status_template
            else None
        )
        if "jobid" in self.requeue.fields and self.regex is None and self.lookup is None:
            raise ActuatorConfigError(
                "requeue_template uses {jobid}: set jobid_regex (--jobid-regex) or "
                "jobid_lookup (--jobid-lookup, e.g. 'squeue -h -w {host} -n {job} -o %i')"
            )
        if check_programs:
            for t in (self.requeue, self.lookup, self.status):
                if t is not None and shutil.which(t.argv[0]) is None:
                    raise ActuatorConfigError(
                        f"program {t.argv[0]!r} of a restart template is not on PATH"
                    )

    def _job_id(self, cmd: IsolationCommand, *, live: bool) -> tuple[str | None, str]:
        """(job id or None when not looked up, how it was found)."""
        if self.regex is not None:
            m = self.regex.search(cmd.job)
            if m is None or not m.group("jobid"):
                raise PermanentActionError(
                    f"job name {cmd.job!r} does not match jobid_regex {self.regex.pattern!r}"
                )
            jobid = m.group("jobid")
            if not _JOBID.fullmatch(jobid):
                raise PermanentActionError(f"jobid_regex gave {jobid!r}, not a job id")
            return jobid, f"job id {jobid} from the job name {cmd.job!r}"
        if self.lookup is None:
            return None, "no job id needed"
        argv = self.lookup.render(cmd)
        shown = shlex.join(argv)
        # A dry run looks the job up when it can (a read), and otherwise says how it would.
        if not live and shutil.which(argv[0]) is None:
            return None, f"job id from `{shown}`"
        try:
            out = self._run("job id lookup", argv)
        except (TransientActionError, ActuatorConfigError) as failed:
            if live:
                raise
            lines = str(failed).splitlines()  # first line says what ran, last one why
            why = lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"
            return None, f"job id from `{shown}` (not available now: {why})"
        ids = parse_job_ids(out)
        if not ids:
            raise PermanentActionError(f"no job named {cmd.job!r} runs on {cmd.host} ({shown})")
        if len(set(ids)) > 1:
            raise PermanentActionError(
                f"{len(set(ids))} jobs on {cmd.host} ({', '.join(sorted(set(ids)))}) for "
                f"{cmd.job!r}; cannot tell which one to restart (narrow {shown})"
            )
        return ids[0], f"job id {ids[0]} from `{shown}`"

    def plan(self, cmd: IsolationCommand, *, live: bool) -> RestartPlan:
        jobid, how = self._job_id(cmd, live=live)
        if jobid is None and "jobid" in self.requeue.fields:
            shown = " ".join(self.requeue.argv)
            return RestartPlan(
                job=cmd.job,
                host=cmd.host,
                target="?",
                description=f"command: {how}, then run {shown} (no shell)",
            )
        argv = self.requeue.render(cmd, jobid=jobid)
        return RestartPlan(
            job=cmd.job,
            host=cmd.host,
            target=jobid or cmd.job,
            description=f"command: run {shlex.join(argv)} ({how}; no shell, "
            f"timeout {self.timeout_s:g}s)",
            argv=tuple(argv),
            extra={"jobid": jobid} if jobid else {},
            cmd=cmd,
        )

    def _run(self, what: str, argv: list[str]) -> str:
        """stdout of ``argv``; a failure raised as classified by sinks.actuator.process."""
        ran = run_argv(argv, timeout_s=self.timeout_s, env=self.env)
        if not ran.ok:
            raise classify(
                ran, what, fatal=self.fatal, permanent=self.permanent, timeout_s=self.timeout_s
            )
        return ran.stdout

    def in_progress(self, plan: RestartPlan) -> str | None:
        # Without a status template: the lookup already asks the scheduler what runs on
        # the node (a requeued job is no longer there); in_progress_s covers the rest.
        jobid = plan.extra.get("jobid")
        if self.status is None or not jobid or plan.cmd is None:
            return None
        out = self._run("job state", self.status.render(plan.cmd, jobid=jobid))
        states = {line.strip().upper() for line in out.splitlines() if line.strip()}
        busy = sorted(states & BUSY_STATES)
        if busy:
            return f"job {jobid} is {', '.join(busy)}: a restart is in progress"
        return None

    def restart(self, plan: RestartPlan) -> ActionOutcome:
        if not plan.argv:
            raise PermanentActionError(f"no restart command resolved for job {plan.job}")
        argv = list(plan.argv)
        self._run(f"restart job {plan.target}", argv)
        return ActionOutcome(changed=True, detail=f"ran {shlex.join(argv)}: exit 0")


def slurm_restarter(
    slurm: SlurmSettings, settings: RestartSettings, *, check_programs: bool
) -> CommandRestarter:
    """The restarter of ``--backend slurm``: ``scontrol requeue`` and a ``squeue`` lookup
    unless the settings give their own templates or a ``jobid_regex``."""
    scontrol = shlex.join([*slurm.command_prefix, slurm.scontrol])
    squeue = os.path.join(os.path.dirname(slurm.scontrol), "squeue")  # beside scontrol
    defaults: dict[str, str] = {}
    if settings.requeue_template is None:
        defaults["requeue_template"] = f"{scontrol} requeue {{jobid}}"
    if settings.jobid_lookup is None and settings.jobid_regex is None:
        defaults["jobid_lookup"] = f"{shlex.quote(squeue)} -h -w {{host}} -n {{job}} -o %i"
    if settings.status_template is None:
        defaults["status_template"] = f"{shlex.quote(squeue)} -h -j {{jobid}} -o %T"
    env = {**os.environ, "SLURM_CONF": slurm.slurm_conf} if slurm.slurm_conf else None
    return CommandRestarter(
        CommandSettings(timeout_s=slurm.timeout_s),
        msgspec.structs.replace(settings, **defaults),
        check_programs=check_programs,
        env=env,
    )
