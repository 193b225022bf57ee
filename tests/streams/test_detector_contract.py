"""One contract suite over every registered detector (as river's ``estimator_checks``
runs one suite over every estimator): a checkpoint round trip gives identical verdicts,
two runs give the same bytes, benign scenarios isolate nothing, state stays bounded
per rank. A detector added to ``streams.core.registry.DETECTORS`` is checked here
without touching this file."""

from __future__ import annotations

import random
import tomllib
from pathlib import Path

import msgspec
import pytest

from producers.events import Event
from producers.simulator import SCENARIOS, BenignSpec, FaultSpec, SimConfig, simulate
from streams.app.engine import CoreEngine
from streams.core import CommDetector, DetectConfig, DetectionPipeline
from streams.core.registry import DETECTORS
from streams.verdicts import Verdict, encode_verdict

R = msgspec.structs.replace
NAMES = sorted(DETECTORS)

# 64 GPUs; every fault class present, stragglers and the slow NIC from the first step
FAULTY = R(
    SCENARIOS["healthy"],
    job="contract",
    hosts=8,
    duration_s=36,
    faults=[
        FaultSpec(kind="straggler", host=1, gpu=2, start_s=0, severity=1.3),
        FaultSpec(kind="slow_nic", host=5, nic=4, start_s=0, severity=0.5),
        FaultSpec(kind="rank_hang", host=6, gpu=1, start_s=28),
    ],
)

BENIGN: dict[str, list[BenignSpec]] = {
    "healthy": [],
    "checkpoint": [BenignSpec(kind="checkpoint", start_s=12, duration_s=8)],
    "congestion": [BenignSpec(kind="congestion", start_s=12, duration_s=8, severity=3.0)],
    "blip": [BenignSpec(kind="blip", start_s=14, host=3, gpu=5, severity=4.0)],
    "clock_offset": [BenignSpec(kind="clock_offset", host=2, severity=50.0)],
    "role_late": [BenignSpec(kind="role_late", start_s=0, gpu=3, severity=1.2)],
}


def _spread(hosts: range, gpus: int, lo: float, hi: float, seed: int) -> list[FaultSpec]:
    """Every GPU of ``hosts`` computing a fixed factor in [lo, hi) from the start: a static
    spread between healthy GPUs (power and clock binning) when below ~1 %, a slower
    pipeline stage by design (more layers) when the hosts are one stage."""
    rng = random.Random(seed)
    return [FaultSpec(kind="straggler", host=h, gpu=g, start_s=0, severity=rng.uniform(lo, hi))
            for h in hosts for g in range(gpus)]  # fmt: skip


# shapes that are not faults, with the job changed to show them
SHAPES: dict[str, dict] = {
    # quiet GPUs (0.3 % jitter per phase), so that the slower of them is last nearly
    # always: a chance-level rule isolated both of "two_slower" and two of the spread
    "static_spread": {"faults": _spread(range(8), 8, 1.0, 1.01, 5), "compute_jitter": 0.003},
    "two_slower": {
        "faults": [
            FaultSpec(kind="straggler", host=h, gpu=g, start_s=0, severity=1.0075)
            for h, g in ((1, 2), (5, 6))
        ],
        "compute_jitter": 0.003,
    },  # fmt: skip
    "bubbles": {"pp": 2},  # two pipeline stages: Send/Recv pairs wait by schedule
    "stage_imbalance": {"pp": 2, "faults": _spread(range(4, 8), 8, 1.15, 1.15, 6)},
}


def config(name: str) -> DetectConfig:
    return DetectConfig(detectors=[name])  # type: ignore[list-item]


_TRACES: dict[bytes, list[list[Event]]] = {}


def trace(cfg: SimConfig) -> list[list[Event]]:
    """The simulated trace of ``cfg``, simulated once per test session."""
    key = msgspec.json.encode(cfg)
    if key not in _TRACES:
        _TRACES[key] = [b for b in simulate(cfg) if b]
    return _TRACES[key]


def run(name: str, cfg: SimConfig, restore_every: int = 0) -> tuple[list[Verdict], dict]:
    """Feed ``cfg``'s trace to one CommDetector per communicator (one detector each),
    advancing every clock after each second; with ``restore_every``, every detector
    is rebuilt from its checkpoint bytes after that many batches."""
    dcfg = config(name)
    dets: dict[str, CommDetector] = {}
    out: list[Verdict] = []
    now = -1
    for i, batch in enumerate(trace(cfg)):
        top = max(e.ts_us for e in batch)
        if now >= 0 and top // 1_000_000 > now // 1_000_000:
            for d in dets.values():
                out += d.advance(now)
        now = max(now, top)
        comm = batch[0].comm
        d = dets.get(comm) or dets.setdefault(comm, CommDetector(comm, dcfg))
        out += d.observe(batch)
        if restore_every and i % restore_every == 0:
            dets = {c: CommDetector.from_bytes(x.to_bytes(), dcfg) for c, x in dets.items()}
    for d in dets.values():
        out += d.advance(now + 1_000_000)
    return out, dets


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_gives_identical_verdicts(name: str) -> None:
    want, _ = run(name, FAULTY)
    got, _ = run(name, FAULTY, restore_every=7)
    assert [v for v in want if not v.benign], f"{name} found nothing to compare"
    assert [encode_verdict(v) for v in got] == [encode_verdict(v) for v in want]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_two_runs_give_the_same_bytes(name: str) -> None:
    a, da = run(name, FAULTY)
    b, db = run(name, FAULTY)
    assert [encode_verdict(v) for v in a] == [encode_verdict(v) for v in b]
    assert {c: d.to_bytes() for c, d in da.items()} == {c: d.to_bytes() for c, d in db.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_benign_scenarios_isolate_nothing(name: str) -> None:
    for kind, benign in BENIGN.items():
        cfg = R(FAULTY, job=f"benign-{kind}", faults=[], benign=benign, seed=3)
        pipe = DetectionPipeline(config(name))
        for b in trace(cfg):
            pipe.feed(b)
        pipe.finish()
        isolated = [(c.host, c.fault, c.reason) for c in pipe.commands if c.action != "alert_only"]
        assert isolated == [], f"{name} on benign {kind}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_benign_shapes_isolate_nothing(name: str) -> None:
    """A static spread of up to 1 % between GPUs, a pipeline's bubbles, and one stage
    slower than the others by design: no detector isolates anything."""
    for kind, change in SHAPES.items():
        cfg = R(FAULTY, job=f"shape-{kind}", seed=4, **{"faults": [], **change})
        pipe = DetectionPipeline(config(name))
        for b in trace(cfg):
            pipe.feed(b)
        pipe.finish()
        isolated = [(c.host, c.fault, c.reason) for c in pipe.commands if c.action != "alert_only"]
        assert isolated == [], f"{name} on {kind}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_state_is_bounded_per_rank(name: str) -> None:
    """State after 36 s is no larger than after 18 s (plus slack for rings filling up),
    and the built-in detectors stay within 2 KB per rank-communicator."""
    sizes = []
    for secs in (18, 36):
        _, dets = run(name, R(FAULTY, duration_s=secs, faults=FAULTY.faults[:2]))
        ranks = sum(d.ranks.n for d in dets.values())
        mem = sum(d.state_bytes() for d in dets.values()) / ranks
        ckpt = sum(len(d.to_bytes()) for d in dets.values()) / ranks
        sizes.append((mem, ckpt))
    (m1, c1), (m2, c2) = sizes
    assert m2 <= 1.1 * m1 + 64 and c2 <= 1.1 * c1 + 64, sizes
    if name != "river":  # river's bound is its feature history (history_windows)
        assert max(m2, c2) <= 2048, sizes


def test_the_example_river_config_builds_its_detectors() -> None:
    path = Path(__file__).resolve().parents[2] / "docs" / "examples" / "worker-river.toml"
    detect = msgspec.convert(tomllib.loads(path.read_text())["worker"]["detect"], DetectConfig)
    engine = CoreEngine(detect)
    names = [d.name for d in engine.new_detector("0xa").detectors]
    assert names == ["hang", "river", "slow_conn"]
    assert engine.detect.river.params["window_size"] == 16
