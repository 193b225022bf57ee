"""Replay a recorded trace into Kafka at its recorded pace (scaled), or as fast as possible.

Any path :func:`producers.sources.open_sources` understands can be replayed; several
paths are merged by event time.

* Contract JSON-lines traces: each good line is sent **byte for byte** as one message,
  keyed by the communicator of its first event — what was recorded is what arrives.
  With ``format="arrow"`` each line is sent as Arrow IPC record batches instead (one
  message per communicator of the line), marked by the ``content-type`` header.
* Converted input (Inspector, Flight Recorder, the Parquet archive): events are grouped
  per communicator per ``window_s`` of trace time, one message each (as an exporter
  would send them), in ``format`` (a JSON array, or an Arrow IPC batch).
* Bad input (a line that does not decode, a dump that cannot be read) goes to the
  dead-letter topic with ``file:line`` and the reason, and is counted.

Pacing: message *i* is sent when ``(ts_i - ts_0) / speed`` seconds have passed since the
first, where ``ts`` is the earliest event time of the message; a message that is late
(or out of order) is sent at once. ``speed=None`` sends without waiting. The final
counts are of messages Kafka acknowledged, so they match the trace only when nothing
was lost; :attr:`ReplayStats.ok` says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaError, Message

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.signing import Sequencer, host_key, load_key, signed_event_headers
from c4base.topics import Topics
from producers.columnar import WireFormat, encode_batch
from producers.events import Event
from producers.exporter.publisher import Publisher, PublisherConfig
from producers.sources import BadLine, SourceBatch, open_sources

__all__ = ["ReplayConfig", "ReplayStats", "parse_speed", "replay"]

log = logging.getLogger(__name__)


def parse_speed(text: str) -> float | None:
    """``"max"`` → ``None`` (no pacing); otherwise a factor > 0.

    >>> parse_speed("max"), parse_speed("4")
    (None, 4.0)
    >>> parse_speed("0")
    Traceback (most recent call last):
    ...
    ValueError: --speed must be a number > 0 or 'max', got '0'
    """
    if text.strip().lower() == "max":
        return None
    try:
        speed = float(text)
    except ValueError:
        speed = 0.0
    if not speed > 0 or speed == float("inf"):
        raise ValueError(f"--speed must be a number > 0 or 'max', got {text!r}")
    return speed


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    events_topic: str = ""
    deadletter_topic: str = ""
    """Topic overrides; empty: ``Topics(prefix=kafka.topic_prefix)``'s, as every stage."""
    speed: float | None = 1.0
    """Trace seconds per wall second; ``None`` = as fast as possible."""
    job: str | None = None
    """Job id for formats that do not carry one (Inspector, Flight Recorder)."""
    window_s: float = 1.0
    """Grouping of converted events per communicator, in trace time."""
    max_batch_events: int = 2000
    """A converted group is sent early at this size (keeps messages well under 1 MB)."""
    progress: bool = True
    flush_timeout_s: float = 60.0
    format: WireFormat = "json"
    """Wire form of the messages: ``json`` arrays or ``arrow`` IPC record batches."""
    sign_with: Path | None = None
    """The operator's master key file: each message is split per host and signed with
    that host's derived key, as the host's own exporter would (docs/security.md)."""

    def __post_init__(self) -> None:
        # Frozen: resolve the defaults once, so every reader sees the prefixed names.
        topics = Topics(prefix=self.kafka.topic_prefix)
        object.__setattr__(self, "events_topic", self.events_topic or topics.events)
        object.__setattr__(self, "deadletter_topic", self.deadletter_topic or topics.deadletter)


@dataclass
class ReplayStats:
    messages: int = 0
    """Event messages sent (each acknowledged one counts in ``delivered``)."""
    events: int = 0
    bad: int = 0
    """Bad lines / unreadable dumps, each sent to the dead-letter topic."""
    delivered: int = 0
    deadletters_delivered: int = 0
    delivery_errors: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every message and dead letter was acknowledged by Kafka."""
        return (
            self.delivery_errors == 0
            and self.delivered == self.messages
            and self.deadletters_delivered == self.bad
        )


class _Pacer:
    """Sleeps (serving delivery reports) until a message's scaled trace time has come."""

    def __init__(self, speed: float | None, publisher: Publisher, clock: Callable[[], float]):
        self.speed = speed
        self.publisher = publisher
        self.clock = clock
        self.t0: float | None = None
        self.ts0 = 0

    def wait_for(self, ts_us: int) -> None:
        if self.speed is None:
            return
        if self.t0 is None:
            self.t0, self.ts0 = self.clock(), ts_us
            return
        target = self.t0 + (ts_us - self.ts0) / 1e6 / self.speed
        while (delay := target - self.clock()) > 0:
            self.publisher.poll(min(delay, 0.05))


def replay(
    paths: Iterable[str | Path],
    config: ReplayConfig,
    *,
    publisher: Publisher | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ReplayStats:
    """Publish the traces at ``paths``; returns the counts (see :class:`ReplayStats`)."""
    from tqdm import tqdm

    stats = ReplayStats()
    bad_seen: list[BadLine] = []
    # Opened first: an unusable path fails here, before a producer or a bar exists.
    batches = open_sources(paths, on_bad=bad_seen.append, job=config.job)
    pub = publisher or Publisher(PublisherConfig(config.kafka, client_id="c4stream-replay"))
    pacer = _Pacer(config.speed, pub, clock)
    bar = tqdm(unit="ev", unit_scale=True, disable=not config.progress, mininterval=0.5)

    def on_event_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is None:
            stats.delivered += 1
        else:
            stats.delivery_errors += 1
            log.error("event message lost: %s", err)

    def on_dl_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is None:
            stats.deadletters_delivered += 1
        else:
            stats.delivery_errors += 1
            log.error("dead letter lost: %s", err)

    def on_bad(bad: BadLine) -> None:
        stats.bad += 1
        dl = DeadLetter.of(
            bad.raw, reason=bad.reason, stage="replay", source=f"{bad.path}:{bad.lineno}"
        )
        pub.produce(config.deadletter_topic, dl.encode(), bad.path.encode(), on_dl_delivery)

    def send(
        value: bytes,
        comm: str,
        n_events: int,
        ts_us: int,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        pacer.wait_for(ts_us)
        pub.produce(
            config.events_topic, value, comm.encode(), on_event_delivery, headers=headers or None
        )
        stats.messages += 1
        stats.events += n_events
        bar.update(n_events)

    window_us = max(1, int(config.window_s * 1e6))
    window: int | None = None
    groups: dict[str, list[Event]] = {}

    fmt = config.format
    encode_batch([], fmt)  # an unknown format fails here, before anything is sent
    master = load_key(config.sign_with) if config.sign_with is not None else None
    seqs: dict[str, Sequencer] = {}  # per host, as each host's exporter numbers its messages

    def send_events(events: list[Event], comm: str) -> None:
        if master is None:
            value, headers = encode_batch(events, fmt)
            send(value, comm, len(events), min(e.ts_us for e in events), headers)
            return
        by_host: dict[str, list[Event]] = {}  # a signed message speaks for one host
        for ev in events:
            by_host.setdefault(ev.host, []).append(ev)
        for host, evs in by_host.items():
            value, headers = encode_batch(evs, fmt)
            fresh = seqs.setdefault(host, Sequencer()).next()
            headers = signed_event_headers(host_key(master, host), host, value, headers, fresh)
            send(value, comm, len(evs), min(e.ts_us for e in evs), headers)

    def flush_groups() -> None:
        for comm, events in groups.items():
            send_events(events, comm)
        groups.clear()

    start = clock()
    try:
        batch: SourceBatch
        for batch in batches:
            while bad_seen:
                on_bad(bad_seen.pop(0))
            if not batch.events:
                continue
            if batch.raw is not None and fmt == "json" and master is None:  # as recorded
                send(batch.raw, batch.events[0].comm, len(batch.events), batch.ts_us)
                continue
            if batch.raw is not None:  # a contract line as Arrow: one batch per communicator
                by_comm: dict[str, list[Event]] = {}
                for ev in batch.events:
                    by_comm.setdefault(ev.comm, []).append(ev)
                for comm, events in by_comm.items():
                    send_events(events, comm)
                continue
            for ev in batch.events:
                w = ev.ts_us // window_us
                if window is not None and w > window:
                    flush_groups()
                if window is None or w > window:
                    window = w
                group = groups.setdefault(ev.comm, [])
                group.append(ev)
                if len(group) >= config.max_batch_events:
                    send_events(group, ev.comm)
                    del groups[ev.comm]
        flush_groups()
        for bad in bad_seen:
            on_bad(bad)
        left = pub.flush(config.flush_timeout_s)
        if left:
            log.error("%d messages not acknowledged within %.0fs", left, config.flush_timeout_s)
    finally:
        bar.close()
        stats.elapsed_s = clock() - start
    return stats
