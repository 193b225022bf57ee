"""Event objects ↔ tables of :data:`~producers.columnar.schema.EVENT_SCHEMA`: the one
builder of event tables (the wire's encoder and the archive use it) and its inverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
import pyarrow as pa

from producers.columnar.schema import (
    _IDENTITY,
    _OP_ONLY,
    _OP_REQUIRED,
    _PROGRESS_ONLY,
    _PROGRESS_REQUIRED,
    CONN_TYPE,
    EVENT_SCHEMA,
)
from producers.events import Conn, Event, OpEvent, ProgressEvent

_OP_CLASS = OpEvent


_NUMPY = {pa.int8(): np.int8, pa.int32(): np.int32, pa.int64(): np.int64, pa.float64(): np.float64}
"""Column types a required field is gathered into with ``np.fromiter`` (one C loop, no
list; an integer beyond the type raises ``OverflowError`` rather than wrapping)."""
_REQUIRED = frozenset(
    [f.name for f in EVENT_SCHEMA if not f.nullable] + [*_OP_REQUIRED, *_PROGRESS_REQUIRED]
)
_EMPTY: tuple[()] = ()


def _attr(objs: Sequence[Any], name: str, type_: pa.DataType) -> pa.Array:
    """One column from objects that all have the attribute (``map(attrgetter)`` runs in
    C: about five times faster than a comprehension of ``getattr`` calls)."""
    values = map(attrgetter(name), objs)
    dtype = _NUMPY.get(type_) if name in _REQUIRED else None
    if dtype is not None:
        return pa.array(np.fromiter(values, dtype, len(objs)), type=type_)
    return pa.array(list(values), type=type_)


def _scattered(
    n: int, idx: np.ndarray, where: np.ndarray | None, objs: Sequence[Any], f: pa.Field
) -> pa.Array:
    """A column only one kind has: the kind's values gathered densely, then put at its
    rows ``idx`` with the other kind's rows null (one ``take``, no object array)."""
    if len(objs) == n:
        return _attr(objs, f.name, f.type)
    if not objs:
        return pa.nulls(n, f.type)
    assert where is not None
    return _attr(objs, f.name, f.type).take(where)


def _conns(events: Sequence[Event]) -> pa.Array:
    """``list<struct>`` from flat child columns and list offsets (no dict per row)."""
    per_event: list[list[Conn] | None] = list(map(attrgetter("conns"), events))
    lists = [c or _EMPTY for c in per_event]
    lengths = np.fromiter(map(len, lists), np.int32, len(per_event))
    offsets = np.zeros(len(per_event) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = list(chain.from_iterable(lists))
    children = [_attr(flat, f.name, f.type) for f in CONN_TYPE]
    values = pa.StructArray.from_arrays(children, fields=list(CONN_TYPE))
    mask = pa.array([c is None for c in per_event], pa.bool_())
    return pa.ListArray.from_arrays(
        pa.array(offsets), values, type=pa.list_(CONN_TYPE), mask=mask if mask.true_count else None
    )


def _positions(n: int, is_kind: np.ndarray, idx: np.ndarray) -> pa.Array:
    """Per row: its place among the kind's rows, null for the other kind's rows."""
    pos = np.zeros(n, np.int64)
    pos[idx] = np.arange(len(idx))
    return pa.array(pos, mask=~is_kind)


def events_table(events: Sequence[Event]) -> pa.Table:
    """Contract events as a table of :data:`EVENT_SCHEMA` (row order kept): the one
    builder of event tables, for the wire (:func:`~producers.columnar.wire.encode_arrow`),
    JSON decoded into columns and the archive (``sinks.archive.tables``). Raises
    ``OverflowError`` or ``pyarrow.ArrowInvalid`` for a value its column cannot hold
    (a ``rank`` beyond ``int32``)."""
    n = len(events)
    is_op = np.fromiter(map(_OP_CLASS.__instancecheck__, events), bool, n)
    op_idx, pr_idx = np.flatnonzero(is_op), np.flatnonzero(~is_op)
    mixed = bool(op_idx.size and pr_idx.size)
    ops = [events[i] for i in op_idx] if mixed else events if op_idx.size else []
    prog = [events[i] for i in pr_idx] if mixed else events if pr_idx.size else []
    op_at = _positions(n, is_op, op_idx) if mixed else None
    pr_at = _positions(n, ~is_op, pr_idx) if mixed else None
    arrays: list[pa.Array] = []
    for f in EVENT_SCHEMA:
        if f.name == "kind":
            arrays.append(pa.array(np.where(is_op, "op", "progress").astype(object), pa.string()))
        elif f.name == "conns":
            arrays.append(_conns(events))
        elif f.name in _OP_ONLY:
            arrays.append(_scattered(n, op_idx, op_at, ops, f))
        elif f.name in _PROGRESS_ONLY:
            arrays.append(_scattered(n, pr_idx, pr_at, prog, f))
        else:
            arrays.append(_attr(events, f.name, f.type))
    return pa.Table.from_arrays(arrays, schema=EVENT_SCHEMA)


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
