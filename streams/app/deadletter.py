"""Dead letters of the worker: what it could not use, where it came from, and why.

>>> rec = Record(topic="c4.events", partition=2, offset=17, key=b"0xa", value=b"{oops")
>>> dl = dead_letter(rec, "undecodable message: malformed JSON")
>>> dl.source, dl.stage, dl.key, dl.payload()
('c4.events[2]@17', 'worker', '0xa', b'{oops')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from c4base.deadletter import DeadLetter
from c4base.progress import Message
from c4base.signing import FRESH_HEADER, HOST_HEADER, SIG_HEADER, SNAPSHOT_HEADER
from producers.columnar import CONTENT_TYPE_HEADER

__all__ = ["CLOCK_HEADER", "DeadLetterPublisher", "Record", "dead_letter", "refused_checkpoint"]

STAGE = "worker"


@dataclass(frozen=True, slots=True)
class Record(Message):
    """One Kafka message as the worker saw it (independent of Faust's event type)."""

    clock_us: int | None = None
    """Header :data:`CLOCK_HEADER` of a verdict: the event-time clock of its events
    partition when the detector concluded it (orders verdicts like DetectionPipeline)."""
    content_type: bytes | None = None
    """Header ``content-type`` of an events message (Arrow IPC batches carry one)."""
    signer: bytes | None = None
    signature: bytes | None = None
    """Headers ``c4-host`` / ``c4-sig`` of a signed events message (streams.app.trust)."""
    fresh: bytes | None = None
    """Header ``c4-fresh`` of a signed events message: the host's sequence number and
    time, inside the signature."""
    snapshot: bytes | None = None
    """Header ``c4-fr-snapshot``: the message is part of a Flight Recorder snapshot
    (judged whole, :mod:`producers.formats.fr_wire`), not of the stream."""

    @classmethod
    def of_event(cls, event: Any) -> Record:
        """From a Faust event whose topic uses raw (bytes) serializers."""
        msg = event.message
        value = event.value
        if not isinstance(value, bytes | bytearray):
            value = msg.value if isinstance(msg.value, bytes | bytearray) else b""
        key = event.key if isinstance(event.key, bytes | bytearray | None) else None
        headers = getattr(msg, "headers", None)
        clock = _header(headers, CLOCK_HEADER)
        return cls(
            msg.topic,
            msg.partition,
            msg.offset,
            key,
            bytes(value),
            int(clock) if clock is not None else None,
            _header(headers, CONTENT_TYPE_HEADER),
            _header(headers, HOST_HEADER),
            _header(headers, SIG_HEADER),
            _header(headers, FRESH_HEADER),
            _header(headers, SNAPSHOT_HEADER),
        )


CLOCK_HEADER = "c4-clock-us"


def _header(headers: Any, name: str) -> bytes | None:
    """A header's value, whether Faust hands them over as a mapping or as pairs.

    >>> _header([("a", b"1"), ("c4-clock-us", b"7")], CLOCK_HEADER), _header(None, "a")
    (b'7', None)
    """
    if not headers:
        return None
    if isinstance(headers, dict):
        return headers.get(name)
    for k, v in headers:
        if k == name:
            return v
    return None


def dead_letter(record: Record, reason: str) -> DeadLetter:
    return DeadLetter.of_record(record, reason, STAGE)


def refused_checkpoint(key: bytes, data: bytes, err: Exception) -> DeadLetter:
    """A checkpoint the core refused to read (corrupt, foreign, a pickle): its bytes go
    to the dead letters, its state starts afresh.

    >>> dl = refused_checkpoint(b"0xa", b"junk", ValueError("not a checkpoint"))
    >>> dl.source, dl.reason
    ('checkpoint:0xa', 'checkpoint refused, state starts afresh: not a checkpoint')
    """
    return DeadLetter.of(
        data,
        reason=f"checkpoint refused, state starts afresh: {err}",
        stage=STAGE,
        source=f"checkpoint:{key.decode('utf-8', 'replace')}",
        key=key,
    )


class DeadLetterPublisher:
    """Sends dead letters to ``c4.deadletter`` (keyed like the original message)."""

    def __init__(self, topic: Any) -> None:
        self.topic = topic
        self.sent = 0

    async def publish(self, letters: list[DeadLetter]) -> None:
        for dl in letters:
            key = dl.key.encode() if dl.key is not None else None
            await self.topic.send(key=key, value=dl.encode())
            self.sent += 1
