"""The wire codec: Arrow IPC streams of events, content types, and reading a stream
safely (size bounds before decompression, full validation of offsets before a value is
read; the IPC reader builds plain arrays, pyarrow ≥ 14 never unpickles extension types).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa

from producers.columnar.rules import _one_batch
from producers.columnar.schema import (
    ARROW_CONTENT_TYPE,
    CONTENT_TYPE_HEADER,
    EVENT_SCHEMA,
    JSON_CONTENT_TYPE,
    MAX_DECODED_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_ROWS,
    WireFormat,
)
from producers.columnar.tables import events_table
from producers.events import Event, EventDecodeError, encode_message


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
