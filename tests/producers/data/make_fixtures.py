"""Writes the real-format fixture files of tests/producers/data (run it to regenerate).

``python tests/producers/data/make_fixtures.py``

* ``inspector/nccl-inspector-4242/<host>-pid<pid>.log`` — NCCL Inspector JSON lines exactly
  as ``ext-profiler/inspector`` writes them (compact JSON, ``%lf`` doubles, ``"nan"`` for
  a NaN bandwidth, one object per line), one file per process; a verbose dump with
  ``event_trace_sn``/``event_trace_ts``, a newer format version with unknown fields, a
  ``p2p_perf`` record, and one truncated (bad) line.
* ``flight_recorder/{json,pickle}/nccl_trace_rank_<r>`` — PyTorch Flight Recorder dumps
  of a 4-rank job where rank 2 never started collective 5 (a non-communication hang):
  the pickle as ``FlightRecorder::dump`` writes it (protocol 2, builtins only,
  ``process_group`` a tuple), the JSON as ``dump_json`` writes it (sorted keys,
  ``pg_status``/``pg_config`` values as strings, absent times as 0).
* ``flight_recorder/malicious/nccl_trace_rank_0`` — a pickle that would run a command.

Deterministic: fixed times, no randomness.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
T0_US = 1_750_000_000_000_000
COMM_A = "0x7f8c496ae9f661"  # 4 ranks, 2 hosts
COMM_B = "0xe62dedaa97644a"  # 2 ranks on node-001 (NVLink)


def _lf(x: float) -> str:
    return "%lf" % x  # noqa: UP031 - the Inspector's own printf format


def inspector_line(
    *,
    comm: str,
    rank: int,
    n_ranks: int,
    nnodes: int,
    host: str,
    pid: int,
    ts_us: int,
    coll: str,
    sn: int,
    size: int,
    exec_us: int,
    algbw: float | None,
    busbw: float,
    verbose: bool = False,
    version: str = "v4.0",
    extra_meta: str = "",
) -> str:
    algbw_s = '"nan"' if algbw is None else _lf(algbw)
    perf = (
        f'"coll":"{coll}","coll_sn":{sn},"coll_msg_size_bytes":{size},'
        f'"coll_exec_time_us":{exec_us},"coll_timing_source":"kernel_gpu",'
        f'"coll_algobw_gbs":{algbw_s},"coll_busbw_gbs":{_lf(busbw)}'
    )
    if verbose:
        start = ts_us - exec_us - 200
        perf += (
            f',"event_trace_sn":{{"coll_start_sn":{3 * sn},"coll_stop_sn":{3 * sn + 1},'
            f'"kernel_events":[{{"channel_id":0,"kernel_start_sn":{3 * sn + 2},'
            f'"kernel_stop_sn":{3 * sn + 4},"kernel_record_sn":{3 * sn + 3}}}]}},'
            f'"event_trace_ts":{{"coll_start_ts":{start},"coll_stop_ts":{start + 5},'
            f'"kernel_events":[{{"channel_id":0,"kernel_start_ts":{start + 120},'
            f'"kernel_stop_ts":{start + 120 + exec_us},'
            f'"kernel_record_ts":{start + 120 + exec_us}}}]}}'
        )
    return (
        f'{{"header":{{"id":"{comm}","rank":{rank},"n_ranks":{n_ranks},"nnodes":{nnodes}}},'
        f'"metadata":{{"inspector_output_format_version":"{version}","git_rev":"",'
        f'"rec_mechanism":"nccl_profiler_interface","dump_timestamp_us":{ts_us},'
        f'"hostname":"{host}","pid":{pid}{extra_meta}}},'
        f'"coll_perf":{{{perf}}}}}\n'
    )


def write_inspector() -> None:
    d = HERE / "inspector" / "nccl-inspector-4242"
    d.mkdir(parents=True, exist_ok=True)
    procs = [
        ("node-001", 1001, 0),
        ("node-001", 1002, 1),
        ("node-002", 2001, 2),
        ("node-002", 2002, 3),
    ]
    for host, pid, rank in procs:
        lines: list[str] = []
        for sn in range(1, 6):
            ts = T0_US + sn * 1_000_000 + rank * 37
            exec_us = 61974 + 100 * rank + sn
            lines.append(
                inspector_line(
                    comm=COMM_A,
                    rank=rank,
                    n_ranks=4,
                    nnodes=2,
                    host=host,
                    pid=pid,
                    ts_us=ts,
                    coll="AllReduce",
                    sn=sn,
                    size=17179869184,
                    exec_us=exec_us,
                    algbw=None if (rank, sn) == (1, 3) else 277.210914,
                    busbw=485.119099,
                    verbose=(host == "node-002" and pid == 2001),
                )
            )
            if host == "node-001":  # the NVLink communicator of node-001's two ranks
                lines.append(
                    inspector_line(
                        comm=COMM_B,
                        rank=rank,
                        n_ranks=2,
                        nnodes=1,
                        host=host,
                        pid=pid,
                        ts_us=ts + 500,
                        coll="ReduceScatter",
                        sn=sn,
                        size=2147483648,
                        exec_us=41057,
                        algbw=418.439467,
                        busbw=366.134533,
                    )
                )
        if pid == 2002:
            # A newer format with fields this reader has never seen, then a p2p record.
            lines.append(
                inspector_line(
                    comm=COMM_A,
                    rank=rank,
                    n_ranks=4,
                    nnodes=2,
                    host=host,
                    pid=pid,
                    ts_us=T0_US + 6_000_000,
                    coll="AllGather",
                    sn=6,
                    size=1048576,
                    exec_us=900,
                    algbw=1.5,
                    busbw=1.1,
                    version="v5.1",
                    extra_meta=',"slurm_job_id":"4242","cuda_device":{"uuid":"GPU-1"}',
                )
            )
            lines.append(
                f'{{"header":{{"id":"{COMM_A}","rank":3,"n_ranks":4,"nnodes":2}},'
                f'"metadata":{{"inspector_output_format_version":"v5.1","git_rev":"",'
                f'"rec_mechanism":"nccl_profiler_interface",'
                f'"dump_timestamp_us":{T0_US + 6_500_000},'
                f'"hostname":"node-002","pid":2002}},"p2p_perf":{{"p2p":"Send","p2p_sn":1,'
                f'"p2p_peer":0,"p2p_msg_size_bytes":4194304,"p2p_exec_time_us":350,'
                f'"p2p_timing_source":"kernel_gpu","p2p_algobw_gbs":{_lf(11.98)},'
                f'"p2p_busbw_gbs":{_lf(11.98)}}}}}\n'
            )
        if pid == 2001:
            lines.insert(2, lines[2][:57] + "\n")  # a line cut short (a crashed writer)
        (d / f"{host}-pid{pid}.log").write_text("".join(lines))


# ------------------------------------------------------------------ flight recorder

PG0 = ("0", "default_pg")
PG1 = ("1", "tp_group")
T0_NS = T0_US * 1000


def _entry(
    rid: int, pg_id: int, pg: tuple[str, str], seq: int, state: str, rank: int
) -> dict[str, Any]:
    created = T0_NS + seq * 1_000_000_000 + pg_id * 1_000_000 + rank * 1000
    started = created + 50_000 if state in ("started", "completed") else None
    completed = created + 8_000_000 + rank * 10_000 if state == "completed" else None
    e: dict[str, Any] = {
        "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 2696}],
        "record_id": rid,
        "pg_id": pg_id,
        "process_group": pg,
        "thread_name": "pt_main_thread",
        "thread_id": "140235",
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": "nccl:all_reduce" if pg_id == 0 else "nccl:_allgather_base",
        "time_created_ns": created,
    }
    if state == "completed":
        e["duration_ms"] = 7.25 + rank * 0.5
    e.update(
        {
            "input_sizes": [[1024, 1024]],
            "input_dtypes": ["Float" if pg_id == 0 else "BFloat16"],
            "output_sizes": [[1024, 1024]],
            "output_dtypes": ["Float" if pg_id == 0 else "BFloat16"],
            "state": state,
            "time_discovered_started_ns": started,
            "time_discovered_completed_ns": completed,
            "retired": state == "completed",
            "timeout_ms": 600000,
            "is_p2p": False,
        }
    )
    return e


def fr_dump(rank: int) -> dict[str, Any]:
    """Rank ``rank``'s dump: collectives 1-4 done everywhere; 5 started except on rank 2."""
    entries = []
    rid = 0
    for seq in range(1, 6):
        state = "completed" if seq < 5 else ("scheduled" if rank == 2 else "started")
        entries.append(_entry(rid, 0, PG0, seq, state, rank))
        rid += 1
        if rank in (0, 1) and seq <= 3:
            entries.append(_entry(rid, 1, PG1, seq, "completed", rank))
            rid += 1
    pg_status: dict[str, dict[str, int]] = {
        "0": {
            "last_enqueued_collective": 5,
            "last_started_collective": 4 if rank == 2 else 5,
            "last_completed_collective": 4,
        }
    }
    pg_config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}
    if rank in (0, 1):
        pg_status["1"] = {
            "last_enqueued_collective": 3,
            "last_started_collective": 3,
            "last_completed_collective": 3,
        }
        pg_config["1"] = {"name": "1", "desc": "tp_group", "ranks": "[0, 1]"}
    return {
        "version": "2.4",
        "pg_config": pg_config,
        "comm_lib_version": "2.21.5",
        "pg_status": pg_status,
        "entries": entries,
    }


def fr_json(dump: dict[str, Any]) -> bytes:
    """What ``dump_json`` writes: nlohmann (sorted keys, compact), strings in pg_*."""
    out = json.loads(json.dumps(dump))
    out["pg_status"] = {
        k: {kk: str(vv) for kk, vv in v.items()} for k, v in dump["pg_status"].items()
    }
    for e in out["entries"]:
        e.pop("frames", None)  # the JSON API dumps no stack frames
        for key in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            e[key] = e[key] or 0
    return json.dumps(out, sort_keys=True, separators=(",", ":")).encode()


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        # relative: were it ever run, the marker appears in the reader's working
        # directory, wherever the checkout is (the test looks there)
        return (os.system, ("touch c4stream-PWNED",))


def write_flight_recorder() -> None:
    base = HERE / "flight_recorder"
    for sub in ("json", "pickle", "malicious"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    mtime = (T0_NS + 6_000_000_000) / 1e9  # 1 s after collective 5 began
    for rank in range(4):
        dump = fr_dump(rank)
        p = base / "pickle" / f"nccl_trace_rank_{rank}"
        p.write_bytes(pickle.dumps(dump, protocol=2))
        j = base / "json" / f"nccl_trace_rank_{rank}.json"
        j.write_bytes(fr_json(dump))
        for f in (p, j):
            os.utime(f, (mtime, mtime))
    (base / "malicious" / "nccl_trace_rank_0").write_bytes(
        pickle.dumps({"version": "2.4", "entries": [_Evil()]}, protocol=2)
    )


if __name__ == "__main__":
    write_inspector()
    write_flight_recorder()
    print(f"fixtures written under {HERE}")
