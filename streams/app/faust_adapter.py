"""The one place that touches Faust beyond its public API.

faust-streaming keeps no public accessor for a partition's committed or read offset;
its consumer holds them in ``_committed_offset`` and ``_read_offset``. Every such use
lives here so that a Faust upgrade that renames them breaks one module, and each
accessor answers None (never raises) when the consumer is not there yet.
"""

from __future__ import annotations

import logging
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
