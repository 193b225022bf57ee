"""What a chat target renders: one :class:`Notification` about one faulty host.

Severity is derived from what the pipeline decided, never configured per message:

- an isolation command that acts (cordon, taint, restart) is ``critical``;
- an ``alert_only`` command, and a command marked ``dry_run`` (nothing will be acted
  on, so nobody needs to be woken), is ``warning``;
- a verdict (one detector's view, before per-host correlation) is ``warning`` when its
  score is at least 0.8 and ``info`` otherwise; a ``benign`` verdict is always ``info``.

>>> severity_of_command("cordon"), severity_of_command("alert_only")
('critical', 'warning')
>>> severity_of_command("cordon", dry_run=True)
'warning'
>>> severity_at_least("critical", "warning"), severity_at_least("info", "warning")
(True, False)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

__all__ = [
    "SEVERITIES",
    "Notification",
    "Severity",
    "Status",
    "fingerprint_of",
    "rfc3339",
    "severity_at_least",
    "severity_of_command",
    "severity_of_verdict",
    "severity_rank",
]

Severity = Literal["info", "warning", "critical"]
Status = Literal["firing", "resolved"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}

# A verdict at or above this score is worth a person's attention before correlation.
VERDICT_WARNING_SCORE = 0.8


def severity_rank(severity: Severity) -> int:
    return _RANK[severity]


def severity_at_least(severity: Severity, minimum: Severity) -> bool:
    return _RANK[severity] >= _RANK[minimum]


def severity_of_command(action: str, dry_run: bool | None = None) -> Severity:
    return "warning" if action == "alert_only" or dry_run else "critical"


def severity_of_verdict(score: float, benign: bool) -> Severity:
    """
    >>> [severity_of_verdict(s, b) for s, b in ((0.9, False), (0.5, False), (1.0, True))]
    ['warning', 'info', 'info']
    """
    if benign or score < VERDICT_WARNING_SCORE:
        return "info"
    return "warning"


def fingerprint_of(key: str) -> str:
    """16 hex digits identifying one alert across firing and resolved (as Alertmanager's).

    >>> len(fingerprint_of("j/h3")), fingerprint_of("j/h3") == fingerprint_of("j/h3")
    (16, True)
    """
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def rfc3339(ts_s: float) -> str:
    """
    >>> rfc3339(0.0)
    '1970-01-01T00:00:00Z'
    """
    dt = datetime.fromtimestamp(ts_s, tz=UTC)
    if dt.microsecond:
        return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Notification:
    """One message about one alert group (a faulty host of a job), firing or resolved."""

    key: str
    """Group key ``job/host``."""
    fingerprint: str
    status: Status
    severity: Severity
    job: str
    host: str
    faults: tuple[str, ...]
    """Every fault seen for this host while the alert was open, first seen first."""
    summary: str
    """The latest reason: one sentence a person on call can act on."""
    starts_at: float
    """Wall-clock seconds when the first command/verdict of the group arrived."""
    ends_at: float | None = None
    """Set when resolved: last arrival plus the resolve timeout."""
    action: str | None = None
    confidence: float | None = None
    gpu: int | None = None
    nic: str | None = None
    peer_host: str | None = None
    dry_run: bool | None = None
    commands: int = 0
    verdicts: int = 0
    escalated: bool = False
    """True when this firing message repeats an open alert because its severity rose."""
    command_id: str | None = None
    url: str | None = None
    """Link for people (dashboard, runbook); from the config's ``external_url``."""
    outcome: str | None = None
    """What the actuator reported doing (``c4.actions``): acted, dry_run, skipped,
    denied, failed; None until it reports."""
    outcome_detail: str | None = None
    previous_severity: Severity | None = None
    """On an escalation: the severity sent before (an identity-per-severity target
    resolves that alert)."""

    @property
    def title(self) -> str:
        """
        >>> n = Notification(key="j/h3", fingerprint="f", status="firing", severity="critical",
        ...                  job="j", host="h3", faults=("straggler",), summary="s", starts_at=0)
        >>> n.title
        '[FIRING:critical] straggler on h3 (job j)'
        """
        faults = ", ".join(self.faults) or "fault"
        state = "RESOLVED" if self.status == "resolved" else "FIRING"
        return f"[{state}:{self.severity}] {faults} on {self.host} (job {self.job})"

    @property
    def text(self) -> str:
        """The main sentence: the reason while firing, what "resolved" means once resolved."""
        if self.status == "resolved":
            return (
                f"No new command or verdict for {self.host} within the resolve timeout: "
                f"c4stream considers it resolved (isolated or recovered). Last reason: "
                f"{self.summary}"
            )
        if self.escalated:
            return f"Escalated to {self.severity}. {self.summary}"
        if self.outcome in ("failed", "skipped", "denied", "unknown"):
            return f"Actuator: {self.outcome} ({self.outcome_detail}). {self.summary}"
        return self.summary

    def facts(self) -> list[tuple[str, str]]:
        """Ordered (name, value) pairs every target shows; absent values are left out."""
        out: list[tuple[str, str]] = [
            ("Host", self.host),
            ("Job", self.job),
            ("Fault", ", ".join(self.faults)),
            ("Severity", self.severity),
        ]
        if self.action is not None:
            out.append(("Action", self.action + (" (dry run)" if self.dry_run else "")))
        if self.outcome is not None:
            shown = self.outcome + (f": {self.outcome_detail}" if self.outcome_detail else "")
            out.append(("Actuator", shown))
        if self.confidence is not None:
            out.append(("Confidence", f"{self.confidence:.2f}"))
        if self.gpu is not None:
            out.append(("GPU", str(self.gpu)))
        if self.nic is not None:
            out.append(("NIC", self.nic))
        if self.peer_host is not None:
            out.append(("Peer host", self.peer_host))
        out.append(("Commands / verdicts", f"{self.commands} / {self.verdicts}"))
        out.append(("Since", rfc3339(self.starts_at)))
        if self.ends_at is not None:
            out.append(("Until", rfc3339(self.ends_at)))
        return out
