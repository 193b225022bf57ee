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
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

from streams.app import correlate_jobs as cj
from streams.app.correlate_status import describe
from streams.app.deadletter import Record, dead_letter
from streams.app.detect_runner import Lane
from streams.app.engine import CorrelatorLike, Engine
from streams.app.host_rails import HostRails
from streams.app.runner import Checkpointable, Lookup, Output, StateRunner
from streams.app.watermark import Mark, Watermark, decode_watermark
from streams.commands import IsolationCommand
from streams.core.correlate import LateEvidence
from streams.verdicts import Verdict, VerdictDecodeError, decode_verdict

__all__ = ["CorrelatorRunner", "HostRails"]

log = logging.getLogger(__name__)


Held = tuple[int, int, bool, int, Verdict, Record]
"""(slice end, ts_us, not benign, seq, verdict, record): a heap entry."""


class CorrelatorRunner(StateRunner[tuple[int, str]]):
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

    Lateness is event time against the job's own watermark, so a mark counts only once
    the verdicts it covers are read: the watermark topic and ``c4.verdicts`` are fetched
    independently, and a backlog of verdicts takes longer to read than its small marks.
    A mark waits (``deferred``) until this correlator has read its verdicts partition up
    to the mark's ``verdicts_offset``, or started past it (``verdicts_read_from``: where
    the consumer resumed, the group's committed offset, asked once before the first
    verdict of the partition is read) — never for some wall time, which, on a backlog
    judged faster than real time, let verdicts still unread be dead-lettered "late by".
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
        verdicts_read_from: Callable[[int], int | None] | None = None,
    ) -> None:
        super().__init__(
            lookup,
            checkpoint_every_events=checkpoint_every_events,
            checkpoint_every_s=checkpoint_every_s,
            clock=clock,
        )
        self.engine = engine
        self.per_job = callable(getattr(engine, "load_correlator_job", None))
        """The engine's correlators checkpoint per job; one that cannot (a plug-in
        engine written before) keeps one record per partition, the form before."""
        self.host_rails = host_rails
        """Cool-down per host and a cap across jobs (None: per job only)."""
        self.watermark_topic = watermark_topic
        self.verdicts_read_from = verdicts_read_from
        self._resumed: dict[int, int] = {}
        """verdicts partition -> the offset this correlator's consumer resumed reading it
        at (None: unknown, from the start): verdicts below were judged before."""
        self.forget_lane_s = forget_lane_s
        self.events_partitions = events_partitions
        self.idle_s = idle_s
        self.max_hold_s = max_hold_s
        self.slice_us = slice_us
        self.max_pending = max_pending
        self.quiet_run_us = allowed_lateness_us // 2
        self.started = clock()
        self.correlators: dict[int, CorrelatorLike] = {}
        self.loaded: dict[int, set[str]] = {}
        """verdicts partition -> the jobs whose checkpoint was read (or found none)."""
        self._migrated: list[tuple[int, bytes, bytes]] = []
        """Records for the next output: moving a partition's checkpoint of the form before
        to one per job; an empty hand-off of held verdicts once they are taken back."""
        self._taken_back: set[int] = set()
        """verdicts partitions whose held verdicts handed off at a revoke were read."""
        self.marks: dict[int, dict[int, Mark]] = {}
        """verdicts partition -> events partition -> what its reports said."""
        self.lanes: dict[int, dict[Lane, Mark]] = {}
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
        """Jobs some lane reports (or with verdicts held); one no lane has reported for
        ``forget_lane_s`` is forgotten with its counters."""
        self.job_seen: dict[str, float] = {}
        self._job_heard: dict[str, float] = {}
        """job -> wall time of its newest verdict or new lane."""
        """job -> wall time this correlator first heard of it."""

    @staticmethod
    def key(partition: int, job: str | None = None) -> bytes:
        """The table key of ``job``'s checkpoint on ``partition`` (None: the partition's
        whole correlator, the form before; :mod:`streams.app.correlate_jobs`)."""
        return cj.partition_key(partition) if job is None else cj.job_key(partition, job)

    # ---------------------------------------------------------------- state
    def _correlator(self, p: int) -> CorrelatorLike:
        cor = self.correlators.get(p)
        if cor is None:
            eng = self.engine
            cor = self.correlators[p] = self._restore(
                self.key(p), self._what(p), eng.load_correlator, eng.new_correlator
            )
            if (rails := self.host_rails) is not None:  # what p's correlator sent: held
                self._restore_side(self.rails_key(p), f"host rails of {p}",
                                   lambda data: rails.load(p, data))  # fmt: skip
            jobs = sorted(getattr(cor, "clock", ())) if self.per_job else []
            self.loaded[p] = set(jobs)
            if jobs:  # a checkpoint of the form before: moved to per-job records
                self._migrated += cj.migration(p, cor, jobs, eng.new_correlator())
        return cor

    def _job(self, p: int, job: str) -> CorrelatorLike:
        """Partition ``p``'s correlator, holding ``job``'s checkpointed state."""
        cor = self._correlator(p)
        loaded = self.loaded[p]
        if job not in loaded:
            loaded.add(job)
            if not self.per_job:
                return cor

            def load(data: bytes) -> None:
                self.engine.load_correlator_job(cor, job, data)

            self._restore(self.key(p, job), f"{self._what(p)}, job {job}", load, lambda: None)
        return cor

    @staticmethod
    def rails_key(partition: int) -> bytes:
        return f"host-rails-{partition}".encode()

    def _what(self, key: int) -> str:
        return f"host correlator {key}"

    def _locate(self, key: tuple[int, str]) -> tuple[int, bytes, Checkpointable] | None:  # type: ignore[override]
        p, job = key
        cor = self.correlators.get(p)
        if cor is None:
            return None
        part = cj.JobPart(cor, job)
        return (p, self.key(p, job), part) if self.per_job else (p, self.key(p), cor)

    def _checkpoint(self, keys: list[tuple[int, str]]) -> list[tuple[int, bytes, bytes]]:  # type: ignore[override]
        """The jobs' records, those of one partition encoded in one pass over its state,
        and each such partition's share of the host rails."""
        by_p: dict[int, list[str]] = {}
        for p, job in keys:
            by_p.setdefault(p, []).append(job)
        out: list[tuple[int, bytes, bytes]] = []
        if self.host_rails is not None:
            out += [(q, self.rails_key(q), self.host_rails.state(q)) for q in by_p
                    if q in self.correlators]  # fmt: skip
        for p, jobs in by_p.items():
            many = getattr(self.correlators.get(p), "parts_to_bytes", None)
            if many is None:  # without per-job records: the partition's one, once
                out += super()._checkpoint([(p, j) for j in (jobs if self.per_job else jobs[:1])])
                continue
            try:
                out += [(p, self.key(p, j), b) for j, b in many(jobs).items()]
            except Exception:
                self.stats.detector_errors += 1
                log.exception("checkpoint of %s failed", self._what(p))
        return out

    def _keys(self, partitions: set[int] | None) -> list[tuple[int, str]]:  # type: ignore[override]
        return [(p, j) for p, jobs in self.loaded.items()
                if partitions is None or p in partitions for j in jobs]  # fmt: skip

    def flush(self, partitions: set[int] | None = None, *, drop: bool = False) -> Output:
        """As the base; but revoked partitions' held verdicts are handed to the next owner
        (:mod:`streams.app.correlate_jobs`), not judged ahead of their watermark."""
        handed: list[tuple[int, bytes, bytes]] = []
        for p, jobs in self.pending.items() if drop else ():
            if partitions is None or p in partitions:
                held = sorted(h for heap in jobs.values() for h in heap)
                jobs.clear()
                hv = [cj.HeldVerdict.of(h[0], h[-1]) for h in held]
                if hv:  # none: the last hand-off of p was emptied when taken back
                    handed.append((p, cj.held_key(p), cj.encode_held(p, hv)))
        out = super().flush(partitions, drop=drop)
        out.checkpoints.extend(handed)
        return out

    def take_back(self, partitions: Iterable[int]) -> None:
        """The held verdicts their last owner handed off, of each verdicts partition not
        taken back yet: at assignment once the tables are recovered, or at its first
        record (a quiet partition would otherwise hold them until traffic returns)."""
        for q in set(partitions) - self._taken_back:
            self._taken_back.add(q)
            self._restore_side(cj.held_key(q), f"held verdicts of {q}", partial(self._held, q))

    def _held(self, q: int, data: bytes) -> None:
        held = cj.decode_held(q, data)
        for h in held:
            rec = Record(h.topic, q, h.offset, None, h.value, clock_us=h.clock_us)
            self._hold(q, decode_verdict(h.value), rec, h.end, self.wall())
        if held:
            self._migrated.append((q, cj.held_key(q), cj.encode_held(q, [])))

    def _hold(self, q: int, verdict: Verdict, rec: Record, end: int, now: float) -> None:
        self._seq += 1
        self._job(q, verdict.job)  # restored (or created) now: status shows what serves q
        self._seen(verdict.job, now)
        heapq.heappush(
            self.pending.setdefault(q, {}).setdefault(verdict.job, []),
            (end, verdict.ts_us, not verdict.benign, self._seq, verdict, rec),
        )

    def _close(self, partitions: set[int] | None, out: Output) -> None:
        """Judge every held verdict (in event-time order per job)."""
        now = self.wall()
        held = {p: h for p, h in self.pending.items() if partitions is None or p in partitions}
        for p, jobs in held.items():
            for heap in jobs.values():
                while heap:
                    self._observe(p, heapq.heappop(heap), out, now)

    def _drop(self, partitions: set[int] | None, keys: list[tuple[int, str]]) -> None:  # type: ignore[override]
        held = set(self.correlators) if partitions is None else partitions
        for p in held | {k[0] for k in keys}:
            self.correlators.pop(p, None)
            self.loaded.pop(p, None)
            self.pending.pop(p, None)
            self._taken_back.discard(p)
            if self.host_rails is not None:
                self.host_rails.forget(p)
        for q in list(self.marks) if partitions is None else partitions:
            self.marks.pop(q, None)
            self.lanes.pop(q, None)
            self.deferred.pop(q, None)
            self.read_upto.pop(q, None)
            self._resumed.pop(q, None)
            for k in [k for k in self._advanced_us if k[0] == q]:
                del self._advanced_us[k]

    # ---------------------------------------------------------------- watermark
    def _marks(self, q: int) -> dict[int, Mark]:
        marks = self.marks.get(q)
        if marks is None:
            # Every events partition holds until it is heard of (or max_hold_s passes).
            n = self.events_partitions or 0
            t = self.started
            marks = self.marks[q] = {p: Mark(-1, t, t) for p in range(n)}
        return marks

    @staticmethod
    def _update(m: Mark, wm: Watermark, now: float) -> None:
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

    def _heard(self, q: int, p: int, now: float) -> None:
        m = self._marks(q).get(p)
        if m is not None:
            m.heard = now

    def _apply(self, q: int, wm: Watermark, now: float) -> None:
        marks = self._marks(q)
        m = marks.get(wm.partition)
        if m is None:
            m = marks[wm.partition] = Mark(-1, now, now)
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
            lm = lanes[(wm.partition, wm.job)] = Mark(-1, now, now)
            self._seen(wm.job, now)
        self._update(lm, wm, now)

    def _seen(self, job: str, now: float) -> None:
        self._job_heard[job] = now
        if job not in self.jobs:
            self.jobs.add(job)
            self.job_seen[job] = now

    def _holds(self, m: Mark, now: float) -> bool:
        return m.idle_since is None or now - m.idle_since < self.idle_s

    def _lane_holds(self, lm: Mark, m: Mark, now: float) -> bool:
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
        """Per verdicts partition and job: its watermark, as ``status.json`` shows it."""
        return describe(self)

    def process(self, records: Sequence[Record]) -> Output:
        out = Output()
        st = self.stats
        st.batches += 1
        now = self.wall()
        for rec in records:
            q = rec.partition
            if q not in self._taken_back:
                self.take_back((q,))
            if rec.topic == self.watermark_topic:
                try:
                    wm = decode_watermark(rec.value)
                except ValueError as err:  # msgspec's DecodeError is one
                    out.deadletters.append(dead_letter(rec, f"undecodable watermark: {err}"))
                    continue
                if wm.verdicts_offset > self._read_upto(q):
                    self.deferred.setdefault(q, []).append((wm, now))
                    # its sender is alive, whatever its clock waits for: a partition
                    # whose marks wait for a backlog of verdicts is not "gone"
                    # (max_hold_s), which would let the other partitions' clocks pass it
                    self._heard(q, wm.partition, now)
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
            clock = rec.clock_us if rec.clock_us is not None else verdict.ts_us
            self._hold(q, verdict, rec, clock - clock % self.slice_us + self.slice_us, now)
        self._release(out, now)
        self._due(out, now)
        self._count(out)
        return out

    def _read_upto(self, q: int) -> int:
        """The highest offset of verdicts partition ``q`` this correlator has read, or
        below which the verdicts were read before it resumed (a restart)."""
        upto = self.read_upto.get(q, -1)
        start = self._resumed.get(q)
        if start is None:
            # where the consumer resumed: asked once, before this correlator read any
            # verdict of q (later, the group's commit may include verdicts fetched but
            # not yet judged here; by then read_upto says it)
            start = -1
            if self.verdicts_read_from is not None and q not in self.read_upto:
                start = self.verdicts_read_from(q) or 0
            self._resumed[q] = start
        return max(upto, start - 1)

    def _undefer(self, now: float) -> None:
        for q, waiting in self.deferred.items():
            if not waiting:
                continue
            upto = self._read_upto(q)
            keep = []
            for wm, at in waiting:
                # by offsets only: however long its verdicts take to be read, a mark
                # never passes them (they would be judged "late" by a backlog's speed)
                if wm.verdicts_offset <= upto:
                    self._apply(q, wm, now)
                else:
                    keep.append((wm, at))
            self.deferred[q] = keep

    def _release(self, out: Output, now: float) -> None:
        self._undefer(now)
        # each job's watermark once per call (it moves with marks only, not verdicts)
        marks: dict[tuple[int, str], int | None] = {}
        for q, jobs in self.pending.items():
            for job, heap in jobs.items():
                if not heap:
                    continue
                wm = marks[(q, job)] = self.watermark(now, q, job)
                while heap and (
                    (wm is not None and heap[0][0] <= wm) or len(heap) > self.max_pending
                ):
                    self._observe(q, heapq.heappop(heap), out, now)
        for q, cor in self.correlators.items():
            due: dict[str, int] = {}
            for job in sorted({j for _, j in self.lanes.get(q, {})} | set(self.pending.get(q, {}))):
                wm = marks[(q, job)] if (q, job) in marks else self.watermark(now, q, job)
                if wm is None or wm <= self._advanced_us.get((q, job), -1):
                    continue
                self._advanced_us[(q, job)] = wm
                due[job] = wm
            if not due:
                continue
            for job in due:  # a job met first by its watermark: its checkpoint read now
                self._job(q, job)
            many = getattr(cor, "advance_jobs", None)  # one pass for all jobs (the core's)
            try:
                if many is not None:
                    found = many(due)
                else:
                    found = [c for job, wm in due.items() for c in cor.advance(wm, job)]
            except Exception:
                self.stats.detector_errors += 1
                log.exception("host correlator %d failed to advance jobs %s", q, sorted(due)[:8])
                continue
            if found:
                out.commands.extend(self._railed(found, q))
            for job in {c.job for c in found}:  # decided: dirty (a clock alone is not)
                self.schedule.touch((q, job), 1, now)

    def _observe(self, p: int, held: Held, out: Output, now: float) -> None:
        end, verdict, rec = held[0], held[-2], held[-1]
        cor = self._job(p, verdict.job)
        behind = end <= self._advanced_us.get((p, verdict.job), -1)
        try:
            out.commands.extend(self._railed(cor.observe(verdict), p))
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
        self.schedule.touch((p, verdict.job), 1, now)

    def _railed(self, cmds: list[IsolationCommand], q: int) -> list[IsolationCommand]:
        return self.host_rails.apply(cmds, q) if self.host_rails is not None and cmds else cmds

    def _late(self, job: str, outcome: str, out: Output) -> None:
        counts = self.late_verdicts.setdefault(job, {})
        counts[outcome] = counts.get(outcome, 0) + 1
        out.late_verdicts.append((job, outcome))

    def _due(self, out: Output, now: float) -> None:
        """Checkpoint the time/count-due jobs, and every job that decided, so that its
        checkpoint goes out right behind the command (a worker killed a second after a
        decision used to send it again); a partition's checkpoint of the form before is
        moved to per-job records first."""
        out.checkpoints.extend(self._migrated)
        self._migrated.clear()
        keys = self.schedule.take_due(now)
        if out.commands:
            deciding = {c.job for c in out.commands}
            keys += self.schedule.take_all([(p, j) for p in self.correlators for j in deciding])
        out.checkpoints.extend(self._checkpoint(keys))

    def tick(self) -> Output:
        """Release what the watermarks allow; advance correlators; time-due checkpoints;
        forget the marks of lanes not reported for ``forget_lane_s`` (finished jobs)."""
        out = Output()
        now = self.wall()
        self._release(out, now)
        held: set[str] = set()
        for q, lanes in self.lanes.items():
            for lane in [k for k, m in lanes.items() if now - m.heard > self.forget_lane_s]:
                del lanes[lane]
            laned = {lj for _, lj in lanes}
            for job in [j for j, h in self.pending.get(q, {}).items() if not h]:
                if job not in laned:
                    del self.pending[q][job]
            held |= laned | set(self.pending.get(q, ()))
        for job in self.jobs - held:  # no lane reports it, no verdict for an hour: done
            if now - self._job_heard.get(job, now) > self.forget_lane_s:
                self.jobs.discard(job)
                self.job_seen.pop(job, None)
                self._job_heard.pop(job, None)
                self.late_verdicts.pop(job, None)
        self._due(out, now)
        self._count(out)
        return out
