"""Straggler evidence: align every rank's kernel time per collective, rank them.

Host clocks disagree by milliseconds, so arrival order cannot be read from
timestamps. It can be read from durations: in a bulk-synchronous collective every rank
waits inside the kernel until the last one arrives, so the last to arrive has the
*shortest* kernel time and its peers' times inflate by its lateness. Worked example,
four ranks, rank 2 computes 75 ms longer than the others::

    exec_us  = [85_000, 84_000, 10_000, 86_000]   # rank 2 waited for nobody
    median   = 84_500  → log(median / exec) = [-0.01, 0.01, 2.14, -0.02]

Over a window the straggler is the rank that has the shortest time in most
collectives and whose log-lateness stands far above its peers' (median/MAD).

>>> import numpy as np
>>> a = SeqAligner(nranks=4, ring=8)
>>> for s in range(6):
...     _ = a.insert(np.arange(4), np.full(4, s), np.array([85e3, 84e3, 10e3, 86e3]), 0)
>>> _ = a.close_due(0)
>>> a.window_n_seqs, a.n_last.tolist()
(6, [0, 0, 6, 0])
"""

from __future__ import annotations

import weakref
from typing import ClassVar

import msgspec
import numpy as np

from streams.core import checkpoint as ck
from streams.core.config import DetectConfig
from streams.core.detector import Batch, CommView, Output, Window
from streams.core.findings import Finding, Observation, PairWait, StragglerEvidence, Waiting
from streams.core.stats import median, new_quantile, quantile_from_state, quantile_state

__all__ = [
    "AlignerGroup",
    "AlignerState",
    "SeqAligner",
    "StragglerDetector",
    "StragglerFinding",
    "aligner_from_state",
    "aligner_state",
    "judge_stragglers",
]


class SeqAligner:
    """A ring of the last ``ring`` collectives × ranks, and per-rank window accumulators."""

    def __init__(self, nranks: int, ring: int, min_present_frac: float = 0.8) -> None:
        self.ring = ring
        self.n = nranks
        self.min_present_frac = min_present_frac
        self.tag = np.full(ring, -1, np.int64)
        self.exec = np.full((ring, nranks), np.nan, np.float32)
        self.count = np.zeros(ring, np.int32)
        self.opened = np.zeros(ring, np.int64)
        self.reset_window()

    def reset_window(self) -> None:
        self.n_seq = np.zeros(self.n, np.int32)
        self.n_last = np.zeros(self.n, np.int32)
        self.lat_sum = np.zeros(self.n, np.float64)
        self.late_us_sum = np.zeros(self.n, np.float64)
        self.late_us_sq = np.zeros(self.n, np.float64)
        """Sum of squared waits: the spread of the wait, for its confidence bound."""
        self.exec_sum = np.zeros(self.n, np.float64)
        self.window_n_seqs = 0
        self.window_seq_lo = -1
        self.window_seq_hi = -1
        """Lowest and highest seq judged in this window: the collectives that ran in it
        (a 1-in-k sample of them judged, as from summarised input, still spans them)."""
        self.window_med_sum = 0.0
        self.window_meds: list[float] = []

    def grow(self, nranks: int) -> None:
        if nranks <= self.n:
            return
        add = nranks - self.n
        self.exec = np.concatenate(
            [self.exec, np.full((self.ring, add), np.nan, np.float32)], axis=1
        )
        self.n_seq = np.concatenate([self.n_seq, np.zeros(add, np.int32)])
        self.n_last = np.concatenate([self.n_last, np.zeros(add, np.int32)])
        self.lat_sum = np.concatenate([self.lat_sum, np.zeros(add, np.float64)])
        self.late_us_sum = np.concatenate([self.late_us_sum, np.zeros(add, np.float64)])
        self.late_us_sq = np.concatenate([self.late_us_sq, np.zeros(add, np.float64)])
        self.exec_sum = np.concatenate([self.exec_sum, np.zeros(add, np.float64)])
        self.n = nranks

    def insert(
        self,
        ranks: np.ndarray,
        seqs: np.ndarray,
        exec_us: np.ndarray,
        now: int,
        distinct: list[int] | None = None,
    ) -> list[float]:
        """Add a batch of (rank, seq, kernel time); returns medians of collectives closed.

        ``distinct``: the batch's distinct seqs in ascending order, when the caller has
        them (cheaper from a Python list than ``np.unique`` on a small array)."""
        closed: list[float] = []
        slots = seqs % self.ring
        if (self.tag[slots] != seqs).any():  # some collective of this batch needs a row
            us = distinct if distinct is not None else np.unique(seqs).tolist()
            if self._open_free_rows(us, now):
                us = []  # the usual case, done at once: every new row was free
            for u in us:
                slot = u % self.ring
                t = int(self.tag[slot])
                if t == u:
                    continue
                if t > u:  # an old collective whose row was already reused: too late
                    continue
                if t >= 0:  # ring full: judge this row and every complete one at once
                    full = (self.tag >= 0) & (self.count >= self.n)
                    full[slot] = True
                    closed += self._close(np.flatnonzero(full))
                self.tag[slot] = u
                self.exec[slot].fill(np.nan)
                self.count[slot] = 0
                self.opened[slot] = now
            ok = self.tag[slots] == seqs
            if not ok.all():
                slots, ranks, exec_us = slots[ok], ranks[ok], exec_us[ok]
        self.exec[slots, ranks] = exec_us
        self.count += np.bincount(slots, minlength=self.ring).astype(np.int32)
        return closed

    def _open_free_rows(self, us: list[int], now: int) -> bool:
        """Open the rows of the new collectives ``us`` (ascending) in one go, when each
        one's row is free and no two share a row; False (nothing done) otherwise, and
        the caller takes them one by one (closing what the full ring pushes out)."""
        if len(us) < 4 or us[-1] - us[0] >= self.ring:
            return False  # a few rows: the loop is cheaper than these array operations
        u = np.array(us, np.int64)
        sl = u % self.ring
        tags = self.tag[sl]
        new = tags != u
        if not (tags[new] == -1).all():
            return False
        sl, u = sl[new], u[new]
        self.tag[sl] = u
        self.exec[sl] = np.nan
        self.count[sl] = 0
        self.opened[sl] = now
        return True

    def close_due(self, cutoff: int) -> list[float]:
        """Judge, in one batch, the collectives every rank reported and those opened
        before ``cutoff`` (with the ranks that reported). Batching keeps numpy calls
        per communicator to a few per second however many collectives it runs."""
        due = np.flatnonzero((self.tag >= 0) & ((self.opened < cutoff) | (self.count >= self.n)))
        return self._close(due) if due.size else []

    def _close(self, slots: np.ndarray) -> list[float]:
        x = self.exec[slots].astype(np.float64)
        seqs = self.tag[slots].copy()
        self.tag[slots] = -1
        self.count[slots] = 0
        present = x > 0  # False for NaN (not reported) too
        n_present = present.sum(axis=1)
        keep = n_present >= max(2, self.min_present_frac * self.n)
        if not keep.all():
            if not keep.any():
                return []
            x, present, n_present = x[keep], present[keep], n_present[keep]
            seqs = seqs[keep]
        lo, hi = int(seqs.min()), int(seqs.max())
        self.window_seq_lo = lo if self.window_seq_lo < 0 else min(self.window_seq_lo, lo)
        self.window_seq_hi = max(self.window_seq_hi, hi)
        absent = ~present
        x[absent] = np.nan
        med = _row_median(x, n_present)
        # absent ranks take the median: log(med/med) = 0 and med - med = 0 exactly, so
        # they add nothing to the sums below (one fill instead of a np.where per sum)
        m = med[:, None]
        xf = np.where(present, x, m)
        lat = np.clip(np.log(m / xf), -5.0, 5.0)  # > 0: this rank spent less than its peers
        self.lat_sum += lat.sum(axis=0)
        wait = m - xf
        self.late_us_sum += wait.sum(axis=0)
        self.late_us_sq += (wait * wait).sum(axis=0)
        self.exec_sum += np.where(present, x, 0.0).sum(axis=0)
        self.n_seq += present.sum(axis=0, dtype=np.int32)
        # the shortest kernel time of each collective (absent ranks never count)
        x[absent] = np.inf
        self.n_last += np.bincount(x.argmin(axis=1), minlength=self.n).astype(np.int32)
        self.window_n_seqs += int(x.shape[0])
        meds = med.tolist()
        self.window_meds += meds
        return meds

    def nbytes(self) -> int:
        return (
            self.exec.nbytes
            + self.tag.nbytes
            + self.count.nbytes
            + self.opened.nbytes
            + self.n_seq.nbytes
            + self.n_last.nbytes
            + self.lat_sum.nbytes
            + self.late_us_sum.nbytes
            + self.late_us_sq.nbytes
            + self.exec_sum.nbytes
            + 8 * len(self.window_meds)
        )


def _row_median(x: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Median of each row ignoring NaNs (np.nanmedian is 10x slower on small rows).

    >>> _row_median(np.array([[3.0, 1.0, np.nan], [4.0, 1.0, 2.0]]), np.array([2, 3]))
    array([2., 2.])
    """
    xs = np.sort(x, axis=1)  # NaNs sort last
    rows = np.arange(x.shape[0])
    return 0.5 * (xs[rows, (count - 1) // 2] + xs[rows, count // 2])


class StragglerFinding:
    """One rank judged a straggler over one window, with the figures behind it."""

    __slots__ = ("rank", "frac_last", "mean_lat", "z", "n_seqs", "late_us", "share")

    def __init__(
        self, rank: int, frac_last: float, mean_lat: float, z: float, n_seqs: int, late_us: float,
        share: float = 0.0,
    ):  # fmt: skip
        self.late_us = late_us
        """Mean time (µs) its peers spent waiting for it per collective."""
        self.rank = rank
        self.frac_last = frac_last
        self.mean_lat = mean_lat
        self.z = z
        self.n_seqs = n_seqs
        self.share = share
        """Lower confidence bound of that wait as a share of the time between two
        collectives (the step's share it costs); 0 when not measured."""


def wait_share(
    n: np.ndarray, late_sum: np.ndarray, late_sq: np.ndarray, period_us: float, conf_z: float
) -> np.ndarray:
    """Per rank, the lower one-sided confidence bound (``conf_z`` standard errors) of
    the mean time its peers waited for it per collective, over ``period_us`` (the time
    between two collectives): the share of the step the rank costs its peers.

    >>> wait_share(np.array([100.0]), np.array([2000.0]), np.array([40000.0]), 1000.0, 1.645)
    array([0.02])
    """
    k = np.maximum(n, 1.0)
    mean = late_sum / k
    var = np.maximum(late_sq / k - mean * mean, 0.0)
    low = mean - conf_z * np.sqrt(var / k)
    return np.where(n > 0, low / max(period_us, 1e-9), 0.0)


def judge_stragglers(
    a: SeqAligner,
    min_seqs: int,
    last_frac: float,
    min_wait: float,
    min_z: float,
    max_culprits: int,
    period_us: float = 0.0,
    min_share: float = 0.0,
    conf_z: float = 1.645,
) -> list[StragglerFinding]:
    """The ranks of this window that were persistently last (see module docstring).

    The reference is the rank's peers in the same window, never its own history: a GPU
    slow from the very first collective stands out like one that turned slow later. A
    rank late by its role (the same position late in every replica of this
    communicator) stands out here too; the correlator tells it apart by comparing
    replicas (``StragglerEvidence.position``).

    Being last is not enough: GPUs differ by about a percent (power and clock binning),
    so one of them is last most of the time while costing nothing. With ``min_share``
    (and ``period_us`` > 0), a rank is a straggler only when the wait it causes its
    peers is, with confidence ``conf_z``, at least that share of the time between two
    collectives (:func:`wait_share`)."""
    if a.window_n_seqs < min_seqs:
        return []
    seen = a.n_seq >= min_seqs
    if seen.sum() < 3:
        return []
    frac = a.n_last / np.maximum(a.n_seq, 1)
    if not (seen & (frac >= last_frac)).any():  # nobody persistently last: the usual case
        return []
    mean_lat = np.where(seen, a.lat_sum / np.maximum(a.n_seq, 1), np.nan)
    seen_lat = mean_lat[seen]  # the finite part (np.nanmedian is ~5x slower)
    med = median(seen_lat)
    # sigma floor: 1% of kernel time, so a perfectly quiet simulator cannot make a
    # millisecond look like many standard deviations
    sigma = max(1.4826 * median(np.abs(seen_lat - med)), 0.01)
    z = (mean_lat - med) / sigma
    share = (
        wait_share(a.n_seq.astype(np.float64), a.late_us_sum, a.late_us_sq, period_us, conf_z)
        if period_us > 0
        else np.zeros(a.n)
    )
    cand = seen & (frac >= last_frac) & (mean_lat - med >= np.log1p(min_wait)) & (z >= min_z)
    if min_share > 0:
        cand &= share >= min_share
    idx = np.flatnonzero(cand)
    if idx.size == 0 or idx.size > max_culprits:
        return []
    return [
        StragglerFinding(
            int(r),
            float(frac[r]),
            float(mean_lat[r] - med),
            float(z[r]),
            int(a.n_seq[r]),
            float(a.late_us_sum[r] / max(a.n_seq[r], 1)),
            float(share[r]),
        )
        for r in idx.tolist()
    ]


class AlignerState(msgspec.Struct, array_like=True):
    n: int
    ring: int
    tag: ck.Array
    exec: ck.Array
    count: ck.Array
    opened: ck.Array
    n_seq: ck.Array
    n_last: ck.Array
    lat_sum: ck.Array
    late_us_sum: ck.Array
    exec_sum: ck.Array
    window_n_seqs: int
    window_meds: list[float]
    late_us_sq: ck.Array | None = None
    """Schema 2 on; absent in a schema-1 checkpoint (its open window is then started
    afresh: the spread of its waits is unknown)."""
    window_seq_lo: int = -1
    window_seq_hi: int = -1
    """The open window's seq span (absent in older checkpoints: the count is used)."""


def migrate_aligner_1(body: list) -> list:
    """Schema 1 -> 2 of a checkpoint whose first field is an aligner: no squared waits."""
    return [list(body[0]) + [None], *body[1:]]


class _StragglerState(msgspec.Struct, array_like=True):
    aligner: AlignerState
    step: bytes | None
    """The river quantile of per-collective median kernel time (its own plain state)."""
    long: list[ck.Array] | None = None
    """Schema 2: the decayed evidence of the last windows (:data:`_LONG`), per rank."""


_ARRAYS = ("tag", "exec", "count", "opened", "n_seq", "n_last", "lat_sum", "late_us_sum",
           "exec_sum")  # fmt: skip


def aligner_state(a: SeqAligner) -> AlignerState:
    arrays = {k: ck.pack(getattr(a, k)) for k in _ARRAYS}
    return AlignerState(n=a.n, ring=a.ring, window_n_seqs=a.window_n_seqs,
                        window_meds=list(a.window_meds), late_us_sq=ck.pack(a.late_us_sq),
                        window_seq_lo=a.window_seq_lo, window_seq_hi=a.window_seq_hi,
                        **arrays)  # fmt: skip


def aligner_from_state(s: AlignerState, config: DetectConfig) -> SeqAligner:
    """The aligner back; :class:`~streams.core.checkpoint.CheckpointError` if the arrays
    do not fit together."""
    a = SeqAligner(0, s.ring, config.min_present_frac)
    arrays = {k: ck.unpack(getattr(s, k)) for k in _ARRAYS}
    n, ring = s.n, s.ring
    want = {"tag": (ring,), "exec": (ring, n), "count": (ring,), "opened": (ring,)}
    for k, arr in arrays.items():
        if arr.shape != want.get(k, (n,)):
            raise ck.CheckpointError(f"aligner state: {k} has shape {arr.shape}")
    a.n, a.ring = n, ring
    for k, arr in arrays.items():
        setattr(a, k, arr)
    a.window_n_seqs, a.window_meds = s.window_n_seqs, list(s.window_meds)
    a.window_seq_lo, a.window_seq_hi = s.window_seq_lo, s.window_seq_hi
    a.window_med_sum = float(sum(a.window_meds))
    if s.late_us_sq is None:  # schema 1: the open window's waits start afresh
        a.reset_window()
    else:
        sq = ck.unpack(s.late_us_sq)
        if sq.shape != (n,):
            raise ck.CheckpointError(f"aligner state: late_us_sq has shape {sq.shape}")
        a.late_us_sq = sq
    return a


def pair_note(view: CommView, a: SeqAligner, start: int, end: int, period_us: float) -> Output:
    """A pipeline pair's window: both ends' mean kernel time (:class:`PairWait`), for
    the correlator to compare with the pairs across the same stage boundary."""
    t = view.ranks
    if a.window_n_seqs < 1 or (a.n_seq < 1).any() or t.n < 2:
        return []
    hosts = [t.host_of(r) or "" for r in (0, 1)]
    if not all(hosts):
        return []
    gpus = [int(g) for g in t.gpu[:2].tolist()]
    mean = (a.exec_sum / np.maximum(a.n_seq, 1)).tolist()
    note = PairWait(
        hosts=hosts, gpus=gpus, exec_ms=[round(x / 1e3, 3) for x in mean],
        collectives=int(a.window_n_seqs), period_ms=round(period_us / 1e3, 3),
    )  # fmt: skip
    reason = (
        f"{view.label}: {hosts[0]} GPU {gpus[0]} spent {mean[0] / 1e3:.1f} ms and "
        f"{hosts[1]} GPU {gpus[1]} {mean[1] / 1e3:.1f} ms per collective."
    )
    return [Observation("straggler", hosts[0], reason, start, end, note, [0, 1])]


_LONG = ("n_seq", "n_last", "late_sum", "late_sq")
"""Per rank, decayed over windows: collectives seen, collectives it was last in, and
the sum and sum of squares of the wait it caused (µs)."""


def _migrate_1(body: list) -> list:
    """Straggler checkpoint schema 1 -> 2: the aligner's squared waits and the long
    evidence did not exist (the open window and the long evidence are re-learned)."""
    return [*migrate_aligner_1(body), None]


class StragglerDetector:
    """Stragglers of one communicator, judged per window against the rank's peers.

    Fed the kernel time of every (rank, collective); per window, the rank with the
    shortest kernel time in most collectives, whose peers waited clearly longer than
    it and for a clear share of the step (see :func:`judge_stragglers`), is a
    straggler. A rank late on a minority of steps only (a GPU that throttles now and
    then) is judged on longer evidence: the last windows, decayed (``_LONG``).

    Notes (observations): GPUs that spent clearly longer than normal in this
    communicator's kernels, with whom they waited for (the stragglers found here, if
    any) — their lateness elsewhere is not their own when that one is late. A
    two-rank communicator (a pipeline Send/Recv pair) cannot name a straggler on its
    own: its note gives both ends' kernel times, which the correlator compares with
    the pairs across the same stage boundary of the other pipeline replicas. One
    finding per rank and window: a window is its own repeat interval.
    """

    name: ClassVar[str] = "straggler"
    _SCHEMA: ClassVar[int] = 2

    def __init__(self, config: DetectConfig) -> None:
        self.config = config
        self.aligner = SeqAligner(0, config.seq_ring, config.min_present_frac)
        self.step = new_quantile(0.25)
        """What peers usually spend per collective (median across ranks), learned."""
        self.long = np.zeros((len(_LONG), 0), np.float64)

    def grow(self, nranks: int) -> None:
        self.aligner.grow(nranks)
        if nranks > self.long.shape[1]:
            add = np.zeros((len(_LONG), nranks - self.long.shape[1]), np.float64)
            self.long = np.concatenate([self.long, add], axis=1)

    def learn(self, view: CommView, batch: Batch) -> None:
        if batch.rank.size == 0:
            return
        x = batch.exec_us.astype(np.float32)
        self.learn_closed(self.aligner.insert(batch.rank, batch.seq, x, view.now, batch.distinct))

    def learn_closed(self, meds: list[float]) -> None:
        """The medians of collectives the aligner just judged (the learned step)."""
        for med in meds:
            self.step.update(med)

    def tick(self, view: CommView) -> Output:
        return []

    def close_window(self, view: CommView, window: Window) -> Output:
        out: Output = []
        if window.learn:
            # judge collectives of this window that are still open with who reported
            for med in self.aligner.close_due(window.end):
                self.step.update(med)
            a = self.aligner
            self.long *= self.config.straggler_long_decay
            self.long += np.stack([a.n_seq, a.n_last, a.late_us_sum, a.late_us_sq])
            if window.judge:
                out = self._judge(view, window.start, window.end)
        self.aligner.reset_window()
        return out

    def dump(self) -> bytes:
        st = _StragglerState(aligner_state(self.aligner), quantile_state(self.step),
                             [ck.pack(x) for x in self.long])  # fmt: skip
        return ck.encode(self.name, self._SCHEMA, st)

    @classmethod
    def load(cls, data: bytes, config: DetectConfig) -> StragglerDetector:
        st = ck.decode(data, cls.name, {cls._SCHEMA: _StragglerState}, {1: _migrate_1})
        d = cls(config)
        d.aligner = aligner_from_state(st.aligner, config)
        d.step = quantile_from_state(0.25, st.step)
        n = d.aligner.n
        d.long = np.zeros((len(_LONG), n), np.float64)
        if st.long is not None:
            rows = [ck.unpack(x) for x in st.long]
            if len(rows) != len(_LONG) or any(r.shape != (n,) for r in rows):
                raise ck.CheckpointError("straggler state: long evidence does not fit")
            d.long = np.stack(rows).astype(np.float64)
        return d

    def nbytes(self) -> int:
        return self.aligner.nbytes() + self.long.nbytes + 200

    # ------------------------------------------------------------ judging
    def _step_normal(self) -> float:
        v = self.step.get()
        return float(v) if v is not None and v == v else 0.0

    def _period(self, view: CommView, start: int, end: int) -> float:
        """Time per collective this window: its span over the collectives that ran in it
        (the seq span of those judged; their count where it is larger). The mean wait
        per collective over this is the share of wall time the rank's peers lost waiting
        for it (whatever the collectives' spacing within a step). With 1 in k collectives
        judged (summarised input) the span still counts all k: the mean wait of a sample
        is the mean wait of all, so the share is the same as on raw input."""
        a = self.aligner
        n = a.window_n_seqs
        if a.window_seq_hi >= a.window_seq_lo >= 0:
            n = max(n, a.window_seq_hi - a.window_seq_lo + 1)
        if n:
            return (end - start) / n
        p = view.model.period()
        return p if p > 0 else 0.0

    def _judge(self, view: CommView, start: int, end: int) -> Output:
        cfg = self.config
        a = self.aligner
        if a.n == 2 and view.p2p:  # a pipeline pair: the correlator compares it with
            return self._pair_note(view, start, end)  # the pairs of its stage boundary
        period = self._period(view, start, end)
        found = judge_stragglers(
            a,
            cfg.straggler_min_seqs,
            cfg.straggler_last_frac,
            cfg.straggler_min_wait,
            cfg.straggler_min_z,
            max(1, int(cfg.max_culprit_frac * a.n)),
            period,
            cfg.straggler_min_share,
            cfg.straggler_confidence_z,
        )
        out: Output = []
        normal = self._step_normal()
        med_now = median(a.window_meds) if a.window_meds else 0.0
        for f in found:
            wait_x = float(np.exp(f.mean_lat))
            reason = (
                f"{view.who(f.rank)} arrived last in {f.frac_last:.0%} of {f.n_seqs} "
                f"collectives over {(end - start) / 1e6:.1f} s; its peers spent "
                f"{wait_x:.1f}x its kernel time waiting for it ({f.share:.0%} of the step "
                "or more)."
            )
            ev = StragglerEvidence(
                collectives=f.n_seqs,
                last_frac=round(f.frac_last, 3),
                peer_time_x=round(wait_x, 3),
                z=round(f.z, 1),
                peer_time_vs_normal=round(med_now / normal, 3) if normal > 0 else None,
                late_ms=round(f.late_us / 1e3, 2),
                position=f.rank,
                step_share=round(f.share, 4),
            )
            score = min(1.0, f.frac_last) * min(1.0, 0.5 + f.z / (4 * cfg.straggler_min_z))
            out.append(Finding("straggler", f.rank, score, reason, start, end, ev, [f.rank]))
        if not found:
            out += self._intermittent(view, start, end, period)
        culprits = [f.rank for f in found] + [
            x.rank for x in out if isinstance(x, Finding) and x.rank not in {f.rank for f in found}
        ]
        slow = normal > 0 and med_now >= 1.25 * normal
        return out + self._waited_notes(view, start, end, normal, culprits, slow)

    def _intermittent(self, view: CommView, start: int, end: int, period: float) -> Output:
        """A rank late on a minority of steps: from the decayed evidence of the last
        windows, the wait it caused is, with confidence, a clear share of the step, and
        it was last far more often than its share of the ranks would make it."""
        cfg = self.config
        n_seq, n_last, late_sum, late_sq = self.long
        n = self.aligner.n
        if period <= 0 or n < 3:
            return []
        enough = n_seq >= cfg.straggler_long_min_seqs
        if not enough.any():
            return []
        frac = n_last / np.maximum(n_seq, 1.0)
        share = wait_share(n_seq, late_sum, late_sq, period, cfg.straggler_confidence_z)
        # last far more often than by chance, many times over: one or two blips of a
        # healthy GPU (a one-step hiccup) are not a GPU that slows down repeatedly
        repeated = n_last - n_seq / n >= cfg.straggler_long_min_late
        cand = np.flatnonzero(
            enough & repeated & (share >= cfg.straggler_min_share)
            & (frac >= max(cfg.straggler_long_last_frac, 2.0 / n))
        )  # fmt: skip
        if cand.size == 0 or cand.size > max(1, int(cfg.max_culprit_frac * n)):
            return []
        out: Output = []
        for r in cand.tolist():
            k = float(n_last[r])
            late_ms = float(late_sum[r] / max(k, 1.0)) / 1e3  # per collective it was last in
            reason = (
                f"{view.who(r)} is intermittently late: it arrived last in {frac[r]:.0%} of "
                f"the last {n_seq[r]:.0f} collectives (about {k:.0f} times), its peers then "
                f"waiting {late_ms:.1f} ms for it; over all of them that is "
                f"{share[r]:.0%} of the step or more."
            )
            ev = StragglerEvidence(
                collectives=int(n_seq[r]),
                last_frac=round(float(frac[r]), 3),
                peer_time_x=1.0,
                late_ms=round(late_ms, 2),
                position=r,
                step_share=round(float(share[r]), 4),
                intermittent=True,
            )
            score = min(1.0, 0.5 + float(share[r]) / (4 * cfg.straggler_min_share))
            out.append(Finding("straggler", r, score, reason, start, end, ev, [r]))
        return out

    def _pair_note(self, view: CommView, start: int, end: int) -> Output:
        return pair_note(view, self.aligner, start, end, self._period(view, start, end))

    def _waited_notes(
        self, view: CommView, start: int, end: int, normal: float, culprits: list[int],
        slow: bool,
    ) -> Output:  # fmt: skip
        """Ranks that spent clearly longer than normal in this communicator's kernels
        this window (waiting for someone), and whom they waited for: ``culprits`` (the
        stragglers found here), and whether the whole communicator ran ``slow`` (then
        its connections are to blame if they are found slow). A GPU held up here
        reaches its next collective elsewhere late; that lateness is not its own."""
        a, t = self.aligner, view.ranks
        if normal <= 0 or a.window_n_seqs < self.config.straggler_min_seqs:
            return []
        mean_exec = a.exec_sum / np.maximum(a.n_seq, 1)
        extra = mean_exec - normal
        # a quarter more than normal: jitter stays below, a straggler's or a slow ring's
        # hold-up (tens of percent) above
        waited = (a.n_seq > 0) & (extra > max(0.25 * normal, 500.0))
        if culprits:
            waited[culprits] = False
        idx = np.flatnonzero(waited)
        if idx.size == 0:
            return []
        waited_for = [(t.host_of(r) or "", int(t.gpu[r])) for r in culprits]
        # Python lists once, not a numpy scalar per rank and field
        gpu_of = dict(zip(idx.tolist(), t.gpu[idx].tolist(), strict=True))
        extra_of = dict(zip(idx.tolist(), extra[idx].tolist(), strict=True))
        out: Output = []
        for hi, rs in view.by_host(idx).items():
            if hi < 0:
                continue
            gpus = [gpu_of[r] for r in rs if gpu_of[r] >= 0]
            extra_ms = [round(extra_of[r] / 1e3, 2) for r in rs if gpu_of[r] >= 0]
            if not gpus:
                continue
            reason = (
                f"{t.hosts[hi]} GPUs {gpus} spent {max(extra_ms):.1f} ms more than normal "
                f"per collective in {view.label}."
            )
            note = Waiting(gpus=gpus, extra_ms=extra_ms, waited_for=waited_for, comm_slow=slow)
            out.append(Observation("straggler", t.hosts[hi], reason, start, end, note, rs))
        return out


class AlignerGroup:
    """The aligner rings of many communicators laid out together, so that a slice's
    inserts for all of them are one numpy pass (:meth:`learn_many`) instead of about
    twenty small numpy calls per communicator.

    Each aligner's ``tag``, ``count``, ``opened`` become rows of (communicator × ring)
    matrices and its ``exec`` a band of columns of one (ring × all ranks) matrix: numpy
    views, so the aligner itself (``insert``, ``close_due``, ``grow``, its checkpoint)
    works as before and sees what the group wrote. An aligner whose arrays are no
    longer views of the group's (it grew, or came back from a checkpoint) is laid out
    again with the others of the call. The physics stays in :meth:`SeqAligner.insert`:
    the group does only its usual case (every new collective's row is free: the ring
    does not wrap within the batch) and hands anything else to the aligner itself;
    ``tests/streams/test_core_group.py`` checks the two give the same state."""

    def __init__(self) -> None:
        self.ring = -1
        self.tag = np.empty((0, 0), np.int64)
        self.count = np.empty((0, 0), np.int32)
        self.opened = np.empty((0, 0), np.int64)
        self.exec = np.empty((0, 0), np.float32)
        self._where: dict[int, tuple[int, int]] = {}
        """id(aligner) -> (its row, its first column)."""
        self._members: list[weakref.ref[SeqAligner]] = []
        self.n_layouts = 0
        self.n_grouped = 0
        self.n_alone = 0
        """Batches inserted by the grouped pass / by the aligner itself (for tests)."""

    def _alone(
        self, d: StragglerDetector, now: int, r: np.ndarray, s: np.ndarray, x: np.ndarray,
        distinct: list[int],
    ) -> None:  # fmt: skip
        """One batch as :meth:`StragglerDetector.learn` does it (on the views)."""
        d.learn_closed(d.aligner.insert(r, s, x.astype(np.float32), now, distinct))

    def _fits(self, aligners: list[SeqAligner]) -> bool:
        where = self._where
        for a in aligners:
            if (
                id(a) not in where
                or a.exec.base is not self.exec
                or a.tag.base is not self.tag
                or a.count.base is not self.count
                or a.opened.base is not self.opened
            ):
                return False
        return True

    def _lay_out(self, aligners: list[SeqAligner]) -> None:
        """Copy the aligners' rings into new shared arrays; theirs become views."""
        ring, k = aligners[0].ring, len(aligners)
        width = sum(a.n for a in aligners)
        self.ring = ring
        self.tag = np.empty((k, ring), np.int64)
        self.count = np.empty((k, ring), np.int32)
        self.opened = np.empty((k, ring), np.int64)
        self.exec = np.empty((ring, width), np.float32)
        self._where = {}
        self._members = [weakref.ref(a) for a in aligners]
        off = 0
        for i, a in enumerate(aligners):
            self.tag[i], self.count[i], self.opened[i] = a.tag, a.count, a.opened
            self.exec[:, off : off + a.n] = a.exec
            a.tag, a.count, a.opened = self.tag[i], self.count[i], self.opened[i]
            a.exec = self.exec[:, off : off + a.n]
            self._where[id(a)] = (i, off)
            off += a.n
        self.n_layouts += 1

    def learn_many(
        self, dets: list[StragglerDetector], nows: list[int], ranks: list[np.ndarray],
        seqs: list[np.ndarray], execs: list[np.ndarray], distinct: list[list[int]],
    ) -> None:  # fmt: skip
        """:meth:`StragglerDetector.learn` of each detector (a batch with ops: its
        ranks, seqs, kernel times, distinct seqs ascending; its clock ``nows``), in one
        pass for those whose batch opens only free rows (parallel lists: no object per
        communicator)."""
        aligners = [d.aligner for d in dets]
        m = len(dets)
        if len({a.ring for a in aligners}) > 1 or len(set(map(id, aligners))) < m:
            for i in range(m):  # rings of different sizes: not laid out together
                self._alone(dets[i], nows[i], ranks[i], seqs[i], execs[i], distinct[i])
            return
        if not self._fits(aligners):
            # those laid out before and untouched since stay (not laid out at every
            # slice that misses one of them); a weak reference: a communicator dropped
            # by its owner is not kept alive here
            kept = [a for a in (w() for w in self._members) if a is not None and self._fits([a])]
            new = {id(a) for a in aligners}
            self._lay_out(aligners + [a for a in kept if id(a) not in new])
        ring = self.ring
        row = np.array([self._where[id(a)][0] for a in aligners], np.int64)
        col = np.array([self._where[id(a)][1] for a in aligners], np.int64)
        sizes = np.fromiter(map(len, ranks), np.int64, m)
        seg = np.repeat(np.arange(m), sizes)
        r = np.concatenate(ranks)
        s = np.concatenate(seqs)
        slots = s % ring
        new_row = self.tag[row[seg], slots] != s
        # the batches' distinct collectives: which need a row, and is it free?
        nd = np.fromiter(map(len, distinct), np.int64, m)
        u = np.fromiter((x for d in distinct for x in d), np.int64, int(nd.sum()))
        useg = np.repeat(np.arange(m), nd)
        dstart = np.zeros(m + 1, np.int64)
        np.cumsum(nd, out=dstart[1:])
        span_ok = u[dstart[1:] - 1] - u[dstart[:-1]] < ring  # ascending: last - first
        usl = u % ring
        utag = self.tag[row[useg], usl]
        unew = utag != u
        taken = np.bincount(useg, weights=unew & (utag != -1), minlength=m) > 0
        needs = np.bincount(seg, weights=new_row, minlength=m) > 0
        alone = needs & (taken | ~span_ok)  # the ring wraps or is full: the aligner's way
        for i in np.flatnonzero(alone).tolist():
            self._alone(dets[i], nows[i], ranks[i], seqs[i], execs[i], distinct[i])
        self.n_alone += int(alone.sum())
        self.n_grouped += m - int(alone.sum())
        # open the new collectives' rows (all free), then write every kernel time
        op = unew & ~alone[useg]
        oi, osl = useg[op], usl[op]
        self.tag[row[oi], osl] = u[op]
        self.count[row[oi], osl] = 0
        self.opened[row[oi], osl] = np.array(nows, np.int64)[oi]
        width = np.fromiter((a.n for a in aligners), np.int64, m)[oi]
        starts = np.zeros(len(oi) + 1, np.int64)
        np.cumsum(width, out=starts[1:])
        band = np.repeat(col[oi] - starts[:-1], width) + np.arange(int(starts[-1]))
        self.exec[np.repeat(osl, width), band] = np.nan
        keep = ~alone[seg]
        x = np.concatenate(execs).astype(np.float32)
        ks, kslot = seg[keep], slots[keep]
        self.exec[kslot, col[ks] + r[keep]] = x[keep]
        flat = np.bincount(row[ks] * ring + kslot, minlength=self.tag.size)
        self.count += flat.reshape(self.tag.shape).astype(np.int32)
