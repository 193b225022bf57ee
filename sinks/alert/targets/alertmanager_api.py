"""A real Alertmanager client: POST ``/api/v2/alerts`` (Alertmanager's own API, v2).

Config: ``type = "alertmanager_api"``, ``url`` = Alertmanager's base URL
(``http://alertmanager:9093``; ``/api/v2/alerts`` is appended unless already there).
Alertmanager then does the routing, grouping, silencing and inhibition; c4stream only
keeps it told, as Prometheus does:

- **identity**: an alert is its label set. c4stream's is stable per job and host:
  ``alertname="C4FaultyHost"``, ``job``, ``host`` and ``severity`` (Alertmanager routes
  on severity, so it must be a label). Everything that changes while a host's alert is
  open — faults, action, dry run, what the actuator did, the reason — is an annotation,
  so it never forks a second alert.
- **escalation** (info → warning → critical) changes ``severity`` and so the identity:
  the post that fires the new severity also resolves the previous one (its ``endsAt`` =
  now), so no stale warning stays active next to the critical alert.
- **firing**: ``startsAt`` = when the host's alert opened; ``endsAt`` = now + 4 ×
  ``refresh_interval_s``, and the alerter re-posts every open alert each
  ``refresh_interval_s`` (default 60 s). So Alertmanager never resolves a live alert by
  its own ``resolve_timeout`` (what a zero ``endsAt`` would invite), and if c4stream
  stops, its alerts resolve by themselves a few minutes later instead of firing forever.
- **resolution**: ``endsAt`` = the resolution time (never later than now).

Replies: 200 is delivered; 400 (a body Alertmanager rejects) is not retried; 429/5xx
and connection errors are retried by the delivery loop.

>>> from sinks.alert.config import Destination
>>> from sinks.alert.samples import sample_notification
>>> t = AlertmanagerApiTarget(Destination(type="alertmanager_api", url="http://am:9093"),
...                           clock=lambda: 1_764_000_060.0)
>>> req = t.request(sample_notification())
>>> req.url, [a["labels"]["severity"] for a in req.json], req.json[0]["endsAt"]
('http://am:9093/api/v2/alerts', ['critical'], '2025-11-24T16:05:00Z')
"""

from __future__ import annotations

from typing import Any

from sinks.alert.model import Notification, Severity, rfc3339
from sinks.alert.targets.alertmanager_webhook import ALERTNAME, common_annotations
from sinks.alert.targets.base import Target, WebhookRequest

__all__ = ["AlertmanagerApiTarget", "alert_labels"]

_PATH = "/api/v2/alerts"
#: How many refresh intervals a firing alert stays valid without a refresh.
_TTL_REFRESHES = 4


def alert_labels(n: Notification, severity: Severity) -> dict[str, str]:
    """The identity of c4stream's alert for ``n``'s host at ``severity``."""
    return {"alertname": ALERTNAME, "job": n.job, "host": n.host, "severity": severity}


class AlertmanagerApiTarget(Target):
    kind = "alertmanager_api"
    #: The alerter re-posts open alerts to this target (see the module docstring).
    refreshes = True
    #: An alert is its label set: the same post twice is one alert (a safe retry).
    idempotent = True

    @property
    def api_url(self) -> str:
        base = self.destination.url.rstrip("/")
        return base if base.endswith(_PATH) else base + _PATH

    def render(self, n: Notification) -> list[dict[str, Any]]:
        now = self.clock()
        annotations = common_annotations(n)
        generator = self.link(n) or ""
        if n.status == "resolved":
            ends = min(n.ends_at if n.ends_at is not None else now, now)
        else:
            ends = now + _TTL_REFRESHES * self.destination.refresh_interval_s
        alerts = [
            {
                "labels": alert_labels(n, n.severity),
                "annotations": annotations,
                "startsAt": rfc3339(n.starts_at),
                "endsAt": rfc3339(ends),
                "generatorURL": generator,
            }
        ]
        if n.previous_severity is not None and n.previous_severity != n.severity:
            alerts.append(
                {
                    "labels": alert_labels(n, n.previous_severity),
                    "annotations": {**annotations, "description": f"Escalated to {n.severity}."},
                    "startsAt": rfc3339(n.starts_at),
                    "endsAt": rfc3339(now),
                    "generatorURL": generator,
                }
            )
        return alerts

    def request(self, n: Notification) -> WebhookRequest:
        return WebhookRequest(self.api_url, self.render(n))
