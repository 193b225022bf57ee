"""One decoder per dataset, each returning a list of records (the contracts' decoders).

Each raises a ``ValueError`` subclass naming the problem (``EventDecodeError``,
``VerdictDecodeError``, ``CommandDecodeError``); the archiver dead-letters the message.

>>> DECODERS["verdicts"](b'{"id": 1}')
Traceback (most recent call last):
...
streams.verdicts.VerdictDecodeError: Expected `str`, got `int` - at `$.id`
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from producers.events import decode_message
from streams.commands import decode_command
from streams.verdicts import decode_verdict

__all__ = ["DECODERS"]

DECODERS: dict[str, Callable[[bytes], list[Any]]] = {
    "events": decode_message,
    "verdicts": lambda data: [decode_verdict(data)],
    "isolations": lambda data: [decode_command(data)],
}
