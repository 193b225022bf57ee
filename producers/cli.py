"""Command-line commands of the producers stage; registered on the main app by :mod:`c4stream.cli`.

Heavy imports stay inside the command functions so that `c4stream --help` is fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from c4base.cli_options import (
    Bootstrap,
    Key,
    LogJson,
    LogLevel,
    MetricsHost,
    MetricsPort,
    config_file,
    fail,
    given,
)

ConfigFile = config_file("[kafka], [exporter]")


def simulate(
    scenario: Annotated[
        str | None, typer.Option("--scenario", "-s", help="preset (--list)")
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", help="SimConfig as TOML")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="resize the job")] = None,
    duration: Annotated[float | None, typer.Option("--duration", help="simulated s")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="random seed")] = None,
    step: Annotated[
        float | None, typer.Option("--step", help="step time in s (pipeline shapes)")
    ] = None,
    rate: Annotated[
        float | None,
        typer.Option("--rate", help="collectives per second per rank (pipeline shapes)"),
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="trace (.gz = gzip)")] = Path("trace.jsonl.gz"),
    truth: Annotated[Path | None, typer.Option("--truth", help="ground-truth JSON")] = None,
    list_: Annotated[bool, typer.Option("--list", help="list the scenarios and exit")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Simulate a training job with injected faults into a trace and a ground truth."""
    from rich.console import Console

    from producers.simulator.cli_impl import list_scenarios, resolve_config, run
    from producers.simulator.config import SimConfigError

    console = Console()
    if list_:
        list_scenarios(console)
        return
    try:
        cfg = resolve_config(scenario, config, gpus, duration, seed, step, rate)
        run(cfg, out, truth, console, progress)
    except SimConfigError as err:
        fail("simulate", err, 2)


_BOOTSTRAP_HELP = "Kafka host:port (default: $KAFKA_BOOTSTRAP or 127.0.0.1:9092)"
_FORMAT_HELP = "wire form of event batches: json arrays or arrow IPC record batches"


def _check_format(fmt: str) -> str:
    if fmt not in ("json", "arrow"):
        raise typer.BadParameter(f"{fmt!r}: use json or arrow", param_hint="--format")
    return fmt


def exporter(
    ctx: typer.Context,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir", help="NCCL Inspector dump directory to follow ([exporter].directory)"
        ),
        Key("directory"),
    ] = None,
    config: ConfigFile = None,
    bootstrap: Bootstrap = None,
    interval: Annotated[
        float,
        typer.Option("--interval", help="seconds per batch per communicator"),
        Key("interval_s"),
    ] = 1.0,
    state_file: Annotated[
        Path | None,
        typer.Option("--state-file", help="file positions: a restart neither loses nor repeats"),
        Key("state_file"),
    ] = None,
    topic: Annotated[
        str,
        typer.Option("--topic", help="events topic (default: c4.events after the prefix)"),
        Key("events_topic"),
    ] = "",
    deadletter_topic: Annotated[
        str,
        typer.Option("--deadletter-topic", help="default: c4.deadletter after the prefix"),
        Key("deadletter_topic"),
    ] = "",
    job: Annotated[
        str | None, typer.Option("--job", help="job id (default: from the dir name)"), Key("job")
    ] = None,
    pattern: Annotated[
        str, typer.Option("--pattern", help="file names to follow"), Key("pattern")
    ] = "*.log",
    wire_format: Annotated[
        str,
        typer.Option("--format", help=_FORMAT_HELP, callback=_check_format),
        Key("format"),
    ] = "json",
    host: Annotated[
        str | None,
        typer.Option("--host", help="this host: other hosts' events are refused ([exporter] host)"),
        Key("host"),
    ] = None,
    signing_key_file: Annotated[
        Path | None,
        typer.Option(
            "--signing-key-file",
            help="this host's key (c4stream keys derive): sign every message",
        ),
        Key("signing_key_file"),
    ] = None,
    summary_k: Annotated[
        int,
        typer.Option(
            "--summary-k",
            help="windows at the source: per rank and interval a summary plus 1 in K "
            "collectives whole (the same seqs on every rank); 0 = every collective",
        ),
        Key("summary_k"),
    ] = 0,
    fr_dir: Annotated[
        Path | None,
        typer.Option(
            "--fr-dir",
            help="also follow this Flight Recorder dump directory (TORCH_FR_DUMP_TEMP_FILE's); "
            "each whole dump is published with the time it was seen ([exporter] dump_*)",
        ),
        Key("dump_directory"),
    ] = None,
    fr_pattern: Annotated[
        str,
        typer.Option("--fr-pattern", help="which files there are dumps, e.g. '_dump_*'"),
        Key("dump_pattern"),
    ] = "*",
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    log_level: LogLevel = None,
    log_json: LogJson = False,
) -> None:
    """Follow an NCCL Inspector dump directory (and a Flight Recorder one) and publish
    their events to Kafka."""
    from rich.console import Console

    from c4base.config import load_section
    from c4base.kafka import KafkaCredentialsError
    from c4base.service import start_service
    from c4base.settings_loader import SettingsError
    from producers.exporter import ExporterConfig, run_exporter
    from producers.exporter.core import EXPORTER_SECTION

    # Flags given on the command line win over [exporter]; [exporter] over the defaults.
    flags = given(ctx, exporter)
    try:
        svc = start_service(config, ctx, stage="exporter")
        cfg: ExporterConfig = load_section("exporter", EXPORTER_SECTION, config, overrides=flags)
    except SettingsError as err:
        if directory is None and "`directory`" in str(err):
            fail("exporter", "--dir DIR (or [exporter] directory = DIR in --config) is required", 2)
        fail("exporter", err, 2)
    try:
        stats = run_exporter(cfg, metrics=svc.metrics)
    except KafkaCredentialsError as err:
        fail("exporter", f"stopped: {err}", 1)
    Console(stderr=True).print(
        f"exporter stopped: {stats.lines} lines, {stats.events} events, "
        f"{stats.delivered}/{stats.messages} messages acknowledged, "
        f"{stats.deadletters} dead letters ({stats.refused} records refused at the edge)"
    )


def replay(
    traces: Annotated[
        list[Path],
        typer.Argument(
            help="contract traces (.jsonl[.gz]), Inspector dirs, Flight Recorder dumps, "
            "the Parquet archive of c4.events"
        ),
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
    wire_format: Annotated[
        str, typer.Option("--format", help=_FORMAT_HELP, callback=_check_format)
    ] = "json",
    sign_with: Annotated[
        Path | None,
        typer.Option(
            "--sign-with",
            help="master key file: sign each host's events with its derived key "
            "(for a worker with require_signed_events; docs/security.md)",
        ),
    ] = None,
) -> None:
    """Publish a recorded trace to Kafka at its recorded pace scaled by --speed."""
    from rich.console import Console

    from c4base.config import KAFKA_SECTION, load_section
    from c4base.kafka import KafkaConfig, KafkaCredentialsError
    from c4base.settings_loader import SettingsError
    from c4base.signing import KeyFileError
    from producers.replay import ReplayConfig, parse_speed
    from producers.replay import replay as run_replay
    from producers.sources import SourceError

    console = Console(stderr=True)
    try:
        pace = parse_speed(speed)
    except ValueError as err:
        fail("replay", f"--speed: {err}", 2)
    try:
        over = {"bootstrap": bootstrap} if bootstrap else None
        kafka: KafkaConfig = load_section("kafka", KAFKA_SECTION, config, overrides=over)
    except SettingsError as err:
        fail("replay", err, 2)
    cfg = ReplayConfig(
        kafka=kafka,
        events_topic=topic,
        deadletter_topic=deadletter_topic,
        speed=pace,
        job=job,
        progress=progress,
        format=wire_format,
        sign_with=sign_with,
    )
    try:
        stats = run_replay(traces, cfg)
    except (SourceError, KeyFileError) as err:
        fail("replay", err, 2)
    except KafkaCredentialsError as err:
        fail("replay", f"stopped: {err}", 1)
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
