"""The node exporter's core: tail → parse → batch per communicator → publish → remember.

:class:`Exporter` does one step per :meth:`Exporter.poll_once` so tests (and the loop in
:mod:`producers.exporter.loop`) can drive it:

1. read the complete new lines of every followed file (:class:`DirectoryTailer`);
2. parse each Inspector line into an ``op`` event and add it to its communicator's
   batch; a bad line becomes a dead letter (``source`` = ``file:line``) right away;
3. once per ``interval_s``, publish one message per communicator (a JSON array of its
   events, or with ``format = "arrow"`` one Arrow IPC record batch; key = communicator
   id; split at ``max_batch_events``), then wait for Kafka
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
from typing import Any

from confluent_kafka import KafkaError, Message

from c4base.config import Section
from c4base.consumer_lag import observe_latency
from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.metrics import MetricsLike, NullMetrics
from c4base.signing import Sequencer, load_key, signed_event_headers
from c4base.topics import Topics
from producers.columnar import WireFormat, encode_batch
from producers.events import Event, OpEvent, edge_problem, encode_message
from producers.exporter.dumps import DumpWatcher, WholeDump, read_snapshot
from producers.exporter.positions import DumpRecord, FilePosition, PositionStore
from producers.exporter.publisher import Publisher, PublisherConfig, PublisherStopped
from producers.exporter.tail import DirectoryTailer, Line, ReadPosition
from producers.formats.fr_dump import DEFAULT_MAX_DUMP_BYTES
from producers.formats.inspector import (
    InspectorError,
    InspectorStatsRecord,
    inspector_job_from_dir,
    parse_inspector_line,
)
from producers.guard import MAX_FUTURE_SKEW_US, MAX_NRANKS, host_problem
from producers.summary import Summariser

__all__ = ["Exporter", "ExporterConfig", "ExporterStats"]

_encode_event = encode_message  # one event in, its JSON object out

log = logging.getLogger(__name__)

STAGE = "exporter"
_ARROW_ROW_BYTES = 256
_ARROW_CONN_BYTES = 40


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
    format: WireFormat = "json"
    """Wire form of a batch: a JSON array, or ``arrow`` (an Arrow IPC record batch marked
    by the ``content-type`` header; see :mod:`producers.columnar`)."""
    host: str | None = None
    """This exporter's host: events reporting another host are refused (counted, logged,
    dead-lettered, never published). None: not checked (signing needs it)."""
    signing_key_file: Path | None = None
    """This host's key (``c4stream keys derive --host H``): every message is signed
    (headers ``c4-host``, ``c4-sig``; docs/security.md). None: unsigned."""
    max_nranks: int = MAX_NRANKS
    max_future_skew_s: float = MAX_FUTURE_SKEW_US / 1e6
    """Records whose ``ts_us`` is further ahead of this host's wall clock are refused."""
    max_past_skew_s: float = 0.0
    """...or further behind it (0: no bound; a restarted exporter may catch up on an
    old dump, and the worker judges lateness by the job's own clock)."""
    summary_k: int = 0
    """Windows at the source (:mod:`producers.summary`): > 0 sends per communicator, rank
    and interval one ``summary`` record plus every collective whose seq is picked 1 in
    ``summary_k`` (the same seqs on every rank) whole; 0 sends every collective."""
    summary_intervals: int = 1
    """With summaries: one summary per rank per this many intervals (fewer records; its
    samples wait for it, so detection is up to this many intervals later)."""
    dump_directory: Path | None = None
    """A Flight Recorder dump directory to follow too (``TORCH_FR_DUMP_TEMP_FILE``'s;
    :mod:`producers.exporter.dumps`, docs/flight-recorder.md). None: none."""
    dump_pattern: str = "*"
    dump_settle_s: float = 1.0
    """A dump is whole once it parses and has not changed for this long."""
    dump_give_up_s: float = 300.0
    dump_gather_s: float = 5.0
    """Dumps whole within this long of the first one are one snapshot."""
    max_dump_bytes: int = DEFAULT_MAX_DUMP_BYTES
    max_gather_bytes: int = 1 << 30
    """Dumps held for one snapshot are sent once their files reach this size together."""
    dump_all_ranks: bool = False
    """The directory holds every rank's dumps (a shared file system); False (a node's
    own): only its empty dumps are absent ranks, other nodes' ranks are not missing."""

    def __post_init__(self) -> None:
        encode_batch([], self.format)  # an unknown format is a config error, said at once
        if self.host is not None and (bad := host_problem(self.host)) is not None:
            raise ValueError(f"host: {bad}")
        if self.signing_key_file is not None:
            if self.host is None:
                raise ValueError(
                    "signing_key_file needs host: the host whose key it is (the exporter "
                    "signs only its own host's events)"
                )
            load_key(self.signing_key_file)  # missing, short, readable by others: say so now
        if self.dump_all_ranks and self.host is not None and self.dump_directory is not None:
            raise ValueError(
                "dump_all_ranks (a shared directory of every node's dumps) with host: every "
                "rank would be given this host; run that exporter without host"
            )
        if self.summary_k < 0 or self.summary_intervals < 1:
            raise ValueError("summary_k must be >= 0 (0: no summaries), summary_intervals >= 1")
        if self.max_nranks < 1 or self.max_future_skew_s < 0 or self.max_past_skew_s < 0:
            raise ValueError("max_nranks must be >= 1 and the skews >= 0")
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
    refused: int = 0
    """Parsed records refused at the edge (bounds, another host's events): dead-lettered."""
    delivery_errors: int = 0
    positions_saved: int = 0


@dataclass(eq=False)
class _Unit:
    """One message (a batch or a dead letter) and the earliest line of each file in it."""

    topic: str
    key: bytes | None
    value: bytes = b""
    parts: list[bytes] = field(default_factory=list)
    """Encoded events of a JSON batch; bytes, not event objects, so the GC has less to walk."""
    events: list[Any] = field(default_factory=list)
    """Events of an Arrow batch (encoded as columns when sent); with summaries too."""
    summary: bool = False
    """Holds summary records (windows at the source): encoded with their columns."""
    headers: list[tuple[str, bytes]] | None = None
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
        wall_us: Callable[[], int] | None = None,
    ) -> None:
        """``wall_us``: this host's wall clock in µs (the time a dump is seen whole)."""
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
        self._closing = False
        self._arrow = config.format == "arrow"
        self._key = load_key(config.signing_key_file) if config.signing_key_file else None
        self._seq = Sequencer()
        """This host's message numbers (header ``c4-fresh``, inside the signature)."""
        self._warned: set[str] = set()
        self._summ = (
            Summariser(config.summary_k, every=config.summary_intervals)
            if config.summary_k > 0
            else None
        )
        self.stats = ExporterStats()
        self._dumps_saved = self._store.load_dumps()
        self._dumps = (
            DumpWatcher(
                config.dump_directory,
                pattern=config.dump_pattern,
                settle_s=config.dump_settle_s,
                give_up_s=config.dump_give_up_s,
                max_bytes=config.max_dump_bytes,
                done=self._dumps_saved,
                clock=clock,
                wall_us=wall_us or (lambda: time.time_ns() // 1000),
            )
            if config.dump_directory is not None
            else None
        )
        self._gather: list[WholeDump] = []
        self._gather_since = 0.0
        self._dump_pending: list[tuple[list[_Unit], dict[str, DumpRecord]]] = []
        """Units of published dumps not yet acknowledged, and the dumps they hold."""

    # ------------------------------------------------------------------ steps

    def poll_once(self, *, publish: bool | None = None) -> ExporterStats:
        """One step: read, parse, and publish when the interval is up (or ``publish``)."""
        for line in self._tailer.poll():
            self._take(line)
        if self._dumps is not None:
            self._poll_dumps()
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
        self._closing = True  # open summary windows close now
        try:
            if self._gather:
                self._publish_snapshot()
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
            self._dead_letter(line, str(err))
            return
        part = None if self._arrow else _encode_event(ev)
        refused = self._refusal(ev, part)
        if refused is not None:
            self.stats.refused += 1
            self._dead_letter(line, refused)
            return
        if self._summ is not None and isinstance(ev, OpEvent):
            self._summ.add(ev, (line.key, ReadPosition(line.start, line.lineno - 1)))
            self.stats.events += 1
            return
        unit = self._batches.get(ev.comm)
        if unit is None:
            unit = self._batches[ev.comm] = _Unit(self.config.events_topic, ev.comm.encode())
        if self._arrow:
            unit.events.append(ev)
            # an estimate, on the high side, of the row's size in the IPC batch
            unit.nbytes += _ARROW_ROW_BYTES + _ARROW_CONN_BYTES * len(ev.conns or ())
        else:
            assert part is not None
            unit.parts.append(part)
            unit.nbytes += len(part) + 1
        unit.cover(line)
        unit.ts_us = ev.ts_us
        self.stats.events += 1
        if (
            len(unit.parts) + len(unit.events) >= self.config.max_batch_events
            or unit.nbytes >= self.config.max_batch_bytes
        ):
            del self._batches[ev.comm]
            self._send_batch(unit)

    def _refusal(self, ev: Event, encoded: bytes | None) -> str | None:
        """Why a parsed record may not be published (the worker's edge limits, and
        another host's events), or None; logged once per kind of reason."""
        cfg = self.config
        if cfg.host is not None and ev.host != cfg.host:
            why, kind = f"event of host {ev.host!r}, this exporter is {cfg.host!r}", "host"
        else:
            why = edge_problem(
                ev,
                now_us=time.time_ns() // 1000,
                max_nranks=cfg.max_nranks,
                max_future_skew_us=int(cfg.max_future_skew_s * 1e6),
                max_past_skew_us=int(cfg.max_past_skew_s * 1e6),
                encoded=encoded,
            )
            kind = why.split(" ", 1)[0] if why else ""
        if why is None:
            return None
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("refused a record (dead-lettered, not published; logged once): %s", why)
        return f"refused at the exporter: {why}"

    def _dead_letter(self, line: Line, reason: str) -> None:
        self._send(self._dead_unit(line.raw, reason, line.path, line.lineno, line))

    def _dead_unit(
        self, raw: bytes, reason: str, path: str, lineno: int, line: Line | None = None
    ) -> _Unit:
        unit = _Unit(
            self.config.deadletter_topic,
            path.encode(),
            DeadLetter.of(
                raw, reason=reason, stage="exporter", source=f"{path}:{lineno}", key=path
            ).encode(),
        )
        if line is not None:
            unit.cover(line)
        self.stats.deadletters += 1
        return unit

    # ------------------------------------------------------ Flight Recorder dumps

    def _poll_dumps(self) -> None:
        assert self._dumps is not None
        ready, bad = self._dumps.poll()
        for path, reason, key, record in bad:  # done once its dead letter is acknowledged
            unit = self._dead_unit(b"", reason, path, 0)
            self._dump_pending.append(([unit], {key: record}))
            self._send(unit)
        if ready and not self._gather:
            self._gather_since = self._clock()
        self._gather += ready
        held = sum(d.record.size for d in self._gather)
        due = self._clock() - self._gather_since >= self.config.dump_gather_s
        if self._gather and (due or held >= self.config.max_gather_bytes):
            self._publish_snapshot()

    def _publish_snapshot(self) -> None:
        """Read the gathered dumps together (one snapshot) and send its events, the time
        each dump was first seen whole as its dump time, in messages of one key with the
        ``c4-fr-snapshot`` header (:mod:`producers.formats.fr_wire`)."""
        from producers.formats.fr_wire import SNAPSHOT_HEADER, snapshot_header

        dumps, self._gather = self._gather, []
        cfg = self.config
        snap, read, facts, bad = read_snapshot(
            dumps, job=self.job, host=cfg.host, all_ranks=cfg.dump_all_ranks
        )
        units = [self._dead_unit(b.raw, b.reason, b.path, 0) for b in bad]
        events: list[tuple[Event, bytes | None]] = []
        for path, ev in read:
            part = None if self._arrow else _encode_event(ev)
            refused = self._refusal(ev, part)
            if refused is not None:
                self.stats.refused += 1
                units.append(self._dead_unit(b"", refused, str(path), 0))
            else:
                events.append((ev, part))
        self.stats.events += len(events)
        # one key for the whole snapshot (one partition), split as any batch is
        key = f"fr-snapshot:{snap}".encode()
        chunks = [_Unit(cfg.events_topic, key)]
        for ev, part in events:
            unit = chunks[-1]
            if (
                len(unit.parts) + len(unit.events) >= cfg.max_batch_events
                or unit.nbytes >= cfg.max_batch_bytes
            ):
                unit = _Unit(cfg.events_topic, key)
                chunks.append(unit)
            if self._arrow:
                unit.events.append(ev)
                unit.nbytes += _ARROW_ROW_BYTES
            else:
                assert part is not None
                unit.parts.append(part)
                unit.nbytes += len(part) + 1
            unit.ts_us = max(unit.ts_us, ev.ts_us)
        batches = [(u, snapshot_header(snap, i, len(chunks), facts)) for i, u in enumerate(chunks)]
        records = {d.key: d.record for d in dumps}
        self._dump_pending.append((units + [u for u, _ in batches], records))
        for unit in units:
            self._send(unit)
        for unit, header in batches:
            self._send_batch(unit, [(SNAPSHOT_HEADER, header)])
        log.info("published a Flight Recorder snapshot of %d dumps (%d events)",
                 len(dumps), len(events))  # fmt: skip

    def _send_batch(self, unit: _Unit, extra: list[tuple[str, bytes]] | None = None) -> None:
        if unit.summary and self._arrow:
            from producers.summary_arrow import encode_arrow_with_summaries

            unit.value, unit.headers = encode_arrow_with_summaries(unit.events)
            unit.events = []
        elif self._arrow:
            unit.value, unit.headers = encode_batch(unit.events, "arrow")
            unit.events = []
        else:
            unit.value = b"[" + b",".join(unit.parts) + b"]"  # what encode_message(events) gives
        unit.parts = []  # the message bytes are what is kept for a resend
        if extra:
            unit.headers = [*(unit.headers or []), *extra]
        if self._key is not None and self.config.host is not None:
            # seq and time inside the signature: a re-sent unit keeps them (a retry
            # is an exact repeat), a captured one replayed later is refused
            unit.headers = signed_event_headers(
                self._key, self.config.host, unit.value, unit.headers, self._seq.next()
            )
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
                unit.topic,
                unit.value,
                unit.key,
                on_delivery,
                give_up=lambda: self._stopping,
                headers=unit.headers,
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
        if self._summ is not None:
            for unit in self._summary_units(force=self._closing):
                self._send_batch(unit)
        left = self._publisher.flush(self.config.flush_timeout_s)
        if left:
            log.warning(
                "%d messages not yet acknowledged after %.1fs", left, self.config.flush_timeout_s
            )
        self._save_positions()

    def _summary_units(self, force: bool) -> list[_Unit]:
        """The summariser's closed windows: one message per communicator (samples, then
        a summary per rank)."""
        assert self._summ is not None
        units = []
        for comm, (records, marks) in self._summ.flush(force=force).items():
            unit = _Unit(self.config.events_topic, comm.encode(), summary=True)
            if self._arrow:
                unit.events = list(records)
            else:
                unit.parts = [_encode_event(r) for r in records]
            unit.first = dict(marks)
            unit.ts_us = max(r.ts_us for r in records)
            units.append(unit)
        return units

    def _save_positions(self) -> None:
        pending = [*self._inflight, *self._batches.values()]
        if self._summ is not None:  # windows still open hold their first lines back
            pending += [_Unit("", None, first=m) for m in self._summ.held_marks()]
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
        dumps = self._dumps_saved
        if self._dumps is not None:
            still = []
            for units, records in self._dump_pending:
                if any(u in self._inflight for u in units):
                    still.append((units, records))
                else:  # every message of these dumps acknowledged
                    dumps = {**dumps, **records}
            self._dump_pending = still
            dumps = {k: v for k, v in dumps.items() if k in self._dumps.done}  # gone: forget
        if files != self._saved or dumps != self._dumps_saved:
            self._store.save(files, dumps)
            self._saved, self._dumps_saved = files, dumps
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
