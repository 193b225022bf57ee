"""Find and remove the duplicates a crash can leave, by the dedupe key.

The key is ``(kafka_topic, kafka_partition, kafka_offset, kafka_index)``
(:data:`~sinks.archive.schemas.DEDUPE_KEY`): one produced record, exactly. A
duplicate always lands in the same ``job=/hour=`` directory as its original (both
come from the record's own job and timestamp), so each directory is checked on its
own and memory stays bounded by one directory.

Removing rewrites only directories that hold duplicates: their files are read in
name order, the first occurrence of each key is kept, one compacted file is published
atomically, then the old files are deleted. Safe beside a running archiver (files it
publishes meanwhile are not touched; run again later) and safe to interrupt (a
re-run removes whatever is left).

Read-side alternative without rewriting: :func:`drop_duplicates` on a table, or the
DuckDB query in ``docs/archive.md``.

>>> t = pa.table({"kafka_topic": ["e", "e", "e"], "kafka_partition": [0, 0, 0],
...               "kafka_offset": [5, 5, 6], "kafka_index": [0, 0, 0], "x": [1, 2, 3]})
>>> count_duplicates(t), drop_duplicates(t).column("x").to_pylist()
(1, [1, 3])
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from sinks.archive.schemas import DEDUPE_KEY, PARTITIONING, SCHEMAS
from sinks.archive.writer import TEMP_SUFFIX, fsync_dir, write_parquet_atomic

__all__ = [
    "DedupeReport",
    "count_duplicates",
    "dedupe_archive",
    "dedupe_dataset",
    "drop_duplicates",
    "open_dataset",
]

log = logging.getLogger(__name__)


def open_dataset(root: Path | str, name: str) -> ds.Dataset:
    """One archived dataset (``events``, ``verdicts`` or ``isolations``) for pyarrow.

    The explicit schemas keep ``job`` a string even when every job name looks like a
    number, and an empty dataset directory still has the right columns.
    """
    schema = SCHEMAS[name]
    for f in PARTITIONING:
        schema = schema.append(f)
    part = ds.partitioning(PARTITIONING, flavor="hive")
    return ds.dataset(Path(root) / name, format="parquet", partitioning=part, schema=schema)


def count_duplicates(table: pa.Table) -> int:
    """Rows beyond the first of each key."""
    keys = table.select(list(DEDUPE_KEY))
    return (
        table.num_rows - keys.group_by(list(DEDUPE_KEY), use_threads=False).aggregate([]).num_rows
    )


def drop_duplicates(table: pa.Table) -> pa.Table:
    """The table with only the first row of each key, in the original order."""
    row = pa.array(range(table.num_rows), pa.int64())
    firsts = (
        table.select(list(DEDUPE_KEY))
        .append_column("__row", row)
        .group_by(list(DEDUPE_KEY), use_threads=False)
        .aggregate([("__row", "min")])
        .column("__row_min")
        .to_numpy()
    )
    return table.take(pa.array(np.sort(firsts)))


@dataclass
class DedupeReport:
    """What one dataset held and what was (or would be) done."""

    dataset: str
    directories: int = 0
    files: int = 0
    rows: int = 0
    duplicates: int = 0
    rewritten_directories: int = 0
    temp_files: int = 0
    """In-progress (or crashed) temp files seen; never part of the dataset."""

    def __str__(self) -> str:
        return (
            f"{self.dataset}: {self.rows} rows in {self.files} files / {self.directories} dirs,"
            f" {self.duplicates} duplicates, {self.rewritten_directories} dirs rewritten,"
            f" {self.temp_files} temp files"
        )


def _data_files(directory: Path) -> list[Path]:
    return sorted(
        p for p in directory.iterdir() if p.suffix == ".parquet" and p.name[0] not in "._"
    )


def dedupe_dataset(root: Path | str, name: str, *, apply: bool) -> DedupeReport:
    """Count (``apply=False``) or remove (``apply=True``) duplicates of one dataset."""
    base = Path(root) / name
    report = DedupeReport(name)
    if not base.is_dir():
        return report
    report.temp_files = sum(1 for _ in base.rglob(f".*{TEMP_SUFFIX}"))
    for directory in sorted({p.parent for p in base.rglob("*.parquet")}):
        files = _data_files(directory)
        if not files:
            continue
        report.directories += 1
        report.files += len(files)
        keys = pa.concat_tables(pq.ParquetFile(f).read(columns=list(DEDUPE_KEY)) for f in files)
        dups = count_duplicates(keys)
        report.rows += keys.num_rows
        report.duplicates += dups
        if dups and apply:
            _rewrite(directory, files)
            report.rewritten_directories += 1
    return report


def _rewrite(directory: Path, files: list[Path]) -> None:
    table = drop_duplicates(pa.concat_tables(pq.ParquetFile(f).read() for f in files))
    # Sorts after the files it replaces, so a re-run keeps this file's rows first.
    out = directory / f"{files[-1].stem}-dedup-{uuid.uuid4().hex[:8]}.parquet"
    write_parquet_atomic(table, out)
    for f in files:
        os.unlink(f)
    fsync_dir(directory)
    log.info("deduplicated %s: %d files -> %s", directory, len(files), out.name)


def dedupe_archive(root: Path | str, *, apply: bool) -> list[DedupeReport]:
    """:func:`dedupe_dataset` over every dataset of an archive root."""
    return [dedupe_dataset(root, name, apply=apply) for name in SCHEMAS]
