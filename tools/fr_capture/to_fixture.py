"""Turn ``capture.py`` runs into a committed set of real Flight Recorder fixtures.

Each argument is one case's ``capture.py --out`` directory: its ``capture.json`` and
one sub-directory per dump moment (``mid/``, ``end/``, ``during/``,
``after_timeout/``, and with ``--backend nccl`` the watchdog's own dumps,
``watchdog/``), each holding ``<prefix><rank>`` (pickle) and ``<prefix><rank>.json``.
The set written under ``--out`` is the layout the tests read
(``tests/streams/test_detect_gloo_3d.py``):

    <out>/captures.json                       {case: that case's capture.json}
    <out>/<case>/<moment>/pickle/<prefix><r>
    <out>/<case>/<moment>/json/<prefix><r>.json

The dump times stay in ``captures.json`` (``file_mtime_ns``, keyed ``<moment>/<file>``):
git keeps no mtimes, and the tests put them back. A case already in the set is
replaced; the others are kept. Files that are not dumps are left out, and said so::

    python tools/fr_capture/to_fixture.py /tmp/fr/dp-hang /tmp/fr/crash \\
        --out tests/producers/data/real/torch-2.15-nccl-3d
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

# PyTorch's dump file names, <prefix><rank> (docs/flight-recorder.md, "Files")
_DUMP = re.compile(r"^(?:.*comm_lib_trace_rank_|.*nccl_trace_rank_|.*_dump_)\d+(?:\.json)?$")


def convert(capture: Path, out: Path) -> tuple[str, int]:
    """One case's capture into ``out``; returns (case, dump files written)."""
    meta = json.loads((capture / "capture.json").read_text())
    case = str(meta["case"])
    dst = out / case
    if dst.exists():
        shutil.rmtree(dst)
    n = 0
    for moment in sorted(p for p in capture.iterdir() if p.is_dir()):
        for f in sorted(moment.iterdir()):
            if not f.is_file() or not _DUMP.match(f.name):
                print(f"{f}: not a dump: left out", file=sys.stderr)
                continue
            if f"{moment.name}/{f.name}" not in meta.get("file_mtime_ns", {}):
                raise SystemExit(f"{f}: no mtime in {capture / 'capture.json'}")
            fmt = "json" if f.suffix == ".json" else "pickle"
            (dst / moment.name / fmt).mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst / moment.name / fmt / f.name)
            n += 1
    if n == 0:
        raise SystemExit(f"{capture}: no dumps")
    index = out / "captures.json"
    cases = json.loads(index.read_text()) if index.exists() else {}
    cases[case] = meta
    index.write_text(json.dumps(dict(sorted(cases.items())), indent=1) + "\n")
    return case, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="+", type=Path, help="capture.py --out directories")
    ap.add_argument("--out", type=Path, required=True, help="the fixture set directory")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for cap in args.captures:
        case, n = convert(cap, args.out)
        print(f"{case}: {n} dumps -> {args.out / case}")


if __name__ == "__main__":
    main()
