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

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache

from c4base.signing import (
    SIG_HEADER,
    SigningError,
    command_bytes,
    commands_key,
    event_bytes,
    host_key,
    parse_fresh,
    sign,
    verify,
)
from streams.app.deadletter import Record

__all__ = ["CommandSigner", "EventTrust", "Freshness", "signature_refusal"]

#: Sequence numbers remembered per host (older ones are refused by their time).
MAX_SEQS_PER_HOST = 4096
#: Hosts whose sequence numbers are remembered (the least recently heard is forgotten).
MAX_FRESH_HOSTS = 65_536


class Freshness:
    """Per signing host: the sequence numbers and times of its accepted messages
    (header ``c4-fresh``, inside the signature), so that a captured message re-sent
    later is refused before it reaches corroboration.

    A message is refused when its seq was already accepted (a replay: the signature
    makes seq and content one), when it is older than the host's newest message by
    more than ``window_us`` (stale: its seq may be forgotten), older than the wall clock
    by more than ``max_age_us``, or ahead of the wall clock by more than ``ahead_us``.
    Messages of one host reach the worker out of order (they go to the partitions of
    their communicators), hence a window rather than "seq must grow".

    >>> f = Freshness(window_us=60_000_000, max_age_us=3_600_000_000, ahead_us=600_000_000,
    ...               epoch=lambda: 1000.0)
    >>> f.refusal("n1", 5, 999_000_000), f.refusal("n1", 4, 999_500_000)
    (None, None)
    >>> f.refusal("n1", 5, 999_000_000)
    'replayed: n1 already sent message seq 5'
    >>> f.refusal("n1", 9, 900_000_000)
    'stale: n1 signed this message 100 s before its newest (window 60 s)'
    """

    def __init__(
        self,
        *,
        window_us: int,
        max_age_us: int,
        ahead_us: int,
        epoch: Callable[[], float] = time.time,
    ) -> None:
        self.window_us, self.max_age_us, self.ahead_us = window_us, max_age_us, ahead_us
        self.epoch = epoch
        self._hosts: dict[str, tuple[set[int], deque[tuple[int, int]], list[int]]] = {}
        """host -> (seqs accepted, (ts, seq) in arrival order, [newest ts, floor ts])."""

    def refusal(self, host: str, seq: int, ts_us: int) -> str | None:
        """Why (seq, ts_us) of ``host`` is not fresh, or None (then it is remembered)."""
        now = int(self.epoch() * 1e6)
        if ts_us > now + self.ahead_us:
            ahead = (ts_us - now) / 1e6
            return f"stale: {host[:80]} signed this message {ahead:.0f} s ahead of the wall clock"
        if ts_us < now - self.max_age_us:
            return f"stale: {host[:80]} signed this message {(now - ts_us) / 1e6:.0f} s ago"
        st = self._hosts.pop(host, None)  # re-inserted last: the dict is an LRU
        if st is None:
            st = (set(), deque(), [ts_us, -1])
        self._hosts[host] = st
        if len(self._hosts) > MAX_FRESH_HOSTS:
            del self._hosts[next(iter(self._hosts))]
        seqs, order, times = st
        if seq in seqs:
            return f"replayed: {host[:80]} already sent message seq {seq}"
        newest, floor = times
        if ts_us < newest - self.window_us or ts_us <= floor:
            return (
                f"stale: {host[:80]} signed this message {(newest - ts_us) / 1e6:.0f} s "
                f"before its newest (window {self.window_us / 1e6:.0f} s)"
            )
        seqs.add(seq)
        order.append((ts_us, seq))
        times[0] = max(newest, ts_us)
        while order and order[0][0] < times[0] - self.window_us:  # the time rule covers them
            seqs.discard(order.popleft()[1])
        while len(order) > MAX_SEQS_PER_HOST:  # forgotten early: refused by their time
            t, q = order.popleft()
            seqs.discard(q)
            times[1] = max(times[1], t)
        return None


class EventTrust:
    """Verifies events messages against per-host keys derived from the master key(s)
    (several during a rotation: docs/security.md)."""

    def __init__(
        self,
        masters: Sequence[bytes],
        freshness: Freshness | None = None,
        require_fresh: bool = False,
    ) -> None:
        if not masters:
            raise ValueError("require_signed_events needs master_key_files")
        self._masters = tuple(masters)
        self.freshness = freshness
        """Refuses replayed and stale signed messages (``c4-fresh``); None: not checked."""
        self.require_fresh = require_fresh
        """A signed message without ``c4-fresh`` is refused (old exporters: set false)."""
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
        fresh: bytes | None = None,
    ) -> str | None:
        """Why a message's signature is not acceptable (before decoding), or None; a
        replayed or stale message (header ``c4-fresh``) is not either."""
        if signer is None or signature is None:
            return "unsigned message: no c4-host/c4-sig headers (require_signed_events is on)"
        host = signer.decode("utf-8", "replace")
        try:
            keys = self._keys(host)
        except SigningError as err:
            return f"bad signature: header c4-host: {err}"
        if not verify(keys, event_bytes(value, host, content_type, fresh), signature):
            return f"bad signature: not signed by the key of {host[:80]} (tampered, or another key)"
        if fresh is None:
            if self.require_fresh:
                return (
                    "no c4-fresh header: signed messages must carry the host's sequence "
                    "number and time ([worker] require_fresh_events)"
                )
            return None
        got = parse_fresh(fresh)
        if got is None:
            return "bad c4-fresh header: not <seq>.<ts_us>"
        return self.freshness.refusal(host, *got) if self.freshness is not None else None

    def of(self, rec: Record) -> str | None:
        """:meth:`refusal` of a worker :class:`~streams.app.deadletter.Record`."""
        return self.refusal(rec.value, rec.content_type, rec.signer, rec.signature, rec.fresh)

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
