"""Who each rank of a communicator is and what it last said (one row per rank, numpy).

State is a handful of fixed-width arrays, so it costs tens of bytes per rank and
updates from a whole batch of events at once.

>>> t = RankTable(4)
>>> t.learn_identity(2, "node-001", 3, "mlx5_3")
>>> t.host_of(2), t.gpu_of(2), t.nic_of(2), t.host_of(0)
('node-001', 3, 'mlx5_3', None)
"""

from __future__ import annotations

import numpy as np

__all__ = ["RankTable"]


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
