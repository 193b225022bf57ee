"""Command-line commands of the streams stage; registered on the main app by :mod:`c4stream.cli`.

Heavy imports stay inside the command functions so that `c4stream --help` is fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from c4base.cli_options import (
    Bootstrap,
    LogJson,
    LogLevel,
    MetricsHost,
    MetricsPort,
    TopicPrefix,
    config_file,
    fail,
)

ConfigFile = config_file("[kafka], [worker]")


def register(app: typer.Typer) -> None:
    """Add this stage's commands to the main ``c4stream`` app."""
    app.command("worker")(worker)
    app.command("detect")(detect)


def worker(
    ctx: typer.Context,
    config: ConfigFile = None,
    bootstrap: Bootstrap = None,
    topic_prefix: TopicPrefix = None,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="Faust data dir and status.json.")
    ] = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    log_level: LogLevel = None,
    log_json: LogJson = False,
) -> None:
    """Run the Faust worker: c4.events -> verdicts -> c4.isolations, until SIGINT/SIGTERM.

    Logs and the Prometheus /metrics endpoint follow [log] and [metrics] of --config;
    the flags win over the file.
    """
    from c4base import lifeguard
    from c4base.kafka import KafkaCredentialsError
    from c4base.service import start_service
    from c4base.settings_loader import SettingsError
    from streams.app.settings import WorkerConfigError, load_worker_config
    from streams.app.topics_admin import TopicSetupError
    from streams.worker import run_worker

    try:
        cfg = load_worker_config(
            config,
            bootstrap=bootstrap,
            topic_prefix=topic_prefix,
            workdir=str(workdir) if workdir else None,
        )
        svc = start_service(config, ctx, stage="worker")
        code = run_worker(cfg, metrics=svc.metrics, own_logging=True)
    except (WorkerConfigError, SettingsError, TopicSetupError, ValueError) as err:
        fail("worker", err, 2)
    except KafkaCredentialsError as err:
        fail("worker", err, lifeguard.EXIT_CREDENTIALS_REFUSED)
    raise typer.Exit(code)


def _epoch_us(text: str) -> int:
    """``2026-12-01T23:40:05Z`` (no zone: UTC) or ``1796115275.48`` → µs since the epoch."""
    from datetime import UTC, datetime

    try:
        return int(float(text) * 1e6)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither ISO 8601 nor seconds since the epoch") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return int(t.timestamp() * 1e6)


def detect(
    traces: Annotated[
        list[Path],
        typer.Argument(
            help="Traces (JSON lines, plain or .gz), Inspector dirs, Flight Recorder dumps "
            "(a directory per snapshot: every rank's dump of one moment), the Parquet "
            "archive of c4.events, Arrow IPC files or stream files of events."
        ),
    ],
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Write isolation commands here (JSON lines; .gz ok)."),
    ],
    no_dry_run: Annotated[
        bool, typer.Option("--no-dry-run", help="Mark commands as real (default: dry_run true).")
    ] = False,
    deny: Annotated[
        list[str] | None, typer.Option("--deny", help="Host never isolated (repeatable).")
    ] = None,
    job_hosts: Annotated[
        int | None, typer.Option("--job-hosts", help="Hosts in the job (for the isolation cap).")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary table.")] = False,
    dump_time: Annotated[
        str | None,
        typer.Option(
            "--dump-time",
            help="When Flight Recorder dumps were taken (ISO 8601, or seconds since the "
            "epoch), for dumps whose mtimes a copy lost; without it, such dumps only alert",
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="c4stream.toml: thresholds from [worker.detect], policy from [worker.policy]",
        ),
    ] = None,
) -> None:
    """Run the detection core over recorded traces, in event time, without Kafka;
    Flight Recorder snapshots are judged as a whole."""
    import msgspec
    from rich.console import Console

    from streams.core.config import PolicyConfig
    from streams.detect import DetectInputError, run_detect, summary_table

    detect_cfg = None
    policy = PolicyConfig()
    if config is not None:  # e.g. an archived day judged with other thresholds
        from streams.app.settings import WorkerConfigError, load_worker_config

        try:
            wc = load_worker_config(config)
        except WorkerConfigError as err:
            raise typer.BadParameter(str(err), param_hint="--config") from None
        detect_cfg, policy = wc.detect, wc.policy
    policy = msgspec.structs.replace(
        policy,
        dry_run=not no_dry_run,
        deny_hosts=list(deny or policy.deny_hosts),
        job_hosts=job_hosts if job_hosts is not None else policy.job_hosts,
    )
    shown = 0

    def on_bad(b) -> None:  # noqa: ANN001 - producers.traces.BadLine
        nonlocal shown
        shown += 1
        if shown <= 20:
            # typer.echo, not rich: a file:line: reason line is for grep, never wrapped
            typer.echo(f"bad input: {b}", err=True)
        elif shown == 21:
            typer.echo("bad input: more bad lines follow; counting only", err=True)

    dump_us = None
    if dump_time is not None:
        try:
            dump_us = _epoch_us(dump_time)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--dump-time") from None
    try:
        res = run_detect(traces, out, detect_cfg, policy=policy, on_bad=on_bad,
                         dump_time_us=dump_us)  # fmt: skip
    except DetectInputError as e:
        fail("detect", e, 2)
    if not quiet:
        Console(width=None if sys.stdout.isatty() else 200).print(summary_table(res))
    typer.echo(
        f"{len(res.commands)} command(s) -> {out}; {res.n_events} events, {res.n_bad} bad "
        f"lines, {res.n_late} late events and {res.n_late_verdicts} late verdicts not "
        f"judged, {res.elapsed_s:.2f} s",
        err=True,
    )
