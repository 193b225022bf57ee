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

import io
import json
import math
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from producers.events import Event, OpEvent, ProgressEvent
from producers.guard import host_problem
from producers.traces import BadLine

__all__ = [
    "FlightRecorderError",
    "GroupFacts",
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


@dataclass(slots=True)
class GroupFacts:
    """One process group of a snapshot, as all its dumps together tell it."""

    name: str
    desc: str
    members: list[int]
    """Global ranks, sorted (a group's local rank is its index here)."""
    size: int
    """The group's size where the dumps record it (``pg_config``, an all-gather's
    outputs, the world), else ``len(members)``; larger than ``members`` when a member's
    dump is missing and it cannot be told which rank that is."""


@dataclass(slots=True)
class P2PWait:
    """A send or receive a rank had not finished at its dump (NCCL records them)."""

    group: str
    rank: int
    """Global rank that waits."""
    peer: int | None
    """Global rank it sends to or receives from (``None``: not in the name)."""
    op: str
    """``send`` or ``recv``."""
    since_ns: int


@dataclass(slots=True)
class SnapshotFacts:
    """What a snapshot's dumps say together beyond the events: who is in which group,
    who left no dump or an empty one, unfinished sends/receives, and whether the dump
    time is known (a trusted mtime on every dump, or ``--dump-time``)."""

    groups: dict[str, GroupFacts] = field(default_factory=dict)
    absent: dict[int, str] = field(default_factory=dict)
    """Global rank → why it has nothing to say (``no dump`` or ``empty dump``)."""
    hosts: dict[int, str] = field(default_factory=dict)
    p2p_waits: list[P2PWait] = field(default_factory=list)
    p2p_recorded: bool = False
    """Whether any dump records sends/receives (NCCL does, gloo does not)."""
    dump_time_known: bool = True
    why_time_unknown: str = ""


class FlightRecorderError(ValueError):
    """A file is not a readable Flight Recorder dump.

    The file is reported as bad input (``file:0: reason``) and skipped. A dump that
    needs a class to unpickle is refused on purpose: real dumps hold only builtin
    containers and scalars, so such a file is either not a dump or was tampered with.
    """


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles builtin containers and scalars only: every class lookup is refused.

    ``find_class`` is the only way a pickle can reach a callable (GLOBAL, STACK_GLOBAL,
    INST, OBJ and the copyreg extension codes all go through it), so refusing it
    refuses code execution.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise FlightRecorderError(
            f"refused to unpickle {module}.{name}: Flight Recorder dumps hold only builtin "
            "containers and scalars, so this file is not a dump or was tampered with"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise FlightRecorderError("refused a persistent id: not a Flight Recorder dump")


def _loads_restricted(data: bytes) -> Any:
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def looks_like_flight_recorder(head: bytes) -> bool:
    """Whether the first bytes of a file look like a Flight Recorder dump.

    >>> looks_like_flight_recorder(b'{"comm_lib_version":"2.21.5","entries":[')
    True
    >>> looks_like_flight_recorder(b'{"header":{"id":"0x1"')
    False
    """
    s = head.lstrip()
    if s.startswith(b"\x80"):  # pickle protocol >= 2
        return True
    return s.startswith(b"{") and any(
        k in s for k in (b'"pg_config"', b'"pg_status"', b'"entries"', b'"comm_lib_version"')
    )


def load_flight_recorder_dump(path: str | Path) -> dict[str, Any]:
    """Load one dump (pickle or JSON) as plain Python data; raises FlightRecorderError."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise FlightRecorderError(f"cannot read: {err}") from None
    stripped = data.lstrip()
    try:
        if stripped.startswith(b"{"):
            dump = json.loads(stripped)
        elif stripped.startswith(b"\x80"):
            dump = _loads_restricted(data)
        else:
            raise FlightRecorderError("neither a pickle nor a JSON object")
    except FlightRecorderError:
        raise
    except (
        pickle.UnpicklingError,
        ValueError,
        EOFError,
        TypeError,
        IndexError,
        RecursionError,  # deep nesting in a JSON dump
    ) as err:
        raise FlightRecorderError(f"corrupt dump: {type(err).__name__}: {err}") from None
    if not isinstance(dump, dict):
        raise FlightRecorderError(f"dump is a {type(dump).__name__}, expected a dict")
    if not any(k in dump for k in ("entries", "pg_status", "pg_config")):
        raise FlightRecorderError("no entries, pg_status or pg_config: not a Flight Recorder dump")
    return dump


_RANK_AFTER = re.compile(r"(?:rank_?|_dump_)(\d+)(?!.*(?:rank_?|_dump_)\d)", re.IGNORECASE)
_RANK_AT_END = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle|bin))?$")


def rank_from_filename(path: str | Path) -> int:
    """The global rank PyTorch put in the dump's file name.

    PyTorch writes ``<prefix><rank>``: ``_dump_<rank>`` (the watchdog's file writer with
    ``TORCH_FR_DUMP_TEMP_FILE=…/_dump_``), ``nccl_trace_rank_<rank>`` (older releases),
    ``comm_lib_trace_rank_<rank>`` (the default since 2.7), or any prefix the job chose;
    a host name in the prefix or after the rank (``…rank_3_node-07``) is no rank.

    >>> rank_from_filename("/tmp/nccl_trace_rank_12"), rank_from_filename("dump_rank_3.json")
    (12, 3)
    >>> rank_from_filename("_dump_7"), rank_from_filename("comm_lib_trace_rank_5_gpu-node07")
    (7, 5)
    >>> rank_from_filename("node12.cluster_fr_3")
    3
    """
    name = Path(path).name
    m = _RANK_AFTER.search(name) or _RANK_AT_END.search(name)
    if not m:
        raise FlightRecorderError(
            "no rank at the end of the file name (PyTorch writes <prefix><rank>, "
            "e.g. nccl_trace_rank_3); rename the file so it ends in its rank"
        )
    return int(m.group(1))


# c10::toString(ScalarType) names → bytes per element.
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
}  # fmt: skip


def default_host(rank: int) -> str:
    """The host of a rank whose dump names none: PyTorch's analyzer's ``host_rank<N>``
    made a valid RFC 1123 name."""
    return f"host-rank{rank}"


def _op_name(profiling_name: Any) -> str:
    """``nccl:all_reduce`` → ``AllReduce``; unknown names pass through without prefix."""
    name = str(profiling_name or "unknown")
    short = name.split(":", 1)[1] if ":" in name else name
    return _OP_NAMES.get(short, short or "unknown")


def _int(value: Any, default: int | None = None) -> int | None:
    # JSON dumps write pg_status values as strings and absent timestamps as 0.
    if value is None or isinstance(value, bool):
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _ts_ns(value: Any) -> int | None:
    v = _int(value)
    return v if v else None  # 0 means "not yet" in JSON dumps


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


def _pg_name(entry: dict[str, Any]) -> tuple[str, str]:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(entry.get("pg_id", "")), ""


def _ranks(pg_info: Any) -> list[int] | None:
    if not isinstance(pg_info, dict):
        return None
    ranks = pg_info.get("ranks")
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except (ValueError, RecursionError):
            return None
    if isinstance(ranks, (list, tuple)) and all(isinstance(r, int) for r in ranks):
        return list(ranks)
    return None


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


_TIME_KEYS = ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns")


def _dump_time_us(
    entries: list[dict[str, Any]], file_mtime_us: int | None, trust: bool = False
) -> int:
    newest_ns = 0
    timeout_ms = 0
    for e in entries:
        for key in _TIME_KEYS:
            newest_ns = max(newest_ns, _ts_ns(e.get(key)) or 0)
        timeout_ms = max(timeout_ms, _int(e.get("timeout_ms"), 0) or 0)
    if newest_ns == 0:
        return file_mtime_us or 0
    newest = newest_ns // 1000
    if trust and file_mtime_us is not None:
        return max(file_mtime_us, newest)
    if file_mtime_us is None or file_mtime_us < newest:
        return newest
    cap = (timeout_ms or 600_000) * 1000 + 60_000_000
    return file_mtime_us if file_mtime_us <= newest + cap else newest


def group_members(dumps: dict[int, dict[str, Any]]) -> dict[str, list[int]]:
    """Which global ranks belong to each process group, read from the dumps themselves:
    a group's members are the ranks whose dumps hold entries of it.

    ProcessGroupGloo's ``pg_config`` is unusable (every rank writes
    ``{'': {'name': '', 'ranks': '[0, 1]'}}`` whatever groups exist, observed with torch
    2.15), but every entry names its group in ``process_group``. A rank whose dump is
    missing, or whose ring no longer holds any entry of a group, is not seen as a member.

    >>> e = lambda g: {"process_group": (g, ""), "collective_seq_id": 1}
    >>> group_members({0: {"entries": [e("0"), e("1")]}, 1: {"entries": [e("0")]},
    ...                2: {"entries": [e("0"), e("1")]}})
    {'0': [0, 1, 2], '1': [0, 2]}
    """
    members: dict[str, set[int]] = {}
    for rank, dump in dumps.items():
        for e in dump.get("entries") or []:
            if isinstance(e, dict):
                members.setdefault(_pg_name(e)[0], set()).add(rank)
    return {name: sorted(rs) for name, rs in sorted(members.items())}


def _records_starts(entries: list[dict[str, Any]]) -> bool:
    """Whether the backend records when a collective starts (ProcessGroupNCCL's watchdog
    does; ProcessGroupGloo leaves every entry ``scheduled`` with no discovered times)."""
    return any(
        e.get("state") in ("started", "completed") or _ts_ns(e.get("time_discovered_started_ns"))
        for e in entries
    )


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
) -> tuple[list[tuple[Path, list[Event]]], SnapshotFacts]:
    """Read one snapshot into events per file, and what the dumps say together.

    Membership of each process group comes from the dumps together
    (:func:`snapshot_facts`). A file that cannot be read, or a second dump of a rank
    already read, goes to ``on_bad`` (line 0) and gives no events. ``dump_time_us``
    (``detect --dump-time``, or the time an exporter saw the files) stands for every
    dump's time, when mtimes cannot be trusted.
    """
    loaded: list[tuple[Path, int, dict[str, Any], int]] = []
    out: dict[Path, list[Event]] = {p: [] for p in paths}
    seen: dict[int, Path] = {}

    def bad(path: Path, reason: str) -> None:
        if on_bad is not None:
            on_bad(BadLine(str(path), 0, b"", reason))

    for path in paths:
        try:
            dump = load_flight_recorder_dump(path)
            rank = rank_from_filename(path) if "rank" not in dump else int(dump["rank"])
            mtime_us = os.stat(path).st_mtime_ns // 1000
        except (FlightRecorderError, OSError, TypeError, ValueError) as err:
            bad(path, str(err))
            continue
        if rank in seen:
            bad(path, f"a second dump of rank {rank} in this snapshot (first: {seen[rank]}); "
                      "skipped — keep one format per directory")  # fmt: skip
            continue
        seen[rank] = path
        loaded.append((path, rank, dump, mtime_us))
    dumps = {r: d for _, r, d, _ in loaded}
    facts = snapshot_facts(dumps, {r: m for _, r, _, m in loaded}, dump_time_us)
    # One dump alone cannot tell who else is in its groups.
    members = {g.name: g.members for g in facts.groups.values()} if len(loaded) > 1 else None
    for path, rank, dump, mtime_us in loaded:
        when = dump_time_us if dump_time_us is not None else mtime_us
        try:
            out[path] = dump_to_events(
                dump, rank=rank, job=job, file_mtime_us=when, members=members,
                on_problem=lambda reason, p=path: bad(p, reason),
                trust_time=dump_time_us is not None,
            )  # fmt: skip
        except (msgspec.ValidationError, TypeError, ValueError, AttributeError) as err:
            bad(path, f"unexpected dump content: {type(err).__name__}: {err}")
            continue
        for ev in out[path]:
            facts.hosts.setdefault(rank, ev.host)
    return list(out.items()), facts


def _entries(dump: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in (dump.get("entries") or []) if isinstance(e, dict)]


def _mtime_trusted(entries: list[dict[str, Any]], mtime_us: int | None) -> bool:
    """Whether a file's mtime can be its dump time (see :func:`_dump_time_us`)."""
    if mtime_us is None or not entries:
        return False
    return _dump_time_us(entries, mtime_us) == mtime_us


_GATHERS = ("all_gather", "allgather", "_allgather_base", "_all_gather_base", "gather")


def _group_size_seen(entries: list[dict[str, Any]]) -> int | None:
    """A group's size as an all-gather records it: its outputs hold one input per member
    (numel of the outputs over numel of the input; gloo writes one stacked tensor
    ``[n, …]``, NCCL a list of tensors or a flat buffer)."""
    for e in entries:
        name = str(e.get("profiling_name") or "")
        short = name.split(":", 1)[-1]
        if not short.startswith(_GATHERS) or "coalesced" in short or e.get("is_p2p"):
            continue

        def numel(sizes: Any) -> int:
            return sum(
                math.prod(int(d) for d in s if isinstance(d, int))
                for s in (sizes or [])
                if isinstance(s, (list, tuple))
            )

        n_in, n_out = numel(e.get("input_sizes")), numel(e.get("output_sizes"))
        if n_in > 0 and n_out >= n_in and n_out % n_in == 0:
            return n_out // n_in
    return None


def snapshot_facts(
    dumps: dict[int, dict[str, Any]],
    mtimes_us: dict[int, int] | None = None,
    dump_time_us: int | None = None,
) -> SnapshotFacts:
    """Who is in which group, and who has nothing to say, from all the dumps together.

    A group is its name (``process_group[0]``, the key of ``pg_config``); ``pg_id`` is
    local to a rank. Its members are the ranks whose dumps name it (in entries or in
    ``pg_config``), or ``pg_config``'s rank list when that list holds every one of them
    (ProcessGroupGloo writes an unusable one: ``[0, 1]`` or ``[]`` keyed ``''``). Its
    size, where recorded (a consistent ``pg_config``, an all-gather's outputs, the world
    for ``default_pg``), shows members whose dumps are missing; the ranks of the world
    (0 … the largest rank seen) without a dump, or with an empty one, fill them in
    when that is unambiguous.
    """
    facts = SnapshotFacts()
    named: dict[str, set[int]] = {}
    descs: dict[str, str] = {}
    configs: dict[str, list[list[int]]] = {}
    by_group: dict[str, list[dict[str, Any]]] = {}
    world = 0
    for rank, dump in dumps.items():
        world = max(world, rank + 1)
        for e in _entries(dump):
            name, desc = _pg_name(e)
            named.setdefault(name, set()).add(rank)
            descs.setdefault(name, desc)
            by_group.setdefault(name, []).append(e)
            facts.p2p_recorded |= bool(e.get("is_p2p"))
        pg_config = dump.get("pg_config")
        for key, info in pg_config.items() if isinstance(pg_config, dict) else []:
            ranks = _ranks(info)
            if not key or not ranks or rank not in ranks:
                continue  # gloo's '' entry, or a list that does not hold the rank itself
            configs.setdefault(str(key), []).append(sorted(ranks))
            named.setdefault(str(key), set()).add(rank)
            if isinstance(info, dict) and info.get("desc"):
                descs.setdefault(str(key), str(info["desc"]))
            world = max(world, max(ranks) + 1)
    for rank in range(world if len(dumps) > 1 else 0):  # one dump alone: no peers known
        if rank not in dumps:
            facts.absent[rank] = "no dump"
        elif not _entries(dumps[rank]):
            facts.absent[rank] = "empty dump"
    for name in sorted(named):
        seen = named[name]
        lists = [c for c in configs.get(name, []) if seen <= set(c)]
        if lists:
            members = max(lists, key=lists.count)
            size = len(members)
        else:
            members = sorted(seen)
            size = _group_size_seen(by_group.get(name, [])) or len(members)
            if descs.get(name) == "default_pg":
                size = max(size, world)
            missing = sorted(set(facts.absent) - seen)
            if size > len(members) and (size == world or len(missing) == size - len(members)):
                members = sorted(seen | set(missing if size != world else range(world)))
        facts.groups[name] = GroupFacts(name, descs.get(name, ""), members, max(size, len(members)))
    for rank, dump in dumps.items():
        facts.p2p_waits += _p2p_waits(rank, _entries(dump), facts.groups)
    if dump_time_us is None:
        times = mtimes_us or {}
        untrusted = [r for r, d in dumps.items() if _entries(d) and not _mtime_trusted(
            _entries(d), times.get(r))]  # fmt: skip
        if untrusted or not times:
            facts.dump_time_known = False
            facts.why_time_unknown = (
                f"dump time unknown: the mtimes of {len(untrusted)} of {len(dumps)} dumps are "
                "not within the timeout after their newest entry (copied files?); keep "
                "mtimes (cp -p, rsync -t), or pass --dump-time"
            )
    return facts


_P2P_NAME = re.compile(r"(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")


def _p2p_waits(
    rank: int, entries: list[dict[str, Any]], groups: dict[str, GroupFacts]
) -> list[P2PWait]:
    """The rank's unfinished sends/receives; ProcessGroupNCCL names them
    ``nccl:send <me>-><peer>`` / ``nccl:recv <me><-<peer>`` in group ranks."""
    with_starts = _records_starts(entries)
    out = []
    for e in entries:
        if not e.get("is_p2p"):
            continue
        done = e.get("state") == "completed" if with_starts else bool(e.get("retired"))
        if done:
            continue
        m = _P2P_NAME.search(str(e.get("profiling_name") or ""))
        if not m:
            continue
        g = groups.get(_pg_name(e)[0])
        peer_local = int(m.group(4))
        peer = g.members[peer_local] if g and peer_local < len(g.members) else None
        out.append(P2PWait(_pg_name(e)[0], rank, peer, m.group(1),
                           _ts_ns(e.get("time_created_ns")) or 0))  # fmt: skip
    return out
