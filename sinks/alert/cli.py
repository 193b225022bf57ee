"""``c4stream alert``: run the alerter on Kafka; ``c4stream alert test``: one sample to all.

Registered by :mod:`sinks.cli`; heavy imports stay inside the functions.
"""

from __future__ import annotations

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
    fail,
    given,
)

TEST_WITHIN_S = 20.0
"""How long ``alert test`` retries a destination."""

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

    from c4base.config import load_section
    from c4base.settings_loader import SettingsError
    from sinks.alert.config import ALERT_SECTION, ConfigError, load_config

    try:
        if _is_unified(config):
            return load_section("alert", ALERT_SECTION, config)
        return load_config(config, env=os.environ)
    except (ConfigError, SettingsError) as err:
        fail("alert", err, 2)


def _logging(level: str) -> None:
    import logging

    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@alert_app.callback()
def alert(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help=_CONFIG_HELP)] = None,
    bootstrap: Bootstrap = None,
    topic_prefix: TopicPrefix = None,
    group: Group = None,
    instance_id: InstanceId = None,
    from_beginning: Annotated[
        bool | None,
        typer.Option(
            "--from-beginning/--from-end",
            help="Where a new consumer group starts (default: the end).",
        ),
        Key("from_beginning"),
    ] = None,
    broker_timeout: BrokerTimeout = None,
    status_file: StatusFile = None,
    log_level: LogLevel = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    log_json: LogJson = False,
) -> None:
    """Consume c4.isolations and c4.verdicts and post grouped alerts until interrupted."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        fail("alert", "--config alert.toml (or c4stream.toml with [alert]) is required", 2)
    import msgspec

    from c4base.config import KAFKA_SECTION, load_section
    from c4base.lifeguard import stop_on_signals
    from c4base.runtime import FatalError
    from c4base.service import start_service
    from c4base.settings_loader import SettingsError
    from sinks.alert.config import ConfigError
    from sinks.alert.consumer import AlertService

    cfg = _load(config)
    # [kafka], [metrics] and [log] come from the file only when it is c4stream.toml.
    shared = config if _is_unified(config) else None
    try:
        own = {k: v for k, v in given(ctx, alert).items() if not k.startswith("kafka.")}
        cfg = msgspec.structs.replace(cfg, **own)
        kafka = load_section(
            "kafka", KAFKA_SECTION, shared, overrides=given(ctx, alert, prefix="kafka.")
        )
        svc = start_service(shared, ctx, stage="alerter")
    except (SettingsError, ConfigError, TypeError) as err:
        fail("alert", err, 2)
    service = AlertService(
        cfg,
        kafka,
        group=cfg.group,
        from_beginning=cfg.from_beginning,
        instance_id=cfg.instance_id,
        metrics=svc.metrics,
        broker_timeout_s=cfg.broker_timeout_s,
        status_path=cfg.status_file or None,
    )
    stop_on_signals(service.stop)
    try:
        stats = service.run()
    except FatalError as err:
        fail("alert", err, 1)
    typer.echo(
        f"c4stream alert: stopped: {stats}, {service.stats}, {service.alerter.delivery.stats}",
        err=True,
    )


@alert_app.command("test")
def alert_test(
    config: Path = typer.Option(..., "--config", "-c", help=_CONFIG_HELP),
    resolved: bool = typer.Option(False, "--resolved", help="Send the resolved form instead."),
    log_level: str = typer.Option("WARNING", "--log-level"),
) -> None:
    """Send one sample alert to every destination, whatever its min_severity; exit 1 on failure."""
    import asyncio

    from sinks.alert.alerter import Alerter
    from sinks.alert.samples import sample_notification

    _logging(log_level)
    cfg = _load(config)
    n = sample_notification("resolved" if resolved else "firing")

    async def main() -> list[tuple[str, str, bool]]:
        async with Alerter.from_config(cfg) as alerter:
            targets = list(alerter.delivery.targets.values())
            # A check answers within seconds, not after the service's 10-minute window.
            sends = (alerter.delivery.send(t, n, within_s=TEST_WITHIN_S) for t in targets)
            oks = await asyncio.gather(*sends)
            return [
                (t.name, t.destination.redacted_url, ok) for t, ok in zip(targets, oks, strict=True)
            ]

    results = asyncio.run(main())
    for name, url, ok in results:
        typer.echo(f"{'ok    ' if ok else 'FAILED'} {name} {url}")
    if not all(ok for _, _, ok in results):
        raise typer.Exit(1)
