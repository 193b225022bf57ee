"""The actuator's Kafka loop: decode, decide, act, record, then commit.

Per message on ``c4.isolations``, strictly in this order:

1. decode with :func:`streams.commands.decode_command`; an invalid message goes to
   ``c4.deadletter`` with the reason (delivery confirmed before going on);
2. decide (:func:`sinks.actuator.policy.decide`) and act through the backend, with
   bounded retries for transient failures (then dead-lettered);
3. record the outcome in the ledger (durable);
4. commit the message's offset (synchronously).

So a crash anywhere before 3 repeats the action on redelivery (backends' actions are
safe repeats), and a crash after 3 never acts again. The isolations topic has one
partition: commands are handled one at a time, in the order they were decided.

:class:`Actuator` holds steps 2–3 and knows nothing of Kafka (tests call it directly);
:func:`run` is the loop around it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from c4base.consumer_lag import LagMonitor, observe_latency
from c4base.deadletter import DeadLetter
from c4base.metrics import Metrics
from sinks.actuator.backends import (
    ActuatorConfigError,
    ActuatorError,
    Backend,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.config import ActuatorConfig
from sinks.actuator.ledger import Ledger, Status
from sinks.actuator.outcomes import ActionReport, OutcomePublisher, new_report, outcome_of
from sinks.actuator.policy import Decision, decide, fault_key
from streams.commands import CommandDecodeError, IsolationCommand, decode_command

__all__ = ["Actuator", "DeadLetterError", "Handled", "Interrupted", "RunStats", "run"]

log = logging.getLogger("c4stream.actuator")

STAGE = "actuator"


def _outcome(h: Handled) -> str:
    """Label of ``c4stream_sink_actions_total``: acted, failed, skipped, dry_run, denied, …"""
    return outcome_of(h.decision, h.status)


def report_for(cmd: IsolationCommand, h: Handled) -> ActionReport:
    """The ``c4.actions`` record of one handled command."""
    return new_report(
        command_id=cmd.id,
        job=cmd.job,
        host=cmd.host,
        node=h.node or cmd.host,
        action=cmd.action,
        fault=cmd.fault,
        decision=h.decision,
        status=h.status,
        detail=h.detail,
    )


class DeadLetterError(ActuatorError):
    """A dead letter could not be delivered to Kafka; the offset was not committed.

    The actuator stops; the message is handled again when it restarts. Check the
    broker and that the dead-letter topic exists.
    """


class Interrupted(ActuatorError):
    """Asked to stop while retrying: the command is neither recorded nor committed, so it
    is delivered again after the restart."""


@dataclass(frozen=True, slots=True)
class Handled:
    """What became of one command."""

    decision: Decision
    status: Status
    detail: str
    deadletter_reason: str | None = None
    node: str | None = None
    """The node name acted on (the host after ``strip_domain`` / ``node_regex``)."""


@dataclass(slots=True)
class RunStats:
    """Counts of one :func:`run`; printed when it ends."""

    received: int = 0
    invalid: int = 0
    by_decision: dict[str, int] = field(default_factory=dict)
    failed: int = 0

    def count(self, h: Handled) -> None:
        key = outcome_of(h.decision, h.status)
        if key == "failed":
            self.failed += 1
        self.by_decision[key] = self.by_decision.get(key, 0) + 1

    def __str__(self) -> str:
        parts = [f"received {self.received}", f"invalid {self.invalid}"]
        parts += [f"{k} {v}" for k, v in sorted(self.by_decision.items())]
        return ", ".join(parts)


class Actuator:
    """Decides, acts (with bounded retries) and records one command at a time."""

    def __init__(
        self,
        cfg: ActuatorConfig,
        backend: Backend,
        ledger: Ledger,
        *,
        stop: threading.Event | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.ledger = ledger
        self.stop = stop or threading.Event()

    def handle(self, cmd: IsolationCommand) -> Handled:
        """Carry out ``cmd`` if the rules allow; the ledger row is written on return.

        Raises :class:`~sinks.actuator.backends.ActuatorConfigError` (stop the actuator;
        nothing recorded).
        """
        node = self.cfg.node_name(cmd.host)
        if node != cmd.host:  # backends act on the scheduler's / Kubernetes' node name
            cmd = msgspec.structs.replace(cmd, host=node)
        key = fault_key(cmd)
        now_us = time.time_ns() // 1000
        decision, why = decide(
            cmd,
            self.cfg,
            already_done=self.ledger.is_done(cmd.id),
            same_fault_done=self.ledger.fault_done(
                key, now_us - int(self.cfg.fault_window_s * 1e6)
            ),
            job_actions=self.ledger.acted_for_job(cmd.job, now_us - 3_600_000_000),
        )
        tag = f"{cmd.id} (host {cmd.host}, {cmd.action}, {cmd.fault})"
        if decision == "duplicate" and self.ledger.is_done(cmd.id):
            log.info("SKIP %s: %s", tag, why)
            h = Handled(decision, "done", why)
        elif decision in ("alert_only", "denied", "duplicate", "capped"):
            log.warning("SKIP %s: %s", tag, why)
            h = Handled(decision, "skipped", why)
        elif decision == "dry_run":
            try:
                plan = self.backend.describe(cmd)
            except PermanentActionError as err:
                plan = f"would fail: {err}"
            log.warning("DRY-RUN %s (%s): would %s", tag, why, plan)
            h = Handled(decision, "dry_run", f"{why}; would {plan}")
        else:
            h = self._act(cmd, tag)
        self.ledger.record(
            cmd.id,
            status=h.status,
            host=cmd.host,
            action=cmd.action,
            detail=h.detail,
            job=cmd.job,
            fault_key=key,
        )
        return dataclasses.replace(h, node=node)

    def _act(self, cmd: IsolationCommand, tag: str) -> Handled:
        attempts = max(1, self.cfg.attempts)
        for attempt in range(1, attempts + 1):
            try:
                if attempt == 1:
                    log.info("ACT %s: %s", tag, self.backend.describe(cmd))
                outcome = self.backend.apply(cmd)
            except ActuatorConfigError:
                raise
            except PermanentActionError as err:
                log.error("FAILED %s: %s (dead-lettered)", tag, err)
                return Handled("act", "failed", str(err), deadletter_reason=str(err))
            except Exception as err:  # TransientActionError, or a surprise
                if not isinstance(err, TransientActionError):
                    # A bug or a surprise from a client library: never crash-loop on one
                    # message; treat it as transient and keep the traceback in the log.
                    log.exception("unexpected error acting on %s", tag)
                if attempt == attempts:
                    reason = f"gave up after {attempt} attempt(s): {err}"
                    log.error("FAILED %s: %s (dead-lettered)", tag, reason)
                    return Handled("act", "failed", reason, deadletter_reason=reason)
                pause = self.cfg.retry_backoff_s * 2 ** (attempt - 1) * random.uniform(0.8, 1.2)
                log.warning(
                    "RETRY %s in %.1fs (attempt %d/%d): %s", tag, pause, attempt, attempts, err
                )
                if self.stop.wait(pause):
                    raise Interrupted(f"stopped while retrying {tag}") from err
            else:
                if outcome.skipped:
                    log.warning("SKIPPED %s: %s", tag, outcome.detail)
                    return Handled("act", "skipped", outcome.detail)
                log.info("DONE %s: %s", tag, outcome.detail)
                return Handled("act", "done", outcome.detail)
        raise AssertionError("unreachable")


def run(
    cfg: ActuatorConfig,
    backend: Backend,
    ledger: Ledger,
    *,
    stop: threading.Event | None = None,
    metrics: Metrics | None = None,
) -> RunStats:
    """Consume ``c4.isolations`` until ``stop``, idle timeout or ``max_messages``.

    With ``metrics``: messages in, dead letters, isolations received (by fault and
    action), sink actions (by outcome: the decision), consumer lag, processing latency.

    Raises :class:`~sinks.actuator.backends.ActuatorConfigError` or
    :class:`DeadLetterError` without committing the message at hand.
    """
    from confluent_kafka import Consumer, KafkaException, Message, Producer

    stop = stop or threading.Event()
    actuator = Actuator(cfg, backend, ledger, stop=stop)
    topic, dl_topic = cfg.isolations_topic(), cfg.deadletter_topic()
    stats = RunStats()
    assigned_at: list[float] = []

    def on_assign(consumer: Any, partitions: list[Any]) -> None:
        assigned_at.append(time.monotonic())
        log.info("assigned %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))

    consumer = Consumer(cfg.kafka.consumer_config(cfg.group))
    producer: Producer | None = None
    outcomes = (
        OutcomePublisher(Producer(cfg.kafka.producer_config()), cfg.actions_topic())
        if cfg.publish_outcomes
        else None
    )
    lag = LagMonitor(consumer, metrics, STAGE) if metrics is not None else None

    def dead_letter(msg: Message, reason: str) -> None:
        nonlocal producer
        if producer is None:
            producer = Producer(cfg.kafka.producer_config(**{"linger.ms": 0}))
        rec = DeadLetter.of(
            msg.value() or b"",
            reason=reason,
            stage=STAGE,
            source=f"{msg.topic()}[{msg.partition()}]@{msg.offset()}",
            key=msg.key(),
        )
        errors: list[str] = []
        delivered: list[bool] = []

        def on_delivery(err: Any, _m: Any) -> None:
            (errors.append(str(err)) if err else delivered.append(True))

        producer.produce(dl_topic, rec.encode(), key=msg.key(), on_delivery=on_delivery)
        producer.flush(30.0)
        if not delivered:
            raise DeadLetterError(
                f"dead letter for {rec.source} not delivered to {dl_topic}: "
                f"{errors[0] if errors else 'timed out after 30s'}"
            )
        if metrics is not None:
            metrics.deadletters.labels(stage=STAGE).inc()

    consumer.subscribe([topic], on_assign=on_assign)
    log.info(
        "actuator consuming %s (group %s, backend %s, %s)",
        topic,
        cfg.group,
        backend.name,
        "EXECUTE (commands the worker marked dry_run are still only logged)"
        if cfg.execute
        else "dry-run: without --execute nothing is acted on",
    )
    last = time.monotonic()
    try:
        while not stop.is_set():
            if lag is not None:
                lag.maybe_update()
            msg = consumer.poll(cfg.poll_timeout_s)
            now = time.monotonic()
            if msg is None:
                idle_since = max(last, assigned_at[0]) if assigned_at else None
                if (
                    cfg.exit_when_idle_s is not None
                    and idle_since is not None
                    and now - idle_since >= cfg.exit_when_idle_s
                ):
                    log.info("idle for %.1fs; stopping", cfg.exit_when_idle_s)
                    break
                continue
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise KafkaException(err)
                log.warning("consumer: %s", err)
                continue
            last = now
            stats.received += 1
            if metrics is not None:
                metrics.messages_in.labels(stage=STAGE).inc()
            source = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
            try:
                cmd = decode_command(msg.value() or b"")
            except CommandDecodeError as decode_err:
                stats.invalid += 1
                log.error("INVALID %s: %s (dead-lettered)", source, decode_err)
                dead_letter(msg, f"invalid isolation command: {decode_err}")
            else:
                if metrics is not None:
                    metrics.isolations.labels(stage=STAGE, fault=cmd.fault, action=cmd.action).inc()
                    observe_latency(metrics, STAGE, ts_us=cmd.ts_us)
                try:
                    handled = actuator.handle(cmd)
                except Interrupted as stopped:
                    log.warning("%s; not committed, it will be delivered again", stopped)
                    break
                stats.count(handled)
                if outcomes is not None:
                    outcomes.publish(report_for(cmd, handled))
                if metrics is not None:
                    metrics.actions.labels(stage=STAGE, outcome=_outcome(handled)).inc()
                if handled.deadletter_reason is not None:
                    dead_letter(msg, handled.deadletter_reason)
            try:
                consumer.commit(message=msg, asynchronous=False)
            except KafkaException as commit_err:
                # Safe: the ledger already holds the outcome, a redelivery will not act.
                log.warning("commit of %s failed (%s); may be delivered again", source, commit_err)
            if cfg.max_messages is not None and stats.received >= cfg.max_messages:
                break
    finally:
        consumer.close()
        if producer is not None:
            producer.flush(10.0)
        if outcomes is not None:
            outcomes.close()
    log.info("actuator stopped: %s", stats)
    return stats
