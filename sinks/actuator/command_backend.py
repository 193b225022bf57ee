"""The command backend: a scheduler command per isolation, run without a shell.

For clusters without Kubernetes, e.g. Slurm::

    scontrol update nodename={host} state=drain reason="{reason}"

The template is split with :func:`shlex.split` *first* and each argument is filled in
*afterwards*, so a value can never add, remove or re-quote arguments: a reason such as
``x" state=resume "`` stays inside the one ``reason=`` argument. The argument vector
runs with :class:`subprocess.Popen` (no shell) in its own process group, which is
killed whole when the timeout expires, so a child the command spawned cannot linger.

Placeholders: ``{host} {reason} {fault} {gpu} {nic} {id} {job} {action} {peer_host}
{confidence}``; format specs work (``{confidence:.2f}``). A template that names
``{gpu}``, ``{nic}`` or ``{peer_host}`` fails for a command that lacks that field
(dead-lettered, never run with a blank).

Exit status 0 is success. A failure is classified by :func:`sinks.actuator.process.classify`:
exit 126/127 or stderr matching ``fatal_patterns`` (default: scontrol's "Invalid user
id", a missing slurm.conf, munge failures) stops the actuator; stderr matching
``permanent_patterns`` (default: scontrol's "Invalid node name specified") fails that
command at once; anything else, and a timeout, is retried, then dead-lettered with the
exit status and the tail of stderr. For Slurm, prefer ``backend = "slurm"``: it also
keeps an administrator's drain (this backend runs the template blindly).

Every run gets ``C4STREAM_COMMAND_ID`` (the command id, also the ``{id}`` placeholder)
in its environment, so a script can deduplicate; and ``C4STREAM_RECOVERY=1`` when it
runs again after an actuator died between running it and recording it. Such a re-run
happens only with ``idempotent = true`` (the operator says the script deduplicates by
that id); else the command is not run again and its outcome is ``unknown``
(:mod:`sinks.actuator.recovery`).

``restart_job`` without ``restart_template`` is skipped with the reason (not recorded
as done, so a template added later still acts when the command is delivered again).

>>> from streams.commands import IsolationCommand
>>> t = CommandTemplate('scontrol update nodename={host} state=drain reason="{reason}"')
>>> cmd = IsolationCommand(id="c4-1", ts_us=1, job="j", host="h3", fault="straggler",
...     action="cordon", confidence=0.9, reason='GPU 2 late; x" state=resume "', evidence={})
>>> t.render(cmd)
['scontrol', 'update', 'nodename=h3', 'state=drain', 'reason=GPU 2 late; x" state=resume "']
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import string

from sinks.actuator.backends import (
    ActionOutcome,
    ActuatorConfigError,
    PermanentActionError,
)
from sinks.actuator.config import CommandSettings
from sinks.actuator.process import SLURM_FATAL, SLURM_PERMANENT, classify, run_argv, tail
from sinks.actuator.recovery import Found
from streams.commands import IsolationCommand

__all__ = ["ENV_ID", "ENV_RECOVERY", "FIELDS", "CommandBackend", "CommandTemplate"]

#: Environment of every run: the command id (to deduplicate), and "1" on a re-run after
#: an unfinished attempt.
ENV_ID = "C4STREAM_COMMAND_ID"
ENV_RECOVERY = "C4STREAM_RECOVERY"

log = logging.getLogger("c4stream.actuator.command")

#: The placeholders a template may use.
FIELDS = frozenset(
    {"host", "reason", "fault", "gpu", "nic", "id", "job", "action", "peer_host", "confidence"}
)
_OPTIONAL = frozenset({"gpu", "nic", "peer_host"})
_NO_RESTART = "no restart template configured (--restart-command-template); restart_job skipped"


class CommandTemplate:
    """An argv template: validated once, rendered per command."""

    def __init__(self, template: str, *, extra: frozenset[str] = frozenset()) -> None:
        """``extra``: placeholders beyond :data:`FIELDS` that ``render`` is given values
        for (the restart's ``{jobid}``)."""
        self.extra = extra
        try:
            self.argv = shlex.split(template)
        except ValueError as err:
            raise ActuatorConfigError(f"command template {template!r}: {err}") from None
        if not self.argv:
            raise ActuatorConfigError("the command template is empty")
        self.fields: set[str] = set()
        for i, token in enumerate(self.argv):
            try:
                names = {f for _, f, _, _ in string.Formatter().parse(token) if f is not None}
            except ValueError as err:
                raise ActuatorConfigError(f"command template argument {token!r}: {err}") from None
            unknown = names - FIELDS - extra
            if unknown:
                raise ActuatorConfigError(
                    f"command template names unknown placeholder(s) {sorted(unknown)}; "
                    f"known: {sorted(FIELDS | extra)}"
                )
            if i == 0 and names:
                # The program itself must be fixed: a value chooses nothing to execute.
                raise ActuatorConfigError(
                    f"the program of a command template must be fixed, not {token!r}"
                )
            self.fields |= names

    def render(self, cmd: IsolationCommand, **extra: str | None) -> list[str]:
        """The argument vector for ``cmd``; raises PermanentActionError on a missing field."""
        values: dict[str, object] = {
            "host": cmd.host,
            "reason": cmd.reason,
            "fault": cmd.fault,
            "gpu": cmd.gpu,
            "nic": cmd.nic,
            "id": cmd.id,
            "job": cmd.job,
            "action": cmd.action,
            "peer_host": cmd.peer_host,
            "confidence": cmd.confidence,
            **{k: extra.get(k) for k in self.extra},
        }
        missing = sorted(f for f in self.fields & (_OPTIONAL | self.extra) if values[f] is None)
        if missing:
            raise PermanentActionError(
                f"command {cmd.id}: the command template needs {missing} but the command "
                "has none; use a template without them for this action"
            )
        return [tok.format_map(values) for tok in self.argv]


class CommandBackend:
    """Runs the configured template per command (see the module docstring)."""

    name = "command"

    def __init__(self, settings: CommandSettings, *, check_programs: bool = True) -> None:
        if settings.template is None:
            raise ActuatorConfigError(
                "the command backend needs --command-template, e.g. "
                "'scontrol update nodename={host} state=drain reason=\"{reason}\"'"
            )
        if settings.timeout_s <= 0:
            raise ActuatorConfigError("--command-timeout must be positive")
        self.settings = settings
        self._recovering: set[str] = set()
        """Command ids whose next run follows an unfinished attempt."""
        self.isolate = CommandTemplate(settings.template)
        self.restart = (
            CommandTemplate(settings.restart_template) if settings.restart_template else None
        )
        if check_programs:
            for t in (self.isolate, self.restart):
                if t is not None and shutil.which(t.argv[0]) is None:
                    raise ActuatorConfigError(
                        f"program {t.argv[0]!r} of the command template is not on PATH "
                        "(or not executable); install it or give its full path"
                    )

    def _template(self, cmd: IsolationCommand) -> CommandTemplate | None:
        return self.restart if cmd.action == "restart_job" else self.isolate

    def describe(self, cmd: IsolationCommand) -> str:
        t = self._template(cmd)
        if t is None:
            return f"command: {_NO_RESTART}"
        argv = shlex.join(t.render(cmd))
        return f"command: run {argv} (no shell, timeout {self.settings.timeout_s:g}s)"

    def apply(self, cmd: IsolationCommand) -> ActionOutcome:
        t = self._template(cmd)
        if t is None:
            return ActionOutcome(changed=False, detail=_NO_RESTART, skipped=True)
        recovery = cmd.id in self._recovering
        self._recovering.discard(cmd.id)
        env = {**os.environ, ENV_ID: cmd.id, ENV_RECOVERY: "1" if recovery else "0"}
        ran = run_argv(t.render(cmd), timeout_s=self.settings.timeout_s, env=env)
        if not ran.ok:
            raise classify(
                ran,
                f"command {cmd.id}",
                fatal=self.settings.fatal_patterns or SLURM_FATAL,
                permanent=self.settings.permanent_patterns or SLURM_PERMANENT,
                timeout_s=self.settings.timeout_s,
            )
        log.info("ran %s: exit 0 %s", ran.shown, tail(ran.stdout))
        return ActionOutcome(changed=True, detail=f"ran {ran.shown}: exit 0")

    def already_applied(self, cmd: IsolationCommand) -> Found:
        """A template is opaque: only the operator can say a re-run is safe."""
        if self._template(cmd) is None:
            return Found("not_applied", _NO_RESTART)
        if self.settings.idempotent:
            self._recovering.add(cmd.id)
            return Found(
                "not_applied",
                f"[actuator.command] idempotent = true: run again with {ENV_ID}={cmd.id} "
                f"and {ENV_RECOVERY}=1",
            )
        return Found(
            "unknown",
            "the command may have run before the actuator stopped; not run again "
            "([actuator.command] idempotent = false): check the host, and to let it act "
            "again set its ledger row to 'failed'",
        )

    def check(self) -> list[str]:
        """The programs are installed; nothing is run (a template may have side effects)."""
        lines = []
        for t in (self.isolate, self.restart):
            if t is not None:
                path = shutil.which(t.argv[0])
                if path is None:
                    raise ActuatorConfigError(f"program {t.argv[0]!r} is not on PATH")
                lines.append(f"command: {t.argv[0]} found at {path}")
        if self.restart is None:
            lines.append(f"command: {_NO_RESTART}")
        return lines
