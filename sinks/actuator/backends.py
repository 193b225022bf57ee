"""What every actuator backend promises, and the error policy they share.

A backend turns one :class:`~streams.commands.IsolationCommand` into an action on the
cluster. It offers two calls:

- ``describe(cmd)`` — the exact text of what ``apply`` would do; the dry-run log line;
- ``apply(cmd)`` — do it, return an :class:`ActionOutcome`, or raise one of the three
  errors below. An outcome with ``skipped=True`` means the backend deliberately did
  nothing (an administrator's drain is kept, no restart template is configured): the
  ledger records ``skipped`` with the reason, so a later delivery may still act.
- ``check()`` — verify, before serving, that the backend can act (``actuate --check``):
  lines to show, or :class:`ActuatorConfigError`.

Each backend classifies its failures where it sees them (the program's exit status and
messages, the API's HTTP status), into one of three errors.
The error class decides what the consumer does next:

================================  ==============================================
error                             what happens
================================  ==============================================
:class:`TransientActionError`     retried (bounded, with back-off), then
                                  dead-lettered; the ledger marks it ``failed``
:class:`PermanentActionError`     dead-lettered at once; ``failed`` in the ledger
:class:`ActuatorConfigError`      the actuator stops without committing the
                                  offset: fix the configuration and restart, the
                                  command is delivered again
================================  ==============================================

``apply`` must be safe to repeat (the ledger makes a command act once, but a crash
between the action and the ledger write repeats it): cordoning a cordoned node or
draining a drained one changes nothing.

The three errors are the shared runtime's classes (:mod:`c4base.runtime`: fatal,
permanent, transient), so the consumer loop acts on them without knowing the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from c4base.runtime import FatalError, PermanentError, TransientError
from streams.commands import IsolationCommand

__all__ = [
    "ActionOutcome",
    "ActuatorConfigError",
    "ActuatorError",
    "Backend",
    "PermanentActionError",
    "TransientActionError",
]


class ActuatorError(Exception):
    """Base of the actuator's errors."""


class ActuatorConfigError(ActuatorError, FatalError):
    """The actuator is misconfigured (template, executable, kubeconfig, RBAC).

    Nothing was acted on and the offset was not committed. Fix the configuration
    named in the message and start ``c4stream actuate`` again.
    """


class PermanentActionError(ActuatorError, PermanentError):
    """This command cannot be carried out (e.g. no such node); retrying will not help.

    The command goes to the dead-letter topic with this message as its reason. Fix
    the cause (e.g. the host-to-node name) and re-publish it if it still matters.
    """


class TransientActionError(ActuatorError, TransientError):
    """The action failed this time (lost write races, server error, exit status, timeout).

    The consumer retries it a bounded number of times, then dead-letters it. The
    ledger marks it ``failed``, which does not block a later delivery from acting.
    """


@dataclass(frozen=True, slots=True)
class ActionOutcome:
    """What ``apply`` did.

    >>> ActionOutcome(changed=False, detail="node h3 already cordoned and tainted")
    ActionOutcome(changed=False, detail='node h3 already cordoned and tainted', skipped=False)
    """

    changed: bool
    """False when the target already was in the wanted state (a safe repeat)."""
    detail: str
    """One line for the log and the ledger."""
    skipped: bool = False
    """Deliberately not acted on (the reason is in ``detail``); not recorded as done."""


class Backend(Protocol):
    """The contract every backend implements (see the module docstring)."""

    name: str

    def describe(self, cmd: IsolationCommand) -> str:
        """Exactly what :meth:`apply` would do for ``cmd``; no side effects."""
        ...

    def apply(self, cmd: IsolationCommand) -> ActionOutcome:
        """Carry ``cmd`` out; raise one of the module's errors on failure."""
        ...

    def check(self) -> list[str]:
        """Verify the backend can act; lines for the operator, or ActuatorConfigError."""
        ...
