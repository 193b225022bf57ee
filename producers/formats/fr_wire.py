"""A Flight Recorder snapshot on the wire: the exporter's events plus what the dumps say
together, so a consumer can judge the snapshot as ``c4stream detect`` does.

The exporter publishes a snapshot's events (contract ``op``/``progress`` events, with
the time it first saw each dump whole as its dump time) in one or more messages, all
with the same key (one partition: one consumer sees the whole snapshot), each with the
header ``c4-fr-snapshot``: ``{"v": 1, "id", "part", "parts", "facts"}`` (``facts``, the
:class:`~producers.formats.fr_facts.SnapshotFacts`, on part 0 only). Consumers that do
not know the header read the events as any others (harmless: a stream detector does not
act on a short history); :class:`SnapshotAssembler` puts the parts back together.

>>> from producers.formats.fr_facts import SnapshotFacts
>>> a = SnapshotAssembler()
>>> h0 = snapshot_header("s1", 0, 2, SnapshotFacts(absent={4: "no dump"}))
>>> a.add(h0, ["e0"]) is None
True
>>> events, facts = a.add(snapshot_header("s1", 1, 2, None), ["e1"])
>>> events, facts.absent, facts.dump_time_known
(['e0', 'e1'], {4: 'no dump'}, True)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from c4base import signing
from producers.formats.fr_dump import FlightRecorderError
from producers.formats.fr_facts import SnapshotFacts

__all__ = ["SNAPSHOT_HEADER", "SnapshotAssembler", "SnapshotPart", "snapshot_header"]

SNAPSHOT_HEADER = signing.SNAPSHOT_HEADER  # inside an events message's signature
MAX_HEADER_BYTES = 1 << 20
"""A header larger than this is refused (the facts of a few thousand ranks fit)."""


class SnapshotPart(msgspec.Struct, kw_only=True):
    v: int = 1
    id: str
    part: int
    parts: int
    facts: SnapshotFacts | None = None


def snapshot_header(snapshot_id: str, part: int, parts: int, facts: SnapshotFacts | None) -> bytes:
    """The header value of one message of a snapshot."""
    return msgspec.json.encode(
        SnapshotPart(id=snapshot_id, part=part, parts=parts, facts=facts if part == 0 else None)
    )


def read_snapshot_header(value: bytes) -> SnapshotPart:
    """Decode a ``c4-fr-snapshot`` header; raises FlightRecorderError (a dead letter)."""
    if len(value) > MAX_HEADER_BYTES:
        raise FlightRecorderError(f"{SNAPSHOT_HEADER} header larger than {MAX_HEADER_BYTES} bytes")
    try:
        part = msgspec.json.decode(value, type=SnapshotPart)
    except msgspec.DecodeError as err:
        raise FlightRecorderError(f"bad {SNAPSHOT_HEADER} header: {err}") from None
    if part.v != 1 or not 0 <= part.part < part.parts <= 10_000:
        raise FlightRecorderError(
            f"bad {SNAPSHOT_HEADER} header: version {part.v}, part {part.part} of {part.parts}"
        )
    return part


class SnapshotAssembler:
    """Collects a snapshot's messages until every part is in (bounded: at most
    ``max_pending`` snapshots wait at once; the oldest incomplete one is dropped)."""

    def __init__(self, max_pending: int = 64) -> None:
        self.max_pending = max_pending
        self.dropped = 0
        self._pending: OrderedDict[str, tuple[int, dict[int, list[Any]], SnapshotFacts | None]]
        self._pending = OrderedDict()

    def add(self, header: bytes, events: list[Any]) -> tuple[list[Any], SnapshotFacts] | None:
        """Add one message; the snapshot's events and facts once all its parts are in."""
        p = read_snapshot_header(header)
        parts, got, facts = self._pending.pop(p.id, (p.parts, {}, None))
        got[p.part] = events
        facts = facts or p.facts
        if len(got) < parts or facts is None:
            self._pending[p.id] = (parts, got, facts)
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
                self.dropped += 1
            return None
        return [e for i in sorted(got) for e in got[i]], facts
