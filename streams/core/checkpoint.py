"""Checkpoints of the detection core as versioned bytes with an explicit schema.

A checkpoint is read back from a Kafka changelog topic, so whoever can write that topic
controls its bytes: nothing here may run code. The format is msgpack (msgspec) of
typed structs, behind a magic prefix and a ``(kind, schema)`` header::

    b"C4CK" + msgpack([kind, schema, body])

- ``kind`` says what it is ("comm", "correlator", or a detector's name); a checkpoint
  of another kind is refused.
- ``schema`` is the body's version. An older body is lifted to the current schema by
  the migrations registered for its kind (one function per step, on plain msgpack
  data), then converted to the current struct; a newer or unknown one is refused.
- numpy arrays travel as (dtype, shape, raw bytes) with a short list of plain numeric
  dtypes; object arrays cannot be expressed.

Anything that is not such a checkpoint (a pickle, truncated bytes, a wrong field) raises
:class:`CheckpointError`, whose message says why: the caller dead-letters the bytes and
starts that state afresh.

>>> import numpy as np
>>> class S(msgspec.Struct):
...     a: Array
>>> data = encode("demo", 1, S(a=pack(np.arange(3, dtype=np.int16))))
>>> data[:4], unpack(decode(data, "demo", {1: S}).a).tolist()
(b'C4CK', [0, 1, 2])
>>> import pickle
>>> try:
...     decode(pickle.dumps({"x": 1}), "demo", {1: S})
... except CheckpointError as err:
...     print(err)
not a c4stream checkpoint (no C4CK header; e.g. a pickle from an older worker)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np

__all__ = ["Array", "CheckpointError", "MAGIC", "decode", "encode", "pack", "unpack"]

MAGIC = b"C4CK"
_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "float32", "float64"})
_MAX_ELEMENTS = 1 << 26  # far above any communicator; a forged shape cannot exhaust memory

Migration = Callable[[Any], Any]
"""Lifts a body (plain msgpack data) from schema n to n + 1."""


class CheckpointError(ValueError):
    """Bytes that are not a checkpoint this worker can read; the state starts afresh.

    What to do: nothing, usually (the communicator re-learns within its warm-up). Many
    of them at once mean a foreign writer on the checkpoint topic: find it."""


class Array(msgspec.Struct, array_like=True, frozen=True):
    """A numpy array as plain data."""

    dtype: str
    shape: list[int]
    data: bytes


_NAMES = {np.dtype(name): name for name in _DTYPES}
"""dtype -> its name (``dtype.name`` is computed in Python on each read: ~20 µs a
communicator's checkpoint, most of an eviction's cost)."""


def pack(a: np.ndarray) -> Array:
    a = np.ascontiguousarray(a)
    name = _NAMES.get(a.dtype)
    if name is None:
        raise TypeError(f"cannot checkpoint an array of {a.dtype}")
    return Array(name, list(a.shape), a.tobytes())


def unpack(x: Array) -> np.ndarray:
    """The array back (a writable copy); :class:`CheckpointError` when it does not add up."""
    if x.dtype not in _DTYPES:
        raise CheckpointError(f"array of dtype {x.dtype!r} is not allowed in a checkpoint")
    n = 1
    for d in x.shape:
        if d < 0:
            raise CheckpointError(f"array shape {x.shape} is negative")
        n *= d
    dt = np.dtype(x.dtype)
    if n > _MAX_ELEMENTS or n * dt.itemsize != len(x.data):
        raise CheckpointError(f"array of shape {x.shape} does not match its {len(x.data)} bytes")
    return np.frombuffer(x.data, dt).reshape(x.shape).copy()


class _Envelope(msgspec.Struct, array_like=True):
    kind: str
    schema: int
    body: msgspec.Raw


_encoder = msgspec.msgpack.Encoder()
_env_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode(kind: str, schema: int, body: msgspec.Struct) -> bytes:
    return MAGIC + _encoder.encode(_Envelope(kind, schema, msgspec.Raw(_encoder.encode(body))))


def decode(
    data: bytes,
    kind: str,
    schemas: Mapping[int, type],
    migrations: Mapping[int, Migration] | None = None,
) -> Any:
    """The body of a ``kind`` checkpoint as the current schema's struct.

    ``schemas`` maps the current schema number to its struct (only the newest is
    needed); ``migrations[n]`` lifts schema n to n + 1."""
    if not data.startswith(MAGIC):
        raise CheckpointError(
            f"not a c4stream checkpoint (no {MAGIC.decode()} header; "
            "e.g. a pickle from an older worker)"
        )
    try:
        env = _env_decoder.decode(data[len(MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise CheckpointError(f"corrupt checkpoint header: {err}") from None
    if env.kind != kind:
        raise CheckpointError(f"a {env.kind!r} checkpoint where a {kind!r} one was expected")
    current = max(schemas)
    schema = env.schema
    if schema > current:
        raise CheckpointError(
            f"{kind} checkpoint schema {schema} is newer than this worker's ({current})"
        )
    try:
        if schema == current:
            return msgspec.msgpack.decode(env.body, type=schemas[current])
        body = msgspec.msgpack.decode(env.body)
        for step in range(schema, current):
            if migrations is None or step not in migrations:
                raise CheckpointError(f"no migration of {kind} checkpoints from schema {step}")
            body = migrations[step](body)
        return msgspec.convert(body, schemas[current])
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise CheckpointError(f"corrupt {kind} checkpoint (schema {schema}): {err}") from None
