"""The worker's broker-free runners (streams.app.detect_runner, .correlate_runner): same
decisions as the offline pipeline, whatever the batching and however skewed the partitions;
dead letters; checkpoints.
"""

from __future__ import annotations

import zlib

import msgspec
import pytest

from producers.events import Event, OpEvent, encode_message
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.app.correlate_runner import CorrelatorRunner
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter, wrap_state
from streams.app.engine import CoreEngine
from streams.app.runner import Output
from streams.app.watermark import Watermark, encode_watermark
from streams.core import DetectionPipeline
from streams.core.columns import EventColumnsLike
from streams.verdicts import Verdict, encode_verdict

SIM = msgspec.structs.replace(
    SCENARIOS["rank_hang"],
    hosts=4,
    duration_s=25,
    faults=[FaultSpec(kind="rank_hang", host=2, gpu=1, start_s=15)],
)


@pytest.fixture(scope="module")
def trace() -> list[list[Event]]:
    return [b for b in simulate(SIM) if b]


def router(engine: object = None, **kw: object) -> CommRouter:
    args: dict = dict(
        checkpoint_every_events=10**9, checkpoint_every_s=1e9, advance_every_us=250_000
    )
    args.update(kw)
    return CommRouter(engine or CoreEngine(), lambda key: None, **args)


def runner() -> CorrelatorRunner:
    return CorrelatorRunner(
        CoreEngine(),
        lambda key: None,
        checkpoint_every_events=10**9,
        checkpoint_every_s=1e9,
        watermark_topic="wm",
    )


@pytest.mark.parametrize(("partitions", "batch"), [(1, 1), (4, 50), (8, 5000)])
def test_router_and_correlator_decide_like_the_offline_pipeline(
    trace: list[list[Event]], partitions: int, batch: int
) -> None:
    offline = DetectionPipeline()
    for b in trace:
        offline.feed(b)
    offline.finish()

    r = router()
    recs = [
        Record("ev", zlib.crc32(b[0].comm.encode()) % partitions, i, b[0].comm.encode(),
               encode_message(b))
        for i, b in enumerate(trace)
    ]  # fmt: skip
    # (crc32: the same partitions in every run; hash() of a str changes per process)
    # Worst-case skew: each partition entirely, one after the other (a catch-up).
    recs.sort(key=lambda rec: rec.partition)
    verdicts: list[Verdict] = []
    clocks: list[int] = []
    for i in range(0, len(recs), batch):
        out = r.process(recs[i : i + batch])
        verdicts += out.verdicts
        clocks += out.clocks
    out = r.close_slices()  # end of input, as DetectionPipeline.finish()
    verdicts += out.verdicts
    clocks += out.clocks
    assert sorted(v.id for v in verdicts) == sorted(v.id for v in offline.verdicts)

    c = runner()
    vrecs = [
        Record("v", 0, i, None, encode_verdict(v), t)
        for i, (v, t) in enumerate(zip(verdicts, clocks, strict=True))
    ]
    held = c.process(vrecs)
    assert held.commands == [] and held_count(c) == len(verdicts)
    marks = [
        Record("wm", 0, i, None, encode_watermark(Watermark(partition=p, clock_us=t, job=j)))
        for i, ((p, j), t) in enumerate(r.clock_us.items())
    ]
    out = c.process(marks)
    assert [(x.host, x.gpu, x.fault, x.id) for x in out.commands] == [
        (x.host, x.gpu, x.fault, x.id) for x in offline.commands
    ]
    assert offline.commands and offline.commands[0].host == "node-002"


def test_a_catch_up_batch_is_corroborated_as_one(trace: list[list[Event]]) -> None:
    """A catch-up batch holds whole partitions one after another: the hung GPU's
    communicator first, alone in its partition, then the job's others. Its verdicts are
    judged before those others are read, and were alert-only ("the only one of the job
    in which this worker saw node-002") although the same batch corroborates them."""
    hung = sorted({b[0].comm for b in trace if any(e.host == "node-002" and e.gpu == 1 for e in b)})
    assert len(hung) == 2
    for first in hung:
        r = router()
        recs = [Record("ev", int(b[0].comm != first), i, b[0].comm.encode(), encode_message(b))
                for i, b in enumerate(trace)]  # fmt: skip
        recs.sort(key=lambda rec: rec.partition)
        verdicts = r.process(recs).verdicts + r.close_slices().verdicts
        hangs = [v for v in verdicts if v.fault == "noncomm_hang" and v.host == "node-002"
                 and v.gpu == 1]  # fmt: skip
        assert hangs and not any(v.benign for v in hangs) and r.stats.uncorroborated == 0


class _Recorder:
    """Records what the router feeds it; raises on an op named Boom."""

    def __init__(self, log: list) -> None:
        self.log = log

    def observe(self, cols: EventColumnsLike) -> list[Verdict]:
        events = cols.to_events()
        if any(isinstance(e, OpEvent) and e.op == "Boom" for e in events):
            raise RuntimeError("boom")
        self.log.append(("observe", [e.ts_us for e in events]))
        return []

    def advance(self, now_us: int) -> list[Verdict]:
        self.log.append(("advance", now_us))
        return []

    def to_bytes(self) -> bytes:
        return b"state"


class _RecorderEngine:
    def __init__(self) -> None:
        self.log: list = []

    def new_detector(self, comm: str) -> _Recorder:
        return _Recorder(self.log)

    def load_detector(self, comm: str, data: bytes) -> _Recorder:
        return _Recorder(self.log)


def ev(ts_us: int, op: str = "AllReduce", rank: int = 0) -> OpEvent:
    return OpEvent(
        v=1,
        job="j",
        comm="0xa",
        nranks=2,
        rank=rank,
        host="h",
        ts_us=ts_us,
        op=op,
        seq=ts_us,
        bytes=1,
        exec_us=1.0,
    )


def test_a_batch_spanning_seconds_is_judged_slice_by_slice() -> None:
    eng = _RecorderEngine()
    r = router(eng, advance_every_us=1_000_000)
    recs = [
        Record("ev", 0, i, b"0xa", encode_message([ev(t)]))
        for i, t in enumerate([100, 900_000, 1_200_000, 2_500_000])
    ]
    r.process(recs)
    assert eng.log == [
        ("observe", [100, 900_000]),
        ("advance", 900_000),
        ("observe", [1_200_000]),
        ("advance", 1_200_000),
    ]  # the open slice is judged when it closes, or by the timer once traffic stops:
    r.tick()
    assert eng.log[-1] == ("advance", 1_200_000)  # the partition was active: no-op
    r.tick()
    assert eng.log[-2:] == [("observe", [2_500_000]), ("advance", 2_500_000)]


def test_bad_messages_become_dead_letters_and_the_rest_is_judged() -> None:
    eng = _RecorderEngine()
    r = router(eng, checkpoint_every_events=2)
    recs = [
        Record("ev", 1, 10, b"0xa", encode_message([ev(1)])),
        Record("ev", 1, 11, b"0xa", b"[]"),
        Record("ev", 1, 12, b"0xa", b"\xff\xfe"),
        Record("ev", 1, 13, b"0xa", encode_message([ev(2, rank=5)])),
        Record("ev", 1, 14, b"0xa", encode_message([ev(3, op="Boom")])),
        Record("ev", 1, 15, b"0xa", encode_message([ev(4)])),
    ]
    out = r.process(recs)
    assert eng.log == [] and out.deadletters  # decoding problems at once; the slice is open
    closed = r.close_slices()
    out.deadletters += closed.deadletters
    out.checkpoints += r.tick().checkpoints
    got = {dl.source: dl.reason for dl in out.deadletters}
    assert set(got) == {"ev[1]@11", "ev[1]@12", "ev[1]@13", "ev[1]@14"}
    assert got["ev[1]@11"].startswith("event breaks the contract: empty message")
    assert got["ev[1]@12"].startswith("undecodable message")
    assert "rank 5 is not below nranks 2" in got["ev[1]@13"]
    assert got["ev[1]@14"] == "detector error in communicator 0xa: RuntimeError: boom"
    assert ("observe", [1]) in eng.log and ("observe", [4]) in eng.log
    # 3 good events >= every 2 events: one checkpoint, to the comm's own partition.
    assert out.checkpoints == [(1, b"0xa", wrap_state(2, b"state"))]
    assert r.flush().checkpoints == []  # nothing dirty any more


# ------------------------------------------------- the correlator's event-time watermark


def live_runner(partitions: int, clock: list[float], **kw: object) -> CorrelatorRunner:
    return CorrelatorRunner(
        CoreEngine(),
        lambda key: None,
        checkpoint_every_events=10**9,
        checkpoint_every_s=1e9,
        watermark_topic="wm",
        events_partitions=partitions,
        clock=lambda: clock[0],
        **kw,
    )


def verdict_records(out: Output, first_offset: int) -> list[Record]:
    """The verdicts of one router output as agent 1 puts them on ``c4.verdicts``."""
    return [
        Record("v", 0, first_offset + j, None, encode_verdict(v), t)
        for j, (v, t) in enumerate(zip(out.verdicts, out.clocks, strict=True))
    ]


def held_count(c: CorrelatorRunner) -> int:
    return sum(len(h) for jobs in c.pending.values() for h in jobs.values())


def mark(p: int, t: int, offset: int = 0, **kw: object) -> Record:
    return Record("wm", 0, offset, None, encode_watermark(Watermark(partition=p, clock_us=t, **kw)))


@pytest.mark.parametrize("partitions", [2, 4])
def test_verdicts_stream_in_like_agent_1_sends_them_and_decide_like_offline(
    trace: list[list[Event]], partitions: int
) -> None:
    """As the agents run: after each detect batch its verdicts, then the clocks of the
    partitions that moved, while one partition after the other is caught up (worst skew)
    and wall time races ahead (a loaded machine). No partition may let a verdict through
    before a slower one has passed it, whatever the wall clock says."""
    offline = DetectionPipeline()
    for b in trace:
        offline.feed(b)
    offline.finish()

    r = router()
    recs = [
        Record("ev", zlib.crc32(key := b[0].comm.encode()) % partitions, i, key, encode_message(b))
        for i, b in enumerate(trace)
    ]
    recs.sort(key=lambda rec: rec.partition)
    wall = [0.0]
    c = live_runner(partitions, wall)
    commands = []
    n_v = 0
    for i in range(0, len(recs), 40):
        out = r.process(recs[i : i + 40])
        vrecs = verdict_records(out, n_v)
        n_v += len(vrecs)
        # Every tick agent 1 reports every partition it serves (lagging ones included).
        clocks = [r.partition_clock(p) for p in range(partitions)]
        marks = [mark(p, t, verdicts_offset=n_v - 1) for p, t in enumerate(clocks)]
        commands += c.process(vrecs + marks).commands
        wall[0] += 60.0  # minutes of wall time per batch: neither idle_s nor max_hold_s apply
    out = r.close_slices()  # end of input, as DetectionPipeline.finish()
    vrecs = verdict_records(out, n_v)
    commands += c.process(vrecs + [mark(p, t, job=j) for (p, j), t in r.clock_us.items()]).commands
    commands += c.flush().commands
    assert [(x.host, x.gpu, x.fault, x.id) for x in commands] == [
        (x.host, x.gpu, x.fault, x.id) for x in offline.commands
    ]


def test_a_partition_not_heard_of_yet_holds_then_one_idle_or_silent_does_not() -> None:
    wall = [100.0]
    c = live_runner(3, wall, idle_s=5.0, max_hold_s=30.0)
    c.process([mark(0, 10_000_000)])
    assert c.watermark(wall[0]) is None  # 1 and 2 never reported: they hold (a restart)
    c.process([mark(1, 4_000_000, caught_up=False), mark(2, 8_000_000, caught_up=True)])
    assert c.watermark(wall[0]) == 4_000_000
    wall[0] += 6.0  # partition 2: no lag for idle_s; 1 still lagging (it reports, slowly)
    c.process([mark(1, 5_000_000), mark(2, 8_000_000, caught_up=True)])
    assert c.watermark(wall[0]) == 5_000_000
    wall[0] += 100.0
    c.process([mark(1, 5_000_000), mark(0, 10_000_000)])  # lag, however long: still holds
    assert c.watermark(wall[0]) == 5_000_000
    wall[0] += 31.0  # 1 went silent (its worker is gone) for max_hold_s: no longer holds
    c.process([mark(0, 12_000_000)])
    assert c.watermark(wall[0]) == 12_000_000


def test_a_watermark_waits_for_the_verdicts_it_covers() -> None:
    wall = [0.0]
    c = live_runner(1, wall)
    v = Verdict(
        id="v1",
        ts_us=1_000_000,
        job="j",
        comm="0xa",
        host="h",
        fault="straggler",
        score=1.0,
        reason="r",
        window_start_us=0,
        window_end_us=1_000_000,
    )
    c.process([mark(0, 2_000_000, offset=0, verdicts_offset=5)])  # fetched before verdict 5
    assert c.watermark(wall[0]) is None
    c.process([Record("v", 0, 5, None, encode_verdict(v))])
    assert c.watermark(wall[0]) == 2_000_000 and held_count(c) == 0
