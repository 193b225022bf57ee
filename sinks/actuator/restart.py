"""Restart the job after an isolation: the actuator closes the loop.

Once a host is isolated (drained, cordoned), the training job it served is still stuck
or slow: it has to be restarted so that the scheduler places it on healthy nodes, from
its last checkpoint. C4 does exactly this (detect → isolate → restart); this module is
c4stream's version, **off by default and per job** (``[actuator.restart] jobs``).

**Why the actuator decides, not the correlator.** Only the actuator knows the isolation
took effect: restarting a job whose faulty node is still schedulable could put it back
on that node. So after an isolation that acted (or, in a dry run, would have acted), the
actuator's :class:`RestartHook` runs the restart through a :class:`Restarter` of its
backend (Slurm: ``scontrol requeue``; Kubernetes: delete the job's pods on the node).
``restart_job`` commands in the contract keep their own, separate path.

The rails, in the order they apply:

1. **enabled**: the job matches ``jobs`` and the fault class is in ``faults`` — else
   nothing happens and nothing is recorded;
2. **once per fault**: a restart is keyed by the isolation command's id (the fault's
   idempotency key); a ``done`` or ``skipped`` row is final, so a redelivered command,
   a replay or a restarted actuator never restarts the job twice for one fault;
3. **not while a restart is in progress**: none within ``in_progress_s`` of the job's
   last restart, nor when the backend sees one under way (Kubernetes: pods of the job
   pending or terminating, e.g. evicted by a NoExecute taint);
4. **at most** ``max_per_hour`` restarts of a job per rolling hour;
5. **dry run first**: with ``execute = false`` (the default), or when the isolation
   itself was a dry run, the restart is described (``would run scontrol requeue 4242``)
   and recorded ``dry_run``; a later real delivery may act.

In a dry run the rails count dry-run restarts as if they had happened, so the log shows
what a real run would do (the second fault of a job within ``in_progress_s`` is
``dry_skipped``); a real run counts only real restarts, and nothing a dry run recorded
blocks it.

The restart log is a table of the actuator's ledger file (SQLite, ``synchronous=FULL``),
written before the isolation's own ledger row: a crash between the two repeats the
(safe) isolation and finds the restart already recorded.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol, Self

from c4base.runtime import TransientError
from sinks.actuator.backends import (
    ActionOutcome,
    ActuatorConfigError,
    ActuatorError,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.config import RestartSettings
from sinks.actuator.ledger import LedgerError
from streams.commands import IsolationCommand

__all__ = [
    "RestartEntry",
    "RestartInterrupted",
    "RestartHook",
    "RestartLog",
    "RestartPlan",
    "RestartResult",
    "RestartStatus",
    "Restarter",
]

log = logging.getLogger("c4stream.actuator.restart")

RestartStatus = Literal["done", "dry_run", "dry_skipped", "skipped", "failed"]
"""``dry_skipped``: a dry run whose rails would have skipped the restart (not final:
a dry run never blocks a later real run; not counted as a restart by the rails)."""
_FINAL = ("done", "skipped")
_ISOLATING = ("cordon", "cordon_and_taint")
_HOUR_US = 3_600_000_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS restarts (
    id          TEXT PRIMARY KEY,
    job         TEXT NOT NULL,
    host        TEXT NOT NULL,
    target      TEXT NOT NULL,
    status      TEXT NOT NULL,
    detail      TEXT NOT NULL,
    cmd_ts_us   INTEGER NOT NULL,
    first_us    INTEGER NOT NULL,
    updated_us  INTEGER NOT NULL,
    deliveries  INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS restarts_job ON restarts (job, first_us);
"""

# A final row (done, skipped) only counts later deliveries; a dry_run or failed row is
# replaced by what the next delivery did (first_us too: a real restart is "issued" then).
_UPSERT = """
INSERT INTO restarts (id, job, host, target, status, detail, cmd_ts_us, first_us, updated_us)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET
    deliveries = deliveries + 1,
    target     = CASE WHEN status IN ('done', 'skipped') THEN target ELSE excluded.target END,
    detail     = CASE WHEN status IN ('done', 'skipped') THEN detail ELSE excluded.detail END,
    first_us   = CASE WHEN status IN ('done', 'skipped') THEN first_us ELSE excluded.first_us END,
    status     = CASE WHEN status IN ('done', 'skipped') THEN status ELSE excluded.status END,
    updated_us = excluded.updated_us
"""


class RestartInterrupted(ActuatorError, TransientError):
    """Asked to stop while retrying a restart: neither the restart nor the isolation is
    recorded or committed, so the command is delivered again after the restart of the
    actuator (the isolation repeats safely, the restart is tried again)."""


@dataclass(frozen=True, slots=True)
class RestartEntry:
    """One fault's restart: what was (or would have been) done, and when (wall clock)."""

    id: str
    """The isolation command's id."""
    job: str
    host: str
    target: str
    """What was restarted: a scheduler job id, pod names, or a selector."""
    status: RestartStatus
    detail: str
    cmd_ts_us: int
    """Event time of the isolation decision (places the restart on the run's timeline)."""
    first_us: int
    """Wall time the restart was issued (or described)."""
    updated_us: int
    deliveries: int


class RestartLog:
    """The ``restarts`` table of the ledger file: one row per fault (isolation id).

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ledger.sqlite3")
    >>> with RestartLog(path) as rl:
    ...     rl.record("c4-1", job="j", host="h3", target="42", status="done", detail="ran",
    ...               cmd_ts_us=5, now_us=1_000)
    ...     rl.record("c4-1", job="j", host="h3", target="42", status="failed", detail="x",
    ...               cmd_ts_us=5, now_us=2_000)
    ...     e = rl.get("c4-1")
    ...     print(e.status, e.deliveries, rl.count("j", since_us=0, statuses=("done",)))
    done 2 1
    """

    def __init__(self, path: str | Path, *, retention_days: float = 30.0) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as err:
            raise LedgerError(f"cannot open the restart log in {self.path}: {err}") from err
        # bounded state, like the ledger's own rows
        self.prune(time.time_ns() // 1000 - int(retention_days * 86_400 * 1e6))

    def get(self, cmd_id: str) -> RestartEntry | None:
        row = self._db.execute("SELECT * FROM restarts WHERE id = ?", (cmd_id,)).fetchone()
        return RestartEntry(*row) if row else None

    def record(
        self,
        cmd_id: str,
        *,
        job: str,
        host: str,
        target: str,
        status: RestartStatus,
        detail: str,
        cmd_ts_us: int,
        now_us: int | None = None,
    ) -> None:
        """Write (durably, before returning) what became of one fault's restart."""
        now = now_us if now_us is not None else time.time_ns() // 1000
        row = (cmd_id, job, host, target, status, detail, cmd_ts_us, now, now)
        try:
            self._db.execute(_UPSERT, row)
        except sqlite3.Error as err:
            raise LedgerError(f"cannot write the restart log in {self.path}: {err}") from err

    def count(
        self, job: str, *, since_us: int, statuses: tuple[str, ...], exclude: str = ""
    ) -> int:
        """Restarts of ``job`` issued at or after ``since_us`` with one of ``statuses``,
        other than the fault ``exclude``."""
        marks = ",".join("?" * len(statuses))
        row = self._db.execute(
            "SELECT COUNT(*) FROM restarts WHERE job = ? AND first_us >= ? AND id != ? "
            f"AND status IN ({marks})",
            (job, since_us, exclude, *statuses),
        ).fetchone()
        return int(row[0])

    def last(
        self, job: str, *, statuses: tuple[str, ...], exclude: str = ""
    ) -> RestartEntry | None:
        """The job's most recently issued restart with one of ``statuses``, other than
        the fault ``exclude`` (its own earlier dry run is not a restart in progress)."""
        marks = ",".join("?" * len(statuses))
        row = self._db.execute(
            f"SELECT * FROM restarts WHERE job = ? AND id != ? AND status IN ({marks}) "
            "ORDER BY first_us DESC LIMIT 1",
            (job, exclude, *statuses),
        ).fetchone()
        return RestartEntry(*row) if row else None

    def entries(self) -> list[RestartEntry]:
        """Every row, oldest first (tests, the demo's timeline)."""
        rows = self._db.execute("SELECT * FROM restarts ORDER BY first_us, id").fetchall()
        return [RestartEntry(*r) for r in rows]

    def prune(self, before_us: int) -> int:
        return self._db.execute("DELETE FROM restarts WHERE updated_us < ?", (before_us,)).rowcount

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class RestartPlan:
    """What a restarter would do for one isolated host's job (no side effects yet)."""

    job: str
    """The telemetry job name."""
    host: str
    target: str
    """The scheduler's handle: a Slurm job id, pod names, or (dry run) a selector."""
    description: str
    """Exactly what :meth:`Restarter.restart` would do; the dry-run log line."""
    argv: tuple[str, ...] = ()
    """Command backend: the argument vector to run."""
    pods: tuple[tuple[str, str], ...] = ()
    """Kubernetes: (name, uid) of the pods to delete."""
    extra: dict[str, str] = field(default_factory=dict)
    cmd: IsolationCommand | None = None
    """The isolation command the plan was made for (templates render from it)."""


class Restarter(Protocol):
    """How a backend restarts the job of an isolated host.

    ``plan`` resolves what to restart; it may read (a ``squeue`` lookup, a pod list)
    when ``live`` is true, never write. It raises
    :class:`~sinks.actuator.backends.PermanentActionError` when there is nothing to
    restart (no job on the node, a job name the rule does not map). ``restart`` carries
    the plan out and raises the backends' errors (see :mod:`sinks.actuator.backends`);
    it must be a safe repeat (a requeued job requeued again, a deleted pod gone).
    """

    name: str

    def plan(self, cmd: IsolationCommand, *, live: bool) -> RestartPlan: ...

    def in_progress(self, plan: RestartPlan) -> str | None:
        """Why a restart of the plan's job is already under way, or None."""
        ...

    def restart(self, plan: RestartPlan) -> ActionOutcome: ...


@dataclass(frozen=True, slots=True)
class RestartResult:
    """What became of one fault's restart (returned for logs, stats and tests)."""

    status: RestartStatus
    detail: str
    target: str = ""


class RestartHook:
    """Applies the rails and runs the restarter after an isolation (module docstring)."""

    def __init__(
        self,
        settings: RestartSettings,
        restarter: Restarter,
        restarts: RestartLog,
        *,
        attempts: int = 3,
        retry_backoff_s: float = 1.0,
        stop: threading.Event | None = None,
    ) -> None:
        if settings.max_per_hour < 1:
            raise ActuatorConfigError("[actuator.restart] max_per_hour must be at least 1")
        if settings.in_progress_s < 0:
            raise ActuatorConfigError("[actuator.restart] in_progress_s must not be negative")
        self.s = settings
        self.restarter = restarter
        self.restarts = restarts
        self.attempts = max(1, attempts)
        self.retry_backoff_s = retry_backoff_s
        self.stop = stop or threading.Event()

    def enabled_for(self, cmd: IsolationCommand) -> bool:
        """Whether a restart is configured for this command's job and fault (rail 1)."""
        job = cmd.job.lower()
        return (
            cmd.action in _ISOLATING
            and cmd.fault in self.s.faults
            and any(fnmatchcase(job, p.lower()) for p in self.s.jobs)
        )

    def after(
        self, cmd: IsolationCommand, decision: str, *, now_us: int | None = None
    ) -> RestartResult | None:
        """Run after the isolation of ``cmd`` was handled with ``decision`` (``act`` and
        done, or ``dry_run``); None when no restart applies. Writes the restart log.

        Raises :class:`~sinks.actuator.backends.ActuatorConfigError` (stop the actuator).
        """
        if decision not in ("act", "dry_run") or not self.enabled_for(cmd):
            return None
        prior = self.restarts.get(cmd.id)
        if prior is not None and prior.status in _FINAL:
            log.info("RESTART %s: already %s for this fault", cmd.id, prior.status)
            return None
        now = now_us if now_us is not None else time.time_ns() // 1000
        dry = decision == "dry_run" or not self.s.execute
        result = self._decide(cmd, dry=dry, now_us=now)
        if dry and result.status == "skipped":  # what a real run would do; never final
            result = RestartResult("dry_skipped", f"would skip: {result.detail}", result.target)
        self.restarts.record(
            cmd.id,
            job=cmd.job,
            host=cmd.host,
            target=result.target,
            status=result.status,
            detail=result.detail,
            cmd_ts_us=cmd.ts_us,
            now_us=now,
        )
        return result

    def _decide(self, cmd: IsolationCommand, *, dry: bool, now_us: int) -> RestartResult:
        tag = f"{cmd.id} (job {cmd.job}, host {cmd.host})"
        counted = ("done", "dry_run") if dry else ("done",)
        last = self.restarts.last(cmd.job, statuses=counted, exclude=cmd.id)
        if last is not None and now_us - last.first_us < self.s.in_progress_s * 1e6:
            ago = (now_us - last.first_us) / 1e6
            why = (
                f"a restart of job {cmd.job} is in progress (issued {ago:.0f} s ago for "
                f"{last.id}; in_progress_s {self.s.in_progress_s:g})"
            )
            log.warning("RESTART SKIPPED %s: %s", tag, why)
            return RestartResult("skipped", why, last.target)
        n = self.restarts.count(
            cmd.job, since_us=now_us - _HOUR_US, statuses=counted, exclude=cmd.id
        )
        if n >= self.s.max_per_hour:
            why = (
                f"job {cmd.job} was restarted {n} times in the last hour "
                f"(max_per_hour {self.s.max_per_hour})"
            )
            log.warning("RESTART SKIPPED %s: %s", tag, why)
            return RestartResult("skipped", why)
        try:
            plan = self.restarter.plan(cmd, live=not dry)
            busy = None if dry else self.restarter.in_progress(plan)
        except PermanentActionError as err:
            log.warning("RESTART SKIPPED %s: %s", tag, err)
            return RestartResult("skipped", f"nothing to restart: {err}")
        except TransientActionError as err:
            log.error("RESTART FAILED %s: %s", tag, err)
            return RestartResult("failed", str(err))
        if busy:
            log.warning("RESTART SKIPPED %s: %s", tag, busy)
            return RestartResult("skipped", busy, plan.target)
        if dry:
            why = (
                "[actuator.restart] execute is false"
                if not self.s.execute
                else "the isolation was a dry run"
            )
            log.warning("RESTART DRY-RUN %s (%s): would %s", tag, why, plan.description)
            return RestartResult("dry_run", f"{why}; would {plan.description}", plan.target)
        return self._restart(plan, tag)

    def _restart(self, plan: RestartPlan, tag: str) -> RestartResult:
        for attempt in range(1, self.attempts + 1):
            try:
                if attempt == 1:
                    log.info("RESTART %s: %s", tag, plan.description)
                out = self.restarter.restart(plan)
            except ActuatorConfigError:
                raise
            except PermanentActionError as err:
                log.error("RESTART FAILED %s: %s", tag, err)
                return RestartResult("failed", str(err), plan.target)
            except Exception as err:  # TransientActionError, or a surprise
                if not isinstance(err, TransientActionError):
                    log.exception("unexpected error restarting %s", tag)
                if attempt == self.attempts:
                    reason = f"gave up after {attempt} attempt(s): {err}"
                    log.error("RESTART FAILED %s: %s", tag, reason)
                    return RestartResult("failed", reason, plan.target)
                pause = self.retry_backoff_s * 2 ** (attempt - 1) * random.uniform(0.8, 1.2)
                log.warning("RESTART RETRY %s in %.1fs: %s", tag, pause, err)
                if self.stop.wait(pause):
                    raise RestartInterrupted(f"stopped while retrying the restart {tag}") from err
            else:
                log.info("RESTARTED %s: %s", tag, out.detail)
                return RestartResult("done", out.detail, plan.target)
        raise AssertionError("unreachable")
