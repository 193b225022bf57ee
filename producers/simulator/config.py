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
    "SimConfig",
    "SimConfigError",
    "load_config",
    "validate",
    "with_gpus",
]

FaultKind = Literal["straggler", "slow_nic", "slow_link", "rank_hang", "host_down", "link_hang"]
BenignKind = Literal["checkpoint", "congestion", "blip", "clock_offset", "role_late"]


class SimConfigError(ValueError):
    """A simulator configuration cannot describe a job; the message says what to change."""


class FaultSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One injected fault.

    ``severity``: straggler — compute-time multiplier (1.3 = 30% slower); slow_nic and
    slow_link — remaining bandwidth fraction (0.5 = half); a value above 1 is read as a
    slow-down factor instead (1.5 = bandwidth / 1.5), see :func:`bandwidth_fraction`.
    Hangs ignore it.
    ``end_s`` None means the fault lasts to the end of the run.
    """

    kind: FaultKind
    host: int
    gpu: int | None = None  # straggler, rank_hang
    nic: int | None = None  # slow_nic, slow_link, link_hang: the rail index (mlx5_<nic>)
    peer_host: int | None = None  # slow_link, link_hang: the receiving host
    start_s: float
    end_s: float | None = None
    severity: float = 1.5


class BenignSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One benign event, which must never be blamed on a component.

    checkpoint — every rank pauses for ``duration_s``; congestion — every network link
    runs at 1/``severity`` of its bandwidth for ``duration_s``; blip — GPU (host, gpu)
    computes one iteration ``severity`` times slower; clock_offset — host's clock is
    off by ``severity`` milliseconds for the whole run; role_late — GPU index ``gpu``
    of every host computes ``severity`` times longer from ``start_s`` on (its role: more
    work by design, e.g. the rank that also logs or embeds), so that position is late
    in every tensor-parallel group alike.
    """

    kind: BenignKind
    start_s: float = 0
    duration_s: float = 1
    host: int | None = None
    gpu: int | None = None
    severity: float = 2.0


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


def bandwidth_fraction(severity: float) -> float:
    """Remaining bandwidth of a slow NIC or link: ``severity`` if <= 1, else 1/severity.

    >>> bandwidth_fraction(0.5), bandwidth_fraction(2.0)
    (0.5, 0.5)
    """
    return severity if severity <= 1 else 1.0 / severity


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
    return cfg
