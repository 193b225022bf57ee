"""Command-line commands of the producers stage; registered on the main app by :mod:`c4stream.cli`.

Heavy imports stay inside the command functions so that `c4stream --help` is fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from c4base.config import KAFKA_SECTION, flag_overrides, load_section
from c4base.kafka import KafkaConfig
from c4base.service import LOG_JSON_HELP, METRICS_HOST_HELP, METRICS_PORT_HELP, start_service
from c4base.settings_loader import SettingsError
from producers.exporter import ExporterConfig, run_exporter
from producers.exporter.core import EXPORTER_SECTION
from producers.replay import ReplayConfig, parse_speed
from producers.replay import replay as run_replay
from producers.simulator.cli_impl import list_scenarios, resolve_config, run
from producers.simulator.config import SimConfigError
from producers.sources import SourceError


def simulate(
    scenario: Annotated[
        str | None, typer.Option("--scenario", "-s", help="preset (--list)")
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", help="SimConfig as TOML")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="resize the job")] = None,
    duration: Annotated[float | None, typer.Option("--duration", help="simulated s")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="random seed")] = None,
    out: Annotated[Path, typer.Option("--out", help="trace (.gz = gzip)")] = Path("trace.jsonl.gz"),
    truth: Annotated[Path | None, typer.Option("--truth", help="ground-truth JSON")] = None,
    list_: Annotated[bool, typer.Option("--list", help="list the scenarios and exit")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Simulate a training job with injected faults into a trace and a ground truth."""
    console = Console()
    if list_:
        list_scenarios(console)
        return
    try:
        cfg = resolve_config(scenario, config, gpus, duration, seed)
        run(cfg, out, truth, console, progress)
    except SimConfigError as err:
        typer.echo(f"c4stream simulate: {err}", err=True)
        raise typer.Exit(2) from None


_BOOTSTRAP_HELP = "Kafka host:port (default: $KAFKA_BOOTSTRAP or 127.0.0.1:9092)"


def exporter(
    ctx: typer.Context,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir", help="NCCL Inspector dump directory to follow ([exporter].directory)"
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="c4stream.toml ([kafka], [exporter]); flags win over it"),
    ] = None,
    bootstrap: Annotated[str | None, typer.Option("--bootstrap", help=_BOOTSTRAP_HELP)] = None,
    interval: Annotated[
        float, typer.Option("--interval", help="seconds per batch per communicator")
    ] = 1.0,
    state_file: Annotated[
        Path | None,
        typer.Option("--state-file", help="file positions: a restart neither loses nor repeats"),
    ] = None,
    topic: Annotated[
        str, typer.Option("--topic", help="events topic (default: c4.events after the prefix)")
    ] = "",
    deadletter_topic: Annotated[
        str, typer.Option("--deadletter-topic", help="default: c4.deadletter after the prefix")
    ] = "",
    job: Annotated[
        str | None, typer.Option("--job", help="job id (default: from the dir name)")
    ] = None,
    pattern: Annotated[str, typer.Option("--pattern", help="file names to follow")] = "*.log",
    metrics_port: Annotated[int, typer.Option("--metrics-port", help=METRICS_PORT_HELP)] = 0,
    metrics_host: Annotated[
        str, typer.Option("--metrics-host", help=METRICS_HOST_HELP)
    ] = "127.0.0.1",
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING…")] = "INFO",
    log_json: Annotated[bool, typer.Option("--log-json", help=LOG_JSON_HELP)] = False,
) -> None:
    """Follow an NCCL Inspector dump directory and publish its events to Kafka."""
    # Flags given on the command line win over [exporter]; [exporter] over the defaults.
    flags = flag_overrides(ctx, _EXPORTER_FLAGS)
    try:
        svc = start_service(config, ctx, stage="exporter")
        cfg: ExporterConfig = load_section("exporter", EXPORTER_SECTION, config, overrides=flags)
    except SettingsError as err:
        if directory is None and "`directory`" in str(err):
            raise typer.BadParameter(
                "--dir DIR (or [exporter] directory = DIR in --config) is required",
                param_hint="--dir",
            ) from None
        raise typer.BadParameter(str(err), param_hint="--config") from None
    stats = run_exporter(cfg, metrics=svc.metrics)
    Console(stderr=True).print(
        f"exporter stopped: {stats.lines} lines, {stats.events} events, "
        f"{stats.delivered}/{stats.messages} messages acknowledged, "
        f"{stats.deadletters} dead letters"
    )


#: Option parameter -> key of the [exporter] table.
_EXPORTER_FLAGS = {
    "directory": "directory",
    "bootstrap": "kafka.bootstrap",
    "interval": "interval_s",
    "state_file": "state_file",
    "topic": "events_topic",
    "deadletter_topic": "deadletter_topic",
    "job": "job",
    "pattern": "pattern",
}


def replay(
    traces: Annotated[
        list[Path],
        typer.Argument(help="contract traces (.jsonl[.gz]), Inspector dirs, Flight Recorder dumps"),
    ],
    bootstrap: Annotated[str | None, typer.Option("--bootstrap", help=_BOOTSTRAP_HELP)] = None,
    speed: Annotated[
        str, typer.Option("--speed", help="pace factor, or 'max' for no pacing")
    ] = "1.0",
    topic: Annotated[
        str, typer.Option("--topic", help="events topic (default: c4.events after the prefix)")
    ] = "",
    deadletter_topic: Annotated[
        str, typer.Option("--deadletter-topic", help="default: c4.deadletter after the prefix")
    ] = "",
    job: Annotated[
        str | None, typer.Option("--job", help="job id for Inspector / Flight Recorder input")
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="c4stream.toml: [kafka] (bootstrap, topic_prefix)"),
    ] = None,
) -> None:
    """Publish a recorded trace to Kafka at its recorded pace scaled by --speed."""
    console = Console(stderr=True)
    try:
        pace = parse_speed(speed)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--speed") from None
    try:
        over = {"bootstrap": bootstrap} if bootstrap else None
        kafka: KafkaConfig = load_section("kafka", KAFKA_SECTION, config, overrides=over)
    except SettingsError as err:
        raise typer.BadParameter(str(err), param_hint="--config") from None
    cfg = ReplayConfig(
        kafka=kafka,
        events_topic=topic,
        deadletter_topic=deadletter_topic,
        speed=pace,
        job=job,
        progress=progress,
    )
    try:
        stats = run_replay(traces, cfg)
    except SourceError as err:
        typer.echo(f"c4stream replay: {err}", err=True)
        raise typer.Exit(2) from None
    rate = stats.events / stats.elapsed_s if stats.elapsed_s > 0 else 0.0
    console.print(
        f"replayed {stats.messages} messages, {stats.events} events, {stats.bad} bad "
        f"(dead-lettered) in {stats.elapsed_s:.2f}s ({rate:,.0f} events/s); "
        f"acknowledged {stats.delivered}/{stats.messages}"
    )
    if not stats.ok:
        typer.echo("c4stream replay: some messages were not acknowledged by Kafka", err=True)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add this stage's commands to the main ``c4stream`` app."""
    app.command("simulate")(simulate)
    app.command("exporter")(exporter)
    app.command("replay")(replay)
