"""Validated event rows as the numpy columns the detection core reads.

:class:`EventColumns` is one communicator's rows; :class:`ColumnBlock` the good
messages of one consumer batch in one set of arrays; :func:`core_arrays` builds the
arrays once per batch or file, and slices of them serve each message.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from producers.columnar.rules import _np_bool, _one_batch
from producers.columnar.tables import _to_events
from producers.events import Event


class EventColumns:
    """The events of one communicator (one message, or several concatenated), as
    validated columns.

    ``table`` (one record batch) has the canonical types of :data:`EVENT_SCHEMA`
    (absent optional columns are all-null), rows in arrival order. Numeric columns come
    out as numpy arrays with a fill value for nulls (:meth:`int`, :meth:`float`), built
    once and cached; a reader that has them for a whole file already (the Parquet
    archive) passes slices of them in ``arrays``, and :meth:`concat` joins those with
    numpy, building the Arrow table of the parts only if a row is read as an object.
    """

    __slots__ = ("_np", "_parts", "_table", "comm")

    def __init__(
        self,
        comm: str,
        table: pa.RecordBatch | None = None,
        arrays: dict[str, np.ndarray] | None = None,
        parts: list[pa.RecordBatch | Taken] | None = None,
    ) -> None:
        self.comm = comm
        self._table = table
        self._parts = parts
        self._np: dict[str, np.ndarray] = arrays if arrays is not None else {}

    @property
    def table(self) -> pa.RecordBatch:
        if self._table is None:
            assert self._parts is not None
            parts = [_taken(p) for p in self._parts]
            self._table = _one_batch(pa.Table.from_batches(parts)) if len(parts) > 1 else parts[0]
            self._parts = None
        return self._table

    @property
    def n(self) -> int:
        if self._table is None and self._parts is not None:
            return sum(
                p.num_rows if isinstance(p, pa.RecordBatch) else len(p[1]) for p in self._parts
            )
        return self.table.num_rows

    def _first(self, name: str) -> Any:
        """The first row's value of column ``name`` (without building the table)."""
        return self.value_at(name, 0)

    def value_at(self, name: str, i: int) -> Any:
        """Row ``i``'s value of column ``name``, without building the table or an event
        object (a new communicator's first op name is read so: a row rebuilt as an
        object cost ~0.2 ms, most of a new communicator's intake)."""
        if self._table is None and self._parts:
            return value_in_parts(self._parts, name, i)
        return self.table.column(name)[i].as_py()

    @property
    def job(self) -> str:
        return str(self._first("job"))

    @property
    def comm_name(self) -> str | None:
        return self._first("comm_name")

    @property
    def is_op(self) -> np.ndarray:
        got = self._np.get(_IS_OP)
        if got is None:
            got = self._np[_IS_OP] = _np_bool(pc.equal(self.table.column("kind"), "op"))
        return got

    def int(self, name: str, fill: int = -1) -> np.ndarray:
        """An integer column as ``int64``, nulls as ``fill``."""
        key = f"{name}:{fill}"
        got = self._np.get(key)
        if got is None:
            got = self._np[key] = _int_column(self.table.column(name), fill)
        return got

    def float(self, name: str, fill: float = 0.0) -> np.ndarray:
        """A float column as ``float64``, nulls as ``fill``."""
        key = f"{name}:{fill}"
        got = self._np.get(key)
        if got is None:
            got = self._np[key] = _float_column(self.table.column(name), fill)
        return got

    @property
    def ts_us(self) -> np.ndarray:
        return self.int("ts_us")

    def conn_counts(self) -> np.ndarray:
        """Per row: how many connections it carries (0 when absent)."""
        got = self._np.get(_CONNS)
        if got is None:
            got = self._np[_CONNS] = _conn_counts(self.table.column("conns"))
        return got

    def conn_arrays(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The connections of rows ``idx`` (in order), flat: peer, send (else recv),
        bytes, time (0 when absent)."""
        if _CPEER in self._np:  # flat arrays of this part's connections, from the file
            flat_idx = self._conn_index(idx)[1]
            return tuple(self._np[k][flat_idx] for k in _CONN_KEYS)  # type: ignore[return-value]
        flat = self.table.column("conns").take(pa.array(idx, pa.int64())).flatten()
        peer, dirs, nbytes, time_us = (flat.field(k) for k in ("peer", "dir", "bytes", "time_us"))
        return (
            _int_column(peer),
            _np_bool(pc.equal(dirs, "send")),
            _float_column(nbytes),
            _float_column(time_us),
        )

    def progress_conns(self, idx: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """The connections of rows ``idx`` as integers, as events carry them: offsets per
        row (``len(idx) + 1``), peer, send (else recv), bytes, retransmits (0 when
        absent) — so the hang detector reads in-flight progress rows without event
        objects. None when the columns came without them (:func:`core_arrays` with
        ``progress=True``)."""
        if _CRETRANS not in self._np:
            return None
        off, flat_idx = self._conn_index(idx)
        return (off, *(self._np[k][flat_idx] for k in (_CPEER, _CSEND, _CBYTES_INT, _CRETRANS)))

    def _conn_index(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``idx``'s connections: offsets per row into the result, and their
        positions in the flat per-connection arrays."""
        counts = self.conn_counts()
        off = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=off[1:])
        lens = counts[idx]
        out = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=out[1:])
        return out, np.repeat(off[idx] - out[:-1], lens) + np.arange(int(out[-1]))

    def rows(self, idx: np.ndarray) -> LazyEvents:
        """The rows ``idx`` as event objects, built only when first read."""
        return LazyEvents(self, idx)

    def identities(self, idx: np.ndarray) -> tuple[list[str], list[int | None], list[str | None]]:
        """Host, GPU and NIC of rows ``idx`` from the columns: a rank first seen learns
        who it is without its rows being rebuilt as event objects."""
        return _identity_lists(self.table, idx)

    def to_events(self) -> list[Event]:
        """The rows as contract event objects, equal to what the JSON decoder gives."""
        return _to_events(self.table)

    @staticmethod
    def concat(parts: Sequence[EventColumns]) -> EventColumns:
        """One communicator's parts (e.g. several messages of one time slice) as one:
        the numpy columns all parts have are concatenated; the Arrow rows only when read."""
        if len(parts) == 1:
            return parts[0]
        keys = set(parts[0]._np).intersection(*(p._np for p in parts[1:]))
        arrays = {k: np.concatenate([p._np[k] for p in parts]) for k in keys}
        tables: list[pa.RecordBatch | Taken] = []
        for p in parts:
            tables += p._parts if p._table is None and p._parts else [p.table]
        return EventColumns(parts[0].comm, None, arrays, tables)


Taken = tuple[pa.RecordBatch, np.ndarray]
"""Rows ``idx`` of a record batch, taken when first read."""


def _taken(part: pa.RecordBatch | Taken) -> pa.RecordBatch:
    if isinstance(part, pa.RecordBatch):
        return part
    return part[0].take(pa.array(part[1], pa.int64()))


_IS_OP = "__is_op"
_CONNS = "__conns"


def _int_column(col: pa.Array, fill: int = -1) -> np.ndarray:
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy().astype(np.int64, copy=False)


def _float_column(col: pa.Array, fill: float = 0.0) -> np.ndarray:
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy().astype(np.float64, copy=False)


def _conn_counts(col: pa.Array) -> np.ndarray:
    lengths = pc.fill_null(pc.list_value_length(col), 0)
    return lengths.to_numpy().astype(np.int64, copy=False)


def core_arrays(
    batch: pa.RecordBatch, *, progress: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The numpy columns the detection core reads, for a whole validated batch: per row,
    and per connection (flat, in row order; row ``i`` owns ``offsets[i]:offsets[i+1]``).
    Slice them per message with :func:`slice_arrays` for :class:`EventColumns`.
    ``progress``: also the connections' bytes as integers and retransmits (null: 0), for
    :meth:`EventColumns.progress_conns` (added after the offsets, so a reader unpacking
    the default per-connection keys and the offsets in order is unaffected)."""
    rows = {f"{k}:-1": _int_column(batch.column(k)) for k in _CORE_INTS}
    rows.update({f"{k}:0.0": _float_column(batch.column(k)) for k in _CORE_FLOATS})
    rows[_IS_OP] = _np_bool(pc.equal(batch.column("kind"), "op"))
    counts = rows[_CONNS] = _conn_counts(batch.column("conns"))
    flat = batch.column("conns").flatten()
    conns = dict(zip(_CONN_KEYS, (
        _int_column(flat.field("peer")),
        _np_bool(pc.equal(flat.field("dir"), "send")),
        _float_column(flat.field("bytes")),
        _float_column(flat.field("time_us")),
    ), strict=True))  # fmt: skip
    off = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=off[1:])
    conns[_COFF] = off
    if progress:
        conns[_CBYTES_INT] = _int_column(flat.field("bytes"), 0)
        conns[_CRETRANS] = _int_column(flat.field("retrans"), 0)
    return rows, conns


def slice_arrays(
    arrays: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], start: int, end: int
) -> dict[str, np.ndarray]:
    """Rows ``start:end`` of :func:`core_arrays` (views, no copy)."""
    rows, conns = arrays
    out = {k: a[start:end] for k, a in rows.items()}
    off = conns[_COFF]
    lo, hi = int(off[start]), int(off[end])
    out.update({k: a[lo:hi] for k, a in conns.items() if k != _COFF})
    return out


_CONN_KEYS = ("__cpeer", "__csend", "__cbytes", "__ctime")
_CPEER, _CSEND = _CONN_KEYS[:2]
_COFF = "__coff"
_CBYTES_INT = "__cbytes_int"
_CRETRANS = "__cretrans"


_CORE_INTS = ("rank", "nranks", "ts_us", "seq", "started", "completed")
_CORE_FLOATS = ("exec_us", "inflight_us")


class RowSource(Protocol):
    """Anything that turns its rows ``pos`` into event objects (a block's slice)."""

    def get(self, pos: np.ndarray) -> list[Event]: ...


def value_in_parts(
    parts: Sequence[pa.RecordBatch | tuple[pa.RecordBatch, np.ndarray]], name: str, i: int
) -> Any:
    """Row ``i``'s value of column ``name`` in rows kept as parts (whole batches, or rows
    of a batch by number), in order: one value, no table gathered, no event object."""
    for p in parts:
        if isinstance(p, pa.RecordBatch):
            if i < p.num_rows:
                return p.column(name)[i].as_py()
            i -= p.num_rows
        elif i < len(p[1]):
            return p[0].column(name)[int(p[1][i])].as_py()
        else:
            i -= len(p[1])
    raise IndexError("row out of range")


class LazyEvents(Sequence[Event]):
    """Rows ``idx`` of a record batch, of columns or of a :class:`RowSource` as event
    objects, all converted on first access."""

    __slots__ = ("_cols", "_events", "_idx")

    def __init__(self, cols: EventColumns | pa.RecordBatch | RowSource, idx: np.ndarray) -> None:
        self._cols = cols
        self._idx = idx
        self._events: list[Event] | None = None

    def __len__(self) -> int:
        return len(self._idx)

    def _all(self) -> list[Event]:
        if self._events is None:
            if isinstance(self._cols, EventColumns | pa.RecordBatch):
                rows = self._source().take(pa.array(self._idx, pa.int64()))
                self._events = _to_events(rows)
            else:
                self._events = self._cols.get(self._idx)
        return self._events

    def _source(self) -> pa.RecordBatch:
        """The batch ``_idx`` indexes, without building a table of all rows when the
        columns stand for rows of one batch (then ``_idx`` is mapped onto them)."""
        c = self._cols
        if isinstance(c, pa.RecordBatch):
            return c
        assert isinstance(c, EventColumns)
        parts = c._parts if c._table is None else None
        if parts and len(parts) == 1 and not isinstance(parts[0], pa.RecordBatch):
            batch, rows = parts[0]
            self._cols, self._idx = batch, rows[self._idx]
            return batch
        return c.table

    def __iter__(self) -> Iterator[Event]:
        return iter(self._all())

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # Sequence's overloads
        # all rows at once: a reader of one row (a rank seen for the first time) usually
        # reads more, and a conversion costs tens of microseconds whatever its size
        return self._all()[i]


def split_by_comm(table: pa.RecordBatch) -> list[EventColumns]:
    """Validated rows (:func:`validate_table`) as one :class:`EventColumns` per
    communicator, in order of first appearance, rows in their order."""
    comm = table.column("comm")
    uniq = pc.unique(comm)
    if len(uniq) == 1:  # the usual case: one communicator
        return [EventColumns(uniq[0].as_py(), table)]
    enc = pc.dictionary_encode(comm)
    codes = enc.indices.to_numpy()
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    parts = sorted(np.split(order, bounds), key=lambda part: int(part[0]))
    return [EventColumns(enc.dictionary[codes[p[0]]].as_py(), table.take(p)) for p in parts]


class ColumnBlock:
    """The good Arrow messages of one consumer batch: one validated record batch of their
    rows (message ``k`` owns rows ``starts[k]:starts[k+1]``), the numpy columns the core
    reads (:func:`core_arrays`), and each row's communicator and job as codes."""

    __slots__ = ("_codes", "_per_message", "arrays", "batch", "comm_codes", "comm_names",
                 "job_codes", "job_names", "starts")  # fmt: skip

    def __init__(self, batch: pa.RecordBatch, starts: np.ndarray) -> None:
        self.batch = batch
        self.starts = starts
        self.arrays = core_arrays(batch, progress=True)
        self.comm_codes, self.comm_names = _codes(batch.column("comm"))
        self.job_codes, self.job_names = _codes(batch.column("job"))
        self._codes: dict[str, tuple[np.ndarray, list[str]]] = {}
        self._per_message: tuple[list[int], list[int], list[int]] | None = None

    def codes(self, name: str) -> tuple[np.ndarray, list[str]]:
        """A string column as integer codes per row and the distinct values (nulls as
        ``""``), computed once."""
        got = self._codes.get(name)
        if got is None:
            got = self._codes[name] = _codes(pc.fill_null(self.batch.column(name), ""))
        return got

    def __len__(self) -> int:
        return len(self.starts) - 1

    def column(self, name: str) -> np.ndarray:
        """A per-row column of :func:`core_arrays` (``rank``, ``nranks``, ``ts_us``, …;
        nulls as -1 / 0.0)."""
        rows = self.arrays[0]
        return rows[f"{name}:-1"] if f"{name}:-1" in rows else rows[f"{name}:0.0"]

    @property
    def is_op(self) -> np.ndarray:
        return self.arrays[0][_IS_OP]

    def conns(self) -> tuple[np.ndarray, np.ndarray]:
        """Every connection's peer (flat, in row order) and the row offsets into it."""
        return self.arrays[1][_CPEER], self.arrays[1][_COFF]

    def message_columns(self, k: int) -> list[EventColumns]:
        """Message ``k``'s rows, one :class:`EventColumns` per communicator (in order of
        first appearance), as views of the block's arrays when it has one."""
        s, e = int(self.starts[k]), int(self.starts[k + 1])
        c = self.comm_codes[s:e]
        if c.min() == c.max():
            return [self.columns(self.comm_names[c[0]], [(s, e)])]
        return split_by_comm(self.batch.slice(s, e - s))

    def per_message(self) -> tuple[list[int], list[int], list[int]]:
        """Per message: its one communicator's code and its one job's (-1: several),
        and its newest ``ts_us``; for all messages at once (numpy costs per call, and
        a message is a few rows)."""
        if self._per_message is None:
            n, m = len(self.batch), len(self)
            if n == 0:
                self._per_message = [-1] * m, [-1] * m, [-1] * m
                return self._per_message
            empty = np.diff(self.starts) == 0  # (the decoder makes none: -1 for them)
            at = np.minimum(self.starts[:-1], n - 1)

            def one(codes: np.ndarray) -> list[int]:
                lo = np.minimum.reduceat(codes, at)
                return np.where((lo == np.maximum.reduceat(codes, at)) & ~empty, lo, -1).tolist()

            top = np.where(empty, -1, np.maximum.reduceat(self.column("ts_us"), at)).tolist()
            self._per_message = one(self.comm_codes), one(self.job_codes), top
        return self._per_message

    def comm_parts(self, s: int, e: int) -> list[tuple[int, list[tuple[int, int]], int]]:
        """Rows ``s:e`` (a message) per communicator, in order of first appearance:
        (its code, its spans of rows in order, its first row)."""
        cc = self.comm_codes[s:e]
        if cc[0] == cc[-1] and (cc == cc[0]).all():  # the usual case: one comm per message
            return [(int(cc[0]), [(s, e)], s)]
        out = []
        uniq, firsts = np.unique(cc, return_index=True)
        for c, first in sorted(zip(uniq, firsts, strict=True), key=lambda x: x[1]):
            rows = np.flatnonzero(cc == c)
            cuts = np.flatnonzero(np.diff(rows) != 1) + 1
            spans = [(s + int(r[0]), s + int(r[-1]) + 1) for r in np.split(rows, cuts)]
            out.append((int(c), spans, s + int(first)))
        return out

    def columns(self, comm: str, spans: Sequence[tuple[int, int]]) -> EventColumns:
        """Rows ``start:end`` of each span, in order, as one communicator's columns (all
        rows must be ``comm``'s)."""
        if len(spans) == 1:
            s, e = spans[0]
            return EventColumns(
                comm, None, slice_arrays(self.arrays, s, e), [self.batch.slice(s, e - s)]
            )
        rows, conns = self.arrays
        se = np.asarray(spans, np.int64)
        idx = _spans_index(se[:, 0], se[:, 1])
        arrays = {k: a[idx] for k, a in rows.items()}
        off = conns[_COFF]
        cidx = _spans_index(off[se[:, 0]], off[se[:, 1]])
        arrays.update({k: a[cidx] for k, a in conns.items() if k != _COFF})
        return EventColumns(comm, None, arrays, [(self.batch, idx)])


def _spans_index(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The indexes ``start:end`` of every span, concatenated (no Python loop)."""
    lens = ends - starts
    before = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=before[1:])
    return np.repeat(starts - before, lens) + np.arange(int(lens.sum()), dtype=np.int64)


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list]:
    """A string column as integer codes per row (null: -1) and the values they stand for."""
    enc = pc.dictionary_encode(col)
    if isinstance(enc, pa.ChunkedArray):
        enc = enc.combine_chunks()
    idx = enc.indices
    if idx.null_count:
        idx = pc.fill_null(idx, -1)
    return np.asarray(idx.to_numpy(), np.int64), enc.dictionary.to_pylist()


def _identity_lists(
    table: pa.RecordBatch, rows: np.ndarray
) -> tuple[list[str], list[int | None], list[str | None]]:
    """Host, GPU and NIC of ``rows`` of ``table`` as lists (None where absent), as the
    event objects would carry them."""
    if table.num_rows <= _SMALL_ROWS:  # a message's rows: read whole, no take (~20 µs)
        ix = rows.tolist()
        host, gpu, nic = (table.column(k).to_pylist() for k in ("host", "gpu", "nic"))
        return [host[i] for i in ix], [gpu[i] for i in ix], [nic[i] for i in ix]
    t = table.select(["host", "gpu", "nic"]).take(pa.array(rows, pa.int64()))
    return t.column(0).to_pylist(), t.column(1).to_pylist(), t.column(2).to_pylist()


_SMALL_ROWS = 64
"""Rows up to which a column is read whole rather than taken row by row."""
