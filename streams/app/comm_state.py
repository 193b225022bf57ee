"""A communicator's state as the worker holds and checkpoints it: its detector, where
it lives (partition, job), and the envelope its checkpoint is written in."""

from __future__ import annotations

import struct

from streams.app.engine import DetectorLike

__all__ = ["Comm", "Enveloped", "unwrap_state", "wrap_state"]


#: Envelope of a communicator's checkpoint: magic, version, the communicator's size
#: (fixed once seen, so it survives a restart), then the detector's own bytes.
_ENVELOPE = struct.Struct("!4sBq")
_MAGIC = b"C4CM"


def wrap_state(nranks: int, state: bytes) -> bytes:
    """The detector's bytes in the envelope.

    >>> unwrap_state(wrap_state(8, b"abc"))
    (8, b'abc')
    """
    return _ENVELOPE.pack(_MAGIC, 1, nranks) + state


def unwrap_state(data: bytes) -> tuple[int, bytes]:
    """(communicator size, detector bytes); ValueError if ``data`` is not an envelope."""
    if len(data) < _ENVELOPE.size:
        raise ValueError("checkpoint shorter than its envelope")
    magic, version, nranks = _ENVELOPE.unpack_from(data)
    if magic != _MAGIC or version != 1 or nranks < 1:
        raise ValueError("not a c4stream communicator checkpoint (no envelope)")
    return nranks, data[_ENVELOPE.size :]


class Enveloped:
    """A detector as its checkpoint is written: in the envelope with its size."""

    __slots__ = ("detector", "nranks")

    def __init__(self, detector: DetectorLike, nranks: int) -> None:
        self.detector = detector
        self.nranks = nranks

    def to_bytes(self) -> bytes:
        return wrap_state(self.nranks, self.detector.to_bytes())


class Comm:
    __slots__ = ("detector", "job", "judged_us", "partition")

    def __init__(self, detector: DetectorLike, partition: int, job: str) -> None:
        self.detector = detector
        self.partition = partition
        self.job = job
        self.judged_us = -1
        """Event time this communicator's detector has been judged up to (events
        observed, or advanced to): its windows before that are closed."""
