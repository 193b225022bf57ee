"""Where a consumer stands: the records it was handed and what is durable of them.

:class:`Record` is one Kafka message as a sink's handler sees it; :class:`Progress`
keeps, per partition, the next offset handled and the offsets a :class:`Hold` still
keeps from being committed, and answers the one question a commit asks: how far is
everything durable?
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from c4base.failures import TP

__all__ = ["Hold", "Message", "Progress", "Record"]


@dataclass(frozen=True, slots=True)
class Message:
    """What every consumer knows of a Kafka message, whichever client read it: the
    sinks' :class:`Record` and the worker's (``streams.app.deadletter.Record``, its
    headers parsed) extend it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes

    @property
    def source(self) -> str:
        """Where it came from, as a dead letter names it."""
        return f"{self.topic}[{self.partition}]@{self.offset}"

    @property
    def tp(self) -> TP:
        return (self.topic, self.partition)


@dataclass(frozen=True, slots=True)
class Record(Message):
    """One Kafka message as a handler sees it (independent of the client library)."""

    timestamp_ms: int = -1
    """Broker or producer timestamp (-1: not available)."""
    headers: tuple[tuple[str, bytes], ...] = ()
    """Kafka headers, e.g. ``content-type`` of an Arrow IPC event batch."""

    @classmethod
    def of(cls, msg: Any) -> Record:
        kind, ts = msg.timestamp()
        return cls(
            msg.topic(),
            msg.partition(),
            msg.offset(),
            msg.key(),
            msg.value() or b"",
            ts if kind != 0 else -1,  # 0 = TIMESTAMP_NOT_AVAILABLE
            tuple(msg.headers() or ()),
        )


class Hold:
    """A record's result is not durable yet; :meth:`release` when it is. Thread-safe."""

    __slots__ = ("_progress", "record", "_open")

    def __init__(self, progress: Progress, record: Record) -> None:
        self._progress = progress
        self.record = record
        self._open = True

    def release(self) -> None:
        if self._open:
            self._open = False
            self._progress._release(self.record)


class Progress:
    """Per partition: the next offset handled, and offsets still held by a :class:`Hold`.

    >>> p = Progress()
    >>> r = Record("t", 0, 5, None, b"")
    >>> h = p.hold(r); p.handled(r); p.handled(Record("t", 0, 6, None, b""))
    >>> p.committable({})
    {('t', 0): 5}
    >>> h.release(); p.committable({})
    {('t', 0): 7}
    """

    def __init__(self) -> None:
        self._next: dict[TP, int] = {}
        self._held: dict[TP, dict[int, int]] = {}
        self._committed: dict[TP, int] = {}
        self._lock = threading.Lock()

    def hold(self, rec: Record) -> Hold:
        with self._lock:
            held = self._held.setdefault(rec.tp, {})
            held[rec.offset] = held.get(rec.offset, 0) + 1
        return Hold(self, rec)

    def _release(self, rec: Record) -> None:
        with self._lock:
            held = self._held.get(rec.tp)
            if held is None or rec.offset not in held:
                return  # the partition was revoked meanwhile
            held[rec.offset] -= 1
            if not held[rec.offset]:
                del held[rec.offset]

    def handled(self, rec: Record) -> None:
        with self._lock:
            if rec.offset + 1 > self._next.get(rec.tp, -1):
                self._next[rec.tp] = rec.offset + 1

    def held(self) -> int:
        with self._lock:
            return sum(sum(h.values()) for h in self._held.values())

    def committable(self, pending: dict[TP, int]) -> dict[TP, int]:
        """Per partition, the offset to commit now (only those that moved on)."""
        out = {}
        with self._lock:
            for tp, nxt in self._next.items():
                safe = min(nxt, pending.get(tp, nxt))
                held = self._held.get(tp)
                if held:
                    safe = min(safe, min(held))
                if safe > self._committed.get(tp, -1):
                    out[tp] = safe
        return out

    def committed(self, offsets: dict[TP, int]) -> None:
        with self._lock:
            self._committed.update(offsets)

    def rewind(self, offsets: dict[TP, int]) -> None:
        """Records from ``offsets`` on are to be handled again: nothing past is committed."""
        with self._lock:
            for tp, off in offsets.items():
                if tp in self._next:
                    self._next[tp] = min(self._next[tp], off)

    def forget(self, tps: Iterable[TP] | None = None) -> None:
        with self._lock:
            for d in (self._next, self._held, self._committed):
                if tps is None:
                    d.clear()
                else:
                    for tp in tps:
                        d.pop(tp, None)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{t}[{p}]": o for (t, p), o in sorted(self._committed.items())}
