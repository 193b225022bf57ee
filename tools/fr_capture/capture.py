"""Capture real PyTorch Flight Recorder dumps from a gloo job on CPU.

Runs ``--world`` processes (``torch.distributed``, ProcessGroupGloo, 127.0.0.1 only)
with the world group and two or more sub-groups (consecutive pairs, and the even
ranks when there are at least four), a few collective kinds per step, and one of
three cases:

* ``healthy``: every rank runs every step;
* ``hang``: rank ``--bad-rank`` never enters its ``--hang-at``-th world collective
  (it sleeps instead, a non-communication hang), or with ``--hang-sub-step K`` its first
  sub-group collective of step K; its peers wait until the gloo timeout fires;
* ``straggler``: rank ``--bad-rank`` sleeps ``--late-ms`` before every collective.

Every rank dumps its recorder with PyTorch's own APIs, as pickle (``_dump_fr_trace``,
written to ``comm_lib_trace_rank_<rank>``, the default file name) and as JSON
(``_dump_fr_trace_json``, to ``comm_lib_trace_rank_<rank>.json``), at chosen moments:

* ``healthy`` / ``straggler``: ``mid/`` at a common wall-clock moment while the job
  runs, ``end/`` after each rank's last collective;
* ``hang``: ``during/`` ``--dump-after`` seconds after the ranks reach the hang,
  ``after_timeout/`` once the timeout has fired on the waiting ranks (the hung rank
  dumps at the same moment, still asleep).

The capture writes ``capture.json`` beside the dumps: the torch version, the case,
its parameters, the groups, and each file's mtime (git does not keep mtimes; the dump
time is not written inside a dump, so readers use the file's mtime).

``--layout 3d`` (8 ranks) runs a job shaped like a tensor × pipeline × data parallel
training job instead: tensor pairs ``[0, 1]``, ``[2, 3]``, …; pipeline stage 0 (ranks
0, 1, 4, 5) sends activations to stage 1 (ranks 2, 3, 6, 7) with ``send``/``recv`` on
pairs ``[0, 2]``, ``[1, 3]``, …, and gets gradients back; ZeRO data-parallel pairs
``[0, 4]``, ``[1, 5]``, … (all-reduce as the reduce-scatter, all-gather); one world
all-reduce (the gradient norm) per step. Its cases: ``healthy``, ``slowdown`` (every
rank slower alike), ``straggler``, ``dp-hang`` (``--bad-rank`` never enters its
data-parallel all-reduce of step ``--hang-step``), ``pp-hang`` (it never sends its
activation of that step), ``crash`` (its process exits there, leaving no dump).

Needs torch (not a c4stream dependency): run it from a virtualenv of its own, e.g.::

    python3 -m venv ~/torchvenv && ~/torchvenv/bin/pip install torch
    ~/torchvenv/bin/python tools/fr_capture/capture.py hang --out /tmp/fr/hang
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path


def _groups(world: int) -> list[list[int]]:
    """Sub-groups: consecutive pairs, plus the even ranks when there are four or more."""
    pairs = [[r, r + 1] for r in range(0, world - 1, 2)]
    evens = [list(range(0, world, 2))] if world >= 4 else []
    return pairs + evens


def _dump(prefix: Path, rank: int, backend: str = "gloo") -> None:
    # Both formats through PyTorch's own dump APIs, written as <prefix><rank> (pickle,
    # the name the watchdog's file writer uses) and <prefix><rank>.json. Not through
    # _dump_fr_trace_file: its writer fixes TORCH_FR_DUMP_TEMP_FILE at first use, so a
    # second dump to another directory would overwrite the first.
    import torch._C._distributed_c10d as c10d  # torch is optional: only this tool needs it

    prefix.parent.mkdir(parents=True, exist_ok=True)
    if backend == "nccl":  # ProcessGroupNCCL's own recorder (CUDA events)
        pkl = c10d._dump_nccl_trace(includeCollectives=True, includeStackTraces=False,
                                    onlyActive=False)  # fmt: skip
        js = c10d._dump_nccl_trace_json(includeCollectives=True, onlyActive=False)
    else:
        pkl, js = c10d._dump_fr_trace(includeStackTraces=False), c10d._dump_fr_trace_json()
    Path(f"{prefix}{rank}").write_bytes(pkl)
    Path(f"{prefix}{rank}.json").write_bytes(js.encode() if isinstance(js, str) else js)


def _worker(args: argparse.Namespace, rank: int) -> None:
    import torch  # optional dependency of this tool only
    import torch.distributed as dist

    out = Path(args.out)
    name = "comm_lib_trace_rank_"
    store = dist.TCPStore("127.0.0.1", args.port, args.world, rank == 0, timedelta(seconds=30))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )  # fmt: skip
    world = dist.group.WORLD
    subs = [dist.new_group(g, timeout=timedelta(seconds=args.timeout)) for g in _groups(args.world)]
    mine = [(g, members) for g, members in zip(subs, _groups(args.world), strict=True)
            if rank in members]  # fmt: skip
    rng = random.Random(rank)
    x = torch.ones(args.elems)
    small = torch.ones(8)

    # Mid-run dump: all ranks at one wall-clock moment (one host, one clock).
    t_mid = float(store.get("t_mid").decode()) if rank else time.time() + args.mid_s
    if rank == 0:
        store.set("t_mid", repr(t_mid))
    if args.case != "hang":
        threading.Thread(
            target=lambda: (
                time.sleep(max(0.0, t_mid - time.time())),
                _dump(out / "mid" / name, rank),
            ),
            daemon=True,
        ).start()

    def late() -> None:
        if args.case == "straggler" and rank == args.bad_rank:
            time.sleep(args.late_ms / 1000)

    def hang_here() -> None:
        # The fault: this rank stops before a collective (a stuck kernel, a data-loader
        # deadlock ...). Dump while its peers wait, and again after their timeout fired,
        # at the moments the peers dump too.
        time.sleep(args.dump_after)
        _dump(out / "during" / name, rank)
        time.sleep(args.timeout - args.dump_after + args.after_timeout_s)
        _dump(out / "after_timeout" / name, rank)
        time.sleep(1.0)
        os._exit(0)

    def dump_during_later() -> None:
        threading.Thread(
            target=lambda: (time.sleep(args.dump_after), _dump(out / "during" / name, rank)),
            daemon=True,
        ).start()

    def run(op: Callable[[], object]) -> None:
        try:
            op()
        except RuntimeError as err:  # the gloo timeout of the hung collective
            print(f"rank {rank}: {type(err).__name__}: {str(err)[:160]}", file=sys.stderr)
            time.sleep(max(0.0, args.after_timeout_s - 0.5))
            _dump(out / "after_timeout" / name, rank)
            time.sleep(1.0)
            os._exit(0)

    hang = args.case == "hang"
    n_world = 0
    for step in range(1, args.steps + 1):
        time.sleep(args.compute_ms / 1000 * (0.8 + 0.4 * rng.random()))  # "compute"
        for kind in ("all_reduce", "broadcast", "all_gather"):
            n_world += 1
            if hang and not args.hang_sub_step and n_world == args.hang_at:
                if rank == args.bad_rank:
                    hang_here()
                dump_during_later()
            late()
            if kind == "all_reduce":
                run(lambda: dist.all_reduce(x, group=world))
            elif kind == "broadcast":
                run(lambda: dist.broadcast(small, src=0, group=world))
            else:
                run(lambda: dist.all_gather([torch.empty_like(small) for _ in range(args.world)],
                                            small))  # fmt: skip
        if hang and step == args.hang_sub_step:  # the fault before a sub-group collective
            if rank == args.bad_rank:
                hang_here()
            dump_during_later()
        for g, members in mine:
            late()
            run(lambda g=g: dist.all_reduce(small, group=g))
            late()
            run(lambda g=g, m=members: dist.all_gather([torch.empty_like(small) for _ in m],
                                                       small, group=g))  # fmt: skip
    _dump(out / "end" / name, rank)
    dist.destroy_process_group()


CASES_3D = ("healthy", "slowdown", "straggler", "dp-hang", "pp-hang", "crash")


def _groups_3d(world: int = 8) -> dict[str, list[list[int]]]:
    """Tensor pairs, pipeline pairs (stage 0 → stage 1) and data-parallel pairs."""
    return {
        "tensor": [[r, r + 1] for r in range(0, world, 2)],
        "pipeline": [[r, r + 2] for r in range(world) if (r // 2) % 2 == 0],
        "data": [[r, r + world // 2] for r in range(world // 2)],
    }


def _worker_3d(args: argparse.Namespace, rank: int) -> None:
    """One rank of the 8-rank tensor × pipeline × data-parallel job (see the docstring)."""
    import torch  # optional dependency of this tool only
    import torch.distributed as dist

    out = Path(args.out)
    backend = args.backend
    name = "nccl_trace_rank_" if backend == "nccl" else "comm_lib_trace_rank_"
    store = dist.TCPStore("127.0.0.1", args.port, args.world, rank == 0, timedelta(seconds=30))
    to = timedelta(seconds=args.timeout)
    device = "cpu"
    if backend == "nccl":  # one GPU per rank (checked in main)
        torch.cuda.set_device(rank)
        device = "cuda"
    dist.init_process_group(backend, store=store, rank=rank, world_size=args.world, timeout=to)
    layout = _groups_3d(args.world)
    handles: dict[str, object] = {}
    for kind in ("tensor", "pipeline", "data"):  # every rank creates every group, in order
        for members in layout[kind]:
            g = dist.new_group(members, timeout=to)
            if rank in members:
                handles[kind] = g
    stage = (rank // 2) % 2
    peer = rank + 2 if stage == 0 else rank - 2  # pipeline peer
    rng = random.Random(rank)
    act = torch.ones(args.elems, device=device)
    small = torch.ones(8, device=device)
    bad = rank == args.bad_rank
    case = args.case
    hang_case = case in ("dp-hang", "pp-hang", "crash")

    t_mid = float(store.get("t_mid").decode()) if rank else time.time() + args.mid_s
    if rank == 0:
        store.set("t_mid", repr(t_mid))
    if not hang_case:
        threading.Thread(
            target=lambda: (time.sleep(max(0.0, t_mid - time.time())),
                            _dump(out / "mid" / name, rank, backend)),
            daemon=True,
        ).start()  # fmt: skip

    def dumps_of_the_hang() -> None:
        # Every surviving rank: one dump while its peers wait, one after the timeout
        # fired (a rank that gave up stays where it stopped), then exit.
        def later() -> None:
            time.sleep(args.dump_after)
            _dump(out / "during" / name, rank, backend)
            time.sleep(args.timeout - args.dump_after + args.after_timeout_s)
            _dump(out / "after_timeout" / name, rank, backend)
            time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=later, daemon=True).start()

    def op(fn: Callable[[], object]) -> None:
        if case == "straggler" and bad:
            time.sleep(args.late_ms / 1000)
        elif case == "slowdown":
            time.sleep(args.late_ms / 1000)  # every rank alike
        try:
            fn()
            if backend == "nccl":  # NCCL is asynchronous: wait as the gloo job does
                torch.cuda.synchronize()
        except RuntimeError as err:  # a timeout behind the hang: stop here
            print(f"rank {rank}: {type(err).__name__}: {str(err)[:160]}", file=sys.stderr)
            while True:
                time.sleep(1.0)

    def fault(where: str, step: int) -> None:
        if not hang_case or step != args.hang_step:
            return
        if where == "start":
            dumps_of_the_hang()
        want = {"dp-hang": "data", "pp-hang": "send", "crash": "data"}[case]
        if bad and where == want:
            if case == "crash":
                os._exit(1)  # the process dies: no dump
            while True:  # a non-communication hang: it never reaches the operation
                time.sleep(1.0)

    tp, pp, dp = handles["tensor"], handles["pipeline"], handles["data"]
    compute = args.compute_ms * (3.0 if case == "slowdown" else 1.0)
    for step in range(1, args.steps + 1):
        fault("start", step)
        time.sleep(compute / 1000 * (0.8 + 0.4 * rng.random()))  # "compute"
        if stage == 0:
            op(lambda: dist.all_reduce(act, group=tp))
            fault("send", step)
            op(lambda: dist.send(act, dst=peer, group=pp))
            op(lambda: dist.recv(act, src=peer, group=pp))  # the gradient back
            op(lambda: dist.all_reduce(act, group=tp))
        else:
            op(lambda: dist.recv(act, src=peer, group=pp))
            op(lambda: dist.all_reduce(act, group=tp))
            op(lambda: dist.all_reduce(act, group=tp))
            fault("send", step)
            op(lambda: dist.send(act, dst=peer, group=pp))
        fault("data", step)
        op(lambda: dist.all_reduce(act, group=dp))  # ZeRO: the reduce-scatter
        op(lambda: dist.all_gather([torch.empty_like(small) for _ in range(2)], small, group=dp))
        op(lambda: dist.all_reduce(small))  # the gradient norm, world
    _dump(out / "end" / name, rank, backend)
    dist.destroy_process_group()


def _manifest(args: argparse.Namespace) -> None:
    import torch  # optional dependency of this tool only

    out = Path(args.out)
    files = {
        str(p.relative_to(out)): p.stat().st_mtime_ns
        for p in sorted(
            [
                *out.rglob("comm_lib_trace_rank_*"),
                *out.rglob("nccl_trace_rank_*"),
                *out.rglob("_dump_*"),
            ]
        )
    }
    if args.layout == "3d":
        meta3 = {
            "torch": torch.__version__, "backend": getattr(args, "backend", "gloo"),
            "layout": "3d", "case": args.case,
            "world": args.world, "groups": {"world": list(range(args.world)), **_groups_3d()},
            "steps": args.steps, "compute_ms": args.compute_ms, "timeout_s": args.timeout,
            "bad_rank": None if args.case in ("healthy", "slowdown") else args.bad_rank,
            "hang_step": args.hang_step if args.case in ("dp-hang", "pp-hang", "crash")
            else None,
            "dump_after_s": args.dump_after, "late_ms": args.late_ms,
            "fr_buffer_size": os.environ.get("TORCH_FR_BUFFER_SIZE", "2000"),
            "file_mtime_ns": files,
        }  # fmt: skip
        (out / "capture.json").write_text(json.dumps(meta3, indent=1) + "\n")
        return
    meta = {
        "torch": torch.__version__,
        "backend": "gloo",
        "case": args.case,
        "world": args.world,
        "groups": [list(range(args.world)), *_groups(args.world)],
        "collectives_per_step": {"world": ["all_reduce", "broadcast", "all_gather"],
                                 "sub_groups": ["all_reduce", "all_gather"]},
        "steps": args.steps,
        "compute_ms": args.compute_ms,
        "timeout_s": args.timeout,
        "bad_rank": args.bad_rank if args.case != "healthy" else None,
        "hang_at_world_collective": args.hang_at
        if args.case == "hang" and not args.hang_sub_step
        else None,
        "hang_at_sub_group_step": args.hang_sub_step or None,
        "dump_after_s": args.dump_after if args.case == "hang" else None,
        "late_ms": args.late_ms if args.case == "straggler" else None,
        "file_mtime_ns": files,
    }  # fmt: skip
    (out / "capture.json").write_text(json.dumps(meta, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=sorted({"healthy", "hang", "straggler", *CASES_3D}))
    ap.add_argument("--layout", choices=["groups", "3d"], default="groups")
    ap.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default="gloo",
        help="3d: nccl needs a GPU machine (one GPU per rank); not run here",
    )
    ap.add_argument("--hang-step", type=int, default=8, help="3d: the step of the fault")
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compute-ms", type=float, default=10.0)
    ap.add_argument("--elems", type=int, default=4096)
    ap.add_argument("--bad-rank", type=int, default=2)
    ap.add_argument(
        "--hang-at", type=int, default=61, help="world collective (1-based) never entered"
    )
    ap.add_argument(
        "--hang-sub-step",
        type=int,
        default=0,
        help="instead: hang before the rank's first sub-group collective of this step (1-based)",
    )
    ap.add_argument("--late-ms", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=8.0, help="gloo timeout, s")
    ap.add_argument("--dump-after", type=float, default=4.0, help="s into the hang")
    ap.add_argument("--after-timeout-s", type=float, default=1.0)
    ap.add_argument("--mid-s", type=float, default=1.5, help="mid-run dump, s after start")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        (_worker_3d if args.layout == "3d" else _worker)(args, args.worker)
        return
    if args.backend == "nccl" and args.layout != "3d":
        ap.error("--backend nccl runs the 3d layout")
    if args.backend == "nccl":  # NCCL refuses two ranks of one group on one GPU
        import torch  # optional dependency of this tool only

        if torch.cuda.device_count() < args.world:
            ap.error(f"--backend nccl needs {args.world} GPUs, one per rank; "
                     f"torch sees {torch.cuda.device_count()}")  # fmt: skip
    if args.layout == "3d" and (args.world != 8 or args.case == "hang"):
        ap.error("--layout 3d runs 8 ranks and the cases " + ", ".join(CASES_3D))
    if args.layout == "groups" and args.case not in ("healthy", "hang", "straggler"):
        ap.error(f"case {args.case} needs --layout 3d")
    # torch 2.9 records nothing unless the buffer size is set; 2.15 defaults to 2000
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "2000")}
    if args.backend == "nccl":  # older releases read the NCCL names; the watchdog dumps too
        env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", env["TORCH_FR_BUFFER_SIZE"])
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(args.out) / "watchdog" / "_dump_"))
        env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", env["TORCH_FR_DUMP_TEMP_FILE"])
        (Path(args.out) / "watchdog").mkdir(parents=True, exist_ok=True)
    procs = [
        subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--worker", str(r)], env=env)
        for r in range(args.world)
    ]
    deadline = time.time() + 120  # bounded: a capture never runs away
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    _manifest(args)


if __name__ == "__main__":
    main()
