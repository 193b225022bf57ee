"""One snapshot's events per communicator, as :mod:`streams.core.snapshot` judges them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from producers.events import Event, OpEvent, ProgressEvent
from producers.formats.fr_facts import SnapshotFacts
from streams.commands import Fault
from streams.core.stats import median, stable_id
from streams.verdicts import Verdict


def _s(us: float) -> str:
    return f"{us / 1e6:.1f} s"


@dataclass(slots=True)
class _Comm:
    """One communicator's part of the snapshot."""

    comm: str
    job: str = ""
    comm_name: str | None = None
    nranks: int = 0
    ident: dict[int, tuple[str, int | None, str | None]] = field(default_factory=dict)
    """rank -> (host, gpu, nic)."""
    progress: dict[int, ProgressEvent] = field(default_factory=dict)
    ops: dict[int, dict[int, OpEvent]] = field(default_factory=dict)
    """rank -> seq -> op."""
    proc: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    """rank -> the process across groups: ``("#rank", global rank)`` where the
    snapshot's facts give the group's members (no host name has a ``#``), else
    ``(host, gpu)``. Several ranks share a host (and dumps name no GPU), so a host alone
    does not tell processes apart."""

    def who(self, rank: int) -> str:
        host, gpu, _ = self.ident.get(rank, ("unknown host", None, None))
        g = f" GPU {gpu}" if gpu is not None else ""
        return f"{host}{g} (rank {rank} of {self.comm_name or self.comm})"

    def hosts(self) -> list[str]:
        return sorted({h for h, _, _ in self.ident.values()})

    def now(self) -> int:
        return max((p.ts_us for p in self.progress.values()), default=0)

    def period_us(self) -> float:
        """Typical time between two collectives, each rank by its own clock (median over
        ranks of the mean interval across the ring), and the p90 kernel time when timed."""
        periods, execs = [], []
        for ops in self.ops.values():
            t = sorted(_when(o) for o in ops.values())
            if len(t) >= 2 and t[-1] > t[0]:
                periods.append((t[-1] - t[0]) / (len(t) - 1))
            execs += [o.exec_us for o in ops.values() if o.exec_us > 0]
        p90 = float(np.percentile(execs, 90)) if execs else 0.0
        return max(median(periods) if periods else 0.0, p90)

    def verdict(
        self,
        fault: Fault,
        rank: int,
        score: float,
        reason: str,
        start: int,
        end: int,
        evidence: dict,
    ) -> Verdict:
        host, gpu, _ = self.ident.get(rank, ("unknown", None, None))
        evidence = {
            "comm_name": self.comm_name or self.comm,
            "comm_hosts": len(self.hosts()),
            "nranks": self.nranks,
            "snapshot": True,
            **evidence,
        }
        return Verdict(
            id=stable_id(self.job, self.comm, fault, host, gpu, None, None, start, False),
            ts_us=self.now(),
            job=self.job,
            comm=self.comm,
            host=host,
            fault=fault,
            score=round(min(1.0, max(0.0, score)), 3),
            reason=reason,
            window_start_us=start,
            window_end_us=end,
            evidence=evidence,
            ranks=[rank],
            gpu=gpu,
        )


def _by_comm(events: Sequence[Event], facts: SnapshotFacts | None = None) -> dict[str, _Comm]:
    comms: dict[str, _Comm] = {}
    for e in events:
        c = comms.get(e.comm)
        if c is None:
            c = comms[e.comm] = _Comm(e.comm, e.job, e.comm_name)
        c.nranks = max(c.nranks, e.nranks)
        c.ident.setdefault(e.rank, (e.host, e.gpu, e.nic))
        if isinstance(e, OpEvent):
            c.ops.setdefault(e.rank, {})[e.seq] = e
        else:
            old = c.progress.get(e.rank)
            if old is None or e.ts_us >= old.ts_us:  # the newest counters of each rank
                c.progress[e.rank] = e
    for c in comms.values():
        g = facts.groups.get(c.comm) if facts is not None else None
        c.proc = {r: ("#rank", g.members[r]) if g is not None and r < len(g.members)
                  else c.ident[r][:2] for r in c.ident}  # fmt: skip
    return comms


def _when(o: OpEvent) -> int:
    return o.ts_us


_NEEDS_ALL = frozenset({"AllReduce", "AllGather", "ReduceScatter", "AllToAll", "Barrier"})
"""Collectives that cannot complete on any member before every member entered them."""


def _stopped_at(
    c: _Comm, rank: int, target: int, newest: dict[tuple[str, int | None], int]
) -> bool:
    """Whether ``rank`` recorded collective ``target`` of this group and nothing after
    it, in this group or any other (its own clock)."""
    op = c.ops.get(rank, {}).get(target)
    return op is not None and _when(op) >= newest.get(c.proc[rank], -1)
