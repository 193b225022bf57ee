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
>>> m.op_p99() >= 100.0
True
"""

from __future__ import annotations

import math

import numpy as np
from river import stats as rstats

__all__ = ["NormalModel", "mad_sigma", "robust_z", "stable_id"]

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma


def mad_sigma(x: np.ndarray, floor: float = 0.0) -> float:
    """Robust standard deviation of ``x`` (NaNs ignored), never below ``floor``."""
    med = np.nanmedian(x)
    return max(float(MAD_TO_SIGMA * np.nanmedian(np.abs(x - med))), floor)


def robust_z(x: np.ndarray, floor: float = 1e-9) -> np.ndarray:
    """How many robust standard deviations each value stands above the median."""
    med = np.nanmedian(x)
    return (x - med) / mad_sigma(x, floor)


def stable_id(*parts: object) -> str:
    """A short deterministic id from the parts (same parts → same id, across runs).

    >>> stable_id("job", "node-001", 3) == stable_id("job", "node-001", 3)
    True
    """
    import hashlib

    text = "\x1f".join("" if p is None else str(p) for p in parts)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class NormalModel:
    """What is normal for one communicator, learned online (river, O(1) state).

    - ``op``: kernel time of one collective on one rank (p50 and p99);
    - ``period``: time between two consecutive collectives on one rank (own clock);
    - ``step``: per-collective median kernel time across ranks (what peers usually spend).

    The hang threshold is a multiple of ``max(op p99, period p50)``; the step median is
    the "normal time" against which peers' waiting is reported.
    """

    def __init__(self) -> None:
        self._op50 = rstats.Quantile(0.5)
        self._op99 = rstats.Quantile(0.99)
        self._period = rstats.Quantile(0.5)
        self._step = rstats.Quantile(0.25)
        self.n_ops = 0
        self.n_periods = 0

    def learn_op(self, exec_us: float) -> None:
        self._op50.update(exec_us)
        self._op99.update(exec_us)
        self.n_ops += 1

    def learn_ops(self, exec_us: np.ndarray, max_samples: int = 8) -> None:
        """Learn from a batch, thinned to ``max_samples`` evenly spaced values (cost bound)."""
        if exec_us.size == 0:
            return
        step = max(1, exec_us.size // max_samples)
        for x in exec_us[::step].tolist():
            self.learn_op(x)

    def learn_periods(self, periods_us: np.ndarray, max_samples: int = 8) -> None:
        if periods_us.size == 0:
            return
        step = max(1, periods_us.size // max_samples)
        for x in periods_us[::step].tolist():
            self._period.update(x)
            self.n_periods += 1

    def learn_step(self, median_exec_us: float) -> None:
        self._step.update(median_exec_us)

    def op_p50(self) -> float:
        return float(self._op50.get() or 0.0) if self.n_ops else 0.0

    def op_p99(self) -> float:
        return float(self._op99.get() or 0.0) if self.n_ops else 0.0

    def period(self) -> float:
        return float(self._period.get() or 0.0) if self.n_periods else 0.0

    def step_normal(self) -> float:
        v = self._step.get()
        return float(v) if v is not None and not math.isnan(v) else 0.0

    def hang_threshold_us(self, floor_us: int, mult: float) -> float:
        """In-flight time beyond which a collective counts as hung for this communicator."""
        return max(float(floor_us), mult * max(self.op_p99(), self.period()))
