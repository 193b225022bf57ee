"""What a :class:`~streams.app.detect_runner.CommRouter` holds, and how it lets go.

Memory is bounded by construction, whatever arrives (issue 25: 120,000 communicators
over 20,000 jobs grew a worker to 1.6 GB with nothing evicted):

* communicators held: at most ``max_comms`` (and ``max_lanes`` lanes) after every tick.
  Over a cap, lanes go, communicators and all, checkpointed first, least recently
  active first: idle ones (quiet for ``evict_idle_s``) before any other, recent ones
  too when none is idle (a flood of new ids faster than ``max_comms / evict_idle_s``),
  never one whose events wait to be judged;
* a lane quiet for ``forget_lane_s`` (a finished job) leaves memory likewise, so the
  communicators of jobs long gone are not pinned under the cap;
* checkpoints in the table (Faust's memory store: in memory too) of communicators not
  held: at most ``max_checkpoints``, the longest kept deleted first (tombstones), the
  ones a restarted worker recovers counted as well;
* a job leaves ``jobs`` (and its per-job series the metrics registry) with its last
  lane.

A communicator that speaks again is restored from its checkpoint, if still kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from streams.app.comm_slices import Lane
from streams.app.runner import Output

if TYPE_CHECKING:
    from streams.app.admission import EdgeLimits
    from streams.app.checkpoint import CheckpointSchedule
    from streams.app.comm_slices import Slice
    from streams.app.comm_state import Comm
    from streams.app.runner import RouterStats

__all__ = ["LaneBounds"]

log = logging.getLogger(__name__)

_EVICT_PER_TICK = 1000
"""Idle communicators evicted per tick at most beyond the excess over the cap (each is
checkpointed first): a tick's eviction work is what arrived since the last tick, not
what went idle at once."""
_WARN_EVERY_S = 60.0
"""Active state evicted over the cap is logged at most once a minute (a flood of new ids
would log every tick)."""


class LaneBounds:
    """The router's eviction, retirement and checkpoint retention (a mixin: the state it
    bounds is the router's own)."""

    comms: dict[str, Comm]
    by_lane: dict[Lane, set[str]]
    pending: dict[Lane, Slice]
    clock_us: dict[Lane, int]
    jobs: set[str]
    late_events: dict[str, int]
    sizes: dict[str, int]
    contested: Any
    ledger: Any
    members: Any
    fresh: Any
    limits: EdgeLimits
    stats: RouterStats
    schedule: CheckpointSchedule
    forget_lane_s: float
    _open: set[Lane]
    _active: set[Lane]
    _last_active: OrderedDict[Lane, float]
    _advanced_us: dict[Lane, int]
    _lane_order: dict[Lane, int]
    moved: set[Lane]
    _moved_now: set[Lane]
    lanes_in: dict[int, int]
    _slice_end: dict[Lane, int]
    _accepted_at: dict[Lane, float]

    if TYPE_CHECKING:  # the runner's (StateRunner), after this class in the router's MRO

        def _checkpoint(self, keys: list[str]) -> list[tuple[int, bytes, bytes]]: ...

    def _init_bounds(self) -> None:
        self._job_lanes: dict[str, int] = {}
        """job -> lanes of it held (``by_lane``)."""
        self._warned_at = -_WARN_EVERY_S
        self._parked: OrderedDict[str, int] = OrderedDict()
        """Communicator -> partition, of checkpoints in the table for communicators not
        held (evicted, retired, recovered), longest kept first: at most
        ``max_checkpoints``."""

    def _held(self, comm: str, lane: Lane) -> None:
        """``comm`` of ``lane`` is held (created or restored)."""
        self._parked.pop(comm, None)
        if lane not in self.by_lane:
            self.by_lane[lane] = set()
            self._job_lanes[lane[1]] = self._job_lanes.get(lane[1], 0) + 1
        self.by_lane[lane].add(comm)
        self.jobs.add(lane[1])

    def _forget_comms(self, keys: list[str]) -> None:
        for comm in keys:
            self.ledger.forget(comm)
            c = self.comms.get(comm)
            self.members.forget(comm, c.job if c is not None else None)
            for per_comm in (self.comms, self.sizes, self.contested):
                per_comm.pop(comm, None)  # type: ignore[attr-defined]

    def _drop(self, partitions: set[int] | None, keys: list[str]) -> None:
        self._forget_comms(keys)
        for comm in [c for c, p in self._parked.items() if partitions is None or p in partitions]:
            del self._parked[comm]  # their checkpoints are the next owner's to count
        self.fresh.drop(partitions)
        lanes = {
            lane
            for lane in set(self.clock_us) | set(self.by_lane)
            if partitions is None or lane[0] in partitions
        }
        for lane in lanes:
            self._drop_lane(lane, [])
            self._active.discard(lane)

    def _forget_lane(self, lane: Lane) -> None:
        """Forget a lane's clock and its place (a new message starts it again)."""
        if self.clock_us.pop(lane, None) is not None:
            self.lanes_in[lane[0]] -= 1
        self._lane_order.pop(lane, None)
        self.moved.discard(lane)
        self._moved_now.discard(lane)
        self._advanced_us.pop(lane, None)
        self._slice_end.pop(lane, None)
        self._last_active.pop(lane, None)
        self._open.discard(lane)

    def _retire(self, out: Output, wall: float) -> None:
        """Lanes quiet for ``forget_lane_s`` (a finished job) leave memory, communicators
        and all, checkpointed first: their watermarks stop, and a new message of the job
        restores what its communicators were judged up to. At most ``_EVICT_PER_TICK``
        communicators a tick; the rest go at the next."""
        due, n = [], 0
        for lane, at in self._last_active.items():  # least recent first: a prefix
            if wall - at <= self.forget_lane_s or n >= _EVICT_PER_TICK:
                break
            if lane not in self._open and lane not in self.pending:
                due.append(lane)
                n += len(self.by_lane.get(lane, ()))
        for lane in due:
            self._evict_lane(lane, out)

    def _evict(self, out: Output, wall: float) -> None:
        """Over ``max_comms`` communicators or ``max_lanes`` (partition, job) lanes:
        checkpoint and forget lanes, communicators and all, least recently active first;
        a communicator that speaks again is restored from its checkpoint. Lanes quiet
        for ``evict_idle_s`` go first; when none is left and the worker is still over a
        cap (new ids faster than ``max_comms / evict_idle_s``: a flood), recent ones go
        too, so the caps bound memory by construction (counted in ``evicted_active``,
        logged once a minute). Lanes with events not yet judged are never evicted."""
        lim = self.limits
        comms = len(self.comms) - lim.max_comms  # how many must go
        lanes = len(self.by_lane) - lim.max_lanes
        if comms <= 0 and lanes <= 0:
            return
        budget = max(comms, 0) + _EVICT_PER_TICK
        due: list[tuple[Lane, bool]] = []
        n = 0
        for lane, at in self._last_active.items():  # least recent first: a prefix
            if (comms <= 0 and lanes <= 0) or n >= budget:
                break
            if lane in self._open or lane in self.pending:
                continue
            k = len(self.by_lane.get(lane, ()))
            due.append((lane, wall - at >= lim.evict_idle_s))
            n, comms, lanes = n + k, comms - k, lanes - 1
        idle = active = 0
        for lane, was_idle in due:
            k = self._evict_lane(lane, out)
            idle, active = (idle + k, active) if was_idle else (idle, active + k)
        self.stats.evicted_active += active
        if idle:
            log.info("evicted %d idle communicators (caps: %d communicators, %d lanes); "
                     "%d held", idle, lim.max_comms, lim.max_lanes, len(self.comms))  # fmt: skip
        if active and wall - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = wall
            log.warning("over the cap of %d communicators (%d lanes) with none idle for "
                        "%.0f s: evicted %d recently active ones (checkpointed; %d in "
                        "all so far), the least recent first; %d held",
                        lim.max_comms, lim.max_lanes, lim.evict_idle_s, active,
                        self.stats.evicted_active, len(self.comms))  # fmt: skip

    def _evict_lane(self, lane: Lane, out: Output) -> int:
        """Checkpoint a lane's communicators and forget it; how many it held."""
        keys = sorted(self.by_lane.get(lane, ()))
        out.checkpoints.extend(self._checkpoint(self.schedule.take_all(keys)))
        for comm in keys:
            self.schedule.forget(comm)
        self._drop_lane(lane, keys)
        self.stats.evicted += len(keys)
        self.park([(lane[0], comm.encode()) for comm in keys], out)
        return len(keys)

    @property
    def parked(self) -> int:
        """Checkpoints in the table of communicators not held, counted under the cap."""
        return len(self._parked)

    def park(self, keys: list[tuple[int, bytes]], out: Output | None = None) -> Output:
        """Count (partition, table key) checkpoints of communicators not held under
        ``max_checkpoints``; beyond, the longest kept are deleted (``out.forgotten``).
        The worker calls it with what its table recovered at an assignment."""
        out = out if out is not None else Output()
        parked = self._parked
        for p, key in keys:
            comm = key.decode("utf-8", "replace")
            if comm not in self.comms and comm not in parked:  # (kept: keeps its age)
                parked[comm] = p
        gone = 0
        while len(parked) > self.limits.max_checkpoints:
            comm, p = parked.popitem(last=False)
            out.forgotten.append((p, comm.encode()))
            gone += 1
        if gone:
            self.stats.forgotten += gone
            log.info("deleted the checkpoints of %d communicators not held, the longest "
                     "kept first (cap: %d kept)", gone, self.limits.max_checkpoints)  # fmt: skip
        return out

    def _drop_lane(self, lane: Lane, keys: list[str]) -> None:
        self._forget_comms(keys)
        self._forget_lane(lane)
        if self.by_lane.pop(lane, None) is not None:
            self._job_lanes[lane[1]] -= 1
            if not self._job_lanes[lane[1]]:  # its last lane: the job is no longer held
                del self._job_lanes[lane[1]]
                self.jobs.discard(lane[1])
                self.late_events.pop(lane[1], None)
        self.pending.pop(lane, None)
        self._accepted_at.pop(lane, None)
