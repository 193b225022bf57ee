"""Who each rank of a communicator is and what it last said (one row per rank, numpy).

State is a handful of fixed-width arrays, so it costs tens of bytes per rank and
updates from a whole batch of events at once.

>>> t = RankTable(4)
>>> t.learn_identity(2, "node-001", 3, "mlx5_3")
>>> t.host_of(2), t.gpu_of(2), t.nic_of(2), t.host_of(0)
('node-001', 3, 'mlx5_3', None)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

__all__ = ["RankTable", "RankTableGroup"]


class RankTable:
    """Identity (host, GPU, NIC) and latest counters of every rank of one communicator."""

    def __init__(self, nranks: int) -> None:
        self.n = 0
        self.hosts: list[str] = []
        self._host_ix: dict[str, int] = {}
        self.nics: list[str] = []
        self._nic_ix: dict[str, int] = {}
        self.host_idx = np.empty(0, np.int32)
        self.gpu = np.empty(0, np.int16)
        self.nic_idx = np.empty(0, np.int16)
        self.started = np.empty(0, np.int64)
        self.completed = np.empty(0, np.int64)
        self.inflight_us = np.empty(0, np.float64)
        self.prog_recv = np.empty(0, np.int64)
        """Communicator clock when this rank's latest progress event was received."""
        self.last_recv = np.empty(0, np.int64)
        """Communicator clock when anything from this rank was last received (-1: never)."""
        self.last_op_ts = np.empty(0, np.int64)
        self.last_op_seq = np.empty(0, np.int64)
        self.grow(nranks)

    def grow(self, nranks: int) -> None:
        """Make room for ``nranks`` ranks (a communicator never shrinks)."""
        if nranks <= self.n:
            return
        add = nranks - self.n

        def ext(a: np.ndarray, fill: float) -> np.ndarray:
            if not a.size:  # a new communicator: no copy
                return np.full(add, fill, a.dtype)
            return np.concatenate([a, np.full(add, fill, a.dtype)])

        self.host_idx = ext(self.host_idx, -1)
        self.gpu = ext(self.gpu, -1)
        self.nic_idx = ext(self.nic_idx, -1)
        self.started = ext(self.started, -1)
        self.completed = ext(self.completed, -1)
        self.inflight_us = ext(self.inflight_us, 0.0)
        self.prog_recv = ext(self.prog_recv, -1)
        self.last_recv = ext(self.last_recv, -1)
        self.last_op_ts = ext(self.last_op_ts, -1)
        self.last_op_seq = ext(self.last_op_seq, -2)
        self.n = nranks

    def learn_identity(self, rank: int, host: str, gpu: int | None, nic: str | None) -> None:
        hi = self._host_ix.get(host)
        if hi is None:
            hi = self._host_ix[host] = len(self.hosts)
            self.hosts.append(host)
        self.host_idx[rank] = hi
        if gpu is not None:
            self.gpu[rank] = gpu
        if nic is not None:
            ni = self._nic_ix.get(nic)
            if ni is None:
                ni = self._nic_ix[nic] = len(self.nics)
                self.nics.append(nic)
            self.nic_idx[rank] = ni

    def host_of(self, rank: int) -> str | None:
        hi = int(self.host_idx[rank]) if 0 <= rank < self.n else -1
        return self.hosts[hi] if hi >= 0 else None

    def gpu_of(self, rank: int) -> int | None:
        g = int(self.gpu[rank]) if 0 <= rank < self.n else -1
        return g if g >= 0 else None

    def nic_of(self, rank: int) -> str | None:
        ni = int(self.nic_idx[rank]) if 0 <= rank < self.n else -1
        return self.nics[ni] if ni >= 0 else None

    def n_hosts(self) -> int:
        return len(self.hosts)

    def nbytes(self) -> int:
        """Approximate bytes held (for the state-size benchmark)."""
        arrays = (
            self.host_idx,
            self.gpu,
            self.nic_idx,
            self.started,
            self.completed,
            self.inflight_us,
            self.prog_recv,
            self.last_recv,
            self.last_op_ts,
            self.last_op_seq,
        )
        return sum(a.nbytes for a in arrays) + 64 * (len(self.hosts) + len(self.nics))


_COUNTERS = ("last_recv", "last_op_ts", "last_op_seq", "started", "completed", "inflight_us",
             "prog_recv")  # fmt: skip


class RankTableGroup:
    """The per-batch counters of many communicators' rank tables laid out together, so
    that a slice's updates of all of them are a few numpy writes (:meth:`update_many`)
    instead of seven per communicator.

    Each table's counter arrays become views (one band each) of one shared array per
    counter, so the table itself — its readers, :meth:`RankTable.grow`, checkpoints —
    works as before and sees what the group wrote. A table whose arrays are no longer
    views of the group's (it grew, or came back from a checkpoint) is laid out again,
    with those laid out before that still are. What is written is what
    :class:`~streams.core.comm.CommDetector` writes one communicator at a time
    (``tests/streams/test_core_group.py`` checks the state is the same)."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._where: dict[int, int] = {}
        """id(table) -> its first row in the shared arrays."""
        self._members: list[weakref.ref[RankTable]] = []
        self.n_layouts = 0

    def _fits(self, tables: Sequence[RankTable]) -> bool:
        arrays = self._arrays
        if not arrays:
            return False
        for t in tables:
            if id(t) not in self._where:
                return False
            for k, big in arrays.items():
                if getattr(t, k).base is not big:
                    return False
        return True

    def _lay_out(self, tables: Sequence[RankTable]) -> None:
        new = {id(t) for t in tables}
        kept = [t for t in (w() for w in self._members) if t is not None and id(t) not in new]
        tables = list(tables) + [t for t in kept if self._fits([t])]
        total = sum(t.n for t in tables)
        arrays = {k: np.empty(total, getattr(tables[0], k).dtype) for k in _COUNTERS}
        self._where, off = {}, 0
        for t in tables:
            for k, big in arrays.items():
                big[off : off + t.n] = getattr(t, k)
                setattr(t, k, big[off : off + t.n])
            self._where[id(t)] = off
            off += t.n
        self._arrays = arrays
        self._members = [weakref.ref(t) for t in tables]
        self.n_layouts += 1

    def update_many(
        self, tables: Sequence[RankTable], nows: Sequence[int], recv: Sequence[np.ndarray],
        last: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray] | None],
        prog: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    ) -> None:  # fmt: skip
        """For each table (its communicator's clock ``nows``): the ranks ``recv`` heard
        from now; ``last``: each rank's last op (ranks, ts, seq) or None; ``prog``: the
        progress events (ranks, started, completed, in-flight µs; in arrival order,
        the last of a rank wins)."""
        if not self._fits(tables):
            self._lay_out(tables)
        a, where = self._arrays, self._where
        off = np.fromiter((where[id(t)] for t in tables), np.int64, len(tables))
        now = np.asarray(nows, np.int64)

        def at(ranks: Sequence[np.ndarray], offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            sizes = np.fromiter(map(len, ranks), np.int64, len(ranks))
            seg = np.repeat(np.arange(len(ranks)), sizes)
            return np.concatenate(ranks) + offs[seg], seg

        i, seg = at(recv, off)
        a["last_recv"][i] = now[seg]
        has = [k for k, x in enumerate(last) if x is not None]
        if has:
            got = [last[k] for k in has]
            i, _ = at([x[0] for x in got], off[has])  # type: ignore[index]
            a["last_op_ts"][i] = np.concatenate([x[1] for x in got])  # type: ignore[index]
            a["last_op_seq"][i] = np.concatenate([x[2] for x in got])  # type: ignore[index]
        i, seg = at([p[0] for p in prog], off)
        if len(i):
            a["started"][i] = np.concatenate([p[1] for p in prog])
            a["completed"][i] = np.concatenate([p[2] for p in prog])
            a["inflight_us"][i] = np.concatenate([p[3] for p in prog])
            a["prog_recv"][i] = now[seg]
