"""The quality benchmark's suite: simulator runs per fault class and severity, plus benign runs.

A :class:`Scenario` is one simulated run: a *group* (the table row, e.g.
``straggler ×1.3``) and a seed. Each group is run with several seeds; the seed picks
the job size (cycling 128, 256, 512, 1024 GPUs; 1024 runs with two pipeline stages),
the faulty host/GPU/NIC, and the fault's start (20–30 s, after the detectors'
start-up). Slow faults and benign runs last 60–75 s; hang runs last until 615 s
after the hang so that the 10-minute watchdog baseline gets its chance to fire.

Default: 6 seeds per group (108 runs); ``--quick``: 2 seeds at 128 and 256 GPUs.

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

__all__ = ["GROUPS", "Group", "Scenario", "build", "suite"]

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
