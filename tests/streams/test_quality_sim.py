"""The quality bar of issue 4, measured on simulator traces of >= 128 GPUs.

- every injected fault found with the right host (and GPU / NIC / peer where it has one);
- zero isolations on benign-only traces, across several seeds and sizes;
- hangs isolated within 10 s of their start; stragglers of >= 1.15x and NICs or links at
  <= 60% bandwidth within 30 s.

Print the figures with ``pytest tests/streams/test_quality_sim.py -q -s``.
"""

from __future__ import annotations

import msgspec
import pytest

from producers.simulator import SCENARIOS, BenignSpec, FaultSpec, SimConfig, ground_truth, simulate
from streams.core import DetectionPipeline
from streams.scoring import RunScore, score_commands

R = msgspec.structs.replace
BASE = R(SCENARIOS["healthy"], hosts=16, gpus_per_host=8, duration_s=70)  # 128 GPUs

FAULTS: dict[str, tuple[FaultSpec, float]] = {
    # name: (fault, latency budget in s)
    "straggler_1.15": (FaultSpec(kind="straggler", host=13, gpu=6, start_s=25, severity=1.15), 30),
    "slow_nic_0.6": (FaultSpec(kind="slow_nic", host=1, nic=4, start_s=25, severity=0.6), 30),
    "slow_link_0.6": (
        FaultSpec(kind="slow_link", host=6, nic=0, peer_host=7, start_s=25, severity=0.6),
        30,
    ),
    "rank_hang": (FaultSpec(kind="rank_hang", host=2, gpu=7, start_s=33.3), 10),
    "host_down": (FaultSpec(kind="host_down", host=15, start_s=40.7), 10),
    "link_hang": (FaultSpec(kind="link_hang", host=4, nic=2, peer_host=5, start_s=37.2), 10),
}

BENIGN_MIX = [
    BenignSpec(kind="checkpoint", start_s=15, duration_s=5, severity=2.0),
    BenignSpec(kind="congestion", start_s=30, duration_s=10, severity=2.0),
    BenignSpec(kind="congestion", start_s=50, duration_s=3, host=3, severity=2.0),
    BenignSpec(kind="blip", start_s=45, duration_s=1, host=4, gpu=2, severity=4.0),
    BenignSpec(kind="clock_offset", host=6, severity=4.0),
]


def detect(cfg: SimConfig) -> tuple[RunScore, DetectionPipeline]:
    pipe = DetectionPipeline()
    for batch in simulate(cfg):
        pipe.feed(batch)
    pipe.finish()
    return score_commands(pipe.commands, ground_truth(cfg)), pipe


def _fmt(c) -> str:  # noqa: ANN001
    return f"{c.host} gpu={c.gpu} nic={c.nic} peer={c.peer_host} {c.fault}: {c.reason}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_found_in_time_without_false_isolations(name: str) -> None:
    fault, budget = FAULTS[name]
    cfg = R(BASE, job=f"q-{name}", faults=[fault], seed=7)
    score, _ = detect(cfg)
    [res] = score.faults
    print(f"\n{name}: found={res.found} latency_s={res.latency_s} "
          f"false_isolations={score.false_isolations}")  # fmt: skip
    assert res.found, f"{name} not found; commands: {[_fmt(c) for c in score.false_decisions]}"
    assert res.latency_s is not None and res.latency_s <= budget
    assert score.false_isolations == 0, [_fmt(c) for c in score.false_decisions]


@pytest.mark.timeout(60)
def test_faults_and_benign_together_demo() -> None:
    score, _ = detect(R(SCENARIOS["demo"], seed=3))
    print(f"\ndemo: {[(f.fault_id, f.found, f.latency_s) for f in score.faults]} "
          f"false_isolations={score.false_isolations}")  # fmt: skip
    assert score.all_found
    assert score.false_isolations == 0, [_fmt(c) for c in score.false_decisions]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("seed", "hosts"), [(0, 16), (1, 16), (2, 32)])
def test_benign_only_traces_isolate_nothing(seed: int, hosts: int) -> None:
    cfg = R(BASE, job=f"benign-{seed}-{hosts}", hosts=hosts, seed=seed, benign=BENIGN_MIX)
    score, pipe = detect(cfg)
    print(f"\nbenign seed={seed} gpus={hosts * 8}: false_isolations={score.false_isolations} "
          f"verdicts={sum(not v.benign for v in pipe.verdicts)}")  # fmt: skip
    assert score.false_isolations == 0, [_fmt(c) for c in score.false_decisions]
    assert pipe.n_events > 10_000
