"""The two Faust agents, their timer and their rebalance/shutdown hooks.

Agent ``detect`` on ``c4.events`` (key = communicator): ``take_events`` batches →
:class:`~streams.app.detect_runner.CommRouter` → verdicts to ``c4.verdicts`` keyed by job,
on partition :func:`~streams.app.watermark.job_partition` (so each job is judged whole by
one correlator, and several correlators share the jobs).
Each verdict carries header ``c4-clock-us`` (its partition's event-time clock when it was
concluded). After each batch, and every ``tick_s`` for all its partitions, agent ``detect``
publishes each partition's clock, whether it has consumer lag, and the offset of its last
verdict to the worker's internal watermark topic
(:class:`~streams.app.watermark.WatermarkSender`). Agent ``correlate`` reads ``c4.verdicts``
and the watermarks → :class:`~streams.app.correlate_runner.CorrelatorRunner` (verdicts
judged in event-time order behind the watermark) → isolation commands to ``c4.isolations``
keyed by host.
Malformed input and failures inside detection go to ``c4.deadletter``; the agents never
stop on them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from c4base import lifeguard
from c4base.consumer_lag import lag_of, observe_latency
from c4base.lifeguard import write_status
from c4base.metrics import MetricsLike, NullMetrics
from c4base.signing import load_keys
from streams.app.checkpoint import TableCheckpoints
from streams.app.correlate_runner import CorrelatorRunner, HostRails
from streams.app.correlate_status import listed
from streams.app.deadletter import CLOCK_HEADER, DeadLetterPublisher, Record
from streams.app.detect_runner import CommRouter, EdgeLimits
from streams.app.engine import Engine
from streams.app.faust_adapter import (
    ConsumerView,
    drain_table_writes,
    recovered_keys,
    stop_on_crash,
)
from streams.app.runner import Output
from streams.app.settings import COMM_TABLE, CORRELATOR_TABLE, WorkerConfig
from streams.app.trust import CommandSigner, EventTrust, Freshness
from streams.app.watermark import WatermarkSender, job_partition
from streams.commands import encode_command
from streams.verdicts import encode_verdict

__all__ = ["WorkerParts", "register_agents"]

log = logging.getLogger(__name__)

#: Under the broker's default ``message.max.bytes`` (1 MiB) with room for headers.
MAX_RECORD_BYTES = 900 * 1024


@dataclass
class WorkerParts:
    """What :func:`register_agents` wired, for the status file and in-process tests."""

    router: CommRouter
    correlator: CorrelatorRunner
    comm_store: TableCheckpoints
    correlator_store: TableCheckpoints
    deadletters: DeadLetterPublisher
    assigned: set[Any]
    started_wall: float
    ready: bool = False
    rebalances: int = 0
    """Rebalances completed, table recovery included: > 0 means serving."""
    broker_down_since: float | None = None
    """Wall time since which the broker watchdog has had no answer (None: it answers)."""

    def status(self) -> dict[str, Any]:
        down = self.broker_down_since
        lanes, lanes_left = listed(sorted(self.router.clock_us))
        jobs = self.router.jobs | self.correlator.jobs
        return {
            "pid": os.getpid(),
            "ready": self.ready and down is None,
            "written_at": round(time.time(), 3),
            "broker_unreachable_s": None if down is None else round(time.time() - down, 1),
            "rebalances": self.rebalances,
            "uptime_s": round(time.time() - self.started_wall, 3),
            "assigned": sorted(f"{tp.topic}[{tp.partition}]" for tp in self.assigned),
            "detect": asdict(self.router.stats),
            "correlate": asdict(self.correlator.stats),
            "comms": len(self.router.comms),
            "clock_us": {f"{p}/{job}": self.router.clock_us[(p, job)] for p, job in lanes},
            "clock_us_not_listed": lanes_left,
            "contested_comms": len(self.router.contested),
            "duplicates": self.router.stats.duplicates,
            "evicted": self.router.stats.evicted,
            "evicted_active": self.router.stats.evicted_active,
            "checkpoints_parked": self.router.parked,
            "table_records": len(self.comm_store.table.data),
            "lanes": len(self.router.by_lane),
            "unreadable_checkpoints": self.comm_store.unreadable + self.correlator_store.unreadable,
            "watermarks": self.correlator.describe(),
            "late": late_status(self.router, self.correlator, jobs),
            "jobs": len(jobs),
            "deadletters_sent": self.deadletters.sent,
            "table_writes": self.comm_store.writes + self.correlator_store.writes,
        }


def register_agents(
    app: Any, config: WorkerConfig, engine: Engine, metrics: Any = None
) -> WorkerParts:
    """Declare topics, tables, agents, the timer and the hooks on ``app``.

    ``metrics`` (a :class:`c4base.metrics.Metrics`) gets the worker's counters,
    processing latency and consumer lag when given.
    """
    topics = config.topics()
    watch = _Meter(metrics)

    def topic(name: str, partitions: int) -> Any:
        return app.topic(
            name,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
            partitions=partitions,
        )

    events_t = topic(topics.events, config.events_partitions)
    verdicts_t = topic(topics.verdicts, config.verdicts_partitions)
    isolations_t = topic(topics.isolations, config.isolations_partitions)
    deadletter_t = topic(topics.deadletter, 1)
    watermark_t = topic(config.watermark_topic(), config.verdicts_partitions)
    # Agent 2 reads verdicts and watermarks through one stream, in fetch order.
    correlate_source = app.topic(
        topics.verdicts,
        config.watermark_topic(),
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
    )

    def table(name: str, partitions: int) -> Any:
        return app.Table(
            name,
            default=None,
            key_type=bytes,
            value_type=bytes,
            partitions=partitions,
        )

    chunk = config.max_checkpoint_chunk_bytes
    masters = load_keys(config.master_key_files)
    signer = CommandSigner(masters[0]) if masters else None
    comm_store = TableCheckpoints(table(COMM_TABLE, config.events_partitions), chunk)
    cor_store = TableCheckpoints(table(CORRELATOR_TABLE, config.verdicts_partitions), chunk)
    router = CommRouter(
        engine,
        comm_store.get,
        checkpoint_every_events=config.checkpoint_every_events,
        checkpoint_every_s=config.checkpoint_every_s,
        advance_every_us=int(config.advance_every_s * 1e6),
        allowed_lateness_us=config.policy.allowed_lateness_us,
        forget_lane_s=config.forget_lane_s,
        limits=EdgeLimits(
            max_nranks=config.max_nranks,
            max_future_skew_us=int(config.max_future_skew_s * 1e6),
            max_past_skew_us=int(config.max_past_skew_s * 1e6),
            max_message_bytes=config.max_message_bytes,
            contested_hold_s=config.contested_hold_s,
            exec_free_us=int(config.detect.hang_floor_us / config.detect.hang_period_mult),
            dedup_messages=config.dedup_messages,
            isolate_uncorroborated=config.isolate_uncorroborated,
            max_comms=config.max_comms,
            max_lanes=config.max_lanes,
            evict_idle_s=config.evict_idle_s,
            max_checkpoints=config.max_checkpoints,
        ),
        trust=event_trust(config, masters),
    )
    correlator = CorrelatorRunner(
        engine,
        cor_store.get,
        checkpoint_every_events=config.checkpoint_every_events,
        checkpoint_every_s=config.checkpoint_every_s,
        watermark_topic=config.watermark_topic(),
        events_partitions=config.events_partitions,
        idle_s=config.watermark_idle_s,
        max_hold_s=config.max_hold_s,
        slice_us=int(config.verdict_slice_s * 1e6),
        allowed_lateness_us=config.policy.allowed_lateness_us,
        forget_lane_s=config.forget_lane_s,
        host_rails=HostRails(config.max_isolations_per_hour, config.policy.cooldown_us / 1e6),
    )
    dl = DeadLetterPublisher(deadletter_t)
    parts = WorkerParts(router, correlator, comm_store, cor_store, dl, set(), time.time())

    offsets = ConsumerView(app)
    # a restarted correlator's marks of verdicts judged before it resumed count at once
    correlator.verdicts_read_from = lambda q: offsets.committed(topics.verdicts, q)

    async def send_mark(q: int, key: bytes, value: bytes) -> Any:
        return await watermark_t.send(key=key, value=value, partition=q)

    marks = WatermarkSender(topics.events, config.verdicts_partitions, offsets, send_mark)

    def fits(kind: str, value: bytes, what: str) -> bool:
        """A record over the broker's default limit would kill the producer (and with it
        the worker): log it, count it as a detector error, and do not send it."""
        if len(value) <= MAX_RECORD_BYTES:
            return True
        router.stats.detector_errors += 1
        log.error("%s %s is %d bytes, over %d: not sent", kind, what, len(value), MAX_RECORD_BYTES)
        return False

    async def emit(out: Output, store: TableCheckpoints, *, heartbeat: bool = False) -> None:
        # The marks as the router's lanes stand now, in line before the first await: the
        # detect agent and the timer emit concurrently, and a mark must never pass a
        # verdict concluded before it that is still on its way to the broker.
        queued = None
        if store is comm_store:
            mine = {tp.partition for tp in parts.assigned if tp.topic == topics.events}
            queued = marks.queue(mine, router.clock_us, router.moved, router.lanes_in)
        watch.output(out)
        encoded = [
            (v, encode_verdict(v), clock) for v, clock in zip(out.verdicts, out.clocks, strict=True)
        ]
        try:
            sent = [
                await verdicts_t.send(
                    key=v.job.encode(),
                    value=data,
                    partition=job_partition(v.job, config.verdicts_partitions),
                    headers=[(CLOCK_HEADER, str(clock).encode())],
                )
                for v, data, clock in encoded
                if fits("verdict", data, v.id)
            ]
        except BaseException:
            if queued is not None:  # the marks behind these are not held for ever
                queued.done.set()
            raise
        if queued is not None:
            await marks.send_queued(queued, sent, heartbeat)
        watch.jobs(router.jobs | correlator.jobs)
        for c in out.commands:
            log.info("isolation command %s: %s %s (%s)", c.id, c.action, c.host, c.fault)
            data = encode_command(c)
            if fits("isolation command", data, c.id):
                sig = signer.headers(data) if signer is not None else None
                await isolations_t.send(key=c.host.encode(), value=data, headers=sig)
        await dl.publish(out.deadletters)
        for partition, key, data in out.checkpoints:
            store.put(partition, key, data)
        for partition, key in out.forgotten:
            store.delete(partition, key)

    status_path = config.status_path()

    def crashed(name: str, err: BaseException) -> None:
        log.critical("agent %s failed on a batch", name, exc_info=err)
        parts.ready = False
        try:
            write_status(status_path, {**parts.status(), "exit": f"agent {name} failed: {err}"})
        finally:
            lifeguard.exit_fatal(f"agent {name} failed ({type(err).__name__}: {err})")

    @app.agent(events_t, name="detect")
    @stop_on_crash(crashed)
    async def detect(stream: Any) -> None:
        async for batch in stream.take_events(config.batch_max, within=config.batch_within_s):
            before = router.stats.events
            records = [Record.of_event(e) for e in batch]
            for rec in records:
                marks.taken(rec.partition, rec.offset)
            # Live partitions (no lag) are judged at once; catching-up ones slice by slice.
            live = {p for p in {rec.partition for rec in records} if marks.caught_up(p)}
            out = router.process(records, live)
            watch.batch(len(batch), router.stats.events - before, router.clock_us)
            await emit(out, comm_store)

    @app.agent(correlate_source, name="correlate")
    @stop_on_crash(crashed)
    async def correlate(stream: Any) -> None:
        async for batch in stream.take_events(config.batch_max, within=config.batch_within_s):
            out = correlator.process([Record.of_event(e) for e in batch])
            await emit(out, cor_store)

    @app.timer(interval=config.tick_s)
    async def tick() -> None:
        await emit(router.tick(), comm_store, heartbeat=True)
        await emit(correlator.tick(), cor_store)
        write_status(status_path, parts.status())
        watch.lag(offsets, parts.assigned)
        watch.state(router, router.jobs | correlator.jobs)

    @app.on_partitions_revoked.connect
    async def on_revoked(sender: Any, revoked: set[Any], **_: Any) -> None:
        # Checkpoint before another worker takes these partitions over, then forget them.
        ev = {tp.partition for tp in revoked if tp.topic == topics.events}
        vd = {tp.partition for tp in revoked if tp.topic == topics.verdicts}
        parts.assigned -= set(revoked)
        marks.revoked(ev)
        await emit(router.flush(ev, drop=True), comm_store)
        await emit(correlator.flush(vd, drop=True), cor_store)
        # on the broker before the next owner restores them; bounded, so that a broker
        # that stopped answering cannot hold the rebalance past its own timeout
        left = await drain_table_writes(app, config.rebalance_timeout_s / 2)
        if left:
            log.error(
                "%d checkpoint writes still not on the broker %.0f s after the revoke; "
                "the rebalance goes on, and the next owner restores the checkpoints "
                "written before them", left, config.rebalance_timeout_s / 2,
            )  # fmt: skip

    @app.on_partitions_assigned.connect
    async def on_assigned(sender: Any, assigned: set[Any], **_: Any) -> None:
        parts.assigned |= {tp for tp in assigned if tp.topic in (topics.events, topics.verdicts)}

    streamed = {topics.events, topics.verdicts, config.watermark_topic()}

    @app.on_rebalance_complete.connect
    async def on_rebalanced(sender: Any, **_: Any) -> None:
        # Sent before Faust resumes the streams: no message of a never-committed
        # partition may stay skipped (see ConsumerView.rewind_uncommitted).
        rewound = await offsets.rewind_uncommitted(streamed)
        if rewound:
            log.info("read from the start (no offset committed): %s", sorted(rewound))
        # Tables are recovered by now: the verdicts a revoke handed off are taken back at
        # once, not at their partition's next record (a quiet one would hold them).
        correlator.take_back(tp.partition for tp in parts.assigned if tp.topic == topics.verdicts)
        # The checkpoints recovered of communicators not held count under the cap.
        mine = {tp.partition for tp in parts.assigned if tp.topic == topics.events}
        await emit(router.park(recovered_keys(comm_store.table, mine)), comm_store)
        parts.rebalances += 1
        parts.ready = True
        write_status(status_path, parts.status())

    @app.on_before_shutdown.connect
    async def on_shutdown(sender: Any, **_: Any) -> None:
        # Clean stop: every dirty state is checkpointed; the producer is flushed after this.
        await emit(router.flush(), comm_store)
        await emit(correlator.flush(), cor_store)
        await drain_table_writes(app)  # on the broker before Faust stops its producer
        parts.ready = False
        write_status(status_path, {**parts.status(), "stopped": True})
        log.info("worker state checkpointed; stopping")

    return parts


def event_trust(config: WorkerConfig, masters: list[bytes]) -> EventTrust | None:
    """The worker's check of signed events, or None (then it says so, loudly: anyone
    who can write ``c4.events`` can then speak for any host)."""
    if not config.require_signed_events:
        log.warning(
            "SIGNING IS OFF: [worker] require_signed_events = false, so any writer of "
            "c4.events can speak for any host (docs/security.md section 5)"
        )
        return None
    fresh = Freshness(
        window_us=int(config.replay_window_s * 1e6),
        max_age_us=int(config.max_past_skew_s * 1e6),
        ahead_us=int(config.max_future_skew_s * 1e6),
    )
    return EventTrust(masters, fresh, require_fresh=config.require_fresh_events)


def late_status(
    router: CommRouter, correlator: CorrelatorRunner, jobs: set[str]
) -> dict[str, dict[str, int]]:
    """Per job of ``jobs``: events dead-lettered as late, verdicts judged late /
    dead-lettered late."""
    out: dict[str, dict[str, int]] = {}
    late = set(router.late_events) | set(correlator.late_verdicts)
    for job in listed(sorted(jobs), late)[0]:  # jobs with late ones first
        v = correlator.late_verdicts.get(job, {})
        out[job] = {
            "events_deadlettered": router.late_events.get(job, 0),
            "verdicts_judged": v.get("judged", 0),
            "verdicts_deadlettered": v.get("deadlettered", 0),
        }
    return out


class _Meter:
    """Prometheus families of :mod:`c4base.metrics` for stage ``worker``."""

    STAGE = "worker"

    def __init__(self, metrics: MetricsLike | None) -> None:
        self.m = metrics or NullMetrics()
        self._exported: set[str] = set()
        self._evicted: dict[str, int] = {}

    def batch(self, messages: int, events: int, clocks: dict[Any, int]) -> None:
        self.m.messages_in.labels(stage=self.STAGE).inc(messages)
        self.m.events_in.labels(stage=self.STAGE).inc(events)
        if clocks:
            # Wall time since the newest event was produced (meaningful on live traffic).
            observe_latency(self.m, self.STAGE, ts_us=max(clocks.values()))

    def output(self, out: Output) -> None:
        for v in out.verdicts:
            self.m.verdicts.labels(stage=self.STAGE, fault=v.fault).inc()
        for c in out.commands:
            self.m.isolations.labels(stage=self.STAGE, fault=c.fault, action=c.action).inc()
        if out.deadletters:
            self.m.deadletters.labels(stage=self.STAGE).inc(len(out.deadletters))
        for job, n in out.late_events:
            self.m.late_events.labels(stage=self.STAGE, job=job).inc(n)
        for job, outcome in out.late_verdicts:
            self.m.late_verdicts.labels(stage=self.STAGE, job=job, outcome=outcome).inc()

    def state(self, router: CommRouter, jobs: set[str]) -> None:
        """What the router holds and has evicted (counters follow its totals); the
        per-job series of jobs no longer held (``jobs``) removed, so a flood of job ids
        does not grow the registry for ever (a job back starts them at 0 again)."""
        for job in self._exported - jobs:
            self.m.late_events.remove(self.STAGE, job)
            for outcome in ("judged", "deadlettered"):
                self.m.late_verdicts.remove(self.STAGE, job, outcome)
        self._exported &= jobs
        st = router.stats
        self.m.held.labels(stage=self.STAGE, kind="communicators").set(len(router.comms))
        self.m.held.labels(stage=self.STAGE, kind="lanes").set(len(router.by_lane))
        for when, total in (("idle", st.evicted - st.evicted_active),
                            ("active", st.evicted_active)):  # fmt: skip
            counter = self.m.evicted.labels(stage=self.STAGE, when=when)
            counter.inc(total - self._evicted.get(when, 0))
            self._evicted[when] = total

    def jobs(self, jobs: set[str]) -> None:
        """Export the late counters of every job seen, from 0 (a rate needs a start)."""
        if jobs <= self._exported:
            return
        for job in jobs - self._exported:
            self.m.late_events.labels(stage=self.STAGE, job=job).inc(0)
            for outcome in ("judged", "deadlettered"):
                self.m.late_verdicts.labels(stage=self.STAGE, job=job, outcome=outcome).inc(0)
        self._exported |= jobs

    def lag(self, offsets: ConsumerView, assigned: set[Any]) -> None:
        """Lag = high watermark - next offset to read, per assigned partition."""
        try:
            for tp in assigned:
                high = offsets.highwater(tp.topic, tp.partition)
                read = offsets.read_offset(tp)  # the last handed over; lag_of wants the next
                nxt = read + 1 if read is not None else 0
                lag = None if high is None else lag_of(high=high, position=nxt, committed=-1)
                if lag is None:
                    continue
                self.m.consumer_lag.labels(
                    stage=self.STAGE, topic=tp.topic, partition=str(tp.partition)
                ).set(lag)
        except Exception:  # metrics must never stop the worker
            log.debug("consumer lag not available", exc_info=True)
