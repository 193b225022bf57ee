"""Hang evidence: who is behind, who is silent, which connections stopped.

A hung collective never completes, so its only trace is in progress heartbeats:
``started``/``completed`` counters, the in-flight time measured by each rank's own
clock, and cumulative bytes (and retransmits) per connection of the in-flight op.

- **Non-communication hang**: most live ranks sit in collective N far longer than this
  communicator's normal (learned) while some ranks have not started N (counter behind)
  or went silent. Those ranks are the culprits; the waiting ones are victims.
- **Communication hang**: every rank started N, nobody completes. The connections
  whose retransmits grow (or, failing that, whose bytes stopped while others moved)
  name the sender NIC / link.

>>> import numpy as np
>>> from streams.core.ranks import RankTable
>>> t = RankTable(4)
>>> t.started[:] = [8, 8, 7, 8]; t.completed[:] = [7, 7, 7, 7]
>>> t.inflight_us[:] = [9e6, 9e6, 0, 9e6]; t.prog_recv[:] = 100; t.last_recv[:] = 100
>>> f = judge_hang(t, now=100, thr_us=2e6, silent_us=3_000_000, min_waiting_frac=0.5,
...                max_culprit_frac=0.34)
>>> f.kind, f.culprits.tolist(), f.target
('noncomm', [2], 8)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from streams.core.ranks import RankTable
from streams.core.stats import median

__all__ = ["HangFinding", "ProgressConns", "judge_hang", "localize_stalled"]


@dataclass(slots=True)
class HangFinding:
    kind: str  # "noncomm" | "comm"
    target: int
    """The collective (started counter) the waiting ranks sit in."""
    culprits: np.ndarray
    silent: np.ndarray
    waiting: np.ndarray
    wait_us: float
    """Median in-flight time of the waiting ranks (their own clocks), extrapolated to now."""
    extra: dict = field(default_factory=dict)


def judge_hang(
    t: RankTable,
    now: int,
    thr_us: float,
    silent_us: int,
    min_waiting_frac: float,
    max_culprit_frac: float,
    expect_all: bool = False,
) -> HangFinding | None:
    """Classify the communicator's state at ``now``; ``None`` when nothing is hung."""
    seen = t.last_recv >= 0
    if seen.sum() < 2:
        return None
    stale = now - t.last_recv
    silent = seen & (stale > silent_us)
    if expect_all:  # past start-up, a rank never heard from is silent too
        silent |= ~seen
    alive = seen & ~silent
    n_alive = int(alive.sum())
    if n_alive < 1:
        return None
    infl = alive & (t.started > t.completed)
    est = np.where(infl, t.inflight_us + (now - t.prog_recv), 0.0)
    waiting = infl & (est > thr_us)
    n_wait = int(waiting.sum())
    if n_wait < max(1, min_waiting_frac * n_alive):
        return None
    target = int(t.started[waiting].max())
    waiting &= t.started == target
    behind = alive & (t.started < target) & (t.started >= 0)
    culprits = behind | silent
    wait_us = median(est[waiting]) if waiting.any() else 0.0
    n_cul = int(culprits.sum())
    if n_cul:
        if n_cul > max(1, max_culprit_frac * t.n):
            return None
        return HangFinding(
            "noncomm",
            target,
            np.flatnonzero(culprits),
            np.flatnonzero(silent),
            np.flatnonzero(waiting),
            wait_us,
        )
    if int(waiting.sum()) >= 0.9 * t.n and (t.completed[alive] < target).all():
        return HangFinding(
            "comm",
            target,
            np.empty(0, np.int64),
            np.empty(0, np.int64),
            np.flatnonzero(waiting),
            wait_us,
        )
    return None


class ProgressConns:
    """Per-connection progress of in-flight ops: bytes stalls and retransmit growth.

    Keyed by reporting rank, then (peer, dir). Entries of a rank are dropped when it has
    nothing in flight, so state is bounded by the connections of in-flight ops.
    """

    def __init__(self) -> None:
        # rank -> {(peer, is_send): [started, bytes, retrans, stalls, retrans_growth, moved]}
        self.by_rank: dict[int, dict[tuple[int, bool], list[int]]] = {}

    def drop(self, rank: int) -> None:
        self.by_rank.pop(rank, None)

    def update(self, rank: int, started: int, conns: list) -> None:
        mine = self.by_rank.setdefault(rank, {})
        for c in conns:
            key = (c.peer, c.dir == "send")
            rt = c.retrans or 0
            e = mine.get(key)
            if e is None or e[0] != started:
                mine[key] = [started, c.bytes, rt, 0, 0, 0]
                continue
            moved = c.bytes - e[1]
            e[3] = e[3] + 1 if moved <= 0 else 0
            e[4] += max(0, rt - e[2])
            e[5] += max(0, moved)
            e[1], e[2] = c.bytes, rt

    def nbytes(self) -> int:
        return sum(100 + 120 * len(v) for v in self.by_rank.values())


def localize_stalled(pc: ProgressConns, target: int) -> list[tuple[int, int, str]]:
    """Directed cells (sender, receiver) to blame for a communication hang, with why.

    Retransmits growing on a connection are the strongest sign; without them, a
    connection whose bytes stopped while most others still moved.
    """
    cells: dict[tuple[int, int], list[int]] = {}
    for rank, conns in pc.by_rank.items():
        for (peer, is_send), e in conns.items():
            if e[0] != target:
                continue
            cell = (rank, peer) if is_send else (peer, rank)
            agg = cells.setdefault(cell, [0, 0, 0])
            agg[0] = max(agg[0], e[3])  # consecutive stalled heartbeats
            agg[1] += e[4]  # retransmit growth
            agg[2] += e[5]  # bytes moved while observed
    if not cells:
        return []
    retrans = [(c, "retransmits growing") for c, a in cells.items() if a[1] > 0]
    if retrans:
        return [(c[0], c[1], why) for c, why in retrans]
    stalled = [c for c, a in cells.items() if a[0] >= 1]
    if 0 < len(stalled) <= max(1, len(cells) // 2):
        return [(c[0], c[1], "bytes stopped") for c in stalled]
    return []
