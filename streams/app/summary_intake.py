"""The worker's intake of ``c4.events`` messages that hold summaries (windows at the
source, :mod:`producers.summary`).

Such a message is decoded with the summary-aware decoder and expanded into the ordinary
events it stands for (samples and progress heartbeats), which then go through the same
admission, corroboration and detection as any JSON message: every edge rule and every
detector rule stays written once. A message that breaks the
summary's contract is refused whole, with the decoder's reason, as any other.

The summaries' kernel-time statistics and per-peer totals are the straggler and
slow-connection rules' evidence (:mod:`streams.core.summary_evidence`, the fold
``c4stream detect`` calls too): :class:`Expanded` keeps them beside the events,
and the router hands them on only once the message is accepted, and only those of a
(communicator, rank, host) the message's own accepted events speak for — a refused or
forged message never makes a rank look late.
"""

from __future__ import annotations

from producers.events import Event, EventDecodeError
from producers.summary import ExpandStats, SummaryEvent, decode_with_summaries, expand
from streams.app.deadletter import Record
from streams.core.summary_evidence import vouched

__all__ = ["Expanded", "summary_events"]


class Expanded(list):  # type: ignore[type-arg]
    """A message's events (a list, as any decoded message) and its summaries."""

    summaries: list[SummaryEvent]

    def vouched(self) -> list[SummaryEvent]:
        """The summaries an event of this message vouches for
        (:func:`streams.core.summary_evidence.vouched`)."""
        return vouched(self.summaries, self)  # type: ignore[return-value]


def summary_events(rec: Record, stats: ExpandStats) -> list[Event] | EventDecodeError:
    """A record's events after expansion (an :class:`Expanded`), or why it cannot be
    read (never raises)."""
    try:
        items = decode_with_summaries(rec.value, rec.content_type)
    except EventDecodeError as err:
        return err
    out = Expanded(expand(items, stats))
    out.summaries = [x for x in items if isinstance(x, SummaryEvent)]
    return out
