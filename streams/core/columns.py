"""What the core needs from a batch given as columns (the columnar ingest path).

Two shapes: :class:`EventColumnsLike` is one communicator's rows (one message, or the
parts of one time slice joined); :class:`ColumnBlockLike` is many consecutive messages
of many communicators in one set of arrays (a stretch of the Parquet archive), which
:meth:`streams.core.pipeline.DetectionPipeline.feed_block` routes without an object per
message: the per-message work left is a few integer comparisons.

:meth:`streams.core.comm.CommDetector.observe` takes any object with this shape;
:class:`producers.columnar.EventColumns` (decoded from Arrow IPC messages or read from
the Parquet archive) is the one the project uses. The core itself stays numpy-only: it
reads numpy arrays and asks for event objects only for the few rows a detector reads
whole.

Where events come as objects (a JSON-lines trace read today, the simulator, a test),
:func:`as_columns` turns one communicator's batch into columns at the edge
(:class:`EventRows`: numpy arrays of the fields the core reads, the objects kept for
the rows a detector reads whole), so that the core has one way in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np

from producers.events import Event, OpEvent

__all__ = ["ColumnBlockLike", "EventColumnsLike", "EventRows", "PartsBlock", "as_blocks",
           "as_columns", "as_parts", "concat_columns"]  # fmt: skip


class EventColumnsLike(Protocol):
    """One communicator's events, rows in arrival order, as columns."""

    @property
    def comm(self) -> str:
        """The communicator of every row."""

    @property
    def n(self) -> int:
        """Number of rows (events)."""

    @property
    def job(self) -> str:
        """The first row's job."""

    @property
    def comm_name(self) -> str | None:
        """The first row's communicator name (None when absent)."""

    @property
    def is_op(self) -> np.ndarray:
        """Per row: an ``op`` event (else ``progress``)."""

    def int(self, name: str, fill: int = -1) -> np.ndarray:
        """An integer field of every row as ``int64`` (absent: ``fill``)."""

    def float(self, name: str, fill: float = 0.0) -> np.ndarray:
        """A number field of every row as ``float64`` (absent: ``fill``)."""

    def conn_counts(self) -> np.ndarray:
        """Per row: how many connections it carries (0 when absent)."""

    def conn_arrays(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The connections of rows ``idx`` (in order), flat: peer, send (else recv),
        bytes, time (0 when absent)."""

    def rows(self, idx: np.ndarray) -> Sequence[Event]:
        """The rows ``idx`` as event objects (built when first read)."""

    def to_events(self) -> list[Event]:
        """Every row as an event object (a batch mixing columns and objects)."""

    def concat(self, parts: Sequence[EventColumnsLike]) -> EventColumnsLike:
        """Several parts of one communicator (this one among them) as one, in order."""


class ColumnBlockLike(Protocol):
    """Consecutive batches ("parts": one communicator's rows of one message each) of
    one or more communicators and jobs, in arrival order, as one set of columns.

    The per-part facts are Python lists (the pipeline walks them part by part, as it
    walks messages); the rows stay in arrays until :meth:`select` cuts them per
    communicator."""

    @property
    def part_comm(self) -> list[str]:
        """Per part: its communicator."""

    @property
    def part_job(self) -> list[str]:
        """Per part: its job."""

    @property
    def part_ts_lo(self) -> list[int]:
        """Per part: its earliest ``ts_us``."""

    @property
    def part_ts_hi(self) -> list[int]:
        """Per part: its latest ``ts_us``."""

    @property
    def part_n(self) -> list[int]:
        """Per part: its number of rows (events)."""

    def select(self, parts: np.ndarray) -> list[EventColumnsLike]:
        """The rows of ``parts`` (ascending part numbers), one columns object per
        communicator in order of first appearance, each with its parts' rows in order:
        what :meth:`EventColumnsLike.concat` of those parts one by one would give."""


_EVERY_ROW = frozenset({"rank", "nranks", "ts_us"})
"""Fields every event has (never None)."""
_ONE_KIND = {"seq": True, "exec_us": True, "bytes": True, "started": False, "completed": False}
"""Fields every op (True) or every progress event (False) has, never None."""


class EventRows:
    """One communicator's events (objects, arrival order) as :class:`EventColumnsLike`:
    each field the core reads becomes one numpy array when first asked for."""

    __slots__ = ("_events", "_np", "comm")

    def __init__(self, events: Sequence[Event]) -> None:
        self._events = events
        self.comm = events[0].comm
        self._np: dict[str, np.ndarray] = {}

    @property
    def n(self) -> int:
        return len(self._events)

    @property
    def job(self) -> str:
        return self._events[0].job

    @property
    def comm_name(self) -> str | None:
        return self._events[0].comm_name

    @property
    def is_op(self) -> np.ndarray:
        got = self._np.get("__is_op")
        if got is None:
            got = self._np["__is_op"] = np.array(
                [e.__class__ is OpEvent for e in self._events], bool
            )
        return got

    def int(self, name: str, fill: int = -1) -> np.ndarray:
        return self._field(name, fill, np.int64)

    def float(self, name: str, fill: float = 0.0) -> np.ndarray:
        return self._field(name, fill, np.float64)

    def _field(self, name: str, fill: float, dtype: type) -> np.ndarray:
        key = f"{name}:{fill}"
        got = self._np.get(key)
        if got is None:
            ev = self._events
            kind = _ONE_KIND.get(name)
            if name in _EVERY_ROW:  # one comprehension: the per-event work
                got = np.array([getattr(e, name) for e in ev], dtype)
            elif kind is not None:  # a field every event of one kind has
                rows = np.flatnonzero(self.is_op == kind)
                got = np.full(len(ev), fill, dtype)
                got[rows] = [getattr(ev[i], name) for i in rows.tolist()]
            else:  # optional: absent as ``fill``
                vals = [getattr(e, name, None) for e in ev]
                got = np.array([fill if x is None else x for x in vals], dtype)
            self._np[key] = got
        return got

    def conn_counts(self) -> np.ndarray:
        got = self._np.get("__conns")
        if got is None:
            got = self._np["__conns"] = np.array(
                [len(e.conns) if e.conns else 0 for e in self._events], np.int64
            )
        return got

    def conn_arrays(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        conns = [c for i in idx.tolist() for c in self._events[i].conns or ()]
        return (
            np.array([c.peer for c in conns], np.int64),
            np.array([c.dir == "send" for c in conns], bool),
            np.array([c.bytes for c in conns], np.float64),
            np.array([c.time_us or 0.0 for c in conns], np.float64),
        )

    def rows(self, idx: np.ndarray) -> Sequence[Event]:
        return _Picked(self._events, idx)

    def to_events(self) -> list[Event]:
        return list(self._events)

    def concat(self, parts: Sequence[EventColumnsLike]) -> EventColumnsLike:
        """Parts of one communicator (all :class:`EventRows`) as one: the arrays every
        part has built already are joined, not built again."""
        if len(parts) == 1:
            return parts[0]
        rows: list[EventRows] = parts  # type: ignore[assignment]
        out = EventRows([e for p in rows for e in p._events])
        keys = set(rows[0]._np).intersection(*(p._np for p in rows[1:]))
        out._np = {k: np.concatenate([p._np[k] for p in rows]) for k in keys}
        return out


class _Picked(Sequence[Event]):
    """Rows ``idx`` of a list of events, picked when read."""

    __slots__ = ("_events", "_idx")

    def __init__(self, events: Sequence[Event], idx: np.ndarray) -> None:
        self._events, self._idx = events, idx

    def __len__(self) -> int:
        return len(self._idx)

    def __iter__(self) -> Iterator[Event]:
        events = self._events
        return (events[j] for j in self._idx.tolist())

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # Sequence's overloads
        if isinstance(i, slice):
            return [self._events[j] for j in self._idx[i].tolist()]
        return self._events[int(self._idx[i])]


def as_columns(batch: EventColumnsLike | Sequence[Event]) -> EventColumnsLike:
    """``batch`` as columns: columns as they are; one communicator's events (objects,
    arrival order) as :class:`EventRows`. The one way objects enter the core."""
    if hasattr(batch, "is_op"):
        return batch  # type: ignore[return-value]
    return EventRows(batch)  # type: ignore[arg-type]


def concat_columns(parts: Sequence[EventColumnsLike]) -> EventColumnsLike:
    """One communicator's parts, in order, as one (parts of different kinds — a slice fed
    both from a JSON trace and from the archive — as their events)."""
    if len(parts) == 1:
        return parts[0]
    kind = parts[0].__class__
    if all(p.__class__ is kind for p in parts):
        return parts[0].concat(parts)
    return EventRows([e for p in parts for e in p.to_events()])


class PartsBlock:
    """Parts (one communicator's rows each, in arrival order) as a
    :class:`ColumnBlockLike`."""

    __slots__ = ("_parts", "part_comm", "part_job", "part_n", "part_ts_hi", "part_ts_lo")

    def __init__(
        self, parts: Sequence[EventColumnsLike], ts: list[tuple[int, int]] | None = None
    ) -> None:
        """``ts``: each part's earliest and latest ``ts_us``, when the caller has them."""
        self._parts = [p for p in parts if p.n] if ts is None else list(parts)
        self.part_comm = [p.comm for p in self._parts]
        self.part_job = [p.job for p in self._parts]
        self.part_n = [p.n for p in self._parts]
        if ts is None:
            ts = [(int(t.min()), int(t.max())) for t in (p.int("ts_us") for p in self._parts)]
        self.part_ts_lo = [lo for lo, _ in ts]
        self.part_ts_hi = [hi for _, hi in ts]

    def select(self, parts: np.ndarray) -> list[EventColumnsLike]:
        per_comm: dict[str, list[EventColumnsLike]] = {}
        for i in parts.tolist():
            p = self._parts[i]
            per_comm.setdefault(p.comm, []).append(p)
        return [concat_columns(ps) for ps in per_comm.values()]


def as_parts(events: Iterable[Event]) -> list[EventColumnsLike]:
    """Events as the pipeline takes them: a list of one communicator's events (what an
    exporter sends) is one part; anything else is one part per event, so that each event
    finds its time slice on its own."""
    if isinstance(events, list) and events:
        comm = events[0].comm
        if all(e.comm == comm for e in events):
            return [EventRows(events)]
    return [EventRows([e]) for e in events]


def as_blocks(events: Iterable[Event]) -> PartsBlock:
    """:func:`as_parts` of ``events`` as one block."""
    return PartsBlock(as_parts(events))
