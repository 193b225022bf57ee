"""Write NCCL-backend Flight Recorder dumps from the format, for tests (no GPU here).

These are **not captured**: no GPU is available to run ProcessGroupNCCL, and no
published real NCCL dumps with a licence that allows committing them were found. They
are written field by field as PyTorch's writer lays them out (``getCollectiveTrace``,
``getPgConfig``/``getPgStatus`` and ``dump_json`` in
``torch/csrc/distributed/c10d/FlightRecorderDetail.hpp``, earlier ``FlightRecorder.hpp``
and ``NCCLUtils.hpp``) for these dump versions (1.4 and 2.2 too, below):

* ``2.3`` (``NCCLUtils.hpp``'s ``NCCLTraceBuffer``): ``version``, ``pg_config``,
  ``pg_status``, ``entries`` (``record_id``, ``pg_id``, ``process_group``,
  ``collective_seq_id``, ``p2p_seq_id``, ``op_id``, ``profiling_name``,
  ``time_created_ns``, ``input_sizes``/``input_dtypes``/``output_sizes``/
  ``output_dtypes``, ``state``, ``time_discovered_started_ns``,
  ``time_discovered_completed_ns``, ``retired``, ``timeout_ms``, ``is_p2p``), files
  ``nccl_trace_rank_<r>``;
* ``2.4`` (``FlightRecorder.hpp``): the same keys, files ``_dump_<r>`` (a job's
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE=…/_dump_``);
* ``2.7`` (``FlightRecorder.hpp``, ``FlightRecorder<EventType>``): adds the dump's
  ``nccl_version`` (from 2.6, pytorch/pytorch#151048), written by ``get_dump`` after
  ``pg_config``; files ``nccl_trace_rank_<r>``;
* ``2.10`` (``FlightRecorderDetail.hpp``): ``comm_lib_version`` in place of
  ``nccl_version``, adds ``thread_name``, ``thread_id``; files
  ``comm_lib_trace_rank_<r>`` with a host name in the prefix.

Pickle as the writer pickles (builtin dicts/lists/tuples, ``process_group`` a tuple,
absent times ``None``); JSON as ``dump_json`` writes it (``pg_config``/``pg_status``
values as strings, absent times ``0``, ``process_group`` a list, no ``entries`` key when
there are none).

The job: 8 ranks, tensor × pipeline × data parallel (2 × 2 × 2) as Megatron-LM lays it
out, on NCCL (p2p recorded: ``nccl:send <me>-><peer>``, ``nccl:recv <me><-<peer>``, group
ranks; ``is_p2p``; ``p2p_seq_id``); group names global (``"0"`` the world, then one per
``new_group`` in creation order), ``pg_id`` local to each rank; descriptions
``TENSOR_MODEL_PARALLEL_GROUP`` etc. Every entry ``scheduled`` with no discovered
times and no ``duration_ms`` (timing off, as in the dumps the issue describes),
``retired`` once finished. A ring of ``--ring`` entries per rank, so the rings of
different ranks cover different collectives. Each rank runs its operations in order
and blocks until each finishes (a CPU that synchronizes on every result).

Faults (``--case``): ``healthy``; ``crash`` (rank 5 dies before its data-parallel
all-reduce of step 6: no dump); ``wedged`` (rank 6 stops at the start of step 6, holding
the GIL: its dump is empty — no entries, ``pg_status`` {}); ``dp-hang`` (rank 2 never
enters its data-parallel all-reduce of step 6); ``pp-hang`` (rank 1 never sends its
activation of step 6; rank 3 waits in ``recv``). The dump time of every hang is the
watchdog's, ``timeout_ms`` (180 s) after the hang began; ``manifest.json`` records it
(git keeps no mtimes) and the truth::

    python tools/fr_capture/nccl_format.py --out tests/producers/data/nccl_format
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path
from typing import Any

WORLD = 8
T0_NS = 1_760_000_000_000_000_000
STEP_NS = 200_000_000
OP_NS = 3_000_000
TIMEOUT_MS = 180_000
DESCS = {
    "tensor": "TENSOR_MODEL_PARALLEL_GROUP",
    "pipeline": "PIPELINE_MODEL_PARALLEL_GROUP",
    "data": "DATA_PARALLEL_GROUP",
}
CASES = {
    "healthy": None,
    "crash": {"rank": 5, "step": 6, "before": "data", "dump": "none"},
    "wedged": {"rank": 6, "step": 6, "before": "start", "dump": "empty"},
    "dp-hang": {"rank": 2, "step": 6, "before": "data", "dump": "full"},
    "pp-hang": {"rank": 1, "step": 6, "before": "send", "dump": "full"},
}
VERSIONS = {
    "1.4": {"name": "nccl_trace_rank_{r}", "formats": ("pickle",)},
    "2.2": {"name": "nccl_trace_rank_{r}", "formats": ("pickle",)},
    "2.3": {"name": "nccl_trace_rank_{r}"},
    "2.4": {"name": "_dump_{r}"},
    "2.7": {"name": "nccl_trace_rank_{r}", "lib": "nccl_version"},
    "2.10": {
        "name": "gpu-node{h}-comm_lib_trace_rank_{r}",
        "lib": "comm_lib_version",
        "threads": True,
    },
}
"""Layouts that differ (docs/flight-recorder.md has the full table): 1.4 (``seq_id``,
``pg_config`` {local pg_id: ranks}, no ``process_group``/``is_p2p``/dtypes/
``timeout_ms``), 2.2 (no ``pg_status``), 2.3–2.5 (``pg_status``), 2.6–2.7
(``nccl_version``), 2.10 (``thread_name``, ``thread_id``, ``comm_lib_version``). 1.4
and 2.2 come as pickle only (the JSON dump is not in the 2.2 writer's source read)."""


def groups() -> list[tuple[str, str, list[int]]]:
    """(global name, desc, ranks) in creation order: the world, then per kind."""
    out = [("0", "default_pg", list(range(WORLD)))]
    layout = {
        "tensor": [[r, r + 1] for r in range(0, WORLD, 2)],
        "pipeline": [[r, r + 2] for r in range(WORLD) if (r // 2) % 2 == 0],
        "data": [[r, r + WORLD // 2] for r in range(WORLD // 2)],
    }
    for kind, lists in layout.items():
        for ranks in lists:
            out.append((str(len(out)), DESCS[kind], ranks))
    return out


def _program(rank: int, steps: int) -> list[tuple[str, str, int | None, str]]:
    """(kind, op, peer global rank, fault point) per operation of ``rank``, in order."""
    stage = (rank // 2) % 2
    peer = rank + 2 if stage == 0 else rank - 2
    ops: list[tuple[str, str, int | None, str]] = []
    for step in range(1, steps + 1):
        ops.append(("mark", f"start {step}", None, "start"))
        if stage == 0:
            ops += [("tensor", "all_reduce", None, ""), ("pipeline", "send", peer, "send"),
                    ("pipeline", "recv", peer, ""), ("tensor", "all_reduce", None, "")]  # fmt: skip
        else:
            ops += [("pipeline", "recv", peer, ""), ("tensor", "all_reduce", None, ""),
                    ("tensor", "all_reduce", None, ""),
                    ("pipeline", "send", peer, "send")]  # fmt: skip
        ops += [("data", "all_reduce", None, "data"), ("data", "_all_gather_base", None, ""),
                ("world", "all_reduce", None, "")]  # fmt: skip
        for i in range(len(ops) - 8, len(ops)):
            k, o, p, f = ops[i]
            ops[i] = (k, o, p, f"{f}@{step}" if f else "")
    return ops


def simulate(case: str, steps: int) -> tuple[dict[int, list[dict[str, Any]]], int]:
    """Every rank's entries (enqueued operations, finished or not) and the hang start."""
    fault = CASES[case]
    gs = groups()
    mine: dict[int, dict[str, Any]] = {r: {} for r in range(WORLD)}
    for name, desc, ranks in gs:
        for r in ranks:
            mine[r][desc] = (name, desc, ranks)
    prog = {r: _program(r, steps) for r in range(WORLD)}
    pos = dict.fromkeys(range(WORLD), 0)
    clock = dict.fromkeys(range(WORLD), T0_NS)
    pending: dict[int, dict[str, Any]] = {}
    entries: dict[int, list[dict[str, Any]]] = {r: [] for r in range(WORLD)}
    seq: dict[tuple[int, str], list[int]] = {}  # (rank, group) -> [collective, p2p, op]
    local_id: dict[tuple[int, str], int] = {}
    for name, _, ranks in gs:
        for r in ranks:
            local_id[(r, name)] = sum(1 for (rr, _) in local_id if rr == r)
    stopped: set[int] = set()
    hang_ns = 0
    progress = True
    while progress:
        progress = False
        for r in range(WORLD):
            if r in stopped or r in pending or pos[r] >= len(prog[r]):
                continue
            kind, op, peer, point = prog[r][pos[r]]
            if fault and r == fault["rank"] and point == f"{fault['before']}@{fault['step']}":
                stopped.add(r)
                hang_ns = hang_ns or clock[r]
                continue
            if kind == "mark":
                step = int(op.split()[1])
                clock[r] = max(clock[r], T0_NS + step * STEP_NS + r * 40_000)
                pos[r] += 1
                progress = True
                continue
            name, desc, ranks = mine[r][DESCS.get(kind, "default_pg")] if kind != "world" else (
                "0", "default_pg", list(range(WORLD)))  # fmt: skip
            cnt = seq.setdefault((r, name), [0, 0, 0])
            p2p = op in ("send", "recv")
            cnt[1 if p2p else 0] += 1
            cnt[2] += 1
            lr = ranks.index(r)
            if p2p:
                lp = ranks.index(peer)
                label = f"nccl:send {lr}->{lp}" if op == "send" else f"nccl:recv {lr}<-{lp}"
            else:
                label = f"nccl:{op}"
            clock[r] += 50_000
            elems = 4096 if kind != "world" else 8
            e = {
                "record_id": len(entries[r]), "pg_id": local_id[(r, name)],
                "process_group": (name, desc), "collective_seq_id": cnt[0],
                "p2p_seq_id": cnt[1], "op_id": cnt[2], "profiling_name": label,
                "time_created_ns": clock[r],
                "input_sizes": [[elems]], "input_dtypes": ["BFloat16"],
                "output_sizes": [[elems * len(ranks)]] if "gather" in op else [[elems]],
                "output_dtypes": ["BFloat16"], "state": "scheduled",
                "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
                "retired": False, "timeout_ms": TIMEOUT_MS, "is_p2p": p2p,
                "_key": (name, "p2p", min(r, peer), cnt[1]) if p2p else (name, "c", cnt[0]),
                "_n": 2 if p2p else len(ranks),
            }  # fmt: skip
            entries[r].append(e)
            pending[r] = e
            pos[r] += 1
            progress = True
        # complete what every participant has enqueued
        by_key: dict[tuple, list[int]] = {}
        for r, e in pending.items():
            by_key.setdefault(e["_key"], []).append(r)
        for rs in by_key.values():
            if len(rs) == pending[rs[0]]["_n"]:
                end = max(pending[r]["time_created_ns"] for r in rs) + OP_NS
                for r in rs:
                    pending[r]["retired"] = True
                    clock[r] = end
                    del pending[r]
                progress = True
    return entries, hang_ns


def _pg_status(rank: int, es: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for e in es:
        st = out.setdefault(str(e["pg_id"]), {"last_enqueued_collective": -1,
                                               "last_started_collective": -1,
                                               "last_completed_collective": -1})  # fmt: skip
        if e["is_p2p"]:
            continue
        st["last_enqueued_collective"] = max(st["last_enqueued_collective"], e["collective_seq_id"])
        if e["retired"]:
            st["last_completed_collective"] = max(
                st["last_completed_collective"], e["collective_seq_id"]
            )
    return out


def write(out: Path, steps: int, ring: int) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "written_from_the_format": True,
        "captured": False,
        "why": "no GPU here and no published real NCCL dumps whose licence allows "
        "committing them; written as PyTorch's writer lays dumps out (see nccl_format.py)",
        "groups": [{"name": n, "desc": d, "ranks": rs} for n, d, rs in groups()],
        "cases": {},
    }
    for case, fault in CASES.items():
        entries, hang_ns = simulate(case, steps)
        last = max(e["time_created_ns"] for es in entries.values() for e in es)
        dump_ns = (hang_ns + TIMEOUT_MS * 1_000_000) if fault else last + 50_000_000
        manifest["cases"][case] = {
            "culprit": fault["rank"] if fault else None,
            "fault": fault,
            "dump_time_ns": dump_ns,
        }
        for version, spec in VERSIONS.items():
            for fmt in spec.get("formats", ("pickle", "json")):
                d = out / case / f"v{version}" / fmt
                d.mkdir(parents=True, exist_ok=True)
                for r in range(WORLD):
                    if fault and r == fault["rank"] and fault["dump"] == "none":
                        continue
                    empty = bool(fault and r == fault["rank"] and fault["dump"] == "empty")
                    es = [] if empty else entries[r][-ring:]
                    body = _dump(r, es, version, spec, fmt, _pg_status(r, es))
                    name = spec["name"].format(r=r, h=r // 4) + (".json" if fmt == "json" else "")
                    (d / name).write_bytes(body)
        (out / case / "v2.4" / "pickle" / "train_rank_logs.txt").write_text(
            "[rank0]: step 5 loss 2.31\n[rank0]: Watchdog caught collective operation timeout\n"
        )  # a log beside the dumps, as jobs leave them
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _dump(
    rank: int, es: list[dict[str, Any]], version: str, spec: dict, fmt: str, status: dict
) -> bytes:
    lib = spec.get("lib")  # the dump's library version key, if the version has one
    gs = [(n, d, rs) for n, d, rs in groups() if rank in rs]
    clean = []
    for e in es:
        e = {k: v for k, v in e.items() if not k.startswith("_")}
        if spec.get("threads"):  # thread_name, thread_id follow process_group
            e = {**{k: e[k] for k in ("record_id", "pg_id", "process_group")},
                 "thread_name": "pt_main_thread", "thread_id": "140245671937856",
                 **{k: v for k, v in e.items() if k not in ("record_id", "pg_id",
                                                             "process_group")}}  # fmt: skip
        clean.append(e)
    if version.startswith("1."):  # seq_id, pg_config by the rank's local pg_id
        local = {e["process_group"][0]: e["pg_id"] for e in es}
        old = [{"record_id": e["record_id"], "pg_id": e["pg_id"], "seq_id": e["op_id"],
                **{k: e[k] for k in ("op_id", "profiling_name", "time_created_ns",
                                     "input_sizes", "output_sizes", "state",
                                     "time_discovered_started_ns",
                                     "time_discovered_completed_ns", "retired")}}
               for e in clean]  # fmt: skip
        config = {local.get(n, i): list(rs) for i, (n, _, rs) in enumerate(gs)}
        return pickle.dumps({"entries": old, "version": version, "pg_config": config}, protocol=2)
    if fmt == "pickle":
        doc: dict[str, Any] = {"version": version,
                               "pg_config": {n: {"name": n, "desc": d, "ranks": str(rs)}
                                             for n, d, rs in gs}}  # fmt: skip
        if lib:
            doc[lib] = "2.21.5"
        if version != "2.2":  # pg_status came with 2.3
            doc["pg_status"] = {} if not es else status
        doc["entries"] = clean
        return pickle.dumps(doc, protocol=2)
    jdoc: dict[str, Any] = {"version": version}
    if lib:
        jdoc[lib] = "2.21.5"
    jdoc["pg_config"] = {n: {"name": n, "desc": d, "ranks": str(rs)} for n, d, rs in gs}
    jdoc["pg_status"] = {} if not es else {
        k: {kk: str(vv) for kk, vv in v.items()} for k, v in status.items()}  # fmt: skip
    if clean:
        jdoc["entries"] = [
            {**e, "process_group": list(e["process_group"]),
             "time_discovered_started_ns": e["time_discovered_started_ns"] or 0,
             "time_discovered_completed_ns": e["time_discovered_completed_ns"] or 0}
            for e in clean
        ]  # fmt: skip
    return json.dumps(jdoc).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ring", type=int, default=20, help="entries kept per rank")
    args = ap.parse_args()
    m = write(args.out, args.steps, args.ring)
    print(json.dumps({c: v["culprit"] for c, v in m["cases"].items()}))


if __name__ == "__main__":
    main()
