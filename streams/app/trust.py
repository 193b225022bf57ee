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

import msgspec

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
from streams.core import checkpoint as ck
from streams.verdicts import Verdict

__all__ = ["CommandSigner", "EventTrust", "Freshness", "alert_only_unless_trusted",
           "signature_refusal"]  # fmt: skip

#: Sequence numbers remembered per host (older ones are refused by their time).
MAX_SEQS_PER_HOST = 4096
#: Hosts whose sequence numbers are remembered (the least recently heard is forgotten).
MAX_FRESH_HOSTS = 65_536


class _Seqs:
    """One signing host's accepted messages on one partition."""

    __slots__ = ("at", "floor", "newest", "order")

    def __init__(self, newest: int, floor: int = -1) -> None:
        self.at: dict[int, int] = {}
        """seq -> the offset it was accepted at (-1: unknown)."""
        self.order: deque[tuple[int, int]] = deque()
        """(ts, seq) in arrival order."""
        self.newest, self.floor = newest, floor


class _FreshState(msgspec.Struct, array_like=True):
    """A partition's freshness as checkpointed: per host (name, newest ts, floor ts,
    [[ts, seq, offset], ...] in arrival order)."""

    hosts: list[tuple[str, int, int, list[tuple[int, int, int]]]]


_FRESH_SCHEMA = 1


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

    What is remembered is kept per events partition (a replay is keyed like the
    original, so it lands on the same partition) and checkpointed with the partition's
    state (:meth:`state`, :meth:`load`): a worker restarted, or the one a partition
    moves to, still refuses a replay. The same message read again at the offset it was
    accepted at (a redelivery after a restart) is not a replay.

    >>> f = Freshness(window_us=60_000_000, max_age_us=3_600_000_000, ahead_us=600_000_000,
    ...               epoch=lambda: 1000.0)
    >>> f.refusal("n1", 5, 999_000_000), f.refusal("n1", 4, 999_500_000)
    (None, None)
    >>> f.refusal("n1", 5, 999_000_000)
    'replayed: n1 already sent message seq 5'
    >>> f.refusal("n1", 9, 900_000_000)
    'stale: n1 signed this message 100 s before its newest (window 60 s)'
    >>> g = Freshness(window_us=60_000_000, max_age_us=3_600_000_000, ahead_us=600_000_000,
    ...               epoch=lambda: 1000.0)
    >>> g.load(0, f.state(0)); g.refusal("n1", 4, 999_500_000)
    'replayed: n1 already sent message seq 4'
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
        self._hosts: dict[tuple[int, str], _Seqs] = {}
        """(partition, host) -> its accepted messages; least recently heard first."""

    def refusal(
        self, host: str, seq: int, ts_us: int, where: tuple[int, int] = (0, -1)
    ) -> str | None:
        """Why (seq, ts_us) of ``host`` is not fresh, or None (then it is remembered).
        ``where``: the message's (partition, offset)."""
        now = int(self.epoch() * 1e6)
        if ts_us > now + self.ahead_us:
            ahead = (ts_us - now) / 1e6
            return f"stale: {host[:80]} signed this message {ahead:.0f} s ahead of the wall clock"
        if ts_us < now - self.max_age_us:
            return f"stale: {host[:80]} signed this message {(now - ts_us) / 1e6:.0f} s ago"
        part, offset = where
        st = self._hosts.pop((part, host), None)  # re-inserted last: the dict is an LRU
        if st is None:
            st = _Seqs(ts_us)
        self._hosts[(part, host)] = st
        if len(self._hosts) > MAX_FRESH_HOSTS:
            del self._hosts[next(iter(self._hosts))]
        if seq in st.at:
            if offset >= 0 and st.at[seq] == offset:
                return None  # the same record read again (a restart): not a replay
            return f"replayed: {host[:80]} already sent message seq {seq}"
        if ts_us < st.newest - self.window_us or ts_us <= st.floor:
            return (
                f"stale: {host[:80]} signed this message {(st.newest - ts_us) / 1e6:.0f} s "
                f"before its newest (window {self.window_us / 1e6:.0f} s)"
            )
        st.at[seq] = offset
        st.order.append((ts_us, seq))
        st.newest = max(st.newest, ts_us)
        order = st.order
        while order and order[0][0] < st.newest - self.window_us:  # the time rule covers them
            st.at.pop(order.popleft()[1], None)
        while len(order) > MAX_SEQS_PER_HOST:  # forgotten early: refused by their time
            t, q = order.popleft()
            st.at.pop(q, None)
            st.floor = max(st.floor, t)
        return None

    def partitions(self) -> set[int]:
        return {p for p, _ in self._hosts}

    def state(self, partition: int) -> bytes:
        """What ``partition`` remembers, as a checkpoint (versioned msgpack, no pickle)."""
        hosts = [
            (h, st.newest, st.floor, [(t, q, st.at.get(q, -1)) for t, q in st.order])
            for (p, h), st in self._hosts.items()
            if p == partition
        ]
        return ck.encode("freshness", _FRESH_SCHEMA, _FreshState(hosts))

    def load(self, partition: int, data: bytes) -> None:
        """:meth:`state` back; :class:`~streams.core.checkpoint.CheckpointError` for
        anything else."""
        st = ck.decode(data, "freshness", {_FRESH_SCHEMA: _FreshState})
        for host, newest, floor, order in st.hosts[:MAX_FRESH_HOSTS]:
            seqs = _Seqs(newest, floor)
            for t, q, offset in order[-MAX_SEQS_PER_HOST:]:
                seqs.order.append((t, q))
                seqs.at[q] = offset
            self._hosts[(partition, host)] = seqs
        while len(self._hosts) > MAX_FRESH_HOSTS:
            del self._hosts[next(iter(self._hosts))]

    def forget(self, partition: int) -> None:
        for key in [k for k in self._hosts if k[0] == partition]:
            del self._hosts[key]


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
        snapshot: bytes | None = None,
        where: tuple[int, int] = (0, -1),
    ) -> str | None:
        """Why a message's signature is not acceptable (before decoding), or None; a
        replayed or stale message (header ``c4-fresh``) is not either. ``where``: its
        (partition, offset)."""
        if signer is None or signature is None:
            return "unsigned message: no c4-host/c4-sig headers (require_signed_events is on)"
        host = signer.decode("utf-8", "replace")
        try:
            keys = self._keys(host)
        except SigningError as err:
            return f"bad signature: header c4-host: {err}"
        if not verify(keys, event_bytes(value, host, content_type, fresh, snapshot), signature):
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
        return self.freshness.refusal(host, *got, where) if self.freshness is not None else None

    def of(self, rec: Record) -> str | None:
        """:meth:`refusal` of a worker :class:`~streams.app.deadletter.Record`."""
        return self.refusal(
            rec.value, rec.content_type, rec.signer, rec.signature, rec.fresh, rec.snapshot,
            (rec.partition, rec.offset),
        )  # fmt: skip

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


def alert_only_unless_trusted(
    verdicts: list[Verdict], contested: str | None, lonely: Callable[[Verdict], str | None]
) -> tuple[list[Verdict], int]:
    """``verdicts`` made alert-only (benign, the reason saying why) while their
    communicator's evidence is ``contested``, or when ``lonely`` says nobody corroborates
    a finding; with how many findings were uncorroborated. Notes stay notes."""
    out, n_lonely = [], 0
    for v in verdicts:
        why = None
        if contested is not None:
            why = f"evidence contested ({contested}); alert only."
        elif not v.benign and (alone := lonely(v)) is not None:
            n_lonely += 1
            why = f"not corroborated ({alone}); alert only."
        if why is None:
            out.append(v)
        else:
            out.append(msgspec.structs.replace(v, benign=True, reason=f"{why} {v.reason}"))
    return out, n_lonely


FRESH_KEY = "\x00c4-fresh/"
"""Table key prefix of a partition's :class:`Freshness` (no communicator id starts with a
NUL: the contract's names are printable)."""


class FreshCheckpoints:
    """The router's side of :class:`Freshness` checkpoints: restored per events partition
    before its first message is checked, marked dirty by every signed message, located,
    listed and forgotten like a communicator's state (keys :data:`FRESH_KEY` + partition)."""

    __slots__ = ("fresh", "held")

    def __init__(self, trust: EventTrust | None) -> None:
        self.fresh = trust.freshness if trust is not None else None
        self.held: set[int] = set()

    def restore(self, records: Sequence[Record], restore: Callable[..., object]) -> dict[str, int]:
        """Restore the freshness of partitions not held yet (``restore``: the runner's);
        the keys to mark dirty, with their signed messages."""
        f = self.fresh
        if f is None:
            return {}
        for p in {r.partition for r in records} - self.held:
            self.held.add(p)
            restore(f"{FRESH_KEY}{p}".encode(), f"freshness of events partition {p}",
                    lambda data, p=p: f.load(p, data))  # fmt: skip
        dirty: dict[str, int] = {}
        for r in records:
            if r.fresh is not None:
                key = f"{FRESH_KEY}{r.partition}"
                dirty[key] = dirty.get(key, 0) + 1
        return dirty

    def locate(self, key: str) -> tuple[int, bytes, _FreshPart] | None:
        if self.fresh is None or not key.startswith(FRESH_KEY):
            return None
        p = int(key[len(FRESH_KEY) :])
        return (p, key.encode(), _FreshPart(self.fresh, p)) if p in self.held else None

    def keys(self, partitions: set[int] | None) -> list[str]:
        return [
            f"{FRESH_KEY}{p}" for p in sorted(self.held) if partitions is None or p in partitions
        ]

    def drop(self, partitions: set[int] | None) -> None:
        for p in [p for p in self.held if partitions is None or p in partitions]:
            self.held.discard(p)
            if self.fresh is not None:
                self.fresh.forget(p)


class _FreshPart:
    __slots__ = ("fresh", "p")

    def __init__(self, fresh: Freshness, p: int) -> None:
        self.fresh, self.p = fresh, p

    def to_bytes(self) -> bytes:
        return self.fresh.state(self.p)
