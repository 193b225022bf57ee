"""The ring model of a synchronous collective, and job-wide pauses.

A ring AllReduce of ``size`` bytes over ``n`` ranks moves ``2(n-1)/n * size`` bytes
over every link of the ring, pipelined, so it runs at the pace of the slowest link.
It cannot start before its last member arrives, so::

    end     = max(arrival) + 2(n-1)/n * size / min(link bandwidth)
    exec_us = end - own arrival        (per rank, by its own clock)

A late rank therefore shows the *shortest* kernel time and its peers the longest —
the straggler syndrome of C4, readable without synchronized clocks.

>>> import numpy as np
>>> arrival = np.array([[0.0, 0.1, 0.3]])          # rank 2 is 0.3 s late
>>> bw = np.full((1, 3), 25e9)
>>> end, _ = ring_end(arrival, ring_bytes(100e6, 3) / bw.min(axis=1), Pauses.none())
>>> np.round((end[:, None] - arrival) * 1e3, 2)   # exec in ms: the late rank is fastest
array([[305.33, 205.33,   5.33]])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Pauses", "ring_bytes", "ring_end"]


def ring_bytes(size: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring AllReduce of ``size`` bytes."""
    return 2.0 * (n - 1) / n * size


@dataclass(frozen=True)
class Pauses:
    """Job-wide pauses (checkpoints): no rank computes or moves bytes inside one.

    :meth:`finish` maps work of ``span`` seconds started at ``start`` to its end time,
    skipping every pause it meets (work started inside a pause waits for its end).

    >>> p = Pauses(np.array([10.0]), np.array([15.0]))
    >>> p.finish(np.array([9.0, 11.0, 3.0]), np.array([2.0, 1.0, 1.0]))
    array([16., 16.,  4.])
    """

    starts: np.ndarray
    ends: np.ndarray

    @classmethod
    def none(cls) -> Pauses:
        return cls(np.empty(0), np.empty(0))

    def finish(self, start: np.ndarray, span: np.ndarray) -> np.ndarray:
        if not len(self.starts):
            return start + span
        start = start.copy()
        end = start + span
        for ps, pe in zip(self.starts, self.ends, strict=True):
            inside = (start >= ps) & (start < pe)
            shift = np.where(inside, pe - start, 0.0)
            shift = np.where((start < ps) & (end > ps), pe - ps, shift)
            start = start + shift
            end = end + shift
        return end


def ring_end(
    arrival: np.ndarray, transfer_s: np.ndarray, pauses: Pauses
) -> tuple[np.ndarray, np.ndarray]:
    """End time of each group's collective: last arrival plus the transfer time.

    ``arrival`` is (groups, members), ``transfer_s`` (groups,). Returns (end, last
    arrival); a group with a member that never arrives (``inf``) never ends.
    """
    last = arrival.max(axis=1)
    with np.errstate(invalid="ignore"):
        end = pauses.finish(last, transfer_s)
    end[~np.isfinite(last)] = np.inf
    return end, last
