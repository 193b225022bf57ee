"""Slack incoming webhook, Block Kit layout.

Body: ``text`` (the notification fallback) plus ``blocks``: a ``header`` (plain text,
at most 150 characters), a ``section`` with the reason in ``mrkdwn`` (at most 3000), then
``section`` blocks of at most 10 ``fields`` each, and a ``context`` line. ``&``, ``<`` and
``>`` are escaped as Slack's mrkdwn requires. Slack answers 200 ``ok``.
"""

from __future__ import annotations

from typing import Any

from sinks.alert.model import Notification
from sinks.alert.targets.base import Target, clip

__all__ = ["SlackTarget", "escape_mrkdwn"]


def escape_mrkdwn(text: str) -> str:
    """
    >>> escape_mrkdwn("a<b> & c")
    'a&lt;b&gt; &amp; c'
    """
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class SlackTarget(Target):
    kind = "slack"

    def render(self, n: Notification) -> dict[str, Any]:
        facts = [
            {"type": "mrkdwn", "text": clip(f"*{k}*\n{escape_mrkdwn(v)}", 2000)}
            for k, v in n.facts()
        ]
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": clip(n.title, 150)}},
            {
                "type": "section",
                "text": {"type": "mrkdwn", "text": clip(escape_mrkdwn(n.text), 3000)},
            },
        ]
        # Slack allows at most 10 fields per section.
        blocks += [
            {"type": "section", "fields": facts[i : i + 10]} for i in range(0, len(facts), 10)
        ]
        context = f"c4stream · fingerprint `{n.fingerprint}`"
        link = self.link(n)
        if link:
            context += f" · <{link}|details>"
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": context}]})
        # The top-level text is the notification fallback, also read as mrkdwn: escape it too.
        return {"text": clip(escape_mrkdwn(f"{n.title}: {n.text}"), 3000), "blocks": blocks}
