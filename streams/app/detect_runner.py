"""Agent ``detect``'s runner (``c4.events``), broker-free.

:class:`CommRouter` decodes each message (a JSON array, or an Arrow IPC batch marked by its
``content-type`` header), dead-letters what breaks the contract, groups
events by communicator, feeds each communicator's detector one batch (JSON messages as
event objects; Arrow messages as numpy columns, checked and judged without an object per
event, with the same outcomes and dead-letter reasons), and advances every
communicator of a job in a partition whenever that job's event-time clock there (max
``ts_us`` seen: a *lane* per partition and job) moves on by ``advance_every_us``, so a
collective that stops completing is noticed while heartbeats keep arriving, and a job
whose events run minutes behind another's is judged on its own time. Messages too late
to be judged are dead-lettered "late by N s" and counted per job. The Faust agent
(:mod:`streams.app.agents`) only moves bytes between Kafka and this class, so all of it
is tested without a broker.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from producers.columnar import ColumnBlock, EventColumns, decode_block, table_events
from producers.events import Event, EventDecodeError, OpEvent, ProgressEvent
from producers.guard import (
    MAX_DEPTH,
    MAX_FUTURE_SKEW_US,
    MAX_MESSAGE_BYTES,
    MAX_NRANKS,
    MAX_PAST_SKEW_US,
)
from producers.summary import ExpandStats, has_summaries
from streams.app.column_intake import (
    INFLIGHT_SLACK_US,
    BlockFacts,
    Corroboration,
    OpState,
    ProgressState,
    block_hosts,
    op_codes,
)
from streams.app.deadletter import Record, dead_letter
from streams.app.engine import DetectorLike, Engine
from streams.app.runner import Checkpointable, Lookup, Output, StateRunner
from streams.app.summary_intake import summary_events
from streams.app.trust import EventTrust, signature_refusal
from streams.core import CommDetector
from streams.core.group import cut_many, fold_many
from streams.verdicts import Verdict

__all__ = ["CommRouter", "EdgeLimits", "Lane", "contract_problem", "unwrap_state", "wrap_state"]

log = logging.getLogger(__name__)

Rows = tuple[ColumnBlock, int, int]
"""Rows ``start:end`` of a consumer batch's Arrow messages (one message, one communicator)."""

Part = list[Event] | Rows
"""One communicator's events of one message: objects (JSON), or rows of Arrow columns."""


class _Group:
    """One communicator's events in its lane's open event-time slice, message by message."""

    __slots__ = ("n", "parts", "top")

    def __init__(self) -> None:
        self.parts: list[tuple[Record, Part]] = []
        self.n = 0
        self.top = -1
        """Newest ``ts_us`` of its events."""

    def add(self, rec: Record, part: Part, n: int, top: int) -> None:
        self.parts.append((rec, part))
        self.n += n
        if top > self.top:
            self.top = top


_EVICT_PER_TICK = 1000
"""Communicators evicted per tick at most (each is checkpointed first: a tick's work
stays bounded however many went idle at once)."""

_DUPLICATE = EventDecodeError("an exact repeat of a message already accepted")
"""What :meth:`CommRouter._decode` gives for a message dropped as a duplicate."""

Slice = dict[str, _Group]
"""An open event-time slice of one lane, by communicator."""

_GROUP_MIN = 2
"""Communicators fed as columns in one slice from which they are judged together (one
alone is cut on its own, as ``observe_columns`` does)."""


def _observe(det: DetectorLike, comm: str, parts: Sequence[tuple[Record, Part]]) -> list[Verdict]:
    """One communicator's parts judged at once: Arrow rows as columns
    (``observe_columns``, the same verdicts as ``observe``, no object per event); a slice
    that mixes JSON and Arrow messages goes as objects, in message order."""
    spans = [p for _, p in parts if isinstance(p, tuple)]
    if not spans:
        return det.observe([e for _, p in parts for e in p])  # type: ignore[union-attr]
    if len(spans) < len(parts):
        return det.observe([e for _, p in parts for e in _events(p)])
    return det.observe_columns(_columns(comm, spans))  # type: ignore[arg-type]


def _columns(comm: str, spans: Sequence[Rows]) -> EventColumns:
    """One communicator's Arrow rows of a slice (message order) as one set of columns."""
    per_block: list[tuple[ColumnBlock, list[tuple[int, int]]]] = []
    for block, s, e in spans:
        if per_block and per_block[-1][0] is block:
            per_block[-1][1].append((s, e))
        else:
            per_block.append((block, [(s, e)]))
    cols = [block.columns(comm, ranges) for block, ranges in per_block]
    return cols[0] if len(cols) == 1 else EventColumns.concat(cols)


def _observe_grouped(
    items: Sequence[tuple[str, CommDetector, Sequence[tuple[Record, Part]]]],
) -> dict[str, list[Verdict] | Exception]:
    """A slice's communicators fed as Arrow columns, judged together
    (:func:`streams.core.group.observe_many`'s steps: one cut and one fold for all, then
    each communicator's own update, in order): per communicator its verdicts, or the
    error its detector raised (the others are judged all the same). An error in the
    shared cut or fold names no communicator: then nothing was judged and the result is
    empty, so the caller judges them one by one and a failure is pinned to its messages."""
    try:
        cols = [_columns(comm, [p for _, p in parts]) for comm, _, parts in items]  # type: ignore[misc]
        cuts = cut_many(cols)
        fold_many([det for _, det, _ in items], cuts)
    except Exception:
        log.warning("grouped cut of %d communicators failed; judging them one by one",
                    len(items), exc_info=True)  # fmt: skip
        return {}
    out: dict[str, list[Verdict] | Exception] = {}
    for (comm, det, _), cut in zip(items, cuts, strict=True):
        try:
            out[comm] = det.observe_cut(cut)
        except Exception as err:  # this communicator's detector: its messages are retried
            out[comm] = err
    return out


def _events(part: Part) -> list[Event]:
    if isinstance(part, tuple):
        block, s, e = part
        return table_events(block.batch.slice(s, e - s))
    return part


@dataclass(frozen=True)
class EdgeLimits:
    """What the worker accepts from ``c4.events`` beyond the contract's types.

    Each bound stops one way a single message could take the worker down or steer it:
    ``nranks = 2^31`` grew the worker to 21 GB; a ``ts_us`` a year ahead moved its
    partition's clock and hid a fault; ``nranks`` doubled mid-stream hid a straggler.
    """

    max_nranks: int = MAX_NRANKS
    """Largest communicator accepted (the core sizes its arrays by ``nranks``)."""
    max_future_skew_us: int = MAX_FUTURE_SKEW_US
    """How far ahead of its partition's clock (and of the wall clock) an event may be."""
    max_past_skew_us: int = MAX_PAST_SKEW_US
    """How far behind its partition's clock an event may be."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_depth: int = MAX_DEPTH
    contested_hold_s: float = 120.0
    """How long (the worker's wall clock: a replayed message's old ``ts_us`` does not
    shorten or lengthen it) a communicator's verdicts stay alert-only after two sources
    contradicted each other about one of its ranks. The verdicts are still sent, as
    alerts saying so; a hold delays isolation, it never hides the fault."""
    exec_free_us: int = 625_000
    """An op's ``exec_us`` at most this long is admitted unchecked: it cannot raise the
    hang threshold above its floor (``hang_floor_us / hang_period_mult``). A longer one
    must fit the physics: it cannot have lasted longer than since its rank's previous
    op in the communicator completed (ops of one communicator run one after another)."""
    dedup_messages: int = 131_072
    """Digests of the most recent accepted messages kept: an exact repeat of one of them
    is dropped (counted in ``duplicates``), never judged twice."""
    isolate_uncorroborated: bool = False
    """Whether a verdict of a communicator nobody corroborates may isolate (see
    :meth:`CommRouter.uncorroborated`); off: alert only, with the reason."""
    max_comms: int = 200_000
    """Communicators held; beyond, idle lanes are evicted (checkpointed first)."""
    max_lanes: int = 50_000
    """(partition, job) lanes held; beyond, idle lanes are evicted likewise."""
    evict_idle_s: float = 60.0
    """Only lanes without a message for this long (wall) are evicted."""


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


class CommRouter(StateRunner[str]):
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
        limits: EdgeLimits | None = None,
        epoch: Callable[[], float] = time.time,
        trust: EventTrust | None = None,
    ) -> None:
        super().__init__(
            lookup,
            checkpoint_every_events=checkpoint_every_events,
            checkpoint_every_s=checkpoint_every_s,
            clock=clock,
        )
        self.engine = engine
        self.advance_every_us = advance_every_us
        self.forget_lane_s = forget_lane_s
        self.allowed_lateness_us = allowed_lateness_us
        self.comms: dict[str, _Comm] = {}
        self.by_lane: dict[Lane, set[str]] = {}
        self.clock_us: dict[Lane, int] = {}
        """Event-time clock (newest ``ts_us`` seen) per lane."""
        self._advanced_us: dict[Lane, int] = {}
        self._slice_end: dict[Lane, int] = {}
        self.pending: dict[Lane, Slice] = {}
        """Per lane, the events of its open event-time slice."""
        self._active: set[Lane] = set()
        """Lanes that got messages since the last tick()."""
        self._open: set[Lane] = set()
        """Lanes that got messages since they were last closed by a tick (judged and
        advanced): a tick's work is these, never every lane of the worker."""
        self._last_active: OrderedDict[Lane, float] = OrderedDict()
        """Lane -> wall time of its last message, least recent first (a lane quiet for
        ``forget_lane_s`` is forgotten: a finished job's watermarks stop; beyond the
        caps, the least recently active idle lanes are evicted)."""
        self.late_events: dict[str, int] = {}
        """Per job: events dead-lettered as late beyond the allowed lateness."""
        self.jobs: set[str] = set()
        """Every job seen (its metrics are exported from 0)."""
        self.limits = limits or EdgeLimits()
        self.trust = trust
        """Checks signed events when ``[worker] require_signed_events`` (None: off)."""
        self.epoch = epoch
        self.sizes: dict[str, int] = {}
        """Communicator -> nranks, fixed by the first event accepted (or its checkpoint)."""
        self._accepted_at: dict[Lane, float] = {}
        """Lane -> wall time (``clock``) of the last message accepted."""
        self._progress: ProgressState = {}
        self._ops: OpState = {}
        self.contested: dict[str, tuple[float, str]] = {}
        """Communicator -> (wall time, ``clock``, until which its verdicts are
        alert-only, why)."""
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        """Digests of recently accepted messages (exact repeats are dropped)."""
        self._corroborated: set[tuple[str, str]] = set()
        """(job, host) pairs known to be in two communicators of the job (cached: this
        only becomes true)."""
        self.signers: dict[str, set[str]] = {}
        """Communicator -> hosts whose signed messages reported for it (at most 2 kept)."""
        self.summaries = ExpandStats()
        """Summary records read (windows at the source) and how their totals were carried."""

    def partition_clock(self, p: int) -> int:
        """Newest clock of any job in partition ``p`` (-1: none)."""
        return max((t for (q, _), t in self.clock_us.items() if q == p), default=-1)

    # ---------------------------------------------------------------- detectors
    def _comm(self, comm: str, partition: int, job: str) -> _Comm:
        c = self.comms.get(comm)
        if c is not None:
            return c
        det = self._restore(
            comm.encode(),
            self._what(comm),
            lambda data: self._load(comm, data),
            lambda: self.engine.new_detector(comm),
        )
        c = self.comms[comm] = _Comm(det, partition, job)
        self.by_lane.setdefault((partition, job), set()).add(comm)
        self.jobs.add(job)
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
        self._close_lanes(self._lanes_of(partitions), out)

    def _lanes_of(self, partitions: set[int] | None) -> set[Lane]:
        return {lane for lane in self.clock_us if partitions is None or lane[0] in partitions}

    def _drop(self, partitions: set[int] | None, keys: list[str]) -> None:
        for comm in keys:
            self.comms.pop(comm)
            for per_comm in (self.sizes, self._progress, self._ops, self.contested, self.signers):
                per_comm.pop(comm, None)
        lanes = {
            lane
            for lane in set(self.clock_us) | set(self.by_lane)
            if partitions is None or lane[0] in partitions
        }
        for lane in lanes:
            self._forget_lane(lane)
            self.by_lane.pop(lane, None)
            self.pending.pop(lane, None)
            self._active.discard(lane)
            self._accepted_at.pop(lane, None)

    def _forget_lane(self, lane: Lane) -> None:
        """Forget a lane's clock (its communicators stay: a new message starts it again)."""
        self.clock_us.pop(lane, None)
        self._advanced_us.pop(lane, None)
        self._slice_end.pop(lane, None)
        self._last_active.pop(lane, None)
        self._open.discard(lane)

    # ---------------------------------------------------------------- batches
    def process(self, records: Sequence[Record], settle: Collection[int] = ()) -> Output:
        """One ``take`` batch of ``c4.events`` messages.

        ``settle``: partitions without consumer lag (live traffic): their open slices are
        judged now, and advanced when due, rather than when the next slice begins, which
        costs up to a second of latency. Partitions with lag (catching up) are judged
        exactly slice by slice, as DetectionPipeline does (per job)."""
        t0 = time.thread_time()
        out = Output()
        st = self.stats
        st.batches += 1
        st.messages += len(records)
        # As in DetectionPipeline, a lane's slice is judged (observe, then advance every
        # comm of the lane) when an event of its next slice arrives, whatever the batches:
        # a catch-up batch spanning minutes of event time is judged slice by slice, and a
        # slice spread over many small batches is judged at once, like offline.
        items, block = self._decode(records)
        if block is not None:
            facts = BlockFacts(block)
            # communicators also in this batch's JSON messages are corroborated row by row
            objects = {ev.comm for x in items if isinstance(x, list) for ev in x}
            checks = Corroboration(block, self._progress, self._ops, objects)
            accepted = np.zeros(len(block), bool)
        for rec, item, digest in zip(records, items, self._digest_of(records), strict=True):
            if digest in self._digests or item is _DUPLICATE:  # an exact repeat: drop it
                st.duplicates += 1
                continue
            if isinstance(item, EventDecodeError):
                out.deadletters.append(dead_letter(rec, f"undecodable message: {item}"))
                continue
            if isinstance(item, str):
                out.deadletters.append(dead_letter(rec, item))
                continue
            if isinstance(item, int):
                ok = self._accept_rows(rec, block, item, facts, checks, out)  # type: ignore[arg-type]
                accepted[item] = ok
            elif item or not has_summaries(rec.value):
                ok = self._accept(rec, item, out)  # type: ignore[arg-type]
            else:  # summaries alone: nothing to judge, but remembered for exact repeats
                ok = True
            if ok:
                self._remember(digest, rec)
        if block is not None:
            checks.commit(accepted)
        for lane in [lane for lane in self.clock_us if lane[0] in settle]:
            groups = self.pending.pop(lane, None)
            if groups:
                self._judge(lane, groups, out)
            if self.clock_us[lane] - self._advanced_us.get(lane, 0) >= self.advance_every_us:
                self._advance_lane(lane, out)
        self._due(out, self.wall())
        self._count(out)
        st.process_s += time.thread_time() - t0
        return out

    def _digest_of(self, records: Sequence[Record]) -> list[bytes]:
        """Per message, the digest an exact repeat shares (headers included: a signed
        message's sequence number makes each one distinct)."""
        out = []
        for rec in records:
            h = hashlib.blake2b(rec.value, digest_size=16)
            h.update(rec.fresh or b"")
            out.append(h.digest())
        return out

    def _remember(self, digest: bytes, rec: Record) -> None:
        self._digests[digest] = None
        if len(self._digests) > self.limits.dedup_messages:
            self._digests.popitem(last=False)

    def _signed_for(self, rec: Record, comm: str) -> None:
        """Note who signed a message accepted for ``comm`` (two signers corroborate)."""
        if rec.signer is None or self.trust is None:
            return
        seen = self.signers.setdefault(comm, set())
        if len(seen) < 2:
            seen.add(rec.signer.decode("utf-8", "replace"))

    def _decode(
        self, records: Sequence[Record]
    ) -> tuple[list[list[Event] | EventDecodeError | int | str], ColumnBlock | None]:
        """The batch's messages decoded: per record its events (JSON), why it cannot be
        read, or (Arrow) the index of its rows in the returned block of numpy columns —
        the batch's Arrow messages validated and converted together. Oversize messages
        are refused before any decoding; with signed events (docs/security.md) a message
        whose signature fails is refused before decoding, and one whose events name
        another host than its signer after (a ``str``: the dead letter's reason)."""
        lim = self.limits
        sized = [len(rec.value) <= lim.max_message_bytes for rec in records]
        # an exact repeat of an accepted message is dropped before its signature's
        # freshness is checked (a producer's retry is not a replay to dead-letter)
        dup = [d in self._digests for d in self._digest_of(records)]
        sized = [ok and not d for ok, d in zip(sized, dup, strict=True)]
        unsigned = [
            signature_refusal(self.trust, rec) if ok else None
            for rec, ok in zip(records, sized, strict=True)
        ]
        summed = [
            ok and not bad and has_summaries(rec.value)
            for rec, ok, bad in zip(records, sized, unsigned, strict=True)
        ]
        decoded, block = decode_block(
            [
                (rec.value, rec.content_type) if ok and not bad and not s else (b"", None)
                for rec, ok, bad, s in zip(records, sized, unsigned, summed, strict=True)
            ]
        )
        items: list[list[Event] | EventDecodeError | int | str] = list(decoded)
        for i, (rec, ok, bad) in enumerate(zip(records, sized, unsigned, strict=True)):
            if summed[i]:  # windows at the source: judged as the events they expand to
                items[i] = summary_events(rec, self.summaries)
            if dup[i]:
                items[i] = _DUPLICATE
            elif not ok:
                items[i] = EventDecodeError(
                    f"{len(rec.value)} bytes is over the limit of {lim.max_message_bytes}"
                )
            elif bad:
                items[i] = bad
            elif self.trust is not None and not isinstance(items[i], EventDecodeError):
                item = items[i]
                hosts = (
                    (ev.host for ev in item) if isinstance(item, list) else block_hosts(block, item)  # type: ignore[arg-type]
                )
                items[i] = signature_refusal(self.trust, rec, hosts) or item
        return items, block

    def _accept(self, rec: Record, events: list[Event], out: Output) -> bool:
        """A message as event objects: dead-lettered with the reason if the contract or
        the edge limits refuse it (False), else corroborated and put into its lanes'
        slices (True)."""
        problem = contract_problem(events) or self._admission_problem(rec.partition, events)
        if problem is not None:
            out.deadletters.append(dead_letter(rec, f"event breaks the contract: {problem}"))
            return False
        self.stats.events += len(events)
        now = self.wall()
        for ev in events:
            self._accepted_at[(rec.partition, ev.job)] = now
            self.sizes.setdefault(ev.comm, ev.nranks)
            if isinstance(ev, ProgressEvent):
                self._check_counters(
                    ev.comm, ev.rank, ev.started, ev.completed, ev.ts_us, ev.inflight_us
                )
            else:
                self._check_op(ev.comm, ev.rank, ev.op, ev.seq, ev.exec_us, ev.ts_us)
        first = events[0].comm
        if all(ev.comm == first for ev in events):  # the usual case: one comm per message
            self._signed_for(rec, first)
            self._take(rec, first, events[0].job, events, out)
        else:
            per_comm: dict[str, list[Event]] = {}
            for ev in events:
                per_comm.setdefault(ev.comm, []).append(ev)
            for comm, evs in per_comm.items():
                self._signed_for(rec, comm)
                self._take(rec, comm, evs[0].job, evs, out)
        return True

    def _accept_rows(
        self,
        rec: Record,
        block: ColumnBlock,
        k: int,
        facts: BlockFacts,
        checks: Corroboration,
        out: Output,
    ) -> bool:
        """An Arrow message as columns: the same outcome as :meth:`_accept` of its events,
        without an object per event. Its admission is decided from per-message minima and
        maxima (the rules compare every row with one bound); only a refused message is
        turned into objects, so that its dead letter names the row as the object path
        does. A message of several communicators or jobs goes through the object path.
        Whether it was accepted (its rows then count for corroboration)."""
        s, e = int(block.starts[k]), int(block.starts[k + 1])
        if not facts.plain[k]:
            return self._accept(rec, table_events(block.batch.slice(s, e - s)), out)
        comm, job, p = facts.comm[k], facts.job[k], rec.partition
        if not self._admissible(p, comm, job, facts, k):
            events = table_events(block.batch.slice(s, e - s))
            problem = contract_problem(events) or self._admission_problem(p, events)
            if problem is None:  # a bound stricter than the rules: they decide
                return self._accept(rec, events, out)
            out.deadletters.append(dead_letter(rec, f"event breaks the contract: {problem}"))
            return False
        self.stats.events += e - s
        self._accepted_at[(p, job)] = self.wall()
        self.sizes.setdefault(comm, facts.nr_first[k])
        if checks.any_exact[k]:
            self._check_rows(comm, block, np.flatnonzero(checks.exact[s:e]) + s)
        self._signed_for(rec, comm)
        self._take(rec, comm, job, (block, s, e), out, e - s, facts.ts_max[k])
        return True

    def _check_rows(self, comm: str, block: ColumnBlock, rows: np.ndarray) -> None:
        """The corroboration checks of Arrow rows ``rows``, one by one, in order."""
        codes, names = op_codes(block)
        col = block.column
        for i, is_op, rank, ts in zip(rows.tolist(), block.is_op[rows].tolist(),
                                      col("rank")[rows].tolist(), col("ts_us")[rows].tolist(),
                                      strict=True):  # fmt: skip
            if is_op:
                op, seq, ex = names[codes[i]], int(col("seq")[i]), float(col("exec_us")[i])
                self._check_op(comm, rank, op, seq, ex, ts)
            else:
                # a null in-flight time is read as 0.0, which no rule tells apart
                self._check_counters(
                    comm, rank, int(col("started")[i]), int(col("completed")[i]), ts,
                    float(col("inflight_us")[i]),
                )  # fmt: skip

    def _admissible(self, p: int, comm: str, job: str, facts: BlockFacts, k: int) -> bool:
        """Whether :meth:`_admission_problem` (and ``contract_problem``) would pass message
        ``k`` of one communicator and job: each rule compares every row with one bound, so
        its rows' minimum and maximum decide."""
        lim = self.limits
        if not facts.contract_ok[k] or facts.nr_max[k] > lim.max_nranks:
            return False
        if facts.ex_max[k] > lim.exec_free_us:  # the physics of long ops: row by row
            return False
        size = self.sizes.get(comm) or self._restored_size(comm, p, job) or facts.nr_first[k]
        if facts.nr_min[k] != size or facts.nr_max[k] != size:
            return False
        top = facts.ts_max[k]
        if top > int(self.epoch() * 1e6) + lim.max_future_skew_us:
            return False
        lane = (p, job)
        clock = self.clock_us.get(lane)
        if clock is None:
            return True
        quiet = self.wall() - self._accepted_at.get(lane, float("-inf"))
        if top > clock + lim.max_future_skew_us and quiet < lim.max_future_skew_us / 1e6:
            return False
        return facts.ts_min[k] >= clock - lim.max_past_skew_us

    def _take(
        self,
        rec: Record,
        comm: str,
        job: str,
        part: Part,
        out: Output,
        n: int = 0,
        top: int = -1,
    ) -> None:
        """Put one communicator's events of one message (objects, or rows with their
        count ``n`` and newest ``top``) into its lane's open slice."""
        if not isinstance(part, tuple):
            n, top = len(part), max(ev.ts_us for ev in part)
        p = rec.partition
        c = self.comms.get(comm)
        if c is not None and c.judged_us - top > self.allowed_lateness_us:
            late = c.judged_us - top
            self.late_events[c.job] = self.late_events.get(c.job, 0) + n
            out.late_events.append((c.job, n))
            out.deadletters.append(
                dead_letter(
                    rec,
                    f"late by {late / 1e6:.0f} s: communicator {comm} of job {c.job} was "
                    f"already judged up to {c.judged_us} (event time), these "
                    f"{n} events end at {top}; allowed lateness "
                    f"{self.allowed_lateness_us / 1e6:g} s",
                )
            )
            return
        if c is None:
            c = self._comm(comm, p, job)  # restored (or created) on arrival
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
        groups = self.pending.setdefault(lane, {})
        g = groups.get(comm)
        if g is None:
            g = groups[comm] = _Group()
        g.add(rec, part, n, top)

    def _admission_problem(self, p: int, events: Sequence[Event]) -> str | None:
        """What makes an otherwise valid message unsafe to feed (None: feed it).

        A communicator's size never changes (NCCL gives a resized one a new id), so a
        different ``nranks`` is a forgery or a bug, not a resize. Event time may not run
        ahead of its lane's clock (partition and job: jobs keep their own time), nor of
        the wall clock, by more than the skew (it would move the clock and make every
        communicator of the job judge the future), nor lag far behind it; such events
        never move the clock. After the lane has been quiet for the skew (wall time), a
        jump ahead is taken as traffic resuming.
        """
        lim = self.limits
        wall = self.wall()
        horizon = int(self.epoch() * 1e6) + lim.max_future_skew_us
        sizes = self.sizes
        seen: dict[str, int] = {}
        for i, ev in enumerate(events):
            if ev.nranks > lim.max_nranks:
                return f"event {i}: nranks {ev.nranks} is over the limit of {lim.max_nranks}"
            size = sizes.get(ev.comm) or self._restored_size(ev.comm, p, ev.job)
            size = size or seen.setdefault(ev.comm, ev.nranks)
            if ev.nranks != size:
                return (
                    f"event {i}: communicator {ev.comm[:64]} has {size} ranks, "
                    f"this event says {ev.nranks} (a communicator never changes size)"
                )
            ts = ev.ts_us
            if ts > horizon:
                return f"event {i}: ts_us {ts} is further ahead of the wall clock than the skew"
            if isinstance(ev, OpEvent) and ev.exec_us > lim.exec_free_us:
                why = self._exec_problem(ev, events[:i])
                if why is not None:
                    return f"event {i}: {why}"
            lane = (p, ev.job)
            clock = self.clock_us.get(lane)
            if clock is None:
                continue
            quiet = wall - self._accepted_at.get(lane, float("-inf"))
            if ts > clock + lim.max_future_skew_us and quiet < lim.max_future_skew_us / 1e6:
                return (
                    f"event {i}: ts_us {ts} is {(ts - clock) / 1e6:.0f}s ahead of its "
                    f"job's clock in this partition (allowed: {lim.max_future_skew_us / 1e6:.0f}s)"
                )
            if ts < clock - lim.max_past_skew_us:
                return (
                    f"event {i}: ts_us {ts} is {(clock - ts) / 1e6:.0f}s behind its "
                    f"job's clock in this partition (allowed: {lim.max_past_skew_us / 1e6:.0f}s)"
                )
        return None

    def _exec_problem(self, ev: OpEvent, before: Sequence[Event]) -> str | None:
        """Why op ``ev`` cannot have lasted ``exec_us`` (None: it can, or nothing is
        known to tell): the ops of one communicator run one after another on a rank, so
        an op cannot have run longer than since that rank's previous op completed
        (its newest one judged, or one earlier in this message), by the rank's own clock.
        Such values would move what the detectors learn as normal (ten ops claiming
        ``exec_us = 1e15`` moved a learned hang threshold from 2.5 s to 640 s)."""
        prev = -1
        c = self.comms.get(ev.comm)
        ranks = getattr(c.detector, "ranks", None) if c is not None else None
        if ranks is not None and ev.rank < ranks.n:
            prev = int(ranks.last_op_ts[ev.rank])
        for e in before:
            same = isinstance(e, OpEvent) and e.comm == ev.comm and e.rank == ev.rank
            if same and e.ts_us < ev.ts_us:
                prev = max(prev, e.ts_us)
        if prev < 0 or prev >= ev.ts_us + INFLIGHT_SLACK_US:
            return None
        gap = ev.ts_us - prev
        if ev.exec_us <= gap + INFLIGHT_SLACK_US:
            return None
        return (
            f"exec_us {ev.exec_us:g} is longer than the {gap / 1e6:.3f} s since rank "
            f"{ev.rank}'s previous op in communicator {ev.comm[:64]} completed (an op "
            "cannot outlast the time since its predecessor)"
        )

    def _check_counters(
        self, comm: str, rank: int, started: int, completed: int, ts: int, inflight: float | None
    ) -> None:
        """Corroboration, within the detector's physics: a rank's heartbeat counters only
        grow, so a heartbeat that goes back means two sources report for one rank (a
        forger and the real exporter). A forged hang must contradict someone: the
        accused's own heartbeats (it is alive and advancing) or its peers' (they are not
        as far ahead as claimed). Such a communicator's verdicts stay alert-only.

        Two more rules of the same physics (one rank, one clock): counters grow with
        ``ts_us`` too (a heartbeat stamped later may not say less), and a rank cannot have
        sat in collective N for longer than since it last reported not having started N
        (a forged "waiting 30 s" copy of a peer's heartbeat, one collective ahead, kept
        its counters plausible and got a healthy host cordoned)."""
        ranks = self._progress.get(comm)
        if ranks is None:
            ranks = self._progress[comm] = {}
        last = ranks.get(rank)
        if last is None:
            ranks[rank] = (started, completed, ts)
            return
        s0, c0, t0 = last
        ranks[rank] = (max(started, s0), max(completed, c0), max(ts, t0))
        if started < s0 or completed < c0:
            why = (
                f"rank {rank}'s heartbeat went back from started {s0}/completed "
                f"{c0} to {started}/{completed}: two sources report for it"
            )
        elif ts < t0 and (started > s0 or completed > c0):
            why = (
                f"rank {rank}'s heartbeat at {ts} says started {started}, one "
                f"stamped later ({t0}) said {s0}: two sources report for it"
            )
        elif started > s0 and inflight is not None and inflight > ts - t0 + INFLIGHT_SLACK_US:
            why = (
                f"rank {rank} says it has been in collective {started} for "
                f"{inflight / 1e6:.1f} s, but {(ts - t0) / 1e6:.1f} s before it "
                f"had started only {s0}: two sources report for it"
            )
        else:
            return
        self._contest(comm, ts, why)

    def _check_op(self, comm: str, rank: int, op: str, seq: int, exec_us: float, ts: int) -> None:
        """The same for completed ops: per rank and op, ``seq`` only grows, and one
        collective has one duration. A re-sent message repeats both exactly; a second
        source (a forged straggler pattern) contradicts the real one in either."""
        ops = self._ops.get(comm)
        if ops is None:
            ops = self._ops[comm] = {}
        key = (rank, op)
        last = ops.get(key)
        if last is None or seq > last[0]:
            ops[key] = (seq, exec_us)
            return
        if seq < last[0]:
            self._contest(comm, ts,
                          f"rank {rank}'s {op} went back from seq {last[0]} to {seq}: "
                          "two sources report for it")  # fmt: skip
        elif exec_us != last[1]:
            why = (
                f"rank {rank}'s {op} seq {seq} reported twice with different "
                f"durations ({last[1]} and {exec_us} us): two sources report for it"
            )
            self._contest(comm, ts, why)

    def _contest(self, comm: str, ts_us: int, why: str) -> None:
        """Hold ``comm``'s verdicts alert-only for ``contested_hold_s`` of the worker's
        own clock from now (not from the event's ``ts_us``, which a replay makes old)."""
        if comm not in self.contested:
            log.warning("communicator %s contested: %s", comm, why)
        self.contested[comm] = (self.wall() + self.limits.contested_hold_s, why)

    def _uncontested(self, comm: str, verdicts: list[Verdict]) -> list[Verdict]:
        """``verdicts`` of ``comm``, made alert-only while its evidence is contested, or
        when nobody corroborates the communicator (:meth:`uncorroborated`)."""
        if not verdicts:
            return verdicts
        hold = self.contested.get(comm)
        if hold is not None and self.wall() > hold[0]:
            hold = None  # expired: a hold delays a decision, never hides it for good
        out = []
        for v in verdicts:
            why = None
            if hold is not None:
                why = f"evidence contested ({hold[1]}); alert only."
            elif not v.benign and not self.limits.isolate_uncorroborated:
                lonely = self.uncorroborated(comm, v.job, v.host)
                if lonely is not None:
                    self.stats.uncorroborated += 1
                    why = f"not corroborated ({lonely}); alert only."
            if why is None:
                out.append(v)
                continue
            if v.benign:  # a note stays a note; it says why too
                out.append(msgspec.structs.replace(v, reason=f"{why} {v.reason}"))
                continue
            out.append(msgspec.structs.replace(v, benign=True, reason=f"{why} {v.reason}"))
        return out

    def uncorroborated(self, comm: str, job: str, host: str) -> str | None:
        """Why nobody corroborates ``comm`` as a source of evidence against ``host``, or
        None. Corroborated: two hosts signed messages for it (signing on: each host
        signs only for itself), or ``host`` is a member of another communicator of the
        same job (its membership matches a job the worker has seen). A communicator
        invented by a forger (two messages about four ranks nobody else reports for, in
        a job of its own) is neither."""
        if len(self.signers.get(comm, ())) >= 2 or (job, host) in self._corroborated:
            return None
        for (_, j), comms in self.by_lane.items():
            if j != job:
                continue
            for other in comms:
                c = self.comms.get(other)
                ranks = getattr(c.detector, "ranks", None) if c is not None else None
                if other != comm and ranks is not None and host in ranks._host_ix:
                    self._corroborated.add((job, host))
                    return None
        signed = "" if self.trust is None else " and no second host signed for it"
        return (
            f"communicator {comm[:64]} is the only one of job {job[:64]} in which this "
            f"worker saw {host}{signed}"
        )

    def _restored_size(self, comm: str, p: int, job: str) -> int | None:
        """The size a communicator's checkpoint fixed (after a restart, before its
        detector is restored), or None. Only a checkpoint whose detector loads counts:
        a forged envelope around a refused state must not fix a size."""
        if comm in self.comms or self.lookup(comm.encode()) is None:
            return None
        self._comm(comm, p, job)  # restores it (or starts afresh if unreadable)
        return self.sizes.get(comm)

    def _judge(self, lane: Lane, groups: Slice, out: Output) -> None:
        now = self.wall()
        clock = self.clock_us[lane]
        grouped = self._judge_columns(groups)
        for comm, g in groups.items():
            c = self.comms[comm]
            if g.top > c.judged_us:
                c.judged_us = g.top
            try:
                got = grouped.get(comm)
                if got is None:  # objects (JSON, mixed) or not grouped: one communicator
                    got = _observe(c.detector, comm, g.parts)
                elif isinstance(got, Exception):
                    raise got
                out.concluded(self._uncontested(comm, got), clock)
            except Exception as err:
                if len(g.parts) == 1:
                    self._detector_failed(comm, err, g.parts[0][0], out)
                    continue
                # Retry message by message so only the offending one is dead-lettered.
                for part in g.parts:
                    try:
                        verdicts = _observe(c.detector, comm, [part])
                        out.concluded(self._uncontested(comm, verdicts), clock)
                    except Exception as err1:
                        self._detector_failed(comm, err1, part[0], out)
            self.schedule.touch(comm, g.n, now)

    def _judge_columns(self, groups: Slice) -> dict[str, list[Verdict] | Exception]:
        """The slice's communicators fed only as Arrow rows, judged together when there
        are several (:func:`_observe_grouped`); the verdicts are those of judging them one
        by one and are sent in the slice's order all the same."""
        items = [
            (comm, det, g.parts)
            for comm, g in groups.items()
            if isinstance(det := self.comms[comm].detector, CommDetector)
            and all(isinstance(p, tuple) for _, p in g.parts)
        ]
        return _observe_grouped(items) if len(items) >= _GROUP_MIN else {}

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
                out.concluded(self._uncontested(comm, found), now_us)
                self.schedule.touch(comm, 0, wall)

    def tick(self) -> Output:
        """Wall-clock timer: close the open slice of every lane that got no message since
        the previous tick (traffic stopped: judge it and advance, so a hang is still
        found), take time-due checkpoints."""
        t0 = time.thread_time()
        wall = self.wall()
        last = self._last_active
        for lane in self._active:
            last[lane] = wall
            last.move_to_end(lane)
        self._open |= self._active
        quiet = self._open - self._active  # the work: lanes that went quiet, not all
        self._active.clear()
        self._open -= quiet
        out = Output()
        self._close_lanes(quiet, out)
        while last:  # least recent first: stops at the first lane still recent
            lane, at = next(iter(last.items()))
            if wall - at <= self.forget_lane_s:
                break
            # Its communicators stay (with what they were judged up to); a new message
            # of the job starts the lane again.
            self._forget_lane(lane)
        self._evict(out, wall)
        self._due(out, wall)
        self._count(out)
        self.stats.process_s += time.thread_time() - t0
        return out

    def _evict(self, out: Output, wall: float) -> None:
        """Over ``max_comms`` communicators or ``max_lanes`` (partition, job) lanes:
        checkpoint and forget the least recently active idle lanes (quiet for
        ``evict_idle_s``), communicators and all; a communicator that speaks again is
        restored from its checkpoint. Counted (``evicted``), logged."""
        lim = self.limits
        if len(self.comms) <= lim.max_comms and len(self.by_lane) <= lim.max_lanes:
            return
        gone: list[str] = []
        lanes = 0
        for lane, at in list(self._last_active.items()):
            if len(self.comms) <= lim.max_comms and len(self.by_lane) <= lim.max_lanes:
                break  # (evicted ones are gone from both already)
            if wall - at < lim.evict_idle_s:
                break  # the rest are more recent: active state is never evicted
            if len(gone) >= _EVICT_PER_TICK:
                break  # each is checkpointed first: the rest wait for the next tick
            if lane in self._open or lane in self.pending:
                continue
            keys = sorted(self.by_lane.get(lane, ()))
            out.checkpoints.extend(self._checkpoint(self.schedule.take_all(keys)))
            for comm in keys:
                self.schedule.forget(comm)
            self._drop_lane(lane, keys)
            gone += keys
            lanes += 1
        if gone:
            self.stats.evicted += len(gone)
            log.info("evicted %d idle communicators of %d lanes (caps: %d communicators, "
                     "%d lanes); %d held", len(gone), lanes, lim.max_comms, lim.max_lanes,
                     len(self.comms))  # fmt: skip
        elif len(self.comms) > lim.max_comms:
            log.warning("%d communicators, over the cap of %d, none idle for %.0f s",
                        len(self.comms), lim.max_comms, lim.evict_idle_s)  # fmt: skip

    def _drop_lane(self, lane: Lane, keys: list[str]) -> None:
        for comm in keys:
            self.comms.pop(comm, None)
            for per_comm in (self.sizes, self._progress, self._ops, self.contested, self.signers):
                per_comm.pop(comm, None)
        self._forget_lane(lane)
        self.by_lane.pop(lane, None)
        self.pending.pop(lane, None)
        self._accepted_at.pop(lane, None)

    def close_slices(self, partitions: set[int] | None = None) -> Output:
        """Judge the open slices of ``partitions`` (all by default) and advance them."""
        out = Output()
        self._close_lanes(self._lanes_of(partitions), out)
        return out

    def _close_lanes(self, lanes: set[Lane], out: Output) -> None:
        for lane in sorted(lanes):
            groups = self.pending.pop(lane, None)
            if groups:
                self._judge(lane, groups, out)
            if lane in self.clock_us and self.clock_us[lane] > self._advanced_us.get(lane, 0):
                self._advance_lane(lane, out)
