"""Who wrote a message: the worker's checks of signed events, and its signature on the
commands it decides (docs/security.md, "Signed messages").

:class:`EventTrust` is called by the decode step of
:class:`~streams.app.detect_runner.CommRouter` when ``[worker] require_signed_events``
is on: before decoding, a message must carry ``c4-host`` and a valid ``c4-sig`` under
that host's key (derived from the master key, so the worker holds no per-host list);
after decoding, every event must report the host that signed it. A compromised host
can sign, but only for itself.

>>> from c4base.signing import host_key, signed_event_headers
>>> master = bytes(32)
>>> trust = EventTrust([master])
>>> hs = signed_event_headers(host_key(master, "node-1"), "node-1", b"[]")
>>> trust.refusal(b"[]", None, dict(hs)["c4-host"], dict(hs)["c4-sig"]) is None
True
>>> trust.refusal(b"[ ]", None, dict(hs)["c4-host"], dict(hs)["c4-sig"])
'bad signature: not signed by the key of node-1 (tampered, or another key)'
>>> trust.refusal(b"[]", None, None, None)
'unsigned message: no c4-host/c4-sig headers (require_signed_events is on)'
>>> trust.host_refusal(b"node-1", ["node-1", "node-2"])
'event host node-2 in a message signed by node-1'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

from c4base.signing import (
    SIG_HEADER,
    SigningError,
    command_bytes,
    commands_key,
    event_bytes,
    host_key,
    sign,
    verify,
)
from streams.app.deadletter import Record

__all__ = ["CommandSigner", "EventTrust", "signature_refusal"]


class EventTrust:
    """Verifies events messages against per-host keys derived from the master key(s)
    (several during a rotation: docs/security.md)."""

    def __init__(self, masters: Sequence[bytes]) -> None:
        if not masters:
            raise ValueError("require_signed_events needs master_key_files")
        self._masters = tuple(masters)
        # Derivation is two HMACs per master; hosts are few (thousands), messages many.
        self._keys = lru_cache(maxsize=65_536)(self._derive)

    def _derive(self, host: str) -> tuple[bytes, ...]:
        return tuple(host_key(m, host) for m in self._masters)

    def refusal(
        self,
        value: bytes,
        content_type: bytes | None,
        signer: bytes | None,
        signature: bytes | None,
    ) -> str | None:
        """Why a message's signature is not acceptable (before decoding), or None."""
        if signer is None or signature is None:
            return "unsigned message: no c4-host/c4-sig headers (require_signed_events is on)"
        host = signer.decode("utf-8", "replace")
        try:
            keys = self._keys(host)
        except SigningError as err:
            return f"bad signature: header c4-host: {err}"
        if not verify(keys, event_bytes(value, host, content_type), signature):
            return f"bad signature: not signed by the key of {host[:80]} (tampered, or another key)"
        return None

    def of(self, rec: Record) -> str | None:
        """:meth:`refusal` of a worker :class:`~streams.app.deadletter.Record`."""
        return self.refusal(rec.value, rec.content_type, rec.signer, rec.signature)

    @staticmethod
    def host_refusal(signer: bytes | None, hosts: Iterable[str]) -> str | None:
        """Why the decoded events do not match their signer (one host per message)."""
        want = (signer or b"").decode("utf-8", "replace")
        for h in hosts:
            if h != want:
                return f"event host {h[:80]} in a message signed by {want[:80]}"
        return None


def signature_refusal(
    trust: EventTrust | None, rec: Record, hosts: Iterable[str] | None = None
) -> str | None:
    """The decode step's one call: before decoding (``hosts`` None) the signature, after
    decoding the events' hosts against the signer; None when signing is not required.
    The reason is the dead letter's, prefixed ``refused:``."""
    if trust is None:
        return None
    why = trust.of(rec) if hosts is None else trust.host_refusal(rec.signer, hosts)
    return None if why is None else f"refused: {why}"


class CommandSigner:
    """Signs the isolation commands the worker produces (header ``c4-sig``) with the
    commands key, derived from the first master key."""

    def __init__(self, master: bytes) -> None:
        self._key = commands_key(master)

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        return [(SIG_HEADER, sign(self._key, command_bytes(value)))]
