"""The collective-event contract as columns: Arrow IPC record batches on the wire.

The package, one job per module: :mod:`.schema` (the columns), :mod:`.rules`
(validation), :mod:`.tables` (objects ↔ tables), :mod:`.wire` (the IPC codec),
:mod:`.arrays` (the numpy columns the core reads), :mod:`.decode` (messages →
columns: :func:`decode_block` for a consumer batch of JSON and Arrow messages alike),
:mod:`.blocks` (many messages as one set of columns for ``detect``). The names below
are re-exported here.

A message on ``c4.events`` is a JSON array of events or an Arrow IPC stream (header
``content-type: application/vnd.apache.arrow.stream``); both become validated rows of
:data:`EVENT_SCHEMA`, nothing in a message can run code, and sizes are bounded
(docs/wire-formats.md).

>>> from producers.events import OpEvent, Conn, ProgressEvent, encode_message
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
>>> items, block = decode_block([(encode_message([op]), None), (data, ARROW_CONTENT_TYPE)])
>>> items, block.starts.tolist()
([0, 1], [0, 1, 3])
>>> decode_arrow(b"{not arrow")
Traceback (most recent call last):
...
producers.events.EventDecodeError: not an Arrow IPC stream: ...
"""

from __future__ import annotations

from producers.columnar.arrays import (
    ColumnBlock,
    EventColumns,
    LazyEvents,
    core_arrays,
    slice_arrays,
    split_by_comm,
)
from producers.columnar.decode import (
    decode_arrow,
    decode_block,
    decode_events,
)
from producers.columnar.rules import validate_table
from producers.columnar.schema import (
    ARROW_CONTENT_TYPE,
    CONN_TYPE,
    CONTENT_TYPE_HEADER,
    EVENT_SCHEMA,
    JSON_CONTENT_TYPE,
    MAX_CONNS,
    MAX_DECODED_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_ROWS,
    WireFormat,
)
from producers.columnar.tables import events_table, table_events
from producers.columnar.wire import (
    _read_stream,  # noqa: F401  (producers.summary_arrow reads summary streams with it)
    content_type_of,
    encode_arrow,
    encode_batch,
    is_arrow,
)

__all__ = [
    "ARROW_CONTENT_TYPE",
    "CONN_TYPE",
    "CONTENT_TYPE_HEADER",
    "ColumnBlock",
    "EVENT_SCHEMA",
    "JSON_CONTENT_TYPE",
    "MAX_CONNS",
    "MAX_DECODED_BYTES",
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
    "encode_arrow",
    "encode_batch",
    "events_table",
    "is_arrow",
    "split_by_comm",
    "table_events",
    "validate_table",
]
