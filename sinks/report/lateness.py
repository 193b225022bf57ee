"""Per-rank lateness over time, read from kernel durations only.

Host clocks are not synchronized, so arrival order comes from durations: every rank of
a collective finishes together, so a rank that arrived ``d`` later than the first one
shows a kernel time ``d`` shorter. For op (comm, seq), rank r's lateness is
``max(exec_us) - exec_us[r]``.

Worked example, four ranks of one AllReduce with kernel times 900, 910, 400 and 905 µs:
rank 2 arrived about half a millisecond after the others.

>>> from producers.events import OpEvent
>>> evs = [OpEvent(v=1, job="j", comm="c", nranks=4, rank=r, host=f"h{r}", ts_us=0,
...                op="AllReduce", seq=0, bytes=1, exec_us=x)
...        for r, x in enumerate([900.0, 910.0, 400.0, 905.0])]
>>> (m,) = lateness_maps(evs, bin_s=1.0)
>>> m.lateness_ms[:, 0].round(3).tolist()
[0.01, 0.0, 0.51, 0.005]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from producers.events import Event, OpEvent

__all__ = ["LatenessMap", "lateness_maps"]


@dataclass(frozen=True, slots=True)
class LatenessMap:
    comm: str
    comm_name: str | None
    hosts: list[str]
    """Host of each rank (index = rank)."""
    t0_us: int
    bin_s: float
    lateness_ms: np.ndarray
    """Shape (nranks, nbins): mean lateness per rank per time bin; NaN where no op."""


def lateness_maps(events: Iterable[Event], bin_s: float = 1.0) -> list[LatenessMap]:
    """One map per communicator that has op events with at least two ranks."""
    cols: dict[str, list[tuple[int, int, float, int]]] = defaultdict(list)
    meta: dict[str, tuple[int, str | None]] = {}
    hosts: dict[str, dict[int, str]] = defaultdict(dict)
    for ev in events:
        if not isinstance(ev, OpEvent):
            continue
        cols[ev.comm].append((ev.seq, ev.rank, ev.exec_us, ev.ts_us))
        meta[ev.comm] = (ev.nranks, ev.comm_name)
        hosts[ev.comm][ev.rank] = ev.host
    out: list[LatenessMap] = []
    for comm, rows in cols.items():
        nranks, name = meta[comm]
        if nranks < 2:
            continue
        a = np.asarray(rows, dtype=np.float64)
        seq, rank, exec_us, ts = a[:, 0], a[:, 1].astype(np.int64), a[:, 2], a[:, 3]
        # max exec per seq, broadcast back to rows
        useq, inv = np.unique(seq, return_inverse=True)
        max_exec = np.full(len(useq), -np.inf)
        np.maximum.at(max_exec, inv, exec_us)
        late_ms = (max_exec[inv] - exec_us) / 1000.0
        t0 = int(ts.min())
        nbins = int((ts.max() - t0) / (bin_s * 1e6)) + 1
        b = ((ts - t0) / (bin_s * 1e6)).astype(np.int64)
        total = np.zeros((nranks, nbins))
        count = np.zeros((nranks, nbins))
        ok = rank < nranks
        np.add.at(total, (rank[ok], b[ok]), late_ms[ok])
        np.add.at(count, (rank[ok], b[ok]), 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(count > 0, total / count, np.nan)
        host_list = [hosts[comm].get(r, "?") for r in range(nranks)]
        out.append(LatenessMap(comm, name, host_list, t0, bin_s, mean))
    out.sort(key=lambda m: m.comm_name or m.comm)
    return out
