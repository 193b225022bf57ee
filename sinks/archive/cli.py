"""``c4stream archive``: run the archiver; ``c4stream archive dedupe DIR``: count/remove duplicates.

Only Typer is imported here; the archiver, pyarrow and confluent-kafka load inside the
commands so ``c4stream --help`` stays fast. Also runnable as ``python -m sinks.archive``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["app", "parse_size"]

app = typer.Typer(
    name="archive",
    help="Archive c4.events, c4.verdicts and c4.isolations to crash-safe Parquet datasets.",
    invoke_without_command=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def parse_size(text: str) -> int:
    """Bytes from ``"134217728"``, ``"128MiB"``, ``"64k"``, ``"1G"``.

    >>> parse_size("128MiB"), parse_size("64k"), parse_size("4096")
    (134217728, 64000, 4096)
    """
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size; use e.g. 134217728, 128MiB or 64k")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


@app.callback()
def archive(
    ctx: typer.Context,
    out: Annotated[
        Path | None, typer.Option("--out", help="Archive root (events/, verdicts/, isolations/).")
    ] = None,
    bootstrap: Annotated[
        str | None, typer.Option(help="Kafka host:port[,…]; KAFKA_BOOTSTRAP overrides.")
    ] = None,
    topic_prefix: Annotated[str, typer.Option(help="Prefix of the c4.* topic names.")] = "",
    group: Annotated[str, typer.Option(help="Kafka consumer group.")] = "c4stream-archive",
    instance_id: Annotated[
        str | None,
        typer.Option(help="Static group member id (e.g. pod name): restarts skip rebalances."),
    ] = None,
    roll_bytes: Annotated[
        str, typer.Option(help="Close a file at this size on disk (e.g. 128MiB).")
    ] = "128MiB",
    roll_seconds: Annotated[
        float, typer.Option(help="Close a file this long after opening it (bounds commit lag).")
    ] = 300.0,
    row_group_bytes: Annotated[
        str, typer.Option(help="Uncompressed bytes buffered per row group.")
    ] = "64MiB",
    max_open_files: Annotated[int, typer.Option(help="Open (job, hour) files per dataset.")] = 64,
    metrics_port: Annotated[
        int, typer.Option(help="Serve Prometheus /metrics on 127.0.0.1:PORT (0: off).")
    ] = 0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING…")] = "INFO",
    json_logs: Annotated[bool, typer.Option(help="One JSON object per log line.")] = False,
) -> None:
    """Consume the topics and write hive-partitioned (job, hour) zstd Parquet until SIGTERM/^C.

    Offsets are committed only after the rows they cover are in completed files, so a
    crash loses nothing; the few duplicates it may leave go with `archive dedupe`.
    """
    if ctx.invoked_subcommand is not None:
        return
    if out is None:
        raise typer.BadParameter("--out DIR is required to run the archiver", param_hint="--out")

    import signal
    import threading

    from c4stream.kafka import KafkaConfig
    from c4stream.logs import setup_logging
    from c4stream.metrics import Metrics, MetricsConfig
    from sinks.archive.consumer import ArchiveConfig, Archiver

    setup_logging(log_level, json_lines=json_logs)
    setup_logging(log_level, json_lines=json_logs, name="sinks")
    kafka = KafkaConfig(topic_prefix=topic_prefix)
    if bootstrap:
        kafka = KafkaConfig(bootstrap=bootstrap, topic_prefix=topic_prefix)
    cfg = ArchiveConfig(
        out=str(out),
        kafka=kafka,
        group=group,
        instance_id=instance_id,
        roll_bytes=parse_size(roll_bytes),
        roll_seconds=roll_seconds,
        row_group_bytes=parse_size(row_group_bytes),
        max_open_files=max_open_files,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        archiver = Archiver(cfg, metrics=(metrics := Metrics()))
    except ValueError as err:  # roll policy out of range
        raise typer.BadParameter(str(err)) from None
    metrics.serve(MetricsConfig(port=metrics_port))
    archiver.run(stop)


@app.command("dedupe")
def dedupe(
    root: Annotated[Path, typer.Argument(help="Archive root given to --out.")],
    check: Annotated[
        bool, typer.Option("--check", help="Only count; exit 1 if duplicates exist.")
    ] = False,
) -> None:
    """Count (--check) or remove duplicate rows (same topic, partition, offset, index)."""
    from sinks.archive.dedupe import dedupe_archive

    if not root.is_dir():
        raise typer.BadParameter(f"{root} is not a directory", param_hint="ROOT")
    reports = dedupe_archive(root, apply=not check)
    for r in reports:
        typer.echo(str(r))
    if check and any(r.duplicates for r in reports):
        raise typer.Exit(1)
