"""The Slurm backend: drain the node with ``scontrol``, never over an administrator's drain.

Per ``cordon`` / ``cordon_and_taint`` command (the command's host, mapped to the node
name by the actuator's ``strip_domain`` / ``node_regex``):

1. ``scontrol -o show node NODE`` — read the node's state and reason;
2. if the node is already drained, draining, down or failed for a reason that is not
   c4stream's, it is an administrator's (or slurmctld's) decision: left exactly as it
   is, and the command ends ``skipped`` with that reason ("RMA ticket 1234" stays);
3. if c4stream already drained it (reason ``c4stream <id>: …``): nothing to do;
4. else ``scontrol update nodename=NODE state=drain reason="c4stream <id>: <reason>"``.

A drain is a safe repeat. The window between 1 and 4 is not atomic (scontrol has no
compare-and-set): an administrator draining the node in that instant has their reason
replaced by c4stream's — the node is drained either way, and c4stream's reason names
the command so the audit trail shows it.

``restart_job`` is skipped with the reason (a Slurm job id is not part of the command);
failures are classified by :func:`sinks.actuator.process.classify` (a non-admin user or
a missing slurm.conf stops the actuator; an unknown node fails that command at once).

``check()`` (``c4stream actuate --check``) runs ``scontrol ping`` (slurmctld UP) and
``scontrol show node`` of ``check_node`` (or the first node listed), and says whether
the user scontrol runs as is SlurmUser or root (others need an AdminLevel in slurmdbd).

>>> from streams.commands import IsolationCommand
>>> from sinks.actuator.config import SlurmSettings
>>> be = SlurmBackend(SlurmSettings(command_prefix=("sudo", "-n")), check_programs=False)
>>> cmd = IsolationCommand(id="c4-1", ts_us=1, job="j", host="node-005", fault="straggler",
...     action="cordon", confidence=0.9, reason="GPU 2 late", evidence={})
>>> be.drain_argv(cmd)[:5], be.drain_argv(cmd)[-1]
(['sudo', '-n', 'scontrol', 'update', 'nodename=node-005'], 'reason=c4stream c4-1: GPU 2 late')
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import shlex
import shutil

from sinks.actuator.backends import ActionOutcome, ActuatorConfigError, PermanentActionError
from sinks.actuator.config import SlurmSettings
from sinks.actuator.process import Ran, classify, run_argv
from sinks.actuator.recovery import Found
from streams.commands import IsolationCommand

__all__ = ["SlurmBackend", "is_held", "parse_node"]

log = logging.getLogger("c4stream.actuator.slurm")

#: Node state flags that mean "someone already took it out of service".
_HELD = frozenset({"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "FAILING", "MAINT"})
_REASON_MAX = 200  # Slurm keeps the whole reason; `sinfo -R` shows about this much


def parse_node(text: str) -> dict[str, str]:
    """``scontrol -o show node`` (one line of ``Key=Value``) as a dict; values may have
    spaces (``Reason=RMA ticket 1234 [root@…]``), so each runs up to the next `` Key=``.

    >>> d = parse_node("NodeName=n1 State=IDLE+DRAIN Reason=RMA ticket 1 [root@2026-01-01]")
    >>> d["State"], d["Reason"]
    ('IDLE+DRAIN', 'RMA ticket 1 [root@2026-01-01]')
    """
    pairs = re.finditer(r"(?:^|\s)([A-Za-z_]+)=(.*?)(?=\s+[A-Za-z_]+=|\s*$)", text.strip())
    return {m.group(1): m.group(2).strip() for m in pairs}


def is_held(state: str) -> bool:
    """Whether a node state (``IDLE+DRAIN``, ``DOWN*``, ``MIXED+DRAIN``) is out of service.

    >>> is_held("IDLE+DRAIN"), is_held("DOWN*"), is_held("IDLE"), is_held("UNKNOWN*")
    (True, True, False, False)
    """
    flags = {f.rstrip("*~#!%$@^-") for f in state.upper().split("+")}
    return bool(flags & _HELD)


class SlurmBackend:
    """Drains Slurm nodes with scontrol (see the module docstring)."""

    name = "slurm"

    def __init__(self, settings: SlurmSettings, *, check_programs: bool = True) -> None:
        if settings.timeout_s <= 0:
            raise ActuatorConfigError("[actuator.slurm] timeout_s must be positive")
        self.s = settings
        self.env: dict[str, str] | None = None
        if settings.slurm_conf is not None:
            if check_programs and not os.path.isfile(settings.slurm_conf):
                raise ActuatorConfigError(
                    f"slurm.conf {settings.slurm_conf!r} ([actuator.slurm] slurm_conf) "
                    "does not exist"
                )
            self.env = {**os.environ, "SLURM_CONF": settings.slurm_conf}
        if check_programs:
            for prog in (*settings.command_prefix[:1], settings.scontrol):
                if shutil.which(prog) is None:
                    raise ActuatorConfigError(
                        f"program {prog!r} is not on PATH; install slurm-client "
                        "or set [actuator.slurm] scontrol to its full path"
                    )

    # ---------------------------------------------------------------- argv

    def _argv(self, *args: str) -> list[str]:
        return [*self.s.command_prefix, self.s.scontrol, *args]

    def reason(self, cmd: IsolationCommand) -> str:
        text = f"{self.s.reason_prefix} {cmd.id}: {cmd.reason}"
        return text if len(text) <= _REASON_MAX else text[: _REASON_MAX - 1] + "…"

    def drain_argv(self, cmd: IsolationCommand) -> list[str]:
        return self._argv(
            "update", f"nodename={cmd.host}", "state=drain", f"reason={self.reason(cmd)}"
        )

    def _run(self, what: str, *args: str) -> Ran:
        return self._run_argv(what, self._argv(*args))

    def _run_argv(self, what: str, argv: list[str]) -> Ran:
        ran = run_argv(argv, timeout_s=self.s.timeout_s, env=self.env)
        if not ran.ok:
            raise classify(ran, what, timeout_s=self.s.timeout_s)
        return ran

    def _ours(self, reason: str) -> bool:
        return reason.startswith(f"{self.s.reason_prefix} ")

    # ---------------------------------------------------------------- backend

    def describe(self, cmd: IsolationCommand) -> str:
        if cmd.action == "restart_job":
            return "slurm: restart_job is not supported by the slurm backend; skipped"
        return (
            f"slurm: node {cmd.host}: unless already drained or down for another reason, "
            f"run {shlex.join(self.drain_argv(cmd))}"
        )

    def node(self, name: str) -> dict[str, str]:
        """The node as slurmctld reports it; PermanentActionError if it does not know it."""
        ran = self._run(f"show node {name}", "-o", "show", "node", name)
        fields = parse_node(ran.stdout)
        if fields.get("NodeName") != name:
            raise PermanentActionError(f"slurm: node {name!r} not found: {ran.stdout[:200]!r}")
        return fields

    def apply(self, cmd: IsolationCommand) -> ActionOutcome:
        if cmd.action == "restart_job":
            return ActionOutcome(changed=False, detail=self.describe(cmd), skipped=True)
        node = self.node(cmd.host)
        state, reason = node.get("State", ""), node.get("Reason", "")
        if is_held(state):
            if self._ours(reason):
                return ActionOutcome(
                    changed=False, detail=f"node {cmd.host} already drained by c4stream ({reason})"
                )
            return ActionOutcome(
                changed=False,
                skipped=True,
                detail=f"node {cmd.host} is already {state} by someone else "
                f"(reason {reason or 'none'!r}); left as it is",
            )
        self._run_argv(f"drain {cmd.host}", self.drain_argv(cmd))
        return ActionOutcome(changed=True, detail=f"drained node {cmd.host} (was {state})")

    def already_applied(self, cmd: IsolationCommand) -> Found:
        """After a crash while acting (sinks.actuator.recovery): slurmctld says whether
        the node is drained by c4stream; one ``scontrol show node``, no write."""
        if cmd.action == "restart_job":
            return Found("not_applied", "restart_job is skipped by the slurm backend")
        node = self.node(cmd.host)
        state, reason = node.get("State", ""), node.get("Reason", "")
        if is_held(state) and self._ours(reason):
            return Found("applied", f"node {cmd.host} is {state} with our reason ({reason})")
        return Found("not_applied", f"node {cmd.host} is {state or '?'} (reason {reason!r})")

    def check(self) -> list[str]:
        ping = self._run("scontrol ping", "ping").stdout
        if " is UP" not in ping:
            raise ActuatorConfigError(f"slurm: slurmctld is not up: {ping or '(no output)'}")
        lines = [f"slurm: {ping.splitlines()[0].strip()}"]
        name = self.s.check_node
        if name is None:
            first = self._run("show nodes", "-o", "show", "nodes").stdout.splitlines()
            name = parse_node(first[0]).get("NodeName") if first else None
        if name is not None:
            try:
                n = self.node(name)
            except PermanentActionError as err:
                raise ActuatorConfigError(f"slurm: check node: {err}") from None
            lines.append(
                f"slurm: node {name}: State={n.get('State', '?')} Reason={n.get('Reason', '')!r}"
            )
        config = self._run("show config", "show", "config").stdout
        m = re.search(r"^SlurmUser\s*=\s*(\S+?)(?:\(\d+\))?\s*$", config, re.M)
        slurm_user = m.group(1) if m else "?"
        who = self._whoami()
        if who in ("root", slurm_user):
            lines.append(f"slurm: scontrol runs as {who} (SlurmUser is {slurm_user}): may drain")
        else:
            lines.append(
                f"slurm: WARNING: scontrol runs as {who}, not root or SlurmUser ({slurm_user}); "
                "drains fail with 'Invalid user id' unless slurmdbd gives it AdminLevel "
                "Operator (set [actuator.slurm] command_prefix, e.g. sudo -n)"
            )
        return lines

    def _whoami(self) -> str:
        if not self.s.command_prefix:
            return getpass.getuser()
        ran = run_argv([*self.s.command_prefix, "id", "-un"], timeout_s=self.s.timeout_s)
        return ran.stdout.strip() if ran.ok else f"? ({ran.stderr or 'id -un failed'})"
