"""Write an NCCL Inspector dump directory in the NCCL 2.30 layout (test fixture).

Field names and their order follow NVIDIA's writer (``plugins/profiler/inspector/
inspector_json.cc``): per dump and per communicator, every operation completed since
the last dump, one JSON line each, with ``header.comm_name``. ``--format v4.2`` adds
what that version writes: ``coll_algo``/``coll_proto`` and one ``dump_stats`` record
per communicator and dump. Four processes on two hosts, a world communicator and one
per host; deterministic (seeded).

    python tools/make_inspector_fixture.py tests/producers/data/inspector_2_30/nccl-inspector-7311
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

_PROCS = [("gpu-node-01", 41001, 0), ("gpu-node-01", 41002, 1),
          ("gpu-node-02", 52001, 2), ("gpu-node-02", 52002, 3)]  # fmt: skip
_COMMS = {
    "0x5e7a1c9d22f04b": ("dp_world", [0, 1, 2, 3]),
    "0x91b2c3d4e5f601": ("tp_node1", [0, 1]),
    "0x91b2c3d4e5f602": ("tp_node2", [2, 3]),
}
_T0 = 1_780_000_000_000_000


def _line(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def write(out: Path, fmt: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    for host, pid, g in _PROCS:
        lines = []
        sn = dict.fromkeys(_COMMS, 0)
        for dump in range(3):
            ts = _T0 + (dump + 1) * 1_000_000 + g * 37
            for cid, (name, ranks) in _COMMS.items():
                if g not in ranks:
                    continue
                n = 6 if name == "dp_world" else 4
                header = {
                    "id": cid,
                    "comm_name": name,
                    "rank": ranks.index(g),
                    "n_ranks": len(ranks),
                    "nnodes": 2 if len(ranks) == 4 else 1,
                }
                meta = {"inspector_output_format_version": fmt, "git_rev": "",
                        "rec_mechanism": "nccl_profiler_interface", "dump_timestamp_us": ts,
                        "hostname": host, "pid": pid}  # fmt: skip
                if fmt == "v4.2":
                    stats = {
                        "coll_records": n,
                        "coll_dropped_total": 0,
                        "coll_dropped_since_last_dump": 0,
                        "p2p_records": 0,
                        "p2p_dropped_total": 0,
                        "p2p_dropped_since_last_dump": 0,
                    }
                    lines.append(_line({"header": header, "metadata": meta, "dump_stats": stats}))
                for i in range(n):
                    sn[cid] += 1
                    other = "AllGather" if name == "dp_world" else "ReduceScatter"
                    coll = "AllReduce" if i % 2 == 0 else other
                    size = 268435456 if name == "dp_world" else 33554432
                    us = int((2900 if name == "dp_world" else 410) * (1 + 0.04 * rng.random()))
                    algbw = size / us / 1e3
                    k = len(ranks)
                    busbw = algbw * (2 * (k - 1) / k if coll == "AllReduce" else (k - 1) / k)
                    perf: dict = {"coll": coll}
                    if fmt == "v4.2":
                        perf |= {"coll_algo": "RING", "coll_proto": "SIMPLE"}
                    perf |= {"coll_sn": sn[cid], "coll_msg_size_bytes": size,
                             "coll_exec_time_us": us, "coll_timing_source": "kernel_gpu",
                             "coll_algobw_gbs": round(algbw, 6),
                             "coll_busbw_gbs": round(busbw, 6)}  # fmt: skip
                    lines.append(_line({"header": header, "metadata": meta, "coll_perf": perf}))
        (out / f"{host}-pid{pid}.log").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--format", default="v4.0", choices=["v4.0", "v4.2"])
    args = ap.parse_args()
    write(args.out, args.format)


if __name__ == "__main__":
    main()
