"""The ``summary`` kind in Arrow IPC messages (see :mod:`producers.summary`).

A message with summaries is one IPC stream whose schema is
:data:`producers.columnar.EVENT_SCHEMA` followed by the summary columns of
:data:`SUMMARY_COLUMNS` (null in ``op``/``progress`` rows). A summary row has
``kind = "summary"``, the identity columns, ``bytes`` (the window's bytes) and
``conns`` (its per-peer totals); the other event columns are null. A reader that knows
only op and progress refuses the message with ``Invalid value 'summary' (op or
progress) - at row i, column `kind``` (extra columns alone are ignored, as the wire
format says); this one takes the summary rows out and reads the rest as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from producers.columnar import (
    ARROW_CONTENT_TYPE,
    CONTENT_TYPE_HEADER,
    EVENT_SCHEMA,
    _read_stream,
    events_table,
    table_events,
    validate_table,
)
from producers.events import Event, EventDecodeError
from producers.summary import SummaryEvent, _check_summary

__all__ = ["SUMMARY_COLUMNS", "decode_arrow_with_summaries", "encode_arrow_with_summaries"]

SUMMARY_COLUMNS = pa.schema(
    [
        pa.field("sv", pa.int8()),
        pa.field("win_start_us", pa.int64()),
        pa.field("count", pa.int64()),
        pa.field("seq_first", pa.int64()),
        pa.field("seq_last", pa.int64()),
        pa.field("exec_sum_us", pa.float64()),
        pa.field("exec_min_us", pa.float64()),
        pa.field("exec_p50_us", pa.float64()),
        pa.field("exec_p90_us", pa.float64()),
        pa.field("exec_max_us", pa.float64()),
        pa.field("sample_k", pa.int64()),
        pa.field("samples", pa.int64()),
    ]
)
SCHEMA = pa.schema(list(EVENT_SCHEMA) + list(SUMMARY_COLUMNS))
_IDENT = ("v", "job", "comm", "comm_name", "nranks", "rank", "host", "gpu", "nic", "ts_us")


def encode_arrow_with_summaries(
    records: Sequence[Event | SummaryEvent],
) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Events and summaries (rows in the given order) as one IPC stream of
    :data:`SCHEMA`, and its headers."""
    is_sum = np.fromiter((isinstance(r, SummaryEvent) for r in records), bool, len(records))
    events = [r for r in records if not isinstance(r, SummaryEvent)]
    sums = [r for r in records if isinstance(r, SummaryEvent)]
    ev_t = events_table(events) if events else EVENT_SCHEMA.empty_table()
    n = len(records)
    order = np.empty(n, np.int64)
    order[~is_sum] = np.arange(len(events))
    order[is_sum] = len(events) + np.arange(len(sums))
    sum_t = pa.Table.from_pylist(
        [
            {
                "kind": "summary",
                **{k: getattr(s, k) for k in _IDENT},
                "bytes": s.bytes,
                "conns": None if s.peers is None else [msgspec.structs.asdict(c) for c in s.peers],
                **{f.name: getattr(s, f.name) for f in SUMMARY_COLUMNS},
            }
            for s in sums
        ],
        schema=SCHEMA,
    )
    nulls = {f.name: pa.nulls(len(events), f.type) for f in SUMMARY_COLUMNS}
    ev_full = pa.Table.from_arrays(
        [ev_t.column(f.name) if f.name in EVENT_SCHEMA.names else nulls[f.name] for f in SCHEMA],
        schema=SCHEMA,
    )
    table = pa.concat_tables([ev_full, sum_t]).take(pa.array(order))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA) as writer:
        for b in table.combine_chunks().to_batches():
            writer.write_batch(b)
    return sink.getvalue().to_pybytes(), [(CONTENT_TYPE_HEADER, ARROW_CONTENT_TYPE.encode())]


def decode_arrow_with_summaries(data: bytes) -> list[Event | SummaryEvent]:
    """Rows of an Arrow message in order: summaries as :class:`SummaryEvent` (each
    checked as the JSON decoder checks one), the rest through the ordinary validation."""
    batch = _read_stream(data)
    if batch.num_rows == 0:
        raise EventDecodeError("empty message: no events")
    is_sum = (
        np.asarray(pc.fill_null(pc.equal(batch.column("kind"), "summary"), False))
        if "kind" in batch.schema.names
        else np.zeros(batch.num_rows, bool)
    )
    out: list[Any] = [None] * batch.num_rows
    rest = np.flatnonzero(~is_sum)
    if rest.size:
        table = validate_table(batch.take(pa.array(rest)))
        for i, ev in zip(rest.tolist(), table_events(table), strict=True):
            out[i] = ev
    for i in np.flatnonzero(is_sum).tolist():
        row = batch.slice(i, 1).to_pylist()[0]
        doc = {k: v for k, v in row.items() if v is not None and k in _SUMMARY_FIELDS}
        if "conns" in row and row["conns"] is not None:
            doc["peers"] = [{k: v for k, v in c.items() if v is not None} for c in row["conns"]]
        try:
            s = msgspec.convert(doc, SummaryEvent)
        except msgspec.ValidationError as err:
            raise EventDecodeError(f"{err} - at row {i} (summary)") from None
        if (bad := _check_summary(s)) is not None:
            raise EventDecodeError(f"summary breaks the contract: {bad} - at row {i}")
        out[i] = s
    return out


_SUMMARY_FIELDS = {"kind", *_IDENT, "bytes", *SUMMARY_COLUMNS.names}

assert set(SUMMARY_COLUMNS.names).isdisjoint(EVENT_SCHEMA.names)
