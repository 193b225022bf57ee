"""Messages (JSON or Arrow IPC) → validated columns: the one decoding pass of the
worker (:func:`decode_block`) and its one-message forms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from producers.columnar.arrays import ColumnBlock, EventColumns, split_by_comm
from producers.columnar.rules import _one_batch, validate_table
from producers.columnar.schema import EVENT_SCHEMA
from producers.columnar.tables import _to_events, events_table
from producers.columnar.wire import _read_stream, is_arrow
from producers.events import Event, EventDecodeError, decode_message


def decode_arrow(data: bytes) -> list[EventColumns]:
    """The events of one Arrow IPC message, one :class:`EventColumns` per communicator
    (in order of first appearance; rows in message order). Raises
    :class:`~producers.events.EventDecodeError` for anything the contract refuses,
    including an empty message."""
    table = validate_table(_read_stream(data))
    if table.num_rows == 0:
        raise EventDecodeError("empty message: no events")
    return split_by_comm(table)


def decode_events(data: bytes, content_type: bytes | str | None) -> list[Event]:
    """One message in either form → event objects (for readers that want objects)."""
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


Message = tuple[bytes, bytes | str | None]
"""A Kafka message's value and its ``content-type`` header (None: none)."""


def _json_rows(events: Sequence[Event]) -> pa.RecordBatch | None:
    """Decoded JSON events as validated rows (the decoder checked every rule already),
    or None when a value does not fit its column (a ``rank`` beyond ``int32``: a bound
    of the edge, not of the decoder, refuses it; the caller keeps such messages as
    objects, so that their dead letter names the rule as before)."""
    try:
        return _one_batch(events_table(events))
    except (OverflowError, pa.ArrowInvalid):
        return None


def decode_block(
    messages: Sequence[Message], read: Mapping[int, Sequence[Event]] | None = None
) -> tuple[list[int | EventDecodeError | list[Event]], ColumnBlock | None]:
    """A consumer batch (value, content type per message), JSON and Arrow IPC alike,
    as one :class:`ColumnBlock`: per message its index ``k`` in the block (rows
    ``block.starts[k]:block.starts[k+1]``, messages in batch order) or why it cannot be
    read (:class:`~producers.events.EventDecodeError`, its text the dead letter's
    reason). Two rare cases stay lists of event objects: a JSON message without events
    (``[]``) and one whose values do not fit the columns (see :func:`_json_rows`).

    JSON is decoded by msgspec (every rule of :mod:`producers.events` and its error
    texts), then all the batch's JSON events become columns in one pass. A small batch
    costs ~100 µs to validate and convert whatever its size, so the Arrow messages of a
    batch are validated together (one pass over their concatenated rows), and only when
    that pass finds a problem one by one, so the error names the message it is in.
    Oversize, truncated or crafted messages are refused by :func:`_read_stream` before
    any of their values is read. ``read``: messages already read as event objects, by
    position (summaries expanded at the source): their events join the JSON ones.
    """
    items: list[int | EventDecodeError | list[Event]] = [[] for _ in messages]
    arrow: list[tuple[int, pa.RecordBatch]] = []
    json_at: list[tuple[int, int, int]] = []  # (message, first event, end)
    events: list[Event] = []
    read = read or {}
    for i, (data, ct) in enumerate(messages):
        try:
            if i in read:
                got = read[i]
                if got:
                    json_at.append((i, len(events), len(events) + len(got)))
                    events += got
            elif is_arrow(ct, data):
                batch = _read_stream(data)
                if batch.num_rows == 0:
                    raise EventDecodeError("empty message: no events")
                arrow.append((i, batch))
            else:
                got = decode_message(data)
                if got:
                    json_at.append((i, len(events), len(events) + len(got)))
                    events += got
        except EventDecodeError as err:
            items[i] = err
    good, whole = _valid_arrow(arrow, items)
    parts: dict[int, pa.RecordBatch] = dict(good)
    rows = None
    if events:
        rows = _json_rows(events)
        for i, a, b in json_at:
            if rows is None:  # one by one: only the messages that do not fit stay objects
                one = _json_rows(events[a:b])
                if one is None:
                    items[i] = events[a:b]
                    continue
                parts[i] = one
            else:
                parts[i] = rows.slice(a, b - a)
    if not parts:
        return items, None
    order = sorted(parts)
    starts = np.zeros(len(order) + 1, np.int64)
    np.cumsum([parts[i].num_rows for i in order], out=starts[1:])
    for k, i in enumerate(order):
        items[i] = k
    if not arrow and rows is not None and len(order) == len(json_at):
        whole = rows  # JSON only: the rows are in message order already
    elif events or whole is None:
        whole = _concat([parts[i] for i in order])
    return items, ColumnBlock(whole, starts)


def _valid_arrow(
    arrow: list[tuple[int, pa.RecordBatch]], items: list[int | EventDecodeError | list[Event]]
) -> tuple[list[tuple[int, pa.RecordBatch]], pa.RecordBatch | None]:
    """The Arrow messages that pass :func:`validate_table` (together when they can:
    one pass, whose rows come back too), the errors of the others into ``items``."""
    if len(arrow) > 1 and all(b.schema.equals(EVENT_SCHEMA) for _, b in arrow):
        try:
            whole = validate_table(_concat([b for _, b in arrow]))
        except EventDecodeError:
            pass  # find the bad message(s) one by one below
        else:
            starts = np.cumsum([0] + [b.num_rows for _, b in arrow]).tolist()
            return [
                (i, whole.slice(starts[k], b.num_rows)) for k, (i, b) in enumerate(arrow)
            ], whole
    good = []
    for i, b in arrow:
        try:
            good.append((i, validate_table(b)))
        except EventDecodeError as err:
            items[i] = err
    return good, None
