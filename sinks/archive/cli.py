"""``c4stream archive``: run the archiver; ``c4stream archive dedupe DIR``: count/remove duplicates.

Only Typer is imported here; the archiver, pyarrow and confluent-kafka load inside the
commands so ``c4stream --help`` stays fast. Also runnable as ``python -m sinks.archive``.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Annotated

import typer

from c4base.cli_options import (
    Bootstrap,
    BrokerTimeout,
    Group,
    InstanceId,
    Key,
    LogJson,
    LogLevel,
    MetricsHost,
    MetricsPort,
    StatusFile,
    TopicPrefix,
    config_file,
    fail,
    given,
)

ConfigFile = config_file("[kafka], [archive]")

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
        fail("archive", f"{text!r} is not a size; use e.g. 134217728, 128MiB or 64k", 2)
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


@app.callback()
def archive(
    ctx: typer.Context,
    config: ConfigFile = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Archive root (events/, verdicts/, isolations/)."),
        Key("out"),
    ] = None,
    bootstrap: Bootstrap = None,
    topic_prefix: TopicPrefix = None,
    group: Group = None,
    instance_id: InstanceId = None,
    broker_timeout: BrokerTimeout = None,
    status_file: StatusFile = None,
    roll_bytes: Annotated[
        str | None,
        typer.Option(help="Close a file at this size on disk (e.g. 128MiB; default 128MiB)."),
        Key("roll_bytes"),
    ] = None,
    roll_seconds: Annotated[
        float | None,
        typer.Option(
            help="Close a file this long after opening it (default 300; bounds commit lag)."
        ),
        Key("roll_seconds"),
    ] = None,
    row_group_bytes: Annotated[
        str | None,
        typer.Option(help="Uncompressed bytes buffered per row group (default 64MiB)."),
        Key("row_group_bytes"),
    ] = None,
    max_open_files: Annotated[
        int | None,
        typer.Option(help="Open (job, hour) files per dataset (default 64)."),
        Key("max_open_files"),
    ] = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    log_level: LogLevel = None,
    log_json: LogJson = False,
) -> None:
    """Consume the topics and write hive-partitioned (job, hour) zstd Parquet until SIGTERM/^C.

    Offsets are committed only after the rows they cover are in completed files, so a
    crash loses nothing; the few duplicates it may leave go with `archive dedupe`.
    """
    if ctx.invoked_subcommand is not None:
        return
    from c4base.config import load_section
    from c4base.lifeguard import stop_on_signals
    from c4base.runtime import FatalError
    from c4base.service import start_service
    from c4base.settings_loader import SettingsError
    from sinks.archive.consumer import ARCHIVE_SECTION, ArchiveConfig, Archiver

    # Flags given on the command line win over [archive]; [archive] over the defaults.
    sizes = {
        name: parse_size(value)
        for name, value in (("roll_bytes", roll_bytes), ("row_group_bytes", row_group_bytes))
        if value is not None
    }
    flags = given(ctx, archive, **sizes)
    try:
        cfg: ArchiveConfig = load_section("archive", ARCHIVE_SECTION, config, overrides=flags)
    except SettingsError as err:
        if out is None and "`out`" in str(err):
            fail("archive", "--out DIR (or [archive] out = DIR in --config) is required", 2)
        fail("archive", err, 2)
    stop = threading.Event()
    stop_on_signals(stop)
    try:
        svc = start_service(config, ctx, stage="archiver")
        archiver = Archiver(cfg, metrics=svc.metrics)
    except (SettingsError, ValueError) as err:  # ValueError: roll policy out of range
        fail("archive", err, 2)
    try:
        archiver.run(stop)
    except FatalError as err:
        fail("archive", err, 1)


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
        fail("archive dedupe", f"{root} is not a directory", 2)
    reports = dedupe_archive(root, apply=not check)
    for r in reports:
        typer.echo(str(r))
    if check and any(r.duplicates for r in reports):
        raise typer.Exit(1)
