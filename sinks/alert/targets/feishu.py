"""Feishu / Lark custom bot, ``interactive`` message card, optionally signed.

Body: ``{"msg_type": "interactive", "card": {header, elements}}`` — header with a colour
``template``, a ``lark_md`` div with the reason, a div of short ``fields``, a rule and a
note. Signing, as Feishu documents it (note the roles: the *key* is the string, the
message is empty), with ``timestamp`` in **seconds**:

    sign = base64(HMAC-SHA256(key=f"{timestamp}\\n{secret}", msg=b""))

sent in the JSON body as ``"timestamp": "<seconds>"`` and ``"sign"``. Feishu rejects a
timestamp more than an hour off. Errors come back as HTTP 200 with ``code`` ≠ 0
(19021 bad signature, 9499 bad request; 11232 rate limited, which is retried).

>>> len(sign_feishu("secret", 1599360473))
44
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from sinks.alert.model import Notification
from sinks.alert.targets.base import Outcome, Target, WebhookRequest, judge_error_code

__all__ = ["FeishuTarget", "sign_feishu"]

_RETRY_CODES = frozenset({11232})  # frequency control
_TEMPLATES = {"critical": "red", "warning": "orange", "info": "blue"}


def sign_feishu(secret: str, timestamp_s: int) -> str:
    """The base64 ``sign`` body field for ``timestamp_s``."""
    key = f"{timestamp_s}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode("ascii")


class FeishuTarget(Target):
    kind = "feishu"

    def render(self, n: Notification) -> dict[str, Any]:
        template = "green" if n.status == "resolved" else _TEMPLATES[n.severity]
        fields = [
            {"is_short": True, "text": {"tag": "lark_md", "content": f"**{k}**\n{v}"}}
            for k, v in n.facts()
        ]
        note = f"c4stream · fingerprint {n.fingerprint}"
        link = self.link(n)
        if link:
            note += f" · {link}"
        card = {
            "config": {"wide_screen_mode": True},
            "header": {"title": {"tag": "plain_text", "content": n.title}, "template": template},
            "elements": [
                {"tag": "div", "text": {"tag": "lark_md", "content": n.text}},
                {"tag": "div", "fields": fields},
                {"tag": "hr"},
                {"tag": "note", "elements": [{"tag": "plain_text", "content": note}]},
            ],
        }
        return {"msg_type": "interactive", "card": card}

    def request(self, n: Notification) -> WebhookRequest:
        body = self.render(n)
        secret = self.destination.secret
        if secret:
            ts = int(self.clock())
            body = {"timestamp": str(ts), "sign": sign_feishu(secret, ts), **body}
        return WebhookRequest(self.destination.url, body)

    def judge(self, status: int, body: bytes) -> tuple[Outcome, str]:
        return judge_error_code(
            status, body, ("code", "StatusCode"), _RETRY_CODES
        ) or super().judge(status, body)
