"""One decoder per dataset, each returning a list of records (the contracts' decoders).

Each raises a ``ValueError`` subclass naming the problem (``EventDecodeError``,
``VerdictDecodeError``, ``CommandDecodeError``); the archiver dead-letters the message.

>>> DECODERS["verdicts"](b'{"id": 1}', None)
Traceback (most recent call last):
...
streams.verdicts.VerdictDecodeError: Expected `str`, got `int` - at `$.id`
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from producers.summary import decode_expanded
from streams.commands import decode_command
from streams.verdicts import decode_verdict

__all__ = ["DECODERS"]

#: dataset -> decoder of (message value, its ``content-type`` header); events come as a
#: JSON array or an Arrow IPC batch (:mod:`producers.columnar`); a message with summaries
#: is archived as the events it expands to (:mod:`producers.summary`).
DECODERS: dict[str, Callable[[bytes, bytes | None], list[Any]]] = {
    "events": decode_expanded,
    "verdicts": lambda data, _ct: [decode_verdict(data)],
    "isolations": lambda data, _ct: [decode_command(data)],
}
