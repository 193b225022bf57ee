"""Message authentication on the wire: who wrote an event batch or a command.

Kafka does not tell a consumer which principal produced a message, so the message
carries it: an HMAC-SHA256 over the message's bytes in a header, with a key only its
rightful writer holds. One operator *master* secret derives every key (a key file holds
64 hex digits, 32 bytes, readable by its owner only):

* each exporter host's key = HMAC(master, ``c4stream/exporter/<host>``): a host holds
  only its own key, so it can sign for itself and nobody else;
* the commands key = HMAC(master, ``c4stream/commands``): the worker signs the isolation
  commands it decides, the actuator (which holds only this key) checks them.

An events message carries headers ``c4-host`` (the host that signed it) and ``c4-sig``
(``v1=`` + hex HMAC over :func:`event_bytes`: the host, the content type and the value,
each length-prefixed, so no field can bleed into another). The topic, key and offset are
not signed: a message may be replayed into another topic by an operator, and a re-sent
message repeats itself exactly (the worker's corroboration tells a repeat from a
contradiction).

>>> master = bytes(range(32))
>>> k = host_key(master, "node-001")
>>> sig = sign(k, event_bytes(b"[]", "node-001", None))
>>> verify([k], event_bytes(b"[]", "node-001", None), sig)
True
>>> verify([k], event_bytes(b"[ ]", "node-001", None), sig)  # one byte changed
False
>>> verify([host_key(master, "node-002")], event_bytes(b"[]", "node-002", None), sig)
False
>>> host_key(master, "--all")
Traceback (most recent call last):
...
c4base.signing.SigningError: host name '--all' is not an RFC 1123 name: no key for it
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = [
    "COMMANDS_CONTEXT",
    "FRESH_HEADER",
    "HOST_HEADER",
    "KEY_BYTES",
    "SIG_HEADER",
    "KeyFileError",
    "Sequencer",
    "SigningError",
    "command_bytes",
    "command_refusal",
    "commands_key",
    "event_bytes",
    "SNAPSHOT_HEADER",
    "fresh_value",
    "parse_fresh",
    "signed_event_headers",
    "generate_key_file",
    "header",
    "host_key",
    "load_key",
    "load_keys",
    "sign",
    "verify",
    "write_key_file",
]

HOST_HEADER = "c4-host"
SIG_HEADER = "c4-sig"
FRESH_HEADER = "c4-fresh"
SNAPSHOT_HEADER = "c4-fr-snapshot"
"""Header of a Flight Recorder snapshot's message (its id, part and the dumps' facts):
inside the signature when present, since the worker judges the snapshot by it."""
"""Optional header of a signed events message: ``<seq>.<ts_us>``, the signing host's
message sequence number and its wall time when it signed, both inside the signature
(a captured message re-sent later repeats its seq and its age shows)."""
KEY_BYTES = 32
"""A key is 32 bytes (SHA-256's block of entropy); shorter key files are refused."""
EXPORTER_CONTEXT = b"c4stream/exporter/"
COMMANDS_CONTEXT = b"c4stream/commands"
_VERSION = b"v1="
_EVENTS_DOMAIN = b"c4stream/events/v1"
_FRESH_DOMAIN = b"c4stream/events/v2"
_SNAPSHOT_DOMAIN = b"c4stream/events/v3"
_COMMANDS_DOMAIN = b"c4stream/commands/v1"
_LEN = struct.Struct("!I")
# Same rule as producers.guard.HOST_PATTERN (the floor cannot import producers): a key
# is derived only for a host name a backend could safely act on.
_HOST_RE = re.compile(
    r"^(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z"
)


class SigningError(ValueError):
    """A key cannot be derived or a signature cannot be made (bad host name)."""


class KeyFileError(SigningError):
    """A key file is missing, too short, not hex, or readable by others: fix the file
    (``c4stream keys generate`` / ``keys derive`` write correct ones, mode 0600)."""


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def host_key(master: bytes, host: str) -> bytes:
    """The exporter key of ``host`` (what ``c4stream keys derive --host`` writes)."""
    if not _HOST_RE.fullmatch(host):
        raise SigningError(f"host name {host[:80]!r} is not an RFC 1123 name: no key for it")
    return _mac(master, EXPORTER_CONTEXT + host.encode())


def commands_key(master: bytes) -> bytes:
    """The key the worker signs isolation commands with and the actuator checks."""
    return _mac(master, COMMANDS_CONTEXT)


def _framed(*parts: bytes) -> bytes:
    return b"".join(_LEN.pack(len(p)) + p for p in parts)


def event_bytes(
    value: bytes,
    host: str,
    content_type: bytes | str | None,
    fresh: bytes | None = None,
    snapshot: bytes | None = None,
) -> bytes:
    """What an events message's signature covers: domain, host, content type, value, and
    the ``c4-fresh`` header when the message has one (another domain: a v1 signature,
    without it, stays valid, and a fresh header cannot be added to or taken off a
    signed message); a ``c4-fr-snapshot`` header too (a third domain), so a snapshot's
    facts cannot be changed or put on a stream message."""
    ct = content_type.encode() if isinstance(content_type, str) else (content_type or b"")
    if snapshot is not None:
        return _framed(_SNAPSHOT_DOMAIN, host.encode(), ct, fresh or b"", snapshot, value)
    if fresh is None:
        return _framed(_EVENTS_DOMAIN, host.encode(), ct, value)
    return _framed(_FRESH_DOMAIN, host.encode(), ct, fresh, value)


def fresh_value(seq: int, ts_us: int) -> bytes:
    """The ``c4-fresh`` header value.

    >>> fresh_value(17, 1_750_000_000_000_000), parse_fresh(b"17.1750000000000000")
    (b'17.1750000000000000', (17, 1750000000000000))
    >>> parse_fresh(b"17") is None, parse_fresh(b"-1.5") is None, parse_fresh(b"1." + b"9" * 30)
    (True, True, None)
    """
    return f"{seq}.{ts_us}".encode()


def parse_fresh(raw: bytes | None) -> tuple[int, int] | None:
    """(seq, ts_us) of a ``c4-fresh`` header, or None when absent or malformed."""
    if raw is None or len(raw) > 41:  # two int64 and a dot
        return None
    seq, dot, ts = raw.partition(b".")
    if not dot or not seq.isdigit() or not ts.isdigit():
        return None
    s, t = int(seq), int(ts)
    return (s, t) if s < 2**63 and t < 2**63 else None


def signed_event_headers(
    key: bytes,
    host: str,
    value: bytes,
    headers: Sequence[tuple[str, bytes]] | None = None,
    fresh: tuple[int, int] | None = None,
) -> list[tuple[str, bytes]]:
    """``headers`` (e.g. an Arrow batch's ``content-type``) plus ``c4-host`` and ``c4-sig``
    (and ``c4-fresh`` when ``fresh`` = (seq, ts_us) is given: inside the signature).

    >>> hs = signed_event_headers(bytes(32), "n1", b"[]")
    >>> [k for k, _ in hs], verify([bytes(32)], event_bytes(b"[]", "n1", None), hs[1][1])
    (['c4-host', 'c4-sig'], True)
    >>> hs = signed_event_headers(bytes(32), "n1", b"[]", fresh=(5, 9))
    >>> [k for k, _ in hs], verify([bytes(32)], event_bytes(b"[]", "n1", None, b"5.9"), hs[2][1])
    (['c4-host', 'c4-fresh', 'c4-sig'], True)
    """
    drop = (HOST_HEADER, SIG_HEADER, FRESH_HEADER)
    out = [(k, v) for k, v in headers or () if k not in drop]
    ct = header(out, "content-type")
    fv = fresh_value(*fresh) if fresh is not None else None
    sig = sign(key, event_bytes(value, host, ct, fv, header(out, SNAPSHOT_HEADER)))
    mine = [(HOST_HEADER, host.encode())] + ([(FRESH_HEADER, fv)] if fv is not None else [])
    return [*out, *mine, (SIG_HEADER, sig)]


class Sequencer:
    """A host's message sequence numbers for ``c4-fresh``: they start at the wall clock's
    microseconds when the process starts and grow by one per message, so they keep
    growing across restarts (unless a host sends more than a million messages a second)
    with no state on disk.

    >>> s = Sequencer(clock=lambda: 10.0)
    >>> s.next(), s.next()
    ((10000000, 10000000), (10000001, 10000000))
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        import time

        self._clock = clock or time.time
        self._seq = int(self._clock() * 1e6)

    def next(self) -> tuple[int, int]:
        """(seq, ts_us) for the next message."""
        seq = self._seq
        self._seq += 1
        return seq, int(self._clock() * 1e6)


def command_bytes(value: bytes) -> bytes:
    """What an isolation command's signature covers."""
    return _framed(_COMMANDS_DOMAIN, value)


def command_refusal(keys: Sequence[bytes], value: bytes, signature: bytes | None) -> str | None:
    """Why an isolation command's ``c4-sig`` is not acceptable under the commands
    key(s), or None.

    >>> k = commands_key(bytes(32))
    >>> command_refusal([k], b"{}", sign(k, command_bytes(b"{}"))) is None
    True
    >>> command_refusal([k], b"{}", None)
    'unsigned command: no c4-sig header (require_signed_commands is on)'
    """
    if signature is None:
        return "unsigned command: no c4-sig header (require_signed_commands is on)"
    if not verify(keys, command_bytes(value), signature):
        return "bad signature: not signed with the commands key (forged or tampered)"
    return None


def sign(key: bytes, data: bytes) -> bytes:
    """The ``c4-sig`` header value: ``v1=`` and the hex HMAC-SHA256 of ``data``."""
    return _VERSION + _mac(key, data).hex().encode()


def verify(keys: Sequence[bytes], data: bytes, signature: bytes | None) -> bool:
    """Whether ``signature`` is a valid ``c4-sig`` of ``data`` under one of ``keys``
    (several during a key rotation). Constant-time comparison."""
    if not signature or not signature.startswith(_VERSION):
        return False
    given = signature[len(_VERSION) :]
    ok = False
    for key in keys:  # every key is tried: the time does not tell which one matched
        ok |= hmac.compare_digest(_mac(key, data).hex().encode(), given)
    return ok


def header(headers: Iterable[tuple[str, bytes | None]] | None, name: str) -> bytes | None:
    """The first value of header ``name`` (None when absent).

    >>> header([("c4-host", b"n1"), ("c4-sig", b"v1=00")], SIG_HEADER)
    b'v1=00'
    """
    for k, v in headers or ():
        if k == name:
            return v
    return None


# ------------------------------------------------------------------ key files


def load_key(path: str | Path) -> bytes:
    """The key in ``path``: 64 (or more) hex digits, the file readable by its owner only.

    Raises :class:`KeyFileError` saying what to fix; the key itself is never in a message.
    """
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_bytes()
    except FileNotFoundError:
        raise KeyFileError(f"key file {p} does not exist") from None
    except OSError as err:
        raise KeyFileError(f"key file {p} cannot be read: {err.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"key file {p} is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"key file {p} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o});"
            f" chmod 600 {p} (Kubernetes: defaultMode 0400 on the Secret volume)"
        )
    digits = text.strip()
    try:
        key = bytes.fromhex(digits.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError(f"key file {p} does not hold hex digits") from None
    if len(key) < KEY_BYTES:
        raise KeyFileError(
            f"key file {p} holds {len(key)} bytes, at least {KEY_BYTES} are needed "
            "(c4stream keys generate)"
        )
    return key


def load_keys(paths: Sequence[str | Path]) -> list[bytes]:
    """Every key of ``paths`` (the first signs, all verify: a rotation keeps the old one)."""
    return [load_key(p) for p in paths]


def write_key_file(path: str | Path, key: bytes) -> Path:
    """Write ``key`` as hex to a new file of mode 0600 (never over an existing file)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{p} already exists; not overwritten") from None
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return p


def generate_key_file(path: str | Path) -> Path:
    """A new random master key in ``path`` (mode 0600)."""
    return write_key_file(path, secrets.token_bytes(KEY_BYTES))
