"""Benchmark of the detection core: events per second per core, state bytes per rank.

Run: ``.venv/bin/python bench/bench_core.py [--seconds 6] [--repeat 3] [--only demo128,...]``

Scenarios (all through :class:`streams.core.DetectionPipeline`, the path ``c4stream
detect`` runs; the Faust worker drives the same ``CommDetector`` objects):

- ``demo128`` / ``demo1024``: the simulator's demo job (faults and benign events) at 128
  GPUs (24 communicators of 8-16 ranks) and 1,024 GPUs (136 communicators of 8 and 128
  ranks), batches as the exporters send them (one per host, communicator and second);
- ``comm1k`` / ``comm4k`` / ``comm16k``: one data-parallel communicator of 1,024, 4,096
  and 16,384 ranks running ``--per-second`` ring AllReduces a second (op events with
  their two connections) plus one heartbeat per rank per second.

Figures:

- *core ev/s*: events over the CPU time (``time.process_time``, best of ``--repeat``) of
  feeding already decoded batches: the core alone, per core. The inputs are built
  before timing and moved out of the garbage collector's view (``gc.freeze``): a
  streaming consumer does not hold a whole trace in memory, and collector passes over
  it would be charged to the core.
- *decode+core ev/s*: the same from JSON bytes, msgspec decoding included.
- *mem B* and *ckpt B*: state bytes per rank-communicator (``state_bytes()``: the
  detector's arrays and rings; ``to_bytes()``: its checkpoint), summed over
  communicators and divided by the summed ranks, after the run (windows reset);
  *peak ckpt B*: the checkpoint's largest, sampled every 200 messages of a run apart
  from the timed ones (mid-window: what a window's connection records add).
- ``--conn-parts N``: the parts a window's connection records are kept in
  (``ConnMatrix.PARTS``, 8; 1 is the window's mean alone, no trend): what the whole
  NIC's trend costs, side by side.

Targets (issue 6): >= 500,000 events/s per core in the core; <= 2 KB per rank-communicator.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from producers.events import Conn, Event, OpEvent, ProgressEvent, decode_message, encode_message
from producers.simulator import SCENARIOS as SIM_SCENARIOS
from producers.simulator import simulate, with_gpus
from streams.core import DetectionPipeline

T0 = 1_750_000_000_000_000
GPUS = 8
TARGET_EVS = 500_000
TARGET_BYTES = 2048


def build(nranks: int, seconds: int, per_second: int, seed: int = 0) -> list[list[Event]]:
    """Batches (one per host per second) of one DP communicator of ``nranks`` ranks."""
    rng = np.random.default_rng(seed)
    nhosts = max(1, nranks // GPUS)
    batches: list[list[Event]] = []
    seq = 0
    cb = 1 << 28
    for s in range(seconds):
        per_host: list[list[Event]] = [[] for _ in range(nhosts)]
        for k in range(per_second):
            exec_us = (20_000 + rng.normal(0, 300, nranks)).round(1).tolist()
            link_us = (10_000 + rng.normal(0, 100, nranks)).round(1).tolist()
            ts = T0 + s * 1_000_000 + k * (1_000_000 // per_second)
            for r in range(nranks):
                conns = [
                    Conn(peer=(r + 1) % nranks, dir="send", bytes=cb, time_us=link_us[r]),
                    Conn(peer=(r - 1) % nranks, dir="recv", bytes=cb, time_us=link_us[r - 1]),
                ]
                h = r % nhosts
                per_host[h].append(
                    OpEvent(
                        v=1,
                        job="bench",
                        comm="0xbench",
                        comm_name="dp-rail0",
                        nranks=nranks,
                        rank=r,
                        host=f"node-{h:05d}",
                        gpu=r // nhosts,
                        nic=f"mlx5_{r // nhosts}",
                        ts_us=ts,
                        op="AllReduce",
                        seq=seq,
                        bytes=cb,
                        exec_us=exec_us[r],
                        conns=conns,
                    )  # fmt: skip
                )
            seq += 1
        ts = T0 + s * 1_000_000 + 999_000
        for r in range(nranks):
            h = r % nhosts
            per_host[h].append(
                ProgressEvent(
                    v=1,
                    job="bench",
                    comm="0xbench",
                    comm_name="dp-rail0",
                    nranks=nranks,
                    rank=r,
                    host=f"node-{h:05d}",
                    gpu=r // nhosts,
                    nic=f"mlx5_{r // nhosts}",
                    ts_us=ts,
                    started=seq,
                    completed=seq,
                )  # fmt: skip
            )
        batches += per_host
    return batches


def demo(gpus: int) -> list[list[Event]]:
    """The simulator's demo job (seed 0) at ``gpus`` GPUs, as exporter batches."""
    import msgspec

    cfg = with_gpus(msgspec.structs.replace(SIM_SCENARIOS["demo"], seed=0), gpus)
    return list(simulate(cfg))


@dataclass(slots=True)
class Row:
    scenario: str
    comms: int
    events: int
    core_s: float
    decode_s: float
    mem_b: float
    ckpt_b: float
    peak_ckpt_b: float
    commands: int

    @property
    def core_evs(self) -> float:
        return self.events / self.core_s

    @property
    def decode_evs(self) -> float:
        return self.events / self.decode_s


def _cpu(fn: Callable[[], DetectionPipeline], repeat: int) -> tuple[float, DetectionPipeline]:
    """Best CPU time of ``repeat`` runs (the machine may be shared) and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    assert out is not None
    return best, out


def measure(name: str, batches: list[list[Event]], repeat: int) -> Row:
    raw = [encode_message(b) for b in batches]
    n_ev = sum(len(b) for b in batches)
    gc.collect()
    gc.freeze()  # the inputs are long-lived here, not in a streaming consumer

    def core() -> DetectionPipeline:
        pipe = DetectionPipeline()
        for b in batches:
            pipe.feed(b)
        pipe.finish()
        return pipe

    def decode_core() -> DetectionPipeline:
        pipe = DetectionPipeline()
        for m in raw:
            pipe.feed(decode_message(m))
        pipe.finish()
        return pipe

    core_s, pipe = _cpu(core, repeat)
    decode_s, _ = _cpu(decode_core, max(1, repeat - 1))
    gc.unfreeze()
    peak, sampled = 0.0, DetectionPipeline()
    for i, b in enumerate(batches):
        sampled.feed(b)
        if i % 200 == 199:
            live = list(sampled.detectors.values())
            n = sum(d.ranks.n for d in live) or 1
            peak = max(peak, sum(len(d.to_bytes()) for d in live) / n)
    dets = list(pipe.detectors.values())
    ranks = sum(d.ranks.n for d in dets)
    return Row(
        scenario=name,
        comms=len(dets),
        events=n_ev,
        core_s=core_s,
        decode_s=decode_s,
        mem_b=sum(d.state_bytes() for d in dets) / ranks,
        ckpt_b=sum(len(d.to_bytes()) for d in dets) / ranks,
        peak_ckpt_b=peak,
        commands=len(pipe.commands),
    )


def table(rows: list[Row]) -> str:
    """A Markdown table (it goes into the README as printed)."""
    head = (
        "| scenario | comms | events | core CPU s | core ev/s | decode+core ev/s "
        "| mem B/rank-comm | ckpt B/rank-comm | peak ckpt B/rank-comm | commands "
        "| >=500k ev/s | <=2 KB |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        fast = "yes" if r.core_evs >= TARGET_EVS else "NO"
        small = "yes" if max(r.mem_b, r.ckpt_b, r.peak_ckpt_b) <= TARGET_BYTES else "NO"
        lines.append(
            f"| {r.scenario} | {r.comms} | {r.events:,} | {r.core_s:.2f} | {r.core_evs:,.0f} "
            f"| {r.decode_evs:,.0f} | {r.mem_b:,.0f} | {r.ckpt_b:,.0f} | {r.peak_ckpt_b:,.0f} "
            f"| {r.commands} | {fast} | {small} |"
        )
    return "\n".join(lines)


SCENARIOS: dict[str, Callable[[argparse.Namespace], list[list[Event]]]] = {
    "demo128": lambda a: demo(128),
    "demo1024": lambda a: demo(1024),
    "comm1k": lambda a: build(1024, a.seconds, a.per_second),
    "comm4k": lambda a: build(4096, a.seconds, a.per_second),
    "comm16k": lambda a: build(16384, a.seconds, a.per_second),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=6, help="length of the single-comm runs")
    ap.add_argument("--per-second", type=int, default=4, help="collectives per second")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    ap.add_argument(
        "--conn-parts", type=int, default=None,
        help="parts of a window's connection records (default 8; 1: the mean alone, no trend)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.conn_parts is not None:
        if not 1 <= args.conn_parts <= 16:  # a part's index takes 4 bits of the fold's key
            ap.error("--conn-parts must be 1 to 16")
        from streams.core.slow_conn import ConnMatrix

        ConnMatrix.PARTS = args.conn_parts
    print(f"connection records in {args.conn_parts or 8} part(s) per window")
    rows = []
    for name in args.only.split(","):
        if name not in SCENARIOS:
            ap.error(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
        rows.append(measure(name, SCENARIOS[name](args), args.repeat))
        print(f"  {name}: {rows[-1].core_evs:,.0f} events/s", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
