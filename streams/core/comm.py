"""CommDetector: one communicator's shared state and its detectors, fed in event time.

The same object runs inside the Faust agent (one per communicator key), in
``c4stream detect`` and in unit tests. It keeps what all detectors share (a
:class:`~streams.core.detector.CommView`: identities, latest counters, the learned
op/period normal, the clock), feeds each batch to the detectors chosen by
``DetectConfig.detectors`` (see :mod:`streams.core.detector` for their contract), and
turns their findings and observations into wire :class:`~streams.verdicts.Verdict`.

Its clock is the communicator's event time: the newest ``ts_us`` seen, or what
:meth:`CommDetector.advance` says. Receipt is stamped with that clock, never with the
sender's own clock, so a host whose clock is off does not look silent.

>>> from producers.events import ProgressEvent
>>> from streams.core.config import DetectConfig
>>> d = CommDetector("0xa", DetectConfig(warmup_us=0))
>>> def hb(rank, ts, started, completed, inflight):
...     return ProgressEvent(v=1, job="j", comm="0xa", nranks=4, rank=rank, host=f"h{rank}",
...                          gpu=0, ts_us=ts, started=started, completed=completed,
...                          inflight_us=inflight)
>>> out = []
>>> for sec in range(1, 9):
...     ts = sec * 1_000_000
...     out += d.observe([hb(r, ts, 11, 10, sec * 1e6) for r in (0, 1, 3)] + [hb(2, ts, 10, 10, 0)])
>>> sorted({(v.fault, v.host, v.benign) for v in out})[:2]
[('noncomm_hang', 'h0', True), ('noncomm_hang', 'h1', True)]
>>> print([v.reason for v in out if not v.benign][0])  # doctest: +NORMALIZE_WHITESPACE
h2 GPU 0 (rank 2 of 0xa) has not started collective 11 while 3 peers have waited 3.0 s
in it (hang threshold 2.5 s).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from producers.events import Event, OpEvent, ProgressEvent
from streams.core import checkpoint as ck
from streams.core.columns import EventColumnsLike, as_columns
from streams.core.config import DetectConfig
from streams.core.cut import Cut, Folded, Identities, cut_columns
from streams.core.detector import (
    Batch,
    CommView,
    ConnArrays,
    Detector,
    Output,
    Window,
)
from streams.core.findings import Census, Finding, Observation
from streams.core.ranks import RankTable
from streams.core.registry import build_detectors, load_detector
from streams.core.stats import NormalModel, NormalState, stable_id
from streams.verdicts import Verdict

__all__ = ["CommDetector"]


_TICK_US = 500_000  # how often (event time) detectors' tick runs; hangs cost O(ranks)
_SCHEMA = 2
_P2P_OPS = frozenset({"Send", "Recv", "send", "recv", "SendRecv"})


class _RanksState(msgspec.Struct, array_like=True):
    hosts: list[str]
    nics: list[str]
    arrays: dict[str, ck.Array]


class _CommState(msgspec.Struct, array_like=True):
    comm: str
    job: str
    comm_name: str | None
    now: int
    first_us: int
    window_idx: int
    n_events: int
    next_tick: int
    census_hosts: int
    ranks: _RanksState
    model: NormalState
    detectors: dict[str, bytes]
    """Each detector's own checkpoint, by its name."""
    p2p: bool | None = None
    """Schema 2 on: the communicator carries Send/Recv (point-to-point) ops."""
    window_start: int = -2
    """Schema 2 on: where the open window started (-2: at ``window_idx`` windows)."""
    window_seq: int = -1
    """... the newest collective seen when it opened, and the newest seen since."""
    seq_hi: int = -1


def _migrate_1(body: list) -> list:
    """Comm checkpoint schema 1 -> 2: point-to-point not known yet (read again from
    the next op that carries connections); the open window counted in time only (its
    start is ``window_idx`` windows; its collectives are counted from now on)."""
    return [*body, None, -2, -1, -1]


_RANK_ARRAYS = ("host_idx", "gpu", "nic_idx", "started", "completed", "inflight_us",
                "prog_recv", "last_recv", "last_op_ts", "last_op_seq")  # fmt: skip


class CommDetector:
    """One communicator: shared view + configured detectors; bounded state."""

    def __init__(
        self, comm: str, config: DetectConfig, detectors: list[Detector] | None = None
    ) -> None:
        self.view = CommView(comm, config)
        self.detectors: list[Detector] = build_detectors(config) if detectors is None else detectors
        self.window_idx = -1
        """Windows of ``window_us`` since the epoch at the open window's last time
        boundary (kept for the checkpoint; windows are counted in collectives too)."""
        self.window_start = -1
        """Event time the open window started at (-1: none yet)."""
        self.window_seq = -1
        """The newest collective seen when the open window started."""
        self.seq_hi = -1
        """The newest collective seen."""
        self.n_events = 0
        self._next_tick = 0
        self._census_hosts = 0
        """Hosts in the last census note (the correlator sizes the job from these)."""
        self._all_known = False
        """Every rank's identity is learned (skip the per-batch lookup)."""

    @property
    def comm(self) -> str:
        return self.view.comm

    @property
    def config(self) -> DetectConfig:
        return self.view.config

    @property
    def ranks(self) -> RankTable:
        return self.view.ranks

    @property
    def now(self) -> int:
        return self.view.now

    # ------------------------------------------------------------------ public API
    def observe(self, batch: EventColumnsLike | Sequence[Event]) -> list[Verdict]:
        """Take a batch of this communicator's events (rows in arrival order) as columns
        (e.g. :class:`producers.columnar.EventColumns`; objects are turned into columns
        at the edge, :func:`~streams.core.columns.as_columns`); returns verdicts
        concluded. Objects are built only for the rows a detector reads whole — ops that
        carry connections, progress events (read only while an op is in flight) — and
        for ranks seen for the first time."""
        cols = as_columns(batch)
        if cols.n == 0:
            return []
        return self.observe_cut(cut_columns(cols))

    def observe_cut(self, c: Cut) -> list[Verdict]:
        """:meth:`observe` of columns already cut into the arrays the core reads
        (:func:`cut_columns`, or :func:`~streams.core.group.cut_many` for many
        communicators at once)."""
        out, batch = self.take_cut(c)
        for d in self.detectors:
            d.learn(self.view, batch)
        return out + self.end_batch()

    def take_cut(self, c: Cut) -> tuple[list[Verdict], Batch]:
        """The first half of :meth:`observe_cut`: the clock, identities and rank table
        updated; the verdicts of a window this batch closed, and the batch each detector
        must now learn — then :meth:`end_batch` (the group judges many communicators'
        detectors together between the two)."""
        out = self.begin_cut(c)
        self.view.ranks.last_recv[c.ident_rank] = self.view.now
        return out, self.fold_cut(c)

    def begin_cut(self, c: Cut) -> list[Verdict]:
        """:meth:`take_cut` up to the rank table's counters: the clock (and the window
        it closed: its verdicts), the ranks' identities. The counters' updates follow,
        here (:meth:`take_cut`) or for many communicators at once
        (:class:`~streams.core.ranks.RankTableGroup`), then :meth:`fold_cut`."""
        v = self.view
        if not v.job:
            v.job, v.comm_name = c.job, c.comm_name
        if c.top > v.ranks.n:
            self._grow(c.top)
        out: list[Verdict] = []
        if c.ts_max > v.now:  # as in observe()
            out = self._verdicts(self._roll_window(c.ts_max))
            v.now = c.ts_max
        if v.first_us < 0:
            v.first_us = v.now
        self.n_events += c.n
        if v.p2p is None and len(c.ro):  # the first op says whether it is a pipeline pair
            v.p2p = c.head_op in _P2P_OPS  # read from the columns, no row as an object
        if c.distinct:
            self.seq_hi = max(self.seq_hi, c.distinct[-1])
        self._learn_identities(c.ident, c.ident_rank, c.ident_cols)
        return out

    def fold_cut(self, c: Cut, tables: bool = True) -> Batch:
        """The rest of :meth:`take_cut`: the learned normal (and, with ``tables``, the
        rank table's last ops and progress counters) updated; the batch to learn."""
        batch = self._fold(
            c.op_objs, c.ro, c.seq, c.exec_us, c.ts, c.distinct, c.prog, c.rp, c.started,
            c.completed, c.inflight_us, c.conns, c.first, c.folded, tables,
        )  # fmt: skip
        batch.prog_conns = c.prog_conns
        return batch

    def end_batch(self) -> list[Verdict]:
        """The second half of :meth:`observe_cut`, once the detectors learnt: the tick."""
        return self._verdicts(self._tick())

    def advance(self, now_us: int) -> list[Verdict]:
        """The event-time clock moved on (maybe without events here): hangs, silence."""
        v = self.view
        if now_us <= v.now or v.first_us < 0:
            return []
        out = self._verdicts(self._roll_window(now_us))  # stamped as in observe()
        v.now = now_us
        return out + self._verdicts(self._tick())

    def to_bytes(self) -> bytes:
        """A checkpoint: versioned msgpack (:mod:`streams.core.checkpoint`), no pickle."""
        v, t = self.view, self.view.ranks
        ranks = _RanksState(
            list(t.hosts), list(t.nics), {k: ck.pack(getattr(t, k)) for k in _RANK_ARRAYS}
        )
        st = _CommState(
            comm=v.comm, job=v.job, comm_name=v.comm_name, now=v.now, first_us=v.first_us,
            window_idx=self.window_idx, n_events=self.n_events, next_tick=self._next_tick,
            census_hosts=self._census_hosts, ranks=ranks, model=v.model.state(),
            detectors={d.name: d.dump() for d in self.detectors}, p2p=v.p2p,
            window_start=self.window_start, window_seq=self.window_seq, seq_hi=self.seq_hi,
        )  # fmt: skip
        return ck.encode("comm", _SCHEMA, st)

    @classmethod
    def from_bytes(cls, data: bytes, config: DetectConfig) -> CommDetector:
        """The detector back from :meth:`to_bytes`; raises
        :class:`~streams.core.checkpoint.CheckpointError` for anything else (a pickle,
        corrupt or foreign bytes). Detectors configured now but absent from the
        checkpoint start fresh; ones no longer configured are dropped."""
        st = ck.decode(data, "comm", {_SCHEMA: _CommState}, {1: _migrate_1})
        want = build_detectors(config)
        dets = [
            load_detector(d.name, st.detectors[d.name], config) if d.name in st.detectors else d
            for d in want
        ]
        obj = cls(st.comm, config, dets)
        v = obj.view
        v.job, v.comm_name, v.now, v.first_us = st.job, st.comm_name, st.now, st.first_us
        v.p2p = st.p2p
        t = RankTable(0)
        arrays = {k: ck.unpack(st.ranks.arrays[k]) for k in _RANK_ARRAYS if k in st.ranks.arrays}
        n = arrays["host_idx"].size if "host_idx" in arrays else 0
        if len(arrays) != len(_RANK_ARRAYS) or any(a.shape != (n,) for a in arrays.values()):
            raise ck.CheckpointError("comm checkpoint: rank table arrays missing or uneven")
        for k, names in (("host_idx", st.ranks.hosts), ("nic_idx", st.ranks.nics)):
            ix = arrays[k]
            if ix.size and (int(ix.max()) >= len(names) or int(ix.min()) < -1):
                raise ck.CheckpointError(f"comm checkpoint: a rank's {k} is not in its list")
        t.hosts, t.nics, t.n = list(st.ranks.hosts), list(st.ranks.nics), n
        t._host_ix = {h: i for i, h in enumerate(t.hosts)}
        t._nic_ix = {x: i for i, x in enumerate(t.nics)}
        for k, a in arrays.items():
            setattr(t, k, a)
        v.ranks = t
        v.model = NormalModel.from_state(st.model)
        for d in obj.detectors:
            d.grow(n)
        obj.window_idx, obj.n_events = st.window_idx, st.n_events
        obj.window_start = (
            st.window_idx * config.window_us if st.window_start == -2 else st.window_start
        )
        obj.window_seq, obj.seq_hi = st.window_seq, st.seq_hi
        obj._all_known = n > 0 and bool((t.host_idx >= 0).all())
        obj._next_tick, obj._census_hosts = st.next_tick, st.census_hosts
        return obj

    def state_bytes(self) -> int:
        """Approximate memory held by this communicator's state."""
        return self.view.ranks.nbytes() + sum(d.nbytes() for d in self.detectors) + 1000

    # ------------------------------------------------------------------ ingestion
    def _grow(self, n: int) -> None:
        self._all_known = False
        self.view.ranks.grow(n)
        for d in self.detectors:
            d.grow(n)

    def _learn_identities(
        self, events: Sequence[Event], r: np.ndarray, cols: Identities | None = None
    ) -> None:
        """Ranks first seen in ``events`` (ranks ``r``) learn who they are; ``cols``:
        the same rows' identities as columns, when offered (no event objects)."""
        top = int(r.max())
        t = self.view.ranks
        if top >= t.n:
            self._grow(top + 1)
        if not self._all_known:  # once every rank is known, skip the lookup per batch
            unknown = np.flatnonzero(t.host_idx[r] < 0)
            got = cols(unknown) if cols is not None and unknown.size else None
            if got is not None:
                for rank, host, gpu, nic in zip(r[unknown].tolist(), *got, strict=True):
                    t.learn_identity(rank, host, gpu, nic)
            else:
                for i in unknown.tolist():
                    e = events[i]
                    t.learn_identity(e.rank, e.host, e.gpu, e.nic)
            self._all_known = bool(unknown.size) and bool((t.host_idx >= 0).all())

    def _fold(
        self,
        ops: Sequence[OpEvent],
        ro: np.ndarray,
        s: np.ndarray,
        x: np.ndarray,
        ts: np.ndarray,
        distinct: list[int],
        prog: Sequence[ProgressEvent],
        rp: np.ndarray,
        st: np.ndarray,
        cp: np.ndarray,
        infl: np.ndarray,
        conns: ConnArrays | None = None,
        first: np.ndarray | None = None,
        folded: Folded | None = None,
        tables: bool = True,
    ) -> Batch:
        """Fold the batch into the shared view; the arrays every detector reads (op fields
        in arrival order, ``distinct`` seqs ascending; ``infl`` 0 where absent).
        ``first``: the op fields come sorted by (rank, seq) already, and this marks
        each rank's first op (the grouped path sorts all communicators at once);
        ``folded``: the periods and each rank's last op computed with them; ``tables``
        False (with ``folded``): the rank table's counters are written by the caller."""
        v, t = self.view, self.view.ranks
        empty = np.empty(0, np.int64)
        if not len(ro):
            r = s = ts = empty
            x = np.empty(0, np.float64)
        elif folded is not None:
            r = ro
            v.model.learn_periods(folded.periods)
            if tables:
                t.last_op_ts[folded.last_rank] = folded.last_ts
                t.last_op_seq[folded.last_rank] = folded.last_seq
            v.model.learn_ops(x)
            v.model.note_peak(float(x.max()), v.now)
        else:
            k = len(ro)
            # period between consecutive collectives of one rank, by that rank's own
            # clock: sort by (rank, seq); an event's predecessor is the one before it in
            # the sorted batch, or the table's last op of its rank for its first event
            if first is None:
                o = np.lexsort((s, ro))
                r, s, ts, x = ro[o], s[o], ts[o], x[o]
                first = np.empty(k, bool)
                first[0] = True
                np.not_equal(r[1:], r[:-1], out=first[1:])
            else:
                r = ro
            prev_ts = np.empty(k, np.int64)
            prev_ts[1:] = ts[:-1]
            prev_seq = np.empty(k, np.int64)
            prev_seq[1:] = s[:-1]
            rf = r[first]
            prev_ts[first] = t.last_op_ts[rf]
            prev_seq[first] = t.last_op_seq[rf]
            periods = ts - prev_ts
            periods = periods[(prev_seq == s - 1) & (prev_ts >= 0) & (periods > 0)]
            v.model.learn_periods(periods.astype(np.float64))
            last = np.empty(k, bool)  # each rank's last op of the batch
            last[-1] = True
            last[:-1] = first[1:]
            t.last_op_ts[r[last]] = ts[last]
            t.last_op_seq[r[last]] = s[last]
            v.model.learn_ops(x)
            v.model.note_peak(float(x.max()), v.now)
        if len(rp) and tables:
            t.started[rp] = st
            t.completed[rp] = cp
            t.inflight_us[rp] = infl
            t.prog_recv[rp] = v.now
        return Batch(ops, r, s, ts, x, distinct, prog, rp, st, cp, conns)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ judging
    def _tick(self) -> Output:
        v = self.view
        if v.now < self._next_tick:
            return []
        half = self._half_window(self._next_tick - _TICK_US)
        self._next_tick = v.now + _TICK_US
        out: Output = []
        for d in self.detectors:
            out += d.tick(v)
            if half is not None and (peek := getattr(d, "peek", None)) is not None:
                out += peek(v, half)
        if v.warm() and v.ranks.n_hosts() != self._census_hosts:
            out.append(self._census())
        return out

    def _half_window(self, last_tick: int) -> Window | None:
        """The open window so far, when this tick is the first past its half and it
        holds half a window's collectives (a window that will fill up by its count
        soon is left to close): detectors with a ``peek`` judge it without closing it,
        so what crosses a bar just after a window's end is found half a window later,
        not a whole one. From checkpointed clocks only, so a
        restored communicator peeks where an uninterrupted one does."""
        v, cfg = self.view, self.view.config
        start = self.window_start
        mid = start + cfg.window_us // 2
        if start < 0 or v.first_us < 0 or not last_tick < mid <= v.now:
            return None
        n = 2 * (self.seq_hi - self.window_seq)  # at this pace, the whole window's
        if n < cfg.window_min_collectives or n >= cfg.window_max_collectives:
            return None  # too little yet; or it will close by its count before long
        return self._window(start, v.now)

    def _window(self, start: int, end: int) -> Window:
        """Learn past the start of the warm-up's last window; judge past the warm-up."""
        v, cfg = self.view, self.view.config
        learn = start >= v.first_us + cfg.warmup_us - max(cfg.window_us, end - start)
        return Window(start, end, learn, learn and end - v.first_us >= cfg.warmup_us)

    def _census(self) -> Observation:
        """A note naming this communicator's hosts, sent when it is warm and again if its
        host set grows: the correlator sizes the job (for the cap on isolated hosts and
        the job-wide-stop rail) from the union of these."""
        v, t = self.view, self.view.ranks
        self._census_hosts = t.n_hosts()
        reason = f"{v.label} spans {t.n_hosts()} hosts."
        host = t.hosts[0] if t.hosts else None
        return Observation("noncomm_hang", host, reason, v.first_us, v.now,
                           Census(hosts=list(t.hosts)))  # fmt: skip

    def _roll_window(self, new_now: int) -> Output:
        """Close the open window when the clock reaches ``new_now``, if it is due.

        Windows are counted in collectives as well as in time, so that a communicator
        is judged over about the same evidence whatever its step: a window closes at
        a ``window_us`` boundary once it holds ``window_min_collectives`` collectives
        (the usual case: a communicator running a few collectives per second is judged
        every ``window_us``); one with fewer (one collective per 46-s step) stays open
        until it has them, up to ``window_max_us`` (silence); one running hundreds per
        second closes as soon as it holds ``window_max_collectives``."""
        v, cfg = self.view, self.view.config
        w = cfg.window_us
        idx = new_now // w
        if self.window_start < 0 or v.first_us < 0:
            self.window_idx = idx
            self.window_start = idx * w
            self.window_seq = self.seq_hi
            return []
        start = self.window_start
        n = self.seq_hi - self.window_seq
        if n >= cfg.window_max_collectives and v.now > start:
            end = v.now  # many collectives: judged now, not at the next time boundary
            nxt = v.now
        elif idx > self.window_idx and (
            n >= cfg.window_min_collectives or new_now - start >= cfg.window_max_us
        ):
            end = max(start + 1, (self.window_idx + 1) * w)  # the boundary just passed
            nxt = idx * w
        else:
            if idx > self.window_idx:
                self.window_idx = idx  # the time boundary passed with too few: stay open
            return []
        window = self._window(start, end)
        out: Output = []
        for d in self.detectors:
            out += d.close_window(v, window)
        self.window_idx = idx
        self.window_start = nxt
        self.window_seq = self.seq_hi
        return out

    def _verdicts(self, out: Output) -> list[Verdict]:
        return [self._verdict(x) for x in out] if out else []

    def _verdict(self, x: Finding | Observation) -> Verdict:
        """The wire form: evidence as the struct's dict, with the communicator's facts."""
        v, t = self.view, self.view.ranks
        common = {"comm_name": v.label, "comm_hosts": t.n_hosts(), "nranks": t.n}
        if isinstance(x, Finding):
            host, gpu = x.host, None
            if x.rank is not None:
                host = host or t.host_of(x.rank)
                gpu = t.gpu_of(x.rank)
            ev = msgspec.to_builtins(msgspec.structs.replace(x.evidence, **common))
            fault, nic, peer, benign, score = x.fault, x.nic, x.peer_host, False, x.score
            ranks = x.ranks
        else:
            host, gpu, nic, peer, benign, score = x.host, None, None, None, True, 0.0
            ev = {**common, **msgspec.to_builtins(x.note)}
            fault, ranks = x.fault, x.ranks
        host = host or "unknown"
        vid = stable_id(v.job, v.comm, fault, host, gpu, nic, peer, x.start_us, benign)
        return Verdict(
            id=vid,
            ts_us=v.now,
            job=v.job,
            comm=v.comm,
            host=host,
            fault=fault,
            score=round(min(1.0, max(0.0, float(score))), 3),
            reason=x.reason,
            window_start_us=x.start_us,
            window_end_us=x.end_us,
            evidence=ev,
            ranks=[int(r) for r in ranks],
            gpu=gpu,
            nic=nic,
            peer_host=peer,
            benign=benign,
        )
