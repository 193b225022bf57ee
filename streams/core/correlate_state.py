"""The host correlator's checkpoint: its episodes, notes and rails as msgspec structs
(schema 3, with the migrations from 1 and 2).

Every part of the state is keyed by job (a job's clock, episodes, notes, rails), so a
checkpoint can hold one job's part (``job`` set: :func:`state_of` with a job), which
the worker's correlator writes per job, only for the jobs whose state changed — not
the whole partition's state behind each decision (16.6 MB at 391 jobs). Loading a
job's part (:func:`load_job`) first forgets what the correlator held of that job, so
a part replaces, never adds to, the job's state. ``job`` None: the whole correlator
(schema 2 and before were always that).

Schema 3 adds ``job``; a schema-2 checkpoint is the whole correlator (``job`` None) and
loads as before; a worker of schema 2 refuses a schema-3 one by its number (newer than
its own), never misreads it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import msgspec

from streams.core import checkpoint as ck
from streams.core.episode import Entry, Episode
from streams.core.family import FamiliesState
from streams.core.findings import evidence_of

if TYPE_CHECKING:
    from streams.core.correlate import HostCorrelator

__all__ = [
    "MIGRATIONS",
    "SCHEMA",
    "CorrelatorState",
    "forget_job",
    "from_state",
    "load",
    "load_job",
    "migrate_1",
    "state_of",
]


SCHEMA = 3


def migrate_1(body: list) -> list:
    """Correlator checkpoint schema 1 -> 2: waiting notes of schema 1 did not say whom
    they waited for (read as older workers' notes); no pipeline or cell families yet
    (learned again from the next windows' notes)."""
    body = list(body)
    body[2] = [[*w, None, False, 0] for w in body[2]]  # waiting
    clock = body[10] if len(body) > 10 else {}
    return [*body[:10], clock, [[], []], []]


def migrate_2(body: list) -> list:
    """Schema 2 -> 3: a schema-2 checkpoint is always the whole correlator (job None)."""
    return [*list(body)[:13], None]


MIGRATIONS = {1: migrate_1, 2: migrate_2}


class _EntryState(msgspec.Struct, array_like=True):
    ts: int
    comm: str
    window: int
    score: float
    gpu: int | None
    nic: str | None
    peer: str | None
    intra: bool
    ev: dict[str, Any]


class _EpisodeState(msgspec.Struct, array_like=True):
    job: str
    host: str
    fault: str
    first_window: int
    decided: str
    entries: list[_EntryState]


class CorrelatorState(msgspec.Struct, array_like=True):
    now: int
    episodes: list[_EpisodeState]
    waiting: list[
        tuple[str, str, int, str, str, int, int, float, list[tuple[str, int]] | None, bool, int]
    ]
    """(job, host, gpu, fault, comm, first ts, last ts, extra ms, whom it waited for,
    communicator slow, its window's span)"""
    silent: list[tuple[str, str, int, int]]
    cooldown: list[tuple[str, str, int]]
    isolated: dict[str, list[int]]
    job_hosts: dict[str, int]
    job_host_names: dict[str, list[str]]
    suppressed: int
    roles: list[tuple[str, int, int, int, str, int]]
    """(job, comm hosts, ranks, position, suspect host, last ts)"""
    clock: dict[str, int] = {}
    """Event time per job (``now`` is their newest; a checkpoint without this field
    gives every job ``now``)."""
    families: FamiliesState = msgspec.field(default_factory=FamiliesState)
    slow_comms: list[tuple[str, str, int]] = []
    job: str | None = None
    """Schema 3: the one job this state is of (None: every job the correlator held)."""


def state_of(c: HostCorrelator, job: str | None = None) -> CorrelatorState:
    """The correlator's state, or (``job`` given) that job's part of it."""
    return states_of(c, None if job is None else [job])[job]


_PARTS = ("episodes", "waiting", "silent", "cooldown", "roles", "pairs", "cells", "slow_comms")
_MAPS = ("isolated", "job_hosts", "job_host_names", "clock")


def states_of(
    c: HostCorrelator, jobs: Collection[str] | None = None
) -> dict[str | None, CorrelatorState]:
    """The whole state (``jobs`` None: under None), or each of ``jobs``' parts (a job
    with nothing left gets an empty part: written, it clears what was checkpointed), in
    one pass over the state whatever the number of jobs."""
    want = None if jobs is None else set(jobs)
    parts: dict[str | None, dict[str, Any]] = {}

    def part(j: str) -> dict[str, Any] | None:
        k = None if want is None else j if j in want else _SKIP
        if k is _SKIP:
            return None
        got = parts.get(k)  # type: ignore[arg-type]
        if got is None:
            got = parts[k] = {n: [] for n in _PARTS} | {n: {} for n in _MAPS}  # type: ignore[index]
        return got

    for (j, host, fault), ep in c.episodes.items():
        if (x := part(j)) is not None:
            x["episodes"].append(_EpisodeState(j, host, fault, ep.first_window, ep.decided, [
                _EntryState(e.ts, e.comm, e.window, e.score, e.comp[0], e.comp[1], e.comp[2],
                            e.intra, msgspec.to_builtins(e.ev))
                for e in ep.entries
            ]))  # fmt: skip
    for k, t in c.waiting.items():
        if (x := part(k[0])) is not None:
            x["waiting"] += [
                (*k, comm, v[0], v[1], v[2], None if v[3] is None else [list(y) for y in v[3]],
                 v[4], v[5])
                for comm, v in t.items()
            ]  # fmt: skip
    for name, d in (("silent", c.silent), ("roles", c.roles)):
        for k, t in d.items():
            if (x := part(k[0])) is not None:
                x[name] += [(*k, g, ts) for g, ts in t.items()]
    for name, d in (("cooldown", c.cooldown), ("slow_comms", c.slow_comms)):
        for k, ts in d.items():
            if (x := part(k[0])) is not None:
                x[name].append((*k, ts))
    for name, m in (("isolated", c.isolated), ("job_hosts", c.job_hosts),
                    ("job_host_names", c.job_host_names), ("clock", c.clock)):  # fmt: skip
        for j, v in m.items():
            if (x := part(j)) is not None:
                x[name][j] = (
                    list(v) if name == "isolated" else sorted(v) if name == "job_host_names" else v
                )
    fam = c.families.state()
    for name, rows in (("pairs", fam.pairs), ("cells", fam.cells)):
        for row in rows:
            if (x := part(row[0])) is not None:
                x[name].append(row)
    for j in [None] if want is None else want:  # nothing held of it: an empty part
        if j not in parts:
            parts[j] = {n: [] for n in _PARTS} | {n: {} for n in _MAPS}
    return {
        k: CorrelatorState(
            now=c.now if k is None else c.clock.get(k, -1),
            episodes=x["episodes"],
            waiting=x["waiting"],
            silent=x["silent"],
            cooldown=x["cooldown"],
            isolated=x["isolated"],
            job_hosts=x["job_hosts"],
            job_host_names=x["job_host_names"],
            suppressed=c.suppressed if k is None else 0,
            roles=x["roles"],
            clock=x["clock"],
            families=FamiliesState(x["pairs"], x["cells"]),
            slow_comms=x["slow_comms"],
            job=k,
        )  # fmt: skip
        for k, x in parts.items()
    }


_SKIP = object()


def forget_job(c: HostCorrelator, job: str) -> None:
    """Drop everything ``c`` holds of ``job`` (every part of the state is keyed by it)."""
    c.clock.pop(job, None)
    c.isolated.pop(job, None)
    c.job_hosts.pop(job, None)
    c.job_host_names.pop(job, None)
    for d in (c.episodes, c.waiting, c._waiting_last, c.silent, c.cooldown, c.roles,
              c.slow_comms):  # fmt: skip
        for k in [k for k in d if k[0] == job]:
            del d[k]  # type: ignore[attr-defined]
    c.families.forget_job(job)


def load_job(c: HostCorrelator, st: CorrelatorState, job: str) -> None:
    """Replace ``job``'s part of ``c`` with ``st`` (a checkpoint of that job alone: one of
    another job, or of a whole correlator, is refused)."""
    if st.job != job:
        raise ValueError(f"a checkpoint of job {st.job!r} where one of job {job!r} was expected")
    stray = {e.job for e in st.episodes} | set(st.clock) | {w[0] for w in st.waiting}
    if stray - {job}:
        raise ValueError(f"checkpoint of job {job!r} holds other jobs: {sorted(stray - {job})[:3]}")
    forget_job(c, job)
    try:
        from_state(st, c)
    except ValueError:
        forget_job(c, job)  # nothing half-read stays
        raise


def load(
    data: bytes,
    fresh: Callable[[], HostCorrelator],
    into: HostCorrelator | None = None,
    job: str | None = None,
) -> HostCorrelator:
    """A correlator checkpoint read back: a whole one into ``fresh()``, or (``job``) that
    job's into ``into``; :class:`~streams.core.checkpoint.CheckpointError` with the
    reason for anything else (a job's part where a whole one is expected, or another
    job's)."""
    st = ck.decode(data, "correlator", {SCHEMA: CorrelatorState}, MIGRATIONS)
    try:
        if job is None:
            if st.job is not None:
                raise ValueError(f"a checkpoint of job {st.job!r}, not of a whole correlator")
            return from_state(st, fresh())
        c = into if into is not None else fresh()
        load_job(c, st, job)
        return c
    except ValueError as err:  # evidence of a wrong type inside the checkpoint
        raise ck.CheckpointError(f"correlator checkpoint: {err}") from None


def from_state(st: CorrelatorState, c: HostCorrelator) -> HostCorrelator:
    """``st`` into ``c``, added to what ``c`` holds (a fresh one: the checkpoint's state)."""
    c.clock.update(st.clock)
    for es in st.episodes:
        ep = Episode(first_window=es.first_window, decided=es.decided)
        for e in es.entries:
            ev = evidence_of(es.fault, e.ev)
            ep.entries.append(
                Entry(e.ts, e.comm, e.window, e.score, (e.gpu, e.nic, e.peer), e.intra, ev)
            )
        c.episodes[(es.job, es.host, es.fault)] = ep
    for job, host, gpu, fault, comm, first, last, extra, culprits, slow, span in st.waiting:
        who = None if culprits is None else tuple((str(h), int(g)) for h, g in culprits)
        c.waiting.setdefault((job, host, gpu, fault), {})[comm] = (
            first, last, extra, who, slow, span,
        )  # fmt: skip
    for k in {tuple(w[:4]) for w in st.waiting}:
        c._waiting_last[k] = max(x[1] + x[5] for x in c.waiting[k].values())  # type: ignore[index]
    for job, host, gpu, ts in st.silent:
        c.silent.setdefault((job, host), {})[gpu] = ts
    c.cooldown.update({(job, host): ts for job, host, ts in st.cooldown})
    c.isolated.update({j: deque(q) for j, q in st.isolated.items()})
    c.job_hosts.update(st.job_hosts)
    c.job_host_names.update({j: set(n) for j, n in st.job_host_names.items()})
    c.suppressed += st.suppressed
    c.families.load(st.families)
    c.slow_comms.update({(job, comm): ts for job, comm, ts in st.slow_comms})
    for job, hosts, nranks, pos, host, ts in st.roles:
        c.roles.setdefault((job, hosts, nranks, pos), {})[host] = ts
    if not st.clock and st.now >= 0:  # written before per-job clocks: one clock for all
        jobs = {k[0] for k in c.episodes} | {k[0] for k in c.cooldown} | set(c.job_hosts)
        c.clock.update(dict.fromkeys(jobs - set(c.clock), st.now))
    return c
