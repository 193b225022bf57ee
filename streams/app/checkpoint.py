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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["CheckpointSchedule", "TableCheckpoints"]


class CheckpointSchedule:
    """Tracks, per key, events since its last checkpoint and when that was."""

    def __init__(self, every_events: int, every_s: float) -> None:
        self.every_events = every_events
        self.every_s = every_s
        self._pending: dict[Any, int] = {}
        self._since: dict[Any, float] = {}

    def touch(self, key: Any, n_events: int, now: float) -> None:
        """``n_events`` changed the state of ``key`` at wall time ``now``."""
        if key not in self._pending:
            self._pending[key] = 0
            self._since[key] = now
        self._pending[key] += n_events

    def take_due(self, now: float) -> list[Any]:
        """Keys to checkpoint now; they count as checkpointed from here on."""
        due = [
            k
            for k, n in self._pending.items()
            if n >= self.every_events or now - self._since[k] >= self.every_s
        ]
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

    def __len__(self) -> int:
        return len(self._pending)


class TableCheckpoints:
    """A Faust table of ``bytes -> bytes`` written with an explicit partition.

    Faust's ``table[key] = value`` writes the changelog record to the partition of the
    *current* event; inside a ``take`` batch (or a timer) that is the wrong one or none.
    We write to the partition the key's own messages came from, so that after a
    rebalance the worker owning that source partition also restores the key.
    """

    def __init__(self, table: Any) -> None:
        self.table = table
        self.writes = 0

    def get(self, key: bytes) -> bytes | None:
        value = self.table.data.get(key)
        return bytes(value) if value is not None else None

    def put(self, partition: int, key: bytes, value: bytes) -> None:
        self.table.data[key] = value  # local copy: a re-assigned partition reads it back
        self.table.send_changelog(partition, key, value)
        self.writes += 1
