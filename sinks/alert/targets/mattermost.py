"""Mattermost incoming webhook: Markdown ``text`` plus one Slack-style message attachment.

Mattermost has no Block Kit; its incoming webhooks take ``text`` (Markdown) and
``attachments`` (``fallback``, ``color``, ``title``, ``title_link``, ``text``,
``fields`` of ``{short, title, value}``, ``footer``). ``username``/``icon_url`` overrides
are left out: servers ignore them unless an admin enabled overrides. Answers 200 ``ok``.
"""

from __future__ import annotations

from typing import Any

from sinks.alert.model import Notification
from sinks.alert.targets.base import Target, clip, color_of

__all__ = ["MattermostTarget"]


class MattermostTarget(Target):
    kind = "mattermost"

    def render(self, n: Notification) -> dict[str, Any]:
        attachment: dict[str, Any] = {
            "fallback": clip(f"{n.title}: {n.text}", 3000),
            "color": color_of(n),
            "title": n.title,
            "text": n.text,
            "fields": [{"short": True, "title": k, "value": v} for k, v in n.facts()],
            "footer": f"c4stream · fingerprint {n.fingerprint}",
        }
        link = self.link(n)
        if link:
            attachment["title_link"] = link
        return {"text": f"#### {n.title}", "attachments": [attachment]}
