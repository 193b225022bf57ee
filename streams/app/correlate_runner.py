"""Agent ``correlate``'s runner (``c4.verdicts`` plus the worker's watermark topic).

One host correlator per verdicts partition, fed in DetectionPipeline's order behind a
watermark (the slowest events partition that still has lag or reports), see
:class:`~streams.app.watermark.Watermark` and :class:`CorrelatorRunner`. Broker-free:
the Faust agent only moves bytes.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from streams.app.deadletter import Record, dead_letter
from streams.app.engine import CorrelatorLike, Engine
from streams.app.runner import Checkpointable, Lookup, Output, StateRunner
from streams.app.watermark import Watermark, decode_watermark
from streams.verdicts import Verdict, VerdictDecodeError, decode_verdict

__all__ = ["CorrelatorRunner"]

log = logging.getLogger(__name__)


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


class CorrelatorRunner(StateRunner[int]):
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
        super().__init__(
            lookup,
            checkpoint_every_events=checkpoint_every_events,
            checkpoint_every_s=checkpoint_every_s,
            clock=clock,
        )
        self.engine = engine
        self.watermark_topic = watermark_topic
        self.events_partitions = events_partitions
        self.idle_s = idle_s
        self.max_hold_s = max_hold_s
        self.slice_us = slice_us
        self.max_pending = max_pending
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

    @staticmethod
    def key(partition: int) -> bytes:
        return f"correlator-{partition}".encode()

    # ---------------------------------------------------------------- state
    def _correlator(self, p: int) -> CorrelatorLike:
        cor = self.correlators.get(p)
        if cor is None:
            cor = self.correlators[p] = self._restore(
                self.key(p), self._what(p), self.engine.load_correlator, self.engine.new_correlator
            )
        return cor

    def _what(self, key: int) -> str:
        return f"host correlator {key}"

    def _locate(self, key: int) -> tuple[int, bytes, Checkpointable] | None:
        cor = self.correlators.get(key)
        return None if cor is None else (key, self.key(key), cor)

    def _keys(self, partitions: set[int] | None) -> list[int]:
        return [p for p in self.correlators if partitions is None or p in partitions]

    def _close(self, partitions: set[int] | None, out: Output) -> None:
        """Judge every held verdict (in event-time order)."""
        now = self.wall()
        held = {p: h for p, h in self.pending.items() if partitions is None or p in partitions}
        for p, heap in held.items():
            while heap:
                verdict, rec = heapq.heappop(heap)[-2:]
                self._observe(p, verdict, rec, out, now)

    def _drop(self, partitions: set[int] | None, keys: list[int]) -> None:
        for p in keys:
            self.correlators.pop(p, None)
            self.pending.pop(p, None)
        for q in list(self.marks) if partitions is None else partitions:
            self.marks.pop(q, None)
            self.deferred.pop(q, None)
            self.read_upto.pop(q, None)
            self._advanced_us.pop(q, None)

    # ---------------------------------------------------------------- watermark
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

    # ---------------------------------------------------------------- batches
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
                except ValueError as err:  # msgspec's DecodeError is one
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
        self._due(out, now)
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

    def _due(self, out: Output, now: float) -> None:
        """Checkpoint the time/count-due correlators, and every dirty one when a decision
        was made, so that its checkpoint goes out right behind the command (a worker
        killed a second after a decision used to send it again)."""
        keys = self.schedule.take_all() if out.commands else self.schedule.take_due(now)
        out.checkpoints.extend(self._checkpoint(keys))

    def tick(self) -> Output:
        """Release what the watermark allows; advance correlators; time-due checkpoints."""
        out = Output()
        now = self.wall()
        self._release(out, now)
        self._due(out, now)
        self._count(out)
        return out
