"""Reading one Flight Recorder dump file: bytes → plain data, its rank, its fields.

A dump is a pickle of builtin dicts/lists/tuples/str/int/float/bool/None, or the same
document as JSON (``pg_config``/``pg_status`` values as strings, absent timestamps ``0``).
Unpickling is restricted (:class:`_RestrictedUnpickler`): nothing read can run code. The
field readers here are shared by the event mapping (:mod:`producers.formats.flight_recorder`)
and the snapshot facts (:mod:`producers.formats.fr_facts`).
"""

from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MAX_DUMP_BYTES",
    "DumpRefused",
    "FlightRecorderError",
    "default_host",
    "load_flight_recorder_dump",
    "looks_like_flight_recorder",
    "parse_flight_recorder_dump",
    "rank_from_filename",
]


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
        raise DumpRefused(
            f"refused to unpickle {module}.{name}: Flight Recorder dumps hold only builtin "
            "containers and scalars, so this file is not a dump or was tampered with"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise DumpRefused("refused a persistent id: not a Flight Recorder dump")


class DumpRefused(FlightRecorderError):
    """A file refused for what it is, not for being cut short: a pickle that names a
    class, or one larger than the limit. Waiting for it to be written further is no use."""


def _loads_restricted(data: bytes) -> Any:
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def looks_like_flight_recorder(head: bytes) -> bool:
    """Whether the first bytes of a file look like a Flight Recorder dump.

    The JSON writer (nlohmann, keys sorted) puts ``entries`` first, or none when the
    ring is empty; then ``nccl_comm_state`` (NCCLX's per-communicator dump, any size)
    and the library version (``nccl_version`` 2.6–2.9, ``comm_lib_version`` from 2.10).

    >>> looks_like_flight_recorder(b'{"comm_lib_version":"2.21.5","entries":[')
    True
    >>> looks_like_flight_recorder(b'{"nccl_comm_state":{"a1b2":{"' + b"x" * 70000)
    True
    >>> looks_like_flight_recorder(b'{"header":{"id":"0x1"')
    False
    """
    s = head.lstrip()
    if s.startswith(b"\x80"):  # pickle protocol >= 2
        return True
    return s.startswith(b"{") and any(k in s for k in _DUMP_KEYS)


_DUMP_KEYS = (b'"pg_config"', b'"pg_status"', b'"entries"', b'"comm_lib_version"',
              b'"nccl_version"', b'"nccl_comm_state"')  # fmt: skip
"""Top-level keys only a Flight Recorder dump has (FlightRecorder.hpp's constants)."""


DEFAULT_MAX_DUMP_BYTES = 256 << 20
"""A dump larger than this is refused unread. A ring of 2000 entries with stack frames
(``TORCH_INCLUDE_STACK_TRACE``) per process group is tens of MB; the parsed data takes
several times the file's size in memory."""


def load_flight_recorder_dump(
    path: str | Path, *, max_bytes: int = DEFAULT_MAX_DUMP_BYTES
) -> dict[str, Any]:
    """Load one dump (pickle or JSON) as plain Python data; raises FlightRecorderError.

    A file larger than ``max_bytes`` is refused before it is read."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as err:
        raise FlightRecorderError(f"cannot read: {err}") from None
    return parse_flight_recorder_dump(data, max_bytes=max_bytes)


def parse_flight_recorder_dump(
    data: bytes, *, max_bytes: int = DEFAULT_MAX_DUMP_BYTES
) -> dict[str, Any]:
    """A dump's bytes as plain Python data (see :func:`load_flight_recorder_dump`).

    A dump cut short (a file still being written: PyTorch's ``DebugInfoWriter`` writes
    the file in place, no temporary name) fails here as corrupt: a pickle without its
    final STOP opcode, or a JSON document without its closing brace.
    """
    if len(data) > max_bytes:
        raise DumpRefused(
            f"larger than {max_bytes} bytes: refused unread (raise the limit if real dumps "
            "of this job are this large)"
        )
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
    return _upgrade_1x(dump)


def _upgrade_1x(dump: dict[str, Any]) -> dict[str, Any]:
    """A version 1.x dump in the 2.x layout (docs/flight-recorder.md, the version table).

    1.x entries carry ``seq_id`` (one counter per process group over every operation)
    and no ``process_group``, ``is_p2p`` or ``timeout_ms``; ``pg_config`` maps the
    rank's local ``pg_id`` to its rank list. A group is then known across ranks only by
    its members, so it is named by them (``ranks:0,2``); sends and receives are told by
    their profiling name. 2.x dumps pass through unchanged.

    >>> d = _upgrade_1x({"version": "1.4", "pg_config": {3: [0, 2]}, "entries": [
    ...     {"pg_id": 3, "seq_id": 7, "profiling_name": "nccl:all_reduce"}]})
    >>> e = d["entries"][0]
    >>> e["process_group"], e["collective_seq_id"], e["is_p2p"], d["pg_config"]["ranks:0,2"]
    (('ranks:0,2', ''), 7, False, {'name': 'ranks:0,2', 'desc': '', 'ranks': '[0, 2]'})
    """
    if not str(dump.get("version", "")).startswith("1."):
        return dump
    config = dump.get("pg_config")
    names: dict[str, str] = {}
    new_config: dict[str, dict[str, str]] = {}
    for pg_id, ranks in config.items() if isinstance(config, dict) else []:
        if isinstance(ranks, (list, tuple)) and all(isinstance(r, int) for r in ranks):
            name = "ranks:" + ",".join(str(r) for r in sorted(ranks))
            names[str(pg_id)] = name
            new_config[name] = {"name": name, "desc": "", "ranks": str(sorted(ranks))}
    entries = []
    for e in dump.get("entries") or []:
        if not isinstance(e, dict):
            continue
        p2p = bool(_P2P_OP.search(str(e.get("profiling_name") or "")))
        name = names.get(str(e.get("pg_id")), str(e.get("pg_id", "")))
        seq = e.get("seq_id")
        entries.append({**e, "process_group": (name, ""), "is_p2p": p2p,
                        "collective_seq_id": 0 if p2p else seq,
                        "p2p_seq_id": seq if p2p else 0})  # fmt: skip
    return {**dump, "pg_config": new_config, "entries": entries}


_P2P_OP = re.compile(r"(?:^|:)(?:send|recv)\b")


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


def default_host(rank: int) -> str:
    """The host of a rank whose dump names none: PyTorch's analyzer's ``host_rank<N>``
    made a valid RFC 1123 name."""
    return f"host-rank{rank}"


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


def _records_starts(entries: list[dict[str, Any]]) -> bool:
    """Whether the backend records when a collective starts (ProcessGroupNCCL's watchdog
    does; ProcessGroupGloo leaves every entry ``scheduled`` with no discovered times)."""
    return any(
        e.get("state") in ("started", "completed") or _ts_ns(e.get("time_discovered_started_ns"))
        for e in entries
    )


def _entries(dump: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in (dump.get("entries") or []) if isinstance(e, dict)]
