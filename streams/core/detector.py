"""The contract every detector of a communicator follows, stated once.

A :class:`~streams.core.comm.CommDetector` owns what all detectors of one communicator
share (a :class:`CommView`: who each rank is, their latest counters, the learned
op/period normal, the event-time clock) and a list of :class:`Detector` objects chosen
by configuration (``DetectConfig.detectors``, section ``[worker.detect]``). Per
communicator, in event time:

1. **fed** — :meth:`Detector.learn` gets every batch of the communicator's events
   (a :class:`Batch`: op events sorted by (rank, seq) as arrays, progress events),
   after the shared view took it. It only accumulates; it never concludes.
2. **judges** — :meth:`Detector.close_window` when a window of ``window_us`` closes
   (``Window.judge`` is False during the warm-up: learn only), and
   :meth:`Detector.tick` at least every 0.5 s of event time (hangs, silence). A
   detector may also have ``peek(view, window) -> Output`` (optional, not in the
   protocol): the open window so far, once half of it has passed (a degrading NIC).
3. **returns** — a list of :class:`~streams.core.findings.Finding` (a fault claim with
   a ``score`` in [0, 1], higher = more certain, a reason sentence and typed evidence)
   and :class:`~streams.core.findings.Observation` (a note claiming no fault). The
   detector owns its reason text and its repeat suppression: the same fault still
   present is said again only when its own repeat interval has passed.

Every detector also keeps its state bounded per rank (:meth:`Detector.nbytes`) and
round-trips it through bytes (:meth:`Detector.dump` / ``load``) without pickle; the
contract suite (``tests/streams/test_detector_contract.py``) checks all of this for
every registered detector, as river's ``utils.estimator_checks`` does for estimators.

Adding a detector: write a class with these methods, register it in
:data:`streams.core.registry.DETECTORS` under a name, list the name in
``[worker.detect] detectors``; see docs/detectors.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from producers.events import OpEvent, ProgressEvent
from streams.core.config import DetectConfig
from streams.core.findings import Finding, Observation
from streams.core.ranks import RankTable
from streams.core.stats import NormalModel

__all__ = ["Batch", "CommView", "ConnArrays", "Detector", "Output", "ProgressConnArrays", "Window"]

Output = list[Finding | Observation]


@dataclass(slots=True)
class Batch:
    """One batch of a communicator's events, as the detectors read it."""

    ops: list[OpEvent]
    """Op events as received (for their per-connection figures)."""
    rank: np.ndarray
    """Op events' rank, sorted by (rank, seq); ``seq``, ``ts``, ``exec_us`` alike."""
    seq: np.ndarray
    ts: np.ndarray
    exec_us: np.ndarray
    distinct: list[int]
    """The batch's distinct seqs, ascending."""
    prog: list[ProgressEvent]
    prog_rank: np.ndarray
    """Progress events' rank, in arrival order; ``started``, ``completed`` alike."""
    started: np.ndarray
    completed: np.ndarray
    conns: ConnArrays | None = None
    """The connections of the ops that carry any, as arrays, when the batch came as
    columns (then a detector need not read ``ops``); None: read them from ``ops``."""
    prog_conns: ProgressConnArrays | None = None
    """The connections of the progress events, as arrays, when the columns had them
    (then a detector need not read ``prog``); None: read them from ``prog``."""


@dataclass(frozen=True, slots=True)
class ProgressConnArrays:
    """Per progress event (``Batch.prog`` order) its connections ``offsets[i]:offsets[i
    + 1]`` of the flat arrays: peer rank, send (else recv), bytes, retransmits (0 when
    absent); integers as the events carry them."""

    offsets: np.ndarray
    peer: np.ndarray
    send: np.ndarray
    nbytes: np.ndarray
    retrans: np.ndarray


@dataclass(frozen=True, slots=True)
class ConnArrays:
    """Per connection, in the order of ``Batch.ops``' connections: the op's rank and seq,
    the peer rank, send (else recv), bytes, time (0 when absent)."""

    rank: np.ndarray
    seq: np.ndarray
    peer: np.ndarray
    send: np.ndarray
    nbytes: np.ndarray
    time_us: np.ndarray


@dataclass(frozen=True, slots=True)
class Window:
    """An event-time window that just closed."""

    start: int
    end: int
    learn: bool
    """Past the start of the warm-up's last window: collectives count."""
    judge: bool
    """Past the warm-up: findings may be returned."""


class CommView:
    """What all detectors of one communicator share; written only by CommDetector."""

    def __init__(self, comm: str, config: DetectConfig) -> None:
        self.comm = comm
        self.config = config
        self.job = ""
        self.comm_name: str | None = None
        self.ranks = RankTable(0)
        self.model = NormalModel()
        self.now = -1
        self.first_us = -1
        self.p2p: bool | None = None
        """Its ops are Send/Recv (a pipeline pair), read from the first op object seen
        (ops that carry connections always come as objects); None: not known yet."""

    @property
    def label(self) -> str:
        return self.comm_name or self.comm

    def warm(self) -> bool:
        """Past the warm-up: seen ``warmup_us``, and past its first
        ``window_min_collectives`` collectives (what is normal for it, its period
        included, is learned from them: a 10-s step has one or two in 5 s), or seen
        ``window_max_us`` whatever it did."""
        cfg, age = self.config, self.now - self.first_us
        if age < cfg.warmup_us:
            return False
        if age >= cfg.window_max_us or not self.ranks.n:
            return True
        t = self.ranks  # collectives done: by op events, or by progress counters
        done = max(int(t.last_op_seq.max()) + 1, int(t.completed.max()))
        return done >= cfg.window_min_collectives

    def who(self, rank: int) -> str:
        t = self.ranks
        g = t.gpu_of(rank)
        gpu = f" GPU {g}" if g is not None else ""
        return f"{t.host_of(rank) or 'unknown host'}{gpu} (rank {rank} of {self.label})"

    def by_host(self, ranks: np.ndarray) -> dict[int, list[int]]:
        """Ranks grouped by host index, in rank order within a host."""
        by_host: dict[int, list[int]] = {}
        for r, hi in zip(ranks.tolist(), self.ranks.host_idx[ranks].tolist(), strict=True):
            by_host.setdefault(hi, []).append(r)
        return by_host


class Detector(Protocol):
    """One fault class's detector of one communicator (see the module docstring)."""

    name: ClassVar[str]
    """Its name in ``[worker.detect] detectors`` and in checkpoints."""

    def grow(self, nranks: int) -> None:
        """The communicator has (at least) this many ranks now."""

    def learn(self, view: CommView, batch: Batch) -> None:
        """Take a batch (already in ``view``); accumulate, conclude nothing."""

    def tick(self, view: CommView) -> Output:
        """The clock moved (at least every 0.5 s of event time): judge what is due."""

    def close_window(self, view: CommView, window: Window) -> Output:
        """A window closed: judge it when ``window.judge``, then start the next."""

    def dump(self) -> bytes:
        """Its state as checkpoint bytes (:mod:`streams.core.checkpoint`, no pickle)."""

    def nbytes(self) -> int:
        """Approximate bytes of state held: bounded per rank, whatever the run length."""
