"""Watermarks follow the job's verdicts partition (issue 22, item 3), broker-free."""

from __future__ import annotations

import asyncio

from streams.app.watermark import Watermark, WatermarkSender, decode_watermark, job_partition


class _Offsets:
    def highwater(self, topic: str, partition: int) -> int | None:
        return 10

    def committed(self, topic: str, partition: int) -> int | None:
        return 10


def _sent(
    q: int, clocks: dict[tuple[int, str], int], parts: list[int]
) -> list[tuple[int, Watermark]]:
    out: list[tuple[int, Watermark]] = []

    async def send(part: int, key: bytes, value: bytes) -> None:
        out.append((part, decode_watermark(value)))

    s = WatermarkSender("ev", q, _Offsets(), send)
    asyncio.run(s.send_all(parts, clocks, heartbeat=True))
    return out


def test_job_partition_is_stable_and_spreads_jobs() -> None:
    # CRC-32: the same in every process (not Python's salted hash)
    assert [job_partition(f"job-{i}", 8) for i in range(6)] == [
        job_partition(f"job-{i}", 8) for i in range(6)
    ]
    assert job_partition("job-0", 1) == 0
    assert len({job_partition(f"job-{i}", 8) for i in range(64)}) == 8


def test_a_jobs_marks_go_to_its_correlator_and_the_others_hear_the_partition() -> None:
    q = 4
    jobs = {}
    i = 0
    while len(jobs) < 2:  # two jobs on two different verdicts partitions
        jobs.setdefault(job_partition(f"j{i}", q), f"j{i}")
        i += 1
    (qa, a), (qb, b) = sorted(jobs.items())
    sent = _sent(q, {(0, a): 100, (0, b): 200, (1, a): 50}, [0, 1, 2])
    by = {(p, w.partition, w.job): w.clock_us for p, w in sent}
    assert by[(qa, 0, a)] == 100 and by[(qb, 0, b)] == 200 and by[(qa, 1, a)] == 50
    # a job's clock never reaches a correlator that does not judge it
    assert all(w.job is None or job_partition(w.job, q) == p for p, w in sent)
    # every correlator hears every events partition (a partition with no job for it:
    # a mark of the partition as a whole, clock -1, so that it holds only while lagging)
    for p in range(q):
        assert {w.partition for qq, w in sent if qq == p} == {0, 1, 2}
    assert all(w.clock_us == -1 for p, w in sent if w.job is None)


def test_one_verdicts_partition_gets_every_mark_as_before() -> None:
    sent = _sent(1, {(0, "x"): 7, (1, "y"): 9}, [0, 1, 2])
    assert {p for p, _ in sent} == {0}
    # every job's clock, and on a heartbeat each events partition as a whole (clock -1)
    assert {(w.partition, w.job, w.clock_us) for _, w in sent} == {
        (0, "x", 7), (1, "y", 9), (0, None, -1), (1, None, -1), (2, None, -1),
    }  # fmt: skip


def test_a_mark_never_passes_a_verdict_queued_before_it() -> None:
    """Agent ``detect`` and the timer emit concurrently: the timer's mark, queued after a
    batch whose verdict is still on its way, must wait for it and count its offset (it
    once went first, and the correlator dead-lettered such verdicts "late by" 10-30 s)."""

    class _Sent:
        def __init__(self, offset: int) -> None:
            self.partition, self.offset = 0, offset

    async def main() -> list[tuple[int, int]]:
        out: list[Watermark] = []

        async def send(part: int, key: bytes, value: bytes) -> None:
            out.append(decode_watermark(value))

        s = WatermarkSender("ev", 1, _Offsets(), send)
        delivery: asyncio.Future[_Sent] = asyncio.get_running_loop().create_future()
        batch = s.queue([0], {(0, "j"): 5_000_000})  # detect: one verdict in flight
        timer = s.queue([0], {(0, "j"): 16_000_000})  # the timer, the lanes moved on
        t_timer = asyncio.create_task(s.send_queued(timer, (), heartbeat=False))
        t_batch = asyncio.create_task(s.send_queued(batch, [delivery], heartbeat=False))
        for _ in range(5):
            await asyncio.sleep(0)
        assert out == []  # neither goes before the verdict is on the broker
        delivery.set_result(_Sent(31))
        await asyncio.gather(t_timer, t_batch)
        return [(w.clock_us, w.verdicts_offset) for w in out if w.job == "j"]

    assert asyncio.run(main()) == [(5_000_000, 31), (16_000_000, 31)]


def test_the_lanes_that_moved_get_the_marks_every_lane_would() -> None:
    """Given the lanes whose clock moved, the sender looks at those (and at the lanes it
    last marked as lagging once their partition has none) instead of every lane: the
    marks the correlators end up with are the same as from a look at every lane, through
    lag coming and going, new lanes and forgotten ones."""
    import random

    rng = random.Random(7)
    lag = {0: False, 1: False, 2: False}

    class _Lag:
        def highwater(self, topic: str, partition: int) -> int | None:
            return 11 if lag[partition] else 10

        def committed(self, topic: str, partition: int) -> int | None:
            return 10

    def sender() -> tuple[WatermarkSender, list[tuple[int, Watermark]]]:
        out: list[tuple[int, Watermark]] = []

        async def send(part: int, key: bytes, value: bytes) -> None:
            out.append((part, decode_watermark(value)))

        return WatermarkSender("ev", 3, _Lag(), send), out

    every, every_out = sender()
    moved_only, moved_out = sender()
    clocks: dict[tuple[int, str], int] = {}
    moved: set[tuple[int, str]] = set()
    for step in range(300):
        for _ in range(rng.randrange(4)):  # some lanes move, some new
            lane = (rng.randrange(3), f"j{rng.randrange(12)}")
            clocks[lane] = clocks.get(lane, 0) + rng.randrange(1, 5)
            moved.add(lane)
        if rng.random() < 0.05 and clocks:  # a lane forgotten
            gone = rng.choice(sorted(clocks))
            del clocks[gone]
            moved.discard(gone)
        if rng.random() < 0.2:
            p = rng.randrange(3)
            lag[p] = not lag[p]
        heartbeat = step % 7 == 0
        lanes_in = {p: sum(1 for q, _ in clocks if q == p) for p in range(3)}
        asyncio.run(every.send_all([0, 1, 2], clocks, heartbeat))
        asyncio.run(moved_only.send_all([0, 1, 2], clocks, heartbeat, moved, lanes_in))
        assert not moved  # taken
        live = {(p, job, q): w for (p, job, q), w in every.marks_sent.items()
                if job is None or (p, job) in clocks}  # fmt: skip
        assert {k: w for k, w in moved_only.marks_sent.items() if k in live} == live
    assert len(moved_out) < len(every_out) * 1.01  # never more marks for looking at less
