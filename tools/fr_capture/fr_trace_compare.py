"""Run PyTorch's Flight Recorder analyzer (``fr_trace``) next to ``c4stream detect``.

For each snapshot directory of pickle dumps given: ``fr_trace`` on the files as they
are, then on copies whose ``pg_config`` is rebuilt from the groups the entries name
(ProcessGroupGloo writes an unusable one, see tools/fr_capture/README.md), then
``c4stream detect``. Prints what each concludes. Needs torch and msgspec in the
interpreter that runs it (the torch virtualenv), and the ``c4stream`` command::

    ~/torchvenv/bin/pip install msgspec
    PYTHONPATH=. ~/torchvenv/bin/python tools/fr_capture/fr_trace_compare.py \\
        --c4stream .venv/bin/c4stream tests/producers/data/real/torch-2.15-gloo/hang/during/pickle
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from producers.formats.flight_recorder import group_members, load_flight_recorder_dump


def _repaired(src: Path, dst: Path) -> None:
    """Copies of the dumps with pg_config = {group name: {name, desc, ranks}}."""
    dumps = {int(re.search(r"(\d+)$", p.name).group(1)): load_flight_recorder_dump(p)
             for p in sorted(src.glob("comm_lib_trace_rank_*"))}  # fmt: skip
    members = group_members(dumps)
    descs = {str(e["process_group"][0]): str(e["process_group"][1])
             for d in dumps.values() for e in d["entries"]}  # fmt: skip
    config = {g: {"name": g, "desc": descs.get(g, ""), "ranks": str(rs)}
              for g, rs in members.items()}  # fmt: skip
    dst.mkdir(parents=True, exist_ok=True)
    for rank, dump in dumps.items():
        dump["pg_config"] = config
        (dst / f"comm_lib_trace_rank_{rank}").write_bytes(pickle.dumps(dump))


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    lines = [ln for ln in text.splitlines() if "NumPy" not in ln and "_conversion_method" not in ln]
    return "\n".join(lines[-25:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--c4stream", default="c4stream", help="the c4stream command to run")
    args = ap.parse_args()
    fr = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    for d in args.dirs:
        print(f"### {d}\n--- fr_trace, dumps as written")
        print(_run([*fr, str(d), "-p", "comm_lib_trace_rank_"]))
        with tempfile.TemporaryDirectory() as tmp:
            fixed = Path(tmp) / "repaired"
            _repaired(d, fixed)
            print("--- fr_trace, pg_config rebuilt from the entries")
            print(_run([*fr, str(fixed), "-p", "comm_lib_trace_rank_"]))
            # c4stream reads the originals; their mtimes are the dump times
            copy = Path(tmp) / "orig"
            shutil.copytree(d, copy)
            print("--- c4stream detect")
            env = {**os.environ, "COLUMNS": "200"}
            out = subprocess.run([args.c4stream, "detect", str(copy), "--out",
                                  str(Path(tmp) / "c.jsonl")], capture_output=True, text=True,
                                 timeout=300, env=env)  # fmt: skip
            print(out.stdout[-3000:] + out.stderr[-2000:])


if __name__ == "__main__":
    main()
