"""PyTorch's Flight Recorder analyzer (``fr_trace``) beside ``c4stream detect``, one
markdown table row per snapshot directory (pickle dumps).

For the analyzer, each snapshot is copied with files renamed ``fr_rank_<r>`` (it wants
one common prefix; a host name in the prefix breaks that), files that are not dumps
left out, and ``pg_config`` rebuilt from the entries where the writer's is unusable
(ProcessGroupGloo); it runs with ``--allow-incomplete-ranks`` (without it, it stops at
the first missing dump). ``c4stream detect`` reads the snapshot with its dump times put
back (the ``--times`` manifest: a captures.json ``file_mtime_ns`` or an NCCL-format
``manifest.json`` ``dump_time_ns``). Run from the torch virtualenv with msgspec
installed, e.g.::

    PYTHONPATH=. ~/torch215/bin/python tools/fr_capture/compare_sets.py \\
        --c4stream .venv/bin/c4stream tests/producers/data/real/torch-2.15-gloo-3d
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from producers.formats.flight_recorder import (
    FlightRecorderError,
    load_flight_recorder_dump,
    rank_from_filename,
    snapshot_facts,
)


def _dumps(d: Path) -> dict[int, tuple[Path, dict]]:
    out = {}
    for f in sorted(d.iterdir()):
        try:
            out[rank_from_filename(f)] = (f, load_flight_recorder_dump(f))
        except FlightRecorderError:
            continue  # a log beside the dumps
    return out


def _for_analyzer(d: Path, dst: Path) -> None:
    dumps = _dumps(d)
    facts = snapshot_facts({r: x[1] for r, x in dumps.items()})
    config = {g.name: {"name": g.name, "desc": g.desc, "ranks": str(g.members)}
              for g in facts.groups.values()}  # fmt: skip
    dst.mkdir(parents=True)
    for r, (path, dump) in dumps.items():
        if str(dump.get("version", "")).startswith("1."):  # as written: no upgrade
            shutil.copyfile(path, dst / f"fr_rank_{r}")
            continue
        if "" in (dump.get("pg_config") or {}):  # gloo's unusable pg_config
            dump = {**dump, "pg_config": config}
        dump.setdefault("entries", [])
        (dst / f"fr_rank_{r}").write_bytes(pickle.dumps(dump))


def _fr_trace(d: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(d), "-p",
           "fr_rank_", "--allow-incomplete-ranks"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    said = []
    for m in re.finditer(r"missing ranks: (\{[^}]*\})", text):
        said.append(f"missing {m.group(1)}")
    for m in re.finditer(r"missed FR dumps from ranks \(?(\{[^}]*\})", text):
        said.append(f"missed dumps {m.group(1)}")
    if out.returncode != 0:
        said.append("fails: " + text.strip().splitlines()[-1][:80])
    uniq = list(dict.fromkeys(said))
    return "; ".join(uniq[:4]) + (f" (+{len(uniq) - 4})" if len(uniq) > 4 else "") or "nothing"


def _c4(d: Path, times: dict | None, c4stream: str, tmp: Path) -> str:
    """``times`` None: a fresh copy (mtimes now), as after ``cp`` without ``-p``."""
    copy = tmp / ("c4" if times is not None else "c4-copied")
    shutil.copytree(d, copy)
    for f in copy.iterdir():
        ns = (times or {}).get(f.name)
        if ns is not None:
            os.utime(f, ns=(ns, ns))
        elif times is None:
            os.utime(f)
    out = copy.with_suffix(".jsonl")
    subprocess.run([c4stream, "detect", str(copy), "--out", str(out), "-q"],
                   capture_output=True, timeout=300, check=False)  # fmt: skip
    cmds = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return "; ".join(f"`{c['host']}` {c['fault']} {c['action']}" for c in cmds) or "nothing"


def _times(root: Path, case: str, moment: str) -> dict[str, int]:
    if (root / "captures.json").exists():
        cap = json.loads((root / "captures.json").read_text())[case]["file_mtime_ns"]
        return {k.split("/", 1)[1]: v for k, v in cap.items() if k.startswith(f"{moment}/")}
    man = json.loads((root / "manifest.json").read_text())["cases"][case]["dump_time_ns"]
    return {f.name: man for f in (root / case / moment / "pickle").iterdir()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--c4stream", default="c4stream")
    args = ap.parse_args()
    print("| set | snapshot | `fr_trace` | `c4stream detect` | `c4stream detect`, copied "
          "(no dump time) |\n|---|---|---|---|---|")  # fmt: skip
    for root in args.roots:
        for snap in sorted(root.glob("*/*/pickle")):
            case, moment = snap.parent.parent.name, snap.parent.name
            with tempfile.TemporaryDirectory() as tmp:
                _for_analyzer(snap, Path(tmp) / "fr")
                fr = _fr_trace(Path(tmp) / "fr")
                c4 = _c4(snap, _times(root, case, moment), args.c4stream, Path(tmp))
                copied = _c4(snap, None, args.c4stream, Path(tmp))
            print(f"| {root.name} | {case}/{moment} | {fr} | {c4} | {copied} |", flush=True)


if __name__ == "__main__":
    main()
