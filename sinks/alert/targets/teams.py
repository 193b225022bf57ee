"""Microsoft Teams through a Workflows webhook ("When a Teams webhook request is received").

Workflows accept Adaptive Cards only (not the retired connectors' MessageCard). The body
is a message with one attachment of ``contentType``
``application/vnd.microsoft.card.adaptive`` whose ``content`` is the card (schema 1.4,
which Teams renders on every client): a title ``TextBlock``, the reason, a ``FactSet``
and an ``Action.OpenUrl`` when a link is configured. Workflows answer 202 Accepted.
"""

from __future__ import annotations

from typing import Any

from sinks.alert.model import Notification
from sinks.alert.targets.base import Target

__all__ = ["ADAPTIVE_CARD_CONTENT_TYPE", "TeamsTarget"]

ADAPTIVE_CARD_CONTENT_TYPE = "application/vnd.microsoft.card.adaptive"


class TeamsTarget(Target):
    kind = "teams"

    def render(self, n: Notification) -> dict[str, Any]:
        color = (
            "Good"
            if n.status == "resolved"
            else (
                "Attention"
                if n.severity == "critical"
                else "Warning"
                if n.severity == "warning"
                else "Accent"
            )
        )
        card: dict[str, Any] = {
            "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
            "type": "AdaptiveCard",
            "version": "1.4",
            "msteams": {"width": "Full"},
            "body": [
                {
                    "type": "TextBlock",
                    "text": n.title,
                    "size": "Large",
                    "weight": "Bolder",
                    "color": color,
                    "wrap": True,
                },
                {"type": "TextBlock", "text": n.text, "wrap": True},
                {"type": "FactSet", "facts": [{"title": k, "value": v} for k, v in n.facts()]},
            ],
        }
        link = self.link(n)
        if link:
            card["actions"] = [{"type": "Action.OpenUrl", "title": "Details", "url": link}]
        return {
            "type": "message",
            "attachments": [
                {"contentType": ADAPTIVE_CARD_CONTENT_TYPE, "contentUrl": None, "content": card}
            ],
        }
