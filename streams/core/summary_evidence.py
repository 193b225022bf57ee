"""Straggler and slow-connection evidence from windows summarised at the source
(issue 22, item 2): the one fold the worker, ``c4stream detect`` and the archive's
reader call.

**Slow connections.** A summary's per-peer totals are the bytes and time of every
collective of its window on each (peer, direction): exactly the sums the
slow-connection matrix (:mod:`streams.core.slow_conn`) makes over a window of raw
collectives — a throughput per cell is bytes over time, whatever the number of
collectives summed. :meth:`SummaryEvidence.fold` adds them to the matrix's open window
as they are, each counted as the ``count`` collectives it stands for (the message size
the family comparison reads). They must not pass through the detector's 1-in-n
sampling of raw collectives by seq: a total stands for all of its window's
collectives, and dropping one (a sample whose seq the sampling skips) loses a whole
window of a rank's traffic.

**Stragglers.**

At 1-in-k samples (k ≈ the rate, ~1 whole collective per rank and second) the
straggler detector sees about two matched collectives per 5-s window: fewer than
``straggler_min_seqs``, so it judges nothing. The summary of every (communicator,
rank, window) still says how long *all* of the window's collectives took on that rank:
count, seq range, kernel time sum / min / p50 / p90 / max. The physics is the
aligner's (:mod:`streams.core.straggler`): in a bulk-synchronous collective every
rank waits inside the kernel until the last one arrives, so the last to arrive has the
*shortest* kernel time and its peers' are longer by its lateness. Over a window of
collectives the late arriver's typical (p50) kernel time is the shortest of its
communicator, and its peers' typical times exceed it by the typical wait.

:class:`SummaryRounds` aligns one communicator's summaries by seq range (a *round*:
one summary per rank over about the same collectives; the exporters of different hosts
close their windows at slightly different seqs, which does not matter: the relation
holds collective by collective) and folds each round into the aligner's per-window
accumulators as the ``count`` collectives it stands for, so the straggler rule weighs
it as it weighs matched collectives — no second rule set:

* ``n_seq[r]`` += the rank's count; ``window_n_seqs`` += the round's (median) count,
  and the round's seq span widens the window's (the share of the step);
* ``lat_sum[r]`` += count × log(median p50 / p50 of r) — the rank's log-lateness;
* ``late_us_sum[r]``, ``late_us_sq[r]`` += count × (median p50 − p50 of r) (and its
  square): the wait its peers spent for it per collective;
* ``n_last[r]`` += count × a *lower bound* of the share of collectives in which r had
  the shortest kernel: r's kernel is shorter than every peer's in at least the share
  of r's collectives below the shortest kernel any peer had (its quantiles: max, p90,
  p50 give 100 %, 90 %, 50 %; else 0). Nothing is claimed that the quantiles do not
  prove; a healthy rank, whose times overlap its peers', gets 0.

The samples of the window are also judged as collectives (they are a subset of the
summarised ones: 1 in k counted twice, negligible at the k this is for).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Round",
    "SummaryEvidence",
    "SummaryRounds",
    "SummaryStats",
    "Totals",
    "fold_round",
    "vouched",
]


@dataclass(frozen=True, slots=True)
class SummaryStats:
    """What one rank's summary of one window says (the fields of
    :class:`producers.summary.SummaryEvent` this evidence reads)."""

    rank: int
    count: int
    seq_first: int
    seq_last: int
    exec_sum_us: float
    exec_min_us: float
    exec_p50_us: float
    exec_p90_us: float
    exec_max_us: float

    @classmethod
    def of(cls, s: object) -> SummaryStats:
        """From a ``SummaryEvent`` (or anything with its fields)."""
        return cls(
            int(s.rank), int(s.count), int(s.seq_first), int(s.seq_last),  # type: ignore[attr-defined]
            float(s.exec_sum_us), float(s.exec_min_us), float(s.exec_p50_us),  # type: ignore[attr-defined]
            float(s.exec_p90_us), float(s.exec_max_us),  # type: ignore[attr-defined]
        )  # fmt: skip


Round = list[SummaryStats]


@dataclass(frozen=True, slots=True)
class Totals:
    """One summary's per-peer totals, as the slow-connection matrix's arrays: rank,
    peer, send (else receive), bytes, time (µs), and the collectives they sum."""

    rank: np.ndarray
    peer: np.ndarray
    send: np.ndarray
    nbytes: np.ndarray
    time_us: np.ndarray
    count: int

    @classmethod
    def of(cls, s: object) -> Totals | None:
        """From a ``SummaryEvent``'s ``peers`` (None without timed ones)."""
        conns = [c for c in (getattr(s, "peers", None) or ()) if c.time_us]
        if not conns:
            return None
        n = len(conns)
        return cls(
            np.full(n, int(s.rank), np.int64),  # type: ignore[attr-defined]
            np.array([c.peer for c in conns], np.int64),
            np.array([c.dir == "send" for c in conns], bool),
            np.array([c.bytes for c in conns], np.float64),
            np.array([c.time_us for c in conns], np.float64),
            int(s.count),  # type: ignore[attr-defined]
        )


def vouched(summaries: Iterable[object], events: Iterable[object]) -> list[object]:
    """The summaries whose (communicator, rank, host) an event of the same message has
    (admitted with the message, checked against the rank's identity); others are
    evidence nobody vouches for, and are not folded."""
    seen = {(e.comm, e.rank, e.host) for e in events}  # type: ignore[attr-defined]
    return [s for s in summaries if (s.comm, s.rank, s.host) in seen]  # type: ignore[attr-defined]


class SummaryRounds:
    """One communicator's summaries, aligned by seq range into rounds (one per rank).

    A round closes when a rank's next summary arrives while the round already holds
    one of it (that rank moved on to its next window), or when every rank is in it;
    :meth:`take` returns the closed rounds with enough ranks present
    (``min_present_frac`` of ``nranks``, at least 3: a pair has no peers to compare)."""

    def __init__(self, nranks: int, min_present_frac: float = 0.8) -> None:
        self.n = nranks
        self.min_present_frac = min_present_frac
        self._open: dict[int, SummaryStats] = {}
        self._closed: list[Round] = []

    def add(self, summaries: Iterable[SummaryStats]) -> None:
        for s in summaries:
            if s.rank >= self.n:
                self.n = s.rank + 1
            if s.rank in self._open and s.seq_first > self._open[s.rank].seq_last:
                self._close()
            self._open[s.rank] = s
            if len(self._open) >= self.n:
                self._close()

    def _close(self) -> None:
        if len(self._open) >= max(3, self.min_present_frac * self.n):
            self._closed.append(list(self._open.values()))
        self._open = {}

    def take(self) -> list[Round]:
        out, self._closed = self._closed, []
        return out


_MAX_CLOSED = 16
"""Closed rounds kept per communicator until its detector takes them (bounded)."""
_MAX_COMMS = 65_536
"""Communicators whose rounds are kept, least recently summarised forgotten first."""


class SummaryEvidence:
    """The intake of many communicators' summaries: :meth:`add` a message's summary
    records, then :meth:`fold` each communicator's per-peer totals into its detector's
    slow-connection matrix and its closed rounds into its straggler aligner (a
    :class:`~streams.core.comm.CommDetector`, after it observed the message's samples,
    so all land in the same window)."""

    def __init__(self, min_present_frac: float = 0.8) -> None:
        self.min_present_frac = min_present_frac
        self.rounds: OrderedDict[str, SummaryRounds] = OrderedDict()
        self.totals: dict[str, list[Totals]] = {}
        """Per-peer totals per communicator, not yet folded (bounded as the rounds)."""
        self.folded = 0
        """Rounds folded into straggler aligners."""
        self.folded_totals = 0
        """Summaries whose per-peer totals were folded into a slow-connection matrix."""

    def add(self, summaries: Iterable[object]) -> set[str]:
        """Take summary records (``SummaryEvent``); returns their communicators."""
        comms: set[str] = set()
        for s in summaries:
            comm = str(s.comm)  # type: ignore[attr-defined]
            r = self.rounds.get(comm)
            if r is None:
                r = self.rounds[comm] = SummaryRounds(int(s.nranks), self.min_present_frac)  # type: ignore[attr-defined]
                if len(self.rounds) > _MAX_COMMS:
                    old, _ = self.rounds.popitem(last=False)
                    self.totals.pop(old, None)
            else:
                self.rounds.move_to_end(comm)
            r.add([SummaryStats.of(s)])
            del r._closed[:-_MAX_CLOSED]
            t = Totals.of(s)
            if t is not None:
                pending = self.totals.setdefault(comm, [])
                pending.append(t)
                del pending[: -_MAX_CLOSED * max(1, r.n)]
            comms.add(comm)
        return comms

    def fold(self, comm: str, detector: object) -> int:
        """Fold ``comm``'s per-peer totals into ``detector``'s slow-connection matrix
        and its closed rounds into its straggler aligner; returns how many rounds were
        folded (0 without a straggler detector)."""
        dets = {d.name: d for d in getattr(detector, "detectors", ())}
        totals = self.totals.pop(comm, ())
        sc = dets.get("slow_conn")
        if sc is not None:
            for t in totals:
                sc.add_totals(t.rank, t.peer, t.send, t.nbytes, t.time_us, t.count)
            self.folded_totals += len(totals)
        r = self.rounds.get(comm)
        st = dets.get("straggler")
        if r is None or st is None:
            return 0
        n = sum(fold_round(st.aligner, rnd) for rnd in r.take())
        self.folded += n
        return n


def fold_round(a: object, rnd: Round) -> bool:
    """Fold one round into a :class:`~streams.core.straggler.SeqAligner`'s open window
    (see the module doc); False (nothing changed) when it cannot be compared."""
    if len(rnd) < 3:
        return False
    ranks = np.array([s.rank for s in rnd], np.int64)
    if ranks.max() >= a.n:  # type: ignore[attr-defined]
        a.grow(int(ranks.max()) + 1)  # type: ignore[attr-defined]
    count = np.array([s.count for s in rnd], np.float64)
    p50 = np.array([s.exec_p50_us for s in rnd], np.float64)
    if (p50 <= 0).any() or (count <= 0).any():
        return False
    med = float(np.median(p50))
    lat = np.clip(np.log(med / p50), -5.0, 5.0)
    wait = med - p50
    # share of r's collectives proven shorter than every peer's shortest kernel
    quant = np.array([[s.exec_max_us, s.exec_p90_us, s.exec_p50_us] for s in rnd], np.float64)
    mins = np.array([s.exec_min_us for s in rnd], np.float64)
    frac = np.zeros(len(rnd))
    for i in range(len(rnd)):
        peer_min = float(np.delete(mins, i).min())
        below = quant[i] < peer_min
        frac[i] = 1.0 if below[0] else 0.9 if below[1] else 0.5 if below[2] else 0.0
    np.add.at(a.n_seq, ranks, count.astype(np.int32))  # type: ignore[attr-defined]
    np.add.at(a.n_last, ranks, np.floor(count * frac).astype(np.int32))  # type: ignore[attr-defined]
    np.add.at(a.lat_sum, ranks, count * lat)  # type: ignore[attr-defined]
    np.add.at(a.late_us_sum, ranks, count * wait)  # type: ignore[attr-defined]
    np.add.at(a.late_us_sq, ranks, count * wait * wait)  # type: ignore[attr-defined]
    np.add.at(a.exec_sum, ranks, np.array([s.exec_sum_us for s in rnd]))  # type: ignore[attr-defined]
    a.window_n_seqs += int(np.median(count))  # type: ignore[attr-defined]
    lo = min(s.seq_first for s in rnd)
    hi = max(s.seq_last for s in rnd)
    a.window_seq_lo = lo if a.window_seq_lo < 0 else min(a.window_seq_lo, lo)  # type: ignore[attr-defined]
    a.window_seq_hi = max(a.window_seq_hi, hi)  # type: ignore[attr-defined]
    return True
