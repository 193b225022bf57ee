"""Where the exporter is in each file, saved so a restart neither loses nor repeats lines.

A position names a file by device and inode (names change on rotation, inodes do not)
and keeps a fingerprint of the file's first bytes, so an inode reused by a new file
after a restart is recognised as new. The file is replaced atomically (temp file, fsync,
rename, fsync of the directory): a crash leaves the old or the new positions, never a
torn file.

>>> import tempfile, pathlib
>>> store = PositionStore(pathlib.Path(tempfile.mkdtemp()) / "pos.json")
>>> store.save({"1:2": FilePosition(path="a.log", offset=10, lineno=1, head="ab", head_len=2)})
>>> store.load()["1:2"].offset
10
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec

__all__ = ["DumpRecord", "FilePosition", "PositionStore", "PositionsError", "fingerprint"]


class PositionsError(RuntimeError):
    """The state file exists but cannot be read; move it away to start from scratch
    (every file is then read again from its start, so lines are sent twice)."""


class FilePosition(msgspec.Struct, kw_only=True):
    path: str
    """Last name the file was seen under (for people; files are matched by inode)."""
    offset: int
    """Byte offset just after the last line whose delivery is confirmed."""
    lineno: int
    """Number of lines up to ``offset`` (for ``file:line`` in dead letters)."""
    head: str
    """sha1 of the file's first ``head_len`` bytes."""
    head_len: int


class DumpRecord(msgspec.Struct, kw_only=True):
    """A version of a Flight Recorder dump file already published (or given up)."""

    path: str
    size: int
    mtime_ns: int


class _State(msgspec.Struct, kw_only=True):
    v: int = 1
    files: dict[str, FilePosition] = {}
    dumps: dict[str, DumpRecord] = {}
    """Flight Recorder dumps published, by ``<dev>:<inode>`` (absent in older files)."""


HEAD_BYTES = 64


def fingerprint(data: bytes) -> str:
    """The fingerprint of a file's first bytes (``head``)."""
    return hashlib.sha1(data, usedforsecurity=False).hexdigest()


class PositionStore:
    """Loads and atomically saves positions keyed by ``"<dev>:<inode>"``; no file = none."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def load(self) -> dict[str, FilePosition]:
        return self._load().files

    def load_dumps(self) -> dict[str, DumpRecord]:
        return self._load().dumps

    def _load(self) -> _State:
        if self.path is None or not self.path.exists():
            return _State()
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=_State)
        except (OSError, msgspec.DecodeError) as err:
            raise PositionsError(f"cannot read exporter state {self.path}: {err}") from None

    def save(
        self, files: dict[str, FilePosition], dumps: dict[str, DumpRecord] | None = None
    ) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(msgspec.json.encode(_State(files=files, dumps=dumps or {})))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
