"""The policy's safety rails: what turns an isolation into ``alert_only`` (a job-wide
stop, the deny list, the cap on isolated hosts per rolling period), and how much
evidence a decision needs, written once."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from streams.commands import Action
from streams.core.config import PolicyConfig
from streams.core.findings import CommHangEvidence, HangEvidence, SlowEvidence

if TYPE_CHECKING:
    from streams.core.correlate import HostCorrelator
    from streams.core.episode import Entry

__all__ = [
    "HANGS",
    "enough_evidence",
    "job_wide_rail",
    "rail_action",
    "settle_time_us",
    "whole_nic",
]

HANGS = ("noncomm_hang", "comm_hang")


def rail_action(
    cfg: PolicyConfig, isolated: dict[str, deque], job: str, n_hosts: int, host: str,
    fault: str, at: int, now: int, rail: str = "",
) -> tuple[Action, str]:  # fmt: skip
    """The action for a decided fault and why a rail held it back (``""``: none held).
    ``isolated``: per job its isolation times, pruned to the cap's period and appended
    to when this one isolates; ``rail``: a reason already found (then only an alert)."""
    action: Action = cfg.actions.get(fault, "alert_only")  # type: ignore[assignment]
    if rail:
        return "alert_only", rail
    if host in cfg.deny_hosts:
        return "alert_only", " Not isolated: the host is on the deny list."
    if action == "alert_only":
        return action, rail
    log = isolated.setdefault(job, deque())
    while log and log[0] < now - cfg.cap_period_us:
        log.popleft()
    cap = max(1, math.floor(cfg.max_isolated_frac * n_hosts))
    if len(log) >= cap:
        return "alert_only", (
            f" Not isolated: {len(log)} of {n_hosts} hosts of the job were "
            f"isolated in the last hour (cap {cap})."
        )
    log.append(at)
    return action, rail


def job_wide_rail(c: HostCorrelator, job: str, first_ts: int) -> str:
    """Why not to isolate, when hangs started on many of the job's hosts at once.

    One faulty component stops one host's GPUs (its peers wait: victims, filtered
    out by ``_live``); a checkpoint or a storage stall stops everybody, and then hang
    evidence that is not explained by waiting shows up on many hosts together.
    """
    cfg = c.config
    # within the window, or the hang threshold of the communicators when longer:
    # with long steps each communicator calls its hang later, seconds apart
    thr = max((e.ev.threshold_s for (j, _, f), ep in c.episodes.items() if j == job
               and f in HANGS for e in ep.entries
               if isinstance(e.ev, (HangEvidence, CommHangEvidence))), default=0.0)  # fmt: skip
    span = max(cfg.job_wide_window_us, int(thr * 1e6))
    lo, hi = first_ts - span, first_ts + span
    hosts = set()
    for (j, h, f), ep in c.episodes.items():
        if j != job or f not in HANGS:
            continue
        live = c._live((j, h, f), ep)
        if live and lo <= min(e.ts for e in live) <= hi:
            hosts.add(h)
    n_hosts = cfg.job_hosts or c.job_hosts.get(job, 1)
    limit = max(cfg.job_wide_min_hosts, math.ceil(cfg.job_wide_frac * n_hosts))
    if len(hosts) <= limit:
        return ""
    return (
        f" Not isolated: {len(hosts)} of {n_hosts} hosts of the job stopped within "
        f"{span / 1e6:.0f} s of each other, a job-wide stop "
        "(checkpoint, storage, planned stop) rather than one faulty component."
    )


def settle_time_us(cfg: PolicyConfig, live: list[Entry]) -> int:
    """How long a hang waits after its first verdict to hear every communicator: the
    policy's settle time, or the hang threshold of its communicators when longer (with
    long steps each communicator calls its hang later, seconds apart, and a job-wide
    stop shows on many hosts only after that)."""
    thr = max((e.ev.threshold_s for e in live if not e.ev.snapshot  # one moment, all heard
               and isinstance(e.ev, (HangEvidence, CommHangEvidence))), default=0.0)  # fmt: skip
    return max(cfg.hang_settle_us, int(thr * 1e6))


def enough_evidence(cfg: PolicyConfig, fault: str, best: list[Entry], total: float) -> bool:
    """Enough for a straggler or slow NIC/link (``best``: one entry per communicator and
    window): ``slow_min_windows`` windows and ``slow_min_score`` — one window of
    congestion must not isolate —, or one window of a whole NIC (:func:`whole_nic`)."""
    windows = len({e.window for e in best})
    if windows >= cfg.slow_min_windows and total >= cfg.slow_min_score:
        return True
    return whole_nic(fault, best)


def whole_nic(fault: str, entries: list[Entry]) -> bool:
    """A slow NIC with every connection through it slow, both ways, two or more remote
    peers, and nothing else slow beside it: the slowness is the NIC's own. Congestion
    is a queue at a shared switch port, one way, and slows the other NICs' connections
    through that port as well; so one window of this is enough (a NIC that degrades is
    isolated in the first window it is under the bar, not the second)."""
    return fault == "slow_nic" and any(
        isinstance(e.ev, SlowEvidence) and e.ev.whole_nic for e in entries
    )
