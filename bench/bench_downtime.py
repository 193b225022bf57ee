"""Downtime benchmark: job time lost to faults with c4stream vs. the watchdog and RAS rule.

A model, fed with two kinds of numbers and parameters for everything else:

**Measured here** — detection latency, localization and false cordons of each detector
on the job-stopping faults of the quality suite (``rank_hang``, ``host_down``,
``link_hang``), either re-measured now (the default: a small suite, seconds to a minute)
or read from ``bench_quality --json runs.json`` (``--quality-json``).

**Published** — how often a large job is interrupted. Meta's Llama 3 paper ("The Llama 3
Herd of Models", arXiv 2407.21783, §3.3.4): during a 54-day snapshot of pre-training on
16,384 H100 GPUs there were 466 job interruptions, 47 planned and 419 unexpected. The
model uses the 419 unexpected ones as a rate per GPU-day and scales it linearly with
the job's GPU count (``--interruptions``, ``--days``, ``--gpus-observed`` to change it).

**Parameters (assumptions; printed with the table)** — per fault, the job loses

    detection latency                          (measured, per detector)
  + isolation time                             (--isolate-s; only a localizing detector
                                                can isolate)
  + diagnosis time, when the detector did      (--triage-min; default 0, the most
    not name the culprit                        favourable case for the baselines)
  + restart cost                               (--restart-min: requeue, scheduling,
                                                start-up, loading the checkpoint)
  + work since the last checkpoint, on average (--checkpoint-min / 2)
    half a checkpoint interval

and a month is ``--month-days`` days of the job running. The C4 paper (arXiv
2406.04594) motivates the comparison: it reports cutting error-induced overhead by
about 30 % in production by finding the faulty component quickly, isolating it and
restarting the job. Its production figures are not reproduced here; this is a model.

    python -m bench.bench_downtime                          # re-measure, default model
    python -m bench.bench_downtime --quality-json runs.json # latencies of a full bench run
    python -m bench.bench_downtime --checkpoint-min 10 --restart-min 5 --triage-min 60
    python -m bench.bench_downtime --json runs.json   # keep the runs; re-read them with
    python -m bench.bench_downtime --quality-json runs.json --triage-min 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.bench_quality import DETECTORS, RunResult, aggregate, run_scenario
from bench.scenarios import suite

HANG_GROUPS = ("rank_hang", "host_down", "link_hang")

# Meta, "The Llama 3 Herd of Models" (arXiv 2407.21783), section 3.3.4: 54-day snapshot,
# 16,384 GPUs, 466 interruptions of which 419 unexpected.
LLAMA3_UNEXPECTED = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16_384


@dataclass(frozen=True, slots=True)
class Measured:
    """One detector on the job-stopping faults: what the quality suite measured."""

    detector: str
    faults: int
    detected: int
    localized: int
    latency_s: float | None
    """Median detection latency over the detected faults (event time)."""
    false_hosts_per_fault: float
    """Healthy hosts it blamed (would cordon) per injected fault."""


@dataclass(frozen=True, slots=True)
class Model:
    """The parameters of the downtime model (see the module docstring)."""

    checkpoint_min: float = 30.0
    restart_min: float = 10.0
    isolate_s: float = 5.0
    triage_min: float = 0.0
    month_days: float = 30.0
    interruptions: int = LLAMA3_UNEXPECTED
    days: float = LLAMA3_DAYS
    gpus_observed: int = LLAMA3_GPUS

    @property
    def rate_per_gpu_day(self) -> float:
        return self.interruptions / (self.days * self.gpus_observed)


_DEFAULT = Model()


@dataclass(frozen=True, slots=True)
class Row:
    gpus: int
    detector: str
    faults_per_month: float
    detect_s: float
    per_fault_min: float
    hours_lost: float
    percent: float
    gpu_hours_lost: float
    false_cordons: float


def per_fault_s(m: Measured, model: Model) -> tuple[float, float]:
    """(detection s, total s lost) per fault, averaged over the faults it detects.

    A fault the detector localizes costs detect + isolate + restart + half a checkpoint
    interval; one it detects without naming the culprit also costs the triage time. A
    detector that misses a fault is not credited (it never happens on these faults:
    every detector detects every hang, see the measured table).

    >>> m = Measured("x", faults=4, detected=4, localized=2, latency_s=10.0,
    ...              false_hosts_per_fault=0.0)
    >>> per_fault_s(m, Model(checkpoint_min=20, restart_min=5, isolate_s=2, triage_min=6))
    (10.0, 1091.0)
    """
    detect = m.latency_s if m.latency_s is not None else float("nan")
    base = detect + model.restart_min * 60 + model.checkpoint_min * 60 / 2
    frac_localized = m.localized / m.detected if m.detected else 0.0
    extra = frac_localized * model.isolate_s + (1 - frac_localized) * model.triage_min * 60
    return detect, base + extra


def rows(measured: Sequence[Measured], model: Model, sizes: Sequence[int]) -> list[Row]:
    out = []
    hours = model.month_days * 24
    for gpus in sizes:
        faults = model.rate_per_gpu_day * gpus * model.month_days
        for m in measured:
            detect, lost = per_fault_s(m, model)
            h = faults * lost / 3600
            out.append(
                Row(
                    gpus=gpus,
                    detector=m.detector,
                    faults_per_month=faults,
                    detect_s=detect,
                    per_fault_min=lost / 60,
                    hours_lost=h,
                    percent=100 * h / hours,
                    gpu_hours_lost=h * gpus,
                    false_cordons=faults * m.false_hosts_per_fault,
                )
            )
    return out


def measure(results: Sequence[RunResult]) -> list[Measured]:
    """Pool the hang groups' faults per detector (each class weighs by its runs)."""
    hang = [r for r in results if r.group in HANG_GROUPS]
    if not hang:
        raise SystemExit(f"no runs of {', '.join(HANG_GROUPS)} in the results")
    detectors = [d for d in DETECTORS if d in hang[0].detectors]
    out = []
    for det in detectors:
        rs = [row for row in aggregate(hang, [det])]
        faults = sum(r.faults for r in rs)
        lat = sorted(x for r in rs for x in r.latencies_s)
        out.append(
            Measured(
                detector=det,
                faults=faults,
                detected=sum(r.detected for r in rs),
                localized=sum(r.localized for r in rs),
                latency_s=statistics.median(lat) if lat else None,
                false_hosts_per_fault=sum(r.false_hosts for r in rs) / max(faults, 1),
            )
        )
    return out


def run_small_suite(seeds: int, gpus: Sequence[int]) -> list[RunResult]:
    """The hang groups of the quality suite, ``seeds`` runs each, in this process."""
    results = []
    for group in HANG_GROUPS:
        for sc in suite(seeds=seeds, gpus=gpus, only=group):
            if sc.group == group:
                results.append(run_scenario(sc))
    return results


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    rows_ = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in body
    ]
    return "\n".join([line, sep, *rows_])


def render(measured: Sequence[Measured], model: Model, table: Sequence[Row], source: str) -> str:
    mt = _table(
        ("detector", "hang faults", "detected", "localized", "latency p50", "false cordons/fault"),
        [
            (
                m.detector,
                str(m.faults),
                f"{m.detected}/{m.faults}",
                f"{m.localized}/{m.faults}",
                "—" if m.latency_s is None else f"{m.latency_s:.1f} s",
                f"{m.false_hosts_per_fault:.1f}",
            )
            for m in measured
        ],
    )
    base = {(r.gpus, r.detector): r for r in table}
    body = []
    for r in table:
        c4 = base.get((r.gpus, "c4stream"))
        saved = (
            ""
            if c4 is None or r.detector == "c4stream"
            else f"{r.hours_lost - c4.hours_lost:.1f} h"
        )
        body.append(
            (
                f"{r.gpus:,}",
                r.detector,
                f"{r.faults_per_month:.1f}",
                f"{r.detect_s:.1f} s",
                f"{r.per_fault_min:.1f} min",
                f"{r.hours_lost:.1f} h",
                f"{r.percent:.2f} %",
                f"{r.gpu_hours_lost:,.0f}",
                saved or "—",
                f"{r.false_cordons:,.0f}",
            )
        )
    main = _table(
        (
            "GPUs",
            "detector",
            "faults/month",
            "detect",
            "lost per fault",
            "job time lost/month",
            "of the month",
            "GPU-hours lost",
            "c4stream saves",
            "healthy hosts cordoned",
        ),
        body,
    )
    rate = model.rate_per_gpu_day
    assumptions = [
        f"fault rate: {model.interruptions} unexpected interruptions in {model.days:g} days on "
        f"{model.gpus_observed:,} GPUs (Llama 3, arXiv 2407.21783 §3.3.4) = {rate:.3g} per "
        "GPU-day, scaled linearly with the job's GPUs; every one stops the job",
        f"month: {model.month_days:g} days of the job running ({model.month_days * 24:g} h)",
        f"checkpoint every {model.checkpoint_min:g} min: on average "
        f"{model.checkpoint_min / 2:g} min of work since the last one is lost per fault",
        f"restart: {model.restart_min:g} min (requeue, scheduling, start-up, checkpoint load)",
        f"isolation: {model.isolate_s:g} s (drain/cordon) when the detector names the host",
        f"diagnosis when it does not: {model.triage_min:g} min "
        + ("(0: the most favourable case for the baselines)" if model.triage_min == 0 else ""),
        "detection latency, localization, false cordons: " + source,
        "the three hang classes pooled with equal weight (the paper breaks interruptions "
        "down by component, not by syndrome); fail-slow faults (stragglers, slow NICs and "
        "links), which neither baseline detects at all, are not in this table",
        "healthy hosts cordoned: per month, from the false cordons per fault measured; "
        "cordoned hosts are capacity lost until a person returns them",
    ]
    return (
        "Measured on the job-stopping faults:\n\n"
        + mt
        + "\n\nTime lost to faults per month:\n\n"
        + main
        + "\n\nAssumptions:\n\n"
        + "\n".join(f"- {a}" for a in assumptions)
        + "\n"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_downtime",
        description="Job time lost to faults per month, c4stream vs. a 10-minute watchdog "
        "and an NCCL-RAS-style 20 s rule, from measured detection latencies and "
        "published failure rates.",
    )
    p.add_argument("--quality-json", type=Path, help="bench_quality --json output to read")
    p.add_argument("--seeds", type=int, default=2, help="runs per hang class when measuring")
    p.add_argument("--measure-gpus", default="128", help="job sizes of the measuring runs")
    p.add_argument("--sizes", default="1024,4096,16384", help="job sizes to model")
    p.add_argument("--checkpoint-min", type=float, default=_DEFAULT.checkpoint_min)
    p.add_argument("--restart-min", type=float, default=_DEFAULT.restart_min)
    p.add_argument("--isolate-s", type=float, default=_DEFAULT.isolate_s)
    p.add_argument("--triage-min", type=float, default=_DEFAULT.triage_min)
    p.add_argument("--month-days", type=float, default=_DEFAULT.month_days)
    p.add_argument("--interruptions", type=int, default=_DEFAULT.interruptions)
    p.add_argument("--days", type=float, default=_DEFAULT.days)
    p.add_argument("--gpus-observed", type=int, default=_DEFAULT.gpus_observed)
    p.add_argument("--markdown", type=Path, help="also write the output here")
    p.add_argument(
        "--json", type=Path, help="write the measuring runs here (read back: --quality-json)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = Model(
        checkpoint_min=args.checkpoint_min,
        restart_min=args.restart_min,
        isolate_s=args.isolate_s,
        triage_min=args.triage_min,
        month_days=args.month_days,
        interruptions=args.interruptions,
        days=args.days,
        gpus_observed=args.gpus_observed,
    )
    if args.quality_json:
        results = msgspec.json.decode(args.quality_json.read_bytes(), type=list[RunResult])
        source = f"read from {args.quality_json}"
    else:
        gpus = [int(x) for x in args.measure_gpus.split(",")]
        t0 = time.perf_counter()
        print(f"measuring {len(HANG_GROUPS)} hang classes × {args.seeds} runs …", file=sys.stderr)
        results = run_small_suite(args.seeds, gpus)
        source = (
            f"measured now with bench.bench_quality's detectors on {len(results)} simulated "
            f"hang runs ({', '.join(HANG_GROUPS)} × {args.seeds} seeds at "
            f"{args.measure_gpus} GPUs; {time.perf_counter() - t0:.0f} s)"
        )
    if args.json:
        args.json.write_bytes(msgspec.json.encode(results))
    measured = measure(results)
    sizes = [int(x) for x in args.sizes.split(",")]
    text = render(measured, model, rows(measured, model, sizes), source)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
