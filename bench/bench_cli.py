"""Benchmark of the command line's first second: CPU seconds of `c4stream --help` and of
`c4stream detect` on one Flight Recorder snapshot.

Run: ``.venv/bin/python -m bench.bench_cli [--repeat 3] [--importtime]``

Each command runs in a fresh interpreter, as a user types it (the installed console
script of the virtualenv this runs in); its CPU seconds are the child's user + system
time (``os.wait4``), best of ``--repeat``: on a shared machine wall time measures the
neighbours, CPU time the command. ``--importtime`` adds the ten modules whose imports
cost the most for each command (``python -X importtime``, cumulative, self-inclusive).

Snapshot: ``tests/producers/data/real/torch-2.15-gloo/hang/after_timeout/pickle``, four
ranks of a real torch 2.15 job (gloo) dumped after rank 2 hung; detect names its host.

Targets (issue 26): ``--help`` <= 0.6 CPU s; ``detect`` on the 4-rank snapshot <= 1.5
CPU s. A missed target prints MISSED.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SNAPSHOT = REPO / "tests/producers/data/real/torch-2.15-gloo/hang/after_timeout/pickle"
TARGETS = {"help": 0.6, "detect": 1.5}


def _cli() -> list[str]:
    """The console script next to this interpreter, else the module (same code path)."""
    script = Path(sys.executable).with_name("c4stream")
    return [str(script)] if script.exists() else [sys.executable, "-m", "c4stream"]


def cpu_seconds(argv: list[str]) -> float:
    """User + system CPU seconds of one run of ``argv`` (output discarded)."""
    with open(os.devnull, "wb") as null:
        proc = subprocess.Popen(argv, stdout=null, stderr=null, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"bench_cli: {' '.join(argv)} exited {proc.returncode}")
    return usage.ru_utime + usage.ru_stime


def top_imports(args: list[str], n: int = 10) -> list[tuple[float, str]]:
    """The ``n`` costliest imports (cumulative seconds) of ``c4stream args``."""
    code = "import sys; from c4stream.cli import main; sys.argv[0] = 'c4stream'; main()"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per command (best is shown)")
    ap.add_argument("--importtime", action="store_true", help="also list the top imports")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "commands.jsonl")
        cases = {
            "help": ["--help"],
            "detect": ["detect", str(SNAPSHOT), "--out", out, "--quiet"],
        }
        shown = {"help": "c4stream --help", "detect": "c4stream detect SNAPSHOT --out OUT -q"}
        print(f"SNAPSHOT = {SNAPSHOT.relative_to(REPO)} (4 ranks)\n")
        print(f"{'command':<40} {'CPU s (best)':>12} {'all runs':>20} {'target':>7}  result")
        for name, args in cases.items():
            runs = [cpu_seconds([*_cli(), *args]) for _ in range(a.repeat)]
            best = min(runs)
            verdict = "met" if best <= TARGETS[name] else "MISSED"
            every = " ".join(f"{r:.2f}" for r in runs)
            print(f"{shown[name]:<40} {best:>12.2f} {every:>20} {TARGETS[name]:>7.1f}  {verdict}")
        if a.importtime:
            for args in cases.values():
                print(f"\ntop imports of `c4stream {args[0]}` (cumulative s, -X importtime):")
                for s, mod in top_imports(args):
                    print(f"  {s:6.3f}  {mod}")


if __name__ == "__main__":
    main()
