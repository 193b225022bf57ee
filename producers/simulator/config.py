"""Typed configuration of a simulated training job: its shape, its timing, its faults.

One :class:`SimConfig` is passed explicitly to every part of the simulator; nothing is
read from the environment. :func:`validate` checks a config up front and raises
:class:`SimConfigError` with a message that says what to change.

>>> cfg = SimConfig(hosts=4, gpus_per_host=8, tp=8)
>>> cfg.gpus
32
>>> try:
...     validate(SimConfig(hosts=4, faults=[FaultSpec(kind="straggler", host=9, gpu=0, start_s=1)]))
... except SimConfigError as err:
...     print(err)
fault 0 (straggler): host 9 does not exist; the job has hosts 0..3
>>> with_gpus(cfg, 128).hosts
16
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

__all__ = [
    "BenignSpec",
    "FaultKind",
    "FaultSpec",
    "bandwidth_fraction",
    "collectives_per_step",
    "describe_shape",
    "moe_layers",
    "step_estimate_s",
    "with_step",
    "SimConfig",
    "SimConfigError",
    "load_config",
    "validate",
    "with_gpus",
]

FaultKind = Literal["straggler", "slow_nic", "slow_link", "rank_hang", "host_down", "link_hang"]
BenignKind = Literal["checkpoint", "congestion", "blip", "clock_offset", "role_late", "stage_heavy"]
Schedule = Literal["classic", "1f1b", "interleaved"]
DpMode = Literal["allreduce", "zero", "fsdp"]


class SimConfigError(ValueError):
    """A simulator configuration cannot describe a job; the message says what to change."""


class FaultSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One injected fault.

    ``severity``: straggler — compute-time multiplier (1.3 = 30% slower); slow_nic and
    slow_link — remaining bandwidth fraction (0.5 = half); a value above 1 is read as a
    slow-down factor instead (1.5 = bandwidth / 1.5), see :func:`bandwidth_fraction`.
    Hangs ignore it.
    ``end_s`` None means the fault lasts to the end of the run.
    ``duty`` (straggler): the share of training steps on which the GPU is slow (0.3 =
    an intermittent straggler, e.g. thermal throttling); which steps is drawn from the
    seed, the same on every run.
    ``ramp_s`` (slow_nic): the NIC degrades linearly from full bandwidth at ``start_s``
    to ``severity`` at ``start_s + ramp_s`` (a degrading optic or cable).
    """

    kind: FaultKind
    host: int
    gpu: int | None = None  # straggler, rank_hang
    nic: int | None = None  # slow_nic, slow_link, link_hang: the rail index (mlx5_<nic>)
    peer_host: int | None = None  # slow_link, link_hang: the receiving host
    start_s: float
    end_s: float | None = None
    severity: float = 1.5
    duty: float = 1.0
    ramp_s: float = 0.0


class BenignSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One benign event, which must never be blamed on a component.

    checkpoint — every rank pauses for ``duration_s``; congestion — every network link
    runs at 1/``severity`` of its bandwidth for ``duration_s``; blip — GPU (host, gpu)
    computes one iteration ``severity`` times slower; clock_offset — host's clock is
    off by ``severity`` milliseconds for the whole run; role_late — GPU index ``gpu``
    of every host computes ``severity`` times longer from ``start_s`` on (its role: more
    work by design, e.g. the rank that also logs or embeds), so that position is late
    in every tensor-parallel group alike; stage_heavy — pipeline stage ``stage``
    computes ``severity`` times longer per layer for the whole run (e.g. the stage that
    also holds the embedding or the loss): every stage of the pipeline waits for it by
    design (pipeline shapes only).
    """

    kind: BenignKind
    start_s: float = 0
    duration_s: float = 1
    host: int | None = None
    gpu: int | None = None
    severity: float = 2.0
    stage: int | None = None


class SimConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Shape, timing and injected events of one simulated training job."""

    job: str = "sim-job"
    hosts: int = 16
    gpus_per_host: int = 8
    tp: int = 8  # tensor-parallel group size, inside a host (NVLink)
    pp: int = 1  # pipeline stages; hosts are split into pp contiguous blocks
    duration_s: float = 60
    iteration_s: float = 0.6  # compute time of one iteration (communication comes on top)
    compute_jitter: float = 0.02  # relative std-dev of each compute phase
    dp_buckets: int = 2  # gradient AllReduces per iteration on each DP ring
    dp_bytes: int = 256 << 20  # bytes of one gradient bucket AllReduce
    tp_bytes: int = 32 << 20  # bytes of one TP AllReduce
    pp_bytes: int = 64 << 20  # bytes of one pipeline Send/Recv
    link_gbs: float = 25.0  # network bandwidth per NIC and direction, GB/s (200 Gb/s)
    nvlink_gbs: float = 200.0
    link_jitter: float = 0.01  # relative noise of per-connection times
    heartbeat_s: float = 1.0
    clock_skew_ms: float = 3.0  # per-host clock offsets drawn uniformly in ±clock_skew_ms
    retrans_per_s: float = 50.0  # retransmissions per second on a stalled connection
    seed: int = 0
    # --- the shapes of large-model training (opt-in; "classic" is the shape above) ---
    # 1f1b / interleaved: per-layer TP collectives, microbatches through a pipeline of
    # Send/Recv pairs, and the data-parallel phase chosen by dp_mode.
    schedule: Schedule = "classic"
    microbatches: int = 8  # per step and pipeline (1f1b/interleaved)
    virtual_stages: int = 2  # interleaved: model chunks per rank
    layers: int = 4  # transformer layers per stage (0: one compute block, no TP ops)
    moe_every: int = 0  # every k-th layer is a mixture-of-experts layer (0: none)
    ep: int = 2  # expert-parallel group: this many hosts of a stage, same rail
    ep_bytes: int = 16 << 20  # bytes each rank sends in one AllToAll
    dp_mode: DpMode = "allreduce"  # zero: RS+AG per bucket per step; fsdp: AG per use
    opt_share: float = 0.02  # optimizer step compute, as a share of iteration_s
    gpu_spread: float = 0.0  # static speed spread: each GPU x U(1-s, 1+s), for the run
    op_latency_us: float = 10.0  # microbatched shapes: fixed cost of every collective
    faults: list[FaultSpec] = []
    benign: list[BenignSpec] = []

    @property
    def gpus(self) -> int:
        """Total number of GPUs (ranks) of the job."""
        return self.hosts * self.gpus_per_host

    @property
    def hosts_per_stage(self) -> int:
        """Hosts in one pipeline stage (the length of a DP ring)."""
        return self.hosts // self.pp

    @property
    def pipelined(self) -> bool:
        """Whether the job has one of the microbatched shapes (not ``classic``)."""
        return self.schedule != "classic"

    @property
    def chunks(self) -> int:
        """Model chunks per rank: ``virtual_stages`` when interleaved, else 1."""
        return self.virtual_stages if self.schedule == "interleaved" else 1


def bandwidth_fraction(severity: float) -> float:
    """Remaining bandwidth of a slow NIC or link: ``severity`` if <= 1, else 1/severity.

    >>> bandwidth_fraction(0.5), bandwidth_fraction(2.0)
    (0.5, 0.5)
    """
    return severity if severity <= 1 else 1.0 / severity


def moe_layers(layers: int, every: int) -> frozenset[int]:
    """Indices of the mixture-of-experts layers among ``layers``: every ``every``-th."""
    return frozenset(i for i in range(layers) if every and (i + 1) % every == 0)


def collectives_per_step(cfg: SimConfig) -> float:
    """Collectives a rank completes per training step on all its communicators, the
    mean over ranks (first and last stage of a 1F1B pipeline have one neighbour), from
    the shape alone: a rate is this over the step time.

    >>> collectives_per_step(SimConfig(hosts=8, pp=4, schedule="1f1b", microbatches=8,
    ...                                layers=4, dp_mode="zero", dp_buckets=2))
    156.0
    """
    P, M, v = cfg.pp, cfg.microbatches, cfg.chunks
    per_chunk = cfg.layers // v if cfg.layers else 0
    moe = len(moe_layers(per_chunk, cfg.moe_every))
    tp = (4 * per_chunk if cfg.tp > 1 else 0) * M * v
    ep = 4 * moe * M * v
    # receive and send, forward and backward; the ends of a 1F1B chain have half
    pp = 0.0 if P == 1 else 4 * M * v * (1.0 if cfg.schedule == "interleaved" else (P - 1) / P)
    buckets = min(cfg.dp_buckets, per_chunk) if per_chunk else 1
    if cfg.dp_mode == "fsdp":
        dp = (2 * M + 1) * buckets * v
    elif cfg.dp_mode == "zero":
        dp = 2 * buckets * v
    else:
        dp = buckets * v
    return float(tp + ep + pp + dp)


def step_estimate_s(cfg: SimConfig) -> float:
    """Compute-bound wall time of one step: ``iteration_s`` stretched by the pipeline's
    fill and drain, ``(M v + P - 1) / (M v)``, plus the optimizer share."""
    if not cfg.pipelined:
        return cfg.iteration_s
    mv = cfg.microbatches * cfg.chunks
    return cfg.iteration_s * ((mv + cfg.pp - 1) / mv + cfg.opt_share)


def with_step(config: SimConfig, step_s: float) -> SimConfig:
    """The same job with ``iteration_s`` set so that a step lasts about ``step_s``
    (compute-bound; communication adds a little on top)."""
    if not step_s > 0:
        raise SimConfigError("--step must be positive")
    return msgspec.structs.replace(
        config, iteration_s=step_s * config.iteration_s / step_estimate_s(config)
    )


def describe_shape(cfg: SimConfig) -> str:
    """The microbatched shape in words.

    >>> describe_shape(SimConfig(hosts=8, pp=4, schedule="1f1b", dp_mode="zero"))
    '1f1b pp=4 tp=8 dp=2 microbatches=8 layers=4 zero'
    """
    parts = [cfg.schedule, f"pp={cfg.pp}", f"tp={cfg.tp}", f"dp={cfg.hosts_per_stage}"]
    if cfg.schedule == "interleaved":
        parts.append(f"virtual_stages={cfg.virtual_stages}")
    parts += [f"microbatches={cfg.microbatches}", f"layers={cfg.layers}", cfg.dp_mode]
    if cfg.moe_every:
        parts.append(f"moe every {cfg.moe_every} (ep={cfg.ep})")
    return " ".join(parts)


def with_gpus(config: SimConfig, gpus: int) -> SimConfig:
    """The same job resized to ``gpus`` GPUs (hosts = gpus / gpus_per_host)."""
    if gpus % config.gpus_per_host:
        raise SimConfigError(
            f"--gpus {gpus} is not a multiple of gpus_per_host={config.gpus_per_host}"
        )
    return msgspec.structs.replace(config, hosts=gpus // config.gpus_per_host)


def load_config(path: str | Path) -> SimConfig:
    """Read a :class:`SimConfig` from a TOML file (``[[faults]]``/``[[benign]]`` tables)."""
    try:
        data = tomllib.loads(Path(path).read_text())
        return msgspec.convert(data, SimConfig)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as err:
        raise SimConfigError(f"{path}: {err}") from None


def _check_host(cfg: SimConfig, where: str, host: int | None, what: str = "host") -> None:
    if host is None or not 0 <= host < cfg.hosts:
        raise SimConfigError(
            f"{where}: {what} {host} does not exist; the job has hosts 0..{cfg.hosts - 1}"
        )


def _check_index(where: str, value: int | None, limit: int, what: str) -> None:
    if value is None or not 0 <= value < limit:
        raise SimConfigError(f"{where}: {what} {value} must be in 0..{limit - 1}")


def ring_next(cfg: SimConfig, host: int) -> int:
    """The host after ``host`` on its DP ring (rings run over the hosts of one stage)."""
    hps = cfg.hosts_per_stage
    stage, pos = divmod(host, hps)
    return stage * hps + (pos + 1) % hps


def pp_peers(cfg: SimConfig, host: int) -> set[int]:
    """Hosts that ``host`` exchanges pipeline Send/Recv with."""
    hps = cfg.hosts_per_stage
    out = set()
    if host + hps < cfg.hosts:
        out.add(host + hps)
    if host - hps >= 0:
        out.add(host - hps)
    if cfg.schedule == "interleaved" and cfg.pp > 1:  # the last stage feeds chunk c+1 of the first
        out.add((host + hps) % cfg.hosts)
        out.add((host - hps) % cfg.hosts)
    return out


def validate(cfg: SimConfig) -> SimConfig:
    """Return ``cfg`` if it describes a job; raise :class:`SimConfigError` otherwise."""
    if cfg.hosts < 1 or cfg.gpus_per_host < 1:
        raise SimConfigError("hosts and gpus_per_host must be at least 1")
    if cfg.tp < 1 or cfg.gpus_per_host % cfg.tp:
        raise SimConfigError(f"tp={cfg.tp} must divide gpus_per_host={cfg.gpus_per_host}")
    if cfg.pp < 1 or cfg.hosts % cfg.pp:
        raise SimConfigError(f"pp={cfg.pp} must divide hosts={cfg.hosts}")
    if cfg.hosts_per_stage < 2:
        raise SimConfigError(
            f"each pipeline stage needs at least 2 hosts for a DP ring; "
            f"have hosts={cfg.hosts}, pp={cfg.pp}"
        )
    for name in ("duration_s", "iteration_s", "heartbeat_s", "link_gbs", "nvlink_gbs"):
        if not getattr(cfg, name) > 0:
            raise SimConfigError(f"{name} must be positive")
    if cfg.dp_buckets < 1:
        raise SimConfigError("dp_buckets must be at least 1")
    if not math.isfinite(cfg.duration_s) or cfg.duration_s > 86400:
        raise SimConfigError("duration_s must be finite and at most one day")
    if not 0 <= cfg.gpu_spread < 0.5:
        raise SimConfigError("gpu_spread is a relative spread, use 0 <= s < 0.5 (e.g. 0.01)")
    if cfg.pipelined:
        _validate_shape(cfg)
    hung_ranks: set[tuple[int, int]] = set()
    for i, f in enumerate(cfg.faults):
        where = f"fault {i} ({f.kind})"
        _check_host(cfg, where, f.host)
        if f.end_s is not None and f.end_s <= f.start_s:
            raise SimConfigError(f"{where}: end_s {f.end_s} must be after start_s {f.start_s}")
        if f.kind in ("straggler", "rank_hang"):
            _check_index(where, f.gpu, cfg.gpus_per_host, "gpu")
        if f.kind in ("slow_nic", "slow_link", "link_hang"):
            _check_index(where, f.nic, cfg.gpus_per_host, "nic (rail)")
        if not 0 < f.duty <= 1:
            raise SimConfigError(f"{where}: duty is a share of steps, use 0 < duty <= 1")
        if f.duty < 1 and f.kind != "straggler":
            raise SimConfigError(f"{where}: duty applies to stragglers only")
        if f.ramp_s < 0 or (f.ramp_s > 0 and f.kind != "slow_nic"):
            raise SimConfigError(f"{where}: ramp_s (>= 0) applies to slow_nic only")
        if f.kind == "straggler" and not f.severity >= 1:
            raise SimConfigError(f"{where}: severity is a compute multiplier, use >= 1 (e.g. 1.3)")
        if f.kind in ("slow_nic", "slow_link") and not f.severity > 0:
            raise SimConfigError(
                f"{where}: severity is the remaining bandwidth fraction, use 0 < s <= 1 (e.g. 0.5)"
            )
        if f.kind in ("slow_link", "link_hang"):
            _check_host(cfg, where, f.peer_host, "peer_host")
            used = {ring_next(cfg, f.host)}
            if f.kind == "slow_link":
                used |= pp_peers(cfg, f.host)
            if f.peer_host not in used:
                raise SimConfigError(
                    f"{where}: no traffic flows host {f.host} -> {f.peer_host} on a rail; "
                    f"use peer_host in {sorted(used)} (the next host on its DP ring"
                    + (" or a pipeline peer)" if f.kind == "slow_link" else ")")
                )
        if f.kind in ("rank_hang", "host_down"):
            gpus = range(cfg.gpus_per_host) if f.kind == "host_down" else [f.gpu or 0]
            for g in gpus:
                if (f.host, g) in hung_ranks:
                    raise SimConfigError(f"{where}: host {f.host} GPU {g} already hangs")
                hung_ranks.add((f.host, g))
    for i, b in enumerate(cfg.benign):
        where = f"benign {i} ({b.kind})"
        if b.kind in ("blip", "clock_offset"):
            _check_host(cfg, where, b.host)
        if b.kind in ("blip", "role_late"):
            _check_index(where, b.gpu, cfg.gpus_per_host, "gpu")
        if b.kind == "role_late" and not b.severity >= 1:
            raise SimConfigError(f"{where}: severity is a compute multiplier, use >= 1")
        if b.kind in ("checkpoint", "congestion") and not b.duration_s > 0:
            raise SimConfigError(f"{where}: duration_s must be positive")
        if b.kind == "congestion" and not b.severity >= 1:
            raise SimConfigError(f"{where}: severity is a slow-down factor, use >= 1")
        if b.kind == "stage_heavy":
            if not cfg.pipelined:
                raise SimConfigError(f"{where}: needs a pipeline schedule (1f1b or interleaved)")
            _check_index(where, b.stage, cfg.pp, "stage")
            if not b.severity >= 1:
                raise SimConfigError(f"{where}: severity is a compute multiplier, use >= 1")
    return cfg


def _validate_shape(cfg: SimConfig) -> None:
    """The extra rules of the microbatched shapes (1f1b, interleaved)."""
    if cfg.microbatches < 1:
        raise SimConfigError("microbatches must be at least 1")
    if cfg.schedule == "interleaved":
        if cfg.virtual_stages < 1:
            raise SimConfigError("virtual_stages must be at least 1")
        if cfg.pp > 1 and cfg.microbatches % cfg.pp:
            raise SimConfigError(
                f"interleaved: microbatches={cfg.microbatches} must be a multiple of pp={cfg.pp}"
            )
        if cfg.layers and cfg.layers % cfg.virtual_stages:
            raise SimConfigError(
                f"interleaved: layers={cfg.layers} must be a multiple of "
                f"virtual_stages={cfg.virtual_stages} (layers per chunk)"
            )
    if cfg.layers < 0:
        raise SimConfigError("layers must be >= 0 (0: one compute block per microbatch)")
    if cfg.moe_every:
        if cfg.moe_every < 0 or not cfg.layers:
            raise SimConfigError("moe_every needs layers > 0 and must be >= 0")
        if cfg.ep < 2 or cfg.hosts_per_stage % cfg.ep:
            raise SimConfigError(
                f"ep={cfg.ep} must be >= 2 and divide the hosts of a stage ({cfg.hosts_per_stage})"
            )
    if not 0 <= cfg.opt_share < 1:
        raise SimConfigError("opt_share must be in [0, 1)")
