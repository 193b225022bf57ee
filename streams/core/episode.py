"""What the host correlator remembers: a verdict's evidence as an entry of an episode
(one per job, host and fault), in memory and in its checkpoint."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from streams.core.findings import Evidence

__all__ = ["MAX_ENTRIES", "Entry", "Episode"]

MAX_ENTRIES = 256
"""Entries an episode keeps (the newest)."""


@dataclass(slots=True)
class Entry:
    ts: int
    comm: str
    window: int
    score: float
    comp: tuple
    intra: bool
    ev: Evidence


@dataclass(slots=True)
class Episode:
    first_window: int
    entries: deque = field(default_factory=lambda: deque(maxlen=MAX_ENTRIES))
    decided: str = ""
