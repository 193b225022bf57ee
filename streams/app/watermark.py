"""The worker's watermark: its wire format and the sender in agent ``detect``.

Verdicts of different ``c4.events`` partitions reach the correlator out of event-time
order (one partition may be seconds ahead of another, very much so while catching up),
and the correlator must see a victim's "waiting in communicator X" before it judges that
victim as the culprit elsewhere. So agent ``detect`` tells every correlator how far each
of its events partitions has been judged (:class:`WatermarkSender`), and agent
``correlate`` holds verdicts until every events partition's clock has passed them
(:class:`~streams.app.correlate_runner.CorrelatorRunner`).
"""

from __future__ import annotations

import asyncio
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from producers.guard import BoundsError, check_bounds

__all__ = [
    "Mark",
    "QueuedMarks",
    "Watermark",
    "WatermarkSender",
    "decode_watermark",
    "encode_watermark",
    "job_partition",
]


def job_partition(job: str, partitions: int) -> int:
    """The ``c4.verdicts`` partition of a job's verdicts (and of its watermarks): a
    stable hash (CRC-32, the same in every process and release), so that one correlator
    sees the whole of a job (its cap on isolated hosts, its job-wide-stop rail) and
    several correlators share the jobs.

    >>> job_partition("job-1", 1), job_partition("job-1", 8) == job_partition("job-1", 8)
    (0, True)
    """
    return zlib.crc32(job.encode()) % partitions


class Watermark(msgspec.Struct, frozen=True, omit_defaults=True):
    """Event-time progress of one job in one ``c4.events`` partition, sent by agent 1 to
    agent 2. ``job`` names the job the mark holds back; a mark without one speaks for the
    partition as a whole (clock -1: nothing of any job there yet; older senders).

    >>> decode_watermark(encode_watermark(Watermark(partition=3, clock_us=7, job="j")))
    Watermark(partition=3, clock_us=7, caught_up=False, verdicts_offset=-1, job='j')
    >>> encode_watermark(Watermark(partition=3, clock_us=-1, caught_up=True))
    b'{"partition":3,"clock_us":-1,"caught_up":true}'
    """

    partition: int
    clock_us: int
    """Newest ``ts_us`` judged in this partition (for ``job``); -1 if none since the
    sender started."""
    caught_up: bool = False
    """The sender had judged everything in the partition (no consumer lag) when it sent
    this: the only case in which the partition may stop holding the watermark back."""
    verdicts_offset: int = -1
    """Offset of the last verdict the sender had put on the ``c4.verdicts`` partition this
    watermark travels with (-1: none). The two topics are fetched independently, so the
    mark only counts once the correlator has read the verdicts partition that far."""
    job: str | None = None
    """The job whose event time this is (None: the partition as a whole)."""


_wm_decoder = msgspec.json.Decoder(Watermark)


def encode_watermark(w: Watermark) -> bytes:
    return msgspec.json.encode(w)


def decode_watermark(data: bytes) -> Watermark:
    """Raises ValueError (msgspec's DecodeError or a bound) on anything not a mark."""
    try:
        check_bounds(data, max_bytes=4096)
        return _wm_decoder.decode(data)
    except (msgspec.DecodeError, BoundsError):
        raise
    except Exception as err:  # RecursionError and the like: never past the edge
        raise ValueError(f"undecodable: {type(err).__name__}") from None


@dataclass
class Mark:
    """What a correlator knows of one events partition, or of one job in it, from the
    marks it read (wall times are its own)."""

    clock_us: int
    heard: float  # when a report on the partition last arrived
    moved: float  # when its clock last moved
    idle_since: float | None = None
    """Since when every report said "caught up" at an unchanged clock (None: lagging)."""
    reported: bool = False
    """Some report arrived since the correlator started (else the partition holds every
    job back, for up to ``max_hold_s``: after a restart it may hold anything)."""
    caught_since: float | None = None
    """Since when every report on the partition said "caught up" (None: lagging)."""


class Offsets(Protocol):
    """What the sender reads of the consumer (:class:`~streams.app.faust_adapter.ConsumerView`)."""

    def highwater(self, topic: str, partition: int) -> int | None: ...

    def committed(self, topic: str, partition: int) -> int | None: ...


REFRESH = 256
"""Unchanged lanes whose mark is sent again per heartbeat, least recently sent first."""

Send = Callable[[int, bytes, bytes], Awaitable[Any]]
"""(verdicts partition, key, value) -> sent: puts one watermark on the topic."""


@dataclass
class QueuedMarks:
    """Marks placed in line by :meth:`WatermarkSender.queue`, waiting to be sent."""

    lanes: dict[int, list[tuple[str, int]]]
    idle: dict[int, bool]
    has_lanes: dict[int, bool]
    """Per partition: whether any job of it has a clock (else its own mark is sent)."""
    clocks: dict[tuple[int, str], int | None]
    """The clocks, at queue time, of the least recently sent lanes (None: forgotten)."""
    after: asyncio.Event | None
    """Set once the marks queued before these have gone."""
    done: asyncio.Event = field(default_factory=asyncio.Event)


class WatermarkSender:
    """Agent ``detect``'s side: tracks what it judged and sends changed clocks."""

    def __init__(
        self,
        events_topic: str,
        verdicts_partitions: int,
        consumer: Offsets,
        send: Send,
    ) -> None:
        self.events_topic = events_topic
        self.verdicts_partitions = verdicts_partitions
        self.consumer = consumer
        self.send = send
        self.marks_sent: OrderedDict[tuple[int, str | None, int], Watermark] = OrderedDict()
        """(events partition, job, verdicts partition) -> last watermark sent, least
        recently sent first."""
        self.judged: dict[int, int] = {}
        """events partition -> next offset agent ``detect`` has not judged yet."""
        self.verdicts_sent: dict[int, int] = {}
        """verdicts partition -> offset of the last verdict this worker put there."""
        self._tail: asyncio.Event | None = None
        """Set once the mark queued last has gone (None: none queued yet)."""
        self._behind: dict[int, set[str]] = {}
        """events partition -> jobs whose last mark said the partition had lag: sent
        again once it has none."""
        self._targets_of: dict[str, int] = {}
        """job -> its verdicts partition (a CRC per lane per send was most of a tick)."""

    def taken(self, partition: int, offset: int) -> None:
        """Agent ``detect`` took the message at ``offset`` of events ``partition``."""
        if offset >= self.judged.get(partition, 0):
            self.judged[partition] = offset + 1

    def revoked(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self.judged.pop(p, None)

    def verdict_sent(self, partition: int, offset: int) -> None:
        """A verdict is on the broker at ``offset`` of verdicts ``partition``."""
        if offset > self.verdicts_sent.get(partition, -1):
            self.verdicts_sent[partition] = offset

    def caught_up(self, p: int) -> bool:
        """No consumer lag: every message of events partition ``p`` fetched so far (the
        broker's high watermark as of the last fetch) has been judged. Unknown counts as
        lag, i.e. keep holding."""
        high = self.consumer.highwater(self.events_topic, p)
        if high is None:
            return False
        nxt = self.judged.get(p)
        if nxt is None:  # nothing judged since start: where the group left off
            nxt = self.consumer.committed(self.events_topic, p) or 0
        return nxt >= high

    def queue(
        self,
        partitions: Iterable[int],
        clocks: Mapping[tuple[int, str], int],
        moved: set[tuple[int, str]] | None = None,
        lanes_in: Mapping[int, int] | None = None,
    ) -> QueuedMarks:
        """The marks of ``partitions`` as the lanes stand now (``clocks``: (partition,
        job) -> clock), placed in line behind every mark queued before. Call it in the
        same step as the router call whose verdicts the marks follow, with no ``await``
        between: the lanes' clocks then cover exactly the verdicts queued so far.

        ``moved`` (taken, then cleared): the lanes whose clock moved since the last
        call, with ``lanes_in`` (partition -> lanes with a clock): then only those, and
        the lanes last marked as lagging of a partition that has no lag now, are looked
        at — the work is what changed, not every lane (20,000 idle lanes cost a tick
        ~80 ms). None: every lane of ``clocks``."""
        lanes: dict[int, list[tuple[str, int]]] = {p: [] for p in partitions}
        for lane in clocks if moved is None else moved:
            clock = clocks.get(lane)
            if clock is not None:
                lanes.setdefault(lane[0], []).append((lane[1], clock))
        idle = {p: self.caught_up(p) for p in lanes}
        if moved is None:
            has_lanes = {p: bool(jobs) for p, jobs in lanes.items()}
        else:
            moved.clear()
            for p, jobs in lanes.items():
                behind = self._behind.get(p)
                if idle[p] and behind:
                    have = {job for job, _ in jobs}
                    jobs += [(j, clocks[(p, j)]) for j in sorted(behind - have) if (p, j) in clocks]
            has_lanes = {p: (lanes_in or {}).get(p, 0) > 0 or bool(lanes[p]) for p in lanes}
        stale: dict[tuple[int, str], int | None] = {}
        for p, job, _ in self.marks_sent:  # room for the sends queued before these
            if len(stale) >= 2 * REFRESH:
                break
            if job is not None:
                stale[(p, job)] = clocks.get((p, job))
        queued = QueuedMarks(lanes, idle, has_lanes, stale, self._tail)
        self._tail = queued.done
        return queued

    async def send_queued(
        self, queued: QueuedMarks, sent: Iterable[Awaitable[Any]], heartbeat: bool
    ) -> None:
        """Send ``queued`` once every mark queued before it has gone and the verdicts
        ``sent`` (their delivery futures) are on the broker.

        Two callers emit concurrently (agent ``detect`` after a batch, the timer after a
        tick). A mark sent by one while the other still waited for its verdicts' offsets
        claimed a clock past verdicts that were not on the broker yet, and the correlator
        dead-lettered those "late by" 10-30 s on a backlog (a job's verdicts concluded at
        5 s landed behind a mark of 16 s)."""
        try:
            if queued.after is not None:
                await queued.after.wait()
            for fut in sent:  # verdicts are on the broker before the watermark passes them
                md = await fut
                self.verdict_sent(md.partition, md.offset)
            await self._send_lanes(queued, heartbeat)
        finally:
            queued.done.set()

    async def send_all(
        self,
        partitions: Iterable[int],
        clocks: Mapping[tuple[int, str], int],
        heartbeat: bool,
        moved: set[tuple[int, str]] | None = None,
        lanes_in: Mapping[int, int] | None = None,
    ) -> None:
        """:meth:`queue` and :meth:`send_queued` with no verdicts of its own."""
        await self.send_queued(self.queue(partitions, clocks, moved, lanes_in), (), heartbeat)

    async def _send_lanes(self, queued: QueuedMarks, heartbeat: bool) -> None:
        """Tell every correlator how far each job in each events partition of this worker
        has been judged: the lanes whose clock or lag changed, a job's clock only to the
        verdicts partition of the job. On ``heartbeat`` also a mark of each partition as
        a whole (clock -1: it moves no clock, it says the partition is alive and whether
        it has lag) and the :data:`REFRESH` least recently sent lanes again: a tick's
        sends do not grow with the number of idle lanes (one per lane per tick was 20,000
        marks a second at 20,000 jobs)."""
        lanes, idle, clocks = queued.lanes, queued.idle, queued.clocks
        sent = self.marks_sent
        for p, jobs in sorted(lanes.items()):
            # the partition as a whole first: its lag holds every job of it (the
            # correlator reads it), so a lane whose clock stands still is not sent again
            # when the partition gets lag, only when it has none any more
            for q in range(self.verdicts_partitions):
                old = sent.get((p, None, q))
                if heartbeat or not queued.has_lanes[p] or old is None or old.caught_up != idle[p]:
                    await self._send(p, None, q, -1, idle[p])
            for job, clock in jobs:
                q = self._target(job)  # the correlator that judges the job
                old = sent.get((p, job, q))
                if old is not None and old.clock_us == clock and (old.caught_up or not idle[p]):
                    continue
                await self._send(p, job, q, clock, idle[p])
        if not heartbeat:
            return
        stale = []
        for key in sent:
            if len(stale) >= REFRESH:
                break
            if key[1] is not None:
                stale.append(key)
        for p, job, q in stale:
            if (p, job) not in clocks:
                break  # moved on since queued: the next heartbeat's
            clock = clocks[(p, job)]  # type: ignore[index]
            if clock is None or p not in idle:  # forgotten lane, or a partition gone
                del sent[(p, job, q)]
                self._behind.get(p, set()).discard(job)  # type: ignore[arg-type]
                continue
            await self._send(p, job, q, clock, idle[p])

    async def _send(self, p: int, job: str | None, q: int, clock: int, idle: bool) -> None:
        wm = Watermark(partition=p, clock_us=clock, caught_up=idle,
                       verdicts_offset=self.verdicts_sent.get(q, -1), job=job)  # fmt: skip
        await self.send(q, str(p).encode(), encode_watermark(wm))
        self.marks_sent[(p, job, q)] = wm
        self.marks_sent.move_to_end((p, job, q))
        if job is not None:
            if idle:
                self._behind.get(p, set()).discard(job)
            else:
                self._behind.setdefault(p, set()).add(job)

    def _target(self, job: str) -> int:
        """The verdicts partition of a job's marks: the one correlator that judges it."""
        q = self._targets_of.get(job)
        if q is None:
            if len(self._targets_of) > 1 << 17:  # bounded: a flood of job ids
                self._targets_of.clear()
            q = self._targets_of[job] = job_partition(job, self.verdicts_partitions)
        return q
