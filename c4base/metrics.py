"""Prometheus metrics every service exposes, and the endpoint that serves them.

One set of metric families shared by all stages, labelled by ``stage``, so one
Grafana dashboard (compose/grafana/c4stream-dashboard.json) covers the whole pipeline. The
endpoint binds to 127.0.0.1 unless told otherwise: metrics are not for the world.

>>> m = Metrics()
>>> m.events_in.labels(stage="worker").inc(3)
>>> b"c4stream_events_in_total" in m.render()
True

A counter with labels appears only once a label set is used, so a service calls
:meth:`Metrics.prime` at start: its stage's counters are exported at 0 from the first
scrape, and a panel or a ``rate()`` shows 0 instead of "No data".

>>> m = Metrics(); m.prime("actuator")
>>> b'c4stream_deadletters_total{stage="actuator"} 0.0' in m.render()
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

__all__ = ["OUTCOMES", "Metrics", "MetricsConfig", "MetricsLike", "NullMetrics"]

#: ``c4stream_sink_actions_total`` outcomes each stage reports (exported at 0 from start).
OUTCOMES: dict[str, tuple[str, ...]] = {
    "exporter": ("delivered", "delivery_error"),
    "actuator": (
        "acted",
        "dry_run",
        "skipped",
        "denied",
        "alert_only",
        "duplicate",
        "failed",
        "unknown",
    ),
    "alerter": ("delivered", "failed", "retried", "dropped", "unconfirmed"),
    "archiver": ("commit",),
}


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    host: str = "127.0.0.1"
    port: int = 0
    """0 disables the endpoint."""


@dataclass
class Metrics:
    """The metric families of one process (a registry per process, not a global)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.events_in = Counter(
            "c4stream_events_in", "Contract events taken in", ["stage"], registry=r
        )
        self.messages_in = Counter(
            "c4stream_messages_in", "Kafka messages or trace lines taken in", ["stage"], registry=r
        )
        self.deadletters = Counter(
            "c4stream_deadletters", "Inputs sent to the dead-letter topic", ["stage"], registry=r
        )
        self.verdicts = Counter(
            "c4stream_verdicts",
            "Verdicts emitted (stage=worker) or received (sinks)",
            ["stage", "fault"],
            registry=r,
        )
        self.isolations = Counter(
            "c4stream_isolations",
            "Isolation commands decided (stage=worker) or received (sinks)",
            ["stage", "fault", "action"],
            registry=r,
        )
        self.actions = Counter(
            "c4stream_sink_actions", "Actions taken by sinks", ["stage", "outcome"], registry=r
        )
        self.late_events = Counter(
            "c4stream_late_events",
            "Events behind the time their communicator was judged up to by more than the "
            "allowed lateness (dead-lettered 'late by N s'), per job",
            ["stage", "job"],
            registry=r,
        )
        self.late_verdicts = Counter(
            "c4stream_late_verdicts",
            "Verdicts that came after their job's event-time watermark had passed them: "
            "outcome=judged (within the allowed lateness) or deadlettered (beyond it)",
            ["stage", "job", "outcome"],
            registry=r,
        )
        self.held = Gauge(
            "c4stream_held",
            "State a stage holds: kind=communicators or lanes (worker), under its caps",
            ["stage", "kind"],
            registry=r,
        )
        self.evicted = Counter(
            "c4stream_evicted",
            "Communicators checkpointed and forgotten to keep under the caps: when=idle "
            "(quiet for evict_idle_s) or active (over the cap with nothing idle: a flood)",
            ["stage", "when"],
            registry=r,
        )
        self.consumer_lag = Gauge(
            "c4stream_consumer_lag",
            "Messages not yet consumed",
            ["stage", "topic", "partition"],
            registry=r,
        )
        self.latency = Histogram(
            "c4stream_processing_latency_seconds",
            "From event production (ts_us) to processing",
            ["stage"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )

    def prime(self, stage: str) -> None:
        """Create ``stage``'s label sets of the label-only counters at 0 (see the module)."""
        for counter in (self.events_in, self.messages_in, self.deadletters):
            counter.labels(stage=stage)
        for outcome in OUTCOMES.get(stage, ()):
            self.actions.labels(stage=stage, outcome=outcome)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, config: MetricsConfig) -> int | None:
        """Start the /metrics endpoint in a thread; returns the bound port (None if off)."""
        if config.port == 0:
            return None
        server, _ = start_http_server(config.port, addr=config.host, registry=self.registry)
        return int(server.server_port)


class _NullChild:
    """A metric child that records nothing."""

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class _NullFamily:
    _child = _NullChild()

    def labels(self, *args: str, **kwargs: str) -> _NullChild:
        return self._child

    def remove(self, *labels: str) -> None:
        pass


class NullMetrics:
    """Same families as :class:`Metrics`, recording nothing: code that counts takes one
    of the two and never asks whether metrics are on.

    >>> NullMetrics().deadletters.labels(stage="x").inc()
    """

    def __init__(self) -> None:
        null = _NullFamily()
        self.events_in = self.messages_in = self.deadletters = null
        self.verdicts = self.isolations = self.actions = null
        self.consumer_lag = self.latency = null
        self.late_events = self.late_verdicts = null
        self.held = self.evicted = null

    def render(self) -> bytes:
        return b""


MetricsLike = Metrics | NullMetrics
"""What services count into: real families or the null object."""
