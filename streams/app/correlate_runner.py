"""Agent ``correlate``'s runner (``c4.verdicts`` plus the worker's watermark topic).

One host correlator per verdicts partition, fed in DetectionPipeline's order behind a
watermark per job (the slowest events partition that still has lag or reports), see
:class:`~streams.app.watermark.Watermark` and :class:`CorrelatorRunner`. Broker-free:
the Faust agent only moves bytes.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from streams.app.deadletter import Record, dead_letter
from streams.app.detect_runner import Lane
from streams.app.engine import CorrelatorLike, Engine
from streams.app.runner import Checkpointable, Lookup, Output, StateRunner
from streams.app.watermark import Watermark, decode_watermark
from streams.commands import IsolationCommand
from streams.core.correlate import LateEvidence
from streams.verdicts import Verdict, VerdictDecodeError, decode_verdict

__all__ = ["CorrelatorRunner", "HostRails"]

log = logging.getLogger(__name__)


class HostRails:
    """Rails that hold across jobs, on the worker's own clock (a job id is free to
    invent, and each job has its own event time): a host isolated for one job is not
    isolated again for another within ``cooldown_s``, and at most ``max_per_hour``
    isolating commands go out per rolling hour whatever their jobs. Beyond, a command
    becomes ``alert_only`` and its reason says why. (The per-job cap and cool-down of
    the correlator still apply within a job.)

    >>> from streams.commands import IsolationCommand
    >>> cmd = lambda job, host: IsolationCommand(id=job + host, ts_us=1, job=job,
    ...     host=host, fault="straggler", action="cordon_and_taint", confidence=1.0,
    ...     reason="slow.", evidence={})
    >>> r = HostRails(2, 600.0, clock=lambda: 0.0)
    >>> [c.action for c in r.apply([cmd("a", "n1"), cmd("b", "n1"), cmd("c", "n2"),
    ...                             cmd("d", "n3")])]
    ['cordon_and_taint', 'alert_only', 'cordon_and_taint', 'alert_only']
    >>> r.apply([cmd("b", "n1")])[0].reason
    'slow. Not isolated: n1 was isolated for job a 0 s ago (cool-down per host, across jobs).'
    """

    def __init__(
        self, max_per_hour: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_per_hour = max_per_hour
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._acted: deque[float] = deque()
        self._hosts: dict[str, tuple[float, str]] = {}
        """host -> (when, job) of its last isolating command."""
        self.held = 0

    def apply(self, cmds: list[IsolationCommand]) -> list[IsolationCommand]:
        if not cmds:
            return cmds
        now = self.clock()
        while self._acted and self._acted[0] < now - 3600.0:
            self._acted.popleft()
        for h in [h for h, (t, _) in self._hosts.items() if t < now - self.cooldown_s]:
            del self._hosts[h]
        out = []
        for c in cmds:
            if c.action == "alert_only":
                out.append(c)
                continue
            prior = self._hosts.get(c.host)
            why = ""
            if prior is not None and prior[1] != c.job:
                why = (
                    f" Not isolated: {c.host} was isolated for job {prior[1][:64]} "
                    f"{now - prior[0]:.0f} s ago (cool-down per host, across jobs)."
                )
            elif len(self._acted) >= self.max_per_hour:
                why = (
                    f" Not isolated: {len(self._acted)} isolating commands in the last hour "
                    f"across all jobs (cap {self.max_per_hour}, [worker] max_isolations_per_hour)."
                )
            if why:
                self.held += 1
                log.warning("isolation of %s for job %s held:%s", c.host, c.job, why)
                out.append(msgspec.structs.replace(c, action="alert_only", reason=c.reason + why))
                continue
            self._acted.append(now)
            self._hosts[c.host] = (now, c.job)
            out.append(c)
        return out


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


class CorrelatorRunner(StateRunner[int]):
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
        host_rails: HostRails | None = None,
    ) -> None:
        super().__init__(
            lookup,
            checkpoint_every_events=checkpoint_every_events,
            checkpoint_every_s=checkpoint_every_s,
            clock=clock,
        )
        self.engine = engine
        self.host_rails = host_rails
        """Cool-down per host and a cap across jobs (None: per job only)."""
        self.watermark_topic = watermark_topic
        self.forget_lane_s = forget_lane_s
        self.events_partitions = events_partitions
        self.idle_s = idle_s
        self.max_hold_s = max_hold_s
        self.slice_us = slice_us
        self.max_pending = max_pending
        self.quiet_run_us = allowed_lateness_us // 2
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
        """Judge every held verdict (in event-time order per job)."""
        now = self.wall()
        held = {p: h for p, h in self.pending.items() if partitions is None or p in partitions}
        for p, jobs in held.items():
            for heap in jobs.values():
                while heap:
                    self._observe(p, heapq.heappop(heap), out, now)

    def _drop(self, partitions: set[int] | None, keys: list[int]) -> None:
        for p in keys:
            self.correlators.pop(p, None)
            self.pending.pop(p, None)
        for q in list(self.marks) if partitions is None else partitions:
            self.marks.pop(q, None)
            self.lanes.pop(q, None)
            self.deferred.pop(q, None)
            self.read_upto.pop(q, None)
            for k in [k for k in self._advanced_us if k[0] == q]:
                del self._advanced_us[k]

    # ---------------------------------------------------------------- watermark
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

    def _lane_holds(self, lm: _Mark, m: _Mark, now: float) -> bool:
        """A lane holds while its own mark or its partition's newest report says lag,
        and for ``idle_s`` after both say none (a sender resends a lane whose clock
        stands still only when its partition has no lag any more: the partition's lag
        holds its lanes meanwhile)."""
        if lm is m:
            return self._holds(m, now)
        if lm.idle_since is None or m.caught_since is None:
            return True
        return now - max(lm.idle_since, m.caught_since) < self.idle_s

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
            if self._lane_holds(lm, m, now):
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
            by_job: dict[str, list[tuple[int, _Mark]]] = {}  # once: not all lanes per job
            for (p, j), lm in sorted(lanes.items()):
                by_job.setdefault(j, []).append((p, lm))
            jobs = sorted(set(by_job) | set(self.pending.get(q, {})))
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
                            for p, lm in by_job.get(job, ())
                            if now - marks[p].heard < self.max_hold_s
                            and self._lane_holds(lm, marks[p], now)
                        ),
                        "clocks": {str(p): lm.clock_us for p, lm in by_job.get(job, ())},
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
            self._seen(verdict.job, now)
            clock = rec.clock_us if rec.clock_us is not None else verdict.ts_us
            end = clock - clock % self.slice_us + self.slice_us
            heapq.heappush(
                self.pending.setdefault(q, {}).setdefault(verdict.job, []),
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
                    out.commands.extend(self._railed(found))
                    self.schedule.touch(q, 1, now)

    def _observe(self, p: int, held: Held, out: Output, now: float) -> None:
        end, verdict, rec = held[0], held[-2], held[-1]
        cor = self._correlator(p)
        behind = end <= self._advanced_us.get((p, verdict.job), -1)
        try:
            out.commands.extend(self._railed(cor.observe(verdict)))
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

    def _railed(self, cmds: list[IsolationCommand]) -> list[IsolationCommand]:
        return self.host_rails.apply(cmds) if self.host_rails is not None and cmds else cmds

    def _late(self, job: str, outcome: str, out: Output) -> None:
        counts = self.late_verdicts.setdefault(job, {})
        counts[outcome] = counts.get(outcome, 0) + 1
        out.late_verdicts.append((job, outcome))

    def _due(self, out: Output, now: float) -> None:
        """Checkpoint the time/count-due correlators, and every dirty one when a decision
        was made, so that its checkpoint goes out right behind the command (a worker
        killed a second after a decision used to send it again)."""
        keys = self.schedule.take_all() if out.commands else self.schedule.take_due(now)
        out.checkpoints.extend(self._checkpoint(keys))

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
        self._due(out, now)
        self._count(out)
        return out
