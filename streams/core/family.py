"""Communicators of one shape judged together: pipeline chains and small-cell families.

A communicator of two ranks (a pipeline Send/Recv pair) or with fewer inter-host
connections than its own throughput matrix needs (a two-host ring) cannot be judged
alone: with two ranks nobody is "the one its peers wait for", and with two cells there
is no median cell. It can be judged against its *replicas*: the communicators of the
same shape elsewhere in the job, which run the same schedule and move the same bytes.

**Pipeline chains.** Pairs are linked into chains by their members: a GPU that is rank 1
of one pair (it receives from the previous stage) and rank 0 of another (it sends to
the next) is a middle stage; a pair's *depth* is how many pairs precede it in its chain
(the stage boundary it crosses). What a rank normally spends per collective at one end
of a pair — its share of the pipeline's bubbles included — is learned from the pairs of
the same depth and end in the other replicas, in the same window. A GPU waited for its
neighbour stage only when it spent clearly more than those (:meth:`Families.waited`):
that, not the bubble itself, clears it of blame for being late elsewhere.

**Cell families.** The directed cells of small communicators (per :class:`Cells`
note) are compared with the same cell of every communicator of the same shape (ranks,
hosts, the cell's rank positions and message size): a cell far below its family's
median is slow. Which component is slow is then decided from every cell through the
NICs at both ends, across all small communicators (pairs in both directions, two-host
rings): a NIC slow with two or more remote NICs is the NIC; one direction slow while the
reverse is fine is the link; both directions of one hop slow, with no other cell of
either NIC to tell them apart, names nothing (neither host is isolated on it). A NIC
whose every cell is slow, both ways, with two or more remote NICs, while no other cell
read beside them is slow, is *whole*: the slowness is its own, not a queue at a shared
switch port (see :mod:`streams.core.slow_conn`).

>>> f = Families()
>>> def pair(r, fwd):  # replica r of a two-stage pipeline: a{r} -> b{r} and back
...     return Cells(src=[0, 1], dst=[1, 0], src_host=[f"a{r}", f"b{r}"], src_nic=["x", "x"],
...                  dst_host=[f"b{r}", f"a{r}"], dst_nic=["x", "x"], gbs=[fwd, 25.0])
>>> for r in (0, 1, 3, 4):
...     _ = f.observe_cells("j", f"pp{r}", 5_000_000, 0, pair(r, 25.0), (2, 2, 26))
>>> [(s.kind, s.host, s.peer_host, round(s.ratio, 2))
...  for s in f.observe_cells("j", "pp2", 5_000_000, 0, pair(2, 10.0), (2, 2, 26))]
[('link', 'a2', 'b2', 0.4)]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np

from streams.core.findings import Cells, PairWait
from streams.core.stats import median

__all__ = ["Families", "FamiliesState", "SlowCell", "Waited"]

_KEEP = 4
"""Windows of notes kept per communicator (the replicas' latest are read)."""
_KEEP_PAIR = 32
"""Windows of a pipeline pair's notes kept (at most; older than the correlator's horizon
are dropped): a straggler's evidence lives for the horizon or three of its windows, and
whether it waited for its neighbour stage is judged on the pair notes of its own time,
which must still be there when it is decided (short steps: windows of a second)."""
_MIN_REPLICAS = 3
"""Other communicators of the shape needed before one is judged against them."""


@dataclass(frozen=True, slots=True)
class Waited:
    """A GPU spent clearly longer than its replicas at its end of a pipeline pair."""

    comm: str
    peer_host: str
    peer_gpu: int
    excess_ms: float
    share: float
    """Excess over the pair's time between collectives."""


@dataclass(frozen=True, slots=True)
class SlowCell:
    """A slow component decided from cell families: ``kind`` "nic" (at ``host`` /
    ``nic``) or "link" (``host`` ``nic`` -> ``peer_host``)."""

    kind: str
    host: str
    nic: str | None
    peer_host: str | None
    ratio: float
    median_gbs: float
    cells: int
    whole: bool = False
    """Every cell through the NIC slow, both ways, two or more remote NICs, no other
    cell read beside them slow."""


@dataclass(slots=True)
class _Pair:
    hosts: tuple[str, str]
    gpus: tuple[int, int]
    notes: deque = field(default_factory=lambda: deque(maxlen=_KEEP_PAIR))
    """(ts, window start, exec ms end 0, exec ms end 1, period ms)"""


@dataclass(slots=True)
class _CellComm:
    shape: tuple[int, int, int]
    notes: deque = field(default_factory=lambda: deque(maxlen=_KEEP))
    """(ts, window start, Cells)"""


class FamiliesState(msgspec.Struct, array_like=True):
    """Checkpoint form (inside the correlator's)."""

    pairs: list[tuple[str, str, list[str], list[int], list[list[float]]]] = []
    """(job, comm, hosts, gpus, notes as [ts, window, exec0, exec1, period])"""
    cells: list[tuple[str, str, list[int], list[tuple[int, int, Cells]]]] = []
    """(job, comm, shape, notes as (ts, window, Cells))"""


class Families:
    """Pipeline chains and cell families of every job, fed the notes of small
    communicators (see the module docstring)."""

    def __init__(self, slow_ratio: float = 0.75, min_share: float = 0.02, min_z: float = 4.0):
        self.slow_ratio = slow_ratio
        self.min_share = min_share
        self.min_z = min_z
        self.pairs: dict[tuple[str, str], _Pair] = {}
        self.member: dict[tuple[str, str, int], dict[str, int]] = {}
        """(job, host, gpu) -> {pair comm: its end (0 sends forward, 1 receives)}"""
        self.cells: dict[tuple[str, str], _CellComm] = {}
        self.fam: dict[tuple, dict[str, deque]] = {}
        """(job, shape, sender position, receiver position) -> {comm: its last windows'
        (start, end, GB/s, GB/s at the end)}"""
        self.nic_comms: dict[tuple[str, str, str | None], set[str]] = {}
        """(job, host, NIC) -> the small communicators with a cell through it"""
        self._fam_med: dict[tuple, tuple[int, int, int, float | None]] = {}
        self._fam_upd: dict[tuple, int] = {}
        self._depth: dict[tuple[str, str], int] = {}
        self._ref: dict[tuple, tuple[float, float, float] | None] = {}
        self._n_notes: dict[tuple[str, int], int] = {}
        """(job, window start) -> pair notes seen (a replica reference is recomputed
        when more notes of its window came)."""

    # ------------------------------------------------------------- pipeline chains
    def observe_pair(self, job: str, comm: str, ts: int, window: int, note: PairWait) -> None:
        if len(note.hosts) != 2 or len(note.gpus) != 2 or len(note.exec_ms) != 2:
            return
        key = (job, comm)
        p = self.pairs.get(key)
        if p is None:
            p = self.pairs[key] = _Pair((note.hosts[0], note.hosts[1]),
                                        (int(note.gpus[0]), int(note.gpus[1])))  # fmt: skip
            for end in (0, 1):
                self.member.setdefault((job, p.hosts[end], p.gpus[end]), {})[comm] = end
            self._depth.clear()
        p.notes.append((ts, window, float(note.exec_ms[0]), float(note.exec_ms[1]),
                        float(note.period_ms)))  # fmt: skip
        self._n_notes[(job, window)] = self._n_notes.get((job, window), 0) + 1

    def depth(self, job: str, comm: str) -> int:
        """Pairs before this one in its chain (the stage boundary it crosses)."""
        key = (job, comm)
        if key in self._depth:
            return self._depth[key]
        d, seen, cur = 0, {comm}, self.pairs[key]
        while True:
            prev = [c for c, end in self.member.get((job, cur.hosts[0], cur.gpus[0]), {}).items()
                    if end == 1 and c not in seen]  # fmt: skip
            if not prev:
                break
            seen.add(prev[0])
            cur = self.pairs[(job, prev[0])]
            d += 1
        self._depth[key] = d
        return d

    @staticmethod
    def _note_at(p: _Pair | _CellComm, ts: int) -> tuple | None:
        """The note of the window that covers ``ts`` (the last one ended by then plus a
        window of slack), else None."""
        best = None
        for n in p.notes:
            span = max(n[0] - n[1], 1)
            if n[0] <= ts + span and ts - n[0] <= 2 * span:
                best = n
        return best

    def _pair_ref(self, job: str, depth: int, end: int, window: int, ts: int):  # type: ignore[no-untyped-def]
        """(median, robust sigma, replicas) of end ``end`` of pairs at ``depth``."""
        k = (job, depth, end, window, self._n_notes.get((job, window), 0))
        if k in self._ref:
            return self._ref[k]
        xs = []
        for (j, c), p in self.pairs.items():
            if j != job or self.depth(j, c) != depth:
                continue
            n = self._note_at(p, ts)
            if n is not None:
                xs.append(n[2 + end])
        if len(xs) <= _MIN_REPLICAS:
            # not cached: the replicas' notes of the same time may come later, under
            # window starts of their own (windows close by collectives, not in step)
            return None
        a = np.array(xs)
        med = median(a)
        ref = (med, max(1.4826 * median(np.abs(a - med)), 0.01 * med, 1e-3), float(len(xs)))
        self._ref[k] = ref
        return ref

    def waited(self, job: str, host: str, gpu: int, ts: int) -> list[Waited]:
        """Pairs in which this GPU spent clearly more per collective than the same end
        of the pairs across the same stage boundary in the other replicas, around
        ``ts``: it waited for its neighbour stage (late, or its link slow)."""
        out: list[Waited] = []
        for comm, end in self.member.get((job, host, gpu), {}).items():
            p = self.pairs[(job, comm)]
            n = self._note_at(p, ts)
            if n is None:
                continue
            ref = self._pair_ref(job, self.depth(job, comm), end, n[1], ts)
            if ref is None:
                continue
            med, sigma, _ = ref
            excess = n[2 + end] - med
            period = max(n[4], 1e-3)
            if excess >= self.min_z * sigma and excess >= self.min_share * period:
                out.append(Waited(comm, p.hosts[1 - end], p.gpus[1 - end], excess, excess / period))
        return out

    def waited_for(self, job: str, host: str, gpu: int, ts: int) -> list[Waited]:
        """Pairs in which this GPU's neighbour stage waited clearly longer than its
        replicas: the stage they wait for (for the reason of a straggler)."""
        out: list[Waited] = []
        for comm, end in self.member.get((job, host, gpu), {}).items():
            p = self.pairs[(job, comm)]
            for w in self.waited(job, p.hosts[1 - end], p.gpus[1 - end], ts):
                if w.comm == comm:
                    out.append(Waited(comm, p.hosts[1 - end], p.gpus[1 - end], w.excess_ms,
                                      w.share))  # fmt: skip
        return out

    # ------------------------------------------------------------- cell families
    def observe_cells(
        self, job: str, comm: str, ts: int, window: int, note: Cells, shape: tuple[int, int, int]
    ) -> list[SlowCell]:
        """Take a small communicator's cells; returns the slow components they and their
        families show now (NIC or link, at most one finding per component)."""
        key = (job, comm)
        c = self.cells.get(key)
        if c is None:
            c = self.cells[key] = _CellComm(shape)
        c.notes.append((ts, window, note))
        for i in range(len(note.gbs)):
            fk = (job, shape, note.src[i], note.dst[i], note.peek)  # like with like
            per = self.fam.setdefault(fk, {})
            if comm not in per:
                per[comm] = deque(maxlen=_KEEP)
            end = note.gbs_end[i] if len(note.gbs_end) == len(note.gbs) else note.gbs[i]
            per[comm].append((window, ts, note.gbs[i], end))
            self._fam_upd[fk] = self._fam_upd.get(fk, 0) + 1
            for nic in ((note.src_host[i], note.src_nic[i]), (note.dst_host[i], note.dst_nic[i])):
                self.nic_comms.setdefault((job, *nic), set()).add(comm)
        out = self._judge(job, comm, ts, at_end=False)
        if any(c.whole for c in out) or any(c.kind != "nic" for c in out):
            return out
        # the window's end, for a whole NIC only, when its mean shows nothing else slow
        # (as a communicator's own matrix is judged: ConnMatrix.judge)
        late = [c for c in self._judge(job, comm, ts, at_end=True) if c.whole]
        if len(late) == 1 and all((c.host, c.nic) == (late[0].host, late[0].nic) for c in out):
            return late
        return out

    def _judge(self, job: str, comm: str, ts: int, at_end: bool) -> list[SlowCell]:
        """The slow components ``comm``'s cells show with their families, on the window's
        mean throughput or its end's (``Cells.gbs_end``, each against its family's end)."""
        mine = [r for r in self._rows(job, comm, ts, at_end) if r[2] < self.slow_ratio]
        if not mine:
            return []
        nics = {r[0] for r in mine} | {r[1] for r in mine}
        comms = set().union(*(self.nic_comms.get((job, *n), set()) for n in nics))
        rows = [r for cm in sorted(comms) for r in self._rows(job, cm, ts, at_end)]
        return self._blame(rows, mine)

    def _median(self, fk: tuple, start: int, end: int, col: int = 2) -> float | None:
        """The family's median cell over the same time as the window ``start``-``end``:
        each communicator's window that overlaps it by half of the shorter of the two
        (the same traffic at the same time: congestion of the whole fabric slows the
        replicas alike). Computed again for another window, or once a tenth of the
        family sent new notes since (a median moves little with a few more values;
        this keeps a window's notes linear in their number). "Another window" is one
        whose ends moved by more than a tenth of its span: the replicas' windows close
        at nearly the same time (each note is stamped when its window closed, so no
        two are equal), and the median over nearly the same time is nearly the same.
        ``col`` 2: of the windows' means; 3: of their ends."""
        upd = self._fam_upd.get(fk, 0)
        got = self._fam_med.get((*fk, col))
        vals = self.fam.get(fk, {})
        tol = 0.1 * max(end - start, 1)
        if (got is not None and abs(got[1] - start) <= tol and abs(got[2] - end) <= tol
                and upd - got[0] <= 0.1 * len(vals) and got[3] is not None):  # fmt: skip
            return got[3]
        xs = []
        for wins in vals.values():
            best, g_best = 0.0, 0.0
            for w in wins:
                s0, s1, g = w[0], w[1], w[col]
                over = min(end, s1) - max(start, s0)
                need = 0.5 * max(1, min(end - start, s1 - s0))
                if over >= need and over > best:
                    best, g_best = over, g
            if best > 0:
                xs.append(g_best)
        med = median(xs) if len(xs) > _MIN_REPLICAS else None
        self._fam_med[(*fk, col)] = (upd, start, end, med)
        return med

    def _rows(self, job: str, comm: str, ts: int, at_end: bool = False) -> list[tuple]:
        """The cells of one communicator's note around ``ts``, as (sender NIC, receiver
        NIC, ratio to the family median, that median, comm); ``at_end``: of the
        window's end."""
        cc = self.cells.get((job, comm))
        n = None if cc is None else self._note_at(cc, ts)
        if n is None:
            return []
        x = n[2]
        gbs = x.gbs_end if at_end and len(x.gbs_end) == len(x.gbs) else x.gbs
        out = []
        for i in range(len(x.gbs)):
            fk = (job, cc.shape, x.src[i], x.dst[i], x.peek)  # type: ignore[union-attr]
            m = self._median(fk, n[1], n[0], 3 if at_end else 2)
            if m is None or m <= 0:
                continue
            out.append(((x.src_host[i], x.src_nic[i]), (x.dst_host[i], x.dst_nic[i]),
                        gbs[i] / m, m, comm))  # fmt: skip
        return out

    def _blame(self, rows: list, mine: list) -> list[SlowCell]:
        """Which NIC or link explains each slow cell of ``mine``, from all ``rows``."""
        slow = [r for r in rows if r[2] < self.slow_ratio]

        def remotes(nic: tuple, cells: list) -> set[tuple]:
            return {r[1] if r[0] == nic else r[0] for r in cells if nic in (r[0], r[1])}

        def whole(nic: tuple) -> bool:
            through = [r for r in rows if nic in (r[0], r[1])]
            return (
                all(r[2] < self.slow_ratio for r in through)
                and any(r[0] == nic for r in through)
                and any(r[1] == nic for r in through)
                and all(nic in (r[0], r[1]) for r in slow)
            )

        out: dict[tuple, SlowCell] = {}
        for s, d, ratio, m, _ in mine:
            for end in (s, d):
                if len(remotes(end, slow)) >= 2:  # slow with two NICs or more: this NIC
                    mine_cells = [r[2] for r in slow if end in (r[0], r[1])]
                    out[("nic", end)] = SlowCell("nic", end[0], end[1], None,
                                                 float(median(mine_cells)), m / 1e3,
                                                 len(mine_cells), whole(end))  # fmt: skip
            if ("nic", s) in out or ("nic", d) in out:
                continue
            if len(remotes(d, slow)) >= 2 or len(remotes(s, slow)) >= 2:
                continue
            reverse = [r for r in rows if r[0] == d and r[1] == s]
            if reverse and all(r[2] >= self.slow_ratio for r in reverse):
                # one direction slow, the way back fine: neither NIC is slow as a whole
                out[("link", s, d)] = SlowCell("link", s[0], s[1], d[0], ratio, m / 1e3, 1)
            # both ways slow and nothing else tells the ends apart: name nobody (wait)
        return list(out.values())

    # ------------------------------------------------------------- upkeep
    @staticmethod
    def _old(notes: deque, now: int, horizon: int) -> bool:
        """The newest note is older than the horizon (or three of its windows)."""
        ts, start = notes[-1][0], notes[-1][1]
        return ts < now - max(horizon, 3 * (ts - start))

    def prune(self, job: str, now: int, horizon: int) -> None:
        """Forget communicators of ``job`` whose newest note is old (event time)."""
        cut = now - horizon
        for key in [k for k, p in self.pairs.items() if k[0] == job
                    and self._old(p.notes, now, horizon)]:  # fmt: skip
            p = self.pairs.pop(key)
            for end in (0, 1):
                m = self.member.get((job, p.hosts[end], p.gpus[end]))
                if m is not None:
                    m.pop(key[1], None)
                    if not m:
                        del self.member[(job, p.hosts[end], p.gpus[end])]
            self._depth.clear()
        for (j, _), p in self.pairs.items():
            if j == job:
                while len(p.notes) > 1 and self._old(deque([p.notes[0]]), now, horizon):
                    p.notes.popleft()
        for key in [k for k, c in self.cells.items() if k[0] == job
                    and self._old(c.notes, now, horizon)]:  # fmt: skip
            del self.cells[key]
        spans = {c: n.notes[-1][0] - n.notes[-1][1] for (j, c), n in self.cells.items() if j == job}
        for fk in [k for k in self.fam if k[0] == job]:
            vals = self.fam[fk]
            old = [
                cm
                for cm, wins in vals.items()
                if wins[-1][1] < now - max(horizon, 3 * spans.get(cm, 0))
            ]
            for cm in old:
                del vals[cm]
            if not vals:
                del self.fam[fk]
        live = {c for (j, c) in self.cells if j == job}
        for nk in [k for k in self.nic_comms if k[0] == job]:
            self.nic_comms[nk] &= live
            if not self.nic_comms[nk]:
                del self.nic_comms[nk]
        for wk in [k for k in self._n_notes if k[0] == job and k[1] < cut - horizon]:
            del self._n_notes[wk]
        self._ref.clear()
        self._fam_med.clear()

    def state(self) -> FamiliesState:
        return FamiliesState(
            pairs=[(j, c, list(p.hosts), list(p.gpus), [list(n) for n in p.notes])
                   for (j, c), p in self.pairs.items()],
            cells=[(j, c, list(cc.shape), [(n[0], n[1], n[2]) for n in cc.notes])
                   for (j, c), cc in self.cells.items()],
        )  # fmt: skip

    def load(self, st: FamiliesState) -> None:
        for job, comm, hosts, gpus, notes in st.pairs:
            if len(hosts) != 2 or len(gpus) != 2:
                raise ValueError("pair state: two hosts and two GPUs expected")
            for n in notes:
                self.observe_pair(job, comm, int(n[0]), int(n[1]),
                                  PairWait(hosts=hosts, gpus=gpus, exec_ms=[n[2], n[3]],
                                           period_ms=n[4]))  # fmt: skip
        for job, comm, shape, cnotes in st.cells:
            if len(shape) != 3:
                raise ValueError("cells state: a shape has three numbers")
            for ts, window, note in cnotes:
                self.observe_cells(job, comm, ts, window, note, (shape[0], shape[1], shape[2]))

    def forget_job(self, job: str) -> None:
        """Drop everything of ``job`` (every key starts with it)."""
        for d in (self.pairs, self.member, self.cells, self.fam, self.nic_comms,
                  self._fam_med, self._fam_upd, self._depth, self._ref, self._n_notes):  # fmt: skip
            for k in [k for k in d if k[0] == job]:
                del d[k]  # type: ignore[attr-defined]

    def nbytes(self) -> int:
        return 200 * len(self.pairs) + 400 * len(self.cells)
