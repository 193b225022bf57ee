"""A backlog read fast is not late (issue 22): the correlator's lateness is event time
against the job's own watermark, and a watermark counts only once the verdicts it
covers are read, never after some wall time.

Broker-free, deterministic: a 30-s fault trace (a backlog three times the 10-s
allowed lateness) is judged by agent ``detect``'s runner and watermark sender as the
worker does; the correlator then reads the watermark topic ahead of ``c4.verdicts``
(fetched independently: a backlog of verdicts takes longer to read than the small
marks), its wall clock passing the watermark's idle time meanwhile. No verdict may be
dead-lettered as late, and the commands are those of the offline pipeline.
"""

from __future__ import annotations

import asyncio
import zlib

import pytest

from producers.events import encode_message
from producers.simulator import FaultSpec, SimConfig, simulate
from streams.app.correlate_runner import CorrelatorRunner
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter
from streams.app.engine import CoreEngine
from streams.app.watermark import Watermark, WatermarkSender, encode_watermark
from streams.core import DetectionPipeline
from streams.verdicts import Verdict, encode_verdict

PARTS = 4
SIM = SimConfig(
    job="backlog",
    hosts=8,
    gpus_per_host=4,
    tp=4,
    duration_s=30,
    seed=3,
    faults=[
        FaultSpec(kind="straggler", host=2, gpu=1, start_s=4, end_s=28, severity=1.5),
        FaultSpec(kind="rank_hang", host=6, gpu=3, start_s=20),
    ],
)


class _Backlog:
    """The detect side's consumer: every message is on the broker before it starts."""

    def __init__(self, ends: dict[int, int]) -> None:
        self.ends = ends

    def highwater(self, topic: str, partition: int) -> int | None:
        return self.ends.get(partition, 0)

    def committed(self, topic: str, partition: int) -> int | None:
        return None


def _detect_side() -> tuple[list[Record], list[Record], int]:
    """(verdict records, watermark records, events) as agent ``detect`` puts them on
    their topics while it catches up on the backlog."""
    parts: dict[int, list[Record]] = {p: [] for p in range(PARTS)}
    events = 0
    for batch in simulate(SIM):
        if not batch:
            continue
        key = batch[0].comm.encode()
        p = zlib.crc32(key) % PARTS
        parts[p].append(Record("ev", p, len(parts[p]), key, encode_message(batch)))
        events += len(batch)
    router = CommRouter(CoreEngine(), lambda k: None, checkpoint_every_events=10**9,
                        checkpoint_every_s=1e9, advance_every_us=1_000_000)  # fmt: skip
    verdicts: list[Record] = []
    marks: list[Record] = []

    async def send(q: int, key: bytes, value: bytes) -> None:
        marks.append(Record("wm", q, len(marks), key, value))

    sender = WatermarkSender("ev", 1, _Backlog({p: len(r) for p, r in parts.items()}), send)

    async def run() -> None:
        # fetches of 16 messages per partition, round robin, as a consumer spreads them
        pos = dict.fromkeys(parts, 0)
        while any(pos[p] < len(parts[p]) for p in parts):
            for p in parts:
                recs = parts[p][pos[p] : pos[p] + 16]
                pos[p] += len(recs)
                for r in recs:
                    sender.taken(p, r.offset)
                live = {q for q in parts if sender.caught_up(q)}
                emit(router.process(recs, live))
                await sender.send_all(range(PARTS), router.clock_us, heartbeat=True)
        emit(router.close_slices())
        await sender.send_all(range(PARTS), router.clock_us, heartbeat=True)

    def emit(out: object) -> None:
        for v, clock in zip(out.verdicts, out.clocks, strict=True):  # type: ignore[attr-defined]
            verdicts.append(Record("v", 0, len(verdicts), v.job.encode(), encode_verdict(v), clock))
            sender.verdict_sent(0, verdicts[-1].offset)

    asyncio.run(run())
    return verdicts, marks, events


@pytest.mark.timeout(120)
def test_a_backlog_longer_than_the_allowed_lateness_read_fast_is_judged_not_dead_lettered() -> None:
    verdicts, marks, _ = _detect_side()
    first, last = min(r.clock_us for r in verdicts), max(r.clock_us for r in verdicts)  # type: ignore[type-var]
    assert last - first > 2 * 10_000_000  # the backlog spans well over the allowed lateness
    wall = [0.0]
    c = CorrelatorRunner(CoreEngine(), lambda k: None, checkpoint_every_events=10**9,
                         checkpoint_every_s=1e9, watermark_topic="wm", events_partitions=PARTS,
                         idle_s=5.0, max_hold_s=30.0, clock=lambda: wall[0])  # fmt: skip
    cmds, dead = [], []
    # the marks topic is read first (small records), the verdicts take longer
    for i in range(0, len(marks), 200):
        out = c.process(marks[i : i + 200])
        cmds += out.commands
        dead += out.deadletters
    for i in range(0, len(verdicts), 20):
        wall[0] += 3.0  # each fetch of verdicts 3 s later: past idle_s and max_hold_s in all
        out = c.process(verdicts[i : i + 20])
        cmds += out.commands + c.tick().commands
        dead += out.deadletters
    for _ in range(40):  # the job then goes quiet: its clock runs on, its hangs settle
        wall[0] += 1.0
        out = c.tick()
        cmds += out.commands
        dead += out.deadletters
    assert [d.reason for d in dead] == []
    assert c.late_verdicts.get("backlog", {}).get("deadlettered", 0) == 0

    p = DetectionPipeline()
    for batch in simulate(SIM):
        if batch:
            p.feed(batch)
    p.finish()
    offline = sorted((x.host, x.gpu, x.fault, x.action) for x in p.commands)
    assert {f for *_, f, _ in offline} >= {"straggler", "noncomm_hang"}, offline
    assert sorted((x.host, x.gpu, x.fault, x.action) for x in cmds) == offline


def test_a_mark_of_verdicts_judged_before_a_restart_counts_at_once_others_wait() -> None:
    resumed = {0: 40}  # the group's committed offset on the verdicts partition
    wall = [0.0]
    c = CorrelatorRunner(CoreEngine(), lambda k: None, checkpoint_every_events=10**9,
                         checkpoint_every_s=1e9, watermark_topic="wm", events_partitions=1,
                         clock=lambda: wall[0], verdicts_read_from=resumed.get)  # fmt: skip
    mark = Watermark(partition=0, clock_us=5_000_000, verdicts_offset=39, job="j")
    c.process([Record("wm", 0, 0, b"0", encode_watermark(mark))])
    assert c.watermark(0.0, 0, "j") == 5_000_000  # verdict 39 was read before the restart
    later = Watermark(partition=0, clock_us=9_000_000, verdicts_offset=41, job="j")
    c.process([Record("wm", 0, 1, b"0", encode_watermark(later))])
    wall[0] = 20.0  # four times idle_s (the sender still alive: within max_hold_s)
    c.tick()
    assert c.watermark(wall[0], 0, "j") == 5_000_000  # 41 not read yet: the mark waits
    assert c.describe()["0"]["deferred"] == 1
    resumed[0] = 42  # the group's commit moves on: not a read here (asked once)
    c.tick()
    assert c.watermark(wall[0], 0, "j") == 5_000_000
    v = Verdict(id="v41", ts_us=4_000_000, job="j", comm="0xa", host="h", fault="straggler",
                score=0.5, reason="r", window_start_us=0, window_end_us=4_000_000)  # fmt: skip
    c.process([Record("v", 0, 41, None, encode_verdict(v), 4_000_000)])  # verdict 41 read
    assert c.watermark(wall[0], 0, "j") == 9_000_000


def test_a_partition_whose_marks_wait_for_their_verdicts_is_not_gone() -> None:
    """Its sender reports every second; its marks wait for a backlog of verdicts longer
    than ``max_hold_s``: it still holds the job, the partition that ran ahead does not
    take the job's clock past its verdicts."""
    t0 = 1_750_000_000_000_000
    wall = [0.0]
    c = CorrelatorRunner(CoreEngine(), lambda k: None, checkpoint_every_events=10**9,
                         checkpoint_every_s=1e9, watermark_topic="wm", events_partitions=2,
                         idle_s=5.0, max_hold_s=30.0, clock=lambda: wall[0])  # fmt: skip

    def mark(p: int, t: int, offset: int, caught_up: bool = False) -> Record:
        wm = Watermark(partition=p, clock_us=t, caught_up=caught_up, verdicts_offset=offset,
                       job="j")  # fmt: skip
        return Record("wm", 0, 0, str(p).encode(), encode_watermark(wm))

    c.process([mark(0, t0 + 10_000_000, -1), mark(1, t0 + 40_000_000, -1, caught_up=True)])
    for s in range(1, 41):
        wall[0] = float(s)
        c.process([mark(0, t0 + 10_000_000 + s * 500_000, 100)])  # verdict 100 not read yet
        c.tick()
    assert c.watermark(wall[0], 0, "j") == t0 + 10_000_000
