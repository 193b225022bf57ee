"""Grouping and de-duplication: one faulty host of a job is one alert, from open to resolved.

What arrives: isolation commands and verdicts, possibly many per host (several
communicators, several windows, a correlator that re-decides, Kafka redelivering).
What people want: one message when a host goes bad, one more if it gets worse, and one
when it is over. The rules, per group key ``job/host``:

- **open**: the first command or verdict for the key makes a ``firing`` notification;
- **de-duplicate**: an id already seen in the group (a redelivery) is ignored; further
  items of the same or lower severity only update the group (counts, faults, latest
  reason) and send nothing;
- **escalate**: an item of higher severity than what was last sent (a ``warning`` verdict,
  then a ``critical`` cordon command) sends one more ``firing`` message, marked escalated;
- **remind**: if ``repeat_interval_s`` > 0, a still-open alert is re-sent that often;
- **outcome**: what the actuator reported (``c4.actions``) is joined to the alert of
  its job and host; an outcome a person must know about (failed, skipped because an
  administrator holds the node, denied) sends one more ``firing`` message; acted and
  dry-run outcomes only update the alert (shown in its next message or refresh);
- **resolve**: "resolved" means *no new command or verdict for the host within
  ``resolve_timeout_s``* of the last one (default 10 minutes). Either the host was
  isolated and stopped producing telemetry, or the fault went away. The ``resolved``
  message carries ``ends_at = last arrival + resolve_timeout_s`` and says exactly that;
  un-cordoning stays a person's decision.

State is bounded: at most ``max_groups`` open alerts (least recently seen forgotten first,
counted) and at most ``_IDS_PER_GROUP`` remembered ids per alert. Time is passed in
explicitly (wall-clock seconds at receipt), so the same code runs live and in tests.

>>> g = Grouper(resolve_timeout_s=60)
>>> obs = [Observation(id=f"c{i}", kind="command", job="j", host="h3", fault="straggler",
...                    severity="critical", reason="h3 arrives last") for i in range(3)]
>>> [n.status for o in obs for n in g.observe(o, now=100.0)]
['firing']
>>> [(n.status, n.commands) for n in g.expire(now=170.0)]
[('resolved', 3)]
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from sinks.alert.model import (
    Notification,
    Severity,
    fingerprint_of,
    severity_of_command,
    severity_of_verdict,
    severity_rank,
)
from streams.commands import IsolationCommand
from streams.verdicts import Verdict

__all__ = ["Grouper", "GroupingStats", "Observation"]

_IDS_PER_GROUP = 256


@dataclass(frozen=True, slots=True)
class Observation:
    """What grouping needs from one command or verdict."""

    id: str
    kind: Literal["command", "verdict"]
    job: str
    host: str
    fault: str
    severity: Severity
    reason: str
    action: str | None = None
    confidence: float | None = None
    gpu: int | None = None
    nic: str | None = None
    peer_host: str | None = None
    dry_run: bool | None = None

    @classmethod
    def of_command(cls, cmd: IsolationCommand) -> Observation:
        return cls(
            id=cmd.id,
            kind="command",
            job=cmd.job,
            host=cmd.host,
            fault=cmd.fault,
            severity=severity_of_command(cmd.action, cmd.dry_run),
            reason=cmd.reason,
            action=cmd.action,
            confidence=cmd.confidence,
            gpu=cmd.gpu,
            nic=cmd.nic,
            peer_host=cmd.peer_host,
            dry_run=cmd.dry_run,
        )

    @classmethod
    def of_verdict(cls, v: Verdict) -> Observation:
        return cls(
            id=v.id,
            kind="verdict",
            job=v.job,
            host=v.host,
            fault=v.fault,
            severity=severity_of_verdict(v.score, v.benign),
            reason=v.reason,
            confidence=v.score,
            gpu=v.gpu,
            nic=v.nic,
            peer_host=v.peer_host,
        )


@dataclass
class GroupingStats:
    opened: int = 0
    escalated: int = 0
    reminded: int = 0
    resolved: int = 0
    duplicates: int = 0
    """Items whose id the group had already seen (redeliveries)."""
    folded: int = 0
    """Items that only updated an open alert: the de-duplication at work."""
    evicted: int = 0


@dataclass(slots=True)
class _Group:
    key: str
    job: str
    host: str
    first_seen: float
    last_seen: float
    severity: Severity
    sent_severity: Severity
    last_sent: float
    reason: str
    faults: list[str]
    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    commands: int = 0
    verdicts: int = 0
    action: str | None = None
    confidence: float | None = None
    gpu: int | None = None
    nic: str | None = None
    peer_host: str | None = None
    dry_run: bool | None = None
    command_id: str | None = None
    has_command: bool = False
    outcome: str | None = None
    outcome_detail: str | None = None

    def absorb(self, o: Observation, now: float) -> None:
        self.ids[o.id] = None
        if len(self.ids) > _IDS_PER_GROUP:
            self.ids.popitem(last=False)
        self.last_seen = now
        if o.fault not in self.faults:
            self.faults.append(o.fault)
        if o.kind == "command":
            self.commands += 1
        else:
            self.verdicts += 1
        # The reason shown is the latest of the most severe items: a later info verdict
        # must not replace the sentence of the cordon command.
        if severity_rank(o.severity) >= severity_rank(self.severity):
            self.reason = o.reason
            self.severity = o.severity
        # Details of a command win over a verdict's: it is the correlated decision.
        if o.kind == "command" or not self.has_command:
            self.has_command = self.has_command or o.kind == "command"
            self.confidence = o.confidence
            self.gpu, self.nic, self.peer_host = o.gpu, o.nic, o.peer_host
            if o.kind == "command":
                self.action, self.dry_run, self.command_id = o.action, o.dry_run, o.id


class Grouper:
    """Folds commands and verdicts into per-host alerts; returns what to notify."""

    def __init__(
        self, *, resolve_timeout_s: float, repeat_interval_s: float = 0.0, max_groups: int = 10_000
    ) -> None:
        self.resolve_timeout_s = resolve_timeout_s
        self.repeat_interval_s = repeat_interval_s
        self.max_groups = max_groups
        self.stats = GroupingStats()
        # Least recently seen first, so expiry and eviction pop from the front.
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        # Actuator outcomes that arrived before their alert opened: key -> (outcome,
        # detail, dry_run, arrival).
        self._pending: OrderedDict[str, tuple[str, str, bool, float]] = OrderedDict()

    def __len__(self) -> int:
        """Open alerts."""
        return len(self._groups)

    def observe(self, o: Observation, now: float) -> list[Notification]:
        key = f"{o.job}/{o.host}"
        out: list[Notification] = []
        g = self._groups.get(key)
        if g is not None and now - g.last_seen >= self.resolve_timeout_s:
            # Quiet for the whole timeout but not yet expired by a tick: close it first.
            del self._groups[key]
            out.append(self._resolved(g))
            g = None
        if g is None:
            g = _Group(
                key=key,
                job=o.job,
                host=o.host,
                first_seen=now,
                last_seen=now,
                severity=o.severity,
                sent_severity=o.severity,
                last_sent=now,
                reason=o.reason,
                faults=[],
            )
            g.absorb(o, now)
            early = self._pending.pop(key, None)
            if early is not None and now - early[3] < self.resolve_timeout_s:
                g.outcome, g.outcome_detail = early[0], early[1]
                g.dry_run = True if early[2] else g.dry_run
            self._groups[key] = g
            self.stats.opened += 1
            out.append(self._firing(g))
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
                self.stats.evicted += 1
            return out
        if o.id in g.ids:
            self.stats.duplicates += 1
            return out
        g.absorb(o, now)
        self._groups.move_to_end(key)
        if severity_rank(g.severity) > severity_rank(g.sent_severity):
            previous = g.sent_severity
            g.sent_severity, g.last_sent = g.severity, now
            self.stats.escalated += 1
            out.append(self._firing(g, escalated=True, previous=previous))
        elif self.repeat_interval_s > 0 and now - g.last_sent >= self.repeat_interval_s:
            g.last_sent = now
            self.stats.reminded += 1
            out.append(self._firing(g))
        else:
            self.stats.folded += 1
        return out

    def observe_outcome(
        self, job: str, host: str, outcome: str, detail: str, dry_run: bool, now: float
    ) -> list[Notification]:
        """Join the actuator's report to the open alert of ``job/host`` (if any)."""
        key = f"{job}/{host}"
        g = self._groups.get(key)
        if g is None:
            # Read before its command (two topics, no order between them): kept for a
            # while and applied when the alert opens. Bounded like the groups.
            self._pending[key] = (outcome, detail, dry_run, now)
            self._pending.move_to_end(key)
            while len(self._pending) > self.max_groups:
                self._pending.popitem(last=False)
            return []
        changed = (g.outcome, g.outcome_detail) != (outcome, detail)
        g.outcome, g.outcome_detail = outcome, detail
        if dry_run:
            g.dry_run = True
        if changed and outcome in ("failed", "skipped", "denied", "unknown"):
            g.last_sent = now
            return [self._firing(g)]
        return []

    def open_alerts(self) -> list[Notification]:
        """The current ``firing`` form of every open alert (targets that refresh)."""
        return [self._firing(g) for g in self._groups.values()]

    def expire(self, now: float) -> list[Notification]:
        """Resolve every alert quiet for ``resolve_timeout_s``; call it about once a second."""
        out: list[Notification] = []
        while self._groups:
            g = next(iter(self._groups.values()))
            if now - g.last_seen < self.resolve_timeout_s:
                break
            del self._groups[g.key]
            out.append(self._resolved(g))
        return out

    def _resolved(self, g: _Group) -> Notification:
        self.stats.resolved += 1
        return self._notification(g, "resolved", ends_at=g.last_seen + self.resolve_timeout_s)

    def _firing(
        self, g: _Group, *, escalated: bool = False, previous: Severity | None = None
    ) -> Notification:
        return self._notification(g, "firing", escalated=escalated, previous=previous)

    @staticmethod
    def _notification(
        g: _Group,
        status: Literal["firing", "resolved"],
        *,
        ends_at: float | None = None,
        escalated: bool = False,
        previous: Severity | None = None,
    ) -> Notification:
        return Notification(
            key=g.key,
            fingerprint=fingerprint_of(g.key),
            status=status,
            severity=g.severity,
            job=g.job,
            host=g.host,
            faults=tuple(g.faults),
            summary=g.reason,
            starts_at=g.first_seen,
            ends_at=ends_at,
            action=g.action,
            confidence=g.confidence,
            gpu=g.gpu,
            nic=g.nic,
            peer_host=g.peer_host,
            dry_run=g.dry_run,
            commands=g.commands,
            verdicts=g.verdicts,
            escalated=escalated,
            command_id=g.command_id,
            outcome=g.outcome,
            outcome_detail=g.outcome_detail,
            previous_severity=previous,
        )
