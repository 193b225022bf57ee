"""Agent ``detect``'s runner (``c4.events``), broker-free.

:class:`CommRouter` takes a consumer batch of messages and, in this order, each rule
written once, for columns:

1. the edge (:func:`streams.app.column_intake.decode_records`): oversize, unsigned and
   exactly repeated messages are refused; every other message (a JSON array, an Arrow
   IPC batch marked by its ``content-type`` header, summaries expanded at the source)
   becomes rows of one block of columns; what cannot be read is dead-lettered;
2. admission (:mod:`streams.app.admission`): the contract's rules and the edge limits,
   over the batch's rows at once, then per message where one could refuse it at its
   turn; a refused message is dead-lettered with the row and the rule;
3. corroboration (:class:`~streams.app.column_intake.Corroboration`, membership): a
   counter going back, a seq repeated with another duration, a communicator nobody
   corroborates — its verdicts alert-only (:meth:`CommRouter._uncontested`);
4. the lanes (:mod:`streams.app.comm_slices`): each communicator's rows go into the open
   event-time slice of its *lane* (partition, job); a slice is judged when the lane's
   clock (max ``ts_us`` seen) passes its end — its communicators together — and every
   communicator of the lane is advanced (a collective that stops completing is noticed
   while heartbeats arrive; a job minutes behind another is judged on its own time);
   messages too late to be judged are dead-lettered "late by N s", counted per job;
5. state (:mod:`streams.app.comm_state`): detectors restored and checkpointed; what is
   held stays under its caps (:mod:`streams.app.lane_bounds`). The Faust agent
   (:mod:`streams.app.agents`) moves bytes between Kafka and this class: all of it is
   tested without a broker.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

import numpy as np

from producers.columnar import ColumnBlock
from producers.events import EventDecodeError
from producers.summary import ExpandStats
from streams.app.admission import (
    BatchView,
    EdgeLimits,
    LaneView,
    admission_problem,
    contract_problem,
    unrefusable,
)
from streams.app.column_intake import DUPLICATE, NOTHING, Corroboration, Ledger, decode_records
from streams.app.comm_slices import Group, Lane, Part, Slice, observe_grouped, slice_columns
from streams.app.comm_state import Comm, Enveloped, unwrap_state, wrap_state
from streams.app.deadletter import Record, dead_letter
from streams.app.engine import DetectorLike, Engine
from streams.app.lane_bounds import LaneBounds
from streams.app.membership import Membership
from streams.app.runner import Checkpointable, Lookup, Output, StateRunner
from streams.app.snapshot_intake import SnapshotIntake
from streams.app.trust import EventTrust, FreshCheckpoints, alert_only_unless_trusted
from streams.core import CommDetector, DetectConfig
from streams.core.summary_evidence import SummaryEvidence
from streams.verdicts import Verdict

__all__ = ["CommRouter", "EdgeLimits", "Lane", "contract_problem", "unwrap_state", "wrap_state"]

log = logging.getLogger(__name__)


class CommRouter(LaneBounds, StateRunner[str]):
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
        self.comms: dict[str, Comm] = {}
        self.by_lane: dict[Lane, set[str]] = {}
        self.clock_us: dict[Lane, int] = {}
        """Event-time clock (newest ``ts_us`` seen) per lane."""
        self._lane_order: dict[Lane, int] = {}
        """Lane -> its place in ``clock_us`` (lanes are judged in that order)."""
        self._lanes_seen = 0
        self.moved: set[Lane] = set()
        """Lanes whose clock moved since the watermark sender last took them (a router
        without a sender, offline, holds at most every lane here)."""
        self._moved_now: set[Lane] = set()
        """Lanes whose clock moved in the batch being processed."""
        self.lanes_in: dict[int, int] = {}
        """Partition -> lanes of it with a clock."""
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
        """Every job held (its metrics are exported from 0); a job leaves with its last
        lane (evicted, or quiet for ``forget_lane_s``)."""
        self.limits = limits or EdgeLimits()
        self.trust = trust
        """Checks signed events when ``[worker] require_signed_events`` (None: off)."""
        self.fresh = FreshCheckpoints(trust)
        """Its sequence numbers, checkpointed per partition (a replay after a restart)."""
        self.epoch = epoch
        self.sizes: dict[str, int] = {}
        """Communicator -> nranks, fixed by the first event accepted (or its checkpoint)."""
        self._accepted_at: dict[Lane, float] = {}
        """Lane -> wall time (``clock``) of the last message accepted."""
        self._init_bounds()
        self.ledger = Ledger()
        """What corroboration remembers per communicator and rank."""
        self.contested: dict[str, tuple[float, str]] = {}
        """Communicator -> (wall time, ``clock``, until which its verdicts are
        alert-only, why)."""
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        """Digests of recently accepted messages (exact repeats are dropped)."""
        self.members = Membership()
        """The communicators of each job and who signed for them (corroboration)."""
        self.summaries = ExpandStats()
        """Summary records read (windows at the source) and how their totals were carried."""
        self.summary_evidence = SummaryEvidence()
        """Summaries' kernel times for the straggler rule (accepted messages only), taken
        with their message's slice (``held`` till then): windows follow event time."""
        self.held: OrderedDict[tuple[str, int, int], list] = OrderedDict()
        self.snapshots = SnapshotIntake(getattr(engine, "detect", None) or DetectConfig())

    def partition_clock(self, p: int) -> int:
        """Newest clock of any job in partition ``p`` (-1: none)."""
        return max((t for (q, _), t in self.clock_us.items() if q == p), default=-1)

    # ---------------------------------------------------------------- detectors
    def _comm(self, comm: str, partition: int, job: str) -> Comm:
        c = self.comms.get(comm)
        if c is not None:
            return c
        det = self._restore(
            comm.encode(),
            self._what(comm),
            lambda data: self._load(comm, data),
            lambda: self.engine.new_detector(comm),
        )
        c = self.comms[comm] = Comm(det, partition, job)
        self._held(comm, (partition, job))
        self.members.add(comm, job)
        return c

    def _load(self, comm: str, data: bytes) -> DetectorLike:
        size, state = unwrap_state(data)
        det = self.engine.load_detector(comm, state)
        self.sizes.setdefault(comm, size)  # only once the state itself loaded
        return det

    def _locate(self, key: str) -> tuple[int, bytes, Checkpointable] | None:
        c = self.comms.get(key)
        if c is None:
            return self.fresh.locate(key)
        return c.partition, key.encode(), Enveloped(c.detector, self.sizes.get(key, 1))

    def _what(self, key: str) -> str:
        return f"communicator {key}"

    def _keys(self, partitions: set[int] | None) -> list[str]:
        held = [k for k, c in self.comms.items() if partitions is None or c.partition in partitions]
        return held + self.fresh.keys(partitions)

    def _close(self, partitions: set[int] | None, out: Output) -> None:
        self._close_lanes(self._lanes_of(partitions), out)

    def _lanes_of(self, partitions: set[int] | None) -> set[Lane]:
        return {lane for lane in self.clock_us if partitions is None or lane[0] in partitions}

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
        for key, n in self.fresh.restore(records, self._restore_side).items():
            self.schedule.touch(key, n, self.wall())
        items, block, digests, summed = decode_records(
            records, self.limits, self._digests, self.trust, self.summaries
        )
        if block is not None:
            checks = Corroboration(block, self.ledger)
            accepted = np.zeros(len(block), bool)
            clear = self._unrefusable(records, items, block)
        self.members.preview(block)
        for i, (rec, item, digest) in enumerate(zip(records, items, digests, strict=True)):
            if digest in self._digests or item is DUPLICATE:  # an exact repeat: drop it
                st.duplicates += 1
                continue
            if isinstance(item, EventDecodeError):
                out.deadletters.append(dead_letter(rec, f"undecodable message: {item}"))
                continue
            if item is NOTHING:  # summaries alone: nothing to judge, but remembered
                self._remember(digest, rec)
                continue
            if isinstance(item, str):
                out.deadletters.append(dead_letter(rec, item))
                continue
            if rec.snapshot is not None:  # a Flight Recorder snapshot: judged whole
                ok = self.snapshots.take(rec, block, item, out, self._lonely, self._move_clock)  # type: ignore[arg-type]
            else:
                ok = accepted[item] = self._accept(rec, block, item, checks, out, clear[item])  # type: ignore[arg-type,index]
            if ok and i in summed:  # its summaries: kernel times for the straggler rule
                self.held[rec.tp + (rec.offset,)] = summed[i].vouched()
                while len(self.held) > self.limits.dedup_messages:  # bounded
                    self.held.popitem(last=False)
            if ok:
                self._remember(digest, rec)
        if block is not None:
            checks.commit(accepted)
        # Only lanes with events pending, or whose clock moved in this batch (a snapshot
        # moves it), can be due, not every lane; in the order the lanes were first seen,
        # as the judgements always came.
        moved, self._moved_now = self._moved_now, set()
        lanes = sorted((lane for lane in self.pending.keys() | moved if lane[0] in settle),
                       key=self._lane_order.__getitem__)  # fmt: skip
        due = [(lane, self.pending.pop(lane, None)) for lane in lanes]
        # the slices due, across lanes, cut and folded at once (a flood of new
        # communicators is one message per lane: cut one by one, each cost ~50 µs more)
        grouped = observe_grouped([x for _, g in due if g for x in self._items(g)])
        for lane, groups in due:
            if groups:
                self._judge(lane, groups, out, grouped)
            if self.clock_us[lane] - self._advanced_us.get(lane, 0) >= self.advance_every_us:
                self._advance_lane(lane, out)
        self._due(out, self.wall())
        self._count(out)
        st.process_s += time.thread_time() - t0
        return out

    def _remember(self, digest: bytes, rec: Record) -> None:
        self._digests[digest] = None
        if len(self._digests) > self.limits.dedup_messages:
            self._digests.popitem(last=False)

    def _unrefusable(self, records: Sequence[Record], items: list, block: ColumnBlock) -> list:
        """Per message of the block: no rule can refuse it at its turn (:func:`unrefusable`)."""
        if any(rec.snapshot is not None for rec in records):  # they move lane clocks too
            return [False] * len(block)
        parts = np.zeros(len(block), np.int64)
        for rec, x in zip(records, items, strict=True):
            if type(x) is int:
                parts[x] = rec.partition
        view = BatchView(self.sizes, self.comms, self.lookup, self.clock_us,
                         int(self.epoch() * 1e6) + self.limits.max_future_skew_us)  # fmt: skip
        return unrefusable(block, parts, self.limits, view)

    def _accept(self, rec: Record, block: ColumnBlock, k: int, checks: Corroboration,
                out: Output, clear: bool = False) -> bool:  # fmt: skip
        """Message ``k`` of the block: dead-lettered with the reason if the contract or
        the edge limits refuse it (False), else corroborated and put into its lanes'
        slices (True; its rows then count for corroboration). ``clear``: no rule can
        refuse it (:meth:`_unrefusable`), so none is run for it alone."""
        s, e, p = int(block.starts[k]), int(block.starts[k + 1]), rec.partition
        if not clear:
            problem = contract_problem(block, s, e) or admission_problem(
                block, s, e, self.limits, self._lane_view(p)
            )
            if problem is not None:
                out.deadletters.append(dead_letter(rec, f"event breaks the contract: {problem}"))
                return False
        self.stats.events += e - s
        now = self.wall()
        comm1, job1, top1 = block.per_message()
        for j in [job1[k]] if job1[k] >= 0 else np.unique(block.job_codes[s:e]).tolist():
            self._accepted_at[(p, block.job_names[j])] = now
        if checks.any_exact[k]:
            self.ledger.check(block, np.flatnonzero(checks.exact[s:e]) + s, self._contest)
        ts, nr = block.column("ts_us"), block.column("nranks")
        parts = [(comm1[k], [(s, e)], s)] if comm1[k] >= 0 else block.comm_parts(s, e)
        for c, spans, first in parts:
            comm = block.comm_names[c]
            self.sizes.setdefault(comm, int(nr[first]))
            if self.trust is not None:  # two signers corroborate
                self.members.signed(comm, rec.signer)
            n = sum(b - a for a, b in spans)
            top = top1[k] if comm1[k] >= 0 else max(int(ts[a:b].max()) for a, b in spans)
            job = block.job_names[block.job_codes[first]]
            self._take(rec, comm, job, (block, spans), out, n, top)
        return True

    def _lane_view(self, p: int) -> LaneView:
        """What the limits read of partition ``p``'s lanes and communicators."""
        wall = self.wall()

        def last_op_ts(comm: str, ranks: np.ndarray) -> np.ndarray:
            c = self.comms.get(comm)
            table = getattr(c.detector, "ranks", None) if c is not None else None
            out = np.full(len(ranks), -1, np.int64)
            if table is not None:
                known = ranks < table.n
                out[known] = table.last_op_ts[ranks[known]]
            return out

        return LaneView(
            size_of=lambda comm, job: self.sizes.get(comm) or self._restored_size(comm, p, job),
            clock_of=lambda job: self.clock_us.get((p, job)),
            quiet_of=lambda job: wall - self._accepted_at.get((p, job), float("-inf")),
            last_op_ts=last_op_ts,
            horizon_us=int(self.epoch() * 1e6) + self.limits.max_future_skew_us,
        )

    def _take(
        self, rec: Record, comm: str, job: str, part: Part, out: Output, n: int, top: int
    ) -> None:
        """Put one communicator's rows of one message (``n`` of them, the newest at
        ``top``) into its lane's open slice."""
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
        self._move_clock(lane, top)
        groups = self.pending.setdefault(lane, {})
        g = groups.get(comm)
        if g is None:
            g = groups[comm] = Group()
        g.add(rec, part, n, top)

    def _move_clock(self, lane: Lane, top: int) -> None:
        """The one place a lane's clock moves (never back); the watermark sender takes
        the lanes that moved."""
        if lane not in self.clock_us:
            self._lane_order[lane] = self._lanes_seen
            self._lanes_seen += 1
            self.lanes_in[lane[0]] = self.lanes_in.get(lane[0], 0) + 1
        if top > self.clock_us.get(lane, -1):
            self.clock_us[lane] = top
            self.moved.add(lane)
            self._moved_now.add(lane)

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
        out, n_lonely = alert_only_unless_trusted(verdicts, hold and hold[1], self._lonely)
        self.stats.uncorroborated += n_lonely
        return out

    def _lonely(self, v: Verdict) -> str | None:
        if self.limits.isolate_uncorroborated:
            return None
        return self.uncorroborated(v.comm, v.job, v.host)

    def uncorroborated(self, comm: str, job: str, host: str) -> str | None:
        """Why nobody corroborates ``comm`` as evidence against ``host``, or None
        (:mod:`streams.app.membership`: two signers, or a membership that fits the job)."""

        def table(key: str) -> object:
            c = self.comms.get(key)
            return getattr(c.detector, "ranks", None) if c is not None else None

        return self.members.uncorroborated(comm, job, host, table, self.trust is not None)

    def _restored_size(self, comm: str, p: int, job: str) -> int | None:
        """The size a communicator's checkpoint fixed (after a restart, before its
        detector is restored), or None. Only a checkpoint whose detector loads counts:
        a forged envelope around a refused state must not fix a size."""
        if comm in self.comms or self.lookup(comm.encode()) is None:
            return None
        self._comm(comm, p, job)  # restores it (or starts afresh if unreadable)
        return self.sizes.get(comm)

    def _items(self, groups: Slice) -> list[tuple[str, CommDetector, list]]:
        return [(comm, det, g.parts) for comm, g in groups.items()
                if isinstance(det := self.comms[comm].detector, CommDetector)]  # fmt: skip

    def _judge(self, lane: Lane, groups: Slice, out: Output, grouped: dict | None = None) -> None:
        """Judge a lane's slice; ``grouped``: its communicators' results already (of
        :func:`observe_grouped` over several lanes), else computed here."""
        now = self.wall()
        clock = self.clock_us[lane]
        if grouped is None:
            grouped = observe_grouped(self._items(groups))
        for comm, g in groups.items():
            c = self.comms[comm]
            if g.top > c.judged_us:
                c.judged_us = g.top
            try:
                got = grouped.get(comm)
                if got is None:  # not grouped: one communicator
                    got = c.detector.observe(slice_columns(comm, [p for _, p in g.parts]))
                elif isinstance(got, Exception):
                    raise got
                out.concluded(self._uncontested(comm, got), clock)
                for rec, _ in g.parts:  # its slice's summaries, folded after its samples
                    self.summary_evidence.add(self.held.pop(rec.tp + (rec.offset,), ()))
                self.summary_evidence.fold(comm, c.detector)
            except Exception as err:
                if len(g.parts) == 1:
                    self._detector_failed(comm, err, g.parts[0][0], out)
                    continue
                # Retry message by message so only the offending one is dead-lettered.
                for rec, part in g.parts:
                    try:
                        verdicts = c.detector.observe(slice_columns(comm, [part]))
                        out.concluded(self._uncontested(comm, verdicts), clock)
                    except Exception as err1:
                        self._detector_failed(comm, err1, rec, out)
            self.schedule.touch(comm, g.n, now)

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
        self._retire(out, wall)
        self._evict(out, wall)
        self._due(out, wall)
        self._count(out)
        self.stats.process_s += time.thread_time() - t0
        return out

    def close_slices(self, partitions: set[int] | None = None) -> Output:
        """Judge the open slices of ``partitions`` (all by default) and advance them."""
        out = Output()
        self._close_lanes(self._lanes_of(partitions), out)
        return out

    def _close_lanes(self, lanes: set[Lane], out: Output) -> None:
        due = [(lane, self.pending.pop(lane, None)) for lane in sorted(lanes)]
        # cut and folded together across lanes, as in process (a tick after a flood of
        # new ids closes thousands of one-message lanes: one by one was most of a tick)
        grouped = observe_grouped([x for _, g in due if g for x in self._items(g)])
        for lane, groups in due:
            if groups:
                self._judge(lane, groups, out, grouped)
            if lane in self.clock_us and self.clock_us[lane] > self._advanced_us.get(lane, 0):
                self._advance_lane(lane, out)
