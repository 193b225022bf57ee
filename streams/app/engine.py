"""What the worker needs from the detection core, as a small protocol.

The agents talk to detectors and correlators only through :class:`Engine`, so the
Faust plumbing is the same whatever detects. :class:`CoreEngine` is the real one
(:mod:`streams.core`); tests may pass a stand-in to :func:`streams.app.faust_app.make_app`.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any, Protocol

from producers.events import Event
from streams.commands import IsolationCommand
from streams.core import CommDetector, HostCorrelator
from streams.core.config import DetectConfig, PolicyConfig
from streams.verdicts import Verdict

__all__ = ["CheckpointRefused", "CoreEngine", "CorrelatorLike", "DetectorLike", "Engine"]


class CheckpointRefused(ValueError):
    """A checkpoint names code outside the detection core's own state classes."""


#: The only globals a checkpoint of :mod:`streams.core` (pickle format) refers to,
#: found by loading checkpoints of every simulator scenario (tests/streams/
#: test_no_code_from_data.py keeps this list honest). A changelog topic is input like
#: any other: a pickle naming ``os.system`` there would otherwise run in the worker.
_ALLOWED_GLOBALS = frozenset(
    {
        ("collections", "deque"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("river._river_rust.stats", "RsQuantile"),
        ("river.stats.quantile", "Quantile"),
        ("streams.core.correlate", "_Entry"),
        ("streams.core.correlate", "_Episode"),
        ("streams.core.hang", "ProgressConns"),
        ("streams.core.ranks", "RankTable"),
        ("streams.core.slow_conn", "ConnMatrix"),
        ("streams.core.stats", "NormalModel"),
        ("streams.core.straggler", "SeqAligner"),
    }
)
#: Protocol 2+ pickles start with PROTO; the core writes protocol 5.
_PICKLE_HEADER = b"\x80"


class _CoreUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise CheckpointRefused(f"checkpoint refers to {module}.{name}: refused")
        return super().find_class(module, name)


def safe_state(data: bytes) -> bytes:
    """Checkpoint bytes the core may load: a pickle is loaded here with only the core's
    own state classes allowed, then written again (so the core's ``from_bytes`` only
    ever unpickles what this process made); any other format passes through untouched
    (the detection core's own versioned format parses, never runs code).

    >>> safe_state(pickle.dumps({"a": [1, 2]}, protocol=5)) == pickle.dumps({"a": [1, 2]}, 5)
    True
    >>> class Evil:
    ...     def __reduce__(self):
    ...         return (print, ("pwned",))
    >>> safe_state(pickle.dumps(Evil()))
    Traceback (most recent call last):
    ...
    streams.app.engine.CheckpointRefused: checkpoint refers to builtins.print: refused
    """
    if not data.startswith(_PICKLE_HEADER):
        return data
    state = _CoreUnpickler(io.BytesIO(data)).load()
    return pickle.dumps(state, protocol=5)


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
    def load_detector(self, comm: str, data: bytes) -> DetectorLike: ...
    def new_correlator(self) -> CorrelatorLike: ...
    def load_correlator(self, data: bytes) -> CorrelatorLike: ...


class CoreEngine:
    """The detection core of :mod:`streams.core` with its typed configs.

    ``detect`` / ``policy`` come typed from ``[worker.detect]``/``[worker.policy]``
    (validated once, when the file is read); the defaults when absent.
    """

    def __init__(self, detect: DetectConfig | None = None, policy: PolicyConfig | None = None):
        self.detect = detect or DetectConfig()
        self.policy = policy or PolicyConfig()

    def new_detector(self, comm: str) -> DetectorLike:
        return CommDetector(comm, self.detect)

    def load_detector(self, comm: str, data: bytes) -> DetectorLike:
        return CommDetector.from_bytes(safe_state(data), self.detect)

    def new_correlator(self) -> CorrelatorLike:
        return HostCorrelator(self.policy)

    def load_correlator(self, data: bytes) -> CorrelatorLike:
        return HostCorrelator.from_bytes(safe_state(data), self.policy)
