"""What a file is, from its first bytes, without its reader: the Parquet and Arrow IPC
readers need pyarrow, which deciding that a Flight Recorder dump is not one of them must
not import (``c4stream detect`` on a snapshot).

>>> looks_like_parquet(b"PAR1\\x15\\x04"), looks_like_arrow_ipc(b"\\xff\\xff\\xff\\xff\\x10")
(True, True)
"""

from __future__ import annotations

__all__ = ["ARROW_FILE_MAGIC", "looks_like_arrow_ipc", "looks_like_parquet"]

PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_CONTINUATION = b"\xff\xff\xff\xff"


def looks_like_parquet(head: bytes) -> bool:
    """A Parquet file starts (and ends) with ``PAR1``."""
    return head[:4] == PARQUET_MAGIC


def looks_like_arrow_ipc(head: bytes) -> bool:
    """An IPC file starts with ``ARROW1``; an IPC stream with the continuation marker
    (no text, gzip, pickle or Parquet file starts with byte 0xff)."""
    return head[:6] == ARROW_FILE_MAGIC or head[:4] == ARROW_CONTINUATION
