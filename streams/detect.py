"""``c4stream detect``: run the detection core over recorded traces, without Kafka.

Loader → pipeline → writer, in event time, deterministic: the same traces give the same
commands, byte for byte. Input is anything :mod:`producers.sources` opens (contract
JSON lines plain or gzip, NCCL Inspector dumps, Flight Recorder dumps); bad lines are
reported with ``file:line: reason``, counted, and skipped. Flight Recorder dumps are a
snapshot (every rank's ring at one moment), judged as a whole
(:mod:`streams.core.snapshot`) rather than replayed as a stream; their verdicts go
through the same correlator and rails.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "t.jsonl").write_text('{"broken": 1}\\n')
>>> r = run_detect([d / "t.jsonl"], d / "out.jsonl")
>>> r.n_events, r.n_bad, r.commands
(0, 1, [])
>>> run_detect([d / "missing.jsonl"], d / "out.jsonl")
Traceback (most recent call last):
...
streams.detect.DetectInputError: ...missing.jsonl: no such file or directory; ...
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from c4base.collector import collector_tuned
from producers.events import Event
from producers.formats.flight_recorder import SnapshotFacts
from producers.sources import SourceBatch, SourceError, open_sources
from producers.traces import BadLine
from streams.commands import IsolationCommand, encode_command
from streams.core import DetectConfig, DetectionPipeline, PolicyConfig
from streams.core.columns import ColumnBlockLike, EventColumnsLike, PartsBlock, as_parts
from streams.core.summary_evidence import vouched

__all__ = ["DetectInputError", "DetectResult", "run_detect", "summary_table"]


class DetectInputError(ValueError):
    """An input path cannot be read at all. Give a trace file (JSON lines, plain or
    .gz), an NCCL Inspector dump directory or Flight Recorder dumps that exist."""


@dataclass(slots=True)
class DetectResult:
    commands: list[IsolationCommand] = field(default_factory=list)
    n_events: int = 0
    n_bad: int = 0
    n_verdicts: int = 0
    n_late: int = 0
    """Events not judged: more than the allowed lateness behind what their communicator
    was already judged up to (the worker dead-letters the same)."""
    n_late_verdicts: int = 0
    """Verdicts the correlator did not judge, late beyond the allowed lateness."""
    n_communicators: int = 0
    elapsed_s: float = 0.0
    first_ts_us: int | None = None


def _open_out(path: Path) -> IO[bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return gzip.open(path, "wb") if path.suffix == ".gz" else open(path, "wb")


def _batches(
    paths: list[Path], on_bad: Callable[[BadLine], None], dump_time_us: int | None = None
) -> Iterator[SourceBatch]:
    """Batches from the inputs (any format :mod:`producers.sources` reads): events, or
    columns (the Parquet archive), and the snapshot a Flight Recorder dump belongs to."""
    for p in paths:
        if not p.exists():
            raise DetectInputError(
                f"{p}: no such file or directory; give a trace file or dump directory that exists"
            )
    try:
        yield from open_sources(paths, on_bad=on_bad, blocks=True, dump_time_us=dump_time_us)
    except SourceError as err:
        raise DetectInputError(str(err)) from None
    except OSError as err:
        raise DetectInputError(f"cannot read input: {err}") from None


def run_detect(
    paths: Iterable[str | Path],
    out: str | Path,
    detect: DetectConfig | None = None,
    policy: PolicyConfig | None = None,
    on_bad: Callable[[BadLine], None] | None = None,
    dump_time_us: int | None = None,
) -> DetectResult:
    """Run the core over ``paths`` and write the isolation commands to ``out`` (JSON lines).

    ``dump_time_us``: when Flight Recorder dumps were taken (``--dump-time``), for dumps
    whose mtimes were lost in a copy."""
    with collector_tuned():
        return _run_detect(paths, out, detect, policy, on_bad, dump_time_us)


def _run_detect(
    paths: Iterable[str | Path],
    out: str | Path,
    detect: DetectConfig | None,
    policy: PolicyConfig | None,
    on_bad: Callable[[BadLine], None] | None,
    dump_time_us: int | None = None,
) -> DetectResult:
    res = DetectResult()
    t0 = time.perf_counter()

    def bad(b: BadLine) -> None:
        res.n_bad += 1
        if on_bad is not None:
            on_bad(b)

    pipe = DetectionPipeline(detect, policy)
    outp = Path(out)
    batches = _batches([Path(p) for p in paths], bad, dump_time_us)
    # Dumps (one snapshot: every rank at one moment) are judged as a whole once read;
    # they are small (a ring of at most a few thousand entries per rank).
    snapshots: dict[str, list[Event]] = {}
    facts: dict[str, SnapshotFacts] = {}
    parts: list[EventColumnsLike] = []  # events read as objects, not yet fed
    sums: dict[int, list[object]] = {}  # windows at the source: summaries by their part
    with _open_out(outp) as fh:
        for batch in batches:
            cols, block = batch.columns, batch.block  # the Parquet archive: as columns
            if res.first_ts_us is None and (cols or block or batch.events):
                res.first_ts_us = (
                    int(block.ts_us[0])
                    if block is not None
                    else int(cols[0].ts_us[0])
                    if cols
                    else batch.events[0].ts_us
                )
            if batch.snapshot is not None:
                snapshots.setdefault(batch.snapshot, []).extend(batch.events)
                if batch.facts is not None:
                    facts[batch.snapshot] = batch.facts
                continue
            if block is None and cols is None:  # events as objects: into columns here
                parts += as_parts(batch.events)
                if batch.summaries and parts:  # folded with the slice of the line's events
                    sums[len(parts) - 1] = vouched(batch.summaries, batch.events)
                if len(parts) < _PARTS:
                    continue  # many lines as one block: the same slices, less per line
            for cmd in _feed(pipe, parts, block or (PartsBlock(cols) if cols else None), sums):
                fh.write(encode_command(cmd) + b"\n")
        for cmd in _feed(pipe, parts, None, sums):
            fh.write(encode_command(cmd) + b"\n")
        for key, snap in snapshots.items():
            for cmd in pipe.judge_snapshot(snap, facts.get(key)):
                fh.write(encode_command(cmd) + b"\n")
        for cmd in pipe.finish():
            fh.write(encode_command(cmd) + b"\n")
    res.commands = pipe.commands
    res.n_events = pipe.n_events
    res.n_verdicts = len(pipe.verdicts)
    res.n_late = sum(n for _, _, n, _ in pipe.late_events)
    res.n_late_verdicts = len(pipe.late)
    res.n_communicators = len(pipe.detectors) + len(pipe.snapshot_comms)
    res.elapsed_s = time.perf_counter() - t0
    return res


_PARTS = 1024
"""Batches of events read as objects fed to the pipeline as one block (one per line of a
JSON trace: fed one by one, each costs a block of its own)."""


def _feed(
    pipe: DetectionPipeline,
    parts: list[EventColumnsLike],
    block: ColumnBlockLike | None,
    sums: dict[int, list[object]],
) -> list[IsolationCommand]:
    """The parts waiting (in order, with the summaries of their lines), then ``block``,
    into the pipeline: the one way in, blocks of columns; the commands decided
    meanwhile."""
    out = pipe.feed_block(PartsBlock(parts), sums or None) if parts else []
    parts.clear()
    sums.clear()
    return out + (pipe.feed_block(block) if block is not None else [])


def summary_table(res: DetectResult):  # -> rich.table.Table (rich imported lazily)
    """The commands as a table a person reads: time, host, component, fault, action, …"""
    from rich.table import Table

    from streams.scoring import component_label

    t0 = res.first_ts_us or 0
    table = Table(
        title=f"c4stream detect: {len(res.commands)} command(s) from {res.n_events} events "
        f"on {res.n_communicators} communicators ({res.n_bad} bad lines"
        + (f", {res.n_late} late events not judged" if res.n_late else "")
        + ")",
        show_lines=False,
    )
    for col in ("t (s)", "host", "component", "fault", "action", "conf.", "reason"):
        table.add_column(col, overflow="fold")
    for c in res.commands:
        comp = component_label(c.gpu, c.nic, c.peer_host, c.fault)  # the demo's words
        action = c.action + (" (dry run)" if c.dry_run else "")
        table.add_row(
            f"{(c.ts_us - t0) / 1e6:.1f}",
            c.host,
            comp,
            c.fault,
            action,
            f"{c.confidence:.2f}",
            c.reason,
        )
    return table
