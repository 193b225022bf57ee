"""End-to-end throughput and latency: Kafka → one Faust worker → verdicts.

Against a real broker (a local one, or ``KAFKA_BOOTSTRAP``):

* **throughput** — a simulated trace is put into ``c4.events`` first, then one worker
  is started and timed until it has processed every event (its ``status.json``
  counters). Per-message overhead dominates, so it is measured at two batchings:
  ``host`` — one message per host per communicator per second, as the simulator writes
  (4–7 events each) — and ``comm`` — one message per communicator per second (what one
  exporter per rack, or a host with many ranks per communicator, sends).
* **latency** — a trace with a straggler and a slow NIC is replayed at its own pace
  (speed 1) into a running worker. For each verdict, latency = the verdict's Kafka
  append time − the wall time at which the event that completed its evidence
  (``ts_us == verdict.ts_us``) was published. That is "event → verdict beyond the
  evidence window".

Run: ``python -m bench.bench_e2e [--gpus 512] [--duration 120] [--latency-duration 45]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from confluent_kafka import Consumer, TopicPartition

from c4base.kafka import KafkaConfig
from compose.local_broker import ensure_broker
from producers.events import Event
from producers.replay import ReplayConfig, replay
from producers.simulator import SCENARIOS, FaultSpec, with_gpus, write_trace
from producers.traces import TraceWriter, iter_events
from streams.app.settings import WorkerConfig
from streams.app.topics_admin import ensure_topics
from streams.verdicts import decode_verdict
from streams.worker import WorkerProcess, start_worker_process


def _simulate(tmp: Path, name: str, gpus: int, duration: float, faults: bool) -> Path:
    cfg = msgspec.structs.replace(
        with_gpus(SCENARIOS["healthy"], gpus), duration_s=duration, seed=3
    )
    if faults:
        hosts = gpus // cfg.gpus_per_host
        cfg = msgspec.structs.replace(
            cfg,
            faults=[
                FaultSpec(kind="straggler", host=1, gpu=2, start_s=10, severity=1.5),
                FaultSpec(kind="slow_nic", host=hosts - 2, nic=0, start_s=10, severity=0.4),
            ],
        )
    path = tmp / f"{name}.jsonl.gz"
    write_trace(cfg, path, tmp / f"{name}.truth.json")
    return path


def _per_comm(src: Path, dst: Path) -> Path:
    """Re-batch a trace: one line per communicator per second of trace time."""
    second: int | None = None
    groups: dict[str, list[Event]] = defaultdict(list)
    with TraceWriter(dst) as out:
        for ev in iter_events(src):
            s = ev.ts_us // 1_000_000
            if second is not None and s > second:
                for batch in groups.values():
                    out.write(batch)
                groups.clear()
            second = s if second is None else max(second, s)
            groups[ev.comm].append(ev)
        for batch in groups.values():
            out.write(batch)
    return dst


def _worker_config(bootstrap: str, tmp: Path, prefix: str) -> WorkerConfig:
    return WorkerConfig(
        kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=prefix),
        app_id="bench",
        tick_s=0.1,  # status.json every 0.1 s: the timing below reads it
        workdir=str(tmp / f"worker-{prefix.rstrip('.')}"),
    )


def _worker(bootstrap: str, tmp: Path, prefix: str) -> WorkerProcess:
    return start_worker_process(_worker_config(bootstrap, tmp, prefix))


def _replay_cfg(bootstrap: str, prefix: str, speed: float | None) -> ReplayConfig:
    return ReplayConfig(
        kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=prefix),
        events_topic=f"{prefix}c4.events",
        deadletter_topic=f"{prefix}c4.deadletter",
        speed=speed,
        progress=False,
    )


def throughput(bootstrap: str, trace: Path, tmp: Path, label: str) -> dict[str, Any]:
    prefix = f"tput-{label}-{int(time.time())}."
    # Create the topics with their partition counts, fill c4.events, then start.
    ensure_topics(_worker_config(bootstrap, tmp, prefix))
    stats = replay([trace], _replay_cfg(bootstrap, prefix, None))
    with _worker(bootstrap, tmp, prefix) as w:
        w.wait_ready(120)
        t0 = time.monotonic()
        done = w.wait_for(lambda s: s["detect"]["events"] >= stats.events, 900, "caught up")
        seconds = time.monotonic() - t0
    return {
        "batching": label,
        "events": stats.events,
        "messages": stats.messages,
        "events_per_msg": stats.events / max(1, stats.messages),
        "seconds": seconds,
        "events_per_s": stats.events / seconds,
        "msgs_per_s": stats.messages / seconds,
        "verdicts": done["detect"]["verdicts"],
    }


def latency(bootstrap: str, trace: Path, truth: Path, tmp: Path) -> dict[str, float]:
    prefix = f"lat-{int(time.time())}."
    epoch_us = json.loads(truth.read_text())["epoch_us"]
    with _worker(bootstrap, tmp, prefix) as w:
        w.wait_ready(120)
        # Replay paces trace time from its first message, which starts at the epoch.
        wall0 = time.time()
        replay([trace], _replay_cfg(bootstrap, prefix, 1.0))
        time.sleep(3)
    topic = f"{prefix}c4.verdicts"
    consumer = Consumer(KafkaConfig(bootstrap=bootstrap).consumer_config(f"bench-{prefix}"))
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])
    lat: list[float] = []
    idle = time.monotonic()
    while time.monotonic() - idle < 3:
        msg = consumer.poll(0.5)
        if msg is None or msg.error():
            continue
        idle = time.monotonic()
        v = decode_verdict(msg.value())
        _, append_ms = msg.timestamp()
        lat.append(append_ms / 1000 - (wall0 + (v.ts_us - epoch_us) / 1e6))
    consumer.close()
    a = np.asarray(lat) if lat else np.asarray([np.nan])
    return {
        "verdicts": len(lat),
        "p50_s": float(np.median(a)),
        "p99_s": float(np.quantile(a, 0.99)),
        "max_s": float(a.max()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gpus", type=int, default=512, help="GPUs of the throughput trace")
    ap.add_argument("--duration", type=float, default=120, help="its simulated seconds")
    ap.add_argument("--latency-gpus", type=int, default=128)
    ap.add_argument("--latency-duration", type=float, default=45)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d, ensure_broker() as bootstrap:
        tmp = Path(d)
        by_host = _simulate(tmp, "tput", args.gpus, args.duration, faults=False)
        by_comm = _per_comm(by_host, tmp / "tput-comm.jsonl.gz")
        rows.append(throughput(bootstrap, by_host, tmp, "host"))
        rows.append(throughput(bootstrap, by_comm, tmp, "comm"))
        lat_trace = _simulate(tmp, "lat", args.latency_gpus, args.latency_duration, faults=True)
        lat = latency(bootstrap, lat_trace, tmp / "lat.truth.json", tmp)
    print(f"\nEnd to end: Kafka → one Faust worker ({args.gpus} GPUs, {args.duration:g} s trace)")
    print("| batching | events | messages | events/msg | seconds | events/s | msgs/s | target |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ok = "met" if r["events_per_s"] >= 200_000 else "missed"
        print(
            f"| {r['batching']} | {r['events']:,} | {r['messages']:,} | "
            f"{r['events_per_msg']:.1f} | {r['seconds']:.2f} | {r['events_per_s']:,.0f} | "
            f"{r['msgs_per_s']:,.0f} | ≥ 200,000 events/s: {ok} |"
        )
    ok = "met" if lat["p99_s"] <= 1.0 else "missed"
    print(
        f"\nEvent → verdict latency beyond the evidence window ({lat['verdicts']} verdicts, "
        f"{args.latency_gpus} GPUs at recorded pace): p50 {lat['p50_s']:.2f} s, "
        f"p99 {lat['p99_s']:.2f} s, max {lat['max_s']:.2f} s — target p99 ≤ 1 s: {ok}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
