"""Validation of event columns: every rule of the contract, vectorized.

:func:`validate_table` holds an Arrow table to the very rules the JSON decoder applies
(types, required fields per kind, ``v == 1``, non-empty names, bounds and patterns read
from the msgspec annotations of :mod:`producers.events`: one definition), and raises
:class:`~producers.events.EventDecodeError` naming the field and row.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from producers.columnar.schema import (
    _CONN_REQUIRED,
    _IDENTITY_REQUIRED,
    _NON_EMPTY,
    _OP_ONLY,
    _OP_REQUIRED,
    _PROGRESS_ONLY,
    _PROGRESS_REQUIRED,
    CONN_TYPE,
    EVENT_SCHEMA,
    MAX_CONNS,
)
from producers.events import Conn, EventDecodeError, OpEvent, ProgressEvent


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
