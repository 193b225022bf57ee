"""Discord webhook with one embed.

Execute-webhook body: ``username``, ``embeds`` (``title`` ≤ 256, ``description`` ≤ 4096,
``color`` as an integer, ``fields`` ≤ 25 of ``{name ≤ 256, value ≤ 1024, inline}``,
``timestamp`` ISO 8601, ``footer``; all text of an embed ≤ 6000, which the clips
here keep: 256 + 2048 + 12 facts × 220 < 6000) and
``allowed_mentions: {"parse": []}`` so a reason that contains ``@everyone`` pings nobody.
Discord answers 204 No Content, and 429 with Retry-After when rate limited.
"""

from __future__ import annotations

from typing import Any

from sinks.alert.model import Notification, rfc3339
from sinks.alert.targets.base import Target, clip, color_of

__all__ = ["DiscordTarget"]


class DiscordTarget(Target):
    kind = "discord"

    def render(self, n: Notification) -> dict[str, Any]:
        embed: dict[str, Any] = {
            "title": clip(n.title, 256),
            "description": clip(n.text, 2048),
            "color": int(color_of(n)[1:], 16),
            "fields": [
                {"name": clip(k, 256), "value": clip(v, 200) or "-", "inline": True}
                for k, v in n.facts()[:25]
            ],
            "timestamp": rfc3339(n.ends_at if n.ends_at is not None else n.starts_at),
            "footer": {"text": f"c4stream · fingerprint {n.fingerprint}"},
        }
        link = self.link(n)
        if link:
            embed["url"] = link
        return {"username": "c4stream", "embeds": [embed], "allowed_mentions": {"parse": []}}
