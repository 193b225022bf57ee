"""Whether a command may act: the actuator's safety rules, in the order they apply.

1. ``duplicate`` — the ledger says this command id already acted: never twice.
2. ``alert_only`` — the pipeline asked for an alert, not an action: never acts.
3. ``denied`` — the host matches a deny pattern: never acts, whatever else says.
4. ``dry_run`` — the actuator runs without ``--execute`` (``[actuator] execute``), or
   the command itself says ``dry_run: true`` (set by the worker while its
   ``[worker.policy] dry_run`` is true, the default): log exactly what would be done,
   do nothing. Both switches must allow an action; the log line names the one that
   held it back, and ``c4stream config check`` warns when they disagree.
5. ``act``.

>>> from streams.commands import IsolationCommand
>>> from sinks.actuator.config import ActuatorConfig
>>> cmd = IsolationCommand(id="c4-1", ts_us=1, job="j", host="h3", fault="straggler",
...                        action="cordon", confidence=0.9, reason="late", evidence={})
>>> decide(cmd, ActuatorConfig(execute=True), already_done=False)
('act', 'execute')
>>> decide(cmd, ActuatorConfig(execute=True, deny=("h*",)), already_done=False)
('denied', 'host h3 is in the deny list (h*)')
>>> decide(cmd, ActuatorConfig(), already_done=False)[0]
'dry_run'
"""

from __future__ import annotations

from typing import Literal

from sinks.actuator.config import ActuatorConfig
from streams.commands import IsolationCommand

__all__ = ["Decision", "decide"]

Decision = Literal["act", "dry_run", "alert_only", "denied", "duplicate"]


def decide(
    cmd: IsolationCommand, cfg: ActuatorConfig, *, already_done: bool
) -> tuple[Decision, str]:
    """The decision for ``cmd`` and a short why (for the log and the ledger)."""
    if already_done:
        return "duplicate", f"command {cmd.id} already acted (ledger)"
    if cmd.action == "alert_only":
        return "alert_only", "action alert_only never acts"
    pattern = cfg.deny_pattern(cmd.host)
    if pattern is not None:
        return "denied", f"host {cmd.host} is in the deny list ({pattern})"
    if not cfg.execute:
        return "dry_run", "actuator runs without --execute ([actuator] execute = false)"
    if cmd.dry_run:
        return "dry_run", (
            "the command says dry_run: the worker's [worker.policy] dry_run is true "
            "(set it to false there to act; --execute alone is not enough)"
        )
    return "act", "execute"
