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
from collections.abc import Collection, Mapping

import msgspec

from streams.commands import IsolationCommand
from streams.core import checkpoint as ck
from streams.core.config import PolicyConfig
from streams.core.correlate_state import SCHEMA, load, state_of, states_of
from streams.core.episode import MAX_ENTRIES, Entry, Episode
from streams.core.family import Families
from streams.core.findings import (
    Cells,
    Census,
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
from streams.core.rails import (
    HANGS,
    enough_evidence,
    job_wide_rail,
    rail_action,
    settle_time_us,
    whole_nic,
)
from streams.core.reasons import command_evidence, reason_text
from streams.core.stats import slow_score, stable_id
from streams.verdicts import Verdict

__all__ = ["HostCorrelator", "LateEvidence"]

_WAIT_MEMORY_US = 15_000_000  # a "waiting" note clears a GPU for this long

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
        self.episodes: dict[tuple[str, str, str], Episode] = {}
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
            ep = self.episodes[key] = Episode(first_window=v.window_start_us)
        comp = (v.gpu, v.nic, v.peer_host)
        ev = evidence_of(v.fault, v.evidence)
        intra = ev.comm_hosts == 1
        if v.fault in ("slow_nic", "slow_link"):
            self.slow_comms[(v.job, v.comm)] = v.ts_us
        ep.entries.append(Entry(v.ts_us, v.comm, v.window_start_us, v.score, comp, intra, ev))
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
        return self.advance_jobs(dict.fromkeys(jobs, now_us))

    def advance_jobs(self, clocks: Mapping[str, int]) -> list[IsolationCommand]:
        """:meth:`advance` of several jobs at once, each to its own clock, in one pass
        over the state: the worker's correlator moves every job it holds at each batch,
        and a pass per job made that quadratic in the jobs (100k GPUs: hundreds)."""
        for j, t in clocks.items():
            if t > self.clock.get(j, -1):
                self.clock[j] = t
        jobs = set(clocks)
        self._prune(jobs)
        out = []
        for key, ep in list(self.episodes.items()):
            if not ep.decided and key[2] in HANGS and key[0] in jobs:
                cmd = self._decide(key, ep)
                if cmd:
                    out.append(cmd)
        return out

    def to_bytes(self, job: str | None = None) -> bytes:
        """A checkpoint (``job``'s part alone when given): versioned msgpack, no pickle."""
        return ck.encode("correlator", SCHEMA, state_of(self, job))

    def parts_to_bytes(self, jobs: Collection[str]) -> dict[str, bytes]:
        """:meth:`to_bytes` of each of ``jobs``, in one pass over the state."""
        return {j: ck.encode("correlator", SCHEMA, st) for j, st in states_of(self, jobs).items()}  # type: ignore[misc]

    @classmethod
    def from_bytes(cls, data: bytes, config: PolicyConfig, into: HostCorrelator | None = None,
                   job: str | None = None) -> HostCorrelator:  # fmt: skip
        """The correlator back from :meth:`to_bytes` (``job``: that job's checkpoint,
        replacing its part of ``into``); else :class:`~streams.core.checkpoint.CheckpointError`."""
        return load(data, lambda: cls(config), into, job)

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
            # kept as long as the evidence they may clear (a hang decided late, after
            # its communicators' long threshold, is still judged with them)
            if k[0] in jobs and t < clock[k[0]] - max(_WAIT_MEMORY_US, h)
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
        if len(seen) > MAX_ENTRIES:  # bounded: forget the oldest
            del seen[min(seen, key=lambda h: (seen[h], h))]

    def _role(self, job: str, e: Entry) -> bool:
        """The entry's rank position is late on ``role_replicas`` or more hosts in
        communicators of its shape within the horizon: a role, not this GPU's fault."""
        ev = e.ev
        if not isinstance(ev, StragglerEvidence) or ev.position < 0:
            return False
        seen = self.roles.get((job, ev.comm_hosts, ev.nranks, ev.position), {})
        cut = self.clock.get(job, -1) - self.config.horizon_us
        return sum(1 for ts in seen.values() if ts >= cut) >= self.config.role_replicas

    def _alive(self, e: Entry, now: int) -> bool:
        """Evidence is kept for the horizon, or three of its windows when they are
        longer (a communicator with long steps has long windows)."""
        return e.ts >= now - max(self.config.horizon_us, 3 * _span(e.ts, e.window))

    def _live(self, key: tuple[str, str, str], ep: Episode) -> list[Entry]:
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
                whole_nic=sc.whole,
            )  # fmt: skip
            score = slow_score(sc.ratio, self.families.slow_ratio)
            key = (v.job, sc.host, fault)
            ep = self.episodes.get(key)
            if ep is None:
                ep = self.episodes[key] = Episode(first_window=v.window_start_us)
            comp = (None, sc.nic, sc.peer_host)
            ep.entries.append(Entry(v.ts_us, v.comm, v.window_start_us, score, comp, False, ev))
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

    def _victim(self, job: str, host: str, fault: str, e: Entry) -> bool:
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
        if fault == "straggler":  # its pipeline link runs through a NIC/link found slow
            for comm in self.families.member.get((job, host, gpu), {}):
                at = self.slow_comms.get((job, comm), -1)
                if at >= 0 and abs(at - e.ts) <= _WAIT_MEMORY_US + _span(e.ts, e.window):
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

    def _decide(self, key: tuple[str, str, str], ep: Episode) -> IsolationCommand | None:
        job, host, fault = key
        cfg = self.config
        now = self.clock[job]
        if (job, host) in self.cooldown and self.cooldown[(job, host)] >= now:
            return None
        live = self._live(key, ep)
        if not live:
            return None
        # one vote per (communicator, window): repeated reports of one window add nothing
        best: dict[tuple[str, int], Entry] = {}
        for e in live:
            k = (e.comm, e.window)
            if k not in best or e.score > best[k].score:
                best[k] = e
        total = sum(e.score for e in best.values())
        windows = {e.window for e in best.values()}
        comms = {e.comm for e in best.values()}
        if fault in HANGS:
            first = min(e.ts for e in live)
            if total < cfg.hang_min_score or now - first < settle_time_us(cfg, live):
                return None
            # one GPU so far: wait a little for the host's other communicators, which
            # tell a dead host (every GPU stops) from one hung process
            gpus = {e.comp[0] for e in best.values() if e.comp[0] is not None}
            gpus |= self._silent_gpus(job, host, first)
            if fault == "noncomm_hang" and len(gpus) < 2 and now - first < cfg.host_wait_us:
                return None
        elif not enough_evidence(cfg, fault, list(best.values()), total):
            return None
        comp, chosen = self._component(fault, list(best.values()))
        if fault in ("slow_nic", "slow_link") and not (
            len({e.window for e in chosen}) >= cfg.slow_min_windows or whole_nic(fault, chosen)
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
        rail = job_wide_rail(self, job, min(e.ts for e in live)) if fault in HANGS else ""
        at = min(now, self._enough_at(job, host, fault, live))
        cmd = self._command(key, ep, comp, chosen, total, windows, comms, at, rail)
        hold = next((e.ev.hold for e in chosen if e.ev.hold), "")
        if hold and cmd.action != "alert_only":  # the finding says why not to isolate
            self.isolated.get(job, deque()).remove(at)
            cmd = msgspec.structs.replace(cmd, action="alert_only", reason=hold)
        return cmd

    def _enough_at(self, job: str, host: str, fault: str, live: list[Entry]) -> int:
        """The earliest event time at which ``live`` (evidence found enough) was enough,
        by the rules of :meth:`_decide` applied to its prefixes in ``ts`` order.

        Commands are stamped with it, so the stamp does not depend on how often the
        clock was advanced (every slice offline, in coarser steps in a busy worker)."""
        cfg = self.config
        first = min(e.ts for e in live)
        notes = self.silent.get((job, host), {})
        silent = sorted(t for t in notes.values() if t >= first - _WAIT_MEMORY_US)
        best: dict[tuple[str, int], Entry] = {}
        total = 0.0
        found: list[int] = []
        for e in sorted(live, key=lambda x: x.ts):
            k = (e.comm, e.window)
            old = best.get(k)
            if old is None or e.score > old.score:
                total += e.score - (old.score if old is not None else 0.0)
                best[k] = e
            if fault not in HANGS:
                if enough_evidence(cfg, fault, list(best.values()), total):
                    return e.ts  # decided on arrival: the first prefix that is enough
                continue
            if total < cfg.hang_min_score:
                continue
            at = max(e.ts, first + settle_time_us(cfg, live))
            if fault == "noncomm_hang":
                n = len({b.comp[0] for b in best.values() if b.comp[0] is not None})
                if n < 2 and n + len(silent) >= 2:  # silence notes make it two GPUs
                    at = max(at, min(first + cfg.host_wait_us, silent[1 - n]))
                elif n < 2:
                    at = max(at, first + cfg.host_wait_us)
            found.append(at)
        return min(found) if found else max(e.ts for e in live)

    def _silent_gpus(self, job: str, host: str, since: int) -> set[int]:
        """GPUs of ``host`` noted silent (alert-only notes) around a hang from ``since``."""
        notes = self.silent.get((job, host), {})
        return {g for g, ts in notes.items() if ts >= since - _WAIT_MEMORY_US}

    @staticmethod
    def _component(fault: str, entries: list[Entry]) -> tuple[tuple, list[Entry]]:
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
        ep: Episode,
        comp: tuple,
        chosen: list[Entry],
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
        n_hosts = cfg.job_hosts or self.job_hosts.get(job, 1)
        action, rail = rail_action(cfg, self.isolated, job, n_hosts, host, fault, at, now, rail)
        ep.decided = cid
        self.cooldown[(job, host)] = at + cfg.cooldown_us
        w0 = min(e.window for e in chosen)
        w1 = max(e.ts for e in chosen)
        evidence = command_evidence(chosen, total, at, windows, comms)
        silent = self._silent_gpus(job, host, w0) if fault == "noncomm_hang" else set()
        reason = reason_text(fault, host, comp, chosen, w0, w1, silent)
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


def _gpu_unclear(comp: tuple, entries: list[Entry]) -> bool:
    """The chosen GPU is not told apart: other GPUs of the host are late too, and no
    communicator inside the host (which would name the one holding them up) voted
    for it. (Votes cannot decide: the communicators' windows arrive one by one.)"""
    if comp[0] is None or any(e.intra and e.comp[0] == comp[0] for e in entries):
        return False
    return any(e.comp[0] != comp[0] for e in entries)


def ep_in_cooldown(c: HostCorrelator, key: tuple[str, str, str]) -> bool:
    return c.episodes[key].decided != "" and (key[0], key[1]) in c.cooldown
