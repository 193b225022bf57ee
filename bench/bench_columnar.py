"""Columnar input: decode and ``detect`` rates for JSON lines, Arrow IPC and the Parquet
archive of the same trace, each as a ratio to merely parsing the JSON in the same run.

The trace has the issue's shape: a simulated healthy job, one line per host per
communicator per second (what one exporter per host writes). From it the script builds
the same events as Arrow IPC messages (one per line) and as the Parquet archive of
``c4.events`` (written by the archiver's own writer). Then, on one core (CPU seconds of
this process, ``time.process_time``):

* **parse JSON (baseline)** — read the ``.jsonl.gz`` and parse each line with msgspec
  into empty structs: every byte parsed, no field kept, no event object built. All
  ratios (×parse) are to this rate, measured in the same run;
* the same from memory (as a worker gets messages); for scale, msgspec's generic decode
  (JSON → dicts and lists) and the project's typed decode
  (``producers.events.decode_message``: JSON → checked event objects, what ``detect``
  and the worker do with JSON); decode Arrow messages → numpy columns per
  communicator; decode Arrow → event objects; a consumer batch of 500 JSON or Arrow
  messages → one column block (``decode_block``, as the worker does); read the Parquet
  archive → messages, and → blocks of messages (what ``detect`` reads);
* ``detect`` over the JSON trace (each line decoded with msgspec, then many lines'
  events turned into the archive's column blocks), over the archive and over the
  archive's rows as one Arrow IPC file (``streams.detect.run_detect``: decode + the
  detection core + the correlator).

Targets (issue 23): ``detect`` on JSON ≥ 0.8× parse; ``detect`` on Arrow/Parquet ≥ 2×
parse (and issue 15's ≥ 1M events/s per core). A missed target is printed as MISSED.

Run: ``python -m bench.bench_columnar [--gpus 1024] [--duration 48]`` (the issue's 394k events)
(~1 min at the defaults; the load average is printed beside the figures).
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from producers.columnar import decode_arrow, decode_block, decode_events, encode_arrow
from producers.events import decode_message
from producers.formats.parquet_archive import read_parquet_blocks, read_parquet_columns
from producers.simulator import SCENARIOS, with_gpus, write_trace
from producers.traces import TraceLine, read_trace
from sinks.archive.schemas import EVENTS
from sinks.archive.tables import MessageSources, events_table
from sinks.archive.writer import DatasetWriter, RollPolicy
from streams.detect import run_detect

__all__ = ["json_parse_rate", "load", "make_trace"]


class _Skip(msgspec.Struct):
    """No fields: msgspec parses every value and keeps none."""


_SKIP = msgspec.json.Decoder(list[_Skip] | _Skip)


def load() -> str:
    """The 1-minute load average and the core count, to print beside any figure."""
    return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def make_trace(tmp: Path, gpus: int, duration: float) -> Path:
    cfg = msgspec.structs.replace(
        with_gpus(SCENARIOS["healthy"], gpus), duration_s=duration, seed=3
    )
    path = tmp / f"trace-{gpus}.jsonl.gz"
    write_trace(cfg, path, tmp / "truth.json")
    return path


def json_parse_rate(trace: Path) -> tuple[int, float]:
    """(events, CPU seconds) of the baseline: gunzip + split + msgspec parse per line."""
    t0 = time.process_time()
    n = 0
    with gzip.open(trace, "rb") as fh:
        for line in fh:
            out = _SKIP.decode(line)
            n += len(out) if isinstance(out, list) else 1
    return n, time.process_time() - t0


def _cpu(fn: Callable[[], int]) -> tuple[int, float]:
    t0 = time.process_time()
    n = fn()
    return n, time.process_time() - t0


def _archive(trace: Path, root: Path) -> Path:
    """The trace as ``c4stream archive`` would have stored it (8 partitions, batches of 200)."""
    w = DatasetWriter(root / "events", EVENTS, RollPolicy())
    offsets = [0] * 8
    lines = [x.events for x in read_trace(trace) if isinstance(x, TraceLine)]
    for k in range(0, len(lines), 200):
        events, msgs = [], []
        for evs in lines[k : k + 200]:
            p = zlib.crc32(evs[0].comm.encode()) % 8
            msgs.append((p, offsets[p], evs[0].ts_us // 1000, len(evs)))
            offsets[p] += 1
            events += evs
        rows = events_table(events, MessageSources.build("c4.events", msgs))
        w.write(rows.table, rows.jobs)
    w.close_all()
    return root / "events"


def _ipc_file(parquet_files: list[Path], events_dir: Path, out: Path) -> Path:
    """The archive's rows (Kafka origin columns included) as one Arrow IPC file in the
    archive's ``job=`` directory layout (the job comes from the path, as for Parquet)."""
    table = pa.concat_tables(pq.ParquetFile(f).read() for f in parquet_files)
    path = out / parquet_files[0].parent.parent.relative_to(events_dir) / "events.arrow"
    path.parent.mkdir(parents=True)
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=65_536)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--duration", type=float, default=48, help="simulated seconds")
    args = ap.parse_args(argv)
    load0 = load()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        trace = make_trace(tmp, args.gpus, args.duration)
        raw_lines = [x.raw for x in read_trace(trace) if isinstance(x, TraceLine)]
        arrow_msgs = [encode_arrow(decode_message(r)) for r in raw_lines]
        events_dir = _archive(trace, tmp / "archive")
        parquet_files = sorted(events_dir.rglob("*.parquet"))
        ipc_file = _ipc_file(parquet_files, events_dir, tmp / "ipc")

        rows: list[tuple[str, int, float, str]] = []
        n, base_s = json_parse_rate(trace)
        base = n / base_s
        rows.append(("parse JSON lines, no objects (baseline)", n, base_s, ""))

        def parse_mem() -> int:
            k = 0
            for r in raw_lines:
                out = _SKIP.decode(r)
                k += len(out) if isinstance(out, list) else 1
            return k

        def dec_json() -> int:
            return sum(len(decode_message(r)) for r in raw_lines)

        def dec_generic() -> int:
            k = 0
            for r in raw_lines:
                out = msgspec.json.decode(r)
                k += len(out) if isinstance(out, list) else 1
            return k

        def dec_arrow_cols() -> int:
            return sum(c.n for m in arrow_msgs for c in decode_arrow(m))

        def dec_arrow_objs() -> int:
            return sum(len(decode_events(m, None)) for m in arrow_msgs)

        def block_of(msgs: list[bytes]) -> Callable[[], int]:
            def dec() -> int:  # what the worker does with a consumer batch of 500
                n = 0
                for k in range(0, len(msgs), 500):
                    _, block = decode_block([(m, None) for m in msgs[k : k + 500]])
                    n += int(block.starts[-1]) if block is not None else 0
                return n

            return dec

        def read_parquet() -> int:
            return sum(
                t.num_rows for f in parquet_files for _, t, _ in read_parquet_columns(f, job="j")
            )

        def read_blocks() -> int:
            return sum(b.n for f in parquet_files for _, b in read_parquet_blocks(f, job="j"))

        rows.append(("parse JSON lines already in memory, no objects", *_cpu(parse_mem), ""))
        rows.append(("decode JSON in memory → dicts (msgspec generic; reference)",
                     *_cpu(dec_generic), ""))  # fmt: skip
        rows.append(("decode JSON in memory → event objects (typed decode_message; reference)",
                     *_cpu(dec_json), ""))  # fmt: skip
        rows.append(("decode Arrow IPC → numpy columns", *_cpu(dec_arrow_cols), ""))
        rows.append(("decode Arrow IPC → event objects", *_cpu(dec_arrow_objs), ""))
        rows.append(("decode JSON → one column block per 500 messages (as the worker)",
                     *_cpu(block_of(raw_lines)), ""))  # fmt: skip
        rows.append(("decode Arrow IPC → one column block per 500 messages (as the worker)",
                     *_cpu(block_of(arrow_msgs)), ""))  # fmt: skip
        rows.append(("read Parquet archive → message columns", *_cpu(read_parquet), ""))
        rows.append(("read Parquet archive → blocks of messages (as detect)",
                     *_cpu(read_blocks), ""))  # fmt: skip
        res = None

        def det_json() -> int:
            nonlocal res
            res = run_detect([trace], tmp / "c1.jsonl")
            return res.n_events

        def det_parquet() -> int:
            return run_detect([events_dir], tmp / "c2.jsonl").n_events

        rows.append(("detect, JSON lines", *_cpu(det_json), "≥ 0.8× parse"))

        def det_ipc() -> int:
            return run_detect([ipc_file], tmp / "c3.jsonl").n_events

        rows.append(("detect, Parquet archive", *_cpu(det_parquet), "≥ 2× parse, ≥ 1M/s"))
        rows.append(("detect, Arrow IPC file", *_cpu(det_ipc), "≥ 2× parse, ≥ 1M/s"))
        same = (tmp / "c1.jsonl").read_bytes() == (tmp / "c2.jsonl").read_bytes()
        same_ipc = (tmp / "c1.jsonl").read_bytes() == (tmp / "c3.jsonl").read_bytes()
    load1 = load()

    print(
        f"\nColumnar input, {args.gpus} GPUs × {args.duration:g} s ({n:,} events, "
        f"{len(raw_lines):,} lines; {len(parquet_files)} Parquet files). CPU seconds of one "
        f"process; {load0} at start, {load1} at end."
    )
    print("| input | events | CPU s | events/s | × parse | target | result |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name, k, s, target in rows:
        rate = k / s if s > 0 else float("inf")
        ratio = rate / base
        verdict = ""
        if target.startswith("≥ 0.8"):
            verdict = "met" if ratio >= 0.8 else "MISSED"
        elif target.startswith("≥ 2"):  # two targets, each said
            verdict = (
                f"2× {'met' if ratio >= 2 else 'MISSED'}; "
                f"1M/s {'met' if rate >= 1_000_000 else 'MISSED'}"
            )
        print(f"| {name} | {k:,} | {s:.2f} | {rate:,.0f} | {ratio:.2f} | {target} | {verdict} |")
    print(f"\ncommands from JSON and from the archive byte-identical: {same}")
    print(f"commands from JSON and from the Arrow IPC file byte-identical: {same_ipc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
