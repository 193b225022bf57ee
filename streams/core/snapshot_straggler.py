"""Stragglers in one snapshot: who arrives last, and how much of that is its own
(see :mod:`streams.core.snapshot`)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from math import exp, lgamma, log, log1p

import numpy as np

from streams.core.config import DetectConfig
from streams.core.snapshot_view import _Comm, _s
from streams.core.stats import median
from streams.verdicts import Verdict


class _Releases:
    """When each rank was released from its previous collective (any group).

    A collective ends no earlier than its last member's arrival, so the latest ``ts_us``
    among its members (their enqueue times when untimed, completions when timed) is
    when it released them (one clock, or synchronized clocks)."""

    def __init__(self, comms: dict[str, _Comm]) -> None:
        self._comms = comms
        self._by_rank: dict[tuple[str, int | None], list[tuple[int, str, int]]] = {}
        for c in comms.values():
            for r, ops in c.ops.items():
                mine = self._by_rank.setdefault(c.proc[r], [])
                mine += [(o.ts_us, c.comm, s) for s, o in ops.items()]
        for v in self._by_rank.values():
            v.sort()
        self._release: dict[tuple[str, int], float] = {}

    def _release_of(self, comm: str, seq: int) -> float:
        key = (comm, seq)
        if key not in self._release:
            c = self._comms[comm]
            t = [ops[seq].ts_us for ops in c.ops.values() if seq in ops]
            # incomplete record of who arrived: the release is unknown (no correction)
            self._release[key] = float(max(t)) if len(t) >= c.nranks else -np.inf
        return self._release[key]

    def before(self, c: _Comm, rank: int, seq: int, arrival_us: float) -> float:
        """The release of ``rank``'s collective before the one it enqueued at
        ``arrival_us`` (``-inf`` when unknown)."""
        mine = self._by_rank.get(c.proc[rank], [])
        i = bisect_left(mine, (int(arrival_us), c.comm, seq))
        if i == 0:
            return -np.inf
        _, comm, prev = mine[i - 1]
        return self._release_of(comm, prev)


@dataclass(slots=True)
class _Arrivals:
    """Collectives × ranks: arrival order of the collectives every member recorded."""

    t_us: np.ndarray
    """Median enqueue (or completion) time of each collective, for windows and spans."""
    arrive: np.ndarray
    """Arrival, larger = later: −log(kernel time) with kernel times, enqueue µs otherwise
    (NaN where a rank did not record the collective)."""
    gap_us: np.ndarray
    """How long the others waited for the last rank alone (its arrival minus the
    second-last one's; kernel time difference or enqueue difference), on the last rank's
    column; 0 elsewhere."""
    timed: bool
    """True: from kernel times; False: from enqueue times."""


def _arrivals(c: _Comm, cfg: DetectConfig, released: _Releases) -> _Arrivals | None:
    n = c.nranks
    if n < 3 or len(c.ops) < 3:
        return None
    seqs = sorted({s for ops in c.ops.values() for s in ops})
    idx = {s: i for i, s in enumerate(seqs)}
    ex = np.full((len(seqs), n), np.nan)
    enq = np.full((len(seqs), n), np.nan)
    ts = np.full((len(seqs), n), np.nan)
    for r, ops in c.ops.items():
        if r >= n:
            continue
        for s, o in ops.items():
            i = idx[s]
            ts[i, r] = o.ts_us
            if o.exec_us > 0:
                ex[i, r] = o.exec_us
            else:  # untimed: ts_us is the enqueue time (Flight Recorder, gloo)
                enq[i, r] = o.ts_us
    need = max(3, cfg.min_present_frac * n)
    timed_rows = (~np.isnan(ex)).sum(axis=1) >= need
    enq_rows = (~np.isnan(enq)).sum(axis=1) >= need
    # Kernel times (within-rank, clock-free) where most collectives have them.
    timed = bool(timed_rows.any() and timed_rows.sum() >= enq_rows.sum() / 2)
    rows = timed_rows if timed else enq_rows
    if rows.sum() < 2 * cfg.straggler_min_seqs:
        return None
    x = ex[rows] if timed else enq[rows]
    arrive = -np.log(x) if timed else x
    filled = np.where(np.isnan(arrive), -np.inf, arrive)
    order = np.argsort(filled, axis=1)
    k = np.arange(x.shape[0])
    last, second = order[:, -1], order[:, -2]
    gap = np.zeros_like(x)
    if timed:  # the last one's kernel ran only the collective; the others waited the rest
        gap[k, last] = x[k, second] - x[k, last]
    else:
        # Only the part of the gap after the last rank was released from its previous
        # collective is its own doing: a rank held up in another group (waiting for
        # someone there) arrives late here through no fault of its own.
        seq_of = np.array(seqs)[rows]
        rel = np.array([released.before(c, int(r), int(s), float(x[i, r]))
                        for i, (r, s) in enumerate(zip(last, seq_of, strict=True))])  # fmt: skip
        gap[k, last] = x[k, last] - np.maximum(x[k, second], rel)
        np.maximum(gap, 0.0, out=gap)
    gap[np.isnan(x)] = np.nan
    return _Arrivals(np.nanmedian(ts[rows], axis=1), arrive, gap, timed)


def _judge_stragglers(c: _Comm, cfg: DetectConfig, released: _Releases) -> list[Verdict]:
    a = _arrivals(c, cfg, released)
    if a is None:
        return []
    # Windows: event-time windows of the stream's length; when the history is shorter
    # than two of them, its two halves.
    k = len(a.t_us)
    win = ((a.t_us - a.t_us.min()) // cfg.window_us).astype(np.int64)
    parts = [np.flatnonzero(win == w) for w in np.unique(win)]
    parts = [p for p in parts if p.size >= cfg.straggler_min_seqs]
    if len(parts) < 2:
        parts = [np.arange(k // 2), np.arange(k // 2, k)]
    period = c.period_us()
    out = []
    for p in parts:
        out += _judge_window(c, cfg, a, p, period)
    return out


_CHANCE = 0.01
"""A rank must be last more often than a 1 % chance would make it (binomial tail)."""


def _chance_last(k: int, n: int, m: int) -> float:
    """P(a rank is last in at least ``k`` of ``n`` collectives by chance, ``m`` ranks).

    >>> round(_chance_last(4, 6, 3), 3), _chance_last(18, 18, 4) < 1e-9
    (0.1, True)
    >>> round(_chance_last(1000, 2000, 2), 2), _chance_last(1500, 2000, 4) < 1e-300
    (0.51, True)
    """
    p = 1.0 / max(m, 2)
    lp, lq = log(p), log1p(-p)
    # in logs: comb(2000, 1000) does not fit a float
    return sum(
        exp(lgamma(n + 1) - lgamma(i + 1) - lgamma(n - i + 1) + i * lp + (n - i) * lq)
        for i in range(k, n + 1)
    )


def _judge_window(
    c: _Comm, cfg: DetectConfig, a: _Arrivals, rows: np.ndarray, period: float
) -> list[Verdict]:
    arrive, gap = a.arrive[rows], a.gap_us[rows]
    present = ~np.isnan(arrive)
    n_seq = present.sum(axis=0)
    last = np.bincount(np.where(present, arrive, -np.inf).argmax(axis=1),
                       minlength=arrive.shape[1])  # fmt: skip
    frac = last / np.maximum(n_seq, 1)
    seen = n_seq >= cfg.straggler_min_seqs
    if seen.sum() < 3 or not (seen & (frac >= cfg.straggler_last_frac)).any():
        return []  # nobody persistently last: the usual case
    # ... and more often than chance would make it: with m ranks each is last with
    # probability 1/m; a snapshot's short history must not turn 4 of 6 into a verdict.
    m = int(present.sum(axis=1).mean().round())
    beyond_chance = np.array(
        [_chance_last(int(k), int(n), m) < _CHANCE for k, n in zip(last, n_seq, strict=True)]
    )
    # The wait each rank alone caused, per collective, on one scale: a fraction of the
    # others' kernel time (kernel times) or of the time between collectives (enqueue).
    mean_gap = np.nansum(gap, axis=0) / np.maximum(n_seq, 1)
    if a.timed:
        x = np.exp(-arrive)
        scale = np.nanmedian(np.where(present, x, np.nan), axis=0)  # each rank's kernel time
    else:
        scale = np.full(arrive.shape[1], max(period, 1.0))
    share = np.where(seen, mean_gap / np.maximum(scale, 1e-9), np.nan)
    vals = share[seen]
    med = median(vals)
    sigma = max(1.4826 * median(np.abs(vals - med)), 0.01)
    z = (share - med) / sigma
    cand = np.flatnonzero(
        seen
        & beyond_chance
        & (frac >= cfg.straggler_last_frac)
        & (share - med >= cfg.straggler_min_wait)
        & (z >= cfg.straggler_min_z)
    )
    if cand.size == 0 or cand.size > max(1, int(cfg.max_culprit_frac * c.nranks)):
        return []
    t = a.t_us[rows]
    start, end = int(t.min()), int(t.max())
    out = []
    for r in cand.tolist():
        late_ms = float(mean_gap[r]) / 1e3
        px = 1.0 + float(share[r])  # the others' time per collective against its own
        ev: dict = {
            "collectives": int(n_seq[r]),
            "last_frac": round(float(frac[r]), 3),
            "peer_time_x": round(px, 3),
            "z": round(float(z[r]), 1),
            "peer_time_vs_normal": None,
            "late_ms": round(late_ms, 2),
            "arrival": "kernel_time" if a.timed else "enqueue_time",
        }
        if a.timed:
            how = f"its peers spent {px:.1f}x its kernel time waiting for it."
        else:
            how = (
                f"its peers waited {late_ms:.1f} ms for it per collective, "
                f"{float(share[r]):.0%} of the time between collectives (by enqueue "
                "times: one clock, or clocks synchronized well below that)."
            )
        reason = (
            f"{c.who(r)} arrived last in {frac[r]:.0%} of {int(n_seq[r])} collectives "
            f"over {_s(max(end - start, 1))}; {how}"
        )
        score = min(1.0, float(frac[r])) * min(1.0, 0.5 + float(z[r]) / (4 * cfg.straggler_min_z))
        out.append(c.verdict("straggler", r, score, reason, start, end, ev))
    return out
