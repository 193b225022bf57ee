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


class CommandDecodeError(ValueError):
    """A message on ``c4.isolations`` is not a valid isolation command (dead-letter it)."""


class IsolationCommand(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One decision to take a component out of service."""

    v: Literal[1] = 1
    kind: Literal["isolate"] = "isolate"
    id: str
    """Stable idempotency key: the same fault decided twice gives the same id."""
    ts_us: int
    """Event time of the decision (in a replay: trace time when the evidence was complete)."""
    job: str
    host: str
    fault: Fault
    action: Action
    confidence: Annotated[float, msgspec.Meta(ge=0, le=1)]
    reason: str
    evidence: dict[str, Any]
    gpu: int | None = None
    nic: str | None = None
    peer_host: str | None = None
    dry_run: bool | None = None


# omit_defaults would drop ``v`` and ``kind``, which the contract requires on the wire,
# so encode through a dict that always carries them.
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(IsolationCommand)


def encode_command(cmd: IsolationCommand) -> bytes:
    d = msgspec.structs.asdict(cmd)
    out = {k: v for k, v in d.items() if v is not None}
    return _encoder.encode(out)


def decode_command(data: bytes | str) -> IsolationCommand:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as err:
        raise CommandDecodeError(str(err)) from None
