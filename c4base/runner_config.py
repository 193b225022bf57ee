"""The settings of the sinks' consumer loop (:class:`~c4base.runtime.ConsumerRunner`)
and what it counts; each service fills :class:`RunnerConfig` from its own table."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from c4base.kafka import KafkaConfig

__all__ = ["RunnerConfig", "RunnerStats", "default_instance_id"]


def default_instance_id(group: str) -> str:
    """A stable ``group.instance.id``: the group and this host's name (a pod's name in
    Kubernetes), so a restarted member is recognised and keeps its partitions.

    >>> default_instance_id("g").startswith("g@")
    True
    """
    return f"{group}@{socket.gethostname()}"


@dataclass(slots=True)
class RunnerConfig:
    """The loop's settings; each service fills them from its own config table."""

    stage: str
    topics: list[str]
    deadletter_topic: str
    group: str
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    instance_id: str | None = None
    """``group.instance.id``; None: :func:`default_instance_id`; "" turns static
    membership off (several members of one group on one host, e.g. in tests)."""
    offset_reset: str = "earliest"
    batch_size: int = 500
    poll_timeout_s: float = 0.5
    tick_s: float = 1.0
    commit_interval_s: float = 0.0
    """Commit at most this often (0: after every batch that moved an offset)."""
    retry_base_s: float = 1.0
    retry_max_s: float = 60.0
    retry_for_s: float = 600.0
    """A transient failure is retried with back-off this long, then dead-lettered."""
    broker_timeout_s: float = 120.0
    """Exit non-zero when the broker stays unreachable this long (0: never)."""
    probe_s: float = 5.0
    """Check the broker this often when no message arrived meanwhile."""
    stop_timeout_s: float = 5.0
    """On stop, time given to the handler to finish in-flight work."""
    session_timeout_s: float = 45.0
    log_every_s: float = 30.0
    """Repeated error lines (same cause) at most this often."""
    status_path: str | None = None
    max_messages: int | None = None
    exit_when_idle_s: float | None = None
    consumer_overrides: dict[str, Any] = field(default_factory=dict)

    def instance(self) -> str | None:
        """The ``group.instance.id`` to use (None: dynamic membership)."""
        if self.instance_id is None:
            return default_instance_id(self.group)
        return self.instance_id or None

    def consumer_config(self, **callbacks: Any) -> dict[str, Any]:
        """The consumer's librdkafka settings (``callbacks``: error_cb, logger)."""
        over: dict[str, Any] = {
            "auto.offset.reset": self.offset_reset,
            "session.timeout.ms": int(self.session_timeout_s * 1000),
            **callbacks,
        }
        iid = self.instance()
        if iid:
            over["group.instance.id"] = iid
        over.update(self.consumer_overrides)
        return self.kafka.consumer_config(self.group, **over)


@dataclass(slots=True)
class RunnerStats:
    received: int = 0
    handled: int = 0
    deadlettered: int = 0
    retries: int = 0
    commits: int = 0
    commit_failures: int = 0
