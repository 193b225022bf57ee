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

import numpy as np

from streams.core.stats import median

__all__ = ["SeqAligner", "StragglerFinding", "judge_stragglers"]


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
        self.base_lat = np.zeros(nranks, np.float32)
        """Each rank's usual lateness (EWMA of its window mean log-lateness)."""
        self.base_n = np.zeros(nranks, np.int16)
        """Windows each rank's usual lateness was learned from (capped)."""
        self.reset_window()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "base_lat" not in state:  # a checkpoint from before the learned lateness
            self.base_lat = np.zeros(self.n, np.float32)
            self.base_n = np.zeros(self.n, np.int16)

    def learn_lateness(self, min_seqs: int, alpha: float) -> None:
        """Fold this window's mean lateness of each rank into its usual lateness (call it
        only for windows without a straggler verdict). The first windows weigh
        1, 1/2, 1/3, ... then ``alpha``: a quick start, then a slow drift."""
        seen = self.n_seq >= min_seqs
        if not seen.any():
            return
        mean = self.lat_sum[seen] / self.n_seq[seen]
        w = np.maximum(alpha, 1.0 / (self.base_n[seen] + 1.0))
        b = self.base_lat[seen]
        self.base_lat[seen] = b + w * (mean - b)
        self.base_n[seen] = np.minimum(self.base_n[seen] + 1, 1000)

    def reset_window(self) -> None:
        self.n_seq = np.zeros(self.n, np.int32)
        self.n_last = np.zeros(self.n, np.int32)
        self.lat_sum = np.zeros(self.n, np.float64)
        self.late_us_sum = np.zeros(self.n, np.float64)
        self.exec_sum = np.zeros(self.n, np.float64)
        self.window_n_seqs = 0
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
        self.exec_sum = np.concatenate([self.exec_sum, np.zeros(add, np.float64)])
        self.base_lat = np.concatenate([self.base_lat, np.zeros(add, np.float32)])
        self.base_n = np.concatenate([self.base_n, np.zeros(add, np.int16)])
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
        self.tag[slots] = -1
        self.count[slots] = 0
        present = x > 0  # False for NaN (not reported) too
        n_present = present.sum(axis=1)
        keep = n_present >= max(2, self.min_present_frac * self.n)
        if not keep.all():
            if not keep.any():
                return []
            x, present, n_present = x[keep], present[keep], n_present[keep]
        absent = ~present
        x[absent] = np.nan
        med = _row_median(x, n_present)
        # absent ranks take the median: log(med/med) = 0 and med - med = 0 exactly, so
        # they add nothing to the sums below (one fill instead of a np.where per sum)
        m = med[:, None]
        xf = np.where(present, x, m)
        lat = np.clip(np.log(m / xf), -5.0, 5.0)  # > 0: this rank spent less than its peers
        self.lat_sum += lat.sum(axis=0)
        self.late_us_sum += (m - xf).sum(axis=0)
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
            + self.base_lat.nbytes
            + self.base_n.nbytes
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

    __slots__ = ("rank", "frac_last", "mean_lat", "z", "n_seqs", "late_us")

    def __init__(
        self, rank: int, frac_last: float, mean_lat: float, z: float, n_seqs: int, late_us: float
    ):
        self.late_us = late_us
        """Mean time (µs) its peers spent waiting for it per collective."""
        self.rank = rank
        self.frac_last = frac_last
        self.mean_lat = mean_lat
        self.z = z
        self.n_seqs = n_seqs


def judge_stragglers(
    a: SeqAligner,
    min_seqs: int,
    last_frac: float,
    min_wait: float,
    min_z: float,
    max_culprits: int,
    learned: bool = True,
) -> list[StragglerFinding]:
    """The ranks of this window that were persistently last (see module docstring).

    With ``learned``, each rank's lateness is scored against its own usual lateness
    (:meth:`SeqAligner.learn_lateness`): a rank that is always a little late by design
    (less compute, a longer path) is normal for this communicator; and a rank without a
    learned baseline yet is not judged."""
    if a.window_n_seqs < min_seqs:
        return []
    seen = a.n_seq >= min_seqs
    if learned:
        seen &= a.base_n > 0
    if seen.sum() < 3:
        return []
    frac = a.n_last / np.maximum(a.n_seq, 1)
    if not (seen & (frac >= last_frac)).any():  # nobody persistently last: the usual case
        return []
    mean_lat = np.where(seen, a.lat_sum / np.maximum(a.n_seq, 1), np.nan)
    if learned:
        mean_lat -= a.base_lat
    seen_lat = mean_lat[seen]  # the finite part (np.nanmedian is ~5x slower)
    med = median(seen_lat)
    # sigma floor: 1% of kernel time, so a perfectly quiet simulator cannot make a
    # millisecond look like many standard deviations
    sigma = max(1.4826 * median(np.abs(seen_lat - med)), 0.01)
    z = (mean_lat - med) / sigma
    cand = np.flatnonzero(
        seen & (frac >= last_frac) & (mean_lat - med >= np.log1p(min_wait)) & (z >= min_z)
    )
    if cand.size == 0 or cand.size > max_culprits:
        return []
    return [
        StragglerFinding(
            int(r),
            float(frac[r]),
            float(mean_lat[r] - med),
            float(z[r]),
            int(a.n_seq[r]),
            float(a.late_us_sum[r] / max(a.n_seq[r], 1)),
        )
        for r in cand.tolist()
    ]
