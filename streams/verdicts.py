"""Verdicts: what a per-communicator detector concludes, before per-host correlation.

Topic ``c4.verdicts``, key = host. A verdict names one suspect (host, and GPU, NIC or
peer host where the fault has one) with a score and the evidence behind it; the
correlator joins verdicts across communicators and windows before anything is isolated.

>>> v = Verdict(id="v1", ts_us=10, job="j", comm="0xa", host="h1", fault="straggler",
...             score=0.8, reason="rank 3 arrives last", window_start_us=0,
...             window_end_us=10, evidence={"late_ratio": 1.2})
>>> decode_verdict(encode_verdict(v)) == v
True
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from producers.guard import MAX_DEPTH, BoundsError, Host, check_bounds
from streams.commands import Fault

__all__ = ["Verdict", "VerdictDecodeError", "decode_verdict", "encode_verdict"]


class VerdictDecodeError(ValueError):
    """A message on ``c4.verdicts`` is not a valid verdict (dead-letter it)."""


class Verdict(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: Literal[1] = 1
    id: str
    """Deterministic from (job, comm, fault, suspect, window): re-deciding gives the same id."""
    ts_us: int
    """Event time at which the evidence was complete."""
    job: str
    comm: str
    host: Host
    fault: Fault
    score: Annotated[float, msgspec.Meta(ge=0, le=1e6)]
    """0..1, higher means more certain; the correlator sums evidence across comms."""
    reason: str
    window_start_us: int
    window_end_us: int
    evidence: dict[str, Any] = {}
    ranks: list[int] = []
    gpu: int | None = None
    nic: str | None = None
    peer_host: Host | None = None
    benign: bool = False
    """True for an alert-only observation (e.g. everybody slow at once): never isolates."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Verdict)


def encode_verdict(v: Verdict) -> bytes:
    return _encoder.encode(v)


#: A verdict carries a bounded evidence dict; the largest real ones are tens of KB.
MAX_VERDICT_BYTES = 1024 * 1024


def decode_verdict(data: bytes | str) -> Verdict:
    """Decode one verdict; every failure is a :class:`VerdictDecodeError` naming it.

    >>> decode_verdict(b'[' * 3000)
    Traceback (most recent call last):
    ...
    streams.verdicts.VerdictDecodeError: JSON nested deeper than 32 levels
    """
    try:
        check_bounds(data, max_bytes=MAX_VERDICT_BYTES, max_depth=MAX_DEPTH)
        return _decoder.decode(data)
    except (msgspec.DecodeError, BoundsError) as err:
        raise VerdictDecodeError(str(err)) from None
    except Exception as err:  # RecursionError, MemoryError: never past the edge
        raise VerdictDecodeError(f"undecodable: {type(err).__name__}: {err}") from None
