"""The two baselines c4stream is measured against, over the same event streams.

Both read only what c4stream reads (the contract's ``progress`` heartbeats) and both
are deliberately the simple rules deployed today:

- :func:`watchdog` — PyTorch's ProcessGroupNCCL watchdog with its default timeout of
  10 minutes (``timeout=timedelta(minutes=10)``): when a rank's in-flight collective
  has run for the timeout (``inflight_us``, or no completion for that long while an
  op is in flight), the whole job is declared hung and torn down. It names **no**
  host — every rank of a hung collective times out alike — so it detects but never
  localizes.
- :func:`nccl_ras` — an NCCL-RAS-style rule: a collective in flight for 20 s
  (``inflight_us >= 20 s``) is *stuck*; the communicator's ranks whose ``started``
  count is behind the communicator's maximum never joined it and are blamed (their
  host and GPU). When nobody is behind it reports a stuck collective but blames no
  one.

Each is a small stateful class with ``feed(events)`` / ``finish()`` (so the benchmark
can drive all detectors in one pass over a simulated trace) and a plain function over
an event iterator. Decisions are :class:`streams.scoring.Decision`.

>>> from producers.events import ProgressEvent
>>> def hb(rank, ts_s, started, completed, inflight_s=None):
...     return ProgressEvent(v=1, job="j", comm="0xa", nranks=2, rank=rank,
...                          host=f"node-{rank:03d}", gpu=0, ts_us=int(ts_s * 1e6),
...                          started=started, completed=completed,
...                          inflight_us=None if inflight_s is None else inflight_s * 1e6)
>>> events = [hb(0, 1, 5, 4, 1), hb(1, 1, 4, 4), hb(0, 21, 5, 4, 21), hb(1, 21, 4, 4)]
>>> [(d.host, d.fault, d.gpu) for d in nccl_ras(events)]
[('node-001', 'noncomm_hang', 0)]
>>> watchdog(events), len(watchdog(events + [hb(0, 601, 5, 4, 601)]))
([], 1)
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from producers.events import Event, ProgressEvent
from streams.scoring import Decision

__all__ = [
    "NcclRas",
    "RasConfig",
    "Watchdog",
    "WatchdogConfig",
    "nccl_ras",
    "watchdog",
]


class WatchdogConfig(msgspec.Struct, kw_only=True, frozen=True):
    timeout_us: int = 600_000_000
    """PyTorch's default NCCL collective timeout: 10 minutes."""


class Watchdog:
    """PyTorch's collective watchdog: one job-level "hung" decision, no localization."""

    name = "watchdog"
    needs_full_trace = True
    """Its 10-minute timeout needs the whole hang; the bench feeds it past the watch cut."""

    def __init__(self, config: WatchdogConfig | None = None) -> None:
        self.config = config or WatchdogConfig()
        # (comm, rank) -> (completed count, event time it last changed)
        self._last: dict[tuple[str, int], tuple[int, int]] = {}
        self.fired: Decision | None = None

    def feed(self, events: Iterable[Event]) -> list[Decision]:
        """Read a batch of events; returns the job-level decision when it fires (once)."""
        if self.fired is not None:
            return []  # the job has been torn down: nothing after this matters
        timeout = self.config.timeout_us
        for ev in events:
            if not isinstance(ev, ProgressEvent):
                continue
            key = (ev.comm, ev.rank)
            prev = self._last.get(key)
            if prev is None or prev[0] != ev.completed:
                self._last[key] = (ev.completed, ev.ts_us)
                prev = self._last[key]
            inflight = ev.started > ev.completed or ev.inflight_us is not None
            if not inflight:
                continue
            ran = ev.inflight_us if ev.inflight_us is not None else 0.0
            if ran >= timeout or ev.ts_us - prev[1] >= timeout:
                self.fired = Decision(
                    detector=self.name,
                    ts_us=ev.ts_us,
                    host=None,
                    fault=None,
                    action="restart_job",
                    reason=(
                        f"watchdog: rank {ev.rank} of comm {ev.comm} has had "
                        f"{ev.inflight_op or 'a collective'} in flight for "
                        f"{max(ran, ev.ts_us - prev[1]) / 1e6:.0f} s ≥ {timeout / 1e6:.0f} s; "
                        "job hung"
                    ),
                )
                return [self.fired]
        return []

    def finish(self) -> list[Decision]:
        return []


def watchdog(events: Iterable[Event], config: WatchdogConfig | None = None) -> list[Decision]:
    """Run the watchdog baseline over an event iterator; at most one decision."""
    wd = Watchdog(config)
    out = wd.feed(events)
    return out + wd.finish()


class RasConfig(msgspec.Struct, kw_only=True, frozen=True):
    stuck_us: int = 20_000_000
    """NCCL RAS's threshold for calling a collective stuck: 20 s."""


class _RankState(msgspec.Struct):
    host: str
    gpu: int | None
    nic: str | None
    started: int


class NcclRas:
    """NCCL-RAS-style rule: stuck ≥ 20 s → blame the ranks whose op count is behind.

    Uses the last reported ``started`` of every rank seen on the communicator (a rank
    that went silent keeps its last count, as RAS keeps a dead peer's). Reports each
    stuck collective once (per communicator and maximum ``started``) and blames each
    (host, GPU) at most once per run.
    """

    name = "nccl-ras"

    def __init__(self, config: RasConfig | None = None) -> None:
        self.config = config or RasConfig()
        self._ranks: dict[str, dict[int, _RankState]] = {}
        self._reported: dict[str, int] = {}  # comm -> max started already reported
        self._blamed: set[tuple[str, int | None]] = set()

    def feed(self, events: Iterable[Event]) -> list[Decision]:
        """Read a batch of events; returns new blames and stuck-collective reports."""
        out: list[Decision] = []
        stuck_us = self.config.stuck_us
        for ev in events:
            if not isinstance(ev, ProgressEvent):
                continue
            ranks = self._ranks.setdefault(ev.comm, {})
            st = ranks.get(ev.rank)
            if st is None:
                ranks[ev.rank] = _RankState(ev.host, ev.gpu, ev.nic, ev.started)
            else:
                st.started = ev.started
            if ev.inflight_us is not None and ev.inflight_us >= stuck_us:
                out.extend(self._stuck(ev, ranks))
        return out

    def _stuck(self, ev: ProgressEvent, ranks: dict[int, _RankState]) -> list[Decision]:
        top = max(s.started for s in ranks.values())
        if self._reported.get(ev.comm) == top:
            return []
        self._reported[ev.comm] = top
        behind = sorted((r, s) for r, s in ranks.items() if s.started < top)
        what = f"comm {ev.comm}: {ev.inflight_op or 'collective'} #{top} stuck for ≥ 20 s"
        if not behind:
            return [
                Decision(
                    detector=self.name,
                    ts_us=ev.ts_us,
                    host=None,
                    fault="comm_hang",
                    action="alert_only",
                    reason=f"nccl-ras: {what}; every rank joined it, nobody blamed",
                )
            ]
        out = []
        for rank, s in behind:
            if (s.host, s.gpu) in self._blamed:
                continue
            self._blamed.add((s.host, s.gpu))
            out.append(
                Decision(
                    detector=self.name,
                    ts_us=ev.ts_us,
                    host=s.host,
                    fault="noncomm_hang",
                    action="cordon",
                    gpu=s.gpu,
                    reason=f"nccl-ras: {what}; rank {rank} started only {s.started}",
                )
            )
        return out

    def finish(self) -> list[Decision]:
        return []


def nccl_ras(events: Iterable[Event], config: RasConfig | None = None) -> list[Decision]:
    """Run the NCCL-RAS-style baseline over an event iterator."""
    ras = NcclRas(config)
    out = ras.feed(events)
    return out + ras.finish()
