"""One configuration file for every service: ``c4stream.toml``.

``[kafka]`` is shared (bootstrap, topic prefix, SASL/TLS properties under
``[kafka.extra]``); each service reads its own table (``[worker]``, ``[exporter]``,
``[actuator]``, ``[archive]``, ``[alert]``) and the common ``[metrics]`` and ``[log]``.
Environment variables ``C4STREAM__SECTION__KEY=value`` override the file, and
``KAFKA_BOOTSTRAP`` overrides the bootstrap servers. ``c4stream config check FILE``
validates every table with the same types the services use.

>>> cfg = load_section("metrics", text="[metrics]\\nport = 9464", env={})
>>> cfg.port, cfg.host
(9464, '127.0.0.1')
>>> check_config(text="[worker]\\nbatch_max = -1", env={})[0].ok
False
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import msgspec

from c4stream.kafka import KafkaConfig
from c4stream.metrics import MetricsConfig
from c4stream.settings_loader import SettingsError, load_raw

__all__ = ["LogSettings", "SectionReport", "check_config", "load_section", "section_types"]


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = "INFO"
    json: bool = False
    """One JSON object per line, for log shippers."""


def _worker() -> type:
    from streams.app.settings import WorkerConfig

    return WorkerConfig


def _exporter() -> type:
    from producers.exporter.core import ExporterConfig

    return ExporterConfig


def _actuator() -> type:
    from sinks.actuator.config import ActuatorConfig

    return ActuatorConfig


def _archive() -> type:
    from sinks.archive.consumer import ArchiveConfig

    return ArchiveConfig


def _alert() -> type:
    from sinks.alert.config import AlertConfig

    return AlertConfig


def section_types() -> dict[str, Callable[[], type]]:
    """Each table of the file and (lazily, to keep start-up fast) the type it must fit."""
    return {
        "kafka": lambda: KafkaConfig,
        "metrics": lambda: MetricsConfig,
        "log": lambda: LogSettings,
        "worker": _worker,
        "exporter": _exporter,
        "actuator": _actuator,
        "archive": _archive,
        "alert": _alert,
    }


def _has_kafka_field(cls: type) -> bool:
    if is_dataclass(cls):
        return any(f.name == "kafka" for f in fields(cls))
    return "kafka" in getattr(cls, "__struct_fields__", ())


def _section_data(doc: Mapping[str, Any], name: str, cls: type) -> dict[str, Any]:
    data = dict(doc.get(name, {}))
    # The shared [kafka] table fills a service's own kafka settings unless it has some.
    if name != "kafka" and _has_kafka_field(cls) and "kafka" not in data and "kafka" in doc:
        data["kafka"] = doc["kafka"]
    return data


def load_section(
    name: str,
    path: str | Path | None = None,
    *,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
    cls: type | None = None,
) -> Any:
    """The typed settings of one service from the file (defaults where it is silent)."""
    target = cls or section_types()[name]()
    doc, source = load_raw(path, text=text, env=env)
    try:
        return msgspec.convert(_section_data(doc, name, target), target)
    except msgspec.ValidationError as err:
        raise SettingsError(f"{source}: [{name}] {err}") from None


@dataclass(frozen=True, slots=True)
class SectionReport:
    section: str
    ok: bool
    message: str


def check_config(
    path: str | Path | None = None,
    *,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[SectionReport]:
    """Validate every table; unknown tables are errors too (a typo must not pass)."""
    doc, source = load_raw(path, text=text, env=env)
    types = section_types()
    out: list[SectionReport] = []
    for name in doc:
        if name not in types:
            out.append(
                SectionReport(name, False, f"unknown table [{name}]; known: {', '.join(types)}")
            )
    for name, get in types.items():
        if name not in doc:
            continue
        cls = get()
        try:
            msgspec.convert(_section_data(doc, name, cls), cls)
            out.append(SectionReport(name, True, "ok"))
        except msgspec.ValidationError as err:
            out.append(SectionReport(name, False, f"{source}: [{name}] {err}"))
    return out
