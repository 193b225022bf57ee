"""The collective-event contract, version 1, as typed msgspec structures.

A Kafka message (or one line of a JSON-lines trace) holds one event or a JSON array
of events. ``kind`` tells an ``op`` (one collective completed on one rank) from a
``progress`` heartbeat (the only evidence of a hang, since a hung op never completes).
Optional fields are ``None`` when absent; an explicit JSON ``null`` is read as absent
too (a deliberate leniency), and the encoder never writes ``null``.

>>> ev = OpEvent(v=1, job="j", comm="0xa", nranks=2, rank=0, host="h0", ts_us=1,
...              op="AllReduce", seq=7, bytes=1024, exec_us=12.5)
>>> encode_message([ev])
b'[{"kind":"op","op":"AllReduce","seq":7,"bytes":1024,"exec_us":12.5,"v":1,"job":"j","comm":"0xa","nranks":2,"rank":0,"host":"h0","ts_us":1}]'
>>> decode_message(encode_message([ev])) == [ev]
True
>>> decode_message(b'{"kind":"op","v":1}')
Traceback (most recent call last):
...
producers.events.EventDecodeError: Object missing required field `op`
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = [
    "Conn",
    "Event",
    "EventDecodeError",
    "OpEvent",
    "ProgressEvent",
    "decode_message",
    "encode_message",
]

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class EventDecodeError(ValueError):
    """A message does not hold contract events.

    The message is not lost: callers send it to the dead-letter topic with ``str(err)``
    as the reason and go on with the next message.
    """


class Conn(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Traffic of one rank with one peer rank (cumulative so far, in progress events)."""

    peer: NonNeg
    dir: Literal["send", "recv"]
    bytes: NonNeg
    time_us: NonNegFloat | None = None
    retrans: NonNeg | None = None


class _Identity(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="kind"):
    v: Literal[1]
    job: NonEmpty
    comm: NonEmpty
    nranks: Annotated[int, msgspec.Meta(ge=1)]
    rank: NonNeg
    host: NonEmpty
    ts_us: int
    comm_name: str | None = None
    gpu: NonNeg | None = None
    nic: str | None = None


class OpEvent(_Identity, tag="op"):
    """One collective (or p2p op) completed on one rank."""

    op: str
    seq: NonNeg
    bytes: NonNeg
    exec_us: NonNegFloat
    algbw_gbs: float | None = None
    busbw_gbs: float | None = None
    algo: str | None = None
    proto: str | None = None
    conns: list[Conn] | None = None


class ProgressEvent(_Identity, tag="progress"):
    """Periodic heartbeat of one rank on one communicator."""

    started: NonNeg
    completed: NonNeg
    inflight_op: str | None = None
    inflight_us: NonNegFloat | None = None
    conns: list[Conn] | None = None


Event = OpEvent | ProgressEvent

_decoder = msgspec.json.Decoder(Event | list[Event])
_encoder = msgspec.json.Encoder()


def decode_message(data: bytes | str) -> list[Event]:
    """Decode one message (a single event or an array of events) into a list.

    Raises :class:`EventDecodeError` naming the offending field, e.g.
    ``Expected `int` >= 0, got -1 - at `$[3].seq```.
    """
    try:
        out = _decoder.decode(data)
    except msgspec.DecodeError as err:  # ValidationError is a subclass
        raise EventDecodeError(str(err)) from None
    return out if isinstance(out, list) else [out]


def encode_message(events: Event | list[Event]) -> bytes:
    """Encode one event, or a batch of events as a JSON array."""
    return _encoder.encode(events)
