"""The two Faust agents, their timer and their rebalance/shutdown hooks.

Agent ``detect`` on ``c4.events`` (key = communicator): ``take_events`` batches →
:class:`~streams.app.router.CommRouter` → verdicts to ``c4.verdicts`` keyed by host.
After each batch agent ``detect`` also publishes each partition's event-time clock to the
worker's internal watermark topic. Agent ``correlate`` reads ``c4.verdicts`` and the
watermarks → :class:`~streams.app.router.CorrelatorRunner` (verdicts judged in event-time
order behind the watermark) → isolation commands to ``c4.isolations`` keyed by host.
Malformed input and failures inside detection go to ``c4.deadletter``; the agents never
stop on them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from streams.app.checkpoint import TableCheckpoints
from streams.app.deadletter import DeadLetterPublisher, Record
from streams.app.engine import Engine
from streams.app.router import (
    CommRouter,
    CorrelatorRunner,
    Output,
    Watermark,
    encode_watermark,
)
from streams.app.settings import COMM_TABLE, CORRELATOR_TABLE, WorkerConfig
from streams.commands import encode_command
from streams.verdicts import encode_verdict

__all__ = ["WorkerParts", "register_agents"]

log = logging.getLogger(__name__)


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

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "ready": self.ready,
            "rebalances": self.rebalances,
            "uptime_s": round(time.time() - self.started_wall, 3),
            "assigned": sorted(f"{tp.topic}[{tp.partition}]" for tp in self.assigned),
            "detect": asdict(self.router.stats),
            "correlate": asdict(self.correlator.stats),
            "comms": len(self.router.comms),
            "clock_us": {str(p): t for p, t in self.router.clock_us.items()},
            "deadletters_sent": self.deadletters.sent,
            "table_writes": self.comm_store.writes + self.correlator_store.writes,
        }


def register_agents(
    app: Any, config: WorkerConfig, engine: Engine, metrics: Any = None
) -> WorkerParts:
    """Declare topics, tables, agents, the timer and the hooks on ``app``.

    ``metrics`` (a :class:`c4stream.metrics.Metrics`) gets the worker's counters,
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

    comm_store = TableCheckpoints(table(COMM_TABLE, config.events_partitions))
    cor_store = TableCheckpoints(table(CORRELATOR_TABLE, config.verdicts_partitions))
    router = CommRouter(
        engine,
        comm_store.get,
        checkpoint_every_events=config.checkpoint_every_events,
        checkpoint_every_s=config.checkpoint_every_s,
        advance_every_us=int(config.advance_every_s * 1e6),
    )
    correlator = CorrelatorRunner(
        engine,
        cor_store.get,
        checkpoint_every_events=config.checkpoint_every_events,
        checkpoint_every_s=config.checkpoint_every_s,
        watermark_topic=config.watermark_topic(),
        idle_s=config.watermark_idle_s,
        max_hold_s=config.max_hold_s,
    )
    dl = DeadLetterPublisher(deadletter_t)
    parts = WorkerParts(router, correlator, comm_store, cor_store, dl, set(), time.time())

    marks_sent: dict[int, int] = {}

    async def emit(out: Output, store: TableCheckpoints) -> None:
        watch.output(out)
        last = None
        for v in out.verdicts:
            last = await verdicts_t.send(key=v.host.encode(), value=encode_verdict(v))
        if store is comm_store:
            await send_watermarks(last)
        for c in out.commands:
            log.info("isolation command %s: %s %s (%s)", c.id, c.action, c.host, c.fault)
            await isolations_t.send(key=c.host.encode(), value=encode_command(c))
        await dl.publish(out.deadletters)
        for partition, key, data in out.checkpoints:
            store.put(partition, key, data)

    async def send_watermarks(last_verdict: Any) -> None:
        moved = {p: t for p, t in router.clock_us.items() if marks_sent.get(p) != t}
        if not moved:
            return
        if last_verdict is not None:
            await last_verdict  # verdicts are on the broker before the watermark passes them
        for p, t in moved.items():
            wm = encode_watermark(Watermark(partition=p, clock_us=t))
            for q in range(config.verdicts_partitions):  # every correlator needs every clock
                await watermark_t.send(key=str(p).encode(), value=wm, partition=q)
            marks_sent[p] = t

    @app.agent(events_t, name="detect")
    async def detect(stream: Any) -> None:
        async for batch in stream.take_events(config.batch_max, within=config.batch_within_s):
            before = router.stats.events
            out = router.process([Record.of_event(e) for e in batch])
            watch.batch(len(batch), router.stats.events - before, router.clock_us)
            await emit(out, comm_store)

    @app.agent(correlate_source, name="correlate")
    async def correlate(stream: Any) -> None:
        async for batch in stream.take_events(config.batch_max, within=config.batch_within_s):
            out = correlator.process([Record.of_event(e) for e in batch])
            await emit(out, cor_store)

    status_path = config.status_path()

    @app.timer(interval=config.tick_s)
    async def tick() -> None:
        await emit(router.tick(), comm_store)
        await emit(correlator.tick(), cor_store)
        write_status(status_path, parts.status())
        watch.lag(app, parts.assigned)

    @app.on_partitions_revoked.connect
    async def on_revoked(sender: Any, revoked: set[Any], **_: Any) -> None:
        # Checkpoint before another worker takes these partitions over, then forget them.
        ev = {tp.partition for tp in revoked if tp.topic == topics.events}
        vd = {tp.partition for tp in revoked if tp.topic == topics.verdicts}
        parts.assigned -= set(revoked)
        await emit(router.flush(ev, drop=True), comm_store)
        await emit(correlator.flush(vd, drop=True), cor_store)

    @app.on_partitions_assigned.connect
    async def on_assigned(sender: Any, assigned: set[Any], **_: Any) -> None:
        parts.assigned |= {tp for tp in assigned if tp.topic in (topics.events, topics.verdicts)}

    @app.on_rebalance_complete.connect
    async def on_rebalanced(sender: Any, **_: Any) -> None:
        parts.rebalances += 1
        parts.ready = True
        write_status(status_path, parts.status())

    @app.on_before_shutdown.connect
    async def on_shutdown(sender: Any, **_: Any) -> None:
        # Clean stop: every dirty state is checkpointed; the producer is flushed after this.
        await emit(router.flush(), comm_store)
        await emit(correlator.flush(), cor_store)
        parts.ready = False
        write_status(status_path, {**parts.status(), "stopped": True})
        log.info("worker state checkpointed; stopping")

    return parts


def write_status(path: Any, status: dict[str, Any]) -> None:
    """Atomically replace the status file (readers never see half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


class _Meter:
    """Prometheus families of :mod:`c4stream.metrics` for stage ``worker`` (no-op if None)."""

    STAGE = "worker"

    def __init__(self, metrics: Any) -> None:
        self.m = metrics

    def batch(self, messages: int, events: int, clocks: dict[int, int]) -> None:
        if self.m is None:
            return
        self.m.messages_in.labels(stage=self.STAGE).inc(messages)
        self.m.events_in.labels(stage=self.STAGE).inc(events)
        if clocks:
            # Wall time since the newest event was produced (meaningful on live traffic).
            self.m.latency.labels(stage=self.STAGE).observe(
                max(0.0, time.time() - max(clocks.values()) / 1e6)
            )

    def output(self, out: Output) -> None:
        if self.m is None:
            return
        for v in out.verdicts:
            self.m.verdicts.labels(stage=self.STAGE, fault=v.fault).inc()
        for c in out.commands:
            self.m.isolations.labels(stage=self.STAGE, fault=c.fault, action=c.action).inc()
        if out.deadletters:
            self.m.deadletters.labels(stage=self.STAGE).inc(len(out.deadletters))

    def lag(self, app: Any, assigned: set[Any]) -> None:
        """Lag = high watermark - next offset to read, per assigned partition."""
        if self.m is None:
            return
        try:
            consumer = app.consumer
            for tp in assigned:
                high = consumer.highwater(tp)
                read = consumer._read_offset[tp]  # Faust keeps no public accessor for it
                if high is None:
                    continue
                lag = high - (read + 1 if read is not None else 0)
                self.m.consumer_lag.labels(
                    stage=self.STAGE, topic=tp.topic, partition=str(tp.partition)
                ).set(max(0, lag))
        except Exception:  # metrics must never stop the worker
            log.debug("consumer lag not available", exc_info=True)
