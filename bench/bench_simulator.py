"""Simulator throughput: events generated per second on one core, at 128 to 4096 GPUs.

Two figures per size: ``simulate()`` alone (building the contract events in memory)
and ``write_trace()`` (the same plus JSON encoding and gzip into a file, what
``c4stream simulate`` does)::

    python -m bench.bench_simulator                       # 128, 1024, 4096 GPUs, 30 s of the demo
    python -m bench.bench_simulator --gpus 128 --duration 60 --scenario straggler

Prints one table row per (gpus, stage): gpus, events, seconds (wall), events/s (wall),
cpu s and events per CPU second (the fair figure on a shared, busy machine), MB.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import msgspec

from producers.simulator import SCENARIOS, simulate, with_gpus, write_trace


def measure(scenario: str, gpus: int, duration: float, seed: int) -> list[tuple]:
    """Rows (gpus, stage, events, seconds, events/s, MB) for one job size."""
    cfg = msgspec.structs.replace(
        with_gpus(SCENARIOS[scenario], gpus), duration_s=duration, seed=seed
    )
    t0, c0 = time.perf_counter(), time.process_time()
    events = sum(len(batch) for batch in simulate(cfg))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = [(gpus, "simulate", events, dt, cpu, 0.0)]
    with tempfile.TemporaryDirectory() as tmp:
        c0 = time.process_time()
        stats = write_trace(cfg, Path(tmp) / "t.jsonl.gz", Path(tmp) / "truth.json")
        cpu = time.process_time() - c0
    rows.append((gpus, "write .gz", stats.events, stats.wall_s, cpu, stats.bytes / 1e6))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--duration", type=float, default=30.0, help="simulated seconds per run")
    ap.add_argument("--scenario", default="demo", choices=sorted(SCENARIOS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"scenario {args.scenario}, {args.duration:g} simulated seconds, one core")
    print(
        f"{'gpus':>6} {'stage':<10} {'events':>10} {'seconds':>8} {'events/s':>10} "
        f"{'cpu s':>7} {'ev/cpu-s':>10} {'MB':>7}"
    )
    for gpus in args.gpus:
        for g, stage, events, dt, cpu, mb in measure(args.scenario, gpus, args.duration, args.seed):
            print(
                f"{g:>6} {stage:<10} {events:>10,} {dt:>8.2f} {events / dt:>10,.0f} "
                f"{cpu:>7.2f} {events / cpu:>10,.0f} {mb:>7.1f}"
            )


if __name__ == "__main__":
    main()
