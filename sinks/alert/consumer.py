"""Kafka side of the alerter: ``c4.isolations``, ``c4.verdicts`` and the actuator's
``c4.actions`` in, alerts out, at least once.

The loop is the shared :class:`~c4base.runtime.ConsumerRunner`; :class:`AlertHandler`
is the alerter's part. HTTP delivery runs on an asyncio loop in a thread of its own,
so a slow or failing chat never stalls consumption.

At least once: each (destination, notification) a message produced holds that
message's offset (:meth:`~c4base.runtime.Context.hold`) until its delivery callback
says what became of it: delivered, or given up after ``retry_for_s`` of retries with
back-off, or dropped from a full queue — and then it is dead-lettered with the reason
first. The offset is committed only once every hold below it is released, so an
alerter killed during a webhook outage reads those messages again when it restarts
and sends their alerts then. A message that groups into an alert already open (no
notification) is done at once. Resolve notifications come from the grouper's timers,
not from a message: a crash can lose those (the firing one was sent).

A new consumer group starts at the end of the topics (``from_beginning=False``):
starting a chat alerter must not replay last week's decisions into the channel.
Undecodable messages go to ``c4.deadletter`` (stage ``alerter``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from c4base.consumer_lag import observe_latency
from c4base.kafka import KafkaConfig
from c4base.metrics import MetricsLike, NullMetrics
from c4base.runtime import (
    BaseHandler,
    ConsumerRunner,
    Context,
    PermanentError,
    Record,
    RunnerConfig,
    RunnerStats,
)
from c4base.topics import Topics
from sinks.actuator.outcomes import ReportDecodeError, decode_report
from sinks.alert.alerter import Alerter
from sinks.alert.config import AlertConfig
from sinks.alert.delivery import Done
from sinks.alert.model import Notification
from sinks.alert.sent import SentLedger, delivery_id
from streams.commands import CommandDecodeError, decode_command
from streams.verdicts import VerdictDecodeError, decode_verdict

__all__ = ["AlertHandler", "AlertService", "ConsumerStats"]

log = logging.getLogger(__name__)

STAGE = "alerter"
T = TypeVar("T")


@dataclass
class ConsumerStats:
    commands: int = 0
    verdicts: int = 0
    deadlettered: int = 0
    """Messages dead-lettered: undecodable, or an alert of theirs not delivered."""
    repeats: int = 0
    """Alerts of messages read again that were posted (or maybe) before: not again."""


class AlertHandler(BaseHandler):
    """Decodes, groups and queues; holds each message until its alerts are settled."""

    def __init__(
        self,
        cfg: AlertConfig,
        topics: Topics,
        *,
        metrics: MetricsLike | None = None,
        alerter: Any = None,
    ) -> None:
        self.topics = topics
        self.metrics = metrics or NullMetrics()
        self.stats = ConsumerStats()
        self._outcomes: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="alert-delivery", daemon=True
        )
        self._thread.start()
        self.alerter: Alerter = self._call(self._open(cfg, alerter))

    async def _open(self, cfg: AlertConfig, alerter: Any) -> Alerter:
        a = alerter or Alerter.from_config(cfg)
        if cfg.sent_ledger and a.delivery.sent is None:
            a.delivery.sent = SentLedger(cfg.sent_ledger)
        a.delivery.start()
        return a

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ------------------------------------------------------------ records

    def handle(self, rec: Record, ctx: Context) -> None:
        notes: list[Notification]
        if rec.topic == self.topics.isolations:
            try:
                cmd = decode_command(rec.value)
            except CommandDecodeError as err:
                self.stats.deadlettered += 1
                raise PermanentError(f"invalid isolation command: {err}") from None
            self.stats.commands += 1
            self.metrics.isolations.labels(stage=STAGE, fault=cmd.fault, action=cmd.action).inc()
            observe_latency(self.metrics, STAGE, ts_us=cmd.ts_us)
            notes = self.alerter.command_notifications(cmd)
        elif rec.topic == self.topics.actions:
            # What the actuator did, shown on the host's open alert.
            try:
                report = decode_report(rec.value)
            except ReportDecodeError as err:
                self.stats.deadlettered += 1
                raise PermanentError(f"invalid action report: {err}") from None
            notes = self.alerter.action_notifications(report)
        else:
            try:
                verdict = decode_verdict(rec.value)
            except VerdictDecodeError as err:
                self.stats.deadlettered += 1
                raise PermanentError(f"invalid verdict: {err}") from None
            self.stats.verdicts += 1
            self.metrics.verdicts.labels(stage=STAGE, fault=verdict.fault).inc()
            observe_latency(self.metrics, STAGE, ts_us=verdict.ts_us)
            notes = self.alerter.verdict_notifications(verdict)
        for name, n in self.alerter.routes(notes):
            ident = delivery_id(rec.topic, rec.partition, rec.offset, rec.timestamp_ms, name, n)
            if self._posted_before(name, n, ident):
                continue
            done = self._settle(rec, n, ctx)
            self.loop.call_soon_threadsafe(self.alerter.delivery.offer, name, n, done, ident)

    def _posted_before(self, name: str, n: Notification, ident: str) -> bool:
        """A message read again (a restart before its commit) whose alert to ``name``
        was posted, or may have been where a repeat would show twice: not posted again."""
        d = self.alerter.delivery
        st = d.sent.status(ident) if d.sent is not None else None
        if st == "posting":  # killed before its first request was all written: not taken
            return False
        if st == "sent":  # killed while its first request was out: maybe delivered
            target = d.targets[name]
            if target.idempotent or target.destination.retry_unconfirmed:
                return False  # a repeat is harmless (or wanted): post it
            log.warning("alert %s %s to %s: the alerter stopped while posting it; maybe "
                        "delivered, not re-posted", n.status, n.key, name)  # fmt: skip
            self.stats.repeats += 1
            return True
        if st in ("posted", "unconfirmed"):
            log.info("alert %s %s to %s was posted before a restart; not again",
                     n.status, n.key, name)  # fmt: skip
            self.stats.repeats += 1
            return True
        return False

    def _settle(self, rec: Record, n: Notification, ctx: Context) -> Done:
        hold = ctx.hold(rec)

        def done(ok: bool, detail: str) -> None:
            if not ok:
                try:
                    ctx.dead_letter(rec, f"alert {n.status} {n.key}: {detail}")
                except Exception:
                    # Keep the hold: the message is not committed and is read again
                    # after a restart rather than lost.
                    log.exception("dead letter for %s failed; not committing it", rec.source)
                    return
                self.stats.deadlettered += 1
            hold.release()

        return done

    def tick(self, ctx: Context) -> None:
        # Resolves and refreshes come from timers, not from a message: nothing to hold.
        for name, n in self.alerter.tick_routes():
            self.loop.call_soon_threadsafe(self.alerter.delivery.offer, name, n)
        self._count_outcomes()

    def _count_outcomes(self) -> None:
        """Move the delivery counters' growth since the last call into the metrics."""
        d = self.alerter.delivery.stats
        now = {
            "delivered": d.delivered,
            "failed": d.failed,
            "retried": d.retries,
            "dropped": d.dropped_total,
            "unconfirmed": d.unconfirmed,
        }
        for outcome, total in now.items():
            grew = total - self._outcomes.get(outcome, 0)
            if grew > 0:
                self.metrics.actions.labels(stage=STAGE, outcome=outcome).inc(grew)
        self._outcomes = now

    # ------------------------------------------------------------ lifecycle

    def close(self, stop_by: float, ctx: Context) -> None:
        """Give queued alerts until ``stop_by``; what is still unsent stays uncommitted."""
        left = max(0.0, stop_by - time.monotonic())
        try:
            if not self._call(self.alerter.delivery.drain(left), timeout=left + 5):
                log.warning(
                    "%d alert(s) not sent at stop; their messages are not committed and "
                    "are read again at the next start",
                    self.alerter.delivery.pending(),
                )
        finally:
            self._count_outcomes()
            self.abort()

    def abort(self) -> None:
        if self.loop.is_running():
            try:
                self._call(self.alerter.delivery.aclose(), timeout=5)
            except Exception:
                log.debug("delivery did not close cleanly", exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        if self.alerter.delivery.sent is not None:
            self.alerter.delivery.sent.close()
            self.alerter.delivery.sent = None

    def status(self) -> dict[str, Any]:
        d = self.alerter.delivery
        return {
            "alerts": {
                "pending": d.pending(),
                "delivered": d.stats.delivered,
                "failed": d.stats.failed,
                "retries": d.stats.retries,
                "unconfirmed": d.stats.unconfirmed,
            }
        }


class AlertService:
    """The alerter on Kafka: :class:`AlertHandler` in the shared runner.

    ``runner_options`` are :class:`~c4base.runtime.RunnerConfig` fields (retry and
    broker timeouts, ``status_path``, ``tick_s``…)."""

    def __init__(
        self,
        cfg: AlertConfig,
        kafka: KafkaConfig,
        *,
        topics: Topics | None = None,
        group: str = "c4stream-alert",
        from_beginning: bool = False,
        instance_id: str | None = None,
        metrics: MetricsLike | None = None,
        stop: threading.Event | None = None,
        alerter: Any = None,
        **runner_options: Any,
    ) -> None:
        self.topics = topics or Topics(prefix=kafka.topic_prefix)
        self.handler = AlertHandler(cfg, self.topics, metrics=metrics, alerter=alerter)
        self.alerter = self.handler.alerter
        rc = RunnerConfig(
            stage=STAGE,
            topics=[self.topics.isolations, self.topics.verdicts, self.topics.actions],
            deadletter_topic=self.topics.deadletter,
            group=group,
            kafka=kafka,
            instance_id=instance_id,
            offset_reset="earliest" if from_beginning else "latest",
            **{"poll_timeout_s": 0.25, **runner_options},  # alerts are for people: promptly
        )
        self.runner = ConsumerRunner(rc, self.handler, metrics=metrics, stop=stop)
        self.stop = self.runner.stop

    @property
    def stats(self) -> ConsumerStats:
        return self.handler.stats

    def run(self) -> RunnerStats:
        """Consume until ``stop``; raises :class:`~c4base.runtime.FatalError`."""
        try:
            return self.runner.run()
        finally:
            self.handler.abort()
