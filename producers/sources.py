"""Open anything c4stream can read events from, by looking at it.

``c4stream detect`` and ``c4stream replay`` take paths and do not ask what they are:

* a contract JSON-lines trace (plain or gzip; one event or an array per line);
* an NCCL Inspector dump directory (``<host>-pid<pid>.log`` JSON lines) or one such file;
* PyTorch Flight Recorder dumps (pickle or JSON), one file per rank, or a directory of them;
* a directory mixing these: every regular, non-hidden file in it is sniffed on its own.

Each file is recognised by its first bytes, not its name (``sniff``). Everything comes
out as :class:`SourceBatch` — the events of one input unit (a trace line, an Inspector
line, a Flight Recorder dump), with ``raw`` holding the original line for contract
traces so replay can send it byte for byte. Bad input never stops a read: it goes to
``on_bad`` as a :class:`~producers.traces.BadLine` (``file:line: reason``; line 0 means
the whole file) and reading goes on.

:func:`open_sources` merges several files by event time (each file is read in order), so
a directory of per-process Inspector logs comes out as one time-ordered stream.

>>> import tempfile, pathlib
>>> from producers.events import ProgressEvent
>>> from producers.traces import TraceWriter
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> ev = ProgressEvent(v=1, job="j", comm="c", nranks=1, rank=0, host="h", ts_us=5,
...                    started=1, completed=1)
>>> with TraceWriter(d / "t.jsonl") as w:
...     w.write([ev, ev])
...     w.write_raw(b"{oops")
>>> bad = []
>>> [(b.source, len(b.events)) for b in open_source(d / "t.jsonl", on_bad=bad.append)]
... # doctest: +ELLIPSIS
[('...t.jsonl:1', 2)]
>>> print(bad[0].lineno, bad[0].reason)
2 JSON is malformed: object keys must be strings (byte 1)
>>> sniff(d / "t.jsonl")
'trace'
"""

from __future__ import annotations

import gzip
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from producers.events import Event
from producers.formats.flight_recorder import looks_like_flight_recorder, read_flight_recorder
from producers.formats.inspector import inspector_job_from_dir, read_inspector_file
from producers.traces import BadLine, TraceLine, read_trace

__all__ = [
    "BadLine",
    "Kind",
    "OnBad",
    "SourceBatch",
    "SourceError",
    "iter_source_events",
    "list_files",
    "open_source",
    "open_sources",
    "sniff",
]

Kind = Literal["trace", "inspector", "flight_recorder"]
OnBad = Callable[[BadLine], None]
_SNIFF_BYTES = 1 << 16


class SourceError(ValueError):
    """A path cannot be read at all (missing, unreadable, an empty directory).

    Give a file or directory that exists and holds a trace, Inspector logs or Flight
    Recorder dumps.
    """


@dataclass(frozen=True, slots=True)
class SourceBatch:
    """The events of one input unit, where they came from, and (traces only) its bytes."""

    source: str
    """``file:line`` of the unit (line 0: a whole file, e.g. a Flight Recorder dump)."""
    events: list[Event]
    raw: bytes | None = None
    """The original contract JSON line (stripped) for traces; ``None`` for converted input."""

    @property
    def ts_us(self) -> int:
        """Earliest event time of the batch (0 when empty), the order :func:`open_sources` uses."""
        return min((e.ts_us for e in self.events), default=0)


def _head(path: Path) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(_SNIFF_BYTES)
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path, "rb") as gz:
                head = gz.read(_SNIFF_BYTES)
        except (OSError, EOFError):
            return b""
    return head


def sniff(path: str | Path) -> Kind:
    """What a file holds, judged from its first 64 KiB (gzip looked into).

    A first line that is a JSON object with ``header`` and ``metadata`` is Inspector; a
    pickle or a JSON object with Flight Recorder keys is a Flight Recorder dump;
    anything else is read as a contract trace (whose reader reports lines it cannot
    decode, so an unknown file shows up as bad lines rather than silence).
    """
    head = _head(Path(path))
    if looks_like_flight_recorder(head):
        return "flight_recorder"
    first = head.lstrip().split(b"\n", 1)[0].strip()
    if first.startswith(b"{"):
        try:
            obj = msgspec.json.decode(first)
        except (msgspec.DecodeError, RecursionError):
            obj = None
        if isinstance(obj, dict) and "header" in obj and "metadata" in obj:
            return "inspector"
    return "trace"


def list_files(path: str | Path) -> list[Path]:
    """The files a path stands for: itself, or a directory's regular non-hidden files
    (recursively, sorted). Raises :class:`SourceError` when there are none."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not files:
            raise SourceError(f"{p}: empty directory, nothing to read")
        return files
    raise SourceError(f"{p}: no such file or directory")


def _read_file(path: Path, kind: Kind, job: str, on_bad: OnBad | None) -> Iterator[SourceBatch]:
    name = str(path)
    if kind == "trace":
        for item in read_trace(path):
            if isinstance(item, TraceLine):
                yield SourceBatch(f"{name}:{item.lineno}", item.events, item.raw)
            elif on_bad is not None:
                on_bad(item)
    elif kind == "inspector":
        for lineno, ev in read_inspector_file(path, job=job, on_bad=on_bad):
            yield SourceBatch(f"{name}:{lineno}", [ev])
    else:
        events = read_flight_recorder(path, job=job, on_bad=on_bad)
        # One batch per event keeps the merged stream in event time; the dump is one unit.
        for ev in events:
            yield SourceBatch(f"{name}:0", [ev])


def open_source(
    path: str | Path,
    *,
    on_bad: OnBad | None = None,
    job: str | None = None,
) -> Iterator[SourceBatch]:
    """Batches of one path (a file, or a directory merged by event time).

    ``job`` names the training job for formats that do not carry it (Inspector,
    Flight Recorder); by default an Inspector directory named ``nccl-inspector-<jobid>``
    gives its job id, else ``unknown``. Contract traces carry their own job.
    Raises :class:`SourceError` only when the path itself is unusable.
    """
    return open_sources([path], on_bad=on_bad, job=job)


def open_sources(
    paths: Iterable[str | Path],
    *,
    on_bad: OnBad | None = None,
    job: str | None = None,
) -> Iterator[SourceBatch]:
    """Batches of several paths, merged by each batch's earliest event time.

    Every file is checked up front (so a missing path fails before anything is read),
    then read lazily: memory stays bounded by one batch per file.
    """
    streams: list[Iterator[SourceBatch]] = []
    for path in paths:
        p = Path(path)
        the_job = job or inspector_job_from_dir(p if p.is_dir() else p.parent)
        for f in list_files(p):
            try:
                kind = sniff(f)
            except OSError as err:
                raise SourceError(f"{f}: cannot read: {err}") from None
            streams.append(_read_file(f, kind, the_job, on_bad))
    if len(streams) == 1:
        return streams[0]
    return heapq.merge(*streams, key=lambda b: b.ts_us)


def iter_source_events(
    paths: str | Path | Iterable[str | Path],
    on_bad: OnBad | None = None,
    *,
    job: str | None = None,
) -> Iterator[Event]:
    """The events of one or more paths, merged by time; bad input goes to ``on_bad``."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for batch in open_sources(paths, on_bad=on_bad, job=job):
        yield from batch.events
