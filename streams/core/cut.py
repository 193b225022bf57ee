"""One communicator's batch of columns cut into the arrays the core reads
(:class:`Cut`): ops and progress rows apart, each rank's fields as arrays, the few rows
a detector reads whole as objects. :meth:`streams.core.comm.CommDetector.observe_cut`
takes it; :func:`streams.core.group.cut_many` cuts many communicators' at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from producers.events import Event, OpEvent, ProgressEvent
from streams.core.columns import EventColumnsLike
from streams.core.detector import ConnArrays, ProgressConnArrays

__all__ = ["Cut", "Folded", "Identities", "conn_arrays", "cut_columns", "first_op",
           "identities", "progress_conns"]  # fmt: skip

Identities = Callable[[np.ndarray], tuple[list[str], list[int | None], list[str | None]] | None]
"""Rows (by number) → their host, GPU and NIC (None when absent) as lists, or None."""


@dataclass(slots=True)
class Cut:
    """One communicator's batch as the arrays the core reads (see :func:`cut_columns`)."""

    n: int
    job: str
    comm_name: str | None
    top: int
    """Ranks the batch says the communicator has (first and last row's ``nranks``)."""
    ts_max: int
    ident: Sequence[Event]
    """Ops, then progress events, in arrival order (read only for ranks first seen)."""
    ident_rank: np.ndarray
    op_objs: Sequence[OpEvent]
    """The ops that carry connections (objects only if a detector reads them)."""
    ro: np.ndarray
    seq: np.ndarray
    exec_us: np.ndarray
    ts: np.ndarray
    """Op fields: in arrival order, or sorted by (rank, seq) when ``first`` is set."""
    distinct: list[int]
    prog: Sequence[ProgressEvent]
    rp: np.ndarray
    started: np.ndarray
    completed: np.ndarray
    inflight_us: np.ndarray
    conns: ConnArrays | None
    first: np.ndarray | None = None
    prog_conns: ProgressConnArrays | None = None
    folded: Folded | None = None
    ident_cols: Identities | None = None
    """The identities of ``ident``'s rows read from the columns (see :func:`identities`)."""
    head_op: str | None = None
    """The first op's name (it tells a pipeline pair), read without building ``ident``."""


@dataclass(frozen=True, slots=True)
class Folded:
    """What the fold of a batch's ops into the rank table computes, done for many
    communicators at once (:mod:`streams.core.group`): the periods to learn (in the
    fold's order, as float) and each rank's last op of the batch."""

    periods: np.ndarray
    last_rank: np.ndarray
    last_ts: np.ndarray
    last_seq: np.ndarray


def cut_columns(cols: EventColumnsLike) -> Cut:
    """One communicator's columns (``n`` > 0) cut for :meth:`CommDetector.observe_cut`."""
    n = cols.n
    nr = cols.int("nranks")
    is_op = cols.is_op
    op_rows = np.flatnonzero(is_op)
    pr_rows = np.flatnonzero(~is_op) if op_rows.size < n else op_rows[:0]
    rank = cols.int("rank")
    ts_all = cols.int("ts_us")
    order = np.concatenate([op_rows, pr_rows])  # observe()'s order: ops, then progress
    s = cols.int("seq")[op_rows]
    counts = cols.conn_counts()[op_rows]
    started, completed = cols.int("started")[pr_rows], cols.int("completed")[pr_rows]
    return Cut(
        n=n, job=cols.job, comm_name=cols.comm_name, top=max(int(nr[0]), int(nr[-1])),
        ts_max=int(ts_all.max()), ident=cols.rows(order), ident_rank=rank[order],
        op_objs=cols.rows(op_rows[counts > 0]), ro=rank[op_rows], seq=s,
        exec_us=cols.float("exec_us")[op_rows], ts=ts_all[op_rows],
        distinct=np.unique(s).tolist(), prog=cols.rows(pr_rows), rp=rank[pr_rows],
        started=started, completed=completed, inflight_us=cols.float("inflight_us")[pr_rows],
        conns=conn_arrays(cols, op_rows, counts, rank, s),
        prog_conns=progress_conns(cols, pr_rows, started > completed),
        ident_cols=identities(cols, order), head_op=first_op(cols, op_rows),
    )  # fmt: skip


def conn_arrays(
    cols: EventColumnsLike, op_rows: np.ndarray, counts: np.ndarray, rank: np.ndarray,
    s: np.ndarray,
) -> ConnArrays | None:  # fmt: skip
    """The connections of the ops ``op_rows`` (``counts`` each; ``s`` their seqs)."""
    has = counts > 0
    with_conns = op_rows[has]
    if not with_conns.size:
        return None
    k = counts[has]
    peer, send, nbytes, time_us = cols.conn_arrays(with_conns)
    return ConnArrays(np.repeat(rank[with_conns], k), np.repeat(s[has], k), peer, send,
                      nbytes, time_us)  # fmt: skip


def first_op(cols: EventColumnsLike, op_rows: np.ndarray) -> str | None:
    """The name of the op at ``op_rows[0]`` (None: no op), from the columns when they
    offer one value (an optional ``value_at(name, row)`` method), else from its object."""
    if not op_rows.size:
        return None
    get = getattr(cols, "value_at", None)
    if get is not None:
        return get("op", int(op_rows[0]))
    return cols.rows(op_rows[:1])[0].op  # type: ignore[union-attr]


def identities(cols: EventColumnsLike, order: np.ndarray) -> Identities | None:
    """Who sent rows ``order[i]`` of ``cols``, for rows ``i`` (a rank first seen), when
    the columns offer it (an optional ``identities(idx)`` method: host, GPU, NIC lists)
    — then no event object is built to learn a new rank's identity."""
    get = getattr(cols, "identities", None)
    if get is None:
        return None
    return lambda i: get(order[i])


def progress_conns(
    cols: EventColumnsLike, pr_rows: np.ndarray, busy: np.ndarray
) -> ProgressConnArrays | None:
    """The connections of the progress rows, when the columns offer them as integer
    arrays (an optional ``progress_conns(idx)`` method) and a row has an op in flight
    (``busy``: only then are they read); None: the hang detector reads objects, if any."""
    get = getattr(cols, "progress_conns", None)
    if get is None or not busy.any():
        return None
    got = get(pr_rows)
    return None if got is None else ProgressConnArrays(*got)
