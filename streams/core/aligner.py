"""The straggler detector's alignment of kernel times per collective, and its state.

:class:`SeqAligner` keeps, per communicator, a ring of recent collectives (by ``seq``)
and every rank's kernel time in each; a collective closes once enough ranks reported or
it aged out, and its ranks' lateness (log of the median over their own time) adds into
the open window's counts (:mod:`streams.core.straggler` judges them).
:class:`AlignerGroup` lays out many communicators' rings together so a slice's inserts
are one numpy pass; ``tests/streams/test_core_group.py`` checks both give one state.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from streams.core import checkpoint as ck
from streams.core.config import DetectConfig

if TYPE_CHECKING:
    from streams.core.straggler import StragglerDetector

__all__ = [
    "AlignerGroup",
    "AlignerState",
    "SeqAligner",
    "aligner_from_state",
    "aligner_state",
    "migrate_aligner_1",
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
