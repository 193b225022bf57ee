"""Kafka topic names and their partition counts: one place, so every stage agrees."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topics"]


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic names of one c4stream deployment (a prefix lets several share a cluster).

    >>> Topics().events, Topics(prefix="t1.").deadletter
    ('c4.events', 't1.c4.deadletter')
    """

    prefix: str = ""
    # Keyed by communicator: partitions bound the number of parallel workers.
    events_partitions: int = 8
    # One partition: verdicts are few, and one correlator must see a whole job so that
    # the per-job cap on isolated hosts holds.
    verdicts_partitions: int = 1
    isolations_partitions: int = 1

    @property
    def events(self) -> str:
        return f"{self.prefix}c4.events"

    @property
    def verdicts(self) -> str:
        return f"{self.prefix}c4.verdicts"

    @property
    def isolations(self) -> str:
        return f"{self.prefix}c4.isolations"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}c4.deadletter"

    @property
    def actions(self) -> str:
        """What the actuator did with each command (read by the alerter); optional."""
        return f"{self.prefix}c4.actions"

    def partitions(self) -> dict[str, int]:
        """Every topic with the partition count to create it with."""
        return {
            self.events: self.events_partitions,
            self.verdicts: self.verdicts_partitions,
            self.isolations: self.isolations_partitions,
            self.deadletter: 1,
            self.actions: 1,
        }
