"""Node exporter: follows an NCCL Inspector dump directory and publishes its events.

* :mod:`~producers.exporter.tail` — following files (appends, rotation, truncation);
* :mod:`~producers.exporter.positions` — where it is in each file, saved atomically;
* :mod:`~producers.exporter.publisher` — the confluent-kafka producer (shared with replay);
* :mod:`~producers.exporter.core` — :class:`Exporter`, one step per ``poll_once()``;
* :mod:`~producers.exporter.loop` — :func:`run_exporter`, the loop with signal handling.
"""

from __future__ import annotations

from producers.exporter.core import Exporter, ExporterConfig, ExporterStats
from producers.exporter.loop import run_exporter

__all__ = ["Exporter", "ExporterConfig", "ExporterStats", "run_exporter"]
