"""Consumer lag and processing latency for the ``c4stream_consumer_lag`` and
``c4stream_processing_latency_seconds`` families.

Lag of a partition = its high watermark − the consumer's position (the next offset it
will read). :class:`LagMonitor` samples it every ``interval_s`` from inside the
consuming loop (confluent-kafka consumers are driven by one thread), with one
watermark query per assigned partition; partitions no longer assigned drop their
series so a rebalance leaves no stale gauges behind.

>>> from c4base.metrics import Metrics
>>> m = Metrics()
>>> observe_latency(m, "actuator", ts_us=1_000_000, now_s=3.5)
>>> b'c4stream_processing_latency_seconds_sum{stage="actuator"} 2.5' in m.render()
True
>>> lag_of(high=120, position=100, committed=-1001)
20
>>> lag_of(high=120, position=-1001, committed=90)   # nothing consumed yet: use the commit
30
>>> lag_of(high=120, position=-1001, committed=-1001) is None
True
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from c4base.metrics import Metrics

__all__ = ["LagMonitor", "lag_of", "observe_latency"]

log = logging.getLogger(__name__)


def observe_latency(
    metrics: Metrics, stage: str, *, ts_us: int, now_s: float | None = None
) -> None:
    """Observe ``now − ts_us`` (event or command production time, wall clock)."""
    now = time.time() if now_s is None else now_s
    metrics.latency.labels(stage=stage).observe(max(0.0, now - ts_us / 1e6))


def lag_of(*, high: int, position: int, committed: int) -> int | None:
    """Messages behind on one partition; None when the consumer has no offset there yet
    (librdkafka reports a missing offset as a negative number)."""
    start = position if position >= 0 else committed
    if high < 0 or start < 0:
        return None
    return max(0, high - start)


class LagMonitor:
    """Samples the lag of every assigned partition of ``consumer`` into ``metrics``."""

    def __init__(
        self,
        consumer: Any,
        metrics: Metrics,
        stage: str,
        *,
        interval_s: float = 5.0,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.consumer = consumer
        self.metrics = metrics
        self.stage = stage
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._next = clock()  # first sample at the first call
        self._series: set[tuple[str, int]] = set()

    def maybe_update(self) -> None:
        """Sample if ``interval_s`` has passed; never raises (lag is not worth a crash)."""
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.interval_s
        try:
            self.update()
        except Exception as err:  # broker away, consumer closing: try again next time
            log.debug("consumer lag not sampled: %s", err)

    def update(self) -> dict[tuple[str, int], int]:
        """Sample now; returns ``{(topic, partition): lag}``."""
        tps = self.consumer.assignment()
        out: dict[tuple[str, int], int] = {}
        if tps:
            positions = self.consumer.position(tps)
            committed: dict[tuple[str, int], int] = {}
            if any(tp.offset < 0 for tp in positions):
                committed = {
                    (tp.topic, tp.partition): tp.offset
                    for tp in self.consumer.committed(tps, timeout=self.timeout_s)
                }
            for tp in positions:
                key = (tp.topic, tp.partition)
                _low, high = self.consumer.get_watermark_offsets(
                    tp, timeout=self.timeout_s, cached=False
                )
                lag = lag_of(high=high, position=tp.offset, committed=committed.get(key, -1))
                if lag is not None:
                    out[key] = lag
        gauge = self.metrics.consumer_lag
        for topic, partition in self._series - set(out):
            gauge.remove(self.stage, topic, str(partition))
        for (topic, partition), lag in out.items():
            gauge.labels(stage=self.stage, topic=topic, partition=str(partition)).set(lag)
        self._series = set(out)
        return out
