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
long the workers took to drain the rest. Two verdicts are printed per row: **by CPU**
(the verdicts per worker CPU-second measured, against the input rate: the cores it
needs while the verdicts come — they come in bursts at window ends — and on average
over the run; it keeps up by CPU when the average needs no more cores than the row's
workers, one core each, so a burst's backlog drains before the next), and **in wall
time on this machine** (the lag stayed within 5 s of input and
everything was judged: MISSED where not, e.g. when the machine has fewer free cores
than the row's workers).

Before the broker runs, the correlator's checkpoint is measured broker-free on the same
verdicts in one correlator (every job on one partition): the whole partition's state
(the form before) against one job's part (what is written per dirty job now), bytes and
encoding time.

    python -m bench.bench_correlator                       # 100k GPUs, 1 vs 4 partitions
    python -m bench.bench_correlator --gpus 10000 --duration 20
"""

from __future__ import annotations

import argparse
import math
import os
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
from streams.core import DetectionPipeline, HostCorrelator, PolicyConfig
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


def checkpoint_sizes(per_second: dict[int, list[tuple[str, bytes]]]) -> list[list[str]]:
    """One correlator fed every job's verdicts: the whole state's checkpoint against one
    job's part (bytes, encoding ms; the median of the jobs for the part)."""
    from streams.verdicts import decode_verdict

    c = HostCorrelator(PolicyConfig())
    jobs: set[str] = set()
    for s in sorted(per_second):
        for job, data in per_second[s]:
            c.observe(decode_verdict(data))
            jobs.add(job)
    t = time.perf_counter()
    whole = len(c.to_bytes())
    whole_ms = (time.perf_counter() - t) * 1e3
    parts = []
    for job in sorted(jobs)[:: max(1, len(jobs) // 32)]:  # a sample of the jobs
        t = time.perf_counter()
        n = len(c.to_bytes(job))
        parts.append((n, (time.perf_counter() - t) * 1e3))
    parts.sort()
    n, ms = parts[len(parts) // 2]
    return [
        [f"whole partition ({len(jobs)} jobs; the form before)", f"{whole:,}", f"{whole_ms:.0f}"],
        ["one job's part (written per dirty job now)", f"{n:,}", f"{ms:.1f}"],
    ]


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
        # every second of event time, those without verdicts too (their watermarks
        # still go out): the input keeps the job's own pace
        for s in range(max(per_second) + 1):
            for job, data in per_second.get(s, ()):
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
    ap.add_argument("--no-broker", action="store_true", help="the checkpoint table only")
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
    print(f"\nThe correlator's checkpoint, {n_jobs} jobs of {args.base_gpus} GPUs on one "
          "partition (broker-free, the same verdicts):\n")  # fmt: skip
    print("| checkpoint | bytes | encode ms |\n|---|---|---|")
    for row in checkpoint_sizes(per_second):
        print("| " + " | ".join(row) + " |")
    if args.no_broker:
        return 0
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
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    mean_in = sum(map(len, per_second.values())) / args.duration
    print(f"(this machine: {cores} cores, load average {load:.1f}; the input's mean "
          f"{mean_in:,.0f} verdicts/s over the {args.duration:g} s; by CPU: the cores the "
          "input needs at the measured verdicts per CPU-s, while it comes and on average, "
          "against one core per worker; wall: the lag stayed within 5 s and everything "
          "was judged)\n")  # fmt: skip
    print(
        "| c4.verdicts partitions | workers | verdicts | verdicts/s in | judged/s (wall) | "
        "max lag | drain after input | judged per worker | worker CPU-s | verdicts per "
        "CPU-s | cores while it comes / mean | keeps up by CPU | keeps up in wall time "
        "here | cores for 100k GPUs (x2) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        need = 100_000 * per_gpu / r["per_cpu_s"] * 2 if r["per_cpu_s"] else math.inf
        cores_in = r["rate_in"] / r["per_cpu_s"] if r["per_cpu_s"] else math.inf
        cores_mean = mean_in / r["per_cpu_s"] if r["per_cpu_s"] else math.inf
        by_cpu = cores_mean <= r["workers"]
        keeps = r["judged"] >= r["verdicts"] and r["max_lag_s"] <= 5.0
        ok = ok and keeps
        print(
            f"| {r['partitions']} | {r['workers']} | {r['verdicts']:,} | {r['rate_in']:,.0f} | "
            f"{r['judged_per_s']:,.0f} | {r['max_lag']:,} ({r['max_lag_s']:.1f} s) | "
            f"{r['drain_s']:.1f} s | {', '.join(f'{x:,}' for x in r['shares'])} | "
            f"{r['cpu_s']:.1f} | {r['per_cpu_s']:,.0f} | {cores_in:.1f} / {cores_mean:.1f} | "
            f"{'yes' if by_cpu else 'MISSED'} | {'yes' if keeps else 'MISSED'} | {need:.1f} |"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
