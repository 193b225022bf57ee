"""Windows at the source: the ``summary`` kind of the event contract, its summariser
(exporter side) and its expansion into ordinary events (worker / ``detect`` side).

At real rates (hundreds to thousands of collectives per second per rank) sending every
collective costs more wire records than the detectors need. An exporter with
``summary_k = k`` sends, per (communicator, rank) and publish window:

* one ``summary`` record (contract extension, ``sv`` = :data:`SUMMARY_VERSION`): count,
  seq range, kernel-time summary (sum, min, p50, p90, max), bytes, and per peer and
  direction the bytes, time and retransmits of every collective of the window;
* *seq-coherent samples*: every collective whose seq is picked by :func:`is_sample` (a
  hash of the seq alone, so the same seqs on every rank) goes out whole, as an ordinary
  ``op`` event, so the straggler's "who arrived last" still has matched collectives.

Progress heartbeats are not summarised. A window is closed at a publish cycle once it
holds a sample (so its summary travels with an op event of its rank, which the worker's
admission checks against the rank's identity: the summary is vouched for), or after
``max_hold`` cycles without one.

:func:`expand` is the edge conversion that keeps each detector rule written once: a
message becomes the ordinary events the core already consumes — the samples (straggler,
op normal, rank identities) and progress heartbeats (the hang detector's counters, as on
raw input). A sample inside a summary with per-peer totals loses its own connections:
the totals count them, and they reach the slow-connection matrix whole, every window,
through :mod:`streams.core.summary_evidence` (with the kernel-time statistics the
straggler rule weighs), which the worker, ``c4stream detect`` and the archive's reader
call alike.

Old workers decode with :func:`producers.events.decode_message`, which knows only
``op`` and ``progress``: a message with a summary is dead-lettered whole with the
decoder's reason (``Invalid value 'summary' - at `$[i].kind```; Arrow: ``Invalid value
'summary' (op or progress) - at row i, column `kind```).

>>> s = Summariser(k=64)
>>> for t in range(1, 201):
...     s.add(OpEvent(v=1, job="j", comm="0xa", nranks=2, rank=0, host="h0", ts_us=t,
...                   op="AllReduce", seq=t, bytes=8, exec_us=float(t),
...                   conns=[Conn(peer=1, dir="send", bytes=8, time_us=1.0)]))
>>> recs, _ = s.flush()["0xa"]
>>> [type(r).__name__ for r in recs][-2:], recs[-1].count, recs[-1].peers[0].bytes
(['OpEvent', 'SummaryEvent'], 200, 1600)
>>> [r.seq for r in recs[:-1]] == [q for q in range(1, 201) if is_sample(q, 64)]
True
>>> events = expand(recs)  # the edge: samples only, their traffic is in the totals
>>> len(events) == len(recs) - 1, any(e.conns for e in events)
(True, False)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from producers.events import (
    I64_MAX,
    Conn,
    Event,
    EventDecodeError,
    NonNeg,
    NonNegFloat,
    OpEvent,
    ProgressEvent,
    _Identity,
)
from producers.guard import MAX_DEPTH, MAX_MESSAGE_BYTES, BoundsError, check_bounds

__all__ = [
    "SUMMARY_VERSION",
    "ExpandStats",
    "SummaryEvent",
    "Summariser",
    "decode_expanded",
    "decode_with_summaries",
    "encode_summary_message",
    "expand",
    "has_summaries",
    "is_sample",
    "suggest_k",
    "summarise_trace",
    "summarised",
    "sample_mask",
]

SUMMARY_VERSION = 1
"""Version of the summary record (``sv``); the identity's ``v`` stays 1."""

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
"""splitmix64's finaliser: consecutive seqs land far apart, so 1 in k of any run is picked."""


def is_sample(seq: int, k: int) -> bool:
    """Whether collective ``seq`` is sent whole at 1-in-``k`` sampling.

    A function of the seq alone (splitmix64's mix of it, not ``seq % k``: collectives repeat
    in a fixed pattern per iteration, and a modulus would pick the same op of the
    pattern every time), so every rank picks the same collectives.

    >>> [s for s in range(200) if is_sample(s, 64)] == [s for s in range(200) if is_sample(s, 64)]
    True
    >>> all(is_sample(s, 1) for s in range(10))
    True
    """
    z = (seq + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return (z ^ (z >> 31)) % k == 0


def sample_mask(seqs: Any, k: int) -> Any:
    """:func:`is_sample` of many seqs at once (uint64 arithmetic wraps as the mask)."""
    import numpy as np

    z = np.asarray(seqs, dtype=np.uint64) + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return ((z ^ (z >> np.uint64(31))) % np.uint64(k)) == 0


Count = Annotated[int, msgspec.Meta(ge=1, le=I64_MAX)]


class SummaryEvent(_Identity, tag="summary"):
    """One window of one rank on one communicator, summarised at the source.

    ``ts_us`` is the time of the window's last collective; ``win_start_us`` that of its
    first. ``peers``: per (peer, dir) the bytes, time and retransmits summed over every
    collective of the window."""

    sv: Literal[1]
    win_start_us: NonNeg
    count: Count
    seq_first: NonNeg
    seq_last: NonNeg
    bytes: NonNeg
    exec_sum_us: NonNegFloat
    exec_min_us: NonNegFloat
    exec_p50_us: NonNegFloat
    exec_p90_us: NonNegFloat
    exec_max_us: NonNegFloat
    sample_k: Count
    samples: NonNeg = 0
    """How many of the window's collectives were sent whole (as ``op`` events)."""
    peers: list[Conn] | None = None


AnyEvent = OpEvent | ProgressEvent | SummaryEvent
_decoder = msgspec.json.Decoder(AnyEvent | list[AnyEvent])
_encoder = msgspec.json.Encoder()


def has_summaries(data: bytes) -> bool:
    """A cheap look before decoding: might this message hold summary records? (True for
    any message containing the word; the decoder then decides.) Our encoders write the
    kind as plain text in JSON and in Arrow's uncompressed string buffers."""
    return b"summary" in data


def encode_summary_message(events: Sequence[Event | SummaryEvent]) -> bytes:
    """A JSON array of events and summaries (as :func:`producers.events.encode_message`)."""
    return _encoder.encode(list(events))


def _check_summary(s: SummaryEvent) -> str | None:
    """The rules a schema cannot say: ordering inside the record, peers below nranks."""
    if s.rank >= s.nranks:
        return f"rank {s.rank} is not below nranks {s.nranks}"
    if s.seq_last < s.seq_first:
        return f"seq_last {s.seq_last} is below seq_first {s.seq_first}"
    if s.ts_us < s.win_start_us:
        return f"ts_us {s.ts_us} is before win_start_us {s.win_start_us}"
    if not s.exec_min_us <= s.exec_p50_us <= s.exec_p90_us <= s.exec_max_us:
        return "kernel times out of order (min <= p50 <= p90 <= max)"
    if s.samples > s.count:
        return f"samples {s.samples} is above count {s.count}"
    for c in s.peers or ():
        if c.peer >= s.nranks:
            return f"peer {c.peer} is not below nranks {s.nranks}"
    return None


def decode_with_summaries(
    data: bytes, content_type: bytes | str | None = None, *, max_bytes: int = MAX_MESSAGE_BYTES
) -> list[Event | SummaryEvent]:
    """Decode one message (JSON or Arrow) that may hold summaries; raises
    :class:`EventDecodeError` with the reason, as the plain decoders do."""
    from producers.columnar import is_arrow

    if is_arrow(content_type, data):
        from producers.summary_arrow import decode_arrow_with_summaries

        return decode_arrow_with_summaries(data)
    try:
        check_bounds(data, max_bytes=max_bytes, max_depth=MAX_DEPTH)
        out = _decoder.decode(data)
    except (msgspec.DecodeError, BoundsError) as err:
        raise EventDecodeError(str(err)) from None
    except Exception as err:  # RecursionError, MemoryError: never past the edge
        raise EventDecodeError(f"undecodable: {type(err).__name__}: {err}") from None
    items = out if isinstance(out, list) else [out]
    for i, ev in enumerate(items):
        if isinstance(ev, SummaryEvent) and (bad := _check_summary(ev)) is not None:
            raise EventDecodeError(f"summary breaks the contract: {bad} - at `$[{i}]`")
    return items


@dataclass
class ExpandStats:
    summaries: int = 0
    stripped: int = 0
    """Samples whose own connections were dropped (their summary's per-peer totals count
    them: :mod:`streams.core.summary_evidence` folds those)."""


def expand(items: Iterable[Event | SummaryEvent], stats: ExpandStats | None = None) -> list[Event]:
    """A message's records as the ordinary events the detection core consumes (see the
    module doc): summaries go; a sample inside the seq range of a summary with per-peer
    totals loses its own connections (the totals count them, and reach the
    slow-connection matrix through :mod:`streams.core.summary_evidence`). Events keep
    their order."""
    events: list[Event] = []
    summaries: list[SummaryEvent] = []
    for it in items:
        if isinstance(it, SummaryEvent):
            summaries.append(it)
        else:
            events.append(it)
    if not summaries:
        return events
    st = stats if stats is not None else ExpandStats()
    st.summaries += len(summaries)
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for s in summaries:
        if s.peers:
            ranges.setdefault((s.comm, s.rank), []).append((s.seq_first, s.seq_last))
    if not ranges:
        return events
    for i, ev in enumerate(events):
        if ev.__class__ is OpEvent and ev.conns:
            spans = ranges.get((ev.comm, ev.rank), ())
            if any(lo <= ev.seq <= hi for lo, hi in spans):  # type: ignore[union-attr]
                events[i] = msgspec.structs.replace(ev, conns=None)  # type: ignore[arg-type]
                st.stripped += 1
    return events


# ---------------------------------------------------------------------------- source


@dataclass(slots=True)
class _Window:
    first: OpEvent
    last: OpEvent
    exec_us: list[float] = field(default_factory=list)
    nbytes: int = 0
    seq_first: int = 0
    seq_last: int = 0
    peers: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    """(peer, dir) -> [bytes, time_us, retrans, has_time, has_retrans]."""
    ts_min: int = 0
    ts_max: int = 0
    samples: list[OpEvent] = field(default_factory=list)
    held: int = 0
    marks: dict[str, Any] = field(default_factory=dict)
    """Caller's marks (e.g. the earliest file position of its lines), first one kept."""


Flushed = tuple[list[Event | SummaryEvent], dict[str, Any]]
"""A communicator's records to send (samples, then summaries) and the marks they cover."""


class Summariser:
    """Per (communicator, rank) windows of op events → samples and one summary each.

    ``add`` every op event in arrival order; ``flush`` at each publish cycle returns per
    communicator the records to send (samples, then summaries) and the marks of the ops
    they cover. A window without a sample yet is held for up to ``max_hold`` flushes so
    that its summary travels with a sample of its rank (see the module doc); ``force``
    closes everything. With ``every = n`` a window spans n flushes (one summary per n
    intervals)."""

    def __init__(self, k: int, *, every: int = 1, max_hold: int = 4) -> None:
        if k < 1 or every < 1:
            raise ValueError(f"summary k and every must be >= 1, got {k}, {every}")
        self.k = k
        self.every = every
        """A window spans this many flushes (publish intervals): fewer summaries."""
        self.max_hold = max(max_hold, every)
        self._open: dict[tuple[str, int], _Window] = {}

    def add(self, ev: OpEvent, mark: tuple[str, Any] | None = None) -> None:
        key = (ev.comm, ev.rank)
        w = self._open.get(key)
        if w is None:
            w = self._open[key] = _Window(
                ev, ev, seq_first=ev.seq, seq_last=ev.seq, ts_min=ev.ts_us, ts_max=ev.ts_us
            )
        w.last = ev
        if ev.ts_us < w.ts_min:
            w.ts_min = ev.ts_us
        if ev.ts_us > w.ts_max:
            w.ts_max = ev.ts_us
        w.exec_us.append(ev.exec_us)
        w.nbytes += ev.bytes
        if ev.seq < w.seq_first:
            w.seq_first = ev.seq
        if ev.seq > w.seq_last:
            w.seq_last = ev.seq
        for c in ev.conns or ():
            acc = w.peers.get((c.peer, c.dir))
            if acc is None:
                acc = w.peers[(c.peer, c.dir)] = [0, 0.0, 0, False, False]
            acc[0] += c.bytes
            if c.time_us is not None:
                acc[1] += c.time_us
                acc[3] = True
            if c.retrans is not None:
                acc[2] += c.retrans
                acc[4] = True
        if is_sample(ev.seq, self.k):
            w.samples.append(ev)
        if mark is not None and mark[0] not in w.marks:
            w.marks[mark[0]] = mark[1]

    def held_marks(self) -> list[dict[str, Any]]:
        """The marks of every window still open (their lines are not yet sent)."""
        return [w.marks for w in self._open.values()]

    def flush(
        self, *, force: bool = False
    ) -> dict[str, tuple[list[Event | SummaryEvent], dict[str, Any]]]:
        out: dict[str, tuple[list[Event | SummaryEvent], dict[str, Any]]] = {}
        for key in list(self._open):
            w = self._open[key]
            w.held += 1
            if not force and (w.held < self.every or (not w.samples and w.held < self.max_hold)):
                continue
            del self._open[key]
            recs, marks = out.setdefault(key[0], ([], {}))
            recs.extend(w.samples)
            recs.append(summarise(w, self.k))
            for k, v in w.marks.items():
                marks.setdefault(k, v)
        # samples first, then summaries, so a reader meets a rank's samples before its summary
        for recs, _marks in out.values():
            recs.sort(key=lambda r: isinstance(r, SummaryEvent))
        return out


def summarise(w: _Window, k: int) -> SummaryEvent:
    import numpy as np

    x = np.asarray(w.exec_us, dtype=np.float64)
    p50, p90 = np.percentile(x, [50, 90])
    last = w.last
    peers = [
        Conn(
            peer=peer,
            dir=d,  # type: ignore[arg-type]
            bytes=int(a[0]),
            time_us=float(a[1]) if a[3] else None,
            retrans=int(a[2]) if a[4] else None,
        )
        for (peer, d), a in sorted(w.peers.items())
    ]
    return SummaryEvent(
        v=1,
        sv=SUMMARY_VERSION,
        job=last.job,
        comm=last.comm,
        comm_name=last.comm_name,
        nranks=last.nranks,
        rank=last.rank,
        host=last.host,
        gpu=last.gpu,
        nic=last.nic,
        ts_us=w.ts_max,
        win_start_us=w.ts_min,
        count=len(w.exec_us),
        seq_first=w.seq_first,
        seq_last=w.seq_last,
        bytes=w.nbytes,
        exec_sum_us=float(x.sum()),
        exec_min_us=float(x.min()),
        exec_p50_us=float(p50),
        exec_p90_us=float(p90),
        exec_max_us=float(x.max()),
        sample_k=k,
        samples=len(w.samples),
        peers=peers or None,
    )


def decode_expanded(
    data: bytes, content_type: bytes | str | None = None, stats: ExpandStats | None = None
) -> list[Event]:
    """One message in either form, summaries or not, as ordinary events: what every
    reader that judges events (worker, ``detect``, archive) takes in."""
    if has_summaries(data):
        return expand(decode_with_summaries(data, content_type), stats)
    from producers.columnar import decode_events

    return decode_events(data, content_type)


def summarised(
    batches: Iterable[Sequence[Event]], k: int, *, every: int = 1, max_hold: int = 4
) -> Iterator[list[Event | SummaryEvent]]:
    """What exporters with ``summary_k = k`` send for a stream of raw batches, each one
    host's events of one communicator over one interval (as the simulator yields them
    and an exporter publishes them): per batch its progress events unchanged, then the
    samples and summaries of the windows it closed (held windows close with a later
    batch of the same host and communicator)."""
    by_source: dict[tuple[str, str], Summariser] = {}
    for batch in batches:
        if not batch:
            continue
        key = (batch[0].host, batch[0].comm)
        summ = by_source.get(key)
        if summ is None:
            summ = by_source[key] = Summariser(k, every=every, max_hold=max_hold)
        out: list[Event | SummaryEvent] = []
        for ev in batch:
            if ev.__class__ is OpEvent:
                summ.add(ev)  # type: ignore[arg-type]
            else:
                out.append(ev)
        for records, _ in summ.flush().values():
            out.extend(records)
        if out:
            yield out
    for summ in by_source.values():
        for records, _ in summ.flush(force=True).values():
            yield records


def suggest_k(collectives_per_rank_s: float) -> int:
    """The 1-in-k that sends about one collective whole per rank and second: the power
    of two nearest the rate (an exporter setting, the same on every host of a job)."""
    import math

    return 1 << max(0, round(math.log2(max(1.0, collectives_per_rank_s))))


def summarise_trace(
    src: str | Path, dst: str | Path, k: int | None = None, *, every: int = 2
) -> tuple[int, int]:
    """Write the trace exporters with summaries would have sent for a recorded one (each
    line one host's events of one communicator over one interval, as the simulator and
    the exporters write them); ``k`` None: :func:`suggest_k` of the trace's own rate.
    Returns (k, lines written). Bad lines are left out."""
    from producers.traces import TraceLine, TraceWriter, read_trace

    def batches() -> Iterator[list[Event]]:
        for item in read_trace(src):
            if isinstance(item, TraceLine):
                yield item.events

    if k is None:
        ops = 0
        gpus: set[tuple[str, int | None, int | None]] = set()
        lo, hi = I64_MAX, 0
        for b in batches():
            for ev in b:
                if ev.__class__ is OpEvent:
                    ops += 1
                    # a GPU is in several communicators: its rate is theirs together
                    gpus.add((ev.host, ev.gpu, None if ev.gpu is not None else ev.rank))
                    lo, hi = min(lo, ev.ts_us), max(hi, ev.ts_us)
        per_rank = ops / max(1, len(gpus)) / max(1e-6, (hi - lo) / 1e6) if ops else 1.0
        k = suggest_k(per_rank)
    with TraceWriter(dst) as out:
        for records in summarised(batches(), k, every=every):
            out.write(records)  # type: ignore[arg-type]
        return k, out.lines
