"""What both agents' runners share: their output, their counters, and the
restore / checkpoint / flush cycle of keyed state kept in a Faust table.

A runner owns state objects (a communicator's detector, a host correlator), each under
a table key on the partition its input came from. It restores one from its last
checkpoint the first time it is needed (bytes the core refuses — corrupt, foreign, a
forged pickle — become a dead letter and the state starts afresh), checkpoints it every
N events or S seconds (:class:`~streams.app.checkpoint.CheckpointSchedule`), and on
revocation or a clean stop checkpoints every dirty one and, when told, forgets them.
Only what to judge differs, in :mod:`streams.app.detect_runner` and
:mod:`streams.app.correlate_runner`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from c4base.deadletter import DeadLetter
from streams.app.checkpoint import CheckpointSchedule
from streams.app.deadletter import refused_checkpoint
from streams.commands import IsolationCommand
from streams.verdicts import Verdict

__all__ = ["Lookup", "Output", "RouterStats", "StateRunner"]

log = logging.getLogger(__name__)

Lookup = Callable[[bytes], bytes | None]
"""Table read: a key's last checkpoint, or None."""


@dataclass
class Output:
    """What one batch (or tick) produced."""

    verdicts: list[Verdict] = field(default_factory=list)
    clocks: list[int] = field(default_factory=list)
    """Per verdict: its events partition's event-time clock when it was concluded."""
    commands: list[IsolationCommand] = field(default_factory=list)
    deadletters: list[DeadLetter] = field(default_factory=list)
    checkpoints: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    """(partition, key, state bytes) to write to the table."""
    forgotten: list[tuple[int, bytes]] = field(default_factory=list)
    """(partition, key) of checkpoints to delete from the table (tombstones)."""
    late_events: list[tuple[str, int]] = field(default_factory=list)
    """(job, events) dead-lettered as late beyond the allowed lateness."""
    late_verdicts: list[tuple[str, str]] = field(default_factory=list)
    """(job, outcome) per verdict that came behind its job's watermark: ``judged``
    (within the allowed lateness) or ``deadlettered`` (beyond it)."""

    def concluded(self, verdicts: list[Verdict], clock_us: int) -> None:
        self.verdicts.extend(verdicts)
        self.clocks.extend([clock_us] * len(verdicts))


@dataclass
class RouterStats:
    messages: int = 0
    events: int = 0
    batches: int = 0
    verdicts: int = 0
    commands: int = 0
    deadletters: int = 0
    detector_errors: int = 0
    duplicates: int = 0
    """Messages dropped as exact repeats of one already accepted (a producer retry, a
    re-send): counted, never judged twice, never read as a counter going back."""
    uncorroborated: int = 0
    """Verdicts made alert-only because nobody corroborates their communicator."""
    evicted: int = 0
    """Communicators forgotten (checkpointed first) to keep under the caps."""
    forgotten: int = 0
    """Checkpoints of communicators not held deleted from the table, the longest parked
    first, to keep under ``max_checkpoints`` (one that speaks again starts afresh)."""
    evicted_active: int = 0
    """Of ``evicted``, those whose lane had spoken within ``evict_idle_s``: the worker was
    over its cap with nothing idle (a flood of new ids, or a cap too low for the jobs)."""
    checkpoints: int = 0
    restored: int = 0
    """Detectors (or correlators) restored from a table checkpoint."""
    created: int = 0
    process_s: float = 0.0
    """CPU seconds the detect runner spent in ``process`` and ``tick`` (decoding, checks,
    detection): the rest of a worker's CPU time goes to Kafka, Faust and correlation."""


class Checkpointable(Protocol):
    def to_bytes(self) -> bytes: ...


K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class StateRunner(Generic[K]):
    """Keyed state with the shared restore / checkpoint / flush cycle.

    Subclasses say where a key's state lives (:meth:`_locate`), how to judge what is
    still open before a flush (:meth:`_close`) and what to forget on revocation
    (:meth:`_drop`)."""

    def __init__(
        self,
        lookup: Lookup,
        *,
        checkpoint_every_events: int,
        checkpoint_every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lookup = lookup
        self.schedule = CheckpointSchedule(checkpoint_every_events, checkpoint_every_s)
        self.wall = clock
        self.stats = RouterStats()
        self._refused: list[DeadLetter] = []
        """Checkpoints the core would not read, as dead letters for the next output."""

    # ------------------------------------------------------------ to override
    def _locate(self, key: K) -> tuple[int, bytes, Checkpointable] | None:
        """(partition, table key, state) of ``key``, or None if it is not held."""
        raise NotImplementedError

    def _what(self, key: K) -> str:
        """How logs name the state of ``key``."""
        return str(key)

    def _keys(self, partitions: set[int] | None) -> list[K]:
        """Keys held for ``partitions`` (all when None)."""
        raise NotImplementedError

    def _close(self, partitions: set[int] | None, out: Output) -> None:
        """Judge what is held open for ``partitions`` before they are checkpointed."""

    def _drop(self, partitions: set[int] | None, keys: list[K]) -> None:
        """Forget ``keys`` and everything kept per partition of ``partitions``."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared cycle
    def _restore(
        self, table_key: bytes, what: str, load: Callable[[bytes], T], new: Callable[[], T]
    ) -> T:
        """The state under ``table_key``: its last checkpoint if readable, else new."""
        data = self.lookup(table_key)
        if data is not None:
            try:
                state = load(data)
            except Exception as err:  # corrupt or foreign bytes: never run, dead-lettered
                log.warning("checkpoint of %s refused (%s); starting afresh", what, err)
                self._refused.append(refused_checkpoint(table_key, data, err))
            else:
                self.stats.restored += 1
                log.info("restored %s from its checkpoint (%d bytes)", what, len(data))
                return state
        self.stats.created += 1
        return new()

    def _restore_side(self, table_key: bytes, what: str, load: Callable[[bytes], object]) -> None:
        """State kept beside the keyed ones (the host rails, the signers' sequence numbers):
        loaded from its last checkpoint if any and readable (else dead-lettered), not
        counted as a detector or correlator restored or created."""
        data = self.lookup(table_key)
        if data is None:
            return
        try:
            load(data)
        except Exception as err:  # corrupt or foreign bytes: never run, dead-lettered
            log.warning("checkpoint of %s refused (%s); starting afresh", what, err)
            self._refused.append(refused_checkpoint(table_key, data, err))
        else:
            log.info("restored %s from its checkpoint (%d bytes)", what, len(data))

    def _checkpoint(self, keys: list[K]) -> list[tuple[int, bytes, bytes]]:
        out = []
        for key in keys:
            found = self._locate(key)
            if found is None:
                continue
            partition, table_key, state = found
            try:
                out.append((partition, table_key, state.to_bytes()))
            except Exception:
                self.stats.detector_errors += 1
                log.exception("checkpoint of %s failed", self._what(key))
        return out

    def _due(self, out: Output, now: float) -> None:
        out.checkpoints.extend(self._checkpoint(self.schedule.take_due(now)))

    def flush(self, partitions: set[int] | None = None, *, drop: bool = False) -> Output:
        """Judge what is open, checkpoint every dirty state (of ``partitions``); ``drop``
        forgets them (the partitions were revoked: another worker restores them)."""
        out = Output()
        self._close(partitions, out)
        keys = self._keys(partitions)
        out.checkpoints.extend(self._checkpoint(self.schedule.take_all(keys)))
        if drop:
            for key in keys:
                self.schedule.forget(key)
            self._drop(partitions, keys)
        self._count(out)
        return out

    def _count(self, out: Output) -> None:
        if self._refused:
            out.deadletters.extend(self._refused)
            self._refused.clear()
        st = self.stats
        st.verdicts += len(out.verdicts)
        st.commands += len(out.commands)
        st.deadletters += len(out.deadletters)
        st.checkpoints += len(out.checkpoints)
