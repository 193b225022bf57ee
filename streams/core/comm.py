"""CommDetector: all detection state of one communicator, fed batches in event time.

The same object runs inside the Faust agent (one per communicator key), in
``c4stream detect`` and in unit tests. Its clock is the communicator's event time: the
newest ``ts_us`` seen, or what :meth:`CommDetector.advance` says. Receipt is stamped
with that clock, never with the sender's own clock, so a host whose clock is off does
not look silent.

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

import pickle
from collections.abc import Sequence

import numpy as np

from producers.events import Event, OpEvent
from streams.commands import Fault
from streams.core.config import DetectConfig
from streams.core.hang import HangFinding, ProgressConns, judge_hang, localize_stalled
from streams.core.ranks import RankTable
from streams.core.slow_conn import ConnMatrix, SlowFinding
from streams.core.stats import NormalModel, median, stable_id
from streams.core.straggler import SeqAligner, judge_stragglers
from streams.verdicts import Verdict

__all__ = ["CommDetector"]

_HANG_CHECK_US = 500_000  # how often (event time) the hang test runs; it costs O(ranks)


def _s(us: float) -> str:
    return f"{us / 1e6:.1f} s"


class CommDetector:
    """All state of one communicator; bounded (fixed-size rings, running stats)."""

    _all_known = False
    """Every rank's identity is learned (class default: older checkpoints lack it)."""

    def __init__(self, comm: str, config: DetectConfig) -> None:
        self.comm = comm
        self.config = config
        self.job = ""
        self.comm_name: str | None = None
        self.ranks = RankTable(0)
        self.aligner = SeqAligner(0, config.seq_ring, config.min_present_frac)
        self.matrix = ConnMatrix()
        self.pconns = ProgressConns()
        self.model = NormalModel()
        self.now = -1
        self.first_us = -1
        self.window_idx = -1
        self.n_events = 0
        self._next_hang_check = 0
        self._hang_target = -1
        self._hang_since = -1
        self._hang_reported: dict[int, int] = {}
        self._silent_reported: set[int] = set()
        self._silent_noted: dict[int, int] = {}
        """rank -> when it was last noted as silent (only while it is)."""
        self._census_hosts = 0
        """Hosts in the last census note (the correlator sizes the job from these)."""
        """Culprits already reported as silent (a rank turning silent is news at once)."""
        self._noted: dict[int, int] = {}
        """rank -> when it was last noted as waiting (only while it waits)."""

    # ------------------------------------------------------------------ public API
    def observe(self, events: Sequence[Event]) -> list[Verdict]:
        """Take a batch of this communicator's events; returns verdicts concluded."""
        if not events:
            return []
        e0 = events[0]
        if not self.job:
            self.job, self.comm_name = e0.job, e0.comm_name
        n = max(e0.nranks, events[-1].nranks)
        if n > self.ranks.n:
            self._grow(n)
        ops = [e for e in events if e.__class__ is OpEvent]
        prog = [e for e in events if e.__class__ is not OpEvent] if len(ops) < len(events) else []
        # one list comprehension per field: the arrays below are all the per-event work
        # (a comprehension is ~2x cheaper than np.fromiter over a generator)
        ro = np.array([e.rank for e in ops], np.int64)
        tso_l = [e.ts_us for e in ops]
        rp = np.array([e.rank for e in prog], np.int64)
        tsp_l = [e.ts_us for e in prog]
        ts_max = max(max(tso_l) if ops else -1, max(tsp_l) if prog else -1)
        out: list[Verdict] = []
        if ts_max > self.now:
            out += self._roll_window(ts_max)
            self.now = ts_max
        if self.first_us < 0:
            self.first_us = self.now
        self.n_events += len(events)
        if ops and prog:  # one identity pass for the whole batch
            self._learn_identities(ops + prog, np.concatenate([ro, rp]))
        else:
            self._learn_identities(ops or prog, ro if ops else rp)
        if ops:
            self._observe_ops(ops, ro, np.array(tso_l, np.int64))
        if prog:
            self._observe_progress(prog, rp)
        out += self._tick()
        return out

    def advance(self, now_us: int) -> list[Verdict]:
        """The event-time clock moved on (maybe without events here): hangs, silence."""
        if now_us <= self.now or self.first_us < 0:
            return []
        out = self._roll_window(now_us)
        self.now = now_us
        return out + self._tick()

    def to_bytes(self) -> bytes:
        state = {k: v for k, v in self.__dict__.items() if k != "config"}
        return pickle.dumps(state, protocol=5)

    @classmethod
    def from_bytes(cls, data: bytes, config: DetectConfig) -> CommDetector:
        obj = cls.__new__(cls)
        obj.__dict__.update(pickle.loads(data))
        obj.config = config
        obj.__dict__.setdefault("_silent_reported", set())  # checkpoints from before them
        obj.__dict__.setdefault("_silent_noted", {})
        obj.__dict__.setdefault("_census_hosts", 0)
        return obj

    def state_bytes(self) -> int:
        """Approximate memory held by this communicator's state."""
        return (
            self.ranks.nbytes()
            + self.aligner.nbytes()
            + self.matrix.nbytes()
            + self.pconns.nbytes()
            + 2000
        )

    # ------------------------------------------------------------------ ingestion
    def _grow(self, n: int) -> None:
        self._all_known = False
        self.ranks.grow(n)
        self.aligner.grow(n)

    def _learn_identities(self, events: Sequence[Event], r: np.ndarray) -> None:
        top = int(r.max())
        if top >= self.ranks.n:
            self._grow(top + 1)
        t = self.ranks
        if not self._all_known:  # once every rank is known, skip the lookup per batch
            unknown = np.flatnonzero(t.host_idx[r] < 0)
            for i in unknown.tolist():
                e = events[i]
                t.learn_identity(e.rank, e.host, e.gpu, e.nic)
            self._all_known = bool(unknown.size) and bool((t.host_idx >= 0).all())
        t.last_recv[r] = self.now

    def _observe_ops(self, ops: list[OpEvent], r: np.ndarray, ts: np.ndarray) -> None:
        k = len(ops)
        t = self.ranks
        s_list = [e.seq for e in ops]
        s = np.array(s_list, np.int64)
        x = np.array([e.exec_us for e in ops], np.float64)
        # period between consecutive collectives of one rank, by that rank's own clock:
        # sort by (rank, seq); an event's predecessor is the one before it in the sorted
        # batch, or the table's last op of its rank for the rank's first event
        o = np.lexsort((s, r))
        r, s, ts = r[o], s[o], ts[o]
        first = np.empty(k, bool)
        first[0] = True
        np.not_equal(r[1:], r[:-1], out=first[1:])
        prev_ts = np.empty(k, np.int64)
        prev_ts[1:] = ts[:-1]
        prev_seq = np.empty(k, np.int64)
        prev_seq[1:] = s[:-1]
        rf = r[first]
        prev_ts[first] = t.last_op_ts[rf]
        prev_seq[first] = t.last_op_seq[rf]
        periods = ts - prev_ts
        periods = periods[(prev_seq == s - 1) & (prev_ts >= 0) & (periods > 0)]
        self.model.learn_periods(periods.astype(np.float64))
        last = np.empty(k, bool)  # each rank's last op of the batch
        last[-1] = True
        last[:-1] = first[1:]
        t.last_op_ts[r[last]] = ts[last]
        t.last_op_seq[r[last]] = s[last]
        self.model.learn_ops(x[o])
        distinct = sorted(set(s_list))
        for med in self.aligner.insert(r, s, x[o].astype(np.float32), self.now, distinct):
            self.model.learn_step(med)
        every = self.config.conn_sample_every
        if every == 1:
            sel = [e for e in ops if e.conns]
        else:
            sel = [e for e in ops if e.conns and e.seq % every == 0]
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
        ok = tu > 0
        snd, rcv = np.where(send, me, peer), np.where(send, peer, me)
        if not ok.all():
            snd, rcv, nb, tu = snd[ok], rcv[ok], nb[ok], tu[ok]
        self.matrix.add_many(snd, rcv, nb, tu)

    def _observe_progress(self, prog: list[Event], r: np.ndarray) -> None:
        t = self.ranks
        st = np.array([e.started for e in prog], np.int64)  # type: ignore[union-attr]
        cp = np.array([e.completed for e in prog], np.int64)  # type: ignore[union-attr]
        t.started[r] = st
        t.completed[r] = cp
        t.inflight_us[r] = np.array([e.inflight_us or 0.0 for e in prog], np.float64)  # type: ignore[union-attr]
        t.prog_recv[r] = self.now
        pc = self.pconns
        infl = st > cp
        if not infl.any():  # nothing in flight: forget these ranks' connections
            if pc.by_rank:
                for rank in r.tolist():
                    pc.by_rank.pop(rank, None)
            return
        # per-connection progress matters only for in-flight ops; events in order, since
        # a rank may report twice in one batch
        for e in prog:
            if e.started > e.completed:  # type: ignore[union-attr]
                if e.conns:
                    pc.update(e.rank, e.started, e.conns)  # type: ignore[union-attr]
            elif e.rank in pc.by_rank:
                pc.drop(e.rank)

    # ------------------------------------------------------------------ judging
    def _warm(self) -> bool:
        return self.now - self.first_us >= self.config.warmup_us

    def _tick(self) -> list[Verdict]:
        out: list[Verdict] = []
        # Collectives are judged in one batch per window (``_roll_window``) or when the
        # ring is full (``SeqAligner.insert``): one set of numpy calls per window, not
        # per collective. Their medians are only read when a window is judged.
        if self.now >= self._next_hang_check:
            self._next_hang_check = self.now + _HANG_CHECK_US
            out += self._check_hang()
            if self._warm() and self.ranks.n_hosts() != self._census_hosts:
                out.append(self._census())
        return out

    def _census(self) -> Verdict:
        """An alert-only note naming this communicator's hosts, sent when it is warm and
        again if its host set grows: the correlator sizes the job (for the cap on
        isolated hosts and the job-wide-stop rail) from the union of these."""
        t = self.ranks
        self._census_hosts = t.n_hosts()
        reason = f"{self.comm_name or self.comm} spans {t.n_hosts()} hosts."
        ev = {"role": "census", "hosts": list(t.hosts)}
        return self._verdict("noncomm_hang", None, 0.0, reason, self.first_us, self.now, ev,
                             [], host=t.hosts[0] if t.hosts else None, benign=True)  # fmt: skip

    def _roll_window(self, new_now: int) -> list[Verdict]:
        w = self.config.window_us
        idx = new_now // w
        if self.window_idx < 0 or self.first_us < 0:
            self.window_idx = idx
            return []
        if idx <= self.window_idx:
            return []
        start, end = self.window_idx * w, (self.window_idx + 1) * w
        out: list[Verdict] = []
        if start >= self.first_us + self.config.warmup_us - w:
            # judge collectives of this window that are still open with who reported
            for med in self.aligner.close_due(end):
                self.model.learn_step(med)
            if end - self.first_us >= self.config.warmup_us:
                out += self._judge_stragglers(start, end)
                out += self._judge_slow(start, end)
        self.aligner.reset_window()
        self.matrix.reset()
        self.window_idx = idx
        return out

    def _verdict(
        self,
        fault: Fault,
        rank: int | None,
        score: float,
        reason: str,
        start: int,
        end: int,
        evidence: dict,
        ranks: list[int],
        host: str | None = None,
        nic: str | None = None,
        peer_host: str | None = None,
        benign: bool = False,
        gpu: int | None = None,
    ) -> Verdict:
        t = self.ranks
        if rank is not None:
            host = host or t.host_of(rank)
            gpu = t.gpu_of(rank) if gpu is None else gpu
        host = host or "unknown"
        evidence = {
            "comm_name": self.comm_name or self.comm,
            "comm_hosts": t.n_hosts(),
            "nranks": t.n,
            **evidence,
        }
        vid = stable_id(self.job, self.comm, fault, host, gpu, nic, peer_host, start, benign)
        return Verdict(
            id=vid,
            ts_us=self.now,
            job=self.job,
            comm=self.comm,
            host=host,
            fault=fault,
            score=round(min(1.0, max(0.0, score)), 3),
            reason=reason,
            window_start_us=start,
            window_end_us=end,
            evidence=evidence,
            ranks=ranks,
            gpu=gpu,
            nic=nic,
            peer_host=peer_host,
            benign=benign,
        )

    def _who(self, rank: int) -> str:
        t = self.ranks
        g = t.gpu_of(rank)
        gpu = f" GPU {g}" if g is not None else ""
        where = self.comm_name or self.comm
        return f"{t.host_of(rank) or 'unknown host'}{gpu} (rank {rank} of {where})"

    # --- hangs ----------------------------------------------------------------------
    def _check_hang(self) -> list[Verdict]:
        cfg = self.config
        if not self._warm():
            return []
        # thr >= hang_floor_us, so notes start at hang_floor_us / 2 and hangs later
        note_us = cfg.hang_floor_us / 2
        if self._quiet(note_us):  # the usual case, in a few numpy reductions
            self._noted.clear()
            self._silent_noted.clear()
            self._hang_target = -1
            self._hang_reported.clear()
            self._silent_reported.clear()
            return []
        thr = self.model.hang_threshold_us(cfg.hang_floor_us, cfg.hang_period_mult)
        out = self._waiting_notes(min(thr, cfg.hang_floor_us) / 2)
        f = judge_hang(
            self.ranks,
            self.now,
            thr,
            cfg.silent_us,
            cfg.min_waiting_frac,
            cfg.max_culprit_frac,
            expect_all=self.now - self.first_us > cfg.warmup_us + cfg.silent_us,
        )
        if f is None:
            self._hang_target = -1
            self._hang_reported.clear()
            self._silent_reported.clear()
            return out + self._silent_notes()
        if f.target != self._hang_target:
            self._hang_target = f.target
            self._hang_since = self.now - int(f.wait_us)
            self._hang_reported.clear()
            self._silent_reported.clear()
        start = self._hang_since - self._hang_since % 1_000_000
        if f.kind == "noncomm":
            out += self._noncomm_verdicts(f, thr, start)
        else:
            out += self._comm_verdicts(f, thr, start)
        return out

    def _quiet(self, note_us: float) -> bool:
        """True when no rank can be silent or waiting: every rank was heard within
        ``silent_us`` and no in-flight collective is older than ``note_us``. Then neither
        :meth:`_waiting_notes` nor :func:`judge_hang` can find anything (same result,
        without their two dozen array operations)."""
        t = self.ranks
        if t.n == 0:
            return False
        lo = int(t.last_recv.min())
        if lo < 0 or self.now - lo > self.config.silent_us:
            return False
        infl = t.started > t.completed
        if not infl.any():
            return True
        est = t.inflight_us[infl] + (self.now - t.prog_recv[infl])
        return bool(est.max() <= note_us)

    def _silent_notes(self) -> list[Verdict]:
        """Alert-only notes: ranks silent here while most of their peers still report,
        though nobody waits for them in this communicator (their peers may be held up
        elsewhere). Alone they isolate nothing; they tell the correlator that a host
        whose GPU hangs elsewhere has stopped as a whole."""
        t, cfg = self.ranks, self.config
        seen = t.last_recv >= 0
        silent = seen & (self.now - t.last_recv > cfg.silent_us)
        n_silent = int(silent.sum())
        if n_silent == 0 or int(seen.sum()) - n_silent <= n_silent:  # a stop, not a fault
            self._silent_noted.clear()
            return []
        noted, repeat = self._silent_noted, cfg.hang_repeat_us
        new = [r for r in np.flatnonzero(silent).tolist()
               if self.now - noted.get(r, -(2**62)) >= repeat]  # fmt: skip
        if not new:
            return []
        for r in new:
            noted[r] = self.now
        out = []
        for hi, rs in self._by_host(np.array(new, np.int64)).items():
            if hi < 0:
                continue
            gpus = sorted({int(t.gpu[r]) for r in rs if t.gpu[r] >= 0})
            quiet = self.now - int(t.last_recv[rs].max())
            reason = (
                f"{t.hosts[hi]} GPUs {gpus} have been silent for {_s(quiet)} in "
                f"{self.comm_name or self.comm} while their peers still report."
            )
            start = self.now - quiet
            start -= start % 1_000_000
            ev = {"role": "silent", "gpus": gpus, "silent_s": round(quiet / 1e6, 1)}
            out.append(self._verdict("noncomm_hang", None, 0.0, reason, start, self.now, ev,
                                     rs, host=t.hosts[hi], benign=True))  # fmt: skip
        return out

    def _waiting_notes(self, note_us: float) -> list[Verdict]:
        """Alert-only notes, sent early (half the hang threshold): these GPUs sit in a
        collective here, so being behind in another communicator is not their fault."""
        t = self.ranks
        live = (t.last_recv >= 0) & (self.now - t.last_recv <= self.config.silent_us)
        infl = live & (t.started > t.completed)
        est = np.where(infl, t.inflight_us + (self.now - t.prog_recv), 0.0)
        waiting = np.flatnonzero(est > note_us)
        noted = self._noted
        if waiting.size == 0:
            noted.clear()
            return []
        # a rank is noted as soon as it waits, and again every hang_repeat_us
        repeat = self.config.hang_repeat_us
        waiting = np.array(
            [r for r in waiting.tolist() if self.now - noted.get(r, -(2**62)) >= repeat], np.int64
        )
        if waiting.size == 0:
            return []
        for r in waiting.tolist():
            noted[r] = self.now
        target = int(t.started[waiting].max())
        wait_us = median(est[waiting])
        start = self.now - int(wait_us)
        start -= start % 1_000_000
        return self._victim_observations(waiting, target, wait_us, start)

    def _noncomm_verdicts(self, f: HangFinding, thr: float, start: int) -> list[Verdict]:
        out = []
        silent = set(f.silent.tolist())
        t = self.ranks
        for r in f.culprits.tolist():
            last = self._hang_reported.get(r)
            newly_silent = r in silent and r not in self._silent_reported
            if (
                last is not None
                and self.now - last < self.config.hang_repeat_us
                and not newly_silent  # behind, now silent too: a dead host, say so now
            ):
                continue
            self._hang_reported[r] = self.now
            if r in silent:
                self._silent_reported.add(r)
            peers = f"{f.waiting.size} peers have waited {_s(f.wait_us)} in it"
            if r in silent:
                quiet = self.now - int(t.last_recv[r]) if t.last_recv[r] >= 0 else None
                what = f"went silent {_s(quiet)} ago" if quiet is not None else "was never heard"
                reason = f"{self._who(r)} {what} while {peers} (collective {f.target})."
            else:
                reason = (
                    f"{self._who(r)} has not started collective {f.target} while "
                    f"{peers} (hang threshold {_s(thr)})."
                )
            ev = {
                "target_collective": f.target,
                "rank_started": int(t.started[r]),
                "silent": r in silent,
                "peers_waiting": int(f.waiting.size),
                "wait_s": round(f.wait_us / 1e6, 2),
                "threshold_s": round(thr / 1e6, 2),
            }
            score = min(1.0, 0.6 + 0.4 * f.wait_us / (2 * thr))
            out.append(self._verdict("noncomm_hang", r, score, reason, start, self.now, ev, [r]))
        return out

    def _comm_verdicts(self, f: HangFinding, thr: float, start: int) -> list[Verdict]:
        last = self._hang_reported.get(-1)
        if last is not None and self.now - last < self.config.hang_repeat_us:
            return []
        cells = localize_stalled(self.pconns, f.target)
        if not cells:
            return []
        self._hang_reported[-1] = self.now
        t = self.ranks
        out = []
        for snd, rcv, why in cells[:8]:
            host, nic, peer = t.host_of(snd), t.nic_of(snd), t.host_of(rcv)
            senders = {c[0] for c in cells}
            peer_hosts = {t.host_of(c[1]) for c in cells if c[0] == snd}
            if len(peer_hosts) > 1:  # one NIC towards several hosts: the NIC, not a link
                peer = None
            reason = (
                f"{host} {nic or 'NIC'} stopped delivering to "
                f"{peer or 'several hosts'} ({why}): collective {f.target} on "
                f"{self.comm_name or self.comm} has hung for {_s(f.wait_us)} on all "
                f"{f.waiting.size} ranks."
            )
            ev = {
                "target_collective": f.target,
                "stalled_conns": len(cells),
                "why": why,
                "sender_rank": snd,
                "receiver_rank": rcv,
                "senders": len(senders),
                "wait_s": round(f.wait_us / 1e6, 2),
                "threshold_s": round(thr / 1e6, 2),
            }
            v = self._verdict(
                "comm_hang",
                snd,
                0.9 if "retrans" in why else 0.7,
                reason,
                start,
                self.now,
                ev,
                [snd, rcv],
                nic=nic,
                peer_host=peer,
            )
            if all(v.id != o.id for o in out):
                out.append(v)
        return out

    def _victim_observations(
        self, waiting: np.ndarray, target: int, wait_us: float, start: int
    ) -> list[Verdict]:
        t = self.ranks
        gpu_of = dict(zip(waiting.tolist(), t.gpu[waiting].tolist(), strict=True))
        out = []
        for hi, rs in self._by_host(waiting).items():
            if hi < 0:
                continue
            gpus = sorted({gpu_of[r] for r in rs if gpu_of[r] >= 0})
            reason = (
                f"{t.hosts[hi]} GPUs {gpus} wait in collective {target} of "
                f"{self.comm_name or self.comm} ({_s(wait_us)})."
            )
            out.append(
                self._verdict(
                    "noncomm_hang",
                    None,
                    0.0,
                    reason,
                    start,
                    self.now,
                    {"role": "waiting", "gpus": gpus, "target_collective": target},
                    rs,
                    host=t.hosts[hi],
                    benign=True,
                )
            )
        return out

    def _by_host(self, ranks: np.ndarray) -> dict[int, list[int]]:
        """Ranks grouped by host index, in rank order within a host."""
        by_host: dict[int, list[int]] = {}
        for r, hi in zip(ranks.tolist(), self.ranks.host_idx[ranks].tolist(), strict=True):
            by_host.setdefault(hi, []).append(r)
        return by_host

    # --- stragglers -----------------------------------------------------------------
    def _judge_stragglers(self, start: int, end: int) -> list[Verdict]:
        cfg = self.config
        a = self.aligner
        found = judge_stragglers(
            a,
            cfg.straggler_min_seqs,
            cfg.straggler_last_frac,
            cfg.straggler_min_wait,
            cfg.straggler_min_z,
            max(1, int(cfg.max_culprit_frac * a.n)),
            learned=cfg.learn_lateness,
        )
        if not found and cfg.learn_lateness:  # a window without a verdict: it is normal
            a.learn_lateness(cfg.straggler_min_seqs, cfg.lateness_alpha)
        out = []
        normal = self.model.step_normal()
        med_now = median(a.window_meds) if a.window_meds else 0.0
        for f in found:
            wait_x = float(np.exp(f.mean_lat))
            vs_normal = med_now / normal if normal > 0 else float("nan")
            reason = (
                f"{self._who(f.rank)} arrived last in {f.frac_last:.0%} of {f.n_seqs} "
                f"collectives over {_s(end - start)}; its peers spent {wait_x:.1f}x its "
                f"kernel time waiting for it."
            )
            ev = {
                "collectives": f.n_seqs,
                "last_frac": round(f.frac_last, 3),
                "peer_time_x": round(wait_x, 3),
                "z": round(f.z, 1),
                "peer_time_vs_normal": round(vs_normal, 3) if normal > 0 else None,
            }
            score = min(1.0, f.frac_last) * min(1.0, 0.5 + f.z / (4 * cfg.straggler_min_z))
            ev["late_ms"] = round(f.late_us / 1e3, 2)
            out.append(self._verdict("straggler", f.rank, score, reason, start, end, ev, [f.rank]))
        return out + self._waited_notes(start, end, normal, {f.rank for f in found})

    def _waited_notes(self, start: int, end: int, normal: float, skip: set[int]) -> list[Verdict]:
        """Alert-only notes: ranks that spent clearly longer than normal in this
        communicator's kernels this window (waiting for someone). A GPU held up here
        reaches its next collective elsewhere late; that lateness is not its own."""
        a, t = self.aligner, self.ranks
        if normal <= 0 or a.window_n_seqs < self.config.straggler_min_seqs:
            return []
        mean_exec = a.exec_sum / np.maximum(a.n_seq, 1)
        extra = mean_exec - normal
        # a quarter more than normal: jitter stays below, a straggler's or a slow ring's
        # hold-up (tens of percent) above
        waited = (a.n_seq > 0) & (extra > max(0.25 * normal, 500.0))
        if skip:
            waited[list(skip)] = False
        idx = np.flatnonzero(waited)
        if idx.size == 0:
            return []
        # Python lists once, not a numpy scalar per rank and field
        gpu_of = dict(zip(idx.tolist(), t.gpu[idx].tolist(), strict=True))
        extra_of = dict(zip(idx.tolist(), extra[idx].tolist(), strict=True))
        out = []
        for hi, rs in self._by_host(idx).items():
            if hi < 0:
                continue
            gpus = [gpu_of[r] for r in rs if gpu_of[r] >= 0]
            extra_ms = [round(extra_of[r] / 1e3, 2) for r in rs if gpu_of[r] >= 0]
            if not gpus:
                continue
            reason = (
                f"{t.hosts[hi]} GPUs {gpus} spent {max(extra_ms):.1f} ms more than normal "
                f"per collective in {self.comm_name or self.comm}."
            )
            ev = {"role": "waiting", "gpus": gpus, "extra_ms": extra_ms}
            out.append(self._verdict("straggler", None, 0.0, reason, start, end, ev, rs,
                                     host=t.hosts[hi], benign=True))  # fmt: skip
        return out

    # --- slow connections -----------------------------------------------------------
    def _judge_slow(self, start: int, end: int) -> list[Verdict]:
        cfg = self.config
        t = self.ranks
        out = []
        for f in self.matrix.judge(t.host_idx, cfg.slow_ratio, cfg.slow_min_cells):
            out.append(self._slow_verdict(f, start, end))
        return out

    def _slow_verdict(self, f: SlowFinding, start: int, end: int) -> Verdict:
        t = self.ranks
        host, nic = t.host_of(f.rank), t.nic_of(f.rank)
        ev = {
            "throughput_ratio": round(f.ratio, 3),
            "cells": f.cells,
            "median_gbs": round(f.median_gbs, 3),
        }
        score = min(1.0, max(0.5, 0.5 + 2 * (self.config.slow_ratio - f.ratio)))
        if f.kind == "nic":
            reason = (
                f"{host} {nic or 'NIC'} moves {f.ratio:.0%} of the median throughput of "
                f"{self.comm_name or self.comm} on its {f.cells} connections "
                f"(median {f.median_gbs:.1f} GB/s)."
            )
            return self._verdict(
                "slow_nic", f.rank, score, reason, start, end, ev, [f.rank], nic=nic
            )
        assert f.peer is not None
        peer = t.host_of(f.peer)
        reason = (
            f"link {host} {nic or ''} -> {peer} moves {f.ratio:.0%} of the median "
            f"throughput of {self.comm_name or self.comm} "
            f"(median {f.median_gbs:.1f} GB/s)."
        )
        return self._verdict(
            "slow_link",
            f.rank,
            score,
            reason,
            start,
            end,
            ev,
            [f.rank, f.peer],
            nic=nic,
            peer_host=peer,
        )
