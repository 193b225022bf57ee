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

from collections.abc import Sequence

from msgspec.structs import replace as msgspec_replace

from producers.events import Event
from producers.formats.fr_dump import default_host
from producers.formats.fr_facts import SnapshotFacts
from streams.core.config import DetectConfig
from streams.core.snapshot_straggler import _judge_stragglers, _Releases
from streams.core.snapshot_view import _NEEDS_ALL, _by_comm, _Comm, _s, _stopped_at, _when
from streams.core.stats import median
from streams.verdicts import Verdict

__all__ = ["judge_snapshot"]


def judge_snapshot(
    events: Sequence[Event], config: DetectConfig, facts: SnapshotFacts | None = None
) -> list[Verdict]:
    """Verdicts of one snapshot (all ranks' dumps taken at one moment), in time order.

    ``facts`` (what the dumps say together, :func:`~producers.formats.flight_recorder.
    read_snapshot_with_facts`) adds the members that left no dump or an empty one, the
    sends/receives a rank waits in, and whether the dump time is known."""
    facts = facts or SnapshotFacts()
    comms = _by_comm(events, facts)
    time_known = facts.dump_time_known
    # Each rank's newest recorded collective over all its groups (its own clock).
    newest: dict[tuple[str, int | None], int] = {}
    for comm in comms.values():
        for r, ops in comm.ops.items():
            key = comm.proc[r]
            newest[key] = max(newest.get(key, -1), *(_when(o) for o in ops.values()))
    # A rank (host, GPU) held in a collective of some group by a member that has not
    # entered it — waiting there still, or stopped there after giving up (timeout) —
    # cannot enter another: being behind elsewhere is not its fault. (A collective every
    # member entered holds nobody back: gloo may not have retired it yet at the dump.)
    # Nor can a rank inside a send or receive its peer has not matched.
    blocked = {comm.proc[r] for comm in comms.values() for r in _held(comm, newest)}
    label = _labels(comms)
    blocked |= {k for w in facts.p2p_waits for k in newest if _is(k, w.rank, facts)}
    released = _Releases(comms)
    out: list[Verdict] = []
    absent = _judge_absent(comms, config, facts, newest)
    p2p = [] if absent else _judge_p2p(comms, config, facts, blocked, label)
    for comm in comms.values():
        if not absent and not p2p:
            out += _judge_hang(comm, config, blocked, newest, facts)
        out += _judge_stragglers(comm, config, released)
    out += absent + p2p
    if facts.groups and not facts.p2p_recorded and not absent:
        out = _unrecorded_p2p(out, {label[k] for k in newest if k not in blocked})
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


def _labels(comms: dict[str, _Comm]) -> dict[tuple[str, int | None], str]:
    """How a process is named in a reason: its host, with its global rank where the host
    is shared (a node's ranks all carry the node's name)."""
    out: dict[tuple[str, int | None], str] = {}
    for c in comms.values():
        for r, key in c.proc.items():
            host = c.ident[r][0]
            g = key[1] if key[0] == "#rank" else None
            out[key] = host if g is None or host == default_host(g) else f"{host} rank {g}"
    return out


def _is(key: tuple[str, int | None], rank: int, facts: SnapshotFacts) -> bool:
    """Whether a process key is global ``rank``'s (by rank, or by host where no group
    facts give the rank)."""
    if key[0] == "#rank":
        return key[1] == rank
    return key[0] == facts.hosts.get(rank, default_host(rank))


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
        host = facts.hosts.get(rank, default_host(rank))
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
    label: dict[tuple[str, int | None], str],
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
        if any(_is(k, y, facts) for k in blocked):
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
    culprits = [r for r in behind if c.proc[r] not in blocked]
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
