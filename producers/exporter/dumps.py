"""Following a Flight Recorder dump directory: when is a dump whole, and when was it seen.

PyTorch dumps each rank's ring to ``<TORCH_FR_DUMP_TEMP_FILE><rank>`` on a watchdog
timeout (or on demand). Its ``DebugInfoWriter`` opens the final name and writes the
pickle in place (``std::ofstream``, no temporary name and no rename), so a file can be
seen half written. A dump counts as **whole** once its size and mtime have not changed
for ``settle_s`` and it parses (a pickle cut short lacks its final STOP opcode, a JSON
document its closing brace: both fail to parse). Its **dump time** is the wall time this
watcher first saw the file as it is now (at most one poll after the write ended);
files already there at the first scan keep their mtime rule (the watcher did not see
them written).

Bounds: a file larger than ``max_bytes``, or a pickle that names a class (nothing read
can run code), is refused at once; one that has not parsed
``give_up_s`` after its last change is given up (a writer that died mid-write); each
is reported once per version of the file (inode, size, mtime). Unpickling is the
restricted unpickler of :mod:`producers.formats.fr_dump`.

>>> import tempfile, pathlib, pickle
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> t = [0.0]
>>> w = DumpWatcher(d, settle_s=1.0, clock=lambda: t[0], wall_us=lambda: 7_000_000)
>>> _ = w.poll()  # the first scan: nothing there yet
>>> data = pickle.dumps({"version": "2.10", "entries": [], "pg_status": {}})
>>> _ = (d / "_dump_0").write_bytes(data[:10])  # half written
>>> w.poll()
([], [])
>>> _ = (d / "_dump_0").write_bytes(data); t[0] = 0.5
>>> w.poll()  # whole now, but not yet settled
([], [])
>>> t[0] = 2.0
>>> ready, bad = w.poll()
>>> [(r.path.name, r.seen_us) for r in ready], bad
([('_dump_0', 7000000)], [])
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producers.events import Event
from producers.exporter.positions import DumpRecord
from producers.exporter.tail import file_key, regular_files
from producers.formats.flight_recorder import LoadedDump, read_snapshot_with_facts
from producers.formats.fr_dump import (
    DEFAULT_MAX_DUMP_BYTES,
    DumpRefused,
    FlightRecorderError,
    parse_flight_recorder_dump,
)
from producers.formats.fr_facts import SnapshotFacts
from producers.traces import BadLine

__all__ = ["DumpWatcher", "WholeDump", "read_snapshot"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WholeDump:
    path: Path
    key: str
    """``<dev>:<inode>`` of the file."""
    record: DumpRecord
    data: dict[str, Any]
    seen_us: int | None
    """Wall time first seen as it is now; None: there at the first scan."""


@dataclass(slots=True)
class _Watch:
    sig: tuple[int, int]
    """(size, mtime_ns) of the version being watched."""
    since: float
    """Monotonic time this version was first seen."""
    seen_us: int | None


class DumpWatcher:
    """Reports each whole new dump of ``directory/pattern`` once (see module doc)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        pattern: str = "*",
        settle_s: float = 1.0,
        give_up_s: float = 300.0,
        max_bytes: int = DEFAULT_MAX_DUMP_BYTES,
        done: dict[str, DumpRecord] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_us: Callable[[], int] = lambda: time.time_ns() // 1000,
    ) -> None:
        self.directory = Path(directory)
        self.pattern = pattern
        self.settle_s = settle_s
        self.give_up_s = give_up_s
        self.max_bytes = max_bytes
        self.done: dict[str, DumpRecord] = dict(done or {})
        """Versions published or given up, by ``<dev>:<inode>``."""
        self._clock = clock
        self._wall_us = wall_us
        self._watch: dict[str, _Watch] = {}
        self._first = True

    def poll(self) -> tuple[list[WholeDump], list[tuple[str, str, str, DumpRecord]]]:
        """Whole dumps new since the last poll, and ``(path, reason, key, record)`` of
        files refused or given up (each version once)."""
        now, wall = self._clock(), self._wall_us()
        first, self._first = self._first, False
        ready: list[WholeDump] = []
        bad: list[tuple[str, str, str, DumpRecord]] = []
        files = regular_files(self.directory)
        if files is None:
            return [], []  # the job has not created it yet
        present = set()
        for entry, st in files:
            if not fnmatch.fnmatch(entry.name, self.pattern):
                continue
            key = file_key(st)
            present.add(key)
            sig = (st.st_size, st.st_mtime_ns)
            rec = self.done.get(key)
            if rec is not None and (rec.size, rec.mtime_ns) == sig:
                continue  # this version was published (or given up) already
            w = self._watch.get(key)
            if w is None or w.sig != sig:  # new, or changed since the last poll
                w = self._watch[key] = _Watch(sig, now, None if first else wall)
            if now - w.since < self.settle_s and not first:
                continue
            record = DumpRecord(path=entry.path, size=sig[0], mtime_ns=sig[1])
            if st.st_size > self.max_bytes:
                bad.append((entry.path, f"dump of {st.st_size} bytes is larger than the "
                            f"limit ({self.max_bytes}): refused unread", key, record))  # fmt: skip
                self._finish(key, record)
                continue
            try:
                with open(entry.path, "rb") as fh:
                    data = parse_flight_recorder_dump(fh.read(self.max_bytes + 1),
                                                      max_bytes=self.max_bytes)  # fmt: skip
            except DumpRefused as err:
                bad.append((entry.path, str(err), key, record))
                self._finish(key, record)
                continue
            except (FlightRecorderError, OSError) as err:
                if now - w.since >= self.give_up_s:
                    why = (f"not a whole dump {self.give_up_s:.0f} s after its last change "
                           f"(a writer that died mid-write?): {err}")  # fmt: skip
                    bad.append((entry.path, why, key, record))
                    self._finish(key, record)
                continue  # still being written, most likely
            ready.append(WholeDump(Path(entry.path), key, record, data, w.seen_us))
            self._finish(key, record)
        for key in set(self._watch) - present:
            del self._watch[key]  # deleted or renamed away before it was whole
        for key in set(self.done) - present:
            del self.done[key]  # gone: its inode may be reused by a new dump
        return ready, bad

    def _finish(self, key: str, record: DumpRecord) -> None:
        self._watch.pop(key, None)
        self.done[key] = record


def read_snapshot(
    dumps: list[WholeDump], *, job: str, host: str | None, all_ranks: bool
) -> tuple[str, list[tuple[Path, Event]], SnapshotFacts, list[BadLine]]:
    """Whole dumps read together as one snapshot: its id (the same for the same files),
    its events (each dump's time the one it was first seen whole), its facts, and what
    could not be read.

    ``all_ranks``: the directory holds every rank's dumps, so a rank without one has
    none; else (a node's own directory) only the empty dumps seen here are absent ranks."""
    bad: list[BadLine] = []
    read, facts = read_snapshot_with_facts(
        [d.path for d in dumps],
        job=job,
        on_bad=bad.append,
        loaded={d.path: LoadedDump(d.data, d.record.mtime_ns // 1000, d.seen_us) for d in dumps},
        host=host,
    )
    if not all_ranks:
        facts.absent = {r: why for r, why in facts.absent.items() if why == "empty dump"}
    if host is not None:  # an empty dump has no events to carry the host: it is here too
        for r, why in facts.absent.items():
            if why == "empty dump":
                facts.hosts[r] = host
    ident = hashlib.sha1(usedforsecurity=False)
    for d in sorted(dumps, key=lambda d: d.key):
        ident.update(f"{d.key}:{d.record.size}:{d.record.mtime_ns};".encode())
    events = [(path, ev) for path, evs in read for ev in evs]
    return f"{job}:{ident.hexdigest()[:16]}", events, facts, bad
