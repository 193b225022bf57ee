"""Named simulator presets: one per fault kind, a benign mix, and the demo.

Each preset is a 128-GPU job (16 hosts x 8 GPUs, TP 8 inside a host, 8 DP rails) of
60 s unless said otherwise; :func:`~producers.simulator.config.with_gpus` resizes
one. Faults start at 20 s (slow faults) or 30 s (hangs), leaving a healthy stretch
for detectors to learn each communicator's normal behaviour.

>>> sorted(SCENARIOS)[:4]
['benign_mix', 'demo', 'healthy', 'host_down']
>>> SCENARIOS["straggler"].faults[0].kind
'straggler'
"""

from __future__ import annotations

from producers.simulator.config import BenignSpec, FaultSpec, SimConfig

__all__ = ["SCENARIOS", "describe"]


def _job(name: str, **kw: object) -> SimConfig:
    return SimConfig(job=f"sim-{name}", **kw)  # type: ignore[arg-type]


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
}


def describe(config: SimConfig) -> str:
    """One line saying what a preset holds.

    >>> describe(SCENARIOS["slow_nic"])
    '128 GPUs, 60 s; faults: slow_nic@node 9 from 20 s'
    """
    parts = [f"{config.gpus} GPUs, {config.duration_s:g} s"]
    if config.faults:
        parts.append(
            "faults: "
            + ", ".join(f"{f.kind}@node {f.host} from {f.start_s:g} s" for f in config.faults)
        )
    if config.benign:
        parts.append("benign: " + ", ".join(b.kind for b in config.benign))
    return "; ".join(parts)
