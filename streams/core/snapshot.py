"""Judging one snapshot: every rank's recorder dumped at one moment (Flight Recorder).

A stream learns what is normal and gathers evidence over windows; a snapshot holds all
there is at once: each rank's counters at its dump time (``progress`` events) and the
ring of its last collectives (``op`` events). Who waits for whom follows from that:

**Hang.** Collective *N* is the newest any member entered. Ranks that entered it and
have not finished it wait in it; ranks that never entered it (counter behind) are the
ones waited for, unless they are themselves held in a collective of another group that
some member has not entered — waiting there, or stopped there after giving up (then they
are victims too: a rank held in a collective cannot enter another).
It is a hang when the waiting ranks have waited longer than the communicator's
normal (``hang_period_mult`` × its period between collectives, at least
``hang_floor_us``), measured by each waiting rank's own clock from its entering *N* to
its dump. After a timeout the waiting ranks count *N* as completed although a member
never entered it: an all-reduce, all-gather, reduce-scatter, all-to-all or barrier
cannot complete without every member, so it ended (timed out or aborted) without that
member, which names it whatever the clocks say (a rooted collective such as a broadcast
may end on its root early, so it counts only with a known wait past the threshold).

**Straggler.** Over the collectives every member has in its ring, the last rank to
arrive is the one the others wait for. Arrival is read, by preference, from kernel
times (within-rank durations, NCCL with ``TORCH_NCCL_ENABLE_TIMING``: the last to
arrive has the *shortest* time, see :mod:`streams.core.straggler`), else from enqueue
times (gloo: its ops carry no kernel time, ``exec_us`` 0, and ``ts_us`` is when the rank
enqueued the collective). Enqueue times of different ranks are compared directly: valid
for ranks on one host (one clock) and across hosts only when their clocks are
synchronized well below the lateness in question. A straggler arrives last in most
collectives (``straggler_last_frac``) and its peers' wait for it is a sizable share of
the time per collective (``straggler_min_wait``) and stands out from every other rank's
(``straggler_min_z``). It must hold in both halves of the history (two windows), as a
stream needs two windows, so one burst is not a straggler.

The verdicts carry the same faults, reasons and evidence as the stream's
(:class:`streams.core.comm.CommDetector`), so the same correlator turns them into
commands.

>>> from producers.events import ProgressEvent
>>> def hb(r, started, completed, inflight_us=None):
...     return ProgressEvent(v=1, job="j", comm="0", nranks=4, rank=r, host=f"h{r}",
...                          ts_us=10_000_000, started=started, completed=completed,
...                          inflight_us=inflight_us)
>>> vs = judge_snapshot([hb(0, 61, 60, 4e6), hb(1, 61, 60, 4e6), hb(2, 60, 60),
...                      hb(3, 61, 60, 4e6)], DetectConfig())
>>> [(v.fault, v.host) for v in vs]
[('noncomm_hang', 'h2')]
>>> print(vs[0].reason)  # doctest: +NORMALIZE_WHITESPACE
h2 (rank 2 of 0) has not started collective 61 while 3 peers have waited 4.0 s in it
(hang threshold 2.5 s).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import exp, lgamma, log, log1p

import numpy as np
from msgspec.structs import replace as msgspec_replace

from producers.events import Event, OpEvent, ProgressEvent
from producers.formats.flight_recorder import SnapshotFacts, default_host
from streams.commands import Fault
from streams.core.config import DetectConfig
from streams.core.stats import median, stable_id
from streams.verdicts import Verdict

__all__ = ["judge_snapshot"]


def _s(us: float) -> str:
    return f"{us / 1e6:.1f} s"


@dataclass(slots=True)
class _Comm:
    """One communicator's part of the snapshot."""

    comm: str
    job: str = ""
    comm_name: str | None = None
    nranks: int = 0
    ident: dict[int, tuple[str, int | None, str | None]] = field(default_factory=dict)
    """rank -> (host, gpu, nic)."""
    progress: dict[int, ProgressEvent] = field(default_factory=dict)
    ops: dict[int, dict[int, OpEvent]] = field(default_factory=dict)
    """rank -> seq -> op."""

    def who(self, rank: int) -> str:
        host, gpu, _ = self.ident.get(rank, ("unknown host", None, None))
        g = f" GPU {gpu}" if gpu is not None else ""
        return f"{host}{g} (rank {rank} of {self.comm_name or self.comm})"

    def hosts(self) -> list[str]:
        return sorted({h for h, _, _ in self.ident.values()})

    def now(self) -> int:
        return max((p.ts_us for p in self.progress.values()), default=0)

    def period_us(self) -> float:
        """Typical time between two collectives, each rank by its own clock (median over
        ranks of the mean interval across the ring), and the p90 kernel time when timed."""
        periods, execs = [], []
        for ops in self.ops.values():
            t = sorted(_when(o) for o in ops.values())
            if len(t) >= 2 and t[-1] > t[0]:
                periods.append((t[-1] - t[0]) / (len(t) - 1))
            execs += [o.exec_us for o in ops.values() if o.exec_us > 0]
        p90 = float(np.percentile(execs, 90)) if execs else 0.0
        return max(median(periods) if periods else 0.0, p90)

    def verdict(
        self,
        fault: Fault,
        rank: int,
        score: float,
        reason: str,
        start: int,
        end: int,
        evidence: dict,
    ) -> Verdict:
        host, gpu, _ = self.ident.get(rank, ("unknown", None, None))
        evidence = {
            "comm_name": self.comm_name or self.comm,
            "comm_hosts": len(self.hosts()),
            "nranks": self.nranks,
            "snapshot": True,
            **evidence,
        }
        return Verdict(
            id=stable_id(self.job, self.comm, fault, host, gpu, None, None, start, False),
            ts_us=self.now(),
            job=self.job,
            comm=self.comm,
            host=host,
            fault=fault,
            score=round(min(1.0, max(0.0, score)), 3),
            reason=reason,
            window_start_us=start,
            window_end_us=end,
            evidence=evidence,
            ranks=[rank],
            gpu=gpu,
        )


def _by_comm(events: Sequence[Event]) -> dict[str, _Comm]:
    comms: dict[str, _Comm] = {}
    for e in events:
        c = comms.get(e.comm)
        if c is None:
            c = comms[e.comm] = _Comm(e.comm, e.job, e.comm_name)
        c.nranks = max(c.nranks, e.nranks)
        c.ident.setdefault(e.rank, (e.host, e.gpu, e.nic))
        if isinstance(e, OpEvent):
            c.ops.setdefault(e.rank, {})[e.seq] = e
        else:
            old = c.progress.get(e.rank)
            if old is None or e.ts_us >= old.ts_us:  # the newest counters of each rank
                c.progress[e.rank] = e
    return comms


def judge_snapshot(
    events: Sequence[Event], config: DetectConfig, facts: SnapshotFacts | None = None
) -> list[Verdict]:
    """Verdicts of one snapshot (all ranks' dumps taken at one moment), in time order.

    ``facts`` (what the dumps say together, :func:`~producers.formats.flight_recorder.
    read_snapshot_with_facts`) adds the members that left no dump or an empty one, the
    sends/receives a rank waits in, and whether the dump time is known."""
    comms = _by_comm(events)
    facts = facts or SnapshotFacts()
    time_known = facts.dump_time_known
    # Each rank's newest recorded collective over all its groups (its own clock).
    newest: dict[tuple[str, int | None], int] = {}
    for comm in comms.values():
        for r, ops in comm.ops.items():
            key = comm.ident[r][:2]
            newest[key] = max(newest.get(key, -1), *(_when(o) for o in ops.values()))
    # A rank (host, GPU) held in a collective of some group by a member that has not
    # entered it — waiting there still, or stopped there after giving up (timeout) —
    # cannot enter another: being behind elsewhere is not its fault. (A collective every
    # member entered holds nobody back: gloo may not have retired it yet at the dump.)
    # Nor can a rank inside a send or receive its peer has not matched.
    blocked = {comm.ident[r][:2] for comm in comms.values() for r in _held(comm, newest)}
    p2p_hosts = {facts.hosts.get(w.rank, default_host(w.rank)) for w in facts.p2p_waits}
    blocked |= {k for k in newest if k[0] in p2p_hosts}
    released = _Releases(comms)
    out: list[Verdict] = []
    absent = _judge_absent(comms, config, facts, newest)
    p2p = [] if absent else _judge_p2p(comms, config, facts, blocked)
    for comm in comms.values():
        if not absent and not p2p:
            out += _judge_hang(comm, config, blocked, newest, facts)
        out += _judge_stragglers(comm, config, released)
    out += absent + p2p
    if facts.groups and not facts.p2p_recorded and not absent:
        out = _unrecorded_p2p(out, {k[0] for k in newest if k not in blocked})
    if not time_known:
        # a rank named late by its arrivals is the one waited for: the missing-ranks
        # alert about it says nothing more
        late = {v.host for v in out if v.fault == "straggler"}
        out = [v for v in out if not (v.evidence.get("hold") and v.host in late)]
    out.sort(key=lambda v: (v.ts_us, v.comm, v.host))
    return out


# --- hangs ----------------------------------------------------------------------------
def _missing_alert(
    c: _Comm, culprits: list[int], waiting: list[int], target: int, facts: SnapshotFacts
) -> Verdict:
    """The analyzer's "missing ranks" line, as an alert: without the dump time, peers
    sitting in collective N may have waited 1 ms (a healthy moment) or an hour."""
    ranks = ", ".join(str(r) for r in sorted(culprits))
    reason = (
        f"{c.comm_name or c.comm} collective {target}: ranks {{{ranks}}} missing "
        f"({len(waiting)} members entered it); not isolated: " + facts.why_time_unknown + "."
    )
    r = culprits[0]
    ev = {"target_collective": target, "peers_collective": target,
          "rank_started": int(c.progress[r].started), "peers_waiting": len(waiting),
          "missing_ranks": sorted(culprits), "hold": reason}  # fmt: skip
    start = c.now() - c.now() % 1_000_000
    return c.verdict("noncomm_hang", r, 0.9, reason, start, c.now(), ev)


def _waits_in(c: _Comm, r: int, newest: dict[tuple[str, int | None], int]) -> bool:
    """Whether rank ``r`` is inside a collective of ``c``: in flight, or stopped at its
    newest one (gave up after the timeout) — nothing after it in any group."""
    p = c.progress.get(r)
    if p is None:
        return False
    return p.started > p.completed or (p.started > 0 and _stopped_at(c, r, p.started, newest))


def _judge_absent(
    comms: dict[str, _Comm],
    cfg: DetectConfig,
    facts: SnapshotFacts,
    newest: dict[tuple[str, int | None], int],
) -> list[Verdict]:
    """Members that left no dump, or an empty one, while their peers wait for them.

    A live process that recorded any collective dumps it (the ring is never empty once
    used), so no dump means its process died or never reached the dump (a crash, a GPU
    error), and an empty one that it dumped nothing it had (wedged: e.g. a thread that
    holds the GIL while the dump runs). The peers waiting in a group of it — in a
    collective, or in a receive from it — wait for it: it is the first suspect and they
    are victims."""
    out = []
    for rank, why in sorted(facts.absent.items()):
        waits: list[tuple[str, int, float]] = []  # (group, waiting rank, wait µs)
        for g in facts.groups.values():
            c = comms.get(g.name)
            if rank not in g.members or c is None or len(g.members) < 2:
                continue
            for local, p in c.progress.items():
                if local < len(g.members) and _waits_in(c, local, newest):
                    op = c.ops.get(local, {}).get(int(p.started))  # gave up there: since
                    since = p.inflight_us or (p.ts_us - _when(op) if op else 0.0)
                    waits.append((g.name, g.members[local], float(since)))
        now = max((c.now() for c in comms.values()), default=0)
        for w in facts.p2p_waits:
            if w.peer == rank:
                waits.append((w.group, w.rank, max(0.0, now - w.since_ns / 1000)))
        if not waits:
            continue
        thr = float(cfg.hang_floor_us)
        wait_us = max(x for _, _, x in waits)
        hold = ""
        if not facts.dump_time_known:
            hold = facts.why_time_unknown
        elif wait_us < thr:
            continue  # peers that just entered a collective: too early to say
        groups = sorted({g for g, _, _ in waits}, key=lambda x: (len(x), x))
        names = [facts.groups[g].desc or g for g in groups if g in facts.groups]
        host = default_host(rank)
        what = ("left no dump: its process died or never reached the dump"
                if why == "no dump" else
                "wrote an empty dump (no entries, no pg_status): it is wedged, e.g. a "
                "thread holding the GIL, or its recorder was reset")  # fmt: skip
        reason = (
            f"{host} (rank {rank}) {what}; {len({w for _, w, _ in waits})} ranks wait for "
            f"it in {', '.join(names[:4])}"
            + (f" (longest {_s(wait_us)})" if facts.dump_time_known else "")
            + (f"; not isolated: {hold}" if hold else "")
            + "."
        )
        c = comms[groups[0]] if groups[0] in comms else next(iter(comms.values()))
        ev = {"target_collective": -1, "rank_started": -1, "silent": True,
              "peers_waiting": len({w for _, w, _ in waits}), "wait_s": round(wait_us / 1e6, 2),
              "threshold_s": round(thr / 1e6, 2), "comm_name": names[0] if names else c.comm,
              "absent": why, "hold": reason if hold else ""}  # fmt: skip
        start = c.now() - c.now() % 1_000_000
        v = c.verdict("noncomm_hang", -1, 0.95, reason, start, c.now(), ev)
        out.append(msgspec_replace(v, host=host, ranks=[rank], gpu=None))
    return out


def _unrecorded_p2p(out: list[Verdict], free: set[str]) -> list[Verdict]:
    """With a backend that records no send/recv (gloo), a rank behind in a collective
    and waiting in none may be blocked in a receive from another such rank: when more
    than one rank is free like that, the dumps cannot tell the culprit from its victims,
    so each is only reported (a pipeline hang: its stage waits in ``recv``)."""
    hangs = [v for v in out if v.fault == "noncomm_hang" and not v.evidence.get("hold")]
    if len(free) < 2 or not hangs:
        return out
    names = ", ".join(sorted(free))
    keep = [v for v in out if v not in hangs]
    for v in hangs:
        hold = (
            f"{v.reason.rstrip('.')}; but {len(free)} ranks ({names}) wait in no recorded "
            "collective, and this backend records no send/recv (gloo): any of them may be "
            "waiting in a receive from another, so the dumps cannot tell the culprit from "
            "its victims; not isolated"
        )
        keep.append(msgspec_replace(v, evidence={**v.evidence, "hold": hold}))
    return keep


def _judge_p2p(
    comms: dict[str, _Comm],
    cfg: DetectConfig,
    facts: SnapshotFacts,
    blocked: set[tuple[str, int | None]],
) -> list[Verdict]:
    """A rank that a peer waits on in a send or receive (NCCL records them) while it
    waits in nothing itself: it never posted its side, the peer is its victim."""
    out: list[Verdict] = []
    now = max((c.now() for c in comms.values()), default=0)
    named: set[int] = set()
    for w in facts.p2p_waits:
        y = w.peer
        if y is None or y in named or y in facts.absent:
            continue
        host = facts.hosts.get(y, default_host(y))
        if any(k[0] == host for k in blocked):
            continue  # it waits somewhere itself: a link in the chain, not its start
        wait_us = max(0.0, now - w.since_ns / 1000)
        hold = "" if facts.dump_time_known else facts.why_time_unknown
        if not hold and wait_us < cfg.hang_floor_us:
            continue
        g = facts.groups.get(w.group)
        c = comms.get(w.group) or next(iter(comms.values()))
        side = "send" if w.op == "recv" else "receive"
        reason = (
            f"{host} (rank {y}) has not posted the {side} that rank {w.rank} waits in "
            f"({w.op} on {g.desc if g and g.desc else w.group})"
            + (f" for {_s(wait_us)}" if not hold else "")
            + ", and waits in no collective or p2p operation itself"
            + (f"; not isolated: {hold}." if hold else ".")
        )
        ev = {"target_collective": -1, "rank_started": -1, "peers_waiting": 1,
              "wait_s": round(wait_us / 1e6, 2), "threshold_s": round(cfg.hang_floor_us / 1e6, 2),
              "hold": reason if hold else ""}  # fmt: skip
        start = now - now % 1_000_000
        v = c.verdict("noncomm_hang", -1, 0.9, reason, start, now, ev)
        out.append(msgspec_replace(v, host=host, ranks=[y], gpu=None))
        named.add(y)
    return out


def _held(c: _Comm, newest: dict[tuple[str, int | None], int]) -> list[int]:
    """Ranks held in this group by a member that has not entered their collective: in
    it still, or finished with it (gave up) and stopped there."""
    prog = c.progress
    low = min((p.started for p in prog.values()), default=0)
    if len(prog) < c.nranks:
        low = 0  # a member without a dump: it may not have arrived
    return [
        r
        for r, p in prog.items()
        if p.started > low and (p.started > p.completed or _stopped_at(c, r, p.started, newest))
    ]


def _when(o: OpEvent) -> int:
    return o.ts_us


def _judge_hang(
    c: _Comm,
    cfg: DetectConfig,
    blocked: set[tuple[str, int | None]],
    newest: dict[tuple[str, int | None], int],
    facts: SnapshotFacts,
) -> list[Verdict]:
    prog = c.progress
    if len(prog) < 2:
        return []
    target = max(p.started for p in prog.values())
    at_target = [r for r, p in prog.items() if p.started == target]
    behind = [r for r, p in prog.items() if p.started < target]
    culprits = [r for r in behind if c.ident[r][:2] not in blocked]
    if not culprits or len(culprits) > max(1, cfg.max_culprit_frac * c.nranks):
        return []
    waiting = [r for r in at_target if prog[r].completed < target]
    finished = [r for r in at_target if prog[r].completed >= target]
    thr = max(float(cfg.hang_floor_us), cfg.hang_period_mult * c.period_us())
    n_alive = len(prog) - len(behind) + len(culprits)
    if waiting and len(waiting) >= max(1, cfg.min_waiting_frac * n_alive):
        wait_us = median([prog[r].inflight_us or 0.0 for r in waiting])
        if not facts.dump_time_known:  # how long they waited is unknown: who is missing
            return [_missing_alert(c, culprits, waiting, target, facts)]
        if wait_us < thr:
            return []  # the usual picture of a healthy job: someone is always last
        ended = False
        peers = waiting
    elif finished and not waiting and len(finished) >= max(1, cfg.min_waiting_frac * n_alive):
        # N ended on its peers without the culprits: for a collective that needs every
        # member only a timeout or an abort does that (a rooted one, e.g. a broadcast,
        # may end on the root first). They must have stopped there (nothing after N in
        # any of their rings), else the dumps were not taken at one moment.
        if not all(_stopped_at(c, r, target, newest) for r in finished):
            return []
        # how long each waited: from entering N to its own dump (its own clock); 0
        # when the dump time is unknown (no trusted mtime: the newest entry stands in)
        waits = [prog[r].ts_us - _when(c.ops[r][target]) for r in finished]
        wait_us = max(0.0, float(median(waits))) if waits else 0.0
        needs_all = all(c.ops[r][target].op in _NEEDS_ALL for r in finished)
        if (wait_us > 0 and wait_us < thr) or (wait_us <= 0 and not needs_all):
            return []
        ended = True
        peers = finished
    else:
        return []
    start = c.now() - int(wait_us)
    start -= start % 1_000_000
    out = []
    for r in culprits:
        # the collective it never entered: its next one (its peers may have finished
        # that one without it, as a gloo broadcast root does, and wait in a later one)
        missed = int(prog[r].started) + 1
        where = "in it" if missed == target else f"in collective {target}"
        if ended:
            reason = (
                f"{c.who(r)} has not started collective {missed}; its {len(peers)} peers "
                f"ended collective {target} without it (timed out or aborted)"
                + (f" {_s(wait_us)} after entering it." if wait_us > 0 else ".")
            )
            score = max(0.9, min(1.0, 0.6 + 0.4 * wait_us / (2 * thr)))
        else:
            reason = (
                f"{c.who(r)} has not started collective {missed} while {len(peers)} peers "
                f"have waited {_s(wait_us)} {where} (hang threshold {_s(thr)})."
            )
            score = min(1.0, 0.6 + 0.4 * wait_us / (2 * thr))
        ev = {
            "target_collective": missed,
            "peers_collective": target,
            "rank_started": int(prog[r].started),
            "silent": False,
            "peers_waiting": len(peers),
            "peers_ended_without_it": ended,
            "wait_s": round(wait_us / 1e6, 2),
            "threshold_s": round(thr / 1e6, 2),
        }
        out.append(c.verdict("noncomm_hang", r, score, reason, start, c.now(), ev))
    return out


_NEEDS_ALL = frozenset({"AllReduce", "AllGather", "ReduceScatter", "AllToAll", "Barrier"})
"""Collectives that cannot complete on any member before every member entered them."""


def _stopped_at(
    c: _Comm, rank: int, target: int, newest: dict[tuple[str, int | None], int]
) -> bool:
    """Whether ``rank`` recorded collective ``target`` of this group and nothing after
    it, in this group or any other (its own clock)."""
    op = c.ops.get(rank, {}).get(target)
    return op is not None and _when(op) >= newest.get(c.ident[rank][:2], -1)


# --- stragglers -------------------------------------------------------------------------
class _Releases:
    """When each rank was released from its previous collective (any group).

    A collective ends no earlier than its last member's arrival, so the latest ``ts_us``
    among its members (their enqueue times when untimed, completions when timed) is
    when it released them (one clock, or synchronized clocks)."""

    def __init__(self, comms: dict[str, _Comm]) -> None:
        self._comms = comms
        self._by_rank: dict[tuple[str, int | None], list[tuple[int, str, int]]] = {}
        for c in comms.values():
            for r, ops in c.ops.items():
                mine = self._by_rank.setdefault(c.ident[r][:2], [])
                mine += [(o.ts_us, c.comm, s) for s, o in ops.items()]
        for v in self._by_rank.values():
            v.sort()
        self._release: dict[tuple[str, int], float] = {}

    def _release_of(self, comm: str, seq: int) -> float:
        key = (comm, seq)
        if key not in self._release:
            c = self._comms[comm]
            t = [ops[seq].ts_us for ops in c.ops.values() if seq in ops]
            # incomplete record of who arrived: the release is unknown (no correction)
            self._release[key] = float(max(t)) if len(t) >= c.nranks else -np.inf
        return self._release[key]

    def before(self, c: _Comm, rank: int, seq: int, arrival_us: float) -> float:
        """The release of ``rank``'s collective before the one it enqueued at
        ``arrival_us`` (``-inf`` when unknown)."""
        mine = self._by_rank.get(c.ident[rank][:2], [])
        i = bisect_left(mine, (int(arrival_us), c.comm, seq))
        if i == 0:
            return -np.inf
        _, comm, prev = mine[i - 1]
        return self._release_of(comm, prev)


@dataclass(slots=True)
class _Arrivals:
    """Collectives × ranks: arrival order of the collectives every member recorded."""

    t_us: np.ndarray
    """Median enqueue (or completion) time of each collective, for windows and spans."""
    arrive: np.ndarray
    """Arrival, larger = later: −log(kernel time) with kernel times, enqueue µs otherwise
    (NaN where a rank did not record the collective)."""
    gap_us: np.ndarray
    """How long the others waited for the last rank alone (its arrival minus the
    second-last one's; kernel time difference or enqueue difference), on the last rank's
    column; 0 elsewhere."""
    timed: bool
    """True: from kernel times; False: from enqueue times."""


def _arrivals(c: _Comm, cfg: DetectConfig, released: _Releases) -> _Arrivals | None:
    n = c.nranks
    if n < 3 or len(c.ops) < 3:
        return None
    seqs = sorted({s for ops in c.ops.values() for s in ops})
    idx = {s: i for i, s in enumerate(seqs)}
    ex = np.full((len(seqs), n), np.nan)
    enq = np.full((len(seqs), n), np.nan)
    ts = np.full((len(seqs), n), np.nan)
    for r, ops in c.ops.items():
        if r >= n:
            continue
        for s, o in ops.items():
            i = idx[s]
            ts[i, r] = o.ts_us
            if o.exec_us > 0:
                ex[i, r] = o.exec_us
            else:  # untimed: ts_us is the enqueue time (Flight Recorder, gloo)
                enq[i, r] = o.ts_us
    need = max(3, cfg.min_present_frac * n)
    timed_rows = (~np.isnan(ex)).sum(axis=1) >= need
    enq_rows = (~np.isnan(enq)).sum(axis=1) >= need
    # Kernel times (within-rank, clock-free) where most collectives have them.
    timed = bool(timed_rows.any() and timed_rows.sum() >= enq_rows.sum() / 2)
    rows = timed_rows if timed else enq_rows
    if rows.sum() < 2 * cfg.straggler_min_seqs:
        return None
    x = ex[rows] if timed else enq[rows]
    arrive = -np.log(x) if timed else x
    filled = np.where(np.isnan(arrive), -np.inf, arrive)
    order = np.argsort(filled, axis=1)
    k = np.arange(x.shape[0])
    last, second = order[:, -1], order[:, -2]
    gap = np.zeros_like(x)
    if timed:  # the last one's kernel ran only the collective; the others waited the rest
        gap[k, last] = x[k, second] - x[k, last]
    else:
        # Only the part of the gap after the last rank was released from its previous
        # collective is its own doing: a rank held up in another group (waiting for
        # someone there) arrives late here through no fault of its own.
        seq_of = np.array(seqs)[rows]
        rel = np.array([released.before(c, int(r), int(s), float(x[i, r]))
                        for i, (r, s) in enumerate(zip(last, seq_of, strict=True))])  # fmt: skip
        gap[k, last] = x[k, last] - np.maximum(x[k, second], rel)
        np.maximum(gap, 0.0, out=gap)
    gap[np.isnan(x)] = np.nan
    return _Arrivals(np.nanmedian(ts[rows], axis=1), arrive, gap, timed)


def _judge_stragglers(c: _Comm, cfg: DetectConfig, released: _Releases) -> list[Verdict]:
    a = _arrivals(c, cfg, released)
    if a is None:
        return []
    # Windows: event-time windows of the stream's length; when the history is shorter
    # than two of them, its two halves.
    k = len(a.t_us)
    win = ((a.t_us - a.t_us.min()) // cfg.window_us).astype(np.int64)
    parts = [np.flatnonzero(win == w) for w in np.unique(win)]
    parts = [p for p in parts if p.size >= cfg.straggler_min_seqs]
    if len(parts) < 2:
        parts = [np.arange(k // 2), np.arange(k // 2, k)]
    period = c.period_us()
    out = []
    for p in parts:
        out += _judge_window(c, cfg, a, p, period)
    return out


_CHANCE = 0.01
"""A rank must be last more often than a 1 % chance would make it (binomial tail)."""


def _chance_last(k: int, n: int, m: int) -> float:
    """P(a rank is last in at least ``k`` of ``n`` collectives by chance, ``m`` ranks).

    >>> round(_chance_last(4, 6, 3), 3), _chance_last(18, 18, 4) < 1e-9
    (0.1, True)
    >>> round(_chance_last(1000, 2000, 2), 2), _chance_last(1500, 2000, 4) < 1e-300
    (0.51, True)
    """
    p = 1.0 / max(m, 2)
    lp, lq = log(p), log1p(-p)
    # in logs: comb(2000, 1000) does not fit a float
    return sum(
        exp(lgamma(n + 1) - lgamma(i + 1) - lgamma(n - i + 1) + i * lp + (n - i) * lq)
        for i in range(k, n + 1)
    )


def _judge_window(
    c: _Comm, cfg: DetectConfig, a: _Arrivals, rows: np.ndarray, period: float
) -> list[Verdict]:
    arrive, gap = a.arrive[rows], a.gap_us[rows]
    present = ~np.isnan(arrive)
    n_seq = present.sum(axis=0)
    last = np.bincount(np.where(present, arrive, -np.inf).argmax(axis=1),
                       minlength=arrive.shape[1])  # fmt: skip
    frac = last / np.maximum(n_seq, 1)
    seen = n_seq >= cfg.straggler_min_seqs
    if seen.sum() < 3 or not (seen & (frac >= cfg.straggler_last_frac)).any():
        return []  # nobody persistently last: the usual case
    # ... and more often than chance would make it: with m ranks each is last with
    # probability 1/m; a snapshot's short history must not turn 4 of 6 into a verdict.
    m = int(present.sum(axis=1).mean().round())
    beyond_chance = np.array(
        [_chance_last(int(k), int(n), m) < _CHANCE for k, n in zip(last, n_seq, strict=True)]
    )
    # The wait each rank alone caused, per collective, on one scale: a fraction of the
    # others' kernel time (kernel times) or of the time between collectives (enqueue).
    mean_gap = np.nansum(gap, axis=0) / np.maximum(n_seq, 1)
    if a.timed:
        x = np.exp(-arrive)
        scale = np.nanmedian(np.where(present, x, np.nan), axis=0)  # each rank's kernel time
    else:
        scale = np.full(arrive.shape[1], max(period, 1.0))
    share = np.where(seen, mean_gap / np.maximum(scale, 1e-9), np.nan)
    vals = share[seen]
    med = median(vals)
    sigma = max(1.4826 * median(np.abs(vals - med)), 0.01)
    z = (share - med) / sigma
    cand = np.flatnonzero(
        seen
        & beyond_chance
        & (frac >= cfg.straggler_last_frac)
        & (share - med >= cfg.straggler_min_wait)
        & (z >= cfg.straggler_min_z)
    )
    if cand.size == 0 or cand.size > max(1, int(cfg.max_culprit_frac * c.nranks)):
        return []
    t = a.t_us[rows]
    start, end = int(t.min()), int(t.max())
    out = []
    for r in cand.tolist():
        late_ms = float(mean_gap[r]) / 1e3
        px = 1.0 + float(share[r])  # the others' time per collective against its own
        ev: dict = {
            "collectives": int(n_seq[r]),
            "last_frac": round(float(frac[r]), 3),
            "peer_time_x": round(px, 3),
            "z": round(float(z[r]), 1),
            "peer_time_vs_normal": None,
            "late_ms": round(late_ms, 2),
            "arrival": "kernel_time" if a.timed else "enqueue_time",
        }
        if a.timed:
            how = f"its peers spent {px:.1f}x its kernel time waiting for it."
        else:
            how = (
                f"its peers waited {late_ms:.1f} ms for it per collective, "
                f"{float(share[r]):.0%} of the time between collectives (by enqueue "
                "times: one clock, or clocks synchronized well below that)."
            )
        reason = (
            f"{c.who(r)} arrived last in {frac[r]:.0%} of {int(n_seq[r])} collectives "
            f"over {_s(max(end - start, 1))}; {how}"
        )
        score = min(1.0, float(frac[r])) * min(1.0, 0.5 + float(z[r]) / (4 * cfg.straggler_min_z))
        out.append(c.verdict("straggler", r, score, reason, start, end, ev))
    return out
