"""Create topics with explicit partition counts and wait until they can be used.

Every stage that creates topics (the local broker's fixtures, the worker, the demo)
goes through :func:`create_topics`: auto-created topics get the broker's default
partition count, which is wrong for Faust tables and for keyed scale-out.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from c4base.kafka import KafkaCredentialsError, credentials_refused

__all__ = ["TopicSetupError", "create_topics"]

log = logging.getLogger(__name__)


class TopicSetupError(RuntimeError):
    """Topics could not be created; check the broker address, ACLs and partition counts."""


def create_topics(
    client: str | Mapping[str, Any],
    topics: Mapping[str, int],
    timeout: float = 30.0,
    *,
    replication_factor: int = 1,
    config: Mapping[str, str] | None = None,
) -> None:
    """Create ``{name: partitions}`` and wait until every partition has a leader.

    ``client`` is a bootstrap address or a librdkafka configuration (with security
    settings). Idempotent: a topic that already exists is fine; a differing partition
    count is logged, not changed, since a shared cluster may have been set up on purpose.
    """
    if not topics:
        return
    conf = {"bootstrap.servers": client} if isinstance(client, str) else dict(client)
    refused: list[KafkaError] = []

    def on_error(err: KafkaError) -> None:
        if credentials_refused(err):
            refused.append(err)

    # librdkafka's own lines go to this module's logger (the service's log), not stderr
    admin = AdminClient({**conf, "error_cb": on_error, "logger": log})
    new = [
        NewTopic(
            name, num_partitions=n, replication_factor=replication_factor, config=dict(config or {})
        )
        for name, n in topics.items()
    ]
    futures = admin.create_topics(new, request_timeout=timeout)
    # Wait in short steps, serving the error callback: refused credentials end the wait
    # at once with a clear error instead of a timeout ``timeout`` seconds later.
    deadline = time.monotonic() + timeout
    waiting = set(futures.values())
    while waiting and time.monotonic() < deadline:
        waiting = concurrent.futures.wait(waiting, timeout=0.25).not_done
        admin.poll(0)
        if refused:
            raise KafkaCredentialsError(
                f"Kafka broker {conf.get('bootstrap.servers')} refused the credentials: "
                f"{refused[-1].str()}; check [kafka.extra] (sasl.*, ssl.*)"
            )
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout)
        except KafkaException as exc:
            err = exc.args[0]
            if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                raise TopicSetupError(f"creating topic {name!r} failed: {err}") from exc

    # Creation is acknowledged by the controller before the broker's metadata shows
    # leaders; producers that start right away would otherwise get transient errors.
    deadline = time.monotonic() + timeout
    pending = dict(topics)
    while pending:
        md = admin.list_topics(timeout=max(0.5, deadline - time.monotonic()))
        for name, want in list(pending.items()):
            t = md.topics.get(name)
            if t is None or t.error is not None or not t.partitions:
                continue
            if any(p.leader < 0 for p in t.partitions.values()):
                continue
            if len(t.partitions) != want:
                log.warning(
                    "topic %s exists with %d partitions, wanted %d", name, len(t.partitions), want
                )
            del pending[name]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TopicSetupError(f"topics not ready after {timeout:.0f}s: {sorted(pending)}")
        time.sleep(0.05)
