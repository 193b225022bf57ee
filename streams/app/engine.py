"""What the worker needs from the detection core, as a small protocol.

The agents talk to detectors and correlators only through :class:`Engine`, so the
Faust plumbing is the same whatever detects. :class:`CoreEngine` is the real one
(:mod:`streams.core`); tests may pass a stand-in to :func:`streams.app.faust_app.make_app`.
"""

from __future__ import annotations

from typing import Protocol

from streams.commands import IsolationCommand
from streams.core import CommDetector, HostCorrelator, build_detectors
from streams.core.columns import EventColumnsLike
from streams.core.config import DetectConfig, PolicyConfig
from streams.verdicts import Verdict

__all__ = ["CoreEngine", "CorrelatorLike", "DetectorLike", "Engine"]


class DetectorLike(Protocol):
    """State of one communicator (``streams.core.CommDetector``)."""

    def observe(self, cols: EventColumnsLike) -> list[Verdict]:
        """One batch of the communicator's events, as columns (rows in arrival order)."""
        ...

    def advance(self, now_us: int) -> list[Verdict]: ...
    def to_bytes(self) -> bytes: ...


class CorrelatorLike(Protocol):
    """Per-host correlation and policy (``streams.core.HostCorrelator``)."""

    def observe(self, verdict: Verdict) -> list[IsolationCommand]: ...
    def advance(self, now_us: int, job: str | None = None) -> list[IsolationCommand]:
        """Move ``job``'s event time on (every job's when None)."""
        ...

    def to_bytes(self, job: str | None = None) -> bytes:
        """A checkpoint of the whole correlator, or of ``job``'s part alone."""
        ...


class Engine(Protocol):
    """Creates and restores detectors and correlators."""

    def new_detector(self, comm: str) -> DetectorLike: ...
    def load_detector(self, comm: str, data: bytes) -> DetectorLike:
        """From checkpoint bytes (``to_bytes``); raises ``ValueError`` for bytes it will
        not read (corrupt, foreign, a pickle): the caller dead-letters them."""
        ...

    def new_correlator(self) -> CorrelatorLike: ...
    def load_correlator(self, data: bytes) -> CorrelatorLike:
        """As :meth:`load_detector`, for a host correlator."""
        ...

    def load_correlator_job(self, into: CorrelatorLike, job: str, data: bytes) -> None:
        """Replace ``job``'s part of ``into`` with its checkpoint (``to_bytes(job)``);
        ``ValueError`` as :meth:`load_detector` (also for another job's). Optional: an
        engine without it is checkpointed one record per verdicts partition (its
        correlators' ``to_bytes()`` without a job), as before per-job records."""
        ...


class CoreEngine:
    """The detection core of :mod:`streams.core` with its typed configs.

    ``detect`` / ``policy`` come typed from ``[worker.detect]``/``[worker.policy]``
    (validated once, when the file is read); the defaults when absent.
    """

    def __init__(self, detect: DetectConfig | None = None, policy: PolicyConfig | None = None):
        self.detect = detect or DetectConfig()
        self.policy = policy or PolicyConfig()
        build_detectors(self.detect)  # e.g. params a river model does not take: say so now

    def new_detector(self, comm: str) -> DetectorLike:
        return CommDetector(comm, self.detect)

    def load_detector(self, comm: str, data: bytes) -> DetectorLike:
        det = CommDetector.from_bytes(data, self.detect)
        if det.comm != comm:  # another key's state: refuse, as any foreign checkpoint
            raise ValueError(f"a checkpoint of communicator {det.comm!r} under key {comm!r}")
        return det

    def new_correlator(self) -> CorrelatorLike:
        return HostCorrelator(self.policy)

    def load_correlator(self, data: bytes) -> CorrelatorLike:
        return HostCorrelator.from_bytes(data, self.policy)

    def load_correlator_job(self, into: CorrelatorLike, job: str, data: bytes) -> None:
        assert isinstance(into, HostCorrelator)
        HostCorrelator.from_bytes(data, self.policy, into, job)
