"""DetectionPipeline: the broker-free path through the same core the Faust agents run.

Events are routed by communicator to :class:`CommDetector` objects in small event-time
slices (``tick_us``); after each slice every detector's clock is advanced (so silence
and hangs are found even where nothing arrives) and the verdicts go, in event-time
order, to the :class:`HostCorrelator`.

Event time is per job: each job has its own clock and its own slices (a *lane*), and
only that job's communicators and correlator state are advanced by it, so two jobs whose
clocks are minutes apart in one stream are each judged on their own time. Events behind
the time their communicator was already judged up to by more than the policy's
``allowed_lateness_us`` (one host's backlog after the rest of its job went on) cannot be
judged any more: they are counted in ``late_events``, as the worker dead-letters them.

Windows summarised at the source (:mod:`producers.summary`) come as their expanded
events plus the summaries themselves: a message's summaries are folded
(:class:`~streams.core.summary_evidence.SummaryEvidence`, the worker's own fold) right
after the slice holding its events is observed, as the worker does.

>>> p = DetectionPipeline()
>>> p.feed([]) == [] and p.finish() == []
True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from producers.events import Event
from producers.formats.flight_recorder import SnapshotFacts
from streams.commands import IsolationCommand
from streams.core.columns import (
    ColumnBlockLike,
    EventColumnsLike,
    as_blocks,
    concat_columns,
)
from streams.core.comm import CommDetector
from streams.core.config import DetectConfig, PolicyConfig
from streams.core.correlate import HostCorrelator, LateEvidence
from streams.core.group import CommGroup, observe_many
from streams.core.snapshot import judge_snapshot
from streams.core.summary_evidence import SummaryEvidence, vouched
from streams.verdicts import Verdict

__all__ = ["DetectionPipeline"]


@dataclass(slots=True)
class _Lane:
    """One job's event time: its clock, its open slice and what is buffered in it."""

    now: int = -1
    slice_end: int = -1
    buffered: int = 0
    comms: list[str] = field(default_factory=list)
    """The job's communicators, in the order they were first seen."""
    blocks: list[tuple[ColumnBlockLike, list[int]]] = field(default_factory=list)
    """Parts of blocks in the open slice (cut per communicator only when it closes)."""
    group: CommGroup = field(default_factory=CommGroup)
    """The job's communicators' state laid out together for the grouped pass."""
    summaries: list[object] = field(default_factory=list)
    """Summaries of the messages in the open slice, folded once it is observed."""


class DetectionPipeline:
    """Offline/broker-free path: routes events by comm to CommDetectors, verdicts to the
    HostCorrelator, in event time per job."""

    def __init__(
        self,
        detect: DetectConfig | None = None,
        policy: PolicyConfig | None = None,
        tick_us: int = 500_000,
        max_buffer: int = 50_000,
    ) -> None:
        self.detect_config = detect or DetectConfig()
        self.policy_config = policy or PolicyConfig()
        self.detectors: dict[str, CommDetector] = {}
        self.correlator = HostCorrelator(self.policy_config)
        self.verdicts: list[Verdict] = []
        self.commands: list[IsolationCommand] = []
        self.late: list[tuple[Verdict, str]] = []
        """Verdicts the correlator did not judge, with why (late beyond the allowed
        lateness; cannot happen while each job's events come in order)."""
        self.late_events: list[tuple[str, str, int, int]] = []
        """(job, comm, events, late by µs) per batch not judged: beyond the allowed
        lateness behind what its communicator was already judged up to."""
        self.n_events = 0
        self.lanes: dict[str, _Lane] = {}
        self._judged: dict[str, int] = {}
        """comm -> event time its detector was judged up to (observed or advanced)."""
        self._lateness = self.policy_config.allowed_lateness_us
        self.snapshot_comms: set[str] = set()
        self._tick_us = tick_us
        self._max_buffer = max_buffer
        self.summary_evidence = SummaryEvidence()

    @property
    def now(self) -> int:
        """The newest event time of any job."""
        return max((lane.now for lane in self.lanes.values()), default=-1)

    def _lane(self, job: str) -> _Lane:
        lane = self.lanes.get(job)
        if lane is None:
            lane = self.lanes[job] = _Lane()
        return lane

    def feed(
        self, events: Iterable[Event], summaries: Sequence[object] = ()
    ) -> list[IsolationCommand]:
        """Take events in (roughly) event-time order per job; returns commands decided
        meanwhile. Objects are turned into columns at the edge
        (:func:`~streams.core.columns.as_blocks`), then fed as :meth:`feed_block`; batches
        already given as columns one by one (the Parquet archive's messages) are fed as
        ``feed_block(PartsBlock(parts))``. ``summaries``: those of one message whose
        events these are (the ones its events vouch for are folded with them)."""
        evs = events if isinstance(events, list) else list(events)
        block = as_blocks(evs)
        sums = vouched(summaries, evs) if summaries else []
        n = len(block.part_comm)
        return self.feed_block(block, {n - 1: sums} if sums and n else None)

    def feed_block(
        self, block: ColumnBlockLike, summaries: Mapping[int, Sequence[object]] | None = None
    ) -> list[IsolationCommand]:
        """Take the block's parts (one communicator's rows of one message each) in
        order, each into its job's open slice: a part costs a few integer comparisons
        here, and the rows of a slice are cut per communicator in one go when it
        closes. A part behind what its communicator was already judged up to by more
        than the allowed lateness is counted in ``late_events``, not judged.
        ``summaries``: per part index, the summaries of its message (vouched for by its
        events), folded after the slice the part lands in is observed."""
        out: list[IsolationCommand] = []
        judged_of, lateness, tick = self._judged, self._lateness, self._tick_us
        jobs, lo_l, hi_l, n_l = block.part_job, block.part_ts_lo, block.part_ts_hi, block.part_n
        job, lane, mine = "", None, None
        for i, comm in enumerate(block.part_comm):
            ts_hi = hi_l[i]
            judged = judged_of.get(comm, -1)
            if judged - ts_hi > lateness:
                self.late_events.append((jobs[i], comm, n_l[i], judged - ts_hi))
                continue
            if jobs[i] != job or lane is None:
                job = jobs[i]
                lane = self._lane(job)
                mine = None
            ts_lo = lo_l[i]
            if ts_lo >= lane.slice_end or lane.buffered >= self._max_buffer:
                if lane.buffered:
                    out += self._flush(job, lane)
                    mine = None
                if ts_lo >= lane.slice_end:
                    lane.slice_end = ts_lo - ts_lo % tick + tick
            if ts_hi > lane.now:
                lane.now = ts_hi
            if mine is None:
                if not lane.blocks or lane.blocks[-1][0] is not block:
                    lane.blocks.append((block, []))
                mine = lane.blocks[-1][1]
            mine.append(i)
            lane.buffered += n_l[i]
            if summaries and (sums := summaries.get(i)):
                lane.summaries.extend(sums)
        return out

    def judge_snapshot(
        self, events: Sequence[Event], facts: SnapshotFacts | None = None
    ) -> list[IsolationCommand]:
        """Judge one snapshot (every rank's dump taken at one moment) as a whole
        (:func:`~streams.core.snapshot.judge_snapshot`); its verdicts go to the same
        correlator as the stream's. Call :meth:`finish` after the last input."""
        verdicts = judge_snapshot(events, self.detect_config, facts)
        self.n_events += len(events)
        self.snapshot_comms.update(e.comm for e in events)
        for e in events:  # the snapshot's time is its job's time
            lane = self._lane(e.job)
            if e.ts_us > lane.now:
                lane.now = e.ts_us
        verdicts.sort(key=lambda v: (v.ts_us, not v.benign))
        out: list[IsolationCommand] = []
        for v in verdicts:
            try:
                out += self.correlator.observe(v)
            except LateEvidence as err:
                self.late.append((v, str(err)))
        self.verdicts += verdicts
        self.commands += out
        return out

    def finish(self) -> list[IsolationCommand]:
        """End of input: judge what is buffered, then decide what waits for more
        evidence (a hang's settle time, a host's other GPUs): none will come. Returns
        the last commands."""
        out: list[IsolationCommand] = []
        for job, lane in self.lanes.items():
            if lane.buffered:
                out += self._flush(job, lane)
        pc = self.policy_config
        wait = max(pc.hang_settle_us, pc.host_wait_us)
        late: list[IsolationCommand] = []
        for job, lane in self.lanes.items():  # each job on its own clock
            late += self.correlator.advance(lane.now + wait, job)
        self.commands += late
        return out + late

    def _flush(self, job: str, lane: _Lane) -> list[IsolationCommand]:
        # each communicator's parts of the slice, in the order communicators arrived
        per_comm: dict[str, list[EventColumnsLike]] = {}
        for block, parts in lane.blocks:
            for cols in block.select(np.array(parts, np.int64)):
                per_comm.setdefault(cols.comm, []).append(cols)
        lane.blocks.clear()
        items: list[tuple[CommDetector, EventColumnsLike]] = []
        for comm, cols in per_comm.items():
            d = self.detectors.get(comm)
            if d is None:
                d = self.detectors[comm] = CommDetector(comm, self.detect_config)
                lane.comms.append(comm)
            items.append((d, concat_columns(cols)))
        # judged together, with the verdicts of judging them one by one, in that order
        verdicts = [v for got in observe_many(items, lane.group) for v in got] if items else []
        if lane.summaries:  # the slice's summaries, folded after its samples (the worker's)
            ev = self.summary_evidence
            for comm in ev.add(lane.summaries):
                if (det := self.detectors.get(comm)) is not None:
                    ev.fold(comm, det)
            lane.summaries.clear()
        self.n_events += lane.buffered
        lane.buffered = 0
        now = lane.now
        judged = self._judged
        for comm in lane.comms:  # only this job's communicators live on its clock
            verdicts += self.detectors[comm].advance(now)
            judged[comm] = now  # >= every event just observed: lane.now is their max
        # notes (benign) first: they say who is a victim before a culprit is judged
        verdicts.sort(key=lambda v: (v.ts_us, not v.benign))
        out: list[IsolationCommand] = []
        for v in verdicts:
            try:
                out += self.correlator.observe(v)
            except LateEvidence as err:
                self.late.append((v, str(err)))
        out += self.correlator.advance(now, job)
        self.verdicts += verdicts
        self.commands += out
        return out
