"""The one place that touches Faust beyond its public API.

faust-streaming keeps no public accessor for a partition's committed or read offset;
its consumer holds them in ``_committed_offset`` and ``_read_offset``. Every such use
lives here so that a Faust upgrade that renames them breaks one module, and each
accessor answers None (never raises) when the consumer is not there yet.

It also holds the worker's guards against a Faust + aiokafka race that lost messages
after a restart (:class:`GuardedTransport`, :meth:`ConsumerView.rewind_uncommitted`),
and :class:`BoundedStopWorker`: Faust's worker wired to the runtime the sinks share
(:mod:`c4base.lifeguard`'s stop deadline, :mod:`c4base.throttle`'s repeated-line limit).
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from faust import Worker
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from c4base import lifeguard
from c4base.throttle import install_repeat_filter

__all__ = [
    "BoundedStopWorker",
    "ConsumerView",
    "GuardedTransport",
    "drain_table_writes",
    "install_guarded_transport",
    "recovered_keys",
    "stop_on_crash",
]

log = logging.getLogger(__name__)

AgentBody = Callable[[Any], Awaitable[None]]


class _SnapshotConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """Fetches for a *copy* of Faust's active partitions, and nothing for none.

    Faust hands its live set of active partitions to the consumer thread, where aiokafka
    waits on it for records; when table recovery ends Faust empties that set (changelogs
    paused, streams not resumed yet), and aiokafka reads an empty set as "every assigned
    partition": it returned the records of ``c4.events``, moved its positions past them,
    and Faust dropped them as not active. A restarted worker then never processed them
    (seen in the chaos suite: 850 of 900 messages, and 7 of 900 after a first fix that
    only rewound never-committed partitions). A copy taken on the event loop, where
    Faust changes the set, cannot change under aiokafka.
    """

    async def getmany(self, active_partitions: Any, timeout: float) -> Any:
        if active_partitions is not None:
            active_partitions = set(active_partitions)
            if not active_partitions:
                return {}
        return await super().getmany(active_partitions, timeout)


class _GuardedConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> Any:
        return _SnapshotConsumerThread(self, loop=self.loop, beacon=self.beacon)


class GuardedTransport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with :class:`_SnapshotConsumerThread`."""

    Consumer = _GuardedConsumer


def install_guarded_transport(app: Any) -> None:
    """Give ``app`` a :class:`GuardedTransport` as its consumer transport. Call it right
    after creating the app: declaring a topic already creates the transport."""
    if app._transport is not None:
        raise RuntimeError("the app's consumer transport exists already")
    app.transport = GuardedTransport(app.conf.broker_consumer, app)


class ConsumerView:
    """Offsets of the app's consumer, by (topic, partition)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @staticmethod
    def tp(topic: str, partition: int) -> TP:
        return TP(topic, partition)

    def highwater(self, topic: str, partition: int) -> int | None:
        """The broker's high watermark as of the last fetch (None: unknown)."""
        try:
            return self.app.consumer.highwater(TP(topic, partition))
        except Exception:  # no consumer (yet)
            log.debug("high watermark of %s[%d] not available", topic, partition, exc_info=True)
            return None

    def committed(self, topic: str, partition: int) -> int | None:
        """The group's committed offset as this consumer knows it (None: none)."""
        try:
            return self.app.consumer._committed_offset.get(TP(topic, partition))
        except Exception:
            log.debug("committed offset of %s[%d] not available", topic, partition, exc_info=True)
            return None

    def read_offset(self, tp: Any) -> int | None:
        """Offset of the last message handed to the stream (None: none yet)."""
        try:
            return self.app.consumer._read_offset[tp]
        except Exception:
            log.debug("read offset of %s not available", tp, exc_info=True)
            return None

    async def rewind_uncommitted(self, topics: Collection[str]) -> list[Any]:
        """Seek every assigned partition of ``topics`` that the group never committed
        (or committed at 0) back to its beginning; returns those partitions.

        Why: records fetched for a partition Faust has just paused are dropped by Faust
        while aiokafka's position has moved past them (:class:`_SnapshotConsumerThread`
        closes the worst case; a pause at a rebalance remains). After a rebalance Faust
        seeks back to the committed offsets, but aiokafka's ``seek_to_committed`` seeks
        only for offsets > 0, so a partition without a commit stayed past records
        nobody processed: a worker SIGKILLed before its first offset commit, restarted,
        read none of the 900 messages of ``c4.events`` again. Offset 0 is the earliest
        (the app's ``auto_offset_reset``; a trimmed log resets to its start).

        Called when a rebalance completes, before Faust resumes the streams.
        """
        consumer = self.app.consumer
        if not consumer.assignment():
            return []  # aiokafka's seek_to_committed asserts on an empty assignment
        committed = await consumer.seek_to_committed()
        rewound = [tp for tp, off in committed.items() if tp.topic in topics and not off]
        for tp in rewound:
            await consumer.seek(tp, 0)
        return rewound


def recovered_keys(table: Any, partitions: Collection[int]) -> list[tuple[int, bytes]]:
    """(partition, key) of the keyed records ``table`` recovered from its changelog for
    ``partitions`` (not chunks or side records: their keys hold a NUL). Faust's memory
    store remembers each recovered key's partition (``_key_partition``, used by its own
    ``on_recovery_completed``); a store that does not, gives none."""
    data = table.data
    where = getattr(data, "_key_partition", None) or {}
    return [(p, bytes(k)) for k, p in list(where.items())
            if p in partitions and b"\x00" not in bytes(k) and k in data]  # fmt: skip


async def drain_table_writes(app: Any, timeout_s: float | None = None) -> int:
    """Wait until Faust's producer buffer (the tables' changelog writes, put there by
    ``send_changelog`` without a send) is empty, for up to ``timeout_s`` (None: the
    stop deadline of :class:`BoundedStopWorker` bounds it); returns what is left (0
    normally).

    Why: a clean stop checkpoints every dirty detector at once (thousands under load),
    and Faust's own flush returns as soon as one message takes over 0.1 s; its buffer
    then raised "Cannot flush: Producer not Running" when it stopped with messages in
    it (the worker exited 1), or those checkpoints were lost. At a revoke nothing else
    bounds it: a broker that stopped answering held the rebalance past its timeout."""
    buffer = app.producer.buffer
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while buffer.size and (deadline is None or time.monotonic() < deadline):
        await buffer.flush_atmost(None)  # returns on a 0.1-s stall: try again
    return buffer.size


def stop_on_crash(
    on_crash: Callable[[str, BaseException], None],
) -> Callable[[AgentBody], AgentBody]:
    """Decorate an agent's body: should it raise, ``on_crash`` (which ends the process)
    is called at once.

    Why: Faust acks a ``take_events`` batch in the generator's ``finally``, which also
    runs after the body raised, and its supervisor restarts the agent on the next batch:
    the failed batch was committed unread (measured: a batch of offsets 0-4 raised, the
    new agent read 5-9, the group committed 10). Exiting before the generator is closed
    commits nothing past it, so a restart reads it again, as a sink's ``FatalError``
    does. A rebalance's cancellation is not an ``Exception`` and passes through.
    """

    def wrap(body: AgentBody) -> AgentBody:
        @functools.wraps(body)
        async def agent(stream: Any) -> None:
            try:
                await body(stream)
            except Exception as err:
                on_crash(body.__name__, err)
                raise

        return agent

    return wrap


class BoundedStopWorker(Worker):
    """Faust's worker whose clean stop is bounded: on SIGTERM/SIGINT it stops consuming
    and checkpoints as Faust does, but past ``grace_s`` the process ends with status
    :data:`~c4base.lifeguard.EXIT_STOP_TIMEOUT` after ``on_overdue`` (Faust's clean stop
    waits for a broker that may never answer). Its log lines pass the repeated-line
    limit; ``own_logging``: the caller configured logging, Faust leaves it alone."""

    def __init__(
        self,
        app: Any,
        *,
        grace_s: float,
        on_overdue: Callable[[], None],
        own_logging: bool,
        **kwargs: Any,
    ) -> None:
        self.c4_grace_s = grace_s
        self.c4_on_overdue = on_overdue
        self.c4_own_logging = own_logging
        super().__init__(app, **kwargs)

    def _setup_logging(self) -> None:
        if not self.c4_own_logging:
            super()._setup_logging()
        install_repeat_filter()

    def install_signal_handlers(self) -> None:
        super().install_signal_handlers()
        # the stop deadline starts when the signal arrives, not when the loop next
        # gets a turn (a long step once kept SIGTERM waiting for a minute)
        lifeguard.arm_on_signal(
            (signal.SIGTERM, signal.SIGINT), self.c4_grace_s, self.c4_on_overdue
        )

    def _schedule_shutdown(self, signum: signal.Signals) -> None:
        # Faust's clean stop waits for the broker; bound it (status 4 past the grace).
        if not self._signal_stop_time:
            log.info("%s: stopping (at most %.0fs)", signum.name, self.c4_grace_s)
            lifeguard.stop_deadline(self.c4_grace_s, self.c4_on_overdue)
        super()._schedule_shutdown(signum)
