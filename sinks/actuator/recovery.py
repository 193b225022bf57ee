"""After a crash while acting: is the action already there? Ask the target, never guess.

The actuator writes an ``in_progress`` ledger row before it acts and the outcome after
(:mod:`sinks.actuator.ledger`). A process killed in between (SIGKILL, OOM, power) leaves
the row ``in_progress``; the command is delivered again because its offset was never
committed. Repeating the action blindly is what ran 6 of 6 commands twice in the
issue-25 probe. Instead the redelivered command asks its backend what the target says:

========================  =====================================================
backend                   how it tells
========================  =====================================================
slurm                     ``scontrol show node``: DRAIN/DRAINED/DRAINING with a
                          reason of ours (``c4stream <id>: …``) → applied
kubernetes                the Node is cordoned (when the action cordons) and
                          carries our taint with the fault and the effect → applied
command                   it cannot: a template is opaque. With
                          ``[actuator.command] idempotent = true`` the operator says
                          the script deduplicates by ``C4STREAM_COMMAND_ID``: it is
                          run again with the same id (and ``C4STREAM_RECOVERY=1``);
                          else the outcome is ``unknown`` (not run again, alerted)
========================  =====================================================

A backend offers this as ``already_applied(cmd) -> Found``. ``applied`` records ``done``
without acting; ``not_applied`` acts as on a first delivery (the action is a safe repeat
where it ran halfway); ``unknown`` records ``unknown``, a final status that blocks later
deliveries and is published to ``c4.actions`` so the alerter shows it.

>>> node = {"spec": {"unschedulable": True, "taints": [
...     {"key": "c4stream.io/fault", "value": "straggler", "effect": "NoSchedule"}]}}
>>> node_isolated(node, taint_key="c4stream.io/fault", fault="straggler",
...               cordon=True, effect="NoSchedule")
True
>>> node_isolated(node, taint_key="c4stream.io/fault", fault="straggler",
...               cordon=True, effect="NoExecute")
False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from streams.commands import IsolationCommand

__all__ = ["Found", "already_applied", "node_isolated"]

State = Literal["applied", "not_applied", "unknown"]


@dataclass(frozen=True, slots=True)
class Found:
    """What the target says about a command left unfinished by a crash."""

    state: State
    detail: str


def already_applied(backend: Any, cmd: IsolationCommand) -> Found:
    """Ask ``backend`` (its ``already_applied``); a backend without one cannot tell."""
    check = getattr(backend, "already_applied", None)
    if check is None:
        return Found(
            "unknown",
            f"backend {getattr(backend, 'name', '?')} cannot tell whether the action ran",
        )
    found: Found = check(cmd)
    return found


def node_isolated(
    node: dict[str, Any], *, taint_key: str, fault: str, cordon: bool, effect: str | None
) -> bool:
    """Whether a Node (raw JSON) already carries what the Kubernetes backend's action
    sets: ``spec.unschedulable`` when it cordons, our taint with this fault and effect."""
    spec = node.get("spec") or {}
    if cordon and not spec.get("unschedulable"):
        return False
    if effect is None:
        return True
    return any(
        t.get("key") == taint_key and t.get("value") == fault and t.get("effect") == effect
        for t in spec.get("taints") or []
    )
