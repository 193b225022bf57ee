"""When to checkpoint state, and where: a Faust table of bytes per key.

Checkpoints are taken every N events or S seconds per key, not per event: encoding
a detector and writing a changelog record costs more than detecting on one event.
A restarted (or rebalanced) worker restores a key's last checkpoint from the table,
so at most S seconds (or N events) of state are lost on a crash, none on a clean stop.

>>> due = CheckpointSchedule(every_events=3, every_s=10.0)
>>> due.touch("a", 2, now=0.0); due.take_due(now=1.0)
[]
>>> due.touch("a", 1, now=1.0); due.take_due(now=1.0)
['a']
>>> due.touch("b", 1, now=2.0); due.take_due(now=12.5)
['b']

A checkpoint is bytes in, bytes out (the detector's format is its own business) and
may be larger than a Kafka message (a 4,096-rank communicator's was 1.5 MB, over the
broker's default 1 MB limit, which killed the worker): it is compressed and, when still
too large, split into chunks (:func:`split_checkpoint`), each its own changelog record.

>>> recs = split_checkpoint(b"k", bytes(range(256)) * 4000, chunk_bytes=100, gen=7)
>>> len(recs) > 2, recs[-1][0] == b"k"
(True, True)
>>> join_checkpoint(dict(recs).get, b"k") == bytes(range(256)) * 4000
True
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "CheckpointSchedule",
    "TableCheckpoints",
    "chunk_keys",
    "join_checkpoint",
    "split_checkpoint",
]

log = logging.getLogger(__name__)

_INLINE = b"C4K\x01"
_MANIFEST = b"C4K\x02"
_MAN = struct.Struct("!4sQIQ32s")
"""Manifest: magic, generation, number of chunks, compressed size, sha256 of it."""
#: Largest checkpoint accepted when reassembling (bounds what a forged manifest costs).
MAX_CHECKPOINT_BYTES = 1 << 30


def chunk_keys(key: bytes, gen: int, n: int) -> list[bytes]:
    """Table keys of the chunks of generation ``gen`` (a NUL never occurs in comm ids)."""
    return [key + b"\x00" + struct.pack("!QI", gen, i) for i in range(n)]


def split_checkpoint(
    key: bytes, value: bytes, *, chunk_bytes: int, gen: int
) -> list[tuple[bytes, bytes]]:
    """(table key, record) pairs to write, in order; the record under ``key`` last.

    The value is zlib-compressed; if it fits in ``chunk_bytes`` it is written inline,
    else in chunks under :func:`chunk_keys` followed by a manifest under ``key``
    (generation, count, size, sha256), so a reader never joins chunks of different
    checkpoints: a manifest only names chunks that were written before it.
    """
    packed = zlib.compress(value, 1)
    if len(packed) + len(_INLINE) <= chunk_bytes:
        return [(key, _INLINE + packed)]
    parts = [packed[i : i + chunk_bytes] for i in range(0, len(packed), chunk_bytes)]
    keys = chunk_keys(key, gen, len(parts))
    digest = hashlib.sha256(packed).digest()
    manifest = _MAN.pack(_MANIFEST, gen, len(parts), len(packed), digest)
    return [*zip(keys, parts, strict=True), (key, manifest)]


def manifest_chunks(key: bytes, record: bytes | None) -> list[bytes]:
    """The chunk keys a record under ``key`` names (none for inline or unknown)."""
    if record is None or not record.startswith(_MANIFEST) or len(record) != _MAN.size:
        return []
    _, gen, n, _, _ = _MAN.unpack(record)
    return chunk_keys(key, gen, min(n, 1 << 16))


def join_checkpoint(get: Callable[[bytes], bytes | None], key: bytes) -> bytes | None:
    """The checkpoint under ``key`` (None if absent); ValueError if it is damaged."""
    record = get(key)
    if record is None:
        return None
    record = bytes(record)
    if record.startswith(_INLINE):
        packed = record[len(_INLINE) :]
    elif record.startswith(_MANIFEST) and len(record) == _MAN.size:
        _, gen, n, size, digest = _MAN.unpack(record)
        if size > MAX_CHECKPOINT_BYTES or n > size + 1:
            raise ValueError(f"checkpoint manifest of {key!r} is implausible")
        chunks = [get(k) for k in chunk_keys(key, gen, n)]
        if any(c is None for c in chunks):
            raise ValueError(f"checkpoint of {key!r} misses chunks")
        packed = b"".join(bytes(c) for c in chunks if c is not None)
        if len(packed) != size or hashlib.sha256(packed).digest() != digest:
            raise ValueError(f"checkpoint of {key!r} fails its checksum")
    else:
        raise ValueError(f"checkpoint of {key!r} is not in a known format")
    # Bounded decompression: a forged record cannot expand without limit.
    d = zlib.decompressobj()
    out = d.decompress(packed, MAX_CHECKPOINT_BYTES)
    if d.unconsumed_tail:
        raise ValueError(f"checkpoint of {key!r} expands beyond the limit")
    return out


class CheckpointSchedule:
    """Tracks, per key, events since its last checkpoint and when that was."""

    def __init__(self, every_events: int, every_s: float) -> None:
        self.every_events = every_events
        self.every_s = every_s
        self._pending: dict[Any, int] = {}
        self._since: dict[Any, float] = {}
        """Key -> when it became dirty, oldest first (a key is re-inserted when it
        becomes dirty again): the keys due by time are a prefix."""
        self._full: dict[Any, None] = {}
        """Keys with ``every_events`` or more pending, in the order they got there."""

    def touch(self, key: Any, n_events: int, now: float) -> None:
        """``n_events`` changed the state of ``key`` at wall time ``now``."""
        if key not in self._pending:
            self._pending[key] = 0
            self._since[key] = now
        n = self._pending[key] = self._pending[key] + n_events
        if n >= self.every_events:
            self._full[key] = None

    def take_due(self, now: float) -> list[Any]:
        """Keys to checkpoint now; they count as checkpointed from here on. The work is
        the keys due, not every dirty one (a tick at 20,000 communicators scanned them
        all)."""
        due = []
        for k, since in self._since.items():
            if now - since < self.every_s:
                break
            due.append(k)
        by_time = set(due)
        due += [k for k in self._full if k not in by_time]
        for k in due:
            self.forget(k)
        return due

    def take_all(self, keys: Iterable[Any] | None = None) -> list[Any]:
        """Every dirty key (of ``keys`` when given): for a clean stop or a revocation."""
        out = [k for k in (self._pending if keys is None else keys) if k in self._pending]
        for k in out:
            self.forget(k)
        return out

    def forget(self, key: Any) -> None:
        self._pending.pop(key, None)
        self._since.pop(key, None)
        self._full.pop(key, None)

    def __len__(self) -> int:
        return len(self._pending)


class TableCheckpoints:
    """A Faust table of ``bytes -> bytes`` written with an explicit partition.

    Faust's ``table[key] = value`` writes the changelog record to the partition of the
    *current* event; inside a ``take`` batch (or a timer) that is the wrong one or none.
    We write to the partition the key's own messages came from, so that after a
    rebalance the worker owning that source partition also restores the key.
    Values are compressed and chunked (:func:`split_checkpoint`); the chunks of the
    previous checkpoint of a key are deleted (tombstones) once the new one is written.
    """

    def __init__(self, table: Any, chunk_bytes: int = 512 * 1024) -> None:
        self.table = table
        self.chunk_bytes = chunk_bytes
        self.writes = 0
        self.unreadable = 0

    def _raw(self, key: bytes) -> bytes | None:
        value = self.table.data.get(key)
        return bytes(value) if value else None

    def get(self, key: bytes) -> bytes | None:
        """The checkpoint of ``key`` (None if absent). A record in no framing of ours is
        handed on as it is, for the runner to refuse with a dead letter; a damaged
        chunked one is logged and counted, and starts afresh."""
        try:
            return join_checkpoint(self._raw, key)
        except ValueError as err:
            raw = self._raw(key)
            if raw is not None and not raw.startswith((_INLINE, _MANIFEST)):
                return raw  # foreign bytes: refused (and dead-lettered) by the runner
            self.unreadable += 1
            log.warning("checkpoint unreadable, starting afresh: %s", err)
            return None

    def put(self, partition: int, key: bytes, value: bytes) -> None:
        old = manifest_chunks(key, self._raw(key))
        gen = time.time_ns()  # unique across restarts: chunks never mix generations
        for k, v in split_checkpoint(key, value, chunk_bytes=self.chunk_bytes, gen=gen):
            self.table.data[k] = v  # local copy: a re-assigned partition reads it back
            self.table.send_changelog(partition, k, v)
            self.writes += 1
        for k in old:
            self.table.data.pop(k, None)
            self.table.send_changelog(partition, k, None)  # tombstone: compaction drops it

    def delete(self, partition: int, key: bytes) -> None:
        """Forget the checkpoint of ``key``: its record and chunks, locally and on the
        changelog (tombstones)."""
        for k in [*manifest_chunks(key, self._raw(key)), key]:
            if self.table.data.pop(k, None) is not None:
                self.table.send_changelog(partition, k, None)
                self.writes += 1
