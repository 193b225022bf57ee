"""The archiver's Kafka loop: consume, decode, write, and commit only what is durable.

Commit policy (why a crash loses nothing):

* auto-commit is off; offsets are committed synchronously, with explicit offsets;
* the committed offset of a partition is never beyond the lowest offset whose rows
  still sit in an open (not yet renamed) file, nor beyond the last consumed message;
* dead letters are flushed (delivered) before any commit that passes their message.

So after a crash every message at or above the committed offset is consumed again.
Rows of such messages already in completed files are then written twice: duplicates
are bounded by the rows written but not yet committed when the process died, which
``roll_seconds`` bounds in time (every file is closed at most that long after it
opened), and are removed by the dedupe key (:mod:`sinks.archive.dedupe`).

Partition revocation or loss closes (publishes) every open file first, so a
rebalance never discards rows whose offsets another member will not re-read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from c4base.config import Section
from c4base.consumer_lag import LagMonitor, observe_latency
from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.metrics import Metrics
from c4base.topics import Topics
from sinks.archive import tables
from sinks.archive.decode import DECODERS
from sinks.archive.schemas import SCHEMAS
from sinks.archive.tables import MessageSources
from sinks.archive.writer import DatasetWriter, RollPolicy, sweep_stale_temps

__all__ = ["ArchiveConfig", "ArchiveError", "ArchiveStats", "Archiver", "OffsetTracker"]

log = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]
STAGE = "archiver"


class ArchiveError(RuntimeError):
    """The archiver cannot go on safely (commit or dead-letter delivery failed).

    Nothing is lost: uncommitted messages are consumed again on restart. Check broker
    reachability and the consumer group's ACLs, then restart ``c4stream archive``.
    """


class ArchiveConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the archiver needs; built by the CLI, passed explicitly."""

    out: str
    """Archive root: datasets go to ``out/events``, ``out/verdicts``, ``out/isolations``."""
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    group: str = "c4stream-archive"
    instance_id: str | None = None
    """Static group membership (``group.instance.id``, e.g. the pod name): a restarted
    archiver takes its partitions back at once instead of waiting for the dead member's
    session to time out and a rebalance."""
    roll_bytes: int = 128 * 1024 * 1024
    roll_seconds: float = 300.0
    row_group_bytes: int = 64 * 1024 * 1024
    max_open_files: int = 64
    batch_messages: int = 1000
    poll_timeout_s: float = 0.5
    commit_interval_s: float = 1.0
    """Commit progress made without a file roll (e.g. dead-lettered messages) this often."""
    stale_temp_s: float | None = None
    """Delete temp files older than this at start; default ``2 * roll_seconds + 60``."""
    stats_interval_s: float = 30.0

    def topics(self) -> Topics:
        return Topics(prefix=self.kafka.topic_prefix)


@dataclass
class ArchiveStats:
    """Counters of one run (also logged every ``stats_interval_s``)."""

    messages: int = 0
    rows: dict[str, int] = field(
        default_factory=lambda: {"events": 0, "verdicts": 0, "isolations": 0}
    )
    files: int = 0
    deadletters: int = 0
    commits: int = 0


class OffsetTracker:
    """What may be committed: per partition, min(next offset, lowest non-durable offset).

    >>> t = OffsetTracker()
    >>> t.consumed("e", 0, 41); t.consumed("e", 0, 42)
    >>> t.committable({("e", 0): 41})      # 41 still only in an open file: resume at 41
    {('e', 0): 41}
    >>> t.mark_committed({("e", 0): 41}); t.committable({("e", 0): 41})
    {}
    >>> t.committable({})                   # everything durable
    {('e', 0): 43}
    >>> t.mark_committed({("e", 0): 43}); t.committable({})
    {}
    """

    def __init__(self) -> None:
        self._next: dict[TopicPartitionKey, int] = {}
        self._committed: dict[TopicPartitionKey, int] = {}

    def consumed(self, topic: str, partition: int, offset: int) -> None:
        tp = (topic, partition)
        if offset + 1 > self._next.get(tp, -1):
            self._next[tp] = offset + 1

    def committable(self, pending: dict[TopicPartitionKey, int]) -> dict[TopicPartitionKey, int]:
        out = {}
        for tp, nxt in self._next.items():
            safe = min(nxt, pending.get(tp, nxt))
            if safe > self._committed.get(tp, -1):
                out[tp] = safe
        return out

    def mark_committed(self, offsets: dict[TopicPartitionKey, int]) -> None:
        self._committed.update(offsets)

    def forget(self, tps: Sequence[TopicPartitionKey] | None = None) -> None:
        """Drop partitions no longer owned (all of them when ``tps`` is None)."""
        if tps is None:
            self._next.clear()
            self._committed.clear()
            return
        for tp in tps:
            self._next.pop(tp, None)
            self._committed.pop(tp, None)


class Archiver:
    """Consumes the three topics into the three datasets until ``stop`` is set.

    Thin: decoding is :mod:`~sinks.archive.tables`, files are
    :mod:`~sinks.archive.writer`, commit arithmetic is :class:`OffsetTracker`.
    """

    def __init__(
        self,
        config: ArchiveConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
    ):

        self.cfg = config
        self._clock = clock
        self.topics = config.topics()
        policy = RollPolicy(
            roll_bytes=config.roll_bytes,
            roll_seconds=config.roll_seconds,
            row_group_bytes=config.row_group_bytes,
            max_open_files=config.max_open_files,
        )
        root = Path(config.out)
        self.writers = {
            name: DatasetWriter(root / name, schema, policy, clock=clock)
            for name, schema in SCHEMAS.items()
        }
        self.dataset_of = {
            self.topics.events: "events",
            self.topics.verdicts: "verdicts",
            self.topics.isolations: "isolations",
        }
        self.tracker = OffsetTracker()
        self.stats = ArchiveStats()
        self.metrics = metrics
        self._consumer: Any = None
        self._producer: Any = None
        self._dl_errors: list[str] = []
        self._last_commit = 0.0

    # ------------------------------------------------------------------ lifecycle

    def run(self, stop: threading.Event) -> ArchiveStats:
        from confluent_kafka import Consumer, Producer

        root = Path(self.cfg.out)
        root.mkdir(parents=True, exist_ok=True)
        stale = self.cfg.stale_temp_s
        removed = sweep_stale_temps(
            root, stale if stale is not None else 2 * self.cfg.roll_seconds + 60
        )
        if removed:
            log.info("removed %d stale temp files of crashed archivers", len(removed))
        self._producer = Producer(self.cfg.kafka.producer_config())
        overrides = {"group.instance.id": self.cfg.instance_id} if self.cfg.instance_id else {}
        self._consumer = Consumer(self.cfg.kafka.consumer_config(self.cfg.group, **overrides))
        self._consumer.subscribe(
            list(self.dataset_of),
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        log.info(
            "archiving %s into %s (group %s)", ", ".join(self.dataset_of), root, self.cfg.group
        )
        next_stats = self._clock() + self.cfg.stats_interval_s
        lag = LagMonitor(self._consumer, self.metrics, STAGE) if self.metrics else None
        try:
            while not stop.is_set():
                if lag is not None:
                    lag.maybe_update()
                msgs = self._consumer.consume(self.cfg.batch_messages, self.cfg.poll_timeout_s)
                if msgs:
                    self._handle(msgs)
                rolled = sum(len(w.roll_due()) for w in self.writers.values())
                self.stats.files += rolled
                self._commit(force=rolled > 0)
                if self._clock() >= next_stats:
                    next_stats = self._clock() + self.cfg.stats_interval_s
                    log.info("archive stats: %s", self.stats)
            self._publish_all()
            self._commit(force=True)
        except BaseException:
            # Open files hold rows whose offsets were never committed: drop them (they
            # are consumed again) and make sure nothing is committed past them.
            for w in self.writers.values():
                w.abort_all()
            self.tracker.forget()
            raise
        finally:
            self._consumer.close()
            self._producer.flush(10)
        log.info("archiver stopped: %s", self.stats)
        return self.stats

    # ------------------------------------------------------------------ messages

    def _handle(self, msgs: list[Any]) -> None:
        from confluent_kafka import KafkaError, KafkaException

        by_dataset: dict[str, list[Any]] = {}
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.fatal():
                    raise KafkaException(err)
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer: %s", err)
                continue
            self.stats.messages += 1
            if self.metrics:
                self.metrics.messages_in.labels(stage=STAGE).inc()
            by_dataset.setdefault(self.dataset_of[m.topic()], []).append(m)
        for name, ms in by_dataset.items():
            self._archive(name, ms)
            # tracked after the rows are in a writer, so pending offsets cover them
            for m in ms:
                self.tracker.consumed(m.topic(), m.partition(), m.offset())

    def _archive(self, name: str, msgs: list[Any]) -> None:

        decode = DECODERS[name]
        records: list[Any] = []
        kept: list[tuple[Any, int]] = []
        for m in msgs:
            value = m.value()
            if not value:
                self._dead_letter(m, "empty message (no value): nothing to archive")
                continue
            try:
                recs = decode(value)
            except ValueError as err:  # the contracts' *DecodeError are ValueErrors
                self._dead_letter(m, f"undecodable {name} message: {err}")
                continue
            records.extend(recs)
            kept.append((m, len(recs)))
            ts_us = getattr(recs[-1], "ts_us", None) if recs else None
            if self.metrics and ts_us:
                # one sample per message (its last record), not per event: cheap
                observe_latency(self.metrics, STAGE, ts_us=ts_us)
        if not kept:
            return
        build = getattr(tables, f"{name}_table")
        for rows in self._build(name, build, kept, records):
            self._write(name, rows)

    def _build(
        self, name: str, build: Callable[..., Any], kept: list[tuple[Any, int]], records: list[Any]
    ) -> list[Any]:
        """Rows of the batch; if some record does not fit the schema (an int beyond int32,
        a job name too long for a directory), bisect to the offending messages,
        dead-letter them and keep the rest: O(bad * log(batch)) builds, not one per message.
        """
        try:
            return [build(records, _sources(kept[0][0].topic(), kept))]
        except (ValueError, TypeError, OverflowError) as err:  # ArrowInvalid is a ValueError
            if len(kept) == 1:
                self._dead_letter(
                    kept[0][0], f"{name} message does not fit the archive schema: {err}"
                )
                return []
            log.debug(
                "batch of %d does not fit the %s schema (%s); bisecting", len(kept), name, err
            )
        half = len(kept) // 2
        split = sum(n for _, n in kept[:half])
        return self._build(name, build, kept[:half], records[:split]) + self._build(
            name, build, kept[half:], records[split:]
        )

    def _write(self, name: str, rows: Any) -> None:
        done = self.writers[name].write(rows.table, rows.jobs)
        self.stats.rows[name] += rows.table.num_rows
        if self.metrics and name == "events":
            self.metrics.events_in.labels(stage=STAGE).inc(rows.table.num_rows)
        if done:
            self.stats.files += len(done)
            self._commit(force=True)

    def _dead_letter(self, m: Any, reason: str) -> None:

        rec = DeadLetter.of(
            m.value() or b"",
            reason=reason,
            stage=STAGE,
            source=f"{m.topic()}[{m.partition()}]@{m.offset()}",
            key=m.key(),
        )
        self._producer.produce(
            self.topics.deadletter, rec.encode(), key=m.key(), on_delivery=self._on_dl_delivery
        )
        self._producer.poll(0)
        self.stats.deadletters += 1
        if self.metrics:
            self.metrics.deadletters.labels(stage=STAGE).inc()
        log.warning("dead-lettered %s: %s", rec.source, reason)

    def _on_dl_delivery(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self._dl_errors.append(str(err))

    # ------------------------------------------------------------------ commits

    def _pending(self) -> dict[TopicPartitionKey, int]:
        out: dict[TopicPartitionKey, int] = {}
        for w in self.writers.values():
            for tp, off in w.pending_offsets().items():
                out[tp] = min(off, out.get(tp, off))
        return out

    def _commit(self, *, force: bool) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        now = self._clock()
        if not force and now - self._last_commit < self.cfg.commit_interval_s:
            return
        self._last_commit = now
        offsets = self.tracker.committable(self._pending())
        if not offsets:
            return
        # dead letters of the messages we are about to pass must be delivered first
        if self._producer.flush(30) > 0 or self._dl_errors:
            raise ArchiveError(
                f"dead letters to {self.topics.deadletter} were not delivered "
                f"({'; '.join(self._dl_errors[:3]) or 'timeout'}); not committing"
            )
        tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        try:
            result = self._consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as err:
            raise ArchiveError(f"committing offsets failed: {err}") from err
        failed = [tp for tp in result or [] if tp.error is not None]
        if failed:
            raise ArchiveError(f"committing offsets failed for {failed}")
        self.tracker.mark_committed(offsets)
        self.stats.commits += 1
        if self.metrics:
            self.metrics.actions.labels(stage=STAGE, outcome="commit").inc()
        log.debug("committed %s", offsets)

    def _publish_all(self) -> None:
        for w in self.writers.values():
            self.stats.files += len(w.close_all())

    def _on_revoke(self, _consumer: Any, partitions: list[Any]) -> None:
        self._publish_all()
        self._commit(force=True)
        self.tracker.forget([(tp.topic, tp.partition) for tp in partitions])

    def _on_lost(self, _consumer: Any, partitions: list[Any]) -> None:
        # Another member may own them already: publish (duplicates are removable,
        # dropping rows of partitions still owned would lose them) but do not commit.
        self._publish_all()
        self.tracker.forget([(tp.topic, tp.partition) for tp in partitions])


def _sources(topic: str, kept: list[tuple[Any, int]]) -> Any:
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

    def ts(m: Any) -> int:
        kind, value = m.timestamp()
        return -1 if kind == TIMESTAMP_NOT_AVAILABLE else value

    return MessageSources.build(topic, [(m.partition(), m.offset(), ts(m), n) for m, n in kept])


ARCHIVE_SECTION = Section(ArchiveConfig)
"""``[archive]`` of ``c4stream.toml``."""
