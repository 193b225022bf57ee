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

from producers.guard import (
    MAX_DEPTH,
    MAX_FUTURE_SKEW_US,
    MAX_MESSAGE_BYTES,
    MAX_NRANKS,
    BoundsError,
    Host,
    check_bounds,
)

__all__ = [
    "Conn",
    "Event",
    "EventDecodeError",
    "OpEvent",
    "ProgressEvent",
    "decode_message",
    "edge_problem",
    "encode_message",
]

# Every number is bounded: the core keeps counters in int64 numpy arrays (ts_us = 10^30
# used to overflow them for good) and durations as finite floats (JSON has no inf/NaN;
# 1e999 is refused by the decoder, 1e300 by these bounds).
I64_MAX = 2**63 - 1
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=I64_MAX)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0, le=1e15)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Short = Annotated[str, msgspec.Meta(max_length=256)]
#: Hard ceiling of the contract; the worker's configurable ``max_nranks`` is lower.
NRANKS_CEILING = 1 << 20


class EventDecodeError(ValueError):
    """A message does not hold contract events.

    The message is not lost: callers send it to the dead-letter topic with ``str(err)``
    as the reason and go on with the next message.
    """


# gc=False: events are acyclic value records, so the garbage collector need not track
# them; a batch of decoded events then costs no collector passes (msgspec decodes a
# trace's lines about 25% faster).
class Conn(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Traffic of one rank with one peer rank (cumulative so far, in progress events)."""

    peer: NonNeg
    dir: Literal["send", "recv"]
    bytes: NonNeg
    time_us: NonNegFloat | None = None
    retrans: NonNeg | None = None


class _Identity(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="kind", gc=False):
    v: Literal[1]
    job: NonEmpty
    comm: NonEmpty
    nranks: Annotated[int, msgspec.Meta(ge=1, le=NRANKS_CEILING)]
    rank: NonNeg
    host: Host
    ts_us: NonNeg
    comm_name: Short | None = None
    gpu: NonNeg | None = None
    nic: Short | None = None


class OpEvent(_Identity, tag="op", gc=False):
    """One collective (or p2p op) completed on one rank."""

    op: Short
    seq: NonNeg
    bytes: NonNeg
    exec_us: NonNegFloat
    algbw_gbs: NonNegFloat | None = None
    busbw_gbs: NonNegFloat | None = None
    algo: Short | None = None
    proto: Short | None = None
    conns: list[Conn] | None = None


class ProgressEvent(_Identity, tag="progress", gc=False):
    """Periodic heartbeat of one rank on one communicator."""

    started: NonNeg
    completed: NonNeg
    inflight_op: Short | None = None
    inflight_us: NonNegFloat | None = None
    conns: list[Conn] | None = None


Event = OpEvent | ProgressEvent

_decoder = msgspec.json.Decoder(Event | list[Event])
_encoder = msgspec.json.Encoder()


def decode_message(
    data: bytes | str, *, max_bytes: int = MAX_MESSAGE_BYTES, max_depth: int = MAX_DEPTH
) -> list[Event]:
    """Decode one message (a single event or an array of events) into a list.

    Raises :class:`EventDecodeError` naming the offending field, e.g.
    ``Expected `int` >= 0, got -1 - at `$[3].seq```, or the bound a message breaks
    (size, nesting: :func:`producers.guard.check_bounds`). Nothing else escapes.

    >>> decode_message(b'[' * 5000)
    Traceback (most recent call last):
    ...
    producers.events.EventDecodeError: JSON nested deeper than 32 levels
    """
    try:
        check_bounds(data, max_bytes=max_bytes, max_depth=max_depth)
        out = _decoder.decode(data)
    except (msgspec.DecodeError, BoundsError) as err:  # ValidationError is a subclass
        raise EventDecodeError(str(err)) from None
    except Exception as err:  # RecursionError, MemoryError: never past the edge
        raise EventDecodeError(f"undecodable: {type(err).__name__}: {err}") from None
    return out if isinstance(out, list) else [out]


def encode_message(events: Event | list[Event]) -> bytes:
    """Encode one event, or a batch of events as a JSON array."""
    return _encoder.encode(events)


def edge_problem(
    ev: Event,
    *,
    now_us: int,
    max_nranks: int = MAX_NRANKS,
    max_future_skew_us: int = MAX_FUTURE_SKEW_US,
    max_past_skew_us: int = 0,
    encoded: bytes | None = None,
) -> str | None:
    """Why an event built from a local record (not decoded from the wire, so msgspec
    has not checked it) may not be published, or None.

    The same limits as the worker's edge: the contract's own bounds (finite
    non-negative numbers, RFC 1123 host, lengths: checked by a round trip through the
    decoder, so there is one definition), ``nranks`` at most ``max_nranks``, ``rank``
    and every ``peer`` below ``nranks``, ``ts_us`` at most ``max_future_skew_us`` ahead
    of ``now_us`` and, when ``max_past_skew_us`` > 0, at most that far behind.
    ``encoded``: the event's JSON when the caller has it already (saves an encode).

    >>> ev = OpEvent(v=1, job="j", comm="0xa", nranks=2, rank=0, host="h", ts_us=10,
    ...              op="AllReduce", seq=1, bytes=8, exec_us=1.0)
    >>> edge_problem(ev, now_us=10) is None
    True
    >>> edge_problem(msgspec.structs.replace(ev, exec_us=float("nan")), now_us=10)
    'breaks the contract: Expected `float`, got `null` - at `$.exec_us`'
    >>> edge_problem(msgspec.structs.replace(ev, rank=2), now_us=10)
    'rank 2 is not below nranks 2'
    >>> edge_problem(ev, now_us=20_000_010, max_past_skew_us=5_000_000)
    'ts_us 10 is 20s behind the wall clock (allowed: 5s)'
    """
    try:
        _decoder.decode(encoded if encoded is not None else _encoder.encode(ev))
    except msgspec.DecodeError as err:
        return f"breaks the contract: {err}"
    except Exception as err:  # e.g. an int too large to encode
        return f"breaks the contract: {type(err).__name__}: {err}"
    if ev.nranks > max_nranks:
        return f"nranks {ev.nranks} is over the limit of {max_nranks}"
    if ev.rank >= ev.nranks:
        return f"rank {ev.rank} is not below nranks {ev.nranks}"
    for c in ev.conns or ():
        if c.peer >= ev.nranks:
            return f"peer {c.peer} is not below nranks {ev.nranks}"
    if ev.ts_us > now_us + max_future_skew_us:
        return (
            f"ts_us {ev.ts_us} is {(ev.ts_us - now_us) / 1e6:.0f}s ahead of the wall clock "
            f"(allowed: {max_future_skew_us / 1e6:.0f}s)"
        )
    if max_past_skew_us > 0 and ev.ts_us < now_us - max_past_skew_us:
        return (
            f"ts_us {ev.ts_us} is {(now_us - ev.ts_us) / 1e6:.0f}s behind the wall clock "
            f"(allowed: {max_past_skew_us / 1e6:.0f}s)"
        )
    return None
