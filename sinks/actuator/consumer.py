"""The actuator's Kafka loop: decode, decide, act, record, then commit.

Per message on ``c4.isolations``, strictly in this order:

1. decode with :func:`streams.commands.decode_command`; an invalid message goes to
   ``c4.deadletter`` with the reason (delivery confirmed before going on);
2. decide (:func:`sinks.actuator.policy.decide`); to act, first write ``in_progress``
   to the ledger (durable), then act through the backend, with bounded retries for
   transient failures (then dead-lettered);
3. record the outcome in the ledger (durable);
4. commit the message's offset (synchronously).

So a crash before 2's ledger write acts on redelivery as the first time; a crash
between it and 3 leaves ``in_progress``, and the redelivered command asks the target
whether the action is already there (:mod:`sinks.actuator.recovery`) instead of
repeating it; a crash after 3 never acts again. The isolations topic has one
partition: commands are handled one at a time, in the order they were decided.

:class:`Actuator` holds steps 2–3 and knows nothing of Kafka (tests call it directly);
:func:`run` puts it in the shared loop (:class:`~c4base.runtime.ConsumerRunner`), which
does steps 1 and 4 for every sink the same way. The backends' errors are the runtime's
classes: transient (retried here, boundedly, then dead-lettered), permanent (dead
letter), fatal (stop, nothing committed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from confluent_kafka import Producer

from c4base.consumer_lag import observe_latency
from c4base.metrics import MetricsLike, NullMetrics
from c4base.runtime import (
    TP,
    BaseHandler,
    ConsumerRunner,
    Context,
    DeadLetterError,
    PermanentError,
    Record,
    RunnerConfig,
    TransientError,
    kafka_logger,
)
from c4base.signing import SIG_HEADER, command_refusal, header, load_keys
from sinks.actuator.backends import (
    ActuatorConfigError,
    ActuatorError,
    Backend,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.config import ActuatorConfig
from sinks.actuator.ledger import FINAL, Ledger, Status
from sinks.actuator.outcomes import ActionReport, OutcomePublisher, new_report, outcome_of
from sinks.actuator.policy import Decision, decide, fault_key
from sinks.actuator.recovery import already_applied
from sinks.actuator.restart import RestartHook
from streams.commands import CommandDecodeError, IsolationCommand, decode_command

__all__ = [
    "Actuator",
    "ActuatorHandler",
    "DeadLetterError",
    "Handled",
    "Interrupted",
    "RunStats",
    "report_for",
    "run",
]

log = logging.getLogger("c4stream.actuator")

STAGE = "actuator"

#: TEST HOOK, off unless set: "1" makes the actuator SIGKILL itself right after a
#: backend acted on a command's first attempt and before the ledger records it (the
#: crash window of sinks.actuator.recovery). Only the chaos and sink tests set it.
TEST_KILL_ENV = "C4STREAM_TEST_KILL_BEFORE_RECORD"

#: Detail prefix of an ``in_progress`` row whose action is done and whose job restart
#: was interrupted (a stop during its back-off): delivered again, it only restarts.
_ACTED = "acted; job restart pending: "


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


class Interrupted(ActuatorError, TransientError):
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
    refused: int = 0
    """Unsigned or forged commands (``require_signed_commands``): never acted on."""
    by_decision: dict[str, int] = field(default_factory=dict)
    failed: int = 0

    def count(self, h: Handled) -> None:
        key = outcome_of(h.decision, h.status)
        if key == "failed":
            self.failed += 1
        self.by_decision[key] = self.by_decision.get(key, 0) + 1

    def __str__(self) -> str:
        parts = [f"received {self.received}", f"invalid {self.invalid}"]
        parts += [f"refused {self.refused}"] if self.refused else []
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
        restart: RestartHook | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.ledger = ledger
        self.stop = stop or threading.Event()
        self.restart = restart
        """Restarts the job after an isolation (sinks.actuator.restart); None: never."""
        self._applied = False
        """The backend's apply returned during the command at hand (for the test hook)."""
        self._kill_before_record = os.environ.get(TEST_KILL_ENV) == "1"
        if self._kill_before_record:
            log.warning("TEST HOOK %s=1: SIGKILL after acting, before recording", TEST_KILL_ENV)
        for e in ledger.unfinished():
            log.warning(
                "UNFINISHED %s (host %s, %s): the actuator stopped while acting; the target "
                "is checked when the command is delivered again",
                e.id,
                e.host,
                e.action,
            )

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
        entry = self.ledger.get(cmd.id)
        prior = entry.status if entry is not None else None
        decision, why = decide(
            cmd,
            self.cfg,
            already_done=prior in FINAL,
            same_fault_done=self.ledger.fault_done(
                key, now_us - int(self.cfg.fault_window_s * 1e6)
            ),
            job_actions=self.ledger.acted_for_job(cmd.job, now_us - 3_600_000_000),
        )
        tag = f"{cmd.id} (host {cmd.host}, {cmd.action}, {cmd.fault})"
        self._applied = False
        if decision == "duplicate" and prior == "unknown":
            why = f"command {cmd.id} may have acted before a crash (ledger: unknown); not run again"
            log.warning("SKIP %s: %s", tag, why)
            h = Handled(decision, "unknown", why)
        elif decision == "duplicate" and prior == "done":
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
            h = self._begin_and_act(cmd, tag, key, unfinished=prior == "in_progress")
        if self.restart is not None and h.status in ("done", "dry_run"):
            # Before the isolation's ledger row: a crash in between repeats the (safe)
            # isolation, and the restart log keeps the restart from happening twice.
            try:
                r = self.restart.after(cmd, h.decision)
            except BaseException:
                if h.decision == "act" and h.status == "done":
                    # Acted, the restart not finished: say so, so the redelivery
                    # restarts without acting (or asking the target) again.
                    self.ledger.begin(
                        cmd.id, host=cmd.host, action=cmd.action,
                        detail=f"{_ACTED}{h.detail}", job=cmd.job, fault_key=key,
                    )  # fmt: skip
                raise
            if r is not None:  # the ledger row and the c4.actions record say it too
                h = dataclasses.replace(h, detail=f"{h.detail}; job restart {r.status}: {r.detail}")
        if self._applied and self._kill_before_record and prior != "in_progress":
            os.kill(os.getpid(), signal.SIGKILL)  # the test hook (TEST_KILL_ENV)
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

    def _begin_and_act(
        self, cmd: IsolationCommand, tag: str, key: str, *, unfinished: bool
    ) -> Handled:
        """Mark ``in_progress`` durably, then act — or, when an earlier attempt was left
        unfinished by a crash, ask the target first (sinks.actuator.recovery)."""
        entry = self.ledger.get(cmd.id) if unfinished else None
        if entry is not None and entry.detail.startswith(_ACTED):
            log.info("DONE %s before the stop; the job restart follows", tag)
            return Handled("act", "done", entry.detail.removeprefix(_ACTED))
        self.ledger.begin(
            cmd.id,
            host=cmd.host,
            action=cmd.action,
            detail="acting" if not unfinished else "checking the target after a crash",
            job=cmd.job,
            fault_key=key,
        )
        if unfinished:
            try:
                found = already_applied(self.backend, cmd)
            except (ActuatorConfigError, TransientActionError):
                raise  # stop, or the runner retries the command: it stays in_progress
            except PermanentActionError as err:  # no such node: it cannot have acted
                log.error("FAILED %s: %s (dead-lettered)", tag, err)
                return Handled("act", "failed", str(err), deadletter_reason=str(err))
            except Exception as err:  # a surprise: retried by the runner, never guessed
                raise TransientActionError(f"checking {tag} after a crash: {err}") from err
            if found.state == "applied":
                log.warning(
                    "RECOVERED %s: already applied before the restart: %s", tag, found.detail
                )
                return Handled(
                    "act", "done", f"found already applied after a crash: {found.detail}"
                )
            if found.state == "unknown":
                log.error("UNKNOWN %s: %s", tag, found.detail)
                return Handled("act", "unknown", found.detail)
            log.warning("RESUME %s after a crash: %s", tag, found.detail)
        try:
            return self._act(cmd, tag)
        except (ActuatorConfigError, Interrupted) as err:
            # It finished (it did not act, or it failed and may be retried): not unfinished.
            self.ledger.record(
                cmd.id,
                status="failed",
                host=cmd.host,
                action=cmd.action,
                detail=str(err),
                job=cmd.job,
                fault_key=key,
            )
            raise

    def _act(self, cmd: IsolationCommand, tag: str) -> Handled:
        attempts = max(1, self.cfg.attempts)
        for attempt in range(1, attempts + 1):
            try:
                if attempt == 1:
                    log.info("ACT %s: %s", tag, self.backend.describe(cmd))
                outcome = self.backend.apply(cmd)
                self._applied = True
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


REPORT_WAIT_S = 10.0
"""How long a command's ``c4.actions`` report may take to be confirmed before the next
command (commands are rare; a broker that slow is one the runner's outage clock sees)."""


class ActuatorHandler(BaseHandler):
    """The actuator's part of the shared loop: decode, then :class:`Actuator`."""

    def __init__(
        self,
        actuator: Actuator,
        stats: RunStats,
        metrics: MetricsLike,
        outcomes: OutcomePublisher | None = None,
    ) -> None:
        self.actuator = actuator
        self.stats = stats
        self.metrics = metrics
        self.outcomes = outcomes
        cfg = actuator.cfg
        self._keys = load_keys(cfg.command_key_files) if cfg.require_signed_commands else None

    def handle(self, rec: Record, ctx: Context) -> None:
        self.stats.received += 1
        if self._keys is not None:
            why = command_refusal(self._keys, rec.value, header(rec.headers, SIG_HEADER))
            if why is not None:
                self._refuse(rec, why, ctx)
        try:
            cmd = decode_command(rec.value)
        except CommandDecodeError as err:
            self.stats.invalid += 1
            log.error("INVALID %s: %s (dead-lettered)", rec.source, err)
            raise PermanentError(f"invalid isolation command: {err}") from None
        self.metrics.isolations.labels(stage=STAGE, fault=cmd.fault, action=cmd.action).inc()
        observe_latency(self.metrics, STAGE, ts_us=cmd.ts_us)
        # ActuatorConfigError is a FatalError: the runner stops without committing.
        handled = self.actuator.handle(cmd)
        self.stats.count(handled)
        self.metrics.actions.labels(stage=STAGE, outcome=_outcome(handled)).inc()
        if self.outcomes is not None:
            # On the broker before the command is committed and the next one acted on: a
            # kill meanwhile lost the report (only the ledger said it, and it is not read
            # again). Should the broker not confirm it in time, the hold keeps the command
            # uncommitted, so it is delivered, and reported, again after a restart.
            self.outcomes.publish(report_for(cmd, handled), ctx.hold(rec).release)
            self.outcomes.flush(REPORT_WAIT_S)
        if handled.deadletter_reason is not None:
            raise PermanentError(handled.deadletter_reason)

    def _refuse(self, rec: Record, why: str, ctx: Context) -> None:
        """Never act on it: dead letter, and a ``denied`` report when it decodes."""
        self.stats.refused += 1
        self.metrics.actions.labels(stage=STAGE, outcome="denied").inc()
        log.error("REFUSED %s: %s (dead-lettered, not acted on)", rec.source, why)
        if self.outcomes is not None:
            try:
                cmd = decode_command(rec.value)
            except CommandDecodeError:
                pass  # nothing to report it under: the dead letter says it
            else:
                h = Handled("denied", "skipped", f"refused: {why}", node=cmd.host)
                self.outcomes.publish(report_for(cmd, h), ctx.hold(rec).release)
                self.outcomes.flush(REPORT_WAIT_S)
        raise PermanentError(f"refused isolation command: {why}")

    def tick(self, ctx: Context) -> None:
        if self.outcomes is not None:
            self.outcomes.poll()  # releases the holds of delivered reports

    def revoked(self, tps: list[TP], lost: bool) -> None:
        if self.outcomes is not None and not lost:
            self.outcomes.flush(5.0)

    def close(self, stop_by: float, ctx: Context) -> None:
        if self.outcomes is not None:
            self.outcomes.flush(stop_by - time.monotonic())

    def status(self) -> dict[str, Any]:
        return {"actuator": str(self.stats)}


def run(
    cfg: ActuatorConfig,
    backend: Backend,
    ledger: Ledger,
    *,
    stop: threading.Event | None = None,
    metrics: MetricsLike | None = None,
    restart: RestartHook | None = None,
) -> RunStats:
    """Consume ``c4.isolations`` until ``stop``, idle timeout or ``max_messages``.

    The loop is the shared :class:`~c4base.runtime.ConsumerRunner`: each message is
    decoded, decided, acted on and recorded, then committed (the dead letter of a
    failed one delivered first). With ``metrics``: messages in, dead letters,
    isolations received (by fault and action), sink actions (by outcome), latency.

    Raises :class:`~c4base.runtime.FatalError` (configuration, an undelivered dead
    letter, broker unreachable past ``broker_timeout_s``) without committing the
    message at hand.
    """
    stop = stop or threading.Event()
    metrics = metrics or NullMetrics()
    stats = RunStats()
    if not cfg.require_signed_commands:
        log.warning(
            "SIGNING IS OFF: [actuator] require_signed_commands = false, so any writer of "
            "c4.isolations can command (docs/security.md section 5)"
        )
    outcomes = (
        OutcomePublisher(
            Producer(cfg.kafka.producer_config(logger=kafka_logger(STAGE))), cfg.actions_topic()
        )
        if cfg.publish_outcomes
        else None
    )
    actuator = Actuator(cfg, backend, ledger, stop=stop, restart=restart)
    handler = ActuatorHandler(actuator, stats, metrics, outcomes)
    runner = ConsumerRunner(
        RunnerConfig(
            stage=STAGE,
            topics=[cfg.isolations_topic()],
            deadletter_topic=cfg.deadletter_topic(),
            group=cfg.group,
            kafka=cfg.kafka,
            instance_id=cfg.instance_id,
            batch_size=1,  # one command at a time, in the order they were decided
            poll_timeout_s=cfg.poll_timeout_s,
            broker_timeout_s=cfg.broker_timeout_s,
            status_path=cfg.status_file or None,
            max_messages=cfg.max_messages,
            exit_when_idle_s=cfg.exit_when_idle_s,
        ),
        handler,
        metrics=metrics,
        stop=stop,
    )
    log.info(
        "actuator: backend %s, %s",
        backend.name,
        "EXECUTE (commands the worker marked dry_run are still only logged)"
        if cfg.execute
        else "dry-run: without --execute nothing is acted on",
    )
    try:
        runner.run()
    finally:
        if outcomes is not None:
            outcomes.close()
    log.info("actuator stopped: %s", stats)
    return stats
