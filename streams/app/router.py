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
import struct
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from c4base.deadletter import DeadLetter
from producers.events import Event, EventDecodeError, OpEvent, ProgressEvent, decode_message
from producers.guard import MAX_DEPTH, MAX_MESSAGE_BYTES, BoundsError, check_bounds
from streams.app.checkpoint import CheckpointSchedule
from streams.app.deadletter import Record, dead_letter
from streams.app.engine import CorrelatorLike, DetectorLike, Engine
from streams.commands import IsolationCommand
from streams.verdicts import Verdict, VerdictDecodeError, decode_verdict

__all__ = [
    "CommRouter",
    "CorrelatorRunner",
    "EdgeLimits",
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


@dataclass(frozen=True)
class EdgeLimits:
    """What the worker accepts from ``c4.events`` beyond the contract's types.

    Each bound stops one way a single message could take the worker down or steer it:
    ``nranks = 2^31`` grew the worker to 21 GB; a ``ts_us`` a year ahead moved its
    partition's clock and hid a fault; ``nranks`` doubled mid-stream hid a straggler.
    """

    max_nranks: int = 65_536
    """Largest communicator accepted (the core sizes its arrays by ``nranks``)."""
    max_future_skew_us: int = 600_000_000
    """How far ahead of its partition's clock (and of the wall clock) an event may be."""
    max_past_skew_us: int = 3_600_000_000
    """How far behind its partition's clock an event may be."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_depth: int = MAX_DEPTH
    contested_hold_us: int = 120_000_000
    """How long (event time) a communicator's verdicts stay alert-only after two sources
    contradicted each other about one of its ranks."""


#: Envelope of a communicator's checkpoint: magic, version, the communicator's size
#: (fixed once seen, so it survives a restart), then the detector's own bytes.
_ENVELOPE = struct.Struct("!4sBq")
_MAGIC = b"C4CM"


def wrap_state(nranks: int, state: bytes) -> bytes:
    """The detector's bytes in the envelope.

    >>> unwrap_state(wrap_state(8, b"abc"))
    (8, b'abc')
    """
    return _ENVELOPE.pack(_MAGIC, 1, nranks) + state


def unwrap_state(data: bytes) -> tuple[int, bytes]:
    """(communicator size, detector bytes); ValueError if ``data`` is not an envelope."""
    if len(data) < _ENVELOPE.size:
        raise ValueError("checkpoint shorter than its envelope")
    magic, version, nranks = _ENVELOPE.unpack_from(data)
    if magic != _MAGIC or version != 1 or nranks < 1:
        raise ValueError("not a communicator checkpoint envelope")
    return nranks, data[_ENVELOPE.size :]


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
        for c in ev.conns or ():
            if c.peer >= ev.nranks:
                return f"event {i}: peer {c.peer} is not below nranks {ev.nranks}"
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
        limits: EdgeLimits | None = None,
        epoch: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.lookup = lookup
        self.schedule = CheckpointSchedule(checkpoint_every_events, checkpoint_every_s)
        self.advance_every_us = advance_every_us
        self.wall = clock
        self.epoch = epoch
        self.limits = limits or EdgeLimits()
        self.comms: dict[str, _Comm] = {}
        self.sizes: dict[str, int] = {}
        """Communicator -> nranks, fixed by the first event accepted (or its checkpoint)."""
        self._accepted_at: dict[int, float] = {}
        """Partition -> wall time (``clock``) of the last message accepted."""
        self._progress: dict[str, dict[int, tuple[int, int]]] = {}
        self._ops: dict[str, dict[tuple[int, str], tuple[int, float]]] = {}
        """Communicator -> (rank, op) -> (seq, exec_us) of its newest completed op."""
        """Communicator -> rank -> (started, completed) of its newest heartbeat."""
        self.contested: dict[str, tuple[int, str]] = {}
        """Communicator -> (event time until which its verdicts are alert-only, why)."""
        self.by_partition: dict[int, set[str]] = {}
        self.clock_us: dict[int, int] = {}
        self._advanced_us: dict[int, int] = {}
        self._slice_end: dict[int, int] = {}
        self.pending: dict[int, dict[str, tuple[list[Event], list[tuple[Record, list[Event]]]]]]
        self.pending = {}
        """Per partition, the events of its open event-time slice, by communicator:
        comm -> (its events, (record, its events) per message)."""
        self._active: set[int] = set()
        """Partitions that got messages since the last tick()."""
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
                size, state = unwrap_state(data)
                det = self.engine.load_detector(comm, state)
                self.sizes.setdefault(comm, size)  # only once the state itself loaded
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
            lim = self.limits
            try:
                events = decode_message(
                    rec.value, max_bytes=lim.max_message_bytes, max_depth=lim.max_depth
                )
            except EventDecodeError as err:
                out.deadletters.append(dead_letter(rec, f"undecodable message: {err}"))
                continue
            problem = contract_problem(events) or self._admission_problem(rec.partition, events)
            if problem is not None:
                out.deadletters.append(dead_letter(rec, f"event breaks the contract: {problem}"))
                continue
            st.events += len(events)
            p = rec.partition
            self._active.add(p)
            self._accepted_at[p] = self.wall()
            for ev in events:
                self.sizes.setdefault(ev.comm, ev.nranks)
                if isinstance(ev, ProgressEvent):
                    self._check_counters(ev)
                else:
                    self._check_op(ev)
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
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(self.wall())))
        self._count(out)
        return out

    def _admission_problem(self, p: int, events: Sequence[Event]) -> str | None:
        """What makes an otherwise valid message unsafe to feed (None: feed it).

        A communicator's size never changes (NCCL gives a resized one a new id), so a
        different ``nranks`` is a forgery or a bug, not a resize. Event time may not run
        ahead of the partition's clock, nor of the wall clock, by more than the skew
        (it would move the clock and make every communicator of the partition judge
        the future), nor lag far behind it; such events never move the clock. After
        the partition has been quiet for the skew (wall time), a jump ahead is taken
        as traffic resuming.
        """
        lim = self.limits
        clock = self.clock_us.get(p)
        quiet = self.wall() - self._accepted_at.get(p, float("-inf"))
        horizon = int(self.epoch() * 1e6) + lim.max_future_skew_us
        sizes = self.sizes
        seen: dict[str, int] = {}
        for i, ev in enumerate(events):
            if ev.nranks > lim.max_nranks:
                return f"event {i}: nranks {ev.nranks} is over the limit of {lim.max_nranks}"
            size = sizes.get(ev.comm) or self._restored_size(ev.comm, p)
            size = size or seen.setdefault(ev.comm, ev.nranks)
            if ev.nranks != size:
                return (
                    f"event {i}: communicator {ev.comm[:64]} has {size} ranks, "
                    f"this event says {ev.nranks} (a communicator never changes size)"
                )
            ts = ev.ts_us
            if ts > horizon:
                return f"event {i}: ts_us {ts} is further ahead of the wall clock than the skew"
            if clock is None:
                continue
            if ts > clock + lim.max_future_skew_us and quiet < lim.max_future_skew_us / 1e6:
                return (
                    f"event {i}: ts_us {ts} is {(ts - clock) / 1e6:.0f}s ahead of its "
                    f"partition's clock (allowed: {lim.max_future_skew_us / 1e6:.0f}s)"
                )
            if ts < clock - lim.max_past_skew_us:
                return (
                    f"event {i}: ts_us {ts} is {(clock - ts) / 1e6:.0f}s behind its "
                    f"partition's clock (allowed: {lim.max_past_skew_us / 1e6:.0f}s)"
                )
        return None

    def _check_counters(self, ev: ProgressEvent) -> None:
        """Corroboration, within the detector's physics: a rank's heartbeat counters only
        grow, so a heartbeat that goes back means two sources report for one rank (a
        forger and the real exporter). A forged hang must contradict someone: the
        accused's own heartbeats (it is alive and advancing) or its peers' (they are not
        as far ahead as claimed). Such a communicator's verdicts stay alert-only."""
        ranks = self._progress.setdefault(ev.comm, {})
        last = ranks.get(ev.rank)
        ranks[ev.rank] = (
            (max(ev.started, last[0]), max(ev.completed, last[1]))
            if last
            else (
                ev.started,
                ev.completed,
            )
        )
        if last is not None and (ev.started < last[0] or ev.completed < last[1]):
            why = (
                f"rank {ev.rank}'s heartbeat went back from started {last[0]}/completed "
                f"{last[1]} to {ev.started}/{ev.completed}: two sources report for it"
            )
            self._contest(ev.comm, ev.ts_us, why)

    def _check_op(self, ev: OpEvent) -> None:
        """The same for completed ops: per rank and op, ``seq`` only grows, and one
        collective has one duration. A re-sent message repeats both exactly; a second
        source (a forged straggler pattern) contradicts the real one in either."""
        ops = self._ops.setdefault(ev.comm, {})
        key = (ev.rank, ev.op)
        last = ops.get(key)
        if last is None or ev.seq > last[0]:
            ops[key] = (ev.seq, ev.exec_us)
            return
        if ev.seq < last[0]:
            self._contest(ev.comm, ev.ts_us,
                          f"rank {ev.rank}'s {ev.op} went back from seq {last[0]} to {ev.seq}: "
                          "two sources report for it")  # fmt: skip
        elif ev.exec_us != last[1]:
            why = (
                f"rank {ev.rank}'s {ev.op} seq {ev.seq} reported twice with different "
                f"durations ({last[1]} and {ev.exec_us} us): two sources report for it"
            )
            self._contest(ev.comm, ev.ts_us, why)

    def _contest(self, comm: str, ts_us: int, why: str) -> None:
        if comm not in self.contested:
            log.warning("communicator %s contested: %s", comm, why)
        self.contested[comm] = (ts_us + self.limits.contested_hold_us, why)

    def _uncontested(self, comm: str, verdicts: list[Verdict]) -> list[Verdict]:
        """``verdicts`` of ``comm``, made alert-only while its evidence is contested."""
        hold = self.contested.get(comm)
        if hold is None or not verdicts:
            return verdicts
        until, why = hold
        out = []
        for v in verdicts:
            if v.ts_us > until:
                out.append(v)
                continue
            out.append(
                msgspec.structs.replace(
                    v, benign=True, reason=f"evidence contested ({why}); alert only. {v.reason}"
                )
            )
        return out

    def _restored_size(self, comm: str, p: int) -> int | None:
        """The size a communicator's checkpoint fixed (after a restart, before its
        detector is restored), or None. Only a checkpoint whose detector loads counts:
        a forged envelope around a refused state must not fix a size."""
        if comm in self.comms or self.lookup(comm.encode()) is None:
            return None
        self._comm(comm, p)  # restores it (or starts afresh if unreadable)
        return self.sizes.get(comm)

    def _judge(
        self,
        p: int,
        groups: dict[str, tuple[list[Event], list[tuple[Record, list[Event]]]]],
        out: Output,
    ) -> None:
        now = self.wall()
        clock = self.clock_us[p]
        for comm, (events, parts) in groups.items():
            c = self._comm(comm, p)
            try:
                out.concluded(self._uncontested(comm, c.detector.observe(events)), clock)
            except Exception as err:
                if len(parts) == 1:
                    self._detector_failed(comm, err, parts[0][0], out)
                    continue
                # Retry message by message so only the offending one is dead-lettered.
                for rec, evs in parts:
                    try:
                        out.concluded(self._uncontested(comm, c.detector.observe(evs)), clock)
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
                out.concluded(self._uncontested(comm, found), now_us)
                self.schedule.touch(comm, 0, wall)

    def tick(self) -> Output:
        """Wall-clock timer: close the open slice of every partition that got no message
        since the previous tick (traffic stopped: judge it and advance, so a hang is
        still found), take time-due checkpoints."""
        quiet = set(self.clock_us) - self._active
        self._active.clear()
        out = self.close_slices(quiet)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(self.wall())))
        self._count(out)
        return out

    def close_slices(self, partitions: set[int] | None = None) -> Output:
        """Judge the open slice of ``partitions`` (all by default) and advance them."""
        out = Output()
        for p in list(self.clock_us if partitions is None else partitions):
            groups = self.pending.pop(p, None)
            if groups:
                self._judge(p, groups, out)
            if p in self.clock_us and self.clock_us[p] > self._advanced_us.get(p, 0):
                self._advance_partition(p, out)
        return out

    def _checkpoint(self, comms: list[str]) -> list[tuple[int, bytes, bytes]]:
        out = []
        for comm in comms:
            c = self.comms.get(comm)
            if c is None:
                continue
            try:
                state = wrap_state(self.sizes.get(comm, 1), c.detector.to_bytes())
                out.append((c.partition, comm.encode(), state))
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
                c = self.comms.pop(comm)
                self.by_partition.get(c.partition, set()).discard(comm)
                self.schedule.forget(comm)
                self.sizes.pop(comm, None)
                self._progress.pop(comm, None)
                self._ops.pop(comm, None)
                self.contested.pop(comm, None)
            for p in partitions or set(self.clock_us):
                self.clock_us.pop(p, None)
                self._advanced_us.pop(p, None)
                self._slice_end.pop(p, None)
                self._accepted_at.pop(p, None)
                self.by_partition.pop(p, None)
                self.pending.pop(p, None)
                self._active.discard(p)
        self._count(out)
        return out

    def _count(self, out: Output) -> None:
        self.stats.verdicts += len(out.verdicts)
        self.stats.deadletters += len(out.deadletters)
        self.stats.checkpoints += len(out.checkpoints)


class Watermark(msgspec.Struct, frozen=True, omit_defaults=True):
    """Event-time progress of one ``c4.events`` partition, sent by agent 1 to agent 2.

    Verdicts of different partitions reach the correlator out of event-time order (one
    partition may be seconds ahead of another, very much so while catching up), and the
    correlator must see a victim's "waiting in communicator X" before it judges that
    victim as the culprit elsewhere. So agent 2 holds verdicts until every events
    partition's clock has passed them, and feeds them in event-time order.

    >>> decode_watermark(encode_watermark(Watermark(partition=3, clock_us=7)))
    Watermark(partition=3, clock_us=7, caught_up=False, verdicts_offset=-1)
    >>> encode_watermark(Watermark(partition=3, clock_us=-1, caught_up=True))
    b'{"partition":3,"clock_us":-1,"caught_up":true}'
    """

    partition: int
    clock_us: int
    """Newest ``ts_us`` judged in this partition; -1 if none since the sender started."""
    caught_up: bool = False
    """The sender had judged everything in the partition (no consumer lag) when it sent
    this: the only case in which the partition may stop holding the watermark back."""
    verdicts_offset: int = -1
    """Offset of the last verdict the sender had put on the ``c4.verdicts`` partition this
    watermark travels with (-1: none). The two topics are fetched independently, so the
    mark only counts once the correlator has read the verdicts partition that far."""


_wm_decoder = msgspec.json.Decoder(Watermark)


def encode_watermark(w: Watermark) -> bytes:
    return msgspec.json.encode(w)


def decode_watermark(data: bytes) -> Watermark:
    """Raises ValueError (msgspec's DecodeError or a bound) on anything not a mark."""
    try:
        check_bounds(data, max_bytes=4096)
        return _wm_decoder.decode(data)
    except (msgspec.DecodeError, BoundsError):
        raise
    except Exception as err:  # RecursionError and the like: never past the edge
        raise ValueError(f"undecodable: {type(err).__name__}") from None


@dataclass
class _Mark:
    """What the correlator knows of one events partition (wall times are its own)."""

    clock_us: int
    heard: float
    """When a report on the partition last arrived."""
    moved: float
    """When its clock last moved."""
    idle_since: float | None = None
    """Since when every report said "caught up" at an unchanged clock (None: lagging)."""


class CorrelatorRunner:
    """One host correlator per ``c4.verdicts`` partition, fed in event-time order.

    Verdicts are judged in the order :class:`~streams.core.DetectionPipeline` judges
    them: by the event-time slice (``slice_us``) of the clock at which their detector
    concluded them (header :data:`~streams.app.deadletter.CLOCK_HEADER`; a hang found
    late carries an early ``ts_us``), then by ``ts_us``, benign notes first. A slice is
    judged once the watermark has passed its end: no partition can conclude anything in
    it any more.

    The event-time watermark of a verdicts partition is the minimum clock of the
    ``c4.events`` partitions (all ``events_partitions`` of them when given, else those
    that reported), not counting a partition that

    * has had no consumer lag at an unchanged clock for ``idle_s`` of wall time (no
      traffic: it must not hold everything back), or
    * sent no report at all for ``max_hold_s`` of wall time (its worker is gone).

    A partition with lag always holds, however slow the machine: wall time alone never
    lets a verdict overtake one that explains it. A partition not heard of yet (e.g.
    after a restart) holds too. When no partition holds, the newest clock moves on by
    wall time, so cool-downs still expire. At most ``max_pending`` verdicts per verdicts
    partition are held (the oldest are judged beyond that: bounded state).
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.lookup = lookup
        self.schedule = CheckpointSchedule(checkpoint_every_events, checkpoint_every_s)
        self.watermark_topic = watermark_topic
        self.events_partitions = events_partitions
        self.idle_s = idle_s
        self.max_hold_s = max_hold_s
        self.slice_us = slice_us
        self.max_pending = max_pending
        self.wall = clock
        self.started = clock()
        self.correlators: dict[int, CorrelatorLike] = {}
        self.marks: dict[int, dict[int, _Mark]] = {}
        """verdicts partition -> events partition -> what its reports said."""
        self.read_upto: dict[int, int] = {}
        """verdicts partition -> highest offset read."""
        self.deferred: dict[int, list[tuple[Watermark, float]]] = {}
        """Watermarks whose verdicts have not been read yet, with when they arrived."""
        self.pending: dict[int, list[tuple[int, int, bool, int, Verdict, Record]]] = {}
        """verdicts partition -> heap of (slice end, ts_us, not benign, seq, ...)."""
        self._seq = 0
        self._advanced_us: dict[int, int] = {}
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

    def _apply(self, q: int, wm: Watermark, now: float) -> None:
        marks = self._marks(q)
        m = marks.get(wm.partition)
        if m is None:
            m = marks[wm.partition] = _Mark(-1, now, now)
        m.heard = now
        moved = wm.clock_us > m.clock_us
        if moved:  # clocks never go back (a restarted sender starts at -1)
            m.clock_us = wm.clock_us
            m.moved = now
        if not wm.caught_up:
            m.idle_since = None
        elif moved or m.idle_since is None:
            m.idle_since = now

    def watermark(self, now: float, q: int = 0) -> int | None:
        """Event time up to which every events partition's verdicts have reached verdicts
        partition ``q`` (None: nothing can be released yet)."""
        marks = self._marks(q)
        holding = [
            m.clock_us
            for m in marks.values()
            if now - m.heard < self.max_hold_s
            and (m.idle_since is None or now - m.idle_since < self.idle_s)
        ]
        if holding:
            low = min(holding)
            return low if low >= 0 else None
        known = [m for m in marks.values() if m.clock_us >= 0]
        if not known:
            return None
        newest = max(known, key=lambda m: m.clock_us)
        return newest.clock_us + int((now - newest.moved) * 1e6)

    def describe(self) -> dict[str, Any]:
        """Per verdicts partition: the watermark, held verdicts and each events
        partition's clock / seconds since heard / seconds caught up (for status.json)."""
        now = self.wall()
        out: dict[str, Any] = {}
        for q, marks in self.marks.items():
            out[str(q)] = {
                "watermark_us": self.watermark(now, q),
                "held": len(self.pending.get(q, ())),
                "deferred": len(self.deferred.get(q, ())),
                "partitions": {
                    str(p): [
                        m.clock_us,
                        round(now - m.heard, 1),
                        None if m.idle_since is None else round(now - m.idle_since, 1),
                    ]
                    for p, m in sorted(marks.items())
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
                except ValueError as err:
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
            clock = rec.clock_us if rec.clock_us is not None else verdict.ts_us
            end = clock - clock % self.slice_us + self.slice_us
            heapq.heappush(
                self.pending.setdefault(q, []),
                (end, verdict.ts_us, not verdict.benign, self._seq, verdict, rec),
            )
        self._release(out, now)
        out.checkpoints.extend(self._checkpoint(self._due(out, now)))
        self._count(out)
        return out

    def _due(self, out: Output, now: float) -> list[int]:
        """Correlators to checkpoint with this output: the time/count-due ones, and all
        dirty ones when a decision was made, so that its checkpoint goes out right behind
        the command (a worker killed a second after a decision sent it again)."""
        return self.schedule.take_all() if out.commands else self.schedule.take_due(now)

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
        for q, heap in self.pending.items():
            wm = self.watermark(now, q)
            while heap and ((wm is not None and heap[0][0] <= wm) or len(heap) > self.max_pending):
                verdict, rec = heapq.heappop(heap)[-2:]
                self._observe(q, verdict, rec, out, now)
        for q, cor in self.correlators.items():
            wm = self.watermark(now, q)
            if wm is None or wm <= self._advanced_us.get(q, -1):
                continue
            self._advanced_us[q] = wm
            try:
                found = cor.advance(wm)
            except Exception:
                self.stats.detector_errors += 1
                log.exception("host correlator %d failed to advance", q)
                continue
            if found:
                out.commands.extend(found)
                self.schedule.touch(q, 1, now)

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
        out.checkpoints.extend(self._checkpoint(self._due(out, now)))
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
                verdict, rec = heapq.heappop(heap)[-2:]
                self._observe(p, verdict, rec, out, now)
        parts = [p for p in self.correlators if partitions is None or p in partitions]
        out.checkpoints.extend(self._checkpoint(self.schedule.take_all(parts)))
        if drop:
            for p in parts:
                self.correlators.pop(p, None)
                self.pending.pop(p, None)
            for q in list(self.marks) if partitions is None else partitions:
                self.marks.pop(q, None)
                self.deferred.pop(q, None)
                self.read_upto.pop(q, None)
                self._advanced_us.pop(q, None)
        self._count(out)
        return out

    def _count(self, out: Output) -> None:
        self.stats.commands += len(out.commands)
        self.stats.deadletters += len(out.deadletters)
        self.stats.checkpoints += len(out.checkpoints)
