"""Slow-connection evidence: the src×dst matrix of per-connection throughput.

Each op event may list its connections (bytes moved and time spent, per peer and
direction). Summed over a window they give one throughput per directed cell
sender→receiver. Cells are compared with the communicator's median inter-host cell
(everybody slow at once cancels out). Then, per rank:

- its sending cells (row) *and* receiving cells (column) slow → its NIC;
- all of ≥2 sending cells slow, or all of ≥2 receiving cells slow → its NIC;
- otherwise each remaining slow cell is a slow link sender→receiver.

Worked example, a six-host ring 0→1→…→5→0 where host 1's NIC runs at half speed:
cells (0,1) and (1,2) are slow; rank 1 has its one row cell and its one column cell
slow → slow NIC on host 1. Had only (1,2) been slow, it is the link 1→2.

>>> import numpy as np
>>> m = ConnMatrix()
>>> for s in range(6):
...     m.add(s, (s + 1) % 6, 1000, 200.0 if s in (0, 1) else 100.0)
>>> f = m.judge(np.arange(6), slow_ratio=0.75, min_cells=3)
>>> [(x.kind, x.rank, x.peer) for x in f]
[('nic', 1, None)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


class ConnMatrix:
    """Bytes and time per directed cell (sender rank, receiver rank) over one window.

    Batches are appended as numpy arrays and folded (``np.unique`` + ``bincount``) when
    they pile up, so the cost per connection is a few numpy element operations and
    the state is bounded by the number of distinct cells.
    """

    _FOLD_AT = 64

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, sender: int, receiver: int, nbytes: int, time_us: float) -> None:
        self.add_many(np.array([sender]), np.array([receiver]), np.array([float(nbytes)]),
                      np.array([float(time_us)]))  # fmt: skip

    def add_many(
        self, sender: np.ndarray, receiver: np.ndarray, nbytes: np.ndarray, time_us: np.ndarray
    ) -> None:
        self._parts.append((sender.astype(np.int64), receiver.astype(np.int64),
                            nbytes.astype(np.float64), time_us.astype(np.float64)))  # fmt: skip
        if len(self._parts) >= self._FOLD_AT:
            self._fold()

    def _fold(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if not self._parts:
            e = np.empty(0)
            return e.astype(np.int64), e.astype(np.int64), e, e
        s = np.concatenate([p[0] for p in self._parts])
        d = np.concatenate([p[1] for p in self._parts])
        b = np.concatenate([p[2] for p in self._parts])
        t = np.concatenate([p[3] for p in self._parts])
        key = (s << 32) | d
        uk, inv = np.unique(key, return_inverse=True)
        folded = (uk >> 32, uk & 0xFFFFFFFF, np.bincount(inv, b), np.bincount(inv, t))
        self._parts = [folded]
        return folded

    @property
    def cells(self) -> dict[tuple[int, int], list[float]]:
        s, d, b, t = self._fold()
        return {
            (int(x), int(y)): [float(u), float(v)] for x, y, u, v in zip(s, d, b, t, strict=True)
        }

    def inter_cells(self, host_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The inter-host cells: sender rank, receiver rank, throughput (bytes/µs)."""
        s, d, b, t = self._fold()
        ok = (t > 0) & (s < host_idx.size) & (d < host_idx.size)
        s, d, b, t = s[ok], d[ok], b[ok], t[ok]
        hs, hd = host_idx[s], host_idx[d]
        inter = (hs >= 0) & (hd >= 0) & (hs != hd)
        return s[inter], d[inter], b[inter] / t[inter]

    def judge(self, host_idx: np.ndarray, slow_ratio: float, min_cells: int) -> list[SlowFinding]:
        """Slow NICs and links of this window (inter-host cells only; NVLink is not a NIC)."""
        s, d, b, t = self._fold()
        if s.size < min_cells:
            return []
        vals = np.stack([b, t], axis=1)
        ok = (vals[:, 1] > 0) & (s < host_idx.size) & (d < host_idx.size)
        s, d, vals = s[ok], d[ok], vals[ok]
        hs, hd = host_idx[s], host_idx[d]
        inter = (hs >= 0) & (hd >= 0) & (hs != hd)
        if inter.sum() < min_cells:
            return []
        s, d, vals = s[inter], d[inter], vals[inter]
        tput = vals[:, 0] / vals[:, 1]  # bytes per µs = MB/s
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
                out.append(
                    SlowFinding(
                        "nic",
                        int(r),
                        None,
                        median(ratio[mine]),
                        int(mine.sum()),
                        med / 1e3,
                    )
                )
        for i in np.flatnonzero(slow & ~explained).tolist():
            out.append(SlowFinding("link", int(s[i]), int(d[i]), float(ratio[i]), 1, med / 1e3))
        return out

    def nbytes(self) -> int:
        return sum(sum(a.nbytes for a in p) for p in self._parts)


class _SlowState(msgspec.Struct, array_like=True):
    sender: ck.Array
    receiver: ck.Array
    nbytes: ck.Array
    time_us: ck.Array
    conn_bytes: float = 0.0
    conn_n: int = 0
    """Schema 2: bytes and count of this window's connection records (message size)."""


def _migrate_1(body: list) -> list:
    """Schema 1 -> 2: no message size yet (this window's is learned afresh)."""
    return [*body, 0.0, 0]


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
    _SCHEMA: ClassVar[int] = 2

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
                self._add_arrays(c.rank, c.peer, c.send, c.nbytes, c.time_us)
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
        self._add_arrays(me, peer, send, nb, tu)

    def _add_arrays(
        self, me: np.ndarray, peer: np.ndarray, send: np.ndarray, nb: np.ndarray, tu: np.ndarray
    ) -> None:
        ok = tu > 0
        snd, rcv = np.where(send, me, peer), np.where(send, peer, me)
        if not ok.all():
            snd, rcv, nb, tu = snd[ok], rcv[ok], nb[ok], tu[ok]
        self.conn_bytes += float(nb.sum())
        self.conn_n += int(nb.size)
        self.matrix.add_many(snd, rcv, nb, tu)

    def tick(self, view: CommView) -> Output:
        return []

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

    def _cells_note(self, view: CommView, window: Window) -> Output:
        """A communicator with too few inter-host cells for its own matrix: its cells,
        for the correlator to compare with the communicators of its shape
        (:mod:`streams.core.family`)."""
        t = view.ranks
        s, d, tput = self.matrix.inter_cells(t.host_idx)
        if not s.size or s.size >= self.config.family_max_cells or self.conn_n == 0:
            return []
        size = int(round(math.log2(max(self.conn_bytes / self.conn_n, 1.0))))
        sl, dl = s.tolist(), d.tolist()
        note = Cells(
            src=sl, dst=dl, src_host=[t.host_of(r) or "" for r in sl],
            src_nic=[t.nic_of(r) for r in sl], dst_host=[t.host_of(r) or "" for r in dl],
            dst_nic=[t.nic_of(r) for r in dl], gbs=[round(x / 1e3, 4) for x in tput.tolist()],
            size_log2=size, p2p=bool(view.p2p),
        )  # fmt: skip
        cells = ", ".join(
            f"{a} -> {b} {g:.1f} GB/s" for a, b, g in zip(note.src_host, note.dst_host, note.gbs,
                                                         strict=True)
        )  # fmt: skip
        reason = f"{view.label} moved {cells} this window."
        return [Observation("slow_link", note.src_host[0], reason, window.start, window.end,
                            note, sorted(set(sl + dl)))]  # fmt: skip

    def dump(self) -> bytes:
        s, d, b, t = self.matrix._fold()
        st = _SlowState(ck.pack(s), ck.pack(d), ck.pack(b), ck.pack(t), self.conn_bytes,
                        self.conn_n)  # fmt: skip
        return ck.encode(self.name, self._SCHEMA, st)

    @classmethod
    def load(cls, data: bytes, config: DetectConfig) -> SlowConnDetector:
        st = ck.decode(data, cls.name, {cls._SCHEMA: _SlowState}, {1: _migrate_1})
        d = cls(config)
        d.conn_bytes, d.conn_n = float(st.conn_bytes), int(st.conn_n)
        parts = tuple(ck.unpack(x) for x in (st.sender, st.receiver, st.nbytes, st.time_us))
        if len({p.shape for p in parts}) != 1 or parts[0].ndim != 1:
            raise ck.CheckpointError("slow_conn state: cell arrays differ in shape")
        if parts[0].size:
            d.matrix._parts = [parts]  # type: ignore[list-item]
        return d

    def nbytes(self) -> int:
        return self.matrix.nbytes() + 100

    def _finding(self, view: CommView, f: SlowFinding, start: int, end: int) -> Finding:
        t = view.ranks
        host, nic = t.host_of(f.rank), t.nic_of(f.rank)
        ev = SlowEvidence(
            throughput_ratio=round(f.ratio, 3), cells=f.cells, median_gbs=round(f.median_gbs, 3)
        )
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
