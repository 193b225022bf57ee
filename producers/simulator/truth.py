"""Ground truth of a simulated run: which component was broken, where and when.

The detection engineer scores verdicts against this file. ``expected_fault`` names
the fault class a detector should report (see the four classes in DESIGN.md):

======== ============== =====================================
kind     expected_fault culprit fields
======== ============== =====================================
straggler    straggler  host, gpu
slow_nic     slow_nic   host, nic
slow_link    slow_link  host (sender), peer_host, nic
rank_hang    noncomm_hang host, gpu
host_down    noncomm_hang host
link_hang    comm_hang  host (sender), peer_host, nic
======== ============== =====================================

Optional fields appear only where they apply: ``duty`` (an intermittent straggler's
share of slow steps), ``ramp_s`` with ``threshold_us`` (a degrading NIC: when its
remaining bandwidth crosses :data:`THRESHOLD_FRACTION`, the moment from which a
detector is expected to isolate it; ``start_us`` is when the degradation begins),
and ``stage`` (the pipeline stage of the host, in the microbatched shapes).

>>> from producers.simulator.config import FaultSpec, SimConfig
>>> cfg = SimConfig(hosts=2, faults=[FaultSpec(kind="host_down", host=1, start_s=5)])
>>> gt = ground_truth(cfg)
>>> gt.faults[0].expected_fault, gt.faults[0].host, gt.faults[0].start_us
('noncomm_hang', 'node-001', 1750000005000000)
"""

from __future__ import annotations

from typing import Literal

import msgspec

from producers.simulator.config import SimConfig, bandwidth_fraction, describe_shape, validate
from producers.simulator.generate import EPOCH_US
from producers.simulator.topology import Topology

__all__ = ["THRESHOLD_FRACTION", "GroundTruth", "TrueBenign", "TrueFault", "ground_truth"]

THRESHOLD_FRACTION = 0.75
"""Remaining bandwidth at which a degrading NIC counts as faulty (its ``threshold_us``)."""

ExpectedFault = Literal["noncomm_hang", "comm_hang", "straggler", "slow_link", "slow_nic"]

EXPECTED: dict[str, ExpectedFault] = {
    "straggler": "straggler",
    "slow_nic": "slow_nic",
    "slow_link": "slow_link",
    "rank_hang": "noncomm_hang",
    "host_down": "noncomm_hang",
    "link_hang": "comm_hang",
}


class TrueFault(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One injected fault, named as on the wire."""

    id: str
    kind: str
    expected_fault: ExpectedFault
    host: str
    start_us: int
    severity: float
    gpu: int | None = None
    nic: str | None = None
    peer_host: str | None = None
    end_us: int | None = None
    duty: float | None = None
    ramp_s: float | None = None
    threshold_us: int | None = None
    stage: int | None = None


class TrueBenign(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One benign event: nothing may be isolated because of it."""

    kind: str
    start_us: int
    end_us: int
    host: str | None = None
    gpu: int | None = None
    severity: float | None = None
    stage: int | None = None


class GroundTruth(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What was injected into one simulated run (``shape``: the microbatched shapes'
    schedule, sizes and data-parallel mode, in words)."""

    job: str
    seed: int
    hosts: list[str]
    gpus: int
    gpus_per_host: int
    duration_s: float
    epoch_us: int
    faults: list[TrueFault]
    benign: list[TrueBenign]
    shape: str | None = None


def _us(seconds: float) -> int:
    return EPOCH_US + round(seconds * 1e6)


def _severity(kind: str, severity: float) -> float:
    # one meaning per kind on the way out: compute multiplier for stragglers, remaining
    # bandwidth fraction for slow NICs and links, 1.0 for hangs
    if kind in ("slow_nic", "slow_link"):
        return bandwidth_fraction(severity)
    return severity if kind == "straggler" else 1.0


def ground_truth(config: SimConfig) -> GroundTruth:
    """The injected faults and benign events of ``config``, with wire names and times."""
    cfg = validate(config)
    names = Topology.build(cfg).host_names
    faults = []
    for i, f in enumerate(cfg.faults):
        threshold_us = None
        frac = bandwidth_fraction(f.severity)
        if f.ramp_s > 0 and frac <= THRESHOLD_FRACTION:
            threshold_us = _us(f.start_s + f.ramp_s * (1 - THRESHOLD_FRACTION) / (1 - frac))
        faults.append(
            TrueFault(
                id=f"f{i}-{f.kind}-{names[f.host]}",
                kind=f.kind,
                expected_fault=EXPECTED[f.kind],
                host=names[f.host],
                gpu=f.gpu if f.kind in ("straggler", "rank_hang") else None,
                nic=f"mlx5_{f.nic}" if f.kind in ("slow_nic", "slow_link", "link_hang") else None,
                peer_host=names[f.peer_host]
                if f.kind in ("slow_link", "link_hang") and f.peer_host is not None
                else None,
                start_us=_us(f.start_s),
                end_us=None if f.end_s is None else _us(f.end_s),
                severity=_severity(f.kind, f.severity),
                duty=f.duty if f.duty < 1 else None,
                ramp_s=f.ramp_s if f.ramp_s > 0 else None,
                threshold_us=threshold_us,
                stage=f.host // cfg.hosts_per_stage if cfg.pipelined else None,
            )
        )
    benign = []
    for b in cfg.benign:
        whole = b.kind in ("clock_offset", "role_late", "stage_heavy")
        benign.append(
            TrueBenign(
                kind=b.kind,
                host=names[b.host] if b.host is not None else None,
                gpu=b.gpu if b.kind in ("blip", "role_late") else None,
                start_us=_us(0 if whole else b.start_s),
                end_us=_us(cfg.duration_s if whole else b.start_s + b.duration_s),
                severity=b.severity,
                stage=b.stage if b.kind == "stage_heavy" else None,
            )
        )
    return GroundTruth(
        job=cfg.job,
        seed=cfg.seed,
        hosts=names,
        gpus=cfg.gpus,
        gpus_per_host=cfg.gpus_per_host,
        duration_s=cfg.duration_s,
        epoch_us=EPOCH_US,
        faults=faults,
        benign=benign,
        shape=describe_shape(cfg) if cfg.pipelined else None,
    )
