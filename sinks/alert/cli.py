"""``c4stream alert``: run the alerter on Kafka; ``c4stream alert test``: one sample to all.

Registered by :mod:`sinks.cli`; heavy imports stay inside the functions.
"""

from __future__ import annotations

from pathlib import Path

import typer

from c4base.config import KAFKA_SECTION, flag_overrides, load_section
from c4base.service import LOG_JSON_HELP, METRICS_HOST_HELP, METRICS_PORT_HELP, start_service
from c4base.settings_loader import SettingsError
from sinks.alert.alerter import Alerter
from sinks.alert.config import ALERT_SECTION, ConfigError, load_config
from sinks.alert.consumer import AlertConsumer
from sinks.alert.samples import sample_notification

alert_app = typer.Typer(
    help=(
        "Post isolation commands and verdicts to ops chat (Slack, Mattermost, Teams, "
        "DingTalk, Feishu/Lark, Discord, Alertmanager API or webhook format). "
        "Run: c4stream alert --bootstrap HOST:PORT --config alert.toml · "
        "check destinations: c4stream alert test --config alert.toml"
    ),
    invoke_without_command=True,
    no_args_is_help=False,
)

_CONFIG_HELP = (
    "alert.toml of [[destination]] tables (type, url, secret, min_severity), or the "
    "one c4stream.toml with an [alert] table and [[alert.destination]]."
)


def _is_unified(config: Path) -> bool:
    """Whether ``config`` is c4stream.toml (it has an ``[alert]`` table) rather than the
    alerter's own alert.toml (top-level ``[[destination]]``)."""
    import tomllib

    try:
        return isinstance(tomllib.loads(config.read_text(encoding="utf-8")).get("alert"), dict)
    except (OSError, tomllib.TOMLDecodeError):
        return False  # the loader below reports the problem with the file's name


def _load(config: Path):  # -> AlertConfig
    import os

    try:
        if _is_unified(config):
            return load_section("alert", ALERT_SECTION, config)
        return load_config(config, env=os.environ)
    except (ConfigError, SettingsError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def _logging(level: str) -> None:
    import logging

    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@alert_app.callback()
def alert(
    ctx: typer.Context,
    config: Path = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
    bootstrap: str = typer.Option(
        "127.0.0.1:9092", "--bootstrap", "-b", help="Kafka host:port (KAFKA_BOOTSTRAP overrides)."
    ),
    topic_prefix: str = typer.Option("", "--topic-prefix", help="Prefix of the c4.* topics."),
    group: str = typer.Option("c4stream-alert", "--group", help="Kafka consumer group."),
    from_beginning: bool = typer.Option(
        False, "--from-beginning", help="A new consumer group reads the topics from the start."
    ),
    log_level: str = typer.Option("INFO", "--log-level"),
    metrics_port: int = typer.Option(0, "--metrics-port", help=METRICS_PORT_HELP),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help=METRICS_HOST_HELP),
    log_json: bool = typer.Option(False, "--log-json", help=LOG_JSON_HELP),
) -> None:
    """Consume c4.isolations and c4.verdicts and post grouped alerts until interrupted."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        typer.echo(
            "error: --config alert.toml (or c4stream.toml with [alert]) is required "
            "(see docs/alerts.md)",
            err=True,
        )
        raise typer.Exit(2)
    import asyncio
    import signal

    cfg = _load(config)
    # [kafka], [metrics] and [log] come from the file only when it is c4stream.toml.
    shared = config if _is_unified(config) else None
    flags = flag_overrides(ctx, {"bootstrap": "bootstrap", "topic_prefix": "topic_prefix"})
    try:
        svc = start_service(shared, ctx, stage="alerter")
        kafka = load_section("kafka", KAFKA_SECTION, shared, overrides=flags)
    except SettingsError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with Alerter.from_config(cfg) as alerter:
            consumer = AlertConsumer(
                alerter,
                kafka,
                group_id=group,
                from_beginning=from_beginning,
                metrics=svc.metrics,
            )
            await consumer.run(stop)
            await alerter.delivery.drain(10.0)
            typer.echo(f"alerter stopped: {consumer.stats}, {alerter.delivery.stats}", err=True)

    asyncio.run(main())


@alert_app.command("test")
def alert_test(
    config: Path = typer.Option(..., "--config", "-c", help=_CONFIG_HELP),
    resolved: bool = typer.Option(False, "--resolved", help="Send the resolved form instead."),
    log_level: str = typer.Option("WARNING", "--log-level"),
) -> None:
    """Send one sample alert to every destination, whatever its min_severity; exit 1 on failure."""
    import asyncio

    _logging(log_level)
    cfg = _load(config)
    n = sample_notification("resolved" if resolved else "firing")

    async def main() -> list[tuple[str, str, bool]]:
        async with Alerter.from_config(cfg) as alerter:
            targets = list(alerter.delivery.targets.values())
            oks = await asyncio.gather(*(alerter.delivery.send(t, n) for t in targets))
            return [
                (t.name, t.destination.redacted_url, ok) for t, ok in zip(targets, oks, strict=True)
            ]

    results = asyncio.run(main())
    for name, url, ok in results:
        typer.echo(f"{'ok    ' if ok else 'FAILED'} {name} {url}")
    if not all(ok for _, _, ok in results):
        raise typer.Exit(1)
