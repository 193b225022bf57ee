"""The one place that touches Faust beyond its public API.

faust-streaming keeps no public accessor for a partition's committed or read offset;
its consumer holds them in ``_committed_offset`` and ``_read_offset``. Every such use
lives here so that a Faust upgrade that renames them breaks one module, and each
accessor answers None (never raises) when the consumer is not there yet.

It also holds the worker's guards against a Faust + aiokafka race that lost messages
after a restart (:class:`GuardedTransport`, :meth:`ConsumerView.rewind_uncommitted`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

__all__ = ["ConsumerView", "GuardedTransport", "install_guarded_transport"]

log = logging.getLogger(__name__)


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
