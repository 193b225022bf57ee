"""One runtime for the Kafka sink services (actuator, archiver, alerter).

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

One dead-letter rule (:class:`DeadLetterSink`): a dead letter is delivered, its delivery
callback confirmed, before any offset that passes its message is committed.

Operability: the runner exits with :class:`BrokerUnreachable` when the broker stays
unreachable for ``broker_timeout_s``; it answers ``stop`` (SIGTERM) within about
``poll_timeout_s`` in every state, back-off included; repeated error lines, its own and
librdkafka's, are rate-limited (:class:`LogThrottle`); ``status()`` (and the optional
status file) says what is true now; a stable ``group.instance.id`` gives static group
membership, so a restarted sink takes its partitions back without a rebalance wait.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from c4base.consumer_lag import LagMonitor
from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig, credentials_refused
from c4base.metrics import Metrics, MetricsLike, NullMetrics

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

TP = tuple[str, int]


# --------------------------------------------------------------------- classified failures


class TransientError(Exception):
    """Trying again later can help (a timeout, HTTP 503, an API server restarting)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Rewind(TransientError):
    """Read again from ``offsets`` (per partition) after ``retry_after_s``: results of
    records from there on were lost before they were durable. Raised by
    :meth:`Handler.handle_batch` or :meth:`Handler.tick`; the records of the batch at
    hand are read again too."""

    def __init__(self, message: str, offsets: dict[TP, int], *, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.offsets = dict(offsets)


class PermanentError(Exception):
    """This record can never be handled (invalid, refused for good): dead-letter it."""


class FatalError(Exception):
    """The service cannot go on (configuration, credentials, an unwritable dead-letter
    topic): it stops, commits nothing more and exits non-zero. The message says what to
    fix; uncommitted records are handled again after the restart."""


class DeadLetterError(FatalError):
    """A dead letter was not delivered; no offset past its message was committed."""


class BrokerUnreachable(FatalError):
    """The broker stayed unreachable longer than ``broker_timeout_s``."""


class CredentialsRefused(FatalError):
    """The broker refused the service's SASL credentials or TLS client certificate:
    retrying cannot help, so the service stops at once (no ``broker_timeout_s`` wait)."""


# --------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Record:
    """One Kafka message as a handler sees it (independent of the client library)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int = -1
    """Broker or producer timestamp (-1: not available)."""
    headers: tuple[tuple[str, bytes], ...] = ()
    """Kafka headers, e.g. ``content-type`` of an Arrow IPC event batch."""

    @property
    def source(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"

    @property
    def tp(self) -> TP:
        return (self.topic, self.partition)

    @classmethod
    def of(cls, msg: Any) -> Record:
        kind, ts = msg.timestamp()
        return cls(
            msg.topic(),
            msg.partition(),
            msg.offset(),
            msg.key(),
            msg.value() or b"",
            ts if kind != 0 else -1,  # 0 = TIMESTAMP_NOT_AVAILABLE
            tuple(msg.headers() or ()),
        )


# --------------------------------------------------------------------- log throttle


class LogThrottle:
    """At most one line per key per ``interval_s``; the next one says how many were held.

    >>> t = LogThrottle(interval_s=10.0, clock=iter([0.0, 1.0, 2.0, 11.0]).__next__)
    >>> [t.allow("down") for _ in range(4)]
    [(True, 0), (False, 0), (False, 0), (True, 2)]
    """

    def __init__(
        self, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> tuple[bool, int]:
        """(log it now?, lines held back since the last one logged)."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False, 0
            self._last[key] = now
            return True, self._held.pop(key, 0)

    def log(self, logger: logging.Logger, level: int, key: str, msg: str, *args: Any) -> None:
        ok, held = self.allow(key)
        if ok:
            if held:
                msg += f" ({held} similar line(s) held back)"
            logger.log(level, msg, *args)


class _ThrottleFilter(logging.Filter):
    """Rate-limits a logger's lines by message template (librdkafka's own logs)."""

    def __init__(self, throttle: LogThrottle) -> None:
        super().__init__()
        self.throttle = throttle

    def filter(self, record: logging.LogRecord) -> bool:
        # librdkafka lines carry the broker address and a counter: key on the facility.
        key = f"{record.name}:{record.levelno}:{str(record.msg)[:40]}"
        ok, held = self.throttle.allow(key)
        if ok and held:
            record.msg = f"{record.msg} ({held} similar line(s) held back)"
        return ok


def kafka_logger(stage: str, every_s: float = 30.0) -> logging.Logger:
    """A logger for librdkafka's own lines (a client's ``logger`` setting) that lets the
    same line through at most every ``every_s``: a broker that is down must not flood."""
    logger = logging.getLogger(f"c4base.runtime.rdkafka.{stage}")
    if not any(isinstance(f, _ThrottleFilter) for f in logger.filters):
        logger.addFilter(_ThrottleFilter(LogThrottle(every_s)))
    return logger


# --------------------------------------------------------------------- dead letters


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
        max_payload_bytes: int = 512 * 1024,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.stage = stage
        self.metrics = metrics or NullMetrics()
        self.confirm_timeout_s = confirm_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.sent = 0
        self.delivered = 0
        self._errors: list[str] = []
        self._lock = threading.Lock()

    def send(self, rec: Record, reason: str) -> None:
        payload = rec.value
        if len(payload) > self.max_payload_bytes:
            # A dead letter must fit in a Kafka message: keep the head and say so.
            reason = f"{reason} (payload truncated from {len(payload)} bytes)"
            payload = payload[: self.max_payload_bytes]
        letter = DeadLetter.of(
            payload, reason=reason, stage=self.stage, source=rec.source, key=rec.key
        )
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


# --------------------------------------------------------------------- progress


class Hold:
    """A record's result is not durable yet; :meth:`release` when it is. Thread-safe."""

    __slots__ = ("_progress", "record", "_open")

    def __init__(self, progress: _Progress, record: Record) -> None:
        self._progress = progress
        self.record = record
        self._open = True

    def release(self) -> None:
        if self._open:
            self._open = False
            self._progress._release(self.record)


class _Progress:
    """Per partition: the next offset handled, and offsets still held by a :class:`Hold`.

    >>> p = _Progress()
    >>> r = Record("t", 0, 5, None, b"")
    >>> h = p.hold(r); p.handled(r); p.handled(Record("t", 0, 6, None, b""))
    >>> p.committable({})
    {('t', 0): 5}
    >>> h.release(); p.committable({})
    {('t', 0): 7}
    """

    def __init__(self) -> None:
        self._next: dict[TP, int] = {}
        self._held: dict[TP, dict[int, int]] = {}
        self._committed: dict[TP, int] = {}
        self._lock = threading.Lock()

    def hold(self, rec: Record) -> Hold:
        with self._lock:
            held = self._held.setdefault(rec.tp, {})
            held[rec.offset] = held.get(rec.offset, 0) + 1
        return Hold(self, rec)

    def _release(self, rec: Record) -> None:
        with self._lock:
            held = self._held.get(rec.tp)
            if held is None or rec.offset not in held:
                return  # the partition was revoked meanwhile
            held[rec.offset] -= 1
            if not held[rec.offset]:
                del held[rec.offset]

    def handled(self, rec: Record) -> None:
        with self._lock:
            if rec.offset + 1 > self._next.get(rec.tp, -1):
                self._next[rec.tp] = rec.offset + 1

    def held(self) -> int:
        with self._lock:
            return sum(sum(h.values()) for h in self._held.values())

    def committable(self, pending: dict[TP, int]) -> dict[TP, int]:
        """Per partition, the offset to commit now (only those that moved on)."""
        out = {}
        with self._lock:
            for tp, nxt in self._next.items():
                safe = min(nxt, pending.get(tp, nxt))
                held = self._held.get(tp)
                if held:
                    safe = min(safe, min(held))
                if safe > self._committed.get(tp, -1):
                    out[tp] = safe
        return out

    def committed(self, offsets: dict[TP, int]) -> None:
        with self._lock:
            self._committed.update(offsets)

    def rewind(self, offsets: dict[TP, int]) -> None:
        """Records from ``offsets`` on are to be handled again: nothing past is committed."""
        with self._lock:
            for tp, off in offsets.items():
                if tp in self._next:
                    self._next[tp] = min(self._next[tp], off)

    def forget(self, tps: Iterable[TP] | None = None) -> None:
        with self._lock:
            for d in (self._next, self._held, self._committed):
                if tps is None:
                    d.clear()
                else:
                    for tp in tps:
                        d.pop(tp, None)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{t}[{p}]": o for (t, p), o in sorted(self._committed.items())}


# --------------------------------------------------------------------- handler API


class Context(Protocol):
    """What the runner offers a handler while it handles records."""

    def hold(self, rec: Record) -> Hold:
        """The result of ``rec`` becomes durable later: do not commit past it until the
        hold is released."""
        ...

    def dead_letter(self, rec: Record, reason: str) -> None:
        """Send ``rec`` to the dead-letter topic (confirmed before any commit past it)."""
        ...


class Handler(Protocol):
    """A service's part of the loop. Only :meth:`handle` is required; see
    :class:`BaseHandler` for the defaults."""

    def handle(self, rec: Record, ctx: Context) -> None:
        """Handle one record; raise a classified error (module docstring) on failure."""
        ...

    def handle_batch(self, records: Sequence[Record], ctx: Context) -> None:
        """Handle records in order; raise :class:`BatchFailed` to say which one failed."""
        ...

    def pending(self) -> dict[TP, int]:
        """Per partition, the lowest offset whose result is not durable yet."""
        ...

    def tick(self, ctx: Context) -> None:
        """About every ``tick_s``: time-driven work (file rolls, resolve timers)."""
        ...

    def revoked(self, tps: list[TP], lost: bool) -> None:
        """Partitions go away: make what can be durable durable (then a commit follows
        unless ``lost``)."""
        ...

    def close(self, stop_by: float, ctx: Context) -> None:
        """Clean stop: finish what can be finished before monotonic time ``stop_by``."""
        ...

    def abort(self) -> None:
        """After a fatal error: drop what is not durable (it is consumed again)."""
        ...

    def status(self) -> dict[str, Any]: ...


class BaseHandler:
    """Defaults for the optional parts of :class:`Handler`."""

    def handle(self, rec: Record, ctx: Context) -> None:
        raise NotImplementedError

    def handle_batch(self, records: Sequence[Record], ctx: Context) -> None:
        """Records one by one; a failure says which record it was."""
        for i, rec in enumerate(records):
            try:
                self.handle(rec, ctx)
            except Exception as err:
                raise BatchFailed(i, err) from err

    def pending(self) -> dict[TP, int]:
        return {}

    def tick(self, ctx: Context) -> None:
        pass

    def revoked(self, tps: list[TP], lost: bool) -> None:
        pass

    def close(self, stop_by: float, ctx: Context) -> None:
        pass

    def abort(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}


class BatchFailed(Exception):
    """Raised by :meth:`Handler.handle_batch`: the records before ``index`` are handled,
    the one at ``index`` failed with ``error`` (classified like any other)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.index = index
        self.error = error


# --------------------------------------------------------------------- the runner


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


@dataclass(slots=True)
class RunnerStats:
    received: int = 0
    handled: int = 0
    deadlettered: int = 0
    retries: int = 0
    commits: int = 0
    commit_failures: int = 0


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
        self.progress = _Progress()
        self.throttle = LogThrottle(cfg.log_every_s)
        self.state = "starting"
        self.assigned: set[TP] = set()
        self.broker_down_since: float | None = None
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

    def _instance_id(self) -> str | None:
        iid = self.cfg.instance_id
        if iid is None:
            return default_instance_id(self.cfg.group)
        return iid or None

    def _consumer_config(self) -> dict[str, Any]:
        over: dict[str, Any] = {
            "auto.offset.reset": self.cfg.offset_reset,
            "session.timeout.ms": int(self.cfg.session_timeout_s * 1000),
            "error_cb": self._on_kafka_error,
            "logger": self._rdkafka_log,
        }
        iid = self._instance_id()
        if iid:
            over["group.instance.id"] = iid
        over.update(self.cfg.consumer_overrides)
        return self.cfg.kafka.consumer_config(self.cfg.group, **over)

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
        self._consumer = Consumer(self._consumer_config())
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
            self._instance_id() or "dynamic",
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
            if self.broker_down_since is None:
                self.broker_down_since = self._clock()
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
        if now - self._last_ok < self.cfg.probe_s and self.broker_down_since is None:
            return
        if now - self._last_probe < self.cfg.probe_s:
            self._give_up_if_long(now)
            return
        self._last_probe = now
        try:
            self._consumer.list_topics(timeout=min(2.0, self.cfg.probe_s))
        except KafkaException:
            if self.broker_down_since is None:
                self.broker_down_since = now
        else:
            self._reachable(now)
        self._give_up_if_long(now)

    def _reachable(self, now: float) -> None:
        if self.broker_down_since is not None:
            log.info("broker reachable again after %.0fs", now - self.broker_down_since)
        self.broker_down_since = None
        self._last_ok = now

    def _give_up_if_long(self, now: float) -> None:
        down = self.broker_down_since
        limit = self.cfg.broker_timeout_s
        if down is not None and limit > 0 and now - down >= limit:
            raise BrokerUnreachable(
                f"Kafka broker {self.cfg.kafka.resolved_bootstrap()} unreachable for "
                f"{now - down:.0f}s (broker_timeout_s = {limit:g}); stopping"
            )

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        now = self._clock()
        down = self.broker_down_since
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
        tmp = f"{path}.tmp"
        try:
            Path(tmp).write_text(json.dumps(self.status()))
            os.replace(tmp, path)
        except OSError as err:
            self.throttle.log(log, logging.WARNING, "status", "status file %s: %s", path, err)
