"""What the worker needs from the detection core, as a small protocol.

The agents talk to detectors and correlators only through :class:`Engine`, so the
Faust plumbing is the same whatever detects. :class:`CoreEngine` is the real one
(:mod:`streams.core`); tests may pass a stand-in to :func:`streams.app.faust_app.make_app`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from producers.events import Event
from streams.commands import IsolationCommand
from streams.verdicts import Verdict

__all__ = ["CoreEngine", "CorrelatorLike", "DetectorLike", "Engine"]


class DetectorLike(Protocol):
    """State of one communicator (``streams.core.CommDetector``)."""

    def observe(self, events: Sequence[Event]) -> list[Verdict]: ...
    def advance(self, now_us: int) -> list[Verdict]: ...
    def to_bytes(self) -> bytes: ...


class CorrelatorLike(Protocol):
    """Per-host correlation and policy (``streams.core.HostCorrelator``)."""

    def observe(self, verdict: Verdict) -> list[IsolationCommand]: ...
    def advance(self, now_us: int) -> list[IsolationCommand]: ...
    def to_bytes(self) -> bytes: ...


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


class CoreEngine:
    """The detection core of :mod:`streams.core` with its configs.

    ``detect`` / ``policy`` are the fields of ``DetectConfig`` / ``PolicyConfig`` as
    plain dicts (from the worker's TOML); they are validated here, at start-up.
    """

    def __init__(self, detect: dict[str, Any] | None = None, policy: dict[str, Any] | None = None):
        import msgspec

        from streams import core

        self._core = core
        try:
            self.detect = msgspec.convert(detect or {}, core.DetectConfig)
            self.policy = msgspec.convert(policy or {}, core.PolicyConfig)
            core.build_detectors(self.detect)  # e.g. an unknown river model: say so now
        except (msgspec.ValidationError, ValueError) as err:
            raise ValueError(f"worker detect/policy settings: {err}") from None

    def new_detector(self, comm: str) -> DetectorLike:
        return self._core.CommDetector(comm, self.detect)

    def load_detector(self, comm: str, data: bytes) -> DetectorLike:
        det = self._core.CommDetector.from_bytes(data, self.detect)
        if det.comm != comm:  # another key's state: refuse, as any foreign checkpoint
            raise ValueError(f"a checkpoint of communicator {det.comm!r} under key {comm!r}")
        return det

    def new_correlator(self) -> CorrelatorLike:
        return self._core.HostCorrelator(self.policy)

    def load_correlator(self, data: bytes) -> CorrelatorLike:
        return self._core.HostCorrelator.from_bytes(data, self.policy)
