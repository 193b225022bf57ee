"""Quality benchmark: c4stream vs. a 10-minute watchdog vs. an NCCL-RAS-style rule.

Runs every scenario of :mod:`bench.scenarios` through the simulator once, feeding
each batch to c4stream's broker-free :class:`~streams.core.DetectionPipeline` and to
the two baselines of :mod:`bench.baselines` side by side, scores all three with
:mod:`streams.scoring`, and prints one table row per (fault class and severity,
detector)::

    python -m bench.bench_quality                 # full suite: 108 runs, 128-1024 GPUs
    python -m bench.bench_quality --quick         # 2 runs per group (128, 256 GPUs), < 1 min
    python -m bench.bench_quality --markdown bench/results/quality.md --json runs.json

Columns (see bench/README.md): detected, host (localized: right host and class),
component (right GPU / NIC / link), wrong class, false isolations, latency p50/max.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import msgspec

from bench.baselines import NcclRas, Watchdog
from bench.scenarios import GROUPS, HANG_WATCH_S, Scenario, suite
from producers.events import Event
from producers.simulator import EPOCH_US, ground_truth, simulate
from streams.core import DetectionPipeline
from streams.scoring import Decision, RunScore, from_command, score_run, truth_faults

DETECTORS = ("c4stream", "watchdog", "nccl-ras")


class DetectorRun(msgspec.Struct, kw_only=True):
    """One detector on one scenario: its score, its decisions and its CPU time."""

    score: RunScore
    decisions: list[Decision]
    seconds: float
    """CPU seconds spent in this detector's feed/finish."""
    error: str | None = None
    """The exception that stopped this detector mid-run (its decisions so far are scored)."""


class RunResult(msgspec.Struct, kw_only=True):
    """Everything measured on one scenario."""

    group: str
    seed: int
    gpus: int
    events: int
    """Events simulated (all fed to the watchdog)."""
    events_watched: int
    """Events fed to c4stream and nccl-ras (fewer in hang runs; see HANG_WATCH_S)."""
    sim_seconds: float
    """CPU seconds spent simulating."""
    wall_seconds: float
    detectors: dict[str, DetectorRun]


class _C4:
    """c4stream's DetectionPipeline behind the same feed/finish shape as the baselines."""

    name = "c4stream"

    def __init__(self) -> None:
        self.pipeline = DetectionPipeline()

    def feed(self, events: Sequence[Event]) -> list[Decision]:
        return [from_command(c) for c in self.pipeline.feed(events)]

    def finish(self) -> list[Decision]:
        return [from_command(c) for c in self.pipeline.finish()]


class Detector(Protocol):
    """What the bench drives: the baselines' shape, and c4stream's through :class:`_C4`."""

    def feed(self, events: Sequence[Event]) -> list[Decision]: ...

    def finish(self) -> list[Decision]: ...


_FACTORIES: dict[str, Callable[[], Detector]] = {
    "c4stream": _C4,
    "watchdog": Watchdog,
    "nccl-ras": NcclRas,
}


class _Slot:
    """One detector during one run: its decisions, CPU time, and whether it is done.

    A detector that raises is stopped and its exception kept: a crash is a result to
    report, not the end of the benchmark.
    """

    def __init__(self, det: Detector) -> None:
        self.det = det
        self.decisions: list[Decision] = []
        self.cpu = 0.0
        self.error: str | None = None
        self.done = False
        # Only the 10-minute watchdog needs the whole hang (see HANG_WATCH_S).
        self.full_trace = bool(getattr(det, "needs_full_trace", False))

    def _call(self, fn: Callable[[], list[Decision]]) -> None:
        t0 = time.process_time()  # CPU time: fair on a busy machine
        try:
            self.decisions.extend(fn())
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
            self.done = True
        self.cpu += time.process_time() - t0

    def feed(self, batch: Sequence[Event]) -> None:
        if not self.done:
            self._call(lambda: self.det.feed(batch))

    def finish(self) -> None:
        if not self.done:
            self._call(self.det.finish)
            self.done = True

    @property
    def fired(self) -> bool:
        return getattr(self.det, "fired", None) is not None


def run_scenario(sc: Scenario, detectors: Sequence[str] = DETECTORS) -> RunResult:
    """Simulate one scenario once, feeding every batch to every detector; score them."""

    t_wall = time.perf_counter()
    slots = {name: _Slot(_FACTORIES[name]()) for name in detectors}
    cutoff = None if sc.watch_s is None else EPOCH_US + int(sc.watch_s * 1e6)
    events = watched = 0
    t_sim = 0.0
    sim = simulate(sc.config)
    while True:
        t0 = time.process_time()
        batch = next(sim, None)
        t_sim += time.process_time() - t0
        if batch is None:
            break
        if cutoff is not None and batch and batch[0].ts_us > cutoff:
            for slot in slots.values():
                if not slot.full_trace:
                    slot.finish()  # past the watch time: only full-trace detectors go on
            cutoff = None
        if all(slot.done or (slot.full_trace and slot.fired) for slot in slots.values()):
            break  # nobody listens any more (the watchdog would have torn the job down)
        events += len(batch)
        if not any(slot.done for slot in slots.values() if not slot.full_trace):
            watched += len(batch)
        for slot in slots.values():
            slot.feed(batch)
    for slot in slots.values():
        slot.finish()
    faults = truth_faults(ground_truth(sc.config))
    return RunResult(
        group=sc.group,
        seed=sc.seed,
        gpus=sc.config.gpus,
        events=events,
        events_watched=watched,
        sim_seconds=t_sim,
        wall_seconds=time.perf_counter() - t_wall,
        detectors={
            name: DetectorRun(
                score=score_run(slot.decisions, faults),
                decisions=slot.decisions,
                seconds=slot.cpu,
                error=slot.error,
            )
            for name, slot in slots.items()
        },
    )


def _run_one(args: tuple[Scenario, tuple[str, ...]]) -> RunResult:
    return run_scenario(*args)


# --------------------------------------------------------------------------- table


class Row(msgspec.Struct, kw_only=True):
    """One table row: one group, one detector, summed over the group's runs."""

    group: str
    detector: str
    runs: int
    faults: int
    detected: int
    localized: int
    component: int
    component_of: int
    wrong_class: int
    false_isolations: int
    false_hosts: int
    latencies_s: list[float]


def aggregate(results: Sequence[RunResult], detectors: Sequence[str]) -> list[Row]:
    """Sum the per-run scores into one :class:`Row` per (group, detector), suite order."""
    order = {g.name: i for i, g in enumerate(GROUPS)}
    groups = sorted({r.group for r in results}, key=lambda g: order.get(g, len(order)))
    rows = []
    for group in groups:
        runs = [r for r in results if r.group == group]
        for det in detectors:
            fs = [f for r in runs for f in r.detectors[det].score.faults]
            rows.append(
                Row(
                    group=group,
                    detector=det,
                    runs=len(runs),
                    faults=len(fs),
                    detected=sum(f.detected for f in fs),
                    localized=sum(f.localized for f in fs),
                    component=sum(f.component is True for f in fs),
                    component_of=sum(f.component is not None for f in fs),
                    wrong_class=sum(f.wrong_class for f in fs),
                    false_isolations=sum(r.detectors[det].score.false_isolations for r in runs),
                    false_hosts=sum(r.detectors[det].score.false_hosts for r in runs),
                    latencies_s=sorted(
                        f.latency_us / 1e6 for f in fs if f.latency_us is not None and f.detected
                    ),
                )
            )
    return rows


HEADER = (
    "scenario",
    "runs",
    "detector",
    "detected",
    "host",
    "GPU/NIC/link",
    "wrong class",
    "false isol.",
    "false hosts",
    "latency p50",
    "latency max",
)


def _frac(n: int, of: int) -> str:
    return "—" if of == 0 else f"{n}/{of}"


def _secs(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f} s"


def cells(row: Row) -> list[str]:
    """The printed cells of one row (— where a figure does not apply)."""
    lat = row.latencies_s
    return [
        row.group,
        str(row.runs),
        row.detector,
        _frac(row.detected, row.faults),
        _frac(row.localized, row.faults),
        _frac(row.component, row.component_of),
        "—" if row.faults == 0 else str(row.wrong_class),
        str(row.false_isolations),
        str(row.false_hosts),
        _secs(statistics.median(lat) if lat else None),
        _secs(max(lat) if lat else None),
    ]


def summary(rows: Sequence[Row], detectors: Sequence[str]) -> list[list[str]]:
    """One line per detector over the whole suite: recall, false isolations, latency."""
    out = []
    for det in detectors:
        rs = [r for r in rows if r.detector == det]
        faults = sum(r.faults for r in rs)
        lat = sorted(x for r in rs for x in r.latencies_s)
        out.append(
            [
                "whole suite",
                str(sum(r.runs for r in rs)),
                det,
                _frac(sum(r.detected for r in rs), faults),
                _frac(sum(r.localized for r in rs), faults),
                _frac(sum(r.component for r in rs), sum(r.component_of for r in rs)),
                str(sum(r.wrong_class for r in rs)),
                f"{sum(r.false_isolations for r in rs)} "
                f"({sum(r.false_isolations for r in rs if not r.faults)} on benign)",
                str(sum(r.false_hosts for r in rs)),
                _secs(statistics.median(lat) if lat else None),
                _secs(max(lat) if lat else None),
            ]
        )
    return out


def compact(rows: Sequence[Row], detectors: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Side by side, one line per group: ``host recall · false isolations · latency p50``.

    For a detector that never localizes (the watchdog) the first figure is what it
    *detected*, marked ``(det.)``.
    """
    header = ["scenario", "runs", *detectors]
    out: list[list[str]] = []
    by_group: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_group.setdefault(r.group, {})[r.detector] = r
    for group, per in by_group.items():
        line = [group, str(next(iter(per.values())).runs)]
        for det in detectors:
            r = per[det]
            lat = _secs(statistics.median(r.latencies_s)) if r.latencies_s else "—"
            if not r.faults:
                line.append(f"{r.false_isolations} false")
            elif r.localized == 0 and r.detected:
                line.append(f"{r.detected}/{r.faults} (det.) · {r.false_isolations} · {lat}")
            else:
                line.append(f"{r.localized}/{r.faults} · {r.false_isolations} · {lat}")
        out.append(line)
    return header, out


def markdown(table: Sequence[Sequence[str]], header: Sequence[str] = HEADER) -> str:
    """A GitHub Markdown table with :data:`HEADER`.

    >>> print(markdown([["a|b", "1"]]).splitlines()[2])
    | a\\|b | 1 |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in table]
    return "\n".join(lines)


def plain(table: Sequence[Sequence[str]]) -> str:
    """The table aligned in plain text, with a rule between groups."""
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(HEADER)]
    fmt = "  ".join(f"{{:{'<' if i in (0, 2) else '>'}{w}}}" for i, w in enumerate(widths))
    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    out = [fmt.format(*HEADER), rule]
    last = None
    for r in table:
        if last is not None and r[0] != last:
            out.append(rule)
        out.append(fmt.format(*r))
        last = r[0]
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_quality",
        description="Recall, false isolations and detection latency of c4stream and two "
        "baselines over a suite of simulated faults.",
    )
    p.add_argument(
        "--quick", action="store_true", help="2 runs per group at 128/256 GPUs (< 1 min)"
    )
    p.add_argument("--seeds", type=int, help="runs per group (default 6; --quick: 2)")
    p.add_argument("--gpus", help="comma-separated job sizes cycled over seeds, e.g. 128,1024")
    p.add_argument("--only", help="keep only groups whose name contains this text")
    p.add_argument(
        "--detectors", default=",".join(DETECTORS), help="comma-separated subset of detectors"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="parallel worker processes (default: min(2, cores))",
    )
    p.add_argument(
        "--full-tail",
        action="store_true",
        help="feed c4stream and nccl-ras the whole 10-minute tail of hang runs too (slow)",
    )
    p.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    p.add_argument("--json", type=Path, help="write every run's scores and decisions here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    detectors = tuple(d.strip() for d in args.detectors.split(",") if d.strip())
    unknown = set(detectors) - set(DETECTORS)
    if unknown:
        print(f"unknown detector(s) {sorted(unknown)}; choose from {DETECTORS}", file=sys.stderr)
        return 2
    gpus = [int(x) for x in args.gpus.split(",")] if args.gpus else None
    scenarios = suite(
        quick=args.quick,
        seeds=args.seeds,
        gpus=gpus,
        only=args.only,
        hang_watch_s=None if args.full_tail else HANG_WATCH_S,
    )
    if not scenarios:
        print("no scenario selected; check --only", file=sys.stderr)
        return 2
    if "c4stream" in detectors:
        _C4()  # fail fast, before the pool starts, if the core cannot be imported
    # Biggest runs first so the pool's last stragglers are short ones.
    work = sorted(scenarios, key=lambda s: -s.cost)
    t0 = time.perf_counter()
    results: list[RunResult] = []
    jobs = max(1, args.jobs)
    print(
        f"quality bench: {len(work)} runs, detectors {', '.join(detectors)}, {jobs} process(es)",
        file=sys.stderr,
    )
    if jobs == 1:
        it = (run_scenario(s, detectors) for s in work)
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(jobs)
        it = pool.imap_unordered(_run_one, [(s, detectors) for s in work])
    try:
        for i, res in enumerate(it, 1):
            results.append(res)
            print(
                f"  [{i}/{len(work)}] {res.group} seed {res.seed} ({res.gpus} GPUs, "
                f"{res.events:,} events) {res.wall_seconds:.1f} s",
                file=sys.stderr,
            )
    except BaseException:  # Ctrl-C or a failing run: stop the workers, do not wait for them
        if pool is not None:
            pool.terminate()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    elapsed = time.perf_counter() - t0

    rows = aggregate(results, detectors)
    table = [cells(r) for r in rows] + summary(rows, detectors)
    events = sum(r.events for r in results)
    cpu = {d: sum(r.detectors[d].seconds for r in results) for d in detectors}
    command = "python -m bench.bench_quality " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    sim_cpu = sum(r.sim_seconds for r in results)
    footer = (
        f"{len(results)} runs, {events:,} events, {elapsed:.0f} s wall on {jobs} process(es); "
        f"CPU time: simulator {sim_cpu:.1f} s, "
        + ", ".join(f"{d} {cpu[d]:.1f} s" for d in detectors)
    )
    crashed = [(r, d) for r in results for d in detectors if r.detectors[d].error]
    if crashed:
        r, d = crashed[0]
        footer += (
            f"\nCRASHED: {len(crashed)} detector run(s) stopped on an exception (their decisions "
            f"until then are scored), e.g. {d} on {r.group} seed {r.seed}: {r.detectors[d].error}"
        )
    side_header, side = compact(rows, detectors)
    print(plain(table))
    print(footer)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(
            f"Command: `{command.strip()}`\n\n{footer}\n\n"
            "Side by side (host recall · false isolations · median latency):\n\n"
            f"{markdown(side, side_header)}\n\nIn full:\n\n{markdown(table)}\n",
            encoding="utf-8",
        )
        print(f"markdown table written to {args.markdown}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(results)))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("interrupted; no table written", file=sys.stderr)
        raise SystemExit(130) from None
