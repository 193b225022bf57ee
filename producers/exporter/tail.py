"""Follow every matching file of a directory, as ``tail -F`` would, one poll at a time.

* New files are read from their start (the Inspector writes a file per process).
* Appended lines are read up to the last newline: a partial last line, still being
  written, stays unread until its newline arrives.
* Rotation (rename + new file): files are tracked by inode, so the renamed file is
  read to its end through the descriptor already open, and the new file from its start.
  A file that left the pattern (renamed away or deleted) is closed after it has not
  grown for ``rotate_grace_s``.
* Truncation (``copytruncate``) or replacement in place: the size dropped below the
  read offset, or the first bytes changed → read again from the start.

Positions to resume from come in as :class:`~producers.exporter.positions.FilePosition`
keyed by ``"<dev>:<inode>"``; files renamed while the exporter was down are found by
scanning every file of the directory for those inodes.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "h-pid1.log").write_bytes(b'{"a":1}\\n{"a":2')
>>> t = DirectoryTailer(d)
>>> [(ln.lineno, ln.raw) for ln in t.poll()]
[(1, b'{"a":1}')]
>>> with open(d / "h-pid1.log", "ab") as fh:
...     _ = fh.write(b"}\\n")
>>> [(ln.lineno, ln.raw) for ln in t.poll()]
[(2, b'{"a":2}')]
>>> t.close()
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from producers.exporter.positions import HEAD_BYTES, FilePosition, fingerprint

__all__ = ["DirectoryTailer", "Line", "ReadPosition"]

log = logging.getLogger(__name__)


@dataclass(slots=True)  # not frozen: built once per line, and frozen init is slower
class Line:
    """One complete line: where it starts and ends in its file (inode key)."""

    key: str
    path: str
    lineno: int
    start: int
    end: int
    raw: bytes
    error: str | None = None
    """Set when the line cannot be used as read (longer than the read limit)."""


@dataclass(frozen=True, slots=True, order=True)
class ReadPosition:
    """A point in a file: byte offset and the number of lines before it."""

    offset: int
    lineno: int


@dataclass(slots=True)
class _Open:
    fh: BinaryIO
    path: str
    pos: ReadPosition
    head: str
    head_len: int
    gone_since: float | None = None  # when it stopped matching the pattern


def file_key(st: os.stat_result) -> str:
    """A file's identity across renames: ``<dev>:<inode>``."""
    return f"{st.st_dev}:{st.st_ino}"


def regular_files(
    directory: str | os.PathLike[str],
) -> list[tuple[os.DirEntry, os.stat_result]] | None:
    """The directory's regular files that are not hidden, with their stat (a file that
    vanishes while listed is left out); None when the directory does not exist yet."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return None
    out = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            if entry.is_file():
                out.append((entry, entry.stat()))
        except FileNotFoundError:
            continue
    return out


class DirectoryTailer:
    """Reads new complete lines of ``directory/pattern`` files on each :meth:`poll`."""

    def __init__(
        self,
        directory: str | Path,
        *,
        pattern: str = "*.log",
        resume: dict[str, FilePosition] | None = None,
        max_bytes_per_file: int = 4 << 20,
        rotate_grace_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.pattern = pattern
        self.max_bytes = max_bytes_per_file
        self.rotate_grace_s = rotate_grace_s
        self._clock = clock
        self._resume = dict(resume or {})
        self._open: dict[str, _Open] = {}
        self._first_scan = True

    # ------------------------------------------------------------------ public

    def poll(self) -> Iterator[Line]:
        """Scan the directory, then yield what every open file gained since last time.

        Lines come file by file (at most ``max_bytes_per_file`` of each), so a consumer
        that handles them as they come holds one file's chunk at a time.
        """
        self._scan()
        now = self._clock()
        for key in list(self._open):
            f = self._open[key]
            got = self._read(key, f)
            yield from got
            if f.gone_since is not None and not got and now - f.gone_since >= self.rotate_grace_s:
                log.info("closing %s: rotated away and drained", f.path)
                f.fh.close()
                del self._open[key]

    def read_positions(self) -> dict[str, tuple[str, ReadPosition, str, int]]:
        """Per open file: ``(path, position after the last line read, head, head_len)``."""
        return {k: (f.path, f.pos, f.head, f.head_len) for k, f in self._open.items()}

    def close(self) -> None:
        for f in self._open.values():
            f.fh.close()
        self._open.clear()

    # ---------------------------------------------------------------- internals

    def _scan(self) -> None:
        seen: set[str] = set()
        # (no directory: the training job has not created it yet)
        for entry, st in regular_files(self.directory) or []:
            matches = fnmatch.fnmatch(entry.name, self.pattern)
            # On the first scan, files renamed away while we were down are found too.
            if not (matches or (self._first_scan and self._resume)):
                continue
            key = file_key(st)
            if not matches and key not in self._resume:
                continue
            if matches:
                seen.add(key)
            f = self._open.get(key)
            if f is None:
                self._adopt(key, entry.path, matches)
            else:
                if f.path != entry.path and matches:
                    f.path = entry.path
                if matches:
                    f.gone_since = None
        now = self._clock()
        for key, f in self._open.items():
            if key not in seen and f.gone_since is None:
                f.gone_since = now
        self._first_scan = False
        self._resume.clear()

    def _adopt(self, key: str, path: str, matches: bool) -> None:
        try:
            fh = open(path, "rb")  # noqa: SIM115 - kept open across polls, closed in close()
        except FileNotFoundError:
            return
        head_bytes = os.pread(fh.fileno(), HEAD_BYTES, 0)
        pos = ReadPosition(0, 0)
        head, head_len = fingerprint(head_bytes), len(head_bytes)
        saved = self._resume.get(key)
        if saved is not None:
            if (
                len(head_bytes) >= saved.head_len
                and fingerprint(head_bytes[: saved.head_len]) == saved.head
            ):
                pos = ReadPosition(saved.offset, saved.lineno)
            else:
                log.warning("%s: inode reused by a different file; reading it from the start", path)
        f = _Open(fh, path, pos, head, head_len, None if matches else self._clock())
        self._open[key] = f

    def _read(self, key: str, f: _Open) -> list[Line]:
        fd = f.fh.fileno()
        size = os.fstat(fd).st_size
        if size < f.pos.offset or self._head_changed(fd, f):
            log.warning("%s: truncated or replaced in place; reading it from the start", f.path)
            f.pos = ReadPosition(0, 0)
            head_bytes = os.pread(fd, HEAD_BYTES, 0)
            f.head, f.head_len = fingerprint(head_bytes), len(head_bytes)
        elif f.head_len < HEAD_BYTES and size > f.head_len:
            head_bytes = os.pread(fd, HEAD_BYTES, 0)
            f.head, f.head_len = fingerprint(head_bytes), len(head_bytes)
        if size <= f.pos.offset:
            return []
        data = os.pread(fd, min(size - f.pos.offset, self.max_bytes), f.pos.offset)
        cut = data.rfind(b"\n")
        if cut < 0:
            if len(data) < self.max_bytes:
                return []  # only a partial line so far
            return self._skip_long_line(key, f, fd, size, data)
        data = data[: cut + 1]
        out: list[Line] = []
        start = f.pos.offset
        lineno = f.pos.lineno
        for raw in data.split(b"\n")[:-1]:
            lineno += 1
            end = start + len(raw) + 1
            line = raw.strip()
            if line:
                out.append(Line(key, f.path, lineno, start, end, line))
            start = end
        f.pos = ReadPosition(start, lineno)
        return out

    def _skip_long_line(self, key: str, f: _Open, fd: int, size: int, head: bytes) -> list[Line]:
        """A line longer than the read limit: report its start and move past it."""
        offset = f.pos.offset + len(head)
        while offset < size:
            chunk = os.pread(fd, min(size - offset, self.max_bytes), offset)
            nl = chunk.find(b"\n")
            if nl >= 0:
                end = offset + nl + 1
                lineno = f.pos.lineno + 1
                line = Line(
                    key, f.path, lineno, f.pos.offset, end, head[:1024],
                    error=f"line longer than {self.max_bytes} bytes ({end - f.pos.offset}); "
                    "the first 1024 are kept",
                )  # fmt: skip
                f.pos = ReadPosition(end, lineno)
                return [line]
            offset += len(chunk)
        return []  # its newline has not been written yet

    @staticmethod
    def _head_changed(fd: int, f: _Open) -> bool:
        if f.head_len == 0:
            return False
        return fingerprint(os.pread(fd, f.head_len, 0)) != f.head
