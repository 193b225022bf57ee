"""The worker's intake: a consumer batch's messages as one block of columns, and the
corroboration checks over it.

:func:`decode_batch` is the edge: every good message of the batch — Arrow IPC, JSON, or
summaries expanded at the source — becomes rows of one
:class:`~producers.columnar.ColumnBlock` (message ``k`` owns rows
``starts[k]:starts[k+1]``), so that admission (:mod:`streams.app.admission`),
corroboration (:class:`Corroboration`), the lanes and the core read one form. JSON is
turned into columns in one place, :func:`_json_block`.

Corroboration is within the detector's physics: a rank's heartbeat counters only grow,
so a heartbeat that goes back means two sources report for one rank (a forger and the
real exporter); per rank and op ``seq`` only grows, and one collective has one duration.
:class:`Corroboration` finds, with numpy over the whole batch, the rows that cannot
contradict anything and checks the others one by one, in message order
(:meth:`Ledger.check`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from producers.columnar import EVENT_SCHEMA, ColumnBlock, decode_block, events_table
from producers.events import Event, EventDecodeError
from producers.summary import ExpandStats, has_summaries
from streams.app.admission import INFLIGHT_SLACK_US, EdgeLimits
from streams.app.deadletter import Record
from streams.app.summary_intake import Expanded, summary_events
from streams.app.trust import EventTrust, signature_refusal

__all__ = [
    "DUPLICATE",
    "INFLIGHT_SLACK_US",
    "NOTHING",
    "digests_of",
    "decode_records",
    "Corroboration",
    "Ledger",
    "OpState",
    "ProgressState",
    "block_hosts",
    "decode_batch",
    "op_codes",
]

Item = EventDecodeError | int | str | None
"""Per message: why it cannot be read, its index in the block, a dead letter's reason, or
None (nothing to judge: summaries that expanded to no event)."""


DUPLICATE = EventDecodeError("an exact repeat of a message already accepted")
"""What :func:`decode_records` gives for a message dropped as a duplicate."""

NOTHING = "summaries alone"
"""What :func:`decode_records` gives for summaries that expand to no event (nothing
to judge; remembered for exact repeats)."""


def decode_records(
    records: Sequence[Record],
    lim: EdgeLimits,
    seen: Container[bytes],
    trust: EventTrust | None,
    summaries: ExpandStats,
) -> tuple[list[Item], ColumnBlock | None, list[bytes], dict[int, Expanded]]:
    """The batch's messages decoded into one block of columns
    (:func:`decode_batch`): per record the index of its rows in the block, or why it
    cannot be read; with the digests and, by position, the messages that held summaries
    (their kernel times are evidence once accepted). Oversize messages are refused before
    any decoding; with signed events (docs/security.md) a message whose signature
    fails is refused before decoding, and one whose events name another host than
    its signer after (a ``str``: the dead letter's reason)."""
    sized = [len(rec.value) <= lim.max_message_bytes for rec in records]
    # an exact repeat of an accepted message is dropped before its signature's
    # freshness is checked (a producer's retry is not a replay to dead-letter)
    digests = digests_of(records)
    dup = [d in seen for d in digests]
    sized = [ok and not d for ok, d in zip(sized, dup, strict=True)]
    unsigned = [
        signature_refusal(trust, rec) if ok else None
        for rec, ok in zip(records, sized, strict=True)
    ]
    summed = {
        i: summary_events(rec, summaries)  # windows at the source: as their events
        for i, (rec, ok, bad) in enumerate(zip(records, sized, unsigned, strict=True))
        if ok and not bad and has_summaries(rec.value)
    }
    decoded, block = decode_batch(
        [
            (rec.value, rec.content_type) if ok and not bad and i not in summed else (b"", None)
            for i, (rec, ok, bad) in enumerate(zip(records, sized, unsigned, strict=True))
        ],
        summed,
    )
    items: list[Item] = []
    for i, (rec, ok, bad) in enumerate(zip(records, sized, unsigned, strict=True)):
        item = NOTHING if decoded[i] is None else decoded[i]
        if dup[i]:
            item = DUPLICATE
        elif not ok:
            item = EventDecodeError(
                f"{len(rec.value)} bytes is over the limit of {lim.max_message_bytes}"
            )
        elif bad:
            item = bad
        elif trust is not None and isinstance(item, int):
            item = signature_refusal(trust, rec, block_hosts(block, item)) or item  # type: ignore[arg-type]
        items.append(item)  # type: ignore[arg-type]
    held = {i: x for i, x in summed.items() if isinstance(x, Expanded)}
    return items, block, digests, held


def digests_of(records: Sequence[Record]) -> list[bytes]:
    """Per message, the digest an exact repeat shares (headers included: a signed
    message's sequence number makes each one distinct)."""
    out = []
    for rec in records:
        h = hashlib.blake2b(rec.value, digest_size=16)
        h.update(rec.fresh or b"")
        out.append(h.digest())
    return out


def decode_batch(
    messages: Sequence[tuple[bytes, bytes | str | None]],
    expanded: dict[int, list[Event] | EventDecodeError],
) -> tuple[list[Item], ColumnBlock | None]:
    """A consumer batch (value, content type per message; ``b""`` for one not to read)
    decoded into one block: per message its index in the block, its decoding error, or
    (a ``str``) the reason to dead-letter it.
    ``expanded``: messages already read as events (summaries expanded at the source),
    by position."""
    read = {i: x for i, x in expanded.items() if isinstance(x, list)}
    decoded, block = decode_block(messages, read)  # the expanded ones join the JSON
    items: list[Item] = [None] * len(messages)
    json: dict[int, list[Event]] = {}
    for i, x in enumerate(decoded):
        got = x if i in read else expanded.get(i, x)
        if isinstance(got, list):
            if got:
                json[i] = got
            elif i not in expanded:  # (summaries may expand to nothing: nothing to judge)
                items[i] = "event breaks the contract: empty message: no events"
        elif isinstance(got, int):
            items[i] = got
        else:
            items[i] = got
    if json:
        block = _json_block(items, block, json)
    return items, block


def _json_block(
    items: list[Item], block: ColumnBlock | None, json: dict[int, list[Event]]
) -> ColumnBlock:
    """The batch's messages left as event objects by :func:`decode_block` (values that
    did not fit its columns in one pass) put into the block with the others, in message
    order (``items`` renumbered in place). The JSON and expanded summaries' events that
    fit are columns already, converted together in :func:`decode_block`."""
    # one conversion for all the batch's JSON events (a table costs ~100 µs to build
    # whatever its size), then each message's rows are a slice of it
    events = [e for evs in json.values() for e in evs]
    table = events_table(events).combine_chunks().to_batches()[0]
    offs = np.zeros(len(json) + 1, np.int64)
    np.cumsum([len(v) for v in json.values()], out=offs[1:])
    if block is None:  # JSON alone: the table is the block, messages in order
        for k, i in enumerate(json):
            items[i] = k
        return ColumnBlock(table, offs)
    at = dict(zip(json, offs[:-1].tolist(), strict=True))
    batches: list[pa.RecordBatch] = []
    for i, x in enumerate(items):
        if i in json:
            batches.append(table.slice(at[i], len(json[i])))
        elif isinstance(x, int):
            s, e = int(block.starts[x]), int(block.starts[x + 1])
            batches.append(block.batch.slice(s, e - s))
        else:
            continue
        items[i] = len(batches) - 1
    starts = np.zeros(len(batches) + 1, np.int64)
    np.cumsum([b.num_rows for b in batches], out=starts[1:])
    whole = pa.Table.from_batches(batches, EVENT_SCHEMA).combine_chunks().to_batches()[0]
    return ColumnBlock(whole, starts)


ProgressState = dict[str, dict[int, tuple[int, int, int]]]
"""Communicator -> rank -> (started, completed, ts_us) of its newest heartbeat (each the
largest seen)."""
OpState = dict[str, dict[tuple[int, str], tuple[int, float]]]
"""Communicator -> (rank, op) -> (seq, exec_us) of its newest completed op."""

Contest = Callable[[str, int, str], None]
"""(communicator, ``ts_us``, why): two sources contradict each other about one of its ranks."""


class Ledger:
    """What corroboration remembers per communicator and rank, and its rules, row by row.

    A forged hang must contradict someone: the accused's own heartbeats (it is alive and
    advancing) or its peers' (they are not as far ahead as claimed). Three rules of one
    rank's physics (one rank, one clock): counters only grow; they grow with ``ts_us``
    too (a heartbeat stamped later may not say less); and a rank cannot have sat in
    collective N for longer than since it last reported not having started N (a forged
    "waiting 30 s" copy of a peer's heartbeat, one collective ahead, kept its counters
    plausible and got a healthy host cordoned). For ops: per rank and op ``seq`` only
    grows, and one collective has one duration (a re-sent message repeats both exactly;
    a second source contradicts the real one in either)."""

    __slots__ = ("ops", "progress")

    def __init__(self) -> None:
        self.progress: ProgressState = {}
        self.ops: OpState = {}

    def forget(self, comm: str) -> None:
        self.progress.pop(comm, None)
        self.ops.pop(comm, None)

    def check(self, block: ColumnBlock, rows: np.ndarray, contest: Contest) -> None:
        """The rules over rows ``rows`` of ``block``, one by one, in order."""
        codes, names = op_codes(block)
        col = block.column
        comms = block.comm_names
        for i, c, is_op, rank, ts in zip(rows.tolist(), block.comm_codes[rows].tolist(),
                                         block.is_op[rows].tolist(), col("rank")[rows].tolist(),
                                         col("ts_us")[rows].tolist(), strict=True):  # fmt: skip
            if is_op:
                op, seq, ex = names[codes[i]], int(col("seq")[i]), float(col("exec_us")[i])
                why = self._op(comms[c], rank, op, seq, ex)
            else:
                # a null in-flight time is read as 0.0, which no rule tells apart
                why = self._counters(comms[c], rank, int(col("started")[i]),
                                     int(col("completed")[i]), ts,
                                     float(col("inflight_us")[i]))  # fmt: skip
            if why is not None:
                contest(comms[c], ts, why)

    def _counters(
        self, comm: str, rank: int, started: int, completed: int, ts: int, inflight: float
    ) -> str | None:
        ranks = self.progress.setdefault(comm, {})
        last = ranks.get(rank)
        if last is None:
            ranks[rank] = (started, completed, ts)
            return None
        s0, c0, t0 = last
        ranks[rank] = (max(started, s0), max(completed, c0), max(ts, t0))
        if started < s0 or completed < c0:
            return (
                f"rank {rank}'s heartbeat went back from started {s0}/completed "
                f"{c0} to {started}/{completed}: two sources report for it"
            )
        if ts < t0 and (started > s0 or completed > c0):
            return (
                f"rank {rank}'s heartbeat at {ts} says started {started}, one "
                f"stamped later ({t0}) said {s0}: two sources report for it"
            )
        if started > s0 and inflight > ts - t0 + INFLIGHT_SLACK_US:
            return (
                f"rank {rank} says it has been in collective {started} for "
                f"{inflight / 1e6:.1f} s, but {(ts - t0) / 1e6:.1f} s before it "
                f"had started only {s0}: two sources report for it"
            )
        return None

    def _op(self, comm: str, rank: int, op: str, seq: int, exec_us: float) -> str | None:
        ops = self.ops.setdefault(comm, {})
        key = (rank, op)
        last = ops.get(key)
        if last is None or seq > last[0]:
            ops[key] = (seq, exec_us)
            return None
        if seq < last[0]:
            return (f"rank {rank}'s {op} went back from seq {last[0]} to {seq}: "
                    "two sources report for it")  # fmt: skip
        if exec_us != last[1]:
            return (
                f"rank {rank}'s {op} seq {seq} reported twice with different "
                f"durations ({last[1]} and {exec_us} us): two sources report for it"
            )
        return None


class Corroboration:
    """The :class:`Ledger`'s rules over a consumer batch's rows, with the outcome of
    checking them row by row in message order, but with numpy for the rows that cannot
    contradict anything.

    Rows are grouped by what a rule compares: (communicator, rank) for heartbeats,
    (communicator, rank, op) for ops. A group whose rows only grow (heartbeat counters
    never go back, seq strictly increases) and whose first row does not go back from
    the state before the batch cannot contradict anything, whichever of its messages
    are accepted: no rule runs per row, and its state becomes its last accepted row
    when the batch ends (:meth:`commit`). Every other row is checked row by row in
    message order (:attr:`exact`) by :meth:`Ledger.check`.
    """

    __slots__ = ("any_exact", "exact", "_block", "_op_groups", "_ops", "_pr_groups",
                 "_progress")  # fmt: skip

    def __init__(self, block: ColumnBlock, ledger: Ledger) -> None:
        self._block, self._progress, self._ops = block, ledger.progress, ledger.ops
        cc, rank, is_op = block.comm_codes, block.column("rank"), block.is_op
        exact = np.zeros(len(cc), bool)
        started, completed = block.column("started"), block.column("completed")
        ts, inflight = block.column("ts_us"), block.column("inflight_us")
        pr = np.flatnonzero(~is_op)
        # The in-flight rule is checked against the row before, whether or not it is
        # accepted: an earlier predecessor is stamped no later, so this is the stricter
        # test, and a group it flags is only checked exactly.
        self._pr_groups = self._groups(
            pr, (cc[pr], rank[pr]), exact,
            lambda a, b: (started[b] < started[a]) | (completed[b] < completed[a])
            | (ts[b] < ts[a]) | (inflight[b] > ts[b] - ts[a] + INFLIGHT_SLACK_US),
            self._progress_goes_back,
        )  # fmt: skip
        codes, op_names = op_codes(block)
        seq = block.column("seq")
        po = np.flatnonzero(is_op)
        self._op_groups = self._groups(
            po, (cc[po], rank[po], codes[po]), exact,
            lambda a, b: seq[b] <= seq[a],
            lambda r: self._op_repeats(r, op_names),
        )  # fmt: skip
        self.exact = exact
        """Per row: checked row by row (in message order) by the caller."""
        self.any_exact: list[bool] = np.logical_or.reduceat(exact, block.starts[:-1]).tolist()

    @staticmethod
    def _groups(
        rows: np.ndarray,
        keys: tuple[np.ndarray, ...],
        exact: np.ndarray,
        back: Callable[[np.ndarray, np.ndarray], np.ndarray],
        first_back: Callable[[np.ndarray], list[bool]],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows sorted by group (stable: message order within a group) and each row's
        group start flag, after marking in ``exact`` every row of a group that goes back
        within the batch (``back(earlier, later)`` of consecutive rows) or whose first row
        goes back from the state (``first_back``)."""
        order = np.lexsort(keys[::-1])  # stable: message order within a group
        rows = rows[order]
        start = np.ones(len(rows), bool)
        start[1:] = False
        for key in keys:
            k = key[order]
            start[1:] |= k[1:] != k[:-1]
        bad = np.zeros(len(rows), bool)
        bad[1:] = ~start[1:] & back(rows[:-1], rows[1:])
        firsts = np.flatnonzero(start)
        bad[firsts] |= np.asarray(first_back(rows[firsts]), bool)
        if bad.any():
            group = np.cumsum(start) - 1
            bad = np.isin(group, group[bad])
            exact[rows[bad]] = True
            return rows[~bad], start[~bad]
        return rows, start

    def _progress_goes_back(self, rows: np.ndarray) -> list[bool]:
        """Per row: its heartbeat may contradict its rank's state before the batch (goes
        back in counters or time, or claims more time in flight than since then)."""
        b, state = self._block, self._progress
        names, out = b.comm_names, []
        col = b.column
        for c, r, st, cp, t, fl in zip(b.comm_codes[rows].tolist(), col("rank")[rows].tolist(),
                                       col("started")[rows].tolist(),
                                       col("completed")[rows].tolist(), col("ts_us")[rows].tolist(),
                                       col("inflight_us")[rows].tolist(), strict=True):  # fmt: skip
            last = state.get(names[c])
            last = last.get(r) if last else None
            out.append(
                last is not None
                and (st < last[0] or cp < last[1] or t < last[2]
                     or fl > t - last[2] + INFLIGHT_SLACK_US)
            )  # fmt: skip
        return out

    def _op_repeats(self, rows: np.ndarray, ops: list[str]) -> list[bool]:
        """Per row: its seq is not beyond its rank's and op's state before the batch."""
        b, state = self._block, self._ops
        names, codes, out = b.comm_names, op_codes(b)[0], []
        for c, r, o, q in zip(b.comm_codes[rows].tolist(), b.column("rank")[rows].tolist(),
                              codes[rows].tolist(), b.column("seq")[rows].tolist(),
                              strict=True):  # fmt: skip
            last = state.get(names[c])
            last = last.get((r, ops[o])) if last else None
            out.append(last is not None and q <= last[0])
        return out

    def commit(self, accepted: np.ndarray) -> None:
        """The state after the batch: each group's last accepted row (``accepted``: per
        message of the block)."""
        b = self._block
        row_ok = np.repeat(accepted, np.diff(b.starts))
        names = b.comm_names
        cc, rank = b.comm_codes, b.column("rank")
        for (rows, start), is_op in ((self._pr_groups, False), (self._op_groups, True)):
            ok = row_ok[rows]
            if not ok.any():
                continue
            group = np.cumsum(start) - 1
            rows, group = rows[ok], group[ok]
            last = np.ones(len(rows), bool)
            last[:-1] = group[1:] != group[:-1]
            lr = rows[last]
            comms = [names[c] for c in cc[lr].tolist()]
            ranks = rank[lr].tolist()
            if is_op:
                codes, opn = op_codes(b)
                seqs, execs = b.column("seq")[lr].tolist(), b.column("exec_us")[lr].tolist()
                for c, r, o, q, x in zip(
                    comms, ranks, codes[lr].tolist(), seqs, execs, strict=True
                ):
                    self._ops.setdefault(c, {})[(r, opn[o])] = (q, x)
            else:
                st, cp = b.column("started")[lr].tolist(), b.column("completed")[lr].tolist()
                tss = b.column("ts_us")[lr].tolist()
                for c, r, a, d, t in zip(comms, ranks, st, cp, tss, strict=True):
                    self._progress.setdefault(c, {})[r] = (a, d, t)


def block_hosts(block: ColumnBlock, k: int) -> list[str]:
    """The hosts named by Arrow message ``k`` of ``block`` (checked against its signer)."""
    s, e = int(block.starts[k]), int(block.starts[k + 1])
    return pc.unique(block.batch.column("host").slice(s, e - s)).to_pylist()


def op_codes(block: ColumnBlock) -> tuple[np.ndarray, list[str]]:
    """The ``op`` column as codes per row (progress rows: the code of "")."""
    return block.codes("op")
