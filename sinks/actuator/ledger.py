"""The actuator's durable idempotency store: which command ids have acted.

One SQLite file (WAL journal, ``synchronous=FULL``: a recorded row survives a crash
or power loss). The consumer writes an ``in_progress`` row *before* it acts
(:meth:`Ledger.begin`), the outcome *after* the action and *before* it commits the
Kafka offset, so:

- crash after the outcome: the command is delivered again, the ledger says ``done``,
  nothing acts twice;
- crash between ``begin`` and the outcome (the action may or may not have run): the
  command is delivered again and finds its row ``in_progress``; the actuator asks the
  target whether the action is already there (see :mod:`sinks.actuator.recovery`)
  instead of repeating it blindly, and records ``done`` or ``unknown``.

``done`` and ``unknown`` are final: they block every later delivery (``unknown``: the
action may have run; a person checks the host and, to let the command act again,
sets the row to ``failed``). ``dry_run``, ``skipped`` and ``failed`` rows are an audit
trail: a command first seen in dry-run mode acts when it is delivered again to an
actuator running with ``--execute``; a failed one is tried again.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "ledger.sqlite3")
>>> with Ledger(path) as led:
...     led.record("c4-1", status="dry_run", host="h3", action="cordon", detail="would")
...     print(led.is_done("c4-1"))
...     led.record("c4-1", status="done", host="h3", action="cordon", detail="cordoned")
...     led.record("c4-1", status="failed", host="h3", action="cordon", detail="late")
False
>>> with Ledger(path) as led:  # reopened: still done, never downgraded; 3 deliveries
...     e = led.get("c4-1")
...     print(led.is_done("c4-1"), e.status, e.detail, e.deliveries)
True done cordoned 3
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

__all__ = ["FINAL", "Ledger", "LedgerEntry", "LedgerError", "Status"]

Status = Literal["done", "dry_run", "skipped", "failed", "in_progress", "unknown"]

#: Statuses a later delivery never overwrites: the command acted, or may have.
FINAL = ("done", "unknown")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS actions (
    id          TEXT PRIMARY KEY,
    status      TEXT NOT NULL,
    host        TEXT NOT NULL,
    action      TEXT NOT NULL,
    detail      TEXT NOT NULL,
    first_us    INTEGER NOT NULL,
    updated_us  INTEGER NOT NULL,
    deliveries  INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS actions_updated ON actions (updated_us);
"""

# Added later: a ledger written by an older actuator gains them when opened.
_COLUMNS = {"job": "TEXT NOT NULL DEFAULT ''", "fault_key": "TEXT NOT NULL DEFAULT ''"}

# A final row (``done``, ``unknown``) stays: later deliveries only count themselves.
_UPSERT = """
INSERT INTO actions (id, status, host, action, detail, first_us, updated_us, job, fault_key)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET
    deliveries = deliveries + CASE WHEN status = 'in_progress' THEN 0 ELSE 1 END,
    status     = CASE WHEN status IN ('done', 'unknown') THEN status ELSE excluded.status END,
    detail     = CASE WHEN status IN ('done', 'unknown') THEN detail ELSE excluded.detail END,
    updated_us = excluded.updated_us
"""

# The mark written before acting (it counts the delivery; the outcome written over it
# then does not); it never lowers a final row.
_BEGIN = """
INSERT INTO actions (id, status, host, action, detail, first_us, updated_us, job, fault_key)
VALUES (?, 'in_progress', ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET
    deliveries = deliveries + 1,
    status     = CASE WHEN status IN ('done', 'unknown') THEN status ELSE 'in_progress' END,
    detail     = CASE WHEN status IN ('done', 'unknown') THEN detail ELSE excluded.detail END,
    updated_us = excluded.updated_us
"""


_FIELDS = "id, status, host, action, detail, first_us, updated_us, deliveries"


class LedgerError(RuntimeError):
    """The ledger file cannot be opened or written: check the path (``--ledger``) is on
    a writable local disk (not NFS: SQLite locking) and that no other program holds it."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    id: str
    status: Status
    host: str
    action: str
    detail: str
    first_us: int
    updated_us: int
    deliveries: int


class Ledger:
    """Command ids and what became of them; a context manager that closes the file."""

    def __init__(self, path: str | Path, *, retention_days: float = 30.0) -> None:
        self.path = Path(path)
        self.retention_us = int(retention_days * 86_400 * 1e6)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(actions)")}
            for name, decl in _COLUMNS.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE actions ADD COLUMN {name} {decl}")
            self._db.execute("CREATE INDEX IF NOT EXISTS actions_fault ON actions (fault_key)")
            self._db.execute("CREATE INDEX IF NOT EXISTS actions_job ON actions (job)")
        except (OSError, sqlite3.Error) as err:
            raise LedgerError(f"cannot open the actuator ledger {self.path}: {err}") from err
        self.prune()

    def is_done(self, cmd_id: str) -> bool:
        """Whether ``cmd_id`` has acted (a ``done`` row exists)."""
        row = self._db.execute("SELECT status FROM actions WHERE id = ?", (cmd_id,)).fetchone()
        return row is not None and row[0] == "done"

    def record(
        self,
        cmd_id: str,
        *,
        status: Status,
        host: str,
        action: str,
        detail: str,
        now_us: int | None = None,
        job: str = "",
        fault_key: str = "",
    ) -> None:
        """Write (durably, before returning) what became of one delivery of ``cmd_id``.

        ``fault_key``: the fault's identity (:func:`sinks.actuator.policy.fault_key`),
        so a fault decided again under another id is recognised as done."""
        now = now_us if now_us is not None else time.time_ns() // 1000
        row = (cmd_id, status, host, action, detail, now, now, job, fault_key)
        try:
            self._db.execute(_UPSERT, row)
        except sqlite3.Error as err:
            raise LedgerError(f"cannot write the actuator ledger {self.path}: {err}") from err

    def begin(
        self,
        cmd_id: str,
        *,
        host: str,
        action: str,
        detail: str,
        job: str = "",
        fault_key: str = "",
    ) -> None:
        """Write (durably, before returning) that ``cmd_id`` is about to act: a crash
        before :meth:`record` leaves the row ``in_progress`` for the restart to resolve."""
        now = time.time_ns() // 1000
        row = (cmd_id, host, action, detail, now, now, job, fault_key)
        try:
            self._db.execute(_BEGIN, row)
        except sqlite3.Error as err:
            raise LedgerError(f"cannot write the actuator ledger {self.path}: {err}") from err

    def unfinished(self) -> list[LedgerEntry]:
        """Rows left ``in_progress`` by an actuator that stopped while acting."""
        rows = self._db.execute(
            f"SELECT {_FIELDS} FROM actions WHERE status = 'in_progress' ORDER BY first_us"
        ).fetchall()
        return [LedgerEntry(*r) for r in rows]

    def fault_done(self, fault_key: str, since_us: int) -> str | None:
        """The id of a command for the same fault that acted (or may have: ``unknown``)
        since ``since_us``, or None."""
        row = self._db.execute(
            "SELECT id FROM actions WHERE fault_key = ? AND fault_key != '' "
            "AND status IN ('done', 'unknown') AND first_us >= ? LIMIT 1",
            (fault_key, since_us),
        ).fetchone()
        return row[0] if row else None

    def acted_for_job(self, job: str, since_us: int) -> int:
        """How many commands of ``job`` acted since ``since_us`` (the actuator's cap)."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM actions WHERE job = ? AND status IN ('done', 'unknown') "
            "AND first_us >= ?",
            (job, since_us),
        ).fetchone()
        return int(row[0])

    def get(self, cmd_id: str) -> LedgerEntry | None:
        row = self._db.execute(f"SELECT {_FIELDS} FROM actions WHERE id = ?", (cmd_id,)).fetchone()
        return LedgerEntry(*row) if row else None

    def entries(self) -> list[LedgerEntry]:
        """Every row, oldest first (for tests and ``--ledger`` inspection)."""
        rows = self._db.execute(f"SELECT {_FIELDS} FROM actions ORDER BY first_us, id").fetchall()
        return [LedgerEntry(*r) for r in rows]

    def prune(self, now_us: int | None = None) -> int:
        """Drop rows not updated within the retention; bounded state. Returns the count."""
        now = now_us if now_us is not None else time.time_ns() // 1000
        cutoff = now - self.retention_us
        cur = self._db.execute("DELETE FROM actions WHERE updated_us < ?", (cutoff,))
        return cur.rowcount

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
