"""Bounds every decoder checks before it trusts a message: size, nesting, host names.

Every JSON message read from Kafka or a file passes :func:`check_bounds` before it is
decoded, so a hostile message costs a bounded amount of work and memory and never
reaches the decoder's recursion: 3,000 nested arrays in 18 KB used to raise an
uncaught ``RecursionError`` inside msgspec and crash the stage that read it.

>>> check_bounds(b'[{"a": [1, 2]}]')
>>> check_bounds(b"[" * 100 + b"]" * 100)
Traceback (most recent call last):
...
producers.guard.BoundsError: JSON nested deeper than 32 levels
>>> check_bounds(b"x" * 10, max_bytes=4)
Traceback (most recent call last):
...
producers.guard.BoundsError: message of 10 bytes is over the limit of 4 bytes
>>> [bool(HOST_RE.fullmatch(h)) for h in ("node-001", "gpu7.rack2.example", "--all", "*")]
[True, True, False, False]
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
import numpy as np

__all__ = [
    "HOST_PATTERN",
    "HOST_RE",
    "MAX_DEPTH",
    "MAX_FUTURE_SKEW_US",
    "MAX_MESSAGE_BYTES",
    "MAX_NRANKS",
    "MAX_PAST_SKEW_US",
    "BoundsError",
    "Host",
    "check_bounds",
    "host_problem",
]

#: Larger than the broker's default ``message.max.bytes`` (1 MiB) leaves no room for
#: a batch of a 16k-rank communicator; nothing legitimate is near 8 MiB.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
#: The contracts nest at most 5 levels (array > event > conns > conn; a command's
#: evidence a few more); 32 leaves room and stays far below Python's recursion limit.
MAX_DEPTH = 32

# Edge limits on events, shared by the exporter (before publishing) and the worker
# (before feeding a detector): one definition, so both edges refuse the same records.
#: Largest communicator accepted (the core sizes its arrays by ``nranks``: one event
#: with ``nranks = 2^31`` once grew the worker to 21 GB).
MAX_NRANKS = 65_536
#: How far ahead of the wall clock (and of its job's clock) an event's ``ts_us`` may be.
MAX_FUTURE_SKEW_US = 600_000_000
#: How far behind its job's clock an event may be (the worker; the exporter's own
#: past bound is off by default: it may catch up on an old dump).
MAX_PAST_SKEW_US = 3_600_000_000

#: RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens,
#: 1-63 characters each, 253 in all. Nothing that a shell, kubectl or a glob would
#: read as an option (``--all``), a pattern (``*``) or a path (``../../etc``).
HOST_PATTERN = (
    r"^(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z"
)
HOST_RE = re.compile(HOST_PATTERN)
Host = Annotated[str, msgspec.Meta(pattern=HOST_PATTERN)]

_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[ord("(")] = 1
_OPEN[ord(")")] = -1
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_ONE_KIND = bytes.maketrans(b"[{]}", b"(())")
"""Both kinds of bracket as one (nesting counts either)."""


class BoundsError(ValueError):
    """A message is too large or too deeply nested to be decoded (dead-letter it)."""


def check_bounds(
    data: bytes | bytearray | memoryview | str,
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_depth: int = MAX_DEPTH,
) -> None:
    """Raise :class:`BoundsError` if ``data`` is over ``max_bytes`` or nests deeper
    than ``max_depth``.

    Brackets inside strings count too (an over-estimate, cheap and safe: no contract
    string holds dozens of unbalanced brackets, and a host name cannot hold any).
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise BoundsError(f"message of {len(raw)} bytes is over the limit of {max_bytes} bytes")
    # only the brackets matter: every other byte dropped in one C pass; fewer brackets
    # than the limit cannot nest deeper than it
    brackets = raw.translate(_ONE_KIND, _NOT_BRACKETS)
    if len(brackets) <= max_depth:
        return
    # the usual message, balanced and shallow: its innermost pairs peeled a level a
    # round, in C (a balanced string is empty after as many rounds as it is deep); a
    # numpy pass costs more than decoding a small message (at most max_depth C passes)
    rest = brackets
    for _ in range(max_depth):
        rest = rest.replace(b"()", b"")
        if not rest:
            return
    depth = np.cumsum(_OPEN[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int32)
    if depth.size and int(depth.max()) > max_depth:
        raise BoundsError(f"JSON nested deeper than {max_depth} levels")


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a valid RFC 1123 host name, or None.

    >>> host_problem("node-1"), host_problem("a b")
    (None, "host name 'a b' is not an RFC 1123 name")
    """
    if HOST_RE.fullmatch(host):
        return None
    return f"host name {host[:80]!r} is not an RFC 1123 name"
