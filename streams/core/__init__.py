"""The detection core: plain typed Python + numpy + river, no Kafka or Faust inside.

The same objects run in the Faust agents, in ``c4stream detect`` and in the tests:

- :class:`CommDetector` — all state of one communicator (hangs, stragglers, slow
  connections, its learned normal);
- :class:`HostCorrelator` — joins verdicts per host and applies the safety rails;
- :class:`DetectionPipeline` — the broker-free path through both, in event time;
- :func:`streams.core.snapshot.judge_snapshot` — one snapshot (every rank's Flight
  Recorder dump at one moment) judged as a whole, same verdicts as the stream.
"""

from streams.core.comm import CommDetector
from streams.core.config import DetectConfig, PolicyConfig
from streams.core.correlate import HostCorrelator
from streams.core.pipeline import DetectionPipeline

__all__ = ["CommDetector", "DetectConfig", "DetectionPipeline", "HostCorrelator", "PolicyConfig"]
