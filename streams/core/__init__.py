"""The detection core: plain typed Python + numpy + river, no Kafka or Faust inside.

The same objects run in the Faust agents, in ``c4stream detect`` and in the tests:

- :class:`~streams.core.detector.Detector` — the contract of one fault class's
  detector (hang, straggler, slow connection, river model), stated once;
- :class:`CommDetector` — one communicator: the state its detectors share and the
  detectors chosen by ``DetectConfig.detectors``;
- :class:`HostCorrelator` — joins verdicts per host and applies the safety rails;
- :class:`DetectionPipeline` — the broker-free path through both, in event time;
- :func:`streams.core.snapshot.judge_snapshot` — one snapshot (every rank's Flight
  Recorder dump at one moment) judged as a whole, same verdicts as the stream.
"""

from streams.core.comm import CommDetector
from streams.core.config import DetectConfig, PolicyConfig
from streams.core.correlate import HostCorrelator
from streams.core.pipeline import DetectionPipeline
from streams.core.registry import DETECTORS, build_detectors

__all__ = [
    "DETECTORS",
    "CommDetector",
    "DetectConfig",
    "DetectionPipeline",
    "HostCorrelator",
    "PolicyConfig",
    "build_detectors",
]
