"""Pre-create every topic of the worker with its partition count, before Faust starts.

Faust would otherwise auto-create topics with ``topic_partitions`` (or the broker's
default of 1), and a table changelog with fewer partitions than its source topic
breaks restores after a rebalance.
"""

from __future__ import annotations

import logging
import time

from streams.app.settings import WorkerConfig

__all__ = ["TopicSetupError", "ensure_topics"]

log = logging.getLogger(__name__)


class TopicSetupError(RuntimeError):
    """Topics could not be created; check the broker address, ACLs and partition counts."""


def ensure_topics(config: WorkerConfig, timeout: float = 30.0) -> dict[str, int]:
    """Create missing topics (idempotent) and wait until they have leaders.

    An existing topic with a different partition count is reported, not changed.
    Returns the ``{topic: partitions}`` that was ensured.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    wanted = config.all_topics()
    admin = AdminClient(
        {"bootstrap.servers": config.kafka.resolved_bootstrap(), **config.kafka.extra}
    )
    new = [
        NewTopic(name, num_partitions=n, replication_factor=config.replication_factor)
        for name, n in wanted.items()
    ]
    for name, fut in admin.create_topics(new, request_timeout=timeout).items():
        try:
            fut.result(timeout=timeout)
        except KafkaException as exc:
            err = exc.args[0]
            if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                raise TopicSetupError(f"creating topic {name!r} failed: {err}") from exc
    deadline = time.monotonic() + timeout
    pending = dict(wanted)
    while pending:
        md = admin.list_topics(timeout=max(0.5, deadline - time.monotonic()))
        for name, want in list(pending.items()):
            t = md.topics.get(name)
            if t is None or t.error is not None or not t.partitions:
                continue
            if any(p.leader < 0 for p in t.partitions.values()):
                continue
            if len(t.partitions) != want:
                log.warning("topic %s has %d partitions, wanted %d", name, len(t.partitions), want)
            del pending[name]
        if pending and time.monotonic() > deadline:
            raise TopicSetupError(f"topics not ready after {timeout:.0f}s: {sorted(pending)}")
        if pending:
            time.sleep(0.05)
    return wanted
