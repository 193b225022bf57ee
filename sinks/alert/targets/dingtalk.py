"""DingTalk custom robot, ``markdown`` message, optionally signed ("加签").

Body: ``{"msgtype": "markdown", "markdown": {"title": ..., "text": ...}}``; ``title`` is
what the notification preview shows. Signing, as DingTalk documents it: with ``timestamp``
the current time in milliseconds,

    sign = urlencode(base64(HMAC-SHA256(key=secret, msg=f"{timestamp}\\n{secret}")))

appended to the webhook URL (which already holds ``access_token``) as ``&timestamp=…&sign=…``.
DingTalk rejects a timestamp more than an hour off, so every attempt signs anew.
Errors come back as HTTP 200 with ``errcode`` ≠ 0 (310000 bad signature or keyword,
130101 sending too fast, which is retried).

>>> sign_dingtalk("secret", 1700000000000)   # vector from a public DingTalk SDK's tests
'OuzzJR5%2BxZ4%2FEYwqtNt6sMYZQMTa%2FHEGvc9miJe7XzY%3D'
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any
from urllib.parse import quote_plus

from sinks.alert.model import Notification
from sinks.alert.targets.base import Outcome, Target, WebhookRequest, judge_error_code

__all__ = ["DingTalkTarget", "sign_dingtalk"]

_RETRY_CODES = frozenset({130101})  # "send too fast": DingTalk's rate limit


def sign_dingtalk(secret: str, timestamp_ms: int) -> str:
    """The URL-encoded ``sign`` query parameter for ``timestamp_ms``."""
    digest = hmac.new(
        secret.encode("utf-8"), f"{timestamp_ms}\n{secret}".encode(), hashlib.sha256
    ).digest()
    return quote_plus(base64.b64encode(digest).decode("ascii"))


class DingTalkTarget(Target):
    kind = "dingtalk"

    def render(self, n: Notification) -> dict[str, Any]:
        lines = [f"#### {n.title}", "", n.text, ""]
        lines += [f"- **{k}**: {v}" for k, v in n.facts()]
        link = self.link(n)
        if link:
            lines += ["", f"[Details]({link})"]
        lines += ["", f"c4stream · fingerprint {n.fingerprint}"]
        return {"msgtype": "markdown", "markdown": {"title": n.title, "text": "\n".join(lines)}}

    def request(self, n: Notification) -> WebhookRequest:
        url = self.destination.url
        secret = self.destination.secret
        if secret:
            ts = int(self.clock() * 1000)
            sep = "&" if "?" in url else "?"
            url = f"{url}{sep}timestamp={ts}&sign={sign_dingtalk(secret, ts)}"
        return WebhookRequest(url, self.render(n))

    def judge(self, status: int, body: bytes) -> tuple[Outcome, str]:
        return judge_error_code(status, body, ("errcode",), _RETRY_CODES) or super().judge(
            status, body
        )
