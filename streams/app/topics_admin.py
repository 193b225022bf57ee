"""Pre-create every topic of the worker with its partition count, before Faust starts.

Faust would otherwise auto-create topics with ``topic_partitions`` (or the broker's
default of 1), and a table changelog with fewer partitions than its source topic
breaks restores after a rebalance.
"""

from __future__ import annotations

from c4base.kafka_admin import TopicSetupError, create_topics
from streams.app.settings import WorkerConfig

__all__ = ["TopicSetupError", "ensure_topics"]


def ensure_topics(config: WorkerConfig, timeout: float = 30.0) -> dict[str, int]:
    """Create missing topics (idempotent) and wait until they have leaders.

    An existing topic with a different partition count is reported, not changed.
    Returns the ``{topic: partitions}`` that was ensured.
    """
    wanted = config.all_topics()
    create_topics(
        {"bootstrap.servers": config.kafka.resolved_bootstrap(), **config.kafka.extra},
        wanted,
        timeout,
        replication_factor=config.replication_factor,
    )
    return wanted
