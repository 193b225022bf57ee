"""Robust statistics across ranks and the online models of a communicator's normal.

Across ranks we use the median and the MAD (scaled to a standard deviation for
normal data, 1.4826·MAD), which one bad rank cannot drag; over time we use river's
running quantiles and exponentially weighted means, which hold O(1) state.

>>> import numpy as np
>>> z = robust_z(np.array([1.0, 1.1, 0.9, 1.0, 5.0]))
>>> int(np.argmax(z)), bool(z[4] > 10)
(4, True)
>>> m = NormalModel()
>>> for x in [100.0] * 50: m.learn_op(x)
>>> m.op_p90() >= 100.0
True
"""

from __future__ import annotations

import math
from hashlib import blake2b
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from streams.core.checkpoint import CheckpointError

if TYPE_CHECKING:
    from river import stats as rstats

__all__ = [
    "NormalModel",
    "NormalState",
    "mad_sigma",
    "median",
    "new_quantile",
    "quantile_from_state",
    "quantile_state",
    "robust_z",
    "slow_score",
    "stable_id",
]

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma


def median(x: np.ndarray | list[float]) -> float:
    """Median of finite values, equal to ``np.median`` (the mean of the two middle values
    of an even count) but without its per-call overhead (~10x on the small arrays here).

    >>> median(np.array([3.0, 1.0, 2.0, 10.0])), float(np.median([3.0, 1.0, 2.0, 10.0]))
    (2.5, 2.5)
    >>> median([4.0])
    4.0
    """
    a = np.sort(np.asarray(x, np.float64))
    n = a.size
    if n == 0:
        return float("nan")
    return float(0.5 * (a[(n - 1) // 2] + a[n // 2]))


def mad_sigma(x: np.ndarray, floor: float = 0.0) -> float:
    """Robust standard deviation of ``x`` (NaNs ignored), never below ``floor``."""
    med = np.nanmedian(x)
    return max(float(MAD_TO_SIGMA * np.nanmedian(np.abs(x - med))), floor)


def robust_z(x: np.ndarray, floor: float = 1e-9) -> np.ndarray:
    """How many robust standard deviations each value stands above the median."""
    med = np.nanmedian(x)
    return (x - med) / mad_sigma(x, floor)


def slow_score(ratio: float, slow_ratio: float) -> float:
    """Score of a connection (or NIC) moving ``ratio`` of its reference throughput, below
    ``slow_ratio``: 0.7 just under the bar, 1.0 from 25 points under. Two windows under
    the bar are enough evidence (the policy's 1.4); one is, for a NIC slow in its own
    right (:func:`streams.core.rails.whole_nic`).

    >>> slow_score(0.74, 0.75), slow_score(0.4, 0.75)
    (0.712, 1.0)
    """
    return round(min(1.0, 0.7 + 1.2 * max(0.0, slow_ratio - ratio)), 3)


def stable_id(*parts: object) -> str:
    """A short deterministic id from the parts (same parts → same id, across runs).

    >>> stable_id("job", "node-001", 3) == stable_id("job", "node-001", 3)
    True
    """
    text = "\x1f".join(["" if p is None else str(p) for p in parts])
    return blake2b(text.encode(), digest_size=8).hexdigest()


class NormalState(msgspec.Struct, array_like=True):
    op50: bytes | None
    op90: bytes | None
    period: bytes | None
    n_ops: int
    n_periods: int
    peak_us: float = 0.0
    """The longest kernel time seen lately (decayed), and when it was last updated."""
    peak_at: int = -1
    peak_ops: int = 0
    """``n_ops`` when the peak was last updated (it decays per kernel time learned too)."""


def new_quantile(p: float) -> rstats.Quantile:
    """A river P² quantile of ``p``. river is imported on the first call, not with the
    core: `c4stream detect` on a Flight Recorder snapshot never builds one."""
    from river import stats

    return stats.Quantile(p)


def quantile_state(q: rstats.Quantile) -> bytes | None:
    """A river ``Quantile``'s state as plain bytes (None before its first value).

    river keeps the P² markers in Rust; its ``__getstate__`` gives them as five
    positions and heights packed as floats, which ``__setstate__`` reads back
    without running any code (unlike unpickling)."""
    if not q._is_updated:
        return None
    return bytes(q._quantile.__getstate__())


def quantile_from_state(p: float, data: bytes | None) -> rstats.Quantile:
    """The quantile back from :func:`quantile_state`; ``CheckpointError`` if unreadable.

    >>> q = new_quantile(0.5)
    >>> for x in range(1, 100): q.update(float(x))
    >>> quantile_from_state(0.5, quantile_state(q)).get() == q.get()
    True
    """
    q = new_quantile(p)
    if data is None:
        return q
    # checked here, not by Rust: its decoder panics (loudly) on short input. Layout:
    # the quantile, 4 x 5 markers (f64, little-endian), the count (<= 5), a flag.
    if len(data) != _P2_BYTES or data[-1] > 1 or data[-2] > 5:
        raise CheckpointError(f"quantile state of {len(data)} bytes is not a P2 state")
    floats = np.frombuffer(data[: _P2_BYTES - 2], "<f8")
    if floats[0] != p or not np.isfinite(floats).all():
        raise CheckpointError(f"quantile state is not a finite p{p * 100:g} state")
    try:
        q._quantile.__setstate__(data)
    except BaseException as err:  # a Rust decode error surfaces as a panic exception
        if isinstance(err, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(f"quantile state unreadable: {err}") from None
    q._is_updated = True
    return q


_P2_BYTES = 8 + 4 * 5 * 8 + 2


CLIP_X = 8.0
"""Learned normals take a sample at most this many times their current p90 (op time)
or median (period) as it is; beyond, as that much (winsorized)."""
CLIP_AFTER = 32
"""...once this many samples were learned (before, nothing is known to clip against)."""
PEAK_MULT = 1.5
PEAK_TAU_PERIODS = 20.0
PEAK_TAU_OPS = 512
"""The recent peak decays by e no faster than every this many kernel times learned
(256 collectives of a two-rank pair): the longest wait of a pipeline pair, its bubble at
the step boundary, recurs once a step, which holds 2 x microbatches of its collectives;
with 60-s steps a minute is one step, and a peak forgotten within a step lets the next
bubble pass for a hang."""


class NormalModel:
    """What is normal for one communicator, learned online (river, O(1) state).

    - ``op``: kernel time of one collective on one rank (p50 and p90);
    - ``period``: time between two consecutive collectives on one rank (own clock);

    The hang threshold is a multiple of ``max(op p90, period p50)``. Checkpointed with
    :meth:`state` / :meth:`from_state` (the quantiles' own plain state, no pickle).
    """

    def __init__(self) -> None:
        self._op50 = new_quantile(0.5)
        # p90, not p99: a few hundred samples cannot hold a stable p99, and one slow
        # collective (a checkpoint: 4 s against 30 ms) sets it for minutes, pushing the
        # hang threshold to 15 s (seen at 1,024 GPUs); p90 shrugs it off
        self._op90 = new_quantile(0.9)
        self._period = new_quantile(0.5)
        self.n_ops = 0
        self.n_periods = 0
        self.peak_us = 0.0
        self.peak_at = -1
        self.peak_ops = 0

    def state(self) -> NormalState:
        return NormalState(
            op50=quantile_state(self._op50),
            op90=quantile_state(self._op90),
            period=quantile_state(self._period),
            n_ops=self.n_ops,
            n_periods=self.n_periods,
            peak_us=self.peak_us,
            peak_at=self.peak_at,
            peak_ops=self.peak_ops,
        )

    @classmethod
    def from_state(cls, st: NormalState) -> NormalModel:
        m = cls()
        m._op50 = quantile_from_state(0.5, st.op50)
        m._op90 = quantile_from_state(0.9, st.op90)
        m._period = quantile_from_state(0.5, st.period)
        m.n_ops, m.n_periods = st.n_ops, st.n_periods
        m.peak_us, m.peak_at, m.peak_ops = st.peak_us, st.peak_at, st.peak_ops
        return m

    def learn_op(self, exec_us: float) -> None:
        exec_us = min(exec_us, self._op_clip())
        self._op50.update(exec_us)
        self._op90.update(exec_us)
        self.n_ops += 1

    def _op_clip(self) -> float:
        """Largest op time learned as it is: beyond :data:`CLIP_X` times the current p90
        (once :data:`CLIP_AFTER` samples are in) a value counts as that much. The
        quantile sketches (P²) follow a huge sample's height: ten ops claiming
        ``exec_us = 1e15`` among thousands moved p90 from 22 ms to 1,087 s and hid a
        hang; clipped, they move it by 1%, and a real change of regime is still
        followed (the clip rises with p90)."""
        if self.n_ops < CLIP_AFTER:
            return float("inf")
        return CLIP_X * max(self.op_p90(), 1.0)

    def learn_ops(self, exec_us: np.ndarray, max_samples: int = 8) -> None:
        """Learn from a batch, thinned to ``max_samples`` evenly spaced values (cost bound),
        each clipped (:meth:`_op_clip`)."""
        if exec_us.size == 0:
            return
        step = max(1, exec_us.size // max_samples)
        xs = np.minimum(exec_us[::step], self._op_clip()).tolist()
        u50, u90 = self._op50.update, self._op90.update  # bound once: this runs per batch
        for x in xs:
            u50(x)
            u90(x)
        self.n_ops += len(xs)

    def learn_periods(self, periods_us: np.ndarray, max_samples: int = 8) -> None:
        if periods_us.size == 0:
            return
        step = max(1, periods_us.size // max_samples)
        clip = CLIP_X * max(self.period(), 1.0) if self.n_periods >= CLIP_AFTER else np.inf
        xs = np.minimum(periods_us[::step], clip).tolist()  # as ops: outliers cannot lead
        update = self._period.update
        for x in xs:
            update(x)
        self.n_periods += len(xs)

    def op_p50(self) -> float:
        return float(self._op50.get() or 0.0) if self.n_ops else 0.0

    def op_p90(self) -> float:
        return float(self._op90.get() or 0.0) if self.n_ops else 0.0

    def period(self) -> float:
        return float(self._period.get() or 0.0) if self.n_periods else 0.0

    def note_peak(self, exec_max: float, now: int) -> None:
        """The longest kernel time of a batch, at event time ``now``: the recent peak,
        decaying by e every :data:`PEAK_TAU_PERIODS` periods (at least a minute) and
        every :data:`PEAK_TAU_OPS` kernel times, whichever is slower, so a one-off (a
        checkpoint's 30-s collective) is forgotten within minutes on a busy
        communicator, while a wait that recurs once a step is remembered over steps."""
        if self.peak_at >= 0 and now > self.peak_at:
            tau = max(60e6, PEAK_TAU_PERIODS * self.period())
            decay = min((now - self.peak_at) / tau, (self.n_ops - self.peak_ops) / PEAK_TAU_OPS)
            self.peak_us *= math.exp(-max(decay, 0.0))
        if exec_max > self.peak_us:
            self.peak_us = float(exec_max)
        if now >= self.peak_at:
            self.peak_at, self.peak_ops = now, self.n_ops

    def hang_threshold_us(self, floor_us: int, mult: float) -> float:
        """In-flight time beyond which a collective counts as hung for this communicator:
        ``mult`` times its p90 kernel time or its period, and at least
        :data:`PEAK_MULT` times the longest kernel time seen lately. The last term is
        for communicators whose longest normal waits are rare: a pipeline pair waits a
        whole bubble once a step, fewer than one collective in ten."""
        return max(float(floor_us), mult * max(self.op_p90(), self.period()),
                   PEAK_MULT * self.peak_us)  # fmt: skip
