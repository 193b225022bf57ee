"""Typed configuration of the detection core and of the isolation policy.

One object of each is built by the caller (CLI, Faust worker, tests) and passed
explicitly; nothing here reads the environment.

>>> DetectConfig().window_us
5000000
>>> PolicyConfig().dry_run
True
>>> PolicyConfig().actions["straggler"]
'cordon'
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from streams.commands import Action, Fault

__all__ = ["DetectConfig", "DetectorName", "PolicyConfig", "RiverConfig"]


def _default_actions() -> dict[Fault, Action]:
    return {
        "noncomm_hang": "cordon_and_taint",
        "comm_hang": "cordon_and_taint",
        "straggler": "cordon",
        "slow_nic": "cordon",
        "slow_link": "cordon",
    }


DetectorName = Literal["hang", "straggler", "slow_conn", "river"]


class RiverConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The ``river`` detector: a river anomaly model over per-rank window features.

    ``model`` names a class of ``river.anomaly`` (an ``AnomalyDetector``, e.g.
    ``HalfSpaceTrees``); ``params`` are its keyword arguments (plain values). The
    default params suit HalfSpaceTrees on small communicators: its reference window
    (``window_size``) must fit in ``history_windows`` × ranks samples, or it scores 0;
    set ``params`` anew when choosing another model."""

    model: str = "HalfSpaceTrees"
    params: dict[str, float | int | str | bool] = msgspec.field(
        default_factory=lambda: {"window_size": 16, "n_trees": 10, "height": 6}
    )
    threshold: float = 0.8
    """Anomaly score (model's ``score_one``, clipped to [0, 1]) from which a rank is
    reported."""
    history_windows: int = 6
    """Windows of per-rank features the model is trained on (the newest first)."""
    min_peer_time_x: float = 1.05
    """... and only a rank whose peers waited at least this much longer than it (the
    model ranks; the physics of a collective keeps jitter out)."""
    seed: int = 42

    def __post_init__(self) -> None:
        # river.anomaly costs ~2 s to import (scipy.stats): only a config that names a
        # model other than the default pays it here; the default is checked when built
        if self.model == "HalfSpaceTrees":
            return
        from river import anomaly
        from river.base import AnomalyDetector

        # a name inside river.anomaly, never a dotted path: nothing else can be built
        cls = getattr(anomaly, self.model, None) if not self.model.startswith("_") else None
        if not (isinstance(cls, type) and issubclass(cls, AnomalyDetector)):
            names = [n for n in anomaly.__all__ if issubclass(getattr(anomaly, n), AnomalyDetector)]
            raise ValueError(
                f"river model {self.model!r} is not a river.anomaly detector; "
                f"use one of {', '.join(sorted(names))}"
            )


class DetectConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Thresholds and windows of the per-communicator detectors (times in µs).

    Defaults suit a training job with iterations of ~0.1-2 s and heartbeats every ~1 s.
    """

    detectors: list[DetectorName] = msgspec.field(
        default_factory=lambda: ["hang", "straggler", "slow_conn"]
    )
    """Which detectors run on every communicator (streams.core.registry), in this order."""
    river: RiverConfig = RiverConfig()
    """Settings of the ``river`` detector (used when it is listed in ``detectors``)."""

    window_us: int = 5_000_000
    """Event-time window over which straggler and slow-connection evidence is judged, when
    it holds ``window_min_collectives`` (windows are counted in collectives too)."""
    window_min_collectives: int = 5
    """A window closes at a ``window_us`` boundary only once it holds this many of its
    communicator's collectives: one collective per 46-s step is judged over a few
    steps, not over a window holding one."""
    window_max_collectives: int = 256
    """... and closes as soon as it holds this many (hundreds per second: judged in a
    fraction of a window; at least one batch, as exporters send them)."""
    window_max_us: int = 600_000_000
    """... and closes after this long whatever it holds (a communicator gone quiet; 5
    steps of 120 s)."""
    warmup_us: int = 5_000_000
    """Job start-up: no verdicts until a communicator has been seen this long."""

    # --- hangs -------------------------------------------------------------------
    hang_floor_us: int = 2_500_000
    """An in-flight collective is never called hung before this long, whatever was learned."""
    hang_period_mult: float = 4.0
    """... nor before this many times the communicator's learned normal period / op time."""
    silent_us: int = 3_000_000
    """A rank is silent when nothing arrived from it for this long while its peers report."""
    hang_repeat_us: int = 5_000_000
    """A hang still present is reported again after this long (fresh evidence)."""
    min_waiting_frac: float = 0.5
    """Fraction of live ranks that must sit in the in-flight collective to call a hang."""
    max_culprit_frac: float = 0.34
    """More ranks behind than this fraction is not one faulty rank (e.g. a planned stop)."""

    # --- straggler ---------------------------------------------------------------
    seq_ring: int = 64
    """Collectives kept per communicator to align ranks by sequence number."""
    min_present_frac: float = 0.8
    """A collective is used only when this fraction of its ranks reported it."""
    straggler_min_seqs: int = 5
    """Collectives per window needed before a straggler is judged."""
    straggler_last_frac: float = 0.6
    """The straggler had the shortest kernel time in at least this fraction of them."""
    straggler_min_wait: float = 0.08
    """... and its peers waited at least this fraction longer than it, on median."""
    straggler_min_z: float = 4.0
    """... and its lateness stands this many robust standard deviations above the others."""
    straggler_min_share: float = 0.02
    """... and the wait it causes its peers is at least this share of the time between two
    collectives (the step it costs the job), at ``straggler_confidence_z``: GPUs differ
    by about 1 % (power and clock binning), which is never isolated."""
    straggler_confidence_z: float = 1.645
    """Standard errors below the mean wait that must still clear ``straggler_min_share``
    (1.645: 95 % one-sided)."""
    straggler_long_decay: float = 0.8
    """Per window, the weight left on the longer evidence (about five windows): a GPU
    late on a minority of steps is judged on it."""
    straggler_long_min_seqs: int = 40
    """Collectives (decayed) of longer evidence needed to call a rank intermittently late."""
    straggler_long_last_frac: float = 0.2
    """... which arrived last in at least this fraction of them (and twice its share)."""
    straggler_long_min_late: float = 16.0
    """... and in this many more of them than chance would make it (1 in the ranks)."""

    # --- slow connection ---------------------------------------------------------
    conn_sample_every: int = 2
    """Read the per-connection figures of one collective in this many (cost control).
    Sampled by sequence number, so every rank reports the same collectives and each
    sampled one fills its whole row and column of the matrix; at 2, a 5 s window of a
    communicator running 4 collectives/s still holds 10 per cell, plenty for a ratio to
    the median (the per-connection figures cost ~1 µs per op event to read)."""
    slow_ratio: float = 0.75
    """A connection is slow below this fraction of its communicator's median throughput."""
    slow_min_cells: int = 3
    """Inter-host connections per window needed before the throughput matrix is judged."""
    family_max_cells: int = 8
    """A communicator with fewer inter-host connections than this (a pipeline pair, a
    ring of a few hosts, where one slow NIC is a third of the matrix or more) also sends
    its cells, to be judged against the same cells of the communicators of its shape
    (``streams.core.family``)."""

    def __post_init__(self) -> None:
        dup = sorted({d for d in self.detectors if self.detectors.count(d) > 1})
        if dup:  # one state per detector name in a checkpoint
            raise ValueError(f"detectors lists {', '.join(dup)} more than once")


class PolicyConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Safety rails between verdicts and isolation commands (times in µs)."""

    dry_run: bool = True
    """Commands carry ``dry_run: true``; the actuator then only reports what it would do."""
    actions: dict[Fault, Action] = msgspec.field(default_factory=_default_actions)
    """Action for each fault class; ``alert_only`` reports without isolating."""
    deny_hosts: list[str] = []
    """Hosts never isolated (their commands become ``alert_only``)."""
    cooldown_us: int = 600_000_000
    """After a command for a host, no other command for it during this long."""
    max_isolated_frac: float = 0.25
    """At most this fraction of a job's hosts isolated per hour (at least one)."""
    cap_period_us: int = 3_600_000_000
    job_hosts: int | None = None
    """Hosts in the job, when known; otherwise the largest communicator seen tells."""
    horizon_us: int = 60_000_000
    """Evidence older than this (event time of its own job) is forgotten."""
    allowed_lateness_us: Annotated[int, msgspec.Meta(ge=0, le=15_000_000)] = 10_000_000
    """Event time is kept per job. A verdict behind its job's correlator clock by at most
    this much is judged as if in order; a later one is not judged but reported
    (:class:`~streams.core.correlate.LateEvidence`; the worker dead-letters it with
    "late by N s"). The worker also dead-letters events this much behind the time their
    communicator was already judged up to, and lets a quiet job's clock run on by wall
    time at most half this far. At most 15 s (how long victim notes are kept)."""
    hang_min_score: float = 0.8
    """Summed verdict score needed for a hang."""
    hang_settle_us: int = 1_500_000
    """Wait this long after a hang's first verdict to hear every communicator."""
    host_wait_us: int = 3_000_000
    """A non-communication hang naming one GPU waits up to this long after its first
    verdict for the host's other GPUs: when two or more stop, the command names the host."""
    job_wide_frac: float = 0.1
    """Hangs on more than this fraction of a job's hosts (and more than
    ``job_wide_min_hosts``), starting within ``job_wide_window_us`` of each other, are a
    job-wide stop (checkpoint, storage, planned stop), not a faulty component: they are
    reported ``alert_only``. One faulty component stops one host;
    a pipeline stage of 8 hosts caught behind together by a checkpoint is a quarter of a
    4-stage job, so the bar is a tenth (and ``job_wide_min_hosts``), not a quarter."""
    job_wide_min_hosts: int = 3
    job_wide_window_us: int = 5_000_000
    slow_min_windows: int = 2
    """Distinct windows (or communicators) needed for a straggler or slow NIC/link."""
    role_replicas: int = 3
    """A straggler finding whose rank position is late on this many hosts, in
    communicators of the same shape (hosts, ranks), within the horizon is a role, not
    a fault: a faulty GPU is late at its own position on its own host, so independent
    faults at one position of one shape on three hosts at once are implausible."""
    slow_min_score: float = 1.4
    """Summed verdict score needed for a straggler or slow NIC/link."""
