"""Routing: each notification goes to every destination whose ``min_severity`` it reaches.

A group's severity only rises while it is open, so a destination that received a
``firing`` message also receives the ``resolved`` one (unless ``send_resolved = false``).

>>> from sinks.alert.config import Destination
>>> r = Router([Destination(type="slack", url="http://a", name="ops", min_severity="info"),
...             Destination(type="dingtalk", url="http://b", name="oncall",
...                         min_severity="critical")])
>>> r.route_severity("warning", "firing"), r.route_severity("critical", "resolved")
(['ops'], ['ops', 'oncall'])
"""

from __future__ import annotations

from collections.abc import Sequence

from sinks.alert.config import Destination
from sinks.alert.model import Notification, Severity, Status, severity_at_least

__all__ = ["Router"]


class Router:
    def __init__(self, destinations: Sequence[Destination]) -> None:
        self.destinations = list(destinations)

    def route_severity(self, severity: Severity, status: Status) -> list[str]:
        return [
            d.name
            for d in self.destinations
            if severity_at_least(severity, d.min_severity)
            and (status == "firing" or d.send_resolved)
        ]

    def route(self, n: Notification) -> list[str]:
        """Names of the destinations that get ``n``."""
        return self.route_severity(n.severity, n.status)
