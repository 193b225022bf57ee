"""Loading one table of ``c4stream.toml`` into the typed object its service uses.

``[kafka]`` is shared (bootstrap, topic prefix, SASL/TLS properties under
``[kafka.extra]``); each service reads its own table (``[worker]``, ``[exporter]``,
``[actuator]``, ``[archive]``, ``[alert]``) and the common ``[metrics]`` and ``[log]``.
Each stage declares its own table as a :class:`Section` and passes it here; this module
knows none of them (``c4stream.config`` gathers them all for ``c4stream config check``).
Environment variables ``C4STREAM__SECTION__KEY=value`` override the file, and
``KAFKA_BOOTSTRAP`` overrides the bootstrap servers.

Precedence, lowest first: defaults < file < ``C4STREAM__…`` environment < command-line
flags (``overrides``, dotted keys); ``KAFKA_BOOTSTRAP`` wins over any bootstrap.

>>> cfg = load_section("metrics", METRICS_SECTION, text="[metrics]\\nport = 9464", env={})
>>> cfg.port, cfg.host
(9464, '127.0.0.1')
>>> load_section("metrics", METRICS_SECTION, text="[metrics]\\nport = 9464", env={},
...              overrides={"port": 1}).port
1
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path, PurePath
from typing import Any

import msgspec

from c4base.kafka import KafkaConfig
from c4base.metrics import MetricsConfig
from c4base.settings_loader import SettingsError, load_raw

__all__ = [
    "KAFKA_SECTION",
    "LOG_SECTION",
    "METRICS_SECTION",
    "LogSettings",
    "Section",
    "SettingsError",
    "flag_overrides",
    "load_section",
    "section_data",
]

Converter = Callable[[dict[str, Any], Mapping[str, str]], Any]
"""``(table, environment) -> typed object``; raises ``ValueError`` (or msgspec's
``ValidationError``) with a message naming the bad setting."""


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = "INFO"
    json: bool = False
    """One JSON object per line, for log shippers."""


def _dec_hook(typ: type, obj: Any) -> Any:
    # msgspec has no Path type: the exporter's dataclass uses Path fields.
    if isinstance(typ, type) and issubclass(typ, PurePath) and isinstance(obj, str):
        return typ(obj)
    raise NotImplementedError(f"{typ} is not a supported setting type")


@dataclass(frozen=True, slots=True)
class Section:
    """How one table becomes the typed object its service uses.

    ``convert`` is for services whose loader does more than a type check (the alerter
    resolves ``url_env`` from the environment); by default the table is converted to
    ``cls`` with msgspec.
    """

    cls: type
    convert: Converter | None = None

    def build(self, data: dict[str, Any], env: Mapping[str, str]) -> Any:
        if self.convert is not None:
            return self.convert(data, env)
        if is_dataclass(
            self.cls
        ):  # msgspec ignores unknown keys of dataclasses; a typo must not pass
            known = {f.name for f in fields(self.cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(
                    f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )
        return msgspec.convert(data, self.cls, dec_hook=_dec_hook)


KAFKA_SECTION = Section(KafkaConfig)
METRICS_SECTION = Section(MetricsConfig)
LOG_SECTION = Section(LogSettings)


def _has_kafka_field(cls: type) -> bool:
    if is_dataclass(cls):
        return any(f.name == "kafka" for f in fields(cls))
    return "kafka" in getattr(cls, "__struct_fields__", ())


def section_data(doc: Mapping[str, Any], name: str, cls: type) -> dict[str, Any]:
    data = dict(doc.get(name, {}))
    # The shared [kafka] table fills a service's own kafka settings unless it has some.
    if name != "kafka" and _has_kafka_field(cls) and "kafka" not in data and "kafka" in doc:
        data["kafka"] = dict(doc["kafka"])
    return data


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        node[part] = child = dict(child) if isinstance(child, Mapping) else {}
        node = child
    node[last] = value


def load_section(
    name: str,
    section: Section | type,
    path: str | Path | None = None,
    *,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """The typed settings of one service from the file (defaults where it is silent).

    ``overrides`` are dotted keys (``"kafka.bootstrap"``, ``"group"``) from command-line
    flags; they win over the file and the environment. Raises :class:`SettingsError`.
    """
    env = os.environ if env is None else env
    section = section if isinstance(section, Section) else Section(section)
    doc, source = load_raw(path, text=text, env=env)
    if not isinstance(doc.get(name, {}), Mapping):
        raise SettingsError(f"{source}: [{name}] must be a table")
    data = section_data(doc, name, section.cls)
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    if overrides:
        source += " + command line"
    try:
        return section.build(data, env)
    except (msgspec.ValidationError, ValueError) as err:
        msg = str(err)
        if msg.startswith(f"[{name}"):
            raise SettingsError(f"{source}: {msg}") from None
        raise SettingsError(f"{source}: [{name}] {msg}") from None


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def flag_overrides(ctx: Any, keys: Mapping[str, str], **values: Any) -> dict[str, Any]:
    """Dotted config keys of the options the user actually gave (not their defaults).

    ``ctx`` is the Click/Typer context, ``keys`` maps an option's parameter name to its
    config key; ``values`` replaces a parameter's raw value (e.g. a list split on commas).
    Flags absent from the command line leave the file's value in place.
    """
    out: dict[str, Any] = {}
    for param, key in keys.items():
        # Compared by name: Typer ships its own copy of Click (typer._click), whose
        # ParameterSource is a different enum from click's.
        source = ctx.get_parameter_source(param)
        if getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT"):
            out[key] = _plain(values[param] if param in values else ctx.params[param])
    return out
