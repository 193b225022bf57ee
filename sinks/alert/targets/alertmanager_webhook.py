"""A JSON receiver that expects Alertmanager's *webhook format* (``webhook_config``, v4).

This is the payload Alertmanager *sends* to its webhook receivers — for anything that
already consumes Alertmanager webhooks (incident tools, custom bridges), which can take
c4stream's alerts unchanged. It cannot feed an Alertmanager (its ``/api/v2/alerts``
answers 400): for that use ``type = "alertmanager_api"``
(:mod:`sinks.alert.targets.alertmanager_api`). Config type ``alertmanager_webhook``;
the old name ``alertmanager`` still selects this target (and ``config check`` says so).

One c4stream alert group (a faulty host of a job) is
one Alertmanager group with one alert::

    {"version": "4", "groupKey": "{}:{host=\\"h3\\", job=\\"j\\"}", "truncatedAlerts": 0,
     "status": "firing" | "resolved", "receiver": <destination name>,
     "groupLabels": {"host", "job"}, "commonLabels": {...}, "commonAnnotations": {...},
     "externalURL": ..., "alerts": [{"status", "labels", "annotations", "startsAt",
     "endsAt", "generatorURL", "fingerprint"}]}

Labels: ``alertname="C4FaultyHost"``, ``job``, ``host``, ``severity``, ``fault``.
While firing, ``endsAt`` is Go's zero time ``0001-01-01T00:00:00Z``, as Alertmanager
sends it. The fingerprint hashes the group key only, so it stays the same when the
severity of an open alert rises.
"""

from __future__ import annotations

from typing import Any

from sinks.alert.model import Notification, rfc3339
from sinks.alert.targets.base import Target

__all__ = ["ALERTNAME", "AlertmanagerWebhookTarget", "common_annotations"]

ALERTNAME = "C4FaultyHost"
_ZERO_TIME = "0001-01-01T00:00:00Z"


def common_annotations(n: Notification) -> dict[str, str]:
    """Annotations both Alertmanager targets send: what a person reads, never identity."""
    annotations = {
        "summary": f"{', '.join(n.faults)} on {n.host} (job {n.job})",
        "description": n.text,
    }
    for key, value in (
        ("action", n.action),
        ("dry_run", None if n.dry_run is None else str(n.dry_run).lower()),
        ("actuator", n.outcome),
        ("actuator_detail", n.outcome_detail),
        ("confidence", None if n.confidence is None else f"{n.confidence:.2f}"),
        ("gpu", None if n.gpu is None else str(n.gpu)),
        ("nic", n.nic),
        ("peer_host", n.peer_host),
        ("command_id", n.command_id),
    ):
        if value is not None:
            annotations[key] = value
    return annotations


class AlertmanagerWebhookTarget(Target):
    kind = "alertmanager_webhook"

    def render(self, n: Notification) -> dict[str, Any]:
        group_labels = {"host": n.host, "job": n.job}
        labels = {
            "alertname": ALERTNAME,
            "job": n.job,
            "host": n.host,
            "severity": n.severity,
            "fault": ",".join(n.faults),
        }
        annotations = common_annotations(n)
        # Alertmanager's groupKey is "<route key>:<group labels>", labels sorted as
        # {a="1", b="2"}; c4stream has a single implicit route "{}".
        group_key = "{}:{" + ", ".join(f'{k}="{v}"' for k, v in sorted(group_labels.items())) + "}"
        alert = {
            "status": n.status,
            "labels": labels,
            "annotations": annotations,
            "startsAt": rfc3339(n.starts_at),
            "endsAt": rfc3339(n.ends_at) if n.ends_at is not None else _ZERO_TIME,
            "generatorURL": self.link(n) or "",
            "fingerprint": n.fingerprint,
        }
        return {
            "version": "4",
            "groupKey": group_key,
            "truncatedAlerts": 0,
            "status": n.status,
            "receiver": self.destination.name,
            "groupLabels": group_labels,
            "commonLabels": labels,
            "commonAnnotations": annotations,
            "externalURL": self.external_url,
            "alerts": [alert],
        }
