"""A cluster simulator: a 3-D parallel training job that emits contract events, with
injected faults, benign disturbances and a ground truth to score detection against.

>>> import msgspec
>>> from producers.simulator import SCENARIOS, simulate, ground_truth, with_gpus
>>> cfg = msgspec.structs.replace(SCENARIOS["straggler"], duration_s=2)
>>> sum(len(batch) for batch in simulate(cfg)) > 0
True
>>> ground_truth(cfg).faults[0].expected_fault, ground_truth(cfg).faults[0].host
('straggler', 'node-005')

Modules: :mod:`.config` (typed config), :mod:`.topology` (who talks to whom),
:mod:`.timing` (ring model), :mod:`.faults` (injection), :mod:`.generate` (the loop),
:mod:`.truth` (ground truth), :mod:`.scenarios` (presets), :mod:`.output` (files).
"""

from __future__ import annotations

from producers.simulator.config import (
    BenignSpec,
    FaultSpec,
    SimConfig,
    SimConfigError,
    load_config,
    validate,
    with_gpus,
)
from producers.simulator.generate import EPOCH_US, Simulation, simulate
from producers.simulator.output import TraceStats, write_trace
from producers.simulator.scenarios import SCENARIOS, describe
from producers.simulator.truth import GroundTruth, TrueBenign, TrueFault, ground_truth

__all__ = [
    "EPOCH_US",
    "SCENARIOS",
    "BenignSpec",
    "FaultSpec",
    "GroundTruth",
    "SimConfig",
    "SimConfigError",
    "Simulation",
    "TraceStats",
    "TrueBenign",
    "TrueFault",
    "describe",
    "ground_truth",
    "load_config",
    "simulate",
    "validate",
    "with_gpus",
    "write_trace",
]
