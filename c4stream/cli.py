"""The ``c4stream`` command: a thin front end; each stage registers its own commands.

producers: simulate, exporter, replay · streams: detect, worker ·
sinks: actuate, archive, alert · compose: broker · demo, config
"""

from __future__ import annotations

from pathlib import Path

import typer

import compose.cli
import producers.cli
import sinks.cli
import streams.cli

app = typer.Typer(
    name="c4stream",
    help=(
        "Find the faulty GPU, NIC, link or process of a distributed training job from "
        "its collective-communication telemetry, and take it out."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

for stage in (producers.cli, streams.cli, sinks.cli, compose.cli):
    stage.register(app)


@app.command()
def demo(
    out: Path = typer.Option(
        Path("demo-out"), "--out", help="Where the trace, archive, report and logs go."
    ),
    gpus: int = typer.Option(128, "--gpus", min=16, help="GPUs in the simulated job."),
    scenario: str = typer.Option(
        "demo", "--scenario", help="Simulator scenario (see `c4stream simulate --list`)."
    ),
    seed: int = typer.Option(0, "--seed"),
    speed: float = typer.Option(
        6.0, "--speed", min=0.1, help="Trace seconds replayed per wall second."
    ),
    bootstrap: str | None = typer.Option(
        None,
        "--bootstrap",
        envvar="KAFKA_BOOTSTRAP",
        help="Use this Kafka cluster instead of starting a local broker.",
    ),
) -> None:
    """Run the whole pipeline on a simulated job with injected faults, and show what it finds.

    Starts a local Kafka broker (or uses --bootstrap), the worker, the archiver, the
    actuator (dry run) and the alerter (posting to a local receiver), replays a
    simulated 128-GPU job, shows decisions live, stops everything and writes
    OUT/report.html and the Parquet archive OUT/archive.
    """
    from c4stream.demo.run import DemoConfig, run_demo

    result = run_demo(
        DemoConfig(
            out_dir=out, gpus=gpus, scenario=scenario, seed=seed, speed=speed, bootstrap=bootstrap
        )
    )
    if result.matched < len(result.truth.get("faults", [])) or result.false_isolations:
        raise typer.Exit(1)


def main() -> None:
    app()
