"""``c4stream archive``: run the archiver; ``c4stream archive dedupe DIR``: count/remove duplicates.

Only Typer is imported here; the archiver, pyarrow and confluent-kafka load inside the
commands so ``c4stream --help`` stays fast. Also runnable as ``python -m sinks.archive``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from c4base.config import flag_overrides, load_section
from c4base.service import LOG_JSON_HELP, METRICS_HOST_HELP, METRICS_PORT_HELP, start_service
from c4base.settings_loader import SettingsError
from sinks.archive.consumer import ARCHIVE_SECTION, ArchiveConfig, Archiver
from sinks.archive.dedupe import dedupe_archive

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
    config: Annotated[
        Path | None,
        typer.Option("--config", help="c4stream.toml ([kafka], [archive]); flags win over it."),
    ] = None,
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
    metrics_port: Annotated[int, typer.Option("--metrics-port", help=METRICS_PORT_HELP)] = 0,
    metrics_host: Annotated[
        str, typer.Option("--metrics-host", help=METRICS_HOST_HELP)
    ] = "127.0.0.1",
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING…")] = "INFO",
    log_json: Annotated[
        bool, typer.Option("--log-json", "--json-logs", help=LOG_JSON_HELP)
    ] = False,
) -> None:
    """Consume the topics and write hive-partitioned (job, hour) zstd Parquet until SIGTERM/^C.

    Offsets are committed only after the rows they cover are in completed files, so a
    crash loses nothing; the few duplicates it may leave go with `archive dedupe`.
    """
    if ctx.invoked_subcommand is not None:
        return
    import signal
    import threading

    # Flags given on the command line win over [archive]; [archive] over the defaults.
    flags = flag_overrides(
        ctx,
        _FLAG_KEYS,
        roll_bytes=parse_size(roll_bytes),
        row_group_bytes=parse_size(row_group_bytes),
    )
    try:
        cfg: ArchiveConfig = load_section("archive", ARCHIVE_SECTION, config, overrides=flags)
    except SettingsError as err:
        if out is None and "`out`" in str(err):
            raise typer.BadParameter(
                "--out DIR (or [archive] out = DIR in --config) is required to run the archiver",
                param_hint="--out",
            ) from None
        raise typer.BadParameter(str(err), param_hint="--config") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        svc = start_service(config, ctx, stage="archiver")
        archiver = Archiver(cfg, metrics=svc.metrics)
    except SettingsError as err:
        raise typer.BadParameter(str(err), param_hint="--metrics-port") from None
    except ValueError as err:  # roll policy out of range
        raise typer.BadParameter(str(err)) from None
    archiver.run(stop)


#: Option parameter -> key of the [archive] table.
_FLAG_KEYS = {
    "out": "out",
    "bootstrap": "kafka.bootstrap",
    "topic_prefix": "kafka.topic_prefix",
    "group": "group",
    "instance_id": "instance_id",
    "roll_bytes": "roll_bytes",
    "roll_seconds": "roll_seconds",
    "row_group_bytes": "row_group_bytes",
    "max_open_files": "max_open_files",
}


@app.command("dedupe")
def dedupe(
    root: Annotated[Path, typer.Argument(help="Archive root given to --out.")],
    check: Annotated[
        bool, typer.Option("--check", help="Only count; exit 1 if duplicates exist.")
    ] = False,
) -> None:
    """Count (--check) or remove duplicate rows (same topic, partition, offset, index)."""

    if not root.is_dir():
        raise typer.BadParameter(f"{root} is not a directory", param_hint="ROOT")
    reports = dedupe_archive(root, apply=not check)
    for r in reports:
        typer.echo(str(r))
    if check and any(r.duplicates for r in reports):
        raise typer.Exit(1)
