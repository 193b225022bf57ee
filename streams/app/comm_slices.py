"""The worker's event-time slices: one lane's (partition, job) open slice holds, per
communicator, its rows of each message (spans of a consumer batch's block of columns),
judged when the slice closes — one communicator alone, or a slice's communicators
together (:func:`observe_grouped`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from producers.columnar import ColumnBlock, EventColumns
from streams.app.deadletter import Record
from streams.core import CommDetector
from streams.core.group import cut_many, fold_many
from streams.verdicts import Verdict

__all__ = ["GROUP_MIN", "Group", "Lane", "Part", "Slice", "observe_grouped", "slice_columns"]

log = logging.getLogger(__name__)

Lane = tuple[int, str]
"""(events partition, job): one job's event time within one partition."""


Part = tuple[ColumnBlock, list[tuple[int, int]]]
"""One communicator's rows of one message: spans ``start:end`` of a consumer batch's block."""


class Group:
    """One communicator's events in its lane's open event-time slice, message by message."""

    __slots__ = ("n", "parts", "top")

    def __init__(self) -> None:
        self.parts: list[tuple[Record, Part]] = []
        self.n = 0
        self.top = -1
        """Newest ``ts_us`` of its events."""

    def add(self, rec: Record, part: Part, n: int, top: int) -> None:
        self.parts.append((rec, part))
        self.n += n
        if top > self.top:
            self.top = top


Slice = dict[str, Group]
"""An open event-time slice of one lane, by communicator."""

GROUP_MIN = 2
"""Communicators in one slice from which they are judged together (one alone is cut on
its own, as ``observe`` does)."""


def slice_columns(comm: str, parts: Sequence[Part]) -> EventColumns:
    """One communicator's rows of a slice (message order) as one set of columns."""
    per_block: list[tuple[ColumnBlock, list[tuple[int, int]]]] = []
    for block, spans in parts:
        if per_block and per_block[-1][0] is block:
            per_block[-1][1].extend(spans)
        else:
            per_block.append((block, list(spans)))
    cols = [block.columns(comm, spans) for block, spans in per_block]
    return cols[0] if len(cols) == 1 else EventColumns.concat(cols)


def observe_grouped(
    items: Sequence[tuple[str, CommDetector, Sequence[tuple[Record, Part]]]],
) -> dict[str, list[Verdict] | Exception]:
    """A slice's communicators judged together (:func:`streams.core.group.observe_many`'s
    steps: one cut and one fold for all, then each communicator's own update, in order):
    per communicator its verdicts, or the error its detector raised (the others are
    judged all the same). An error in the shared cut or fold names no communicator: then
    nothing was judged and the result is empty, so the caller judges them one by one and
    a failure is pinned to its messages."""
    if len(items) < GROUP_MIN:
        return {}
    try:
        cols = [slice_columns(comm, [p for _, p in parts]) for comm, _, parts in items]
        cuts = cut_many(cols)
        fold_many([det for _, det, _ in items], cuts)
    except Exception:
        log.warning("grouped cut of %d communicators failed; judging them one by one",
                    len(items), exc_info=True)  # fmt: skip
        return {}
    out: dict[str, list[Verdict] | Exception] = {}
    for (comm, det, _), cut in zip(items, cuts, strict=True):
        try:
            out[comm] = det.observe_cut(cut)
        except Exception as err:  # this communicator's detector: its messages are retried
            out[comm] = err
    return out
