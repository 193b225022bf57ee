"""The sinks' dead-letter path: a dead letter is delivered, its delivery callback
confirmed, before any offset that passes its message is committed.

(The Faust worker keeps the same rule through Faust: its consumer flushes the producer
before it commits, see docs/runtime.md.)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from c4base.deadletter import DeadLetter
from c4base.failures import DeadLetterError
from c4base.metrics import MetricsLike, NullMetrics
from c4base.progress import Record

__all__ = ["DeadLetterSink"]

log = logging.getLogger(__name__)


class DeadLetterSink:
    """The one dead-letter path: produce with a delivery callback; :meth:`confirm`
    before committing any offset past a dead-lettered message.

    Thread-safe: the alerter dead-letters from its delivery thread."""

    def __init__(
        self,
        producer: Any,
        topic: str,
        stage: str,
        *,
        metrics: MetricsLike | None = None,
        confirm_timeout_s: float = 30.0,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.stage = stage
        self.metrics = metrics or NullMetrics()
        self.confirm_timeout_s = confirm_timeout_s
        self.sent = 0
        self.delivered = 0
        self._errors: list[str] = []
        self._lock = threading.Lock()

    def send(self, rec: Record, reason: str) -> None:
        letter = DeadLetter.of_record(rec, reason, self.stage)  # bounded to fit a message
        with self._lock:
            self.sent += 1
        self.producer.produce(
            self.topic, letter.encode(), key=rec.key, on_delivery=self._on_delivery
        )
        self.producer.poll(0)
        self.metrics.deadletters.labels(stage=self.stage).inc()
        log.warning("dead-lettered %s: %s", rec.source, reason)

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        with self._lock:
            if err is not None:
                self._errors.append(str(err))
            else:
                self.delivered += 1

    @property
    def unconfirmed(self) -> int:
        with self._lock:
            return self.sent - self.delivered - len(self._errors)

    def confirm(self) -> None:
        """Return once every dead letter sent so far is delivered; raise
        :class:`DeadLetterError` if one failed or delivery timed out."""
        if self.unconfirmed:
            self.producer.flush(self.confirm_timeout_s)
        with self._lock:
            errors = list(self._errors)
            missing = self.sent - self.delivered - len(errors)
        if errors or missing:
            raise DeadLetterError(
                f"dead letters to {self.topic} not delivered "
                f"({'; '.join(errors[:3]) or f'{missing} timed out'}); nothing past them "
                "was committed. Check the broker and that the topic accepts the messages."
            )
