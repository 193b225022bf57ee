"""The event contract as columns: the Arrow schema of the wire and the archive, the
field groups per kind, and the size bounds of a message.

The column names and meanings are the event contract's (:mod:`producers.events`; the
JSON Schema in ``contracts/`` stays the source of truth). ``kind`` tells ``op`` rows
from ``progress`` rows, fields the other kind lacks are null, absent optional fields
are null, and ``conns`` is a ``list<struct<peer, dir, bytes, time_us, retrans>>``.

>>> EVENT_SCHEMA.names[:4], [f.name for f in CONN_TYPE]
(['kind', 'v', 'job', 'comm'], ['peer', 'dir', 'bytes', 'time_us', 'retrans'])
"""

from __future__ import annotations

from typing import Literal

import msgspec
import msgspec.inspect
import pyarrow as pa

from producers.events import Conn, OpEvent, ProgressEvent, _Identity

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


def _fields(cls: type, *, required: bool | None = None, own: bool = False) -> tuple[str, ...]:
    """Field names of an event struct in declaration order (``own``: not the identity's;
    ``required``: only those without a default, or only those with one)."""
    skip = set(_Identity.__struct_fields__) if own else set()
    return tuple(
        f.name
        for f in msgspec.structs.fields(cls)
        if f.name not in skip and f.name != "conns" and required in (None, f.required)
    )


# The field groups of the contract, read from its structs (one definition: events.py).
_IDENTITY = _fields(_Identity)
_IDENTITY_REQUIRED = ("kind", *_fields(_Identity, required=True))
_OP_ONLY = _fields(OpEvent, own=True)
_OP_REQUIRED = _fields(OpEvent, own=True, required=True)
_PROGRESS_ONLY = _fields(ProgressEvent, own=True)
_PROGRESS_REQUIRED = _fields(ProgressEvent, own=True, required=True)
_CONN_REQUIRED = _fields(Conn, required=True)
_NON_EMPTY = tuple(
    f.name
    for f in msgspec.inspect.type_info(_Identity).fields  # type: ignore[union-attr]
    if isinstance(f.type, msgspec.inspect.StrType) and (f.type.min_length or 0) >= 1
)
"""String fields that must not be empty (``min_length=1``)."""


#: Where an archived row came from (``sinks.archive``): the four first identify one
#: produced event exactly (the archive's dedupe key, :data:`ORIGIN`).
SOURCE_FIELDS = [
    pa.field("kafka_topic", pa.string(), nullable=False),
    pa.field("kafka_partition", pa.int32(), nullable=False),
    pa.field("kafka_offset", pa.int64(), nullable=False),
    pa.field("kafka_index", pa.int32(), nullable=False),
    pa.field("kafka_ts_ms", pa.int64()),
]
ORIGIN = ("kafka_topic", "kafka_partition", "kafka_offset", "kafka_index")

#: The events archive's rows (``c4stream archive``): the wire's columns without ``job``
#: (a partition directory there), ``v`` widened as archived since the first release,
#: then where each row came from.
ARCHIVE_EVENT_SCHEMA = pa.schema(
    [
        pa.field("v", pa.int16(), nullable=False) if f.name == "v" else f
        for f in EVENT_SCHEMA
        if f.name != "job"
    ]
    + SOURCE_FIELDS
)
