"""Arrow IPC files of events as an input (read like a Parquet file of events).

An Arrow IPC *file* (``pyarrow.ipc.new_file``: magic ``ARROW1``) or *stream*
(``pyarrow.ipc.new_stream`` written to a file: it starts with the continuation marker
``ff ff ff ff``) whose columns are :data:`producers.columnar.EVENT_SCHEMA` (optionally
with the archive's Kafka origin columns) is read whole here and then judged and cut into
messages exactly as a Parquet file is (:mod:`producers.formats.parquet_archive`).

As for Arrow on the wire (:mod:`producers.columnar`), nothing in a file can run code or
read out of bounds: a column read must have a plain type (no extension type, at any
depth; pyarrow ≥ 14 never unpickles one anyway), and every record batch is validated in
full (offsets, lengths) before a value of it is read. A file that breaks this raises
:class:`ValueError` or :class:`pyarrow.ArrowException` with the reason.

>>> looks_like_arrow_ipc(b"ARROW1\\x00\\x00"), looks_like_arrow_ipc(b"\\xff\\xff\\xff\\xff\\x10")
(True, True)
>>> looks_like_arrow_ipc(b"PAR1"), looks_like_arrow_ipc(b'{"kind":"op"}')
(False, False)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from producers.formats.magic import ARROW_FILE_MAGIC, looks_like_arrow_ipc

__all__ = ["looks_like_arrow_ipc", "read_ipc_table"]


def _extension_in(t: pa.DataType) -> bool:
    """Whether ``t`` is, or holds at any depth, an extension type."""
    if isinstance(t, pa.BaseExtensionType):
        return True
    if pa.types.is_dictionary(t):
        return _extension_in(t.value_type)
    return any(_extension_in(t.field(i).type) for i in range(t.num_fields))


def read_ipc_table(path: str | Path, columns: Iterable[str]) -> pa.Table:
    """The ``columns`` (those present) of an Arrow IPC file or stream, every batch
    validated in full. Read through a plain file (not a memory map: a file cut short
    while mapped would crash the process instead of raising)."""
    with pa.OSFile(str(path), "rb") as src:
        ipc_file = src.read(6) == ARROW_FILE_MAGIC
        src.seek(0)
        if ipc_file:
            reader = pa.ipc.open_file(src)
            schema = reader.schema
            get = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            stream = pa.ipc.open_stream(src)
            schema = stream.schema
            get = iter(stream)
        if len(set(schema.names)) != len(schema.names):
            raise ValueError("duplicate column names")
        wanted = [c for c in columns if c in schema.names]
        for name in wanted:
            if _extension_in(schema.field(name).type):
                raise ValueError(
                    f"column `{name}` has extension type {schema.field(name).type}; "
                    "only plain Arrow types are read"
                )
        batches = []
        for batch in get:
            # the reader trusts offsets and lengths: check them before reading a value
            batch.validate(full=True)
            batches.append(batch.select(wanted))
    return pa.Table.from_batches(batches, schema=pa.schema([schema.field(n) for n in wanted]))
