"""What the worker admits from ``c4.events``: the contract's rules beyond its types and
the edge limits, each written once, for columns.

A message is rows ``s:e`` of the consumer batch's :class:`~producers.columnar.ColumnBlock`
(JSON and Arrow alike: :func:`streams.app.column_intake.decode_batch`). Each rule is a
mask over the message's rows; the first row any rule refuses, and the first rule that
refuses it, name the dead letter's reason ("event 1: rank 5 is not below nranks 4"),
which is all a person reads. The contract's rules (ranks and peers below ``nranks``) are
looked at before the limits, over all rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from producers.columnar import ColumnBlock
from producers.guard import (
    MAX_DEPTH,
    MAX_FUTURE_SKEW_US,
    MAX_MESSAGE_BYTES,
    MAX_NRANKS,
    MAX_PAST_SKEW_US,
)
from streams.app.settings import (
    CONTESTED_HOLD_S,
    DEDUP_MESSAGES,
    EVICT_IDLE_S,
    MAX_CHECKPOINTS,
    MAX_COMMS,
    MAX_LANES,
)

__all__ = ["INFLIGHT_SLACK_US", "BatchView", "EdgeLimits", "LaneView", "admission_problem",
           "contract_problem", "unrefusable"]  # fmt: skip

#: Measurement noise allowed between two stamps of one rank's host clock (an in-flight
#: time and its heartbeat's stamp; an op's duration and its predecessor's completion).
INFLIGHT_SLACK_US = 200_000


@dataclass(frozen=True)
class EdgeLimits:
    """What the worker accepts from ``c4.events`` beyond the contract's types.

    Each bound stops one way a single message could take the worker down or steer it:
    ``nranks = 2^31`` grew the worker to 21 GB; a ``ts_us`` a year ahead moved its
    partition's clock and hid a fault; ``nranks`` doubled mid-stream hid a straggler.
    """

    max_nranks: int = MAX_NRANKS
    """Largest communicator accepted (the core sizes its arrays by ``nranks``)."""
    max_future_skew_us: int = MAX_FUTURE_SKEW_US
    """How far ahead of its partition's clock (and of the wall clock) an event may be."""
    max_past_skew_us: int = MAX_PAST_SKEW_US
    """How far behind its partition's clock an event may be."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_depth: int = MAX_DEPTH
    contested_hold_s: float = CONTESTED_HOLD_S
    """How long (the worker's wall clock: a replayed message's old ``ts_us`` does not
    shorten or lengthen it) a communicator's verdicts stay alert-only after two sources
    contradicted each other about one of its ranks. The verdicts are still sent, as
    alerts saying so; a hold delays isolation, it never hides the fault."""
    exec_free_us: int = 625_000
    """An op's ``exec_us`` at most this long is admitted unchecked: it cannot raise the
    hang threshold above its floor (``hang_floor_us / hang_period_mult``). A longer one
    must fit the physics: it cannot have lasted longer than since its rank's previous
    op in the communicator completed (ops of one communicator run one after another)."""
    dedup_messages: int = DEDUP_MESSAGES
    """Digests of the most recent accepted messages kept: an exact repeat of one of them
    is dropped (counted in ``duplicates``), never judged twice."""
    isolate_uncorroborated: bool = False
    """Whether a verdict of a communicator nobody corroborates may isolate (see
    :meth:`CommRouter.uncorroborated`); off: alert only, with the reason."""
    max_comms: int = MAX_COMMS
    """Communicators held; beyond, lanes are evicted (checkpointed first), idle first."""
    max_lanes: int = MAX_LANES
    """(partition, job) lanes held; beyond, lanes are evicted likewise."""
    evict_idle_s: float = EVICT_IDLE_S
    """Lanes without a message for this long (wall) are evicted before any other."""
    max_checkpoints: int = MAX_CHECKPOINTS
    """Checkpoints kept of communicators not held; beyond, the longest kept go."""


def contract_problem(block: ColumnBlock, s: int, e: int) -> str | None:
    """What in rows ``s:e`` breaks the contract beyond the types the decoder checks, or
    None: every rank, and every connection's peer, is below the row's ``nranks``.

    >>> from producers.columnar import decode_block, encode_arrow
    >>> from producers.events import OpEvent
    >>> ev = OpEvent(v=1, job="j", comm="0xa", nranks=2, rank=2, host="h", ts_us=1,
    ...              op="AllReduce", seq=1, bytes=8, exec_us=1.0)
    >>> _, block = decode_block([(encode_arrow([ev]), None)])
    >>> contract_problem(block, 0, 1)
    'event 0: rank 2 is not below nranks 2'
    """
    if e <= s:
        return "empty message: no events"
    bad, bad_peer, owner, peers = _contract_rows(block, s, e)
    rows = bad.copy()
    rows[owner[bad_peer]] = True
    if not rows.any():
        return None
    nr, rank = block.column("nranks")[s:e], block.column("rank")[s:e]
    i = int(np.argmax(rows))
    if bad[i]:
        return f"event {i}: rank {rank[i]} is not below nranks {nr[i]}"
    j = int(np.argmax(bad_peer & (owner == i)))
    return f"event {i}: peer {peers[j]} is not below nranks {nr[i]}"


def _contract_rows(
    block: ColumnBlock, s: int, e: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The contract's rule over rows ``s:e``: per row its rank not below its ``nranks``;
    per connection its peer not below its row's; each connection's row (from ``s``) and
    peer."""
    nr = block.column("nranks")[s:e]
    bad = block.column("rank")[s:e] >= nr
    peer, off = block.conns()
    peers = peer[int(off[s]) : int(off[e])]
    owner = np.repeat(np.arange(e - s), np.diff(off[s : e + 1]))
    return bad, peers >= nr[owner], owner, peers


@dataclass(frozen=True, slots=True)
class LaneView:
    """What the limits read of the worker's state, for one message (partition ``p``)."""

    size_of: Callable[[str, str], int | None]
    """(communicator, job) → its size fixed before (or by its checkpoint), or None."""
    clock_of: Callable[[str], int | None]
    """job → its lane's clock in this partition (None: no clock yet)."""
    quiet_of: Callable[[str], float]
    """job → wall seconds since its lane last accepted a message."""
    last_op_ts: Callable[[str, np.ndarray], np.ndarray]
    """(communicator, ranks) → each rank's newest op judged (its ``ts_us``; -1: none)."""
    horizon_us: int
    """The wall clock plus the skew: no event is stamped later."""


def admission_problem(
    block: ColumnBlock, s: int, e: int, lim: EdgeLimits, lane: LaneView
) -> str | None:
    """What makes rows ``s:e`` (one message, valid by the contract) unsafe to feed (None:
    feed them).

    A communicator's size never changes (NCCL gives a resized one a new id), so a
    different ``nranks`` is a forgery or a bug, not a resize. Event time may not run
    ahead of its lane's clock (partition and job: jobs keep their own time), nor of the
    wall clock, by more than the skew (it would move the clock and make every
    communicator of the job judge the future), nor lag far behind it; such events never
    move the clock. After the lane has been quiet for the skew (wall time), a jump ahead
    is taken as traffic resuming. An op cannot have lasted longer than since its rank's
    previous op in the communicator completed (:func:`_exec_rows`).
    """
    n = e - s
    nr = block.column("nranks")[s:e]
    ts = block.column("ts_us")[s:e]
    cc = block.comm_codes[s:e]
    jc = block.job_codes[s:e]
    comms, jobs = block.comm_names, block.job_names
    # each row's communicator size: fixed before, else its first row's here
    size = np.empty(n, np.int64)
    for c, at in _by_code(cc):
        first = 0 if at is _ALL else int(np.argmax(at))
        size[at] = lane.size_of(comms[c], jobs[jc[first]]) or int(nr[first])
    long_op = _exec_rows(block, s, e, lim, lane)
    too_long = np.zeros(n, bool)
    too_long[list(long_op)] = True
    clocks = np.full(n, -1, np.int64)
    has_clock = np.zeros(n, bool)
    ahead_on = np.zeros(n, bool)
    for j, at in _by_code(jc):
        clock = lane.clock_of(jobs[j])
        if clock is None:
            continue
        clocks[at] = clock
        has_clock[at] = True
        ahead_on[at] = lane.quiet_of(jobs[j]) < lim.max_future_skew_us / 1e6
    over, resized, ahead_wall, ahead, behind = _limit_rows(
        nr, ts, size, lane.horizon_us, (clocks, ahead_on), (clocks, has_clock), lim
    )
    rules = (over, resized, ahead_wall, too_long, ahead, behind)
    bad = np.logical_or.reduce(rules)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    t, clock = int(ts[i]), int(clocks[i])
    if over[i]:
        return f"event {i}: nranks {nr[i]} is over the limit of {lim.max_nranks}"
    if resized[i]:
        return (
            f"event {i}: communicator {comms[cc[i]][:64]} has {size[i]} ranks, "
            f"this event says {nr[i]} (a communicator never changes size)"
        )
    if ahead_wall[i]:
        return f"event {i}: ts_us {t} is further ahead of the wall clock than the skew"
    if too_long[i]:
        return f"event {i}: {long_op[i]}"
    if ahead[i]:
        return (
            f"event {i}: ts_us {t} is {(t - clock) / 1e6:.0f}s ahead of its "
            f"job's clock in this partition (allowed: {lim.max_future_skew_us / 1e6:.0f}s)"
        )
    return (
        f"event {i}: ts_us {t} is {(clock - t) / 1e6:.0f}s behind its "
        f"job's clock in this partition (allowed: {lim.max_past_skew_us / 1e6:.0f}s)"
    )


def _limit_rows(
    nr: np.ndarray,
    ts: np.ndarray,
    size: np.ndarray,
    horizon_us: int,
    ahead_of: tuple[np.ndarray, np.ndarray],
    behind_of: tuple[np.ndarray, np.ndarray],
    lim: EdgeLimits,
) -> tuple[np.ndarray, ...]:
    """The edge limits per row (over the size limit, resized, ahead of the wall clock,
    ahead of its lane's clock, behind it): ``ahead_of`` and ``behind_of`` are each the
    lane clock to compare with and where the rule applies."""
    (lo, ahead_on), (hi, behind_on) = ahead_of, behind_of
    return (
        nr > lim.max_nranks,
        nr != size,
        ts > horizon_us,
        ahead_on & (ts > lo + lim.max_future_skew_us),
        behind_on & (ts < hi - lim.max_past_skew_us),
    )


@dataclass(frozen=True, slots=True)
class BatchView:
    """What the limits read of the worker's state as a consumer batch begins."""

    sizes: Mapping[str, int]
    """Communicator → its size, fixed by its first accepted row (or its checkpoint)."""
    held: Mapping[str, Any]
    """Communicator → what holds its detector (``partition`` and ``job``: its lane)."""
    lookup: Callable[[bytes], object]
    """A communicator's checkpoint (None: none; one may fix its size at its turn)."""
    clocks: Mapping[tuple[int, str], int]
    """(partition, job) → its lane's clock."""
    horizon_us: int
    """The wall clock plus the skew: no event is stamped later."""

    def size_of(self, comm: str) -> int | None:
        """Its size fixed before; None: not fixed; -1: its checkpoint may fix it."""
        got = self.sizes.get(comm)
        if got:
            return got
        return -1 if comm not in self.held and self.lookup(comm.encode()) is not None else None

    def lane_of(self, comm: str) -> tuple[int, str] | None:
        c = self.held.get(comm)
        return None if c is None else (c.partition, c.job)


def unrefusable(
    block: ColumnBlock, partition: np.ndarray, lim: EdgeLimits, view: BatchView
) -> list[bool]:
    """Per message of the block (its partition in ``partition``): True when neither the
    contract's rules nor the edge limits can refuse it at its turn in the batch,
    whichever of the batch's messages are accepted before it, so that it needs no check
    of its own; False: :func:`contract_problem` and :func:`admission_problem` judge it,
    at its turn. Numpy costs per call, not per row: the batch's rows at once cost about
    what one message's did.

    What the batch itself can change is bounded: a lane's clock only grows, to at most
    the newest ``ts_us`` of a communicator with rows in it (its lower bound, once it
    has a clock, is the oldest), so a row behind the upper bound or ahead of the lower
    one is checked at its turn, quiet or not; a communicator's size is what was fixed,
    or its one ``nranks`` in the batch (two: checked); an op longer than
    ``exec_free_us`` is always checked, and the wall clock's horizon only moves on."""
    n = len(block.batch)
    starts = block.starts
    counts = np.diff(starts)
    nr, ts = block.column("nranks"), block.column("ts_us")
    cc, jc = block.comm_codes, block.job_codes
    bad, bad_peer, owner, _ = _contract_rows(block, 0, n)
    bad[owner[bad_peer]] = True
    nc = len(block.comm_names)
    cmin, cmax = np.full(nc, np.iinfo(np.int64).max), np.full(nc, np.iinfo(np.int64).min)
    nmin, nmax = cmin.copy(), cmax.copy()
    np.minimum.at(cmin, cc, ts)
    np.maximum.at(cmax, cc, ts)
    np.minimum.at(nmin, cc, nr)
    np.maximum.at(nmax, cc, nr)
    sizes = np.full(nc, -1, np.int64)
    lanes_of_comm: dict[int, tuple[int, str]] = {}
    for c, name in enumerate(block.comm_names):
        known = view.size_of(name)
        if known is None:  # fixed by its first accepted row: checked unless one nranks
            known = int(nmin[c]) if nmin[c] == nmax[c] else -1
        sizes[c] = known
        held = view.lane_of(name)
        if held is not None:
            lanes_of_comm[c] = held
    # each row's lane (partition, job), and the bounds of what its clock can become
    p_row = np.repeat(partition, counts)
    lane_code = p_row * len(block.job_names) + jc
    codes, inv = np.unique(lane_code, return_inverse=True)
    lo = np.full(len(codes), np.iinfo(np.int64).max)
    hi = np.full(len(codes), np.iinfo(np.int64).min)
    np.minimum.at(lo, inv, cmin[cc])
    np.maximum.at(hi, inv, cmax[cc])
    at = {(int(k) // len(block.job_names), block.job_names[int(k) % len(block.job_names)]): i
          for i, k in enumerate(codes.tolist())}  # fmt: skip
    for c, held in lanes_of_comm.items():  # a held communicator moves its own lane's clock
        i = at.get(held)
        if i is not None:
            lo[i], hi[i] = min(lo[i], cmin[c]), max(hi[i], cmax[c])
    for lane, i in at.items():
        clock = view.clocks.get(lane)
        if clock is not None:
            lo[i], hi[i] = clock, max(int(hi[i]), clock)
    on = np.ones(n, bool)
    rows = np.logical_or.reduce(
        _limit_rows(nr, ts, sizes[cc], view.horizon_us, (lo[inv], on), (hi[inv], on), lim)
        + (bad, block.is_op & (block.column("exec_us") > lim.exec_free_us))
    )
    flagged = np.bincount(np.repeat(np.arange(len(counts)), counts), rows, len(counts))
    return ((flagged == 0) & (counts > 0)).tolist()


_ALL = slice(None)
"""Every row (the usual message: one communicator, one job)."""


def _by_code(codes: np.ndarray) -> list[tuple[int, slice | np.ndarray]]:
    """Each distinct code of ``codes`` with its rows (a mask, or :data:`_ALL`)."""
    c0 = int(codes[0])
    if c0 == codes[-1] and (codes == c0).all():
        return [(c0, _ALL)]
    return [(c, codes == c) for c in np.unique(codes).tolist()]


def _exec_rows(
    block: ColumnBlock, s: int, e: int, lim: EdgeLimits, lane: LaneView
) -> dict[int, str]:
    """Row → why its op cannot have lasted ``exec_us`` (absent: it can, or nothing is
    known to tell): the ops of one communicator run one after another on a rank, so an
    op cannot have run longer than since that rank's previous op completed (its newest
    one judged, or one earlier in this message), by the rank's own clock. Such values
    would move what the detectors learn as normal (ten ops claiming ``exec_us = 1e15``
    moved a learned hang threshold from 2.5 s to 640 s). Only ops longer than
    ``exec_free_us`` are looked at (they are rare)."""
    out: dict[int, str] = {}
    is_op = block.is_op[s:e]
    ex = block.column("exec_us")[s:e]
    long_rows = np.flatnonzero(is_op & (ex > lim.exec_free_us))
    if not long_rows.size:
        return out
    rank, ts, cc = block.column("rank")[s:e], block.column("ts_us")[s:e], block.comm_codes[s:e]
    for i in long_rows.tolist():
        comm = block.comm_names[cc[i]]
        prev = int(lane.last_op_ts(comm, rank[i : i + 1])[0])
        same = np.flatnonzero(is_op[:i] & (cc[:i] == cc[i]) & (rank[:i] == rank[i]))
        earlier = ts[same][ts[same] < ts[i]]
        if earlier.size:
            prev = max(prev, int(earlier.max()))
        if prev < 0 or prev >= ts[i] + INFLIGHT_SLACK_US:
            continue
        gap = int(ts[i]) - prev
        if ex[i] <= gap + INFLIGHT_SLACK_US:
            continue
        out[i] = (
            f"exec_us {ex[i]:g} is longer than the {gap / 1e6:.3f} s since rank "
            f"{rank[i]}'s previous op in communicator {comm[:64]} completed (an op "
            "cannot outlast the time since its predecessor)"
        )
    return out
