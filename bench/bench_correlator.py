"""The correlator scaled out (issue 22, item 3): verdicts of 100k simulated GPUs through
a real broker into one correlator (``c4.verdicts`` with 1 partition) and into several
(``--partitions`` partitions keyed by job, shared by ``--workers`` worker processes).

The verdict stream is measured, not guessed: a base job (``--base-gpus``, a straggler in
it) is simulated and judged by the detection core, and its verdicts (findings and the
benign notes the correlator reads: census, waiting, silent) are replicated into as many
jobs as make ``--gpus`` GPUs (job names and ids renamed). They are produced at their
event-time pace (``--speed`` times faster), second by second, each second followed by a
watermark per job (as agent ``detect`` sends them), keyed and partitioned by job. Each
second the bench reads the workers' ``status.json``: verdicts judged so far against
verdicts produced is the lag (verdicts, and seconds at the input rate); at the end, how
long the workers took to drain the rest. A row keeps up when its lag stays bounded.

    python -m bench.bench_correlator                       # 100k GPUs, 1 vs 4 partitions
    python -m bench.bench_correlator --gpus 10000 --duration 20
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import msgspec
from confluent_kafka import Producer

from bench.bench_scaleout import _cpu_s
from c4base.kafka import KafkaConfig
from compose.local_broker import ensure_broker
from producers.simulator import SCENARIOS, FaultSpec, simulate, with_gpus
from streams.app.deadletter import CLOCK_HEADER
from streams.app.settings import WorkerConfig
from streams.app.topics_admin import ensure_topics
from streams.app.watermark import Watermark, encode_watermark, job_partition
from streams.core import DetectionPipeline
from streams.verdicts import Verdict, encode_verdict
from streams.worker import start_worker_process


def base_verdicts(gpus: int, duration_s: float) -> list[Verdict]:
    cfg = msgspec.structs.replace(
        with_gpus(SCENARIOS["healthy"], gpus),
        job="base",
        duration_s=duration_s,
        seed=4,
        faults=[FaultSpec(kind="straggler", host=3, gpu=2, start_s=8, severity=1.5)],
    )
    p = DetectionPipeline()
    for batch in simulate(cfg):
        p.feed(batch)
    p.finish()
    return sorted(p.verdicts, key=lambda v: v.ts_us)


def replicate(base: list[Verdict], jobs: int) -> dict[int, list[tuple[str, bytes]]]:
    """Per second of event time: (job, encoded verdict) for every job's copy."""
    t0 = base[0].ts_us // 1_000_000
    out: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
    for j in range(jobs):
        job = f"job-{j:04d}"
        for v in base:
            copy = msgspec.structs.replace(v, job=job, id=f"{v.id}-{j}")
            out[v.ts_us // 1_000_000 - t0].append((job, encode_verdict(copy)))
    return out


def run(bootstrap: str, tmp: Path, per_second: dict[int, list[tuple[str, bytes]]],
        base_t0_us: int, jobs: list[str], q: int, workers: int, speed: float) -> dict:  # fmt: skip
    cfgs = [
        WorkerConfig(
            kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=f"bc{q}-{uuid.uuid4().hex[:6]}."),
            events_partitions=1,
            verdicts_partitions=q,
            workdir=str(tmp / f"q{q}-w{i}"),
            tick_s=0.5,
            session_timeout_s=6.0,
            rebalance_timeout_s=6.0,
            heartbeat_interval_s=0.5,
            loglevel="warning",
        )
        for i in range(workers)
    ]
    cfgs[1:] = [msgspec.structs.replace(c, kafka=cfgs[0].kafka) for c in cfgs[1:]]
    ensure_topics(cfgs[0])
    topics = cfgs[0].topics()
    wm_topic = cfgs[0].watermark_topic()
    procs = [start_worker_process(c) for c in cfgs]
    samples: list[tuple[int, int]] = []
    try:
        for w in procs:
            w.wait_ready(120)
        time.sleep(3.0)  # the group settles: every verdicts partition owned
        cpu0 = _cpu_s(procs)
        p = Producer(KafkaConfig(bootstrap=bootstrap).producer_config(**{"linger.ms": 5}))
        produced = 0
        start = time.monotonic()
        for s in sorted(per_second):
            for job, data in per_second[s]:
                clock = base_t0_us + s * 1_000_000
                p.produce(topics.verdicts, key=job.encode(), value=data,
                          partition=job_partition(job, q),
                          headers=[(CLOCK_HEADER, str(clock).encode())])  # fmt: skip
                produced += 1
                if produced % 10_000 == 0:
                    p.poll(0)
            clock = base_t0_us + (s + 1) * 1_000_000
            for job in jobs:  # agent detect's watermark: the job judged up to here
                wm = Watermark(partition=0, clock_us=clock, caught_up=True, job=job)
                p.produce(wm_topic, key=b"0", value=encode_watermark(wm),
                          partition=job_partition(job, q))  # fmt: skip
            p.flush(30)
            judged = sum(w.status().get("correlate", {}).get("events", 0) for w in procs)
            samples.append((produced, judged))
            wait = start + (s + 1) / speed - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        sent_s = time.monotonic() - start
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            judged = sum(w.status().get("correlate", {}).get("events", 0) for w in procs)
            if judged >= produced:
                break
            time.sleep(0.2)
        total_s = time.monotonic() - start
        cpu = (_cpu_s(procs) or 0.0) - (cpu0 or 0.0)
        shares = [w.status().get("correlate", {}).get("events", 0) for w in procs]
    finally:
        for w in procs:
            w.stop()
    rate_in = produced / sent_s
    lags = [a - b for a, b in samples]
    return {
        "partitions": q,
        "workers": workers,
        "verdicts": produced,
        "rate_in": rate_in,
        "judged_per_s": judged / total_s,
        "max_lag": max(lags),
        "last_lag": lags[-1],
        "max_lag_s": max(lags) / rate_in if rate_in else math.inf,
        "drain_s": total_s - sent_s,
        "judged": judged,
        "shares": shares,
        "cpu_s": cpu,
        "per_cpu_s": judged / cpu if cpu > 0 else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=100_000)
    ap.add_argument("--base-gpus", type=int, default=256)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--speed", type=float, default=1.0)
    args = ap.parse_args(argv)
    base = base_verdicts(args.base_gpus, args.duration)
    n_jobs = max(1, round(args.gpus / args.base_gpus))
    per_second = replicate(base, n_jobs)
    jobs = [f"job-{j:04d}" for j in range(n_jobs)]
    t0 = (base[0].ts_us // 1_000_000) * 1_000_000
    print(f"{len(base):,} verdicts from {args.base_gpus} GPUs over {args.duration:g} s "
          f"({len(base) / args.base_gpus / args.duration:.3f} per GPU per second); "
          f"x{n_jobs} jobs = {n_jobs * args.base_gpus:,} GPUs, "
          f"{sum(map(len, per_second.values())):,} verdicts", file=sys.stderr)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as d, ensure_broker() as bootstrap:
        for q, w in ((1, 1), (args.partitions, args.workers)):
            r = run(bootstrap, Path(d), per_second, t0, jobs, q, w, args.speed)
            rows.append(r)
            print(r, file=sys.stderr)
    gpus = n_jobs * args.base_gpus
    per_gpu = sum(map(len, per_second.values())) / gpus / args.duration
    print(
        f"\nCorrelator at {gpus:,} simulated GPUs ({n_jobs} jobs of {args.base_gpus}), "
        f"{args.duration:g} s of verdicts ({per_gpu:.3f} per GPU per second) at "
        f"x{args.speed:g} pace:\n"
    )
    print(
        "| c4.verdicts partitions | workers | verdicts | verdicts/s in | judged/s (wall) | "
        "max lag | drain after input | judged per worker | worker CPU-s | verdicts per "
        "CPU-s | cores for 100k GPUs (x2) | keeps up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        need = 100_000 * per_gpu / r["per_cpu_s"] * 2 if r["per_cpu_s"] else math.inf
        keeps = r["judged"] >= r["verdicts"] and r["max_lag_s"] <= 5.0
        ok = ok and keeps
        print(
            f"| {r['partitions']} | {r['workers']} | {r['verdicts']:,} | {r['rate_in']:,.0f} | "
            f"{r['judged_per_s']:,.0f} | {r['max_lag']:,} ({r['max_lag_s']:.1f} s) | "
            f"{r['drain_s']:.1f} s | {', '.join(f'{x:,}' for x in r['shares'])} | "
            f"{r['cpu_s']:.1f} | {r['per_cpu_s']:,.0f} | {need:.1f} | "
            f"{'yes' if keeps else 'MISSED'} |"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
