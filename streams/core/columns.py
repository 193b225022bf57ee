"""What the core needs from a batch given as columns (the columnar ingest path).

Two shapes: :class:`EventColumnsLike` is one communicator's rows (one message, or the
parts of one time slice joined); :class:`ColumnBlockLike` is many consecutive messages
of many communicators in one set of arrays (a stretch of the Parquet archive), which
:meth:`streams.core.pipeline.DetectionPipeline.feed_block` routes without an object per
message: the per-message work left is a few integer comparisons.

:meth:`streams.core.comm.CommDetector.observe_columns` takes any object with this shape;
:class:`producers.columnar.EventColumns` (decoded from Arrow IPC messages or read from
the Parquet archive) is the one the project uses. The core itself stays numpy-only: it
reads numpy arrays and asks for event objects only for the few rows a detector reads
whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from producers.events import Event

__all__ = ["ColumnBlockLike", "EventColumnsLike"]


class EventColumnsLike(Protocol):
    """One communicator's events, rows in arrival order, as columns."""

    @property
    def comm(self) -> str:
        """The communicator of every row."""

    @property
    def n(self) -> int:
        """Number of rows (events)."""

    @property
    def job(self) -> str:
        """The first row's job."""

    @property
    def comm_name(self) -> str | None:
        """The first row's communicator name (None when absent)."""

    @property
    def is_op(self) -> np.ndarray:
        """Per row: an ``op`` event (else ``progress``)."""

    def int(self, name: str, fill: int = -1) -> np.ndarray:
        """An integer field of every row as ``int64`` (absent: ``fill``)."""

    def float(self, name: str, fill: float = 0.0) -> np.ndarray:
        """A number field of every row as ``float64`` (absent: ``fill``)."""

    def conn_counts(self) -> np.ndarray:
        """Per row: how many connections it carries (0 when absent)."""

    def conn_arrays(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The connections of rows ``idx`` (in order), flat: peer, send (else recv),
        bytes, time (0 when absent)."""

    def rows(self, idx: np.ndarray) -> Sequence[Event]:
        """The rows ``idx`` as event objects (built when first read)."""

    def to_events(self) -> list[Event]:
        """Every row as an event object (a batch mixing columns and objects)."""

    def concat(self, parts: Sequence[EventColumnsLike]) -> EventColumnsLike:
        """Several parts of one communicator (this one among them) as one, in order."""


class ColumnBlockLike(Protocol):
    """Consecutive batches ("parts": one communicator's rows of one message each) of
    one or more communicators and jobs, in arrival order, as one set of columns.

    The per-part facts are Python lists (the pipeline walks them part by part, as it
    walks messages); the rows stay in arrays until :meth:`select` cuts them per
    communicator."""

    @property
    def part_comm(self) -> list[str]:
        """Per part: its communicator."""

    @property
    def part_job(self) -> list[str]:
        """Per part: its job."""

    @property
    def part_ts_lo(self) -> list[int]:
        """Per part: its earliest ``ts_us``."""

    @property
    def part_ts_hi(self) -> list[int]:
        """Per part: its latest ``ts_us``."""

    @property
    def part_n(self) -> list[int]:
        """Per part: its number of rows (events)."""

    def select(self, parts: np.ndarray) -> list[EventColumnsLike]:
        """The rows of ``parts`` (ascending part numbers), one columns object per
        communicator in order of first appearance, each with its parts' rows in order:
        what :meth:`EventColumnsLike.concat` of those parts one by one would give."""
