"""The worker's intake of ``c4.events`` messages that hold summaries (windows at the
source, :mod:`producers.summary`).

Such a message is decoded with the summary-aware decoder and expanded into the ordinary
events it stands for (samples; the window's per-peer totals on its carrier sample), which
then go through the same admission, corroboration and detection as any JSON message:
every edge rule and every detector rule stays written once. A message that breaks the
summary's contract is refused whole, with the decoder's reason, as any other.
"""

from __future__ import annotations

from producers.events import Event, EventDecodeError
from producers.summary import ExpandStats, decode_with_summaries, expand
from streams.app.deadletter import Record

__all__ = ["summary_events"]


def summary_events(rec: Record, stats: ExpandStats) -> list[Event] | EventDecodeError:
    """A record's events after expansion, or why it cannot be read (never raises)."""
    try:
        return expand(decode_with_summaries(rec.value, rec.content_type), stats)
    except EventDecodeError as err:
        return err
