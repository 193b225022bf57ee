"""One runtime for the Kafka sink services (actuator, archiver, alerter).

This module is the loop; its parts live by job in :mod:`c4base.failures` (the
classified errors), :mod:`c4base.progress` (records, holds, what may be committed),
:mod:`c4base.handler` (a service's part), :mod:`c4base.deadletter_sink`,
:mod:`c4base.throttle` and :mod:`c4base.lifeguard` (broker outage, stop, status file),
and are named here too, so a sink imports the runtime from one place.
docs/runtime.md maps each duty to its home, for the sinks and the Faust worker.

:class:`ConsumerRunner` is the loop every sink shares: poll, decode, hand records to the
service's :class:`Handler`, dead-letter what fails for good, and commit an offset only
once the results of every message below it are durable. What "durable" means is the
handler's business: a ledger row (actuator), a renamed Parquet file (archiver), a
webhook delivered (alerter). The runner learns it in one of two ways:

* synchronously: :meth:`Handler.handle` returned, so the record is done;
* later: the handler took a :class:`Hold` on the record (``ctx.hold(rec)``) and
  releases it when the result is durable, or reports its lowest non-durable offset per
  partition from :meth:`Handler.pending` (files still open).

Failures are classified where they happen (STYLE.md habit 9), by the exception the
handler raises:

* :class:`TransientError` — retry later. The record and everything after it in its
  partition stay uncommitted; the runner pauses the assignment, waits with back-off and
  tries again for up to ``retry_for_s``, then dead-letters the record with the reason.
* :class:`Rewind` (a transient error) — results already handled were lost (a full
  disk took an archive file with them): the runner reads each named partition again
  from the given offset after ``retry_after_s``, commits nothing past it, and never
  dead-letters for it (the records are fine; the service is held).
* :class:`PermanentError` — this record cannot be used: dead letter, go on.
* :class:`FatalError` — the service cannot go on (bad configuration, dead-letter topic
  unwritable, broker gone): stop loudly, commit nothing more, exit non-zero.

Anything else a handler raises is a surprise: it is logged with its traceback and
treated as transient (never a crash loop on one message, never a silent skip).

One dead-letter rule (:class:`~c4base.deadletter_sink.DeadLetterSink`): a dead letter is
delivered, its delivery callback confirmed, before any offset that passes its message is
committed.

Operability: the runner exits with :class:`BrokerUnreachable` when the broker stays
unreachable for ``broker_timeout_s``; it answers ``stop`` (SIGTERM) within about
``poll_timeout_s`` in every state, back-off included; repeated error lines, its own and
librdkafka's, are rate-limited (:mod:`c4base.throttle`); how long the broker may stay
away is judged by :class:`~c4base.lifeguard.Outage`, as in the worker; ``status()``
(and the optional status file) says what is true now; a stable ``group.instance.id``
gives static group membership, so a restarted sink takes its partitions back without a
rebalance wait.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from c4base.consumer_lag import LagMonitor
from c4base.deadletter_sink import DeadLetterSink
from c4base.failures import (
    TP,
    BrokerUnreachable,
    CredentialsRefused,
    DeadLetterError,
    FatalError,
    PermanentError,
    Rewind,
    TransientError,
)
from c4base.handler import BaseHandler, BatchFailed, Context, Handler
from c4base.kafka import credentials_refused
from c4base.lifeguard import Outage, write_status
from c4base.metrics import Metrics, MetricsLike, NullMetrics
from c4base.progress import Hold, Progress, Record
from c4base.runner_config import RunnerConfig, RunnerStats, default_instance_id
from c4base.throttle import LogThrottle, kafka_logger

__all__ = [
    "BaseHandler",
    "BatchFailed",
    "BrokerUnreachable",
    "CredentialsRefused",
    "ConsumerRunner",
    "Context",
    "DeadLetterError",
    "DeadLetterSink",
    "FatalError",
    "Handler",
    "Hold",
    "LogThrottle",
    "PermanentError",
    "Record",
    "RunnerConfig",
    "Rewind",
    "RunnerStats",
    "TransientError",
    "default_instance_id",
    "kafka_logger",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------- the runner


class _Retry:
    """Records waiting for a transient failure to heal."""

    __slots__ = ("records", "first", "attempt", "at", "error")

    def __init__(self, records: list[Record], error: BaseException, now: float) -> None:
        self.records = records
        self.first = now
        self.attempt = 0
        self.at = now
        self.error = error


class ConsumerRunner:
    """Poll → handler → dead letters → commit, for one sink service. See the module doc."""

    def __init__(
        self,
        cfg: RunnerConfig,
        handler: Handler,
        *,
        metrics: MetricsLike | None = None,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.cfg = cfg
        self.handler = handler
        self.metrics = metrics or NullMetrics()
        self.stop = stop or threading.Event()
        self._clock = clock
        self._rng = rng
        self.stats = RunnerStats()
        self.progress = Progress()
        self.throttle = LogThrottle(cfg.log_every_s)
        self.state = "starting"
        self.assigned: set[TP] = set()
        self.outage = Outage(cfg.broker_timeout_s or None)
        self._refused: KafkaError | None = None
        """The broker refused our credentials (set from librdkafka's error callback)."""
        self.started = clock()
        self.last_poll = self.started
        self._last_heard = self.started
        self._last_commit = -1e18
        self._retry: _Retry | None = None
        self._rewind_at: float | None = None
        """Paused after a :class:`Rewind`: reading resumes at this monotonic time."""
        self._paused = False
        self._assigned_at = self.started
        self._last_probe = -1e18
        self._last_ok = self.started
        """When the broker last answered (a message or a probe)."""
        self._consumer: Any = None
        self._producer: Any = None
        self.deadletters: DeadLetterSink | None = None
        self._rdkafka_log = kafka_logger(cfg.stage, cfg.log_every_s)

    # ------------------------------------------------------------ Context

    def hold(self, rec: Record) -> Hold:
        return self.progress.hold(rec)

    def dead_letter(self, rec: Record, reason: str) -> None:
        assert self.deadletters is not None, "dead_letter() outside run()"
        self.deadletters.send(rec, reason)
        self.stats.deadlettered += 1

    # ------------------------------------------------------------ lifecycle

    def run(self) -> RunnerStats:
        """Consume until ``stop``, ``max_messages`` or idle timeout; raises
        :class:`FatalError` (after committing nothing more) when the service cannot go on."""
        cfg = self.cfg
        self._producer = Producer(
            cfg.kafka.producer_config(
                **{"linger.ms": 5, "error_cb": self._on_kafka_error, "logger": self._rdkafka_log}
            )
        )
        self.deadletters = DeadLetterSink(
            self._producer, cfg.deadletter_topic, cfg.stage, metrics=self.metrics
        )
        self._consumer = Consumer(
            cfg.consumer_config(error_cb=self._on_kafka_error, logger=self._rdkafka_log)
        )
        # Lag costs a watermark query per partition: only when metrics are served.
        self._lag = (
            LagMonitor(self._consumer, self.metrics, cfg.stage)
            if isinstance(self.metrics, Metrics)
            else None
        )
        self._consumer.subscribe(
            cfg.topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        log.info(
            "%s consuming %s (group %s, instance %s)",
            cfg.stage,
            ", ".join(cfg.topics),
            cfg.group,
            cfg.instance() or "dynamic",
        )
        self.state = "joining"
        next_tick = self._clock() + cfg.tick_s
        fatal: BaseException | None = None
        try:
            while not self.stop.is_set():
                self._step()
                now = self._clock()
                if now >= next_tick:
                    next_tick = now + cfg.tick_s
                    try:
                        self.handler.tick(self)
                    except Rewind as err:
                        self._rewind(err, [])
                    self._write_status()
                self._commit(force=False)
                if cfg.max_messages is not None and self.stats.received >= cfg.max_messages:
                    if not self._retry and not self.progress.held():
                        break
                if self._idle_expired(now):
                    log.info("idle for %.1fs; stopping", cfg.exit_when_idle_s)
                    break
            self.state = "stopping"
            self._write_status()
            self.handler.close(self._clock() + cfg.stop_timeout_s, self)
            self._commit(force=True)
        except BaseException as err:
            fatal = err
            self.state = "failed"
            self.handler.abort()
            self.progress.forget()  # nothing more is committed
            raise
        finally:
            self._shutdown(fatal)
        log.info("%s stopped: %s", cfg.stage, self.stats)
        return self.stats

    def _shutdown(self, fatal: BaseException | None) -> None:
        # Leaving the group can wait on an unreachable coordinator: bound it by running
        # close() in a daemon thread, so SIGTERM is answered within seconds regardless.
        consumer, producer = self._consumer, self._producer
        t = threading.Thread(target=consumer.close, daemon=True, name="consumer-close")
        t.start()
        t.join(self.cfg.stop_timeout_s)
        if t.is_alive():
            log.warning("consumer did not leave the group within %.0fs", self.cfg.stop_timeout_s)
        left = producer.flush(min(5.0, self.cfg.stop_timeout_s))
        if left and fatal is None:
            log.warning(
                "%d dead letter(s) not delivered at stop (their offsets were not committed)", left
            )
        if self.state != "failed":
            self.state = "stopped"
        self._write_status()

    def _idle_expired(self, now: float) -> bool:
        idle = self.cfg.exit_when_idle_s
        if (
            idle is None
            or not self.assigned
            or self._retry
            or self._rewind_at is not None
            or self.progress.held()
        ):
            return False
        return now - self._last_heard >= idle and now - self._assigned_at >= idle

    # ------------------------------------------------------------ one step

    def _step(self) -> None:
        if self._rewind_at is not None:
            if self._clock() < self._rewind_at:
                self._consumer.poll(0)  # keeps the membership; paused: nothing comes
                self._check_broker(got_message=False)
                self.stop.wait(min(self.cfg.poll_timeout_s, self._rewind_at - self._clock()))
                return
            self._rewind_at = None
            self._pause(False)
        if self._retry is not None:
            # Paused: this only keeps the group membership alive. Should a message come
            # anyway, rewind to it so it is neither skipped nor committed past.
            m = self._consumer.poll(0)
            if m is not None and m.error() is None:
                self._consumer.seek(TopicPartition(m.topic(), m.partition(), m.offset()))
            self._check_broker(got_message=False)
            if self._clock() < self._retry.at:
                self.stop.wait(min(self.cfg.poll_timeout_s, self._retry.at - self._clock()))
                return
            self._handle(self._retry.records)
            return
        if self._lag is not None:
            self._lag.maybe_update()
        msgs = self._consumer.consume(self.cfg.batch_size, self.cfg.poll_timeout_s)
        self.last_poll = self._clock()
        records = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.fatal():
                    raise FatalError(f"Kafka consumer: {err}")
                if err.code() != KafkaError._PARTITION_EOF:
                    self.throttle.log(log, logging.WARNING, f"c:{err.code()}", "consumer: %s", err)
                continue
            records.append(Record.of(m))
        self._check_broker(got_message=bool(msgs))
        if records:
            self._last_heard = self._clock()
            self.stats.received += len(records)
            self.metrics.messages_in.labels(stage=self.cfg.stage).inc(len(records))
            self._handle(records)

    def _handle(self, records: list[Record]) -> None:
        """Hand ``records`` to the handler; classify a failure and go on after it."""
        while records:
            try:
                self.handler.handle_batch(records, self)
            except BatchFailed as failed:
                idx, err = failed.index, failed.error
            except Exception as surprise:  # a batch handler that did not say where
                idx, err = 0, surprise
            else:
                self._handled(records)
                self._end_retry()
                return
            self._handled(records[:idx])
            rec = records[idx]
            if isinstance(err, FatalError):
                raise err
            if isinstance(err, Rewind):
                self._rewind(err, records[idx:])
                return
            if isinstance(err, PermanentError):
                self.dead_letter(rec, str(err))
            elif self._retry_later(rec, err, records[idx:]):
                return
            self._handled([rec])
            self._end_retry()
            records = records[idx + 1 :]

    def _handled(self, records: Sequence[Record]) -> None:
        for rec in records:
            self.progress.handled(rec)
        self.stats.handled += len(records)

    def _retry_later(self, rec: Record, err: BaseException, rest: list[Record]) -> bool:
        """Schedule ``rest`` (``rec`` first) for a retry; False when the retry window is
        over and ``rec`` was dead-lettered instead."""
        if not isinstance(err, TransientError):
            self.throttle.log(
                log,
                logging.ERROR,
                f"surprise:{type(err).__name__}",
                "unexpected error on %s (retried as transient): %s: %s",
                rec.source,
                type(err).__name__,
                err,
            )
            log.debug("traceback of the unexpected error", exc_info=err)
        now = self._clock()
        r = self._retry
        if r is None or r.records[0] != rec:
            r = self._retry = _Retry(rest, err, now)
            self._pause(True)
        r.records, r.error = rest, err
        if now - r.first >= self.cfg.retry_for_s:
            self.dead_letter(
                rec,
                f"gave up after {r.attempt + 1} attempt(s) over {now - r.first:.0f}s: "
                f"{type(err).__name__}: {err}",
            )
            return False
        r.attempt += 1
        self.stats.retries += 1
        delay = getattr(err, "retry_after_s", None)
        if delay is None:
            # Full-jitter exponential back-off, capped.
            delay = self._rng() * min(self.cfg.retry_max_s, self.cfg.retry_base_s * 2**r.attempt)
        r.at = now + max(0.05, min(delay, self.cfg.retry_max_s))
        self.throttle.log(
            log,
            logging.WARNING,
            f"retry:{type(err).__name__}",
            "%s: %s; retry %d in %.1fs (dead letter after %.0fs)",
            rec.source,
            err,
            r.attempt,
            r.at - now,
            self.cfg.retry_for_s,
        )
        return True

    def _rewind(self, err: Rewind, unhandled: Sequence[Record]) -> None:
        """Seek back to ``err.offsets`` (and to the first of ``unhandled`` per partition),
        commit nothing past them, pause for ``err.retry_after_s``."""
        offsets = dict(err.offsets)
        for rec in unhandled:
            offsets[rec.tp] = min(rec.offset, offsets.get(rec.tp, rec.offset))
        self.progress.rewind(offsets)
        self._end_retry()
        for (topic, partition), off in sorted(offsets.items()):
            if (topic, partition) not in self.assigned:
                continue  # revoked meanwhile: its new owner reads from the commit
            try:
                self._consumer.seek(TopicPartition(topic, partition, off))
            except KafkaException as kerr:
                # Not re-read in this process: stop cleanly, nothing past was committed.
                raise FatalError(
                    f"cannot read {topic}[{partition}] again from offset {off} ({kerr}) "
                    f"after: {err}; restart to read it again from the last commit"
                ) from kerr
        self.stats.retries += 1
        delay = err.retry_after_s if err.retry_after_s is not None else self.cfg.retry_base_s
        self._rewind_at = self._clock() + max(0.05, min(delay, self.cfg.retry_max_s))
        self._pause(True)
        log.debug("rewound %s; reading again in %.1fs: %s", offsets, delay, err)

    def _end_retry(self) -> None:
        if self._retry is not None:
            self._retry = None
            self._pause(False)

    def _pause(self, on: bool) -> None:
        if on == self._paused:
            return
        tps = [TopicPartition(t, p) for t, p in self.assigned]
        try:
            if on:
                self._consumer.pause(tps)
            else:
                self._consumer.resume(tps)
        except KafkaException as err:
            log.warning("%s partitions: %s", "pause" if on else "resume", err)
        self._paused = on

    # ------------------------------------------------------------ commits

    def _commit(self, *, force: bool) -> None:
        now = self._clock()
        if not force and now - self._last_commit < self.cfg.commit_interval_s:
            return
        offsets = self.progress.committable(self.handler.pending())
        if not offsets:
            return
        self._last_commit = now
        assert self.deadletters is not None
        self.deadletters.confirm()  # the one rule: dead letters before the offsets passing them
        tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        try:
            result = self._consumer.commit(offsets=tps, asynchronous=False)
            failed = [tp for tp in result or [] if tp.error is not None]
            if failed:
                raise KafkaException(failed[0].error)
        except KafkaException as err:
            # Nothing is lost: the records are consumed again. The broker timeout decides
            # whether to give up.
            self.stats.commit_failures += 1
            self.throttle.log(log, logging.WARNING, "commit", "commit failed: %s", err)
            return
        self.progress.committed(offsets)
        self.stats.commits += 1
        self.metrics.actions.labels(stage=self.cfg.stage, outcome="commit").inc()

    # ------------------------------------------------------------ rebalances

    def _on_assign(self, _c: Any, partitions: list[Any]) -> None:
        self.assigned |= {(tp.topic, tp.partition) for tp in partitions}
        self._assigned_at = self._clock()
        self.state = "running"
        log.info("assigned %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions))
        if self._paused:
            # A retry is waiting: the new assignment waits too (assign first, so the
            # pause applies to it rather than being replaced by the automatic assign).
            self._consumer.assign(partitions)
            self._consumer.pause(partitions)

    def _on_revoke(self, _c: Any, partitions: list[Any]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self.handler.revoked(tps, False)
        try:
            self._commit(force=True)
        finally:
            self.progress.forget(tps)
            self.assigned -= set(tps)
            self._drop_retry(tps)

    def _on_lost(self, _c: Any, partitions: list[Any]) -> None:
        tps = [(tp.topic, tp.partition) for tp in partitions]
        self.handler.revoked(tps, True)
        self.progress.forget(tps)
        self.assigned -= set(tps)
        self._drop_retry(tps)

    def _drop_retry(self, tps: list[TP]) -> None:
        """Revoked partitions' records are no longer ours to retry (uncommitted: the new
        owner reads them again)."""
        r = self._retry
        if r is not None:
            gone = set(tps)
            r.records = [rec for rec in r.records if rec.tp not in gone]
            if not r.records:
                self._end_retry()

    # ------------------------------------------------------------ broker health

    def _on_kafka_error(self, err: KafkaError) -> None:
        code = err.code()
        if credentials_refused(err) and self._refused is None:
            self._refused = err  # raised from the loop: not from inside librdkafka
        if code in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._RESOLVE):
            self.outage.failed(self._clock())
        self.throttle.log(log, logging.WARNING, f"kafka:{code}", "kafka: %s", err)

    def _check_broker(self, *, got_message: bool) -> None:
        if self._refused is not None:
            raise CredentialsRefused(
                f"Kafka broker {self.cfg.kafka.resolved_bootstrap()} refused this service's "
                f"credentials: {self._refused.str()}; check [kafka.extra] (sasl.username, "
                "sasl.password, ssl.*) and the broker's users"
            )
        now = self._clock()
        if got_message:
            self._reachable(now)
            return
        if now - self._last_ok < self.cfg.probe_s and self.outage.since is None:
            return
        if now - self._last_probe < self.cfg.probe_s:
            self._give_up_if_long(now)
            return
        self._last_probe = now
        try:
            self._consumer.list_topics(timeout=min(2.0, self.cfg.probe_s))
        except KafkaException:
            self.outage.failed(now)
        else:
            self._reachable(now)
        self._give_up_if_long(now)

    def _reachable(self, now: float) -> None:
        down = self.outage.answered(now)
        if down is not None:
            log.info("broker reachable again after %.0fs", down)
        self._last_ok = now

    def _give_up_if_long(self, now: float) -> None:
        down = self.outage.too_long(now)
        if down is not None:
            raise BrokerUnreachable(
                f"Kafka broker {self.cfg.kafka.resolved_bootstrap()} unreachable for "
                f"{down:.0f}s (broker_timeout_s = {self.cfg.broker_timeout_s:g}); stopping"
            )

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        now = self._clock()
        down = self.outage.since
        return {
            "stage": self.cfg.stage,
            "pid": os.getpid(),
            "state": self.state,
            "ready": self.state == "running" and down is None and bool(self.assigned),
            "broker_down_s": None if down is None else round(now - down, 1),
            "assigned": sorted(f"{t}[{p}]" for t, p in self.assigned),
            "retrying": None
            if self._retry is None
            else {
                "source": self._retry.records[0].source if self._retry.records else None,
                "attempts": self._retry.attempt,
                "for_s": round(now - self._retry.first, 1),
                "error": str(self._retry.error),
            },
            "held": self.progress.held(),
            "committed": self.progress.snapshot(),
            "uptime_s": round(now - self.started, 1),
            "stats": {k: getattr(self.stats, k) for k in self.stats.__slots__},
            **self.handler.status(),
        }

    def _write_status(self) -> None:
        path = self.cfg.status_path
        if not path:
            return
        try:
            write_status(path, self.status())
        except OSError as err:
            self.throttle.log(log, logging.WARNING, "status", "status file %s: %s", path, err)
