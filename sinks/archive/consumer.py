"""The archiver in the shared loop: consume, decode, write, and commit only what is durable.

The loop is :class:`~c4base.runtime.ConsumerRunner`; :class:`ArchiveHandler` writes the
rows and reports, per partition, the lowest offset whose rows are still in an open
file (:meth:`ArchiveHandler.pending`). Commit policy (why a crash loses nothing):

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

A full filesystem (ENOSPC, or any other OSError writing the archive) never ends the
process: the archiver logs one line saying so, drops every open file with its
``.inprogress`` temp (a failed write leaves a Parquet file unusable; dropping them also
frees their space), commits nothing past the lowest offset whose rows are not in a
published file, and reads again from there after a back-off (1 s doubling to 60 s,
:class:`~c4base.runtime.Rewind`) until writes succeed; then it logs that it resumed.
Nothing is lost and no temp file is left; rows of messages that were in files already
published are written again, as after a crash, and removed by the dedupe key.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from c4base.config import Section
from c4base.consumer_lag import observe_latency
from c4base.kafka import KafkaConfig
from c4base.metrics import MetricsLike, NullMetrics
from c4base.runtime import (
    BaseHandler,
    ConsumerRunner,
    Context,
    LogThrottle,
    Record,
    Rewind,
    RunnerConfig,
)
from c4base.topics import Topics
from producers.columnar import content_type_of
from sinks.archive.decode import DECODERS
from sinks.archive.schemas import SCHEMAS
from sinks.archive.tables import BUILDERS, MessageSources
from sinks.archive.writer import DatasetWriter, RollPolicy, sweep_stale_temps

__all__ = ["ARCHIVE_SECTION", "ArchiveConfig", "ArchiveHandler", "ArchiveStats", "Archiver"]

log = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]
STAGE = "archiver"


class ArchiveConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the archiver needs; built by the CLI, passed explicitly."""

    out: str
    """Archive root: datasets go to ``out/events``, ``out/verdicts``, ``out/isolations``."""
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    group: str = "c4stream-archive"
    instance_id: str | None = None
    """Static group membership (``group.instance.id``; default ``group@hostname``, e.g.
    the pod name; "" for dynamic): a restarted archiver takes its partitions back at
    once instead of waiting for the dead member's session to time out and a rebalance."""
    broker_timeout_s: float = 120.0
    """Exit non-zero when the broker stays unreachable this long (0: never)."""
    status_file: str = ""
    """Write the archiver's status JSON here every second ("": no file)."""
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


class ArchiveHandler(BaseHandler):
    """The archiver's part of the shared loop: decode, build Arrow rows, write files;
    :meth:`pending` keeps the commit below every row not yet in a published file.

    Thin: decoding is :mod:`~sinks.archive.tables`, files are
    :mod:`~sinks.archive.writer`, the loop and commits are
    :class:`~c4base.runtime.ConsumerRunner`.
    """

    def __init__(
        self,
        config: ArchiveConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: MetricsLike | None = None,
    ) -> None:
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
        self.stats = ArchiveStats()
        self.metrics = metrics or NullMetrics()
        self._next_stats = clock() + config.stats_interval_s
        self._held_since: float | None = None
        """When writing first failed (a full disk), until a write succeeds again."""
        self._holds = 0
        self._throttle = LogThrottle(60.0, clock)

    # ------------------------------------------------------------------ messages

    def handle_batch(self, records: Sequence[Record], ctx: Context) -> None:
        by_dataset: dict[str, list[Record]] = {}
        for rec in records:
            self.stats.messages += 1
            by_dataset.setdefault(self.dataset_of[rec.topic], []).append(rec)
        for w in self.writers.values():
            w.reread(records)
        try:
            for name, recs in by_dataset.items():
                self._archive(name, recs, ctx)
        except OSError as err:
            raise self._hold(err, "writing") from None

    # ------------------------------------------------------------------ a full disk

    def _hold(self, err: OSError, doing: str) -> Rewind:
        """Drop every open file, keep the commit below their rows, read them again later."""
        offsets = self.pending()  # before discarding: the open files' lowest offsets
        for w in self.writers.values():
            w.discard()
            w.forget_lost()  # the runner now holds them (Rewind)
        self._holds += 1
        if self._held_since is None:
            self._held_since = self._clock()
        delay = min(60.0, 2.0 ** min(self._holds - 1, 6))
        what = "filesystem full" if _disk_full(err) else "cannot write"
        self._throttle.log(
            log,
            logging.WARNING,
            "hold",
            "archive %s (%s %s: %s): holding — open files dropped, nothing committed past "
            "what is in published files, reading again in %.0fs",
            what,
            doing,
            self.cfg.out,
            err,
            delay,
        )
        return Rewind(f"archive {what}: {err}", offsets, retry_after_s=delay)

    def _writable(self) -> None:
        """A file was published: if writing had failed, say it works again."""
        if self._held_since is not None:
            log.warning(
                "archive writable again after %.0fs (%d hold(s)); archiving resumed",
                self._clock() - self._held_since,
                self._holds,
            )
            self._held_since, self._holds = None, 0

    def _archive(self, name: str, recs: list[Record], ctx: Context) -> None:
        decode = DECODERS[name]
        records: list[Any] = []
        kept: list[tuple[Record, int]] = []
        for rec in recs:
            if not rec.value:
                self._dead_letter(ctx, rec, "empty message (no value): nothing to archive")
                continue
            try:
                decoded = decode(rec.value, content_type_of(rec.headers))
            except ValueError as err:  # the contracts' *DecodeError are ValueErrors
                self._dead_letter(ctx, rec, f"undecodable {name} message: {err}")
                continue
            records.extend(decoded)
            kept.append((rec, len(decoded)))
            ts_us = getattr(decoded[-1], "ts_us", None) if decoded else None
            if ts_us:
                # one sample per message (its last record), not per event: cheap
                observe_latency(self.metrics, STAGE, ts_us=ts_us)
        if not kept:
            return
        build = BUILDERS[name]
        for rows in self._build(name, build, kept, records, ctx):
            self._write(name, rows)

    def _build(
        self,
        name: str,
        build: Callable[..., Any],
        kept: list[tuple[Record, int]],
        records: list[Any],
        ctx: Context,
    ) -> list[Any]:
        """Rows of the batch; if some record does not fit the schema (an int beyond int32,
        a job name too long for a directory), bisect to the offending messages,
        dead-letter them and keep the rest: O(bad * log(batch)) builds, not one per message.
        """
        try:
            return [build(records, _sources(kept[0][0].topic, kept))]
        except (ValueError, TypeError, OverflowError) as err:  # ArrowInvalid is a ValueError
            if len(kept) == 1:
                self._dead_letter(
                    ctx, kept[0][0], f"{name} message does not fit the archive schema: {err}"
                )
                return []
            log.debug(
                "batch of %d does not fit the %s schema (%s); bisecting", len(kept), name, err
            )
        half = len(kept) // 2
        split = sum(n for _, n in kept[:half])
        return self._build(name, build, kept[:half], records[:split], ctx) + self._build(
            name, build, kept[half:], records[split:], ctx
        )

    def _write(self, name: str, rows: Any) -> None:
        done = self.writers[name].write(rows.table, rows.jobs)
        if done:
            self._writable()
        self.stats.rows[name] += rows.table.num_rows
        if name == "events":
            self.metrics.events_in.labels(stage=STAGE).inc(rows.table.num_rows)
        self.stats.files += len(done)

    def _dead_letter(self, ctx: Context, rec: Record, reason: str) -> None:
        ctx.dead_letter(rec, reason)
        self.stats.deadletters += 1

    # ------------------------------------------------------------------ durability

    def pending(self) -> dict[TopicPartitionKey, int]:
        out: dict[TopicPartitionKey, int] = {}
        for w in self.writers.values():
            for tp, off in w.pending_offsets().items():
                out[tp] = min(off, out.get(tp, off))
        return out

    def tick(self, ctx: Context) -> None:
        try:
            rolled = sum(len(w.roll_due()) for w in self.writers.values())
        except OSError as err:
            raise self._hold(err, "publishing a file in") from None
        if rolled:
            self.stats.files += rolled
            self._writable()
        if self._clock() >= self._next_stats:
            self._next_stats = self._clock() + self.cfg.stats_interval_s
            log.info("archive stats: %s", self.stats)

    def _publish_all(self) -> None:
        """Publish every open file; on a full disk drop them instead (no temp left) and
        keep their offsets pending, so the commit that follows stays below them."""
        try:
            for w in self.writers.values():
                self.stats.files += len(w.close_all())
        except OSError as err:
            log.warning(
                "archive cannot publish its open files (%s); dropped, their rows are read "
                "again from the last commit by whoever consumes next",
                err,
            )
            for w in self.writers.values():
                w.discard()

    def revoked(self, tps: list[TopicPartitionKey], lost: bool) -> None:
        # Publish before another member takes over (or, if lost, may already own them):
        # duplicates are removable, dropping rows of partitions still owned would lose them.
        self._publish_all()

    def close(self, stop_by: float, ctx: Context) -> None:
        self._publish_all()

    def abort(self) -> None:
        # Open files hold rows whose offsets were never committed: drop them (they
        # are consumed again).
        for w in self.writers.values():
            w.abort_all()

    def status(self) -> dict[str, Any]:
        return {"archive": {"rows": dict(self.stats.rows), "files": self.stats.files}}


class Archiver:
    """Consumes the three topics into the three datasets until ``stop`` is set."""

    def __init__(
        self,
        config: ArchiveConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: MetricsLike | None = None,
    ):
        self.cfg = config
        self.handler = ArchiveHandler(config, clock=clock, metrics=metrics)
        self.metrics = metrics
        self.topics = self.handler.topics
        self.stats = self.handler.stats

    def run(self, stop: threading.Event) -> ArchiveStats:
        """Raises :class:`~c4base.runtime.FatalError` (nothing more committed)."""
        root = Path(self.cfg.out)
        root.mkdir(parents=True, exist_ok=True)
        stale = self.cfg.stale_temp_s
        removed = sweep_stale_temps(
            root, stale if stale is not None else 2 * self.cfg.roll_seconds + 60
        )
        if removed:
            log.info("removed %d stale temp files of crashed archivers", len(removed))
        runner = ConsumerRunner(
            RunnerConfig(
                stage=STAGE,
                topics=list(self.handler.dataset_of),
                deadletter_topic=self.topics.deadletter,
                group=self.cfg.group,
                kafka=self.cfg.kafka,
                instance_id=self.cfg.instance_id,
                batch_size=self.cfg.batch_messages,
                poll_timeout_s=self.cfg.poll_timeout_s,
                tick_s=min(1.0, self.cfg.poll_timeout_s),
                commit_interval_s=self.cfg.commit_interval_s,
                broker_timeout_s=self.cfg.broker_timeout_s,
                status_path=self.cfg.status_file or None,
            ),
            self.handler,
            metrics=self.metrics,
            stop=stop,
        )
        log.info("archiving into %s", root)
        runner.run()
        self.stats.commits = runner.stats.commits
        log.info("archiver stopped: %s", self.stats)
        return self.stats


def _disk_full(err: OSError) -> bool:
    """ENOSPC or EDQUOT, also from pyarrow (its OSError may carry the errno in the text).

    >>> _disk_full(OSError(errno.ENOSPC, "No space left on device"))
    True
    >>> _disk_full(OSError("Error writing bytes to file. Detail: [errno 28] No space left"))
    True
    """
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return "No space left" in text or "Disk quota exceeded" in text


def _sources(topic: str, kept: list[tuple[Record, int]]) -> Any:
    return MessageSources.build(
        topic, [(r.partition, r.offset, r.timestamp_ms, n) for r, n in kept]
    )


ARCHIVE_SECTION = Section(ArchiveConfig)
"""``[archive]`` of ``c4stream.toml``."""
