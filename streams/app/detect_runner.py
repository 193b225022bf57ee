"""Agent ``detect``'s runner (``c4.events``), broker-free.

:class:`CommRouter` decodes each message, dead-letters what breaks the contract, groups
events by communicator, feeds each communicator's detector one batch, and advances every
communicator of a partition whenever that partition's event-time clock (max ``ts_us``
seen) moves on by ``advance_every_us``, so a collective that stops completing is noticed
while heartbeats keep arriving. The Faust agent (:mod:`streams.app.agents`) only moves
bytes between Kafka and this class, so all of it is tested without a broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence

from producers.events import Event, EventDecodeError, decode_message
from streams.app.deadletter import Record, dead_letter
from streams.app.engine import DetectorLike, Engine
from streams.app.runner import Checkpointable, Lookup, Output, StateRunner

__all__ = ["CommRouter", "contract_problem"]

log = logging.getLogger(__name__)

Slice = dict[str, tuple[list[Event], list[tuple[Record, list[Event]]]]]
"""An open event-time slice of one partition, by communicator:
comm -> (its events, (record, its events) per message)."""


def contract_problem(events: Sequence[Event]) -> str | None:
    """What breaks the contract beyond the types msgspec checks, or None.

    >>> from producers.events import OpEvent
    >>> ev = OpEvent(v=1, job="j", comm="0xa", nranks=2, rank=2, host="h", ts_us=1,
    ...              op="AllReduce", seq=1, bytes=8, exec_us=1.0)
    >>> contract_problem([ev])
    'event 0: rank 2 is not below nranks 2'
    """
    for i, ev in enumerate(events):
        if ev.rank >= ev.nranks:
            return f"event {i}: rank {ev.rank} is not below nranks {ev.nranks}"
    if not events:
        return "empty message: no events"
    return None


class _Comm:
    __slots__ = ("detector", "partition")

    def __init__(self, detector: DetectorLike, partition: int) -> None:
        self.detector = detector
        self.partition = partition


class CommRouter(StateRunner[str]):
    """All communicators of one worker, by partition."""

    def __init__(
        self,
        engine: Engine,
        lookup: Lookup,
        *,
        checkpoint_every_events: int,
        checkpoint_every_s: float,
        advance_every_us: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            lookup,
            checkpoint_every_events=checkpoint_every_events,
            checkpoint_every_s=checkpoint_every_s,
            clock=clock,
        )
        self.engine = engine
        self.advance_every_us = advance_every_us
        self.comms: dict[str, _Comm] = {}
        self.by_partition: dict[int, set[str]] = {}
        self.clock_us: dict[int, int] = {}
        self._advanced_us: dict[int, int] = {}
        self._slice_end: dict[int, int] = {}
        self.pending: dict[int, Slice] = {}
        """Per partition, the events of its open event-time slice."""
        self._active: set[int] = set()
        """Partitions that got messages since the last tick()."""

    # ---------------------------------------------------------------- state
    def _comm(self, comm: str, partition: int) -> _Comm:
        c = self.comms.get(comm)
        if c is not None:
            return c
        det = self._restore(
            comm.encode(),
            self._what(comm),
            lambda data: self.engine.load_detector(comm, data),
            lambda: self.engine.new_detector(comm),
        )
        c = self.comms[comm] = _Comm(det, partition)
        self.by_partition.setdefault(partition, set()).add(comm)
        return c

    def _locate(self, key: str) -> tuple[int, bytes, Checkpointable] | None:
        c = self.comms.get(key)
        return None if c is None else (c.partition, key.encode(), c.detector)

    def _what(self, key: str) -> str:
        return f"communicator {key}"

    def _keys(self, partitions: set[int] | None) -> list[str]:
        return [
            comm
            for comm, c in self.comms.items()
            if partitions is None or c.partition in partitions
        ]

    def _close(self, partitions: set[int] | None, out: Output) -> None:
        self._close_slices(partitions, out)

    def _drop(self, partitions: set[int] | None, keys: list[str]) -> None:
        for comm in keys:
            c = self.comms.pop(comm)
            self.by_partition.get(c.partition, set()).discard(comm)
        for p in partitions or set(self.clock_us):
            self.clock_us.pop(p, None)
            self._advanced_us.pop(p, None)
            self._slice_end.pop(p, None)
            self.by_partition.pop(p, None)
            self.pending.pop(p, None)
            self._active.discard(p)

    # ---------------------------------------------------------------- batches
    def process(self, records: Sequence[Record], settle: Collection[int] = ()) -> Output:
        """One ``take`` batch of ``c4.events`` messages.

        ``settle``: partitions without consumer lag (live traffic): their open slice is
        judged now, and advanced when due, rather than when the next slice begins, which
        costs up to a second of latency. Partitions with lag (catching up) are judged
        exactly slice by slice, as DetectionPipeline does."""
        out = Output()
        st = self.stats
        st.batches += 1
        st.messages += len(records)
        # As in DetectionPipeline, a slice is judged (observe, then advance every comm of
        # the partition) when an event of the next slice arrives, whatever the batches:
        # a catch-up batch spanning minutes of event time is judged slice by slice, and a
        # slice spread over many small batches is judged at once, like offline.
        pending = self.pending
        for rec in records:
            try:
                events = decode_message(rec.value)
            except EventDecodeError as err:
                out.deadletters.append(dead_letter(rec, f"undecodable message: {err}"))
                continue
            problem = contract_problem(events)
            if problem is not None:
                out.deadletters.append(dead_letter(rec, f"event breaks the contract: {problem}"))
                continue
            st.events += len(events)
            p = rec.partition
            self._active.add(p)
            top = max(ev.ts_us for ev in events)
            end = self._slice_end.get(p)
            if end is None or top >= end:
                if end is not None and p in pending:
                    self._judge(p, pending.pop(p), out)
                    self._advance_partition(p, out)
                self._slice_end[p] = top - top % self.advance_every_us + self.advance_every_us
            if top > self.clock_us.get(p, -1):
                self.clock_us[p] = top
            groups = pending.setdefault(p, {})
            first = events[0].comm
            if all(ev.comm == first for ev in events):  # the usual case: one comm per message
                g = groups.get(first)
                if g is None:
                    self._comm(first, p)  # restored (or created) on arrival, like status says
                    g = groups[first] = ([], [])
                g[0].extend(events)
                g[1].append((rec, events))
            else:
                per_comm: dict[str, list[Event]] = {}
                for ev in events:
                    per_comm.setdefault(ev.comm, []).append(ev)
                for comm, evs in per_comm.items():
                    g = groups.get(comm)
                    if g is None:
                        self._comm(comm, p)
                        g = groups[comm] = ([], [])
                    g[0].extend(evs)
                    g[1].append((rec, evs))
        for p in settle:
            groups = pending.pop(p, None)
            if groups:
                self._judge(p, groups, out)
            if p in self.clock_us and (
                self.clock_us[p] - self._advanced_us.get(p, 0) >= self.advance_every_us
            ):
                self._advance_partition(p, out)
        self._due(out, self.wall())
        self._count(out)
        return out

    def _judge(self, p: int, groups: Slice, out: Output) -> None:
        now = self.wall()
        clock = self.clock_us[p]
        for comm, (events, parts) in groups.items():
            c = self._comm(comm, p)
            try:
                out.concluded(c.detector.observe(events), clock)
            except Exception as err:
                if len(parts) == 1:
                    self._detector_failed(comm, err, parts[0][0], out)
                    continue
                # Retry message by message so only the offending one is dead-lettered.
                for rec, evs in parts:
                    try:
                        out.concluded(c.detector.observe(evs), clock)
                    except Exception as err1:
                        self._detector_failed(comm, err1, rec, out)
            self.schedule.touch(comm, len(events), now)

    def _detector_failed(self, comm: str, err: Exception, rec: Record, out: Output) -> None:
        self.stats.detector_errors += 1
        log.error(
            "detector of communicator %s failed on %s; dead-lettered",
            comm,
            rec.source,
            exc_info=err,
        )
        reason = f"detector error in communicator {comm}: {type(err).__name__}: {err}"
        out.deadletters.append(dead_letter(rec, reason))

    def _advance_partition(self, p: int, out: Output) -> None:
        now_us = self.clock_us[p]
        self._advanced_us[p] = now_us
        wall = self.wall()
        for comm in list(self.by_partition.get(p, ())):
            c = self.comms[comm]
            try:
                found = c.detector.advance(now_us)
            except Exception:
                self.stats.detector_errors += 1
                log.exception("detector of communicator %s failed to advance to %d", comm, now_us)
                continue
            if found:
                out.concluded(found, now_us)
                self.schedule.touch(comm, 0, wall)

    def tick(self) -> Output:
        """Wall-clock timer: close the open slice of every partition that got no message
        since the previous tick (traffic stopped: judge it and advance, so a hang is
        still found), take time-due checkpoints."""
        quiet = set(self.clock_us) - self._active
        self._active.clear()
        out = self.close_slices(quiet)
        self._due(out, self.wall())
        self._count(out)
        return out

    def close_slices(self, partitions: set[int] | None = None) -> Output:
        """Judge the open slice of ``partitions`` (all by default) and advance them."""
        out = Output()
        self._close_slices(partitions, out)
        return out

    def _close_slices(self, partitions: set[int] | None, out: Output) -> None:
        for p in list(self.clock_us if partitions is None else partitions):
            groups = self.pending.pop(p, None)
            if groups:
                self._judge(p, groups, out)
            if p in self.clock_us and self.clock_us[p] > self._advanced_us.get(p, 0):
                self._advance_partition(p, out)
