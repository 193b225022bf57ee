"""JSON-lines traces of contract events: plain or gzip, read and written in constant memory.

A line holds one event or a JSON array of events (the batch an exporter would send as
one Kafka message). A malformed line never stops the read: it is reported as a
:class:`BadLine` with file, line number and reason, and the next line is read.

>>> import tempfile, pathlib
>>> from producers.events import ProgressEvent
>>> ev = ProgressEvent(v=1, job="j", comm="c", nranks=1, rank=0, host="h", ts_us=5,
...                    started=3, completed=3)
>>> path = pathlib.Path(tempfile.mkdtemp()) / "t.jsonl.gz"
>>> with TraceWriter(path) as w:
...     w.write([ev, ev])
...     w.write_raw(b"{not json")
>>> for item in read_trace(path):
...     print(type(item).__name__, item.lineno)
TraceLine 1
BadLine 2
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from producers.events import Event, EventDecodeError, decode_message, encode_message
from producers.summary import SummaryEvent, decode_with_summaries, expand, has_summaries

__all__ = ["BadLine", "TraceLine", "TraceWriter", "iter_events", "read_trace"]


@dataclass(frozen=True, slots=True)
class TraceLine:
    """One good line: its events and the raw bytes (for byte-identical replay)."""

    path: str
    lineno: int
    raw: bytes
    events: list[Event]
    summaries: Sequence[SummaryEvent] = ()
    """A line of windows summarised at the source: its summaries (``events`` are what
    they expand to), the evidence :mod:`streams.core.summary_evidence` folds."""


@dataclass(frozen=True, slots=True)
class BadLine:
    """One line that does not hold contract events, and why."""

    path: str
    lineno: int
    raw: bytes
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.lineno}: {self.reason}"


def _open_binary(path: Path, mode: str) -> IO[bytes]:
    # gzip is detected by name when writing and by magic bytes when reading, so a
    # renamed file still reads.
    if "r" in mode:
        with open(path, "rb") as probe:
            magic = probe.read(2)
        if magic == b"\x1f\x8b":
            return gzip.open(path, "rb")
        return open(path, "rb")
    if path.suffix == ".gz":
        # A buffer in front of gzip: Python's gzip compresses on every write call, and
        # traces are written a line at a time.
        return io.BufferedWriter(gzip.open(path, mode + "b", compresslevel=5), 1 << 20)  # type: ignore[arg-type]
    return open(path, mode + "b")


def read_trace(path: str | Path) -> Iterator[TraceLine | BadLine]:
    """Yield each non-blank line of a trace as a :class:`TraceLine` or :class:`BadLine`.

    Raises ``OSError`` only when the file itself cannot be opened; a gzip stream cut
    short ends the read with a final :class:`BadLine` saying so.
    """
    p = Path(path)
    name = str(p)
    with _open_binary(p, "r") as fh:
        lineno = 0
        try:
            for raw in fh:
                lineno += 1
                line = raw.strip()
                if not line:
                    continue
                try:
                    yield TraceLine(name, lineno, line, decode_message(line))
                except EventDecodeError as err:
                    if not has_summaries(line):
                        yield BadLine(name, lineno, line, str(err))
                        continue
                    try:  # a line of summaries and samples: its events and its summaries
                        items = decode_with_summaries(line)
                        sums = [x for x in items if isinstance(x, SummaryEvent)]
                        yield TraceLine(name, lineno, line, expand(items), sums)
                    except EventDecodeError as err2:
                        yield BadLine(name, lineno, line, str(err2))
        except (EOFError, gzip.BadGzipFile) as err:
            yield BadLine(name, lineno + 1, b"", f"truncated or corrupt gzip stream: {err}")


def iter_events(
    paths: str | Path | list[str | Path],
    on_bad: Callable[[BadLine], None] | None = None,
) -> Iterator[Event]:
    """Yield the events of one or more traces in file order; bad lines go to ``on_bad``."""
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        for item in read_trace(path):
            if isinstance(item, TraceLine):
                yield from item.events
            elif on_bad is not None:
                on_bad(item)


class TraceWriter:
    """Writes events as JSON lines, gzip-compressed when the name ends in ``.gz``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = _open_binary(self.path, "w")
        self.lines = 0
        self.events = 0

    def write(self, events: Event | list[Event]) -> None:
        """Write one line: a single event, or a batch as one JSON array."""
        self._fh.write(encode_message(events))
        self._fh.write(b"\n")
        self.lines += 1
        self.events += len(events) if isinstance(events, list) else 1

    def write_raw(self, line: bytes) -> None:
        """Write a line as given (for tests and for copying lines byte for byte)."""
        self._fh.write(line.rstrip(b"\n") + b"\n")
        self.lines += 1

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
