"""The one place that touches Faust beyond its public API.

faust-streaming keeps no public accessor for a partition's committed or read offset;
its consumer holds them in ``_committed_offset`` and ``_read_offset``. Every such use
lives here so that a Faust upgrade that renames them breaks one module, and each
accessor answers None (never raises) when the consumer is not there yet.

It also holds the worker's guard against a Faust + aiokafka race that lost messages
after a restart (:meth:`ConsumerView.rewind_uncommitted`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from faust.types import TP

__all__ = ["ConsumerView"]

log = logging.getLogger(__name__)


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

        Why: during table recovery Faust hands its *live* set of active partitions to
        the consumer thread; when recovery ends it empties that set (changelogs paused,
        streams not yet resumed). A fetch already queued then asks aiokafka for the
        records of an empty set, which aiokafka reads as "every partition": it returns
        them and moves its positions past them, and Faust drops them as not active.
        Faust then seeks back to the committed offsets, but aiokafka's
        ``seek_to_committed`` seeks only for offsets > 0, so a partition without a
        commit stays past records nobody processed. Seen in the chaos suite: a worker
        SIGKILLed before its first offset commit, restarted, read none of the 900
        messages of ``c4.events`` again. Offset 0 is the earliest (the app's
        ``auto_offset_reset``; a trimmed log resets to its start).

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
