"""The worker's one typed configuration object, and how it is read from a file.

Everything the Faust worker needs is in :class:`WorkerConfig`; nothing is read from
the environment deep inside (``KAFKA_BOOTSTRAP`` is honoured by
:class:`~c4base.kafka.KafkaConfig` itself, ``C4STREAM__…`` overrides by
:func:`load_worker_config`).

>>> cfg = WorkerConfig(kafka=KafkaConfig(topic_prefix="t1."), events_partitions=4)
>>> cfg.topics().events, cfg.topics().partitions()["t1.c4.events"]
('t1.c4.events', 4)
>>> cfg.group_id(), cfg.comm_table_changelog()
('t1.c4stream-worker', 't1.c4stream-worker-comm-state-changelog')
>>> load_worker_config(None, checkpoint_every_events=0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
streams.app.settings.WorkerConfigError: ...Expected `int` >= 1 - at `$.checkpoint_every_events`
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

from c4base.collector import GEN0_THRESHOLD
from c4base.config import Section, load_section
from c4base.kafka import KafkaConfig
from c4base.settings_loader import SettingsError
from c4base.signing import load_keys
from c4base.topics import Topics
from producers.guard import MAX_FUTURE_SKEW_US, MAX_NRANKS, MAX_PAST_SKEW_US
from streams.core.config import DetectConfig, PolicyConfig

# Worker limits the edge (``streams.app.admission.EdgeLimits``) takes as its defaults too:
# each written once, here, where the settings file's reader looks.
DEDUP_MESSAGES = 131_072
CONTESTED_HOLD_S = 120.0
MAX_COMMS = 20_000
MAX_LANES = 20_000
EVICT_IDLE_S = 60.0
MAX_CHECKPOINTS = 200_000

__all__ = ["WORKER_SECTION", "WorkerConfig", "WorkerConfigError", "load_worker_config"]

Pos = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]

COMM_TABLE = "comm-state"
CORRELATOR_TABLE = "correlator-state"


class WorkerConfigError(ValueError):
    """The worker configuration is invalid; the message names the setting to fix."""


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of one ``c4stream worker`` process (one Faust app instance)."""

    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    app_id: str = "c4stream-worker"
    """Faust app id = consumer group; the topic prefix is prepended so deployments sharing
    a cluster (and tests sharing a broker) stay apart."""
    events_partitions: Pos = 8
    verdicts_partitions: Pos = 1
    isolations_partitions: Pos = 1
    replication_factor: Pos = 1
    """Of the topics the worker creates (changelogs, and any missing pipeline topic)."""

    batch_max: Pos = 1000
    """At most this many Kafka messages per ``stream.take`` batch."""
    batch_within_s: PosFloat = 0.2
    """A batch is processed after this long even when not full."""
    max_poll_records: Pos = 5000
    stream_buffer_maxsize: Pos = 16384
    """Faust fetch/queue sizes: larger than the defaults (500/4096), which measured ~1.5x
    slower on a backlog (Faust's per-message overhead dominates small messages)."""
    gc_gen0_threshold: Pos = GEN0_THRESHOLD
    """The garbage collector's first threshold in the worker process, whose start-up
    objects are frozen (``gc.freeze``); Python's default is 700. Why it is raised, and
    what that measured: ``c4base.collector``."""
    fetch_max_partition_bytes: Pos = 4 * 1024 * 1024
    """Most bytes one fetch returns per partition (Faust ``consumer_max_fetch_size``,
    default 1 MiB): fewer fetch round trips on a backlog."""
    checkpoint_every_events: Pos = 20_000
    """Checkpoint a communicator after this many events (not per event: a table write
    costs more than detecting on the event)."""
    checkpoint_every_s: PosFloat = 5.0
    """...or after this many seconds of wall time, whichever comes first."""
    advance_every_s: PosFloat = 0.25
    """Event-time step at which every communicator of a partition is advanced (hangs are
    found by the clock moving on while a collective does not complete)."""
    watermark_idle_s: PosFloat = 5.0
    """An events partition with no consumer lag whose clock has not moved for this long
    (wall) no longer holds back the correlator's event-time watermark. A partition with
    lag always holds, however slow the machine."""
    max_hold_s: PosFloat = 30.0
    """An events partition from which no watermark at all arrived for this long (wall:
    its worker is gone) no longer holds back the correlator. Live workers report every
    ``tick_s``."""
    forget_lane_s: PosFloat = 3600.0
    """A job that sent nothing to an events partition for this long (wall) is forgotten
    there: its watermarks stop (a finished job must not cost a message per tick forever).
    Its communicators keep their state; a new message of the job starts again."""
    verdict_slice_s: PosFloat = 0.5
    """Verdicts concluded within one event-time slice of this length are judged together,
    ordered by ``ts_us`` (as ``DetectionPipeline`` with its default ``tick_us``)."""
    tick_s: PosFloat = 1.0
    """Wall-clock period of the timer that advances detectors, checkpoints, writes status."""

    max_nranks: Pos = MAX_NRANKS
    """Largest communicator accepted; an event claiming more is dead-lettered."""
    max_future_skew_s: PosFloat = MAX_FUTURE_SKEW_US / 1e6
    """Events further ahead of their partition's clock (or of the wall clock) than this
    are dead-lettered and never move the clock."""
    max_past_skew_s: PosFloat = MAX_PAST_SKEW_US / 1e6
    """Events further behind their partition's clock than this are dead-lettered."""
    max_message_bytes: Pos = 8 * 1024 * 1024
    """Larger ``c4.events`` messages are dead-lettered undecoded."""
    max_checkpoint_chunk_bytes: Pos = 512 * 1024
    """Checkpoints (compressed) are split into changelog records of at most this size,
    well under the broker's default 1 MB ``message.max.bytes``."""
    broker_unreachable_exit_s: PosFloat = 60.0
    """Exit non-zero when no broker has answered for this long (the supervisor restarts
    the worker; a worker that pretends to run is worse)."""

    stop_grace_s: PosFloat = 10.0
    """SIGTERM/SIGINT: a clean stop (checkpoints, producer flush) that takes longer than
    this (e.g. the broker is gone) ends the process anyway, with status 4."""

    session_timeout_s: PosFloat = 10.0
    heartbeat_interval_s: PosFloat = 1.0
    rebalance_timeout_s: PosFloat = 10.0
    commit_interval_s: PosFloat = 1.0
    recovery_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Faust waits this long after a rebalance before restoring tables (default 3 s)."""

    web_enabled: bool = False
    web_port: int = 6066
    """Faust's web server, only when enabled; always bound to 127.0.0.1."""
    workdir: str = ".c4stream/worker"
    """Faust data dir and ``status.json`` (live counters, read by the CLI, demo and tests)."""
    loglevel: str = "info"

    require_signed_events: bool = False
    """Accept only ``c4.events`` messages signed by the host they report for (headers
    ``c4-host``/``c4-sig``, keys derived from the master key; docs/security.md); any
    other is dead-lettered: unsigned, bad signature, or an event of another host."""
    master_key_files: tuple[str, ...] = ()
    """The operator's master key file(s): the first signs the isolation commands (the
    actuator's ``require_signed_commands``), all verify events (a rotation lists the new
    key first, then the old one). Empty: commands unsigned, events not verifiable."""

    require_fresh_events: bool = True
    """With ``require_signed_events``: a signed message must carry header ``c4-fresh``
    (the host's sequence number and time, inside the signature); false only while
    exporters older than it still run. A replayed one (its seq already accepted) or a
    stale one is dead-lettered before corroboration."""
    replay_window_s: PosFloat = 120.0
    """A signed message stamped this much earlier than its host's newest is stale
    (dead-lettered): the window within which sequence numbers are remembered. Messages
    of one host reach the worker through several partitions, out of order by at most
    the partitions' skew."""
    dedup_messages: Pos = DEDUP_MESSAGES
    """Digests of this many recently accepted messages are kept: an exact repeat (a
    producer retry, a re-send) is dropped and counted, never judged twice."""
    isolate_uncorroborated: bool = False
    """A verdict of a communicator nobody corroborates (no second host signed for it,
    and the accused host is in no other communicator of its job seen by this worker)
    is alert-only unless this is true."""
    contested_hold_s: PosFloat = CONTESTED_HOLD_S
    """Worker wall time a contested communicator's verdicts stay alert-only (its faults
    are still sent as alerts that say so)."""
    max_isolations_per_hour: Pos = 8
    """Isolating commands per rolling hour of the worker's clock across all jobs (a job
    id is free to invent: the per-job cap alone gave 11 cordons to 22 forged messages);
    beyond it, alert only. A host isolated for one job is not isolated again for another
    within the policy's cool-down either."""
    max_comms: Pos = MAX_COMMS
    """Communicators held by one worker: its memory bound (~12 KB each for a 4-rank
    one, docs/limits.md). Beyond it, lanes (partition, job) are checkpointed and
    forgotten, communicators and all, least recently active first: idle ones (quiet
    for ``evict_idle_s``) before any other, and when none is idle (a flood of new ids)
    recent ones too (logged once a minute, ``c4stream_evicted_total{when="active"}``).
    A communicator that speaks again is restored from its checkpoint. Size it above
    the communicators of the jobs the worker's partitions carry (about 1–2 per GPU:
    its tensor-, pipeline- and data-parallel groups and point-to-point pairs)."""
    max_lanes: Pos = MAX_LANES
    """(events partition, job) lanes held by one worker; beyond it, likewise."""
    evict_idle_s: PosFloat = EVICT_IDLE_S
    """Lanes quiet this long (wall) are the first evicted over a cap."""
    max_checkpoints: Pos = MAX_CHECKPOINTS
    """Checkpoints kept in the worker's table (memory, ~0.8 KB each for a 4-rank
    communicator) for communicators it does not hold (evicted, or their job quiet for
    ``forget_lane_s``), beyond those it holds; beyond it the longest kept are deleted
    (tombstones; counted in ``forgotten``): such a communicator, speaking again, starts
    afresh. A restarted worker counts the ones it recovers."""

    detect: DetectConfig = msgspec.field(default_factory=DetectConfig)
    """``[worker.detect]``: thresholds and windows of the detection core."""
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    """``[worker.policy]``: what the correlator may do (rails, dry run)."""

    def __post_init__(self) -> None:
        if self.require_signed_events and not self.master_key_files:
            raise ValueError(
                "require_signed_events = true needs master_key_files (the operator's "
                "master key, docs/security.md)"
            )
        load_keys(self.master_key_files)  # missing, short, readable by others: say so now

    def topics(self) -> Topics:
        return Topics(
            prefix=self.kafka.topic_prefix,
            events_partitions=self.events_partitions,
            verdicts_partitions=self.verdicts_partitions,
            isolations_partitions=self.isolations_partitions,
        )

    def group_id(self) -> str:
        return f"{self.kafka.topic_prefix}{self.app_id}"

    def comm_table_changelog(self) -> str:
        return f"{self.group_id()}-{COMM_TABLE}-changelog"

    def correlator_table_changelog(self) -> str:
        return f"{self.group_id()}-{CORRELATOR_TABLE}-changelog"

    def watermark_topic(self) -> str:
        """Internal: event-time progress of each events partition, for the correlator."""
        return f"{self.group_id()}-watermarks"

    def all_topics(self) -> dict[str, int]:
        """Every topic the worker reads or writes, with its partition count.

        Changelog topics get the partition count of the topic their table shadows:
        Faust writes a communicator's checkpoint to the partition its events came from.
        """
        out = self.topics().partitions()
        out[self.comm_table_changelog()] = self.events_partitions
        out[self.correlator_table_changelog()] = self.verdicts_partitions
        out[self.watermark_topic()] = self.verdicts_partitions
        return out

    def status_path(self) -> Path:
        return Path(self.workdir) / "status.json"


def load_worker_config(path: str | Path | None = None, **overrides: Any) -> WorkerConfig:
    """``[worker]`` of ``c4stream.toml`` (``[kafka]`` shared), like every service reads it.

    Same rules as :func:`c4base.config.load_section` (``C4STREAM__WORKER__…``
    environment overrides; ``c4stream config check`` validates with the same code).
    ``overrides`` (e.g. from CLI flags; ``bootstrap``/``topic_prefix`` go to ``kafka``)
    win over the file; ``None`` values are ignored.

    >>> load_worker_config(None, workdir="/tmp/w", bootstrap="k:1").kafka.bootstrap
    'k:1'
    """
    dotted = {
        (f"kafka.{k}" if k in ("bootstrap", "topic_prefix") else k): v
        for k, v in overrides.items()
        if v is not None
    }
    try:
        return load_section("worker", WORKER_SECTION, path, overrides=dotted)
    except (SettingsError, msgspec.ValidationError) as err:
        raise WorkerConfigError(f"worker configuration: {err}") from None


WORKER_SECTION = Section(WorkerConfig)
"""``[worker]`` of ``c4stream.toml`` (``[worker.detect]``/``[worker.policy]`` typed)."""
