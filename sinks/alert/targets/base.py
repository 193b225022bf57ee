"""The one contract every chat target implements (render a notification, judge a reply).

A target turns a :class:`~sinks.alert.model.Notification` into one HTTP POST with a JSON
body. Signing targets (DingTalk, Feishu) sign inside :meth:`Target.request`, which the
delivery loop calls again for every attempt, so a retried message carries a fresh
timestamp. :meth:`Target.judge` maps a reply to deliver / retry / give up; targets whose
API answers errors with HTTP 200 and an error code in the body override it.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from sinks.alert.config import Destination
from sinks.alert.model import Notification

__all__ = [
    "COLORS",
    "TARGETS",
    "Outcome",
    "Target",
    "WebhookRequest",
    "clip",
    "color_of",
]

TARGETS: dict[str, type[Target]] = {}
"""Every target class by its config ``type``; filled as the target modules are imported."""

COLORS = {"critical": "#D32F2F", "warning": "#F57C00", "info": "#1976D2", "resolved": "#2E7D32"}


def color_of(n: Notification) -> str:
    """Hex colour for a notification: green once resolved, else by severity."""
    return COLORS["resolved" if n.status == "resolved" else n.severity]


def clip(text: str, limit: int) -> str:
    """Cut ``text`` to ``limit`` characters, marking the cut with an ellipsis.

    >>> clip("abcdef", 4), clip("abc", 4)
    ('abc…', 'abc')
    """
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Outcome(enum.Enum):
    OK = "ok"
    RETRY = "retry"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class WebhookRequest:
    """One POST: where to, and the JSON body. ``url`` may carry credentials: never log it."""

    url: str
    json: dict[str, Any] | list[dict[str, Any]]
    """The body: an object for chat webhooks, a list of alerts for Alertmanager's API."""
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> bytes:
        return msgspec.json.encode(self.json)


class Target(ABC):
    """Base class of chat targets; subclasses set ``kind`` and implement :meth:`render`."""

    kind: ClassVar[str]
    refreshes: ClassVar[bool] = False
    """True for targets that must be told again about open alerts every
    ``refresh_interval_s`` (Alertmanager's API: alerts expire at their ``endsAt``)."""
    idempotent: ClassVar[bool] = False
    """True when posting the same notification twice shows it once (Alertmanager's API
    deduplicates by labels), so a request whose answer never came may be sent again.
    Chat webhooks (Slack, Teams, Discord, Mattermost, DingTalk, Feishu) offer no
    deduplication key: a second post is a second message."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        TARGETS[cls.kind] = cls

    def __init__(
        self,
        destination: Destination,
        *,
        external_url: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.destination = destination
        self.external_url = external_url
        self.clock = clock
        """Wall clock in seconds; only signing targets read it."""

    @property
    def name(self) -> str:
        return self.destination.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.destination!r})"

    @abstractmethod
    def render(self, n: Notification) -> dict[str, Any] | list[dict[str, Any]]:
        """The JSON body in this chat's own format."""

    def request(self, n: Notification) -> WebhookRequest:
        """The POST to send now (signing targets add a fresh timestamp and signature)."""
        return WebhookRequest(self.destination.url, self.render(n))

    def judge(self, status: int, body: bytes) -> tuple[Outcome, str]:
        """Deliver, retry or give up on a reply: 2xx ok; 429 and 5xx retry; other 4xx fail.

        >>> from sinks.alert.config import Destination
        >>> from sinks.alert.targets.slack import SlackTarget
        >>> t = SlackTarget(Destination(type="slack", url="https://x/y"))
        >>> [t.judge(s, b"")[0].value for s in (200, 204, 429, 503, 404)]
        ['ok', 'ok', 'retry', 'retry', 'fail']
        """
        if 200 <= status < 300:
            return Outcome.OK, f"HTTP {status}"
        detail = f"HTTP {status}: {clip(body.decode('utf-8', 'replace').strip(), 200)}"
        if status == 429 or status >= 500:
            return Outcome.RETRY, detail
        return Outcome.FAIL, detail

    def link(self, n: Notification) -> str | None:
        """Where a person clicks for details: the notification's URL or the configured one."""
        return n.url or self.external_url or None


def judge_error_code(
    status: int, body: bytes, code_keys: tuple[str, ...], retry_codes: frozenset[int]
) -> tuple[Outcome, str] | None:
    """For APIs that answer HTTP 200 with ``{"<code>": n, ...}``: a verdict, or None if ok.

    >>> judge_error_code(200, b'{"errcode":310000,"errmsg":"sign not match"}',
    ...                  ("errcode",), frozenset())
    (<Outcome.FAIL: 'fail'>, 'errcode 310000: sign not match')
    >>> judge_error_code(200, b'{"errcode":0}', ("errcode",), frozenset()) is None
    True
    """
    if not 200 <= status < 300:
        return None
    try:
        doc = msgspec.json.decode(body) if body else {}
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    for key in code_keys:
        code = doc.get(key)
        if isinstance(code, int) and code != 0:
            msg = doc.get("errmsg") or doc.get("msg") or ""
            outcome = Outcome.RETRY if code in retry_codes else Outcome.FAIL
            return outcome, clip(f"{key} {code}: {msg}", 200)
    return None
