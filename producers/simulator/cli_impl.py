"""Body of ``c4stream simulate`` (the Typer wrapper lives in :mod:`producers.cli`)."""

from __future__ import annotations

from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from producers.simulator.config import (
    SimConfig,
    SimConfigError,
    load_config,
    validate,
    with_gpus,
    with_step,
)
from producers.simulator.output import write_trace
from producers.simulator.scenarios import SCENARIOS, describe


def list_scenarios(console: Console) -> None:
    """Print the presets as a table."""
    table = Table(title="simulator scenarios")
    table.add_column("name")
    table.add_column("what")
    for name, cfg in SCENARIOS.items():
        table.add_row(name, describe(cfg))
    console.print(table)


def resolve_config(
    scenario: str | None,
    config_file: Path | None,
    gpus: int | None,
    duration: float | None,
    seed: int | None,
    step: float | None = None,
    rate: float | None = None,
) -> SimConfig:
    """The config a command line asks for; raises SimConfigError with what to fix.

    ``step`` sets the step time (seconds), ``rate`` the collectives per second per
    rank (by the number of layers), both for the microbatched shapes only.
    """
    if (scenario is None) == (config_file is None):
        raise SimConfigError("give exactly one of --scenario NAME or --config FILE.toml")
    if scenario is not None:
        if scenario not in SCENARIOS:
            raise SimConfigError(
                f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}"
            )
        cfg = SCENARIOS[scenario]
    else:
        assert config_file is not None
        cfg = load_config(config_file)
    if gpus is not None:
        cfg = with_gpus(cfg, gpus)
    if duration is not None:
        cfg = msgspec.structs.replace(cfg, duration_s=duration)
    if seed is not None:
        cfg = msgspec.structs.replace(cfg, seed=seed)
    if (step is not None or rate is not None) and not cfg.pipelined:
        raise SimConfigError(
            "--step and --rate need a pipeline shape (schedule 1f1b or interleaved), "
            "e.g. --scenario pp_healthy"
        )
    if step is not None:
        cfg = with_step(cfg, step)
    if rate is not None:
        from producers.simulator.pipeline import with_rate

        cfg = with_rate(cfg, rate, step)
    return validate(cfg)


def run(cfg: SimConfig, out: Path, truth: Path | None, console: Console, progress: bool) -> None:
    """Simulate into ``out`` with a progress bar, then print one summary line."""
    from tqdm import tqdm

    total = int(-(-cfg.duration_s // 1))
    with tqdm(
        total=total, unit="sim-s", desc=f"simulate {cfg.gpus} GPUs", disable=not progress
    ) as bar:

        def on_second(n: int) -> None:
            bar.update(n - bar.n)

        stats = write_trace(cfg, out, truth, on_second=on_second)
        bar.update(total - bar.n)
    console.print(
        f"wrote {stats.events:,} events in {stats.lines:,} lines "
        f"({stats.bytes / 1e6:.1f} MB) to {out}"
        + (f", truth to {truth}" if truth else "")
        + f" in {stats.wall_s:.1f} s ({stats.events_per_s:,.0f} events/s)"
    )
