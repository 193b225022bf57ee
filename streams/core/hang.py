"""Hang evidence: who is behind, who is silent, which connections stopped.

A hung collective never completes, so its only trace is in progress heartbeats:
``started``/``completed`` counters, the in-flight time measured by each rank's own
clock, and cumulative bytes (and retransmits) per connection of the in-flight op.

- **Non-communication hang**: most live ranks sit in collective N far longer than this
  communicator's normal (learned) while some ranks have not started N (counter behind)
  or went silent. Those ranks are the culprits; the waiting ones are victims.
- **Communication hang**: every rank started N, nobody completes. The connections
  whose retransmits grow (or, failing that, whose bytes stopped while others moved)
  name the sender NIC / link.

>>> import numpy as np
>>> from streams.core.ranks import RankTable
>>> t = RankTable(4)
>>> t.started[:] = [8, 8, 7, 8]; t.completed[:] = [7, 7, 7, 7]
>>> t.inflight_us[:] = [9e6, 9e6, 0, 9e6]; t.prog_recv[:] = 100; t.last_recv[:] = 100
>>> f = judge_hang(t, now=100, thr_us=2e6, silent_us=3_000_000, min_waiting_frac=0.5,
...                max_culprit_frac=0.34)
>>> f.kind, f.culprits.tolist(), f.target
('noncomm', [2], 8)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import msgspec
import numpy as np

from streams.core import checkpoint as ck
from streams.core.config import DetectConfig
from streams.core.detector import Batch, CommView, Output, Window
from streams.core.findings import (
    CommHangEvidence,
    Finding,
    HangEvidence,
    Observation,
    Silent,
    Waiting,
)
from streams.core.ranks import RankTable
from streams.core.stats import median

__all__ = ["HangDetector", "HangFinding", "ProgressConns", "judge_hang", "localize_stalled"]

_NEVER = -(2**62)


def _s(us: float) -> str:
    return f"{us / 1e6:.1f} s"


@dataclass(slots=True)
class HangFinding:
    kind: str  # "noncomm" | "comm"
    target: int
    """The collective (started counter) the waiting ranks sit in."""
    culprits: np.ndarray
    silent: np.ndarray
    waiting: np.ndarray
    wait_us: float
    """Median in-flight time of the waiting ranks (their own clocks), extrapolated to now."""
    extra: dict = field(default_factory=dict)


def judge_hang(
    t: RankTable,
    now: int,
    thr_us: float,
    silent_us: int,
    min_waiting_frac: float,
    max_culprit_frac: float,
    expect_all: bool = False,
    sending: np.ndarray | None = None,
) -> HangFinding | None:
    """Classify the communicator's state at ``now``; ``None`` when nothing is hung.

    ``sending``: ranks whose in-flight op is a point-to-point Send (only send
    connections). A posted Send holds nobody up: its rank computes on meanwhile (the
    Send runs on its own stream), and the receiver posts its Recv when its own schedule
    reaches it — a pipeline stage busy with another microbatch. A rank behind is a
    culprit only while someone is blocked on it (a Recv, or a collective that needs
    everyone); when only senders wait, nothing is hung. A stopped receiver is still
    found: the sender soon blocks in a Recv from it, and its other communicators stop."""
    seen = t.last_recv >= 0
    if seen.sum() < 2:
        return None
    stale = now - t.last_recv
    silent = seen & (stale > silent_us)
    if expect_all:  # past start-up, a rank never heard from is silent too
        silent |= ~seen
    alive = seen & ~silent
    n_alive = int(alive.sum())
    if n_alive < 1:
        return None
    infl = alive & (t.started > t.completed)
    est = np.where(infl, t.inflight_us + (now - t.prog_recv), 0.0)
    waiting = infl & (est > thr_us)
    n_wait = int(waiting.sum())
    if n_wait < max(1, min_waiting_frac * n_alive):
        return None
    target = int(t.started[waiting].max())
    waiting &= t.started == target
    behind = alive & (t.started < target) & (t.started >= 0)
    culprits = behind | silent
    wait_us = median(est[waiting]) if waiting.any() else 0.0
    n_cul = int(culprits.sum())
    if n_cul:
        if n_cul > max(1, max_culprit_frac * t.n):
            return None
        if sending is not None and not (waiting & ~sending).any():
            return None  # only posted Sends wait: nobody is blocked (see above)
        return HangFinding(
            "noncomm",
            target,
            np.flatnonzero(culprits),
            np.flatnonzero(silent),
            np.flatnonzero(waiting),
            wait_us,
        )
    if int(waiting.sum()) >= 0.9 * t.n and (t.completed[alive] < target).all():
        return HangFinding(
            "comm",
            target,
            np.empty(0, np.int64),
            np.empty(0, np.int64),
            np.flatnonzero(waiting),
            wait_us,
        )
    return None


class ProgressConns:
    """Per-connection progress of in-flight ops: bytes stalls and retransmit growth.

    Keyed by reporting rank, then (peer, dir). Entries of a rank are dropped when it has
    nothing in flight, so state is bounded by the connections of in-flight ops.
    """

    def __init__(self) -> None:
        # rank -> {(peer, is_send): [started, bytes, retrans, stalls, retrans_growth, moved]}
        self.by_rank: dict[int, dict[tuple[int, bool], list[int]]] = {}

    def drop(self, rank: int) -> None:
        self.by_rank.pop(rank, None)

    def update(self, rank: int, started: int, conns: list) -> None:
        mine = self.by_rank.setdefault(rank, {})
        for c in conns:
            key = (c.peer, c.dir == "send")
            rt = c.retrans or 0
            e = mine.get(key)
            if e is None or e[0] != started:
                mine[key] = [started, c.bytes, rt, 0, 0, 0]
                continue
            moved = c.bytes - e[1]
            e[3] = e[3] + 1 if moved <= 0 else 0
            e[4] += max(0, rt - e[2])
            e[5] += max(0, moved)
            e[1], e[2] = c.bytes, rt

    def update_arrays(
        self, rank: int, started: int, peer: list[int], send: list[bool], nbytes: list[int],
        retrans: list[int],
    ) -> None:  # fmt: skip
        """:meth:`update` of one event's connections given as lists (the column path)."""
        mine = self.by_rank.setdefault(rank, {})
        for key, b, rt in zip(zip(peer, send, strict=True), nbytes, retrans, strict=True):
            e = mine.get(key)
            if e is None or e[0] != started:
                mine[key] = [started, b, rt, 0, 0, 0]
                continue
            moved = b - e[1]
            e[3] = e[3] + 1 if moved <= 0 else 0
            e[4] += max(0, rt - e[2])
            e[5] += max(0, moved)
            e[1], e[2] = b, rt

    def nbytes(self) -> int:
        return sum(100 + 120 * len(v) for v in self.by_rank.values())


def localize_stalled(pc: ProgressConns, target: int) -> list[tuple[int, int, str]]:
    """Directed cells (sender, receiver) to blame for a communication hang, with why.

    Retransmits growing on a connection are the strongest sign; without them, a
    connection whose bytes stopped while most others still moved.
    """
    cells: dict[tuple[int, int], list[int]] = {}
    for rank, conns in pc.by_rank.items():
        for (peer, is_send), e in conns.items():
            if e[0] != target:
                continue
            cell = (rank, peer) if is_send else (peer, rank)
            agg = cells.setdefault(cell, [0, 0, 0])
            agg[0] = max(agg[0], e[3])  # consecutive stalled heartbeats
            agg[1] += e[4]  # retransmit growth
            agg[2] += e[5]  # bytes moved while observed
    if not cells:
        return []
    retrans = [(c, "retransmits growing") for c, a in cells.items() if a[1] > 0]
    if retrans:
        return [(c[0], c[1], why) for c, why in retrans]
    stalled = [c for c, a in cells.items() if a[0] >= 1]
    if 0 < len(stalled) <= max(1, len(cells) // 2):
        return [(c[0], c[1], "bytes stopped") for c in stalled]
    return []


class _HangState(msgspec.Struct, array_like=True):
    conns: list[tuple[int, int, bool, list[int]]]
    """(rank, peer, is_send, [started, bytes, retrans, stalls, retrans growth, moved])"""
    target: int
    since: int
    reported: dict[int, int]
    silent_reported: list[int]
    silent_noted: dict[int, int]
    noted: dict[int, int]


class HangDetector:
    """Hangs of one communicator (both kinds) and the notes around them.

    Judges on every tick: who is behind or silent while most ranks wait (a
    non-communication hang), or which connections stopped when every rank waits (a
    communication hang). A hang still present is reported again every
    ``hang_repeat_us``, and at once when a culprit that was behind goes silent.
    Notes (observations): GPUs waiting in a collective here (victims, sent at half the
    threshold) and GPUs silent here while nobody waits for them.
    """

    name: ClassVar[str] = "hang"
    _SCHEMA: ClassVar[int] = 1

    def __init__(self, config: DetectConfig) -> None:
        self.config = config
        self.pconns = ProgressConns()
        self._target = -1
        self._since = -1
        self._reported: dict[int, int] = {}
        """culprit rank (-1: the communication hang) -> when it was last reported."""
        self._silent_reported: set[int] = set()
        """Culprits already reported as silent (a rank turning silent is news at once)."""
        self._silent_noted: dict[int, int] = {}
        """rank -> when it was last noted as silent (only while it is)."""
        self._noted: dict[int, int] = {}
        """rank -> when it was last noted as waiting (only while it waits)."""

    # ------------------------------------------------------------ the contract
    def grow(self, nranks: int) -> None:
        pass  # per-rank state lives in dicts of the ranks concerned

    def learn(self, view: CommView, batch: Batch) -> None:
        if not batch.prog:
            return
        pc = self.pconns
        if not (batch.started > batch.completed).any():  # the usual case: nothing in flight
            if pc.by_rank:
                for rank in batch.prog_rank.tolist():
                    pc.by_rank.pop(rank, None)
            return
        # per-connection progress matters only for in-flight ops; events in order, since
        # a rank may report twice in one batch
        a = batch.prog_conns
        if a is not None:  # the same, from columns: no event objects
            off = a.offsets.tolist()
            peer, send, nb, rt = (
                a.peer.tolist(),
                a.send.tolist(),
                a.nbytes.tolist(),
                a.retrans.tolist(),
            )
            st, cp = batch.started.tolist(), batch.completed.tolist()
            for i, r in enumerate(batch.prog_rank.tolist()):
                if st[i] > cp[i]:
                    lo, hi = off[i], off[i + 1]
                    if hi > lo:
                        pc.update_arrays(r, st[i], peer[lo:hi], send[lo:hi], nb[lo:hi], rt[lo:hi])
                elif pc.by_rank and r in pc.by_rank:
                    pc.drop(r)
            return
        for e in batch.prog:
            if e.started > e.completed:
                if e.conns:
                    pc.update(e.rank, e.started, e.conns)
            elif pc.by_rank and e.rank in pc.by_rank:
                pc.drop(e.rank)

    def close_window(self, view: CommView, window: Window) -> Output:
        return []

    def tick(self, view: CommView) -> Output:
        cfg = self.config
        if not view.warm():
            return []
        # thr >= hang_floor_us, so notes start at hang_floor_us / 2 and hangs later
        if self._quiet(view, cfg.hang_floor_us / 2):  # the usual case, in a few reductions
            self._noted.clear()
            self._silent_noted.clear()
            self._forget_hang()
            return []
        thr = view.model.hang_threshold_us(cfg.hang_floor_us, cfg.hang_period_mult)
        out = self._waiting_notes(view, min(thr, cfg.hang_floor_us) / 2)
        f = judge_hang(
            view.ranks,
            view.now,
            thr,
            cfg.silent_us,
            cfg.min_waiting_frac,
            cfg.max_culprit_frac,
            expect_all=view.now - view.first_us > cfg.warmup_us + cfg.silent_us,
            sending=self._sending(view.ranks),
        )
        if f is None:
            self._forget_hang()
            return out + self._silent_notes(view)
        if f.target != self._target:
            self._target = f.target
            self._since = view.now - int(f.wait_us)
            self._reported.clear()
            self._silent_reported.clear()
        start = self._since - self._since % 1_000_000
        if f.kind == "noncomm":
            out += self._noncomm(view, f, thr, start)
        else:
            out += self._comm(view, f, thr, start)
        return out

    def dump(self) -> bytes:
        conns = [
            (r, peer, is_send, e)
            for r, mine in self.pconns.by_rank.items()
            for (peer, is_send), e in mine.items()
        ]
        st = _HangState(
            conns, self._target, self._since, self._reported, sorted(self._silent_reported),
            self._silent_noted, self._noted,
        )  # fmt: skip
        return ck.encode(self.name, self._SCHEMA, st)

    @classmethod
    def load(cls, data: bytes, config: DetectConfig) -> HangDetector:
        st = ck.decode(data, cls.name, {cls._SCHEMA: _HangState})
        d = cls(config)
        for r, peer, is_send, e in st.conns:
            if len(e) != 6:
                raise ck.CheckpointError(f"hang state: a connection has {len(e)} figures, not 6")
            d.pconns.by_rank.setdefault(r, {})[(peer, is_send)] = list(e)
        d._target, d._since = st.target, st.since
        d._reported, d._silent_reported = dict(st.reported), set(st.silent_reported)
        d._silent_noted, d._noted = dict(st.silent_noted), dict(st.noted)
        return d

    def nbytes(self) -> int:
        small = len(self._reported) + len(self._silent_noted) + len(self._noted)
        return self.pconns.nbytes() + 48 * small + 200

    # ------------------------------------------------------------ judging
    def _sending(self, t: RankTable) -> np.ndarray | None:
        """Ranks whose in-flight op has only send connections (a point-to-point Send),
        from the connections their heartbeats report; None when none reports any."""
        by_rank = self.pconns.by_rank
        if not by_rank:
            return None
        out = np.zeros(t.n, bool)
        started = t.started
        for r, mine in by_rank.items():
            if r >= t.n:
                continue
            cur = [k[1] for k, e in mine.items() if e[0] == started[r]]
            out[r] = bool(cur) and all(cur)
        return out

    def _forget_hang(self) -> None:
        self._target = -1
        self._reported.clear()
        self._silent_reported.clear()

    def _quiet(self, view: CommView, note_us: float) -> bool:
        """True when no rank can be silent or waiting: every rank was heard within
        ``silent_us`` and no in-flight collective is older than ``note_us``. Then neither
        the notes nor :func:`judge_hang` can find anything (same result, without their
        two dozen array operations)."""
        t = view.ranks
        if t.n == 0:
            return False
        lo = int(t.last_recv.min())
        if lo < 0 or view.now - lo > self.config.silent_us:
            return False
        infl = t.started > t.completed
        if not infl.any():
            return True
        est = t.inflight_us[infl] + (view.now - t.prog_recv[infl])
        return bool(est.max() <= note_us)

    def _silent_notes(self, view: CommView) -> Output:
        """Ranks silent here while most of their peers still report, though nobody waits
        for them in this communicator (their peers may be held up elsewhere). Alone they
        isolate nothing; they tell the correlator that a host whose GPU hangs elsewhere
        has stopped as a whole."""
        t, cfg, now = view.ranks, self.config, view.now
        seen = t.last_recv >= 0
        silent = seen & (now - t.last_recv > cfg.silent_us)
        n_silent = int(silent.sum())
        if n_silent == 0 or int(seen.sum()) - n_silent <= n_silent:  # a stop, not a fault
            self._silent_noted.clear()
            return []
        noted, repeat = self._silent_noted, cfg.hang_repeat_us
        new = [r for r in np.flatnonzero(silent).tolist()
               if now - noted.get(r, _NEVER) >= repeat]  # fmt: skip
        if not new:
            return []
        for r in new:
            noted[r] = now
        out: Output = []
        for hi, rs in view.by_host(np.array(new, np.int64)).items():
            if hi < 0:
                continue
            gpus = sorted({int(t.gpu[r]) for r in rs if t.gpu[r] >= 0})
            quiet = now - int(t.last_recv[rs].max())
            reason = (
                f"{t.hosts[hi]} GPUs {gpus} have been silent for {_s(quiet)} in "
                f"{view.label} while their peers still report."
            )
            start = now - quiet
            start -= start % 1_000_000
            note = Silent(gpus=gpus, silent_s=round(quiet / 1e6, 1))
            out.append(Observation("noncomm_hang", t.hosts[hi], reason, start, now, note, rs))
        return out

    def _waiting_notes(self, view: CommView, note_us: float) -> Output:
        """Sent early (half the hang threshold): these GPUs sit in a collective here, so
        being behind in another communicator is not their fault."""
        t, now = view.ranks, view.now
        live = (t.last_recv >= 0) & (now - t.last_recv <= self.config.silent_us)
        infl = live & (t.started > t.completed)
        est = np.where(infl, t.inflight_us + (now - t.prog_recv), 0.0)
        waiting = np.flatnonzero(est > note_us)
        noted = self._noted
        if waiting.size == 0:
            noted.clear()
            return []
        # a rank is noted as soon as it waits, and again every hang_repeat_us
        repeat = self.config.hang_repeat_us
        waiting = np.array(
            [r for r in waiting.tolist() if now - noted.get(r, _NEVER) >= repeat], np.int64
        )
        if waiting.size == 0:
            return []
        for r in waiting.tolist():
            noted[r] = now
        target = int(t.started[waiting].max())
        wait_us = median(est[waiting])
        start = now - int(wait_us)
        start -= start % 1_000_000
        gpu_of = dict(zip(waiting.tolist(), t.gpu[waiting].tolist(), strict=True))
        out: Output = []
        for hi, rs in view.by_host(waiting).items():
            if hi < 0:
                continue
            gpus = sorted({gpu_of[r] for r in rs if gpu_of[r] >= 0})
            reason = (
                f"{t.hosts[hi]} GPUs {gpus} wait in collective {target} of "
                f"{view.label} ({_s(wait_us)})."
            )
            note = Waiting(gpus=gpus, target_collective=target)
            out.append(Observation("noncomm_hang", t.hosts[hi], reason, start, now, note, rs))
        return out

    def _noncomm(self, view: CommView, f: HangFinding, thr: float, start: int) -> Output:
        out: Output = []
        silent = set(f.silent.tolist())
        t, now = view.ranks, view.now
        for r in f.culprits.tolist():
            last = self._reported.get(r)
            newly_silent = r in silent and r not in self._silent_reported
            if (
                last is not None
                and now - last < self.config.hang_repeat_us
                and not newly_silent  # behind, now silent too: a dead host, say so now
            ):
                continue
            self._reported[r] = now
            if r in silent:
                self._silent_reported.add(r)
            peers = f"{f.waiting.size} peers have waited {_s(f.wait_us)} in it"
            if r in silent:
                quiet = now - int(t.last_recv[r]) if t.last_recv[r] >= 0 else None
                what = f"went silent {_s(quiet)} ago" if quiet is not None else "was never heard"
                reason = f"{view.who(r)} {what} while {peers} (collective {f.target})."
            else:
                reason = (
                    f"{view.who(r)} has not started collective {f.target} while "
                    f"{peers} (hang threshold {_s(thr)})."
                )
            ev = HangEvidence(
                target_collective=f.target,
                rank_started=int(t.started[r]),
                silent=r in silent,
                peers_waiting=int(f.waiting.size),
                wait_s=round(f.wait_us / 1e6, 2),
                threshold_s=round(thr / 1e6, 2),
            )
            score = min(1.0, 0.6 + 0.4 * f.wait_us / (2 * thr))
            out.append(Finding("noncomm_hang", r, score, reason, start, now, ev, [r]))
        return out

    def _comm(self, view: CommView, f: HangFinding, thr: float, start: int) -> Output:
        last = self._reported.get(-1)
        if last is not None and view.now - last < self.config.hang_repeat_us:
            return []
        cells = localize_stalled(self.pconns, f.target)
        if not cells:
            return []
        self._reported[-1] = view.now
        t = view.ranks
        out: Output = []
        seen: set[tuple] = set()
        senders = {c[0] for c in cells}
        for snd, rcv, why in cells[:8]:
            host, nic, peer = t.host_of(snd), t.nic_of(snd), t.host_of(rcv)
            peer_hosts = {t.host_of(c[1]) for c in cells if c[0] == snd}
            if len(peer_hosts) > 1:  # one NIC towards several hosts: the NIC, not a link
                peer = None
            key = (host, t.gpu_of(snd), nic, peer)
            if key in seen:
                continue
            seen.add(key)
            reason = (
                f"{host} {nic or 'NIC'} stopped delivering to "
                f"{peer or 'several hosts'} ({why}): collective {f.target} on "
                f"{view.label} has hung for {_s(f.wait_us)} on all "
                f"{f.waiting.size} ranks."
            )
            ev = CommHangEvidence(
                target_collective=f.target,
                stalled_conns=len(cells),
                why=why,
                sender_rank=snd,
                receiver_rank=rcv,
                senders=len(senders),
                wait_s=round(f.wait_us / 1e6, 2),
                threshold_s=round(thr / 1e6, 2),
            )
            score = 0.9 if "retrans" in why else 0.7
            out.append(
                Finding(
                    "comm_hang",
                    snd,
                    score,
                    reason,
                    start,
                    view.now,
                    ev,
                    [snd, rcv],
                    nic=nic,
                    peer_host=peer,
                )  # fmt: skip
            )
        return out
