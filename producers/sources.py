"""Open anything c4stream can read events from, by looking at it.

``c4stream detect`` and ``c4stream replay`` take paths and do not ask what they are:

* a contract JSON-lines trace (plain or gzip; one event or an array per line);
* an NCCL Inspector dump directory (``<host>-pid<pid>.log`` JSON lines) or one such file;
* PyTorch Flight Recorder dumps (pickle or JSON), one file per rank, or a directory of them:
  the dumps of one directory (or of directories without a rank in common, e.g. one per
  host) are one snapshot (every rank's dump taken at one moment), read together so that
  group membership can come from the dumps themselves;
* the Parquet archive of ``c4.events`` (``c4stream archive``): its ``events`` directory,
  an hour of it, or files — cut back into the archived messages
  (:mod:`producers.formats.parquet_archive`);
* an Arrow IPC file or stream file of events (the wire's columns,
  :mod:`producers.formats.arrow_ipc`), read exactly as a Parquet file of events;
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

from producers.events import Event
from producers.formats.flight_recorder import (
    FlightRecorderError,
    SnapshotFacts,
    looks_like_flight_recorder,
    rank_from_filename,
    read_snapshot_with_facts,
)
from producers.formats.inspector import inspector_job_from_dir, read_inspector_file
from producers.formats.magic import looks_like_arrow_ipc, looks_like_parquet
from producers.traces import BadLine, TraceLine, read_trace

if TYPE_CHECKING:  # the columnar readers (pyarrow) load when a columnar file is read
    from producers.columnar import EventColumns
    from producers.columnar.blocks import ArchiveBlock
    from producers.formats.parquet_archive import SeenMessages

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

Kind = Literal["trace", "inspector", "flight_recorder", "parquet", "arrow_ipc", "other"]
_COLUMNAR = ("parquet", "arrow_ipc")
"""Kinds read as tables of events (:func:`read_parquet_columns` reads both)."""
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
    events: Sequence[Event]
    """A list; for the Parquet archive a sequence that builds the objects when read."""
    raw: bytes | None = None
    """The original contract JSON line (stripped) for traces; ``None`` for converted input."""
    snapshot: str | None = None
    """For Flight Recorder dumps: the snapshot (directory of per-rank dumps taken at one
    moment) they belong to; a consumer can judge a snapshot as a whole."""
    columns: list[EventColumns] | None = None
    """The same events as columns, one part per communicator (the Parquet archive), for
    consumers that take columns (``c4stream detect``)."""
    facts: SnapshotFacts | None = None
    """For Flight Recorder snapshots, on one (event-less) batch of each: what its dumps
    say together (members without a dump, sends/receives waited in, the dump time)."""
    block: ArchiveBlock | None = None
    """Many archived messages at once, as one set of columns (``open_sources(...,
    blocks=True)``); ``columns`` is then None."""
    summaries: Sequence[Any] = ()
    """A message of windows summarised at the source: its summaries
    (:class:`producers.summary.SummaryEvent`; ``events`` are what they expand to)."""

    @property
    def ts_us(self) -> int:
        """Earliest event time of the batch (0 when empty), the order :func:`open_sources` uses."""
        if self.block is not None:
            return int(self.block.ts_us.min())
        if self.columns is not None:
            return min((int(c.ts_us.min()) for c in self.columns), default=0)
        return min((e.ts_us for e in self.events), default=0)


def _head(path: Path) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(_SNIFF_BYTES)
    if looks_like_parquet(head) or looks_like_arrow_ipc(head):
        return head
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path, "rb") as gz:
                head = gz.read(_SNIFF_BYTES)
        except (OSError, EOFError):
            return b""
    return head


def sniff(path: str | Path) -> Kind:
    """What a file holds, judged from its first 64 KiB (gzip looked into).

    ``PAR1`` is a Parquet file (the events archive); ``ARROW1`` or ``ff ff ff ff`` an
    Arrow IPC file or stream of events; a first line that is a JSON object
    with ``header`` and ``metadata`` is Inspector; a pickle or a JSON object with Flight
    Recorder keys is a Flight Recorder dump; a file whose first byte is neither ``{``
    nor ``[`` (a log beside the dumps, a core file) is ``other``: skipped with one line
    that says so; anything else is read as a contract trace (whose reader reports lines
    it cannot decode, so a damaged trace shows up as bad lines rather than silence).
    """
    head = _head(Path(path))
    if looks_like_parquet(head):
        return "parquet"
    if looks_like_arrow_ipc(head):
        return "arrow_ipc"
    if looks_like_flight_recorder(head):
        return "flight_recorder"
    first = head.lstrip().split(b"\n", 1)[0].strip()
    if first and (
        first[:1] not in (b"{", b"[")
        or (first[:1] == b"[" and first[1:].lstrip()[:1] not in (b"{", b"]", b""))
    ):
        return "other"  # not JSON: e.g. "[rank0]: Watchdog caught …" beside the dumps
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


def _read_file(
    path: Path,
    kind: Kind,
    job: str,
    on_bad: OnBad | None,
    seen: SeenMessages | None = None,
    blocks: bool = False,
    alone: bool = False,
) -> Iterator[SourceBatch]:
    """``alone``: the only file of its stream (blocks need no cut by second)."""
    name = str(path)
    if kind in _COLUMNAR:
        from producers.columnar import LazyEvents
        from producers.formats.parquet_archive import read_parquet_blocks, read_parquet_columns
    if kind in _COLUMNAR and blocks:
        got = read_parquet_blocks(path, job=job, on_bad=on_bad, seen=seen, by_second=not alone)
        for row, block in got:
            rows = LazyEvents(block.table, np.arange(block.n))
            yield SourceBatch(f"{name}:{row}", rows, block=block)
    elif kind == "trace" and blocks:
        yield from _trace_blocks(path, on_bad, alone)
    elif kind == "trace":
        for item in read_trace(path):
            if isinstance(item, TraceLine):
                yield SourceBatch(f"{name}:{item.lineno}", item.events, item.raw,
                                  summaries=item.summaries)  # fmt: skip
            elif on_bad is not None:
                on_bad(item)
    elif kind in _COLUMNAR:
        # one batch per archived message, in event time (tables → objects per message)
        for row, batch, cols in read_parquet_columns(path, job=job, on_bad=on_bad, seen=seen):
            rows = LazyEvents(batch, np.arange(batch.num_rows))
            yield SourceBatch(f"{name}:{row}", rows, columns=cols)
    elif kind == "inspector":
        for lineno, ev in read_inspector_file(path, job=job, on_bad=on_bad):
            yield SourceBatch(f"{name}:{lineno}", [ev])
    else:
        yield from _read_snapshot([path], job, on_bad)


def _trace_blocks(path: Path, on_bad: OnBad | None, alone: bool) -> Iterator[SourceBatch]:
    """A contract trace as blocks of columns: each line decoded and checked as ever (a
    bad line goes to ``on_bad``), then many lines' events turned into columns at once.
    A line of summaries comes out alone, as its events with its summaries (the lines
    before it first), so its evidence stays beside its own events."""
    from producers.columnar import LazyEvents
    from producers.columnar.blocks import json_blocks

    pending: list[tuple[int, Sequence[Event]]] = []

    def blocks() -> Iterator[SourceBatch]:
        for lineno, got in json_blocks(pending, by_second=not alone):
            if isinstance(got, Sequence):  # values no column holds: as the events themselves
                yield SourceBatch(f"{path}:{lineno}", got)
            else:
                yield SourceBatch(
                    f"{path}:{lineno}", LazyEvents(got.table, np.arange(got.n)), block=got
                )
        pending.clear()

    rows = 0
    for item in read_trace(path):
        if not isinstance(item, TraceLine):
            if on_bad is not None:
                on_bad(item)
            continue
        if item.summaries:
            yield from blocks()
            rows = 0
            yield SourceBatch(f"{path}:{item.lineno}", item.events, item.raw,
                              summaries=item.summaries)  # fmt: skip
            continue
        pending.append((item.lineno, item.events))
        rows += len(item.events)
        if rows >= _BLOCK_ROWS:  # json_blocks cuts at its max_rows anyway: never more held
            yield from blocks()
            rows = 0
    yield from blocks()


_BLOCK_ROWS = 65_536
"""Rows of trace lines held before they are turned into columns (json_blocks' max)."""


def _snapshots(files: list[Path]) -> list[list[Path]]:
    """Group one input path's dump files into snapshots (every rank at one moment).

    A snapshot holds at most one dump per rank. The dumps of one directory belong
    together (pickle and JSON dumps apart: each set is one snapshot); directories whose
    ranks do not overlap are joined (per-host directories of one moment), directories
    with a rank in common are not (``during/`` and ``after_timeout/``, ``pickle/`` and
    ``json/``), in sorted order.

    >>> p = [Path(x) for x in ("a/h1/r_0", "a/h1/r_1", "a/h2/r_2", "b/r_0", "b/r_1")]
    >>> [[str(f) for f in s] for s in _snapshots(p)]
    [['a/h1/r_0', 'a/h1/r_1', 'a/h2/r_2'], ['b/r_0', 'b/r_1']]
    """
    by_dir: dict[tuple[Path, bool], list[Path]] = {}
    for f in sorted(files):
        # PyTorch's pickle and JSON dumps of one moment side by side: two snapshots
        by_dir.setdefault((f.parent, _is_json(f)), []).append(f)
    out: list[tuple[set[int | str], list[Path]]] = []
    for group in by_dir.values():
        ranks: set[int | str] = set()
        for f in group:
            try:
                ranks.add(rank_from_filename(f))
            except FlightRecorderError:
                ranks.add(str(f))  # no rank in the name: its own key (reported later)
        for seen, snap in out:
            if not seen & ranks:
                seen |= ranks
                snap += group
                break
        else:
            out.append((ranks, list(group)))
    return [snap for _, snap in out]


def _is_json(path: Path) -> bool:
    try:
        return _head(path).lstrip()[:1] == b"{"
    except OSError:
        return False


def _read_snapshot(
    paths: list[Path], job: str, on_bad: OnBad | None, dump_time_us: int | None = None
) -> Iterator[SourceBatch]:
    """One batch per event keeps the merged stream in event time; each dump is one unit.
    The first batch (no events) carries the snapshot's facts."""
    snap = str(paths[0].parent)
    read, facts = read_snapshot_with_facts(paths, job=job, on_bad=on_bad,
                                           dump_time_us=dump_time_us)  # fmt: skip
    yield SourceBatch(f"{snap}:0", [], snapshot=snap, facts=facts)
    for path, events in read:
        for ev in events:
            yield SourceBatch(f"{path}:0", [ev], snapshot=snap)


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
    blocks: bool = False,
    dump_time_us: int | None = None,
) -> Iterator[SourceBatch]:
    """Batches of several paths, merged by each batch's earliest event time.

    Every file is checked up front (so a missing path fails before anything is read),
    then read lazily: memory stays bounded by one batch per file (a block: at most
    64k rows). ``blocks``: the Parquet archive (or one JSON-lines trace, decoded into
    columns) comes as :class:`ArchiveBlock` (many messages per batch) when it is the
    only stream (one directory of files, merged by
    the second of their messages; with other streams, merged by exact event time,
    messages come one at a time as without ``blocks``). ``dump_time_us``: when Flight
    Recorder dumps were taken, for dumps whose mtimes are lost (``--dump-time``).
    """
    streams: list[Iterator[SourceBatch]] = []
    found: list[tuple[Path, Path, Kind, str]] = []  # (path given, file, kind, job)
    for path in paths:
        p = Path(path)
        the_job = job or inspector_job_from_dir(p if p.is_dir() else p.parent)
        for f in list_files(p):
            try:
                found.append((p, f, sniff(f), the_job))
            except OSError as err:
                raise SourceError(f"{f}: cannot read: {err}") from None
    # blocks only when the archive is one stream: nothing to interleave message by message
    blocks = blocks and (
        (
            len({f.parent for _, f, _, _ in found}) == 1
            and all(kind in _COLUMNAR for _, _, kind, _ in found)
        )
        or [kind for _, _, kind, _ in found] == ["trace"]  # one JSON-lines trace
    )
    archive: dict[Path, list[Iterator[SourceBatch]]] = {}  # Parquet/IPC files by directory
    seen: dict[Path, SeenMessages] = {}  # per directory: archived messages read once
    dumps: dict[tuple[Path, str], list[Path]] = {}  # Flight Recorder dumps by directory
    alone = len(found) == 1
    for p, f, kind, the_job in found:
        if kind == "other":
            if on_bad is not None:
                on_bad(BadLine(str(f), 0, b"", "not a Flight Recorder dump, event trace, "
                               "Inspector log or events archive: skipped"))  # fmt: skip
            continue
        if kind == "flight_recorder":
            dumps.setdefault((p, the_job), []).append(f)
        elif kind in _COLUMNAR:
            from producers.formats.parquet_archive import SeenMessages

            dedupe = seen.setdefault(f.parent, SeenMessages())
            archive.setdefault(f.parent, []).append(
                _read_file(f, kind, the_job, on_bad, dedupe, blocks, alone)
            )
        else:
            streams.append(_read_file(f, kind, the_job, on_bad, None, blocks, alone))
    for (_, the_job), files in dumps.items():
        for snapshot in _snapshots(files):
            streams.append(_read_snapshot(snapshot, the_job, on_bad, dump_time_us))
    for parts in archive.values():
        # by the second their messages cover: one archiver's files in turn (as it wrote
        # them), several archivers' files interleaved; a stable merge keeps file order
        streams.append(
            parts[0] if len(parts) == 1 else heapq.merge(*parts, key=lambda b: b.ts_us // 1_000_000)
        )
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
