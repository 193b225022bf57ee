"""PyTorch Flight Recorder dumps → contract ``progress`` and ``op`` events.

PyTorch keeps a ring buffer of each process group's last collectives
(``TORCH_FR_BUFFER_SIZE``, alias ``TORCH_NCCL_TRACE_BUFFER_SIZE``, default 2000) and
dumps it per rank to ``<TORCH_FR_DUMP_TEMP_FILE><rank>`` (default
``~/.cache/torch/comm_lib_trace_rank_<rank>``; older releases: ``/tmp/nccl_trace_rank_``):
a pickle of builtin dicts/lists/tuples/str/int/float/bool/None (pickled without type
tags) or, from the JSON API, the same document as JSON with the ``pg_config``/
``pg_status`` values as strings and absent timestamps as ``0``. Keys read
(``torch/csrc/distributed/c10d/FlightRecorder.hpp``, dump ``version`` "2.x"; checked
against real torch 2.15 gloo dumps, version "2.10"):

* ``pg_config``: ``{group_name: {"name", "desc", "ranks": "[0, 1, …]"}}`` — unusable
  from ProcessGroupGloo (``{'': {'name': '', 'ranks': '[0, 1]'}}`` on every rank), so
  membership also comes from the snapshot's entries (:func:`group_members`)
* ``pg_status``: ``{str(pg_id): {"last_enqueued_collective", "last_started_collective",
  "last_completed_collective"}}`` (gloo keeps ``last_started_collective`` at -1)
* ``entries``: ``[{"pg_id", "process_group": (name, desc), "collective_seq_id",
  "p2p_seq_id", "op_id", "profiling_name", "time_created_ns",
  "time_discovered_started_ns", "time_discovered_completed_ns", "duration_ms"?,
  "input_sizes", "input_dtypes", "state": scheduled|started|completed, "retired",
  "is_p2p", "timeout_ms", …}]`` (gloo: always ``scheduled``, no discovered times,
  ``retired`` once its work ended)

Mapping, per process group (communicator ``comm`` = group name):

* one ``progress`` event at the dump time: ``started`` = ``last_started_collective``, or
  ``last_enqueued_collective`` where the backend records no starts (gloo);
  ``completed`` = ``last_completed_collective`` (negative "none yet" → 0; from the
  entries when ``pg_status`` is missing); ``inflight_op``/``inflight_us`` from the oldest
  collective started and not finished;
* one ``op`` event per finished collective (entries of one coalesced launch share a
  ``collective_seq_id`` and are merged): ``seq`` = ``collective_seq_id``, ``op`` from
  ``profiling_name`` (``nccl:all_reduce`` → ``AllReduce``), ``bytes`` from
  ``input_sizes`` × dtype size, ``exec_us`` = ``duration_ms``·1000 (needs
  ``TORCH_NCCL_ENABLE_TIMING=1``) else the watchdog's discovered completed − started
  else 0 (gloo), ``ts_us`` = discovered completion time, else (gloo) the enqueue time.

The dump time is not in the file: it is the newest timestamp in the entries, moved up
to the file's mtime when that lies within the largest ``timeout_ms`` (+1 min) after it —
a watchdog dump is written right after the timeout, a copied file is not trusted.

A snapshot's dumps read together (:func:`read_snapshot_with_facts`) also tell
(:class:`SnapshotFacts`) each group's members by name across ranks, the members that
left no dump or an empty one, the sends/receives a rank had not finished (NCCL names
them ``nccl:send <me>-><peer>``; gloo records none), and whether the dump time is known.

What it cannot tell: the hostname (``host`` is ``host-rank<N>``, PyTorch's analyzer's
``host_rank<N>`` made a valid RFC 1123 name, unless the dump carries a ``hostname``),
GPU and NIC, per-connection traffic, anything older than the ring buffer; p2p
operations give no ``op`` events (``p2p_seq_id`` does not match across ranks).

>>> dump = {"version": "2.4", "pg_config": {"0": {"name": "0", "desc": "default_pg",
...         "ranks": "[0, 1]"}}, "pg_status": {"0": {"last_enqueued_collective": 2,
...         "last_started_collective": 2, "last_completed_collective": 1}},
...         "entries": [_example_entry(1, "completed"), _example_entry(2, "started")]}
>>> for ev in dump_to_events(dump, rank=1, job="j", file_mtime_us=None):
...     print(type(ev).__name__, ev.comm, ev.rank)
OpEvent 0 1
ProgressEvent 0 1
>>> [e for e in dump_to_events(dump, rank=1, job="j", file_mtime_us=None)][1].inflight_op
'AllReduce'
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from producers.events import Event, OpEvent, ProgressEvent
from producers.formats.fr_dump import (
    FlightRecorderError,
    _dump_time_us,
    _int,
    _pg_name,
    _ranks,
    _records_starts,
    _ts_ns,
    default_host,
    load_flight_recorder_dump,
    looks_like_flight_recorder,
    rank_from_filename,
)
from producers.formats.fr_facts import (
    GroupFacts,
    P2PWait,
    SnapshotFacts,
    group_members,
    snapshot_facts,
)
from producers.guard import host_problem
from producers.traces import BadLine

__all__ = [
    "FlightRecorderError",
    "GroupFacts",
    "LoadedDump",
    "P2PWait",
    "SnapshotFacts",
    "default_host",
    "dump_to_events",
    "load_flight_recorder_dump",
    "looks_like_flight_recorder",
    "rank_from_filename",
    "group_members",
    "read_flight_recorder",
    "read_flight_recorder_snapshot",
    "read_snapshot_with_facts",
    "snapshot_facts",
]


_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
    "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16,
    "ComplexHalf": 4, "UInt16": 2, "UInt32": 4, "UInt64": 8,
    "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
    "Float8_e8m0fnu": 1,
}  # fmt: skip

_OP_NAMES = {
    "all_reduce": "AllReduce", "allreduce": "AllReduce", "all_reduce_coalesced": "AllReduce",
    "allreduce_coalesced": "AllReduce", "all_gather": "AllGather", "allgather": "AllGather",
    "_allgather_base": "AllGather", "_all_gather_base": "AllGather",
    "all_gather_into_tensor_coalesced": "AllGather",
    "allgather_into_tensor_coalesced": "AllGather", "allgather_coalesced": "AllGather",
    "reduce_scatter": "ReduceScatter", "_reduce_scatter_base": "ReduceScatter",
    "reduce_scatter_tensor_coalesced": "ReduceScatter", "broadcast": "Broadcast",
    "reduce": "Reduce", "all_to_all": "AllToAll", "alltoall": "AllToAll",
    "alltoall_base": "AllToAll", "all_to_all_single": "AllToAll", "send": "Send",
    "recv": "Recv", "barrier": "Barrier", "gather": "Gather", "scatter": "Scatter",
    # names the analyzer knows too (torch/distributed/flight_recorder/components/types.py)
    "all_gather_single": "AllGather", "all_gather_v": "AllGather",
    "reduce_scatter_single": "ReduceScatter", "reduce_scatter_v": "ReduceScatter",
    "all_to_all_v_single": "AllToAll", "all_reduce_barrier": "Barrier",
    "_broadcast_oop": "Broadcast", "_reduce_oop": "Reduce",
}  # fmt: skip


def _op_name(profiling_name: Any) -> str:
    """``nccl:all_reduce`` → ``AllReduce``; unknown names pass through without prefix.

    A coalesced launch ends, from dump version 2.7, in an entry named after its op
    (``nccl:ALLGATHER_coalesced``, ``nccl:allreduce_coalesced``), before in
    ``nccl:coalesced`` (which passes through).

    >>> _op_name("nccl:ALLGATHER_coalesced"), _op_name("nccl:coalesced")
    ('AllGather', 'coalesced')

    The other names PyTorch's analyzer lists as collectives map to their op as well:

    >>> [_op_name(n) for n in ("nccl:all_gather_single", "nccl:reduce_scatter_v",
    ...                        "nccl:all_to_all_v_single", "nccl:_broadcast_oop",
    ...                        "gloo:all_reduce_barrier", "nccl2:_reduce_oop")]
    ['AllGather', 'ReduceScatter', 'AllToAll', 'Broadcast', 'Barrier', 'Reduce']
    """
    name = str(profiling_name or "unknown")
    short = name.split(":", 1)[1] if ":" in name else name
    key = short.lower()
    base = key.removesuffix("_coalesced")
    return _OP_NAMES.get(key) or _OP_NAMES.get(base) or short or "unknown"


def _bytes_of(entry: dict[str, Any]) -> int:
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    total = 0
    for i, shape in enumerate(sizes):
        if not isinstance(shape, (list, tuple)):
            continue
        n = math.prod(int(d) for d in shape if isinstance(d, int) and d >= 0)
        dtype = dtypes[i] if i < len(dtypes) else None
        total += n * _DTYPE_BYTES.get(str(dtype), 4)  # unknown dtype: counted as 4 bytes
    return total


def _example_entry(seq: int, state: str) -> dict[str, Any]:
    """A minimal entry for the doctest above (times in ns)."""
    t = 1_750_000_000_000_000_000 + seq * 1_000_000_000
    return {
        "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
        "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce",
        "time_created_ns": t, "time_discovered_started_ns": t + 1000,
        "time_discovered_completed_ns": t + 5_000_000 if state == "completed" else None,
        "input_sizes": [[1024]], "input_dtypes": ["Float"], "state": state,
        "is_p2p": False, "timeout_ms": 600000,
    }  # fmt: skip


def dump_to_events(
    dump: dict[str, Any],
    *,
    rank: int,
    job: str,
    file_mtime_us: int | None,
    host: str | None = None,
    on_problem: Callable[[str], None] | None = None,
    members: dict[str, list[int]] | None = None,
    trust_time: bool = False,
) -> list[Event]:
    """Map one rank's dump to events: ``op`` events in completion order, then one
    ``progress`` event per process group at the dump time.

    ``members`` (group name → global ranks, from :func:`group_members` over all the
    snapshot's dumps) is used where ``pg_config`` has no rank list holding this rank.
    ``on_problem`` hears about process groups that still cannot be mapped; their events
    are skipped. ``trust_time``: ``file_mtime_us`` is the dump time given by the user
    (``--dump-time``), not an mtime to check.
    """
    rank = _int(dump.get("rank"), rank) or rank
    host = host or str(dump.get("hostname") or default_host(rank))
    if (bad_host := host_problem(host)) is not None:  # refused here, not downstream
        raise FlightRecorderError(bad_host)
    entries = [e for e in (dump.get("entries") or []) if isinstance(e, dict)]
    pg_config = dump.get("pg_config") or {}
    pg_status = dump.get("pg_status") or {}
    now_us = _dump_time_us(entries, file_mtime_us, trust_time)
    with_starts = _records_starts(entries)

    # pg_id → (name, desc): pg_status is keyed by the rank's local pg_id, entries carry
    # the group's global name. A pg_id without entries is named only if pg_config knows it.
    names: dict[str, tuple[str, str]] = {}
    for e in entries:
        names.setdefault(str(e.get("pg_id")), _pg_name(e))
    pg_ids = list(names)
    if isinstance(pg_status, dict) and isinstance(pg_config, dict):
        pg_ids += [str(k) for k in pg_status if str(k) not in names and str(k) in pg_config]

    out_ops: list[OpEvent] = []
    out_progress: list[ProgressEvent] = []
    for pg_id in pg_ids:
        name, desc = names.get(pg_id, (pg_id, ""))
        info = pg_config.get(name) if isinstance(pg_config, dict) else None
        ranks = (members or {}).get(name) or _ranks(info)
        if not ranks:
            if on_problem is not None:
                on_problem(
                    f"process group {name!r} (pg_id {pg_id}) has no rank list in pg_config; "
                    "read all ranks' dumps together so membership comes from their entries"
                )
            continue
        if rank not in ranks:
            if on_problem is not None:
                on_problem(f"rank {rank} is not in process group {name!r} ranks {ranks}")
            continue
        ident = {
            "v": 1,
            "job": job,
            "comm": name,
            "nranks": len(ranks),
            "rank": ranks.index(rank),
            "host": host,
            "comm_name": desc or None,
        }
        mine = [e for e in entries if str(e.get("pg_id")) == pg_id and not e.get("is_p2p")]
        out_ops.extend(_op_events(mine, ident, with_starts))
        out_progress.append(
            _progress_event(mine, ident, pg_status.get(pg_id) if isinstance(pg_status, dict)
                            else None, with_starts, now_us)
        )  # fmt: skip
    out_ops.sort(key=lambda ev: ev.ts_us)
    return [*out_ops, *out_progress]


def _op_events(
    mine: list[dict[str, Any]], ident: dict[str, Any], with_starts: bool
) -> list[OpEvent]:
    """One op event per finished collective_seq_id (coalesced entries merged).

    Finished: ``state == "completed"`` where the backend records states (NCCL), else
    ``retired`` (gloo retires an entry when its work ends). Without a recorded
    completion, ``ts_us`` is the enqueue time (``time_created_ns``, the rank's arrival
    at the collective) and ``exec_us`` 0 (not timed): readers of untimed ops take
    ``ts_us`` as the arrival time.
    """
    done: dict[int, OpEvent] = {}
    for e in mine:
        seq = _int(e.get("collective_seq_id"), 0) or 0
        if seq <= 0:
            continue
        created_ns = _ts_ns(e.get("time_created_ns"))
        end_ns = _ts_ns(e.get("time_discovered_completed_ns"))
        if with_starts:
            if e.get("state") != "completed" or end_ns is None:
                continue
        elif not e.get("retired") or created_ns is None:
            continue
        start_ns = _ts_ns(e.get("time_discovered_started_ns"))
        duration = e.get("duration_ms")
        if isinstance(duration, (int, float)) and math.isfinite(duration) and duration >= 0:
            exec_us = float(duration) * 1000.0
        elif start_ns is not None and end_ns is not None:
            exec_us = max(0.0, (end_ns - start_ns) / 1000.0)
        else:
            exec_us = 0.0
        nbytes = _bytes_of(e)
        prev = done.get(seq)
        if prev is not None:  # same launch, another op of a coalesced group
            done[seq] = msgspec.structs.replace(
                prev, bytes=prev.bytes + nbytes, exec_us=max(prev.exec_us, exec_us)
            )
            continue
        done[seq] = OpEvent(
            **ident,
            ts_us=(end_ns or created_ns or 0) // 1000,
            op=_op_name(e.get("profiling_name")),
            seq=seq,
            bytes=nbytes,
            exec_us=exec_us,
        )
    return list(done.values())


def _progress_event(
    mine: list[dict[str, Any]],
    ident: dict[str, Any],
    status: Any,
    with_starts: bool,
    now_us: int,
) -> ProgressEvent:
    """Counters from ``pg_status`` (else from the entries) and the in-flight collective.

    ``started``: ``last_started_collective``; where the backend records no starts (gloo
    keeps it at -1) ``last_enqueued_collective``, since a gloo collective runs once
    enqueued. In flight: the oldest collective started and not finished, timed from its
    discovered start (NCCL) or its enqueue (gloo).
    """
    seqs = [(_int(e.get("collective_seq_id"), 0) or 0, e) for e in mine]
    if with_starts:
        started_seqs = [s for s, e in seqs if e.get("state") in ("started", "completed")]
        completed_seqs = [s for s, e in seqs if e.get("state") == "completed"]
    else:
        started_seqs = [s for s, _ in seqs]
        completed_seqs = [s for s, e in seqs if e.get("retired")]
    if isinstance(status, dict):
        started = _int(status.get("last_started_collective"), -1)
        if started is None or started < 0 or not with_starts:
            started = max(started or 0, _int(status.get("last_enqueued_collective"), 0) or 0)
        completed = _int(status.get("last_completed_collective"), 0) or 0
    else:
        started = max(started_seqs, default=0)
        completed = max(completed_seqs, default=0)
    started, completed = max(started, 0), max(completed, 0)
    if with_starts:
        inflight = [
            (s, _ts_ns(e.get("time_discovered_started_ns")), e)
            for s, e in seqs
            if e.get("state") == "started" and _ts_ns(e.get("time_discovered_started_ns"))
        ]
    else:
        inflight = [(s, _ts_ns(e.get("time_created_ns")), e) for s, e in seqs
                    if completed < s <= started and not e.get("retired")
                    and _ts_ns(e.get("time_created_ns"))]  # fmt: skip
    inflight_op = inflight_us = None
    if inflight:
        _, began_ns, oldest = min(inflight, key=lambda x: x[0])
        inflight_op = _op_name(oldest.get("profiling_name"))
        inflight_us = float(max(0, now_us - (began_ns or 0) // 1000))
    return ProgressEvent(
        **ident,
        ts_us=now_us,
        started=started,
        completed=min(completed, started),
        inflight_op=inflight_op,
        inflight_us=inflight_us,
    )


@dataclass(frozen=True, slots=True)
class LoadedDump:
    """A dump already read: its data, its file's mtime, and the wall time an exporter
    first saw it whole (``None``: not seen being written, e.g. there before it started)."""

    data: dict[str, Any]
    mtime_us: int
    seen_us: int | None = None


def read_flight_recorder(
    path: str | Path,
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
) -> list[Event]:
    """Read one rank's dump file on its own; a bad file goes to ``on_bad`` (line 0).

    Group membership then comes from ``pg_config`` only; read a snapshot's dumps
    together (:func:`read_flight_recorder_snapshot`) for dumps whose ``pg_config`` is
    unusable (ProcessGroupGloo)."""
    return read_flight_recorder_snapshot([Path(path)], job=job, on_bad=on_bad)[0][1]


def read_flight_recorder_snapshot(
    paths: list[Path],
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
    dump_time_us: int | None = None,
) -> list[tuple[Path, list[Event]]]:
    """Read one snapshot (every rank's dump taken at one moment) into events per file
    (:func:`read_snapshot_with_facts` without the facts)."""
    return read_snapshot_with_facts(paths, job=job, on_bad=on_bad, dump_time_us=dump_time_us)[0]


def read_snapshot_with_facts(
    paths: list[Path],
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
    dump_time_us: int | None = None,
    loaded: dict[Path, LoadedDump] | None = None,
    host: str | None = None,
) -> tuple[list[tuple[Path, list[Event]]], SnapshotFacts]:
    """Read one snapshot into events per file, and what the dumps say together.

    Membership of each process group comes from the dumps together
    (:func:`snapshot_facts`). A file that cannot be read, or a second dump of a rank
    already read, goes to ``on_bad`` (line 0) and gives no events. ``dump_time_us``
    (``detect --dump-time``) stands for every dump's time, when mtimes cannot be
    trusted. ``loaded``: dumps already read (the exporter reads each once, to know it is
    complete), with the wall time it first saw each one whole, which is then that
    dump's time. ``host``: the host of every rank (an exporter's own), for dumps that
    name none.
    """
    reads: list[tuple[Path, int, dict[str, Any], int]] = []
    out: dict[Path, list[Event]] = {p: [] for p in paths}
    seen: dict[int, Path] = {}

    def bad(path: Path, reason: str) -> None:
        if on_bad is not None:
            on_bad(BadLine(str(path), 0, b"", reason))

    given = loaded or {}
    seen_us: dict[int, int] = {}
    for path in paths:
        try:
            pre = given.get(path)
            dump = pre.data if pre is not None else load_flight_recorder_dump(path)
            rank = rank_from_filename(path) if "rank" not in dump else int(dump["rank"])
            mtime_us = pre.mtime_us if pre is not None else os.stat(path).st_mtime_ns // 1000
        except (FlightRecorderError, OSError, TypeError, ValueError) as err:
            bad(path, str(err))
            continue
        if rank in seen:
            bad(path, f"a second dump of rank {rank} in this snapshot (first: {seen[rank]}); "
                      "skipped — keep one format per directory")  # fmt: skip
            continue
        seen[rank] = path
        if pre is not None and pre.seen_us is not None:
            seen_us[rank] = pre.seen_us
        reads.append((path, rank, dump, mtime_us))
    dumps = {r: d for _, r, d, _ in reads}
    facts = snapshot_facts(dumps, {r: m for _, r, _, m in reads}, dump_time_us, set(seen_us))
    # One dump alone cannot tell who else is in its groups.
    members = {g.name: g.members for g in facts.groups.values()} if len(reads) > 1 else None
    for path, rank, dump, mtime_us in reads:
        when = dump_time_us if dump_time_us is not None else seen_us.get(rank, mtime_us)
        try:
            out[path] = dump_to_events(
                dump, rank=rank, job=job, file_mtime_us=when, members=members, host=host,
                on_problem=lambda reason, p=path: bad(p, reason),
                trust_time=dump_time_us is not None or rank in seen_us,
            )  # fmt: skip
        except (msgspec.ValidationError, TypeError, ValueError, AttributeError) as err:
            bad(path, f"unexpected dump content: {type(err).__name__}: {err}")
            continue
        for ev in out[path]:
            facts.hosts.setdefault(rank, ev.host)
    return list(out.items()), facts
