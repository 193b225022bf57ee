"""What detectors conclude, as types: fault claims (:class:`Finding`) with their typed
evidence, and observations that claim no fault (:class:`Observation`).

On the wire (``c4.verdicts``) both travel as a :class:`~streams.verdicts.Verdict`
whose ``evidence`` is the plain dict of the struct below (the contract is unchanged);
an observation is a verdict with ``benign: true`` and ``evidence.role`` set. The
correlator turns the dict back into these types with :func:`evidence_of` and
:func:`observation_of` and reads them by attribute.

>>> ev = StragglerEvidence(comm_name="dp-rail0", comm_hosts=16, nranks=16, collectives=20,
...                        last_frac=0.9, peer_time_x=1.4, z=9.0, late_ms=12.0, position=3)
>>> wire = msgspec.to_builtins(ev)
>>> wire["late_ms"], evidence_of("straggler", wire) == ev
(12.0, True)
>>> observation_of({"role": "waiting", "gpus": [1, 2], "extra_ms": [3.0, 4.0]})
Waiting(gpus=[1, 2], target_collective=None, extra_ms=[3.0, 4.0], waited_for=None, comm_slow=False)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from streams.commands import Fault

__all__ = [
    "Census",
    "CommHangEvidence",
    "Evidence",
    "Finding",
    "HangEvidence",
    "Note",
    "Observation",
    "PairWait",
    "Cells",
    "RiverEvidence",
    "Silent",
    "SlowEvidence",
    "StragglerEvidence",
    "Waiting",
    "comm_facts",
    "evidence_of",
    "observation_of",
]


class Evidence(msgspec.Struct, kw_only=True):
    """What every finding says about the communicator it comes from."""

    comm_name: str = ""
    comm_hosts: int = 0
    """Hosts the communicator spans (1: inside one host, e.g. tensor parallel)."""
    nranks: int = 0
    snapshot: bool = False
    """Judged from one Flight Recorder snapshot as a whole (``streams.core.snapshot``)."""
    hold: str = ""
    """Why this finding must not isolate (e.g. a snapshot whose dump time is unknown):
    its command is ``alert_only`` with this reason."""


class HangEvidence(Evidence, kw_only=True):
    """A non-communication hang: a rank did not start the collective its peers wait in."""

    target_collective: int = -1
    rank_started: int = -1
    silent: bool = False
    """The culprit stopped reporting altogether (not just behind)."""
    peers_waiting: int = 0
    wait_s: float = 0.0
    threshold_s: float = 0.0
    peers_collective: int | None = None
    """Snapshots: the collective the peers are in (or ended), when not the target."""
    peers_ended_without_it: bool = False
    """Snapshots: the peers ended the collective without it (timed out or aborted)."""
    absent: str = ""
    """Snapshots: it left ``no dump`` or an ``empty dump`` while its peers wait for it."""


class CommHangEvidence(Evidence, kw_only=True):
    """A communication hang: every rank is in the collective; these connections stopped."""

    target_collective: int = -1
    stalled_conns: int = 0
    why: str = "no progress"
    sender_rank: int = -1
    receiver_rank: int = -1
    senders: int = 0
    wait_s: float = 0.0
    threshold_s: float = 0.0


class StragglerEvidence(Evidence, kw_only=True):
    """A rank persistently last to arrive, measured against its peers of one window."""

    collectives: int = 0
    last_frac: float = 0.0
    peer_time_x: float = 1.0
    """Its peers' kernel time over its own (> 1: they waited for it)."""
    z: float = 0.0
    peer_time_vs_normal: float | None = None
    late_ms: float = 0.0
    """Mean time its peers waited for it per collective."""
    position: int = -1
    """Its rank in the communicator: a role (the same position late in every replica of
    a communicator) is told from a faulty GPU by it."""
    step_share: float | None = None
    """The wait it caused its peers, as a share of the time between two collectives
    (lower confidence bound; see docs/detectors.md). None: not measured."""
    intermittent: bool = False
    """Found on the decayed evidence of the last windows: late on a minority of steps."""
    arrival: str = "kernel_time"
    """How arrival order was read: ``kernel_time`` (durations) or, in snapshots without
    timing, ``enqueue_time``."""


class SlowEvidence(Evidence, kw_only=True):
    """A slow NIC or link: throughput of its connections over the communicator's median."""

    throughput_ratio: float = 1.0
    cells: int = 0
    median_gbs: float = 0.0
    only_peer: str | None = None
    """Every slow cell of this NIC joins it to this one host, whose NIC has no other
    connection here either: this communicator cannot tell the two ends apart (the
    correlator asks the NIC's other communicators)."""
    family: str | None = None
    """Judged against the same cell of communicators of one shape (e.g. the pipeline
    pairs across one stage boundary), not within one communicator's matrix."""
    whole_nic: bool = False
    """Every connection through this NIC was slow, both ways, with two or more remote
    peers, and no other connection beside them: the slowness is the NIC's own (one
    window is enough, see :mod:`streams.core.slow_conn`)."""


class RiverEvidence(StragglerEvidence, kw_only=True):
    """A river anomaly model scored this rank's window features as anomalous (read by
    the correlator as straggler evidence, plus the model's own figures)."""

    model: str = ""
    anomaly_score: float = 0.0
    features: list[float] = []


_EVIDENCE: dict[str, type[Evidence]] = {
    "noncomm_hang": HangEvidence,
    "comm_hang": CommHangEvidence,
    "straggler": StragglerEvidence,
    "slow_nic": SlowEvidence,
    "slow_link": SlowEvidence,
}


def comm_facts(evidence: dict[str, Any]) -> Evidence:
    """What any verdict's evidence says about its communicator (findings and notes
    alike carry these three fields)."""
    try:
        return msgspec.convert(evidence, Evidence)
    except msgspec.ValidationError as err:
        raise ValueError(f"verdict evidence: {err}") from None


def evidence_of(fault: str, evidence: dict[str, Any]) -> Evidence:
    """The typed evidence of a (non-benign) verdict of ``fault``.

    Raises ``ValueError`` (with what is wrong) when a field has the wrong type."""
    typ: type[Evidence] = RiverEvidence if "anomaly_score" in evidence else _EVIDENCE[fault]
    try:
        return msgspec.convert(evidence, typ)
    except msgspec.ValidationError as err:
        raise ValueError(f"{fault} evidence: {err}") from None


class Census(msgspec.Struct, kw_only=True, tag_field="role", tag="census"):
    """The hosts a communicator spans (the correlator sizes the job from these)."""

    hosts: list[str] = []


class Silent(msgspec.Struct, kw_only=True, tag_field="role", tag="silent"):
    """These GPUs of a host went silent here while their peers still report."""

    gpus: list[int] = []
    silent_s: float = 0.0


class Waiting(msgspec.Struct, kw_only=True, tag_field="role", tag="waiting"):
    """These GPUs of a host were held up here (in a hung collective, or for longer than
    normal): being late elsewhere is then not their fault."""

    gpus: list[int] = []
    target_collective: int | None = None
    extra_ms: list[float] | None = None
    """Per GPU, the extra time per collective (straggler detector's notes)."""
    waited_for: list[tuple[str, int]] | None = None
    """Whom they waited for, as (host, GPU): the stragglers this communicator found in
    the same window. Empty: nobody known to be late (e.g. a pipeline bubble: waiting
    by schedule), which clears nobody. None: a note from an older worker (read as
    before: it clears)."""
    comm_slow: bool = False
    """The communicator as a whole ran clearly slower than its learned normal (a slow
    ring or link held everybody up): clears them when that communicator's own slow
    connection is found."""


class PairWait(msgspec.Struct, kw_only=True, tag_field="role", tag="pair"):
    """A two-rank communicator's window (e.g. a pipeline Send/Recv pair): who is at
    each end and how long each spent per collective, so the correlator can compare it
    with the pairs that cross the same stage boundary in the other pipeline replicas
    (its bubbles are normal there too)."""

    hosts: list[str] = []
    gpus: list[int] = []
    exec_ms: list[float] = []
    """Mean kernel time per collective of rank 0 and rank 1."""
    collectives: int = 0
    period_ms: float = 0.0
    """The communicator's learned time between collectives (one rank's own clock)."""


class Cells(msgspec.Struct, kw_only=True, tag_field="role", tag="cells"):
    """The inter-host connections of a communicator too small to judge its own
    throughput matrix (a pipeline pair, a two-host ring): per directed cell sender ->
    receiver its throughput this window, compared by the correlator with the same cell
    of the other communicators of one shape. Parallel lists, one entry per cell."""

    src: list[int] = []
    dst: list[int] = []
    """Rank positions of each cell's sender and receiver."""
    src_host: list[str] = []
    src_nic: list[str | None] = []
    dst_host: list[str] = []
    dst_nic: list[str | None] = []
    gbs: list[float] = []
    """GB/s the cell moved this window."""
    gbs_end: list[float] = []
    """GB/s at the window's end: the trend of its parts where it falls, else ``gbs``
    (:meth:`streams.core.slow_conn.ConnMatrix.end_cells`); empty from older workers."""
    size_log2: int = 0
    """Mean bytes per connection record, log2 rounded (throughput depends on it)."""
    p2p: bool = False
    """Point-to-point (Send/Recv) traffic, not a collective."""
    peek: bool = False
    """Read half a window in, each cell at the median of its collectives
    (:meth:`streams.core.slow_conn.SlowConnDetector.peek`): compared only with the
    replicas' notes read the same way."""


Note = Census | Silent | Waiting | PairWait | Cells


def observation_of(evidence: dict[str, Any]) -> Note | None:
    """The typed note of a benign verdict; ``None`` for a benign verdict without a role
    (e.g. from an older worker)."""
    if evidence.get("role") not in ("census", "silent", "waiting", "pair", "cells"):
        return None
    try:
        return msgspec.convert(evidence, Note)  # type: ignore[arg-type]
    except msgspec.ValidationError as err:
        raise ValueError(f"observation {evidence.get('role')}: {err}") from None


@dataclass(slots=True)
class Finding:
    """A fault claim of one detector about one suspect (a rank, or a host's NIC/link).

    ``score`` is in [0, 1], higher = more certain; the correlator sums scores across
    communicators and windows. ``reason`` is one sentence a person reads."""

    fault: Fault
    rank: int | None
    score: float
    reason: str
    start_us: int
    end_us: int
    evidence: Evidence
    ranks: list[int]
    host: str | None = None
    nic: str | None = None
    peer_host: str | None = None


@dataclass(slots=True)
class Observation:
    """A note that claims no fault (census, "these GPUs waited", "these went silent").

    ``fault`` names the detector's class it helps the correlator judge."""

    fault: Fault
    host: str | None
    reason: str
    start_us: int
    end_us: int
    note: Note
    ranks: list[int] = field(default_factory=list)
