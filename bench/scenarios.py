"""The quality benchmark's suite: simulator runs per fault class and severity, plus benign runs.

A :class:`Scenario` is one simulated run: a *group* (the table row, e.g.
``straggler ×1.3``) and a seed. Each group is run with several seeds; the seed picks
the job size (cycling 128, 256, 512, 1024 GPUs; 1024 runs with two pipeline stages),
the faulty host/GPU/NIC, and the fault's start (20–30 s, after the detectors'
start-up). Slow faults and benign runs last 60–75 s; hang runs last until 615 s
after the hang so that the 10-minute watchdog baseline gets its chance to fire.

Default: 6 seeds per group (108 runs); ``--quick``: 2 seeds at 128 and 256 GPUs.

The *pipeline* suite (:func:`pipeline_suite`, :data:`PIPELINE_GROUPS`) is the shape of
large-model training: TP 8 in a host, a 4-stage 1F1B pipeline (8 stages at 2,048 GPUs),
ZeRO data parallel, ±1 % static GPU spread, at steps of 0.1, 1, 10 and 60 s, jobs of
128-2,048 GPUs. Faults start after 20 s or 6 steps (whichever is longer) and are
watched for 30 s or 8 steps (intermittent: 60 s or 20 steps; hangs: 90 s or 5 steps).

Groups:

====================  ===============================================================
straggler ×1.15/1.3/2  one GPU computes that many times slower
slow_nic 0.6/0.3       one NIC keeps that fraction of its bandwidth
slow_link 0.6/0.3      one direction of one link (host → next host on its DP rail)
rank_hang              one GPU's process stops (its exporter still reports)
host_down              a whole host goes silent
link_hang              one link stops moving bytes
… from t=0             a straggler ×1.15 and a slow NIC 0.6 present from the first
                       collective (a restarted job with a degraded node still in it)
benign: …              checkpoint (30 s job-wide pause), fabric congestion (10 s at
                       1/3 bandwidth), one-iteration GPU blip (4×), 50 ms clock offset,
                       a late role (one GPU position of every host ×1.2 from t=0),
                       and a healthy run: nothing may be isolated
====================  ===============================================================

>>> s = suite(quick=True)
>>> len(s), s[0].group, [x.config.gpus for x in s[:2]]
(36, 'straggler ×1.15', [128, 256])
>>> sorted({x.config.gpus for x in suite()})
[128, 256, 512, 1024]
>>> [f.kind for f in s[0].config.faults]
['straggler']
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from producers.simulator import BenignSpec, FaultSpec, SimConfig
from producers.simulator.config import ring_next, validate

__all__ = [
    "GROUPS",
    "PIPELINE_GROUPS",
    "PIPELINE_STEPS",
    "Group",
    "Scenario",
    "ShapeGroup",
    "ShapeScenario",
    "build",
    "build_shape",
    "pipeline_suite",
    "suite",
]

SIZES = (128, 256, 512, 1024)
"""Job sizes in GPUs; seed ``k`` runs at ``SIZES[k % 4]``."""
HANG_TAIL_S = 615.0
"""Hang runs continue this long after the hang (the watchdog fires at 600 s)."""
HANG_WATCH_S = 90.0
"""... but the fast detectors (c4stream, nccl-ras) see only this long after the hang.

Why: once a detector has named the culprit (seconds) the job is restarted; feeding
c4stream ten minutes of a frozen job only costs benchmark time (progress heartbeats
of every rank). A fast detector that has not found a hang within 90 s — 4.5 times the
NCCL-RAS threshold — is scored as having missed it. ``--full-tail`` lifts the cut.
"""


class Group(msgspec.Struct, kw_only=True, frozen=True):
    """One row of the table: a fault (or benign event) kind at one severity."""

    name: str
    kind: str
    """A simulator fault kind, or ``benign:<kind>``, or ``healthy``."""
    severity: float | None = None
    from_start: bool = False
    """The fault is present from the first collective (start 0 s)."""

    @property
    def benign(self) -> bool:
        return self.kind not in _FAULT_KINDS


_FAULT_KINDS = {"straggler", "slow_nic", "slow_link", "rank_hang", "host_down", "link_hang"}

GROUPS: tuple[Group, ...] = (
    Group(name="straggler ×1.15", kind="straggler", severity=1.15),
    Group(name="straggler ×1.3", kind="straggler", severity=1.3),
    Group(name="straggler ×2", kind="straggler", severity=2.0),
    Group(name="slow_nic 0.6", kind="slow_nic", severity=0.6),
    Group(name="slow_nic 0.3", kind="slow_nic", severity=0.3),
    Group(name="slow_link 0.6", kind="slow_link", severity=0.6),
    Group(name="slow_link 0.3", kind="slow_link", severity=0.3),
    Group(name="rank_hang", kind="rank_hang"),
    Group(name="host_down", kind="host_down"),
    Group(name="link_hang", kind="link_hang"),
    Group(name="straggler ×1.15 from t=0", kind="straggler", severity=1.15, from_start=True),
    Group(name="slow_nic 0.6 from t=0", kind="slow_nic", severity=0.6, from_start=True),
    Group(name="benign: checkpoint 30 s", kind="benign:checkpoint"),
    Group(name="benign: congestion", kind="benign:congestion"),
    Group(name="benign: GPU blip", kind="benign:blip"),
    Group(name="benign: clock offset", kind="benign:clock_offset"),
    Group(name="benign: late role", kind="benign:role_late"),
    Group(name="healthy", kind="healthy"),
)


class Scenario(msgspec.Struct, kw_only=True, frozen=True):
    """One simulated run of the suite."""

    group: str
    kind: str
    seed: int
    config: SimConfig
    watch_s: float | None = None
    """Simulated time after which only the watchdog is fed (None: everyone sees all)."""

    @property
    def name(self) -> str:
        return f"{self.group} / seed {self.seed} / {self.config.gpus} GPUs"

    @property
    def cost(self) -> float:
        """Rough relative cost (rank-seconds fed to c4stream), to schedule big runs first."""
        return self.config.gpus * (self.watch_s or self.config.duration_s)


def build(
    group: Group, seed: int, gpus: int | None = None, hang_watch_s: float | None = HANG_WATCH_S
) -> Scenario:
    """The run of ``group`` with ``seed`` (deterministic); ``gpus`` overrides the size.

    ``hang_watch_s``: see :data:`HANG_WATCH_S` (None: every detector sees the whole run).

    >>> sc = build(GROUPS[9], seed=1)
    >>> f = sc.config.faults[0]
    >>> sc.config.gpus, f.kind, f.peer_host == f.host + 1 or f.peer_host == 0
    (256, 'link_hang', True)
    >>> sc.config.duration_s - f.start_s
    615.0
    """
    rng = random.Random(f"{group.name}/{seed}")
    gpus = gpus or SIZES[seed % len(SIZES)]
    gph = 8
    hosts = gpus // gph
    pp = 2 if gpus >= 1024 else 1
    base = SimConfig(
        job=f"bench-{group.kind.replace(':', '-')}-{seed}",
        hosts=hosts,
        gpus_per_host=gph,
        tp=8,
        pp=pp,
        seed=seed,
        duration_s=60.0,
    )
    host, gpu, nic = rng.randrange(hosts), rng.randrange(gph), rng.randrange(gph)
    start = round(rng.uniform(20.0, 30.0), 2)
    if group.from_start:
        start = 0.0
    faults: list[FaultSpec] = []
    benign: list[BenignSpec] = []
    duration = 60.0
    kind = group.kind
    if kind in ("straggler", "rank_hang"):
        faults.append(
            FaultSpec(kind=kind, host=host, gpu=gpu, start_s=start, severity=group.severity or 1.5)
        )
    elif kind == "slow_nic":
        faults.append(
            FaultSpec(kind=kind, host=host, nic=nic, start_s=start, severity=group.severity or 0.5)
        )
    elif kind in ("slow_link", "link_hang"):
        peer = ring_next(base, host)
        faults.append(
            FaultSpec(
                kind=kind,  # type: ignore[arg-type]
                host=host,
                peer_host=peer,
                nic=nic,
                start_s=start,
                severity=group.severity or 0.5,
            )
        )
    elif kind == "host_down":
        faults.append(FaultSpec(kind=kind, host=host, start_s=start))
    elif kind == "benign:checkpoint":
        benign.append(BenignSpec(kind="checkpoint", start_s=start, duration_s=30.0))
        duration = 75.0
    elif kind == "benign:congestion":
        benign.append(BenignSpec(kind="congestion", start_s=start, duration_s=10.0, severity=3.0))
    elif kind == "benign:blip":
        benign.append(BenignSpec(kind="blip", start_s=start, host=host, gpu=gpu, severity=4.0))
    elif kind == "benign:clock_offset":
        benign.append(BenignSpec(kind="clock_offset", host=host, severity=50.0))
    elif kind == "benign:role_late":
        benign.append(BenignSpec(kind="role_late", start_s=0.0, gpu=gpu, severity=1.2))
    elif kind != "healthy":
        raise ValueError(f"unknown group kind {kind!r}; use one of GROUPS")
    watch = None
    if kind in ("rank_hang", "host_down", "link_hang"):
        duration = start + HANG_TAIL_S
        watch = None if hang_watch_s is None else start + hang_watch_s
    cfg = msgspec.structs.replace(base, duration_s=duration, faults=faults, benign=benign)
    return Scenario(group=group.name, kind=kind, seed=seed, config=validate(cfg), watch_s=watch)


def suite(
    quick: bool = False,
    seeds: int | None = None,
    gpus: Sequence[int] | None = None,
    only: str | None = None,
    hang_watch_s: float | None = HANG_WATCH_S,
) -> list[Scenario]:
    """The benchmark's runs: every group × ``seeds`` seeds (default 6; quick: 2, at 128/256 GPUs).

    ``gpus`` forces the sizes (cycled over seeds); ``only`` keeps groups whose name
    contains it.
    """
    n = seeds if seeds is not None else (2 if quick else 6)
    sizes = list(gpus) if gpus else (list(SIZES[:2]) if quick else list(SIZES))
    out = []
    for group in GROUPS:
        if only and only not in group.name:
            continue
        for seed in range(n):
            out.append(build(group, seed, sizes[seed % len(sizes)], hang_watch_s))
    return out


# --------------------------------------------------------------------------- pipeline

PIPELINE_STEPS: tuple[float, ...] = (0.1, 1.0, 10.0, 60.0)
"""Step times of the pipeline rows, seconds."""

PIPELINE_SIZES: dict[float, tuple[int, ...]] = {
    0.1: (128,),
    1.0: (128, 2048, 512),
    10.0: (256, 1024),
    60.0: (128, 512),
}
"""Job sizes cycled over seeds per step time: the rank-seconds a run costs grow with
the collectives per second, so the fastest steps run on the smaller jobs."""


class ShapeGroup(msgspec.Struct, kw_only=True, frozen=True):
    """A fault class (or benign event) on the pipeline shape: one row per step time."""

    name: str
    kind: str
    """A simulator fault kind, ``benign:<kind>``, or ``healthy``."""
    severity: float | None = None
    from_start: bool = False
    duty: float = 1.0
    ramp_s: float = 0.0
    spread: float = 0.01
    pair_ring: bool = False
    """Two hosts per stage: a NIC's only data-parallel peer is its neighbour."""

    @property
    def benign(self) -> bool:
        return self.kind not in _FAULT_KINDS


PIPELINE_GROUPS: tuple[ShapeGroup, ...] = (
    ShapeGroup(name="straggler ×1.2 mid-run", kind="straggler", severity=1.2),
    ShapeGroup(name="straggler ×1.25 from t=0", kind="straggler", severity=1.25, from_start=True),
    ShapeGroup(name="intermittent ×1.5 on 30 %", kind="straggler", severity=1.5, duty=0.3),
    ShapeGroup(name="pipeline link 0.4 one-way", kind="slow_link", severity=0.4),
    ShapeGroup(name="slow NIC 0.5, 2-host ring", kind="slow_nic", severity=0.5, pair_ring=True),
    ShapeGroup(name="NIC 1.0→0.4 over 90 s", kind="slow_nic", severity=0.4, ramp_s=90.0),
    ShapeGroup(name="rank_hang", kind="rank_hang"),
    ShapeGroup(name="host_down", kind="host_down"),
    ShapeGroup(name="link_hang", kind="link_hang"),
    ShapeGroup(name="benign: stage imbalance ×1.3", kind="benign:stage_heavy", severity=1.3),
    ShapeGroup(name="benign: bubbles only", kind="healthy", spread=0.0),
    ShapeGroup(name="benign: static spread ±1 %", kind="healthy", spread=0.01),
    ShapeGroup(name="benign: checkpoint 30 s", kind="benign:checkpoint"),
    ShapeGroup(name="benign: congestion", kind="benign:congestion"),
)

PIPELINE_BASE = SimConfig(
    gpus_per_host=8, tp=8, pp=4, schedule="1f1b", microbatches=4, layers=1, dp_mode="zero",
    dp_buckets=1,
)  # fmt: skip
"""The bench's pipeline job: TP 8 in a host, a 1F1B pipeline of 4 stages (8 for 2,048
GPUs; as deep as the hosts allow for the 2-host ring), 4 microbatches, 1 layer per
stage, ZeRO: about 30 collectives per rank per step — few, so 100+ runs fit on two
cores (the rate knob of the simulator makes real rates)."""


class ShapeScenario(msgspec.Struct, kw_only=True, frozen=True):
    """One simulated run of the pipeline suite."""

    group: str
    kind: str
    step_s: float
    seed: int
    config: SimConfig

    @property
    def row(self) -> str:
        return f"{self.group} · step {self.step_s:g} s"

    @property
    def name(self) -> str:
        return f"{self.row} / seed {self.seed} / {self.config.gpus} GPUs"

    @property
    def cost(self) -> float:
        """Rough relative cost: rank-seconds times (collectives per second + heartbeats)."""
        from producers.simulator.config import collectives_per_step

        rate = collectives_per_step(self.config) / self.step_s + 4
        return self.config.gpus * self.config.duration_s * rate


PAIR_RING_MAX_GPUS = 256
"""Largest job of the two-host-ring row (its pipeline has hosts / 2 stages)."""
PIPELINE_HANG_WATCH_S = 60.0
"""A hang run of the pipeline rows lasts this long past the hang, or 10 steps when
longer: only c4stream is judged there (no 10-minute watchdog tail), and it finds hangs
within a few of its hang thresholds, which follow the step."""


def _learn_s(step_s: float) -> float:
    """Healthy time before a fault: 20 s or 6 steps, whichever is longer."""
    return max(20.0, 6 * step_s)


def build_shape(group: ShapeGroup, step_s: float, seed: int, gpus: int) -> ShapeScenario:
    """The run of ``group`` at step ``step_s`` with ``seed`` on ``gpus`` GPUs (deterministic).

    >>> sc = build_shape(PIPELINE_GROUPS[3], 1.0, seed=0, gpus=128)
    >>> f = sc.config.faults[0]
    >>> f.kind, abs(f.peer_host - f.host) == sc.config.hosts_per_stage, f.severity
    ('slow_link', True, 0.4)
    >>> build_shape(PIPELINE_GROUPS[4], 1.0, seed=0, gpus=128).config.hosts_per_stage
    2
    """
    from producers.simulator.config import with_step

    rng = random.Random(f"pipeline/{group.name}/{step_s}/{seed}")
    if group.pair_ring:
        # two hosts per stage make the pipeline as deep as the job is wide: at 2,048
        # GPUs a 128-stage pipeline, a shape nobody trains (and the suite's costliest
        # run by far); the two-host ring is run on jobs of up to 256 GPUs (16 stages)
        gpus = min(gpus, PAIR_RING_MAX_GPUS)
    hosts = gpus // 8
    pp = hosts // 2 if group.pair_ring else (8 if gpus >= 2048 else 4)
    base = msgspec.structs.replace(
        PIPELINE_BASE,
        job=f"bench-pp-{group.kind.replace(':', '-')}-{step_s:g}-{seed}",
        hosts=hosts,
        pp=pp,
        seed=seed,
        gpu_spread=group.spread,
    )
    if group.pair_ring:
        base = msgspec.structs.replace(base, microbatches=max(4, pp))  # M >= P, as 1F1B runs
    base = with_step(base, step_s)
    hps = base.hosts_per_stage
    learn = _learn_s(step_s)
    start = 0.0 if group.from_start else round(learn + rng.uniform(0, max(5.0, step_s)), 2)
    after = max(30.0, 8 * step_s)
    host, gpu, nic = rng.randrange(hosts), rng.randrange(8), rng.randrange(8)
    faults: list[FaultSpec] = []
    benign: list[BenignSpec] = []
    kind = group.kind
    duration = start + after
    if kind == "straggler":
        if group.duty < 1:
            after = max(60.0, 20 * step_s)  # a minority of steps: longer evidence
        faults.append(
            FaultSpec(kind="straggler", host=host, gpu=gpu, start_s=start,
                      severity=group.severity or 1.2, duty=group.duty)
        )  # fmt: skip
        duration = (learn if group.from_start else start) + after
    elif kind == "slow_link":
        forward = rng.random() < 0.5
        stage = rng.randrange(pp - 1) + (0 if forward else 1)
        host = stage * hps + rng.randrange(hps)
        peer = host + hps if forward else host - hps
        faults.append(
            FaultSpec(kind="slow_link", host=host, peer_host=peer, nic=nic, start_s=start,
                      severity=group.severity or 0.4)
        )  # fmt: skip
    elif kind == "slow_nic":
        faults.append(
            FaultSpec(kind="slow_nic", host=host, nic=nic, start_s=start,
                      severity=group.severity or 0.5, ramp_s=group.ramp_s)
        )  # fmt: skip
        if group.ramp_s:
            frac = group.severity or 0.4
            crossing = start + group.ramp_s * 0.25 / (1 - frac)
            duration = crossing + after
    elif kind in ("rank_hang", "host_down", "link_hang"):
        if kind == "rank_hang":
            faults.append(FaultSpec(kind="rank_hang", host=host, gpu=gpu, start_s=start))
        elif kind == "host_down":
            faults.append(FaultSpec(kind="host_down", host=host, start_s=start))
        else:
            faults.append(
                FaultSpec(kind="link_hang", host=host, peer_host=ring_next(base, host), nic=nic,
                          start_s=start)
            )  # fmt: skip
        duration = start + max(PIPELINE_HANG_WATCH_S, 10 * step_s)
    elif kind == "benign:stage_heavy":
        stage = rng.choice([0, pp - 1])  # the stage with the embedding or the loss
        benign.append(BenignSpec(kind="stage_heavy", stage=stage, severity=group.severity or 1.3))
    elif kind == "benign:checkpoint":
        benign.append(BenignSpec(kind="checkpoint", start_s=start, duration_s=30.0))
        duration = start + 30.0 + after
    elif kind == "benign:congestion":
        span = max(10.0, 2 * step_s)
        benign.append(BenignSpec(kind="congestion", start_s=start, duration_s=span, severity=3.0))
        duration = start + span + after
    elif kind != "healthy":
        raise ValueError(f"unknown group kind {kind!r}; use one of PIPELINE_GROUPS")
    cfg = msgspec.structs.replace(base, duration_s=round(duration, 2), faults=faults, benign=benign)
    return ShapeScenario(
        group=group.name, kind=kind, step_s=step_s, seed=seed, config=validate(cfg)
    )


def pipeline_suite(
    quick: bool = False,
    seeds: int | None = None,
    gpus: Sequence[int] | None = None,
    only: str | None = None,
    steps: Sequence[float] | None = None,
) -> list[ShapeScenario]:
    """The pipeline rows' runs: every group × step time × seeds (default: 2 per fault
    row, 3 per benign row, 132 runs; quick: 1 seed, steps 1 and 10 s, 128/256 GPUs).

    >>> len(pipeline_suite()), len(pipeline_suite(quick=True))
    (132, 28)
    >>> sorted({s.config.gpus for s in pipeline_suite()})
    [128, 256, 512, 1024, 2048]
    """
    chosen = tuple(steps) if steps else ((1.0, 10.0) if quick else PIPELINE_STEPS)
    out = []
    for group in PIPELINE_GROUPS:
        if only and only not in group.name:
            continue
        n = seeds if seeds is not None else (1 if quick else (3 if group.benign else 2))
        for step in chosen:
            sizes = list(gpus) if gpus else list(PIPELINE_SIZES.get(step, (128,)))
            if quick and not gpus:
                sizes = [min(sizes)]
            for seed in range(n):
                out.append(build_shape(group, step, seed, sizes[seed % len(sizes)]))
    return out
