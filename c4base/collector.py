"""The garbage collector as the long-running stages run it: the first threshold raised,
and what exists at start (modules, the app) frozen out of the collector's view.

Python's default first threshold (700) runs the collector every few hundred container
objects. The stages allocate several objects per message that die young by their last
reference (no cycle), so at 700 the collector mostly walks live state for nothing: its
passes cost ~12% of a worker's CPU on an Arrow backlog (bench/bench_scaleout.py) and
15–40% of a ``c4stream detect`` run (bench_columnar, 1,024 GPUs). The worker process
(``[worker] gc_gen0_threshold``), ``detect`` and the benchmarks that measure the worker's
parts all take their threshold from here, so a figure measured in a bench is the one the
worker has.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["GEN0_THRESHOLD", "collector_tuned", "tune_collector"]

GEN0_THRESHOLD = 20_000
"""The first threshold by default (container objects allocated, net, between passes)."""


def tune_collector(gen0: int = GEN0_THRESHOLD) -> None:
    """For the rest of the process: what exists now frozen (``gc.freeze``), the first
    threshold ``gen0``."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0, *gc.get_threshold()[1:])


@contextmanager
def collector_tuned(gen0: int = GEN0_THRESHOLD) -> Iterator[None]:
    """The first threshold ``gen0``, and what exists before out of the collector's view,
    for the length of the block; both undone after (a process that froze objects itself
    keeps them frozen: then nothing is frozen here)."""
    before = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(gen0, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        if freeze:
            gc.unfreeze()
