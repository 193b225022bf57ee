"""The Parquet archive of ``c4.events`` (what ``c4stream archive`` writes) as an input.

A user replays an archived day through ``c4stream detect`` with other thresholds, or
back into Kafka with ``c4stream replay``: point either at the archive's ``events``
directory (``events/job=<job>/hour=<hour>/part-….parquet``), an hour of it, or files.

Each file is read whole (the archiver rolls files at ``--roll-bytes``, 128 MiB by
default), checked against the contract (:func:`producers.columnar.validate_table`:
the same rules as a Kafka message; a file that breaks them is reported as
``file:0: reason`` and skipped) and cut back into the messages it was archived from:

* rows carry their Kafka origin (``kafka_topic``, ``kafka_partition``, ``kafka_offset``,
  ``kafka_index``): a message is the rows of one (topic, partition, offset), in
  ``kafka_index`` order; a message archived twice (an archiver crash writes the rows
  it had not committed again, into a later file of the same ``job=/hour=`` directory)
  is read once: the files of one directory share a :class:`SeenMessages` (8 bytes per
  message, not per event);
* messages come out in the order they were archived (the archiver's consumption order,
  which is what a worker saw); :func:`producers.sources.open_sources` merges the files
  of one directory by the second of their messages' earliest ``ts_us`` (files of one
  archiver follow each other; files of several archivers interleave), and
  directories (hours, jobs) by ``ts_us`` as every input;
* a Parquet file of events without those columns is cut into one message per
  communicator per second of ``ts_us``, as replay groups converted input.

An Arrow IPC file or stream file of events (:mod:`producers.formats.arrow_ipc`) is
read by the same functions: only the step that reads the file's columns differs.

The ``job`` of the rows is the hive directory ``job=<job>`` above the file (URI-decoded,
as the archiver wrote it); without one, the ``job`` given by the caller.

>>> looks_like_parquet(b"PAR1\\x15\\x04"), looks_like_parquet(b'{"kind":"op"}')
(True, False)
>>> job_from_path("/a/events/job=train%2F7/hour=2026-11-29T20/part-1.parquet")
'train/7'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from producers.columnar import (
    EVENT_SCHEMA,
    EventColumns,
    core_arrays,
    slice_arrays,
    split_by_comm,
    validate_table,
)
from producers.columnar.blocks import _GROUP_US, ArchiveBlock, cut_blocks
from producers.columnar.schema import ORIGIN
from producers.events import EventDecodeError
from producers.formats.arrow_ipc import looks_like_arrow_ipc, read_ipc_table
from producers.formats.magic import looks_like_parquet
from producers.traces import BadLine

__all__ = [
    "SeenMessages",
    "job_from_path",
    "looks_like_parquet",
    "read_parquet_blocks",
    "read_parquet_columns",
]

_ORIGIN = ORIGIN
_WANTED = (*EVENT_SCHEMA.names, *_ORIGIN)


def job_from_path(path: str | Path) -> str | None:
    """The job of a hive-partitioned archive file: the nearest ``job=<job>`` directory."""
    for part in reversed(Path(path).parent.parts):
        if part.startswith("job="):
            return unquote(part[4:]) or None
    return None


class SeenMessages:
    """Kafka messages already read from the files of one archive directory."""

    def __init__(self) -> None:
        self._keys: dict[str, list[np.ndarray]] = {}

    def drop_seen(self, topic: str, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` (partition << 40 | offset, one per message) not seen before;
        remembers them."""
        old = self._keys.setdefault(topic, [])
        fresh = np.ones(len(keys), bool)
        for arr in old:
            fresh &= ~np.isin(keys, arr, assume_unique=True)
        old.append(np.unique(keys[fresh]))
        return fresh


def _message_order(table: pa.Table, seen: SeenMessages | None) -> tuple[np.ndarray, np.ndarray]:
    """Row order (deduplicated) and the start of each message in it."""
    ts = table.column("ts_us").to_numpy()
    n = len(ts)
    if all(c in table.column_names for c in _ORIGIN) and not any(
        table.column(c).null_count for c in _ORIGIN
    ):
        topic = pc.dictionary_encode(table.column("kafka_topic")).combine_chunks()
        keys = [np.asarray(topic.indices.to_numpy(), np.int64)] + [
            table.column(c).to_numpy().astype(np.int64) for c in _ORIGIN[1:]
        ]
        o = np.lexsort(keys[::-1])  # by topic, partition, offset, index
        k = np.stack([a[o] for a in keys])
        keep = np.ones(n, bool)
        keep[1:] = (k[:, 1:] != k[:, :-1]).any(axis=0)  # a duplicate repeats the whole key
        o = o[keep]
        msg = np.stack([a[o] for a in keys[:3]])
        if seen is not None and len(o):
            topics = topic.dictionary.to_pylist()
            fresh = np.ones(len(o), bool)
            new_msg = np.ones(len(o), bool)
            new_msg[1:] = (msg[:, 1:] != msg[:, :-1]).any(axis=0)
            starts = np.flatnonzero(new_msg)
            msg_key = (msg[1, starts] << 40) | msg[2, starts]
            for t, name in enumerate(topics):
                sel = msg[0, starts] == t
                keep_msg = np.ones(len(starts), bool)
                keep_msg[sel] = seen.drop_seen(name, msg_key[sel])
                fresh &= np.repeat(keep_msg, np.diff(np.append(starts, len(o))))
            o, msg = o[fresh], msg[:, fresh]
    else:  # plain events: one message per communicator per second
        comm = pc.dictionary_encode(table.column("comm")).combine_chunks().indices
        c = np.asarray(comm.to_numpy(), np.int64)
        w = ts // _GROUP_US
        o = np.lexsort((np.arange(n), c, w))
        msg = np.stack([w[o], c[o]])
    if len(o) == 0:
        return o, np.empty(0, np.int64)
    new = np.ones(len(o), bool)
    new[1:] = (msg[:, 1:] != msg[:, :-1]).any(axis=0)
    starts = np.flatnonzero(new)
    bounds = np.append(starts, len(o))
    # messages in the order they were archived (the archiver's consumption order: what
    # the worker saw), i.e. by their first row in the file
    order = np.argsort(np.minimum.reduceat(o, starts), kind="stable")
    sizes = np.diff(bounds)[order]
    new_starts = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=new_starts[1:])
    # each message's rows moved as a run: row j of the result is o[its run's old start
    # + (j - its run's new start)]
    rows = o[np.repeat(starts[order] - new_starts, sizes) + np.arange(len(o))]
    return rows, new_starts


def _read_parquet(path: Path) -> pa.Table:
    """The contract and Kafka origin columns of a Parquet file."""
    pf = pq.ParquetFile(path)
    present = set(pf.schema_arrow.names)
    wanted = [f for f in _WANTED if f in present]
    # one thread: detect is CPU-bound in one process, and threads cost more CPU in all
    return pf.read(columns=wanted, use_threads=False)


def _read_ordered(
    path: Path, job: str, on_bad: Callable[[BadLine], None] | None, seen: SeenMessages | None
) -> tuple[pa.RecordBatch, np.ndarray, np.ndarray] | None:
    """The file's validated rows in message order, each message's first row number in
    the file, and where each message starts; ``None`` when the file is bad or empty.
    The file is Parquet or Arrow IPC (file or stream), told by its first bytes."""
    name = str(path)

    def bad(reason: str) -> None:
        if on_bad is not None:
            on_bad(BadLine(name, 0, b"", reason))

    what = "events"
    try:
        with open(path, "rb") as fh:
            ipc = looks_like_arrow_ipc(fh.read(8))
        what = "Arrow IPC" if ipc else "Parquet"
        table = read_ipc_table(path, _WANTED) if ipc else _read_parquet(path)
    except (pa.ArrowException, OSError, ValueError) as err:
        bad(f"unreadable {what} file: {err}")
        return None
    present = set(table.column_names)
    if "kind" not in present or "comm" not in present:
        bad(f"{what} file is not an events archive (no `kind`/`comm` columns)")
        return None
    if "job" not in present:
        the_job = job_from_path(path) or job
        table = table.append_column(
            "job", pa.repeat(pa.scalar(the_job, pa.string()), table.num_rows)
        )
    try:
        checked = validate_table(table)
    except EventDecodeError as err:
        bad(f"{what} events break the contract: {err}")
        return None
    keyed = pa.Table.from_batches([checked])
    for c in _ORIGIN:
        if c in table.column_names:
            keyed = keyed.append_column(c, table.column(c))
    rows, starts = _message_order(keyed, seen)
    if rows.size == 0:
        return None
    # one gather into message order (none when the file is in it already, as one
    # archiver writes it); messages are then zero-copy slices of it
    if len(rows) == checked.num_rows and (rows == np.arange(len(rows))).all():
        return checked, rows[starts], starts
    return checked.take(pa.array(rows)), rows[starts], starts


def read_parquet_columns(
    path: str | Path,
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
    seen: SeenMessages | None = None,
) -> Iterator[tuple[int, pa.RecordBatch, list[EventColumns]]]:
    """``(first row number in the file, validated rows of one message, the message as
    :class:`~producers.columnar.EventColumns`, one per communicator)``, in the order
    the messages were archived; an unreadable or non-contract file goes to ``on_bad``.
    ``seen``: shared by the files of one directory, so a message is read once. The
    numpy columns are slices of arrays built once for the whole file: per message, no
    Arrow call at all."""
    got = _read_ordered(Path(path), job, on_bad, seen)
    if got is None:
        return
    ordered, first_rows, starts = got
    arrays = core_arrays(ordered)
    enc = pc.dictionary_encode(ordered.column("comm"))
    codes = np.asarray(enc.indices.to_numpy(), np.int64)
    names = enc.dictionary.to_pylist()
    ends = np.append(starts[1:], ordered.num_rows)
    for row, s, e in zip(first_rows.tolist(), starts.tolist(), ends.tolist(), strict=True):
        part = ordered.slice(s, e - s)
        c = codes[s:e]
        if c.min() == c.max():  # the usual case: one communicator per message
            cols = [EventColumns(names[c[0]], part, slice_arrays(arrays, s, e))]
        else:
            cols = split_by_comm(part)
        yield row, part, cols


def read_parquet_blocks(
    path: str | Path,
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
    seen: SeenMessages | None = None,
    max_rows: int = 65_536,
    by_second: bool = True,
) -> Iterator[tuple[int, ArchiveBlock]]:
    """As :func:`read_parquet_columns`, many messages at a time: ``(first row number in
    the file of the block's first message, the block)``. A block holds consecutive
    messages, at most ``max_rows`` rows (whole messages; at least one); with
    ``by_second``, only messages whose earliest ``ts_us`` falls in the same second —
    the key :func:`producers.sources.open_sources` merges the files of one directory
    by, so merging blocks orders the messages as merging them one by one would (a
    file read alone needs no such cut)."""
    got = _read_ordered(Path(path), job, on_bad, seen)
    if got is None:
        return
    ordered, first_rows, starts = got
    yield from cut_blocks(ordered, first_rows, starts, max_rows=max_rows, by_second=by_second)
