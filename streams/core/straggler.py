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

from typing import ClassVar

import msgspec
import numpy as np

from streams.core import checkpoint as ck
from streams.core.aligner import (
    AlignerGroup,
    AlignerState,
    SeqAligner,
    aligner_from_state,
    aligner_state,
    migrate_aligner_1,
)
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


class _StragglerState(msgspec.Struct, array_like=True):
    aligner: AlignerState
    step: bytes | None
    """The river quantile of per-collective median kernel time (its own plain state)."""
    long: list[ck.Array] | None = None
    """Schema 2: the decayed evidence of the last windows (:data:`_LONG`), per rank."""


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
