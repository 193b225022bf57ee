"""Dead-letter records: what was rejected, where it came from, and why.

Every stage that rejects input (an exporter's bad line, a worker's undecodable
message, a sink's invalid command) publishes one of these to ``c4.deadletter`` and
goes on. The original bytes travel base64-encoded so nothing is lost, even when they
are not UTF-8.

>>> rec = DeadLetter.of(b"{oops", reason="malformed JSON", stage="worker",
...                     source="c4.events[0]@17", ts_us=1)
>>> DeadLetter.decode(rec.encode()).payload()
b'{oops'
"""

from __future__ import annotations

import base64
import time

import msgspec

__all__ = ["DeadLetter"]


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
    ) -> DeadLetter:
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        return cls(
            stage=stage,
            source=source,
            reason=reason,
            ts_us=ts_us if ts_us is not None else time.time_ns() // 1000,
            payload_b64=base64.b64encode(payload).decode("ascii"),
            key=key,
        )

    def payload(self) -> bytes:
        return base64.b64decode(self.payload_b64)

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> DeadLetter:
        return msgspec.json.decode(data, type=cls)
