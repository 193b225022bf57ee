"""Broker-free heart of the agents: routes records to detectors, keeps clocks and checkpoints.

The Faust agents (:mod:`streams.app.agents`) only move bytes between Kafka and these
two classes, so everything here is tested without a broker.

:class:`CommRouter` (agent 1, ``c4.events``): decodes each message, dead-letters what
breaks the contract, groups events by communicator, feeds each communicator's detector
one batch, and advances every communicator of a partition whenever that partition's
event-time clock (max ``ts_us`` seen) moves on by ``advance_every_us``, so a collective
that stops completing is noticed while heartbeats keep arriving.

:class:`CorrelatorRunner` (agent 2, ``c4.verdicts`` plus the worker's watermark topic):
one host correlator per verdicts partition, fed in event-time order behind a watermark
(the slowest active events partition), see :class:`Watermark`.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from c4stream.deadletter import DeadLetter
from producers.events import Event, EventDecodeError, decode_message
from streams.app.checkpoint import CheckpointSchedule
from streams.app.deadletter import Record, dead_letter
from streams.app.engine import CorrelatorLike, DetectorLike, Engine
from streams.commands import IsolationCommand
from streams.verdicts import Verdict, VerdictDecodeError, decode_verdict

__all__ = [
    "CommRouter",
    "CorrelatorRunner",
    "Output",
    "RouterStats",
    "Watermark",
    "contract_problem",
    "decode_watermark",
    "encode_watermark",
]

log = logging.getLogger(__name__)

Lookup = Callable[[bytes], bytes | None]


@dataclass
class Output:
    """What one batch (or tick) produced."""

    verdicts: list[Verdict] = field(default_factory=list)
    commands: list[IsolationCommand] = field(default_factory=list)
    deadletters: list[DeadLetter] = field(default_factory=list)
    checkpoints: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    """(partition, key, state bytes) to write to the table."""


@dataclass
class RouterStats:
    messages: int = 0
    events: int = 0
    batches: int = 0
    verdicts: int = 0
    commands: int = 0
    deadletters: int = 0
    detector_errors: int = 0
    checkpoints: int = 0
    restored: int = 0
    """Detectors (or correlators) restored from a table checkpoint."""
    created: int = 0


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


class CommRouter:
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
        self.engine = engine
        self.lookup = lookup
        self.schedule = CheckpointSchedule(checkpoint_every_events, checkpoint_every_s)
        self.advance_every_us = advance_every_us
        self.wall = clock
        self.comms: dict[str, _Comm] = {}
        self.by_partition: dict[int, set[str]] = {}
        self.clock_us: dict[int, int] = {}
        self._advanced_us: dict[int, int] = {}
        self._slice_end: dict[int, int] = {}
        self.stats = RouterStats()

    # ---------------------------------------------------------------- detectors
    def _comm(self, comm: str, partition: int) -> _Comm:
        c = self.comms.get(comm)
        if c is not None:
            return c
        data = self.lookup(comm.encode())
        det: DetectorLike | None = None
        if data is not None:
            try:
                det = self.engine.load_detector(comm, data)
                self.stats.restored += 1
                log.info("restored communicator %s from its checkpoint (%d bytes)", comm, len(data))
            except Exception:
                log.exception("checkpoint of communicator %s unreadable; starting afresh", comm)
        if det is None:
            det = self.engine.new_detector(comm)
            self.stats.created += 1
        c = self.comms[comm] = _Comm(det, partition)
        self.by_partition.setdefault(partition, set()).add(comm)
        return c

    # ---------------------------------------------------------------- batches
    def process(self, records: Sequence[Record]) -> Output:
        """One ``take`` batch of ``c4.events`` messages."""
        out = Output()
        st = self.stats
        st.batches += 1
        st.messages += len(records)
        # Per partition, pending events of the current event-time slice, by communicator:
        # comm -> (its events, (record, its events) per message). As in DetectionPipeline,
        # a slice is judged (observe, then advance every comm of the partition) when an
        # event of the next slice arrives, so a catch-up batch spanning minutes of event
        # time is judged slice by slice, like live traffic.
        pending: dict[int, dict[str, tuple[list[Event], list[tuple[Record, list[Event]]]]]] = {}
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
                g = groups.setdefault(first, ([], []))
                g[0].extend(events)
                g[1].append((rec, events))
            else:
                per_comm: dict[str, list[Event]] = {}
                for ev in events:
                    per_comm.setdefault(ev.comm, []).append(ev)
                for comm, evs in per_comm.items():
                    g = groups.setdefault(comm, ([], []))
                    g[0].extend(evs)
                    g[1].append((rec, evs))
        for p, groups in pending.items():
            self._judge(p, groups, out)
            if self.clock_us[p] - self._advanced_us.get(p, 0) >= self.advance_every_us:
                self._advance_partition(p, out)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(self.wall())))
        self._count(out)
        return out

    def _judge(
        self,
        p: int,
        groups: dict[str, tuple[list[Event], list[tuple[Record, list[Event]]]]],
        out: Output,
    ) -> None:
        now = self.wall()
        for comm, (events, parts) in groups.items():
            c = self._comm(comm, p)
            try:
                out.verdicts.extend(c.detector.observe(events))
            except Exception as err:
                if len(parts) == 1:
                    self._detector_failed(comm, err, parts[0][0], out)
                    continue
                # Retry message by message so only the offending one is dead-lettered.
                for rec, evs in parts:
                    try:
                        out.verdicts.extend(c.detector.observe(evs))
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
                out.verdicts.extend(found)
                self.schedule.touch(comm, 0, wall)

    def tick(self) -> Output:
        """Wall-clock timer: advance lagging partitions, take time-due checkpoints."""
        out = Output()
        for p in list(self.clock_us):
            if self.clock_us[p] > self._advanced_us.get(p, 0):
                self._advance_partition(p, out)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(self.wall())))
        self._count(out)
        return out

    def _checkpoint(self, comms: list[str]) -> list[tuple[int, bytes, bytes]]:
        out = []
        for comm in comms:
            c = self.comms.get(comm)
            if c is None:
                continue
            try:
                out.append((c.partition, comm.encode(), c.detector.to_bytes()))
            except Exception:
                self.stats.detector_errors += 1
                log.exception("checkpoint of communicator %s failed", comm)
        return out

    def flush(self, partitions: set[int] | None = None, *, drop: bool = False) -> Output:
        """Checkpoint every dirty communicator (of ``partitions``); ``drop`` forgets them
        (the partitions were revoked: another worker restores them from the table)."""
        keys = [
            comm
            for comm, c in self.comms.items()
            if partitions is None or c.partition in partitions
        ]
        out = Output(checkpoints=self._checkpoint(self.schedule.take_all(keys)))
        if drop:
            for comm in keys:
                c = self.comms.pop(comm)
                self.by_partition.get(c.partition, set()).discard(comm)
                self.schedule.forget(comm)
            for p in partitions or set(self.clock_us):
                self.clock_us.pop(p, None)
                self._advanced_us.pop(p, None)
                self._slice_end.pop(p, None)
                self.by_partition.pop(p, None)
        self._count(out)
        return out

    def _count(self, out: Output) -> None:
        self.stats.verdicts += len(out.verdicts)
        self.stats.deadletters += len(out.deadletters)
        self.stats.checkpoints += len(out.checkpoints)


class Watermark(msgspec.Struct, frozen=True):
    """Event-time progress of one ``c4.events`` partition, sent by agent 1 to agent 2.

    Verdicts of different partitions reach the correlator out of event-time order (one
    partition may be seconds ahead of another, very much so while catching up), and the
    correlator must see a victim's "waiting in communicator X" before it judges that
    victim as the culprit elsewhere. So agent 2 holds verdicts until every active
    partition's clock has passed them, and feeds them in event-time order.

    >>> decode_watermark(encode_watermark(Watermark(partition=3, clock_us=7)))
    Watermark(partition=3, clock_us=7)
    """

    partition: int
    clock_us: int


_wm_decoder = msgspec.json.Decoder(Watermark)


def encode_watermark(w: Watermark) -> bytes:
    return msgspec.json.encode(w)


def decode_watermark(data: bytes) -> Watermark:
    return _wm_decoder.decode(data)


class CorrelatorRunner:
    """One host correlator per ``c4.verdicts`` partition, fed in event-time order.

    The event-time clock (watermark) is the minimum clock of the ``c4.events``
    partitions that reported progress within ``idle_s`` of wall time (a partition
    without traffic must not hold everything back); when none did, the newest clock
    moved on by wall time, so cool-downs still expire. A verdict waits at most
    ``max_hold_s`` of wall time for the watermark.
    """

    def __init__(
        self,
        engine: Engine,
        lookup: Lookup,
        *,
        checkpoint_every_events: int,
        checkpoint_every_s: float,
        watermark_topic: str = "",
        idle_s: float = 5.0,
        max_hold_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.lookup = lookup
        self.schedule = CheckpointSchedule(checkpoint_every_events, checkpoint_every_s)
        self.watermark_topic = watermark_topic
        self.idle_s = idle_s
        self.max_hold_s = max_hold_s
        self.wall = clock
        self.correlators: dict[int, CorrelatorLike] = {}
        self.marks: dict[int, tuple[int, float]] = {}
        """events partition -> (clock_us, wall time it last moved)."""
        self.pending: dict[int, list[tuple[int, int, float, Verdict, Record]]] = {}
        self._seq = 0
        self._advanced_us = -1
        self.stats = RouterStats()

    @staticmethod
    def key(partition: int) -> bytes:
        return f"correlator-{partition}".encode()

    def _correlator(self, p: int) -> CorrelatorLike:
        cor = self.correlators.get(p)
        if cor is not None:
            return cor
        data = self.lookup(self.key(p))
        if data is not None:
            try:
                cor = self.engine.load_correlator(data)
                self.stats.restored += 1
                log.info("restored host correlator %d from its checkpoint", p)
            except Exception:
                log.exception("checkpoint of host correlator %d unreadable; starting afresh", p)
        if cor is None:
            cor = self.engine.new_correlator()
            self.stats.created += 1
        self.correlators[p] = cor
        return cor

    def watermark(self, now: float) -> int | None:
        """Event time up to which every active partition's verdicts have arrived."""
        if not self.marks:
            return None
        live = [c for c, w in self.marks.values() if now - w <= self.idle_s]
        if live:
            return min(live)
        clock, moved = max(self.marks.values())
        return clock + int((now - moved) * 1e6)

    def process(self, records: Sequence[Record]) -> Output:
        out = Output()
        st = self.stats
        st.batches += 1
        now = self.wall()
        for rec in records:
            if rec.topic == self.watermark_topic:
                try:
                    wm = decode_watermark(rec.value)
                except msgspec.DecodeError as err:
                    out.deadletters.append(dead_letter(rec, f"undecodable watermark: {err}"))
                    continue
                old = self.marks.get(wm.partition)
                if old is None or wm.clock_us > old[0]:
                    self.marks[wm.partition] = (wm.clock_us, now)
                continue
            st.messages += 1
            try:
                verdict = decode_verdict(rec.value)
            except VerdictDecodeError as err:
                out.deadletters.append(dead_letter(rec, f"undecodable verdict: {err}"))
                continue
            st.events += 1
            self._seq += 1
            heapq.heappush(
                self.pending.setdefault(rec.partition, []),
                (verdict.ts_us, self._seq, now, verdict, rec),
            )
        self._release(out, now)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(now)))
        self._count(out)
        return out

    def _release(self, out: Output, now: float, *, everything: bool = False) -> None:
        wm = self.watermark(now)
        for p, heap in self.pending.items():
            while heap and (
                everything
                or (wm is not None and heap[0][0] <= wm)
                or now - heap[0][2] >= self.max_hold_s
            ):
                _, _, _, verdict, rec = heapq.heappop(heap)
                self._observe(p, verdict, rec, out, now)
        if wm is not None and wm > self._advanced_us:
            self._advanced_us = wm
            for p, cor in self.correlators.items():
                try:
                    found = cor.advance(wm)
                except Exception:
                    self.stats.detector_errors += 1
                    log.exception("host correlator %d failed to advance", p)
                    continue
                if found:
                    out.commands.extend(found)
                    self.schedule.touch(p, 1, now)

    def _observe(self, p: int, verdict: Verdict, rec: Record, out: Output, now: float) -> None:
        cor = self._correlator(p)
        try:
            out.commands.extend(cor.observe(verdict))
        except Exception as err:
            self.stats.detector_errors += 1
            log.exception("host correlator failed on verdict %s", verdict.id)
            reason = f"correlator error: {type(err).__name__}: {err}"
            out.deadletters.append(dead_letter(rec, reason))
            return
        self.schedule.touch(p, 1, now)

    def tick(self) -> Output:
        """Release what the watermark allows; advance correlators; time-due checkpoints."""
        out = Output()
        now = self.wall()
        self._release(out, now)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(now)))
        self._count(out)
        return out

    def _checkpoint(self, parts: list[int]) -> list[tuple[int, bytes, bytes]]:
        out = []
        for p in parts:
            try:
                out.append((p, self.key(p), self.correlators[p].to_bytes()))
            except Exception:
                self.stats.detector_errors += 1
                log.exception("checkpoint of host correlator %d failed", p)
        return out

    def flush(self, partitions: set[int] | None = None, *, drop: bool = False) -> Output:
        """Judge every held verdict (in event-time order), then checkpoint."""
        out = Output()
        now = self.wall()
        held = {p: h for p, h in self.pending.items() if partitions is None or p in partitions}
        for p, heap in held.items():
            while heap:
                _, _, _, verdict, rec = heapq.heappop(heap)
                self._observe(p, verdict, rec, out, now)
        parts = [p for p in self.correlators if partitions is None or p in partitions]
        out.checkpoints.extend(self._checkpoint(self.schedule.take_all(parts)))
        if drop:
            for p in parts:
                self.correlators.pop(p, None)
                self.pending.pop(p, None)
        self._count(out)
        return out

    def _count(self, out: Output) -> None:
        self.stats.commands += len(out.commands)
        self.stats.deadletters += len(out.deadletters)
        self.stats.checkpoints += len(out.checkpoints)
