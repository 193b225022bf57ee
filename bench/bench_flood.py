"""The high-cardinality flood (issue 25) through the real worker process and a real
broker, at the shipped caps: what ``bench_cardinality`` measures of the router alone,
with Kafka, Faust, the watermarks, the table's changelog and the correlator agent in
the same process.

    python -m bench.bench_flood                       # 120,000 communicators, 20,000 jobs
    python -m bench.bench_flood --comms 12000 --jobs 2000

The flood (one 4-rank message per new communicator, ``comms / jobs`` per job) is fed at
``--feed`` messages per second; then a rank-hang trace. Prints the intake (messages per
second of wall time from the first message to the last judged, and per CPU-second of
the worker process), what it holds and evicted, its table, its peak RSS against the bound
docs/limits.md states for the caps, and whether the hang was isolated (and how long
after its last message was judged). Targets: intake at least the feed, RSS within the
bound, the hang found; a missed target prints MISSED. The broker and the feeding
producer share the machine with the worker: the per-CPU-second figure is the worker's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from confluent_kafka import Consumer, Producer

from bench.bench_cardinality import flood, rss_bound_mb
from c4base.kafka import KafkaConfig
from compose.local_broker import ensure_broker
from producers.events import encode_message
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.app.settings import WorkerConfig
from streams.app.topics_admin import ensure_topics
from streams.commands import decode_command
from streams.worker import start_worker_process


def hang_trace() -> tuple[list[tuple[bytes, bytes]], str]:
    """The chaos suite's rank hang (node-002, GPU 1, from 10 s of 25) and its host."""
    cfg = msgspec.structs.replace(SCENARIOS["rank_hang"], hosts=4, duration_s=25,
                                  faults=[FaultSpec(kind="rank_hang", host=2, gpu=1,
                                                    start_s=10.0)])  # fmt: skip
    return [(b[0].comm.encode(), encode_message(b)) for b in simulate(cfg) if b], "node-002"


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return -1.0


def _isolated(bootstrap: str, topic: str, host: str, timeout: float) -> float | None:
    """Seconds until an isolating command for ``host`` is on ``topic``, or None."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"flood-{time.time_ns()}",
                  "auto.offset.reset": "earliest"})  # fmt: skip
    c.subscribe([topic])
    t = time.monotonic()
    try:
        while time.monotonic() - t < timeout:
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            if decode_command(m.value()).host == host:
                return time.monotonic() - t
        return None
    finally:
        c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--comms", type=int, default=120_000)
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--feed", type=float, default=2000.0, help="messages per second")
    a = ap.parse_args(argv)
    msgs = flood(a.comms, a.jobs)
    hang, culprit = hang_trace()
    with tempfile.TemporaryDirectory() as d, ensure_broker() as bootstrap:
        cfg = WorkerConfig(kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix="flood."),
                           app_id="bench-flood", workdir=str(Path(d) / "w"))  # fmt: skip
        ensure_topics(cfg)
        topic = cfg.topics().events
        bound = rss_bound_mb(cfg.max_comms, cfg.max_checkpoints)
        p = Producer(KafkaConfig(bootstrap=bootstrap).producer_config(**{"linger.ms": 5}))
        with start_worker_process(cfg) as w:
            w.wait_ready(120)
            c0, t0 = _cpu_s(w.proc.pid), time.monotonic()
            step = max(1, int(a.feed / 10))
            for i in range(0, len(msgs), step):  # paced: --feed messages per second
                for key, value in msgs[i : i + step]:
                    p.produce(topic, key=key, value=value)
                p.poll(0)
                while time.monotonic() < t0 + (i + step) / a.feed:
                    time.sleep(0.005)
            p.flush(60)
            w.wait_for(lambda s: s["detect"]["messages"] >= len(msgs), 1800, "the flood")
            took, used = time.monotonic() - t0, _cpu_s(w.proc.pid) - c0
            for key, value in hang:
                p.produce(topic, key=key, value=value)
            p.flush(60)
            w.wait_for(lambda s: s["detect"]["messages"] >= len(msgs) + len(hang), 600, "hang")
            found = _isolated(bootstrap, cfg.topics().isolations, culprit, 120)
            st, peak = w.status(), _peak_rss_mb(w.proc.pid)
            w.stop()
        del p  # closed before its broker stops (else it logs the broker going away)
    wall, per_cpu = len(msgs) / took, len(msgs) / used
    rows = [
        ("intake, messages/s (wall, first sent to last judged)", f"{wall:,.0f}",
         "" if wall >= a.feed else "MISSED"),
        ("intake, messages per worker CPU-second", f"{per_cpu:,.0f}",
         "" if per_cpu >= a.feed else "MISSED"),
        ("communicators held / evicted (of them active)",
         f"{st['comms']} / {st['detect']['evicted']} ({st['evicted_active']})", ""),
        ("checkpoints kept of those not held / table records",
         f"{st['checkpoints_parked']} / {st['table_records']}", ""),
        ("peak RSS, MB", f"{peak:,.0f}", f"≤ {bound:,.0f}" + ("" if peak <= bound else " MISSED")),
        ("the rank hang isolated, s after its messages were judged",
         "no" if found is None else f"{found:.1f}", "" if found is not None else "MISSED"),
    ]  # fmt: skip
    print(f"| {a.comms:,} communicators over {a.jobs:,} jobs at {a.feed:,.0f} msg/s, one worker, "
          f"caps {cfg.max_comms:,} held, {cfg.max_checkpoints:,} kept | value | target |\n"
          "|---|---:|---|")  # fmt: skip
    for name, v, miss in rows:
        print(f"| {name} | {v} | {miss} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
