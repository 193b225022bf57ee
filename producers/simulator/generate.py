"""The simulation loop: time iterations with numpy, then cut them into exporter batches.

Two halves that alternate:

1. *Timing* (:meth:`Simulation._iteration`): one training iteration for every rank at
   once — compute phases with jitter, TP AllReduces, pipeline Send/Recv, DP gradient
   AllReduces — each collective timed for a whole family of communicators with one
   numpy operation (the ring model of :mod:`producers.simulator.timing`). Each
   collective leaves an :class:`OpRecord`: arrival of every member, end per group.
2. *Emission* (:meth:`Simulation._emit_second`): once every rank's clock has passed
   the end of second S, the op events completed in S and the heartbeats ticking in S
   are built, grouped per (host, communicator) — one batch as one exporter message —
   and yielded. Records wholly in the past are folded into per-member counters, so
   state stays bounded however long the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from producers.events import Conn, Event, OpEvent, ProgressEvent
from producers.simulator.config import SimConfig, validate
from producers.simulator.faults import Injection
from producers.simulator.timing import ring_bytes, ring_end
from producers.simulator.topology import Family, Topology

__all__ = ["EPOCH_US", "Simulation", "simulate"]

#: Simulated time 0 on the wire (2025-06-15T15:06:40Z), fixed so runs are reproducible.
EPOCH_US = 1_750_000_000_000_000

# Shares of iteration_s spent computing before each collective phase.
_FWD, _BWD, _GRAD = 0.3, 0.4, 0.3


@dataclass
class OpRecord:
    """One collective of one family: every group's members' arrivals and its end."""

    seq: int
    ops: list[str]  # op name per member column
    nbytes: int
    arrival: np.ndarray  # (g, n) seconds; inf = never started
    end: np.ndarray  # (g,) seconds; inf = never completes
    last: np.ndarray  # (g,) last arrival: when bytes start to move
    nominal_end: np.ndarray  # (g,) end without link hangs (for byte progress)
    conn_bytes: int = 0  # per connection (network families)
    link_s: np.ndarray | None = None  # dp: (g, n) time of link i -> i+1; pp: (g,); ep: (g, n, n)
    src: int = -1  # pp: the sending member; -2: an AllToAll (every member to every other)
    stalls: dict[int, tuple[int, float]] = field(default_factory=dict)


@dataclass
class Wire:
    """Per-member wire fields of a family, as nested lists (built once, read per event)."""

    cids: list[str]  # per group
    cnames: list[str]
    keys: list[list[tuple[int, int]]]  # (host, comm) batch key per member
    names: list[list[str]]
    gpus: list[list[int]]
    nics: list[list[str | None]]

    @classmethod
    def build(cls, fam: Family, topo: Topology) -> Wire:
        hosts = topo.host_of(fam.members).tolist()
        gpus = topo.gpu_of(fam.members).tolist()
        comms = fam.comms.tolist()
        return cls(
            cids=[topo.comm_ids[c] for c in comms],
            cnames=[topo.comm_names[c] for c in comms],
            keys=[[(h, c) for h in hs] for hs, c in zip(hosts, comms, strict=True)],
            names=[[topo.host_names[h] for h in hs] for hs in hosts],
            gpus=gpus,
            nics=[[f"mlx5_{x}" if fam.network else None for x in gs] for gs in gpus],
        )


@dataclass
class FamilyState:
    """Counters and pending records of one family of communicators."""

    fam: Family
    hosts: np.ndarray  # (g, n) host of each member
    wire: Wire
    seq: int = 0
    records: list[OpRecord] = field(default_factory=list)
    base_started: np.ndarray | None = None  # (g, n) ops folded away
    base_completed: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.base_started = np.zeros(self.fam.members.shape, np.int64)
        self.base_completed = np.zeros(self.fam.members.shape, np.int64)


class Simulation:
    """One run of one :class:`SimConfig`; iterate :meth:`batches` once."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = cfg = validate(config)
        self.rng = np.random.default_rng(cfg.seed)
        self.topo = Topology.build(cfg)
        self.inj = Injection.build(cfg, self.rng)
        H = cfg.hosts
        self.hb_phase = self.rng.uniform(0.0, min(cfg.heartbeat_s, 1.0), H)
        self.t = self.rng.uniform(0.0, 0.02, self.topo.ranks)  # start-up spread
        self.states = [
            FamilyState(f, self.topo.host_of(f.members), Wire.build(f, self.topo))
            for f in self.topo.families
        ]
        self._by_name = {s.fam.name: s for s in self.states}
        self.engine = None
        if cfg.pipelined:
            from producers.simulator.pipeline import PipelineEngine

            self.engine = PipelineEngine(self)
        self.iterations = 0
        self.emitted_seconds = 0  # seconds whose batches have been (or are being) yielded

    # ---------------------------------------------------------------- timing --------

    def _compute(self, t: np.ndarray, share: float, blip: np.ndarray | None) -> np.ndarray:
        cfg = self.cfg
        jitter = 1.0 + cfg.compute_jitter * self.rng.standard_normal(t.shape[0])
        span = cfg.iteration_s * share * np.maximum(jitter, 0.5)
        factor = self.inj.compute_factor(t)
        if factor is not None:
            span *= factor
        if self.inj.speed is not None:
            span *= self.inj.speed
        if blip is not None:
            span *= blip
        with np.errstate(invalid="ignore"):
            return self.inj.arrive(self.inj.pauses.finish(t, span))

    def _record(self, st: FamilyState, rec: OpRecord, t: np.ndarray) -> np.ndarray:
        st.records.append(rec)
        st.seq += 1
        t = t.copy()
        t[st.fam.members] = rec.end[:, None]
        return t

    def _tp(self, t: np.ndarray) -> np.ndarray:
        st = self._by_name["tp"]
        fam, cfg = st.fam, self.cfg
        arrival = t[fam.members]
        transfer = np.full(fam.groups, ring_bytes(cfg.tp_bytes, fam.size) / (cfg.nvlink_gbs * 1e9))
        end, last = ring_end(arrival, transfer, self.inj.pauses)
        end = self.inj.kill_inflight(fam.members, last, end)
        rec = OpRecord(st.seq, ["AllReduce"] * fam.size, cfg.tp_bytes, arrival, end, last, end)
        return self._record(st, rec, t)

    def _dp(self, t: np.ndarray) -> np.ndarray:
        st = self._by_name["dp"]
        fam, cfg, inj = st.fam, self.cfg, self.inj
        arrival = t[fam.members]
        last = arrival.max(axis=1)
        cb = int(ring_bytes(cfg.dp_bytes, fam.size))
        bw = np.full(arrival.shape, cfg.link_gbs * 1e9)
        cong = inj.congestion_factor(last)
        if cong is not None:
            bw *= cong[:, None]
        inj.dp_bandwidth(bw, last)
        noise = 1.0 + cfg.link_jitter * np.abs(self.rng.standard_normal(arrival.shape))
        link_s = cb / bw * noise
        end, last = ring_end(arrival, link_s.max(axis=1), inj.pauses)
        nominal = end
        end, stalls = inj.dp_link_hangs(last, end)
        end = inj.kill_inflight(fam.members, last, end)
        rec = OpRecord(
            st.seq, ["AllReduce"] * fam.size, cfg.dp_bytes, arrival, end, last, nominal,
            conn_bytes=cb, link_s=link_s, stalls=stalls,
        )  # fmt: skip
        return self._record(st, rec, t)

    def _pp(self, t: np.ndarray, boundary: int, src: int) -> np.ndarray:
        st = self._by_name[f"pp{boundary}"]
        fam, cfg, inj = st.fam, self.cfg, self.inj
        arrival = t[fam.members]
        last = arrival.max(axis=1)
        bw = np.full(fam.groups, cfg.link_gbs * 1e9)
        cong = inj.congestion_factor(last)
        if cong is not None:
            bw *= cong
        bw = inj.pp_bandwidth(bw, fam.members, src, last)
        noise = 1.0 + cfg.link_jitter * np.abs(self.rng.standard_normal(fam.groups))
        link_s = cfg.pp_bytes / bw * noise
        end, last = ring_end(arrival, link_s, inj.pauses)
        end = inj.kill_inflight(fam.members, last, end)
        ops = ["Send", "Recv"] if src == 0 else ["Recv", "Send"]
        rec = OpRecord(
            st.seq, ops, cfg.pp_bytes, arrival, end, last, end,
            conn_bytes=cfg.pp_bytes, link_s=link_s, src=src,
        )  # fmt: skip
        return self._record(st, rec, t)

    def _iteration(self) -> None:
        cfg = self.cfg
        self.inj.begin_step(self.iterations)
        if self.engine is not None:
            self.engine.step()
            self.iterations += 1
            return
        t = self.t
        blip = self.inj.iteration_blips(t)
        has_tp = "tp" in self._by_name
        t = self._compute(t, _FWD, blip)
        if has_tp:
            t = self._tp(t)
        for b in range(cfg.pp - 1):  # activations flow forward
            t = self._pp(self.inj.arrive(t), b, 0)
        t = self._compute(t, _BWD, blip)
        if has_tp:
            t = self._tp(t)
        for b in reversed(range(cfg.pp - 1)):  # gradients flow back
            t = self._pp(self.inj.arrive(t), b, 1)
        for _ in range(cfg.dp_buckets):
            t = self._compute(t, _GRAD / cfg.dp_buckets, blip)
            t = self._dp(t)
        self.t = t
        self.iterations += 1

    def _advance_to(self, horizon: float) -> None:
        """Run iterations until no rank can still start or end an op before ``horizon``."""
        while True:
            finite = self.t[np.isfinite(self.t)]
            if finite.size == 0 or finite.min() >= horizon:
                return
            self._iteration()

    # ---------------------------------------------------------------- emission ------

    def batches(self) -> Iterator[list[Event]]:
        """Yield one batch per (host, communicator) per second, in second order."""
        seconds = int(np.ceil(self.cfg.duration_s))
        for s in range(seconds):
            self._advance_to(min(s + 1.0, self.cfg.duration_s))
            out: dict[tuple[int, int], list[Event]] = {}
            for st in self.states:
                self._emit_ops(st, s, out)
            for st in self.states:
                self._emit_progress(st, s, out)
            for st in self.states:
                self._fold(st, s + 1.0)
            self.emitted_seconds = s + 1
            for key in sorted(out):
                yield out[key]

    def _alive(self, hosts: np.ndarray, when: np.ndarray) -> np.ndarray:
        inj = self.inj
        return ~((when >= inj.down_start[hosts]) & (when < inj.down_end[hosts]))

    def _emit_ops(self, st: FamilyState, s: int, out: dict[tuple[int, int], list[Event]]) -> None:
        cfg, fam, wire = self.cfg, st.fam, st.wire
        lo, hi = float(s), min(s + 1.0, cfg.duration_s)
        n, job, kind = fam.size, cfg.job, fam.kind
        off = self.inj.clock_offset_s
        for rec in st.records:
            gs = np.nonzero((rec.end >= lo) & (rec.end < hi))[0]
            if not gs.size:
                continue
            hosts = st.hosts[gs]
            end = rec.end[gs]
            alive = self._alive(hosts, end[:, None]).tolist()
            ts = (np.rint((end[:, None] + off[hosts]) * 1e6).astype(np.int64) + EPOCH_US).tolist()
            exec_us = np.round((end[:, None] - rec.arrival[gs]) * 1e6, 1).tolist()
            link_us = None if rec.link_s is None else np.round(rec.link_s[gs] * 1e6, 1).tolist()
            ops, seq, nbytes, cb = rec.ops, rec.seq, rec.nbytes, rec.conn_bytes
            for k, g in enumerate(gs.tolist()):
                cid, cname = wire.cids[g], wire.cnames[g]
                keys, names, gpus, nics = wire.keys[g], wire.names[g], wire.gpus[g], wire.nics[g]
                alive_k, ts_k, exec_k = alive[k], ts[k], exec_us[k]
                for m in range(n):
                    if not alive_k[m]:
                        continue
                    conns = None
                    if kind == "dp":
                        lk = link_us[k]
                        conns = [
                            Conn(peer=(m + 1) % n, dir="send", bytes=cb, time_us=lk[m],
                                 retrans=0),
                            Conn(peer=(m - 1) % n, dir="recv", bytes=cb, time_us=lk[m - 1],
                                 retrans=0),
                        ]  # fmt: skip
                    elif kind == "pp":
                        conns = [
                            Conn(peer=1 - m, dir="send" if m == rec.src else "recv", bytes=cb,
                                 time_us=link_us[k], retrans=0)
                        ]  # fmt: skip
                    elif kind == "ep":
                        lk = link_us[k]
                        conns = [
                            Conn(peer=p, dir=d, bytes=cb, time_us=lk[m][p] if d == "send"
                                 else lk[p][m], retrans=0)
                            for p in range(n) if p != m for d in ("send", "recv")
                        ]  # fmt: skip
                    ev = OpEvent(
                        v=1, job=job, comm=cid, nranks=n, rank=m, host=names[m], ts_us=ts_k[m],
                        comm_name=cname, gpu=gpus[m], nic=nics[m], op=ops[m], seq=seq,
                        bytes=nbytes, exec_us=exec_k[m], conns=conns,
                    )  # fmt: skip
                    lst = out.get(keys[m])
                    if lst is None:
                        out[keys[m]] = [ev]
                    else:
                        lst.append(ev)

    def _ticks(self, s: int) -> list[np.ndarray]:
        """Heartbeat times per host inside second s (nan where a host has none)."""
        hb, phase = self.cfg.heartbeat_s, self.hb_phase
        k0 = np.ceil((s - phase) / hb - 1e-9)
        ticks = []
        for j in range(int(np.ceil(1.0 / hb)) + 1):
            tau = phase + (k0 + j) * hb
            tau = np.where((tau >= s) & (tau < min(s + 1.0, self.cfg.duration_s)), tau, np.nan)
            if np.isfinite(tau).any():
                ticks.append(tau)
        return ticks

    def _emit_progress(
        self, st: FamilyState, s: int, out: dict[tuple[int, int], list[Event]]
    ) -> None:
        cfg, fam, wire = self.cfg, st.fam, st.wire
        n, job, network = fam.size, cfg.job, fam.network
        off = self.inj.clock_offset_s[st.hosts]
        for host_tau in self._ticks(s):
            tau = host_tau[st.hosts]  # (g, n)
            valid = np.isfinite(tau) & self._alive(st.hosts, tau)
            started = st.base_started.copy()
            completed = st.base_completed.copy()
            inflight = np.full(tau.shape, -1)
            for ri, rec in enumerate(st.records):
                a_le = rec.arrival <= tau
                e_le = rec.end[:, None] <= tau
                started += a_le
                completed += e_le
                inflight[a_le & ~e_le] = ri
            busy = inflight >= 0
            if busy.any():
                ius, send_b, recv_b, retrans = self._inflight(st, tau, inflight)
                ius_l, send_l, recv_l, retr_l = (
                    ius.tolist(),
                    send_b.tolist(),
                    recv_b.tolist(),
                    retrans.tolist(),
                )
            ts = (np.rint((tau + off) * 1e6) + EPOCH_US).tolist()
            valid_l, infl_l = valid.tolist(), inflight.tolist()
            started_l, completed_l = started.tolist(), completed.tolist()
            records = st.records
            for g in range(fam.groups):
                cid, cname = wire.cids[g], wire.cnames[g]
                keys, names, gpus, nics = wire.keys[g], wire.names[g], wire.gpus[g], wire.nics[g]
                valid_g, infl_g, ts_l = valid_l[g], infl_l[g], ts[g]
                for m in range(n):
                    if not valid_g[m]:
                        continue
                    ri = infl_g[m]
                    if ri < 0:
                        ev = ProgressEvent(
                            v=1, job=job, comm=cid, nranks=n, rank=m, host=names[m],
                            ts_us=int(ts_l[m]), comm_name=cname, gpu=gpus[m], nic=nics[m],
                            started=started_l[g][m], completed=completed_l[g][m],
                        )  # fmt: skip
                    else:
                        rec = records[ri]
                        conns = None
                        if network:
                            conns = self._conns(rec, m, n, send_l[g][m], recv_l[g][m], retr_l[g][m])
                        ev = ProgressEvent(
                            v=1, job=job, comm=cid, nranks=n, rank=m, host=names[m],
                            ts_us=int(ts_l[m]), comm_name=cname, gpu=gpus[m], nic=nics[m],
                            started=started_l[g][m], completed=completed_l[g][m],
                            inflight_op=rec.ops[m], inflight_us=ius_l[g][m], conns=conns,
                        )  # fmt: skip
                    lst = out.get(keys[m])
                    if lst is None:
                        out[keys[m]] = [ev]
                    else:
                        lst.append(ev)

    def _inflight(
        self, st: FamilyState, tau: np.ndarray, inflight: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For members with an op in flight at ``tau``: how long it has run (µs), the
        cumulative bytes sent and received for it so far, and retransmits."""
        shape = tau.shape
        n = shape[1]
        ius = np.zeros(shape)
        send_b = np.zeros(shape, np.int64)
        recv_b = np.zeros(shape, np.int64)
        retrans = np.zeros(shape, np.int64)
        for ri, rec in enumerate(st.records):
            mask = inflight == ri
            if not mask.any():
                continue
            ius[mask] = np.round((tau - rec.arrival)[mask] * 1e6, 1)
            if not st.fam.network:
                continue
            # bytes move from the last arrival on, at the pace of the slowest link
            with np.errstate(invalid="ignore", divide="ignore"):
                span = (rec.nominal_end - rec.last)[:, None]
                frac = np.nan_to_num(np.clip((tau - rec.last[:, None]) / span, 0.0, 1.0))
            f_send, f_recv = frac, frac.copy()
            for g, (i, stall_t) in rec.stalls.items():
                frozen = min(1.0, max(0.0, (stall_t - rec.last[g]) / span[g, 0]))
                f_send[g, i] = min(f_send[g, i], frozen)
                f_recv[g, (i + 1) % n] = min(f_recv[g, (i + 1) % n], frozen)
                retrans[g, i] = int(max(0.0, tau[g, i] - stall_t) * self.cfg.retrans_per_s)
            send_b[mask] = (rec.conn_bytes * f_send[mask]).astype(np.int64)
            recv_b[mask] = (rec.conn_bytes * f_recv[mask]).astype(np.int64)
        return ius, send_b, recv_b, retrans

    @staticmethod
    def _conns(rec: OpRecord, m: int, n: int, sent: int, got: int, retrans: int) -> list[Conn]:
        if rec.src == -2:  # all-to-all: every peer
            return [
                Conn(peer=p, dir=d, bytes=sent if d == "send" else got, retrans=0)
                for p in range(n)
                if p != m
                for d in ("send", "recv")
            ]
        if rec.src >= 0:  # pipeline pair: one connection
            if m == rec.src:
                return [Conn(peer=1 - m, dir="send", bytes=sent, retrans=retrans)]
            return [Conn(peer=1 - m, dir="recv", bytes=got, retrans=0)]
        return [
            Conn(peer=(m + 1) % n, dir="send", bytes=sent, retrans=retrans),
            Conn(peer=(m - 1) % n, dir="recv", bytes=got, retrans=0),
        ]

    @staticmethod
    def _fold(st: FamilyState, horizon: float) -> None:
        """Fold groups whose op ended before ``horizon`` into the base counters."""
        keep = []
        for rec in st.records:
            done = rec.end < horizon
            if done.any():
                st.base_started[done] += 1
                st.base_completed[done] += 1
                rec.arrival[done] = np.inf
                rec.end[done] = np.inf
            if np.isfinite(rec.arrival).any():
                keep.append(rec)
        st.records = keep


def simulate(config: SimConfig) -> Iterator[list[Event]]:
    """Yield the trace of a simulated job as exporter batches (one per host, communicator
    and second), in nondecreasing order of the second they cover.

    >>> from producers.simulator.config import SimConfig
    >>> batches = list(simulate(SimConfig(hosts=2, gpus_per_host=2, tp=2, duration_s=2)))
    >>> len(batches)  # 2 s x 2 hosts x (1 TP + 2 DP communicators)
    12
    >>> sorted({type(e).__name__ for b in batches for e in b})
    ['OpEvent', 'ProgressEvent']
    """
    yield from Simulation(config).batches()
