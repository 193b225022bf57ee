"""NCCL Inspector plugin dumps → contract :class:`~producers.events.OpEvent`.

The Inspector (NVIDIA nccl, ``ext-profiler/inspector``) writes one file per process,
``<dump dir>/<hostname>-pid<pid>.log``, and appends one compact JSON object per line:
``{"header":{…},"metadata":{…},"coll_perf":{…}}`` (or ``"p2p_perf"`` for point-to-point
operations). Doubles are printed with ``%lf`` and a NaN bandwidth as the *string*
``"nan"``; verbose dumps (``NCCL_INSPECTOR_DUMP_VERBOSE=1``) add ``event_trace_sn`` and
``event_trace_ts`` inside ``coll_perf``. Unknown fields and newer
``inspector_output_format_version`` values are accepted: only the fields below are read.

Mapping (docs/inputs.md has the full table):

==========================================  =====================
Inspector                                    contract ``op`` event
==========================================  =====================
``header.id``                                ``comm``
``header.rank`` / ``header.n_ranks``         ``rank`` / ``nranks``
``metadata.hostname``                        ``host``
``metadata.dump_timestamp_us``               ``ts_us``
``coll_perf.coll`` / ``p2p_perf.p2p``        ``op``
``coll_perf.coll_sn`` / ``p2p_perf.p2p_sn``  ``seq``
``…_msg_size_bytes``                         ``bytes``
``…_exec_time_us``                           ``exec_us``
``…_algobw_gbs`` / ``…_busbw_gbs``           ``algbw_gbs`` / ``busbw_gbs``
``p2p_perf.p2p_peer``                        ``conns[0].peer``
==========================================  =====================

The Inspector only records *completed* operations and has no heartbeat, so it can show
slowness but never a hang. Up to NCCL 2.29 it dumped the last completed collective of
each communicator per dump interval (sequence numbers have gaps); from NCCL 2.30 each
dump writes, per communicator, the ring of operations completed since the last dump
(up to 1024; ops under 8192 bytes or without GPU kernel timing are dropped), one line
each, and ``header.comm_name`` names the communicator (``comm_name``; "unknown" when the
application gave none). Format "v4.2" adds ``coll_algo``/``coll_proto`` (read as
``algo``/``proto``) and one ``dump_stats`` record per communicator and dump (records
written, ring drops), which carries no operation and is skipped.

>>> line = (b'{"header":{"id":"0x7f8c496ae9f661","rank":2,"n_ranks":8,"nnodes":1},'
...         b'"metadata":{"inspector_output_format_version":"v4.0","git_rev":"",'
...         b'"rec_mechanism":"nccl_profiler_interface","dump_timestamp_us":1748030377748202,'
...         b'"hostname":"node-001","pid":1639453},"coll_perf":{"coll":"AllReduce",'
...         b'"coll_sn":1407,"coll_msg_size_bytes":17179869184,"coll_exec_time_us":61974,'
...         b'"coll_timing_source":"kernel_gpu","coll_algobw_gbs":277.210914,'
...         b'"coll_busbw_gbs":485.119099}}')
>>> ev = parse_inspector_line(line, job="j1")
>>> (ev.comm, ev.rank, ev.nranks, ev.host, ev.op, ev.seq, ev.exec_us)
('0x7f8c496ae9f661', 2, 8, 'node-001', 'AllReduce', 1407, 61974.0)
>>> parse_inspector_line(b'{"header":{"id":"0x1","rank":0,"n_ranks":1}}', job="j")
Traceback (most recent call last):
...
producers.formats.inspector.InspectorError: Object missing required field `metadata`
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import msgspec

from producers.events import Conn, OpEvent
from producers.guard import host_problem
from producers.traces import BadLine, _open_binary

__all__ = [
    "KNOWN_FORMAT",
    "InspectorError",
    "InspectorStatsRecord",
    "inspector_job_from_dir",
    "parse_inspector_line",
    "read_inspector_file",
]


class InspectorError(ValueError):
    """A line is not an NCCL Inspector record (or lacks a field the mapping needs).

    The line is reported as bad input with this message and the next line is read;
    nothing else needs to be done unless every line of a file fails, in which case the
    file is probably not an Inspector dump (Prometheus mode, ``NCCL_INSPECTOR_PROM_DUMP=1``,
    writes text metrics instead: switch it off for c4stream).
    """


# Typed views of the fields the mapping reads. msgspec ignores unknown fields, which is
# how newer format versions stay readable. gc=False: they hold no cycles, and the cyclic
# GC walking hundreds of thousands of them costs more than decoding them.
# Constraints are checked here, at decode time: msgspec does not check them when the
# contract structs are built in Python, so a negative size would slip through otherwise.
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_NonNegF = Annotated[float, msgspec.Meta(ge=0)]


class _Header(msgspec.Struct, gc=False):
    id: str
    rank: _NonNeg
    n_ranks: Annotated[int, msgspec.Meta(ge=1)]
    nnodes: int | None = None
    comm_name: str | None = None
    """From NCCL 2.30: the name the application gave the communicator ("unknown" if none)."""


class _Metadata(msgspec.Struct, gc=False):
    hostname: str
    dump_timestamp_us: int
    inspector_output_format_version: str | None = None
    pid: int | None = None


Bandwidth = float | str | None  # "%lf" prints NaN as the string "nan"


class _CollPerf(msgspec.Struct, gc=False):
    coll: str
    coll_sn: _NonNeg
    coll_msg_size_bytes: _NonNeg
    coll_exec_time_us: _NonNegF
    coll_timing_source: str | None = None
    coll_algobw_gbs: Bandwidth = None
    coll_busbw_gbs: Bandwidth = None
    coll_algo: str | None = None
    coll_proto: str | None = None


class _P2pPerf(msgspec.Struct, gc=False):
    # Only p2p, p2p_sn and p2p_peer are given by the issue; the other names follow the
    # coll_perf pattern (the stored v4.0 source writes no p2p records).
    p2p: str
    p2p_sn: _NonNeg
    p2p_peer: _NonNeg | None = None
    p2p_msg_size_bytes: _NonNeg = 0
    p2p_exec_time_us: _NonNegF = 0.0
    p2p_timing_source: str | None = None
    p2p_algobw_gbs: Bandwidth = None
    p2p_busbw_gbs: Bandwidth = None


class _Record(msgspec.Struct, gc=False):
    header: _Header
    metadata: _Metadata
    coll_perf: _CollPerf | None = None
    p2p_perf: _P2pPerf | None = None
    dump_stats: dict | None = None


class _VersionOnly(msgspec.Struct, gc=False):
    """What is left to read of a line this reader cannot map: its format version."""

    class _Meta(msgspec.Struct, gc=False):
        inspector_output_format_version: str | None = None

    metadata: _Meta | None = None


class InspectorStatsRecord(InspectorError):
    """A per-dump statistics record (``dump_stats``: records written and ring drops of
    one communicator), not an operation: there is no event to make of it."""


# The newest format version whose layout this reader was checked against (NVIDIA's
# writer: "v4.0" up to NCCL 2.30, "v4.2" adds a dump_stats record per communicator).
KNOWN_FORMAT = (4, 2)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)")


def _newer_than_known(version: str | None) -> bool:
    """
    >>> _newer_than_known("v4.0"), _newer_than_known("v4.3"), _newer_than_known("v5.0")
    (False, True, True)
    """
    m = _VERSION.match(version or "")
    return bool(m) and (int(m.group(1)), int(m.group(2))) > KNOWN_FORMAT


_decoder = msgspec.json.Decoder(_Record)
_version_decoder = msgspec.json.Decoder(_VersionOnly)


def _bw(value: Bandwidth) -> float | None:
    if value is None:
        return None
    try:
        out = float(value)
    except ValueError:
        return None
    return out if math.isfinite(out) else None


def parse_inspector_line(line: bytes | str, *, job: str) -> OpEvent:
    """Map one Inspector JSON line to an ``op`` event; raises :class:`InspectorError`."""
    try:
        rec = _decoder.decode(line)
    except msgspec.DecodeError as err:
        raise InspectorError(str(err)) from None
    except RecursionError:  # deep nesting in an unknown field: a bad line, not a crash
        raise InspectorError("JSON nested too deeply") from None
    h, m = rec.header, rec.metadata
    if not h.id or not m.hostname:
        raise InspectorError("empty header.id or metadata.hostname")
    if (bad_host := host_problem(m.hostname)) is not None:  # refused here, not downstream
        raise InspectorError(f"metadata.hostname: {bad_host}")
    if h.rank >= h.n_ranks:
        raise InspectorError(f"header.rank {h.rank} outside 0..n_ranks-1 (n_ranks={h.n_ranks})")
    if rec.dump_stats is not None and rec.coll_perf is None and rec.p2p_perf is None:
        raise InspectorStatsRecord("a dump_stats record (per-dump statistics), not an operation")
    # The identity of the rank, the same for collective and p2p records.
    ident = dict(
        v=1,
        job=job,
        comm=h.id,
        nranks=h.n_ranks,
        rank=h.rank,
        host=m.hostname,
        ts_us=m.dump_timestamp_us,
        comm_name=h.comm_name if h.comm_name and h.comm_name != "unknown" else None,
    )
    if rec.coll_perf is not None:
        c = rec.coll_perf
        return OpEvent(
            **ident,
            op=c.coll,
            seq=c.coll_sn,
            bytes=c.coll_msg_size_bytes,
            exec_us=float(c.coll_exec_time_us),
            algbw_gbs=_bw(c.coll_algobw_gbs),
            busbw_gbs=_bw(c.coll_busbw_gbs),
            algo=c.coll_algo if c.coll_algo and c.coll_algo != "unknown" else None,
            proto=c.coll_proto if c.coll_proto and c.coll_proto != "unknown" else None,
        )
    if rec.p2p_perf is not None:
        p = rec.p2p_perf
        conns = None
        if p.p2p_peer is not None:
            direction = "recv" if p.p2p.lower().startswith("recv") else "send"
            conns = [
                Conn(
                    peer=p.p2p_peer,
                    dir=direction,
                    bytes=p.p2p_msg_size_bytes,
                    time_us=float(p.p2p_exec_time_us),
                )
            ]
        return OpEvent(
            **ident,
            op=p.p2p,
            seq=p.p2p_sn,
            bytes=p.p2p_msg_size_bytes,
            exec_us=float(p.p2p_exec_time_us),
            algbw_gbs=_bw(p.p2p_algobw_gbs),
            busbw_gbs=_bw(p.p2p_busbw_gbs),
            conns=conns,
        )
    raise InspectorError("record has neither coll_perf nor p2p_perf")


_JOB_DIR = re.compile(r"^nccl-inspector-(.+)$")


def inspector_job_from_dir(directory: str | Path, default: str = "unknown") -> str:
    """The job id the Inspector put in its default dump directory name, else ``default``.

    >>> inspector_job_from_dir("/scratch/nccl-inspector-48213")
    '48213'
    >>> inspector_job_from_dir("/var/log/nccl")
    'unknown'
    """
    m = _JOB_DIR.match(Path(directory).name)
    return m.group(1) if m and m.group(1) != "unknown-jobid" else default


def _version_of(line: bytes) -> str | None:
    try:
        meta = _version_decoder.decode(line).metadata
    except msgspec.DecodeError:
        return None
    return meta.inspector_output_format_version if meta is not None else None


def read_inspector_file(
    path: str | Path,
    *,
    job: str,
    on_bad: Callable[[BadLine], None] | None = None,
) -> Iterator[tuple[int, OpEvent]]:
    """Yield ``(line number, event)`` for each complete line of one Inspector file.

    A malformed line goes to ``on_bad`` as a :class:`~producers.traces.BadLine`; a last
    line without its newline (still being written) is ignored. Reads gzip too
    (``.log.gz``, as NVIDIA's exporter accepts). ``dump_stats`` records are skipped.
    Records of a format version newer than :data:`KNOWN_FORMAT` are read when they
    hold the mapped fields; those that do not are reported once for the whole file
    (one message naming the version and the count), not once per line.
    """

    name = str(path)
    version: str | None = None  # the file's format version, from the last record read
    newer: list[tuple[int, bytes]] = []  # lines unreadable in a newer format: one message
    with _open_binary(Path(path), "r") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                break  # partial last line: the writer has not finished it
            line = raw.strip()
            if not line:
                continue
            try:
                ev = parse_inspector_line(line, job=job)
            except InspectorError as err:
                version = _version_of(line) or version
                if isinstance(err, InspectorStatsRecord):
                    continue  # it states the version of the records that follow
                if _newer_than_known(version):
                    newer.append((lineno, line))
                elif on_bad is not None:
                    on_bad(BadLine(name, lineno, line, str(err)))
                continue
            version = None  # a readable record: whatever its version, this layout is known
            yield lineno, ev
    if newer and on_bad is not None:
        lineno, line = newer[0]
        on_bad(
            BadLine(
                name,
                lineno,
                line,
                f"Inspector output format {version} is newer than this reader knows "
                f"(v{KNOWN_FORMAT[0]}.{KNOWN_FORMAT[1]}): {len(newer)} record(s) of this file "
                "lack the fields it maps (header, metadata, coll_perf/p2p_perf) and were "
                "skipped; upgrade c4stream, or pin the Inspector plugin to a known version",
            )
        )
