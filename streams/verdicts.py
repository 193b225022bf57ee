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

from typing import Any, Literal

import msgspec

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
    host: str
    fault: Fault
    score: float
    """0..1, higher means more certain; the correlator sums evidence across comms."""
    reason: str
    window_start_us: int
    window_end_us: int
    evidence: dict[str, Any] = {}
    ranks: list[int] = []
    gpu: int | None = None
    nic: str | None = None
    peer_host: str | None = None
    benign: bool = False
    """True for an alert-only observation (e.g. everybody slow at once): never isolates."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Verdict)


def encode_verdict(v: Verdict) -> bytes:
    return _encoder.encode(v)


def decode_verdict(data: bytes | str) -> Verdict:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as err:
        raise VerdictDecodeError(str(err)) from None
