"""High cardinality (issue 25): many communicators over many jobs through the worker's
router and watermark sender, broker-free. Prints intake (messages/s), the slowest tick,
the watermarks a tick sends, communicators held and evicted, and the peak RSS.

    nice -n 5 .venv/bin/python -m bench.bench_cardinality --comms 120000 --jobs 20000

Intake is printed per wall second and per CPU second of the thread (on a shared
machine the wall figure counts time other processes had the core). Targets: intake
at least the feed (2,000 messages/s), a tick under 1 s whatever the
number of idle lanes, peak RSS under the bound docs/limits.md states for the caps
(``--rss-mb`` overrides it): a base, plus so much per communicator held (``--max-comms``,
the worker's default) and per checkpoint kept of those not held (``--max-checkpoints``).
The checkpoints go into a table as the worker's (compressed records in a dict, the
deleted ones taken out), so the table's memory is in the figure. A missed target
prints MISSED. The collector runs as in the worker process (``c4base.collector``:
what exists at start frozen, the first threshold ``--gc-gen0``, the worker's default):
at Python's default it walked the flood's live state every few hundred objects.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

from c4base.collector import GEN0_THRESHOLD, tune_collector
from producers.events import OpEvent, encode_message
from streams.app.checkpoint import split_checkpoint
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter, EdgeLimits
from streams.app.engine import CoreEngine
from streams.app.runner import Output
from streams.app.settings import EVICT_IDLE_S, MAX_CHECKPOINTS, MAX_COMMS
from streams.app.watermark import WatermarkSender

T0 = 1_750_000_000_000_000

# The bound docs/limits.md states for a worker process (4-rank communicators): the base
# is the process's (Faust, Kafka clients, the correlator agent, the heap a flood's churn
# leaves: bench_flood measured 648 MB at the shipped caps), not this router's alone.
BASE_MB = 400.0
HELD_KB = 12.0
KEPT_KB = 0.8


def rss_bound_mb(max_comms: int, max_checkpoints: int) -> float:
    return BASE_MB + (max_comms * HELD_KB + max_checkpoints * KEPT_KB) / 1024


def flood(comms: int, jobs: int) -> list[tuple[bytes, bytes]]:
    """(key, value): one message (4 ranks, one op each) per communicator, ``comms //
    jobs`` per job, as a flood of new ids comes (also the chaos suite's, smaller)."""
    per = max(1, comms // jobs)
    out = []
    for c in range(comms):
        evs = [OpEvent(v=1, job=f"flood-{c // per}", comm=f"0xf{c:x}", nranks=4, rank=k,
                       host=f"node-{k:03d}", ts_us=T0 + c * 1000, op="AllReduce", seq=1,
                       bytes=8, exec_us=10.0) for k in range(4)]  # fmt: skip
        out.append((evs[0].comm.encode(), encode_message(evs)))
    return out


class _Offsets:
    def highwater(self, topic: str, partition: int) -> int | None:
        return 0

    def committed(self, topic: str, partition: int) -> int | None:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--comms", type=int, default=12_000)
    ap.add_argument("--jobs", type=int, default=2_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--max-comms", type=int, default=MAX_COMMS)
    ap.add_argument("--max-checkpoints", type=int, default=MAX_CHECKPOINTS)
    ap.add_argument("--evict-idle-s", type=float, default=EVICT_IDLE_S)
    ap.add_argument("--feed", type=float, default=2000.0, help="messages/s to keep up with")
    ap.add_argument("--rss-mb", type=float, default=None, help="default: the stated bound")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument(
        "--gc-gen0",
        type=int,
        default=GEN0_THRESHOLD,
        help="the collector's first threshold (the worker's default)",
    )
    a = ap.parse_args()

    wall = [0.0]
    engine = CoreEngine()
    engine.new_detector("warm-up")  # imports river's quantiles once (~0.3 s), not timed
    tune_collector(a.gc_gen0)  # as the worker process does once it is built
    r = CommRouter(engine, lambda key: None, checkpoint_every_events=10**9,
                   checkpoint_every_s=1e9, advance_every_us=250_000, clock=lambda: wall[0],
                   epoch=lambda: T0 / 1e6 + 60,
                   limits=EdgeLimits(max_comms=a.max_comms, evict_idle_s=a.evict_idle_s,
                                     max_checkpoints=a.max_checkpoints))  # fmt: skip
    rss_mb = a.rss_mb if a.rss_mb is not None else rss_bound_mb(a.max_comms, a.max_checkpoints)
    table: dict[bytes, bytes] = {}

    def keep(out: Output) -> None:  # as the worker's table: compressed, deletions applied
        for _, key, value in out.checkpoints:
            table.update(split_checkpoint(key, value, chunk_bytes=512 * 1024, gen=1))
        for _, key in out.forgotten:
            table.pop(key, None)

    sent = [0]

    def send_marks(heartbeat: bool) -> None:  # as agent detect: the lanes that moved
        parts = range(a.partitions)
        loop.run_until_complete(marks.send_all(parts, r.clock_us, heartbeat, r.moved, r.lanes_in))

    async def send(q: int, key: bytes, value: bytes) -> None:
        sent[0] += 1

    marks = WatermarkSender("ev", 1, _Offsets(), send)
    loop = asyncio.new_event_loop()
    n_msgs = 0
    busy = 0.0
    cpu = 0.0
    worst_tick = 0.0
    tick_marks = 0
    batch: list[Record] = []
    # every communicator sends one message (4 ranks, one op each) in turn, as a flood of
    # new ids does; the wall clock runs at the feed rate
    for c, (_, value) in enumerate(flood(a.comms, a.jobs)):
        batch.append(Record("ev", c % a.partitions, c, None, value))
        if len(batch) == a.batch or c == a.comms - 1:
            t, t_cpu = time.perf_counter(), time.thread_time()
            keep(r.process(batch, settle=set(range(a.partitions))))
            send_marks(False)
            busy += time.perf_counter() - t
            n_msgs += len(batch)
            wall[0] = n_msgs / a.feed
            batch = []
            t = time.perf_counter()
            sent[0] = 0
            keep(r.tick())
            send_marks(True)
            dt = time.perf_counter() - t
            busy += dt
            cpu += time.thread_time() - t_cpu
            worst_tick, tick_marks = max(worst_tick, dt), max(tick_marks, sent[0])
    # then all idle: ticks with nothing new (the cost of idle lanes), after the eviction age
    wall[0] += a.evict_idle_s + 1
    for _ in range(3):
        t = time.perf_counter()
        sent[0] = 0
        keep(r.tick())
        send_marks(True)
        dt = time.perf_counter() - t
        worst_tick, tick_marks = max(worst_tick, dt), max(tick_marks, sent[0])
        wall[0] += 1.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    intake, intake_cpu = n_msgs / busy, n_msgs / cpu
    rows = [
        ("messages", f"{n_msgs}", ""),
        ("intake, messages/s (wall)", f"{intake:,.0f}", "" if intake >= a.feed else "MISSED"),
        ("intake, messages per CPU-second", f"{intake_cpu:,.0f}",
         "" if intake_cpu >= a.feed else "MISSED"),
        ("slowest tick (router + watermarks), s", f"{worst_tick:.3f}",
         "" if worst_tick < 1.0 else "MISSED"),
        ("watermarks sent in one tick, most", f"{tick_marks}", ""),
        ("communicators held / evicted (of them active)",
         f"{len(r.comms)} / {r.stats.evicted} ({r.stats.evicted_active})", ""),
        ("checkpoints kept of those not held / deleted", f"{r.parked} / {r.stats.forgotten}", ""),
        ("table records", f"{len(table)}", ""),
        ("peak RSS, MB", f"{rss:,.0f}", f"≤ {rss_mb:,.0f}" + ("" if rss <= rss_mb else " MISSED")),
    ]  # fmt: skip
    print(f"| {a.comms} communicators over {a.jobs} jobs, {a.partitions} partitions, "
          f"caps {a.max_comms} held, {a.max_checkpoints} kept | value | target |\n"
          "|---|---:|---|")  # fmt: skip
    for name, v, miss in rows:
        print(f"| {name} | {v} | {miss} |")


if __name__ == "__main__":
    main()
