"""Broker-free heart of the agents: routes records to detectors, keeps clocks and checkpoints.

The Faust agents (:mod:`streams.app.agents`) only move bytes between Kafka and these
two classes, so everything here is tested without a broker.

:class:`CommRouter` (agent 1, ``c4.events``): decodes each message, dead-letters what
breaks the contract, groups events by communicator, feeds each communicator's detector
one batch, and advances every communicator of a partition whenever that partition's
event-time clock (max ``ts_us`` seen) moves on by ``advance_every_us``, so a collective
that stops completing is noticed while heartbeats keep arriving.

:class:`CorrelatorRunner` (agent 2, ``c4.verdicts`` plus the worker's watermark topic):
one host correlator per verdicts partition, fed in DetectionPipeline's order behind a
watermark (the slowest events partition that still has lag or reports), see
:class:`Watermark` and :class:`CorrelatorRunner`.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from c4base.deadletter import DeadLetter
from producers.events import Event, EventDecodeError, decode_message
from streams.app.checkpoint import CheckpointSchedule
from streams.app.deadletter import Record, dead_letter
from streams.app.engine import CorrelatorLike, DetectorLike, Engine
from streams.commands import IsolationCommand
from streams.core.correlate import LateEvidence
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
    clocks: list[int] = field(default_factory=list)
    """Per verdict: its events partition's event-time clock when it was concluded."""
    commands: list[IsolationCommand] = field(default_factory=list)
    deadletters: list[DeadLetter] = field(default_factory=list)
    checkpoints: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    """(partition, key, state bytes) to write to the table."""
    late_events: list[tuple[str, int]] = field(default_factory=list)
    """(job, events) dead-lettered as late beyond the allowed lateness."""
    late_verdicts: list[tuple[str, str]] = field(default_factory=list)
    """(job, outcome) per verdict that came behind its job's watermark: ``judged``
    (within the allowed lateness) or ``deadlettered`` (beyond it)."""

    def concluded(self, verdicts: list[Verdict], clock_us: int) -> None:
        self.verdicts.extend(verdicts)
        self.clocks.extend([clock_us] * len(verdicts))


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
    __slots__ = ("detector", "job", "judged_us", "partition")

    def __init__(self, detector: DetectorLike, partition: int, job: str) -> None:
        self.detector = detector
        self.partition = partition
        self.job = job
        self.judged_us = -1
        """Event time this communicator's detector has been judged up to (events
        observed, or advanced to): its windows before that are closed."""


Lane = tuple[int, str]
"""(events partition, job): one job's event time within one partition."""


class CommRouter:
    """All communicators of one worker, by partition and job.

    Event time is kept per *lane* (partition, job): a job's communicators are advanced
    by that job's clock only, so a job whose events run minutes behind another's in the
    same partition (a delayed exporter, a replayed trace) is judged on its own time.
    A message whose events are behind the time their communicator was already judged up
    to by more than ``allowed_lateness_us`` cannot be judged any more (its windows are
    closed): it is dead-lettered "late by N s" and counted in ``late_events`` per job.
    """

    def __init__(
        self,
        engine: Engine,
        lookup: Lookup,
        *,
        checkpoint_every_events: int,
        checkpoint_every_s: float,
        advance_every_us: int,
        allowed_lateness_us: int = 10_000_000,
        forget_lane_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.lookup = lookup
        self.schedule = CheckpointSchedule(checkpoint_every_events, checkpoint_every_s)
        self.advance_every_us = advance_every_us
        self.forget_lane_s = forget_lane_s
        self.allowed_lateness_us = allowed_lateness_us
        self.wall = clock
        self.comms: dict[str, _Comm] = {}
        self.by_lane: dict[Lane, set[str]] = {}
        self.clock_us: dict[Lane, int] = {}
        """Event-time clock (newest ``ts_us`` seen) per lane."""
        self._advanced_us: dict[Lane, int] = {}
        self._slice_end: dict[Lane, int] = {}
        self.pending: dict[Lane, dict[str, tuple[list[Event], list[tuple[Record, list[Event]]]]]]
        self.pending = {}
        """Per lane, the events of its open event-time slice, by communicator:
        comm -> (its events, (record, its events) per message)."""
        self._active: set[Lane] = set()
        """Lanes that got messages since the last tick()."""
        self._last_active: dict[Lane, float] = {}
        """Lane -> wall time of its last message (a lane quiet for ``forget_lane_s`` is
        forgotten: a finished job's watermarks stop)."""
        self.late_events: dict[str, int] = {}
        """Per job: events dead-lettered as late beyond the allowed lateness."""
        self.jobs: set[str] = set()
        """Every job seen (its metrics are exported from 0)."""
        self.stats = RouterStats()

    def partition_clock(self, p: int) -> int:
        """Newest clock of any job in partition ``p`` (-1: none)."""
        return max((t for (q, _), t in self.clock_us.items() if q == p), default=-1)

    # ---------------------------------------------------------------- detectors
    def _comm(self, comm: str, partition: int, job: str) -> _Comm:
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
        c = self.comms[comm] = _Comm(det, partition, job)
        self.by_lane.setdefault((partition, job), set()).add(comm)
        self.jobs.add(job)
        return c

    # ---------------------------------------------------------------- batches
    def process(self, records: Sequence[Record], settle: Collection[int] = ()) -> Output:
        """One ``take`` batch of ``c4.events`` messages.

        ``settle``: partitions without consumer lag (live traffic): their open slices are
        judged now, and advanced when due, rather than when the next slice begins, which
        costs up to a second of latency. Partitions with lag (catching up) are judged
        exactly slice by slice, as DetectionPipeline does (per job)."""
        out = Output()
        st = self.stats
        st.batches += 1
        st.messages += len(records)
        # As in DetectionPipeline, a lane's slice is judged (observe, then advance every
        # comm of the lane) when an event of its next slice arrives, whatever the batches:
        # a catch-up batch spanning minutes of event time is judged slice by slice, and a
        # slice spread over many small batches is judged at once, like offline.
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
            first = events[0].comm
            if all(ev.comm == first for ev in events):  # the usual case: one comm per message
                self._take(rec, first, events, out)
            else:
                per_comm: dict[str, list[Event]] = {}
                for ev in events:
                    per_comm.setdefault(ev.comm, []).append(ev)
                for comm, evs in per_comm.items():
                    self._take(rec, comm, evs, out)
        for lane in [lane for lane in self.clock_us if lane[0] in settle]:
            groups = self.pending.pop(lane, None)
            if groups:
                self._judge(lane, groups, out)
            if self.clock_us[lane] - self._advanced_us.get(lane, 0) >= self.advance_every_us:
                self._advance_lane(lane, out)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(self.wall())))
        self._count(out)
        return out

    def _take(self, rec: Record, comm: str, events: list[Event], out: Output) -> None:
        """Put one communicator's events of one message into its lane's open slice."""
        p = rec.partition
        c = self.comms.get(comm)
        top = max(ev.ts_us for ev in events)
        if c is not None and c.judged_us - top > self.allowed_lateness_us:
            late = c.judged_us - top
            self.late_events[c.job] = self.late_events.get(c.job, 0) + len(events)
            out.late_events.append((c.job, len(events)))
            out.deadletters.append(
                dead_letter(
                    rec,
                    f"late by {late / 1e6:.0f} s: communicator {comm} of job {c.job} was "
                    f"already judged up to {c.judged_us} (event time), these "
                    f"{len(events)} events end at {top}; allowed lateness "
                    f"{self.allowed_lateness_us / 1e6:g} s",
                )
            )
            return
        if c is None:
            c = self._comm(comm, p, events[0].job)  # restored (or created) on arrival
        lane = (c.partition, c.job)
        self._active.add(lane)
        end = self._slice_end.get(lane)
        if end is None or top >= end:
            if end is not None and lane in self.pending:
                self._judge(lane, self.pending.pop(lane), out)
                self._advance_lane(lane, out)
            self._slice_end[lane] = top - top % self.advance_every_us + self.advance_every_us
        if top > self.clock_us.get(lane, -1):
            self.clock_us[lane] = top
        g = self.pending.setdefault(lane, {}).get(comm)
        if g is None:
            g = self.pending[lane][comm] = ([], [])
        g[0].extend(events)
        g[1].append((rec, events))

    def _judge(
        self,
        lane: Lane,
        groups: dict[str, tuple[list[Event], list[tuple[Record, list[Event]]]]],
        out: Output,
    ) -> None:
        now = self.wall()
        clock = self.clock_us[lane]
        for comm, (events, parts) in groups.items():
            c = self.comms[comm]
            top = max(ev.ts_us for ev in events)
            if top > c.judged_us:
                c.judged_us = top
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

    def _advance_lane(self, lane: Lane, out: Output) -> None:
        now_us = self.clock_us[lane]
        self._advanced_us[lane] = now_us
        wall = self.wall()
        for comm in list(self.by_lane.get(lane, ())):
            c = self.comms[comm]
            if now_us > c.judged_us:
                c.judged_us = now_us
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
        """Wall-clock timer: close the open slice of every lane that got no message since
        the previous tick (traffic stopped: judge it and advance, so a hang is still
        found), take time-due checkpoints."""
        quiet = set(self.clock_us) - self._active
        wall = self.wall()
        for lane in self._active:
            self._last_active[lane] = wall
        self._active.clear()
        out = self._close(quiet)
        for lane in [
            x for x in quiet if wall - self._last_active.get(x, wall) > self.forget_lane_s
        ]:
            # Its communicators stay (with what they were judged up to); a new message
            # of the job starts the lane again.
            self.clock_us.pop(lane, None)
            self._advanced_us.pop(lane, None)
            self._slice_end.pop(lane, None)
            self._last_active.pop(lane, None)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(self.wall())))
        self._count(out)
        return out

    def close_slices(self, partitions: set[int] | None = None) -> Output:
        """Judge the open slices of ``partitions`` (all by default) and advance them."""
        return self._close(
            {lane for lane in self.clock_us if partitions is None or lane[0] in partitions}
        )

    def _close(self, lanes: set[Lane]) -> Output:
        out = Output()
        for lane in sorted(lanes):
            groups = self.pending.pop(lane, None)
            if groups:
                self._judge(lane, groups, out)
            if lane in self.clock_us and self.clock_us[lane] > self._advanced_us.get(lane, 0):
                self._advance_lane(lane, out)
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
        (the partitions were revoked: another worker restores them from the table).
        Open slices are judged first."""
        out = self.close_slices(partitions)
        keys = [
            comm
            for comm, c in self.comms.items()
            if partitions is None or c.partition in partitions
        ]
        out.checkpoints.extend(self._checkpoint(self.schedule.take_all(keys)))
        if drop:
            for comm in keys:
                self.comms.pop(comm)
                self.schedule.forget(comm)
            lanes = {
                lane
                for lane in set(self.clock_us) | set(self.by_lane)
                if partitions is None or lane[0] in partitions
            }
            for lane in lanes:
                self.clock_us.pop(lane, None)
                self._advanced_us.pop(lane, None)
                self._slice_end.pop(lane, None)
                self.by_lane.pop(lane, None)
                self.pending.pop(lane, None)
                self._active.discard(lane)
                self._last_active.pop(lane, None)
        self._count(out)
        return out

    def _count(self, out: Output) -> None:
        self.stats.verdicts += len(out.verdicts)
        self.stats.deadletters += len(out.deadletters)
        self.stats.checkpoints += len(out.checkpoints)


class Watermark(msgspec.Struct, frozen=True, omit_defaults=True):
    """Event-time progress of one job in one ``c4.events`` partition, sent by agent 1 to
    agent 2.

    Verdicts of different partitions reach the correlator out of event-time order (one
    partition may be seconds ahead of another, very much so while catching up), and the
    correlator must see a victim's "waiting in communicator X" before it judges that
    victim as the culprit elsewhere. So agent 2 holds each job's verdicts until every
    events partition's clock *for that job* has passed them, and feeds them in event-time
    order. ``job`` names the job the mark holds back; a mark without one speaks for the
    partition as a whole (clock -1: nothing of any job there yet; older senders).

    >>> decode_watermark(encode_watermark(Watermark(partition=3, clock_us=7, job="j")))
    Watermark(partition=3, clock_us=7, caught_up=False, verdicts_offset=-1, job='j')
    >>> encode_watermark(Watermark(partition=3, clock_us=-1, caught_up=True))
    b'{"partition":3,"clock_us":-1,"caught_up":true}'
    """

    partition: int
    clock_us: int
    """Newest ``ts_us`` judged in this partition (for ``job``); -1 if none since the
    sender started."""
    caught_up: bool = False
    """The sender had judged everything in the partition (no consumer lag) when it sent
    this: the only case in which the partition may stop holding the watermark back."""
    verdicts_offset: int = -1
    """Offset of the last verdict the sender had put on the ``c4.verdicts`` partition this
    watermark travels with (-1: none). The two topics are fetched independently, so the
    mark only counts once the correlator has read the verdicts partition that far."""
    job: str | None = None
    """The job whose event time this is (None: the partition as a whole)."""


_wm_decoder = msgspec.json.Decoder(Watermark)


def encode_watermark(w: Watermark) -> bytes:
    return msgspec.json.encode(w)


def decode_watermark(data: bytes) -> Watermark:
    return _wm_decoder.decode(data)


@dataclass
class _Mark:
    """What the correlator knows of one events partition, or of one job in it (wall
    times are its own)."""

    clock_us: int
    heard: float
    """When a report on the partition last arrived."""
    moved: float
    """When its clock last moved."""
    idle_since: float | None = None
    """Since when every report said "caught up" at an unchanged clock (None: lagging)."""
    reported: bool = False
    """Some report arrived since the correlator started (else the partition holds every
    job back, for up to ``max_hold_s``: after a restart it may hold anything)."""
    caught_since: float | None = None
    """Since when every report on the partition said "caught up" (None: lagging)."""


Held = tuple[int, int, bool, int, Verdict, Record]
"""(slice end, ts_us, not benign, seq, verdict, record): a heap entry."""


class CorrelatorRunner:
    """One host correlator per ``c4.verdicts`` partition, fed in event-time order per job.

    Verdicts are judged in the order :class:`~streams.core.DetectionPipeline` judges
    them: by the event-time slice (``slice_us``) of the clock at which their detector
    concluded them (header :data:`~streams.app.deadletter.CLOCK_HEADER`; a hang found
    late carries an early ``ts_us``), then by ``ts_us``, benign notes first. A slice is
    judged once its job's watermark has passed its end: no partition can conclude
    anything of that job in it any more.

    Event time is per job. The watermark of job J on a verdicts partition is the minimum
    clock for J of the ``c4.events`` partitions that reported J (a partition that never
    reported anything since the start holds every job), not counting a partition that

    * has had no consumer lag at an unchanged clock for ``idle_s`` of wall time (no
      traffic: it must not hold everything back), or
    * sent no report at all for ``max_hold_s`` of wall time (its worker is gone).

    A partition with lag always holds, however slow the machine: wall time alone never
    lets a verdict overtake one that explains it. When no partition holds J, J's newest
    clock moves on by wall time, but at most half of ``allowed_lateness_us`` (so its last
    hangs settle; and a backlog of J that arrives later, say from an exporter that was cut
    off, is still within the allowed lateness). A verdict that arrives after its job's
    watermark passed it is judged at once (counted ``judged`` in ``late_verdicts``); the
    correlator refuses one beyond the allowed lateness, which is dead-lettered "late by
    N s" (counted ``deadlettered``). At most ``max_pending`` verdicts per verdicts
    partition and job are held (the oldest are judged beyond that: bounded state).
    """

    def __init__(
        self,
        engine: Engine,
        lookup: Lookup,
        *,
        checkpoint_every_events: int,
        checkpoint_every_s: float,
        watermark_topic: str = "",
        events_partitions: int | None = None,
        idle_s: float = 5.0,
        max_hold_s: float = 30.0,
        slice_us: int = 500_000,
        max_pending: int = 100_000,
        allowed_lateness_us: int = 10_000_000,
        forget_lane_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.lookup = lookup
        self.schedule = CheckpointSchedule(checkpoint_every_events, checkpoint_every_s)
        self.watermark_topic = watermark_topic
        self.forget_lane_s = forget_lane_s
        self.events_partitions = events_partitions
        self.idle_s = idle_s
        self.max_hold_s = max_hold_s
        self.slice_us = slice_us
        self.max_pending = max_pending
        self.quiet_run_us = allowed_lateness_us // 2
        self.wall = clock
        self.started = clock()
        self.correlators: dict[int, CorrelatorLike] = {}
        self.marks: dict[int, dict[int, _Mark]] = {}
        """verdicts partition -> events partition -> what its reports said."""
        self.lanes: dict[int, dict[Lane, _Mark]] = {}
        """verdicts partition -> (events partition, job) -> what its reports said."""
        self.read_upto: dict[int, int] = {}
        """verdicts partition -> highest offset read."""
        self.deferred: dict[int, list[tuple[Watermark, float]]] = {}
        """Watermarks whose verdicts have not been read yet, with when they arrived."""
        self.pending: dict[int, dict[str, list[Held]]] = {}
        """verdicts partition -> job -> heap of held verdicts."""
        self._seq = 0
        self._advanced_us: dict[tuple[int, str], int] = {}
        """(verdicts partition, job) -> event time its correlator was advanced to."""
        self.late_verdicts: dict[str, dict[str, int]] = {}
        """job -> outcome (``judged``/``deadlettered``) -> verdicts that came behind the
        job's watermark."""
        self.jobs: set[str] = set()
        self.job_seen: dict[str, float] = {}
        """job -> wall time this correlator first heard of it."""
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

    def _marks(self, q: int) -> dict[int, _Mark]:
        marks = self.marks.get(q)
        if marks is None:
            # Every events partition holds until it is heard of (or max_hold_s passes).
            n = self.events_partitions or 0
            t = self.started
            marks = self.marks[q] = {p: _Mark(-1, t, t) for p in range(n)}
        return marks

    @staticmethod
    def _update(m: _Mark, wm: Watermark, now: float) -> None:
        m.heard = now
        m.reported = True
        moved = wm.clock_us > m.clock_us
        if moved:  # clocks never go back (a restarted sender starts at -1)
            m.clock_us = wm.clock_us
            m.moved = now
        if not wm.caught_up:
            m.idle_since = None
        elif moved or m.idle_since is None:
            m.idle_since = now

    def _apply(self, q: int, wm: Watermark, now: float) -> None:
        marks = self._marks(q)
        m = marks.get(wm.partition)
        if m is None:
            m = marks[wm.partition] = _Mark(-1, now, now)
        if not wm.caught_up:
            m.caught_since = None
        elif m.caught_since is None:
            m.caught_since = now
        if wm.job is None:
            self._update(m, wm, now)
            return
        m.heard, m.reported = now, True
        lanes = self.lanes.setdefault(q, {})
        lm = lanes.get((wm.partition, wm.job))
        if lm is None:
            lm = lanes[(wm.partition, wm.job)] = _Mark(-1, now, now)
            self._seen(wm.job, now)
        self._update(lm, wm, now)

    def _seen(self, job: str, now: float) -> None:
        if job not in self.jobs:
            self.jobs.add(job)
            self.job_seen[job] = now

    def _holds(self, m: _Mark, now: float) -> bool:
        return m.idle_since is None or now - m.idle_since < self.idle_s

    def watermark(self, now: float, q: int = 0, job: str | None = None) -> int | None:
        """Event time of ``job`` up to which every events partition's verdicts have
        reached verdicts partition ``q`` (None: nothing can be released yet). Without a
        job: the partitions' own clocks (marks sent without a job)."""
        marks = self._marks(q)
        if job is None:
            holding = [
                m.clock_us
                for m in marks.values()
                if now - m.heard < self.max_hold_s and self._holds(m, now)
            ]
            if holding:
                low = min(holding)
                return low if low >= 0 else None
            known = [m for m in marks.values() if m.clock_us >= 0]
            if not known:
                return None
            newest = max(known, key=lambda m: m.clock_us)
            return newest.clock_us + int((now - newest.moved) * 1e6)
        lanes = self.lanes.get(q, {})
        holding = []
        known = []
        for p, m in marks.items():
            lm = lanes.get((p, job))
            if lm is None and m.clock_us >= 0:
                lm = m  # a sender that reports partitions, not jobs
            if lm is not None and lm.clock_us >= 0:
                known.append(lm)
            if now - m.heard >= self.max_hold_s:
                continue  # gone
            if lm is None:
                # Nothing of this job reported from p. It may still hold some in its
                # backlog unless it has had no lag for idle_s since the job was first
                # seen (a "caught up" can be a fetch behind: give it idle_s, as a lane).
                seen = self.job_seen.get(job, now)
                since = m.caught_since
                if not m.reported or since is None or now - max(since, seen) < self.idle_s:
                    holding.append(-1)
                continue
            if self._holds(lm, now):
                holding.append(lm.clock_us)
        if holding:
            low = min(holding)
            return low if low >= 0 else None
        if not known:
            return None
        newest = max(known, key=lambda m: m.clock_us)
        return newest.clock_us + min(int((now - newest.moved) * 1e6), self.quiet_run_us)

    def describe(self) -> dict[str, Any]:
        """Per verdicts partition and job: the watermark, held verdicts and each events
        partition's clock / seconds since heard / seconds caught up (for status.json)."""
        now = self.wall()
        out: dict[str, Any] = {}
        for q, marks in self.marks.items():
            lanes = self.lanes.get(q, {})
            jobs = sorted({j for _, j in lanes} | set(self.pending.get(q, {})))
            out[str(q)] = {
                "deferred": len(self.deferred.get(q, ())),
                "partitions": {
                    str(p): [
                        m.clock_us,
                        round(now - m.heard, 1),
                        None if m.idle_since is None else round(now - m.idle_since, 1),
                    ]
                    for p, m in sorted(marks.items())
                },
                "jobs": {
                    job: {
                        "watermark_us": self.watermark(now, q, job),
                        "held": len(self.pending.get(q, {}).get(job, ())),
                        "holding": sorted(
                            p
                            for (p, j), lm in lanes.items()
                            if j == job
                            and now - marks[p].heard < self.max_hold_s
                            and self._holds(lm, now)
                        ),
                        "clocks": {
                            str(p): lm.clock_us for (p, j), lm in sorted(lanes.items()) if j == job
                        },
                    }
                    for job in jobs
                },
            }
        return out

    def process(self, records: Sequence[Record]) -> Output:
        out = Output()
        st = self.stats
        st.batches += 1
        now = self.wall()
        for rec in records:
            q = rec.partition
            if rec.topic == self.watermark_topic:
                try:
                    wm = decode_watermark(rec.value)
                except msgspec.DecodeError as err:
                    out.deadletters.append(dead_letter(rec, f"undecodable watermark: {err}"))
                    continue
                if wm.verdicts_offset > self.read_upto.get(q, -1):
                    self.deferred.setdefault(q, []).append((wm, now))
                else:
                    self._apply(q, wm, now)
                continue
            if rec.offset > self.read_upto.get(q, -1):
                self.read_upto[q] = rec.offset
            st.messages += 1
            try:
                verdict = decode_verdict(rec.value)
            except VerdictDecodeError as err:
                out.deadletters.append(dead_letter(rec, f"undecodable verdict: {err}"))
                continue
            st.events += 1
            self._seq += 1
            self._correlator(q)  # restored (or created) now: status shows what serves q
            self._seen(verdict.job, now)
            clock = rec.clock_us if rec.clock_us is not None else verdict.ts_us
            end = clock - clock % self.slice_us + self.slice_us
            heapq.heappush(
                self.pending.setdefault(q, {}).setdefault(verdict.job, []),
                (end, verdict.ts_us, not verdict.benign, self._seq, verdict, rec),
            )
        self._release(out, now)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(now)))
        self._count(out)
        return out

    def _undefer(self, now: float) -> None:
        for q, waiting in self.deferred.items():
            if not waiting:
                continue
            upto = self.read_upto.get(q, -1)
            keep = []
            for wm, at in waiting:
                # A mark whose verdict never shows up (this correlator started past it,
                # e.g. after a restart) counts after idle_s rather than never.
                if wm.verdicts_offset <= upto or now - at >= self.idle_s:
                    self._apply(q, wm, now)
                else:
                    keep.append((wm, at))
            self.deferred[q] = keep

    def _release(self, out: Output, now: float) -> None:
        self._undefer(now)
        for q, jobs in self.pending.items():
            for job, heap in jobs.items():
                wm = self.watermark(now, q, job)
                while heap and (
                    (wm is not None and heap[0][0] <= wm) or len(heap) > self.max_pending
                ):
                    self._observe(q, heapq.heappop(heap), out, now)
        for q, cor in self.correlators.items():
            jobs = {j for _, j in self.lanes.get(q, {})} | set(self.pending.get(q, {}))
            for job in sorted(jobs):
                wm = self.watermark(now, q, job)
                if wm is None or wm <= self._advanced_us.get((q, job), -1):
                    continue
                self._advanced_us[(q, job)] = wm
                try:
                    found = cor.advance(wm, job)
                except Exception:
                    self.stats.detector_errors += 1
                    log.exception("host correlator %d failed to advance job %s", q, job)
                    continue
                if found:
                    out.commands.extend(found)
                    self.schedule.touch(q, 1, now)

    def _observe(self, p: int, held: Held, out: Output, now: float) -> None:
        end, verdict, rec = held[0], held[-2], held[-1]
        cor = self._correlator(p)
        behind = end <= self._advanced_us.get((p, verdict.job), -1)
        try:
            out.commands.extend(cor.observe(verdict))
        except LateEvidence as err:
            self._late(verdict.job, "deadlettered", out)
            out.deadletters.append(dead_letter(rec, str(err)))
            return
        except Exception as err:
            self.stats.detector_errors += 1
            log.exception("host correlator failed on verdict %s", verdict.id)
            reason = f"correlator error: {type(err).__name__}: {err}"
            out.deadletters.append(dead_letter(rec, reason))
            return
        if behind:  # its job's watermark had passed it: judged late, within the lateness
            self._late(verdict.job, "judged", out)
        self.schedule.touch(p, 1, now)

    def _late(self, job: str, outcome: str, out: Output) -> None:
        counts = self.late_verdicts.setdefault(job, {})
        counts[outcome] = counts.get(outcome, 0) + 1
        out.late_verdicts.append((job, outcome))

    def tick(self) -> Output:
        """Release what the watermarks allow; advance correlators; time-due checkpoints;
        forget the marks of lanes not reported for ``forget_lane_s`` (finished jobs)."""
        out = Output()
        now = self.wall()
        self._release(out, now)
        for q, lanes in self.lanes.items():
            for lane in [k for k, m in lanes.items() if now - m.heard > self.forget_lane_s]:
                del lanes[lane]
            for job in [j for j, h in self.pending.get(q, {}).items() if not h]:
                if not any(job == lj for _, lj in lanes):
                    del self.pending[q][job]
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
        """Judge every held verdict (in event-time order per job), then checkpoint."""
        out = Output()
        now = self.wall()
        held = {p: h for p, h in self.pending.items() if partitions is None or p in partitions}
        for p, jobs in held.items():
            for heap in jobs.values():
                while heap:
                    self._observe(p, heapq.heappop(heap), out, now)
        parts = [p for p in self.correlators if partitions is None or p in partitions]
        out.checkpoints.extend(self._checkpoint(self.schedule.take_all(parts)))
        if drop:
            for p in parts:
                self.correlators.pop(p, None)
                self.pending.pop(p, None)
            for q in list(self.marks) if partitions is None else partitions:
                self.marks.pop(q, None)
                self.lanes.pop(q, None)
                self.deferred.pop(q, None)
                self.read_upto.pop(q, None)
                for k in [k for k in self._advanced_us if k[0] == q]:
                    del self._advanced_us[k]
        self._count(out)
        return out

    def _count(self, out: Output) -> None:
        self.stats.commands += len(out.commands)
        self.stats.deadletters += len(out.deadletters)
        self.stats.checkpoints += len(out.checkpoints)
