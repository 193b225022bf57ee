"""What every long-running service sets up the same way: its settings, logs and metrics.

Each service command (``exporter``, ``worker``, ``actuate``, ``alert``, ``archive``) has
the same operations flags, declared once in :mod:`c4base.cli_options` — ``--config
FILE``, ``--bootstrap``, ``--metrics-port``, ``--metrics-host``, ``--log-level``,
``--log-json`` — and calls :func:`start_service` once, which reads
``[log]`` and ``[metrics]`` from the file (flags win), configures logging for the whole
process and starts the ``/metrics`` endpoint (off unless a port is set; 127.0.0.1
unless told otherwise).

>>> sorted(METRICS_FLAGS.values()), sorted(LOG_FLAGS.values())
(['host', 'port'], ['json', 'level'])
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from c4base.config import LOG_SECTION, METRICS_SECTION, LogSettings, flag_overrides, load_section
from c4base.logs import setup_logging
from c4base.metrics import Metrics
from c4base.settings_loader import SettingsError

if TYPE_CHECKING:  # CLI modules import the help texts below: keep this import light
    from c4base.metrics import Metrics, MetricsConfig

__all__ = ["METRICS_FLAGS", "LOG_FLAGS", "Service", "start_service"]

METRICS_FLAGS = {"metrics_port": "port", "metrics_host": "host"}
"""Option parameter → key of ``[metrics]``."""
LOG_FLAGS = {"log_level": "level", "log_json": "json"}
"""Option parameter → key of ``[log]``."""


@dataclass(frozen=True, slots=True)
class Service:
    """The per-process operations state a service passes to its loop."""

    stage: str
    metrics: Metrics
    metrics_config: MetricsConfig
    port: int | None
    """Bound port of /metrics (None: off)."""
    log: logging.Logger


def start_service(
    config: Path | None,
    ctx: Any,
    *,
    stage: str,
    env: Mapping[str, str] | None = None,
    log_values: Mapping[str, Any] | None = None,
) -> Service:
    """Read ``[log]``/``[metrics]`` (flags in ``ctx`` win), set up logging, serve metrics.

    ``log_values`` replaces a flag's value (e.g. ``--verbose`` given → level DEBUG).
    Raises :class:`~c4base.settings_loader.SettingsError` on a bad setting or a
    metrics port that cannot be bound.
    """

    log_over = flag_overrides(ctx, LOG_FLAGS, **dict(log_values or {}))
    logs: LogSettings = load_section("log", LOG_SECTION, config, env=env, overrides=log_over)
    mcfg: MetricsConfig = load_section(
        "metrics", METRICS_SECTION, config, env=env, overrides=flag_overrides(ctx, METRICS_FLAGS)
    )
    # The root logger: a service is a process of its own, and every package's logger
    # (c4stream.*, sinks.*, producers.*, librdkafka's) should come out the same way.
    setup_logging(logs.level, json_lines=logs.json, name="")
    log = logging.getLogger(f"c4stream.{stage}")
    metrics = Metrics()
    metrics.prime(stage)  # counters at 0 from the first scrape, not "No data"
    try:
        port = metrics.serve(mcfg)
    except OSError as err:
        raise SettingsError(
            f"cannot serve metrics on {mcfg.host}:{mcfg.port}: {err}; "
            "pick a free --metrics-port (or 0 to turn the endpoint off)"
        ) from None
    if port is not None:
        log.info("metrics on http://%s:%d/metrics", mcfg.host, port, extra={"stage": stage})
    return Service(stage, metrics, mcfg, port, log)
