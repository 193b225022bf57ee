"""Detectors by name, as ``[worker.detect] detectors`` lists them.

>>> from streams.core.config import DetectConfig
>>> [d.name for d in build_detectors(DetectConfig())]
['hang', 'straggler', 'slow_conn']
"""

from __future__ import annotations

from typing import Protocol

from streams.core.config import DetectConfig
from streams.core.detector import Detector
from streams.core.hang import HangDetector
from streams.core.river_detector import RiverDetector
from streams.core.slow_conn import SlowConnDetector
from streams.core.straggler import StragglerDetector

__all__ = ["DETECTORS", "DetectorClass", "build_detectors", "load_detector"]


class DetectorClass(Protocol):
    """How a detector is made: fresh from the config, or back from its checkpoint."""

    def __call__(self, config: DetectConfig) -> Detector: ...
    def load(self, data: bytes, config: DetectConfig) -> Detector: ...


DETECTORS: dict[str, DetectorClass] = {
    HangDetector.name: HangDetector,
    StragglerDetector.name: StragglerDetector,
    SlowConnDetector.name: SlowConnDetector,
    RiverDetector.name: RiverDetector,
}


def build_detectors(config: DetectConfig) -> list[Detector]:
    """Fresh detectors for one communicator, in the configured order."""
    return [DETECTORS[name](config) for name in config.detectors]


def load_detector(name: str, data: bytes, config: DetectConfig) -> Detector:
    """A detector back from its checkpoint bytes (``CheckpointError`` if unreadable)."""
    return DETECTORS[name].load(data, config)
