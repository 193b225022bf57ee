"""Injected faults and benign events, compiled into arrays the timing loop applies.

How each fault acts on the model (times in simulated seconds):

- straggler: compute phases of one rank that *start* inside the fault take
  ``severity`` times longer, so that rank arrives late at every collective of every
  communicator it belongs to.
- slow_nic: both directions of NIC ``mlx5_<nic>`` of a host run at ``severity`` of
  their bandwidth: on the rail's DP ring the host's send link *and* the link into it
  are slow (a slow row and a slow column of the rail's src×dst matrix).
- slow_link: one direction ``host -> peer_host`` on one rail (a single slow cell).
- rank_hang: the process stops between two collectives: from ``start_s`` it starts
  no collective (its started counter freezes); its exporter keeps sending
  heartbeats with the frozen counters, since the host is alive.
- host_down: the host goes silent (no events at all); a collective it was part of
  never completes, and it starts no new one. Peers wait with growing inflight_us.
- link_hang: bytes stop on connection ``host -> peer_host`` of the rail's DP ring:
  every rank has started the collective, nobody completes, the sender retransmits.

A fault with ``end_s`` set recovers then (a hung rank resumes, a dead host returns).

Intermittent stragglers (``duty`` < 1) are slow on a seeded share of training steps;
a ramped slow_nic (``ramp_s`` > 0) loses bandwidth linearly until it reaches
``severity``. A static per-GPU speed spread (``gpu_spread``) multiplies every compute
phase of a GPU by its own factor for the whole run (benign: power and clock binning).

Benign: checkpoints pause every rank at once; congestion slows every network link;
a blip slows one GPU for one iteration; clock offsets shift a host's timestamps; a late
role slows one GPU position on every host alike (a straggler everywhere is a role).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from producers.simulator.config import SimConfig, bandwidth_fraction
from producers.simulator.timing import Pauses

__all__ = ["Injection"]

INF = np.inf


def _end(x: float | None) -> float:
    return INF if x is None else float(x)


@dataclass
class Injection:
    """Everything injected into one run, in the form the timing loop needs."""

    gpus_per_host: int
    hosts_per_stage: int
    hang_start: np.ndarray  # (ranks,) a rank arriving in [hang_start, hang_end) waits till end
    hang_end: np.ndarray
    down_start: np.ndarray  # (hosts,) host silent in [down_start, down_end)
    down_end: np.ndarray
    clock_offset_s: np.ndarray  # (hosts,)
    pauses: Pauses
    stragglers: list[tuple[int, float, float, float]] = field(default_factory=list)
    straggler_duty: list[float] = field(default_factory=list)  # per stragglers entry
    slow_step: list[bool] = field(default_factory=list)  # per stragglers entry, this step
    speed: np.ndarray | None = None  # (ranks,) static compute multiplier (gpu_spread)
    stage_factor: np.ndarray | None = None  # (stages,) stage_heavy compute multiplier
    nic_ramp_s: list[float] = field(default_factory=list)  # per slow_nics entry
    seed: int = 0
    blips: list[list] = field(default_factory=list)  # [rank, start, severity, applied]
    slow_nics: list[tuple[int, int, float, float, float]] = field(default_factory=list)
    slow_links: list[tuple[int, int, int, float, float, float]] = field(default_factory=list)
    link_hangs: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    congestion: list[tuple[float, float, float]] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: SimConfig, rng: np.random.Generator) -> Injection:
        G, H = cfg.gpus_per_host, cfg.hosts
        n = H * G
        inj = cls(
            gpus_per_host=G,
            hosts_per_stage=cfg.hosts_per_stage,
            hang_start=np.full(n, INF),
            hang_end=np.full(n, INF),
            down_start=np.full(H, INF),
            down_end=np.full(H, INF),
            clock_offset_s=rng.uniform(-1.0, 1.0, H) * cfg.clock_skew_ms * 1e-3,
            pauses=Pauses.none(),
            seed=cfg.seed,
        )
        if cfg.gpu_spread > 0:
            # its own stream of randomness: the main one (and so every other draw) is as
            # without a spread
            spread = np.random.default_rng([cfg.seed, 0x5EED]).uniform(-1.0, 1.0, n)
            inj.speed = 1.0 + cfg.gpu_spread * spread
        for f in cfg.faults:
            start, end = float(f.start_s), _end(f.end_s)
            if f.kind == "straggler":
                inj.stragglers.append((f.host * G + (f.gpu or 0), start, end, f.severity))
                inj.straggler_duty.append(f.duty)
            elif f.kind == "slow_nic":
                inj.slow_nics.append(
                    (f.host, f.nic or 0, start, end, bandwidth_fraction(f.severity))
                )
                inj.nic_ramp_s.append(f.ramp_s)
            elif f.kind == "slow_link":
                inj.slow_links.append(
                    (
                        f.host,
                        int(f.peer_host or 0),
                        f.nic or 0,
                        start,
                        end,
                        bandwidth_fraction(f.severity),
                    )
                )
            elif f.kind == "link_hang":
                inj.link_hangs.append((f.host, int(f.peer_host or 0), f.nic or 0, start, end))
            elif f.kind == "rank_hang":
                r = f.host * G + (f.gpu or 0)
                inj.hang_start[r], inj.hang_end[r] = start, end
            elif f.kind == "host_down":
                rs = slice(f.host * G, f.host * G + G)
                inj.hang_start[rs], inj.hang_end[rs] = start, end
                inj.down_start[f.host], inj.down_end[f.host] = start, end
        pauses = []
        for b in cfg.benign:
            if b.kind == "checkpoint":
                pauses.append((b.start_s, b.start_s + b.duration_s))
            elif b.kind == "congestion":
                inj.congestion.append((b.start_s, b.start_s + b.duration_s, b.severity))
            elif b.kind == "blip":
                inj.blips.append(
                    [int(b.host or 0) * G + (b.gpu or 0), b.start_s, b.severity, False]
                )
            elif b.kind == "clock_offset":
                inj.clock_offset_s[int(b.host or 0)] += b.severity * 1e-3
            elif b.kind == "role_late":
                for h in range(H):
                    inj.stragglers.append((h * G + (b.gpu or 0), b.start_s, INF, b.severity))
                    inj.straggler_duty.append(1.0)
            elif b.kind == "stage_heavy":
                if inj.stage_factor is None:
                    inj.stage_factor = np.ones(cfg.pp)
                inj.stage_factor[int(b.stage or 0)] *= b.severity
        inj.slow_step = [True] * len(inj.stragglers)
        if pauses:
            pauses.sort()
            inj.pauses = Pauses(np.array([p[0] for p in pauses]), np.array([p[1] for p in pauses]))
        return inj

    # -- ranks -------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Draw which intermittent stragglers are slow in training step ``step``.

        From a stream of its own per (seed, straggler, step), so the draw neither
        depends on nor disturbs any other randomness of the run.
        """
        for i, duty in enumerate(self.straggler_duty):
            if duty < 1:
                u = np.random.default_rng([self.seed, 0xD07, i, step]).random()
                self.slow_step[i] = bool(u < duty)

    def compute_factor(self, t: np.ndarray) -> np.ndarray | None:
        """Compute-time multiplier per rank for phases starting at ``t`` (None: all 1)."""
        if not self.stragglers:
            return None
        f = np.ones_like(t)
        for (rank, start, end, sev), slow in zip(self.stragglers, self.slow_step, strict=True):
            if slow and start <= t[rank] < end:
                f[rank] *= sev
        return f

    def compute_factor_of(self, ranks: np.ndarray, t: np.ndarray) -> np.ndarray | None:
        """:meth:`compute_factor` for the ranks ``ranks`` only (``t`` aligned with them),
        the static speed spread included (None: all 1)."""
        f = None if self.speed is None else self.speed[ranks].copy()
        if not self.stragglers:
            return f
        pos = {int(r): i for i, r in enumerate(ranks.tolist())} if len(self.stragglers) else {}
        for (rank, start, end, sev), slow in zip(self.stragglers, self.slow_step, strict=True):
            i = pos.get(rank)
            if i is not None and slow and start <= t[i] < end:
                f = np.ones_like(t) if f is None else f
                f[i] *= sev
        return f

    def nic_fraction(self, k: int, t: np.ndarray | float) -> np.ndarray | float:
        """Remaining bandwidth of slow NIC ``k`` for a transfer starting at ``t``
        (its full severity at once, or along its ramp)."""
        sev = self.slow_nics[k][4]
        ramp = self.nic_ramp_s[k]
        if ramp <= 0:
            return sev
        start = self.slow_nics[k][2]
        return 1.0 - (1.0 - sev) * np.clip((np.asarray(t) - start) / ramp, 0.0, 1.0)

    def iteration_blips(self, t: np.ndarray) -> np.ndarray | None:
        """Per-rank multiplier for the iteration starting at ``t``: each blip fires once."""
        out = None
        for blip in self.blips:
            rank, start, sev, applied = blip
            if not applied and t[rank] >= start:
                blip[3] = True
                if np.isfinite(t[rank]):
                    out = np.ones_like(t) if out is None else out
                    out[rank] *= sev
        return out

    def arrive(self, t: np.ndarray) -> np.ndarray:
        """Arrival times after hangs: a rank hung at its arrival waits till the hang ends."""
        blocked = (t >= self.hang_start) & (t < self.hang_end)
        if blocked.any():
            t = np.where(blocked, self.hang_end, t)
        return t

    def kill_inflight(self, members: np.ndarray, last: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Collectives in flight when a member's host dies never end (or end after it returns)."""
        if not np.isfinite(self.down_start).any():
            return end
        hosts = members // self.gpus_per_host
        ds = self.down_start[hosts]
        hit = (last[:, None] < ds) & (end[:, None] > ds)
        if not hit.any():
            return end
        back = np.where(hit, self.down_end[hosts], -INF).max(axis=1)
        with np.errstate(invalid="ignore"):
            resumed = back + (end - last)
        return np.where(hit.any(axis=1), resumed, end)

    # -- links -------------------------------------------------------------------------

    def congestion_factor(self, t: np.ndarray) -> np.ndarray | None:
        """Bandwidth fraction of every network link for transfers starting at ``t``."""
        if not self.congestion:
            return None
        f = np.ones_like(t)
        for start, end, sev in self.congestion:
            f = np.where((t >= start) & (t < end), f / sev, f)
        return f

    def _ring_pos(self, host: int, rail: int) -> tuple[int, int]:
        stage, pos = divmod(host, self.hosts_per_stage)
        return stage * self.gpus_per_host + rail, pos

    def dp_bandwidth(self, bw: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Scale (rings, n) link bandwidths (link i -> i+1) by NIC and link faults active
        when each ring's transfer starts (``last``, per ring). Modifies ``bw``."""
        n = bw.shape[1]
        for k, (host, rail, start, end, _sev) in enumerate(self.slow_nics):
            g, i = self._ring_pos(host, rail)
            if start <= last[g] < end:
                sev = self.nic_fraction(k, float(last[g]))
                bw[g, i] *= sev  # the host's send link
                bw[g, (i - 1) % n] *= sev  # the link into the host
        for host, _peer, rail, start, end, sev in self.slow_links:
            g, i = self._ring_pos(host, rail)
            if _peer == self._next_host(host) and start <= last[g] < end:
                bw[g, i] *= sev
        return bw

    def _next_host(self, host: int) -> int:
        stage, pos = divmod(host, self.hosts_per_stage)
        return stage * self.hosts_per_stage + (pos + 1) % self.hosts_per_stage

    def pp_bandwidth(
        self, bw: np.ndarray, members: np.ndarray, src: int, last: np.ndarray
    ) -> np.ndarray:
        """Scale (pairs,) bandwidths of pipeline transfers from member ``src`` to the other."""
        if not (self.slow_nics or self.slow_links):
            return bw
        G = self.gpus_per_host
        s_host, d_host = members[:, src] // G, members[:, 1 - src] // G
        rail = members[:, 0] % G
        for k, (host, nic, start, end, _sev) in enumerate(self.slow_nics):
            hit = ((s_host == host) | (d_host == host)) & (rail == nic)
            hit &= (last >= start) & (last < end)
            bw = np.where(hit, bw * self.nic_fraction(k, last), bw)
        for host, peer, nic, start, end, sev in self.slow_links:
            hit = (s_host == host) & (d_host == peer) & (rail == nic)
            hit &= (last >= start) & (last < end)
            bw = np.where(hit, bw * sev, bw)
        return bw

    def dp_link_hangs(
        self, last: np.ndarray, end: np.ndarray
    ) -> tuple[np.ndarray, dict[int, tuple[int, float]]]:
        """Apply link hangs to DP ring collectives: returns new ends and, per stalled
        ring, (sending member, stall time)."""
        stalls: dict[int, tuple[int, float]] = {}
        for host, _peer, rail, start, stop in self.link_hangs:
            g, i = self._ring_pos(host, rail)
            if np.isfinite(last[g]) and end[g] > start and last[g] < stop:
                stall_t = max(start, float(last[g]))
                stalls[g] = (i, stall_t)
                end = end.copy()
                end[g] = INF if not np.isfinite(stop) else stop + (end[g] - stall_t)
        return end, stalls
