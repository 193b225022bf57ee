"""What a snapshot's dumps say together: groups by name, absent ranks, unfinished
sends/receives, and whether the dump time is known (:func:`snapshot_facts`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from producers.formats.fr_dump import (
    _dump_time_us,
    _entries,
    _pg_name,
    _ranks,
    _records_starts,
    _ts_ns,
)

__all__ = ["GroupFacts", "P2PWait", "SnapshotFacts", "group_members", "snapshot_facts"]


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
    seen_ranks: set[int] | None = None,
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
        seen = seen_ranks or set()  # dumps whose time an exporter saw them: trusted
        untrusted = [r for r, d in dumps.items() if _entries(d) and r not in seen
                     and not _mtime_trusted(_entries(d), times.get(r))]  # fmt: skip
        if untrusted or not (times or seen):
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
