"""Timing of the microbatched shapes: a pipeline of stages, per-layer tensor-parallel
collectives, ZeRO/FSDP data parallel and expert all-to-all, one training step at a time.

Who waits for whom (the physics every number below follows):

- **Inside a stage** every rank runs the same steps (:mod:`.schedule`); each layer of
  a forward is compute, a TP AllReduce (NVLink), compute, a TP AllReduce — a backward
  the same at twice the compute. A mixture-of-experts layer puts an AllToAll over its
  expert group before and after the expert compute. A collective ends when its last
  member arrives plus its transfer (the ring model of :mod:`.timing`), so the ranks of
  a TP, DP or expert group wait for their slowest member.
- **Between stages** activations (forward) and gradients (backward) are Send/Recv on a
  two-rank communicator per (host, rail) pair of adjacent stages. A send is posted
  when the producing step ends and does not block the sender's compute (its own
  stream); a receive is posted when the consuming step could start and blocks it. The
  transfer moves bytes once both are posted, so *both* kernels' times include waiting
  for the other stage: the Recv of the stage downstream of a slow one, the Send of the
  stage upstream of it. In warm-up and cool-down those waits are the bubbles of the
  schedule: waiting by design.
- **Data parallel** (rings per stage and rail): ``allreduce`` — one AllReduce per
  bucket after the last backward; ``zero`` (ZeRO-1/2, Megatron's distributed
  optimizer) — a ReduceScatter per bucket, the optimizer step, an AllGather per bucket;
  ``fsdp`` (ZeRO-3) — an AllGather of a bucket's parameters before its layers run in
  every forward and backward, and a ReduceScatter of its gradients after the backward
  of the last microbatch.

Compute: one step of one stage computes ``iteration_s`` (one third forward, two thirds
backward, split evenly over microbatches, chunks and layers) plus ``opt_share`` of it
for the optimizer, times the static per-GPU speed, stragglers and ``stage_heavy``. The
wall time of a step is longer by the pipeline's fill and drain: about
``iteration_s * (M + P - 1) / M`` for 1F1B with ``M`` microbatches and ``P`` stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from producers.simulator.config import moe_layers
from producers.simulator.schedule import Step, Transfer, program, transfers_of
from producers.simulator.timing import ring_bytes, ring_end

if TYPE_CHECKING:
    from producers.simulator.generate import FamilyState, Simulation

__all__ = ["PipelineEngine"]

_FWD_SHARE = 1.0 / 3.0  # of a microbatch's compute; the backward is the other 2/3


class PipelineEngine:
    """Runs one training step of a microbatched shape on a :class:`Simulation`'s state."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        cfg = self.cfg = sim.cfg
        self.inj = sim.inj
        self.rng = sim.rng
        P, G = cfg.pp, cfg.gpus_per_host
        hps = cfg.hosts_per_stage
        self.P, self.v = P, cfg.chunks
        self.stage_ranks = [np.arange(s * hps * G, (s + 1) * hps * G) for s in range(P)]
        by = sim._by_name
        self.tp = [by.get(f"tp-s{s}") for s in range(P)]
        self.dp = [by[f"dp-s{s}"] for s in range(P)]
        self.ep = [by.get(f"ep-s{s}") for s in range(P)]
        self.pp = {b: by[f"pp{b}"] for b in range(P) if f"pp{b}" in by}
        self.programs = [program(cfg.schedule, s, P, cfg.microbatches, self.v) for s in range(P)]
        self.layers = cfg.layers // self.v if cfg.layers else 0  # per chunk
        self.moe = moe_layers(self.layers, cfg.moe_every)
        nb = min(cfg.dp_buckets, self.layers) if self.layers else 1
        self.buckets = nb
        # bucket of each layer (contiguous runs of layers)
        self.bucket_of = [ell * nb // max(self.layers, 1) for ell in range(max(self.layers, 1))]
        self.dp_bucket_bytes = cfg.dp_bytes
        self.lat = cfg.op_latency_us * 1e-6
        # compute of one forward of one chunk of one microbatch, per stage
        sf = self.inj.stage_factor
        self.fwd_s = [
            cfg.iteration_s
            * _FWD_SHARE
            / (cfg.microbatches * self.v)
            * (sf[s] if sf is not None else 1.0)
            for s in range(P)
        ]

    # ------------------------------------------------------------------ helpers ----

    def _arrive(self, ranks: np.ndarray, t: np.ndarray) -> np.ndarray:
        inj = self.inj
        blocked = (t >= inj.hang_start[ranks]) & (t < inj.hang_end[ranks])
        return np.where(blocked, inj.hang_end[ranks], t) if blocked.any() else t

    def _compute(self, s: int, span_s: float) -> None:
        """Every rank of stage ``s`` computes ``span_s`` (jitter, stragglers, pauses)."""
        t = self.sim.t
        ranks = self.stage_ranks[s]
        tt = t[ranks]
        jitter = 1.0 + self.cfg.compute_jitter * self.rng.standard_normal(ranks.shape[0])
        span = span_s * np.maximum(jitter, 0.5)
        factor = self.inj.compute_factor_of(ranks, tt)
        if factor is not None:
            span *= factor
        with np.errstate(invalid="ignore"):
            t[ranks] = self._arrive(ranks, self.inj.pauses.finish(tt, span))

    def _record(self, st: FamilyState, rec, t_set: bool = True) -> None:  # noqa: ANN001
        st.records.append(rec)
        st.seq += 1
        if t_set:
            self.sim.t[st.fam.members] = rec.end[:, None]

    def _tp(self, s: int) -> None:
        st = self.tp[s]
        if st is None:
            return
        from producers.simulator.generate import OpRecord

        fam, cfg = st.fam, self.cfg
        arrival = self.sim.t[fam.members]
        transfer = np.full(
            fam.groups, ring_bytes(cfg.tp_bytes, fam.size) / (cfg.nvlink_gbs * 1e9) + self.lat
        )
        end, last = ring_end(arrival, transfer, self.inj.pauses)
        end = self.inj.kill_inflight(fam.members, last, end)
        self._record(st, OpRecord(st.seq, ["AllReduce"] * fam.size, cfg.tp_bytes, arrival,
                                  end, last, end))  # fmt: skip

    def _link_bw(self, hosts: np.ndarray, rails: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Bandwidth of each host's NIC on its rail (either direction): slow NICs and
        congestion at each transfer's start ``last`` (broadcast against ``hosts``)."""
        inj, cfg = self.inj, self.cfg
        bw = np.full(hosts.shape, cfg.link_gbs * 1e9)
        cong = inj.congestion_factor(np.broadcast_to(last, hosts.shape).astype(float))
        if cong is not None:
            bw = bw * cong
        for k, (host, nic, start, end, _sev) in enumerate(inj.slow_nics):
            tl = np.broadcast_to(last, hosts.shape)
            hit = (hosts == host) & (rails == nic) & (tl >= start) & (tl < end)
            if hit.any():
                bw = np.where(hit, bw * inj.nic_fraction(k, tl), bw)
        return bw

    def _dp(self, s: int, op: str, nbytes: int) -> None:
        """One ring collective on every DP ring of stage ``s`` (op AllReduce,
        ReduceScatter or AllGather)."""
        from producers.simulator.generate import OpRecord

        st = self.dp[s]
        fam, cfg, inj = st.fam, self.cfg, self.inj
        members = fam.members
        arrival = self.sim.t[members]
        last = arrival.max(axis=1)
        n = fam.size
        factor = 2.0 if op == "AllReduce" else 1.0
        cb = int(factor * (n - 1) / n * nbytes)
        hosts = st.hosts
        nxt = np.roll(hosts, -1, axis=1)
        rails = members % cfg.gpus_per_host
        # link i -> i+1 runs at the slower of the two NICs it joins
        bw = np.minimum(
            self._link_bw(hosts, rails, last[:, None]), self._link_bw(nxt, rails, last[:, None])
        )
        for host, peer, nic, start, end, sev in inj.slow_links:
            hit = (hosts == host) & (nxt == peer) & (rails == nic)
            hit &= (last[:, None] >= start) & (last[:, None] < end)
            bw = np.where(hit, bw * sev, bw)
        noise = 1.0 + cfg.link_jitter * np.abs(self.rng.standard_normal(arrival.shape))
        link_s = cb / bw * noise
        end, last = ring_end(arrival, link_s.max(axis=1) + self.lat, inj.pauses)
        nominal = end
        stalls: dict[int, tuple[int, float]] = {}
        for host, peer, nic, start, stop in inj.link_hangs:
            rows, cols = np.nonzero((hosts == host) & (nxt == peer) & (rails == nic))
            for g, i in zip(rows.tolist(), cols.tolist(), strict=True):
                if np.isfinite(last[g]) and end[g] > start and last[g] < stop:
                    stall_t = max(start, float(last[g]))
                    stalls[g] = (i, stall_t)
                    end = end.copy()
                    end[g] = np.inf if not np.isfinite(stop) else stop + (end[g] - stall_t)
        end = inj.kill_inflight(members, last, end)
        self._record(st, OpRecord(st.seq, [op] * n, nbytes, arrival, end, last, nominal,
                                  conn_bytes=cb, link_s=link_s, stalls=stalls))  # fmt: skip

    def _ep(self, s: int) -> None:
        """One AllToAll on every expert group of stage ``s``: each rank sends 1/n of
        ``ep_bytes`` to each peer; a pair's flow shares both NICs with the n-1 others."""
        from producers.simulator.generate import OpRecord

        st = self.ep[s]
        if st is None:
            return
        fam, cfg, inj = st.fam, self.cfg, self.inj
        members = fam.members
        n = fam.size
        arrival = self.sim.t[members]
        last = arrival.max(axis=1)
        hosts = st.hosts
        rails = members % cfg.gpus_per_host
        nic_bw = self._link_bw(hosts, rails, last[:, None])  # (g, n)
        pair_bw = np.minimum(nic_bw[:, :, None], nic_bw[:, None, :])  # (g, src, dst)
        for host, peer, nic, start, end, sev in inj.slow_links:
            hit = (hosts[:, :, None] == host) & (hosts[:, None, :] == peer)
            hit &= (rails[:, :, None] == nic) & (last[:, None, None] >= start)
            hit &= last[:, None, None] < end
            pair_bw = np.where(hit, pair_bw * sev, pair_bw)
        per_pair = cfg.ep_bytes // n
        noise = 1.0 + cfg.link_jitter * np.abs(self.rng.standard_normal(pair_bw.shape))
        link_s = cfg.ep_bytes * (n - 1) / n / pair_bw * noise
        idx = np.arange(n)
        link_s[:, idx, idx] = 0.0
        end, last = ring_end(
            arrival, link_s.reshape(fam.groups, -1).max(axis=1) + self.lat, inj.pauses
        )
        end = inj.kill_inflight(members, last, end)
        self._record(st, OpRecord(st.seq, ["AllToAll"] * n, cfg.ep_bytes, arrival, end, last,
                                  end, conn_bytes=per_pair, link_s=link_s,
                                  src=-2))  # fmt: skip

    # ------------------------------------------------------------------ pipeline ---

    def _route(self, x: Transfer) -> tuple[int, int]:
        """(boundary, sending member) of a transfer."""
        kind, k, _m = x
        s = k % self.P
        return (s, 0) if kind == "f" else ((s - 1) % self.P, 1)

    def _transfer(self, x: Transfer, send_post: np.ndarray, recv_post: np.ndarray) -> None:
        """Both ends have posted: move the bytes; the receiver resumes at the end."""
        from producers.simulator.generate import OpRecord

        b, src = self._route(x)
        st = self.pp[b]
        fam, cfg, inj = st.fam, self.cfg, self.inj
        arrival = np.empty(fam.members.shape)
        arrival[:, src] = send_post
        arrival[:, 1 - src] = recv_post
        last = arrival.max(axis=1)
        bw = np.full(fam.groups, cfg.link_gbs * 1e9)
        cong = inj.congestion_factor(last)
        if cong is not None:
            bw *= cong
        bw = inj.pp_bandwidth(bw, fam.members, src, last)
        noise = 1.0 + cfg.link_jitter * np.abs(self.rng.standard_normal(fam.groups))
        link_s = cfg.pp_bytes / bw * noise
        end, last = ring_end(arrival, link_s + self.lat, inj.pauses)
        end = inj.kill_inflight(fam.members, last, end)
        ops = ["Send", "Recv"] if src == 0 else ["Recv", "Send"]
        rec = OpRecord(st.seq, ops, cfg.pp_bytes, arrival, end, last, end,
                       conn_bytes=cfg.pp_bytes, link_s=link_s, src=src)  # fmt: skip
        self._record(st, rec, t_set=False)
        recv = fam.members[:, 1 - src]
        t = self.sim.t
        t[recv] = np.maximum(t[recv], end)

    def _posts(self, x: Transfer, side: str) -> np.ndarray:
        b, src = self._route(x)
        col = src if side == "send" else 1 - src
        return self.sim.t[self.pp[b].fam.members[:, col]].copy()

    def _run_step(self, s: int, step: Step, last_mb: bool) -> None:
        """The compute and stage-local collectives of one forward or backward."""
        phase = step[0]
        fwd = self.fwd_s[s]
        span = fwd if phase == "F" else 2.0 * fwd
        L = self.layers
        fsdp = self.cfg.dp_mode == "fsdp"
        if not L:
            if fsdp:
                self._dp(s, "AllGather", self.dp_bucket_bytes)
            self._compute(s, span)
            if fsdp and phase == "B" and last_mb:
                self._dp(s, "ReduceScatter", self.dp_bucket_bytes)
            return
        order = range(L) if phase == "F" else range(L - 1, -1, -1)
        half = span / L / 2.0
        prev_bucket = -1
        for ell in order:
            bucket = self.bucket_of[ell]
            if fsdp and bucket != prev_bucket:
                self._dp(s, "AllGather", self.dp_bucket_bytes)
            self._compute(s, half)
            self._tp(s)
            if ell in self.moe:
                self._ep(s)
                self._compute(s, half)
                self._ep(s)
            else:
                self._compute(s, half)
            self._tp(s)
            prev_bucket = bucket
            last_of_bucket = (
                ell == 0 or self.bucket_of[ell - 1] != bucket
                if phase == "B"
                else ell == L - 1 or self.bucket_of[ell + 1] != bucket
            )
            if fsdp and phase == "B" and last_mb and last_of_bucket:
                self._dp(s, "ReduceScatter", self.dp_bucket_bytes)

    def _finish_step(self, s: int) -> None:
        """The data-parallel phase and optimizer step that close a training step."""
        cfg = self.cfg
        n = self.buckets * self.v
        mode = cfg.dp_mode
        if mode == "allreduce":
            for _ in range(n):
                self._dp(s, "AllReduce", self.dp_bucket_bytes)
        elif mode == "zero":
            for _ in range(n):
                self._dp(s, "ReduceScatter", self.dp_bucket_bytes)
        if cfg.opt_share > 0:
            self._compute(s, cfg.iteration_s * cfg.opt_share)
        if mode == "zero":
            for _ in range(n):
                self._dp(s, "AllGather", self.dp_bucket_bytes)

    def step(self) -> None:
        """One training step of every stage, in dependency order.

        Each stage runs its program until it needs a transfer whose sender has not
        posted yet; then the next stage runs. Sends never block, so a valid schedule
        always progresses; a stuck one is a bug in the schedule and raises.
        """
        P, v = self.P, self.v
        ptr = [0] * P
        sent: dict[Transfer, np.ndarray] = {}
        waiting: set[Transfer] = set()
        done: set[Transfer] = set()
        last_mb = {s: self._last_use(s) for s in range(P)}
        finished = [False] * P
        progressed = True
        while progressed:
            progressed = False
            for s in range(P):
                prog = self.programs[s]
                while ptr[s] < len(prog):
                    step = prog[ptr[s]]
                    inp, out = transfers_of(step, s, P, v)
                    if inp is not None and inp not in done:
                        if inp not in sent:
                            waiting.add(inp)
                            break
                        self._transfer(inp, sent.pop(inp), self._posts(inp, "recv"))
                        waiting.discard(inp)
                        done.add(inp)
                    self._run_step(s, step, last_mb[s][ptr[s]])
                    if out is not None:
                        post = self._posts(out, "send")
                        if out in waiting:
                            # the receiver is blocked at its post time, which its own
                            # ranks' clocks still show
                            self._transfer(out, post, self._posts(out, "recv"))
                            waiting.discard(out)
                            done.add(out)
                        else:
                            sent[out] = post
                    ptr[s] += 1
                    progressed = True
                if ptr[s] == len(prog) and not finished[s]:
                    self._finish_step(s)
                    finished[s] = True
        if not all(finished):
            raise RuntimeError(f"pipeline schedule stuck at steps {ptr}")

    def _last_use(self, s: int) -> list[bool]:
        """Per program step: whether it is the backward of the last microbatch of its
        chunk on stage ``s`` (FSDP reduces the chunk's gradients then)."""
        prog = self.programs[s]
        last: dict[int, int] = {}
        for i, (phase, chunk, _m) in enumerate(prog):
            if phase == "B":
                last[chunk] = i
        return [i == last.get(c) and p == "B" for i, (p, c, _m) in enumerate(prog)]


def measure_step_s(config, steps: int = 3) -> float:  # noqa: ANN001  (SimConfig)
    """Mean wall time of a training step of ``config``'s shape, timed (not emitted) on
    a small healthy copy of it: two hosts per stage (``ep`` if larger), no faults."""
    import msgspec

    from producers.simulator.generate import Simulation

    hps = max(2, config.ep if config.moe_every else 2)
    small = msgspec.structs.replace(
        config, hosts=config.pp * hps, faults=[], benign=[], duration_s=1e4, gpu_spread=0.0
    )
    sim = Simulation(small)
    sim._iteration()  # the first step starts from the start-up spread
    t0 = float(sim.t.max())
    for _ in range(steps):
        sim._iteration()
    return (float(sim.t.max()) - t0) / steps


def with_rate(config, rate: float, step_s: float | None = None):  # noqa: ANN001, ANN201
    """The same job with ``layers`` (and ``iteration_s``) set so that each rank
    completes about ``rate`` collectives per second at a step of ``step_s`` (default:
    the job's current step). Deterministic: the step is timed on a small healthy copy.
    More layers in the same step are thinner layers, so ``tp_bytes`` shrinks to keep
    the tensor-parallel transfers within a quarter of the step (NVLink-bound, as real
    jobs are at these rates); a step shorter than a second is a smaller model, so its
    pipeline, data-parallel and expert messages shrink in proportion.

    Raises SimConfigError when the collectives alone would take longer than the step.
    """
    import msgspec

    from producers.simulator.config import (
        SimConfigError,
        collectives_per_step,
        step_estimate_s,
        with_step,
    )

    if not config.pipelined:
        raise SimConfigError("--rate needs a microbatched shape (schedule 1f1b or interleaved)")
    if not rate > 0:
        raise SimConfigError("--rate must be positive")
    target = step_s or measure_step_s(config)
    v = config.chunks
    lo = msgspec.structs.replace(config, layers=v)
    hi = msgspec.structs.replace(config, layers=2 * v)
    slope = (collectives_per_step(hi) - collectives_per_step(lo)) / v
    cfg = config
    if target < 1.0:
        cfg = msgspec.structs.replace(
            cfg,
            pp_bytes=int(cfg.pp_bytes * target),
            dp_bytes=int(cfg.dp_bytes * target),
            ep_bytes=int(cfg.ep_bytes * target),
        )
    for _ in range(3):
        if slope <= 0:
            raise SimConfigError("--rate needs tensor-parallel groups (tp > 1) to add layers")
        layers = (rate * target - collectives_per_step(lo)) / slope + v
        layers = max(v, int(round(layers / v)) * v)
        cfg = msgspec.structs.replace(cfg, layers=layers)
        # whole layers: the step absorbs the rounding so that the rate is the one asked
        target = collectives_per_step(cfg) / rate
        tp_ops = 4 * layers * cfg.microbatches if cfg.tp > 1 else 0
        if tp_ops:
            per_op_s = 0.25 * target / tp_ops
            fit = per_op_s * cfg.nvlink_gbs * 1e9 / (2 * (cfg.tp - 1) / cfg.tp)
            cfg = msgspec.structs.replace(cfg, tp_bytes=int(min(config.tp_bytes, fit)))
        cfg = with_step(cfg, target)
        overhead = measure_step_s(cfg) - step_estimate_s(cfg)
        if overhead >= 0.8 * target:
            raise SimConfigError(
                f"--rate {rate:g}: {layers} layers of collectives take {overhead:.3g} s, "
                f"more than a {target:.3g}-s step allows; ask for a lower rate or longer step"
            )
        cfg = with_step(cfg, target - overhead)
    return cfg
