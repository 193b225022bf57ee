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
import struct
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import msgspec

from producers.events import Event, EventDecodeError, OpEvent, ProgressEvent, decode_message
from producers.guard import MAX_DEPTH, MAX_MESSAGE_BYTES
from streams.app.deadletter import Record, dead_letter
from streams.app.engine import DetectorLike, Engine
from streams.app.runner import Checkpointable, Lookup, Output, StateRunner
from streams.verdicts import Verdict

__all__ = ["CommRouter", "EdgeLimits", "contract_problem", "unwrap_state", "wrap_state"]

log = logging.getLogger(__name__)

Slice = dict[str, tuple[list[Event], list[tuple[Record, list[Event]]]]]
"""An open event-time slice of one partition, by communicator:
comm -> (its events, (record, its events) per message)."""


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
        raise ValueError("not a c4stream communicator checkpoint (no envelope)")
    return nranks, data[_ENVELOPE.size :]


class _Enveloped:
    """A detector as its checkpoint is written: in the envelope with its size."""

    __slots__ = ("detector", "nranks")

    def __init__(self, detector: DetectorLike, nranks: int) -> None:
        self.detector = detector
        self.nranks = nranks

    def to_bytes(self) -> bytes:
        return wrap_state(self.nranks, self.detector.to_bytes())


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
        limits: EdgeLimits | None = None,
        epoch: Callable[[], float] = time.time,
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
        self.limits = limits or EdgeLimits()
        self.epoch = epoch
        self.sizes: dict[str, int] = {}
        """Communicator -> nranks, fixed by the first event accepted (or its checkpoint)."""
        self._accepted_at: dict[int, float] = {}
        """Partition -> wall time (``clock``) of the last message accepted."""
        self._progress: dict[str, dict[int, tuple[int, int]]] = {}
        """Communicator -> rank -> (started, completed) of its newest heartbeat."""
        self._ops: dict[str, dict[tuple[int, str], tuple[int, float]]] = {}
        """Communicator -> (rank, op) -> (seq, exec_us) of its newest completed op."""
        self.contested: dict[str, tuple[int, str]] = {}
        """Communicator -> (event time until which its verdicts are alert-only, why)."""

    # ---------------------------------------------------------------- state
    def _comm(self, comm: str, partition: int) -> _Comm:
        c = self.comms.get(comm)
        if c is not None:
            return c
        det = self._restore(
            comm.encode(),
            self._what(comm),
            lambda data: self._load(comm, data),
            lambda: self.engine.new_detector(comm),
        )
        c = self.comms[comm] = _Comm(det, partition)
        self.by_partition.setdefault(partition, set()).add(comm)
        return c

    def _load(self, comm: str, data: bytes) -> DetectorLike:
        size, state = unwrap_state(data)
        det = self.engine.load_detector(comm, state)
        self.sizes.setdefault(comm, size)  # only once the state itself loaded
        return det

    def _locate(self, key: str) -> tuple[int, bytes, Checkpointable] | None:
        c = self.comms.get(key)
        if c is None:
            return None
        return c.partition, key.encode(), _Enveloped(c.detector, self.sizes.get(key, 1))

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
            for per_comm in (self.sizes, self._progress, self._ops, self.contested):
                per_comm.pop(comm, None)
        for p in partitions or set(self.clock_us):
            self._accepted_at.pop(p, None)
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
        self._due(out, self.wall())
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

    def _judge(self, p: int, groups: Slice, out: Output) -> None:
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
