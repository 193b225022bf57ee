"""A confluent-kafka producer with the settings and habits every c4stream publisher needs.

* idempotent (no duplicates from its own retries), zstd-compressed, batched
  (:meth:`c4base.kafka.KafkaConfig.producer_config`), retried by librdkafka until
  ``message.timeout.ms``;
* a bounded local queue (``queue.buffering.max.messages``): when it is full,
  ``produce`` raises ``BufferError`` and :meth:`Publisher.produce` serves delivery
  reports until there is room — back-pressure that slows the reader instead of growing
  memory;
* a delivery callback per message, so callers learn what Kafka acknowledged;
* credentials the broker refuses (SASL, TLS client certificate) raise
  :class:`~c4base.kafka.KafkaCredentialsError` from the next call instead of retrying
  until ``message.timeout.ms``: no retry can fix them.

Shared by the exporter and replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from c4base.kafka import KafkaConfig, KafkaCredentialsError, credentials_refused

__all__ = ["DeliveryCallback", "Publisher", "PublisherConfig", "PublisherStopped"]

log = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, Message], None]


class PublisherStopped(RuntimeError):
    """``produce`` gave up waiting for room because the caller is stopping (Kafka is
    unreachable and the local queue is full); the message was not queued."""


class PublisherConfig:
    """Producer tuning on top of :class:`KafkaConfig` (which carries bootstrap and security)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        *,
        queue_max_messages: int = 10_000,
        queue_max_kbytes: int = 256 * 1024,
        message_timeout_ms: int = 120_000,
        linger_ms: int = 20,
        client_id: str = "c4stream-producer",
    ) -> None:
        self.kafka = kafka
        self.queue_max_messages = queue_max_messages
        self.queue_max_kbytes = queue_max_kbytes
        self.message_timeout_ms = message_timeout_ms
        self.linger_ms = linger_ms
        self.client_id = client_id

    def producer_config(self) -> dict[str, Any]:
        return self.kafka.producer_config(
            **{
                "queue.buffering.max.messages": self.queue_max_messages,
                "queue.buffering.max.kbytes": self.queue_max_kbytes,
                "message.timeout.ms": self.message_timeout_ms,
                "linger.ms": self.linger_ms,
                "client.id": self.client_id,
            }
        )


class Publisher:
    """Thin owner of one ``confluent_kafka.Producer``; ``produce`` never drops a message."""

    def __init__(self, config: PublisherConfig) -> None:
        self._bootstrap = config.kafka.resolved_bootstrap()
        self._refused: KafkaError | None = None
        self._producer = Producer(
            {**config.producer_config(), "error_cb": self._on_error}, logger=log
        )
        self.backpressure_waits = 0

    def _on_error(self, err: KafkaError) -> None:
        if credentials_refused(err) and self._refused is None:
            self._refused = err

    def _check_refused(self) -> None:
        if self._refused is not None:
            raise KafkaCredentialsError(
                f"Kafka broker {self._bootstrap} refused the credentials: "
                f"{self._refused.str()}; check [kafka.extra] (sasl.*, ssl.*)"
            )

    def produce(
        self,
        topic: str,
        value: bytes,
        key: bytes | None,
        on_delivery: DeliveryCallback,
        give_up: Callable[[], bool] | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Queue one message; blocks (serving delivery reports) while the queue is full.

        ``give_up`` is asked while waiting: when it returns true, :class:`PublisherStopped`
        is raised instead of waiting on (so a stop request is not stuck behind a dead
        broker). ``headers``: e.g. the ``content-type`` of an Arrow batch.
        """
        while True:
            self._check_refused()
            try:
                self._producer.produce(
                    topic, value=value, key=key, on_delivery=on_delivery, headers=headers
                )
                return
            except BufferError:
                # Local queue full: let librdkafka send and report, then try again.
                if give_up is not None and give_up():
                    raise PublisherStopped("local queue full while stopping") from None
                self.backpressure_waits += 1
                self._producer.poll(0.05)

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery callbacks; returns how many were served."""
        served = self._producer.poll(timeout)
        self._check_refused()
        return served

    def flush(self, timeout: float) -> int:
        """Wait until everything queued is acknowledged (or ``timeout``); returns what is
        left. Waits in short steps so refused credentials end it at once."""
        deadline = time.monotonic() + timeout
        while True:
            left = self._producer.flush(max(0.0, min(0.5, deadline - time.monotonic())))
            self._check_refused()
            if not left or time.monotonic() >= deadline:
                return left

    def __len__(self) -> int:
        return len(self._producer)
