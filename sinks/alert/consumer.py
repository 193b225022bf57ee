"""Kafka side of the alerter: consume ``c4.isolations`` and ``c4.verdicts``, feed the Alerter.

confluent-kafka's consumer is blocking, so each ``consume`` call runs in a worker thread
while HTTP delivery runs on the event loop; the loop itself only decodes, groups and
enqueues (:meth:`Delivery.offer` never waits), so a slow chat never stalls consumption.

Offsets are committed after each batch has been grouped and queued, not after the HTTP
posts: an alerter restart re-reads at most one uncommitted batch (grouping then sends
that host's alert again) and never re-reads the whole history. A new consumer group
starts at the end of the topics (``from_beginning=False``): starting a chat alerter
must not replay last week's decisions into the channel.

Undecodable messages go to ``c4.deadletter`` (stage ``alerter``) and are skipped.

With a :class:`~c4base.metrics.Metrics`, the consumer also counts messages in, dead
letters, commands and verdicts received, webhook outcomes (``c4stream_sink_actions``:
delivered, failed, retried, dropped — taken from the delivery counters each tick),
consumer lag and processing latency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from c4base.consumer_lag import LagMonitor, observe_latency
from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.metrics import Metrics
from c4base.topics import Topics
from sinks.actuator.outcomes import ReportDecodeError, decode_report
from sinks.alert.alerter import Alerter
from streams.commands import CommandDecodeError, decode_command
from streams.verdicts import VerdictDecodeError, decode_verdict

__all__ = ["AlertConsumer", "ConsumerStats"]

log = logging.getLogger(__name__)

STAGE = "alerter"


@dataclass
class ConsumerStats:
    commands: int = 0
    verdicts: int = 0
    deadlettered: int = 0


class AlertConsumer:
    def __init__(
        self,
        alerter: Alerter,
        kafka: KafkaConfig,
        *,
        topics: Topics | None = None,
        group_id: str = "c4stream-alert",
        from_beginning: bool = False,
        batch_size: int = 500,
        poll_s: float = 0.25,
        tick_s: float = 1.0,
        metrics: Metrics | None = None,
    ) -> None:
        self.alerter = alerter
        self.kafka = kafka
        self.topics = topics or Topics(prefix=kafka.topic_prefix)
        self.group_id = group_id
        self.from_beginning = from_beginning
        self.batch_size = batch_size
        self.poll_s = poll_s
        self.tick_s = tick_s
        self.stats = ConsumerStats()
        self.metrics = metrics
        self._outcomes: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then flush what can be flushed."""
        from confluent_kafka import Consumer, Producer

        reset = "earliest" if self.from_beginning else "latest"
        consumer = Consumer(
            self.kafka.consumer_config(self.group_id, **{"auto.offset.reset": reset})
        )
        producer = Producer(self.kafka.producer_config())
        consumer.subscribe([self.topics.isolations, self.topics.verdicts, self.topics.actions])
        lag = LagMonitor(consumer, self.metrics, STAGE) if self.metrics is not None else None
        next_tick = time.monotonic() + self.tick_s
        try:
            while not stop.is_set():
                if lag is not None:
                    await asyncio.to_thread(lag.maybe_update)
                msgs = await asyncio.to_thread(consumer.consume, self.batch_size, self.poll_s)
                for msg in msgs:
                    if msg.error() is not None:
                        log.warning("kafka: %s", msg.error())
                        continue
                    if self.metrics is not None:
                        self.metrics.messages_in.labels(stage=STAGE).inc()
                    self._handle(msg, producer)
                if msgs:
                    consumer.commit(asynchronous=True)
                    producer.poll(0)
                if time.monotonic() >= next_tick:
                    self.alerter.tick()
                    self._count_outcomes()
                    next_tick = time.monotonic() + self.tick_s
        finally:
            self._count_outcomes()
            await asyncio.to_thread(consumer.close)
            await asyncio.to_thread(producer.flush, 5.0)

    def _handle(self, msg: object, producer: object) -> None:
        topic = msg.topic()  # type: ignore[attr-defined]
        value: bytes = msg.value() or b""  # type: ignore[attr-defined]
        try:
            if topic == self.topics.isolations:
                cmd = decode_command(value)
                self.alerter.on_command(cmd)
                self.stats.commands += 1
                if self.metrics is not None:
                    self.metrics.isolations.labels(
                        stage=STAGE, fault=cmd.fault, action=cmd.action
                    ).inc()
                    observe_latency(self.metrics, STAGE, ts_us=cmd.ts_us)
            elif topic == self.topics.actions:
                self.alerter.on_action(decode_report(value))
            else:
                verdict = decode_verdict(value)
                self.alerter.on_verdict(verdict)
                self.stats.verdicts += 1
                if self.metrics is not None:
                    self.metrics.verdicts.labels(stage=STAGE, fault=verdict.fault).inc()
                    observe_latency(self.metrics, STAGE, ts_us=verdict.ts_us)
        except (CommandDecodeError, VerdictDecodeError, ReportDecodeError) as err:
            source = f"{topic}[{msg.partition()}]@{msg.offset()}"  # type: ignore[attr-defined]
            rec = DeadLetter.of(
                value,
                reason=str(err),
                stage="alerter",
                source=source,
                key=msg.key(),  # type: ignore[attr-defined]
            )
            producer.produce(self.topics.deadletter, rec.encode(), key=msg.key())  # type: ignore[attr-defined]
            self.stats.deadlettered += 1
            if self.metrics is not None:
                self.metrics.deadletters.labels(stage=STAGE).inc()
            log.warning("alerter: dead-lettered %s: %s", source, err)

    def _count_outcomes(self) -> None:
        """Move the delivery counters' growth since the last call into the metrics."""
        if self.metrics is None:
            return
        d = self.alerter.delivery.stats
        now = {
            "delivered": d.delivered,
            "failed": d.failed,
            "retried": d.retries,
            "dropped": d.dropped_total,
        }
        for outcome, total in now.items():
            grew = total - self._outcomes.get(outcome, 0)
            if grew > 0:
                self.metrics.actions.labels(stage=STAGE, outcome=outcome).inc(grew)
        self._outcomes = now
