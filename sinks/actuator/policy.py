"""Whether a command may act: the actuator's safety rules, in the order they apply.

1. ``duplicate`` — the ledger says this command id already acted, or a command for
   the same fault (job, host, component, fault; see :func:`fault_key`) acted within
   ``fault_window_s``: never twice, even when a restarted worker decided it again
   under another id.
2. ``alert_only`` — the pipeline asked for an alert, not an action: never acts.
3. ``denied`` — the host matches a deny pattern: never acts, whatever else says.
4. ``dry_run`` — the actuator runs without ``--execute`` (``[actuator] execute``), or
   the command itself says ``dry_run: true`` (set by the worker while its
   ``[worker.policy] dry_run`` is true, the default), or does not say ``dry_run:
   false`` at all (absent means dry run: a forged or older command never acts by
   omission): log exactly what would be done, do nothing. Both switches must allow an
   action; the log line names the one that held it back, and ``c4stream config
   check`` warns when they disagree.
5. ``capped`` — ``max_actions_per_job_per_hour`` commands of this job acted in the
   last hour: the actuator's own cap, whatever the pipeline's policy says.
6. ``act``.

>>> from streams.commands import IsolationCommand
>>> from sinks.actuator.config import ActuatorConfig
>>> cmd = IsolationCommand(id="c4-1", ts_us=1, job="j", host="h3", fault="straggler",
...                        action="cordon", confidence=0.9, reason="late", evidence={},
...                        dry_run=False)
>>> decide(cmd, ActuatorConfig(execute=True), already_done=False)
('act', 'execute')
>>> decide(msgspec.structs.replace(cmd, dry_run=None), ActuatorConfig(execute=True),
...        already_done=False)
('dry_run', 'the command does not say dry_run: false')
>>> decide(cmd, ActuatorConfig(execute=True), already_done=False, job_actions=2)[0]
'capped'
>>> decide(cmd, ActuatorConfig(execute=True, deny=("h*",)), already_done=False)
('denied', 'host h3 is in the deny list (h*)')
>>> decide(cmd, ActuatorConfig(), already_done=False)[0]
'dry_run'
"""

from __future__ import annotations

from typing import Literal

import msgspec

from sinks.actuator.config import ActuatorConfig
from streams.commands import IsolationCommand

__all__ = ["Decision", "decide", "fault_key"]

Decision = Literal["act", "dry_run", "alert_only", "denied", "duplicate", "capped"]


def fault_key(cmd: IsolationCommand) -> str:
    """The fault's identity (and the action asked for it), whatever id the pipeline gave
    the command.

    >>> c = IsolationCommand(id="x", ts_us=1, job="j", host="h3", fault="noncomm_hang",
    ...                      action="cordon", confidence=1, reason="", evidence={}, gpu=2)
    >>> fault_key(c)
    '["j","h3","noncomm_hang",2,null,null,"cordon"]'
    """
    return msgspec.json.encode(
        [cmd.job, cmd.host, cmd.fault, cmd.gpu, cmd.nic, cmd.peer_host, cmd.action]
    ).decode()


def decide(
    cmd: IsolationCommand,
    cfg: ActuatorConfig,
    *,
    already_done: bool,
    same_fault_done: str | None = None,
    job_actions: int = 0,
) -> tuple[Decision, str]:
    """The decision for ``cmd`` and a short why (for the log and the ledger).

    ``same_fault_done``: id of a command for the same fault that acted within
    ``cfg.fault_window_s``; ``job_actions``: commands of the job acted in the last hour.
    """
    if already_done:
        return "duplicate", f"command {cmd.id} already acted (ledger)"
    if same_fault_done is not None and cmd.action != "alert_only":
        return "duplicate", f"the same fault already acted as command {same_fault_done}"
    if cmd.action == "alert_only":
        return "alert_only", "action alert_only never acts"
    pattern = cfg.deny_pattern(cmd.host)
    if pattern is not None:
        return "denied", f"host {cmd.host} is in the deny list ({pattern})"
    if not cfg.execute:
        return "dry_run", "actuator runs without --execute ([actuator] execute = false)"
    if cmd.dry_run is None:
        return "dry_run", "the command does not say dry_run: false"
    if cmd.dry_run:
        return "dry_run", (
            "the command says dry_run: the worker's [worker.policy] dry_run is true "
            "(set it to false there to act; --execute alone is not enough)"
        )
    if job_actions >= cfg.max_actions_per_job_per_hour:
        return "capped", (
            f"{job_actions} commands of job {cmd.job} acted in the last hour "
            f"(cap {cfg.max_actions_per_job_per_hour})"
        )
    return "act", "execute"
