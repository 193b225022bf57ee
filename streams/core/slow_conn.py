"""Slow-connection evidence: the src×dst matrix of per-connection throughput.

Each op event may list its connections (bytes moved and time spent, per peer and
direction). Summed over a window they give one throughput per directed cell
sender→receiver. Cells are compared with the communicator's median inter-host cell
(everybody slow at once cancels out). Then, per rank:

- its sending cells (row) *and* receiving cells (column) slow → its NIC;
- all of ≥2 sending cells slow, or all of ≥2 receiving cells slow → its NIC;
- otherwise each remaining slow cell is a slow link sender→receiver.

A NIC is *whole* when every one of its connections here is slow, both ways (it sends
and receives), with two or more other ranks, and no other connection of the matrix is
slow: the slowness sits at that NIC. Congestion is a queue at a shared switch port, in
one direction (an oversubscribed uplink, or incast into a receiver), and it slows every
NIC's connections through that port: other cells, one direction. The correlator takes
one window of a whole NIC as enough; any other finding needs two. A whole NIC is also
judged at the window's *end* (:meth:`ConnMatrix.end_cells`: the trend of the window's
parts, by collective order), so a NIC that degrades is isolated at the end of the
window in which it crosses the bar, not half a window after its mean does.

Worked example, a six-host ring 0→1→…→5→0 where host 1's NIC runs at half speed:
cells (0,1) and (1,2) are slow; rank 1 has its one row cell and its one column cell
slow → slow NIC on host 1. Had only (1,2) been slow, it is the link 1→2.

>>> import numpy as np
>>> m = ConnMatrix()
>>> for s in range(6):
...     m.add(s, (s + 1) % 6, 1000, 200.0 if s in (0, 1) else 100.0)
>>> f = m.judge(np.arange(6), slow_ratio=0.75, min_cells=3)
>>> [(x.kind, x.rank, x.peer, x.whole) for x in f]
[('nic', 1, None, True)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import msgspec
import numpy as np

from producers.events import OpEvent
from streams.core import checkpoint as ck
from streams.core.config import DetectConfig
from streams.core.detector import Batch, CommView, ConnArrays, Output, Window
from streams.core.findings import Cells, Finding, Observation, SlowEvidence
from streams.core.stats import median, slow_score

__all__ = ["ConnMatrix", "SlowConnDetector", "SlowFinding"]


@dataclass(frozen=True, slots=True)
class SlowFinding:
    """A slow NIC (``kind='nic'``, at ``rank``) or link (``rank`` → ``peer``)."""

    kind: str
    rank: int
    peer: int | None
    ratio: float
    """Throughput of the culprit's cells over the communicator's median cell."""
    cells: int
    median_gbs: float
    whole: bool = False
    """A NIC with every connection slow, both ways, two or more peers, nothing else slow."""


class ConnMatrix:
    """Bytes and time per directed cell (sender rank, receiver rank) over one window,
    in up to ``PARTS`` parts of the window by collective order (sequence number).

    Batches are appended as numpy arrays and folded (``np.unique`` + ``bincount``) when
    they pile up, so the cost per connection is a few numpy element operations and
    the state is bounded by the number of distinct cells times ``PARTS``. A part spans
    a power of two of sequence numbers, doubled (two parts merged) when the window
    outgrows ``PARTS`` of them: the parts are what the window's trend is read from
    (:meth:`end_cells`).
    """

    _FOLD_AT = 64
    PARTS = 8

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._parts: list[tuple[np.ndarray, ...]] = []
        """(sender, receiver, seq from the window's first, bytes, time): raw records, or
        folded ones whose seq is their part's first"""
        self.seq0: int | None = None
        self.seq_end = 0
        """One past the window's last sequence number, from ``seq0``."""
        self.shift = 0
        """A part spans 2**shift sequence numbers."""

    def add(self, sender: int, receiver: int, nbytes: int, time_us: float, seq: int = 0) -> None:
        self.add_many(np.array([sender]), np.array([receiver]), np.array([float(nbytes)]),
                      np.array([float(time_us)]), np.array([seq]))  # fmt: skip

    def add_many(
        self, sender: np.ndarray, receiver: np.ndarray, nbytes: np.ndarray, time_us: np.ndarray,
        seq: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """``seq``: each record's collective (None: one moment, e.g. a window's totals)."""
        q = np.zeros(sender.size, np.int64) if seq is None else seq.astype(np.int64)
        if q.size:
            if self.seq0 is None:
                self.seq0 = int(q.min())
            q = np.maximum(q - self.seq0, 0)  # a record older than the window's first
            self.seq_end = max(self.seq_end, int(q.max()) + 1)
        self._parts.append((sender.astype(np.int64), receiver.astype(np.int64), q,
                            nbytes.astype(np.float64), time_us.astype(np.float64)))  # fmt: skip
        if len(self._parts) >= self._FOLD_AT:
            self._fold()

    def _fold(self) -> tuple[np.ndarray, ...]:
        if not self._parts:
            e = np.empty(0)
            return e.astype(np.int64), e.astype(np.int64), e.astype(np.int64), e, e
        s, d, q, b, t = (np.concatenate([p[i] for p in self._parts]) for i in range(5))
        while (self.seq_end - 1) >> self.shift >= self.PARTS:
            self.shift += 1
        part = q >> self.shift
        key = (((s << 32) | d) << 4) | part  # ranks below 2**27, parts below 16
        uk, inv = np.unique(key, return_inverse=True)
        folded = (uk >> 36, (uk >> 4) & 0xFFFFFFFF, (uk & 0xF) << self.shift,
                  np.bincount(inv, b, uk.size), np.bincount(inv, t, uk.size))  # fmt: skip
        self._parts = [folded]
        return folded

    def _totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per cell (over its parts): sender, receiver, bytes, time, and the index of
        each folded record's cell."""
        s, d, _, b, t = self._fold()
        uk, inv = np.unique((s << 32) | d, return_inverse=True)
        return uk >> 32, uk & 0xFFFFFFFF, np.bincount(inv, b, uk.size), \
            np.bincount(inv, t, uk.size), inv  # fmt: skip

    @property
    def cells(self) -> dict[tuple[int, int], list[float]]:
        s, d, b, t, _ = self._totals()
        return {
            (int(x), int(y)): [float(u), float(v)] for x, y, u, v in zip(s, d, b, t, strict=True)
        }

    def _inter(self, s: np.ndarray, d: np.ndarray, t: np.ndarray, host_idx: np.ndarray
               ) -> np.ndarray:  # fmt: skip
        ok = (t > 0) & (s < host_idx.size) & (d < host_idx.size)
        hs, hd = host_idx[np.where(ok, s, 0)], host_idx[np.where(ok, d, 0)]
        return ok & (hs >= 0) & (hd >= 0) & (hs != hd)

    def inter_cells(self, host_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The inter-host cells: sender rank, receiver rank, throughput (bytes/µs)."""
        s, d, b, t, _ = self._totals()
        i = self._inter(s, d, t, host_idx)
        return s[i], d[i], b[i] / t[i]

    def end_cells(self, host_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The inter-host cells with their throughput at the window's *end*: a straight
        line through the cell's parts (throughput per part against the part's middle),
        read at the end, when it falls; the window's mean when it does not fall or the
        cell has fewer than three parts. A window's mean is its middle's throughput: a
        link that degrades steadily is half a window lower at the end."""
        s, d, b, t, inv = self._totals()
        i = self._inter(s, d, t, host_idx)
        mean = np.divide(b, t, out=np.zeros(b.shape), where=t > 0)
        _, _, q, pb, pt = self._fold()
        n, span = s.size, max(self.seq_end, 1)
        x = (q + np.minimum(q + (1 << self.shift), span)) / (2 * span)  # middle; window = 1
        y = np.divide(pb, pt, out=np.zeros(pb.shape), where=pt > 0)
        w = pt  # a part weighs what it moved for: the time spent on it
        sw, sx, sy = (np.bincount(inv, v, n) for v in (w, w * x, w * y))
        sxx, sxy = np.bincount(inv, w * x * x, n), np.bincount(inv, w * x * y, n)
        parts = np.bincount(inv, (pt > 0).astype(np.float64), n)
        den = sw * sxx - sx * sx
        fit = (parts >= 3) & (den > 1e-12 * sw * sw)
        slope = np.divide(sw * sxy - sx * sy, den, out=np.zeros(n), where=fit)
        line_end = np.divide(sy + slope * (sw - sx), sw, out=mean.copy(), where=sw > 0)  # at x=1
        end = np.where(slope < 0, np.maximum(line_end, 0.0), mean)
        return s[i], d[i], end[i]

    def median_cells(self, host_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The inter-host cells (in :meth:`inter_cells`' order) with the median of their
        parts' throughput: what most of the collectives so far moved, which one
        collective caught by a passing queue (a slow transfer among three) moves little,
        where it pulls the mean of a few under the bar."""
        s, d, b, t, inv = self._totals()
        i = self._inter(s, d, t, host_idx)
        _, _, _, pb, pt = self._fold()
        y = pb / pt  # records with no time were dropped on the way in: pt > 0
        order = np.lexsort((y, inv))
        counts = np.bincount(inv, minlength=s.size)
        first = np.cumsum(counts) - counts
        ys = y[order]
        med = (ys[first + (counts - 1) // 2] + ys[first + counts // 2]) / 2
        return s[i], d[i], med[i]

    def judge(self, host_idx: np.ndarray, slow_ratio: float, min_cells: int) -> list[SlowFinding]:
        """Slow NICs and links of this window (inter-host cells only; NVLink is not a NIC).

        Judged on the window's mean; and on its end (:meth:`end_cells`) for a whole NIC
        only, when the mean shows nothing else slow: a NIC whose every connection both
        ways is under the bar at the window's end, falling, is degrading now."""
        s, d, tput = self.inter_cells(host_idx)
        out = _judge(s, d, tput, slow_ratio, min_cells)
        if any(f.whole for f in out) or any(f.kind != "nic" for f in out):
            return out
        se, de, te = self.end_cells(host_idx)
        late = [f for f in _judge(se, de, te, slow_ratio, min_cells) if f.whole]
        if len(late) == 1 and all(f.rank == late[0].rank for f in out):
            return late
        return out

    def nbytes(self) -> int:
        return sum(sum(a.nbytes for a in p) for p in self._parts)


def _judge(s: np.ndarray, d: np.ndarray, tput: np.ndarray, slow_ratio: float, min_cells: int
           ) -> list[SlowFinding]:  # fmt: skip
    """Slow NICs and links of directed inter-host cells ``s`` -> ``d`` moving ``tput``
    (see the module docstring)."""
    if s.size < min_cells:
        return []
    med = median(tput)
    if med <= 0:
        return []
    ratio = tput / med
    slow = ratio < slow_ratio
    if not slow.any() or slow.mean() > 0.34:  # a third of the fabric slow: not one part
        return []
    out: list[SlowFinding] = []
    explained = np.zeros(slow.size, bool)
    for r in np.unique(np.concatenate([s[slow], d[slow]])).tolist():
        row, col = s == r, d == r
        row_slow, col_slow = (row & slow).sum(), (col & slow).sum()
        row_all = row.sum() > 0 and row_slow == row.sum()
        col_all = col.sum() > 0 and col_slow == col.sum()
        is_nic = (row_slow > 0 and col_slow > 0 and (row_all or col_all)) or (
            (row_all and row.sum() >= 2) or (col_all and col.sum() >= 2)
        )
        if is_nic:
            mine = (row | col) & slow
            explained |= mine
            peers = np.unique(np.concatenate([d[row], s[col]])).size
            whole = row_all and col_all and peers >= 2
            out.append(SlowFinding("nic", int(r), None, median(ratio[mine]),
                                   int(mine.sum()), med / 1e3, whole))  # fmt: skip
    if len(out) != 1 or not explained[slow].all():  # other NICs or cells slow as well
        out = [replace(f, whole=False) for f in out]
    for i in np.flatnonzero(slow & ~explained).tolist():
        out.append(SlowFinding("link", int(s[i]), int(d[i]), float(ratio[i]), 1, med / 1e3))
    return out


class _SlowState(msgspec.Struct, array_like=True):
    sender: ck.Array
    receiver: ck.Array
    nbytes: ck.Array
    time_us: ck.Array
    conn_bytes: float = 0.0
    conn_n: int = 0
    """Schema 2: bytes and count of this window's connection records (message size)."""
    part_seq: ck.Array | None = None
    seq0: int | None = None
    seq_end: int = 0
    shift: int = 0
    """Schema 3: each folded record's part (its first seq from ``seq0``) and the parts'
    span (:class:`ConnMatrix`)."""


def _migrate_1(body: list) -> list:
    """Schema 1 -> 2: no message size yet (this window's is learned afresh)."""
    return [*body, 0.0, 0]


def _migrate_2(body: list) -> list:
    """Schema 2 -> 3: no parts yet (the window restored is one part: judged on its mean)."""
    return [*body, None, None, 0, 0]


class SlowConnDetector:
    """Slow NICs and links of one communicator, judged per window.

    Fed the per-connection figures of sampled collectives (one in
    ``conn_sample_every``, chosen by sequence number so every rank reports the same
    ones); per window, the src×dst throughput matrix against its median cell. The
    reference is the communicator's other connections in the same window, so a NIC
    slow from the first collective is found like one that slows later. One finding
    per NIC or link and window.
    """

    name: ClassVar[str] = "slow_conn"
    _SCHEMA: ClassVar[int] = 3

    def __init__(self, config: DetectConfig) -> None:
        self.config = config
        self.matrix = ConnMatrix()
        self.conn_bytes = 0.0
        self.conn_n = 0
        """This window's connection records: their bytes and count (the message size
        that puts a small communicator in a family with others of its shape)."""

    def grow(self, nranks: int) -> None:
        pass  # cells are kept only for the connections seen this window

    def learn(self, view: CommView, batch: Batch) -> None:
        # a pipeline pair alternates directions (forward, backward) from one collective
        # to the next: sampling one in two would see one direction only; its one
        # connection per op is cheap to read whole
        every = 1 if view.p2p else self.config.conn_sample_every
        c = batch.conns
        if c is not None:  # the columnar path: the same figures, already as arrays
            if every != 1 and len(c.seq):
                keep = c.seq % every == 0
                c = ConnArrays(c.rank[keep], c.seq[keep], c.peer[keep], c.send[keep],
                               c.nbytes[keep], c.time_us[keep])  # fmt: skip
            if len(c.rank):
                self._add_arrays(c.rank, c.peer, c.send, c.nbytes, c.time_us, c.seq)
            return
        if not batch.ops:
            return
        if every == 1:
            sel = [e for e in batch.ops if e.conns]
        else:
            sel = [e for e in batch.ops if e.conns and e.seq % every == 0]
        if sel:
            self._add_conns(sel)

    def _add_conns(self, sel: list[OpEvent]) -> None:
        """Per-connection figures of these ops into the window's throughput matrix."""
        flat = [c for e in sel for c in e.conns]  # type: ignore[union-attr]
        lens = np.array([len(e.conns) for e in sel], np.int64)  # type: ignore[arg-type]
        me = np.repeat(np.array([e.rank for e in sel], np.int64), lens)
        peer = np.array([c.peer for c in flat], np.int64)
        send = np.array([c.dir == "send" for c in flat], bool)
        nb = np.array([c.bytes for c in flat], np.float64)
        tu = np.array([c.time_us or 0.0 for c in flat], np.float64)
        seq = np.repeat(np.array([e.seq for e in sel], np.int64), lens)
        self._add_arrays(me, peer, send, nb, tu, seq)

    def add_totals(
        self, me: np.ndarray, peer: np.ndarray, send: np.ndarray, nb: np.ndarray,
        tu: np.ndarray, collectives: int,
    ) -> None:  # fmt: skip
        """A window's per-peer totals summarised at the source (each the sum over
        ``collectives`` collectives): into the matrix whole, not sampled by seq
        (:mod:`streams.core.summary_evidence`); one moment, so no trend is read from
        them (the window's mean is judged)."""
        self._add_arrays(me, peer, send, nb, tu, None, collectives)

    def _add_arrays(
        self, me: np.ndarray, peer: np.ndarray, send: np.ndarray, nb: np.ndarray,
        tu: np.ndarray, seq: np.ndarray | None, per_record: int = 1,
    ) -> None:  # fmt: skip
        ok = tu > 0
        snd, rcv = np.where(send, me, peer), np.where(send, peer, me)
        if not ok.all():
            snd, rcv, nb, tu = snd[ok], rcv[ok], nb[ok], tu[ok]
            seq = None if seq is None else seq[ok]
        self.conn_bytes += float(nb.sum())
        self.conn_n += int(nb.size) * per_record  # the message size: bytes per collective
        self.matrix.add_many(snd, rcv, nb, tu, seq)

    def tick(self, view: CommView) -> Output:
        return []

    def peek(self, view: CommView, window: Window) -> Output:
        """Half a window in (:meth:`CommDetector._half_window`): the window so far, for a
        whole NIC (the one finding a single window settles) and, for a small
        communicator, its cells (its replicas note theirs at the same moment, so the
        family compares the same time). Each cell is read at the median of its parts
        (:meth:`ConnMatrix.median_cells`): half a window holds few collectives, and a
        queue that passes through the fabric slows one of them on every NIC whose
        transfers it catches, both ways. A NIC that crosses the bar just after a
        window's end is under it in every collective since: found half a window later,
        not at the next end."""
        if not window.judge:
            return []
        cfg, host_idx = self.config, view.ranks.host_idx
        s, d, med = self.matrix.median_cells(host_idx)
        found = [f for f in _judge(s, d, med, cfg.slow_ratio, cfg.slow_min_cells) if f.whole]
        out: Output = [self._finding(view, f, window.start, window.end) for f in found]
        return out + self._cells_note(view, window, (s, d, med, med), peek=True)

    def close_window(self, view: CommView, window: Window) -> Output:
        out: Output = []
        if window.judge:
            cfg = self.config
            found = self.matrix.judge(view.ranks.host_idx, cfg.slow_ratio, cfg.slow_min_cells)
            out = [self._finding(view, f, window.start, window.end) for f in found]
            out += self._cells_note(view, window)
        self.matrix.reset()
        self.conn_bytes, self.conn_n = 0.0, 0
        return out

    def _cells_note(
        self, view: CommView, window: Window, read: tuple[np.ndarray, ...] | None = None,
        peek: bool = False,
    ) -> Output:  # fmt: skip
        """A communicator with too few inter-host cells for its own matrix: its cells,
        for the correlator to compare with the communicators of its shape
        (:mod:`streams.core.family`). ``read``: the cells as already read (sender,
        receiver, throughput, at the end); else the window's means and its end."""
        t = view.ranks
        if read is None:
            s, d, tput = self.matrix.inter_cells(t.host_idx)
            at_end = None
        else:
            s, d, tput, at_end = read
        if not s.size or s.size >= self.config.family_max_cells or self.conn_n == 0:
            return []
        if at_end is None:  # the same cells, in the same order
            _, _, at_end = self.matrix.end_cells(t.host_idx)
        size = int(round(math.log2(max(self.conn_bytes / self.conn_n, 1.0))))
        sl, dl = s.tolist(), d.tolist()
        note = Cells(
            src=sl, dst=dl, src_host=[t.host_of(r) or "" for r in sl],
            src_nic=[t.nic_of(r) for r in sl], dst_host=[t.host_of(r) or "" for r in dl],
            dst_nic=[t.nic_of(r) for r in dl], gbs=[round(x / 1e3, 4) for x in tput.tolist()],
            gbs_end=[round(x / 1e3, 4) for x in at_end.tolist()], size_log2=size,
            p2p=bool(view.p2p), peek=peek,
        )  # fmt: skip
        cells = ", ".join(
            f"{a} -> {b} {g:.1f} GB/s" for a, b, g in zip(note.src_host, note.dst_host, note.gbs,
                                                         strict=True)
        )  # fmt: skip
        reason = f"{view.label} moved {cells} this window."
        return [Observation("slow_link", note.src_host[0], reason, window.start, window.end,
                            note, sorted(set(sl + dl)))]  # fmt: skip

    def dump(self) -> bytes:
        m = self.matrix
        s, d, q, b, t = m._fold()
        st = _SlowState(ck.pack(s), ck.pack(d), ck.pack(b), ck.pack(t), self.conn_bytes,
                        self.conn_n, ck.pack(q), m.seq0, m.seq_end, m.shift)  # fmt: skip
        return ck.encode(self.name, self._SCHEMA, st)

    @classmethod
    def load(cls, data: bytes, config: DetectConfig) -> SlowConnDetector:
        st = ck.decode(data, cls.name, {cls._SCHEMA: _SlowState},
                       {1: _migrate_1, 2: _migrate_2})  # fmt: skip
        d = cls(config)
        d.conn_bytes, d.conn_n = float(st.conn_bytes), int(st.conn_n)
        s, r, b, t = (ck.unpack(x) for x in (st.sender, st.receiver, st.nbytes, st.time_us))
        q = np.zeros(s.shape, np.int64) if st.part_seq is None else ck.unpack(st.part_seq)
        parts = (s, r, q.astype(np.int64), b, t)
        if len({p.shape for p in parts}) != 1 or s.ndim != 1:
            raise ck.CheckpointError("slow_conn state: cell arrays differ in shape")
        m = d.matrix
        if (
            st.shift < 0
            or st.seq_end < 0
            or (q.size and int(q.max()) >= st.seq_end + (1 << st.shift))
        ):
            raise ck.CheckpointError("slow_conn state: parts outside the window")
        m.seq0, m.seq_end, m.shift = (
            st.seq0,
            max(int(st.seq_end), 1 if s.size else 0),
            int(st.shift),
        )
        if s.size:
            m._parts = [parts]
        return d

    def nbytes(self) -> int:
        return self.matrix.nbytes() + 100

    def _finding(self, view: CommView, f: SlowFinding, start: int, end: int) -> Finding:
        t = view.ranks
        host, nic = t.host_of(f.rank), t.nic_of(f.rank)
        ev = SlowEvidence(
            throughput_ratio=round(f.ratio, 3), cells=f.cells, median_gbs=round(f.median_gbs, 3),
            whole_nic=f.whole,
        )  # fmt: skip
        score = slow_score(f.ratio, self.config.slow_ratio)
        if f.kind == "nic":
            reason = (
                f"{host} {nic or 'NIC'} moves {f.ratio:.0%} of the median throughput of "
                f"{view.label} on its {f.cells} connections "
                f"(median {f.median_gbs:.1f} GB/s)."
            )
            return Finding("slow_nic", f.rank, score, reason, start, end, ev, [f.rank], nic=nic)
        assert f.peer is not None
        peer = t.host_of(f.peer)
        reason = (
            f"link {host} {nic or ''} -> {peer} moves {f.ratio:.0%} of the median "
            f"throughput of {view.label} (median {f.median_gbs:.1f} GB/s)."
        )
        return Finding("slow_link", f.rank, score, reason, start, end, ev, [f.rank, f.peer],
                       nic=nic, peer_host=peer)  # fmt: skip
