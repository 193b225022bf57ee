"""DetectionPipeline: the broker-free path through the same core the Faust agents run.

Events are routed by communicator to :class:`CommDetector` objects in small event-time
slices (``tick_us``); after each slice every detector's clock is advanced (so silence
and hangs are found even where nothing arrives) and the verdicts go, in event-time
order, to the :class:`HostCorrelator`.

>>> p = DetectionPipeline()
>>> p.feed([]) == [] and p.finish() == []
True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from producers.events import Event
from streams.commands import IsolationCommand
from streams.core.comm import CommDetector
from streams.core.config import DetectConfig, PolicyConfig
from streams.core.correlate import HostCorrelator
from streams.core.snapshot import judge_snapshot
from streams.verdicts import Verdict

__all__ = ["DetectionPipeline"]


class DetectionPipeline:
    """Offline/broker-free path: routes events by comm to CommDetectors, verdicts to the
    HostCorrelator, in event time."""

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
        self.n_events = 0
        self.snapshot_comms: set[str] = set()
        self.now = -1
        self._tick_us = tick_us
        self._max_buffer = max_buffer
        self._slice_end = -1
        self._buf: dict[str, list[Event]] = {}
        self._buffered = 0

    def feed(self, events: Iterable[Event]) -> list[IsolationCommand]:
        """Take events in (roughly) event-time order; returns commands decided meanwhile."""
        out: list[IsolationCommand] = []
        buf = self._buf
        if isinstance(events, list) and events:
            # fast path: an exporter batch holds one communicator's events of one host.
            # List comprehensions, not generator expressions: this runs for every event.
            comm = events[0].comm
            if len({e.comm for e in events}) == 1:
                tss = [e.ts_us for e in events]
                ts_lo = min(tss)
                ts_hi = max(tss)
                if ts_lo >= self._slice_end or self._buffered >= self._max_buffer:
                    if self._buffered:
                        out += self._flush()
                    if ts_lo >= self._slice_end:
                        self._slice_end = ts_lo - ts_lo % self._tick_us + self._tick_us
                if ts_hi > self.now:
                    self.now = ts_hi
                b = buf.get(comm)
                if b is None:
                    buf[comm] = list(events)
                else:
                    b.extend(events)
                self._buffered += len(events)
                return out
        for e in events:
            ts = e.ts_us
            if ts >= self._slice_end or self._buffered >= self._max_buffer:
                if self._buffered:
                    out += self._flush()
                if ts >= self._slice_end:
                    self._slice_end = ts - ts % self._tick_us + self._tick_us
            if ts > self.now:
                self.now = ts
            b = buf.get(e.comm)
            if b is None:
                buf[e.comm] = [e]
            else:
                b.append(e)
            self._buffered += 1
        return out

    def judge_snapshot(self, events: Sequence[Event]) -> list[IsolationCommand]:
        """Judge one snapshot (every rank's dump taken at one moment) as a whole
        (:func:`~streams.core.snapshot.judge_snapshot`); its verdicts go to the same
        correlator as the stream's. Call :meth:`finish` after the last input."""
        verdicts = judge_snapshot(events, self.detect_config)
        self.n_events += len(events)
        self.snapshot_comms.update(e.comm for e in events)
        self.now = max(self.now, max((e.ts_us for e in events), default=-1))
        verdicts.sort(key=lambda v: (v.ts_us, not v.benign))
        out: list[IsolationCommand] = []
        for v in verdicts:
            out += self.correlator.observe(v)
        self.verdicts += verdicts
        self.commands += out
        return out

    def finish(self) -> list[IsolationCommand]:
        """End of input: judge what is buffered, then decide what waits for more
        evidence (a hang's settle time, a host's other GPUs): none will come. Returns
        the last commands."""
        out = self._flush() if self._buffered else []
        pc = self.policy_config
        late = self.correlator.advance(self.now + max(pc.hang_settle_us, pc.host_wait_us))
        self.commands += late
        return out + late

    def _flush(self) -> list[IsolationCommand]:
        verdicts: list[Verdict] = []
        for comm, evs in self._buf.items():
            d = self.detectors.get(comm)
            if d is None:
                d = self.detectors[comm] = CommDetector(comm, self.detect_config)
            verdicts += d.observe(evs)
        self.n_events += self._buffered
        self._buf.clear()  # in place: feed() holds a reference to this dict
        self._buffered = 0
        now = self.now
        for d in self.detectors.values():
            verdicts += d.advance(now)
        # notes (benign) first: they say who is a victim before a culprit is judged
        verdicts.sort(key=lambda v: (v.ts_us, not v.benign))
        out: list[IsolationCommand] = []
        for v in verdicts:
            out += self.correlator.observe(v)
        out += self.correlator.advance(now)
        self.verdicts += verdicts
        self.commands += out
        return out
