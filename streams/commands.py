"""The isolation-command contract, version 1 (``shared/contracts/isolation-command``).

>>> cmd = IsolationCommand(id="c4-1", ts_us=1, job="j", host="h3", fault="straggler",
...                        action="alert_only", confidence=0.9,
...                        reason="h3 GPU 2 arrives last.", evidence={"comms": ["0xa"]})
>>> decode_command(encode_command(cmd)) == cmd
True
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from producers.guard import MAX_DEPTH, BoundsError, Host, check_bounds

__all__ = [
    "Action",
    "CommandDecodeError",
    "Fault",
    "IsolationCommand",
    "decode_command",
    "encode_command",
]

Fault = Literal["noncomm_hang", "comm_hang", "straggler", "slow_link", "slow_nic"]
Action = Literal["cordon", "cordon_and_taint", "restart_job", "alert_only"]


#: A command is small (its evidence a few KB); anything near this is not one.
MAX_COMMAND_BYTES = 256 * 1024
_Str = Annotated[str, msgspec.Meta(max_length=4096)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class CommandDecodeError(ValueError):
    """A message on ``c4.isolations`` is not a valid isolation command (dead-letter it)."""


class IsolationCommand(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One decision to take a component out of service."""

    v: Literal[1] = 1
    kind: Literal["isolate"] = "isolate"
    id: _Id
    """Stable idempotency key: the same fault decided twice gives the same id."""
    ts_us: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    """Event time of the decision (in a replay: trace time when the evidence was complete)."""
    job: _Id
    host: Host
    """An RFC 1123 host name: checked here, before any backend sees it."""
    fault: Fault
    action: Action
    confidence: Annotated[float, msgspec.Meta(ge=0, le=1)]
    reason: _Str
    evidence: dict[str, Any]
    gpu: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None
    nic: _Id | None = None
    peer_host: Host | None = None
    dry_run: bool | None = None
    """Absent means dry run: only an explicit ``false`` lets an actuator act."""


# omit_defaults would drop ``v`` and ``kind``, which the contract requires on the wire,
# so encode through a dict that always carries them.
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(IsolationCommand)


def encode_command(cmd: IsolationCommand) -> bytes:
    d = msgspec.structs.asdict(cmd)
    out = {k: v for k, v in d.items() if v is not None}
    return _encoder.encode(out)


def decode_command(data: bytes | str) -> IsolationCommand:
    """Decode one command; every failure (size, nesting, types, host name) is a
    :class:`CommandDecodeError` naming it.

    >>> decode_command(b'{"evidence":' + b'[' * 3000 + b']' * 3000 + b'}')
    Traceback (most recent call last):
    ...
    streams.commands.CommandDecodeError: JSON nested deeper than 32 levels
    """
    try:
        check_bounds(data, max_bytes=MAX_COMMAND_BYTES, max_depth=MAX_DEPTH)
        return _decoder.decode(data)
    except (msgspec.DecodeError, BoundsError) as err:
        raise CommandDecodeError(str(err)) from None
    except Exception as err:  # RecursionError, MemoryError: never past the edge
        raise CommandDecodeError(f"undecodable: {type(err).__name__}: {err}") from None
