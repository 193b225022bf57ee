"""Scale-out through Kafka: one worker vs two on the same ``c4.events`` (8 partitions),
JSON vs Arrow IPC batches, and the capacity table derived from the measured rates.

Against a real broker (a local one, or ``KAFKA_BOOTSTRAP``). For each row a fresh topic
prefix: the workers are started on an empty ``c4.events``; once every one of them is
ready and the 8 partitions are spread over them, the trace's lines (one message each,
encoded beforehand as JSON or Arrow) are produced as fast as the producer goes, and the
clock runs from the first message sent until the workers' ``status.json`` counters
have every event. Rate = events / seconds; the table also shows how long producing
took (if it is close to the total, the producer, not the workers, set the pace), the
CPU seconds the workers used meanwhile (Linux ``/proc``), events per worker CPU-second
(what a worker with a core of its own would do, less dependent on the machine's load)
and the share of that CPU the detect runner spent decoding, checking and judging (its
``process_s`` counter in ``status.json``; the rest is Kafka, Faust and correlation).

The JSON parse rate of the same trace (msgspec, one JSON value per line, no objects
built; :func:`bench.bench_columnar.json_parse_rate`) is measured in the same run; the
issue's target for one worker with Arrow batches is ≥ 1× that rate (and ≥ 300k
events/s on a machine where it is about 300k). A missed target is printed as MISSED.

The capacity table multiplies the measured per-worker rate out to 1k, 10k and 100k
GPUs for two telemetry sources: the NCCL Inspector (one line per communicator per
dump interval, 0.5 s as recommended in the README, 3 communicators per GPU → 6
events/s per GPU) and per-collective telemetry (the simulator's rate, measured from the
trace: every collective of every rank plus heartbeats; --per-collective overrides it).
Workers = ceil(events/s ÷ (per-worker rate × 0.5 headroom)); partitions = the next
power of two ≥ 2 × workers, at least 8 (room to add workers without repartitioning).

A last row sends the same trace as one Arrow message per communicator per second (all
hosts' lines of it together, ~60 events instead of ~7: an exporter batching per
communicator, or a longer interval), to show what the per-message cost leaves
(``--no-per-comm`` skips it).

Then the latency of one worker fed Arrow batches (``bench.bench_e2e.latency``: a trace with
a straggler and a slow NIC replayed at its own pace; p99 event → verdict beyond the
evidence window, target ≤ 1 s; ``--latency-duration 0`` skips it).

Run: ``python -m bench.bench_scaleout [--gpus 512] [--duration 30]`` (several minutes;
on a 2-core machine two workers and the broker share two cores, so the ratio there
says little about a real deployment — run it where each worker has its own core).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from bench.bench_columnar import json_parse_rate, load, make_trace
from bench.bench_e2e import _simulate, latency
from c4base.kafka import KafkaConfig
from compose.local_broker import ensure_broker
from producers.columnar import decode_events, encode_batch
from producers.events import Event
from producers.traces import TraceLine, read_trace
from streams.app.settings import WorkerConfig
from streams.app.topics_admin import ensure_topics
from streams.worker import WorkerProcess, start_worker_process

PARTITIONS = 8
INSPECTOR_EVENTS_PER_GPU_S = 3 / 0.5  # 3 communicators per GPU, a line each per 0.5 s


STALL_S = 60.0
"""A run whose workers processed nothing for this long is reported as not finished."""


def _config(bootstrap: str, prefix: str, workdir: Path) -> WorkerConfig:
    return WorkerConfig(
        kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=prefix),
        app_id="bench",
        events_partitions=PARTITIONS,
        tick_s=0.1,  # status.json every 0.1 s: the timing below reads it
        workdir=str(workdir),
        loglevel="warning",
    )


def _events_parts(w: WorkerProcess, topic: str) -> set[str]:
    return {a for a in w.status().get("assigned", []) if a.startswith(f"{topic}[")}


def _processed(workers: list[WorkerProcess]) -> int:
    return sum(w.status().get("detect", {}).get("events", 0) for w in workers)


def _detect_s(workers: list[WorkerProcess]) -> float:
    """CPU seconds the workers' detect runners spent decoding, checking and judging."""
    return sum(w.status().get("detect", {}).get("process_s", 0.0) for w in workers)


def _cpu_s(workers: list[WorkerProcess]) -> float | None:
    """CPU seconds the worker processes used so far (Linux ``/proc``; None elsewhere)."""
    total = 0.0
    try:
        for w in workers:
            fields = Path(f"/proc/{w.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def _messages(
    trace: Path, fmt: str, per_comm: bool = False
) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """(key, value, headers) per trace line, encoded before the clock starts; with
    ``per_comm``, one message per communicator per second of the trace (every host's
    lines of that communicator and second together: what an exporter batching per
    communicator, or a longer interval, would send), in order of each one's first line."""
    lines = [x for x in read_trace(trace) if isinstance(x, TraceLine)]
    if per_comm:
        merged: dict[tuple[str, int], list[Event]] = {}
        for line in lines:
            ev = line.events[0]
            merged.setdefault((ev.comm, ev.ts_us // 1_000_000), []).extend(line.events)
        batches = list(merged.values())
    elif fmt == "json":  # the trace's own bytes
        return [(line.events[0].comm.encode(), line.raw, []) for line in lines]
    else:
        batches = [list(line.events) for line in lines]
    out = []
    for events in batches:
        value, headers = encode_batch(events, fmt)  # type: ignore[arg-type]
        out.append((events[0].comm.encode(), value, headers))
    return out


def run(
    bootstrap: str, trace: Path, tmp: Path, fmt: str, n_workers: int, per_comm: bool = False
) -> dict[str, Any]:
    prefix = f"so-{fmt}-{n_workers}{'-c' if per_comm else ''}-{int(time.time())}."
    cfgs = [_config(bootstrap, prefix, tmp / f"{prefix}w{i}") for i in range(n_workers)]
    ensure_topics(cfgs[0])
    topics = cfgs[0].topics()
    msgs = _messages(trace, fmt, per_comm)
    total = sum(len(decode_events(v, None)) for _, v, _ in msgs)
    workers = [start_worker_process(c) for c in cfgs]
    try:
        for w in workers:
            w.wait_ready(180)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            parts = [_events_parts(w, topics.events) for w in workers]
            if all(parts) and len(set().union(*parts)) == PARTITIONS == sum(map(len, parts)):
                break
            time.sleep(0.1)
        # the workers wait on an empty topic; the clock runs from the first message sent
        # (pre-encoded, so the producer outruns the workers) to the last event processed
        producer = Producer(
            KafkaConfig(bootstrap=bootstrap).producer_config(
                **{"linger.ms": 20, "queue.buffering.max.messages": 1_000_000}
            )
        )
        cpu0, det0 = _cpu_s(workers), _detect_s(workers)
        t0 = time.monotonic()
        for key, value, headers in msgs:
            producer.produce(topics.events, value=value, key=key, headers=headers or None)
            producer.poll(0)
        producer.flush(60)
        sent_s = time.monotonic() - t0
        deadline = t0 + 1800
        seen, moved = 0, time.monotonic()
        while time.monotonic() < deadline and (now := _processed(workers)) < total:
            if now != seen:
                seen, moved = now, time.monotonic()
            elif time.monotonic() - moved > STALL_S:  # stuck (not slow): say so, go on
                break
            time.sleep(0.02)
        seconds = time.monotonic() - t0
        cpu1 = _cpu_s(workers)
        cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        detect_s = _detect_s(workers) - det0
        done = _processed(workers)
        share = [w.status().get("detect", {}).get("events", 0) for w in workers]
    finally:
        for w in workers:
            w.stop()
    return {
        "format": fmt,
        "workers": n_workers,
        "per_comm": per_comm,
        "events": total,
        "messages": len(msgs),
        "sent_s": sent_s,
        "seconds": seconds,
        "rate": done / seconds if seconds > 0 else 0.0,
        "complete": done >= total,
        "share": share,
        "cpu_s": cpu,
        "detect_s": detect_s,
    }


def capacity(per_worker: float, per_gpu_collective: float) -> list[str]:
    lines = [
        "| telemetry | events/s per GPU | GPUs | events/s | workers | partitions |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, per_gpu in (
        ("NCCL Inspector (0.5 s dumps)", INSPECTOR_EVENTS_PER_GPU_S),
        ("per-collective (simulator rate)", per_gpu_collective),
    ):
        for gpus in (1_000, 10_000, 100_000):
            total = gpus * per_gpu
            workers = max(1, math.ceil(total / (per_worker * 0.5)))
            parts = max(8, 2 ** math.ceil(math.log2(2 * workers)))
            lines.append(
                f"| {name} | {per_gpu:.1f} | {gpus:,} | {total:,.0f} | {workers:,} | {parts:,} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gpus", type=int, default=512)
    ap.add_argument("--duration", type=float, default=30, help="simulated seconds")
    ap.add_argument(
        "--per-collective", type=float, default=None, help="events/s per GPU (default: trace)"
    )
    ap.add_argument(
        "--no-per-comm",
        action="store_true",
        help="skip the row of one Arrow message per communicator per second",
    )
    ap.add_argument("--latency-gpus", type=int, default=128)
    ap.add_argument("--latency-duration", type=float, default=45, help="0: skip the latency run")
    args = ap.parse_args(argv)
    load0 = load()
    rows = []
    with tempfile.TemporaryDirectory() as d, ensure_broker() as bootstrap:
        tmp = Path(d)
        trace = make_trace(tmp, args.gpus, args.duration)
        n, parse_s = json_parse_rate(trace)
        parse = n / parse_s
        for fmt, k in (("json", 1), ("arrow", 1), ("arrow", 2)):
            rows.append(run(bootstrap, trace, tmp, fmt, k))
        if not args.no_per_comm:  # larger messages: what the per-message cost allows
            rows.append(run(bootstrap, trace, tmp, "arrow", 1, per_comm=True))
        lat = None
        if args.latency_duration > 0:
            lat_trace = _simulate(tmp, "lat", args.latency_gpus, args.latency_duration, True)
            lat = latency(bootstrap, lat_trace, tmp / "lat.truth.json", tmp, "arrow")
    load1 = load()
    per_gpu = args.per_collective or n / (args.gpus * args.duration)
    print(
        f"\nScale-out: {args.gpus} GPUs × {args.duration:g} s ({n:,} events), "
        f"c4.events with {PARTITIONS} partitions; {load0} at start, {load1} at end. "
        f"JSON parse rate of the same trace: {parse:,.0f} events/s (one core)."
    )
    print("| input | workers | events/msg | events | produced in s | seconds | events/s | × parse "
          "| events per worker | worker CPU s | events per CPU s | in detection | target "
          "| result |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|")
    one_arrow = next(
        r for r in rows if r["format"] == "arrow" and r["workers"] == 1 and not r["per_comm"]
    )
    for r in rows:
        ratio = r["rate"] / parse
        target = result = ""
        if r is one_arrow:
            target = "≥ 1× parse"
            result = "met" if ratio >= 1 else "MISSED"
        if not r["complete"]:
            result += " (did not finish)"
        cpu = per_cpu = share = "?"
        if r["cpu_s"]:
            cpu = f"{r['cpu_s']:.2f}"
            per_cpu = f"{r['events'] / r['cpu_s']:,.0f}"
            share = f"{r['detect_s'] / r['cpu_s']:.0%}"
        print(
            f"| {r['format']} | {r['workers']} | {r['events'] / max(1, r['messages']):.1f} | "
            f"{r['events']:,} | {r['sent_s']:.2f} | {r['seconds']:.2f} | {r['rate']:,.0f} | "
            f"{ratio:.2f} | {' / '.join(f'{x:,}' for x in r['share'])} | {cpu} | {per_cpu} | "
            f"{share} | {target} | {result} |"
        )
    if lat is not None:
        ok = "met" if lat["p99_s"] <= 1.0 else "MISSED"
        print(
            f"\nEvent → verdict latency beyond the evidence window, Arrow batches, one worker "
            f"({lat['verdicts']} verdicts, {args.latency_gpus} GPUs at recorded pace): "
            f"p50 {lat['p50_s']:.2f} s, p99 {lat['p99_s']:.2f} s, max {lat['max_s']:.2f} s "
            f"— target p99 ≤ 1 s: {ok}"
        )
    two = next(r for r in rows if r["format"] == "arrow" and r["workers"] == 2)
    for r in rows:
        if r["per_comm"]:
            print(
                f"\nOne message per communicator per second "
                f"({r['events'] / max(1, r['messages']):.0f} events/msg), one worker, Arrow: "
                f"{r['rate']:,.0f} events/s ({r['rate'] / max(1e-9, one_arrow['rate']):.1f}× "
                f"the {one_arrow['events'] / max(1, one_arrow['messages']):.0f} events/msg row)"
            )
    print(f"\n2 workers / 1 worker (Arrow): {two['rate'] / max(1e-9, one_arrow['rate']):.2f}×")
    print(f"\nCapacity at {one_arrow['rate']:,.0f} events/s per worker (Arrow, measured above):")
    print("\n".join(capacity(one_arrow["rate"], per_gpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
