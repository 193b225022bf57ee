"""What the actuator did with each command, published to ``c4.actions`` for the alerter.

One JSON record per handled command (key = the command's host), after the ledger
write. The alerter joins it to its open alert by ``job`` and ``host`` (the host as the
command named it, before node-name mapping) and shows what really happened: acted,
dry run, skipped (an administrator's drain kept), denied, failed.

The ledger is the record of truth, and a missing ``c4.actions`` topic must not stop
isolations: a delivery error is logged and counted. But a report is not lost to a
crash: the command's offset is committed only once its report is on the broker (the
handler holds it until ``on_done``), so a command whose report was still queued when
the actuator was killed is delivered again and reported again (a ``duplicate`` of
the ledger's status; readers key on ``command_id``).

>>> r = ActionReport(command_id="c4-1", ts_us=1, job="j", host="n5.cluster.local",
...                  node="n5", action="cordon", fault="straggler", decision="act",
...                  status="done", detail="drained node n5", dry_run=False)
>>> decode_report(encode_report(r)) == r
True
>>> r.outcome
'acted'
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

__all__ = [
    "ActionReport",
    "OutcomePublisher",
    "ReportDecodeError",
    "decode_report",
    "encode_report",
    "new_report",
    "outcome_of",
]

log = logging.getLogger("c4stream.actuator.outcomes")

Outcome = Literal[
    "acted",
    "dry_run",
    "skipped",
    "denied",
    "alert_only",
    "duplicate",
    "capped",
    "failed",
    "unknown",
]


def outcome_of(decision: str, status: str) -> Outcome:
    """One word for what became of a command (the metric label and the alert's field).

    >>> outcome_of("act", "done"), outcome_of("act", "skipped"), outcome_of("act", "failed")
    ('acted', 'skipped', 'failed')
    >>> outcome_of("dry_run", "dry_run"), outcome_of("denied", "skipped")
    ('dry_run', 'denied')
    >>> outcome_of("act", "unknown")  # stopped while acting; the target cannot tell
    'unknown'
    """
    if status in ("failed", "unknown"):
        return status  # type: ignore[return-value]
    if decision == "act":
        return "skipped" if status == "skipped" else "acted"
    return decision  # type: ignore[return-value]


class ReportDecodeError(ValueError):
    """A record on the actions topic is not an :class:`ActionReport`."""


class ActionReport(msgspec.Struct, kw_only=True):
    """One handled command (``c4.actions`` v1: sinks/contracts/action-report.schema.json)."""

    v: Literal[1] = 1
    kind: Literal["action"] = "action"
    command_id: str
    ts_us: int
    """When the actuator finished with it, µs since the epoch."""
    job: str
    host: str
    """The command's host, as the pipeline named it."""
    node: str
    """The node acted on (after ``strip_domain`` / ``node_regex``)."""
    action: str
    fault: str
    decision: str
    """The policy's decision: act, dry_run, denied, alert_only, duplicate, capped."""
    status: str
    """The ledger's status: done, dry_run, skipped, failed, unknown (the actuator stopped
    while acting and the target cannot tell whether the action ran; not run again)."""
    detail: str
    dry_run: bool
    """True when nothing was acted on because of a dry-run switch (either one)."""

    @property
    def outcome(self) -> Outcome:
        return outcome_of(self.decision, self.status)


_decoder = msgspec.json.Decoder(ActionReport)


def encode_report(r: ActionReport) -> bytes:
    return msgspec.json.encode(r)


def decode_report(data: bytes) -> ActionReport:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as err:
        raise ReportDecodeError(f"invalid action report: {err}") from None


class OutcomePublisher:
    """Produces :class:`ActionReport` records without waiting; ``on_done`` says when
    one is settled (on the broker, or given up with an error logged, see module)."""

    def __init__(self, producer: Any, topic: str) -> None:
        self.producer = producer
        self.topic = topic
        self.errors = 0

    def publish(self, report: ActionReport, on_done: Callable[[], None] | None = None) -> None:
        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                self.errors += 1
                log.warning("outcome of %s not published to %s: %s", report.command_id,
                            self.topic, err)  # fmt: skip
            if on_done is not None:
                on_done()

        try:
            self.producer.produce(
                self.topic,
                encode_report(report),
                key=report.host.encode(),
                on_delivery=on_delivery,
            )
        except BufferError as err:  # local queue full: the ledger still has it
            on_delivery(err, None)
        self.producer.poll(0)

    def poll(self) -> None:
        """Serve delivery reports (their ``on_done``) without waiting."""
        self.producer.poll(0)

    def flush(self, timeout_s: float) -> None:
        self.producer.flush(max(0.0, timeout_s))

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)


def new_report(
    *,
    command_id: str,
    job: str,
    host: str,
    node: str,
    action: str,
    fault: str,
    decision: str,
    status: str,
    detail: str,
) -> ActionReport:
    """An :class:`ActionReport` stamped now."""
    return ActionReport(
        command_id=command_id,
        ts_us=time.time_ns() // 1000,
        job=job,
        host=host,
        node=node,
        action=action,
        fault=fault,
        decision=decision,
        status=status,
        detail=detail[:500],
        dry_run=decision == "dry_run",
    )
