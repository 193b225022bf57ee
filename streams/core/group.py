"""Many communicators' batches of one time slice, cut in one numpy pass.

A job of many small communicators (a 1,024-GPU job has about 136, mostly of 8 ranks)
sends each of them a batch of a few dozen events per slice. Cut one at a time
(:func:`~streams.core.comm.cut_columns`), each batch pays the same two dozen numpy
calls on arrays of a few elements, and that fixed cost, not the events, is what the
core spends its time on. :func:`observe_many` lays the slice's batches end to end,
does that work once for all of them — the split into ops and progress events, the
sort by (communicator, rank, seq), each rank's first op, the distinct collectives,
the newest time — and hands each communicator its views of the result
(:class:`~streams.core.comm.Cut`). Each communicator's own state (rank table, learned
normal, detectors, checkpoints) is then updated as before, in the same order, so the
verdicts and the state are those of :meth:`CommDetector.observe` called one
communicator after the other.

Given a :class:`CommGroup` kept from slice to slice, two pieces of that state are also
updated for all communicators at once: the rank tables' counters
(:class:`~streams.core.ranks.RankTableGroup`) and the straggler aligners' rings
(:class:`~streams.core.straggler.AlignerGroup`), each laid out as views of shared
arrays — the communicators still own (and checkpoint) their state; the group only
writes into it. Each grouped pass sits next to the code it repeats, and
``tests/streams/test_core_group.py`` checks that it leaves the same state.

>>> from producers.columnar import decode_arrow, encode_arrow
>>> from producers.events import ProgressEvent
>>> from streams.core.config import DetectConfig
>>> def hb(comm, rank):
...     return ProgressEvent(v=1, job="j", comm=comm, nranks=2, rank=rank, host=f"h{rank}",
...                          ts_us=1_000_000, started=3, completed=3)
>>> a, b = CommDetector("a", DetectConfig()), CommDetector("b", DetectConfig())
>>> cols = [decode_arrow(encode_arrow([hb(c, 0), hb(c, 1)]))[0] for c in "ab"]
>>> observe_many([(a, cols[0]), (b, cols[1])])
[[], []]
>>> a.n_events, b.ranks.host_of(1), int(b.ranks.completed[0])
(2, 'h1', 3)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streams.core.columns import EventColumnsLike
from streams.core.comm import CommDetector
from streams.core.cut import (
    Cut,
    Folded,
    conn_arrays,
    cut_columns,
    first_op,
    identities,
    progress_conns,
)
from streams.core.detector import Batch
from streams.core.ranks import RankTableGroup
from streams.core.straggler import AlignerGroup, StragglerDetector
from streams.verdicts import Verdict

__all__ = ["CommGroup", "cut_many", "fold_many", "observe_many"]

_FEW = 2
"""Below this many communicators the grouped pass costs more than it saves."""


class CommGroup:
    """What stays laid out together between calls of :func:`observe_many` for the same
    communicators (one per job lane): their rank tables' counters
    (:class:`~streams.core.ranks.RankTableGroup`) and straggler aligners' rings
    (:class:`~streams.core.straggler.AlignerGroup`). Holds views of the communicators'
    own state, nothing of its own that a checkpoint would need."""

    def __init__(self) -> None:
        self.ranks = RankTableGroup()
        self.stragglers = AlignerGroup()


def observe_many(
    items: Sequence[tuple[CommDetector, EventColumnsLike]], group: CommGroup | None = None
) -> list[list[Verdict]]:
    """Each communicator's batch (columns, ``n`` > 0) observed, in the order given: the
    verdicts of each, as :meth:`CommDetector.observe` of it would return them.
    A communicator may appear once per call. ``group`` (kept by the caller from call to
    call): the detectors that have a grouped pass learn in it."""
    cuts = cut_many([c for _, c in items])
    if len(cuts) < _FEW:
        return [d.observe_cut(c) for (d, _), c in zip(items, cuts, strict=True)]
    dets = [d for d, _ in items]
    fold_many(dets, cuts)
    if group is None:
        return [d.observe_cut(c) for d, c in zip(dets, cuts, strict=True)]
    # first every communicator's clock, window and identities; then all rank tables'
    # counters at once; then each one's detectors in turn, but the stragglers' all at
    # once after: a detector's learn changes only its own state (the Detector
    # contract), so the order between them is free; the ticks come after every learn,
    # as alone. No object per communicator is kept across the loops but the cuts.
    outs = [d.begin_cut(c) for d, c in zip(dets, cuts, strict=True)]
    group.ranks.update_many(
        [d.view.ranks for d in dets], [d.view.now for d in dets], [c.ident_rank for c in cuts],
        [None if c.folded is None else (c.folded.last_rank, c.folded.last_ts, c.folded.last_seq)
         for c in cuts],
        [(c.rp, c.started, c.completed, c.inflight_us) for c in cuts],
    )  # fmt: skip
    st = _Stragglers()
    for d, c in zip(dets, cuts, strict=True):
        batch = d.fold_cut(c, tables=False)
        for x in d.detectors:
            if x.__class__ is not StragglerDetector:
                x.learn(d.view, batch)
            elif batch.rank.size:
                st.add(x, d.view.now, batch)  # type: ignore[arg-type]
    if st.dets:
        group.stragglers.learn_many(st.dets, st.nows, st.ranks, st.seqs, st.execs, st.distinct)
    return [out + d.end_batch() for d, out in zip(dets, outs, strict=True)]


class _Stragglers:
    """The straggler detectors' batches of one call, as parallel lists."""

    def __init__(self) -> None:
        self.dets: list[StragglerDetector] = []
        self.nows: list[int] = []
        self.ranks: list[np.ndarray] = []
        self.seqs: list[np.ndarray] = []
        self.execs: list[np.ndarray] = []
        self.distinct: list[list[int]] = []

    def add(self, d: StragglerDetector, now: int, b: Batch) -> None:
        self.dets.append(d)
        self.nows.append(now)
        self.ranks.append(b.rank)
        self.seqs.append(b.seq)
        self.execs.append(b.exec_us)
        self.distinct.append(b.distinct)


def fold_many(dets: Sequence[CommDetector], cuts: list[Cut]) -> None:
    """Add to each cut (ops sorted, ``first`` set: :func:`cut_many`) what the fold into
    its communicator's rank table computes (:class:`~streams.core.comm.Folded`): the
    period between consecutive collectives of a rank by its own clock, with the table's
    last op as the predecessor of a rank's first op of the batch — one numpy pass for
    all communicators, the look-up of those predecessors included."""
    r = np.concatenate([c.ro for c in cuts])
    if not len(r):
        return
    s = np.concatenate([c.seq for c in cuts])
    ts = np.concatenate([c.ts for c in cuts])
    first = np.concatenate([c.first for c in cuts])  # type: ignore[misc]
    no = np.zeros(len(cuts) + 1, np.int64)  # each cut's ops in the concatenation
    np.cumsum([len(c.ro) for c in cuts], out=no[1:])
    n_first = np.diff(np.concatenate([[0], np.cumsum(first)])[no])
    f_ts, f_seq = _last_ops(dets, n_first, r[first])
    prev_ts = np.empty(len(r), np.int64)
    prev_ts[1:] = ts[:-1]
    prev_seq = np.empty(len(r), np.int64)
    prev_seq[1:] = s[:-1]
    prev_ts[first] = f_ts
    prev_seq[first] = f_seq
    periods = ts - prev_ts
    ok = (prev_seq == s - 1) & (prev_ts >= 0) & (periods > 0)
    good = periods[ok].astype(np.float64)
    last = np.empty(len(r), bool)  # each rank's last op of its batch
    last[-1] = True
    last[:-1] = first[1:]
    lr, lts, lseq = r[last], ts[last], s[last]
    n_ok = np.concatenate([[0], np.cumsum(ok)])[no].tolist()
    n_last = np.concatenate([[0], np.cumsum(last)])[no].tolist()
    for i, c in enumerate(cuts):
        if len(c.ro):
            a, b = n_last[i], n_last[i + 1]
            c.folded = Folded(good[n_ok[i] : n_ok[i + 1]], lr[a:b], lts[a:b], lseq[a:b])


def _last_ops(
    dets: Sequence[CommDetector], n_first: np.ndarray, rf: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rank table's last op (ts, seq) of the ranks ``rf`` (``n_first`` of them per
    communicator, laid end to end), read from all the tables laid end to end in one
    look-up; a rank not in its table yet gets what :meth:`RankTable.grow` gives it."""
    tables = [d.view.ranks for d in dets]
    sizes = np.fromiter((t.n for t in tables), np.int64, len(tables))
    start = np.zeros(len(tables), np.int64)
    np.cumsum(sizes[:-1], out=start[1:])
    known = rf < np.repeat(sizes, n_first)
    at = np.repeat(start, n_first) + rf
    all_ts = np.concatenate([t.last_op_ts for t in tables])
    all_seq = np.concatenate([t.last_op_seq for t in tables])
    if known.all():
        return all_ts[at], all_seq[at]
    f_ts = np.full(len(rf), -1, np.int64)
    f_seq = np.full(len(rf), -2, np.int64)
    f_ts[known], f_seq[known] = all_ts[at[known]], all_seq[at[known]]
    return f_ts, f_seq


def cut_many(parts: Sequence[EventColumnsLike]) -> list[Cut]:
    """:func:`~streams.core.comm.cut_columns` of each part (one communicator each, ``n``
    > 0), computed for all of them at once; ops come sorted by (rank, seq)."""
    k = len(parts)
    if k < _FEW:
        return [cut_columns(c) for c in parts]
    sizes = np.fromiter((c.n for c in parts), np.int64, k)
    bounds = np.zeros(k + 1, np.int64)
    np.cumsum(sizes, out=bounds[1:])
    starts = bounds[:-1]

    def cat(get) -> np.ndarray:  # type: ignore[no-untyped-def]
        return np.concatenate([get(c) for c in parts])

    is_op = cat(lambda c: c.is_op)
    rank = cat(lambda c: c.int("rank"))
    ts = cat(lambda c: c.int("ts_us"))
    nr = cat(lambda c: c.int("nranks"))
    seg = np.repeat(np.arange(k), sizes)
    ts_max = np.maximum.reduceat(ts, starts).tolist()
    top = np.maximum(nr[starts], nr[bounds[1:] - 1]).tolist()
    local = np.arange(int(bounds[-1])) - np.repeat(starts, sizes)  # row number in its part
    # ops, then progress events, per part, each in arrival order (observe()'s order)
    kind_order = np.lexsort((~is_op, seg))
    op_rows = np.flatnonzero(is_op)
    n_ops = np.add.reduceat(is_op.astype(np.int64), starts)
    # the fold's order: by (part, rank, seq); each rank's first op in its part
    seq_all = cat(lambda c: c.int("seq"))
    oseg, orank, oseq = seg[op_rows], rank[op_rows], seq_all[op_rows]
    o = np.lexsort((oseq, orank, oseg))
    srows = op_rows[o]
    sseg, srank, sseq = oseg[o], orank[o], oseq[o]
    first = np.ones(len(srows), bool)
    first[1:] = (srank[1:] != srank[:-1]) | (sseg[1:] != sseg[:-1])
    exec_s = cat(lambda c: c.float("exec_us"))[srows]
    ts_s = ts[srows]
    # distinct seqs per part: the sorted (part, seq) pairs, deduplicated
    d = np.lexsort((oseq, oseg))
    dseg, dseq = oseg[d], oseq[d]
    keep = np.ones(len(d), bool)
    keep[1:] = (dseq[1:] != dseq[:-1]) | (dseg[1:] != dseg[:-1])
    dseg, dseq = dseg[keep], dseq[keep]
    dcut = np.searchsorted(dseg, np.arange(k + 1)).tolist()
    distinct = dseq.tolist()
    ocut = np.zeros(k + 1, np.int64)
    np.cumsum(n_ops, out=ocut[1:])
    oc = ocut.tolist()
    pr_rows = kind_order  # per part: its ops first, then its progress rows
    pr_start = (bounds[:-1] + n_ops).tolist()
    b = bounds.tolist()
    st_all, cp_all = cat(lambda c: c.int("started")), cat(lambda c: c.int("completed"))
    infl_all = cat(lambda c: c.float("inflight_us"))
    busy = ~is_op & (st_all > cp_all)  # progress rows with an op in flight
    busy_part = np.logical_or.reduceat(busy, starts).tolist()
    ident_rank = rank[kind_order]
    loc_kind = local[kind_order]
    out: list[Cut] = []
    for i, c in enumerate(parts):
        lo, hi, o0, o1 = b[i], b[i + 1], oc[i], oc[i + 1]
        p0 = pr_start[i]
        order = loc_kind[lo:hi]
        loc_ops, loc_pr = order[: o1 - o0], loc_kind[p0:hi]
        prs = pr_rows[p0:hi]
        counts = c.conn_counts()
        # the fold reads ops sorted; connections keep the arrival order of their ops
        counts_ops = counts[loc_ops]
        out.append(Cut(
            n=hi - lo, job=c.job, comm_name=c.comm_name, top=top[i], ts_max=ts_max[i],
            ident=c.rows(order), ident_rank=ident_rank[lo:hi],
            op_objs=c.rows(loc_ops[counts_ops > 0]),
            ro=srank[o0:o1], seq=sseq[o0:o1], exec_us=exec_s[o0:o1], ts=ts_s[o0:o1],
            distinct=distinct[dcut[i] : dcut[i + 1]],
            prog=c.rows(loc_pr), rp=rank[prs],
            started=st_all[prs], completed=cp_all[prs], inflight_us=infl_all[prs],
            conns=conn_arrays(c, loc_ops, counts_ops, c.int("rank"), seq_all[op_rows[o0:o1]]),
            first=first[o0:o1],
            prog_conns=progress_conns(c, loc_pr, busy[prs]) if busy_part[i] else None,
            ident_cols=identities(c, order), head_op=first_op(c, loc_ops),
        ))  # fmt: skip
    return out
