"""The Parquet archive of ``c4.events`` (what ``c4stream archive`` writes) as an input.

A user replays an archived day through ``c4stream detect`` with other thresholds, or
back into Kafka with ``c4stream replay``: point either at the archive's ``events``
directory (``events/job=<job>/hour=<hour>/part-….parquet``), an hour of it, or files.

Each file is read whole (the archiver rolls files at ``--roll-bytes``, 128 MiB by
default), checked against the contract (:func:`producers.columnar.validate_table`:
the same rules as a Kafka message; a file that breaks them is reported as
``file:0: reason`` and skipped) and cut back into the messages it was archived from:

* rows carry their Kafka origin (``kafka_topic``, ``kafka_partition``, ``kafka_offset``,
  ``kafka_index``): a message is the rows of one (topic, partition, offset), in
  ``kafka_index`` order; a message archived twice (an archiver crash writes the rows
  it had not committed again, into a later file of the same ``job=/hour=`` directory)
  is read once: the files of one directory share a :class:`SeenMessages` (8 bytes per
  message, not per event);
* messages come out in the order they were archived (the archiver's consumption order,
  which is what a worker saw); :func:`producers.sources.open_sources` merges the files
  of one directory by the second of their messages' earliest ``ts_us`` (files of one
  archiver follow each other; files of several archivers interleave), and
  directories (hours, jobs) by ``ts_us`` as every input;
* a Parquet file of events without those columns is cut into one message per
  communicator per second of ``ts_us``, as replay groups converted input.

An Arrow IPC file or stream file of events (:mod:`producers.formats.arrow_ipc`) is
read by the same functions: only the step that reads the file's columns differs.

The ``job`` of the rows is the hive directory ``job=<job>`` above the file (URI-decoded,
as the archiver wrote it); without one, the ``job`` given by the caller.

>>> looks_like_parquet(b"PAR1\\x15\\x04"), looks_like_parquet(b'{"kind":"op"}')
(True, False)
>>> job_from_path("/a/events/job=train%2F7/hour=2026-11-29T20/part-1.parquet")
'train/7'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from producers.columnar import (
    _CONNS,
    _IS_OP,
    EVENT_SCHEMA,
    EventColumns,
    LazyEvents,
    core_arrays,
    slice_arrays,
    split_by_comm,
    table_events,
    validate_table,
)
from producers.events import Event, EventDecodeError
from producers.formats.arrow_ipc import looks_like_arrow_ipc, read_ipc_table
from producers.formats.magic import looks_like_parquet
from producers.traces import BadLine

__all__ = [
    "ArchiveBlock",
    "BlockColumns",
    "SeenMessages",
    "job_from_path",
    "looks_like_parquet",
    "read_parquet_blocks",
    "read_parquet_columns",
    "read_parquet_events",
    "read_parquet_messages",
]

_ORIGIN = ("kafka_topic", "kafka_partition", "kafka_offset", "kafka_index")
_GROUP_US = 1_000_000
_WANTED = (*EVENT_SCHEMA.names, *_ORIGIN)


def job_from_path(path: str | Path) -> str | None:
    """The job of a hive-partitioned archive file: the nearest ``job=<job>`` directory."""
    for part in reversed(Path(path).parent.parts):
        if part.startswith("job="):
            return unquote(part[4:]) or None
    return None


class SeenMessages:
    """Kafka messages already read from the files of one archive directory."""

    def __init__(self) -> None:
        self._keys: dict[str, list[np.ndarray]] = {}

    def drop_seen(self, topic: str, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` (partition << 40 | offset, one per message) not seen before;
        remembers them."""
        old = self._keys.setdefault(topic, [])
        fresh = np.ones(len(keys), bool)
        for arr in old:
            fresh &= ~np.isin(keys, arr, assume_unique=True)
        old.append(np.unique(keys[fresh]))
        return fresh


def _message_order(table: pa.Table, seen: SeenMessages | None) -> tuple[np.ndarray, np.ndarray]:
    """Row order (deduplicated) and the start of each message in it."""
    ts = table.column("ts_us").to_numpy()
    n = len(ts)
    if all(c in table.column_names for c in _ORIGIN) and not any(
        table.column(c).null_count for c in _ORIGIN
    ):
        topic = pc.dictionary_encode(table.column("kafka_topic")).combine_chunks()
        keys = [np.asarray(topic.indices.to_numpy(), np.int64)] + [
            table.column(c).to_numpy().astype(np.int64) for c in _ORIGIN[1:]
        ]
        o = np.lexsort(keys[::-1])  # by topic, partition, offset, index
        k = np.stack([a[o] for a in keys])
        keep = np.ones(n, bool)
        keep[1:] = (k[:, 1:] != k[:, :-1]).any(axis=0)  # a duplicate repeats the whole key
        o = o[keep]
        msg = np.stack([a[o] for a in keys[:3]])
        if seen is not None and len(o):
            topics = topic.dictionary.to_pylist()
            fresh = np.ones(len(o), bool)
            new_msg = np.ones(len(o), bool)
            new_msg[1:] = (msg[:, 1:] != msg[:, :-1]).any(axis=0)
            starts = np.flatnonzero(new_msg)
            msg_key = (msg[1, starts] << 40) | msg[2, starts]
            for t, name in enumerate(topics):
                sel = msg[0, starts] == t
                keep_msg = np.ones(len(starts), bool)
                keep_msg[sel] = seen.drop_seen(name, msg_key[sel])
                fresh &= np.repeat(keep_msg, np.diff(np.append(starts, len(o))))
            o, msg = o[fresh], msg[:, fresh]
    else:  # plain events: one message per communicator per second
        comm = pc.dictionary_encode(table.column("comm")).combine_chunks().indices
        c = np.asarray(comm.to_numpy(), np.int64)
        w = ts // _GROUP_US
        o = np.lexsort((np.arange(n), c, w))
        msg = np.stack([w[o], c[o]])
    if len(o) == 0:
        return o, np.empty(0, np.int64)
    new = np.ones(len(o), bool)
    new[1:] = (msg[:, 1:] != msg[:, :-1]).any(axis=0)
    starts = np.flatnonzero(new)
    bounds = np.append(starts, len(o))
    # messages in the order they were archived (the archiver's consumption order: what
    # the worker saw), i.e. by their first row in the file
    order = np.argsort(np.minimum.reduceat(o, starts), kind="stable")
    sizes = np.diff(bounds)[order]
    new_starts = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=new_starts[1:])
    # each message's rows moved as a run: row j of the result is o[its run's old start
    # + (j - its run's new start)]
    rows = o[np.repeat(starts[order] - new_starts, sizes) + np.arange(len(o))]
    return rows, new_starts


def _read_parquet(path: Path) -> pa.Table:
    """The contract and Kafka origin columns of a Parquet file."""
    pf = pq.ParquetFile(path)
    present = set(pf.schema_arrow.names)
    wanted = [f for f in _WANTED if f in present]
    # one thread: detect is CPU-bound in one process, and threads cost more CPU in all
    return pf.read(columns=wanted, use_threads=False)


def _read_ordered(
    path: Path, job: str, on_bad: Callable[[BadLine], None] | None, seen: SeenMessages | None
) -> tuple[pa.RecordBatch, np.ndarray, np.ndarray] | None:
    """The file's validated rows in message order, each message's first row number in
    the file, and where each message starts; ``None`` when the file is bad or empty.
    The file is Parquet or Arrow IPC (file or stream), told by its first bytes."""
    name = str(path)

    def bad(reason: str) -> None:
        if on_bad is not None:
            on_bad(BadLine(name, 0, b"", reason))

    what = "events"
    try:
        with open(path, "rb") as fh:
            ipc = looks_like_arrow_ipc(fh.read(8))
        what = "Arrow IPC" if ipc else "Parquet"
        table = read_ipc_table(path, _WANTED) if ipc else _read_parquet(path)
    except (pa.ArrowException, OSError, ValueError) as err:
        bad(f"unreadable {what} file: {err}")
        return None
    present = set(table.column_names)
    if "kind" not in present or "comm" not in present:
        bad(f"{what} file is not an events archive (no `kind`/`comm` columns)")
        return None
    if "job" not in present:
        the_job = job_from_path(path) or job
        table = table.append_column(
            "job", pa.repeat(pa.scalar(the_job, pa.string()), table.num_rows)
        )
    try:
        checked = validate_table(table)
    except EventDecodeError as err:
        bad(f"{what} events break the contract: {err}")
        return None
    keyed = pa.Table.from_batches([checked])
    for c in _ORIGIN:
        if c in table.column_names:
            keyed = keyed.append_column(c, table.column(c))
    rows, starts = _message_order(keyed, seen)
    if rows.size == 0:
        return None
    # one gather into message order (none when the file is in it already, as one
    # archiver writes it); messages are then zero-copy slices of it
    if len(rows) == checked.num_rows and (rows == np.arange(len(rows))).all():
        return checked, rows[starts], starts
    return checked.take(pa.array(rows)), rows[starts], starts


def read_parquet_messages(
    path: str | Path,
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
    seen: SeenMessages | None = None,
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """``(first row number in the file, validated rows of one message)``, in the order
    the messages were archived; an unreadable or non-contract file goes to ``on_bad``.
    ``seen``: shared by the files of one directory, so a message is read once."""
    got = _read_ordered(Path(path), job, on_bad, seen)
    if got is None:
        return
    ordered, first_rows, starts = got
    ends = np.append(starts[1:], ordered.num_rows)
    for row, s, e in zip(first_rows.tolist(), starts.tolist(), ends.tolist(), strict=True):
        yield row, ordered.slice(s, e - s)


def read_parquet_events(
    path: str | Path,
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
    seen: SeenMessages | None = None,
    chunk_rows: int = 65_536,
) -> Iterator[tuple[int, list[Event]]]:
    """As :func:`read_parquet_messages`, each message's rows as event objects. Rows are
    converted ``chunk_rows`` at a time (whole messages), not message by message: a
    conversion costs tens of microseconds whatever its size."""
    got = _read_ordered(Path(path), job, on_bad, seen)
    if got is None:
        return
    ordered, first_rows, starts = got
    ends = np.append(starts[1:], ordered.num_rows)
    i, m = 0, len(starts)
    while i < m:
        # whole messages up to chunk_rows rows (at least one message)
        j = max(i + 1, int(np.searchsorted(ends, starts[i] + chunk_rows, side="right")))
        lo, hi = int(starts[i]), int(ends[j - 1])
        events = table_events(ordered.slice(lo, hi - lo))
        for k in range(i, j):
            yield int(first_rows[k]), events[starts[k] - lo : ends[k] - lo]
        i = j


def read_parquet_columns(
    path: str | Path,
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
    seen: SeenMessages | None = None,
) -> Iterator[tuple[int, pa.RecordBatch, list[EventColumns]]]:
    """As :func:`read_parquet_messages`, with each message also as
    :class:`~producers.columnar.EventColumns` (one per communicator) whose numpy
    columns are slices of arrays built once for the whole file: per message, no Arrow
    call at all."""
    got = _read_ordered(Path(path), job, on_bad, seen)
    if got is None:
        return
    ordered, first_rows, starts = got
    arrays = core_arrays(ordered)
    enc = pc.dictionary_encode(ordered.column("comm"))
    codes = np.asarray(enc.indices.to_numpy(), np.int64)
    names = enc.dictionary.to_pylist()
    ends = np.append(starts[1:], ordered.num_rows)
    for row, s, e in zip(first_rows.tolist(), starts.tolist(), ends.tolist(), strict=True):
        part = ordered.slice(s, e - s)
        c = codes[s:e]
        if c.min() == c.max():  # the usual case: one communicator per message
            cols = [EventColumns(names[c[0]], part, slice_arrays(arrays, s, e))]
        else:
            cols = split_by_comm(part)
        yield row, part, cols


class BlockColumns:
    """One communicator's rows of an :class:`ArchiveBlock` (its parts of one time
    slice) as :class:`~streams.core.columns.EventColumnsLike`: numpy views of arrays
    gathered once for every communicator of the slice; event objects are built only for
    the rows a detector reads whole (from the block's Arrow rows)."""

    __slots__ = ("_block", "_coff", "_conns", "_np", "_objs", "_src", "_table", "comm",
                 "comm_name", "job")  # fmt: skip

    def __init__(
        self,
        comm: str,
        job: str,
        comm_name: str | None,
        rows: dict[str, np.ndarray],
        conns: tuple[np.ndarray, ...],
        coff: np.ndarray,
        src: list[tuple[pa.RecordBatch, np.ndarray]],
        objs: tuple[_SliceObjects, int] | None = None,
        block: list[ArchiveBlock] | None = None,
    ) -> None:
        self.comm, self.job, self.comm_name = comm, job, comm_name
        self._block = block
        """The block each source of ``src`` comes from: their progress connections."""
        self._objs = objs
        """The slice's shared objects and where these rows start in it (one part only)."""
        self._np = rows
        self._conns = conns
        """Flat connections of these rows: peer, send, bytes, time."""
        self._coff = coff
        """Row ``i`` owns connections ``coff[i]:coff[i+1]``."""
        self._src = src
        """Where the rows are: (Arrow rows, row numbers in them), in order."""
        self._table: pa.RecordBatch | None = None

    @property
    def n(self) -> int:
        return len(self._np[_IS_OP])

    @property
    def table(self) -> pa.RecordBatch:
        """The rows as one Arrow batch (built when first read)."""
        if self._table is None:
            taken = [t.take(pa.array(r, pa.int64())) for t, r in self._src]
            self._table = pa.Table.from_batches(taken).combine_chunks().to_batches()[0]
        return self._table

    @property
    def is_op(self) -> np.ndarray:
        return self._np[_IS_OP]

    @property
    def ts_us(self) -> np.ndarray:
        return self.int("ts_us")

    def int(self, name: str, fill: int = -1) -> np.ndarray:
        got = self._np.get(f"{name}:{fill}")
        return got if got is not None else EventColumns(self.comm, self.table).int(name, fill)

    def float(self, name: str, fill: float = 0.0) -> np.ndarray:
        got = self._np.get(f"{name}:{fill}")
        return got if got is not None else EventColumns(self.comm, self.table).float(name, fill)

    def conn_counts(self) -> np.ndarray:
        return self._np[_CONNS]

    def conn_arrays(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        lens = self._np[_CONNS][idx]
        before = np.zeros(len(lens), np.int64)
        np.cumsum(lens[:-1], out=before[1:])
        flat = np.repeat(self._coff[idx] - before, lens) + np.arange(int(lens.sum()))
        return tuple(a[flat] for a in self._conns)  # type: ignore[return-value]

    def progress_conns(self, idx: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """The connections of rows ``idx`` as integers, as events carry them: offsets
        per row (``len(idx) + 1``), peer, send (else recv), bytes, retransmits (0 when
        absent); None when the rows are not one block's."""
        blocks = self._block
        if blocks is None:
            return None
        if len(blocks) == 1:
            return blocks[0].progress_conns(self._src[0][1][idx])
        # rows of several blocks (a slice cut by a block's end): each block's share, in
        # order; rows not in source order (never asked so today) get None
        ends = np.cumsum([len(r) for _, r in self._src])
        which = np.searchsorted(ends, idx, side="right")
        if len(idx) and (np.diff(which) < 0).any():
            return None
        cut = np.searchsorted(which, np.arange(len(blocks) + 1)).tolist()
        got = []
        for k, (blk, (_, r)) in enumerate(zip(blocks, self._src, strict=True)):
            if cut[k + 1] > cut[k]:
                got.append(blk.progress_conns(r[idx[cut[k] : cut[k + 1]] - (ends[k] - len(r))]))
        if len(got) == 1:
            return got[0]
        base = np.cumsum([0] + [int(g[0][-1]) for g in got[:-1]])
        shifted = [g[0][1:] + b for g, b in zip(got, base, strict=True)]
        off = np.concatenate([np.zeros(1, np.int64), *shifted])
        return (off, *(np.concatenate([g[j] for g in got]) for j in range(1, 5)))

    def identities(self, idx: np.ndarray) -> tuple[list[str], list[int | None], list[str | None]]:
        """Host, GPU and NIC (None when absent) of rows ``idx``, read from the columns:
        a rank first seen learns who it is without an event object."""
        if self._objs is not None:  # read once for the whole slice
            shared, start = self._objs
            return shared.identities(idx + start)
        got = [_identity_lists(t, r) for t, r in self._src]
        want = idx.tolist()
        hosts, gpus, nics = ([x for g in got for x in g[k]] for k in range(3))
        return [hosts[i] for i in want], [gpus[i] for i in want], [nics[i] for i in want]

    def rows(self, idx: np.ndarray) -> Sequence[Event]:
        if self._objs is not None:  # converted with the slice's other rows read whole
            shared, start = self._objs
            return _SliceRows(shared, idx + start)
        if self._table is None and len(self._src) == 1:  # no need to gather the rows first
            t, r = self._src[0]
            return LazyEvents(t, r[idx])
        return _SliceRows(self, idx)  # the rows are gathered only if read

    def to_events(self) -> list[Event]:
        return table_events(self.table)

    def get(self, pos: np.ndarray) -> list[Event]:
        """Rows ``pos`` as event objects (for :class:`_SliceRows`)."""
        return table_events(self.table.take(pa.array(pos, pa.int64())))

    @staticmethod
    def concat(parts: Sequence[BlockColumns]) -> BlockColumns:
        """Several parts of one communicator (e.g. a time slice cut by a block's end)."""
        if len(parts) == 1:
            return parts[0]
        p0 = parts[0]
        rows = {k: np.concatenate([p._np[k] for p in parts]) for k in p0._np}
        conns = tuple(np.concatenate([p._conns[i] for p in parts]) for i in range(len(p0._conns)))
        coff = np.zeros(len(rows[_IS_OP]) + 1, np.int64)
        np.cumsum(rows[_CONNS], out=coff[1:])
        src = [s for p in parts for s in p._src]
        blocks = [b for p in parts for b in p._block] if all(p._block for p in parts) else None
        return BlockColumns(p0.comm, p0.job, p0.comm_name, rows, conns, coff, src, None, blocks)


def _identity_lists(
    table: pa.RecordBatch, rows: np.ndarray
) -> tuple[list[str], list[int | None], list[str | None]]:
    """Host, GPU and NIC of ``rows`` of ``table`` as lists (None where absent), as the
    event objects would carry them."""
    t = table.select(["host", "gpu", "nic"]).take(pa.array(rows, pa.int64()))
    return t.column(0).to_pylist(), t.column(1).to_pylist(), t.column(2).to_pylist()


class _SliceObjects:
    """Event objects of a slice's rows, built for many communicators at once (a
    conversion costs about a millisecond whatever its size): the first rows asked for
    alone; at a second miss the whole slice (the first slices, where every rank is new
    to every communicator and each asks for its rows)."""

    __slots__ = ("_cache", "_ids", "_misses", "_rows", "_table")

    def __init__(self, table: pa.RecordBatch, rows: np.ndarray) -> None:
        self._table, self._rows = table, rows
        self._cache: dict[int, Event] = {}
        self._misses = 0
        self._ids: tuple[list[str], list[int | None], list[str | None]] | None = None

    def identities(self, pos: np.ndarray) -> tuple[list[str], list[int | None], list[str | None]]:
        """Host, GPU, NIC of the slice's rows ``pos`` (the slice's columns read once)."""
        if self._ids is None:
            self._ids = _identity_lists(self._table, self._rows)
        hosts, gpus, nics = self._ids
        want = pos.tolist()
        return [hosts[i] for i in want], [gpus[i] for i in want], [nics[i] for i in want]

    def get(self, pos: np.ndarray) -> list[Event]:
        cache = self._cache
        want = pos.tolist()
        missing = [p for p in want if p not in cache]
        if missing:
            self._misses += 1
            if self._misses == 1:
                fill = np.array(missing, np.int64)
            else:
                fill = np.arange(len(self._rows))
            fill = fill[[p not in cache for p in fill.tolist()]]
            events = table_events(self._table.take(pa.array(self._rows[fill], pa.int64())))
            cache.update(zip(fill.tolist(), events, strict=True))
        return [cache[p] for p in want]


class _SliceRows(Sequence[Event]):
    """Rows as event objects, from :class:`_SliceObjects` (or the rows of a
    :class:`BlockColumns`) when first read."""

    __slots__ = ("_events", "_pos", "_shared")

    def __init__(self, shared: _SliceObjects | BlockColumns, pos: np.ndarray) -> None:
        self._shared, self._pos = shared, pos
        self._events: list[Event] | None = None

    def __len__(self) -> int:
        return len(self._pos)

    def _all(self) -> list[Event]:
        if self._events is None:
            self._events = self._shared.get(self._pos)
        return self._events

    def __iter__(self) -> Iterator[Event]:
        return iter(self._all())

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # Sequence's overloads
        return self._all()[i]


class ArchiveBlock:
    """Consecutive archived messages of one file, as one set of columns
    (:class:`~streams.core.columns.ColumnBlockLike`): a *part* is one communicator's
    rows of one message (a message of several communicators is several parts, as
    :func:`~producers.columnar.split_by_comm` cuts it)."""

    __slots__ = ("_bounds", "_cname", "_cnames", "_code", "_coff", "_conns", "_ints", "_np",
                 "_table", "part_comm", "part_job", "part_n", "part_ts_hi",
                 "part_ts_lo")  # fmt: skip

    def __init__(
        self,
        table: pa.RecordBatch,
        rows: dict[str, np.ndarray],
        conns: tuple[np.ndarray, ...],
        coff: np.ndarray,
        bounds: np.ndarray,
        code: np.ndarray,
        names: list[str],
        cname: np.ndarray,
        cnames: list[str | None],
        part_job: list[str],
    ) -> None:
        self._table, self._np, self._conns, self._coff = table, rows, conns, coff
        self._ints: tuple[np.ndarray, ...] | None = None
        self._bounds, self._code = bounds, code
        self._cname, self._cnames = cname, cnames
        ts = rows["ts_us:-1"]
        starts = bounds[:-1]
        self.part_comm = [names[c] for c in code.tolist()]
        self.part_job = part_job
        self.part_ts_lo = np.minimum.reduceat(ts, starts).tolist()
        self.part_ts_hi = np.maximum.reduceat(ts, starts).tolist()
        self.part_n = np.diff(bounds).tolist()

    @property
    def ts_us(self) -> np.ndarray:
        """Every row's ``ts_us``, in arrival order."""
        return self._np["ts_us:-1"]

    @property
    def n(self) -> int:
        return self._table.num_rows

    @property
    def table(self) -> pa.RecordBatch:
        """The block's rows (parts in order) as Arrow."""
        return self._table

    def progress_conns(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """See :meth:`BlockColumns.progress_conns` (``rows``: the block's row numbers)."""
        if self._ints is None:  # once per block: the connections' integer fields
            flat = self._table.column("conns").flatten()
            self._ints = (
                flat.field("peer").to_numpy().astype(np.int64),
                np.asarray(
                    pc.equal(flat.field("dir"), "send").to_numpy(zero_copy_only=False), bool
                ),
                flat.field("bytes").to_numpy().astype(np.int64),
                pc.fill_null(flat.field("retrans"), 0).to_numpy().astype(np.int64),
            )
        lens = self._np[_CONNS][rows]
        off = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        flat_idx = np.repeat(self._coff[rows] - off[:-1], lens) + np.arange(int(off[-1]))
        return (off, *(a[flat_idx] for a in self._ints))

    def select(self, parts: np.ndarray) -> list[BlockColumns]:
        b = self._bounds
        codes = self._code[parts]
        uniq, first = np.unique(codes, return_index=True)
        appear = np.empty(len(uniq), np.int64)  # each code's rank by first appearance
        appear[np.argsort(first, kind="stable")] = np.arange(len(uniq))
        rank = appear[np.searchsorted(uniq, codes)]
        o = np.argsort(rank, kind="stable")  # parts grouped by communicator, in order
        ps = parts[o]
        lens = b[ps + 1] - b[ps]
        ends = np.cumsum(lens)
        rows = np.repeat(b[ps] - (ends - lens), lens) + np.arange(int(ends[-1]))
        got = {k: a[rows] for k, a in self._np.items()}
        cnt = got[_CONNS]
        goff = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(cnt, out=goff[1:])
        flat = np.repeat(self._coff[rows] - goff[:-1], cnt) + np.arange(int(goff[-1]))
        conns = tuple(a[flat] for a in self._conns)
        # each communicator's rows are one run of the gathered arrays
        group = np.flatnonzero(np.diff(rank[o], prepend=-1))
        lo = (ends - lens)[group].tolist() + [len(rows)]
        shared = _SliceObjects(self._table, rows)
        out: list[BlockColumns] = []
        for g, i in enumerate(ps[group].tolist()):
            r0, r1 = lo[g], lo[g + 1]
            c0, c1 = int(goff[r0]), int(goff[r1])
            cn = int(self._cname[rows[r0]])
            out.append(BlockColumns(
                self.part_comm[i], self.part_job[i], self._cnames[cn] if cn >= 0 else None,
                {key: a[r0:r1] for key, a in got.items()},
                tuple(a[c0:c1] for a in conns), goff[r0 : r1 + 1] - c0,
                [(self._table, rows[r0:r1])], (shared, r0), [self],
            ))  # fmt: skip
        return out


def read_parquet_blocks(
    path: str | Path,
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
    seen: SeenMessages | None = None,
    max_rows: int = 65_536,
    by_second: bool = True,
) -> Iterator[tuple[int, ArchiveBlock]]:
    """As :func:`read_parquet_columns`, many messages at a time: ``(first row number in
    the file of the block's first message, the block)``. A block holds consecutive
    messages, at most ``max_rows`` rows (whole messages; at least one); with
    ``by_second``, only messages whose earliest ``ts_us`` falls in the same second —
    the key :func:`producers.sources.open_sources` merges the files of one directory
    by, so merging blocks orders the messages as merging them one by one would (a
    file read alone needs no such cut)."""
    got = _read_ordered(Path(path), job, on_bad, seen)
    if got is None:
        return
    ordered, first_rows, starts = got
    n = ordered.num_rows
    code, names = _codes(ordered.column("comm"))
    ts = ordered.column("ts_us").to_numpy()
    msg_key = np.minimum.reduceat(ts, starts) // _GROUP_US
    msg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
    if (code != code[starts][msg]).any():
        # a message of several communicators: one part per communicator, in order of
        # first appearance, rows in order (as split_by_comm cuts a message)
        pos = np.arange(n)
        o = np.lexsort((pos, code, msg))
        new = np.ones(n, bool)
        new[1:] = (msg[o][1:] != msg[o][:-1]) | (code[o][1:] != code[o][:-1])
        first = np.empty(n, np.int64)
        first[o] = o[new][np.cumsum(new) - 1]
        order = np.lexsort((pos, first))  # first lies inside its message: messages keep order
        ordered, code, msg = ordered.take(pa.array(order)), code[order], msg[order]
        pstart = np.flatnonzero((np.diff(msg, prepend=-1) != 0) | (np.diff(code, prepend=-1) != 0))
    else:
        pstart = starts
    part_msg = msg[pstart]
    jcode, jobs = _codes(ordered.column("job"))
    cname, cnames = _codes(ordered.column("comm_name"))
    rows, conns = core_arrays(ordered)
    *flat, off = conns.values()  # core_arrays: peer, send, bytes, time, then offsets
    bounds = np.append(pstart, n)
    part_key = msg_key[part_msg]
    runs = (
        np.flatnonzero(np.diff(part_key, prepend=part_key[0] - 1)).tolist() if by_second else [0]
    ) + [len(pstart)]
    msg_start = np.flatnonzero(np.diff(part_msg, prepend=-1))  # parts that begin a message
    for ra, rb in zip(runs[:-1], runs[1:], strict=True):
        a = ra
        while a < rb:
            # whole messages up to max_rows rows (at least one message)
            b = int(np.searchsorted(bounds, bounds[a] + max_rows, side="right")) - 1
            if b < rb:
                b = int(msg_start[np.searchsorted(msg_start, b, side="right") - 1])
            b = min(b, rb)
            if b <= a:
                nxt = np.searchsorted(msg_start, a, side="right")
                b = min(int(msg_start[nxt]) if nxt < len(msg_start) else rb, rb)
            lo, hi = int(bounds[a]), int(bounds[b])
            o0, o1 = int(off[lo]), int(off[hi])
            block = ArchiveBlock(
                ordered.slice(lo, hi - lo),
                {k: v[lo:hi] for k, v in rows.items()},
                tuple(v[o0:o1] for v in flat),
                off[lo : hi + 1] - o0,
                bounds[a : b + 1] - lo,
                code[pstart[a:b]],
                names,
                cname[lo:hi],
                cnames,
                [jobs[j] for j in jcode[pstart[a:b]].tolist()],
            )
            yield int(first_rows[part_msg[a]]), block
            a = b


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list]:
    """A string column as integer codes (null: -1) and the values they stand for."""
    enc = pc.dictionary_encode(col)
    if isinstance(enc, pa.ChunkedArray):
        enc = enc.combine_chunks()
    idx = enc.indices
    if idx.null_count:
        idx = pc.fill_null(idx, -1)
    return np.asarray(idx.to_numpy(), np.int64), enc.dictionary.to_pylist()
