"""Named simulator presets: one per fault kind, a benign mix, and the demo.

Each preset is a 128-GPU job (16 hosts x 8 GPUs, TP 8 inside a host, 8 DP rails) of
60 s unless said otherwise; :func:`~producers.simulator.config.with_gpus` resizes
one. Faults start at 20 s (slow faults) or 30 s (hangs), leaving a healthy stretch
for detectors to learn each communicator's normal behaviour.

The ``pp_*`` and ``long_step_*`` presets have the shape of large-model training
(:data:`PIPELINE`): TP 8 inside a host, a 4-stage 1F1B pipeline of Send/Recv pairs
with 8 microbatches and 4 layers per stage, ZeRO data parallel over 4 hosts per stage,
a static ±1 % speed spread between GPUs, and a step of about 1 s (``long_step_*``:
46 s, one ReduceScatter per data-parallel ring per step).

>>> sorted(SCENARIOS)[:4]
['benign_mix', 'demo', 'healthy', 'host_down']
>>> SCENARIOS["straggler"].faults[0].kind
'straggler'
"""

from __future__ import annotations

import msgspec

from producers.simulator.config import BenignSpec, FaultSpec, SimConfig, with_step

__all__ = ["PIPELINE", "SCENARIOS", "describe"]


def _job(name: str, **kw: object) -> SimConfig:
    return SimConfig(job=f"sim-{name}", **kw)  # type: ignore[arg-type]


PIPELINE = with_step(
    SimConfig(
        hosts=16, gpus_per_host=8, tp=8, pp=4, schedule="1f1b", microbatches=8, layers=4,
        dp_mode="zero", dp_buckets=2, gpu_spread=0.01,
    ),
    1.0,
)  # fmt: skip
"""The base of the pipeline presets: 128 GPUs, 1F1B over 4 stages, ZeRO, ~1-s steps."""

LONG_STEP = with_step(
    SimConfig(
        hosts=4, gpus_per_host=8, tp=8, pp=1, schedule="1f1b", microbatches=4, layers=2,
        dp_mode="zero", dp_buckets=1, gpu_spread=0.01, duration_s=12 * 46.0,
    ),
    46.0,
)  # fmt: skip
"""A 46-s step over a data-parallel group of 4 hosts (32 GPUs), one ReduceScatter and
one AllGather per ring per step; 12 steps."""


def _pp(name: str, base: SimConfig = PIPELINE, **kw: object) -> SimConfig:
    return msgspec.structs.replace(base, job=f"sim-{name}", **kw)


def _rate(base: SimConfig, rate: float) -> SimConfig:
    """About ``rate`` collectives per second per rank: layers from the shape's count per
    step (compute-bound), thinner TP messages so NVLink time stays small."""
    return msgspec.structs.replace(
        with_step(base, 0.9), layers=max(1, round((rate - 30) / 28)), tp_bytes=4 << 20
    )


SCENARIOS: dict[str, SimConfig] = {
    "healthy": _job("healthy"),
    "straggler": _job(
        "straggler",
        faults=[FaultSpec(kind="straggler", host=5, gpu=3, start_s=20, severity=1.3)],
    ),
    "slow_nic": _job(
        "slow_nic", faults=[FaultSpec(kind="slow_nic", host=9, nic=2, start_s=20, severity=0.5)]
    ),
    "slow_link": _job(
        "slow_link",
        faults=[FaultSpec(kind="slow_link", host=3, peer_host=4, nic=6, start_s=20, severity=0.4)],
    ),
    "rank_hang": _job("rank_hang", faults=[FaultSpec(kind="rank_hang", host=7, gpu=1, start_s=30)]),
    "host_down": _job("host_down", faults=[FaultSpec(kind="host_down", host=11, start_s=30)]),
    "link_hang": _job(
        "link_hang",
        faults=[FaultSpec(kind="link_hang", host=2, peer_host=3, nic=5, start_s=30)],
    ),
    "benign_mix": _job(
        "benign_mix",
        benign=[
            BenignSpec(kind="checkpoint", start_s=15, duration_s=5),
            BenignSpec(kind="congestion", start_s=30, duration_s=10, severity=2.0),
            BenignSpec(kind="blip", start_s=45, host=4, gpu=2, severity=3.0),
            BenignSpec(kind="clock_offset", host=6, severity=4.0),
        ],
    ),
    "demo": _job(
        "demo",
        duration_s=90,
        faults=[
            FaultSpec(kind="straggler", host=3, gpu=5, start_s=20, end_s=45, severity=1.3),
            FaultSpec(kind="slow_nic", host=12, nic=1, start_s=50, severity=0.5),
            FaultSpec(kind="host_down", host=8, start_s=75),
        ],
        benign=[
            BenignSpec(kind="checkpoint", start_s=10, duration_s=4),
            BenignSpec(kind="congestion", start_s=35, duration_s=5, severity=1.8),
            BenignSpec(kind="blip", start_s=60, host=6, gpu=0, severity=3.0),
            BenignSpec(kind="clock_offset", host=2, severity=5.0),
        ],
    ),
    # ---- the shapes of large-model training (docs/simulator.md, "Pipeline shapes") ----
    "pp_healthy": _pp("pp_healthy"),
    "pp_interleaved": _pp("pp_interleaved", schedule="interleaved", virtual_stages=2),
    "pp_fsdp": _pp("pp_fsdp", dp_mode="fsdp"),
    "pp_moe": _pp("pp_moe", moe_every=2, ep=2),
    "pp_rate1000": _pp("pp_rate1000", base=_rate(PIPELINE, 1000), duration_s=20),
    "pp_straggler": _pp(
        "pp_straggler",
        faults=[FaultSpec(kind="straggler", host=6, gpu=3, start_s=20, severity=1.2)],
    ),
    "pp_straggler_t0": _pp(
        "pp_straggler_t0",
        faults=[FaultSpec(kind="straggler", host=13, gpu=1, start_s=0, severity=1.25)],
    ),
    "pp_intermittent": _pp(
        "pp_intermittent",
        duration_s=90,
        faults=[FaultSpec(kind="straggler", host=9, gpu=5, start_s=10, severity=1.5, duty=0.3)],
    ),
    "pp_straggler_2048": _pp(
        "pp_straggler_2048",
        hosts=256,
        pp=8,
        faults=[FaultSpec(kind="straggler", host=100, gpu=2, start_s=20, severity=1.2)],
    ),
    "pp_slow_link": _pp(
        "pp_slow_link",
        faults=[FaultSpec(kind="slow_link", host=5, peer_host=9, nic=3, start_s=20, severity=0.4)],
    ),
    "pp_slow_nic_pair": _pp(
        "pp_slow_nic_pair",
        hosts=8,
        faults=[FaultSpec(kind="slow_nic", host=3, nic=2, start_s=20, severity=0.5)],
    ),
    "pp_nic_degrading": _pp(
        "pp_nic_degrading",
        duration_s=140,
        faults=[FaultSpec(kind="slow_nic", host=10, nic=6, start_s=20, ramp_s=90, severity=0.4)],
    ),
    "pp_rank_hang": _pp(
        "pp_rank_hang", faults=[FaultSpec(kind="rank_hang", host=7, gpu=1, start_s=30)]
    ),
    "pp_host_down": _pp("pp_host_down", faults=[FaultSpec(kind="host_down", host=11, start_s=30)]),
    "pp_link_hang": _pp(
        "pp_link_hang",
        faults=[FaultSpec(kind="link_hang", host=4, peer_host=5, nic=2, start_s=30)],
    ),
    "pp_stage_heavy": _pp(
        "pp_stage_heavy", benign=[BenignSpec(kind="stage_heavy", stage=3, severity=1.3)]
    ),
    "pp_benign_mix": _pp(
        "pp_benign_mix",
        benign=[
            BenignSpec(kind="checkpoint", start_s=15, duration_s=5),
            BenignSpec(kind="congestion", start_s=30, duration_s=10, severity=2.0),
            BenignSpec(kind="blip", start_s=45, host=4, gpu=2, severity=3.0),
            BenignSpec(kind="clock_offset", host=6, severity=4.0),
        ],
    ),
    "long_step_healthy": _pp("long_step_healthy", base=LONG_STEP),
    "long_step_straggler": _pp(
        "long_step_straggler",
        base=LONG_STEP,
        faults=[FaultSpec(kind="straggler", host=2, gpu=4, start_s=0, severity=1.06)],
    ),
}


def describe(config: SimConfig) -> str:
    """One line saying what a preset holds.

    >>> describe(SCENARIOS["slow_nic"])
    '128 GPUs, 60 s; faults: slow_nic@node 9 from 20 s'
    """
    parts = [f"{config.gpus} GPUs, {config.duration_s:g} s"]
    if config.pipelined:
        from producers.simulator.config import describe_shape, step_estimate_s

        parts[0] += f", {describe_shape(config)}, step ~{step_estimate_s(config):.3g} s"
    if config.faults:
        parts.append(
            "faults: "
            + ", ".join(f"{f.kind}@node {f.host} from {f.start_s:g} s" for f in config.faults)
        )
    if config.benign:
        parts.append("benign: " + ", ".join(b.kind for b in config.benign))
    return "; ".join(parts)
