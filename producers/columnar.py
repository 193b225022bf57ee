"""The collective-event contract as columns: Arrow IPC record batches on the wire.

A Kafka message on ``c4.events`` holds either a JSON array of events
(:mod:`producers.events`) or, marked by the header ``content-type:
application/vnd.apache.arrow.stream``, an Arrow IPC *stream* whose record batches hold
one row per event. The columns are the contract's fields (:data:`EVENT_SCHEMA`; the JSON
Schema in ``contracts/`` stays the source of truth for names and meaning): ``kind``
tells ``op`` rows from ``progress`` rows, fields the other kind lacks are null, absent
optional fields are null, and ``conns`` is a ``list<struct<peer, dir, bytes, time_us,
retrans>>`` column. Exporters send one batch per communicator per interval.

:func:`decode_arrow` turns a message into :class:`EventColumns` — numpy columns of one
communicator each — without one Python object per event, and checks every rule the
JSON decoder checks (types, required fields per kind, ``v == 1``, non-empty names,
non-negative counts and times, ``dir`` in send/recv), vectorized. A message that breaks
one raises :class:`~producers.events.EventDecodeError` naming the field and row, so the
worker dead-letters it with that reason. Nothing in a message can run code: the IPC
reader builds plain arrays (pyarrow ≥ 14 never unpickles extension types), every
column's type must be one of the plain types below, and each batch is fully validated
(offsets, lengths) before a value is read. Size is bounded: :data:`MAX_MESSAGE_BYTES`,
:data:`MAX_ROWS` and :data:`MAX_CONNS` per message.

>>> from producers.events import OpEvent, Conn, ProgressEvent
>>> op = OpEvent(v=1, job="j", comm="0xa", nranks=2, rank=0, host="h0", ts_us=1,
...              op="AllReduce", seq=7, bytes=1024, exec_us=12.5,
...              conns=[Conn(peer=1, dir="send", bytes=512, time_us=3.0)])
>>> pr = ProgressEvent(v=1, job="j", comm="0xa", nranks=2, rank=1, host="h1", ts_us=2,
...                    started=8, completed=7)
>>> data = encode_arrow([op, pr])
>>> (cols,) = decode_arrow(data)
>>> cols.comm, cols.n, cols.is_op.tolist(), cols.int("seq").tolist()
('0xa', 2, [True, False], [7, -1])
>>> cols.to_events() == [op, pr]
True
>>> decode_events(data, ARROW_CONTENT_TYPE) == decode_events(encode_message([op, pr]), None)
True
>>> decode_arrow(b"{not arrow")
Traceback (most recent call last):
...
producers.events.EventDecodeError: not an Arrow IPC stream: ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import cache
from operator import attrgetter
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from producers.events import (
    Conn,
    Event,
    EventDecodeError,
    OpEvent,
    ProgressEvent,
    decode_message,
    encode_message,
)

__all__ = [
    "ARROW_CONTENT_TYPE",
    "CONN_TYPE",
    "CONTENT_TYPE_HEADER",
    "ColumnBlock",
    "EVENT_SCHEMA",
    "JSON_CONTENT_TYPE",
    "MAX_CONNS",
    "MAX_MESSAGE_BYTES",
    "MAX_ROWS",
    "EventColumns",
    "LazyEvents",
    "core_arrays",
    "slice_arrays",
    "WireFormat",
    "content_type_of",
    "decode_arrow",
    "decode_events",
    "decode_block",
    "decode_columns_many",
    "decode_events_many",
    "encode_arrow",
    "encode_batch",
    "events_table",
    "is_arrow",
    "split_by_comm",
    "table_events",
    "validate_table",
]

CONTENT_TYPE_HEADER = "content-type"
ARROW_CONTENT_TYPE = "application/vnd.apache.arrow.stream"
JSON_CONTENT_TYPE = "application/json"
WireFormat = Literal["json", "arrow"]
"""What ``--format`` of the exporter and replay takes."""

MAX_MESSAGE_BYTES = 32 << 20
"""Larger messages are refused unread (Kafka's own default limit is 1 MB)."""
MAX_ROWS = 1_000_000
MAX_CONNS = 16_000_000
MAX_DECODED_BYTES = 64 << 20
"""Most bytes a message's record batches may take once decompressed, checked from the
IPC metadata before anything is decompressed (a 17 KB message whose zstd body held a
400 MB ``comm_name`` cost a worker 3.5 GB)."""

#: One connection of a rank with a peer (``producers.events.Conn``).
CONN_TYPE = pa.struct(
    [
        pa.field("peer", pa.int32(), nullable=False),
        pa.field("dir", pa.string(), nullable=False),
        pa.field("bytes", pa.int64(), nullable=False),
        pa.field("time_us", pa.float64()),
        pa.field("retrans", pa.int64()),
    ]
)

#: The contract's fields as columns, in the JSON Schema's order (identity, op, progress).
EVENT_SCHEMA = pa.schema(
    [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("v", pa.int8(), nullable=False),
        pa.field("job", pa.string(), nullable=False),
        pa.field("comm", pa.string(), nullable=False),
        pa.field("comm_name", pa.string()),
        pa.field("nranks", pa.int32(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("host", pa.string(), nullable=False),
        pa.field("gpu", pa.int32()),
        pa.field("nic", pa.string()),
        pa.field("ts_us", pa.int64(), nullable=False),
        # op events
        pa.field("op", pa.string()),
        pa.field("seq", pa.int64()),
        pa.field("bytes", pa.int64()),
        pa.field("exec_us", pa.float64()),
        pa.field("algbw_gbs", pa.float64()),
        pa.field("busbw_gbs", pa.float64()),
        pa.field("algo", pa.string()),
        pa.field("proto", pa.string()),
        # progress events
        pa.field("started", pa.int64()),
        pa.field("completed", pa.int64()),
        pa.field("inflight_op", pa.string()),
        pa.field("inflight_us", pa.float64()),
        # both
        pa.field("conns", pa.list_(CONN_TYPE)),
    ]
)

_IDENTITY_REQUIRED = ("kind", "v", "job", "comm", "nranks", "rank", "host", "ts_us")
_OP_REQUIRED = ("op", "seq", "bytes", "exec_us")
_PROGRESS_REQUIRED = ("started", "completed")
_NON_EMPTY = ("job", "comm", "host")
_CONN_REQUIRED = ("peer", "dir", "bytes")
_OP_ONLY = ("op", "seq", "bytes", "exec_us", "algbw_gbs", "busbw_gbs", "algo", "proto")
_PROGRESS_ONLY = ("started", "completed", "inflight_op", "inflight_us")
_IDENTITY = ("v", "job", "comm", "nranks", "rank", "host", "ts_us", "comm_name", "gpu", "nic")


class _Rule(NamedTuple):
    """What the JSON decoder asks of one field (its msgspec annotation): numbers within
    [ge, le] (NaN and infinities are not), strings of at most ``max_length`` characters
    matching ``pattern``."""

    ge: float | None = None
    le: float | None = None
    max_length: int | None = None
    pattern: str | None = None


@cache
def _rules() -> tuple[dict[str, _Rule], dict[str, _Rule]]:
    """The contract's bounds per column and per connection field, read from the event
    structs' annotations, so that an Arrow batch is held to the very rules the JSON
    decoder applies (one definition: ``producers.events``)."""
    import msgspec.inspect as mi

    def rule(t: Any) -> _Rule | None:
        if isinstance(t, mi.UnionType):
            t = next((x for x in t.types if not isinstance(x, mi.NoneType)), None)
        if isinstance(t, mi.IntType | mi.FloatType):
            return _Rule(ge=t.ge, le=t.le)
        if isinstance(t, mi.StrType):
            return _Rule(max_length=t.max_length, pattern=t.pattern)
        return None

    cols: dict[str, _Rule] = {}
    for cls in (OpEvent, ProgressEvent):
        for f in mi.type_info(cls).fields:  # type: ignore[union-attr]
            r = rule(f.type)
            if r is not None and f.name != "v":
                cols[f.name] = r
    conn = {f.name: r for f in mi.type_info(Conn).fields if (r := rule(f.type))}  # type: ignore[union-attr]
    return cols, conn


def _out_of_rule(a: pa.Array, r: _Rule) -> tuple[np.ndarray, str] | None:
    """Rows of ``a`` that break ``r`` (nulls never do) and what the JSON decoder says."""
    if r.ge is not None or r.le is not None:
        x = np.asarray(a.to_numpy(zero_copy_only=False), np.float64)
        with np.errstate(invalid="ignore"):
            ok = np.ones(len(x), bool)
            if r.ge is not None:
                ok &= x >= r.ge
            if r.le is not None:
                ok &= x <= r.le
        bad = ~ok & _valid(a) if a.null_count else ~ok
        if bad.any():
            got = a[_first_bad(bad)].as_py()
            if r.ge is not None and not got >= r.ge:
                return bad, f"Expected a value >= {r.ge:g}, got {got}"
            return bad, f"Expected a value <= {r.le:g}, got {got}"
        return None
    if r.max_length is not None:
        over = _str_lengths(a) > r.max_length  # bytes: at least as many as characters
        if over.any():
            chars = np.asarray(pc.fill_null(pc.utf8_length(a), 0).to_numpy(zero_copy_only=False))
            over = chars > r.max_length
            if over.any():
                return over, f"Expected `str` of length <= {r.max_length}"
    if r.pattern is not None:
        import re

        rx = re.compile(r.pattern)
        wrong = [u for u in pc.unique(a).to_pylist() if u is not None and not rx.fullmatch(u)]
        if wrong:
            bad = _np_bool(pc.is_in(a, value_set=pa.array(wrong, a.type)))
            return bad, f"Expected `str` matching regex {r.pattern!r}"
    return None


# ---------------------------------------------------------------------------- encode
def _attr(objs: Sequence[Any], name: str, type_: pa.DataType) -> pa.Array:
    # map(attrgetter) runs in C: about five times faster than a comprehension of getattr
    return pa.array(list(map(attrgetter(name), objs)), type=type_)


def _scattered(n: int, idx: np.ndarray, objs: Sequence[Any], name: str, t: pa.DataType) -> pa.Array:
    """A column only one kind has: its rows get the values, the other kind's rows null."""
    if len(objs) == n:
        return _attr(objs, name, t)
    values = np.full(n, None, dtype=object)
    if objs:
        values[idx] = list(map(attrgetter(name), objs))
    return pa.array(values, type=t)


def _conns(events: Sequence[Event]) -> pa.Array:
    """``list<struct>`` from flat child columns and list offsets (no dict per row)."""
    per_event: list[list[Conn] | None] = list(map(attrgetter("conns"), events))
    lengths = np.fromiter((len(c) if c else 0 for c in per_event), np.int32, len(per_event))
    offsets = np.zeros(len(per_event) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = [c for cs in per_event if cs for c in cs]
    children = [_attr(flat, f.name, f.type) for f in CONN_TYPE]
    values = pa.StructArray.from_arrays(children, fields=list(CONN_TYPE))
    mask = pa.array([c is None for c in per_event], pa.bool_())
    return pa.ListArray.from_arrays(
        pa.array(offsets), values, type=pa.list_(CONN_TYPE), mask=mask if mask.true_count else None
    )


def events_table(events: Sequence[Event]) -> pa.Table:
    """Contract events as a table of :data:`EVENT_SCHEMA` (row order kept)."""
    n = len(events)
    is_op = np.fromiter((e.__class__ is OpEvent for e in events), bool, n)
    op_idx, pr_idx = np.flatnonzero(is_op), np.flatnonzero(~is_op)
    ops = [events[i] for i in op_idx] if pr_idx.size else events
    prog = [events[i] for i in pr_idx] if op_idx.size else events
    arrays: list[pa.Array] = []
    for f in EVENT_SCHEMA:
        if f.name == "kind":
            arrays.append(pa.array(np.where(is_op, "op", "progress").astype(object), pa.string()))
        elif f.name == "conns":
            arrays.append(_conns(events))
        elif f.name in _OP_ONLY:
            arrays.append(_scattered(n, op_idx, ops if op_idx.size else [], f.name, f.type))
        elif f.name in _PROGRESS_ONLY:
            arrays.append(_scattered(n, pr_idx, prog if pr_idx.size else [], f.name, f.type))
        else:
            arrays.append(_attr(events, f.name, f.type))
    return pa.Table.from_arrays(arrays, schema=EVENT_SCHEMA)


def _ipc(batches: Iterable[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    # Uncompressed: Kafka compresses whole message sets (zstd) already.
    with pa.ipc.new_stream(sink, EVENT_SCHEMA) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue().to_pybytes()


def encode_arrow(events: Sequence[Event] | pa.Table) -> bytes:
    """One Arrow IPC stream holding ``events`` (a list, or a table of the schema) as one batch."""
    table = events if isinstance(events, pa.Table) else events_table(events)
    return _ipc(table.combine_chunks().to_batches())


def encode_batch(events: Sequence[Event], fmt: WireFormat) -> tuple[bytes, list[tuple[str, bytes]]]:
    """A message value and its headers in the wire format ``fmt`` (``json``/``arrow``)."""
    if fmt == "arrow":
        return encode_arrow(events), [(CONTENT_TYPE_HEADER, ARROW_CONTENT_TYPE.encode())]
    if fmt == "json":
        return encode_message(list(events)), []
    raise ValueError(f"unknown wire format {fmt!r}: use 'json' or 'arrow'")


# ---------------------------------------------------------------------------- decode
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
        if self._table is None and self._parts:
            p = self._parts[0]
            if isinstance(p, pa.RecordBatch):
                return p.column(name)[0].as_py()
            return p[0].column(name)[int(p[1][0])].as_py()
        return self.table.column(name)[0].as_py()

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


class LazyEvents(Sequence[Event]):
    """Rows of a record batch as event objects, all converted on first access."""

    __slots__ = ("_cols", "_events", "_idx")

    def __init__(self, cols: EventColumns | pa.RecordBatch, idx: np.ndarray) -> None:
        self._cols = cols
        self._idx = idx
        self._events: list[Event] | None = None

    def __len__(self) -> int:
        return len(self._idx)

    def _all(self) -> list[Event]:
        if self._events is None:
            self._events = _to_events(self._source().take(pa.array(self._idx, pa.int64())))
        return self._events

    def _source(self) -> pa.RecordBatch:
        """The batch ``_idx`` indexes, without building a table of all rows when the
        columns stand for rows of one batch (then ``_idx`` is mapped onto them)."""
        c = self._cols
        if not isinstance(c, EventColumns):
            return c
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


def _np_bool(arr: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bool)


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _is_string(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _family_ok(want: pa.DataType, got: pa.DataType) -> bool:
    """Whether a column of type ``got`` may hold the contract field of type ``want``.

    As the JSON decoder: any integer width for an integer, an integer or a float for a
    number, any string encoding for a string, null type for an all-absent optional field.
    """
    if pa.types.is_null(got):
        return True
    if pa.types.is_integer(want):
        return pa.types.is_integer(got)
    if pa.types.is_floating(want):
        return pa.types.is_integer(got) or pa.types.is_floating(got)
    if pa.types.is_string(want):
        return _is_string(got)
    return False


def _canonical_conns(col: pa.ChunkedArray) -> pa.ChunkedArray:
    t = col.type
    if pa.types.is_null(t):
        return pa.chunked_array([pa.nulls(len(col), pa.list_(CONN_TYPE))])
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(
        t.value_type
    ):
        raise EventDecodeError(f"column `conns` must be a list of structs, got {t}")
    st = t.value_type
    names = [st.field(i).name for i in range(st.num_fields)]
    out_chunks = []
    for chunk in col.chunks:
        offsets = chunk.offsets
        if pa.types.is_large_list(t):
            offsets = offsets.cast(pa.int32())
        # the values the offsets point at (all of them: also those behind a null slot),
        # with the offsets rebased on them when the list array is a slice
        base = offsets[0].as_py() if len(offsets) else 0
        values = chunk.values.slice(base, (offsets[-1].as_py() - base) if len(offsets) else 0)
        if base:
            offsets = pc.subtract(offsets, base)
        if values.null_count:
            i = _first_bad(_np_bool(values.is_null()))
            raise EventDecodeError(f"connection {i} is null, not an object")
        flat = values.flatten()  # children with the slice offset applied
        children = []
        for f in CONN_TYPE:
            if f.name in names:
                child = flat[names.index(f.name)]
                if not _family_ok(f.type, child.type):
                    raise EventDecodeError(
                        f"column `conns.{f.name}` must be {_kind_word(f.type)}, got {child.type}"
                    )
                children.append(_cast(child, f.type, f"conns.{f.name}"))
            elif f.name in _CONN_REQUIRED:
                raise EventDecodeError(f"column `conns` lacks the required field `{f.name}`")
            else:
                children.append(pa.nulls(len(values), f.type))
        structs = pa.StructArray.from_arrays(children, fields=list(CONN_TYPE))
        out_chunks.append(
            pa.ListArray.from_arrays(
                offsets,
                structs,
                type=pa.list_(CONN_TYPE),
                mask=chunk.is_null() if chunk.null_count else None,
            )
        )
    return pa.chunked_array(out_chunks, type=pa.list_(CONN_TYPE))


def _kind_word(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "an integer"
    if pa.types.is_floating(t):
        return "a number"
    return "a string"


def _cast(arr: Any, t: pa.DataType, name: str) -> Any:
    if arr.type == t:
        return arr
    try:
        return pc.cast(arr, t, safe=True)  # safe: an int64 beyond int32 is an error
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise EventDecodeError(f"column `{name}` does not fit {t}: {err}") from None


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _valid(a: pa.Array) -> np.ndarray:
    """Validity of each slot as a bool array (from the bitmap, no compute call)."""
    n = len(a)
    if a.null_count == 0:
        return np.ones(n, bool)
    if a.null_count == n:
        return np.zeros(n, bool)
    bits = np.frombuffer(a.buffers()[0], np.uint8)
    return np.unpackbits(bits, bitorder="little")[a.offset : a.offset + n].astype(bool)


def _str_lengths(a: pa.Array) -> np.ndarray:
    """Byte length of each slot of a ``string`` array, from its offsets buffer."""
    off = np.frombuffer(a.buffers()[1], np.int32)[a.offset : a.offset + len(a) + 1]
    return np.diff(off)


def _one_batch(table: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
    """A table's rows as one record batch (its chunks combined)."""
    if isinstance(table, pa.RecordBatch):
        return table
    batches = table.combine_chunks().to_batches()
    if len(batches) == 1:
        return batches[0]
    if not batches:
        return pa.RecordBatch.from_pylist([], schema=table.schema)
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def validate_table(table: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
    """Canonical types of :data:`EVENT_SCHEMA` and every rule of the contract, or raise
    :class:`~producers.events.EventDecodeError`. Columns beyond the contract are dropped.

    The checks run on numpy views of the Arrow buffers (a few microseconds per column),
    not one compute call per rule: a message of a few events costs tens of microseconds.
    """
    batch = _one_batch(table)
    names = batch.schema.names
    if len(set(names)) != len(names):
        raise EventDecodeError("duplicate column names")
    n = batch.num_rows
    # what this project's encoder writes: the columns as they are, no cast, no rebuild
    canonical = batch.schema.equals(EVENT_SCHEMA)
    cols: dict[str, pa.Array] = dict(zip(names, batch.columns, strict=True)) if canonical else {}
    for f in () if canonical else EVENT_SCHEMA:
        if f.name not in names:  # unknown columns are ignored, as unknown JSON fields are
            if f.name in _IDENTITY_REQUIRED:
                raise EventDecodeError(f"missing required column `{f.name}`")
            cols[f.name] = pa.nulls(n, f.type)
            continue
        col = batch.column(f.name)
        if f.name == "conns":
            cols[f.name] = _canonical_conns(pa.chunked_array([col])).combine_chunks()
            continue
        if not _family_ok(f.type, col.type):
            raise EventDecodeError(
                f"column `{f.name}` must be {_kind_word(f.type)}, got {col.type}"
            )
        cols[f.name] = _cast(col, f.type, f.name)

    def where(name: str, rows: np.ndarray, what: str) -> str:
        return f"{what} - at row {_first_bad(rows)}, column `{name}`"

    for name in _IDENTITY_REQUIRED:
        if cols[name].null_count:
            raise EventDecodeError(where(name, ~_valid(cols[name]), "missing required field"))
    kind = cols["kind"]
    is_op = _np_bool(pc.equal(kind, "op"))
    is_pr = _np_bool(pc.equal(kind, "progress")) if not is_op.all() else np.zeros(n, bool)
    bad = ~(is_op | is_pr)
    if bad.any():
        got = kind[_first_bad(bad)].as_py()
        raise EventDecodeError(where("kind", bad, f"Invalid value {got!r} (op or progress)"))
    for names_, rows, what in (
        (_OP_REQUIRED, is_op, "op event missing required field"),
        (_PROGRESS_REQUIRED, is_pr, "progress event missing required field"),
    ):
        for name in names_:
            if cols[name].null_count:
                miss = rows & ~_valid(cols[name])
                if miss.any():
                    raise EventDecodeError(where(name, miss, what))
    v = cols["v"].to_numpy()
    if (v != 1).any():
        raise EventDecodeError(where("v", v != 1, f"Expected `1`, got {int(v[v != 1][0])}"))
    for name in _NON_EMPTY:
        empty = _str_lengths(cols[name]) == 0
        if empty.any():
            raise EventDecodeError(where(name, empty, "Expected `str` of length >= 1"))
    col_rules, conn_rules = _rules()
    for name, rule in col_rules.items():
        col = cols[name]
        if col.null_count == n:
            continue
        # rows of the other kind are not judged (their value is ignored, as JSON ignores
        # a field its kind does not have); NaN is not >= 0 for the JSON decoder either
        broken = _out_of_rule(col, rule)
        if broken is None:
            continue
        badm, what = broken
        if name in _OP_ONLY:
            badm &= is_op
        elif name in _PROGRESS_ONLY:
            badm &= is_pr
        if badm.any():
            raise EventDecodeError(where(name, badm, what))
    conns = cols["conns"]
    if conns.null_count < n:
        flat = conns.flatten()  # struct values of the non-null lists
        if len(flat) > MAX_CONNS:
            raise EventDecodeError(f"{len(flat)} connections in one message (limit {MAX_CONNS})")
        if len(flat):
            if flat.null_count:
                i = _first_bad(~_valid(flat))
                raise EventDecodeError(f"connection {i} is null, not an object")
            cn = dict(zip([f.name for f in CONN_TYPE], flat.flatten(), strict=True))
            for name in _CONN_REQUIRED:
                if cn[name].null_count:
                    i = _first_bad(~_valid(cn[name]))
                    raise EventDecodeError(f"connection {i} missing required field `{name}`")
            d = cn["dir"]
            okd = _np_bool(pc.equal(d, "send"))
            if not okd.all():
                okd |= _np_bool(pc.equal(d, "recv"))
            if not okd.all():
                i = _first_bad(~okd)
                raise EventDecodeError(
                    f"Invalid enum value {d[i].as_py()!r} - at connection {i}, field `dir`"
                )
            for name, rule in conn_rules.items():
                c = cn[name]
                if c.null_count == len(c) or name == "dir":
                    continue
                broken = _out_of_rule(c, rule)
                if broken is not None:
                    i = _first_bad(broken[0])
                    raise EventDecodeError(f"{broken[1]} - at connection {i}, field `{name}`")
    if canonical:
        return batch
    return pa.RecordBatch.from_arrays([cols[f.name] for f in EVENT_SCHEMA], schema=EVENT_SCHEMA)


def _u32(b: bytes, i: int) -> int:
    return int.from_bytes(b[i : i + 4], "little")


def _field_pos(b: bytes, table: int, field: int) -> int | None:
    """Position of a flatbuffer table's ``field`` (None: absent), bounds checked."""
    vt = table - int.from_bytes(b[table : table + 4], "little", signed=True)
    if not 0 <= vt <= len(b) - 4:
        raise ValueError("vtable out of bounds")
    vlen = int.from_bytes(b[vt : vt + 2], "little")
    at = 4 + 2 * field
    if at + 2 > vlen:
        return None
    off = int.from_bytes(b[vt + at : vt + at + 2], "little")
    return table + off if off else None


def _ref(b: bytes, pos: int) -> int:
    target = pos + _u32(b, pos)
    if not 0 <= target < len(b):
        raise ValueError("offset out of bounds")
    return target


def _decoded_size(meta: bytes, body: bytes) -> int:
    """Bytes a record (or dictionary) batch message's buffers take decompressed, read
    from its metadata (Arrow's ``Message`` flatbuffer: header → ``RecordBatch`` →
    ``buffers`` and ``compression``) and, when compressed, from each buffer's 8-byte
    uncompressed length prefix. Nothing is decompressed."""
    msg = _ref(meta, 0)
    kind_pos, head_pos = _field_pos(meta, msg, 1), _field_pos(meta, msg, 2)
    if kind_pos is None or head_pos is None:
        return len(body)
    kind, head = meta[kind_pos], _ref(meta, head_pos)
    if kind == 4:  # DictionaryBatch: its RecordBatch is field 1
        data_pos = _field_pos(meta, head, 1)
        if data_pos is None:
            return len(body)
        head = _ref(meta, data_pos)
    elif kind != 3:  # not a RecordBatch
        return len(body)
    bufs_pos = _field_pos(meta, head, 2)
    if bufs_pos is None:
        return 0
    vec = _ref(meta, bufs_pos)
    n = _u32(meta, vec)
    if vec + 4 + 16 * n > len(meta):
        raise ValueError("buffers out of bounds")
    compressed = _field_pos(meta, head, 3) is not None
    total = 0
    for i in range(n):
        at = vec + 4 + 16 * i
        off = int.from_bytes(meta[at : at + 8], "little", signed=True)
        length = int.from_bytes(meta[at + 8 : at + 16], "little", signed=True)
        if off < 0 or length < 0 or off + length > len(body):
            raise ValueError("buffer out of bounds")
        if not compressed or length < 8:
            total += length
            continue
        raw = int.from_bytes(body[off : off + 8], "little", signed=True)
        total += length - 8 if raw < 0 else raw  # -1: stored uncompressed
    return total


def _check_decoded_size(data: bytes) -> None:
    """Refuse a stream whose batches would decompress to more than
    :data:`MAX_DECODED_BYTES`, before any is decompressed."""
    total = 0
    try:
        reader = pa.BufferReader(pa.py_buffer(data))
        while (pos := reader.tell()) < len(data) and data[pos : pos + 8] != _EOS:
            msg = pa.ipc.read_message(reader)
            if msg.type in ("record batch", "dictionary"):
                total += _decoded_size(msg.metadata.to_pybytes(), msg.body.to_pybytes())
            if total > MAX_DECODED_BYTES:
                raise EventDecodeError(
                    f"Arrow batches of {total} bytes or more once decompressed "
                    f"(limit {MAX_DECODED_BYTES})"
                )
    except EventDecodeError:
        raise
    except (pa.ArrowException, ValueError, OSError, EOFError, IndexError) as err:
        raise EventDecodeError(f"not an Arrow IPC stream: {err}") from None


def _read_stream(data: bytes) -> pa.RecordBatch:
    if len(data) > MAX_MESSAGE_BYTES:
        raise EventDecodeError(f"message of {len(data)} bytes (limit {MAX_MESSAGE_BYTES})")
    _check_decoded_size(data)
    batches = _read_canonical(data)
    if batches is None:
        batches = _read_any(data)
    rows = 0
    for batch in batches:
        # The IPC reader trusts offsets and lengths; a full validation first means a
        # crafted batch is an error here, never an out-of-bounds read later.
        try:
            batch.validate(full=True)
        except (pa.ArrowException, ValueError) as err:
            raise EventDecodeError(f"not an Arrow IPC stream: {err}") from None
        rows += batch.num_rows
        if rows > MAX_ROWS:
            raise EventDecodeError(f"more than {MAX_ROWS} rows in one message")
    if len(batches) == 1:
        return batches[0]
    return _one_batch(pa.Table.from_batches(batches, schema=batches[0].schema))


def _read_any(data: bytes) -> list[pa.RecordBatch]:
    """Every record batch of an IPC stream, whatever its schema (the full reader)."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        return list(reader) or [pa.RecordBatch.from_pylist([], schema=reader.schema)]
    except (pa.ArrowException, ValueError, OSError, IndexError) as err:
        raise EventDecodeError(f"not an Arrow IPC stream: {err}") from None


def _schema_prefix() -> bytes:
    """The schema message of :data:`EVENT_SCHEMA` as this encoder frames it (the first
    bytes of every stream it writes)."""
    data = _ipc([])
    reader = pa.BufferReader(pa.py_buffer(data))
    pa.ipc.read_message(reader)
    return data[: reader.tell()]


_SCHEMA_PREFIX = _schema_prefix()
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The end-of-stream marker."""


def _read_canonical(data: bytes) -> list[pa.RecordBatch] | None:
    """The record batches of a stream whose schema message is byte for byte the one this
    encoder writes, or None (then the full reader decides, and words any error).

    Opening a stream reader parses the schema (24 fields) each time: about two thirds of
    a small message's decoding. Here the schema is compared as bytes, and each batch is
    read against the schema parsed once; a stream that holds anything but record batches
    after it goes the long way."""
    start = len(_SCHEMA_PREFIX)
    if data[:start] != _SCHEMA_PREFIX:
        return None
    try:
        reader = pa.BufferReader(pa.py_buffer(data))
        reader.seek(start)
        batches = []
        while (pos := reader.tell()) < len(data) and data[pos : pos + 8] != _EOS:
            msg = pa.ipc.read_message(reader)
            if msg.type != "record batch":
                return None
            batches.append(pa.ipc.read_record_batch(msg, EVENT_SCHEMA))
        return batches or None
    except (pa.ArrowException, ValueError, OSError, EOFError):
        return None


def decode_arrow(data: bytes) -> list[EventColumns]:
    """The events of one Arrow IPC message, one :class:`EventColumns` per communicator
    (in order of first appearance; rows in message order). Raises
    :class:`~producers.events.EventDecodeError` for anything the contract refuses,
    including an empty message."""
    table = validate_table(_read_stream(data))
    if table.num_rows == 0:
        raise EventDecodeError("empty message: no events")
    return split_by_comm(table)


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


def table_events(table: pa.RecordBatch) -> list[Event]:
    """Rows of a validated table (:func:`validate_table`) as contract event objects."""
    return _to_events(table)


def _to_events(table: pa.RecordBatch) -> list[Event]:
    """Rows → event objects; one ``to_pylist`` per column, then one constructor per row."""
    n = table.num_rows
    col = {name: table.column(name).to_pylist() for name in table.schema.names}
    conns_raw = col["conns"]
    conns: list[list[Conn] | None] = [
        None if cs is None else [Conn(**c) for c in cs] for cs in conns_raw
    ]
    ident = [col[k] for k in _IDENTITY]
    kinds = col["kind"]
    out: list[Event] = []
    op_cols = [col[k] for k in _OP_ONLY]
    pr_cols = [col[k] for k in _PROGRESS_ONLY]
    for i in range(n):
        v, job, comm, nranks, rank, host, ts, cname, gpu, nic = (c[i] for c in ident)
        if kinds[i] == "op":
            op, seq, nb, ex, alg, bus, algo, proto = (c[i] for c in op_cols)
            out.append(
                OpEvent(
                    v=v, job=job, comm=comm, nranks=nranks, rank=rank, host=host, ts_us=ts,
                    comm_name=cname, gpu=gpu, nic=nic, op=op, seq=seq, bytes=nb,
                    exec_us=float(ex), algbw_gbs=alg, busbw_gbs=bus, algo=algo, proto=proto,
                    conns=conns[i],
                )
            )  # fmt: skip
        else:
            st, cp, iop, ius = (c[i] for c in pr_cols)
            out.append(
                ProgressEvent(
                    v=v, job=job, comm=comm, nranks=nranks, rank=rank, host=host, ts_us=ts,
                    comm_name=cname, gpu=gpu, nic=nic, started=st, completed=cp,
                    inflight_op=iop, inflight_us=None if ius is None else float(ius),
                    conns=conns[i],
                )
            )  # fmt: skip
    return out


# ---------------------------------------------------------------------------- dispatch
def is_arrow(content_type: bytes | str | None, data: bytes) -> bool:
    """Whether a message is Arrow: its ``content-type`` header says so; without the
    header, an IPC stream's first bytes (the continuation marker ``ff ff ff ff``, which
    no JSON text starts with) say so, so a message whose headers were dropped on the
    way (an old mirror) still reads. Any other content type is refused."""
    if content_type is None:
        return data[:4] == b"\xff\xff\xff\xff"
    ct = content_type.decode("latin-1") if isinstance(content_type, bytes) else content_type
    ct = ct.split(";", 1)[0].strip().lower()
    if ct == ARROW_CONTENT_TYPE:
        return True
    if ct in (JSON_CONTENT_TYPE, ""):
        return False
    raise EventDecodeError(
        f"unsupported content-type {ct!r}: use {ARROW_CONTENT_TYPE} or {JSON_CONTENT_TYPE}"
    )


def content_type_of(headers: Any) -> bytes | None:
    """The ``content-type`` header's value from Kafka headers (pairs or a mapping)."""
    if not headers:
        return None
    if isinstance(headers, dict):
        return headers.get(CONTENT_TYPE_HEADER)
    for k, val in headers:
        if k == CONTENT_TYPE_HEADER:
            return val
    return None


def decode_events(data: bytes, content_type: bytes | str | None) -> list[Event]:
    """One message in either form → event objects (the core's current input form)."""
    if is_arrow(content_type, data):
        table = validate_table(_read_stream(data))
        if table.num_rows == 0:
            raise EventDecodeError("empty message: no events")
        return _to_events(table)  # message order, as the JSON decoder gives
    return decode_message(data)


def _concat(batches: Sequence[pa.RecordBatch]) -> pa.RecordBatch:
    """Batches of one schema as one (``pa.concat_batches`` where pyarrow has it, ≥ 19)."""
    if len(batches) == 1:
        return batches[0]
    concat = getattr(pa, "concat_batches", None)
    if concat is not None:
        return concat(batches)
    return _one_batch(pa.Table.from_batches(batches))


class _Decoded:
    """A consumer batch decoded: per message its events (JSON), its error, or None for an
    Arrow message whose rows are ``arrow[k]``'s in ``whole`` (``starts[k]:starts[k+1]``)."""

    __slots__ = ("arrow", "out", "starts", "whole")

    def __init__(
        self,
        out: list[list[Event] | EventDecodeError | None],
        arrow: list[tuple[int, pa.RecordBatch]],
        whole: pa.RecordBatch | None = None,
    ) -> None:
        self.out = out
        self.arrow = [i for i, _ in arrow]
        if whole is None and arrow:
            whole = _concat([b for _, b in arrow])
        self.whole = whole
        self.starts = np.zeros(len(arrow) + 1, np.int64)
        np.cumsum([b.num_rows for _, b in arrow], out=self.starts[1:])


def _decode_many(messages: Sequence[tuple[bytes, bytes | str | None]]) -> _Decoded:
    """The one decoding pass behind :func:`decode_events_many`, :func:`decode_columns_many`
    and :func:`decode_block`.

    A small batch costs ~100 µs to validate and convert whatever its size, so the Arrow
    messages of a consumer batch are validated together (one pass over their concatenated
    rows), and only when that pass finds a problem one by one, so the error names the
    message it is in. Oversize, truncated or crafted messages are refused by
    :func:`_read_stream` before any of their values is read.
    """
    out: list[list[Event] | EventDecodeError | None] = [None] * len(messages)
    arrow: list[tuple[int, pa.RecordBatch]] = []
    for i, (data, ct) in enumerate(messages):
        try:
            if is_arrow(ct, data):
                batch = _read_stream(data)
                if batch.num_rows == 0:
                    raise EventDecodeError("empty message: no events")
                arrow.append((i, batch))
            else:
                out[i] = decode_message(data)
        except EventDecodeError as err:
            out[i] = err
    if len(arrow) > 1 and all(b.schema.equals(EVENT_SCHEMA) for _, b in arrow):
        try:
            whole = validate_table(_concat([b for _, b in arrow]))
        except EventDecodeError:
            pass  # find the bad message(s) one by one below
        else:
            return _Decoded(out, arrow, whole)
    good = []
    for i, b in arrow:
        try:
            good.append((i, validate_table(b)))
        except EventDecodeError as err:
            out[i] = err
    return _Decoded(out, good)


def decode_events_many(
    messages: Sequence[tuple[bytes, bytes | str | None]],
) -> list[list[Event] | EventDecodeError]:
    """Many messages (value, content type) → per message its events or its error: the
    same results as :func:`decode_events` one by one, cheaper for Arrow (one validation
    and one conversion for all the batch's Arrow rows)."""
    d = _decode_many(messages)
    out: list[list[Event] | EventDecodeError] = [x if x is not None else [] for x in d.out]
    if d.whole is not None:
        events = _to_events(d.whole)
        bounds = d.starts.tolist()
        for k, i in enumerate(d.arrow):
            out[i] = events[bounds[k] : bounds[k + 1]]
    return out


def decode_columns_many(
    messages: Sequence[tuple[bytes, bytes | str | None]],
) -> list[list[Event] | list[EventColumns] | EventDecodeError]:
    """As :func:`decode_events_many`, but Arrow messages come out as columns (one
    :class:`EventColumns` per communicator, in order of first appearance): the batch's
    Arrow rows are validated together and turned into numpy once; each message's
    columns are views of those arrays. JSON messages come out as event objects."""
    items, block = decode_block(messages)
    out: list[list[Event] | list[EventColumns] | EventDecodeError] = []
    for x in items:
        if isinstance(x, int):
            assert block is not None
            out.append(block.message_columns(x))
        else:
            out.append(x)
    return out


def decode_block(
    messages: Sequence[tuple[bytes, bytes | str | None]],
) -> tuple[list[list[Event] | EventDecodeError | int], ColumnBlock | None]:
    """A consumer batch (value, content type per message) for the worker: per message
    its events (JSON), its error, or for an Arrow message its index ``k`` in the returned
    :class:`ColumnBlock`, which holds every good Arrow row of the batch as numpy columns
    (no object per event)."""
    d = _decode_many(messages)
    items: list[list[Event] | EventDecodeError | int] = [x if x is not None else [] for x in d.out]
    for k, i in enumerate(d.arrow):
        items[i] = k
    block = ColumnBlock(d.whole, d.starts) if d.whole is not None else None
    return items, block


class ColumnBlock:
    """The good Arrow messages of one consumer batch: one validated record batch of their
    rows (message ``k`` owns rows ``starts[k]:starts[k+1]``), the numpy columns the core
    reads (:func:`core_arrays`), and each row's communicator and job as codes."""

    __slots__ = ("_codes", "arrays", "batch", "comm_codes", "comm_names", "job_codes",
                 "job_names", "starts")  # fmt: skip

    def __init__(self, batch: pa.RecordBatch, starts: np.ndarray) -> None:
        self.batch = batch
        self.starts = starts
        self.arrays = core_arrays(batch, progress=True)
        self.comm_codes, self.comm_names = _codes(batch.column("comm"))
        self.job_codes, self.job_names = _codes(batch.column("job"))
        self._codes: dict[str, tuple[np.ndarray, list[str]]] = {}

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


def _codes(col: pa.Array) -> tuple[np.ndarray, list[str]]:
    """A string column as integer codes per row and the distinct values."""
    enc = pc.dictionary_encode(col)
    return np.asarray(enc.indices.to_numpy(), np.int64), enc.dictionary.to_pylist()
