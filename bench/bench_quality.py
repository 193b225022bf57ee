"""Quality benchmark: c4stream vs. a 10-minute watchdog vs. an NCCL-RAS-style rule.

Runs every scenario of :mod:`bench.scenarios` through the simulator once, feeding
each batch to c4stream's broker-free :class:`~streams.core.DetectionPipeline` and to
the two baselines of :mod:`bench.baselines` side by side, scores all three with
:mod:`streams.scoring`, and prints one table row per (fault class and severity,
detector)::

    python -m bench.bench_quality                 # full suite: 108 + 132 pipeline runs
    python -m bench.bench_quality --quick         # 2 runs per group (128, 256 GPUs), < 1 min
    python -m bench.bench_quality --markdown bench/results/quality.md --json runs.json
    python -m bench.bench_quality --suite pipeline --steps 0.1,60 --only straggler

Columns (see bench/README.md): detected, host (localized: right host and class),
component (right GPU / NIC / link), wrong class, false isolations, latency p50/max.

The *pipeline rows* (``--suite pipeline``; :data:`bench.scenarios.PIPELINE_GROUPS`):
pipeline-parallel ZeRO jobs of 128-2048 GPUs at steps of 0.1, 1, 10 and 60 s, every
fault class and benign event (stage imbalance, bubbles, static spread, checkpoint,
congestion). Each run's trace is simulated once into a cache on disk and judged by
``c4stream detect``'s core (:func:`detect_row`), for each input kind of :data:`INPUTS`
(``raw``: the trace itself); rows print found on the right component, missed, false
isolations and latency in seconds, detector windows and steps.
"""

from __future__ import annotations

import argparse
import functools
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
from bench.scenarios import (
    GROUPS,
    HANG_WATCH_S,
    Scenario,
    ShapeScenario,
    pipeline_suite,
    suite,
)
from producers.events import Event
from producers.simulator import EPOCH_US, ground_truth, simulate
from streams.core import DetectConfig, DetectionPipeline, PolicyConfig
from streams.scoring import (
    Decision,
    FaultScore,
    RunScore,
    component_label,
    from_command,
    score_run,
    truth_faults,
)

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


# --------------------------------------------------------------------------- pipeline rows
#
# The shapes of large-model training (bench.scenarios.PIPELINE_GROUPS): each run's trace
# is simulated once into a cache on disk (keyed by its config and the simulator's
# source), then read by ``c4stream detect``'s core (streams.detect.run_detect), the same
# path a user takes with a trace file. INPUTS maps an input kind to the file it gives
# the core: "raw" is the simulated trace itself; another kind (e.g. the exporter's
# per-window summaries) is one more entry, and its rows print beside the raw ones.

InputMaker = Callable[[ShapeScenario, Path], Path]
"""Given a run and its raw trace, the input file to judge (may be written next to it)."""


def _summarised(sc: ShapeScenario, trace: Path) -> Path:
    """What exporters with windows at the source send for the run (docs/summaries.md:
    k from the trace's rate, one summary per rank per 2 s), cached beside the trace."""
    from producers.summary import summarise_trace

    out = trace.with_name(trace.name.replace(".jsonl.gz", ".summarised.jsonl.gz"))
    if not out.exists():
        part = out.with_name(f"{out.name}.{os.getpid()}.part.jsonl.gz")
        summarise_trace(trace, part)
        part.rename(out)
    return out


INPUTS: dict[str, InputMaker] = {"raw": lambda sc, trace: trace, "summarised": _summarised}


@functools.cache
def _simulator_digest() -> str:
    """Digest of the simulator's source: a cached trace is stale once it changes (read
    once per process, before the pool forks, so it names the code that runs)."""
    import hashlib

    import producers.simulator as simpkg

    h = hashlib.sha256()
    root = Path(simpkg.__file__).parent
    for f in sorted(root.glob("*.py")) + [root.parent / "events.py"]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def default_cache() -> Path:
    """Where simulated traces are kept between runs (``$XDG_CACHE_HOME`` or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "c4stream" / "bench-quality"


def trace_for(sc: ShapeScenario, cache: Path) -> tuple[Path, float]:
    """The run's trace, simulated now or found in ``cache``; and the CPU seconds spent
    simulating (0 when cached)."""
    import hashlib

    from producers.simulator import write_trace

    key = hashlib.sha256(msgspec.json.encode(sc.config) + _simulator_digest().encode())
    path = cache / f"{key.hexdigest()[:24]}.jsonl.gz"
    if path.exists():
        return path, 0.0
    cache.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name[:24]}.{os.getpid()}.part.jsonl.gz")  # gzip by name
    t0 = time.process_time()
    write_trace(sc.config, part)
    part.rename(path)  # atomic: a reader never sees half a trace
    return path, time.process_time() - t0


class ShapeRun(msgspec.Struct, kw_only=True):
    """One pipeline run judged by c4stream on one input kind: one row of its group."""

    row: str
    group: str
    step_s: float
    seed: int
    gpus: int
    input: str
    events: int
    faults: list[FaultScore]
    false_isolations: int
    false_hosts: int
    latencies_s: list[float]
    """Per found fault: first right isolation minus the fault's start (for a degrading
    NIC: minus when it crossed the threshold, so it may be negative)."""
    window_s: float
    own_windows: list[float] = []
    """Per found degrading NIC: its latency in the deciding communicator's own windows
    (the command's span from its first window over its windows; ``window_us`` when that
    is shorter: a decision half a window in spans half of one)."""
    commands: list[str]
    """The first few commands, as "host component fault: reason"."""
    detect_seconds: float
    sim_seconds: float = 0.0


def detect_row(
    sc: ShapeScenario,
    trace: Path,
    input: str = "raw",
    detect: DetectConfig | None = None,
    policy: PolicyConfig | None = None,
) -> ShapeRun:
    """Run ``c4stream detect``'s core on ``trace`` (the input of kind ``input`` for the
    run ``sc``) and score its commands against the run's ground truth."""
    import tempfile

    from streams.detect import run_detect

    detect = detect or DetectConfig()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.process_time()
        res = run_detect([trace], Path(tmp) / "commands.jsonl", detect, policy)
        cpu = time.process_time() - t0
    truth = ground_truth(sc.config)
    decisions = [from_command(c) for c in res.commands]
    score = score_run(decisions, truth_faults(truth))
    lat, own = [], []
    for f, fs in zip(truth.faults, score.faults, strict=True):
        if fs.found and fs.latency_us is not None:
            origin = f.threshold_us if f.threshold_us is not None else f.start_us
            lat.append((fs.latency_us + f.start_us - origin) / 1e6)
            at = fs.latency_us + f.start_us
            cmd = next((c for c in res.commands if c.ts_us == at), None)
            if f.threshold_us is not None and cmd is not None:
                ev = cmd.evidence
                # a decision at a window's half (a peek) spans half of it: the unit is
                # window_us, or the communicator's own window when longer (long steps)
                span = max(ev["decided_after_s"] / max(1, ev["windows"]), detect.window_us / 1e6)
                own.append(round(lat[-1] / span, 2) if span > 0 else float("nan"))
    return ShapeRun(
        row=sc.row, group=sc.group, step_s=sc.step_s, seed=sc.seed, gpus=sc.config.gpus,
        input=input, events=res.n_events, faults=score.faults,
        false_isolations=score.false_isolations, false_hosts=score.false_hosts,
        latencies_s=sorted(lat), window_s=detect.window_us / 1e6, own_windows=sorted(own),
        commands=[
            f"{c.host} {component_label(c.gpu, c.nic, c.peer_host)} {c.fault} {c.action}: "
            f"{c.reason}"
            for c in res.commands[:3]
        ],
        detect_seconds=cpu,
    )  # fmt: skip


def _shape_one(args: tuple[ShapeScenario, Path, tuple[str, ...]]) -> list[ShapeRun]:
    sc, cache, inputs = args
    trace, sim_s = trace_for(sc, cache)
    out = []
    for name in inputs:
        run = detect_row(sc, INPUTS[name](sc, trace), name)
        run.sim_seconds = sim_s
        out.append(run)
    return out


SHAPE_HEADER = (
    "pipeline row",
    "input",
    "runs",
    "GPUs",
    "found",
    "GPU/NIC/link",
    "missed",
    "wrong class",
    "false isol.",
    "latency p50",
    "latency max",
)


def shape_rows(runs: Sequence[ShapeRun]) -> list[list[str]]:
    """One printed line per (row, input), suite order: found on the right component,
    missed, false isolations, latency in seconds, windows and steps."""
    order: dict[tuple[str, str], list[ShapeRun]] = {}
    for r in runs:
        order.setdefault((r.row, r.input), []).append(r)
    out = []
    for (row, inp), rs in order.items():
        fs = [f for r in rs for f in r.faults]
        found = sum(f.found for f in fs)
        comp = sum(f.component is True for f in fs)
        comp_of = sum(f.component is not None for f in fs)
        lat = sorted(x for r in rs for x in r.latencies_s)
        own = sorted(x for r in rs for x in r.own_windows)
        p50 = statistics.median(lat) if lat else None
        step, win = rs[0].step_s, rs[0].window_s
        out.append(
            [
                row,
                inp,
                str(len(rs)),
                ",".join(str(g) for g in sorted({r.gpus for r in rs})),
                _frac(found, len(fs)),
                _frac(comp, comp_of),
                "—" if not fs else ("MISSED " + str(len(fs) - found) if found < len(fs) else "0"),
                "—" if not fs else str(sum(f.wrong_class for f in fs)),
                str(sum(r.false_isolations for r in rs)),
                _latency(p50, win, step, statistics.median(own) if own else None),
                _latency(max(lat) if lat else None, win, step, max(own) if own else None),
            ]
        )
    return out


def _latency(x: float | None, window_s: float, step_s: float, own: float | None = None) -> str:
    """A latency in seconds, in detector windows (w) and in training steps (st); for a
    degrading NIC also in its deciding communicator's own windows (ow), marked MISSED
    above one (the target: isolated within one window of crossing)."""
    if x is None:
        return "—"
    out = f"{x:.1f} s / {x / window_s:.1f} w / {x / step_s:.1f} st"
    if own is not None:
        out += f" / {own:.2f} ow" + (" MISSED" if own > 1.0 else "")
    return out


def shape_summary(runs: Sequence[ShapeRun]) -> list[list[str]]:
    """The whole pipeline suite per input: found, false isolations (on benign runs)."""
    out = []
    for inp in dict.fromkeys(r.input for r in runs):
        rs = [r for r in runs if r.input == inp]
        fs = [f for r in rs for f in r.faults]
        found = sum(f.found for f in fs)
        benign_false = sum(r.false_isolations for r in rs if not r.faults)
        out.append(
            [
                "whole pipeline suite", inp, str(len(rs)), "—", _frac(found, len(fs)),
                _frac(sum(f.component is True for f in fs), sum(f.component is not None
                                                            for f in fs)),
                str(len(fs) - found), str(sum(f.wrong_class for f in fs)),
                f"{sum(r.false_isolations for r in rs)} ({benign_false} on benign)", "—", "—",
            ]
        )  # fmt: skip
    return out


def plain_table(header: Sequence[str], table: Sequence[Sequence[str]]) -> str:
    """``table`` aligned under ``header`` in plain text."""
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    return "\n".join([fmt.format(*header), rule, *(fmt.format(*r) for r in table)])


def run_pipeline_suite(
    scenarios: Sequence[ShapeScenario],
    cache: Path,
    inputs: Sequence[str] = ("raw",),
    jobs: int = 1,
    log: Path | None = None,
    run_missing: bool = True,
) -> list[ShapeRun]:
    """Every pipeline run on every input kind over ``jobs`` processes: seed by seed
    (seed 0 is every row at every step once, on the smaller job sizes), biggest first
    within a seed, so that a suite stopped half-way has covered the rows evenly.

    ``log``: each run's scores are appended there as one JSON line when it ends, and
    runs already in it (same row, seed, size and input) are taken from it instead of
    run again: a suite stopped half-way resumes, and its figures so far can be read
    (``run_missing`` False: only those, nothing is run)."""
    runs: list[ShapeRun] = []
    if log is not None and log.exists():
        done = {}
        for line in log.read_bytes().splitlines():
            if line.strip():
                r = msgspec.json.decode(line, type=ShapeRun)
                done[(r.row, r.seed, r.gpus, r.input)] = r
        keep = []
        for s in scenarios:
            got = [done.get((s.row, s.seed, s.config.gpus, x)) for x in inputs]
            if all(got):
                runs.extend(got)  # type: ignore[arg-type]
            else:
                keep.append(s)
        scenarios_left: Sequence[ShapeScenario] = keep
    else:
        scenarios_left = scenarios
    if not run_missing:
        scenarios_left = []
    work = sorted(scenarios_left, key=lambda s: (s.seed, -s.cost))
    args = [(s, cache, tuple(inputs)) for s in work]
    _simulator_digest()
    fh = open(log, "ab") if log is not None else None  # noqa: SIM115 (closed below)
    if jobs == 1:
        it = map(_shape_one, args)
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(jobs)
        it = pool.imap_unordered(_shape_one, args)
    try:
        for i, got in enumerate(it, 1):
            runs.extend(got)
            if fh is not None:
                fh.write(b"".join(msgspec.json.encode(r) + b"\n" for r in got))
                fh.flush()
            r = got[0]
            print(
                f"  [{i}/{len(work)}] {r.row} seed {r.seed} ({r.gpus} GPUs, {r.events:,} "
                f"events) sim {r.sim_seconds:.1f} s, detect {r.detect_seconds:.1f} s; found "
                f"{sum(f.found for f in r.faults)}/{len(r.faults)}, false isolations "
                f"{r.false_isolations}",
                file=sys.stderr,
            )
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        if fh is not None:
            fh.close()
        if pool is not None:
            pool.close()
            pool.join()
    rank = {(s.row, s.seed): i for i, s in enumerate(scenarios)}
    names = list(inputs)
    runs.sort(key=lambda r: (rank[(r.row, r.seed)], names.index(r.input)))
    return runs


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
    p.add_argument(
        "--suite",
        choices=("all", "classic", "pipeline"),
        default="all",
        help="classic: the earlier rows; pipeline: the pipeline-parallel ZeRO rows (c4stream "
        "only, through c4stream detect's core); all: both (default)",
    )
    p.add_argument(
        "--steps", help="pipeline rows: comma-separated step times in s (default 0.1,1,10,60)"
    )
    p.add_argument(
        "--pipeline-seeds", type=int, help="pipeline rows: runs per row (default 2, benign 3)"
    )
    p.add_argument(
        "--pipeline-gpus", help="pipeline rows: comma-separated job sizes (default per step)"
    )
    p.add_argument(
        "--inputs",
        default="raw",
        help=f"pipeline rows: comma-separated input kinds, of {', '.join(INPUTS)}",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="pipeline rows: directory of simulated traces kept between runs "
        "(default $XDG_CACHE_HOME/c4stream/bench-quality)",
    )
    p.add_argument(
        "--runs-log",
        type=Path,
        help="pipeline rows: append each run's scores here as it ends (JSON lines); runs "
        "already there are not run again (resume a stopped suite)",
    )
    p.add_argument(
        "--log-only",
        action="store_true",
        help="pipeline rows: print the table of the runs already in --runs-log, run nothing",
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
    inputs = tuple(x.strip() for x in args.inputs.split(",") if x.strip())
    if set(inputs) - set(INPUTS):
        print(f"unknown input(s) {sorted(set(inputs) - set(INPUTS))}; choose from "
              f"{', '.join(INPUTS)}", file=sys.stderr)  # fmt: skip
        return 2
    command = "python -m bench.bench_quality " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    md: list[str] = [f"Command: `{command.strip()}`\n"]
    ran = False
    if args.suite in ("all", "classic"):
        rc = _main_classic(args, detectors, md)
        if rc is not None and rc != 0:
            return rc
        ran = ran or rc == 0
    if args.suite in ("all", "pipeline"):
        if "c4stream" not in detectors:
            print("pipeline rows judge c4stream only; skipped", file=sys.stderr)
        else:
            ran = _main_pipeline(args, inputs, md) or ran
    if not ran:
        print("no scenario selected; check --only", file=sys.stderr)
        return 2
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(md) + "\n", encoding="utf-8")
        print(f"markdown table written to {args.markdown}", file=sys.stderr)
    return 0


def _main_pipeline(args: argparse.Namespace, inputs: Sequence[str], md: list[str]) -> bool:
    """The pipeline rows: simulate (cached), judge with c4stream detect, print."""
    steps = [float(x) for x in args.steps.split(",")] if args.steps else None
    sizes = [int(x) for x in args.pipeline_gpus.split(",")] if args.pipeline_gpus else None
    scenarios = pipeline_suite(
        quick=args.quick, seeds=args.pipeline_seeds, gpus=sizes, only=args.only, steps=steps
    )
    if not scenarios:
        return False
    cache = args.cache or default_cache()
    jobs = max(1, args.jobs)
    print(
        f"quality bench, pipeline rows: {len(scenarios)} runs x {len(inputs)} input(s), "
        f"traces cached in {cache}, {jobs} process(es)",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    if args.log_only and args.runs_log is None:
        print("--log-only needs --runs-log", file=sys.stderr)
        return False
    runs = run_pipeline_suite(
        scenarios, cache, inputs, jobs, args.runs_log, run_missing=not args.log_only
    )
    if args.log_only:
        print(f"{len(runs)} of {len(scenarios)} runs are in {args.runs_log} (--log-only: "
              "the table shows those)", file=sys.stderr)  # fmt: skip
    elapsed = time.perf_counter() - t0
    table = shape_rows(runs) + shape_summary(runs)
    footer = (
        f"{len(runs)} pipeline runs, {sum(r.events for r in runs):,} events judged, "
        f"{elapsed:.0f} s wall on {jobs} process(es); CPU: simulator "
        f"{sum(r.sim_seconds for r in runs):.1f} s (0 for cached traces), c4stream detect "
        f"{sum(r.detect_seconds for r in runs):.1f} s. Latency: s / detector windows "
        f"(window_us) / training steps; a degrading NIC's from when it crossed 0.75, also in "
        f"its deciding communicator's own windows (ow: their own median and max; target: "
        f"within one)."
    )
    print()
    print(plain_table(SHAPE_HEADER, table))
    print(footer)
    notes = [
        f"  {r.row} seed {r.seed} ({r.input}): {r.commands[0]}"
        for r in runs
        if r.commands and (r.false_isolations or not all(f.found for f in r.faults))
    ]
    if notes:
        print("first command of runs with a miss or a false isolation:")
        print("\n".join(n[:300] for n in notes[:20]))
    md.append(f"Pipeline-parallel ZeRO rows (c4stream detect):\n\n{footer}\n")
    md.append(markdown(table, SHAPE_HEADER) + "\n")
    if args.json:
        path = args.json.with_name(args.json.stem + "-pipeline" + args.json.suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.json.format(msgspec.json.encode(runs)))
    return True


def _main_classic(args: argparse.Namespace, detectors: Sequence[str], md: list[str]) -> int | None:
    """The earlier rows (c4stream and the two baselines over bench.scenarios.GROUPS);
    None when none is selected."""
    gpus = [int(x) for x in args.gpus.split(",")] if args.gpus else None
    scenarios = suite(
        quick=args.quick,
        seeds=args.seeds,
        gpus=gpus,
        only=args.only,
        hang_watch_s=None if args.full_tail else HANG_WATCH_S,
    )
    if not scenarios:
        return None
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
    md.append(
        f"{footer}\n\n"
        "Side by side (host recall · false isolations · median latency):\n\n"
        f"{markdown(side, side_header)}\n\nIn full:\n\n{markdown(table)}\n"
    )
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
