"""Consecutive messages of events as one set of columns: :class:`ArchiveBlock` (the
:class:`~streams.core.columns.ColumnBlockLike` the pipeline's ``feed_block`` routes)
and :class:`BlockColumns` (one communicator's rows of a time slice of it).

A reader that has the validated rows of many messages in one batch, in message order
(the Parquet archive, an Arrow IPC file, a JSON-lines trace decoded into columns),
cuts them into blocks with :func:`cut_blocks`; the numpy columns are built once per
batch and every block, part and slice is a view of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from producers.columnar.arrays import (
    _CONNS,
    _IS_OP,
    EventColumns,
    LazyEvents,
    _codes,
    _identity_lists,
    core_arrays,
    value_in_parts,
)
from producers.columnar.tables import events_table, table_events
from producers.events import Event

__all__ = ["ArchiveBlock", "BlockColumns", "cut_blocks", "json_blocks"]

_GROUP_US = 1_000_000
"""Blocks cut ``by_second`` hold messages whose earliest ``ts_us`` is in one second."""


class BlockColumns:
    """One communicator's rows of an :class:`ArchiveBlock` (its parts of one time
    slice) as :class:`~streams.core.columns.EventColumnsLike`: numpy views of arrays
    gathered once for every communicator of the slice; event objects are built only for
    the rows a detector reads whole (from the block's Arrow rows)."""

    __slots__ = ("_block", "_coff", "_conns", "_np", "_objs", "_src", "_table", "comm",
                 "comm_name", "job")  # fmt: skip

    def __init__(
        self,
        comm: str,
        job: str,
        comm_name: str | None,
        rows: dict[str, np.ndarray],
        conns: tuple[np.ndarray, ...],
        coff: np.ndarray,
        src: list[tuple[pa.RecordBatch, np.ndarray]],
        objs: tuple[_SliceObjects, int] | None = None,
        block: list[ArchiveBlock] | None = None,
    ) -> None:
        self.comm, self.job, self.comm_name = comm, job, comm_name
        self._block = block
        """The block each source of ``src`` comes from: their progress connections."""
        self._objs = objs
        """The slice's shared objects and where these rows start in it (one part only)."""
        self._np = rows
        self._conns = conns
        """Flat connections of these rows: peer, send, bytes, time."""
        self._coff = coff
        """Row ``i`` owns connections ``coff[i]:coff[i+1]``."""
        self._src = src
        """Where the rows are: (Arrow rows, row numbers in them), in order."""
        self._table: pa.RecordBatch | None = None

    @property
    def n(self) -> int:
        return len(self._np[_IS_OP])

    @property
    def table(self) -> pa.RecordBatch:
        """The rows as one Arrow batch (built when first read)."""
        if self._table is None:
            taken = [t.take(pa.array(r, pa.int64())) for t, r in self._src]
            self._table = pa.Table.from_batches(taken).combine_chunks().to_batches()[0]
        return self._table

    @property
    def is_op(self) -> np.ndarray:
        return self._np[_IS_OP]

    @property
    def ts_us(self) -> np.ndarray:
        return self.int("ts_us")

    def int(self, name: str, fill: int = -1) -> np.ndarray:
        got = self._np.get(f"{name}:{fill}")
        return got if got is not None else EventColumns(self.comm, self.table).int(name, fill)

    def float(self, name: str, fill: float = 0.0) -> np.ndarray:
        got = self._np.get(f"{name}:{fill}")
        return got if got is not None else EventColumns(self.comm, self.table).float(name, fill)

    def conn_counts(self) -> np.ndarray:
        return self._np[_CONNS]

    def conn_arrays(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        lens = self._np[_CONNS][idx]
        before = np.zeros(len(lens), np.int64)
        np.cumsum(lens[:-1], out=before[1:])
        flat = np.repeat(self._coff[idx] - before, lens) + np.arange(int(lens.sum()))
        return tuple(a[flat] for a in self._conns)  # type: ignore[return-value]

    def progress_conns(self, idx: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """The connections of rows ``idx`` as integers, as events carry them: offsets
        per row (``len(idx) + 1``), peer, send (else recv), bytes, retransmits (0 when
        absent); None when the rows are not one block's."""
        blocks = self._block
        if blocks is None:
            return None
        if len(blocks) == 1:
            return blocks[0].progress_conns(self._src[0][1][idx])
        # rows of several blocks (a slice cut by a block's end): each block's share, in
        # order; rows not in source order (never asked so today) get None
        ends = np.cumsum([len(r) for _, r in self._src])
        which = np.searchsorted(ends, idx, side="right")
        if len(idx) and (np.diff(which) < 0).any():
            return None
        cut = np.searchsorted(which, np.arange(len(blocks) + 1)).tolist()
        got = []
        for k, (blk, (_, r)) in enumerate(zip(blocks, self._src, strict=True)):
            if cut[k + 1] > cut[k]:
                got.append(blk.progress_conns(r[idx[cut[k] : cut[k + 1]] - (ends[k] - len(r))]))
        if len(got) == 1:
            return got[0]
        base = np.cumsum([0] + [int(g[0][-1]) for g in got[:-1]])
        shifted = [g[0][1:] + b for g, b in zip(got, base, strict=True)]
        off = np.concatenate([np.zeros(1, np.int64), *shifted])
        return (off, *(np.concatenate([g[j] for g in got]) for j in range(1, 5)))

    def identities(self, idx: np.ndarray) -> tuple[list[str], list[int | None], list[str | None]]:
        """Host, GPU and NIC (None when absent) of rows ``idx``, read from the columns:
        a rank first seen learns who it is without an event object."""
        if self._objs is not None:  # read once for the whole slice
            shared, start = self._objs
            return shared.identities(idx + start)
        got = [_identity_lists(t, r) for t, r in self._src]
        want = idx.tolist()
        hosts, gpus, nics = ([x for g in got for x in g[k]] for k in range(3))
        return [hosts[i] for i in want], [gpus[i] for i in want], [nics[i] for i in want]

    def rows(self, idx: np.ndarray) -> Sequence[Event]:
        if self._objs is not None:  # converted with the slice's other rows read whole
            shared, start = self._objs
            return LazyEvents(shared, idx + start)
        if self._table is None and len(self._src) == 1:  # no need to gather the rows first
            t, r = self._src[0]
            return LazyEvents(t, r[idx])
        return LazyEvents(self, idx)  # the rows are gathered only if read

    def to_events(self) -> list[Event]:
        return table_events(self.table)

    def value_at(self, name: str, i: int) -> Any:
        """Row ``i``'s value of column ``name`` (a cut reads its first op's name so):
        one value from the Arrow rows. Read from an event object instead, it made the
        slice's shared objects convert the whole slice for every communicator's first
        op, half of ``detect``'s CPU on the Parquet archive."""
        if self._table is not None:
            return self._table.column(name)[i].as_py()
        return value_in_parts(self._src, name, i)

    def get(self, pos: np.ndarray) -> list[Event]:
        """Rows ``pos`` as event objects (for :class:`~producers.columnar.arrays.LazyEvents`)."""
        return table_events(self.table.take(pa.array(pos, pa.int64())))

    @staticmethod
    def concat(parts: Sequence[BlockColumns]) -> BlockColumns:
        """Several parts of one communicator (e.g. a time slice cut by a block's end)."""
        if len(parts) == 1:
            return parts[0]
        p0 = parts[0]
        rows = {k: np.concatenate([p._np[k] for p in parts]) for k in p0._np}
        conns = tuple(np.concatenate([p._conns[i] for p in parts]) for i in range(len(p0._conns)))
        coff = np.zeros(len(rows[_IS_OP]) + 1, np.int64)
        np.cumsum(rows[_CONNS], out=coff[1:])
        src = [s for p in parts for s in p._src]
        blocks = [b for p in parts for b in p._block] if all(p._block for p in parts) else None
        return BlockColumns(p0.comm, p0.job, p0.comm_name, rows, conns, coff, src, None, blocks)


class _SliceObjects:
    """Event objects of a slice's rows, built for many communicators at once (a
    conversion costs about a millisecond whatever its size): the first rows asked for
    alone; at a second miss the whole slice (the first slices, where every rank is new
    to every communicator and each asks for its rows)."""

    __slots__ = ("_cache", "_ids", "_misses", "_rows", "_table")

    def __init__(self, table: pa.RecordBatch, rows: np.ndarray) -> None:
        self._table, self._rows = table, rows
        self._cache: dict[int, Event] = {}
        self._misses = 0
        self._ids: tuple[list[str], list[int | None], list[str | None]] | None = None

    def identities(self, pos: np.ndarray) -> tuple[list[str], list[int | None], list[str | None]]:
        """Host, GPU, NIC of the slice's rows ``pos`` (the slice's columns read once)."""
        if self._ids is None:
            self._ids = _identity_lists(self._table, self._rows)
        hosts, gpus, nics = self._ids
        want = pos.tolist()
        return [hosts[i] for i in want], [gpus[i] for i in want], [nics[i] for i in want]

    def get(self, pos: np.ndarray) -> list[Event]:
        cache = self._cache
        want = pos.tolist()
        missing = [p for p in want if p not in cache]
        if missing:
            self._misses += 1
            if self._misses == 1:
                fill = np.array(missing, np.int64)
            else:
                fill = np.arange(len(self._rows))
            fill = fill[[p not in cache for p in fill.tolist()]]
            events = table_events(self._table.take(pa.array(self._rows[fill], pa.int64())))
            cache.update(zip(fill.tolist(), events, strict=True))
        return [cache[p] for p in want]


class ArchiveBlock:
    """Consecutive archived messages of one file, as one set of columns
    (:class:`~streams.core.columns.ColumnBlockLike`): a *part* is one communicator's
    rows of one message (a message of several communicators is several parts, as
    :func:`~producers.columnar.split_by_comm` cuts it)."""

    __slots__ = ("_bounds", "_cname", "_cnames", "_code", "_coff", "_conns", "_ints", "_np",
                 "_table", "part_comm", "part_job", "part_n", "part_ts_hi",
                 "part_ts_lo")  # fmt: skip

    def __init__(
        self,
        table: pa.RecordBatch,
        rows: dict[str, np.ndarray],
        conns: tuple[np.ndarray, ...],
        coff: np.ndarray,
        bounds: np.ndarray,
        code: np.ndarray,
        names: list[str],
        cname: np.ndarray,
        cnames: list[str | None],
        part_job: list[str],
    ) -> None:
        self._table, self._np, self._conns, self._coff = table, rows, conns, coff
        self._ints: tuple[np.ndarray, ...] | None = None
        self._bounds, self._code = bounds, code
        self._cname, self._cnames = cname, cnames
        ts = rows["ts_us:-1"]
        starts = bounds[:-1]
        self.part_comm = [names[c] for c in code.tolist()]
        self.part_job = part_job
        self.part_ts_lo = np.minimum.reduceat(ts, starts).tolist()
        self.part_ts_hi = np.maximum.reduceat(ts, starts).tolist()
        self.part_n = np.diff(bounds).tolist()

    @property
    def ts_us(self) -> np.ndarray:
        """Every row's ``ts_us``, in arrival order."""
        return self._np["ts_us:-1"]

    @property
    def n(self) -> int:
        return self._table.num_rows

    @property
    def table(self) -> pa.RecordBatch:
        """The block's rows (parts in order) as Arrow."""
        return self._table

    def progress_conns(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """See :meth:`BlockColumns.progress_conns` (``rows``: the block's row numbers)."""
        if self._ints is None:  # once per block: the connections' integer fields
            flat = self._table.column("conns").flatten()
            self._ints = (
                flat.field("peer").to_numpy().astype(np.int64),
                np.asarray(
                    pc.equal(flat.field("dir"), "send").to_numpy(zero_copy_only=False), bool
                ),
                flat.field("bytes").to_numpy().astype(np.int64),
                pc.fill_null(flat.field("retrans"), 0).to_numpy().astype(np.int64),
            )
        lens = self._np[_CONNS][rows]
        off = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        flat_idx = np.repeat(self._coff[rows] - off[:-1], lens) + np.arange(int(off[-1]))
        return (off, *(a[flat_idx] for a in self._ints))

    def select(self, parts: np.ndarray) -> list[BlockColumns]:
        b = self._bounds
        codes = self._code[parts]
        uniq, first = np.unique(codes, return_index=True)
        appear = np.empty(len(uniq), np.int64)  # each code's rank by first appearance
        appear[np.argsort(first, kind="stable")] = np.arange(len(uniq))
        rank = appear[np.searchsorted(uniq, codes)]
        o = np.argsort(rank, kind="stable")  # parts grouped by communicator, in order
        ps = parts[o]
        lens = b[ps + 1] - b[ps]
        ends = np.cumsum(lens)
        rows = np.repeat(b[ps] - (ends - lens), lens) + np.arange(int(ends[-1]))
        got = {k: a[rows] for k, a in self._np.items()}
        cnt = got[_CONNS]
        goff = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(cnt, out=goff[1:])
        flat = np.repeat(self._coff[rows] - goff[:-1], cnt) + np.arange(int(goff[-1]))
        conns = tuple(a[flat] for a in self._conns)
        # each communicator's rows are one run of the gathered arrays
        group = np.flatnonzero(np.diff(rank[o], prepend=-1))
        lo = (ends - lens)[group].tolist() + [len(rows)]
        shared = _SliceObjects(self._table, rows)
        out: list[BlockColumns] = []
        for g, i in enumerate(ps[group].tolist()):
            r0, r1 = lo[g], lo[g + 1]
            c0, c1 = int(goff[r0]), int(goff[r1])
            cn = int(self._cname[rows[r0]])
            out.append(BlockColumns(
                self.part_comm[i], self.part_job[i], self._cnames[cn] if cn >= 0 else None,
                {key: a[r0:r1] for key, a in got.items()},
                tuple(a[c0:c1] for a in conns), goff[r0 : r1 + 1] - c0,
                [(self._table, rows[r0:r1])], (shared, r0), [self],
            ))  # fmt: skip
        return out


def cut_blocks(
    ordered: pa.RecordBatch,
    first_rows: np.ndarray,
    starts: np.ndarray,
    *,
    max_rows: int = 65_536,
    by_second: bool = True,
) -> Iterator[tuple[int, ArchiveBlock]]:
    """Validated rows of consecutive messages (message ``k`` starts at row
    ``starts[k]``; ``first_rows[k]`` is where it came from: its row in the file, its
    line) as blocks: ``(first_rows of the block's first message, the block)``. A block
    holds consecutive messages, at most ``max_rows`` rows (whole messages; at least
    one); with ``by_second``, only messages whose earliest ``ts_us`` falls in the same
    second — the key :func:`producers.sources.open_sources` merges the files of one
    directory by, so merging blocks orders the messages as merging them one by one
    would (a file read alone needs no such cut)."""
    n = ordered.num_rows
    code, names = _codes(ordered.column("comm"))
    ts = ordered.column("ts_us").to_numpy()
    msg_key = np.minimum.reduceat(ts, starts) // _GROUP_US
    msg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
    if (code != code[starts][msg]).any():
        # a message of several communicators: one part per communicator, in order of
        # first appearance, rows in order (as split_by_comm cuts a message)
        pos = np.arange(n)
        o = np.lexsort((pos, code, msg))
        new = np.ones(n, bool)
        new[1:] = (msg[o][1:] != msg[o][:-1]) | (code[o][1:] != code[o][:-1])
        first = np.empty(n, np.int64)
        first[o] = o[new][np.cumsum(new) - 1]
        order = np.lexsort((pos, first))  # first lies inside its message: messages keep order
        ordered, code, msg = ordered.take(pa.array(order)), code[order], msg[order]
        pstart = np.flatnonzero((np.diff(msg, prepend=-1) != 0) | (np.diff(code, prepend=-1) != 0))
    else:
        pstart = starts
    part_msg = msg[pstart]
    jcode, jobs = _codes(ordered.column("job"))
    cname, cnames = _codes(ordered.column("comm_name"))
    rows, conns = core_arrays(ordered)
    *flat, off = conns.values()  # core_arrays: peer, send, bytes, time, then offsets
    bounds = np.append(pstart, n)
    part_key = msg_key[part_msg]
    runs = (
        np.flatnonzero(np.diff(part_key, prepend=part_key[0] - 1)).tolist() if by_second else [0]
    ) + [len(pstart)]
    msg_start = np.flatnonzero(np.diff(part_msg, prepend=-1))  # parts that begin a message
    for ra, rb in zip(runs[:-1], runs[1:], strict=True):
        a = ra
        while a < rb:
            # whole messages up to max_rows rows (at least one message)
            b = int(np.searchsorted(bounds, bounds[a] + max_rows, side="right")) - 1
            if b < rb:
                b = int(msg_start[np.searchsorted(msg_start, b, side="right") - 1])
            b = min(b, rb)
            if b <= a:
                nxt = np.searchsorted(msg_start, a, side="right")
                b = min(int(msg_start[nxt]) if nxt < len(msg_start) else rb, rb)
            lo, hi = int(bounds[a]), int(bounds[b])
            o0, o1 = int(off[lo]), int(off[hi])
            block = ArchiveBlock(
                ordered.slice(lo, hi - lo),
                {k: v[lo:hi] for k, v in rows.items()},
                tuple(v[o0:o1] for v in flat),
                off[lo : hi + 1] - o0,
                bounds[a : b + 1] - lo,
                code[pstart[a:b]],
                names,
                cname[lo:hi],
                cnames,
                [jobs[j] for j in jcode[pstart[a:b]].tolist()],
            )
            yield int(first_rows[part_msg[a]]), block
            a = b


def json_blocks(
    messages: Iterable[tuple[int, Sequence[Event]]],
    *,
    max_rows: int = 65_536,
    by_second: bool = True,
) -> Iterator[tuple[int, ArchiveBlock | Sequence[Event]]]:
    """Decoded JSON messages (where each came from, e.g. its line; its events) as blocks,
    as :func:`cut_blocks` cuts the archive's: the events of up to ``max_rows`` rows of
    messages become columns in one pass. A stretch with a value its column cannot hold
    (a ``rank`` beyond ``int32``, which the edge refuses) comes out message by message
    as the events themselves."""
    buf: list[Event] = []
    marks: list[tuple[int, int]] = []  # (where from, first row)

    def flush() -> Iterator[tuple[int, ArchiveBlock | Sequence[Event]]]:
        try:
            batch = events_table(buf).combine_chunks().to_batches()[0]
        except (OverflowError, pa.ArrowInvalid):
            ends = [m[1] for m in marks[1:]] + [len(buf)]
            for (pos, a), b in zip(marks, ends, strict=True):
                yield pos, buf[a:b]
        else:
            first = np.array([m[0] for m in marks], np.int64)
            starts = np.array([m[1] for m in marks], np.int64)
            yield from cut_blocks(batch, first, starts, max_rows=max_rows, by_second=by_second)
        buf.clear()
        marks.clear()

    for pos, events in messages:
        if not events:
            continue
        marks.append((pos, len(buf)))
        buf.extend(events)
        if len(buf) >= max_rows:
            yield from flush()
    if buf:
        yield from flush()
