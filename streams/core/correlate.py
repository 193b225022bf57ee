"""HostCorrelator: joins verdicts per host across communicators and windows, applies
the policy's safety rails, and emits isolation commands.

One *episode* per (job, host, fault) gathers verdicts over ``horizon_us`` of event
time. It is decided when its evidence is enough (a hang: summed score, after a short
settle time so every communicator is heard; a straggler or slow NIC/link: distinct
windows). The component (GPU, NIC, link) is the one most verdicts point at;
communicators inside one host (tensor parallel over NVLink) name a GPU more precisely
than cross-host ones, so they weigh double. Waiting ranks reported by hang detectors
("these GPUs wait in collective N here") clear the same GPUs of blame for being
behind elsewhere: a GPU stuck waiting is a victim of a hang, not its cause.
A non-communication hang that names one GPU waits up to ``host_wait_us`` for the host's
other GPUs: when two or more stopped (blamed elsewhere, or noted silent where nobody
waits for them), the command names the host (no GPU) and says it went silent.

Event time is kept per job: each job has its own clock (the newest ``ts_us`` of its
verdicts, or what :meth:`HostCorrelator.advance` says for it), and its horizon,
cool-downs and cap are measured on that clock only, so a job whose telemetry runs
minutes behind another's (a delayed exporter, a trace replayed into a live pipeline)
keeps all its evidence. A verdict behind its job's clock by more than
``allowed_lateness_us`` is not judged (the notes that would explain it are gone):
:meth:`~HostCorrelator.observe` raises :class:`LateEvidence`, never drops it silently.

Rails: deny list, the cap on isolated hosts per hour, and hangs on many hosts at once
(a job-wide stop such as a long checkpoint, not a faulty component) turn a command into
``alert_only``; the cool-down per host drops further commands for it; ``dry_run``
marks every command.

>>> from streams.verdicts import Verdict
>>> from streams.core.config import PolicyConfig
>>> c = HostCorrelator(PolicyConfig(hang_settle_us=0, host_wait_us=0))
>>> v = Verdict(id="x", ts_us=5_000_000, job="j", comm="0xa", host="node-001", gpu=3,
...             fault="noncomm_hang", score=0.9, reason="...", window_start_us=1_000_000,
...             window_end_us=5_000_000, evidence={"target_collective": 12, "wait_s": 4.0,
...             "comm_hosts": 16}, ranks=[1])
>>> [cmd] = c.observe(v)
>>> cmd.host, cmd.gpu, cmd.action, cmd.dry_run
('node-001', 3, 'cordon_and_taint', True)
>>> print(cmd.reason)  # doctest: +NORMALIZE_WHITESPACE
node-001 GPU 3 hangs: it has not started collective 12 on 1 communicator while its peers
waited 4.0 s.
>>> c.observe(v)  # the same fault again: cool-down, nothing new
[]
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streams.commands import Action, IsolationCommand
from streams.core import checkpoint as ck
from streams.core.config import PolicyConfig
from streams.core.family import Families, FamiliesState
from streams.core.findings import (
    Cells,
    Census,
    CommHangEvidence,
    Evidence,
    HangEvidence,
    PairWait,
    Silent,
    SlowEvidence,
    StragglerEvidence,
    Waiting,
    comm_facts,
    evidence_of,
    observation_of,
)
from streams.core.stats import slow_score, stable_id
from streams.verdicts import Verdict

__all__ = ["HostCorrelator", "LateEvidence"]

_HANGS = ("noncomm_hang", "comm_hang")
_WAIT_MEMORY_US = 15_000_000  # a "waiting" note clears a GPU for this long
_MAX_ENTRIES = 256
_Wait = tuple[int, int, float, tuple[tuple[str, int], ...] | None, bool, int]


def _span(ts: int, window_start: int) -> int:
    """How long a verdict's window was (windows follow their communicator's pace)."""
    return max(0, ts - window_start)


class LateEvidence(ValueError):
    """A verdict is behind its job's event time by more than the allowed lateness.

    The correlator did not judge it: the victim notes and episodes of that moment are
    already forgotten, so judging it now could blame a victim. The worker dead-letters
    the verdict with this message (``late by N s: ...``) and counts it per job; raise
    ``allowed_lateness_us`` (up to the 15 s the notes are kept) if this is routine.
    """

    def __init__(self, job: str, late_us: int, clock_us: int, allowed_us: int) -> None:
        self.job = job
        self.late_us = late_us
        super().__init__(
            f"late by {late_us / 1e6:.0f} s: job {job}'s correlator clock is at {clock_us} "
            f"(event time); verdicts more than {allowed_us / 1e6:g} s behind it are not judged"
        )


@dataclass(slots=True)
class _Entry:
    ts: int
    comm: str
    window: int
    score: float
    comp: tuple
    intra: bool
    ev: Evidence


@dataclass(slots=True)
class _Episode:
    first_window: int
    entries: deque = field(default_factory=lambda: deque(maxlen=_MAX_ENTRIES))
    decided: str = ""


class HostCorrelator:
    """Joins verdicts across communicators and windows per host; applies the PolicyConfig
    safety rails; emits commands."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        if config.allowed_lateness_us > _WAIT_MEMORY_US:
            raise ValueError(
                f"policy allowed_lateness_us {config.allowed_lateness_us} is above "
                f"{_WAIT_MEMORY_US}: victim notes are kept that long, later verdicts "
                "could not be judged safely"
            )
        self.clock: dict[str, int] = {}
        """Event time per job: newest verdict ``ts_us`` or advance() for that job."""
        self.episodes: dict[tuple[str, str, str], _Episode] = {}
        self.waiting: dict[tuple[str, str, int, str], dict[str, _Wait]] = {}
        """(job, host, gpu, fault) -> {comm: (first ts, last ts, extra ms, whom it waited
        for, the communicator as a whole slow)}: where a GPU was seen waiting (held up
        by a hang, a straggler or a slow ring)."""
        self._waiting_last: dict[tuple[str, str, int, str], int] = {}
        """Newest note per key of ``waiting`` (pruning reads this, not every note)."""
        self.silent: dict[tuple[str, str], dict[int, int]] = {}
        """(job, host) -> {gpu: when last noted silent} from alert-only silence notes."""
        self.cooldown: dict[tuple[str, str], int] = {}
        self.isolated: dict[str, deque] = {}
        self.job_hosts: dict[str, int] = {}
        """Hosts per job: the union of the communicators' census notes (bounded by the
        job's size), or the largest communicator a verdict came from."""
        self.job_host_names: dict[str, set[str]] = {}
        self.suppressed = 0
        self.families = Families()
        """Pipeline chains and the cell families of small communicators, per job."""
        self.slow_comms: dict[tuple[str, str], int] = {}
        """(job, comm) -> last ts of a slow NIC/link found on it (a GPU held up in a slow
        communicator waited for its connections, not for nobody)."""
        self.roles: dict[tuple[str, int, int, int], dict[str, int]] = {}
        """(job, comm hosts, ranks, position) -> {suspect host: last ts}: straggler
        findings per rank position of communicators of one shape. The same position
        late on several hosts (in several replicas) is a role (more work by design, or
        held up by a slow rail it shares), not a faulty GPU: a faulty GPU is late at its
        own position on its own host (its host-mates, held up by it, make that host
        late in every replica too: one host, not a role), and in every communicator it
        belongs to (a GPU flagged in communicators of two shapes is never a role)."""

    @property
    def now(self) -> int:
        """The newest clock of any job (for status; decisions read their job's clock)."""
        return max(self.clock.values(), default=-1)

    # ------------------------------------------------------------------ public API
    def observe(self, verdict: Verdict) -> list[IsolationCommand]:
        """Take one verdict (evidence read as its typed struct; ``ValueError`` when a
        field has the wrong type); returns the commands it decided.

        Raises :class:`LateEvidence` (nothing is changed) when the verdict is behind its
        job's clock by more than ``allowed_lateness_us``."""
        v = verdict
        clock = self.clock.get(v.job, -1)
        if clock - v.ts_us > self.config.allowed_lateness_us and clock >= 0:
            raise LateEvidence(v.job, clock - v.ts_us, clock, self.config.allowed_lateness_us)
        hosts = comm_facts(v.evidence).comm_hosts
        if v.ts_us > clock:
            self.clock[v.job] = v.ts_us
        if hosts > self.job_hosts.get(v.job, 0):
            self.job_hosts[v.job] = hosts
        if v.benign:
            note = observation_of(v.evidence)
            if isinstance(note, Census):
                names = self.job_host_names.setdefault(v.job, set())
                names.update(note.hosts)
                self.job_hosts[v.job] = max(self.job_hosts.get(v.job, 0), len(names))
                return []
            if isinstance(note, Silent):
                gone = self.silent.setdefault((v.job, v.host), {})
                for g in note.gpus:
                    gone[int(g)] = v.ts_us
                return []
            if isinstance(note, PairWait):
                self.families.observe_pair(v.job, v.comm, v.ts_us, v.window_start_us, note)
                return []
            if isinstance(note, Cells):
                return self._cells(v, note)
            if isinstance(note, Waiting):
                extra = note.extra_ms or [0.0] * len(note.gpus)
                culprits = (
                    None
                    if note.waited_for is None
                    else tuple((str(h), int(g)) for h, g in note.waited_for)
                )
                for g, x in zip(note.gpus, extra, strict=False):
                    wkey = (v.job, v.host, int(g), v.fault)
                    notes = self.waiting.setdefault(wkey, {})
                    first = notes[v.comm][0] if v.comm in notes else v.ts_us
                    notes[v.comm] = (
                        first,
                        v.ts_us,
                        max(float(x), notes[v.comm][2] if v.comm in notes else 0.0),
                        culprits,
                        note.comm_slow,
                        _span(v.ts_us, v.window_start_us),
                    )
                    # kept for the memory plus its window (long steps: long windows)
                    until = v.ts_us + _span(v.ts_us, v.window_start_us)
                    if until >= self._waiting_last.get(wkey, -1):  # in order: the usual case
                        self._waiting_last[wkey] = until
                    else:
                        self._waiting_last[wkey] = max(n[1] + n[5] for n in notes.values())
            return []
        key = (v.job, v.host, v.fault)
        ep = self.episodes.get(key)
        if ep is None:
            ep = self.episodes[key] = _Episode(first_window=v.window_start_us)
        comp = (v.gpu, v.nic, v.peer_host)
        ev = evidence_of(v.fault, v.evidence)
        intra = ev.comm_hosts == 1
        if v.fault in ("slow_nic", "slow_link"):
            self.slow_comms[(v.job, v.comm)] = v.ts_us
        ep.entries.append(_Entry(v.ts_us, v.comm, v.window_start_us, v.score, comp, intra, ev))
        if isinstance(ev, StragglerEvidence) and ev.position >= 0:
            self._note_role(v.job, v.host, v.ts_us, ev)
        cmd = self._decide(key, ep)
        return [cmd] if cmd else []

    def advance(self, now_us: int, job: str | None = None) -> list[IsolationCommand]:
        """Move ``job``'s clock on to ``now_us`` (event time passes without verdicts), age
        out its old evidence and decide its hangs that have waited long enough.

        ``job`` None moves every known job: only right when all share one clock (one job
        per stream, or tests); the pipeline and the worker pass the job."""
        jobs = list(self.clock) if job is None else [job]
        for j in jobs:
            if now_us > self.clock.get(j, -1):
                self.clock[j] = now_us
        self._prune(set(jobs))
        out = []
        for key, ep in list(self.episodes.items()):
            if not ep.decided and key[2] in _HANGS and key[0] in jobs:
                cmd = self._decide(key, ep)
                if cmd:
                    out.append(cmd)
        return out

    def to_bytes(self) -> bytes:
        """A checkpoint: versioned msgpack (:mod:`streams.core.checkpoint`), no pickle."""
        return ck.encode("correlator", _SCHEMA, _state_of(self))

    @classmethod
    def from_bytes(cls, data: bytes, config: PolicyConfig) -> HostCorrelator:
        """The correlator back from :meth:`to_bytes`; raises
        :class:`~streams.core.checkpoint.CheckpointError` for anything else."""
        st = ck.decode(data, "correlator", {_SCHEMA: _CorrelatorState}, {1: _migrate_1})
        try:
            return _from_state(st, cls(config))
        except ValueError as err:  # evidence of a wrong type inside the checkpoint
            raise ck.CheckpointError(f"correlator checkpoint: {err}") from None

    # ------------------------------------------------------------------ internals
    def _prune(self, jobs: set[str]) -> None:
        """Forget what is old on each job's own clock (keys all start with the job)."""
        clock = self.clock
        h = self.config.horizon_us
        for key in [
            k
            for k, ep in self.episodes.items()
            if k[0] in jobs and not self._alive(ep.entries[-1], clock[k[0]])
        ]:
            if not ep_in_cooldown(self, key):
                del self.episodes[key]
        for k in [
            k
            for k, t in self._waiting_last.items()
            if k[0] in jobs and t < clock[k[0]] - _WAIT_MEMORY_US
        ]:
            del self.waiting[k], self._waiting_last[k]
        for k in [
            k
            for k, g in self.silent.items()
            if k[0] in jobs and max(g.values()) < clock[k[0]] - _WAIT_MEMORY_US
        ]:
            del self.silent[k]
        for k in [k for k, t in self.cooldown.items() if k[0] in jobs and t < clock[k[0]]]:
            del self.cooldown[k]
        for k in [k for k, t in self.slow_comms.items() if k[0] in jobs and t < clock[k[0]] - h]:
            del self.slow_comms[k]
        for j in jobs:
            self.families.prune(j, clock[j], h)
        for k, seen in list(self.roles.items()):
            if k[0] not in jobs:
                continue
            cut = clock[k[0]] - h
            for c in [c for c, ts in seen.items() if ts < cut]:
                del seen[c]
            if not seen:
                del self.roles[k]

    def _note_role(self, job: str, host: str, ts: int, ev: StragglerEvidence) -> None:
        seen = self.roles.setdefault((job, ev.comm_hosts, ev.nranks, ev.position), {})
        seen[host] = ts
        if len(seen) > _MAX_ENTRIES:  # bounded: forget the oldest
            del seen[min(seen, key=lambda h: (seen[h], h))]

    def _role(self, job: str, e: _Entry) -> bool:
        """The entry's rank position is late on ``role_replicas`` or more hosts in
        communicators of its shape within the horizon: a role, not this GPU's fault."""
        ev = e.ev
        if not isinstance(ev, StragglerEvidence) or ev.position < 0:
            return False
        seen = self.roles.get((job, ev.comm_hosts, ev.nranks, ev.position), {})
        cut = self.clock.get(job, -1) - self.config.horizon_us
        return sum(1 for ts in seen.values() if ts >= cut) >= self.config.role_replicas

    def _alive(self, e: _Entry, now: int) -> bool:
        """Evidence is kept for the horizon, or three of its windows when they are
        longer (a communicator with long steps has long windows)."""
        return e.ts >= now - max(self.config.horizon_us, 3 * _span(e.ts, e.window))

    def _live(self, key: tuple[str, str, str], ep: _Episode) -> list[_Entry]:
        now = self.clock[key[0]]
        job, host, fault = key
        out = [e for e in ep.entries if self._alive(e, now)]
        if fault in ("noncomm_hang", "straggler"):
            out = [e for e in out if not self._victim(job, host, fault, e)]
        if fault == "straggler":
            # a faulty GPU is late in every communicator it belongs to; a role, or a
            # GPU held up by a slow rail, only in the replicas of one shape
            shapes: dict[int | None, set[tuple[int, int]]] = {}
            for e in out:
                shapes.setdefault(e.comp[0], set()).add((e.ev.comm_hosts, e.ev.nranks))
            out = [e for e in out if len(shapes[e.comp[0]]) > 1 or not self._role(job, e)]
        return out

    def _cells(self, v: Verdict, note: Cells) -> list[IsolationCommand]:
        """A small communicator's cells: judged with its family; what they show slow
        becomes evidence like a slow-connection finding of that communicator."""
        facts = comm_facts(v.evidence)
        shape = (facts.nranks, facts.comm_hosts, note.size_log2 * 2 + int(note.p2p))
        out: list[IsolationCommand] = []
        for sc in self.families.observe_cells(v.job, v.comm, v.ts_us, v.window_start_us, note,
                                              shape):  # fmt: skip
            fault = "slow_nic" if sc.kind == "nic" else "slow_link"
            ev = SlowEvidence(
                comm_name=facts.comm_name, comm_hosts=facts.comm_hosts, nranks=facts.nranks,
                throughput_ratio=round(sc.ratio, 3), cells=sc.cells,
                median_gbs=round(sc.median_gbs, 3),
                family="pipeline pairs" if note.p2p else "communicators of its shape",
            )  # fmt: skip
            score = slow_score(sc.ratio, self.families.slow_ratio)
            key = (v.job, sc.host, fault)
            ep = self.episodes.get(key)
            if ep is None:
                ep = self.episodes[key] = _Episode(first_window=v.window_start_us)
            comp = (None, sc.nic, sc.peer_host)
            ep.entries.append(_Entry(v.ts_us, v.comm, v.window_start_us, score, comp, False, ev))
            self.slow_comms[(v.job, v.comm)] = v.ts_us
            cmd = self._decide(key, ep)
            if cmd:
                out.append(cmd)
        return out

    def _stage_text(self, job: str, host: str, gpu: int, ts: int) -> str:
        """What its pipeline neighbours say, when they waited for this GPU's stage."""
        ws = self.families.waited_for(job, host, gpu, ts)
        if not ws:
            return ""
        peers = ", ".join(sorted({f"{w.peer_host} GPU {w.peer_gpu}" for w in ws}))
        worst = max(ws, key=lambda w: w.excess_ms)
        return (
            f" Its pipeline stage is the one its neighbours wait for: {peers} spent "
            f"{worst.excess_ms:.1f} ms more per transfer than the same stage of the other "
            "pipeline replicas."
        )

    def _victim(self, job: str, host: str, fault: str, e: _Entry) -> bool:
        """A GPU is cleared of blame only by evidence that it waited for someone else
        who is itself late: a hang holds its peers inside collectives; a straggler's
        delay shows as extra kernel time in the communicator where the GPU waited for
        it (a note naming whom: the straggler that communicator found, or its slow
        connections); at its end of a pipeline pair, a GPU waited for its neighbour
        stage only when it spent clearly more than the same end of the pairs across the
        same stage boundary in the other replicas — the bubbles themselves are the
        schedule and clear nobody."""
        if e.comp[0] is None or (isinstance(e.ev, HangEvidence) and e.ev.silent):
            return False
        gpu = e.comp[0]
        if fault == "straggler" and self.families.waited(job, host, gpu, e.ts):
            return True
        notes = self.waiting.get((job, host, gpu, fault), {})
        for comm, (first, last, extra_ms, culprits, comm_slow, span) in notes.items():
            mem = _WAIT_MEMORY_US + span
            if comm == e.comm or not first - mem <= e.ts <= last + mem:
                continue
            late_ms = e.ev.late_ms if isinstance(e.ev, StragglerEvidence) else 0.0
            if fault == "straggler" and extra_ms < 0.5 * late_ms:
                continue
            if culprits is None:  # a note of an older worker: read as before
                return True
            if any(c != (host, gpu) for c in culprits):
                return True
            slow_at = self.slow_comms.get((job, comm), -1)
            if comm_slow and slow_at >= 0 and abs(slow_at - e.ts) <= mem:
                return True
        return False

    def _decide(self, key: tuple[str, str, str], ep: _Episode) -> IsolationCommand | None:
        job, host, fault = key
        cfg = self.config
        now = self.clock[job]
        if (job, host) in self.cooldown and self.cooldown[(job, host)] >= now:
            return None
        live = self._live(key, ep)
        if not live:
            return None
        # one vote per (communicator, window): repeated reports of one window add nothing
        best: dict[tuple[str, int], _Entry] = {}
        for e in live:
            k = (e.comm, e.window)
            if k not in best or e.score > best[k].score:
                best[k] = e
        total = sum(e.score for e in best.values())
        windows = {e.window for e in best.values()}
        comms = {e.comm for e in best.values()}
        if fault in _HANGS:
            first = min(e.ts for e in live)
            if total < cfg.hang_min_score or now - first < _settle(cfg, live):
                return None
            # one GPU so far: wait a little for the host's other communicators, which
            # tell a dead host (every GPU stops) from one hung process
            gpus = {e.comp[0] for e in best.values() if e.comp[0] is not None}
            gpus |= self._silent_gpus(job, host, first)
            if fault == "noncomm_hang" and len(gpus) < 2 and now - first < cfg.host_wait_us:
                return None
        elif len(windows) < cfg.slow_min_windows or total < cfg.slow_min_score:
            return None
        comp, chosen = self._component(fault, list(best.values()))
        if fault in ("slow_nic", "slow_link") and (
            len({e.window for e in chosen}) < cfg.slow_min_windows
        ):  # the windows must be the chosen component's own, not other links' of the host
            return None
        if fault == "straggler" and _gpu_unclear(comp, list(best.values())):
            # the host is late in communicators across hosts on several GPUs alike
            # (one slow GPU holds its host-mates up): its host's own communicator names
            # the GPU; wait two more windows for it, then name the host
            if len(windows) < cfg.slow_min_windows + 2:
                return None
            comp, chosen = (None, None, None), list(best.values())
        if fault == "noncomm_hang" and comp[0] is not None:
            first = min(e.ts for e in live)
            if self._silent_gpus(job, host, first) - {comp[0]}:  # its other GPUs went quiet
                comp = (None, None, None)
        rail = self._job_wide_rail(job, min(e.ts for e in live)) if fault in _HANGS else ""
        at = min(now, self._enough_at(job, host, fault, live))
        cmd = self._command(key, ep, comp, chosen, total, windows, comms, at, rail)
        hold = next((e.ev.hold for e in chosen if e.ev.hold), "")
        if hold and cmd.action != "alert_only":  # the finding says why not to isolate
            self.isolated.get(job, deque()).remove(at)
            cmd = msgspec.structs.replace(cmd, action="alert_only", reason=hold)
        return cmd

    def _enough_at(self, job: str, host: str, fault: str, live: list[_Entry]) -> int:
        """The earliest event time at which ``live`` (evidence found enough) was enough,
        by the rules of :meth:`_decide` applied to its prefixes in ``ts`` order.

        Commands are stamped with it, so the stamp does not depend on how often the
        clock was advanced (every slice offline, in coarser steps in a busy worker)."""
        cfg = self.config
        first = min(e.ts for e in live)
        notes = self.silent.get((job, host), {})
        silent = sorted(t for t in notes.values() if t >= first - _WAIT_MEMORY_US)
        best: dict[tuple[str, int], _Entry] = {}
        total = 0.0
        found: list[int] = []
        for e in sorted(live, key=lambda x: x.ts):
            k = (e.comm, e.window)
            old = best.get(k)
            if old is None or e.score > old.score:
                total += e.score - (old.score if old is not None else 0.0)
                best[k] = e
            if fault not in _HANGS:
                windows = len({b.window for b in best.values()})
                if windows >= cfg.slow_min_windows and total >= cfg.slow_min_score:
                    return e.ts  # decided on arrival: the first prefix that is enough
                continue
            if total < cfg.hang_min_score:
                continue
            at = max(e.ts, first + _settle(cfg, live))
            if fault == "noncomm_hang":
                n = len({b.comp[0] for b in best.values() if b.comp[0] is not None})
                if n < 2 and n + len(silent) >= 2:  # silence notes make it two GPUs
                    at = max(at, min(first + cfg.host_wait_us, silent[1 - n]))
                elif n < 2:
                    at = max(at, first + cfg.host_wait_us)
            found.append(at)
        return min(found) if found else max(e.ts for e in live)

    def _job_wide_rail(self, job: str, first_ts: int) -> str:
        """Why not to isolate, when hangs started on many of the job's hosts at once.

        One faulty component stops one host's GPUs (its peers wait: victims, filtered
        out by ``_live``); a checkpoint or a storage stall stops everybody, and then hang
        evidence that is not explained by waiting shows up on many hosts together.
        """
        cfg = self.config
        # within the window, or the hang threshold of the communicators when longer:
        # with long steps each communicator calls its hang later, seconds apart
        thr = max((e.ev.threshold_s for (j, _, f), ep in self.episodes.items() if j == job
                   and f in _HANGS for e in ep.entries
                   if isinstance(e.ev, (HangEvidence, CommHangEvidence))), default=0.0)  # fmt: skip
        span = max(cfg.job_wide_window_us, int(thr * 1e6))
        lo, hi = first_ts - span, first_ts + span
        hosts = set()
        for (j, h, f), ep in self.episodes.items():
            if j != job or f not in _HANGS:
                continue
            live = self._live((j, h, f), ep)
            if live and lo <= min(e.ts for e in live) <= hi:
                hosts.add(h)
        n_hosts = cfg.job_hosts or self.job_hosts.get(job, 1)
        limit = max(cfg.job_wide_min_hosts, math.ceil(cfg.job_wide_frac * n_hosts))
        if len(hosts) <= limit:
            return ""
        return (
            f" Not isolated: {len(hosts)} of {n_hosts} hosts of the job stopped within "
            f"{span / 1e6:.0f} s of each other, a job-wide stop "
            "(checkpoint, storage, planned stop) rather than one faulty component."
        )

    def _silent_gpus(self, job: str, host: str, since: int) -> set[int]:
        """GPUs of ``host`` noted silent (alert-only notes) around a hang from ``since``."""
        notes = self.silent.get((job, host), {})
        return {g for g, ts in notes.items() if ts >= since - _WAIT_MEMORY_US}

    @staticmethod
    def _component(fault: str, entries: list[_Entry]) -> tuple[tuple, list[_Entry]]:
        votes: dict[tuple, float] = {}
        for e in entries:
            votes[e.comp] = votes.get(e.comp, 0.0) + e.score * (2.0 if e.intra else 1.0)
        comp = max(votes, key=lambda c: (votes[c], str(c)))
        if fault == "noncomm_hang":
            # several GPUs of the host stopped (silent, or not starting the collective
            # their peers wait in), on their own communicators: the host, not a GPU
            stopped = {e.comp[0] for e in entries if e.comp[0] is not None}
            if len(stopped) >= 2:
                return (None, None, None), entries
        return comp, [e for e in entries if e.comp == comp]

    def _command(
        self,
        key: tuple[str, str, str],
        ep: _Episode,
        comp: tuple,
        chosen: list[_Entry],
        total: float,
        windows: set[int],
        comms: set[str],
        at: int,
        rail: str = "",
    ) -> IsolationCommand:
        """The command, stamped ``at`` (when its evidence became enough, event time)."""
        job, host, fault = key
        cfg = self.config
        now = self.clock[job]
        gpu, nic, peer = comp
        cid = "c4-" + stable_id(job, host, fault, gpu, nic, peer, ep.first_window)
        action: Action = cfg.actions.get(fault, "alert_only")  # type: ignore[arg-type]
        if rail:
            action = "alert_only"
        elif host in cfg.deny_hosts:
            action, rail = "alert_only", " Not isolated: the host is on the deny list."
        elif action != "alert_only":
            log = self.isolated.setdefault(job, deque())
            while log and log[0] < now - cfg.cap_period_us:
                log.popleft()
            n_hosts = cfg.job_hosts or self.job_hosts.get(job, 1)
            cap = max(1, math.floor(cfg.max_isolated_frac * n_hosts))
            if len(log) >= cap:
                action = "alert_only"
                rail = (
                    f" Not isolated: {len(log)} of {n_hosts} hosts of the job were "
                    f"isolated in the last hour (cap {cap})."
                )
            else:
                log.append(at)
        ep.decided = cid
        self.cooldown[(job, host)] = at + cfg.cooldown_us
        used = {e.comm for e in chosen}
        w0 = min(e.window for e in chosen)
        w1 = max(e.ts for e in chosen)
        evidence: dict[str, Any] = {
            "communicators": sorted({e.ev.comm_name or e.comm for e in chosen}),
            "comm_ids": sorted(used),
            "windows": len({e.window for e in chosen}),
            "verdicts": len(chosen),
            "score": round(total, 3),
            "first_window_us": w0,
            "decided_after_s": round((at - w0) / 1e6, 1),
            "all_communicators": len(comms),
            "all_windows": len(windows),
        }
        silent = self._silent_gpus(job, host, w0) if fault == "noncomm_hang" else set()
        reason = _reason(fault, host, comp, chosen, w0, w1, silent)
        if fault == "straggler" and comp[0] is not None:
            reason += self._stage_text(job, host, comp[0], at)
        reason += rail
        return IsolationCommand(
            id=cid,
            ts_us=at,
            job=job,
            host=host,
            fault=fault,  # type: ignore[arg-type]
            action=action,
            confidence=round(min(0.99, 1 - math.exp(-total)), 3),
            reason=reason,
            evidence=evidence,
            gpu=gpu,
            nic=nic,
            peer_host=peer,
            dry_run=cfg.dry_run,  # explicit: an actuator treats an absent dry_run as true
        )


def _settle(cfg: PolicyConfig, live: list[_Entry]) -> int:
    """How long a hang waits after its first verdict to hear every communicator: the
    policy's settle time, or the hang threshold of its communicators when longer (with
    long steps each communicator calls its hang later, seconds apart, and a job-wide
    stop shows on many hosts only after that)."""
    thr = max((e.ev.threshold_s for e in live if not e.ev.snapshot  # one moment, all heard
               and isinstance(e.ev, (HangEvidence, CommHangEvidence))), default=0.0)  # fmt: skip
    return max(cfg.hang_settle_us, int(thr * 1e6))


def _gpu_unclear(comp: tuple, entries: list[_Entry]) -> bool:
    """The chosen GPU is not told apart: other GPUs of the host are late too, and no
    communicator inside the host (which would name the one holding them up) voted
    for it. (Votes cannot decide: the communicators' windows arrive one by one.)"""
    if comp[0] is None or any(e.intra and e.comp[0] == comp[0] for e in entries):
        return False
    return any(e.comp[0] != comp[0] for e in entries)


def ep_in_cooldown(c: HostCorrelator, key: tuple[str, str, str]) -> bool:
    return c.episodes[key].decided != "" and (key[0], key[1]) in c.cooldown


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _reason(
    fault: str,
    host: str,
    comp: tuple,
    es: list[_Entry],
    w0: int,
    w1: int,
    silent_gpus: set[int] | None = None,
) -> str:
    """One sentence a person on call can act on."""
    gpu, nic, peer = comp
    n_comms = len({e.comm for e in es})
    on = _plural(n_comms, "communicator")
    span = f"{max(1.0, (w1 - w0) / 1e6):.0f} s"
    if fault == "straggler":
        st = [e.ev for e in es if isinstance(e.ev, StragglerEvidence)]
        n = sum(x.collectives for x in st)
        last = sum(x.last_frac * x.collectives for x in st) / max(n, 1)
        vs = [x.peer_time_vs_normal for x in st if x.peer_time_vs_normal]
        px = _median([x.peer_time_x for x in st])
        wait = (
            f"its peers waited {_median(vs):.1f}x their normal time"
            if vs
            else f"its peers spent {px:.1f}x its kernel time"
        )
        if st and all(x.arrival == "enqueue_time" for x in st):  # snapshots without timing
            late = _median([x.late_ms for x in st])
            wait = f"its peers waited {late:.1f} ms for it per collective (by enqueue times)"
        if gpu is None:  # several GPUs alike: the host
            gpus = sorted({e.comp[0] for e in es if e.comp[0] is not None})
            if gpus:
                return (
                    f"{host} is a straggler: its GPUs {', '.join(map(str, gpus))} arrived "
                    f"last in {last:.0%} of {n} collectives on {on} over {span}, {wait}; no "
                    "communicator inside the host names one GPU."
                )
        who = f"{host} GPU {gpu}" if gpu is not None else host
        if st and all(x.intermittent for x in st):
            late = _median([x.late_ms for x in st])
            share = _median([x.step_share or 0.0 for x in st])
            return (
                f"{who} is intermittently late: it arrived last in {last:.0%} of {n} "
                f"collectives on {on} over {span} (on a minority of steps), its peers then "
                f"waiting {late:.1f} ms for it, {share:.0%} of the step or more overall; a "
                "GPU that slows down now and then (check its clocks, temperature and power)."
            )
        return (
            f"{who} is a straggler: it arrived last in {last:.0%} of {n} "
            f"collectives on {on} over {span}, {wait}."
        )
    if fault == "noncomm_hang":
        hs = [e.ev for e in es if isinstance(e.ev, HangEvidence)]
        tgt = sorted({x.target_collective for x in hs if x.target_collective >= 0})
        wait = max((x.wait_s for x in hs), default=0.0)
        coll = f"collective {tgt[0]}" if len(tgt) == 1 else "the current collective"
        gpus = sorted({e.comp[0] for e in es if e.comp[0] is not None} | (silent_gpus or set()))
        absent = next((x.absent for x in hs if x.absent), "")
        if absent:  # a snapshot member with nothing to say while its peers wait for it
            what = ("left no dump: its process died or never reached the dump"
                    if absent == "no dump" else "wrote an empty dump: it is wedged")  # fmt: skip
            return (
                f"{host} {what}; {max(x.peers_waiting for x in hs)} ranks waited "
                f"{wait:.1f} s for it on {on}."
            )
        if gpu is None and len(gpus) >= 2:  # the host as a whole
            silent = all(x.silent for x in hs) or bool(silent_gpus)
            gone = "went silent" if silent else "stopped as a whole"
            return (
                f"{host} {gone}: {_plural(len(gpus), 'GPU')} "
                f"({', '.join(map(str, gpus))}) stopped while their peers waited {wait:.1f} s "
                f"in {coll} on {on}; the host, not one GPU, is at fault."
            )
        if gpu is None and any(x.silent for x in hs):
            return (
                f"{host} went silent: {_plural(len(gpus), 'GPU')} stopped reporting on "
                f"{on} while their peers waited {wait:.1f} s in {coll}."
            )
        who = f"{host} GPU {gpu}" if gpu is not None else host
        if all(x.silent for x in hs):
            return f"{who} went silent on {on} while its peers waited {wait:.1f} s in {coll}."
        return (
            f"{who} hangs: it has not started {coll} on {on} while its peers waited {wait:.1f} s."
        )
    if fault == "comm_hang":
        cs = [e.ev for e in es if isinstance(e.ev, CommHangEvidence)]
        wait = max((x.wait_s for x in cs), default=0.0)
        why = cs[-1].why if cs else "no progress"
        what = f"link {host} {nic} -> {peer}" if peer else f"{host} {nic}"
        return (
            f"{what} is dead: a collective on {on} hung for {wait:.1f} s on all ranks "
            f"({why} on the connections it carries)."
        )
    ratio = _median([e.ev.throughput_ratio for e in es if isinstance(e.ev, SlowEvidence)])
    windows = len({e.window for e in es})
    fams = sorted({e.ev.family for e in es if isinstance(e.ev, SlowEvidence) and e.ev.family})
    against = f" (against the same connection of the other {' and '.join(fams)})" if fams else ""
    if fault == "slow_nic":
        return (
            f"{host} {nic} is slow: its connections moved {ratio:.0%} of their peers' "
            f"median throughput in {_plural(windows, 'window')} over {span} on {on}{against}."
        )
    return (
        f"link {host} {nic} -> {peer} is slow: it moved {ratio:.0%} of the median "
        f"throughput in {_plural(windows, 'window')} over {span} on {on}{against}."
    )


# ---------------------------------------------------------------------- checkpoints
_SCHEMA = 2


def _migrate_1(body: list) -> list:
    """Correlator checkpoint schema 1 -> 2: waiting notes of schema 1 did not say whom
    they waited for (read as older workers' notes); no pipeline or cell families yet
    (learned again from the next windows' notes)."""
    body = list(body)
    body[2] = [[*w, None, False, 0] for w in body[2]]  # waiting
    clock = body[10] if len(body) > 10 else {}
    return [*body[:10], clock, [[], []], []]


class _EntryState(msgspec.Struct, array_like=True):
    ts: int
    comm: str
    window: int
    score: float
    gpu: int | None
    nic: str | None
    peer: str | None
    intra: bool
    ev: dict[str, Any]


class _EpisodeState(msgspec.Struct, array_like=True):
    job: str
    host: str
    fault: str
    first_window: int
    decided: str
    entries: list[_EntryState]


class _CorrelatorState(msgspec.Struct, array_like=True):
    now: int
    episodes: list[_EpisodeState]
    waiting: list[
        tuple[str, str, int, str, str, int, int, float, list[tuple[str, int]] | None, bool, int]
    ]
    """(job, host, gpu, fault, comm, first ts, last ts, extra ms, whom it waited for,
    communicator slow, its window's span)"""
    silent: list[tuple[str, str, int, int]]
    cooldown: list[tuple[str, str, int]]
    isolated: dict[str, list[int]]
    job_hosts: dict[str, int]
    job_host_names: dict[str, list[str]]
    suppressed: int
    roles: list[tuple[str, int, int, int, str, int]]
    """(job, comm hosts, ranks, position, suspect host, last ts)"""
    clock: dict[str, int] = {}
    """Event time per job (``now`` is their newest; a checkpoint without this field
    gives every job ``now``)."""
    families: FamiliesState = msgspec.field(default_factory=FamiliesState)
    slow_comms: list[tuple[str, str, int]] = []


def _state_of(c: HostCorrelator) -> _CorrelatorState:
    eps = [
        _EpisodeState(job, host, fault, ep.first_window, ep.decided, [
            _EntryState(e.ts, e.comm, e.window, e.score, e.comp[0], e.comp[1], e.comp[2],
                        e.intra, msgspec.to_builtins(e.ev))
            for e in ep.entries
        ])
        for (job, host, fault), ep in c.episodes.items()
    ]  # fmt: skip
    return _CorrelatorState(
        now=c.now,
        episodes=eps,
        waiting=[
            (
                *k,
                comm,
                v[0],
                v[1],
                v[2],
                None if v[3] is None else [list(x) for x in v[3]],
                v[4],
                v[5],
            )
            for k, t in c.waiting.items()
            for comm, v in t.items()
        ],
        silent=[(*k, g, ts) for k, t in c.silent.items() for g, ts in t.items()],
        cooldown=[(*k, ts) for k, ts in c.cooldown.items()],
        isolated={j: list(q) for j, q in c.isolated.items()},
        job_hosts=dict(c.job_hosts),
        job_host_names={j: sorted(n) for j, n in c.job_host_names.items()},
        suppressed=c.suppressed,
        roles=[(*k, h, ts) for k, t in c.roles.items() for h, ts in t.items()],
        clock=dict(c.clock),
        families=c.families.state(),
        slow_comms=[(*k, ts) for k, ts in c.slow_comms.items()],
    )


def _from_state(st: _CorrelatorState, c: HostCorrelator) -> HostCorrelator:
    c.clock = dict(st.clock)
    for es in st.episodes:
        ep = _Episode(first_window=es.first_window, decided=es.decided)
        for e in es.entries:
            ev = evidence_of(es.fault, e.ev)
            ep.entries.append(
                _Entry(e.ts, e.comm, e.window, e.score, (e.gpu, e.nic, e.peer), e.intra, ev)
            )
        c.episodes[(es.job, es.host, es.fault)] = ep
    for job, host, gpu, fault, comm, first, last, extra, culprits, slow, span in st.waiting:
        who = None if culprits is None else tuple((str(h), int(g)) for h, g in culprits)
        c.waiting.setdefault((job, host, gpu, fault), {})[comm] = (
            first, last, extra, who, slow, span,
        )  # fmt: skip
    c._waiting_last = {k: max(x[1] + x[5] for x in t.values()) for k, t in c.waiting.items()}
    for job, host, gpu, ts in st.silent:
        c.silent.setdefault((job, host), {})[gpu] = ts
    c.cooldown = {(job, host): ts for job, host, ts in st.cooldown}
    c.isolated = {j: deque(q) for j, q in st.isolated.items()}
    c.job_hosts = dict(st.job_hosts)
    c.job_host_names = {j: set(n) for j, n in st.job_host_names.items()}
    c.suppressed = st.suppressed
    c.families.load(st.families)
    c.slow_comms = {(job, comm): ts for job, comm, ts in st.slow_comms}
    for job, hosts, nranks, pos, host, ts in st.roles:
        c.roles.setdefault((job, hosts, nranks, pos), {})[host] = ts
    if not st.clock and st.now >= 0:  # written before per-job clocks: one clock for all
        jobs = {k[0] for k in c.episodes} | {k[0] for k in c.cooldown} | set(c.job_hosts)
        c.clock = dict.fromkeys(jobs, st.now)
    return c
