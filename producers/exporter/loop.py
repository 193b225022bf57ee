"""The exporter's main loop: poll, sleep a little, stop cleanly on SIGTERM/SIGINT.

On a signal the loop finishes its step, publishes what is pending, waits for Kafka to
acknowledge it and saves the positions (:meth:`Exporter.close`), then returns.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from c4base.metrics import Metrics
from producers.exporter.core import Exporter, ExporterConfig, ExporterStats

__all__ = ["run_exporter"]

log = logging.getLogger(__name__)


def run_exporter(
    config: ExporterConfig,
    *,
    stop: threading.Event | None = None,
    poll_s: float | None = None,
    metrics: Metrics | None = None,
) -> ExporterStats:
    """Run until ``stop`` is set or SIGTERM/SIGINT arrives; returns the final counts.

    Signal handlers are installed only when called from the main thread. With
    ``metrics``, the counters are brought up to date after every step.
    """
    stop = stop or threading.Event()
    poll_s = poll_s if poll_s is not None else min(0.2, config.interval_s / 5)
    previous: dict[int, object] = {}

    exporter = Exporter(config, metrics=metrics)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: flushing and stopping", signum)
        stop.set()
        exporter.request_stop()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        while not stop.is_set():
            exporter.poll_once()
            exporter.sync_metrics()
            stop.wait(poll_s)
    finally:
        exporter.request_stop()
        exporter.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
    return exporter.stats
