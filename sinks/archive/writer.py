"""Rolling, crash-safe Parquet files of one hive-partitioned dataset.

A file is written under a hidden temp name in its final directory
(``.part-….parquet.inprogress``: both pyarrow's dataset discovery, which skips names
starting with ``.``, and a ``*.parquet`` glob ignore it) and becomes visible only when
complete::

    write row groups → close (footer) → fsync(file) → rename → fsync(dir)

so a reader never sees a half-written file and a crash leaves at most a stale temp
file, never a torn ``.parquet``. A write that fails (a full disk: ENOSPC) loses the
open files' rows, not the data: :meth:`DatasetWriter.discard` drops every open file
and its temp (none is left behind), and :meth:`DatasetWriter.pending_offsets` keeps
naming their lowest offsets until :meth:`DatasetWriter.forget_lost`, so the consumer
commits nothing past them and reads them again from Kafka.

Rows are *durable* once their file is renamed; the writer reports, per Kafka partition,
the lowest offset still held only in open (non-durable) files so the consumer commits
nothing beyond it.

Files roll when they reach ``roll_bytes`` on disk or ``roll_seconds`` of age; rows
are buffered in memory up to ``row_group_bytes`` (uncompressed) and written as one
row group, so row groups stay large however small the consumer batches are.

>>> import tempfile, pyarrow.parquet as pq
>>> from sinks.archive.schemas import VERDICTS
>>> root = Path(tempfile.mkdtemp())
>>> w = DatasetWriter(root / "verdicts", VERDICTS, RollPolicy(roll_seconds=60))
>>> rows = {f.name: [None] for f in VERDICTS}
>>> rows.update(v=[1], id=["v1"], ts_us=[1_795_983_300_000_000], comm=["0xa"], host=["h1"],
...             fault=["straggler"], score=[0.5], reason=["late"], window_start_us=[0],
...             window_end_us=[1], evidence=["{}"], benign=[False], kafka_topic=["t"],
...             kafka_partition=[0], kafka_offset=[7], kafka_index=[0])
>>> w.write(pa.Table.from_pydict(rows, schema=VERDICTS), pa.array(["job-1"]))
[]
>>> w.pending_offsets()
{('t', 0): 7}
>>> [p.relative_to(root).parent.as_posix() for p in w.close_all()]
['verdicts/job=job-1/hour=2026-11-29T20']
>>> w.pending_offsets()
{}
>>> import shutil; shutil.rmtree(root)
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = [
    "TEMP_SUFFIX",
    "DatasetWriter",
    "RollPolicy",
    "fsync_dir",
    "hour_partitions",
    "job_partition",
    "sweep_stale_temps",
    "write_parquet_atomic",
]

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".inprogress"
#: What pyarrow and Hive use for a null or empty partition value.
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
_PARQUET_OPTIONS = {"compression": "zstd", "use_dictionary": True, "write_statistics": True}


@dataclass(frozen=True, slots=True)
class RollPolicy:
    """When a file is closed and a new one started."""

    roll_bytes: int = 128 * 1024 * 1024
    """Close a file once this many bytes are on disk (compressed)."""
    roll_seconds: float = 300.0
    """Close a file this long after it was opened, however small: bounds how long rows
    wait to become durable, hence how far committed offsets lag and how many rows a
    crash can duplicate."""
    row_group_bytes: int = 64 * 1024 * 1024
    """Buffer up to this many uncompressed bytes before writing a row group."""
    max_open_files: int = 64
    """Open (job, hour) files per dataset; the oldest is closed to open another."""

    def __post_init__(self) -> None:
        if self.roll_bytes <= 0 or self.roll_seconds <= 0 or self.max_open_files < 1:
            raise ValueError(
                "roll_bytes and roll_seconds must be > 0 and max_open_files >= 1, got "
                f"{self.roll_bytes}, {self.roll_seconds}, {self.max_open_files}"
            )


# --------------------------------------------------------------------------- filesystem


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file or subdirectory) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    # fsync through any descriptor flushes the inode's data (Linux, POSIX).
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs_durable(path: Path) -> None:
    """``mkdir -p`` that also fsyncs the parent of every directory it creates."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def _temp_of(final: Path) -> Path:
    return final.with_name(f".{final.name}{TEMP_SUFFIX}")


def _publish(tmp: Path, final: Path) -> None:
    _fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_parquet_atomic(table: pa.Table, final: Path) -> Path:
    """Write one complete file with the same temp → fsync → rename → fsync-dir steps."""
    _make_dirs_durable(final.parent)
    tmp = _temp_of(final)
    pq.write_table(table, tmp, **_PARQUET_OPTIONS)
    _publish(tmp, final)
    return final


def sweep_stale_temps(root: Path, older_than_s: float, now: float | None = None) -> list[Path]:
    """Delete temp files of crashed writers (untouched for ``older_than_s`` seconds).

    A live writer closes every file within ``roll_seconds`` of opening it, so a temp
    file much older than that belongs to a dead process. Returns what was removed.
    """
    now = time.time() if now is None else now
    removed = []
    for tmp in root.rglob(f".*{TEMP_SUFFIX}"):
        try:
            if now - tmp.stat().st_mtime > older_than_s:
                tmp.unlink()
                removed.append(tmp)
        except FileNotFoundError:  # finished or swept by someone else meanwhile
            continue
    return removed


# --------------------------------------------------------------------------- partitions


def job_partition(job: str | None) -> str:
    """The ``job=`` directory name; URI-encoded as pyarrow and DuckDB decode it.

    >>> job_partition("train/llama-70b"), job_partition("")
    ('job=train%2Fllama-70b', 'job=__HIVE_DEFAULT_PARTITION__')
    """
    return f"job={quote(job, safe='') if job else NULL_PARTITION}"


def hour_partitions(ts_us: pa.Array | np.ndarray) -> np.ndarray:
    """Hour (UTC) of each microsecond timestamp, as ``2026-11-29T20`` strings.

    >>> hour_partitions(np.array([1_795_983_300_000_000, 0])).tolist()
    ['2026-11-29T20', '1970-01-01T00']
    """
    us = np.asarray(ts_us, dtype=np.int64).astype("datetime64[us]")
    return np.datetime_as_string(us.astype("datetime64[h]"), unit="h")


def _partition_groups(jobs: pa.Array, ts_us: pa.Array) -> Iterator[tuple[str, np.ndarray]]:
    """``(relative dir, row indices)`` for each (job, hour) present in a batch."""
    hours = hour_partitions(ts_us)
    keys = pc.binary_join_element_wise(jobs, pa.array(hours, pa.string()), "\x00")
    enc = keys.dictionary_encode()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    for idx in np.split(order, bounds):
        if len(idx) == 0:
            continue
        job, hour = enc.dictionary[codes[idx[0]]].as_py().rsplit("\x00", 1)
        yield f"{job_partition(job)}/hour={hour}", idx


# --------------------------------------------------------------------------- writer


@dataclass(slots=True)
class _OpenFile:
    final: Path
    tmp: Path
    writer: pq.ParquetWriter
    opened_at: float
    pending: list[pa.Table] = field(default_factory=list)
    pending_bytes: int = 0
    rows: int = 0
    disk_bytes: int = 0
    min_offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    def flush_row_group(self) -> None:
        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending), row_group_size=1 << 30)
            self.pending.clear()
            self.pending_bytes = 0
            self.disk_bytes = self.tmp.stat().st_size


class DatasetWriter:
    """Rolling Parquet files of one dataset: ``root/job=<job>/hour=<hour>/part-….parquet``.

    Not thread-safe; one per dataset per consumer. Tables must carry the ``kafka_topic``,
    ``kafka_partition``, ``kafka_offset`` and ``ts_us`` columns of the archive schemas.
    """

    def __init__(
        self,
        root: Path,
        schema: pa.Schema,
        policy: RollPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        writer_id: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.schema = schema
        self.policy = policy
        self._clock = clock
        self._id = writer_id or uuid.uuid4().hex[:8]
        self._seq = 0
        self._open: dict[str, _OpenFile] = {}
        self._lost: dict[tuple[str, int], int] = {}
        """Lowest offsets of rows dropped with a failed file, until read again."""
        self.files_written = 0
        self.rows_written = 0

    # ---- writing

    def write(self, table: pa.Table, jobs: pa.Array) -> list[Path]:
        """Append rows (partitioned by ``jobs`` and the hour of ``ts_us``).

        Returns the files completed (made durable) while doing so.
        """
        if table.num_rows == 0:
            return []
        if not table.schema.equals(self.schema):
            raise TypeError(f"table schema differs from the {self.root.name} schema")
        done: list[Path] = []
        for rel, idx in _partition_groups(jobs, table.column("ts_us")):
            part = table.take(pa.array(idx)) if len(idx) != table.num_rows else table
            f = self._open.get(rel)
            if f is None:
                if len(self._open) >= self.policy.max_open_files:
                    oldest = min(self._open, key=lambda k: self._open[k].opened_at)
                    done.append(self._complete(oldest))
                f = self._open_file(rel)
            self._track_offsets(f, part)
            f.pending.append(part)
            f.pending_bytes += part.nbytes
            f.rows += part.num_rows
            if f.pending_bytes >= min(self.policy.row_group_bytes, self.policy.roll_bytes):
                f.flush_row_group()
            if f.disk_bytes >= self.policy.roll_bytes:
                done.append(self._complete(rel))
        return done

    def roll_due(self) -> list[Path]:
        """Complete every file older than ``roll_seconds``; call this even when idle."""
        now = self._clock()
        due = [k for k, f in self._open.items() if now - f.opened_at >= self.policy.roll_seconds]
        return [self._complete(k) for k in due]

    def close_all(self) -> list[Path]:
        """Complete every open file (shutdown, partition revocation)."""
        return [self._complete(k) for k in list(self._open)]

    def abort_all(self) -> None:
        """Drop open files without publishing them (their rows were never committed)."""
        self.discard()

    def discard(self) -> None:
        """Drop every open file and its temp, even on a full disk (a failed write leaves
        a file unusable); their offsets stay in :meth:`pending_offsets` until
        :meth:`forget_lost`."""
        for f in self._open.values():
            self._drop(f)
        self._open.clear()

    def forget_lost(self) -> None:
        """The consumer reads the dropped rows again: stop holding their offsets."""
        self._lost.clear()

    def reread(self, records: Iterable[Any]) -> None:
        """Records (with ``tp``) consumed again: their partitions need no holding any
        more. (A partition's dropped rows are held only across the commit of a stop or a
        revocation; whatever it delivers next starts at a committed offset at or below
        them, or past them when another member archived them meanwhile.)"""
        if self._lost:
            for rec in records:
                self._lost.pop(rec.tp, None)

    def _drop(self, f: _OpenFile) -> None:
        try:
            f.writer.close()
        except Exception as err:  # ENOSPC again on the footer: the file is dropped anyway
            log.debug("closing %s while dropping it: %s", f.tmp, err)
        f.tmp.unlink(missing_ok=True)
        for tp, off in f.min_offsets.items():
            self._lost[tp] = min(off, self._lost.get(tp, off))

    # ---- offsets

    def pending_offsets(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition): the lowest Kafka offset with rows not yet durable."""
        out: dict[tuple[str, int], int] = dict(self._lost)
        for f in self._open.values():
            for tp, off in f.min_offsets.items():
                if off < out.get(tp, off + 1):
                    out[tp] = off
        return out

    @property
    def open_files(self) -> int:
        return len(self._open)

    # ---- internals

    def _open_file(self, rel: str) -> _OpenFile:
        directory = self.root / rel
        _make_dirs_durable(directory)
        self._seq += 1
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        final = directory / f"part-{stamp}-{self._id}-{self._seq:06d}.parquet"
        tmp = _temp_of(final)
        try:
            writer = pq.ParquetWriter(tmp, self.schema, **_PARQUET_OPTIONS)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        f = _OpenFile(final, tmp, writer, self._clock())
        self._open[rel] = f
        return f

    @staticmethod
    def _track_offsets(f: _OpenFile, part: pa.Table) -> None:
        topics = part.column("kafka_topic")
        parts = part.column("kafka_partition").to_numpy()
        offs = part.column("kafka_offset").to_numpy()
        topic_codes = topics.dictionary_encode().combine_chunks()
        tnames = topic_codes.dictionary.to_pylist()
        tcodes = topic_codes.indices.to_numpy(zero_copy_only=False)
        # one key per (topic, partition); min offset of each via a sort, not a loop per row
        key = tcodes.astype(np.int64) * (1 << 32) + parts.astype(np.int64)
        order = np.lexsort((offs, key))
        first = np.concatenate(([True], np.diff(key[order]) != 0))
        for i in order[first]:
            tp = (tnames[tcodes[i]], int(parts[i]))
            off = int(offs[i])
            if off < f.min_offsets.get(tp, off + 1):
                f.min_offsets[tp] = off

    def _complete(self, rel: str) -> Path:
        f = self._open.pop(rel)
        try:
            f.flush_row_group()
            f.writer.close()
            _publish(f.tmp, f.final)
        except BaseException:
            self._drop(f)  # no temp left behind; its rows are read again
            raise
        self.files_written += 1
        self.rows_written += f.rows
        log.debug("archived %s (%d rows, %d bytes)", f.final, f.rows, f.final.stat().st_size)
        return f.final
