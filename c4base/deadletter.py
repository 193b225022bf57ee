"""Dead-letter records: what was rejected, where it came from, and why.

Every stage that rejects input (an exporter's bad line, a worker's undecodable
message, a sink's invalid command) publishes one of these to ``c4.deadletter`` and
goes on. The original bytes travel base64-encoded so nothing is lost, even when they
are not UTF-8.

>>> rec = DeadLetter.of(b"{oops", reason="malformed JSON", stage="worker",
...                     source="c4.events[0]@17", ts_us=1)
>>> DeadLetter.decode(rec.encode()).payload()
b'{oops'

What a dead letter carries is bounded (a 695 KB event once made a dead letter over the
broker's 1 MB limit, and the worker died sending it): payloads over ``max_payload``
keep their head, with their full size and sha256 to find the original.

>>> big = DeadLetter.of(b"x" * 100_000, reason="r" * 5000, stage="worker", source="s")
>>> len(big.payload()), big.payload_bytes, big.truncated, len(big.reason)
(65536, 100000, True, 2000)
"""

from __future__ import annotations

import base64
import hashlib
import time

import msgspec

from c4base.progress import Message

__all__ = ["DeadLetter"]


#: Payload bytes a dead letter keeps (base64 makes it ~87 KB on the wire).
MAX_PAYLOAD = 64 * 1024
MAX_REASON = 2000
MAX_KEY = 1024


class DeadLetter(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 1
    kind: str = "deadletter"
    stage: str
    """Which component rejected it: exporter, replay, worker, archiver, actuator, alerter."""
    source: str
    """Where it came from: ``file:line`` or ``topic[partition]@offset``."""
    reason: str
    ts_us: int
    payload_b64: str
    key: str | None = None
    truncated: bool = False
    """The payload is only the head of the original (see ``payload_bytes``)."""
    payload_bytes: int | None = None
    """Size of the original payload, when truncated."""
    payload_sha256: str | None = None
    """sha256 of the original payload, when truncated."""

    @classmethod
    def of(
        cls,
        payload: bytes,
        *,
        reason: str,
        stage: str,
        source: str,
        key: str | bytes | None = None,
        ts_us: int | None = None,
        max_payload: int = MAX_PAYLOAD,
    ) -> DeadLetter:
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        cut = len(payload) > max_payload
        return cls(
            stage=stage,
            source=source,
            reason=reason[:MAX_REASON],
            ts_us=ts_us if ts_us is not None else time.time_ns() // 1000,
            payload_b64=base64.b64encode(payload[:max_payload]).decode("ascii"),
            key=key[:MAX_KEY] if key is not None else None,
            truncated=cut,
            payload_bytes=len(payload) if cut else None,
            payload_sha256=hashlib.sha256(payload).hexdigest() if cut else None,
        )

    @classmethod
    def of_record(cls, rec: Message, reason: str, stage: str) -> DeadLetter:
        """The dead letter of a consumed record, keyed and sourced like it."""
        return cls.of(rec.value, reason=reason, stage=stage, source=rec.source, key=rec.key)

    def payload(self) -> bytes:
        return base64.b64decode(self.payload_b64)

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> DeadLetter:
        return msgspec.json.decode(data, type=cls)
