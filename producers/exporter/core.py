"""The node exporter's core: tail → parse → batch per communicator → publish → remember.

:class:`Exporter` does one step per :meth:`Exporter.poll_once` so tests (and the loop in
:mod:`producers.exporter.loop`) can drive it:

1. read the complete new lines of every followed file (:class:`DirectoryTailer`);
2. parse each Inspector line into an ``op`` event and add it to its communicator's
   batch; a bad line becomes a dead letter (``source`` = ``file:line``) right away;
3. once per ``interval_s``, publish one message per communicator (a JSON array of its
   events, key = communicator id; split at ``max_batch_events``), then wait for Kafka
   to acknowledge what was sent (``flush``);
4. advance each file's saved position to the start of the oldest line that is not yet
   acknowledged (or to the end of what was read), and save the positions atomically.

Because a cycle ends with everything acknowledged and saved, stopping the exporter
between two polls — even with SIGKILL — loses nothing and repeats nothing on restart.
A kill *during* the flush of a cycle can repeat that cycle's messages (at-least-once; the
idempotent producer rules out duplicates from its own retries). Messages Kafka rejects
are kept and sent again on the next cycle; their lines are not marked done meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaError, Message

from c4base.config import Section
from c4base.consumer_lag import observe_latency
from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.metrics import MetricsLike, NullMetrics
from c4base.topics import Topics
from producers.events import encode_message
from producers.exporter.positions import FilePosition, PositionStore
from producers.exporter.publisher import Publisher, PublisherConfig, PublisherStopped
from producers.exporter.tail import DirectoryTailer, Line, ReadPosition
from producers.formats.inspector import (
    InspectorError,
    InspectorStatsRecord,
    inspector_job_from_dir,
    parse_inspector_line,
)

__all__ = ["Exporter", "ExporterConfig", "ExporterStats"]

_encode_event = encode_message  # one event in, its JSON object out

log = logging.getLogger(__name__)

STAGE = "exporter"


@dataclass(frozen=True, kw_only=True)
class ExporterConfig:
    """Everything one exporter needs, passed explicitly (the CLI builds it)."""

    directory: Path
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    events_topic: str = ""
    deadletter_topic: str = ""
    """Topic overrides; empty: ``Topics(prefix=kafka.topic_prefix)``'s, as every stage."""
    interval_s: float = 1.0
    state_file: Path | None = None
    job: str | None = None
    """Job id for the events; default: from a ``nccl-inspector-<jobid>`` directory name."""
    pattern: str = "*.log"
    max_batch_events: int = 5000
    max_batch_bytes: int = 512 * 1024
    """A batch is sent early at this many bytes (Kafka's default message limit is 1 MB,
    checked before compression)."""
    max_bytes_per_file: int = 4 << 20
    rotate_grace_s: float = 5.0
    flush_timeout_s: float = 10.0
    queue_max_messages: int = 10_000

    def __post_init__(self) -> None:
        # Frozen: resolve the defaults once, so every reader sees the prefixed names.
        topics = Topics(prefix=self.kafka.topic_prefix)
        object.__setattr__(self, "events_topic", self.events_topic or topics.events)
        object.__setattr__(self, "deadletter_topic", self.deadletter_topic or topics.deadletter)


@dataclass
class ExporterStats:
    lines: int = 0
    events: int = 0
    messages: int = 0
    delivered: int = 0
    deadletters: int = 0
    delivery_errors: int = 0
    positions_saved: int = 0


@dataclass(eq=False)
class _Unit:
    """One message (a batch or a dead letter) and the earliest line of each file in it."""

    topic: str
    key: bytes | None
    value: bytes = b""
    parts: list[bytes] = field(default_factory=list)
    """Encoded events of a batch; bytes, not event objects, so the GC has less to walk."""
    nbytes: int = 0
    first: dict[str, ReadPosition] = field(default_factory=dict)
    ts_us: int = 0
    """Newest event time in a batch (for the processing-latency metric); 0: none."""

    def cover(self, line: Line) -> None:
        # Lines of one file arrive in file order, so the first one seen is the earliest.
        if line.key not in self.first:
            self.first[line.key] = ReadPosition(line.start, line.lineno - 1)


class Exporter:
    """Follows one Inspector dump directory and publishes its events; see module doc."""

    def __init__(
        self,
        config: ExporterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        publisher: Publisher | None = None,
        metrics: MetricsLike | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or NullMetrics()
        self._counted = ExporterStats()
        self.job = config.job or inspector_job_from_dir(config.directory, default="unknown")
        self._clock = clock
        self._store = PositionStore(config.state_file)
        self._saved = self._store.load()
        self._tailer = DirectoryTailer(
            config.directory,
            pattern=config.pattern,
            resume=self._saved,
            max_bytes_per_file=config.max_bytes_per_file,
            rotate_grace_s=config.rotate_grace_s,
            clock=clock,
        )
        self._publisher = publisher or Publisher(
            PublisherConfig(
                config.kafka,
                queue_max_messages=config.queue_max_messages,
                client_id="c4stream-exporter",
            )
        )
        self._batches: dict[str, _Unit] = {}
        self._inflight: set[_Unit] = set()
        self._retry: list[_Unit] = []
        self._last_publish = clock()
        self._stopping = False
        self.stats = ExporterStats()

    # ------------------------------------------------------------------ steps

    def poll_once(self, *, publish: bool | None = None) -> ExporterStats:
        """One step: read, parse, and publish when the interval is up (or ``publish``)."""
        for line in self._tailer.poll():
            self._take(line)
        due = self._clock() - self._last_publish >= self.config.interval_s
        if publish or (publish is None and due):
            self._publish_cycle()
        else:
            self._publisher.poll(0)
        return self.stats

    def request_stop(self) -> None:
        """Ask a blocked ``produce`` (full queue, Kafka away) to give up; safe from a
        signal handler. :meth:`close` still flushes what it can."""
        self._stopping = True

    def close(self) -> None:
        """Publish what is pending, wait for it, save positions, release files."""
        try:
            self._publish_cycle()
        finally:
            self._tailer.close()

    # -------------------------------------------------------------- internals

    def _take(self, line: Line) -> None:
        self.stats.lines += 1
        try:
            if line.error is not None:
                raise InspectorError(line.error)
            ev = parse_inspector_line(line.raw, job=self.job)
        except InspectorStatsRecord:
            return  # per-dump statistics (format v4.2): no event, and nothing lost
        except InspectorError as err:
            unit = _Unit(
                self.config.deadletter_topic,
                line.path.encode(),
                DeadLetter.of(
                    line.raw,
                    reason=str(err),
                    stage="exporter",
                    source=f"{line.path}:{line.lineno}",
                    key=line.path,
                ).encode(),
            )
            unit.cover(line)
            self.stats.deadletters += 1
            self._send(unit)
            return
        unit = self._batches.get(ev.comm)
        if unit is None:
            unit = self._batches[ev.comm] = _Unit(self.config.events_topic, ev.comm.encode())
        part = _encode_event(ev)
        unit.parts.append(part)
        unit.nbytes += len(part) + 1
        unit.cover(line)
        unit.ts_us = ev.ts_us
        self.stats.events += 1
        if (
            len(unit.parts) >= self.config.max_batch_events
            or unit.nbytes >= self.config.max_batch_bytes
        ):
            del self._batches[ev.comm]
            self._send_batch(unit)

    def _send_batch(self, unit: _Unit) -> None:
        unit.value = b"[" + b",".join(unit.parts) + b"]"  # what encode_message(events) gives
        unit.parts = []  # the message bytes are what is kept for a resend
        self._send(unit)

    def _send(self, unit: _Unit) -> None:
        self._inflight.add(unit)
        self.stats.messages += 1

        def on_delivery(err: KafkaError | None, msg: Message, unit: _Unit = unit) -> None:
            if err is None:
                self._inflight.discard(unit)
                self.stats.delivered += 1
                if unit.ts_us:
                    observe_latency(self.metrics, STAGE, ts_us=unit.ts_us)
            else:
                self.stats.delivery_errors += 1
                log.warning("delivery to %s failed, will resend: %s", unit.topic, err)
                self._retry.append(unit)

        try:
            self._publisher.produce(
                unit.topic, unit.value, unit.key, on_delivery, give_up=lambda: self._stopping
            )
        except PublisherStopped:
            # Stopping with Kafka unreachable: the unit stays unconfirmed, so its lines
            # are read again after a restart.
            log.warning("stopping with a full local queue: %s left unsent", unit.topic)

    def _publish_cycle(self) -> None:
        self._last_publish = self._clock()
        retry, self._retry = self._retry, []
        for unit in retry:
            self.stats.messages -= 1  # counted once, when first sent
            self._send(unit)
        batches, self._batches = self._batches, {}
        for unit in batches.values():
            self._send_batch(unit)
        left = self._publisher.flush(self.config.flush_timeout_s)
        if left:
            log.warning(
                "%d messages not yet acknowledged after %.1fs", left, self.config.flush_timeout_s
            )
        self._save_positions()

    def _save_positions(self) -> None:
        pending = [*self._inflight, *self._batches.values()]
        files: dict[str, FilePosition] = {}
        for key, (path, read_pos, head, head_len) in self._tailer.read_positions().items():
            pos = min((u.first[key] for u in pending if key in u.first), default=read_pos)
            pos = min(pos, read_pos)
            files[key] = FilePosition(
                path=path, offset=pos.offset, lineno=pos.lineno, head=head, head_len=head_len
            )
        # A file closed by the tailer (rotated away) keeps its last saved position while
        # some of its lines are still unacknowledged.
        for u in pending:
            for key in u.first:
                if key not in files and key in self._saved:
                    files[key] = self._saved[key]
        if files != self._saved:
            self._store.save(files)
            self._saved = files
            self.stats.positions_saved += 1

    def sync_metrics(self) -> None:
        """Add the counters' growth since the last call to the Prometheus families.

        Called once per loop step rather than per line: the hot path only bumps ints.
        """
        m = self.metrics
        s, c = self.stats, self._counted
        for counter, grew in (
            (m.messages_in.labels(stage=STAGE), s.lines - c.lines),
            (m.events_in.labels(stage=STAGE), s.events - c.events),
            (m.deadletters.labels(stage=STAGE), s.deadletters - c.deadletters),
            (m.actions.labels(stage=STAGE, outcome="delivered"), s.delivered - c.delivered),
            (
                m.actions.labels(stage=STAGE, outcome="delivery_error"),
                s.delivery_errors - c.delivery_errors,
            ),
        ):
            if grew > 0:
                counter.inc(grew)
        self._counted = ExporterStats(
            lines=s.lines,
            events=s.events,
            deadletters=s.deadletters,
            delivered=s.delivered,
            delivery_errors=s.delivery_errors,
        )


EXPORTER_SECTION = Section(ExporterConfig)
"""``[exporter]`` of ``c4stream.toml``."""
