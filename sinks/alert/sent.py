"""The alerter's durable record of what it posted: no alert posted twice after a kill.

A message's offset is committed after its alerts are settled, so an alerter killed
between a chat accepting a post and that commit (about one poll, 0.25 s) read the
message again at its restart and posted the alert again. Each (message, destination,
notification) is one *delivery*, named by :func:`delivery_id` (the Kafka record's topic,
partition, offset and timestamp: a re-read is the same record), and written here
*before* each request (``posting``; ``reposting`` for a retry after the receiver
refused it), once the first request's body is written (``sent``), and after its answer
(``posted``; ``unconfirmed``: a read timeout after the request was sent; ``failed``:
refused or not sent, so safe to post again — a 503 during an outage). A re-read
delivery found ``posted`` or ``unconfirmed`` is not posted again; one found ``posting``
(killed before its body was written: the receiver has an incomplete request at most) is
posted; one found ``sent`` (killed while it was out) is re-posted only where a repeat is
harmless (the target deduplicates, or ``retry_unconfirmed``), else settled as "maybe
delivered" — the same rule as a read timeout (:mod:`sinks.alert.delivery`); one found
``reposting`` or ``failed`` (killed during an outage) is posted again: at least once,
since the receiver was refusing it. A kill between a body's write and its mark
(microseconds) posts it twice: at least once. (Measured against the real broker, an
alerter SIGKILLed with 8 posts out: "maybe delivered" for one the receiver never got
lost it; ``tests/sinks/test_alert_outage.py``.)

One SQLite file (WAL journal, ``synchronous=NORMAL``), rows older than the retention
pruned at open.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "sent.sqlite3")
>>> with SentLedger(path) as s:
...     s.mark("d1", "posting"); s.mark("d1", "posted")
>>> SentLedger(path).status("d1"), SentLedger(path).status("d2")
('posted', None)
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from sinks.alert.model import Notification

__all__ = ["DEFAULT_SENT_LEDGER", "SentLedger", "SentStatus", "delivery_id"]

DEFAULT_SENT_LEDGER = ".c4stream/alert-sent.sqlite3"

SentStatus = Literal["posting", "reposting", "sent", "posted", "unconfirmed", "failed"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sent (
    id         TEXT PRIMARY KEY,
    status     TEXT NOT NULL,
    updated_us INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS sent_updated ON sent (updated_us);
"""


def delivery_id(
    topic: str, partition: int, offset: int, timestamp_ms: int, destination: str, n: Notification
) -> str:
    """The same for a message read again (same record) and each of its notifications."""
    raw = f"{topic}\0{partition}\0{offset}\0{timestamp_ms}\0{destination}\0{n.status}\0{n.key}"
    return hashlib.sha256(raw.encode("utf-8", "replace")).hexdigest()[:32]


class SentLedger:
    """Delivery id -> what became of its post (thread-safe: the Kafka loop reads, the
    delivery thread writes)."""

    def __init__(self, path: str | Path, *, retention_days: float = 7.0) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(p, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a WAL commit is in the OS's page cache at once, which a killed process
        # cannot lose (a machine's crash can: then a re-post); FULL's fsync per mark took
        # milliseconds, the window in which a kill left the mark behind the request
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        cutoff = int((time.time() - retention_days * 86400) * 1e6)
        self._db.execute("DELETE FROM sent WHERE updated_us < ?", (cutoff,))

    def status(self, ident: str) -> SentStatus | None:
        with self._lock:
            row = self._db.execute("SELECT status FROM sent WHERE id = ?", (ident,)).fetchone()
        return None if row is None else row[0]

    def mark(self, ident: str, status: SentStatus) -> None:
        """Durable on return (a crash after it keeps it)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO sent (id, status, updated_us) VALUES (?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET status = excluded.status, "
                "updated_us = excluded.updated_us",
                (ident, status, int(time.time() * 1e6)),
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
